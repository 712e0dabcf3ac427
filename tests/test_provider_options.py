"""A provider option is one field of its settings dataclass (``_providers/options.py``): the
provider's keyword, the ``flotilla launch`` flag, the task file's ``config:`` key and its
``resources`` mapping are derived from it; ``launch --dryrun`` shows the settings it
resolved. In-process, except the --dryrun runs (the CLI as a subprocess; nothing starts)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_cli import CLI
from test_cli import cli as cli  # the fixture

from flotilla._errors import ConfigurationError
from flotilla._providers.aws import AWS
from flotilla._providers.aws.settings import AWSSettings
from flotilla._providers.local import Local
from flotilla._providers.settings import LocalSettings
from flotilla._providers.ssh import SSH
from flotilla._providers.vast.settings import VastSettings
from flotilla.cli.backends import registry
from flotilla.cli.backends.base import ResourceSpec
from flotilla.cli.backends.local import LocalBackend
from flotilla.cli.parser import build_parser
from flotilla.cli.state import all_names
from flotilla.cli.taskfile import Resources, Task, load_task


def launch_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", "task.yaml", *flags])


def task_file(tmp_path: Path, text: str) -> Task:
    path = tmp_path / "task.yaml"
    path.write_text(textwrap.dedent(text))
    return load_task(str(path))


@dataclass(frozen=True)
class MoreLocalSettings(LocalSettings):
    """The local provider's settings with one more field, as a developer adds one.

    Attributes:
        niceness: how nice the nodes' processes are to the others on this machine.
    """

    niceness: int = 0


def test_a_field_added_to_a_settings_class_is_a_keyword_a_flag_and_a_config_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One line in the settings class, nothing else: ``Local(niceness=5)``, ``flotilla
    launch --local-niceness 5`` (with its help and type check) and ``config: {local:
    {niceness: 3}}`` all reach the provider; the flag wins over the task file."""
    monkeypatch.setattr(Local, "settings_type", MoreLocalSettings)  # the class, as edited
    monkeypatch.setattr(LocalBackend, "settings_type", MoreLocalSettings)

    assert Local(niceness=5).settings.niceness == 5  # a keyword of the provider
    assert Local(settings=MoreLocalSettings(niceness=6)).settings.niceness == 6

    helps = build_parser()._subparsers._group_actions[0].choices["launch"].format_help()  # type: ignore[union-attr]
    assert "--local-niceness" in helps and "how nice the nodes' processes are" in helps
    with pytest.raises(SystemExit):  # argparse: an int
        launch_args("--local-niceness", "very")

    backend = registry.backend("local")
    spec = registry.spec_from_args(launch_args("--local-niceness", "5"), Task(run="x"))
    assert spec is not None and spec.kind == "local"  # the flag chose the provider
    assert backend.make_provider(spec, tmp_path).settings.niceness == 5  # type: ignore[attr-defined]

    task = task_file(tmp_path, "config:\n  local:\n    niceness: 3\nrun: x\n")
    spec = registry.spec_from_args(launch_args("--provider", "local"), task)
    assert spec is not None
    assert backend.make_provider(spec, tmp_path).settings.niceness == 3  # type: ignore[attr-defined]
    spec = registry.spec_from_args(launch_args("--local-niceness", "9"), task)
    assert spec is not None
    assert backend.make_provider(spec, tmp_path).settings.niceness == 9  # type: ignore[attr-defined]


def test_a_task_files_config_sets_any_setting_by_name_and_a_flag_wins(tmp_path: Path) -> None:
    task = task_file(
        tmp_path,
        """\
        resources:
          infra: aws
        config:
          aws:
            region: eu-west-1
            ttl: 900
            subnet: subnet-0123456789abcdef0
          ssh:
            hosts: [root@h1, h2:2222]
            user: me
            connect_timeout: 3
        run: x
        """,
    )
    aws = registry.backend("aws")
    spec = registry.spec_from_args(launch_args(), task)
    assert spec is not None and spec.kind == "aws"
    settings = aws.settings_of(spec)
    assert (settings.region, settings.ttl, settings.subnet) == (
        "eu-west-1",
        900.0,
        "subnet-0123456789abcdef0",
    )
    spec = registry.spec_from_args(launch_args("--region", "us-east-1", "--ttl", "1200"), task)
    assert spec is not None
    assert (aws.settings_of(spec).region, aws.settings_of(spec).ttl) == ("us-east-1", 1200.0)

    spec = registry.spec_from_args(launch_args("--provider", "ssh"), task)
    assert spec is not None
    provider = registry.backend_for(spec).make_provider(spec, tmp_path)
    assert isinstance(provider, SSH)
    assert [(h.host, h.user, h.port) for h in provider.hosts] == [
        ("h1", "root", None),
        ("h2", None, 2222),
    ]
    assert (provider.settings.user, provider.settings.connect_timeout) == ("me", 3.0)


