"""What a pool's nodes start with: :class:`Startup`, one frozen value that ``Compute.open``
builds (:func:`prepare`, every check of it before anything is provisioned) and hands to
:meth:`Bringup.begin` before the first node is brought up; with the checks of a pool's
arguments that ``Compute`` makes when it is created."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from .._accelerators import Accelerator
from .._errors import ConfigurationError, SerializationError, check_number
from .._image import Image, ship_user_modules
from .._providers.base import Options, PoolSpec, Provider
from .._providers.fallback import Candidate
from .._providers.limits import ensure_open_files
from .._redaction import plain_env, plugin_secrets, secret_values
from .._volume import Volume, node_spec
from .._wire.bodies import Config
from .._wire.serialize import pickle_obj
from .._worker import Worker
from ..metrics import Metric, specs
from . import shm
from .interpreter import Policy, check_image

VOLUME_FLUSH_TIMEOUT = 300.0
"""Seconds a node's agent waits, at the end, for its writable volumes to be written back
(the client waits as long for the agents to exit)."""


@dataclass(frozen=True)
class Startup:
    """What every node of a pool is configured with (CONFIG, see ``Bringup.configure``),
    fixed before anything is provisioned. A fallback's chosen provider replaces ``home``
    and ``python``, the allocation ``delivered`` (``dataclasses.replace``), before the
    first node is brought up.

    Attributes:
        pool_id: the pool's id.
        accelerator: the accelerators of each node, or None.
        procs_per_node: processes per node (a plugin's, or one per accelerator).
        shm_prefix: the pool's shared-memory files' prefix (``shm.pool_prefix``).
        workers: task slots per node (``Worker(concurrency=...)``, or a plugin's processes).
        threads: the slots are threads of one process (``Worker(executor="thread")``).
        observe: the metrics' part of CONFIG (``_node/metrics.py``).
        home: the folder of flotilla's files on a node (the provider's).
        python: what may be done when a node's Python differs from the client's.
        env: variables set in every task process (the plain ones; the secrets' values are
            in ``secrets``, to redact).
        build_spec: the node environment to build (``Image.build_spec``), or None.
        includes: the Image's includes archive, sent to a node that asks for it.
        blob: the pickled plugins, sent with the configuration.
        preload: the modules every agent imports before it forks its executors (the
            plugins' ``preload``, :func:`preload_modules`).
        volumes: the buckets every node mounts or copies (``_volume.node_spec``), or None.
        secrets: the values never shown in clear (the Image's, the Options', the plugins'
            and the volumes').
        delivered: variables the allocation already delivers (see
            ``Allocation.delivered_env``): not sent again.
    """

    pool_id: str
    accelerator: Accelerator | None
    procs_per_node: int
    shm_prefix: str
    workers: int
    threads: bool
    observe: Config
    home: str
    python: Policy
    env: dict[str, str] = field(default_factory=dict)
    build_spec: dict[str, Any] | None = None
    includes: bytes = b""
    blob: bytes = b""
    preload: tuple[str, ...] = ()
    volumes: dict[str, Any] | None = None
    secrets: tuple[str, ...] = ()
    delivered: frozenset[str] = frozenset()


class Size(Protocol):
    """A pool's size (``elastic.Nodes``), as far as :func:`prepare` reads it."""

    @property
    def elastic(self) -> bool: ...

    @property
    def most(self) -> int: ...

    @property
    def desired(self) -> int: ...


class Opening(Protocol):
    """What :func:`prepare` reads of the pool being opened (a ``Compute``)."""

    pool_id: str
    accelerator: Accelerator | None
    procs_per_node: int
    provider: Provider
    volumes: tuple[Volume, ...]
    plugins: tuple[Any, ...]
    options: Options
    worker: Worker
    metrics_config: tuple[Metric, ...]
    vcpus: float | None
    memory_gb: float | None
    max_hourly_cost: float | None
    max_node_hourly_cost: float | None

    @property
    def reattach_grace(self) -> float: ...

    @property
    def size(self) -> Size: ...

    @property
    def workers_per_node(self) -> int: ...


def pool_spec(pool: Opening, image: Image) -> PoolSpec:
    """What ``pool`` asks of its provider, with ``image``."""
    return PoolSpec(
        pool.pool_id,
        pool.size.desired,
        pool.accelerator,
        image,
        pool.plugins,
        pool.options,
        vcpus=pool.vcpus,
        memory_gb=pool.memory_gb,
        max_nodes=pool.size.most if pool.size.elastic else 0,
        max_hourly_cost=pool.max_hourly_cost,
        max_node_hourly_cost=pool.max_node_hourly_cost,
        keep_agents=pool.reattach_grace,
    )


def prepare(pool: Opening, image: Image) -> tuple[PoolSpec, Startup]:
    """Check what ``pool`` asks of its provider, apply its plugins' ``transform`` to
    ``image``, and build its start: the pool's spec and its :class:`Startup`. Raises
    ConfigurationError (or SerializationError) before anything is provisioned."""
    provider = pool.provider
    spec = pool_spec(pool, image)
    if pool.size.elastic and not provider.elastic:
        raise ConfigurationError(
            f"nodes={pool.size}: the {provider.name} provider has fixed-size pools "
            "only (every built-in provider has elastic pools); "
            "pass a number of nodes"
        )
    acc = spec.accelerator
    if (
        acc is not None
        and acc.fractional
        and not getattr(provider, "fractional_accelerators", False)
    ):
        raise ConfigurationError(
            f"accelerator {acc} is a fraction of one; "
            f"{type(provider).__name__} has no fractional accelerators (none "
            "of flotilla's providers has yet: Skyward's are AWS g6f and Vultr "
            "slices); ask for a whole one, or use plugins.mig() to partition one"
        )
    provider.validate(spec)
    # every provider: three pipes per node here
    ensure_open_files(pool.size.most, str(getattr(provider, "name", "")))
    volumes: dict[str, Any] | None = None
    volume_secrets: list[str] = []
    if pool.volumes:  # the buckets can be read: before anything is provisioned
        from .._providers.local import Local

        volumes, volume_secrets = node_spec(pool.volumes, isinstance(provider, Local))
        volumes["flush_timeout"] = VOLUME_FLUSH_TIMEOUT
    for p in pool.plugins:
        hook = getattr(p, "transform", None)
        if hook is not None:
            image = hook(image, spec)
            if not isinstance(image, Image):
                raise ConfigurationError(f"plugin {p!r}: transform() must return an Image")
    check_image(image)  # a plugin's too
    spec = pool_spec(pool, image)
    python = Policy.of(provider, image)
    try:
        blob = pickle_obj(list(pool.plugins)).main if pool.plugins else b""
    except Exception as e:
        raise SerializationError(f"the pool's plugins cannot be pickled: {e}") from e
    if not provider.shares_filesystem:
        ship_user_modules()
    includes = image.includes_archive()
    secrets = (
        secret_values(image.env)
        + secret_values(pool.options.env)
        + plugin_secrets(pool.plugins)
        + volume_secrets
    )
    return spec, Startup(
        pool_id=pool.pool_id,
        accelerator=pool.accelerator,
        procs_per_node=pool.procs_per_node,
        shm_prefix=shm.pool_prefix(pool.pool_id),
        workers=pool.workers_per_node,
        threads=pool.worker.resolved_executor == "thread",  # (one process)
        observe=observe_config(pool.metrics_config, provider),
        home=provider.home,
        python=python,
        env={**plain_env(image.env), **plain_env(pool.options.env)},
        build_spec=image.build_spec(includes) if image.needs_build else None,
        includes=includes,
        blob=blob,
        preload=preload_modules(pool.plugins),
        volumes=volumes,
        secrets=tuple(secrets),
    )


def for_chosen(startup: Startup, chosen: object) -> Startup:
    """``startup`` for the provider a fallback chose (``chosen``; anything else: as it
    is): that provider's home and interpreter policy, and a :class:`Candidate`'s own
    accelerator, which is what its nodes have (``instance_info()``), over the pool's."""
    if not isinstance(chosen, Provider):
        return startup
    python = replace(
        startup.python,
        pinned=chosen.python_pinned,
        home=str(chosen.home),
        provider=type(chosen).__name__,
    )
    own = chosen.accelerator if isinstance(chosen, Candidate) else None
    return replace(startup, home=chosen.home, python=python, accelerator=own or startup.accelerator)


def procs_per_node(plugins: Sequence[Any], accelerator: Accelerator | None) -> int:
    """Processes per node: the most any plugin asks (``plugins.torch(procs_per_node=2)``;
    its None: one per accelerator), at least 1."""
    per_accelerator = accelerator.whole if accelerator is not None else 1
    asked = (getattr(p, "procs_per_node", 1) for p in plugins)
    return max([per_accelerator if n is None else int(n) for n in asked] + [1])


def check_plugins(plugins: Sequence[Any], options: Options) -> None:
    """ConfigurationError for an object that is no plugin, a plugin that refuses another
    one, or one that needs cluster mode in a pool without it."""
    for p in plugins:
        if not (hasattr(p, "around_process") or hasattr(p, "transform")):
            raise ConfigurationError(
                f"{p!r} is not a flotilla plugin (it has neither transform nor around_process)"
            )
        check = getattr(p, "check_plugins", None)
        if check is not None:  # a plugin that refuses some others (ray: torch)
            check(plugins)
        preload_modules([p])
        if not options.cluster and getattr(p, "requires_cluster", False):
            name = getattr(p, "name", type(p).__name__)
            raise ConfigurationError(
                f"plugin {name!r} needs cluster mode (nodes that know each other), "
                "but the pool "
                f"has Options(cluster=False): remove the plugin or use cluster=True"
            )


def preload_modules(plugins: Sequence[Any]) -> tuple[str, ...]:
    """The modules ``plugins`` name in their ``preload``, in order, once each; a
    ConfigurationError for a ``preload`` that is not a tuple or list of module names."""
    names: dict[str, None] = {}
    for p in plugins:
        preload = getattr(p, "preload", ())
        if not isinstance(preload, tuple | list) or not all(
            isinstance(n, str) and all(part.isidentifier() for part in n.split("."))
            for n in preload
        ):
            name = getattr(p, "name", type(p).__name__)
            raise ConfigurationError(
                f"plugin {name!r}: preload must be a tuple of module names such as "
                f"('torch', 'torch.distributed'), got {preload!r}"
            )
        names.update(dict.fromkeys(preload))
    return tuple(names)


def resource(name: str, value: object, example: str) -> float | None:
    """A per-node resource request: None or a positive number (as a float)."""
    if value is None:
        return None
    check_number(value, f"{name} must be a positive number ({example}), got {value!r}", above=0)
    check_number(
        value, f"{name} must be a finite number ({example}), got {value!r}", below=float("inf")
    )
    assert isinstance(value, int | float)
    return float(value)


def observe_config(metrics: tuple[Metric, ...], provider: Any) -> Config:
    """What CONFIG tells the agents of the metrics (``_node/metrics.py``): their specs and
    where usage is measured: the node's own process tree where the provider's nodes share
    one machine (local processes, containers, pods), else the machine (or its cgroup)."""
    if not metrics:
        return {}
    names = {
        type(p).__name__ for p in (provider if isinstance(provider, list | tuple) else [provider])
    }
    shared = bool(names & {"Local", "Container", "Kubernetes"})
    return {"metrics": specs(metrics), "metrics_scope": "tree" if shared else "host"}
