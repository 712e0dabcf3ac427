"""Shared fixtures: real local pools (real agent and executor processes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _procs import remove_stale_test_folders

import flotilla as sky


def pytest_sessionstart(session: pytest.Session) -> None:
    """Remove the temp folders that killed test sessions left (their teardown never ran)."""
    remove_stale_test_folders()


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
