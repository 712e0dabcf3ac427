"""The node agent: ``python -m flotilla.agent``.

Every provider starts exactly this command on every node, with the protocol on its
stdin/stdout. The agent is single-threaded and imports only the standard library, so it
starts in a few tens of milliseconds. It

* says HELLO (pid, host, boot id, a free port), then waits for CONFIG;
* forks the executor, relays frames between client and executor, and forwards the
  executor's stdout/stderr as OUTPUT frames;
* enforces per-task timeouts, replaces an executor that dies or times out (the task that
  was running gets a DIED/TIMEOUT result, the queued ones are re-sent to the new one);
* in a pool whose processes form one group (``config["group"]``: a plugin's collective,
  e.g. a torch process group), does not replace a lost executor alone, since a lone new
  process could not rejoin the group: it tells the client (BROKEN), which restarts every
  executor of the pool (RESTART: queued and running tasks end ABORTED);
* exits, stopping the executor's whole process group, on SHUTDOWN, on end of stdin (the
  client is gone), on SIGTERM, or when no frame arrived for ``heartbeat_timeout`` seconds.

Executor states (one executor at a time)::

    STARTING --READY--> RUNNING --died / timeout / cancelled--> STARTING (a new process)
    RUNNING --died / timeout / cancelled, group pool--> (none) --RESTART--> STARTING
    RUNNING | STARTING --RESTART--> STARTING (a new process)
    STARTING --failed start--> FAILED
    RUNNING | STARTING --shutdown--> STOPPING --exited--> STOPPED
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from itertools import islice
from typing import Any

from .._wire.exits import describe_exit
from .._wire.frames import HEADER, TASK_HEAD, Buffer, FrameReader, Kind, Status, frame

_STDERR_TAIL_LINES = 40
PORT_BLOCK = 64
"""HELLO's ``port`` starts a block of this many ports that were free on the node: the
head's becomes ``head_port``, and plugins use the ports after it (JAX, TensorFlow)."""
_DEFAULT_HEARTBEAT_TIMEOUT = 60.0


class ExecState(Enum):
    """Lifecycle of the executor process (transitions in the module docstring)."""

    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Poller:
    """epoll with a callback per descriptor.

    Callbacks registered ``first`` run before the others of the same wake-up: the
    executor's output pipes are drained before its results are forwarded, so a task's
    output always reaches the client before the task's result.
    """

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.callbacks: dict[int, tuple[bool, Callable[[], object]]] = {}

    def register(
        self, fd: int, write: bool, callback: Callable[[], object], first: bool = False
    ) -> None:
        self.epoll.register(fd, select.EPOLLOUT if write else select.EPOLLIN)
        self.callbacks[fd] = (first, callback)

    def unregister(self, fd: int) -> None:
        if self.callbacks.pop(fd, None) is not None:
            self.epoll.unregister(fd)

    def __contains__(self, fd: int) -> bool:
        return fd in self.callbacks

    def poll(self, timeout: float) -> list[Callable[[], object]]:
        events = self.epoll.poll(timeout)
        cbs = self.callbacks
        if len(events) == 1:
            entry = cbs.get(events[0][0])
            return [entry[1]] if entry else []
        entries = [cbs[fd] for fd, _ in events if fd in cbs]
        return [cb for first, cb in entries if first] + [cb for first, cb in entries if not first]

    def close(self) -> None:
        self.epoll.close()


