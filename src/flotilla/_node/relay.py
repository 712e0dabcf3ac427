"""The agent's side of a broadcast that fans out: large payloads relayed from node to node
(standard library only; the client's side is ``_client/fanout.py``).

A broadcast of a large argument to many remote nodes would cost the client one upload per
node. Instead the client sends the payload to one node (BLOB frames over its own channel)
and tells every other node where to fetch it (FETCH: the payload's reference, that is its
sha256 and the broadcast's number, its size, and a parent node's address and relay port);
the nodes form a tree in which each fetches from its parent over TCP while the parent is
still receiving (the bytes flow on as they come). The calls refer to the payload by its
reference (TASKREF) and wait on the node until it is there and checked; the executors map
it from a shared-memory file of the node when there is one (no copy through their pipes).

Trust:

* **Authenticated channels.** Each agent of a remote pool listens on a relay port (opened
  when the client's CONFIG gives a per-pool key, never on the client's own machine). A
  connection must prove it knows the key before a byte of payload flows, and the parent
  proves it too (HMAC-SHA256 challenge-response over both sides' nonces and the hash asked
  for); a connection that fails either proof is closed. The key travels only over the
  client's own channels (SSH).
* **Integrity at every hop.** Each node hashes what it receives (sha256) and uses it only
  if it matches the hash the client sent it over its own channel: bytes from a tampered or
  broken relay are never run.
* **The tree is an optimisation.** A fetch that fails (the parent died or is unreachable,
  its bytes do not match, nothing came for a while) is reported to the client (HAVE with
  ``ok: false``), which then sends this node the payload itself; the node's own children
  go on fetching from it meanwhile. Every node ends with the payload or is lost.

Memory: a payload's shared-memory file is not removed when its broadcast ends if no
process maps it any more (each call's executor says so in its RESULT,
``frames.UNMAPPED``): the node keeps it (:class:`Segments`, mapped, its pages already
there) and receives the next payload of the same size into it, which saves allocating,
zeroing, faulting in and freeing its pages per broadcast. A file a call may still see (a
task kept the array, forked, died or was cancelled) is removed as before: a later
broadcast never changes what a call sees.

Relay handshake (child connects to parent)::

    child:  MAGIC(8) | child nonce(16) | reference(40)
    parent: parent nonce(16) | HMAC(key, "parent" | child nonce | parent nonce | reference)
    child:  HMAC(key, "child" | child nonce | parent nonce | reference)
    parent: size u64 | the payload's bytes, as the parent has them
"""

from __future__ import annotations

import _socket
import errno
import mmap
import os
import struct
import time
from collections.abc import Callable

from .._system import fastjson as json
from .._wire.frames import TASK_HEAD, UNMAPPED, Body, Buffer, Kind, Status, frame
from .eventloop import Outbox, Poller

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from typing import Any

