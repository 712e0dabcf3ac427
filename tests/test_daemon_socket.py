"""The cluster daemon's socket (``cli/daemon_socket.py``), served for a stand-in daemon
whose jobs end inside ``submit``: the quickest job there is, over before the command that
submitted it could follow it (a real daemon's job of a few milliseconds on a busy machine:
the ``exec`` of CI run 60 printed "job 2 succeeded" and none of its output)."""

from __future__ import annotations

import socket
import threading
from collections import deque
from pathlib import Path

from flotilla.cli.daemon_socket import DaemonSocket
from flotilla.cli.ipc import request
from flotilla.cli.jobs import Job, Subscriber
from flotilla.cli.jobspec import JobSpec
from flotilla.cli.ledger import Allocation
from flotilla.cli.state import JobStatus, Paths


class EndsAtOnce:
    """A daemon, as the socket asks of one (``daemon_socket.Served``), whose every job
    prints two lines on each of its 2 nodes and succeeds before ``submit`` returns."""

    def __init__(self, home: Path) -> None:
        self.paths = Paths("quick", home)
        self.paths.ensure()
        self.error = ""
        self.autodown = False
        self.cv = threading.Condition()
        self.queue: deque[Job] = deque()
        self.running: dict[int, tuple[Job, Allocation | None]] = {}
        self.jobs: dict[int, Job] = {}
        self.stopped = threading.Event()

    def submit(self, spec: JobSpec, follow: bool = False) -> tuple[Job, Subscriber | None]:
        job_id = len(self.jobs) + 1
        job = Job(job_id, spec, f"quick-{job_id}", self.paths.job_dir(job_id))
        sub = job.subscribe(None, replay=False)[1] if follow else None
        self.jobs[job_id] = job
        for node in (0, 1):
            job.output(node, 1, [f"hello from node {node}"])
            job.output(node, 2, [f"warning from node {node}"])
        job.finish(JobStatus.SUCCEEDED, 0, [])
        return job, sub

    def cancel(self, job: Job) -> None:
        raise AssertionError("not asked here")

    def set_autostop(self, minutes: float | None, down: bool) -> None:
        raise AssertionError("not asked here")

    def request_stop(self, delete_record: bool) -> None:
        raise AssertionError("not asked here")


def test_a_job_over_before_its_submitter_follows_it_still_streams_all_its_output(
    tmp_path: Path,
) -> None:
    daemon = EndsAtOnce(tmp_path)
    served = DaemonSocket(daemon)
    served.bind()
    accepting = threading.Thread(target=served.accept_forever, daemon=True)
    accepting.start()
    try:
        spec = JobSpec(name="quick", run="echo hello")
        got = list(
            request(daemon.paths.socket, {"op": "submit", "job": spec.to_dict(), "attach": True})
        )
    finally:
        assert served.server is not None
        served.server.shutdown(socket.SHUT_RDWR)  # (accept returns)
        accepting.join(30)
        served.close()
    assert not accepting.is_alive()
    assert [e["ev"] for e in got] == ["accepted", "out", "out", "out", "out", "end"], got
    lines = [(e["node"], e["stream"], e["line"]) for e in got if e["ev"] == "out"]
    assert lines == [
        (0, 1, "hello from node 0"),
        (0, 2, "warning from node 0"),
        (1, 1, "hello from node 1"),
        (1, 2, "warning from node 1"),
    ]
    assert got[-1]["status"] == JobStatus.SUCCEEDED.value and not daemon.jobs[1].subscribers
