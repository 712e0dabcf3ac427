"""The command line's backends: the registry is the only place that lists provider kinds,
an unknown kind is a clear error, and flags choose and build a backend's spec. In-process:
no cluster is started here (tests/test_cli.py runs the backends for real)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

import flotilla.cli
from flotilla._errors import ConfigurationError
from flotilla._providers.base import Provider
from flotilla.cli.backends import registry
from flotilla.cli.backends.aws import AWSSpec
from flotilla.cli.backends.base import Backend, Flag, ProviderSpec, ShellCommand
from flotilla.cli.backends.local import LocalSpec
from flotilla.cli.backends.slurm import SlurmSpec
from flotilla.cli.backends.ssh import SSHSpec
from flotilla.cli.clusters import DAEMON_MODULE
from flotilla.cli.parser import build_parser
from flotilla.cli.state import NodeRecord, Paths
from flotilla.cli.taskfile import Resources, Task

CLI_DIR = Path(flotilla.cli.__file__).parent
BACKENDS_DIR = CLI_DIR / "backends"


def launch_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", "task.yaml", *flags])


# -- provider kinds are named in the backends only ---------------------------------------------
def _kind_literals(path: Path, kinds: set[str], root: Path = CLI_DIR.parent) -> list[str]:
    """``file:line: 'kind'`` for each string constant equal to a provider kind, except a
    sub-command's name (``add_parser("ssh")``: the `flotilla ssh` command, or a name in
    ``cli/parser.py``'s table of the sub-commands it builds on demand, ``_PARTS``) and a
    path component (``home / "ssh"``: a folder's name)."""
    tree = ast.parse(path.read_text(), str(path))
    allowed: set[int] = set()
    for node in ast.walk(tree):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == "_PARTS":
            assert isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Tuple)
            for row in node.value.elts:  # (names, the commands it changes, its builder)
                if isinstance(row, ast.Tuple) and isinstance(row.elts[0], ast.Tuple):
                    allowed.update(id(name) for name in row.elts[0].elts)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_parser"
            and node.args
        ):
            allowed.add(id(node.args[0]))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            allowed.update((id(node.left), id(node.right)))
    hits = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in kinds and id(node) not in allowed
    ]
    hits.sort(key=lambda node: (node.lineno, node.col_offset))
    return [f"{path.relative_to(root)}:{node.lineno}: {node.value!r}" for node in hits]


def test_provider_kinds_appear_only_in_the_backend_modules() -> None:
    kinds = set(registry.kinds())
    modules = [p for p in CLI_DIR.rglob("*.py") if BACKENDS_DIR not in p.parents]
    assert len(modules) > 10  # the walk found the command line's modules
    found = [hit for path in sorted(modules) for hit in _kind_literals(path, kinds)]
    assert found == [], (
        "provider kinds named outside cli/backends/ (ask the backend instead: "
        "registry.backend_for(spec).<member>):\n" + "\n".join(found)
    )


def test_the_kind_check_catches_a_comparison(tmp_path: Path) -> None:
    """The check above can fail: a branch on a kind is reported, a command name is not."""
    module = tmp_path / "flotilla" / "cli" / "bad.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        'def f(kind, sub, home):\n    sub.add_parser("ssh")\n    d = home / "ssh"\n'
        '    return kind == "ssh"\n'
        '_PARTS: tuple = ((("ssh",), ("ssh",), f),)\n'
    )
    assert _kind_literals(module, {"ssh"}, tmp_path) == [
        "flotilla/cli/bad.py:4: 'ssh'",
        "flotilla/cli/bad.py:5: 'ssh'",  # a table's command name, yes; its other columns, no
    ]


def test_every_backend_module_is_in_the_registry() -> None:
    """A backend module that is not listed would silently not exist for the command line."""
    listed = {type(b).__module__ for b in registry.BACKENDS}
    for path in BACKENDS_DIR.glob("*.py"):
        if path.stem in ("__init__", "base", "registry", "plugin"):  # plugin: other packages
            continue
        module = importlib.import_module(f"flotilla.cli.backends.{path.stem}")
        assert isinstance(module.BACKEND, Backend), f"{path.name} has no BACKEND"
        assert module.__name__ in listed, f"{path.name} is not in registry.BACKENDS"
    assert len(set(registry.kinds())) == len(registry.BACKENDS), "two backends share a kind"


