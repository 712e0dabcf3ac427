"""Built-in plugins (``flotilla.plugins``): image transforms, version semantics, and real
distributed runs on the local provider (torch DDP/FSDP over gloo, jax.distributed, Keras).

Framework tests skip when the framework is not installed. Pools whose plugins would make
the nodes install a framework the client lacks (tensorflow, transformers) use
:class:`AroundProcessOnly`, which runs a plugin's node-side hook without its transform.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from _procs import wait_until

import flotilla as sky
import flotilla.plugins as plugins
from flotilla._info import InstanceInfo, Peer
from flotilla.plugins import _versions
from flotilla.plugins._extend import extend, merge_requirements, package_name
from flotilla.plugins._jax import coordinator_address, jax_env, local_device_ids
from flotilla.plugins._net import interface_for, parse_ip_addr, wait_listening
from flotilla.plugins._tensorflow import tf_config
from flotilla.plugins._torch import rank_env, socket_ifname_env, threads_env

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@dataclass(frozen=True)
class StandInImage:
    """The fields of ``flotilla.Image`` that plugins touch."""

    python: str | None = None
    pip: tuple[str, ...] = ()
    pip_indexes: tuple[str, ...] = ()
    apt: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    includes: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()


class AroundProcessOnly:
    """A plugin's node-side hook without its transform (so nothing gets installed)."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.name = plugin.name
        self.requires_cluster = plugin.requires_cluster

    def around_process(self, info: InstanceInfo) -> Any:
        return self.plugin.around_process(info)


def spec(nodes: int = 2, accelerator: Any = None, cluster: bool = True) -> sky.PoolSpec:
    acc = sky.Accelerator(accelerator) if isinstance(accelerator, str) else accelerator
    return sky.PoolSpec("test", nodes, acc, None, (), sky.Options(cluster=cluster))


def info(
    node: int = 0,
    total: int = 2,
    head: str = "10.0.0.1",
    port: int = 29500,
    local_rank: int = 0,
    procs: int = 1,
    accelerators: int = 0,
) -> InstanceInfo:
    peers = tuple(Peer(k, f"10.0.0.{k + 1}", f"n{k}") for k in range(total))
    return InstanceInfo(
        node=node,
        total_nodes=total,
        is_head=node == 0,
        head_addr=head,
        head_port=port,
        accelerators=accelerators,
        peers=peers,
        pool_id="p1",
        addr=peers[node].addr,
        local_rank=local_rank,
        procs_per_node=procs,
    )


class TwoPerNode(sky.Plugin):
    """Two processes per node, as ``plugins.torch(procs_per_node=2)`` asks."""

    procs_per_node = 2


def test_exports_and_pickling() -> None:
    assert plugins.__all__ == [
        "accelerate",
        "cuml",
        "dask",
        "huggingface",
        "jax",
        "joblib",
        "keras",
        "mig",
        "mps",
        "ray",
        "sklearn",
        "tensorflow",
        "torch",
    ]
    made = [
        plugins.torch(vision="latest"),
        plugins.jax(),
        plugins.keras(),
        plugins.huggingface(token="hf_x"),
        plugins.tensorflow(),
        plugins.accelerate(config={"mixed_precision": "bf16"}),
        plugins.joblib(),
        plugins.sklearn(),
        plugins.mig("1g.10gb"),
        plugins.mps(50),
        plugins.cuml(),
        plugins.ray(object_store_memory=100 * 1024 * 1024, resources={"disk": 1}),
        plugins.dask(threads=2),
    ]
    for p in made:
        assert isinstance(p, sky.Plugin)
        assert pickle.loads(pickle.dumps(p)) == p  # plugins travel to the nodes pickled
    assert [p.name for p in made] == [
        "torch",
        "jax",
        "keras",
        "huggingface",
        "tensorflow",
        "accelerate",
        "joblib",
        "joblib",
        "mig",
        "mps",
        "cuml",
        "ray",
        "dask",
    ]
    requires_cluster = [True, False, False, False, True, True, False, False, False, False, False]
    requires_cluster += [True, True]
    assert [p.requires_cluster for p in made] == requires_cluster
    assert repr(plugins.torch()).startswith("TorchPlugin(backend=None, cuda='cu128'")


# -- versions ---------------------------------------------------------------------------

VALID = [
    ("latest", "torch"),
    ("2.3.0", "torch==2.3.0"),
    ("2.3", "torch==2.3"),
    ("2.3.*", "torch==2.3.*"),
    ("2.4.0rc1", "torch==2.4.0rc1"),
    ("2.3.0+cu121", "torch==2.3.0+cu121"),
    (">=2.3", "torch>=2.3"),
    ("~=2.4", "torch~=2.4"),
    ("<2.5", "torch<2.5"),
    ("==2.3.1", "torch==2.3.1"),
    ("!=2.4.0", "torch!=2.4.0"),
    (">=2.3,<2.5", "torch>=2.3,<2.5"),
    (">= 2.3, < 2.5", "torch>=2.3,<2.5"),
]
INVALID = [
    "",
    "  ",
    "newest",
    "v2.3",
    ">=",
    "=>2.3",
    "2.3.0.x!",
    ">=2.3,",
    "~=2",
    "2..3",
    "=2.3",
    ">=2.3;python_version>'3'",
    "[cpu]",
]


@pytest.mark.parametrize(("version", "req"), VALID)
def test_version_forms(version: str, req: str) -> None:
    assert _versions.requirement("torch", version) == req
    assert plugins.torch(version=version).requirements() == [req]


