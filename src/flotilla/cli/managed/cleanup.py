"""Cleaning up after a managed job whose controller is gone."""

from __future__ import annotations

from .state import JobsHome, ManagedJobRecord


def reap_leftovers(home: JobsHome, rec: ManagedJobRecord) -> None:
    """Clean up after a job whose controller died, as ``flotilla down`` does after a
    daemon: its backend kills what the job left on this machine."""
    from ..backends import registry

    spec = registry.spec_from_dict(rec.provider)
    paths, record = home.cluster(rec)
    registry.backend_for(spec).on_down(paths, record)
