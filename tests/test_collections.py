"""Distributed collections (sky.dict, counter, set, queue, barrier, lock): shared by the
client and every node of a real local pool, over real SSH test hosts, and kept when a node
is killed (they live in the client)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from _hosts import Lab, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture

import flotilla as sky


@pytest.fixture(scope="module")
def pool() -> Iterator[sky.Compute]:
    with sky.Compute(nodes=4) as p:
        yield p


# -- tasks ----------------------------------------------------------------------------------
@sky.function
def increment(name: str, times: int) -> int:
    counter = sky.counter(name, consistency="strong")
    for _ in range(times):
        counter.increment()
    return sky.instance_info().node


@sky.function
def dict_ops(name: str) -> dict[str, object]:
    d = sky.dict(name)
    d["a"] = 1
    d.update({"b": 2, "c": 3})
    del d["c"]
    missing = False
    try:
        d["nope"]
    except KeyError:
        missing = True
    return {
        "a": d["a"],
        "from_client": d.get("client"),
        "default": d.get("nope", "dflt"),
        "in": "b" in d,
        "not_in": "c" in d,
        "missing": missing,
        "pop": d.pop("b"),
        "pop_default": d.pop("b", "gone"),
    }


@sky.function
def set_ops(name: str) -> tuple[bool, bool, int]:
    s = sky.set(name)
    node = sky.instance_info().node
    s.add(node)
    s.add(f"x{node}")  # this node's own: another node's add cannot race its discard
    s.discard(f"x{node}")
    return node in s, f"x{node}" in s, len(s)


@sky.function
def produce_or_consume(name: str, items: int) -> list[int]:
    """Nodes 0 and 1 put ``items`` numbers each (then an end mark); 2 and 3 take numbers
    until they see an end mark."""
    q = sky.queue(name)
    node = sky.instance_info().node
    if node < 2:
        for i in range(items):
            q.put(node * items + i)
        q.put(-1)
        return []
    taken = []
    while (value := q.get()) != -1:
        taken.append(value)
    return taken


@sky.function
def meet(name: str, n: int) -> int:
    d = sky.dict(name)
    d[sky.instance_info().node] = True
    sky.barrier(name, n).wait()
    return len(d)  # every node wrote before any passed the barrier


@sky.function
def add_under_lock(name: str, times: int) -> None:
    d = sky.dict(name)
    for _ in range(times):
        with sky.lock(name):
            d["total"] = d.get("total", 0) + 1  # read-modify-write: only safe under the lock


@sky.function
def collection_in_task() -> int:
    return int(sky.counter("c"))


@sky.function
def uses_a_passed_proxy(d: object) -> object:
    d["from_node"] = sky.instance_info().node  # type: ignore[index]
    return d["from_client"]  # type: ignore[index]


# -- one pool: every operation ------------------------------------------------------------------
def test_dict_operations_from_a_node_see_the_clients(pool: sky.Compute) -> None:
    pool.dict("ops")["client"] = "hello"
    got = dict_ops("ops") >> pool
    assert got == {
        "a": 1,
        "from_client": "hello",
        "default": "dflt",
        "in": True,
        "not_in": False,
        "missing": True,
        "pop": 2,
        "pop_default": "gone",
    }
    d = sky.dict("ops")  # the module function on the client: the open pool's
    assert d["a"] == 1 and "b" not in d and len(d) == 2
    assert sorted(d.keys()) == ["a", "client"]


def test_counter_operations(pool: sky.Compute) -> None:
    c = pool.counter("ops")
    assert int(c) == 0
    assert c.increment(5) == 5 and c.decrement(2) == 3
    c.reset(10)
    assert c.value == 10
    c.reset()
    assert int(c) == 0


def test_set_operations_from_every_node(pool: sky.Compute) -> None:
    results = set_ops("members") @ pool
    assert all(mine and not x for mine, x, _ in results)
    s = pool.set("members")
    assert len(s) == 4 and all(n in s for n in range(4)) and "x0" not in s


def test_queue_get_with_timeout_gives_none_and_keeps_order(pool: sky.Compute) -> None:
    q = pool.queue("fifo")
    assert q.empty() and q.get(timeout=0) is None and q.get(timeout=0.05) is None
    for i in range(3):
        q.put(i)
    assert len(q) == 3 and [q.get(), q.get(), q.get()] == [0, 1, 2] and q.empty()


def test_four_nodes_times_1000_strong_increments_end_at_4000(pool: sky.Compute) -> None:
    assert sorted(increment("hits", 1000) @ pool) == [0, 1, 2, 3]
    assert int(pool.counter("hits")) == 4000


def test_10000_queue_items_none_lost_none_twice(pool: sky.Compute) -> None:
    results = produce_or_consume("work", 5000) @ pool
    assert results[0] == results[1] == []
    taken = results[2] + results[3]
    assert len(taken) == 10000 and sorted(taken) == list(range(10000))
    assert pool.queue("work").empty()


def test_barrier_holds_every_node_until_all_arrive(pool: sky.Compute) -> None:
    assert meet("meeting", 4) @ pool == [4, 4, 4, 4]
    assert meet("meeting", 4) @ pool == [4, 4, 4, 4]  # the barrier serves another round


def test_lock_makes_read_modify_write_exact(pool: sky.Compute) -> None:
    add_under_lock("guarded", 200) @ pool
    assert pool.dict("guarded")["total"] == 800
    lock = pool.lock("guarded")
    assert not lock.locked()
    assert lock.acquire(timeout=1) and lock.locked()
    assert not lock.acquire(blocking=False)  # not reentrant: held by this thread already
    lock.release()
    with pytest.raises(RuntimeError, match="not held"):
        lock.release()


def test_a_proxy_passed_to_a_task_reaches_the_same_collection(pool: sky.Compute) -> None:
    d = pool.dict("passed")
    d["from_client"] = 7
    assert pickle.loads(pickle.dumps(d)).name == "passed"
    assert uses_a_passed_proxy(d) >> pool == 7
    assert d["from_node"] in range(4)


def test_async_forms(pool: sky.Compute) -> None:
    import asyncio

    async def main() -> tuple[object, ...]:
        c = pool.counter("async")
        await c.increment_async(3)
        d = pool.dict("async")
        await d.set_async("k", "v")
        q = pool.queue("async")
        await q.put_async(1)
        async with pool.lock("async"):
            locked = pool.lock("async").locked()
        return await c.value_async(), await d.get_async("k"), await q.get_async(), locked

    assert asyncio.run(main()) == (3, "v", 1, True)


def test_bad_arguments_are_refused_early(pool: sky.Compute) -> None:
    with pytest.raises(sky.ConfigurationError, match="consistency"):
        sky.dict("x", consistency="weak")  # type: ignore[arg-type]
    with pytest.raises(sky.ConfigurationError, match="name"):
        pool.counter("")
    with pytest.raises(sky.ConfigurationError, match="parties"):
        pool.barrier("b", 0)
    with pytest.raises(sky.ConfigurationError, match="timeout"):
        pool.queue("q").get(timeout=-1)


@sky.function
def newer_names(name: str) -> tuple[object, ...]:
    """Skyward's newer guide's names, on a node."""
    steps = sky.counter(name)
    steps.add()
    work = sky.queue(name)
    work.offer("t")
    seen = sky.set(name)
    seen.add("a")
    seen.remove("a")
    seen.remove("absent")  # no error
    models = sky.registry(name)
    models.register(3, "model-3")
    return steps.get(), work.poll(), work.poll(), "a" in seen, models.lookup(3)


def test_skywards_newer_names(pool: sky.Compute) -> None:
    assert newer_names("newer") >> pool == (1, "t", None, False, "model-3")
    r = pool.registry("newer")
    assert r.list() == [3] and r.lookup(4) is None
    r.unregister(3)
    assert r.list() == []
    d = pool.dict("newer")
    d.update(a=1, b=2)
    assert sorted(d.items()) == [("a", 1), ("b", 2)]
    d.clear()
    assert len(d) == 0
    s = pool.set("newer")
    s.add(1)
    s.clear()
    assert len(s) == 0
    q = pool.queue("newer")
    q.offer(1)
    q.clear()
    assert q.poll() is None
    assert meet("parties", 4) @ pool == [4, 4, 4, 4]
    assert sky.barrier("b", parties=2).n == 2 and pool.barrier("b", parties=3).n == 3
    with pytest.raises(sky.ConfigurationError, match="parties"):
        pool.barrier("b")


def test_a_locks_lease_ends_and_a_bounded_wait_gives_up(pool: sky.Compute) -> None:
    leased = pool.lock("leased", ttl=0.2)
    assert leased.acquire()
    waiting = pool.lock("leased", timeout=60)
    assert waiting.acquire()  # taken once the lease ended
    bounded = pool.lock("leased", timeout=0.05)
    with pytest.raises(RuntimeError, match="not acquired within"), bounded:
        pass
    waiting.release()


# -- no cluster pool --------------------------------------------------------------------------
def test_outside_a_pool_a_clear_error() -> None:
    """In a fresh interpreter (this module's pool is open here)."""
    code = "import flotilla as sky\nsky.counter('c').increment()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert "ClusterRequiredError: distributed collections live in a pool" in done.stderr


def test_without_cluster_mode_a_clear_error() -> None:
    with sky.Compute(nodes=1, options=sky.Options(cluster=False)) as p:
        with pytest.raises(sky.ConfigurationError, match="cluster"):
            p.counter("c")
        with pytest.raises(sky.ConfigurationError, match="cluster"):
            int(sky.counter("c"))
        with pytest.raises(sky.ConfigurationError, match="cluster"):  # raised on the node
            collection_in_task() >> p


def test_without_a_cluster_skywards_runtime_error() -> None:
    """Skyward raises RuntimeError there: so does flotilla, on the client and on a node."""
    assert issubclass(sky.ClusterRequiredError, sky.ConfigurationError)
    with sky.Compute(nodes=1, options=sky.Options(cluster=False)) as p:
        with pytest.raises(RuntimeError, match="cluster"):
            sky.dict("d")["k"] = 1
        with pytest.raises(RuntimeError, match="cluster"):
            p.queue("q")
        with pytest.raises(sky.ClusterRequiredError, match="cluster"):  # raised on the node
            collection_in_task() >> p


def _name_every_collection() -> list[str]:
    """Only name each kind of collection (no operation); what each raised."""
    makers = [
        lambda: sky.dict("d"),
        lambda: sky.counter("c"),
        lambda: sky.set("s"),
        lambda: sky.queue("q"),
        lambda: sky.barrier("b", n=2),
        lambda: sky.lock("l"),
        lambda: sky.registry("r"),
    ]
    raised = []
    for make in makers:
        try:
            make()
            raised.append("nothing")
        except RuntimeError as e:
            raised.append(f"{type(e).__name__}: {e}")
    return raised


@sky.function
def names_every_collection() -> list[str]:
    return _name_every_collection()


def test_naming_a_collection_in_a_standalone_pool_raises_at_once() -> None:
    """As Skyward's guide says: ``sky.dict()`` itself (not only a later operation) raises
    RuntimeError in a standalone pool, on the client and inside a task."""
    expected = "ClusterRequiredError: distributed collections need a cluster pool"
    with sky.Compute(nodes=1, options=sky.Options(cluster=False)) as p:
        on_client = _name_every_collection()
        on_node = names_every_collection() >> p
    assert len(on_client) == 7 and all(r.startswith(expected) for r in on_client), on_client
    assert len(on_node) == 7 and all(r.startswith(expected) for r in on_node), on_node


# -- a node lost mid-use ------------------------------------------------------------------------
@sky.function
def hold_the_lock() -> None:
    """The first attempt takes the lock, says so, and waits for ever (its node is killed)."""
    if sky.counter("attempts").increment() > 1:
        return
    sky.lock("held").acquire()
    sky.queue("holding").put(sky.instance_info().node)
    sky.queue("never").get()


def test_a_node_killed_mid_use_loses_nothing_stored_and_frees_its_lock() -> None:
    with sky.Compute(nodes=2) as p:
        p.dict("kept")["before"] = 1
        increment("kills", 100) @ p
        pending = hold_the_lock() > p
        rank = p.queue("holding").get(timeout=60)
        assert rank in (0, 1)
        assert p.lock("held").locked()
        os.kill(int(p._nodes[rank].hello_info["pid"]), signal.SIGKILL)
        assert p.lock("held").acquire(timeout=60)  # released with its node
        p.lock("held").release()
        try:
            pending.result(timeout=120)
        except sky.NodeLostError:
            pass
        assert p.dict("kept")["before"] == 1 and int(p.counter("kills")) == 200
        increment("kills", 100) @ p  # the survivors and the replacement still reach them
        assert int(p.counter("kills")) == 400


@sky.function
def take_the_lock_and_die() -> None:
    import os

    sky.lock("crash").acquire()
    os._exit(3)


def test_a_crashed_process_releases_its_locks(pool: sky.Compute) -> None:
    with pytest.raises(sky.WorkerDiedError):
        take_the_lock_and_die() >> pool
    assert pool.lock("crash").acquire(timeout=60)  # released when its process ended
    pool.lock("crash").release()


# -- real SSH hosts -----------------------------------------------------------------------------
def test_collections_across_ssh_hosts(ssh_lab: Lab) -> None:
    with sky.Compute(provider=ssh_lab.provider(ssh_lab.hosts[:3]), nodes=3) as p:
        assert sorted(increment("ssh", 300) @ p) == [0, 1, 2]
        assert int(p.counter("ssh")) == 900
        assert meet("ssh-meet", 3) @ p == [3, 3, 3]
        add_under_lock("ssh-lock", 50) @ p
        assert p.dict("ssh-lock")["total"] == 150