@pytest.mark.parametrize("version", INVALID)
def test_invalid_version_is_a_value_error_at_creation(version: str) -> None:
    with pytest.raises(ValueError, match="version"):
        plugins.torch(version=version)
    with pytest.raises(ValueError, match="torchvision"):
        plugins.torch(vision=version)
    with pytest.raises(ValueError, match="torchaudio"):
        plugins.torch(audio=version)


def test_other_invalid_arguments() -> None:
    with pytest.raises(TypeError):
        plugins.torch(version=2.3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend"):
        plugins.torch(backend="nccl2")
    with pytest.raises(ValueError, match="cuda"):
        plugins.torch(cuda="cu 128")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="procs_per_node"):
            plugins.torch(procs_per_node=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keras backend"):
        plugins.keras(backend="theano")
    with pytest.raises(ValueError, match="token"):
        plugins.huggingface(token="")


# -- transforms -------------------------------------------------------------------------


def test_torch_transform_cpu_pool_uses_cpu_index() -> None:
    out = plugins.torch().transform(StandInImage(), spec())
    assert out == StandInImage(pip=("torch",), pip_indexes=(CPU_INDEX,))


def test_torch_transform_cuda_accelerator_uses_cuda_index() -> None:
    cuda_spec = spec(accelerator=sky.accelerators.A100())
    out = plugins.torch(vision="latest", audio="2.3.0").transform(StandInImage(), cuda_spec)
    assert out.pip == ("torch", "torchvision", "torchaudio==2.3.0")
    assert out.pip_indexes == ("https://download.pytorch.org/whl/cu128",)
    out = plugins.torch(cuda="cu124").transform(StandInImage(), cuda_spec)
    assert out.pip_indexes == ("https://download.pytorch.org/whl/cu124",)


def test_torchs_wheel_index_serves_torch_packages_only() -> None:
    image = sky.Image(pip=["requests"])
    out = plugins.torch(vision="latest").transform(image, spec())
    assert out.pip == ("requests", "torch", "torchvision")
    assert out.pip_index_packages == {CPU_INDEX: ("torch", "torchvision")}
    assert out.build_spec(b"")["pip_index_packages"] == {CPU_INDEX: ["torch", "torchvision"]}


def test_torch_transform_non_cuda_accelerator_uses_cpu_index() -> None:
    out = plugins.torch().transform(StandInImage(), spec(accelerator=sky.accelerators.MI300X()))
    assert out.pip_indexes == (CPU_INDEX,)


def test_transform_keeps_what_the_image_has_without_duplicates() -> None:
    image = StandInImage(
        pip=("numpy", "torchvision==0.18.0", "torch"),
        pip_indexes=(CPU_INDEX + "/", "https://example.invalid/simple"),
        env={"A": "1"},
    )
    out = plugins.torch(version="2.3.0", vision="latest").transform(image, spec())
    # the bare "torch" is refined by the pin; the image's pinned torchvision wins
    assert out.pip == ("numpy", "torchvision==0.18.0", "torch==2.3.0")
    assert out.pip_indexes == image.pip_indexes
    assert out.env == {"A": "1"}
    assert image.pip == ("numpy", "torchvision==0.18.0", "torch")  # not mutated
    again = plugins.torch(version="2.3.0", vision="latest").transform(out, spec())
    assert again == out


def test_merge_requirements_by_normalised_name() -> None:
    assert package_name("Torch_Vision[extra]>=1 ; python_version>'3'") == "torch-vision"
    assert merge_requirements(["jax[cuda12]"], ["jax"]) == ("jax[cuda12]",)
    assert merge_requirements(["Jax"], ["jax[cuda12]"]) == ("jax[cuda12]",)
    assert merge_requirements([], ["a", "b", "a"]) == ("a", "b")


def test_other_plugins_transforms() -> None:
    cuda = spec(accelerator="H100")
    assert plugins.jax().transform(StandInImage(), spec()).pip == ("jax",)
    assert plugins.jax().transform(StandInImage(), cuda).pip == ("jax[cuda12]",)
    assert plugins.keras().transform(StandInImage(), spec()).pip == ("keras",)
    assert plugins.huggingface().transform(StandInImage(pip=("torch",)), spec()).pip == (
        "torch",
        "transformers",
        "datasets",
        "tokenizers",
        "accelerate",  # what Trainer needs; torch is listed once
    )
    assert plugins.tensorflow().transform(StandInImage(), spec()).pip == ("tensorflow",)
    assert plugins.tensorflow().transform(StandInImage(), cuda).pip == ("tensorflow[and-cuda]",)


def test_transforms_chain_in_plugin_order() -> None:
    image: Any = StandInImage()
    for p in (plugins.torch(), plugins.huggingface(token="hf_x"), plugins.torch()):
        image = p.transform(image, spec())
    assert image.pip == ("torch", "transformers", "datasets", "tokenizers", "accelerate")
    assert image.pip_indexes == (CPU_INDEX,)


def test_transform_of_no_image() -> None:
    out = plugins.torch().transform(None, spec())
    image_cls = getattr(sky, "Image", None) if "Image" in sky.__all__ else None
    if image_cls is None:
        assert out is None
    else:
        assert isinstance(out, image_cls)
        assert out.pip == ("torch",)
        assert out.pip_indexes == (CPU_INDEX,)


def test_transform_of_a_real_image() -> None:
    if "Image" not in sky.__all__:
        pytest.skip("this flotilla has no Image yet")
    image = sky.Image(pip=["numpy"], env={"X": "1"})
    out = plugins.torch(vision="0.18.0").transform(image, spec())
    assert out.pip == ("numpy", "torch", "torchvision==0.18.0")
    assert out.pip_indexes == (CPU_INDEX,)
    assert dict(out.env) == {"X": "1"}


def test_extend_refuses_what_is_not_an_image() -> None:
    with pytest.raises(TypeError, match="Image"):
        extend({"pip": []}, pip=["x"])
    assert extend(StandInImage(), env={"A": "1"}).env == {"A": "1"}
    assert extend(StandInImage(env={"A": "0"}), env={"A": "1", "B": "2"}).env == {
        "A": "0",
        "B": "2",
    }


# -- cluster mode -----------------------------------------------------------------------


def test_standalone_pool_refuses_torch_and_tensorflow() -> None:
    for plugin in (plugins.torch(), plugins.tensorflow()):
        with pytest.raises(sky.ConfigurationError, match="cluster"):
            sky.Compute(nodes=2, plugins=[plugin], options=sky.Options(cluster=False))


def test_jax_and_keras_refuse_a_multi_node_standalone_pool_before_start() -> None:
    for plugin in (plugins.jax(), plugins.keras()):
        with pytest.raises(sky.ConfigurationError, match="cluster"):
            plugin.transform(None, spec(nodes=2, cluster=False))
        plugin.transform(None, spec(nodes=1, cluster=False))  # one node: fine
        pool = sky.Compute(nodes=2, plugins=[plugin], options=sky.Options(cluster=False))
        with pytest.raises(sky.ConfigurationError, match="cluster"):
            pool.open()
        assert pool.state is sky.PoolState.CLOSED or pool.state is sky.PoolState.NEW
    plugins.keras(backend="torch").transform(None, spec(nodes=2, cluster=False))


def test_torch_procs_per_node_sets_the_pools_processes() -> None:
    assert sky.Compute(nodes=2, plugins=[plugins.torch(procs_per_node=3)]).procs_per_node == 3
    # by default one rank per accelerator of the node (torchrun's --nproc_per_node=gpu)
    assert sky.Compute(nodes=2, plugins=[plugins.torch()]).procs_per_node == 1
    per_gpu = sky.Compute(nodes=2, accelerator="A100:4", plugins=[plugins.torch()])
    assert per_gpu.procs_per_node == 4
    asked = sky.Compute(nodes=2, accelerator="A100:4", plugins=[plugins.torch(procs_per_node=1)])
    assert asked.procs_per_node == 1


class RecordsCollector(sky.Plugin):
    """Records, in the executor's environment, whether the collector ran during its hook."""

    @contextlib.contextmanager
    def _record(self) -> Iterator[None]:
        os.environ["HOOK_SAW_GC"] = str(gc.isenabled())
        yield

    def around_process(self, info: InstanceInfo) -> Any:
        return self._record()


@sky.function
def collector_state() -> tuple[str, bool, int]:
    return os.environ["HOOK_SAW_GC"], gc.isenabled(), gc.get_freeze_count()


def test_hooks_run_with_the_collector_paused_and_tasks_with_it_running() -> None:
    with sky.Compute(nodes=2, plugins=[RecordsCollector()]) as pool:
        states = collector_state() @ pool
    for hook_saw, task_sees, frozen in states:
        assert hook_saw == "False"  # the frameworks' imports run without collections
        assert task_sees is True  # the user's code runs with the collector on
        assert frozen > 0  # what the hooks made is frozen, not walked by each collection


class Preloads(sky.Plugin):
    """Names a module for each agent to import before it forks its executors; its hook
    records whether the executor had the module before anything of the pool's ran."""

    preload = ("_preload_probe",)

    @contextlib.contextmanager
    def _record(self) -> Iterator[None]:
        os.environ["HOOK_SAW_PRELOADED"] = str("_preload_probe" in sys.modules)
        yield

    def around_process(self, info: InstanceInfo) -> Any:
        return self._record()


@sky.function
def preloaded() -> tuple[str, int, int, str | None, str | None]:
    import _preload_probe

    return (
        os.environ["HOOK_SAW_PRELOADED"],
        _preload_probe.PID,
        os.getppid(),
        _preload_probe.ENV,
        os.environ.get("PRELOAD_PROBE"),
    )


def test_a_plugins_preload_is_imported_once_by_the_agent_as_its_executors_would() -> None:
    image = sky.Image(env={"PRELOAD_PROBE": "the pool's"})
    with sky.Compute(nodes=2, image=image, plugins=[Preloads()]) as pool:
        results = preloaded() @ pool
    assert len(results) == 2
    for hook_saw, imported_by, agent, env_then, env_now in results:
        assert hook_saw == "True"  # the executor began with it
        assert imported_by == agent != os.getpid()  # its agent imported it, then forked
        assert env_then == env_now == "the pool's"  # in the executor's environment


class PreloadsSlowly(sky.Plugin):
    preload = ("_preload_slow",)  # an import of 5 s


@sky.function
def preloaded_slowly() -> bool:
    import _preload_slow

    return os.getppid() == _preload_slow.PID


def test_an_agent_goes_on_beating_while_it_preloads() -> None:
    """The agent imports a plugin's ``preload`` beside its loop: an import that lasts longer
    than the pool's heartbeat timeout does not lose the node."""
    options = sky.Options(heartbeat_timeout=2)
    with sky.Compute(nodes=1, plugins=[PreloadsSlowly()], options=options) as pool:
        assert preloaded_slowly() @ pool == [True]


class PreloadsPartly(sky.Plugin):
    preload = ("_preload_partial",)  # fails in the agent, one submodule imported whole


@sky.function
def imported_whole() -> bool:
    import _preload_partial

    return _preload_partial.done.PACKAGE is _preload_partial


def test_a_preload_that_fails_leaves_the_executors_nothing_half_imported() -> None:
    """A preload whose import fails in the agent after a submodule was imported whole (as
    ``torch._dynamo``'s did once, leaving its executor a circular-import error): what it
    added is dropped, each executor imports the package whole itself, and the agent says
    what failed (in its stderr, which explains a lost node)."""
    said = "could not preload _preload_partial: ImportError: a failure of the agent's preload"
    with sky.Compute(nodes=1, plugins=[PreloadsPartly()]) as pool:
        assert imported_whole() @ pool == [True]
        node = pool._nodes[0]
        assert wait_until(lambda: any(said in line for line in node.stderr_tail), 60)


class PreloadsAString(sky.Plugin):
    preload = "torch"  # type: ignore[assignment]  # a string, not a tuple of names


class PreloadsNoName(sky.Plugin):
    preload = ("torch", "not a name")


def test_a_preload_that_names_no_modules_is_refused_before_anything_starts() -> None:
    with pytest.raises(sky.ConfigurationError, match=r"preload must be a tuple of module names"):
        sky.Compute(nodes=1, plugins=[PreloadsAString()])
    with pytest.raises(sky.ConfigurationError, match=r"got \('torch', 'not a name'\)"):
        sky.Compute(nodes=1, plugins=[PreloadsNoName()])


# -- node-side environment (pure) -----------------------------------------------------


def test_rank_env_one_process_per_node() -> None:
    assert rank_env(info(node=2, total=4)) == {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "WORLD_SIZE": "4",
        "RANK": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "NODE_RANK": "2",
    }


def test_rank_env_several_processes_per_node() -> None:
    envs = [rank_env(info(node=n, total=3), local, 4) for n in range(3) for local in range(4)]
    assert [int(e["RANK"]) for e in envs] == list(range(12))
    assert {e["WORLD_SIZE"] for e in envs} == {"12"}
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}
    e = rank_env(info(node=1, total=3), 2, 4)
    assert (e["RANK"], e["LOCAL_RANK"], e["NODE_RANK"]) == ("6", "2", "1")
    with pytest.raises(ValueError, match="local_rank"):
        rank_env(info(), 4, 4)
    with pytest.raises(ValueError, match="procs_per_node"):
        rank_env(info(), 0, 0)