class Outbox:
    """Non-blocking writer: queues what the descriptor cannot take now."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self.queue: deque[memoryview] = deque()
        self.broken = False

    def send(self, parts: list[Buffer]) -> None:
        if self.broken:
            return
        if not self.queue:  # fast path: write directly
            try:
                n = os.writev(self.fd, parts)
            except BlockingIOError:
                n = 0
            except OSError:
                self.broken = True
                return
            for p in parts:
                size = memoryview(p).nbytes
                if n >= size:
                    n -= size
                    continue
                self.queue.append(memoryview(p).cast("B")[n:])
                n = 0
            return
        self.queue.extend(memoryview(p).cast("B") for p in parts if len(p))
        self.flush()

    def flush(self) -> bool:
        """Write what fits; True when nothing is left."""
        q = self.queue
        while q and not self.broken:
            try:
                n = os.writev(self.fd, list(islice(q, 256)))
            except BlockingIOError:
                return False
            except OSError:  # the reader is gone
                self.broken = True
                q.clear()
                return True
            while n:
                if n >= q[0].nbytes:
                    n -= q.popleft().nbytes
                else:
                    q[0] = q[0][n:]
                    n = 0
        return not q


@dataclass
class Task:
    ident: int
    timeout: float
    frame: list[Buffer]
    deadline: float = 0.0
    cancelled: bool = False


@dataclass(eq=False)
class Executor:
    """One executor process and the pipes the agent holds to it."""

    slot: Slot
    pid: int
    to_fd: int
    from_fd: int
    out_fd: int
    err_fd: int
    outbox: Outbox
    reader: FrameReader = field(default_factory=FrameReader)
    state: ExecState = ExecState.STARTING
    stderr_tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=_STDERR_TAIL_LINES))
    partial_err: bytes = b""


@dataclass(eq=False)
class Slot:
    """One local rank of the node: its executor (replaced when it dies) and its tasks.

    ``tasks`` were sent to the executor in order; ``tasks[0]`` is the one running.
    """

    rank: int
    tasks: deque[Task] = field(default_factory=deque)
    executor: Executor | None = None
    restarts: int = 0
    ready: bool = False


class Agent:
    def __init__(self) -> None:
        self.proto_in = 0
        self.proto_out = os.dup(1)
        os.dup2(2, 1)  # anything printed in this process goes to stderr, not the protocol
        self.client = Outbox(self.proto_out)
        self.client_reader = FrameReader()
        self.sel = Poller()
        self.sel.register(self.proto_in, False, self._on_client)
        self.config: dict[str, Any] | None = None
        self.blob = b""
        self.defines: list[list[Buffer]] = []
        self.slots: list[Slot] = []
        self.builder: Any = None  # the environment build subprocess, while it runs
        self.last_seen = time.monotonic()
        self.heartbeat_timeout = _DEFAULT_HEARTBEAT_TIMEOUT
        self.stopping = False
        self.stop_deadline = 0.0
        self.done = False
        self.generation = 0  # of the pool's process group: RESTART frames count them
        self.cloud: Any = None  # on a cloud instance: its watchdog's contact (see cloud.py)
        if "FLOTILLA_CLOUD" in os.environ:
            from .cloud import start

            self.cloud = start()

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.begin_stop(grace=1.0))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._hello()
        try:
            while not self.done:
                for callback in self.sel.poll(self._next_wakeup()):
                    callback()
                self._check_deadlines()
                self._watch_writes()
        finally:
            self._cleanup()

    def _next_wakeup(self) -> float:
        now = time.monotonic()
        wake = self.last_seen + self.heartbeat_timeout
        for slot in self.slots:
            if slot.tasks and slot.tasks[0].deadline:
                wake = min(wake, slot.tasks[0].deadline)
        if self.stopping:
            wake = min(wake, self.stop_deadline)
        return max(0.0, wake - now)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if self.stopping:
            idle = all(s.executor is None for s in self.slots) and self.builder is None
            if idle or now >= self.stop_deadline:
                self.done = True
            return
        if now - self.last_seen > self.heartbeat_timeout:
            self._log(f"no message from the client for {self.heartbeat_timeout:.0f} s; exiting")
            self.begin_stop(grace=1.0)
            return
        for slot in self.slots:
            if slot.tasks and slot.tasks[0].deadline and now >= slot.tasks[0].deadline:
                task = slot.tasks.popleft()
                self._kill_executor(slot)
                body = json.dumps({"timeout": task.timeout}).encode()
                self.client.send(frame(Kind.RESULT, task.ident, bytes((Status.TIMEOUT,)), body))
                self._replace(slot, f"a call ran longer than its timeout of {task.timeout:g} s")

    # -- client side -------------------------------------------------------------------
    def _hello(self) -> None:
        port = free_port_block(PORT_BLOCK)
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot_id = f.read().strip()
        except OSError:
            boot_id = ""
        hello = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "boot_id": boot_id,
            "python": sys.executable,
            "python_version": ".".join(map(str, sys.version_info[:3])),
            "port": port,
        }
        self.client.send(frame(Kind.HELLO, 0, json.dumps(hello).encode()))

    def _on_client(self) -> None:
        frames = self.client_reader.read(self.proto_in)
        if frames is None:  # the client is gone
            self.sel.unregister(self.proto_in)
            self.client.broken = True
            self.begin_stop(grace=1.0)
            return
        self.last_seen = time.monotonic()
        if self.cloud is not None:
            self.cloud.touch(self.last_seen)
        for kind, ident, body in frames:
            if kind == Kind.TASK:
                timeout, local_rank = TASK_HEAD.unpack_from(body)
                slot = self.slots[local_rank]
                task = Task(ident, timeout, [HEADER.pack(kind, ident, len(body)), body])
                slot.tasks.append(task)
                if len(slot.tasks) == 1:
                    self._arm(task)
                self._to_executor(slot, task.frame)
            elif kind == Kind.DEFINE:
                parts: list[Buffer] = [HEADER.pack(kind, ident, len(body)), body]
                self.defines.append(parts)
                for slot in self.slots:
                    self._to_executor(slot, parts)
            elif kind == Kind.CONFIG:
                self._configure(body)
            elif kind == Kind.INCLUDES:
                self._start_build(bytes(body))
            elif kind == Kind.CANCEL:
                self._cancel(ident)
            elif kind == Kind.RESTART:
                self._restart(ident, bytes(body))
            elif kind == Kind.SHUTDOWN:
                self.begin_stop(grace=float((self.config or {}).get("shutdown_grace", 3.0)))

    def _configure(self, body: bytes | bytearray) -> None:
        n = int.from_bytes(body[:4], "little")
        config: dict[str, Any] = json.loads(bytes(body[4 : 4 + n]))
        self.blob = bytes(body[4 + n :])
        self.heartbeat_timeout = float(config.get("heartbeat_timeout", _DEFAULT_HEARTBEAT_TIMEOUT))
        workdir = config.get("workdir")
        if workdir:
            os.makedirs(os.path.expanduser(workdir), exist_ok=True)
            os.chdir(os.path.expanduser(workdir))
        probe = config.get("shm_probe")
        shm_ok = False
        if probe:
            try:
                with open(os.path.join("/dev/shm", probe["name"])) as f:
                    shm_ok = f.read() == probe["token"]
            except OSError:
                shm_ok = False
        config["shm_prefix"] = f"flotilla-{config['pool_id']}-" if shm_ok else ""
        self.config = config
        self.slots = [Slot(rank) for rank in range(int(config.get("procs", 1)))]
        image = config.get("image")
        if image:
            from .build import env_dir, is_built

            config["image_dir"] = env_dir(config["home"], image["hash"])
            if not is_built(config["home"], image["hash"]):
                need = bool(image["includes_sha256"])
                self.client.send(frame(Kind.BUILD, 0, json.dumps({"need_includes": need}).encode()))
                if not need:
                    self._start_build(b"")
                return
        self._start_executors()

    # -- environment build -------------------------------------------------------------
    def _start_build(self, includes: bytes) -> None:
        """Build the Image in a subprocess; its output streams to the client as PROGRESS."""
        import subprocess

        assert self.config is not None
        env = dict(os.environ, **self.config.get("env", {}))
        proc = subprocess.Popen(
            [sys.executable, "-m", "flotilla._node.build", self.config["home"]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        self.builder = proc
        self.build_tail: deque[bytes] = deque(maxlen=_STDERR_TAIL_LINES)
        self.build_step = "start"
        self.build_error = ""
        self.build_partial = b""
        out = proc.stdout.fileno()
        os.set_blocking(out, False)
        self.sel.register(out, False, self._on_build_output)
        try:
            proc.stdin.write(json.dumps(self.config["image"]).encode() + b"\n" + includes)
            proc.stdin.close()
        except OSError:
            pass  # it died early; its output says why

    def _on_build_output(self) -> None:
        proc = self.builder
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if data:
            lines = (self.build_partial + data).split(b"\n")
            self.build_partial = lines.pop()
            for line in lines:
                if line.startswith(b"::step "):
                    self.build_step = line[7:].decode(errors="replace")
                elif line.startswith(b"::error "):
                    self.build_error = line[8:].decode(errors="replace")
                else:
                    self.build_tail.append(line)
            self.client.send(frame(Kind.PROGRESS, 0, data))
            return
        self.sel.unregister(fd)
        code = proc.wait()
        proc.stdout.close()
        self.builder = None
        if code == 0:
            self._start_executors()
            return
        tail = b"\n".join([*self.build_tail, self.build_partial]).decode(errors="replace")
        reason = f": {self.build_error}" if self.build_error else ""
        error = {
            "error": f"the environment build failed in step {self.build_step!r} "
            f"with exit code {code}{reason}",
            "build_step": self.build_step,
            "exitcode": code,
            "stderr_tail": tail,
        }
        self.client.send(frame(Kind.READY, 0, json.dumps(error).encode()))

    def _cancel(self, ident: int) -> None:
        """Stop a task: replace the executor if it runs it, else let the executor skip it."""
        for slot in self.slots:
            if slot.tasks and slot.tasks[0].ident == ident:
                slot.tasks.popleft()
                self._kill_executor(slot)
                self.client.send(frame(Kind.RESULT, ident, bytes((Status.CANCELLED,))))
                self._replace(slot, "a running call was cancelled")
                return
            for task in slot.tasks:
                if task.ident == ident:
                    task.cancelled = True  # settled here if this executor is replaced
                    self._to_executor(slot, frame(Kind.CANCEL, ident))
                    return

    def _replace(self, slot: Slot, reason: str) -> None:
        """Start a new executor in place of one that was stopped or died; in a group pool,
        ask the client to restart the whole group instead (see the module docstring)."""
        assert self.config is not None
        if not self.config.get("group"):
            self._start_executor(slot)
        elif not self.stopping:
            where = f"local rank {slot.rank}: " if len(self.slots) > 1 else ""
            self.client.send(frame(Kind.BROKEN, self.generation, (where + reason).encode()))

    def _restart(self, generation: int, cause: bytes) -> None:
        """Replace every executor; the tasks they held end ABORTED (with ``cause``)."""
        self.generation = generation
        for slot in self.slots:
            self._kill_executor(slot)
            while slot.tasks:
                task = slot.tasks.popleft()
                if task.cancelled:
                    self.client.send(frame(Kind.RESULT, task.ident, bytes((Status.CANCELLED,))))
                else:
                    status = bytes((Status.ABORTED,))
                    self.client.send(frame(Kind.RESULT, task.ident, status, cause))
            slot.restarts += 1
            self._start_executor(slot)

    def _arm(self, task: Task) -> None:
        task.deadline = time.monotonic() + task.timeout if task.timeout > 0 else 0.0

    # -- executor side -----------------------------------------------------------------
    def _start_executors(self) -> None:
        for slot in self.slots:
            self._start_executor(slot)

    def _start_executor(self, slot: Slot) -> None:
        assert self.config is not None
        if self.stopping:
            return
        r_task, w_task = os.pipe()
        r_res, w_res = os.pipe()
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the executor
            try:
                self.sel.close()
                for fd in (self.proto_in, self.proto_out, w_task, r_res, r_out, r_err):
                    os.close(fd)
                for other in self.slots:
                    if other.executor is not None:
                        ex = other.executor
                        for fd in (ex.to_fd, ex.from_fd, ex.out_fd, ex.err_fd):
                            os.close(fd)
                os.setpgid(0, 0)
                _die_with_parent()
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.dup2(w_out, 1)
                os.dup2(w_err, 2)
                for fd in (devnull, w_out, w_err):
                    os.close(fd)
                from .executor import main

                main(dict(self.config, local_rank=slot.rank), self.blob, r_task, w_res)
            finally:
                os._exit(70)
        for fd in (r_task, w_res, w_out, w_err):
            os.close(fd)
        ex = Executor(slot, pid, w_task, r_res, r_out, r_err, Outbox(w_task))
        slot.executor = ex
        os.set_blocking(r_out, False)
        os.set_blocking(r_err, False)
        self.sel.register(r_res, False, partial(self._on_executor, ex))
        self.sel.register(r_out, False, partial(self._on_output, ex, 1), first=True)
        self.sel.register(r_err, False, partial(self._on_output, ex, 2), first=True)
        for parts in self.defines:
            ex.outbox.send(parts)
        for task in [t for t in slot.tasks if t.cancelled]:
            slot.tasks.remove(task)
            self.client.send(frame(Kind.RESULT, task.ident, bytes((Status.CANCELLED,))))
        for task in slot.tasks:
            ex.outbox.send(task.frame)
        if slot.tasks:
            self._arm(slot.tasks[0])

    def _to_executor(self, slot: Slot, parts: list[Buffer]) -> None:
        ex = slot.executor
        if ex is not None and ex.state in (ExecState.STARTING, ExecState.RUNNING):
            ex.outbox.send(parts)

    def _watch_writes(self) -> None:
        """Watch for writability exactly the outboxes that have something queued."""
        outboxes = [self.client]
        outboxes += [s.executor.outbox for s in self.slots if s.executor is not None]
        for box in outboxes:
            if box.queue and box.fd not in self.sel:
                self.sel.register(box.fd, True, box.flush)
            elif not box.queue and box.fd in self.sel:
                self.sel.unregister(box.fd)

    def _on_executor(self, ex: Executor) -> None:
        frames = ex.reader.read(ex.from_fd)
        if frames is None:
            self._executor_exited(ex)
            return
        slot = ex.slot
        for kind, ident, body in frames:
            if kind == Kind.RESULT:  # its output was forwarded first (see Poller)
                self.client.send([HEADER.pack(kind, ident, len(body)), body])
                if slot.tasks and slot.tasks[0].ident == ident:
                    slot.tasks.popleft()
                    if slot.tasks:
                        self._arm(slot.tasks[0])
            elif kind == Kind.READY:
                info = json.loads(body)
                if "error" in info:
                    ex.state = ExecState.FAILED
                    info["local_rank"] = slot.rank
                    self.client.send(frame(Kind.READY, 0, json.dumps(info).encode()))
                    continue
                ex.state = ExecState.RUNNING
                first = not all(s.ready for s in self.slots)
                slot.ready = True
                if first and all(s.ready for s in self.slots):  # the whole node is up
                    ready = {
                        "pids": [s.executor.pid for s in self.slots if s.executor],
                        "restarts": sum(s.restarts for s in self.slots),
                        "shm": bool(self.config and self.config["shm_prefix"]),
                    }
                    self.client.send(frame(Kind.READY, 0, json.dumps(ready).encode()))

    def _on_output(self, ex: Executor, stream: int) -> None:
        self._forward_output(ex, ex.out_fd if stream == 1 else ex.err_fd, stream)

    def _forward_output(self, ex: Executor, fd: int, stream: int) -> bool:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not data:
            self.sel.unregister(fd)
            return False
        if stream == 2:
            lines = (ex.partial_err + data).split(b"\n")
            ex.partial_err = lines.pop()[-4096:]
            ex.stderr_tail.extend(line[-1000:] for line in lines)
        self.client.send(frame(Kind.OUTPUT, stream | ex.slot.rank << 8, data))
        return True

    def _drain_output(self, ex: Executor) -> None:
        """Forward what the executor wrote before it exited."""
        for fd, stream in ((ex.out_fd, 1), (ex.err_fd, 2)):
            while fd in self.sel and self._forward_output(ex, fd, stream):
                pass

    def _executor_exited(self, ex: Executor) -> None:
        slot = ex.slot
        status = _reap(ex.pid)
        self._drain_output(ex)
        self._close_executor(ex)
        if self.stopping:
            return
        tail = list(ex.stderr_tail) + ([ex.partial_err] if ex.partial_err else [])
        exitcode = os.waitstatus_to_exitcode(status) if status is not None else None
        death = {
            "exitcode": exitcode,
            "stderr_tail": b"\n".join(tail).decode(errors="replace"),
            "pid": ex.pid,
            "local_rank": slot.rank,
        }
        if ex.state is ExecState.STARTING or ex.state is ExecState.FAILED:
            if ex.state is ExecState.STARTING:
                error = "the executor process exited during start-up"
                self.client.send(
                    frame(Kind.READY, 0, json.dumps({"error": error, **death}).encode())
                )
            return
        task = slot.tasks.popleft() if slot.tasks else None
        slot.restarts += 1
        how, _ = describe_exit(exitcode)
        # in a group pool, the restart is asked for first: a retry of the task comes after it
        self._replace(slot, f"the process {'running a call ' if task else ''}{how}")
        if task is not None:
            body = json.dumps(death).encode()
            self.client.send(frame(Kind.RESULT, task.ident, bytes((Status.DIED,)), body))

    def _kill_executor(self, slot: Slot) -> None:
        ex = slot.executor
        if ex is None:
            return
        _kill_group(ex.pid)
        _reap(ex.pid, wait=True)
        self._close_executor(ex)

    def _close_executor(self, ex: Executor) -> None:
        for fd in (ex.from_fd, ex.out_fd, ex.err_fd, ex.to_fd):
            self.sel.unregister(fd)
            try:
                os.close(fd)
            except OSError:
                pass
        _kill_group(ex.pid)  # whatever the task left behind in its process group
        if ex.slot.executor is ex:
            ex.slot.executor = None

    # -- shutdown ----------------------------------------------------------------------
    def begin_stop(self, grace: float) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.stop_deadline = time.monotonic() + grace
        if self.builder is not None:
            _kill_group(self.builder.pid)
        for slot in self.slots:
            ex = slot.executor
            if ex is not None and ex.state is not ExecState.FAILED:
                ex.outbox.send(frame(Kind.SHUTDOWN, 0))

    def _cleanup(self) -> None:
        for slot in self.slots:
            self._kill_executor(slot)
        if self.builder is not None:
            _kill_group(self.builder.pid)
            self.builder.wait()
        if self.config and self.config.get("pool_id"):
            prefix = f"flotilla-{self.config['pool_id']}-"
            try:
                for name in os.listdir("/dev/shm"):
                    if name.startswith(prefix):
                        try:
                            os.unlink(os.path.join("/dev/shm", name))
                        except OSError:
                            pass
            except OSError:
                pass
        self.client.flush()

    def _log(self, message: str) -> None:
        print(f"flotilla agent {os.getpid()}: {message}", file=sys.stderr, flush=True)


def free_port_block(width: int) -> int:
    """A port ``p`` such that ``p .. p + width - 1`` can all be bound now (the best of a
    few tries: the first port alone if no whole block is found)."""
    first = 0
    for _ in range(20):
        with socket.socket() as s:
            s.bind(("", 0))
            base = int(s.getsockname()[1])
        first = first or base
        if base + width <= 65536 and all(_bindable(base + i) for i in range(1, width)):
            return base
    return first


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _reap(pid: int, wait: bool = False) -> int | None:
    """Wait for ``pid``; give it up to 2 s to exit by itself unless ``wait``."""
    deadline = time.monotonic() + 2.0
    while True:
        try:
            done, status = os.waitpid(pid, 0 if wait else os.WNOHANG)
        except ChildProcessError:
            return None
        if done:
            return status
        if time.monotonic() > deadline:
            _kill_group(pid)
            wait = True
        else:
            time.sleep(0.005)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_parent() -> None:
    """Make the kernel kill this process when the agent dies (Linux)."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def main() -> None:
    """Entry point of ``python -m flotilla.agent``."""
    Agent().run()
    os._exit(0)
