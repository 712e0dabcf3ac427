"""Broadcasts that fan out (``_client/fanout.py``, ``_node/relay.py``) on real sshd test
hosts: a large payload goes from the client to one node and from node to node in a tree,
over authenticated connections, checked (sha256) at every hop; a failed hop falls back to
the client sending that node the payload itself."""

from __future__ import annotations

import hashlib
import hmac
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from typing import Any

import pytest
from _hosts import Lab, lab_unavailable
from _procs import wait_until

import flotilla as sky
from flotilla._client import fanout
from flotilla._client.compute import Compute
from flotilla._node import relay

HOSTS = 7  # a tree of degree 2: 0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 6

pytestmark = pytest.mark.timeout(300)


@sky.function
def digest(data: Any) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


@sky.function
def where_and_digest(data: Any) -> tuple[int, str]:
    return sky.instance_info().node, hashlib.sha256(memoryview(data)).hexdigest()


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    with Lab() as lab:
        lab.add_hosts(HOSTS)
        yield lab


@pytest.fixture(autouse=True)
def binary_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "DEGREE", 2)
    monkeypatch.setattr(fanout, "CHUNK", 1 << 18)  # several BLOB frames for a small payload


def _pool(lab: Lab, **options: Any) -> Compute:
    provider = lab.provider(python=sys.executable, connect_timeout=30.0)
    opts = sky.Options(start_timeout=120.0, **options)
    return sky.Compute(provider=provider, nodes=HOSTS, options=opts)


def _payload() -> tuple[bytearray, str]:
    data = bytearray(os.urandom(3 << 20))
    return data, hashlib.sha256(data).hexdigest()


def _key(pool: Compute) -> bytes:
    return bytes.fromhex(pool._bringup.relay_key)


def test_a_large_broadcast_reaches_every_node_through_the_tree(lab: Lab) -> None:
    data, want = _payload()
    with _pool(lab) as pool:
        assert all(fanout.eligible(n) for n in pool._nodes)
        # in rank order, as every broadcast (the root is sent to last)
        assert where_and_digest(data) @ pool == [(r, want) for r in range(HOSTS)]
        ref = _ref_of(pool)
        # the root from the client, every other node from its parent, each one checked
        assert [n.have[ref]["via"] for n in pool._nodes] == ["client"] + ["relay"] * (HOSTS - 1)
        assert all(n.have[ref]["ok"] for n in pool._nodes)
        assert not any(n.relay_failures for n in pool._nodes)
        # small payloads keep the direct path
        assert digest(b"small") @ pool == [hashlib.sha256(b"small").hexdigest()] * HOSTS
        assert [len(n.have) for n in pool._nodes] == [1] * HOSTS
        # the payload is dropped once the broadcast ended; the next ones fan out again, two
        # at once of the same bytes too (each broadcast has its own copy on the nodes)
        assert wait_until(lambda: not any(n.blobs for n in pool._nodes))
        first, second = (pool.submit_broadcast(digest(data)) for _ in range(2))
        assert [f.result() for f in first + second] == [want] * (2 * HOSTS)
        assert [len(n.have) for n in pool._nodes] == [3] * HOSTS
        assert all(info["ok"] for n in pool._nodes for info in n.have.values())


def test_a_relay_killed_mid_broadcast_leaves_every_other_node_with_the_payload(
    lab: Lab,
) -> None:
    data, want = _payload()
    with _pool(lab, replace_lost_nodes=False, heartbeat_timeout=120.0) as pool:
        relay_node = pool._nodes[1]  # the parent of nodes 3 and 4
        pid = int(relay_node.hello_info["pid"])
        os.kill(pid, signal.SIGSTOP)  # it takes part in nothing until it is killed
        try:
            futures = pool.submit_broadcast(digest(data))
            others = [f for r, f in enumerate(futures) if r not in (1, 3, 4)]
            assert [f.result(timeout=120) for f in others] == [want] * (HOSTS - 3)
            # mid-broadcast: nodes 3 and 4 wait for their parent, which is stopped
            assert not futures[3].done() and not futures[4].done()
        finally:
            os.kill(pid, signal.SIGKILL)
        assert futures[3].result(timeout=120) == want
        assert futures[4].result(timeout=120) == want
        with pytest.raises(sky.NodeLostError) as lost:
            futures[1].result(timeout=120)
        assert lost.value.node == 1
        ref = _ref_of(pool)
        for rank in (3, 4):  # from the client, after the failed hop
            node = pool._nodes[rank]
            assert node.relay_failures, rank
            assert node.have[ref] == {"ref": ref, "ok": True, "via": "client", "why": ""}