def test_one_thread_per_rank_when_ranks_share_a_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_env(info(node=1)) == {}  # one rank on each machine: all its cores
    assert threads_env(info(node=1, procs=2)) == {"OMP_NUM_THREADS": "1"}
    shared = dataclasses.replace(
        info(node=1), addr="127.0.0.1", peers=(Peer(0, "127.0.0.1"), Peer(1, "127.0.0.1"))
    )
    assert threads_env(shared) == {"OMP_NUM_THREADS": "1"}  # two local nodes
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_env(shared) == {}  # the user's choice stands


def test_single_rank_gets_no_setup() -> None:
    one = info(node=0, total=1)
    assert plugins.torch().around_process(one) is None
    assert plugins.jax().around_process(one) is None
    assert plugins.tensorflow().around_process(one) is None
    two_local = info(node=0, total=1, local_rank=1, procs=2)  # one node, two processes
    assert plugins.torch().around_process(two_local) is not None
    assert plugins.jax().around_process(two_local) is not None
    assert plugins.tensorflow().around_process(two_local) is not None


def test_jax_env_uses_the_port_after_torchs() -> None:
    assert jax_env(info(node=1, total=3)) == {
        "JAX_COORDINATOR_ADDRESS": "10.0.0.1:29501",
        "JAX_NUM_PROCESSES": "3",
        "JAX_PROCESS_ID": "1",
        "JAX_LOCAL_DEVICE_COUNT": "1",
    }
    assert coordinator_address(info(head="fd00::1")) == "[fd00::1]:29501"


