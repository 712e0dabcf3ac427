"""The configuration files (``_providers/config.py``): the user's
``$FLOTILLA_HOME/config.yaml``, the project's ``.flotilla.yaml`` over it, a task's
``config:`` over both and the flags over all; named pools (``Compute(name=...)``, Skyward's
``skyward.toml`` pools); ``flotilla config show|validate``; bad keys and values refused
naming the file, line, key and what is allowed, before anything starts."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import pytest
from test_cli import CLI
from test_cli import cli as cli  # the fixture

from flotilla import Compute, Image, Local, function, instance_info
from flotilla._errors import ConfigurationError
from flotilla._providers import config_files as configuration
from flotilla.cli.backends import registry
from flotilla.cli.parser import build_parser
from flotilla.cli.state import all_names
from flotilla.cli.taskfile import Task, TaskError, load_task


def launch_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", "task.yaml", *flags])


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder (the current one) and a FLOTILLA_HOME of this test's."""
    home = tmp_path / "home"
    home.mkdir()
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.setenv("FLOTILLA_HOME", str(home))
    monkeypatch.chdir(project)
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def user_file(here: Path, text: str) -> Path:
    return write(here / "home" / "config.yaml", text)


def project_file(here: Path, text: str) -> Path:
    return write(here / "project" / ".flotilla.yaml", text)


def test_the_layers_user_then_project_then_task_config_then_flags(here: Path) -> None:
    """Each layer overrides the one below it key by key; the rest comes through."""
    user_file(
        here,
        """\
        aws:
          region: eu-west-1
          ttl: 900
          ssh_user: admin
          tags: {team: ml}
        """,
    )
    project_file(here, "aws:\n  ttl: 1200\n  subnet: subnet-1\n")
    task = write(
        here / "project" / "task.yaml",
        "resources:\n  infra: aws\nconfig:\n  aws:\n    subnet: subnet-2\nrun: x\n",
    )
    aws = registry.backend("aws")

    def settings(*flags: str) -> object:
        spec = registry.spec_from_args(launch_args(*flags), load_task(str(task)))
        assert spec is not None and spec.kind == "aws"
        return aws.settings_of(spec)

    got = settings()
    assert (got.region, got.ttl, got.ssh_user, got.subnet) == (  # type: ignore[attr-defined]
        "eu-west-1",  # the user's
        1200.0,  # the project's over the user's
        "admin",
        "subnet-2",  # the task's config: over the project's
    )
    assert dict(got.tags) == {"team": "ml"}  # type: ignore[attr-defined]
    got = settings("--region", "us-east-1", "--subnet", "subnet-3")
    assert (got.region, got.subnet) == ("us-east-1", "subnet-3")  # type: ignore[attr-defined]
    # a task's resources win over the files' defaults (the files are defaults)
    task2 = write(here / "project" / "t2.yaml", "resources:\n  infra: aws/ap-south-1\nrun: x\n")
    spec = registry.spec_from_args(launch_args(), load_task(str(task2)))
    assert spec is not None and aws.settings_of(spec).region == "ap-south-1"


def test_down_orphans_looks_where_the_configured_defaults_put_clusters(here: Path) -> None:
    """``down --orphans --provider aws`` (no task) takes the files' region; a flag wins."""
    user_file(here, "aws:\n  region: eu-west-1\n")

    def region(*flags: str) -> str:
        args = build_parser().parse_args(["down", "--orphans", "--provider", "aws", *flags])
        spec = registry.spec_from_args(args)
        assert spec is not None
        return str(registry.backend("aws").settings_of(spec).region)

    assert region() == "eu-west-1"
    assert region("--region", "us-east-2") == "us-east-2"


def test_defaults_of_the_default_provider_apply_without_provider_flag(here: Path) -> None:
    """``local:`` defaults reach a launch that names no provider (the default one); the
    fields command-line clusters set themselves stay Compute's."""
    user_file(here, "local:\n  python: /usr/bin/python3\n  workdir: /somewhere\n")
    local = registry.backend("local")
    values = local.file_values()
    assert values == {"python": "/usr/bin/python3"}  # workdir: the cluster's folder


BAD = [
    ("awz:\n  region: x\n", "config.yaml:1: awz: unknown key (allowed: local, ssh, slurm"),
    ("aws:\n  regoin: x\n", "config.yaml:2: aws.regoin: the aws provider has no such setting"),
    ("aws:\n  ttl: soon\n", "config.yaml:2: aws.ttl: must be a number, got a string ('soon')"),
    ("aws:\n  ttl: -5\n", "config.yaml:2: aws.ttl: AWS(ttl=-5): a positive number of seconds"),
    ("aws:\n  network_tier: fast\n", "aws.network_tier: 'fast' is not allowed (allowed: "),
    ("vast:\n  api_key: k-1\n", "config.yaml:2: vast.api_key: a secret, never kept"),
    ("ssh:\n  hosts: 5\n", "ssh.hosts: must be a list of (a string) or a string, got a number (5)"),
    ("aws: [1, 2]\n", "config.yaml:1: aws: must be a mapping (key: value lines), got a list"),
    ("pools:\n  t:\n    nodes: 2\n", "config.yaml:2: pools.t: a pool needs `provider:`"),
    ("pools:\n  t:\n    provider: gce\n", "pools.t.provider: unknown provider 'gce' (allowed:"),
    ("pools:\n  t:\n    provider: aws\n    gpus: 2\n", "pools.t.gpus: unknown key (allowed:"),
    (
        "pools:\n  t:\n    provider: aws\n    nodes: [3, 1]\n",
        "config.yaml:4: pools.t.nodes: must be a whole number >= 1, or [min, max], got a list",
    ),
    (
        "pools:\n  t:\n    provider: aws\n    settings: {zone: a}\n",
        "pools.t.settings.zone: the aws provider has no such setting",
    ),
    (
        "pools:\n  t:\n    provider: local\n    image: {pipp: [x]}\n",
        "config.yaml:4: pools.t.image.pipp: Image has no such field",
    ),
    ("a: &a [*a]\n", "config.yaml:1: "),  # a cycle: refused by the bounded loader
    ("aws:\n  ttl: 1\n  ttl: 2\n", "config.yaml:3: aws.ttl: given twice"),
    ("- aws\n", "config.yaml: must be a mapping"),
]