def test_a_call_waiting_for_its_relayed_payload_can_be_cancelled(lab: Lab) -> None:
    data, want = _payload()
    with _pool(lab, heartbeat_timeout=120.0) as pool:
        pid = int(pool._nodes[1].hello_info["pid"])
        os.kill(pid, signal.SIGSTOP)  # nodes 3 and 4 wait for their parent
        try:
            futures = pool.submit_broadcast(digest(data))
            assert [futures[r].result(timeout=120) for r in (0, 2, 5, 6)] == [want] * 4
            pool.cancel([futures[3], futures[4]])
            for rank in (3, 4):
                with pytest.raises(CancelledError):
                    futures[rank].result(timeout=120)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert futures[1].result(timeout=120) == want  # the relay goes on where it was
        assert digest(data) @ pool == [want] * HOSTS


def test_bytes_that_do_not_match_the_hash_are_never_run(
    lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parent that authenticates but sends other bytes (a tampered relay): the child's
    sha256 check catches it, and the client sends the payload itself."""
    data, want = _payload()
    with _pool(lab) as pool:
        fake = _FakeParent(_key(pool))
        victim = pool._nodes[5]
        real = fanout.Fanout.__init__

        def planted(self: fanout.Fanout, parts: Any, nodes: Any) -> None:
            real(self, parts, nodes)
            self.parent[victim] = fake.node(lab)
            fake.size = self.size

        monkeypatch.setattr(fanout.Fanout, "__init__", planted)
        try:
            assert digest(data) @ pool == [want] * HOSTS
        finally:
            fake.close()
        assert fake.served == 1
        assert any("sha256 does not match" in why for why in victim.relay_failures)
        assert victim.have[_ref_of(pool)]["via"] == "client"


@sky.function
def mapped_file(array: Any) -> tuple[str, str]:
    """The file this node's call sees ``array`` in (from its process's memory map), and
    the array's sha256."""
    return _file_of(array), hashlib.sha256(memoryview(array)).hexdigest()


@sky.function
def keep(array: Any) -> tuple[str, str]:
    """As :func:`mapped_file`, and keep ``array`` in a module global of the node."""
    sys.modules.setdefault("_kept_by_the_test", type(sys)("_kept_by_the_test")).array = array  # type: ignore[attr-defined]
    return _file_of(array), hashlib.sha256(memoryview(array)).hexdigest()


@sky.function
def kept_digest() -> str:
    """The sha256 of the array :func:`keep` kept, as this node's process sees it now."""
    return hashlib.sha256(memoryview(sys.modules["_kept_by_the_test"].array)).hexdigest()  # type: ignore[attr-defined]


def _file_of(array: Any) -> str:
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def test_a_nodes_payload_file_takes_the_next_broadcast_only_once_no_call_sees_it(
    lab: Lab,
) -> None:
    """A relayed payload's file is kept for the next broadcast of its size (no new pages
    to allocate and free) when its calls unmapped it; a file a call still sees (a task
    kept the array) is never written again: that call's array stays as it was."""
    np = pytest.importorskip("numpy")

    def arrays() -> tuple[Any, str]:
        array = np.frombuffer(os.urandom(3 << 20), dtype=np.uint8)
        return array, hashlib.sha256(array).hexdigest()

    with _pool(lab) as pool:

        def broadcast(fn: Any) -> tuple[list[str], str]:
            array, want = arrays()
            got = fn(array) @ pool
            assert [g[1] for g in got] == [want] * HOSTS
            assert wait_until(lambda: not any(n.blobs for n in pool._nodes))
            files = [g[0] for g in got]
            assert all("-relay-" in f for f in files), files  # a view of the node's file
            return files, want

        first, _ = broadcast(mapped_file)
        assert len(set(first)) == HOSTS
        second, _ = broadcast(mapped_file)
        assert second == first  # each node received the next payload into the same file
        kept, want_kept = broadcast(keep)
        assert kept == first
        after, _ = broadcast(mapped_file)
        # the kept array still maps its file: the next payload went into another one,
        # and the array a call kept never changes under it
        assert not set(after) & set(kept)
        assert kept_digest() @ pool == [want_kept] * HOSTS
        assert broadcast(mapped_file)[0] == after