def test_the_head_port_starts_a_block_of_free_ports() -> None:
    from flotilla._node.agent import PORT_BLOCK, _bindable, _ephemeral_start, free_port_block

    base = free_port_block(PORT_BLOCK)
    assert [p for p in range(base, base + PORT_BLOCK) if not _bindable(p)] == []
    # below the ephemeral ports: no socket bound to port 0 on the node can take one of them
    assert base + PORT_BLOCK <= _ephemeral_start()
    with sky.Compute(nodes=2) as pool:
        head_port = sky.function(lambda: sky.instance_info().head_port)() >> pool
    assert [p for p in range(head_port, head_port + PORT_BLOCK) if not _bindable(p)] == []
    assert head_port + PORT_BLOCK <= _ephemeral_start()


def test_jax_env_with_several_processes_per_node() -> None:
    env = jax_env(info(node=1, total=3, local_rank=1, procs=2))
    assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("6", "3")
    assert env["JAX_LOCAL_DEVICE_COUNT"] == "1"
    gpus = [local_device_ids(info(local_rank=r, procs=4, accelerators=8)) for r in range(4)]
    assert gpus == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert jax_env(info(local_rank=3, procs=4, accelerators=8))["JAX_LOCAL_DEVICE_COUNT"] == "2"
    assert local_device_ids(info(local_rank=1, procs=2, accelerators=1)) == [0]
    assert local_device_ids(info(procs=1, accelerators=8)) is None  # all of them
    assert local_device_ids(info(local_rank=1, procs=2)) is None  # CPU
    assert jax_env(info(accelerators=8))["JAX_LOCAL_DEVICE_COUNT"] == "8"