# -- the registry --------------------------------------------------------------------------------
def test_an_unknown_kind_is_an_error_listing_the_known_ones() -> None:
    known = ", ".join(registry.kinds())
    with pytest.raises(
        ConfigurationError, match=f"unknown provider 'nomad': flotilla has {known}$"
    ):
        registry.backend("nomad")
    with pytest.raises(ConfigurationError, match="unknown provider 'nomad'"):
        registry.spec_from_dict({"kind": "nomad", "hosts": ["h1"]})
    assert known == "local, ssh, slurm, aws, k8s, vast, runpod, lambda, gcp, verda, container"


def test_specs_round_trip_through_the_state_file_format() -> None:
    specs: list[ProviderSpec] = [
        LocalSpec(),
        SSHSpec(
            settings=(("hosts", ("root@h1", "h2:2222")), ("key", "/k")),
        ),
        SlurmSpec(
            settings=(("partition", "gpu"), ("time", "2:00:00")), accelerator="A100:2", vcpus=4.0
        ),
        AWSSpec(
            settings=(
                ("region", "us-east-1"),
                ("allocation", "spot"),
                ("ports", ("8080", "9000-9001")),
                ("tags", {"team": "ml"}),
            ),
            memory_gb=16.0,
        ),
    ]
    for spec in specs:
        data = json.loads(json.dumps(spec.to_dict()))
        assert data["kind"] == spec.kind
        assert registry.spec_from_dict(data) == spec
        assert registry.backend_for(spec).kind == spec.kind
    # an older state file (no kind) is the default backend; unknown keys are ignored
    assert registry.spec_from_dict({"future_option": 1}) == registry.DEFAULT.spec_type()


def test_flags_choose_the_backend_and_build_its_spec() -> None:
    assert registry.spec_from_args(launch_args()) is None  # nothing asked: the cluster's own
    assert registry.spec_from_args(launch_args("--provider", "local")) == LocalSpec()
    spec = registry.spec_from_args(
        launch_args("--hosts", "a, b", "--ssh-key", "key", "--accept-new-host-keys")
    )
    key = str(Path("key").absolute())
    assert spec == SSHSpec(
        settings=(("hosts", ("a", "b")), ("key", key), ("accept_new_host_keys", True))
    )
    with pytest.raises(ConfigurationError, match="--hosts is for --provider ssh, not local"):
        registry.spec_from_args(launch_args("--provider", "local", "--hosts", "a"))
    with pytest.raises(ConfigurationError, match="needs hosts: --hosts"):
        registry.spec_from_args(launch_args("--ssh-key", "key"))
    with pytest.raises(ConfigurationError, match="unknown provider 'nomad'"):
        registry.spec_from_args(launch_args("--provider", "nomad"))


def test_the_daemon_module_the_cli_starts_exists() -> None:
    spec = importlib.util.find_spec(DAEMON_MODULE)
    assert spec is not None and spec.origin is not None
    assert "def main(" in Path(spec.origin).read_text()


# -- a new backend is one class and one registry entry --------------------------------------------
@dataclass(frozen=True)
class FakeSpec(ProviderSpec):
    """A backend the registry does not ship, added the way SLURM or AWS will be."""

    kind = "fake"
    partition: str | None = None


class FakeBackend(Backend[FakeSpec]):
    spec_type = FakeSpec
    summary = "a test double"
    flags = (Flag("--fake-partition", "where jobs go"), Flag("--fake-gpus", "GPUs", type=int))
    infra = ("fake",)
    hint_reason = "a test double"

    def spec_from_args(self, args: argparse.Namespace) -> FakeSpec:
        return FakeSpec(partition=args.fake_partition)

    def make_provider(self, spec: FakeSpec, nodes_dir: Path) -> Provider:
        raise NotImplementedError

    def shell(
        self, paths: Paths, spec: FakeSpec, nodes: Sequence[NodeRecord], node: int, command: str
    ) -> ShellCommand:
        raise NotImplementedError


