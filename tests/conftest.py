"""Shared fixtures: real local pools (real agent and executor processes), and the guard
that no test leaves a lab's environment (a cloud's credentials, its API address) behind."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from _lifecycle import MARKET_PREFIXES
from _procs import remove_stale_test_folders

import flotilla as sky

WATCHED_PREFIXES = (*MARKET_PREFIXES, "FLOTILLA_")
WATCHED_NAMES = ("HOME", "KUBECONFIG", "XDG_CACHE_HOME")


def watched_environment() -> dict[str, str]:
    """The variables through which a client finds a cloud, a market, a cluster or its own
    state (credentials, API addresses, kubeconfig, flotilla's home): what a lab sets for
    the tests that ask for it."""
    return {
        k: v for k, v in os.environ.items() if k.startswith(WATCHED_PREFIXES) or k in WATCHED_NAMES
    }


_SESSION_ENVIRONMENT = watched_environment()
""":func:`watched_environment` as the session started (this process's, under xdist):
what every test must start and end with."""


def pytest_sessionstart(session: pytest.Session) -> None:
    """Remove the temp folders that killed test sessions left (their teardown never ran)."""
    remove_stale_test_folders()


def _differences(now: dict[str, str]) -> list[str]:
    """What differs in ``now`` from the session's start, each variable named (values not
    shown: they may be secrets)."""
    said = []
    for key in sorted(now.keys() | _SESSION_ENVIRONMENT.keys()):
        if key not in _SESSION_ENVIRONMENT:
            said.append(f"{key} set")
        elif key not in now:
            said.append(f"{key} removed")
        elif now[key] != _SESSION_ENVIRONMENT[key]:
            said.append(f"{key} changed")
    return said


def _put_back() -> None:
    for key in watched_environment().keys() - _SESSION_ENVIRONMENT.keys():
        del os.environ[key]
    os.environ.update(_SESSION_ENVIRONMENT)


@pytest.fixture(autouse=True)
def lab_environment_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test starts and ends with the session's own :func:`watched_environment`: a
    lab's variables are in ``os.environ`` only while a test that asked for the lab runs
    (its function-scoped fixture applies them: ``Lifecycle.environment``), never for a
    lab that outlives the test (a shared or module-scoped one), or a later test in the
    same process would find that cloud configured (CI of 5732eba: Verda's offers listed
    by the ``show-gpus`` of a test that never asked for Verda). Set up before the test's
    other function-scoped fixtures and torn down after them; on a difference the test
    errors naming the variables, and the session's values are put back."""
    before = _differences(watched_environment())
    if before:
        _put_back()
        pytest.fail(
            f"{request.node.nodeid} started with the environment changed from the "
            f"session's start: {', '.join(before)} (a module- or session-scoped fixture of "
            "this test, or an earlier test in this process, left it: apply a lab's "
            "environment in the function-scoped fixture a test asks for)",
            pytrace=False,
        )
    yield
    after = _differences(watched_environment())
    if after:
        _put_back()
        pytest.fail(
            f"{request.node.nodeid} left the environment changed from the session's start: "
            f"{', '.join(after)} (put it back when the test ends: monkeypatch.setenv, or "
            "the lab's environment() in the fixture the test asks for)",
            pytrace=False,
        )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the Kubernetes lab's binaries into their cache (about 10 minutes, once per
    machine) before any test runs when a selected test uses the lab: outside every test's
    timeout."""
    if any("k8s_lab" in getattr(item, "fixturenames", ()) for item in session.items):
        from _k8s import prepare

        prepare()


@pytest.fixture(scope="module")
def pool4() -> Iterator[sky.Compute]:
    """A 4-node local pool shared by a test module."""
    with sky.Compute(nodes=4) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool2() -> Iterator[sky.Compute]:
    """A 2-node local pool shared by a test module."""
    with sky.Compute(nodes=2) as pool:
        yield pool