def test_tf_config_content() -> None:
    assert tf_config(info(node=1, total=3)) == {
        "cluster": {"worker": ["10.0.0.1:29502", "10.0.0.2:29503", "10.0.0.3:29504"]},
        "task": {"type": "worker", "index": 1},
    }
    assert tf_config(info(node=1, total=2, local_rank=1, procs=2)) == {
        "cluster": {
            "worker": ["10.0.0.1:29502", "10.0.0.1:29503", "10.0.0.2:29504", "10.0.0.2:29505"]
        },
        "task": {"type": "worker", "index": 3},
    }


def test_around_process_restores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", "before")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    cm = plugins.tensorflow().around_process(info(node=0, total=2))
    assert cm is not None
    with cm:
        assert json.loads(os.environ["TF_CONFIG"])["task"] == {"type": "worker", "index": 0}
    assert os.environ["TF_CONFIG"] == "before"
    hf = plugins.huggingface(token="hf_abc").around_process(info())
    assert hf is not None
    with hf:
        assert os.environ["HF_TOKEN"] == "hf_abc"
    assert "HF_TOKEN" not in os.environ
    assert plugins.huggingface().around_process(info()) is None


def test_keras_sets_its_backend_on_a_single_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.delitem(sys.modules, "keras", raising=False)
    with plugins.keras(backend="torch").around_process(info(total=1)):
        assert os.environ["KERAS_BACKEND"] == "torch"
    assert "KERAS_BACKEND" not in os.environ


# -- network interface ------------------------------------------------------------------

IP_ADDR_OUTPUT = """\
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever
4: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\\       valid_lft forever
4: eth0    inet 192.0.2.9/24 scope global secondary eth0\\       valid_lft forever
5: ib0@if7    inet6 fd00::2/64 scope global \\       valid_lft forever preferred_lft forever
"""


def test_parse_ip_addr() -> None:
    import ipaddress

    def find(addr: str) -> str | None:
        return parse_ip_addr(IP_ADDR_OUTPUT, ipaddress.ip_address(addr))

    assert find("127.0.0.1") == "lo"
    assert find("192.0.2.9") == "eth0"
    assert find("fd00::2") == "ib0"
    assert find("192.0.2.3") is None


def test_interface_for_this_machine() -> None:
    assert interface_for("127.0.0.1") == "lo"
    assert interface_for("localhost") == "lo"
    assert interface_for("198.51.100.77") is None  # TEST-NET-2: on no interface here
    assert interface_for("no-such-host.invalid") is None


def test_socket_ifname_env_keeps_the_users_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert socket_ifname_env("127.0.0.1") == {
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
    }
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert socket_ifname_env("127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo"}
    assert socket_ifname_env("198.51.100.77") == {}


def test_wait_listening_sees_a_listener_and_gives_up_on_a_closed_port() -> None:
    with socket.socket() as listener, socket.socket() as closed:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        assert wait_listening("127.0.0.1", listener.getsockname()[1], timeout=5)
        assert not wait_listening("127.0.0.1", closed.getsockname()[1], timeout=0.05)