def test_a_backend_added_to_the_registry_gets_its_flags_infra_and_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry, "BACKENDS", (*registry.BACKENDS, FakeBackend()))
    spec = registry.spec_from_args(launch_args("--fake-partition", "gpu"))
    assert spec == FakeSpec(partition="gpu")
    assert registry.spec_from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert registry.spec_from_args(launch_args("--provider", "fake")) == FakeSpec()
    assert launch_args("--fake-gpus", "2").fake_gpus == 2
    assert registry.spec_from_args(launch_args("--fake-gpus", "2")) == FakeSpec()  # it chose fake
    with pytest.raises(ConfigurationError, match="--fake-partition is for --provider fake"):
        registry.spec_from_args(launch_args("--provider", "local", "--fake-partition", "x"))

    task = Task(run="x", resources=Resources(infra="fake/region-1", use_spot=True))
    assert registry.spec_from_args(launch_args(), task) == FakeSpec()  # chosen by infra
    assert registry.spec_from_args(launch_args(), Task(run="x")) is None
    warnings = registry.backend("fake").check_task(task, FakeSpec(), 2)
    assert [w.split(":")[0] for w in warnings] == ["resources.use_spot"]  # infra is acted on
    local_warnings = registry.DEFAULT.check_task(task, registry.DEFAULT.spec_type(), 2)
    assert any("resources.infra: 'fake/region-1'" in w for w in local_warnings)


# -- task files choose and complete the SLURM and AWS specs ---------------------------------------
def test_task_resources_complete_the_slurm_spec() -> None:
    task = Task(
        run="true",
        resources=Resources(infra="slurm/gpu", accelerators="A100:2", cpus="4+", memory="32"),
    )
    spec = registry.spec_from_args(launch_args(), task)
    assert spec == SlurmSpec(
        settings=(("partition", "gpu"),), accelerator="A100:2", vcpus=4.0, memory_gb=32.0
    )
    backend = registry.backend_for(spec)
    assert backend.check_task(task, spec, 2) == []  # every field acted on
    wants = backend.pool_resources(spec)
    assert (wants.accelerator, wants.vcpus, wants.memory_gb) == ("A100:2", 4.0, 32.0)
    # the command line wins over the task
    spec = registry.spec_from_args(launch_args("--partition", "debug"), task)
    assert isinstance(spec, SlurmSpec) and spec.value("partition") == "debug"
    with pytest.raises(ConfigurationError, match="unlimited time"):
        registry.spec_from_args(launch_args("--time", "UNLIMITED"), task)


def test_network_tier_best_is_acted_on_by_aws_and_noted_elsewhere() -> None:
    best = Task(run="true", resources=Resources(infra="aws", network_tier="best"))
    spec = registry.spec_from_args(launch_args(), best)
    assert isinstance(spec, AWSSpec) and spec.value("network_tier") == "best"
    settings = registry.backend_for(spec).settings_of(spec)
    assert settings.network_tier == "best"  # reaches AWS(network_tier=)
    assert registry.backend_for(spec).check_task(best, spec, 2) == []
    on_local = Task(run="true", resources=Resources(network_tier="best"))
    (note,) = registry.DEFAULT.check_task(on_local, registry.DEFAULT.spec_type(), 2)
    assert note.startswith("resources.network_tier: 'best'")  # one line: not acted on here


def test_task_resources_complete_the_aws_spec() -> None:
    res = Resources(
        infra="aws/eu-west-1",
        use_spot=True,
        instance_type="c5.large",
        cpus="2",
        memory="4+",
        disk_size=50,
        image_id="ami-0123456789abcdef0",
        ports=("8080", "9000-9001"),
        labels={"team": "ml"},
    )
    task = Task(run="true", resources=res)
    spec = registry.spec_from_args(launch_args(), task)
    assert spec == AWSSpec(
        settings=(
            ("region", "eu-west-1"),
            ("instance_type", "c5.large"),
            ("allocation", "spot"),
            ("ami", "ami-0123456789abcdef0"),
            ("disk_gb", 50),
            ("ports", ("8080", "9000-9001")),
            ("tags", {"team": "ml"}),
        ),
        vcpus=2.0,
        memory_gb=4.0,
    )
    assert registry.backend_for(spec).check_task(task, spec, 3) == []
    with pytest.raises(ConfigurationError, match=r"resources\.cpus: 'many'"):
        registry.spec_from_args(
            launch_args(), Task(run="true", resources=Resources(infra="aws", cpus="many"))
        )
    with pytest.raises(ConfigurationError, match="disk_gb"):
        registry.spec_from_args(
            launch_args(), Task(run="true", resources=Resources(infra="aws", disk_size=2))
        )