def test_a_bad_config_key_or_value_is_refused_naming_the_line(tmp_path: Path) -> None:
    def refused(config: str, *flags: str) -> str:
        task = task_file(tmp_path, f"resources:\n  infra: aws\nconfig:\n{config}run: x\n")
        with pytest.raises(ConfigurationError) as raised:
            registry.spec_from_args(launch_args(*flags), task)
        return str(raised.value)

    said = refused("  aws:\n    regoin: eu-west-1\n")
    assert "task.yaml:5: config.aws.regoin: the aws provider has no such setting" in said
    assert "region" in said  # the ones it has
    said = refused("  aws:\n    allocation: cheap\n")
    assert "allocation" in said and "--allocation" in said  # the provider's check, the flag
    said = refused("  vast:\n    api_key: k-1\n", "--provider", "vast")
    assert "config.vast.api_key: not a task-file setting (a secret" in said
    assert "k-1" not in said
    said = refused("  local:\n    workdir: /x\n", "--provider", "local")
    assert "config.local.workdir: not a task-file setting (the cluster's folder)" in said


def test_one_default_per_option_and_skypilots_use_spot_is_one_mapping_line() -> None:
    """The library's default is the settings field's; a task file reads ``use_spot`` as
    SkyPilot does (unset: on-demand); a flag wins. No backend's spec repeats a setting."""
    assert AWS().settings.allocation == AWSSettings.allocation == "spot-if-available"
    aws = registry.backend("aws")

    def allocation(res: Resources, *flags: str) -> str:
        spec = registry.spec_from_args(
            launch_args("--provider", "aws", *flags), Task("t", resources=res)
        )
        assert spec is not None
        return str(aws.settings_of(spec).allocation)

    assert allocation(Resources()) == "on-demand"
    assert allocation(Resources(use_spot=True)) == "spot"
    assert allocation(Resources(), "--allocation", "spot-if-available") == "spot-if-available"
    own = {f.name for f in dataclasses.fields(ResourceSpec)}
    for b in registry.BACKENDS:
        extra = {f.name for f in dataclasses.fields(b.spec_type)} - own
        assert extra == set(), f"{b.kind}'s spec repeats settings: {extra}"


def test_a_state_file_of_the_previous_format_keeps_its_settings() -> None:
    """A cluster recorded when the options were fields of the spec (a running cluster
    across an upgrade): they become its settings."""
    spec = registry.spec_from_dict(
        {
            "kind": "aws",
            "settings": [["profile", "dev"]],
            "region": "eu-west-1",
            "allocation": "on-demand",
            "ami": None,
            "tags": [["team", "ml"]],
            "poweroff_command": None,
            "accelerator": "A100:1",
        }
    )
    settings = registry.backend_for(spec).settings_of(spec)
    assert (settings.region, settings.allocation, settings.profile) == (
        "eu-west-1",
        "on-demand",
        "dev",
    )
    assert dict(settings.tags) == {"team": "ml"} and settings.poweroff_command[0] == "sudo"
    assert registry.backend_for(spec).pool_resources(spec).accelerator == "A100:1"


def test_secrets_are_never_shown_in_clear() -> None:
    from flotilla._providers.options import shown

    assert shown(VastSettings(api_key="k-123"))["api_key"] == "***"
    assert shown(VastSettings())["api_key"] is None
    assert "k-123" not in repr(VastSettings(api_key="k-123"))

    @dataclass(frozen=True)
    class Unmarked:  # a provider from another package that marked nothing
        hf_token: str | None = None
        region: str = "r1"

    assert shown(Unmarked(hf_token="hf-1")) == {"hf_token": "***", "region": "r1"}


