"""A task cannot break its node: a corrupt frame on the executor's channel, closed standard
streams. Each test checks that the node still runs the next call correctly."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import flotilla as sky


@pytest.fixture(scope="module")
def solo() -> Iterator[sky.Compute]:
    with sky.Compute(nodes=1) as pool:
        yield pool


@sky.function
def corrupt_the_result_channel() -> None:
    """Write a frame header announcing 2**62 bytes on every pipe this process writes to
    (the executor's result channel among them), then wait."""
    import fcntl
    import os
    import stat
    import struct
    import time

    header = struct.pack("<BQQ", 3, 1, 1 << 62)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in (1, 2):
            continue
        try:
            writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY
            if writable and stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, header)
        except OSError:
            pass
    time.sleep(60)


@sky.function
def hello(text: str) -> str:
    print(text)
    return text


@sky.function
def close_stdout() -> None:
    import os

    os.close(1)


def test_an_absurd_frame_length_fails_the_call_not_the_node(solo: sky.Compute) -> None:
    with pytest.raises(sky.WorkerDiedError) as info:
        corrupt_the_result_channel() >> solo
    assert "result channel broke" in str(info.value)
    assert "more than this machine's memory" in str(info.value)
    assert "wrote a corrupt frame on its result channel" in str(info.value)
    assert "out of memory?" not in str(info.value)  # it was not the OOM killer
    assert hello("still here") >> solo == "still here"


def test_a_task_closing_stdout_does_not_silence_the_next_ones(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with sky.Compute(nodes=1) as pool:
        close_stdout() >> pool
        assert hello("printed after os.close(1)") >> pool == "printed after os.close(1)"
    # the pool is closed: its output was flushed
    assert "printed after os.close(1)" in capfd.readouterr().out


@sky.function
def fork_and_return_in_both() -> str:
    """The child returns too (as a careless fork does); the parent waits for it."""
    import os

    pid = os.fork()
    if pid == 0:
        return "child"
    os.waitpid(pid, 0)
    return "parent"


def test_a_child_forked_by_a_task_cannot_answer_for_it(solo: sky.Compute) -> None:
    assert fork_and_return_in_both() >> solo == "parent"
    assert [hello(str(i)) >> solo for i in range(3)] == ["0", "1", "2"]