# -- every provider setting is reachable from `flotilla launch` --------------------------------
@pytest.mark.parametrize("b", registry.BACKENDS, ids=lambda b: b.kind)
def test_every_provider_setting_has_a_flag_or_is_set_by_the_command_line(b: Backend) -> None:  # type: ignore[type-arg]
    """Each field of the provider's settings object is set by a `flotilla launch` flag
    (derived from it), or by the command line itself (``Backend.fixed``), or is a secret
    (never a flag: from the environment)."""
    assert b.settings_type is not None
    fields_ = {f.name for f in dataclasses.fields(b.settings_type)}
    flagged = {flag.setting for flag in b.all_flags if flag.setting}
    secret = {o.name for o in b.options() if o.secret}
    assert flagged | set(b.fixed) | secret == fields_
    assert not flagged & (set(b.fixed) | secret)


_SAMPLES = {
    "subnet": "subnet-0123456789abcdef0",
    "sbatch_args": "--exclusive=user --nice=5",
    "min_reliability": "0.5",
    "workdir": "/x1",
    "region": "us-east-1",
    "allocation": "spot",
    "instance_type": "c5.large",
    "ami": "ami-0123456789abcdef0",
    "disk_gb": "50",
    "tags": "team=ml,tier=a",
    "ports": "8080 9000-9001",
    "network_tier": "best",
    "namespace": "ns-1",
    "time": "2:00:00",
    "regions": "US SE",
    "cloud_type": "community",
    "data_centers": "EU-RO-1 US-TX-3",
    "hosts": "h1,h2",
    "binary": "podman",
    "image": "python:3.11-slim",
    "rootfs": "/x1",
    "volumes": "/a:/b",
    "network": "net1",
    "container_prefix": "fx",
    "poweroff_command": "sudo -n halt",
}
_KIND_SAMPLES = {  # where a kind spells a setting its own way
    ("gcp", "region"): "europe-west4",
    ("gcp", "zone"): "europe-west4-a",
    ("gcp", "api_endpoint"): "http://127.0.0.1:8089/compute/v1/",
    ("runpod", "volume_mount_path"): "/x1",
    ("verda", "region"): "FIN-01",
    ("verda", "instance_type"): "1A100.22V",
}
_REQUIRED = {"ssh": ["--hosts", "h1,h2"], "container": ["--container-binary", "podman"]}


@pytest.mark.parametrize(
    ("kind", "flag"),
    [(b.kind, f) for b in registry.BACKENDS for f in b.all_flags if f.setting],
    ids=lambda v: v if isinstance(v, str) else v.name,
)
def test_a_settings_flag_reaches_the_provider(kind: str, flag: Flag, tmp_path: Path) -> None:
    """`flotilla launch --provider KIND --FLAG VALUE`: the provider the cluster's daemon
    makes from the spec (also after the state file's round trip) has VALUE in its
    settings."""
    b = registry.backend(kind)
    argv = ["--provider", kind, *_REQUIRED.get(kind, []), flag.name]
    if not flag.switch:
        default = "7" if flag.type in (int, float) else "x1"
        argv.append(_KIND_SAMPLES.get((kind, flag.setting), _SAMPLES.get(flag.setting, default)))
    spec = registry.spec_from_args(launch_args(*argv))
    assert spec is not None
    kept = registry.spec_from_dict(json.loads(json.dumps(spec.to_dict())))
    assert kept == spec and hash(kept) == hash(spec)  # the state file keeps it as it is
    provider = b.make_provider(kept, tmp_path)
    value = getattr(provider.settings, flag.setting)  # type: ignore[attr-defined]
    if flag.setting == "hosts":
        value = tuple(h.host for h in value)
    if flag.switch:
        expected: object = flag.value
    elif flag.type is shlex.split:
        expected = tuple(shlex.split(argv[-1]))
    else:
        expected = flag.type(argv[-1])
    assert value == expected