PROVIDERS = ["Local", "SSH", "AWS", "Slurm", "Kubernetes", "Container", "VastAI", "RunPod"]
PROVIDERS += ["LambdaCloud", "GCP", "Verda"]


@pytest.mark.parametrize("name", PROVIDERS)
def test_a_providers_constructor_and_repr_are_derived_from_its_settings(name: str) -> None:
    """Every built-in provider's constructor is its settings class's fields (and
    ``settings=``); a keyword that is no field is a ConfigurationError naming it and the
    fields there are, before anything is made; the ``repr`` shows the fields given that
    differ from their defaults, never a secret."""
    import inspect

    import flotilla as sky

    provider = getattr(sky, name)
    known = [f.name for f in dataclasses.fields(provider.settings_type)]
    assert list(inspect.signature(provider).parameters) == [*known, "settings"]
    with pytest.raises(ConfigurationError) as info:
        provider(bogus=1)
    assert str(info.value) == (
        f"{name}() got an unexpected keyword argument 'bogus' (its settings: {', '.join(known)})"
    )
    with pytest.raises(ConfigurationError, match=rf"{name}\(settings=\.\.\.\) must be a"):
        provider(settings=LocalSettings() if name != "Local" else AWSSettings())


def test_a_providers_repr_shows_the_settings_given_never_a_secret() -> None:
    import flotilla as sky

    assert repr(sky.Local()) == "Local()"
    assert repr(sky.Kubernetes(namespace="ml")) == "Kubernetes(namespace='ml')"
    assert repr(sky.RunPod(api_key="k-123", ttl=900)) == "RunPod(ttl=900.0)"
    assert repr(sky.Verda(client_id="c", client_secret="s-1")) == "Verda()"
    made = sky.AWS(settings=AWSSettings(region="eu-west-1"), allocation="spot")
    assert repr(made) == "AWS(region='eu-west-1', allocation='spot')"


# -- launch --dryrun ---------------------------------------------------------------------------
TASK = """\
num_nodes: 2
resources:
  infra: aws/eu-west-1
  accelerators: A100:1
  use_spot: true
config:
  aws:
    ttl: 900
run: echo hi
"""


def test_dryrun_prints_the_provider_every_setting_and_the_resources(cli: CLI) -> None:
    task = cli.task("job.yaml", TASK)
    done = cli.ok("launch", task, "-c", "dry", "--dryrun", "--json", "--aws-user", "admin")
    plan = json.loads(done.stdout)
    assert (plan["cluster"], plan["nodes"], plan["job_nodes"]) == ("dry", 2, 2)
    assert (plan["provider"], plan["where"]) == ("aws", "aws eu-west-1")
    assert set(plan["settings"]) == {f.name for f in dataclasses.fields(AWSSettings)}
    settings = plan["settings"]
    assert (settings["region"], settings["allocation"], settings["ttl"]) == (
        "eu-west-1",
        "spot",
        900.0,
    )
    assert (settings["ssh_user"], settings["instance_type"]) == ("admin", None)
    assert plan["per_node"]["accelerator"] == "A100:1"
    assert all_names(cli.home) == []  # no cluster, no daemon: nothing started

    text = cli.ok("launch", task, "-c", "dry", "--dryrun").stdout
    assert "provider: aws (aws eu-west-1)" in text
    assert "  allocation: 'spot'" in text and "A100:1" in text
    assert "nothing was started" in text
    assert all_names(cli.home) == []


def test_dryrun_of_a_tasks_candidates_shows_each_one(cli: CLI) -> None:
    task = cli.task(
        "any.yaml",
        """\
        resources:
          any_of:
            - {infra: vast, accelerators: A100:1}
            - {infra: aws/us-east-1, image_id: ami-0123456789abcdef0}
        run: echo hi
        """,
    )
    plan = json.loads(cli.ok("launch", task, "--dryrun", "--json").stdout)
    assert plan["provider"] == "fallback"
    first, second = plan["candidates"]
    assert (first["provider"], first["per_node"]["accelerator"]) == ("vast", "A100:1")
    assert first["settings"]["api_key"] is None  # the key is found when used, never shown
    assert (second["provider"], second["settings"]["ami"]) == ("aws", "ami-0123456789abcdef0")
    assert all_names(cli.home) == []
