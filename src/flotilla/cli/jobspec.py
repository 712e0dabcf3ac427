"""A command-line job as submitted to a cluster, and the environment its nodes get.

Light on imports: the CLI builds a :class:`JobSpec` and sends it to the cluster daemon as
JSON; the daemon computes each phase's variables with :func:`phase_env`.

Variables of ``setup`` and ``run`` (FLOTILLA_* and their SkyPilot names, same meaning)::

    FLOTILLA_NODE_RANK          SKYPILOT_NODE_RANK          this node's rank, 0 = head
    FLOTILLA_NODE_IPS           SKYPILOT_NODE_IPS           node addresses, one per line, head first
    FLOTILLA_NUM_NODES          SKYPILOT_NUM_NODES          number of nodes
    FLOTILLA_NUM_GPUS_PER_NODE  SKYPILOT_NUM_GPUS_PER_NODE  accelerators per node (task's count)
    FLOTILLA_TASK_ID            SKYPILOT_TASK_ID            the job's id, the same on every node
    FLOTILLA_CLUSTER_INFO       SKYPILOT_CLUSTER_INFO       JSON: cluster_name, cloud, region...
    FLOTILLA_SETUP_NODE_RANK    SKYPILOT_SETUP_NODE_RANK    in setup: rank among every node
    FLOTILLA_SETUP_NODE_IPS     SKYPILOT_SETUP_NODE_IPS     in setup: every node of the cluster
    FLOTILLA_SETUP_NUM_NODES    SKYPILOT_SETUP_NUM_NODES    in setup: the cluster's size
    FLOTILLA_HOSTFILE           path of a DeepSpeed/MPI hostfile: "ip slots=G" per node
    FLOTILLA_CLUSTER_NAME, FLOTILLA_JOB_ID
    MASTER_ADDR, MASTER_PORT    the head's address and a port free on it (torchrun, env://)
    WORLD_SIZE, NODE_RANK, RANK number of nodes, this node's rank (one process per node)
    PYTHONUNBUFFERED=1          so that Python programs' output streams as it is printed
    HOME (nodes on this machine) the node's working directory, where ``~`` in file_mounts
                                lands (XDG_CACHE_HOME keeps the real ~/.cache: shared caches)

In ``run`` they describe the job's nodes only (those the cluster's queue gave it: see
``ledger.Ledger``); in ``setup`` every node of the cluster. CUDA_VISIBLE_DEVICES names the
devices of a job that declared accelerators (it is empty for a job that declared only
vCPUs or memory; unset for a job that declared nothing and holds its nodes whole). The
task's ``envs`` and ``secrets`` come last and win.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class JobSpec:
    """What a client asks a cluster to run.

    Attributes:
        name: shown in ``flotilla queue``.
        run: shell commands run on each of the job's nodes (None: nothing).
        setup: shell commands run first on every node of the cluster (None: nothing).
        num_nodes: the job's nodes (None: every node of the cluster).
        envs: task variables.
        secrets: secret variables: kept in memory only, redacted from output.
        workdir: absolute local folder synced to every node's working directory.
        file_mounts: node path -> absolute local path, copied to every node.
        gpus_per_node: the task's accelerators per node (of its first candidate, when
            it has several: see ``candidate_gpus``).
        candidate_gpus: a task with candidates (``any_of``, ``ordered``, accelerator sets):
            each candidate's accelerators per node, in the task's order. The candidate
            the cluster started on defines the job's (:meth:`gpus_on`), as SkyPilot's
            launched resources do; empty: ``gpus_per_node`` on any cluster.
        do_setup: whether to run ``setup`` (False for ``exec`` and ``--no-setup``).
        down_after: stop and remove the cluster once this job ends (``launch --down``).
        retries: how many times a failed ``run`` is run again (on the same nodes, with
            the same task id) before the job fails.
        gpu_share: accelerators per node as the task declares them, a fraction kept
            (``A100:0.5``: 0.5): what the cluster's job queue holds for the job.
        cpus: vCPUs per node the task declares (``4+``: 4; 0: none).
        memory: memory per node in GB the task declares (0: none).
        accelerator: the accelerator's name (``A100``), for ``flotilla queue``.
    """

    name: str
    run: str | None = None
    setup: str | None = None
    num_nodes: int | None = None
    envs: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    file_mounts: dict[str, str] = field(default_factory=dict)
    gpus_per_node: int = 0
    candidate_gpus: list[int] = field(default_factory=list)
    do_setup: bool = True
    down_after: bool = False
    retries: int = 0
    gpu_share: float = 0.0
    cpus: float = 0.0
    memory: float = 0.0
    accelerator: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def gpus_on(self, candidate: int | None) -> int:
        """Accelerators per node the job needs on a cluster started on its candidate at
        position ``candidate`` (None: a cluster without candidates)."""
        if candidate is not None and 0 <= candidate < len(self.candidate_gpus):
            return self.candidate_gpus[candidate]
        return self.gpus_per_node

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def __repr__(self) -> str:  # never show secret values
        return f"JobSpec(name={self.name!r}, secrets={sorted(self.secrets)!r}, ...)"


def task_id(cluster: str, job_id: int, when: float | None = None) -> str:
    """The job's FLOTILLA_TASK_ID, in SkyPilot's shape: ``flotilla-<time>_<cluster>_<job>``."""
    t = time.time() if when is None else when
    stamp = time.strftime("%Y-%m-%d-%H-%M-%S", time.localtime(t)) + f"-{int(t * 1e6) % 10**6:06d}"
    return f"flotilla-{stamp}_{cluster}_{job_id}"


def cluster_info(cluster: str, provider: str, ips: list[str]) -> str:
    """FLOTILLA_CLUSTER_INFO / SKYPILOT_CLUSTER_INFO (JSON)."""
    return json.dumps(
        {
            "cluster_name": cluster,
            "cloud": provider,
            "provider": provider,
            "region": None,
            "zone": None,
            "num_nodes": len(ips),
            "node_ips": ips,
            "head_ip": ips[0] if ips else None,
        }
    )


def hostfile(ips: list[str], gpus_per_node: int) -> str:
    """A DeepSpeed/MPI hostfile: ``ip slots=G`` per node (G at least 1)."""
    return "".join(f"{ip} slots={max(gpus_per_node, 1)}\n" for ip in ips)


def phase_env(
    *,
    cluster: str,
    provider: str,
    cluster_ips: list[str],
    job_nodes: int,
    job_id: int,
    task: str,
    gpus_per_node: int,
    master_port: int,
    setup: bool,
    nodes: list[int] | None = None,
) -> tuple[dict[str, str], dict[int, dict[str, str]]]:
    """The variables of a phase: (the same on every node, node index -> its own).

    ``setup`` covers every node of the cluster; ``run`` the job's nodes: ``nodes`` (node
    indices, in rank order), else the first ``job_nodes`` nodes.
    """
    chosen = list(range(len(cluster_ips))) if setup else (nodes or list(range(job_nodes)))
    ips = [cluster_ips[i] for i in chosen]
    both = ("FLOTILLA", "SKYPILOT")
    common: dict[str, str] = {}
    for p in both:
        common[f"{p}_NODE_IPS"] = "\n".join(ips)
        common[f"{p}_NUM_NODES"] = str(len(ips))
        common[f"{p}_NUM_GPUS_PER_NODE"] = str(gpus_per_node)
        common[f"{p}_TASK_ID"] = task
        common[f"{p}_CLUSTER_INFO"] = cluster_info(cluster, provider, cluster_ips)
        if setup:
            common[f"{p}_SETUP_NODE_IPS"] = "\n".join(cluster_ips)
            common[f"{p}_SETUP_NUM_NODES"] = str(len(cluster_ips))
    common["FLOTILLA_CLUSTER_NAME"] = cluster
    common["FLOTILLA_JOB_ID"] = str(job_id)
    common["MASTER_ADDR"] = ips[0]
    common["MASTER_PORT"] = str(master_port)
    common["WORLD_SIZE"] = str(len(ips))
    common["PYTHONUNBUFFERED"] = "1"
    per_node: dict[int, dict[str, str]] = {}
    for rank, node in enumerate(chosen):
        mine = {"NODE_RANK": str(rank), "RANK": str(rank)}
        for p in both:
            mine[f"{p}_NODE_RANK"] = str(rank)
            if setup:
                mine[f"{p}_SETUP_NODE_RANK"] = str(rank)
        per_node[node] = mine
    return common, per_node


def shared_machine_home(workdir: str) -> dict[str, str]:
    """HOME for a node that shares this machine with others (the local provider): its own
    working directory, so that ``~/x`` in ``setup`` and ``run`` is where a ``~/x`` file
    mount was unpacked, and nodes do not write over each other's home. Caches (pip, uv,
    Hugging Face) stay in the real ``~/.cache``, shared, through XDG_CACHE_HOME."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return {"HOME": workdir, "XDG_CACHE_HOME": cache}
