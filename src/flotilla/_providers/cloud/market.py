"""What the providers of rented instances share around their allocations: the settings
plumbing of their constructors, the checks before anything is rented (``ssh``, a TTL
longer than the heartbeat), an acquire that releases what a failed launch made, the labels
``flotilla:{pool}:{client}``, the instances and orphan pools found by them (a release,
``flotilla down --orphans``)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from ..._accelerators import Accelerator, offered_as, unknown_name
from ..._errors import ConfigurationError, ProvisionCause, ProvisionError, check_number
from ..base import Allocation, PoolSpec, Provider
from .guard import USER_NAME
from .identity import orphaned
from .kept import Keep, KeptPool

_A = TypeVar("_A", bound=Allocation)
_T = TypeVar("_T")


class Client(Protocol):
    """What :class:`MarketProvider` needs of an API client: the URL it calls."""

    @property
    def url(self) -> str: ...


_S = TypeVar("_S")
_Api = TypeVar("_Api", bound=Client)

LABEL_PREFIX = "flotilla:"
"""A pool's instances are labelled (or named) ``flotilla:{pool id}:{client host:pid:start}``."""


def label(pool_id: str, client: str) -> str:
    return f"{LABEL_PREFIX}{pool_id}:{client}"


def parse_label(text: str) -> tuple[str, str] | None:
    """(pool id, client) of a flotilla label; None for another label."""
    if not text.startswith(LABEL_PREFIX):
        return None
    pool, _, client = text[len(LABEL_PREFIX) :].partition(":")
    return (pool, client) if pool else None


@dataclass(frozen=True)
class CloudOrphans:
    """What a provider's ``remove_orphans`` found (and removed unless a dry run).

    Attributes:
        pools: the orphan pools' ids.
        instances: their instances.
        skipped: pools whose client ran on another machine (not touched).
    """

    pools: tuple[str, ...]
    instances: tuple[Any, ...]
    skipped: tuple[str, ...]


def find_orphans(found: Iterable[tuple[str, str, _T]]) -> tuple[set[str], set[str], list[_T]]:
    """Of ``found`` ((pool, client, instance) of every flotilla instance listed): the
    orphan pools (their client on this machine is gone), the pools skipped (a client of
    another machine), and the orphans' instances, in order."""
    pools: set[str] = set()
    skipped: set[str] = set()
    gone: list[_T] = []
    for pool, client, instance in found:
        if orphaned(pool, client, skipped):
            pools.add(pool)
            gone.append(instance)
    return pools, skipped, gone


def labelled(rows: Iterable[dict[str, Any]], key: str) -> Iterable[tuple[str, str, str]]:
    """(pool, client, id) of the ``rows`` whose ``key`` is a flotilla label."""
    for row in rows:
        found = parse_label(str(row.get(key) or ""))
        if found is not None:
            yield found[0], found[1], str(row["id"])


def orphans_in(rows: Iterable[dict[str, Any]], key: str) -> tuple[set[str], set[str], list[str]]:
    """:func:`find_orphans` of the ``rows`` (an API's instances) whose ``key`` holds a
    flotilla label: the orphan pools, the pools skipped, the orphans' ids."""
    return find_orphans(labelled(rows, key))


def pool_ids(rows: Iterable[dict[str, Any]], key: str, pool_id: str) -> set[str]:
    """The ids of the ``rows`` whose ``key`` labels them as pool ``pool_id``'s (the release
    finds by them what a create whose answer was lost made)."""
    return {ident for pool, _, ident in labelled(rows, key) if pool == pool_id}


def release_each(ids: Iterable[_T], release: Callable[[_T], None]) -> list[str]:
    """``release`` each of ``ids``, in order and all of them; the errors (ProvisionError)
    of those that failed."""
    errors = []
    for ident in ids:
        try:
            release(ident)
        except ProvisionError as e:
            errors.append(str(e))
    return errors


class MarketProvider(Provider, Generic[_S, _Api]):
    """A provider of rented instances (elastic): its settings (``_S``, whose ``workdir`` is
    its ``home``; its constructor is derived from them, see ``options.provider_init``) and
    its API client (``_Api``), made on first use (:attr:`api`, by :meth:`connect`).

    Attributes:
        keep: set for a stoppable pool (a named cluster's, where the provider can stop its
            instances, see ``kept``): its instances are recorded there, closing the pool
            with ``keep.stop`` set stops them, and the next pool starts them again.
    """

    settings: _S
    elastic = True
    keep: Keep | None = None
    reattaches_over_ssh = True
    """A named cluster's nodes are re-attached to over the pool's SSH login
    (``_providers/reattach.py``)."""
    accepted = "key"
    """What :meth:`check` says the API accepted ("credentials")."""
    _api: _Api | None = None

    @property
    def api(self) -> _Api:
        """The API client, made (:meth:`connect`) on first use."""
        if self._api is None:
            self._api = self.connect()
        return self._api

    @abstractmethod
    def connect(self) -> _Api:
        """A new API client; a ConfigurationError when no credentials are found (naming
        where they were looked for and how to give them)."""

    def check(self) -> str:
        """Whether the credentials work: the API that accepted them and the number of
        instances it lists, or a ConfigurationError saying why not (naming where they came
        from)."""
        listed = self.instances()
        return f"{self.accepted} accepted by {self.api.url} ({len(listed)} instance(s))"

    def instances(self) -> list[Any]:
        """The account's instances, as the API lists them (:meth:`check`, the orphans)."""
        raise NotImplementedError

    def remove_kept(self, kept: KeptPool) -> None:
        """Remove a stopped pool's instances (``flotilla down`` of a stopped cluster)."""
        raise ConfigurationError(f"{type(self).__name__} keeps no stopped instances")


