"""Task files (SkyPilot format): parse and validate them into :class:`Task`.

A task file says how many nodes a job needs, what they need, how to set them up and what
to run::

    name: train
    num_nodes: 2
    resources:
      accelerators: A100:8
    workdir: .
    envs: {EPOCHS: "3"}
    secrets: {HF_TOKEN: null}        # given with --secret HF_TOKEN=...
    setup: pip install -r requirements.txt
    run: torchrun --nnodes=$SKYPILOT_NUM_NODES ... train.py

Every mistake is reported with the file, the line and the field (``task.yaml:3: unknown
field 'num_node' (did you mean 'num_nodes'?)``) before anything starts. PyYAML is imported
only here, so commands that take no task file do not pay for it.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .._errors import ConfigurationError
from .._providers.config_files import kind_of as _kind
from .._volume import Volume
from .conventions import DEFAULT_AUTOSTOP_MINUTES
from .managed.recovery import JobRecovery, parse_job_recovery

if TYPE_CHECKING:
    import yaml

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_AMOUNT = re.compile(r"\d+(\.\d+)?\+?")
_PORTS = re.compile(r"\d+(-\d+)?")


class TaskError(ConfigurationError):
    """A task file that cannot be run as written.

    Attributes:
        path: the task file ('' for a task given on the command line).
        line: 1-based line of the offending field (0 when unknown).
        field: dotted name of the field (``resources.accelerators``), or ''.
    """

    def __init__(self, message: str, *, path: str = "", line: int = 0, field: str = "") -> None:
        where = path + (f":{line}" if path and line else "")
        super().__init__(f"{where}: {message}" if where else message)
        self.path = path
        self.line = line
        self.field = field


@dataclass(frozen=True)
class Autostop:
    """``resources.autostop`` (SkyPilot's forms: ``true`` (5 minutes), ``10`` or ``10m``,
    ``2h``, ``1d``, or ``{idle_minutes: 10, down: true}``).

    Attributes:
        idle_minutes: minutes without jobs before the cluster stops.
        down: tear the cluster down instead of stopping it.
    """

    idle_minutes: float
    down: bool = False


_AUTOSTOP_UNITS = {"m": 1.0, "h": 60.0, "d": 1440.0}


@dataclass(frozen=True)
class Resources:
    """What every node of the task needs (``resources:``). Only ``accelerators`` is a hard
    requirement on the local and SSH providers; the other fields are hints they report.

    Attributes:
        accelerators: accelerator type and count per node, e.g. "A100:8" (None: no GPU).
        cpus: vCPUs per node: "4" (exactly) or "4+" (at least).
        memory: memory per node in GB: "64" or "64+".
        infra: where to run, e.g. "aws/us-east-1" or "k8s" (``cloud`` is its old name).
        use_spot: whether spot/preemptible instances may be used.
        network_tier: "standard" or "best" (InfiniBand/EFA where available).
        disk_size: OS disk size per node, in GB.
        ports: ports to open on the nodes: 8080, "10000-10010" or a list of them.
        image_id: the machine or container image to boot the nodes from.
        region: cloud region (a hint).
        zone: cloud zone (a hint).
        instance_type: cloud instance type (a hint).
        disk_tier: disk performance tier (a hint).
        labels: labels to attach to the nodes.
        job_recovery: how a managed job (``flotilla jobs launch``) recovers; None: the
            defaults (see ``managed.recovery``). Plain ``launch`` ignores it.
        autostop: stop (or tear down) the cluster after this long without jobs, as
            ``launch --autostop M [--down]`` (SkyPilot's field); None: never.
        max_hourly_cost: the most the cluster may cost per hour, in USD, all its nodes
            (``Compute(max_hourly_cost=)``): a provider that knows its prices (Vast, AWS
            when priced) refuses offers above it before renting; None: no limit.
        max_node_hourly_cost: the most ONE node may cost per hour, in USD (flotilla's
            field, Skyward's ``Spec(max_hourly_cost=)``, ``Compute(max_node_hourly_cost=)``;
            SkyPilot has none): offers above it are not taken; None: no limit.
        candidates: alternatives, from ``any_of`` or ``ordered`` (each a resources mapping
            over these fields) and accelerator sets (``accelerators: {A100:8, H100:8}``,
            any of them; a list: in order): every combination, each complete (a
            candidate's fields over the top-level ones, its labels added to theirs, as
            SkyPilot merges them). Empty: these resources only. The first candidate's
            fields are also this object's; a job's are those of the candidate its
            cluster started on (``JobSpec.candidate_gpus``).
        ordered: try the candidates in order (``ordered``, an accelerator list); False:
            cheapest first (``any_of``, an accelerator set).
    """

    accelerators: str | None = None
    cpus: str | None = None
    memory: str | None = None
    infra: str | None = None
    use_spot: bool | None = None
    network_tier: str | None = None
    disk_size: int | None = None
    ports: tuple[str, ...] = ()
    image_id: str | None = None
    region: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    disk_tier: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    job_recovery: JobRecovery | None = None
    autostop: Autostop | None = None
    max_hourly_cost: float | None = None
    max_node_hourly_cost: float | None = None
    candidates: tuple[Resources, ...] = ()
    ordered: bool = True

    @property
    def accelerator_name(self) -> str | None:
        """The accelerator type ("A100"), or None."""
        return self.accelerators.partition(":")[0] if self.accelerators else None

    @property
    def gpus_per_node(self) -> int:
        """Accelerators per node, a fraction rounded up (0 without accelerators)."""
        if not self.accelerators:
            return 0
        _, _, count = self.accelerators.partition(":")
        return math.ceil(float(count)) if count else 1

    def hints(self) -> dict[str, object]:
        """The fields that are set, other than ``accelerators``: name -> value."""
        out: dict[str, object] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name in (
                "accelerators",
                "job_recovery",
                "autostop",
                "max_hourly_cost",
                "max_node_hourly_cost",
                "candidates",
                "ordered",
            ):
                continue
            if value not in (None, (), {}):
                out[name] = value
        return out


@dataclass(frozen=True)
class Task:
    """A job: where it runs, how nodes are set up, what runs on them.

    Attributes:
        name: a name shown in ``flotilla queue`` (default: the file's name).
        num_nodes: nodes the ``run`` commands run on (None: not given; see the CLI).
        resources: what every node needs.
        workdir: a local folder synced to every node's working directory; ``run`` and
            ``setup`` start there. Absolute once loaded.
        file_mounts: node path -> local file or folder (absolute) copied there; on the
            local provider ``~`` and relative node paths are inside the node's working
            directory.
        volumes: the ``file_mounts`` whose sources are buckets, as Volumes: they are
            set up when the cluster starts (``Compute(volumes=...)``).
        envs: environment variables of ``setup`` and ``run``.
        secrets: like ``envs``, but never written to disk nor shown (redacted as ``***``).
        setup: shell commands run once on every node of the cluster, before ``run``.
        run: shell commands run on each of the ``num_nodes`` nodes.
        config: SkyPilot's ``config:`` section: provider -> its settings (``{aws: {region:
            eu-west-1}}``), each a field of the provider's settings class; the command
            line's flags win over it.
        engines: engines the cluster runs over its nodes while it is up (flotilla's field:
            ``engines: [ray]``, ``[dask]``): started with the cluster by ``plugins.ray()``
            / ``plugins.dask()``, so ``setup`` and ``run`` see ``RAY_ADDRESS`` /
            ``DASK_SCHEDULER_ADDRESS``.
        path: the task file ('' for a command given on the command line).
        lines: field name -> line number in the file, for later messages.
    """

    name: str | None = None
    num_nodes: int | None = None
    resources: Resources = field(default_factory=Resources)
    workdir: str | None = None
    file_mounts: Mapping[str, str] = field(default_factory=dict)
    volumes: tuple[Volume, ...] = ()
    envs: Mapping[str, str | None] = field(default_factory=dict)
    secrets: Mapping[str, str | None] = field(default_factory=dict)
    setup: str | None = None
    run: str | None = None
    config: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    engines: tuple[str, ...] = ()
    path: str = ""
    lines: Mapping[str, int] = field(default_factory=dict, repr=False, compare=False)

    def with_overrides(
        self, envs: Mapping[str, str | None], secrets: Mapping[str, str | None]
    ) -> Task:
        """``--env`` / ``--secret`` applied (a value of None is read from this process's
        environment); every variable must then have a value."""
        merged_env = dict(self.envs)
        merged_secrets = dict(self.secrets)
        for target, given, flag in (
            (merged_env, envs, "--env"),
            (merged_secrets, secrets, "--secret"),
        ):
            for key, value in given.items():
                if not _NAME.fullmatch(key):
                    raise TaskError(f"{flag} {key}: not a valid environment variable name")
                if value is None:
                    value = os.environ.get(key)
                    if value is None:
                        raise TaskError(
                            f"{flag} {key}: no value given and {key} is not set here "
                            f"(write {flag} {key}=VALUE)"
                        )
                target[key] = value
        for kind, values, flag in (
            ("envs", merged_env, "--env"),
            ("secrets", merged_secrets, "--secret"),
        ):
            for key, value in values.items():
                if value is None:
                    raise TaskError(
                        f"{kind}.{key} has no value: pass {flag} {key}=VALUE",
                        path=self.path,
                        line=self.lines.get(f"{kind}.{key}", 0),
                        field=f"{kind}.{key}",
                    )
        return replace(self, envs=merged_env, secrets=merged_secrets)

    def job_nodes(self, cluster_nodes: int) -> int:
        """Nodes the ``run`` commands use on a cluster of ``cluster_nodes``."""
        n = self.num_nodes if self.num_nodes is not None else cluster_nodes
        if n > cluster_nodes:
            raise TaskError(
                f"num_nodes is {n} but the cluster has {cluster_nodes} node(s): launch a "
                f"cluster with at least {n} nodes (flotilla launch --nodes {n} ...)",
                path=self.path,
                line=self.lines.get("num_nodes", 0),
                field="num_nodes",
            )
        return n


def command_task(command: str, num_nodes: int | None = None) -> Task:
    """A task that runs a shell ``command`` (``flotilla exec NAME 'CMD'``)."""
    if not command.strip():
        raise TaskError("the command is empty")
    from .conventions import job_name

    return Task(name=job_name(command), num_nodes=num_nodes, run=command)


# -- loading -------------------------------------------------------------------------------
def load_task(path: str) -> Task:
    """Read and validate the task file at ``path``; TaskError names the field and line.
    The file is read through the bounded loader (``yamlsafe``): hostile files are refused
    before anything is built from them."""
    root = _compose(path, many=False)[0]
    return _Parser(path).task(root)


EXECUTIONS = ("serial", "parallel")
_HEADER_FIELDS = ("name", "execution")


@dataclass(frozen=True)
class Pipeline:
    """A managed pipeline (SkyPilot's multi-document task file): a header document with
    ``name`` and optional ``execution``, then one task per document.

    Attributes:
        name: the pipeline's name (the header's, else the file's stem).
        execution: "serial" (each task after the one before it succeeded) or "parallel"
            (a job group: every task at once, each on its own cluster).
        tasks: the tasks, in the file's order; their names are unique.
        path: the file.
    """

    name: str
    execution: str
    tasks: tuple[Task, ...]
    path: str = ""


def load_tasks(path: str) -> Task | Pipeline:
    """A task file of one document (a Task) or of several (a Pipeline): every document
    checked, each mistake naming the file and its line, before anything starts."""
    import yaml

    roots = _compose(path, many=True)
    head = roots[0]
    lone_header = isinstance(head, yaml.MappingNode) and any(
        isinstance(k, yaml.ScalarNode) and k.value == "execution" for k, _ in head.value
    )
    if len(roots) == 1 and not lone_header:
        return _Parser(path).task(head)
    return _pipeline(path, roots)


def _pipeline(path: str, roots: list[yaml.Node]) -> Pipeline:
    import yaml

    stem = os.path.splitext(os.path.basename(path))[0]
    parser = _Parser(path)
    head = roots[0]
    name, execution = stem, "serial"
    keys = (
        {str(k.value) for k, _ in head.value if isinstance(k, yaml.ScalarNode)}
        if isinstance(head, yaml.MappingNode)
        else set()
    )  # a header: name and execution only, or execution and nothing to run
    header = isinstance(head, yaml.MappingNode) and (
        keys <= set(_HEADER_FIELDS) or ("execution" in keys and not keys & {"run", "setup"})
    )
    if header:
        fields = parser.mapping(head, "", dict.fromkeys(_HEADER_FIELDS))
        if "name" in fields:
            name = parser.text(fields["name"][1], "name") or stem
        if "execution" in fields:
            node = fields["execution"][1]
            value = parser.value(node)
            if value not in EXECUTIONS:
                raise parser.error(
                    f"`execution` must be serial or parallel, got {_kind(value)}",
                    node,
                    "execution",
                )
            execution = value
        roots = roots[1:]
    if not roots:
        raise TaskError(
            "the pipeline has a header but no task: add a document (after `---`) per task",
            path=path,
            line=_line(head),
        )
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for i, root in enumerate(roots):
        where = _line(root)
        if not isinstance(root, yaml.MappingNode):
            raise TaskError(
                f"document {i + 1 + header} of the pipeline is not a task (a mapping with "
                f"`run:`), it is {_kind(parser.value(root))}",
                path=path,
                line=where,
            )
        task = _Parser(path).task(root, f"{stem}-{i + 1}", where)
        task_name = task.name or ""
        if task_name in seen:
            raise TaskError(
                f"two tasks of the pipeline are named {task_name!r} (lines {seen[task_name]} "
                f"and {where}): give each task a name of its own",
                path=path,
                line=where,
            )
        seen[task_name] = where
        tasks.append(task)
    return Pipeline(name=name, execution=execution, tasks=tuple(tasks), path=path)


def _compose(path: str, many: bool) -> list[yaml.Node]:
    """The file's checked YAML documents (exactly one unless ``many``)."""
    import yaml

    from .._providers.yamlsafe import MAX_BYTES, YamlRefused, compose, compose_all

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # enough to see it is too large
    except OSError as e:
        raise TaskError(f"cannot read the task file: {e.strerror or e}", path=path) from None
    try:
        roots = compose_all(data) if many else [r for r in [compose(data)] if r is not None]
    except YamlRefused as e:
        raise TaskError(e.message, path=path, line=e.line) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else 0
        if isinstance(e, yaml.composer.ComposerError) and "another document" in str(e.problem):
            raise TaskError(
                "this file holds several YAML documents (`---` between them): a pipeline of "
                "tasks, which runs as a managed job: `flotilla jobs launch FILE` (see "
                "docs/jobs.md)",
                path=path,
                line=line,
            ) from None
        problem = e.problem or e.context or "syntax error"
        raise TaskError(f"invalid YAML: {problem}", path=path, line=line) from None
    except yaml.YAMLError as e:
        raise TaskError(f"invalid YAML: {e}", path=path) from None
    if not roots:
        raise TaskError("the task file is empty: it needs at least `run:`", path=path)
    return roots


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


class _TaskParser:
    """Turns the composed YAML tree into a Task, checking each field against its node: the
    task's fields here, ``resources`` and its fields in :class:`_Parser`."""

    def __init__(self, path: str) -> None:
        import yaml

        self.yaml = yaml
        self.path = path
        self.lines: dict[str, int] = {}
        self.volumes: list[Volume] = []  # file_mounts from buckets
        self.constructor = yaml.SafeLoader("")

    def error(self, message: str, node: yaml.Node | None, name: str) -> TaskError:
        line = _line(node) if node is not None else 0
        return TaskError(message, path=self.path, line=line, field=name)

    def value(self, node: yaml.Node) -> Any:
        return self.constructor.construct_object(node, deep=True)

    def mapping(
        self, node: yaml.Node, name: str, known: Mapping[str, Any] | None
    ) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        """A mapping's entries: key -> (key node, value node); unknown keys are errors."""
        if not isinstance(node, self.yaml.MappingNode):
            what = f"`{name}`" if name else "the task file"
            raise self.error(
                f"{what} must be a mapping (key: value lines), got {_kind(self.value(node))}",
                node,
                name,
            )
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            key = self.value(key_node)
            full = f"{name}.{key}" if name else str(key)
            if not isinstance(key, str):
                raise self.error(f"field names must be strings, got {key!r}", key_node, full)
            if key in out:
                raise self.error(f"field '{full}' is given twice", key_node, full)
            if known is not None and key not in known:
                raise self.error(_unknown(key, name, known), key_node, full)
            self.lines[full] = _line(key_node)
            out[key] = (key_node, value_node)
        return out

    def task(self, root: yaml.Node, default_name: str = "", line: int = 0) -> Task:
        """The task of document ``root`` (``default_name``: its name when it gives none;
        ``line``: where the document starts, for errors about the whole task)."""
        fields = self.mapping(root, "", _TASK_FIELDS)
        values: dict[str, Any] = {}
        for key, (_key_node, node) in fields.items():
            values[key] = _TASK_FIELDS[key](self, node, key)
        if not values.get("run") and not values.get("setup"):
            raise TaskError(
                "the task has nothing to run: add `run:` (and optionally `setup:`)",
                path=self.path,
                line=line,
            )
        name = (
            values.get("name") or default_name or os.path.splitext(os.path.basename(self.path))[0]
        )
        values["name"] = name
        values["volumes"] = tuple(self.volumes)
        return Task(**values, path=self.path, lines=dict(self.lines))

    # -- field checkers (each returns the field's value) --------------------------------
    def text(self, node: yaml.Node, name: str) -> str | None:
        value = self.value(node)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.error(f"`{name}` must be a string, got {_kind(value)}", node, name)
        return value

    def config(self, node: yaml.Node, name: str) -> dict[str, dict[str, Any]]:
        """``config: {PROVIDER: {FIELD: VALUE}}``: each provider's settings (which fields
        exist is the provider's to say, when the task runs there)."""
        from .._providers.config_files import ALIASES, KINDS

        out: dict[str, dict[str, Any]] = {}
        for key, (key_node, section) in self.mapping(node, name, None).items():
            if key not in KINDS and key not in ALIASES and not _plugin_kind(key):
                known = ", ".join([*KINDS, *ALIASES])
                raise self.error(
                    f"`{name}.{key}`: not a provider (a task's config: sets providers' "
                    f"settings: {known}; named pools belong in a configuration file, see "
                    "`flotilla config show`)"
                    if key == "pools"
                    else f"`{name}.{key}`: no such provider (config: takes {known}, or a "
                    "provider another package registers)",
                    key_node,
                    f"{name}.{key}",
                )
            fields = self.mapping(section, f"{name}.{key}", None)
            out[key] = {k: self.value(v) for k, (_, v) in fields.items()}
        return out

    def script(self, node: yaml.Node, name: str) -> str | None:
        value = self.value(node)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return "\n".join(value)  # a list of commands, one per line
        return self.text(node, name)

    def positive_int(self, node: yaml.Node, name: str) -> int | None:
        value = self.value(node)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"`{name}` must be a whole number, got {_kind(value)}", node, name)
        if value < 1:
            raise self.error(f"`{name}` must be at least 1, got {value}", node, name)
        return value

    def engines(self, node: yaml.Node, name: str) -> tuple[str, ...]:
        value = self.value(node)
        items = [] if value is None else value if isinstance(value, list) else [value]
        for item in items:
            if item not in ENGINES:
                raise self.error(
                    f"`{name}` lists engines the cluster starts: {' and/or '.join(ENGINES)}, "
                    f"got {_kind(item)}",
                    node,
                    name,
                )
        return tuple(dict.fromkeys(items))

    def boolean(self, node: yaml.Node, name: str) -> bool | None:
        value = self.value(node)
        if value is None or isinstance(value, bool):
            return value
        raise self.error(f"`{name}` must be true or false, got {_kind(value)}", node, name)

    def folder(self, node: yaml.Node, name: str) -> str | None:
        value = self.text(node, name)
        if value is None:
            return None
        path = os.path.abspath(os.path.expanduser(value))
        if not os.path.isdir(path):
            raise self.error(
                f"`{name}`: {value!r} is not a folder (from {os.getcwd()})", node, name
            )
        return path

    def variables(self, node: yaml.Node, name: str) -> dict[str, str | None]:
        if self.value(node) is None:
            return {}
        out: dict[str, str | None] = {}
        for key, (key_node, value_node) in self.mapping(node, name, None).items():
            full = f"{name}.{key}"
            if not _NAME.fullmatch(key):
                raise self.error(f"`{full}`: not a valid environment variable name", key_node, full)
            value = self.value(value_node)
            if value is None:
                out[key] = None
            elif isinstance(value, bool):
                out[key] = "true" if value else "false"
            elif isinstance(value, str | int | float):
                out[key] = str(value)
            else:
                raise self.error(
                    f"`{full}` must be a string or a number, got {_kind(value)}", value_node, full
                )
        return out

    def mounts(self, node: yaml.Node, name: str) -> dict[str, str]:
        """Local sources (node path -> local path); bucket sources go to ``self.volumes``
        (SkyPilot's forms: ``/p: s3://b/x`` (COPY), ``{source, mode}``, and storage
        entries ``{name, store: s3, mode, persistent}``)."""
        if self.value(node) is None:
            return {}
        out: dict[str, str] = {}
        for target, (key_node, value_node) in self.mapping(node, name, None).items():
            full = f"{name}.{target}"
            source = self.value(value_node)
            if not target.strip():
                raise self.error(f"`{name}`: an empty node path", key_node, full)
            if isinstance(source, dict):
                volume = self.storage(source, target, value_node, full)
                if volume is not None:
                    self.volumes.append(volume)
                    continue
                source = source.get("source")
            if not isinstance(source, str):
                raise self.error(
                    f"`{full}` must be a local path, got {_kind(source)}", value_node, full
                )
            if re.match(r"[a-z][a-z0-9+]*://", source):
                self.volumes.append(self.bucket(source, target, "COPY", value_node, full))
                continue
            local = os.path.abspath(os.path.expanduser(source))
            if not os.path.exists(local):
                raise self.error(f"`{full}`: {source!r} does not exist", value_node, full)
            out[target] = local
        return out

    def storage(
        self, entry: dict[str, Any], target: str, node: yaml.Node, full: str
    ) -> Volume | None:
        """A ``{source, mode}`` entry with a bucket source, or a storage entry (``name``,
        ``store``): its Volume; None for a local source."""
        unknown = set(entry) - {"source", "mode", "name", "store", "persistent"}
        if unknown:
            raise self.error(
                f"`{full}`: unknown field(s) {', '.join(sorted(map(str, unknown)))} (known: "
                "source, mode, name, store, persistent)",
                node,
                full,
            )
        mode = entry.get("mode", "MOUNT")
        if not isinstance(mode, str) or mode.upper() not in _STORAGE_MODES:
            raise self.error(
                f"`{full}.mode` must be one of {', '.join(_STORAGE_MODES)}, got {mode!r}",
                node,
                full,
            )
        source, bucket_name = entry.get("source"), entry.get("name")
        if bucket_name is None:
            if isinstance(source, str) and re.match(r"[a-z][a-z0-9+]*://", source):
                return self.bucket(source, target, mode.upper(), node, full)
            return None
        store = entry.get("store", "s3")
        if store != "s3":
            raise self.error(
                f"`{full}.store`: {store!r} is not supported (flotilla mounts S3 buckets: "
                "store: s3)",
                node,
                full,
            )
        if entry.get("persistent", True) is not True:
            raise self.error(
                f"`{full}.persistent: false` is not supported: flotilla never deletes a "
                "bucket; remove the field (buckets persist) and delete it yourself",
                node,
                full,
            )
        if source is not None:
            raise self.error(
                f"`{full}.source`: uploading a local folder into a storage bucket is not "
                f"supported; upload it first (aws s3 sync {source} s3://{bucket_name}) and "
                "give only `name`",
                node,
                full,
            )
        if not isinstance(bucket_name, str):
            raise self.error(f"`{full}.name` must be a bucket name", node, full)
        return self.bucket(f"s3://{bucket_name}", target, mode.upper(), node, full)

    def bucket(self, source: str, target: str, mode: str, node: yaml.Node, full: str) -> Volume:
        """A bucket source as a Volume: COPY is a read-only copy (SkyPilot's), MOUNT and
        MOUNT_CACHED a writable FUSE mount."""
        if not source.startswith("s3://"):
            raise self.error(
                f"`{full}`: {source!r}: flotilla mounts S3 buckets (s3://...) only",
                node,
                full,
            )
        try:
            if mode == "COPY":
                return Volume(source, target, mode="copy", read_only=True)
            return Volume(source, target, mode="mount", read_only=False)
        except ConfigurationError as e:
            raise self.error(f"`{full}`: {e}", node, full) from None