@pytest.fixture
def netns() -> Iterator[str]:
    """A network namespace with interface fl0 carrying 10.213.7.2 and (secondary) .9."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    name = f"fltest-{uuid.uuid4().hex[:8]}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    try:
        ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace: {e.stderr.decode().strip()}")
    try:
        ip("-n", name, "link", "add", "fl0", "type", "veth", "peer", "name", "fl1")
        ip("-n", name, "addr", "add", "10.213.7.2/24", "dev", "fl0")
        ip("-n", name, "addr", "add", "10.213.7.9/24", "dev", "fl0")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def test_interface_for_in_a_network_namespace(netns: str) -> None:
    code = (
        "from flotilla.plugins._net import interface_for as f;"
        "print(f('10.213.7.2'), f('10.213.7.9'), f('127.0.0.1'), f('10.213.7.3'))"
    )
    out = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    ).stdout.split()
    assert out == ["fl0", "fl0", "lo", "None"]


# -- secrets ----------------------------------------------------------------------------

TOKEN = "hf_Sup3rS3cretT0kenValue"


def test_huggingface_repr_hides_the_token() -> None:
    p = plugins.huggingface(token=TOKEN)
    for text in (repr(p), str(p), f"{p}", repr([p]), repr(AroundProcessOnly(p).__dict__)):
        assert TOKEN not in text
    assert "***" in repr(p)
    assert repr(plugins.huggingface()) == "plugins.huggingface(token=None)"
    assert pickle.loads(pickle.dumps(p)).token == TOKEN
    assert dataclasses.replace(p).token == TOKEN


@sky.function
def hf_env(plugin: Any) -> bool:
    print(f"plugin: {plugin!r}")
    print(f"environment: {sorted(os.environ)}")
    return os.environ.get("HF_TOKEN") == TOKEN


def test_huggingface_token_reaches_the_nodes_and_no_output(
    capfd: pytest.CaptureFixture[str],
) -> None:
    plugin = plugins.huggingface(token=TOKEN)
    with sky.Compute(nodes=2, plugins=[AroundProcessOnly(plugin)]) as pool:
        assert hf_env(plugin) @ pool == [True, True]
    out, err = capfd.readouterr()
    assert "plugin: plugins.huggingface(token=***)" in out
    assert "HF_TOKEN" in out
    assert TOKEN not in out + err


# -- TensorFlow -------------------------------------------------------------------------


@sky.function
def read_tf_config() -> tuple[sky.InstanceInfo, Any]:
    return sky.instance_info(), json.loads(os.environ["TF_CONFIG"])


@pytest.mark.parametrize("procs", [1, 2])
def test_tf_config_on_each_node(procs: int) -> None:
    chosen: list[Any] = [AroundProcessOnly(plugins.tensorflow())]
    if procs == 2:
        chosen.append(TwoPerNode())
    with sky.Compute(nodes=3, plugins=chosen) as pool:
        results = read_tf_config() @ pool
    assert len(results) == 3 * procs
    first = results[0][0]
    workers = [
        f"{p.addr}:{first.head_port + 2 + p.node * procs + local}"
        for p in first.peers
        for local in range(procs)
    ]
    assert len(set(workers)) == 3 * procs
    for rank, (node_info, config) in enumerate(results):
        assert node_info.node * procs + node_info.local_rank == rank
        assert config == {
            "cluster": {"worker": workers},
            "task": {"type": "worker", "index": rank},
        }


# -- PyTorch ----------------------------------------------------------------------------


@sky.function
def ddp_train(x_full: Any, y_full: Any, mode: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    rank = dist.get_rank()
    torch.manual_seed(rank)  # different on every node: DDP must broadcast rank 0's weights
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    initial = [p.detach().clone() for p in model.parameters()]
    if mode == "sampler":
        dataset = TensorDataset(x_full, y_full)
        sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=rank)
        loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    else:
        x, y = sky.shard(x_full, y_full)
        sampler = None
        loader = DataLoader(TensorDataset(x, y), batch_size=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = 0
    for epoch in range(3):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for bx, by in loader:
            loss = nn.functional.mse_loss(model(bx), by)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(bx)
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "seen": seen,
        "initial": initial,
        "final": [p.detach().clone() for p in model.parameters()],
        "env": {k: os.environ[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")},
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "threads": torch.get_num_threads(),
    }


@pytest.fixture(scope="module")
def torch_pool4() -> Iterator[sky.Compute]:
    pytest.importorskip("torch")
    with sky.Compute(nodes=4, plugins=[plugins.torch()]) as pool:
        yield pool


@pytest.mark.parametrize("mode", ["sampler", "shard"])
def test_ddp_on_four_nodes(torch_pool4: sky.Compute, mode: str) -> None:
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    results = ddp_train(x, y, mode) @ torch_pool4
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert {(r["world"], r["backend"], r["ifname"]) for r in results} == {(4, "gloo", "lo")}
    assert [r["env"]["NODE_RANK"] for r in results] == ["0", "1", "2", "3"]
    assert {(r["env"]["LOCAL_RANK"], r["env"]["LOCAL_WORLD_SIZE"]) for r in results} == {("0", "1")}
    assert [r["seen"] for r in results] == [3 * 64] * 4  # each node trained on its quarter
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))  # the user's, else one per rank
    assert [r["threads"] for r in results] == [threads] * 4
    first = results[0]
    for r in results:
        for a, b in zip(r["initial"], first["initial"], strict=True):
            assert torch.equal(a, b)  # DDP synchronised the initial weights
        for a, b in zip(r["final"], first["final"], strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-6)  # identical after training
    assert any(
        not torch.allclose(a, b) for a, b in zip(first["final"], first["initial"], strict=True)
    )


def test_ddp_with_two_processes_per_node() -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    with sky.Compute(nodes=2, plugins=[plugins.torch(procs_per_node=2)]) as pool:
        results = ddp_train(x, y, "sampler") @ pool
    assert [r["rank"] for r in results] == [0, 1, 2, 3]  # one result per rank, in order
    assert [(r["env"]["NODE_RANK"], r["env"]["LOCAL_RANK"]) for r in results] == [
        ("0", "0"),
        ("0", "1"),
        ("1", "0"),
        ("1", "1"),
    ]
    assert {(r["world"], r["env"]["LOCAL_WORLD_SIZE"]) for r in results} == {(4, "2")}
    assert [r["seen"] for r in results] == [3 * 64] * 4
    for r in results:
        for a, b in zip(r["final"], results[0]["final"], strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_reference_torch_example_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """Document 002's "Basic DDP training", ``.cuda()`` removed, local provider."""
    pytest.importorskip("torch")

    @sky.function
    @sky.stdout(only="head")
    def train() -> dict:  # type: ignore[type-arg]
        import torch
        import torch.distributed as dist
        import torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        rank = dist.get_rank()
        world_size = dist.get_world_size()

        model = nn.Linear(784, 10)
        model = DDP(model)

        x = torch.randn(1000, 784)
        y = torch.randint(0, 10, (1000,))
        dataset = TensorDataset(x, y)
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
        loader = DataLoader(dataset, batch_size=64, sampler=sampler)

        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn = nn.CrossEntropyLoss()

        for epoch in range(10):
            sampler.set_epoch(epoch)
            for batch_x, batch_y in loader:
                batch_x, batch_y = batch_x, batch_y
                loss = loss_fn(model(batch_x), batch_y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            print(f"Epoch {epoch}: loss={loss.item():.4f}")

        return {"final_loss": loss.item(), "rank": rank}

    with sky.Compute(
        nodes=4,
        plugins=[sky.plugins.torch()],  # type: ignore[attr-defined]
    ) as compute:
        results = train() @ compute

    for r in results:
        print(f"Rank {r['rank']}: loss={r['final_loss']:.4f}")

    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    out = capsys.readouterr().out.splitlines()
    epochs = [line for line in out if "Epoch" in line]
    assert len(epochs) == 10
    assert all(line.startswith("(node-0, rank=0) Epoch") for line in epochs)
    assert len([line for line in out if line.startswith("Rank ")]) == 4


@sky.function
def fsdp_train() -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # FSDP shards the (identical) initial weights
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    initial = [p.detach().clone() for p in model.parameters()]
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)  # each node its own data
    losses = []
    for _ in range(20):
        x = torch.randn(32, 8, generator=gen)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    shards = [tuple(p.to_local().shape) for p in model.parameters()]
    final = [p.full_tensor().detach().clone() for p in model.parameters()]
    return {"rank": rank, "initial": initial, "final": final, "shards": shards, "losses": losses}