def check_stoppable(provider: Any, spec: PoolSpec) -> None:
    """ConfigurationError when an elastic pool (``spec.max_nodes``) would be a stoppable
    one (``provider.keep`` set: a named cluster's): its instances come and go, and what is
    kept is a fixed pool's nodes."""
    if spec.max_nodes and getattr(provider, "keep", None) is not None:
        raise ConfigurationError(
            f"an elastic pool (up to {spec.most} nodes) cannot be a stoppable one: its "
            "instances come and go; pass a number of nodes"
        )


def check_ttl(provider: Any, spec: PoolSpec, would: str) -> None:
    """``ssh`` on this machine, and a TTL of ``provider``'s settings that the client's
    silence cannot reach (else ``would`` happen under a live pool): ConfigurationError
    otherwise."""
    from ..ssh_shell import ssh_client

    ssh_client()
    ttl = provider.settings.ttl
    if ttl <= spec.options.heartbeat_timeout:
        raise ConfigurationError(
            f"{type(provider).__name__}(ttl={ttl:g}) must exceed Options(heartbeat_timeout="
            f"{spec.options.heartbeat_timeout:g}): the client may be silent that long, and "
            f"{would} under a live pool"
        )


async def launched(allocation: _A, launch: Callable[[], Awaitable[None]]) -> _A:
    """``allocation`` once ``launch()`` made it; released (nothing left) when it fails or
    is cancelled."""
    try:
        await launch()
    except BaseException:
        await allocation.release()
        raise
    return allocation


def over_budget(
    cost: float | None,
    cap: float | None,
    what: str,
    note: str = "",
    cap_name: str = "max_hourly_cost",
) -> None:
    """ProvisionError (CAPACITY, before anything is rented) when ``cost`` an hour is above
    ``cap`` (``cap_name``; None: no cap), saying ``{what} ${cost}/h{note}``."""
    if cost is not None and cap is not None and cost > cap:
        raise ProvisionError(
            f"{what} ${cost:.2f}/h{note}, above {cap_name}=${cap:.2f}/h: nothing was rented",
            cause=ProvisionCause.CAPACITY,
        )


def fits(
    acc: Accelerator | None,
    instance_type: str | None,
    name: str,
    gpus: int,
    described: str,
    market: str,
) -> bool:
    """Whether instance type ``name`` (``gpus`` GPUs, ``described`` so on ``market``) can be
    the pool's: the one ``instance_type`` names; one with ``acc`` (count included); with no
    accelerator asked for, one with GPUs."""
    if instance_type is not None and name != instance_type:
        return False
    if acc is not None:
        return gpus == acc.count and offered_as(acc, described, market)
    return instance_type is not None or gpus != 0


def unoffered(acc: Accelerator, cloud: str, market: str, offered: list[str]) -> ConfigurationError:
    """The error for an accelerator no instance type of ``cloud`` has, naming the nearest
    of ``offered``."""
    asked = f"{acc.name}:{acc.count:g}" if acc.count != 1 else acc.name
    return ConfigurationError(unknown_name(asked, cloud, {market: offered}))


def check_self_ending(settings: Any, provider: str, secrets: tuple[str, ...], region: str) -> None:
    """The checks the settings of the providers whose instances end themselves share (see
    ``allocation.SelfEnding``), in a ``__post_init__``: the ``secrets`` fields None or
    non-empty strings, ``region`` None or a name of letters, digits and dashes (``region``
    says which, "a region name such as 'us-east-1'"), ``ssh_user`` a login name, ``ttl``
    positive seconds; ``ttl`` and ``connect_timeout`` are made floats. ``provider`` is named
    in the errors."""
    for name in secrets:
        value = getattr(settings, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigurationError(f"{provider}({name}=...): a non-empty string")
    where = settings.region
    if where is not None and (not isinstance(where, str) or not where.replace("-", "").isalnum()):
        raise ConfigurationError(f"{provider}(region={where!r}): {region}")
    user = settings.ssh_user
    if not isinstance(user, str) or not USER_NAME.fullmatch(user):
        raise ConfigurationError(f"{provider}(ssh_user={user!r}): a login name")
    ttl = settings.ttl
    check_number(ttl, f"{provider}(ttl={ttl!r}): a positive number of seconds", above=0)
    object.__setattr__(settings, "ttl", float(ttl))
    object.__setattr__(settings, "connect_timeout", float(settings.connect_timeout))