def test_a_kept_file_is_cut_to_a_smaller_payload_and_removed_once_idle() -> None:
    """The node's kept files (``relay.Segments``): a smaller payload takes a larger kept
    file, cut to its size; a larger one gets a new file; an idle one goes; none outlives
    the relay."""
    prefix = f"flotilla-test{os.getpid()}-relay-"

    def files() -> dict[str, int]:
        return {
            n: os.stat(os.path.join(relay.SHM_DIR, n)).st_size
            for n in os.listdir(relay.SHM_DIR)
            if n.startswith(prefix)
        }

    kept = relay.Segments()
    try:
        made = kept.take(2 << 20, prefix)
        assert isinstance(made, tuple)
        name, mapping = made
        mapping[:4] = b"used"
        kept.give(name, mapping)
        again = kept.take(1 << 20, prefix)
        assert isinstance(again, tuple) and again[0] == name and len(again[1]) == 1 << 20
        assert files() == {name: 1 << 20}  # the pages beyond are given back
        kept.give(*again)
        larger = kept.take(3 << 20, prefix)
        assert isinstance(larger, tuple) and larger[0] != name
        assert files() == {name: 1 << 20, larger[0]: 3 << 20}
        kept.give(*larger)
        kept.trim(time.monotonic() + relay.KEEP_IDLE + 1)
        assert files() == {}
        last = kept.take(1 << 20, prefix)
        assert isinstance(last, tuple)
        kept.give(*last)
        assert len(files()) == 1
    finally:
        kept.close()
    assert files() == {}


def test_the_relay_port_refuses_unauthenticated_connections(lab: Lab) -> None:
    data, want = _payload()
    with _pool(lab) as pool:
        node = pool._nodes[2]
        where = (node.proc.address, int(node.ready_info["relay_port"]))
        sha = hashlib.sha256(b"anything").digest() + bytes(8)  # a payload's reference
        # not the protocol at all: closed without a word
        with socket.create_connection(where, timeout=30) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(40))
            assert _read_all(s) == b""
        # the protocol, with a proof made without the pool's key: closed, nothing served
        with socket.create_connection(where, timeout=30) as s:
            nonce = os.urandom(relay.NONCE)
            s.sendall(relay.MAGIC + nonce + sha)
            answer = _read_exactly(s, relay.PROOF_SIZE)
            parent_nonce, proof = answer[: relay.NONCE], answer[relay.NONCE :]
            wrong = relay.mac(b"not the key", b"child", nonce, parent_nonce, sha)
            s.sendall(wrong)
            assert _read_all(s) == b""
            # the node proved itself with the pool's key, which the client alone gave it
            key = _key(pool)
            assert hmac.compare_digest(proof, relay.mac(key, b"parent", nonce, parent_nonce, sha))
        # a proof of another connection (replayed) does not open this one
        with socket.create_connection(where, timeout=30) as s:
            s.sendall(relay.MAGIC + nonce + sha)
            _read_exactly(s, relay.PROOF_SIZE)  # a new parent nonce: the old proof is stale
            s.sendall(relay.mac(key, b"child", nonce, parent_nonce, sha))
            assert _read_all(s) == b""
        # the pool goes on: the agents refused those connections and nothing else
        assert digest(data) @ pool == [want] * HOSTS


def test_without_relay_no_port_opens_and_the_client_sends_every_copy(lab: Lab) -> None:
    data, want = _payload()
    with _pool(lab, relay=False) as pool:
        assert not any("relay_port" in n.ready_info for n in pool._nodes)
        assert digest(data) @ pool == [want] * HOSTS
        assert not any(n.have for n in pool._nodes)


# -- helpers ---------------------------------------------------------------------------------
def _ref_of(pool: Compute) -> str:
    """The reference of the one broadcast sent to ``pool`` that fanned out."""
    refs = {ref for n in pool._nodes for ref in n.have}
    assert len(refs) == 1, refs
    return refs.pop()


def _read_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        assert got, f"closed after {len(out)} of {n} bytes"
        out += got
    return out


def _read_all(s: socket.socket) -> bytes:
    """What comes until the peer closes the connection (or resets it: closed with what we
    sent unread)."""
    out = b""
    try:
        while got := s.recv(65536):
            out += got
    except ConnectionResetError:
        pass
    return out


class _FakeParent:
    """A relay parent on the lab's bridge that knows the pool's key and serves zeros
    instead of the payload asked for."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.size = 0
        self.served = 0
        self.sock = socket.socket()
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def node(self, lab: Lab) -> Any:
        """A stand-in for a Node as the tree's plan sees a parent."""
        port = self.sock.getsockname()[1]

        class Proc:
            address = f"{lab.subnet}.1"

        class Parent:
            proc = Proc()
            ready_info = {"relay_port": port}

        return Parent()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                hello = _read_exactly(conn, relay.HELLO_SIZE)
                nonce, sha = hello[8:24], hello[24:]
                mine = os.urandom(relay.NONCE)
                conn.sendall(mine + relay.mac(self.key, b"parent", nonce, mine, sha))
                _read_exactly(conn, 32)
                conn.sendall(relay.SIZE.pack(self.size) + bytes(self.size))
                self.served += 1

    def close(self) -> None:
        self.sock.close()