def test_fsdp_on_two_nodes() -> None:
    torch = pytest.importorskip("torch")
    with sky.Compute(nodes=2, plugins=[plugins.torch()]) as pool:
        results = fsdp_train() @ pool
    a, b = results
    assert (a["rank"], b["rank"]) == (0, 1)
    assert a["shards"][0] == (16, 8)  # the 32x8 weight is split between the two nodes
    for x, y in zip(a["final"], b["final"], strict=True):
        assert torch.allclose(x, y, rtol=0, atol=1e-6)
    assert any(not torch.allclose(f, i) for f, i in zip(a["final"], a["initial"], strict=True))
    assert a["losses"][-1] < a["losses"][0]


# -- JAX and Keras ----------------------------------------------------------------------


@sky.function
def jax_probe() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    local = jnp.array([jax.process_index() + 1.0, 10.0 * (jax.process_index() + 1)])
    gathered = multihost_utils.process_allgather(local)
    return {
        "count": jax.process_count(),
        "index": jax.process_index(),
        "devices": len(jax.devices()),
        "gathered": gathered.tolist(),
        "total": float(gathered.sum()),
        "env": {k: v for k, v in os.environ.items() if k.startswith("JAX_")},
    }


def test_jax_distributed_on_two_nodes() -> None:
    pytest.importorskip("jax")
    with sky.Compute(nodes=2, plugins=[plugins.jax()]) as pool:
        results = jax_probe() @ pool
    assert [(r["count"], r["index"], r["devices"]) for r in results] == [(2, 0, 2), (2, 1, 2)]
    for r in results:
        assert r["gathered"] == [[1.0, 10.0], [2.0, 20.0]]
        assert r["total"] == 33.0
    assert [r["env"]["JAX_PROCESS_ID"] for r in results] == ["0", "1"]
    assert {r["env"]["JAX_NUM_PROCESSES"] for r in results} == {"2"}


def test_jax_distributed_with_two_processes_on_one_node() -> None:
    pytest.importorskip("jax")
    with sky.Compute(nodes=1, plugins=[TwoPerNode(), plugins.jax()]) as pool:
        results = jax_probe() @ pool
    assert [(r["count"], r["index"]) for r in results] == [(2, 0), (2, 1)]
    assert results[0]["gathered"] == [[1.0, 10.0], [2.0, 20.0]]


@sky.function
def keras_train(x_full: Any, y_full: Any) -> dict[str, Any]:
    import jax
    import keras
    import numpy as np

    x, y = sky.shard(x_full, y_full)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    return {
        "backend": keras.backend.backend(),
        "processes": jax.process_count(),
        "distribution": type(keras.distribution.distribution()).__name__,
        "losses": history.history["loss"],
        "before": before,
        "after": [np.asarray(w) for w in model.get_weights()],
    }


@pytest.mark.parametrize("with_jax_plugin", [True, False], ids=["jax+keras", "keras-alone"])
def test_keras_jax_trains_on_two_nodes(with_jax_plugin: bool) -> None:
    np = pytest.importorskip("numpy")
    pytest.importorskip("jax")
    if importlib.util.find_spec("keras") is None:  # importing it here would pick a backend
        pytest.skip("keras is not installed")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], dtype="float32"))[:, None]
    chosen = [plugins.jax(), plugins.keras()] if with_jax_plugin else [plugins.keras("jax")]
    with sky.Compute(nodes=2, plugins=chosen) as pool:
        a, b = keras_train(x, y) @ pool
    for r in (a, b):
        assert (r["backend"], r["processes"], r["distribution"]) == ("jax", 2, "DataParallel")
        assert r["losses"][-1] < r["losses"][0]
    assert a["losses"] == b["losses"]  # one global loss: the nodes trained together
    for wa, wb in zip(a["after"], b["after"], strict=True):
        np.testing.assert_allclose(wa, wb, rtol=0, atol=1e-6)
    assert any(not np.allclose(w, w0) for w, w0 in zip(a["after"], a["before"], strict=True))


@sky.function
def hf_train(steps: int) -> dict[str, Any]:
    import os
    import tempfile

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
    )
    before = sum(float(p.detach().sum()) for p in model.parameters())
    data = [{"input_ids": torch.arange(16) % 64, "labels": torch.arange(16) % 64}] * 32
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(dir=os.getcwd()),  # the node's folder: goes with the pool
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    after = [float(p.detach().sum()) for p in model.parameters()]
    return {
        "world_size": args.world_size,
        "token_set": os.environ.get("HF_TOKEN") == TOKEN,
        "before": before,
        "after": after,
    }