class _Parser(_TaskParser):
    """The task parser with the checkers of ``resources`` and its fields."""

    def resources(self, node: yaml.Node, name: str) -> Resources:
        if self.value(node) is None:
            return Resources()
        known = {**_RESOURCE_FIELDS, "any_of": _Parser.text, "ordered": _Parser.text}
        fields = self.mapping(node, name, known)
        if "any_of" in fields and "ordered" in fields:
            raise self.error(
                f"give `{name}.any_of` or `{name}.ordered`, not both", fields["ordered"][1], name
            )
        values = self._resource_values(fields, name)
        base = Resources(**values)
        sets = self._accelerator_sets(fields.get("accelerators"), f"{name}.accelerators")
        alternatives: list[dict[str, Any]] = [{}]
        ordered = True
        for key in ("any_of", "ordered"):
            if key in fields:
                ordered = key == "ordered"
                alternatives = self._alternatives(fields[key][1], f"{name}.{key}")
        if sets is not None:
            ordered = ordered and sets[1]
        candidates: list[Resources] = []
        for alt in alternatives:
            # SkyPilot's merge: the candidate's fields over the top-level ones, its
            # labels added to theirs
            merged = {**alt, "labels": {**base.labels, **alt["labels"]}} if "labels" in alt else alt
            one = replace(base, **merged)
            accs = sets[0] if sets is not None and "accelerators" not in alt else ()
            candidates.extend([replace(one, accelerators=a) for a in accs] or [one])
        if len(candidates) == 1:
            return candidates[0]
        first = candidates[0]
        return replace(first, candidates=tuple(candidates), ordered=ordered)

    def _resource_values(
        self, fields: dict[str, tuple[yaml.Node, yaml.Node]], name: str
    ) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for key, (_key_node, value_node) in fields.items():
            if key in ("any_of", "ordered"):
                continue
            full = f"{name}.{key}"
            if key == "accelerators" and self._accelerator_sets(value_node, full) is not None:
                continue  # a set or a list: one candidate each
            checked = _RESOURCE_FIELDS[key](self, value_node, full)
            if key == "cloud":  # the old name of `infra`
                if "infra" in fields:
                    raise self.error(f"give `{name}.infra` or `{full}`, not both", value_node, full)
                key = "infra"
            values[key] = checked
        return values

    def _accelerator_sets(self, entry: Any, name: str) -> tuple[tuple[str, ...], bool] | None:
        """(the accelerators, ordered) of ``accelerators: {A100:8, H100:8}`` (a set: any
        of them) or ``[A100:8, H100:8]`` (in order); None for one accelerator."""
        node = entry[1] if isinstance(entry, tuple) else entry
        if node is None:
            return None
        value = self.value(node)
        if isinstance(value, dict) and len(value) > 1:
            items = [f"{k}:{v}" if v is not None else str(k) for k, v in value.items()]
            ordered = False
        elif isinstance(value, list):
            items = [
                f"{next(iter(v))}:{next(iter(v.values()))}" if isinstance(v, dict) else v
                for v in value
            ]
            ordered = True
        else:
            return None
        out = []
        for item in items:
            if not isinstance(item, str):
                raise self.error(
                    f"`{name}`: {item!r} is not an accelerator like 'A100:8'", node, name
                )
            out.append(self.accelerators(self.yaml.ScalarNode("tag:yaml.org,2002:str", item), name))
        return tuple(a for a in out if a), ordered

    def _alternatives(self, node: yaml.Node, name: str) -> list[dict[str, Any]]:
        """The mappings of ``any_of``/``ordered``: each checked as resources are."""
        if not isinstance(node, self.yaml.SequenceNode) or not node.value:
            raise self.error(f"`{name}` must be a list of resources mappings", node, name)
        out = []
        for i, item in enumerate(node.value):
            full = f"{name}[{i}]"
            fields = self.mapping(item, full, _RESOURCE_FIELDS)
            for once in ("job_recovery", "autostop"):
                if once in fields:
                    raise self.error(f"`{full}.{once}`: give it once, outside", item, full)
            if self._accelerator_sets(fields.get("accelerators"), full) is not None:
                raise self.error(
                    f"`{full}.accelerators`: one accelerator per candidate", item, full
                )
            out.append(self._resource_values(fields, full))
        return out

    def accelerators(self, node: yaml.Node, name: str) -> str | None:
        value = self.value(node)
        if value is None:
            return None
        if isinstance(value, dict) and len(value) == 1:
            ((acc, count),) = value.items()
            value = f"{acc}:{count}" if count is not None else str(acc)
        if not isinstance(value, str):
            raise self.error(
                f"`{name}` must be one accelerator like 'A100:8', got {_kind(value)}", node, name
            )
        acc, _, count = value.partition(":")
        if not acc.strip() or (count and not re.fullmatch(r"\d+(\.\d+)?", count.strip())):
            raise self.error(
                f"`{name}`: {value!r} is not an accelerator like 'A100' or 'A100:8'", node, name
            )
        if count and float(count) <= 0:
            raise self.error(f"`{name}`: the count must be positive, got {count}", node, name)
        return f"{acc.strip()}:{count.strip()}" if count else acc.strip()

    def autostop(self, node: yaml.Node, name: str) -> Autostop | None:
        value = self.value(node)
        forms = "true, false, minutes (10, '10m', '2h', '1d') or {idle_minutes: 10, down: true}"
        down = False
        if isinstance(value, dict):
            fields = self.mapping(node, name, {"idle_minutes": 0, "down": 0, "wait_for": 0})
            wait = self.value(fields["wait_for"][1]) if "wait_for" in fields else "jobs"
            if wait != "jobs":
                raise self.error(
                    f"`{name}.wait_for`: flotilla counts jobs only: give `jobs` (or leave it "
                    f"out), got {_kind(wait)}",
                    fields["wait_for"][1],
                    f"{name}.wait_for",
                )
            if "down" in fields:
                flag = self.value(fields["down"][1])
                if not isinstance(flag, bool):
                    raise self.error(
                        f"`{name}.down` must be true or false, got {_kind(flag)}",
                        fields["down"][1],
                        f"{name}.down",
                    )
                down = flag
            value = self.value(fields["idle_minutes"][1]) if "idle_minutes" in fields else True
        if value is False or value is None:
            return None
        if value is True:
            return Autostop(DEFAULT_AUTOSTOP_MINUTES, down)
        minutes: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            minutes = float(value)
        elif isinstance(value, str):
            text = value.strip().lower()
            unit = _AUTOSTOP_UNITS.get(text[-1:], 0.0)
            number = text[:-1] if unit else text
            if re.fullmatch(r"\d+(\.\d+)?", number):
                minutes = float(number) * (unit or 1.0)
        if minutes is None or minutes <= 0:
            raise self.error(f"`{name}` must be {forms}; got {_kind(value)}", node, name)
        return Autostop(minutes, down)

    def job_recovery(self, node: yaml.Node, name: str) -> JobRecovery:
        try:
            return parse_job_recovery(self.value(node), name)
        except ConfigurationError as e:
            raise self.error(str(e), node, name) from None

    def amount(self, node: yaml.Node, name: str) -> str | None:
        value = self.value(node)
        if value is None:
            return None
        if isinstance(value, bool) or not (
            isinstance(value, int | float) or (isinstance(value, str) and _AMOUNT.fullmatch(value))
        ):
            raise self.error(
                f"`{name}` must be a number, optionally followed by + ('4' or '4+'), "
                f"got {_kind(value)}",
                node,
                name,
            )
        if float(str(value).rstrip("+")) <= 0:
            raise self.error(f"`{name}` must be positive, got {value}", node, name)
        return str(value)

    def price(self, node: yaml.Node, name: str) -> float | None:
        value = self.value(node)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise self.error(
                f"`{name}` must be a positive number of USD per hour (e.g. 12.5), got "
                f"{_kind(value)}",
                node,
                name,
            )
        return float(value)

    def tier(self, node: yaml.Node, name: str) -> str | None:
        value = self.text(node, name)
        if value is not None and value not in ("standard", "best"):
            raise self.error(f"`{name}` must be 'standard' or 'best', got {value!r}", node, name)
        return value

    def ports(self, node: yaml.Node, name: str) -> tuple[str, ...]:
        value = self.value(node)
        if value is None:
            return ()
        items = value if isinstance(value, list) else [value]
        out = []
        for item in items:
            text = str(item) if isinstance(item, int) and not isinstance(item, bool) else item
            if not isinstance(text, str) or not _PORTS.fullmatch(text):
                raise self.error(
                    f"`{name}` must be ports like 8080 or '10000-10010', got {_kind(item)}",
                    node,
                    name,
                )
            out.append(text)
        return tuple(out)

    def labels(self, node: yaml.Node, name: str) -> dict[str, str]:
        values = self.variables(node, name) if self.value(node) is not None else {}
        return {k: v or "" for k, v in values.items()}


