"""``flotilla launch`` and ``flotilla exec``: turn a task file or a command into a job and
run it on a cluster (started first by ``launch`` when it is not up)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .._errors import ConfigurationError
from .._volume import Volume, check_volumes, node_spec
from .backends import registry
from .clusters import launch_here, running, start_daemon, submit
from .console import CLIError, say
from .conventions import next_steps
from .jobspec import JobSpec
from .state import ClusterState, Paths, load

if TYPE_CHECKING:
    from .backends.base import ProviderSpec
    from .taskfile import Task


def _task_from(arg: str, nodes: int | None, args: argparse.Namespace) -> Task:
    from .taskfile import command_task, load_task

    if os.path.isfile(arg) or arg.endswith((".yaml", ".yml")):
        task = load_task(arg)
    else:
        task = command_task(arg, nodes)
    if getattr(args, "workdir", None) is not None:  # --workdir over the task's
        folder = os.path.abspath(os.path.expanduser(args.workdir))
        if not os.path.isdir(folder):
            raise ConfigurationError(f"--workdir {args.workdir}: not a folder")
        task = replace(task, workdir=folder)
    envs, secrets = _variables(args)
    return task.with_overrides(envs, secrets)


def _variables(
    args: argparse.Namespace,
) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """``--env`` and ``--secret``/``--secret-file`` as given (a value of None: taken from
    this process's environment by ``Task.with_overrides``)."""
    secrets: dict[str, str | None] = {}
    for path in args.secret_file:
        secrets.update(_secret_file(path))
    given = _pairs(args.secret, "--secret")
    shown = sorted(k for k, v in given.items() if v is not None)
    if shown:
        say(
            f"warning: --secret {shown[0]}=VALUE puts the value on the command line, where "
            f"every user of this machine can read it (ps); pass --secret {shown[0]} to take "
            "it from the environment, or --secret-file FILE"
        )
    secrets.update(given)
    envs: dict[str, str | None] = {}
    for path in getattr(args, "env_file", ()):
        envs.update(_secret_file(path, "--env-file"))
    envs.update(_pairs(args.env, "--env"))
    return envs, secrets


def _secret_file(path: str, flag: str = "--secret-file") -> dict[str, str | None]:
    """The ``KEY=VALUE`` lines of a ``--secret-file`` (blank lines and ``#`` comments are
    skipped; the value is taken as it is, quotes included) or, ``flag`` ``--env-file``, of
    a dotenv file (also ``export KEY=VALUE``; one pair of quotes around a value removed,
    as python-dotenv does)."""
    import stat

    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigurationError(f"{flag} {path}: cannot read it ({e})") from None
    dotenv = flag == "--env-file"
    if stat.S_IMODE(mode) & 0o077 and not dotenv:
        say(f"warning: {flag} {path} can be read by other users: chmod 600 {path}")
    out: dict[str, str | None] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if dotenv and text.startswith("export "):
            text = text[len("export ") :].lstrip()
        key, eq, value = text.partition("=")
        if not eq or not key.strip():
            raise ConfigurationError(
                f"{path}:{number}: expected KEY=VALUE (a {flag[2:]} has one per line)"
            )
        if dotenv and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def _pairs(items: list[str], flag: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not key:
            raise ConfigurationError(f"{flag} {item!r}: expected NAME=VALUE")
        out[key] = value if eq else None
    return out


def _job_spec(
    task: Task, nodes: int, do_setup: bool, mounts: bool, down: bool, retries: int
) -> JobSpec:
    if retries < 0:
        raise ConfigurationError(f"--retries must be 0 or more, got {retries}")
    return JobSpec(
        name=task.name or "job",
        run=task.run,
        setup=task.setup,
        num_nodes=nodes,
        envs={k: v for k, v in task.envs.items() if v is not None},
        secrets={k: v for k, v in task.secrets.items() if v is not None},
        workdir=task.workdir,
        file_mounts=dict(task.file_mounts) if mounts else {},
        gpus_per_node=task.resources.gpus_per_node,
        candidate_gpus=[c.gpus_per_node for c in task.resources.candidates],
        do_setup=do_setup,
        down_after=down,
        retries=retries,
        gpu_share=_share(task.resources.accelerators),
        cpus=_amount(task.resources.cpus),
        memory=_amount(task.resources.memory),
        accelerator=task.resources.accelerator_name or "",
    )


def _share(accelerators: str | None) -> float:
    """``A100:0.5`` -> 0.5, ``A100`` -> 1 (None -> 0)."""
    if not accelerators:
        return 0.0
    _, _, count = accelerators.partition(":")
    return float(count) if count else 1.0


def _amount(value: str | None) -> float:
    """``4`` or ``4+`` (at least 4) -> 4.0 (None -> 0)."""
    return float(value.rstrip("+")) if value else 0.0


def _resource_flags(task: Task, args: argparse.Namespace) -> Task:
    """``--gpus``/``--cpus``/``--memory`` and ``launch``'s ``--infra``/``--use-spot``
    (SkyPilot's flags) over the task's resources."""
    import re

    changes: dict[str, Any] = {}
    infra = getattr(args, "infra", None)
    if infra is not None:
        if not infra.strip() or infra.startswith("/"):
            raise ConfigurationError(
                f"--infra {infra!r}: give a provider and optionally where, like aws, "
                "aws/us-east-1 or k8s"
            )
        changes["infra"] = infra
    if getattr(args, "use_spot", None) is not None:
        changes["use_spot"] = args.use_spot
    if args.gpus is not None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+(:\d+(\.\d+)?)?", args.gpus) or args.gpus.endswith(
            ":0"
        ):
            raise ConfigurationError(
                f"--gpus {args.gpus!r}: give an accelerator and a count per node, like "
                "A100, A100:2 or A100:0.5 (a fraction shares one device)"
            )
        changes["accelerators"] = args.gpus
    for flag in ("cpus", "memory"):
        value = getattr(args, flag)
        if value is not None:
            if not re.fullmatch(r"\d+(\.\d+)?\+?", value) or _amount(value) <= 0:
                raise ConfigurationError(
                    f"--{flag} {value!r}: give a positive number per node, like 4 or 4+"
                )
            changes[flag] = value
    if not changes:
        return task
    res = task.resources  # the flags over every candidate's fields too
    candidates = tuple(replace(c, **changes) for c in res.candidates)
    return replace(task, resources=replace(res, **changes, candidates=candidates))


def cmd_launch(args: argparse.Namespace) -> int:
    task = _resource_flags(_task_from(args.task, None, args), args)
    if args.idle_minutes is None and task.resources.autostop is not None:  # the task's own
        args.idle_minutes = task.resources.autostop.idle_minutes
        args.down = args.down or task.resources.autostop.down
    if args.nodes is not None and args.nodes < 1:
        raise ConfigurationError(f"--nodes must be at least 1, got {args.nodes}")
    if args.idle_minutes is not None and args.idle_minutes <= 0:
        raise ConfigurationError(f"--autostop must be positive, got {args.idle_minutes}")
    # --autostop M --down: torn down after M idle minutes (SkyPilot's), not after the job
    autodown = args.down and args.idle_minutes is not None
    name = args.cluster or f"flotilla-{os.urandom(2).hex()}"
    paths = Paths(name)
    wanted = registry.spec_from_args(args, task)
    existing = load(paths)
    state = existing.observed_state() if existing else None
    if existing is not None and state is ClusterState.STALE:
        existing = running(paths)  # re-attached to, or it raises saying so
        state = existing.observed_state()
    reuse = existing is not None and state in (ClusterState.UP, ClusterState.STARTING)
    # a stopped cluster whose nodes were kept (AWS instances) starts them again: same spec
    kept = (
        existing is not None
        and state in (ClusterState.STOPPED, ClusterState.FAILED)
        and registry.backend_for(registry.spec_from_dict(existing.provider)).restartable(paths)
    )
    if existing is not None and (reuse or kept):
        spec = registry.spec_from_dict(existing.provider)
        if wanted is not None and wanted != spec:
            raise CLIError(
                f"cluster {name} runs on {spec.describe()}; "
                f"`flotilla down {name}` first to change its provider"
            )
        if args.nodes is not None and args.nodes > existing.num_nodes:
            raise CLIError(
                f"cluster {name} has {existing.num_nodes} node(s), not {args.nodes}: "
                f"`flotilla down {name}` first, or launch on another cluster name"
            )
        cluster_nodes = existing.num_nodes
    else:
        spec = wanted or registry.DEFAULT.with_task(registry.DEFAULT.spec_type(), task)
        cluster_nodes = args.nodes or task.num_nodes or 1
    # --nodes/--num-nodes overrides the task's num_nodes, as SkyPilot's --num-nodes does
    job_nodes = args.nodes if args.nodes is not None else task.job_nodes(cluster_nodes)
    for warning in registry.backend_for(spec).check_task(task, spec, cluster_nodes):
        say(f"warning: {warning}")
    if args.idle_minutes is not None and not autodown and not reuse:
        refusal = registry.backend_for(spec).autostop_refusal(spec)
        if refusal:
            raise CLIError(
                f"--autostop cannot stop this cluster: {refusal}; add --down to tear it "
                "down when idle instead",
                code=2,
            )
    down_after = args.down and not autodown
    job = _job_spec(task, job_nodes, not args.no_setup, True, down_after, args.retries)
    if args.dryrun:
        plan = {
            "cluster": name,
            "reuse": reuse or kept,
            "nodes": cluster_nodes,
            "job_nodes": job_nodes,
            **registry.backend_for(spec).describe_plan(spec),
        }
        _print_plan(plan, args.json)
        return 0
    volumes = _node_volumes(task, spec)
    if reuse:
        assert existing is not None
        _same_volumes(name, existing.volumes, volumes)
        if task.engines and list(task.engines) != existing.engines:
            raise CLIError(
                f"cluster {name} is up with engines {existing.engines or 'none'}: engines "
                f"start with a cluster; `flotilla down {name}` and launch again, or use "
                "another cluster name",
                code=2,
            )
    elif volumes:  # the buckets can be read: before anything is provisioned
        shared = registry.backend_for(spec).shares_filesystem
        check_volumes(volumes, this_machine=shared)
        node_spec(volumes)
    if not reuse:
        if down_after and not args.detach:
            return launch_here(
                paths, existing, spec, cluster_nodes, args.idle_minutes, job, volumes, task.engines
            )
        existing = start_daemon(
            paths,
            existing,
            spec,
            cluster_nodes,
            args.idle_minutes,
            volumes,
            autodown,
            task.engines,
        )
        say(f"cluster {name}: {cluster_nodes} {spec.kind} node(s) starting")
    assert existing is not None
    code = submit(paths, existing, job, args.detach)
    if not down_after and code == 0:  # the cluster stays: say what next (a failure's
        # report stays the last thing said)
        for line in next_steps(name, None, existing.idle_minutes):
            say(line)
        from .sshconfig import offer

        offer(paths.ssh_config, args.yes)  # `ssh NAME`: ~/.ssh/config's Include line
    return code


def _print_plan(plan: dict[str, Any], as_json: bool) -> None:
    """``launch --dryrun``'s report: one JSON document, or lines for a reader."""
    import json

    if as_json:
        print(json.dumps(plan, indent=2, sort_keys=False, default=str))
        return
    what = "running, reused" if plan["reuse"] else "new"
    print(
        f"cluster {plan['cluster']} ({what}): {plan['nodes']} node(s), the job on "
        f"{plan['job_nodes']}"
    )
    _print_provider(plan, "")
    print("--dryrun: nothing was started")


def _print_provider(plan: dict[str, Any], indent: str) -> None:
    print(f"{indent}provider: {plan['provider']} ({plan['where']})")
    for i, candidate in enumerate(plan.get("candidates", ())):
        print(f"{indent}candidate {i} ({plan['allocation']}):")
        _print_provider(candidate, indent + "  ")
    if "settings" in plan:
        print(f"{indent}settings:")
        for key, value in plan["settings"].items():
            print(f"{indent}  {key}: {value!r}")
        for key, how in plan["set_by_flotilla"].items():
            print(f"{indent}  {key}: set by flotilla ({how})")
    if "per_node" in plan:
        wants = ", ".join(f"{k} {v}" for k, v in plan["per_node"].items() if v is not None)
        print(f"{indent}every node asks for: {wants or 'nothing in particular'}")
    if plan.get("max_hourly_cost") is not None:
        print(f"{indent}at most ${plan['max_hourly_cost']:g}/h for the cluster")
    if plan.get("max_node_hourly_cost") is not None:
        print(f"{indent}at most ${plan['max_node_hourly_cost']:g}/h a node")


def _node_volumes(task: Task, spec: ProviderSpec) -> tuple[Volume, ...]:
    """The task's bucket file_mounts; on nodes of this machine ``~`` is the node's working
    directory (as for local file_mounts), so ``~/x`` becomes the relative path ``x``."""
    if not registry.backend_for(spec).shares_filesystem:
        return task.volumes
    return tuple(
        replace(v, mount=v.mount[2:]) if v.mount.startswith("~/") else v for v in task.volumes
    )


def _same_volumes(name: str, launched: list[dict[str, Any]], volumes: Sequence[Volume]) -> None:
    """A job on a running cluster cannot change its buckets (set up when it started)."""
    if volumes and [v.to_node() for v in volumes] != launched:
        raise CLIError(
            f"cluster {name} is up with other bucket file_mounts: buckets are set up when a "
            f"cluster starts; `flotilla down {name}` and launch again, or use another "
            "cluster name",
            code=2,
        )


def cmd_exec(args: argparse.Namespace) -> int:
    paths = Paths(args.cluster)
    rec = running(paths)
    task = _task_from(" ".join(args.task), args.nodes, args)  # unquoted: words, as SkyPilot
    task = _resource_flags(task, args)
    _same_volumes(
        paths.name, rec.volumes, _node_volumes(task, registry.spec_from_dict(rec.provider))
    )
    nodes = args.nodes or task.num_nodes or rec.num_nodes
    if nodes > rec.num_nodes:
        raise CLIError(
            f"the job needs {nodes} node(s) but cluster {paths.name} has {rec.num_nodes}",
            code=2,
        )
    if task.resources.gpus_per_node:
        spec = registry.spec_from_dict(rec.provider)
        for warning in registry.backend_for(spec).check_task(task, spec, rec.num_nodes):
            say(f"warning: {warning}")
    job = _job_spec(task, nodes, False, False, False, args.retries)
    if rec.nodes and not job.candidate_gpus:  # never fits: refused before it is queued
        from .ledger import Ledger, demand_of

        why = Ledger(rec.nodes).refusal(demand_of(job), nodes, paths.name, job.accelerator)
        if why:
            raise CLIError(f"cluster {paths.name}: {why}", code=2)
    if args.dryrun:
        _print_job(paths.name, rec.num_nodes, job)
        return 0
    return submit(paths, rec, job, args.detach)


def _print_job(cluster: str, cluster_nodes: int, job: JobSpec) -> None:
    """``exec --dryrun``'s report: the job as it would be submitted (variables by name)."""
    holds = [
        f"{job.accelerator or 'GPU'}:{job.gpu_share:g}" if job.gpu_share else "",
        f"cpus={job.cpus:g}" if job.cpus else "",
        f"memory={job.memory:g}GB" if job.memory else "",
    ]
    print(
        f"job {job.name} on {job.num_nodes} of cluster {cluster}'s {cluster_nodes} node(s), "
        f"holding {' '.join(h for h in holds if h) or 'whole nodes'} while it runs"
    )
    if job.workdir:
        print(f"workdir: {job.workdir} (synced to every node)")
    for kind, names in (("envs", job.envs), ("secrets", job.secrets)):
        if names:
            print(f"{kind}: {', '.join(sorted(names))}")
    print(f"run: {job.run}" if job.run and "\n" not in job.run else "run: (a script)")
    print("--dryrun: nothing was submitted")
