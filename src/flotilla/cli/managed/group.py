"""Job groups (``execution: parallel`` pipelines): how their tasks wait for each other's
clusters and find each other (the variables every task gets)."""

from __future__ import annotations

import json
import re
import threading

from ..._errors import FlotillaError


def env_name(task: str) -> str:
    """A task's name as it appears in variable names: upper case, other characters ``_``."""
    return re.sub(r"[^A-Za-z0-9]", "_", task).upper()


def group_env(group: str, hosts: dict[str, list[str]]) -> dict[str, str]:
    """The variables every task of job group ``group`` gets (``hosts``: each task's node
    addresses, head first, in the file's order)::

        SKYPILOT_JOBGROUP_NAME, FLOTILLA_JOBGROUP_NAME   the group's name
        FLOTILLA_JOBGROUP_TASKS                          its tasks' names, comma-separated
        FLOTILLA_JOBGROUP_<TASK>_HEAD_IP                 each task's head node address
        FLOTILLA_JOBGROUP_<TASK>_IPS                     each task's node addresses, one a line
        FLOTILLA_JOBGROUP_HOSTS                          all of it as JSON {task: [ips]}

    ``<TASK>`` is :func:`env_name` of the task's name."""
    env = {
        "SKYPILOT_JOBGROUP_NAME": group,
        "FLOTILLA_JOBGROUP_NAME": group,
        "FLOTILLA_JOBGROUP_TASKS": ",".join(hosts),
        "FLOTILLA_JOBGROUP_HOSTS": json.dumps(hosts),
    }
    for task, ips in hosts.items():
        env[f"FLOTILLA_JOBGROUP_{env_name(task)}_HEAD_IP"] = ips[0] if ips else ""
        env[f"FLOTILLA_JOBGROUP_{env_name(task)}_IPS"] = "\n".join(ips)
    return env


class GroupBarrier:
    """Where a job group's tasks wait for each other's clusters before they run.

    Args:
        group: the group's name.
        names: the tasks that take part (in the file's order).
    """

    def __init__(self, group: str, names: list[str]) -> None:
        self.group = group
        self.names = list(names)
        self.hosts: dict[str, list[str]] = {}
        self.failed = ""
        self.cond = threading.Condition()

    def arrive(self, name: str, ips: list[str], cancelled: threading.Event) -> dict[str, str]:
        """Task ``name``'s cluster is up at ``ips``: wait for the others; the group's
        variables. FlotillaError when another task could not start or on cancellation."""
        with self.cond:
            self.hosts[name] = ips
            self.cond.notify_all()
            while not self.failed and len(self.hosts) < len(self.names):
                if cancelled.is_set():
                    raise FlotillaError("cancelled")
                self.cond.wait(0.5)
            if self.failed:
                raise FlotillaError(
                    f"task {self.failed!r} of job group {self.group} could not start"
                )
            ordered = {n: self.hosts[n] for n in self.names}
        return group_env(self.group, ordered)

    def moved(self, name: str, ips: list[str]) -> dict[str, str]:
        """Task ``name`` (which arrived) runs again, on nodes at ``ips`` (a recovery may
        have replaced them): record them; the group's variables as they are now, with the
        latest addresses of every task (those that moved since this one arrived too)."""
        with self.cond:
            self.hosts[name] = ips
            ordered = {n: self.hosts.get(n, []) for n in self.names}
        return group_env(self.group, ordered)

    def fail(self, name: str) -> None:
        """Task ``name`` will not arrive: the others stop waiting."""
        with self.cond:
            if not self.failed:
                self.failed = name
            self.cond.notify_all()