def _plugin_kind(name: str) -> bool:
    """Whether another package registers a provider named ``name``."""
    from .._providers.config_files import entry_points

    return name in entry_points()


def _unknown(key: str, section: str, known: Mapping[str, Any]) -> str:
    where = f"in `{section}` " if section else ""
    message = f"unknown field '{key}' {where}".rstrip()
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if close:
        return f"{message} (did you mean '{close[0]}'?)"
    return f"{message} (known fields: {', '.join(sorted(known))})"


ENGINES = ("ray", "dask")
"""What a task file's ``engines`` may list (``plugins.ray()``, ``plugins.dask()``)."""

_STORAGE_MODES = ("MOUNT", "COPY", "MOUNT_CACHED")

_Check = Callable[[Any, "yaml.Node", str], Any]  # a _Parser's checker (self, node, name)

_TASK_FIELDS: dict[str, _Check] = {
    "name": _Parser.text,
    "num_nodes": _Parser.positive_int,
    "resources": _Parser.resources,
    "workdir": _Parser.folder,
    "file_mounts": _Parser.mounts,
    "envs": _Parser.variables,
    "secrets": _Parser.variables,
    "setup": _Parser.script,
    "run": _Parser.script,
    "config": _Parser.config,
    "engines": _Parser.engines,
}

_RESOURCE_FIELDS: dict[str, _Check] = {
    "accelerators": _Parser.accelerators,
    "job_recovery": _Parser.job_recovery,
    "autostop": _Parser.autostop,
    "max_hourly_cost": _Parser.price,
    "max_node_hourly_cost": _Parser.price,
    "cpus": _Parser.amount,
    "memory": _Parser.amount,
    "infra": _Parser.text,
    "cloud": _Parser.text,
    "use_spot": _Parser.boolean,
    "network_tier": _Parser.tier,
    "disk_size": _Parser.positive_int,
    "ports": _Parser.ports,
    "image_id": _Parser.text,
    "region": _Parser.text,
    "zone": _Parser.text,
    "instance_type": _Parser.text,
    "disk_tier": _Parser.text,
    "labels": _Parser.labels,
}