def test_huggingface_trainer_trains_distributed_on_two_nodes(
    capfd: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    with sky.Compute(nodes=2, plugins=[plugins.torch(), plugins.huggingface(token=TOKEN)]) as pool:
        results = hf_train(4) @ pool
    assert [r["world_size"] for r in results] == [2, 2]  # the Trainer saw the process group
    assert all(r["token_set"] for r in results)
    assert results[0]["after"] == results[1]["after"]  # replicas stayed in sync
    assert sum(results[0]["after"]) != pytest.approx(results[0]["before"])  # and trained
    out, err = capfd.readouterr()
    assert TOKEN not in out + err


# -- launcher plugins: joblib, scikit-learn, accelerate; the Trainer with huggingface alone ----
def square_where(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


@sky.function
def executor_pid() -> int:
    return os.getpid()


@pytest.mark.timeout(600)  # it first builds the nodes' environment: minutes when loaded
def test_joblib_parallel_inside_the_pool_runs_on_its_nodes() -> None:
    joblib = pytest.importorskip("joblib")
    with sky.Compute(nodes=2, plugins=[plugins.joblib()]) as pool:
        executors = set(executor_pid() @ pool)
        out = joblib.Parallel(n_jobs=-1, batch_size=1)(
            joblib.delayed(square_where)(i) for i in range(12)
        )
        assert joblib.Parallel(n_jobs=-1)._effective_n_jobs() == 2  # one worker per process
    assert [v for v, _ in out] == [i * i for i in range(12)]
    assert {pid for _, pid in out} == executors  # every batch ran on the pool, on both nodes
    assert os.getpid() not in executors
    # after the pool: joblib is back to its own default backend
    assert joblib.Parallel(n_jobs=1)(joblib.delayed(square_where)(2) for _ in range(1)) == [
        (4, os.getpid())
    ]


class PidScorer:
    """A scorer that returns the process that scored (picklable, by reference)."""

    def __call__(self, estimator: Any, x: Any, y: Any) -> float:
        return float(os.getpid())


@pytest.mark.timeout(600)  # it first builds the nodes' environment: minutes when loaded
def test_sklearn_grid_search_with_n_jobs_minus_one_spreads_over_the_pool() -> None:
    pytest.importorskip("sklearn")
    from sklearn.datasets import make_classification
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV

    x, y = make_classification(n_samples=60, n_features=4, random_state=0)
    with sky.Compute(nodes=2, plugins=[plugins.sklearn()]) as pool:
        executors = set(executor_pid() @ pool)
        search = GridSearchCV(
            LogisticRegression(max_iter=200),
            {"C": [0.1, 1.0, 10.0, 100.0]},
            cv=3,
            n_jobs=-1,
            scoring=PidScorer(),
            pre_dispatch="all",
        ).fit(x, y)
    pids = {int(v) for k, v in search.cv_results_.items() if k.startswith("split") for v in v}
    assert pids == executors  # the 12 fits were scored on both nodes, none here
    assert search.best_params_["C"] in (0.1, 1.0, 10.0, 100.0)


def test_sklearn_and_joblib_plugins_install_what_the_nodes_need() -> None:
    image = plugins.sklearn().transform(sky.Image(), None)
    assert {"scikit-learn", "joblib"} <= {package_name(p) for p in image.pip}
    assert [package_name(p) for p in plugins.joblib().transform(None, None).pip] == ["joblib"]
    with pytest.raises(ValueError, match="joblib version"):
        plugins.joblib(version="not a version")


@sky.function
def accelerate_state() -> tuple[int, int, str]:
    from accelerate import Accelerator

    acc = Accelerator()  # as a training script makes it: no arguments
    return acc.num_processes, acc.process_index, os.environ["ACCELERATE_MIXED_PRECISION"]


def test_accelerate_plugin_gives_every_process_its_place_across_the_cluster() -> None:
    pytest.importorskip("accelerate")
    plugin = plugins.accelerate(config={"mixed_precision": "no"})
    with sky.Compute(nodes=2, plugins=[plugin]) as pool:
        assert accelerate_state() @ pool == [(2, 0, "no"), (2, 1, "no")]
    image = plugin.transform(sky.Image(), PoolSpecStandIn())
    assert {"torch", "accelerate"} <= {package_name(p) for p in image.pip}
    with pytest.raises(sky.ConfigurationError, match="unknown key"):
        plugins.accelerate(config={"num_processes": 8})  # topology comes from the pool


@dataclass
class PoolSpecStandIn:
    accelerator: Any = None


def test_huggingface_alone_runs_the_trainer_on_one_node() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    image = plugins.huggingface().transform(sky.Image(), None)
    assert {"transformers", "accelerate", "torch"} <= {package_name(p) for p in image.pip}
    with sky.Compute(nodes=1, plugins=[plugins.huggingface(token=TOKEN)]) as pool:
        (result,) = hf_train(2) @ pool
    assert result["world_size"] == 1 and result["token_set"]
    assert sum(result["after"]) != pytest.approx(result["before"])  # it trained


class RecordsPool(sky.Plugin):
    """Records the client-side hook's life in a list the test holds."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __reduce__(self) -> Any:
        return (sky.Plugin, ())  # the nodes get a plain plugin: the log stays here

    @contextlib.contextmanager
    def _around(self, pool: sky.Compute) -> Iterator[None]:
        self.log.append(f"enter {pool.state.name}")
        yield
        self.log.append("exit")

    def around_pool(self, pool: Any) -> Any:
        return self._around(pool)


def test_around_pool_is_entered_once_the_pool_runs_and_exited_when_it_closes() -> None:
    log: list[str] = []
    with sky.Compute(nodes=1, plugins=[RecordsPool(log)]) as pool:
        assert log == ["enter RUNNING"]
        assert executor_pid() >> pool != os.getpid()
    assert log == ["enter RUNNING", "exit"]