MAGIC = b"FLRELAY1"
NONCE = 16
REF = 40
"""A payload's reference: its sha256 (32 bytes), then the client's number of its broadcast
(u64: two broadcasts of the same bytes never share a node's copy, nor its drop)."""
MAC = 32
HELLO_SIZE = len(MAGIC) + NONCE + REF
PROOF_SIZE = NONCE + MAC  # the parent's nonce and MAC
BLOB_HEAD = struct.Struct("<40sQ")
"""Start of a BLOB frame's body: the payload's reference and the offset of the bytes after."""
SIZE = struct.Struct("<Q")
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a connection to the relay port gets to authenticate."""
STALL_TIMEOUT = 30.0
"""Seconds a relay connection may go without progress before it is given up (a fetch: the
client is asked for the payload instead)."""
MAX_UNAUTHENTICATED = 256
"""Connections still proving themselves, at most; more are closed at once."""
_SEND_MAX = 4 << 20
SHM_DIR = "/dev/shm"
KEEP_SEGMENTS = 2
"""Shared-memory files a node keeps for the next payloads, at most (see :class:`Segments`)."""
KEEP_IDLE = 60.0
"""Seconds a kept file waits for a next payload before it is removed (an idle node gives
its shared memory back)."""


def mac(key: bytes, role: bytes, child: bytes, parent: bytes, ref: bytes) -> bytes:
    """The proof of ``role`` (b"parent" or b"child") in the handshake of a relay
    connection."""
    import hashlib
    import hmac

    return hmac.new(key, role + child + parent + ref, hashlib.sha256).digest()


def _same(a: bytes, b: bytes) -> bool:
    """``a == b`` in constant time. hashlib and hmac (OpenSSL's start) are imported on the
    first broadcast, not when the agent starts: most pools never relay a payload."""
    import hmac

    return hmac.compare_digest(a, b)


def _sha256() -> Any:
    import hashlib

    return hashlib.sha256()


class Blob:
    """A payload on this node: being received (from a parent or the client), or whole."""

    __slots__ = (
        "buf",
        "complete",
        "filled",
        "hasher",
        "mapped",
        "name",
        "ref",
        "servers",
        "size",
        "source",
        "tasks",
        "unsure",
        "via",
    )

    def __init__(self, ref: bytes) -> None:
        self.ref = ref
        self.size = -1  # not known yet (a child asked before the client announced it)
        self.buf: bytearray | mmap.mmap = bytearray()
        self.name = ""  # the shared-memory file that holds it (else it is in ``buf`` alone)
        self.filled = 0
        self.hasher = _sha256()
        self.complete = False
        self.source: Fetch | None = None
        self.servers: list[Serve] = []
        self.tasks: list[tuple[int, bytes]] = []  # TASKREFs waiting: (task id, TASK_HEAD)
        self.via = ""
        self.mapped: set[int] = set()  # calls given its file, not yet answered UNMAPPED
        self.unsure = False  # a call answered without UNMAPPED: its file may still be seen

    def restart(self, size: int, via: str, shm_prefix: str, kept: Segments) -> None:
        """Receive the payload again from its first byte (``via``: from whom), into a
        shared-memory file named with ``shm_prefix`` (one of ``kept`` if it fits) when one
        can be made."""
        if self.size != size:
            self.unlink()
            made = kept.take(size, shm_prefix) if shm_prefix and size else bytearray(size)
            if isinstance(made, tuple):
                self.name, self.buf = made
            else:
                self.buf = made
            self.size = size
        self.filled = 0
        self.hasher = _sha256()
        self.via = via

    def unlink(self) -> None:
        """Remove its shared-memory file (the processes that mapped it keep their view)."""
        if self.name:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except OSError:
                pass
            self.name = ""

    def reusable(self) -> bool:
        """Whether its file can take another payload: every call given it unmapped it."""
        return bool(self.name) and not self.mapped and not self.unsure

    def release(self, kept: Segments) -> None:
        """Its broadcast ended here: its file goes to ``kept`` when no process maps it any
        more, else it is removed."""
        if self.reusable():
            assert isinstance(self.buf, mmap.mmap)
            kept.give(self.name, self.buf)
            self.name = ""
        else:
            self.unlink()
        self.buf = bytearray()
        self.size = -1


class Segments:
    """The shared-memory files (mapped) a node keeps for its next payloads: at most
    :data:`KEEP_SEGMENTS` and a quarter of ``/dev/shm``, each for :data:`KEEP_IDLE` s.

    A payload of a size one of them has goes into it (no new pages: none to zero, fault
    in or free, and no full ``/dev/shm`` can fail the writes); a larger one is cut to a
    smaller payload's size (the pages beyond are freed). Only files no process maps any
    more are given back (:meth:`Blob.release`)."""

    def __init__(self) -> None:
        self.kept: list[tuple[str, mmap.mmap, float]] = []  # (name, mapping, kept at)
        self._cap = -1

    def take(self, size: int, prefix: str) -> tuple[str, mmap.mmap] | bytearray:
        """A file of ``size`` bytes and its mapping, kept or new (see :func:`_shared`)."""
        fits = [k for k in self.kept if len(k[1]) >= size]
        if fits:
            found = min(fits, key=lambda k: len(k[1]))
            self.kept.remove(found)
            name, mapping, _ = found
            try:
                if len(mapping) != size:
                    mapping.resize(size)  # truncates the file too: its pages beyond are freed
                return name, mapping
            except (OSError, ValueError, SystemError, BufferError):
                self._remove(name, mapping)
        return _shared(size, prefix)

    def give(self, name: str, mapping: mmap.mmap) -> None:
        """Keep ``name`` (mapped by ``mapping``) for a later payload; the oldest kept go
        beyond the limits."""
        if self._cap < 0:
            try:
                st = os.statvfs(SHM_DIR)
                self._cap = st.f_blocks * st.f_frsize // 4
            except OSError:
                self._cap = 0
        self.kept.append((name, mapping, time.monotonic()))
        while self.kept and (
            len(self.kept) > KEEP_SEGMENTS or sum(len(k[1]) for k in self.kept) > self._cap
        ):
            self._remove(*self.kept.pop(0)[:2])

    def next_deadline(self, default: float) -> float:
        return min([default, *(k[2] + KEEP_IDLE for k in self.kept)])

    def trim(self, now: float) -> None:
        """Remove the files kept for more than :data:`KEEP_IDLE` s by ``now``."""
        for k in [k for k in self.kept if now - k[2] > KEEP_IDLE]:
            self.kept.remove(k)
            self._remove(k[0], k[1])

    def close(self) -> None:
        for name, mapping, _ in self.kept:
            self._remove(name, mapping)
        self.kept = []

    @staticmethod
    def _remove(name: str, mapping: mmap.mmap) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass
        try:
            mapping.close()
        except BufferError:  # (cannot be: nothing views a kept file)
            pass


def _shared(size: int, prefix: str) -> tuple[str, mmap.mmap] | bytearray:
    """A new shared-memory file of ``size`` bytes, its space reserved, and its mapping;
    a plain buffer when none can be made (no ``/dev/shm``, or too small)."""
    name = f"{prefix}{os.urandom(8).hex()}"
    path = os.path.join(SHM_DIR, name)
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return bytearray(size)
    try:
        os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here, not as a SIGBUS later
        mapping = mmap.mmap(fd, size)
    except OSError:
        os.unlink(path)
        return bytearray(size)
    finally:
        os.close(fd)
    return name, mapping


class _Conn:
    """A relay connection: its socket and when it is given up."""

    def __init__(self, relay: Relay, sock: socket.socket, timeout: float) -> None:
        self.relay = relay
        self.sock = sock
        self.fd = sock.fileno()
        self.inbuf = bytearray()
        self.deadline = time.monotonic() + timeout
        self.closed = False

    def watch(self, write: bool, callback: Callable[[], object]) -> None:
        sel = self.relay.sel
        sel.unregister(self.fd)
        sel.register(self.fd, write, callback)

    def unwatch(self) -> None:
        self.relay.sel.unregister(self.fd)

    def take(self, need: int) -> bytes | None:
        """Read towards ``need`` bytes in ``inbuf``; those bytes once there (else None).
        Raises ConnectionError at end of stream."""
        try:
            data = self.sock.recv(need - len(self.inbuf))
        except BlockingIOError:
            return None
        if not data:
            raise ConnectionError("the connection was closed")
        self.inbuf += data
        if len(self.inbuf) < need:
            return None
        out, self.inbuf = bytes(self.inbuf), bytearray()
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.unwatch()
        self.relay.conns.discard(self)
        try:
            self.sock.close()
        except OSError:
            pass


class Serve(_Conn):
    """A child's connection to this node's relay port: it proves itself, then gets the
    payload it asked for, as this node has it."""

    def __init__(self, relay: Relay, sock: socket.socket) -> None:
        super().__init__(relay, sock, HANDSHAKE_TIMEOUT)
        self.state = "hello"
        self.child_nonce = b""
        self.parent_nonce = b""
        self.ref = b""
        self.blob: Blob | None = None
        self.head = b""  # the size, not sent yet
        self.sent = 0
        self.watch(False, self.on_read)

    def on_read(self) -> None:
        try:
            if self.state == "hello":
                got = self.take(HELLO_SIZE)
                if got is None:
                    return
                if got[: len(MAGIC)] != MAGIC:
                    raise ConnectionError("not a relay connection")
                self.child_nonce = got[len(MAGIC) : len(MAGIC) + NONCE]
                ref = got[len(MAGIC) + NONCE :]
                self.parent_nonce = os.urandom(NONCE)
                proof = mac(self.relay.key, b"parent", self.child_nonce, self.parent_nonce, ref)
                self.sock.sendall(self.parent_nonce + proof)  # 48 bytes into an empty buffer
                self.ref = ref
                self.state = "proof"
                return
            got = self.take(MAC)
            if got is None:
                return
            want = mac(self.relay.key, b"child", self.child_nonce, self.parent_nonce, self.ref)
            if not _same(got, want):
                raise ConnectionError("the child's proof is wrong")
        except OSError:
            self.close()  # refused: unauthenticated, tampered with, or gone
            return
        self.state = "serve"
        self.deadline = time.monotonic() + self.relay.stall
        self.unwatch()
        blob = self.relay.blob(self.ref)
        self.blob = blob
        blob.servers.append(self)
        self.wake()

    def wake(self) -> None:
        """The payload grew (or its size became known): send what there is."""
        blob = self.blob
        if self.closed or blob is None or blob.size < 0:
            return
        if self.sent == 0 and not self.head and self.state == "serve":
            self.head = SIZE.pack(blob.size)
            self.state = "sending"
        if (self.head or self.sent < blob.filled) and self.fd not in self.relay.sel:
            self.watch(True, self.on_write)

    def on_write(self) -> None:
        blob = self.blob
        assert blob is not None
        try:
            while True:
                if self.head:
                    n = self.sock.send(self.head)
                    self.head = self.head[n:]
                    if self.head:
                        return
                    continue
                if self.sent >= blob.filled:
                    break
                end = min(blob.filled, self.sent + _SEND_MAX)
                n = self.sock.send(memoryview(blob.buf)[self.sent : end])
                self.sent += n
                self.deadline = time.monotonic() + self.relay.stall
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        if self.sent >= blob.size:  # all of it: the child checks it
            if self in blob.servers:
                blob.servers.remove(self)
            self.close()
            return
        self.unwatch()  # wait until more arrives here (wake)

    def close(self) -> None:
        if self.blob is not None and self in self.blob.servers:
            self.blob.servers.remove(self)
        super().close()


class Fetch(_Conn):
    """This node's connection to its parent, fetching a payload."""

    def __init__(self, relay: Relay, blob: Blob, addr: tuple[str, int]) -> None:
        import socket

        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        super().__init__(relay, sock, relay.stall)
        self.blob = blob
        self.addr = addr
        self.state = "connect"
        self.nonce = os.urandom(NONCE)
        code = sock.connect_ex(addr)
        if code not in (0, errno.EINPROGRESS):
            raise OSError(code, os.strerror(code))
        self.watch(True, self.on_connected)

    def on_connected(self) -> None:
        import socket

        code = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            self.fail(f"cannot connect to {self.addr[0]}:{self.addr[1]}: {os.strerror(code)}")
            return
        try:
            self.sock.sendall(MAGIC + self.nonce + self.blob.ref)
        except OSError as e:
            self.fail(f"the parent {self.addr[0]} closed the connection ({e})")
            return
        self.state = "proof"
        self.watch(False, self.on_read)

    def on_read(self) -> None:
        blob = self.blob
        try:
            if self.state == "proof":
                got = self.take(PROOF_SIZE)
                if got is None:
                    return
                parent_nonce, proof = got[:NONCE], got[NONCE:]
                want = mac(self.relay.key, b"parent", self.nonce, parent_nonce, blob.ref)
                if not _same(proof, want):
                    self.fail(f"the parent {self.addr[0]} failed to authenticate")
                    return
                proof = mac(self.relay.key, b"child", self.nonce, parent_nonce, blob.ref)
                self.sock.sendall(proof)
                self.state = "size"
                self._progress()
                return
            if self.state == "size":
                got = self.take(SIZE.size)
                if got is None:
                    return
                if SIZE.unpack(got)[0] != blob.size:
                    self.fail(f"the parent {self.addr[0]} announced another size")
                    return
                self.state = "data"
                self._progress()
                return
        except BlockingIOError:
            return
        except OSError as e:
            self.fail(f"the connection to the parent {self.addr[0]} broke ({e})")
            return
        # the payload's bytes: all there are now (one pass of the loop for many reads)
        view = memoryview(blob.buf)
        start = end = blob.filled
        closed = ""
        while end < blob.size:
            try:
                n = self.sock.recv_into(view[end : blob.size])
            except BlockingIOError:
                break
            except OSError as e:
                closed = f"the connection to the parent {self.addr[0]} broke ({e})"
                break
            if n == 0:
                closed = f"the parent {self.addr[0]} closed the connection after {end} bytes"
                break
            end += n
        del view
        if end > start:
            self._progress()
            self.relay.grew(blob, end - start)
        if closed and not blob.complete and blob.source is self:
            self.fail(closed)

    def _progress(self) -> None:
        self.deadline = time.monotonic() + self.relay.stall

    def fail(self, why: str) -> None:
        self.close()
        if self.blob.source is self:
            self.blob.source = None
            self.relay.report(self.blob, False, why)

    def expire(self) -> None:
        self.fail(f"nothing came from the parent {self.addr[0]} for {self.relay.stall:g} s")


class Relay:
    """The node's payloads and relay connections (see the module docstring).

    Args:
        sel: the agent's poller.
        client: the agent's outbox to the client (HAVE frames).
        submit: gives a task (id, its TASK_HEAD, the frame for its executor) to the
            executors.

    Attributes:
        shm_prefix: names of the shared-memory files that hold payloads (empty: none):
            an executor maps the file instead of receiving the payload through its pipe.
    """

    def __init__(
        self, sel: Poller, client: Outbox, submit: Callable[[int, bytes, list[Buffer]], None]
    ) -> None:
        self.sel = sel
        self.client = client
        self.submit = submit
        self.key = b""
        self.shm_prefix = ""
        self.stall = STALL_TIMEOUT
        self.listener: _socket.socket | None = None  # a socket.socket once it accepted
        self.blobs: dict[bytes, Blob] = {}
        self.conns: set[_Conn] = set()
        self.kept = Segments()
        self.mapping: dict[int, Blob] = {}  # calls given a payload's file, until answered

    # -- the relay port -------------------------------------------------------------------
    def listen(self, key: bytes) -> int:
        """Open the relay port (every address of the node, IPv6 and IPv4 where it can);
        its number. What ``socket.create_server`` does, with ``_socket``: an agent opens it
        at CONFIG, and ``socket``, whose import makes its enums (~2.5 ms of a node's
        start), is imported once a connection comes (:meth:`_accept`)."""
        self.key = key
        try:
            sock = _socket.socket(_socket.AF_INET6, _socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            sock = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        else:
            try:
                sock.setsockopt(_socket.IPPROTO_IPV6, _socket.IPV6_V6ONLY, 0)  # IPv4 too
            except OSError:  # an IPv6 socket that cannot take IPv4: IPv4 alone
                sock.close()
                sock = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        try:
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
            sock.bind(("", 0))
            sock.listen()
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.listener = sock
        self.sel.register(sock.fileno(), False, self._accept)
        return int(sock.getsockname()[1])

    def _accept(self) -> None:
        import socket

        assert self.listener is not None
        listener = self.listener
        if not isinstance(listener, socket.socket):  # the first connection: ``accept``'s
            listener = self.listener = socket.socket(fileno=listener.detach())
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of descriptors: the child falls back to the client
                return
            sock.setblocking(False)
            if self._unauthenticated() >= MAX_UNAUTHENTICATED:
                sock.close()
                continue
            self.conns.add(Serve(self, sock))

    def _unauthenticated(self) -> int:
        return sum(1 for c in self.conns if isinstance(c, Serve) and c.state in ("hello", "proof"))

    def fds(self) -> list[int]:
        """The relay's descriptors (closed in a forked executor)."""
        out = [c.fd for c in self.conns if not c.closed]
        if self.listener is not None:
            out.append(self.listener.fileno())
        return out

    # -- what the client sends ------------------------------------------------------------
    def blob(self, ref: bytes) -> Blob:
        found = self.blobs.get(ref)
        if found is None:
            found = self.blobs[ref] = Blob(ref)
        return found

    def fetch(self, _: int, body: Body) -> None:
        """FETCH: get a payload from a parent node, or (no parent) from the client's BLOB
        frames that follow."""
        info: dict[str, Any] = json.loads(bytes(body))
        blob = self.blob(bytes.fromhex(info["ref"]))
        if blob.complete:
            self.report(blob, True)
            return
        if blob.source is not None:
            blob.source.close()
            blob.source = None
        parent = info.get("parent")
        blob.restart(int(info["size"]), "relay" if parent else "client", self.shm_prefix, self.kept)
        for srv in blob.servers:
            srv.wake()
        if parent:
            try:
                conn = Fetch(self, blob, (str(parent[0]), int(parent[1])))
            except OSError as e:
                self.report(blob, False, f"cannot connect to {parent[0]}:{parent[1]}: {e}")
                return
            blob.source = conn
            self.conns.add(conn)

    def chunk(self, _: int, body: Body) -> None:
        """BLOB: bytes of a payload from the client (announced by a FETCH without parent)."""
        ref, offset = BLOB_HEAD.unpack_from(body)
        blob = self.blobs.get(ref)
        if blob is None or blob.complete or blob.source is not None or blob.size < 0:
            return
        data = memoryview(body)[BLOB_HEAD.size :]
        if offset != blob.filled or offset + data.nbytes > blob.size:
            return  # not the continuation of the stream (cannot happen on an ordered channel)
        blob.buf[offset : offset + data.nbytes] = data
        self.grew(blob, data.nbytes)

    def task(self, ident: int, body: Body) -> None:
        """TASKREF: a call whose arguments are a payload, by its hash: run it once the
        payload is here (the client sends it itself when it is not coming)."""
        head = bytes(body[: TASK_HEAD.size])
        ref = bytes(body[TASK_HEAD.size : TASK_HEAD.size + REF])
        blob = self.blobs.get(ref)
        if blob is not None and blob.complete:
            self._submit(ident, head, blob)
            return
        if blob is None:  # never announced, or dropped
            blob = self.blob(ref)
            self.report(blob, False, "this node does not have the payload")
        blob.tasks.append((ident, head))

    def cancel(self, ident: int) -> bool:
        """CANCEL of a call still waiting for its payload: it ends CANCELLED (True)."""
        for blob in self.blobs.values():
            for i, (waiting, _) in enumerate(blob.tasks):
                if waiting == ident:
                    del blob.tasks[i]
                    self.client.send(frame(Kind.RESULT, ident, bytes((Status.CANCELLED,))))
                    return True
        return False

    def abort(self, cause: bytes) -> None:
        """RESTART of the pool's processes: the calls waiting for a payload end ABORTED,
        as the queued ones do."""
        for blob in self.blobs.values():
            tasks, blob.tasks = blob.tasks, []
            for ident, _ in tasks:
                self.client.send(frame(Kind.RESULT, ident, bytes((Status.ABORTED,)), cause))

    def drop(self, _: int, body: Body) -> None:
        """DROP: the payload is no longer needed here (its calls ended)."""
        blob = self.blobs.pop(bytes(body[:REF]), None)
        if blob is None:
            return
        for conn in [*blob.servers, *([blob.source] if blob.source else [])]:
            conn.close()
        for ident in blob.mapped:  # never answered by its executor (e.g. it died)
            self.mapping.pop(ident, None)
        blob.release(self.kept)

    def answered(self, ident: int, status: int) -> None:
        """An executor's RESULT of call ``ident`` (``status``, its first byte): a call
        given a payload's file says whether it unmapped it (see :meth:`Blob.release`)."""
        blob = self.mapping.pop(ident, None)
        if blob is None:
            return
        blob.mapped.discard(ident)
        if not status & UNMAPPED:
            blob.unsure = True

    # -- progress -------------------------------------------------------------------------
    def grew(self, blob: Blob, n: int) -> None:
        """``n`` more bytes of ``blob`` arrived: hash them, pass them on, check the whole."""
        start = blob.filled
        blob.filled += n
        blob.hasher.update(memoryview(blob.buf)[start : blob.filled])
        for srv in blob.servers:
            srv.wake()
        if blob.filled < blob.size:
            return
        source, blob.source = blob.source, None
        if source is not None:
            source.close()
        if not _same(blob.hasher.digest(), blob.ref[:32]):
            self.report(blob, False, f"the payload's sha256 does not match (via {blob.via})")
            return
        blob.complete = True
        self.report(blob, True)
        tasks, blob.tasks = blob.tasks, []
        for ident, head in tasks:
            self._submit(ident, head, blob)

    def _submit(self, ident: int, head: bytes, blob: Blob) -> None:
        if blob.name:  # the executor maps the file
            blob.mapped.add(ident)
            self.mapping[ident] = blob
            self.submit(ident, head, frame(Kind.TASKREF, ident, head, blob.name.encode()))
        else:
            self.submit(ident, head, frame(Kind.TASK, ident, head, memoryview(blob.buf)))

    def report(self, blob: Blob, ok: bool, why: str = "") -> None:
        info = {"ref": blob.ref.hex(), "ok": ok, "via": blob.via, "why": why}
        self.client.send(frame(Kind.HAVE, 0, json.dumps(info).encode()))

    # -- time -----------------------------------------------------------------------------
    def next_deadline(self, default: float) -> float:
        if not self.conns and not self.kept.kept:  # (no relay in use: each wake-up asks)
            return default
        wake = self.kept.next_deadline(default)
        for conn in self.conns:
            wake = min(wake, conn.deadline)
        return wake

    def check(self, now: float) -> None:
        """Give up the connections past their deadline; remove the files kept too long."""
        self.kept.trim(now)
        for conn in [c for c in self.conns if c.deadline <= now]:
            if isinstance(conn, Fetch):
                conn.expire()
            else:
                conn.close()

    def close(self) -> None:
        for conn in list(self.conns):
            conn.close()
        for blob in self.blobs.values():
            blob.unlink()
        self.kept.close()
        if self.listener is not None:
            self.sel.unregister(self.listener.fileno())
            self.listener.close()
            self.listener = None
