"""Task files (SkyPilot format): parsing, validation messages, provider checks, job
variables and the sync archive. In-process: no cluster is started here."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from flotilla._errors import ConfigurationError
from flotilla.cli.backends import registry
from flotilla.cli.backends.base import ProviderSpec, check_gpus
from flotilla.cli.backends.local import LocalSpec
from flotilla.cli.backends.ssh import SSHSpec
from flotilla.cli.jobspec import hostfile, phase_env, task_id
from flotilla.cli.node_ops import unpack
from flotilla.cli.sync import build
from flotilla.cli.taskfile import Resources, Task, TaskError, command_task, load_task


def check_task(task: Task, spec: ProviderSpec, cluster_nodes: int) -> list[str]:
    return registry.backend_for(spec).check_task(task, spec, cluster_nodes)


def write(tmp_path: Path, text: str, name: str = "task.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error_of(tmp_path: Path, text: str) -> TaskError:
    with pytest.raises(TaskError) as info:
        load_task(write(tmp_path, text))
    return info.value


# -- a full task -------------------------------------------------------------------------------
def test_every_field_of_a_skypilot_task_is_read(tmp_path: Path) -> None:
    (tmp_path / "project").mkdir()
    (tmp_path / "data.txt").write_text("x")
    path = write(
        tmp_path,
        f"""\
        name: minGPT-ddp
        num_nodes: 2
        resources:
          accelerators: A100:8
          cpus: 8+
          memory: 64+
          infra: aws/us-east-1
          use_spot: true
          network_tier: best
          disk_size: 256
          ports: [8080, "10000-10010"]
          image_id: docker:pytorch/pytorch
        workdir: {tmp_path / "project"}
        file_mounts:
          ~/data.txt: {tmp_path / "data.txt"}
        envs:
          EPOCHS: 3
          DEBUG: false
          NAME: run1
        secrets:
          HF_TOKEN: null
        setup: |
          pip install torch
        run: |
          torchrun train.py
        """,
    )
    task = load_task(path)
    assert task.name == "minGPT-ddp"
    assert task.num_nodes == 2
    assert task.resources == Resources(
        accelerators="A100:8",
        cpus="8+",
        memory="64+",
        infra="aws/us-east-1",
        use_spot=True,
        network_tier="best",
        disk_size=256,
        ports=("8080", "10000-10010"),
        image_id="docker:pytorch/pytorch",
    )
    assert task.resources.gpus_per_node == 8
    assert task.resources.accelerator_name == "A100"
    assert task.workdir == str(tmp_path / "project")
    assert task.file_mounts == {"~/data.txt": str(tmp_path / "data.txt")}
    assert task.envs == {"EPOCHS": "3", "DEBUG": "false", "NAME": "run1"}
    assert task.secrets == {"HF_TOKEN": None}
    assert task.setup == "pip install torch\n"
    assert task.run == "torchrun train.py\n"
    assert task.lines["resources.network_tier"] == 9


def test_defaults_and_other_accepted_shapes(tmp_path: Path) -> None:
    task = load_task(
        write(
            tmp_path,
            """\
            run:
              - echo one
              - echo two
            resources:
              cloud: gcp
              accelerators: {L4: 0.5}
            """,
            name="short.yml",
        )
    )
    assert task.name == "short"  # the file's name
    assert task.num_nodes is None
    assert task.run == "echo one\necho two"
    assert task.resources.infra == "gcp"
    assert task.resources.accelerators == "L4:0.5"
    assert task.resources.gpus_per_node == 1  # a fraction rounds up


# -- errors name the field and its line --------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        ("run: echo\nnum_node: 2\n", 2, "num_node", ["did you mean 'num_nodes'"]),
        ("run: echo\nsetpu: x\n", 2, "setpu", ["did you mean 'setup'"]),
        ("run: echo\nzzz: 1\n", 2, "zzz", ["known fields:", "num_nodes"]),
        (
            "run: echo\nresources:\n  cpu: 4\n",
            3,
            "resources.cpu",
            ["in `resources`", "did you mean 'cpus'"],
        ),
        ("run: echo\nnum_nodes: 2.5\n", 2, "num_nodes", ["whole number", "2.5"]),
        ("run: echo\nnum_nodes: '2'\n", 2, "num_nodes", ["whole number"]),
        ("run: echo\nnum_nodes: true\n", 2, "num_nodes", ["whole number", "boolean"]),
        ("run: echo\nnum_nodes: -3\n", 2, "num_nodes", ["at least 1", "-3"]),
        ("run: echo\nnum_nodes: 0\n", 2, "num_nodes", ["at least 1"]),
        ("run: 5\n", 1, "run", ["must be a string"]),
        ("run: echo\nenvs:\n  A: [1]\n", 3, "envs.A", ["string or a number"]),
        ("run: echo\nenvs:\n  1BAD: x\n", 3, "envs.1BAD", ["environment variable name"]),
        ("run: echo\nresources: big\n", 2, "resources", ["mapping"]),
        ("run: echo\nresources:\n  use_spot: maybe\n", 3, "resources.use_spot", ["true or false"]),
        ("run: echo\nresources:\n  cpus: lots\n", 3, "resources.cpus", ["'4+'"]),
        ("run: echo\nresources:\n  disk_size: -1\n", 3, "resources.disk_size", ["at least 1"]),
        ("run: echo\nresources:\n  network_tier: fast\n", 3, "resources.network_tier", ["best"]),
        ("run: echo\nresources:\n  ports: [http]\n", 3, "resources.ports", ["8080"]),
        ("run: echo\nresources:\n  accelerators: A100:x\n", 3, "resources.accelerators", []),
        ("run: echo\nworkdir: /no/such/folder\n", 2, "workdir", ["not a folder"]),
        ("run: echo\nfile_mounts:\n  /d: /no/such\n", 3, "file_mounts./d", ["does not exist"]),
        ("run: echo\nfile_mounts:\n  /d: gs://bucket\n", 3, "file_mounts./d", ["S3 buckets"]),
        (
            "run: echo\nfile_mounts:\n  /d:\n    source: s3://b\n    mode: RSYNC\n",
            4,
            "file_mounts./d",
            ["MOUNT, COPY, MOUNT_CACHED"],
        ),
        (
            "run: echo\nfile_mounts:\n  /d:\n    name: b\n    persistent: false\n",
            4,
            "file_mounts./d",
            ["never deletes a bucket"],
        ),
        (
            "run: echo\nfile_mounts:\n  /d:\n    name: b\n    store: gcs\n",
            4,
            "file_mounts./d",
            ["store: s3"],
        ),
        ("run: echo\nrun: again\n", 2, "run", ["twice"]),
    ],
)
def test_mistakes_name_the_field_and_line(
    tmp_path: Path, text: str, line: int, field: str, words: list[str]
) -> None:
    err = error_of(tmp_path, text)
    assert (err.line, err.field) == (line, field), str(err)
    assert str(err).startswith(f"{tmp_path / 'task.yaml'}:{line}: ")
    for word in words:
        assert word in str(err)
    assert isinstance(err, ConfigurationError)


def test_files_that_are_not_tasks(tmp_path: Path) -> None:
    assert "empty" in str(error_of(tmp_path, ""))
    assert "nothing to run" in str(error_of(tmp_path, "name: x\n"))
    assert "must be a mapping" in str(error_of(tmp_path, "- a\n- b\n"))
    syntax = error_of(tmp_path, "run: echo\n  - x: [\n")
    assert "invalid YAML" in str(syntax) and syntax.line > 0
    pipeline = error_of(tmp_path, "name: a\nrun: echo a\n---\nname: b\nrun: echo b\n")
    assert "several YAML documents" in str(pipeline) and "pipeline" in str(pipeline)
    assert "invalid YAML" not in str(pipeline) and pipeline.line == 3
    with pytest.raises(TaskError, match="cannot read"):
        load_task(str(tmp_path / "missing.yaml"))


# -- overrides -----------------------------------------------------------------------------------
def test_env_and_secret_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = load_task(
        write(tmp_path, "run: echo\nenvs:\n  A: '1'\n  B: null\nsecrets:\n  TOKEN: null\n")
    )
    with pytest.raises(TaskError, match=r"task\.yaml:4: envs\.B has no value: pass --env B="):
        task.with_overrides({}, {"TOKEN": "x" * 8})
    with pytest.raises(TaskError, match=r"secrets\.TOKEN has no value: pass --secret TOKEN="):
        task.with_overrides({"B": "2"}, {})
    done = task.with_overrides({"B": "2", "C": "3"}, {"TOKEN": "abcdefgh"})
    assert done.envs == {"A": "1", "B": "2", "C": "3"}
    assert done.secrets == {"TOKEN": "abcdefgh"}
    monkeypatch.setenv("TOKEN", "from-here")
    assert task.with_overrides({"B": "x"}, {"TOKEN": None}).secrets == {"TOKEN": "from-here"}
    monkeypatch.delenv("TOKEN")
    with pytest.raises(TaskError, match="TOKEN is not set here"):
        task.with_overrides({"B": "x"}, {"TOKEN": None})
    with pytest.raises(TaskError, match="not a valid environment variable"):
        task.with_overrides({"1X": "x"}, {})


def test_job_nodes_and_command_tasks() -> None:
    assert Task(run="x", num_nodes=2).job_nodes(3) == 2
    assert Task(run="x").job_nodes(3) == 3
    with pytest.raises(TaskError, match="num_nodes is 4 but the cluster has 3"):
        Task(run="x", num_nodes=4).job_nodes(3)
    task = command_task("python train.py --fast", 2)
    assert (task.name, task.num_nodes) == ("python-train.py-fast", 2)
    assert task.run == "python train.py --fast"
    with pytest.raises(TaskError):
        command_task("  ")


# -- what a provider can honour ------------------------------------------------------------------
def test_local_provider_refuses_missing_gpus_and_warns_about_hints(tmp_path: Path) -> None:
    gpu = load_task(write(tmp_path, "run: x\nresources:\n  accelerators: H100:4\n"))
    with pytest.raises(ConfigurationError, match=r"task.yaml:3: resources.accelerators: H100:4"):
        check_task(gpu, LocalSpec(), 2)
    hints = load_task(
        write(
            tmp_path,
            "run: x\nresources:\n  cpus: 100000\n  memory: 100000+\n  infra: aws\n"
            "  ports: 8080\n  network_tier: standard\n",
        )
    )
    warnings = check_task(hints, LocalSpec(), 2)
    assert [w.split(": ")[1] for w in warnings] == [
        "resources.cpus",
        "resources.memory",
        "resources.infra",
    ]
    assert all(w.startswith(f"{tmp_path / 'task.yaml'}:") for w in warnings)
    assert check_task(Task(run="x"), LocalSpec(), 1) == []


def test_ssh_provider_spec_checks() -> None:
    with pytest.raises(ConfigurationError, match="needs hosts"):
        registry.backend("ssh").check_spec(SSHSpec())
    with pytest.raises(ConfigurationError, match="unknown provider 'nomad'"):
        registry.spec_from_dict({"kind": "nomad"})
    spec = SSHSpec(settings=(("hosts", ("root@h1", "root@h2")),))
    assert registry.spec_from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ConfigurationError, match="3 nodes wanted but --hosts lists 2"):
        check_task(Task(run="x"), spec, 3)
    hints = Task(run="x", resources=Resources(cpus="4"))
    assert "cannot act on" in check_task(hints, spec, 2)[0]
    check_gpus(2, [2, 2])
    check_gpus(0, [0, 0])
    with pytest.raises(ConfigurationError, match=r"node\(s\) 1 have 0"):
        check_gpus(2, [2, 0])


# -- job variables -------------------------------------------------------------------------------
def test_run_phase_variables_describe_only_the_jobs_nodes() -> None:
    ips = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    tid = task_id("dev", 7)
    common, per_node = phase_env(
        cluster="dev",
        provider="ssh",
        cluster_ips=ips,
        job_nodes=2,
        job_id=7,
        task=tid,
        gpus_per_node=8,
        master_port=29500,
        setup=False,
    )
    for p in ("FLOTILLA", "SKYPILOT"):
        assert common[f"{p}_NODE_IPS"] == "10.0.0.1\n10.0.0.2"
        assert common[f"{p}_NUM_NODES"] == "2"
        assert common[f"{p}_NUM_GPUS_PER_NODE"] == "8"
        assert common[f"{p}_TASK_ID"] == tid
        assert json.loads(common[f"{p}_CLUSTER_INFO"])["cluster_name"] == "dev"
        assert f"{p}_SETUP_NODE_RANK" not in per_node[0]
    assert (common["MASTER_ADDR"], common["MASTER_PORT"], common["WORLD_SIZE"]) == (
        "10.0.0.1",
        "29500",
        "2",
    )
    assert sorted(per_node) == [0, 1]
    assert per_node[1]["SKYPILOT_NODE_RANK"] == per_node[1]["NODE_RANK"] == "1"
    assert tid.startswith("flotilla-") and tid.endswith("_dev_7")
    assert hostfile(ips[:2], 8) == "10.0.0.1 slots=8\n10.0.0.2 slots=8\n"
    assert hostfile(ips[:1], 0) == "10.0.0.1 slots=1\n"


def test_setup_phase_variables_cover_the_whole_cluster() -> None:
    common, per_node = phase_env(
        cluster="dev",
        provider="local",
        cluster_ips=["a", "b", "c"],
        job_nodes=2,
        job_id=1,
        task="t",
        gpus_per_node=0,
        master_port=1,
        setup=True,
    )
    assert common["SKYPILOT_SETUP_NODE_IPS"] == common["FLOTILLA_SETUP_NODE_IPS"] == "a\nb\nc"
    assert common["SKYPILOT_SETUP_NUM_NODES"] == "3"
    assert per_node[2]["SKYPILOT_SETUP_NODE_RANK"] == per_node[2]["FLOTILLA_NODE_RANK"] == "2"


# -- the sync archive ----------------------------------------------------------------------------
def test_workdir_and_file_mounts_round_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "train.py").write_text("print('hi')\n")
    (project / "pkg" / "mod.py").write_text("X = 1\n")
    (project / ".git").mkdir()
    (project / ".git" / "HEAD").write_text("ref")
    (project / "big.bin").write_text("skip me")
    (project / ".skyignore").write_text("# comment\nbig.bin\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.csv").write_text("1,2\n")
    single = tmp_path / "config.json"
    single.write_text("{}")
    outside = tmp_path / "abs-target"

    archive = build(
        str(project),
        {"~/datasets": str(data), "cfg/config.json": str(single), str(outside): str(data)},
    )
    assert archive is not None and archive.files == 6
    assert build(str(project), {}) is not None
    assert build(None, {}) is None
    again = build(
        str(project),
        {"~/datasets": str(data), "cfg/config.json": str(single), str(outside): str(data)},
    )
    assert again is not None and again.digest == archive.digest

    node = tmp_path / "node"
    node.mkdir()
    monkeypatch.chdir(node)
    unpack.local(archive.data, archive.targets, True)
    assert (node / "train.py").read_text() == "print('hi')\n"
    assert (node / "pkg" / "mod.py").read_text() == "X = 1\n"
    assert not (node / ".git").exists() and not (node / "big.bin").exists()
    assert (node / "datasets" / "a.csv").read_text() == "1,2\n"  # ~ is the node's folder
    assert (node / "cfg" / "config.json").read_text() == "{}"
    assert (outside / "a.csv").read_text() == "1,2\n"
    assert os.listdir(tmp_path / "abs-target") == ["a.csv"]


def test_bucket_file_mounts_become_volumes(tmp_path: Path) -> None:
    """SkyPilot's three forms: a bucket URL (COPY: a read-only copy), ``{source, mode}``
    and a storage entry (``name``, ``store``, ``mode``: MOUNT is writable)."""
    from flotilla import Volume

    path = tmp_path / "task.yaml"
    path.write_text(
        "run: echo\n"
        "file_mounts:\n"
        "  /data: s3://bkt/images\n"
        "  /ckpt:\n"
        "    source: s3://bkt/ckpt\n"
        "    mode: MOUNT\n"
        "  /cached:\n"
        "    source: s3://bkt\n"
        "    mode: MOUNT_CACHED\n"
        "  /store:\n"
        "    name: other\n"
        "    store: s3\n"
        "    mode: COPY\n"
        "    persistent: true\n"
    )
    task = load_task(str(path))
    assert task.file_mounts == {}
    assert task.volumes == (
        Volume("bkt", "/data", prefix="images", mode="copy", read_only=True),
        Volume("bkt", "/ckpt", prefix="ckpt", mode="mount", read_only=False),
        Volume("bkt", "/cached", mode="mount", read_only=False),
        Volume("other", "/store", mode="copy", read_only=True),
    )