@pytest.mark.parametrize(("text", "said"), BAD)
def test_a_bad_key_or_value_names_the_file_line_key_and_what_is_allowed(
    here: Path, text: str, said: str
) -> None:
    path = user_file(here, text)
    with pytest.raises(ConfigurationError) as raised:
        configuration.load()
    assert said in str(raised.value)
    assert str(path) in str(raised.value)
    assert "k-1" not in str(raised.value)


def test_a_tasks_config_names_only_providers(here: Path) -> None:
    """A task's ``config:`` with a key that is no provider (a typo, or ``pools``) is refused
    at its line, as the task file is read."""
    for text, said in (
        ("config:\n  awz:\n    region: x\nrun: x\n", "task.yaml:2: `config.awz`: no such"),
        ("config:\n  pools:\n    t: {}\nrun: x\n", "named pools belong in a configuration"),
    ):
        task = write(here / "project" / "task.yaml", text)
        with pytest.raises(TaskError) as raised:
            load_task(str(task))
        assert said in str(raised.value)
    task = write(here / "project" / "task.yaml", "config:\n  kubernetes: {}\nrun: x\n")
    assert load_task(str(task)).config == {"kubernetes": {}}  # SkyPilot's name of k8s


def test_a_bad_file_stops_launch_before_anything_starts(cli: CLI) -> None:
    (cli.home).mkdir(parents=True, exist_ok=True)
    (cli.cwd / ".flotilla.yaml").write_text("local:\n  pythn: python3\n")
    done = cli("launch", "-c", "c1", "echo hi")
    assert done.returncode == 2, done.stderr
    assert ".flotilla.yaml:2: local.pythn: the local provider has no such setting" in done.stderr
    assert all_names(cli.home) == []


def test_config_show_and_validate(cli: CLI) -> None:
    cli.home.mkdir(parents=True, exist_ok=True)
    (cli.home / "config.yaml").write_text(
        "aws:\n  region: eu-west-1\n  ttl: 900\npools:\n  train:\n    provider: aws\n"
        "    nodes: 4\n    accelerator: A10G:1\n"
    )
    (cli.cwd / ".flotilla.yaml").write_text("aws:\n  ttl: 1200\n")
    shown = cli.ok("config", "show").stdout
    user = str(cli.home / "config.yaml")
    assert f"# {user}: read" in shown
    assert f"  region: eu-west-1  # {user}:2" in shown
    assert f"  ttl: 1200  # {cli.cwd / '.flotilla.yaml'}:2" in shown
    assert f"    nodes: 4  # {user}:7" in shown
    assert f"      region: eu-west-1  # {user}:2" in shown  # the pool's, from the default
    done = cli.ok("config", "validate")
    assert f"{user}: valid" in done.stdout
    bad = cli.cwd / "bad.yaml"
    bad.write_text("pools:\n  p:\n    provider: ssh\n")  # SSH needs hosts
    done = cli("config", "validate", str(bad))
    assert done.returncode == 2
    assert f"{bad}:2: pools.p: SSH(hosts=...) needs at least one host" in done.stderr
    bad.write_text("slurm:\n  workdir: /scratch\n")  # Compute's; the CLI sets its own
    done = cli.ok("config", "validate", str(bad))
    assert "slurm.workdir applies to Compute(...) only" in done.stderr


def test_compute_name_takes_a_named_pool(here: Path) -> None:
    """``Compute(name="train")`` gets its provider, settings, nodes and image from the
    pool; an argument given wins; an unknown name lists the pools there are."""
    workdir = here / "nodes"
    user_file(
        here,
        f"""\
        local:
          workdir: {workdir}
        pools:
          train:
            provider: local
            nodes: 2
            image: {{env: {{WHERE: from-the-pool}}}}
        """,
    )

    @function
    def where() -> tuple[int, str, str]:
        import os

        info = instance_info()
        return info.node, os.environ["WHERE"], os.getcwd()

    with Compute(name="train") as pool:
        assert isinstance(pool.provider, Local)
        seen = sorted(where() @ pool)
    assert [s[:2] for s in seen] == [(0, "from-the-pool"), (1, "from-the-pool")]
    assert all(s[2].startswith(str(workdir)) for s in seen)  # the local: default
    assert Compute(name="train", nodes=3).size.desired == 3
    given = Compute(name="train", image=Image(env={"WHERE": "mine"}))
    assert given.image.env == {"WHERE": "mine"}
    with pytest.raises(ConfigurationError, match=r"no pool named 'eval' .* \(pools there: train\)"):
        Compute(name="eval")


def test_the_files_kinds_are_the_command_lines() -> None:
    assert list(configuration.KINDS) == registry.kinds()
    for kind in configuration.KINDS:
        assert configuration.settings_class(kind) is registry.backend(kind).settings_type
    task = Task(run="x")
    assert task.config == {}
