"""How a process ended, in words: one family (flotilla._wire.exits) for the executor's
death, a lost node and a failed job's script."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from flotilla._wire.exits import describe_exit, exit_signal, exit_summary, signal_name


@pytest.mark.parametrize(
    ("status", "verb", "noun", "sig"),
    [
        (0, "exited with status 0", "exit status 0", None),
        (3, "exited with status 3", "exit status 3", None),
        (-9, "was killed by SIGKILL — out of memory?", "killed by SIGKILL", "SIGKILL"),
        (-11, "was killed by SIGSEGV", "killed by SIGSEGV", "SIGSEGV"),
        (-99, "was killed by signal 99", "killed by signal 99", "signal 99"),
        (None, "exited (status unknown)", "status unknown", None),
    ],
)
def test_both_phrasings_say_the_same_facts(
    status: int | None, verb: str, noun: str, sig: str | None
) -> None:
    assert describe_exit(status) == (verb, sig)
    assert exit_summary(status) == noun
    assert exit_signal(status) == sig


def test_statuses_of_real_processes() -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    killed = subprocess.run([sys.executable, "-c", code]).returncode
    assert describe_exit(killed) == ("was killed by SIGTERM", "SIGTERM")
    exited = subprocess.run([sys.executable, "-c", "raise SystemExit(4)"]).returncode
    assert exit_summary(exited) == "exit status 4"
    assert signal_name(int(signal.SIGINT)) == "SIGINT"


def test_every_signal_is_named_as_the_signal_module_names_it() -> None:
    """``signal_name`` reads ``_signal``'s constants (not ``signal``, whose enums a node's
    start does without): for every number, the name ``signal.Signals`` gives, the first
    of a number's aliases (SIGABRT, not SIGIOT; SIGCHLD, not SIGCLD; SIGIO, not SIGPOLL)."""
    numbers = {int(s) for s in signal.Signals} | set(range(-2, 2 * signal.NSIG))
    for number in sorted(numbers):
        try:
            expected = signal.Signals(number).name
        except ValueError:
            expected = f"signal {number}"
        assert signal_name(number) == expected
    assert [signal_name(signal.SIGABRT), signal_name(signal.SIGCHLD)] == ["SIGABRT", "SIGCHLD"]
