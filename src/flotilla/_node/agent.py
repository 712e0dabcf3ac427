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
* sends BEAT every quarter of ``heartbeat_timeout`` once configured, so that the client
  learns within that time when the node stops answering (a frozen process or VM, a network
  black hole), whatever carries the channel;
* marks every process it starts with a token in its environment (``FLOTILLA_NODE_TOKEN``,
  inherited by what tasks start), and at exit kills every process that carries it: what a
  task left running outside the executor's process group (``setsid``, a double fork, a
  launcher's workers) is stopped with the pool too;
* exits, stopping the executor's whole process group, on SHUTDOWN, on end of stdin (the
  client is gone; a cluster's agent, configured with ``reattach_grace``, first waits that
  long for a new client on its re-attach socket, see :mod:`.reattach`), on SIGTERM, or
  when no frame arrived for ``heartbeat_timeout`` seconds
  (after reading what waits in its stdin: a stopped and resumed agent finds the client's
  pings there and goes on).

The parts: :mod:`.eventloop` (the poller and non-blocking writers it runs on),
:mod:`.supervisor` (the executors: fork, feed, watch, replace; their states),
:mod:`.environment` (the Image's build and the volumes, before the executors start), and
this module, the client-facing side: HELLO, CONFIG, the frames the client sends,
heartbeats and shutdown.
"""

from __future__ import annotations

import _socket
import gc
import os
import sys
import time
from collections.abc import Callable

from .._system import fastjson as json
from .._system.procs import has_env, kill_all
from .._wire.bodies import Config, Hello, PythonSearch, dump, load_config
from .._wire.frames import Body, FrameError, FrameReader, Kind, frame
from .._wire.protocol import BUILD_STOP_GRACE
from .environment import TOKEN_VAR, NodeEnvironment
from .eventloop import Outbox, Poller
from .lanes import lane_socket
from .processes import end_unstarted, kill_group, signal_group, starts_due
from .relay import Relay
from .supervisor import Supervisor

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal  # (typeshed has no _signal: signal's names, its types)
    from typing import Any
else:
    import _signal  # signal.py's C module: the same calls and SIG* ints, without its enums

_KEPT_BYTES = 64 << 20
"""What a detached agent keeps for its next client at most (the oldest frames go first)."""
PORT_BLOCK = 64
"""HELLO's ``port`` starts a block of this many ports that were free on the node: the
head's becomes ``head_port``, and plugins use the ports after it (JAX, TensorFlow)."""
_DEFAULT_HEARTBEAT_TIMEOUT = 60.0
NODE_DIR_VAR = "FLOTILLA_NODE_DIR"
"""Set by a provider that made a working folder for this node alone: removed at exit."""
SWITCH_VAR = "FLOTILLA_PYTHON_SWITCH"
"""Set for the interpreter an agent became (see ``_switch_python``): JSON, the one it left
(``python_version``, ``python``) and whether the new one was ``installed``."""


class Reattachable(NodeEnvironment):
    """The re-attach side of an :class:`Agent` (a cluster's agent, see :mod:`.reattach`):
    its socket, detaching when its client is gone and taking a new client; the agent
    sets these attributes."""

    proto_in: int
    proto_out: int
    listener: Any
    reattach_key: bytes
    reattach_grace: float
    detached_until: float
    last_seen: float
    next_beat: float
    heartbeat_timeout: float
    cloud: Any
    client_reader: FrameReader

    def _hello(self, search: Any = None, again: bool = False) -> None:
        raise NotImplementedError

    def _on_client(self) -> None:
        raise NotImplementedError

    def _detach(self) -> None:
        """The client is gone: keep running for ``reattach_grace`` seconds, keeping what
        would go to it (up to a limit), for a new client on the re-attach socket."""
        if self.client.fd in self.sel:
            self.sel.unregister(self.client.fd)
        if self.executors.lanes is not None:  # (no lane for another client)
            self.executors.lanes.close()
            self.executors.lanes = None
        for fd in {self.proto_in, self.proto_out}:
            if fd > 2:
                os.close(fd)
        quiet = os.open(os.devnull, os.O_WRONLY)  # stderr was the old client's too
        os.dup2(quiet, 2)
        os.dup2(quiet, 1)
        os.close(quiet)
        self.client.queue.clear()  # (a frame half-written to the old client: dropped)
        self.client.broken = False  # (a write to the old one may have failed first)
        self.client.held = _KEPT_BYTES
        self.client.kept = 0
        self.detached_until = time.monotonic() + self.reattach_grace
        if self.cloud is not None:  # the instance lives as long as the wait, not ``ttl``
            self.cloud.hold(self.reattach_grace)
        self._log(f"the client is gone; waiting {self.reattach_grace:.0f} s for it to re-attach")

    def _on_reattach(self) -> None:
        """A connection on the re-attach socket: the new client, if none is attached."""
        conn = self.listener.accept(self.reattach_key)
        if conn is None:
            return
        if not self.detached_until or self.stopping:  # a client is attached (or it ends)
            conn.close()
            return
        fd = conn.detach()
        self.proto_in, self.proto_out = fd, os.dup(fd)
        os.set_blocking(fd, False)
        os.set_blocking(self.proto_out, False)
        self.executors.agent_fds = (fd, self.proto_out, self.listener.fileno())
        self.client_reader = FrameReader()
        self.sel.register(fd, False, self._on_client)
        self.detached_until = 0.0
        self.last_seen = time.monotonic()
        self.next_beat = self.last_seen
        if self.cloud is not None:  # the new client keeps the instance alive from now
            self.cloud.renew()
        self._hello(again=True)
        self.client.fd = self.proto_out
        self.client.held = 0
        self.client.kept = 0
        Outbox.queued = True  # what was kept goes out now: _watch_writes looks
        self._log("a client re-attached")

    def _readopt(self, config: Config) -> None:
        """CONFIG from a re-attached client: the node keeps its own (its executors run);
        only the heartbeat follows the new client; READY answers at once."""
        self.heartbeat_timeout = float(config.get("heartbeat_timeout", self.heartbeat_timeout))
        ready = self.executors.ready_info()
        if ready is not None:
            self.client.send(frame(Kind.READY, 0, dump(ready)))

    def _listen(self, config: Config) -> None:
        """A cluster's agent (``reattach_grace``): open the re-attach socket; its name is
        in the tasks' environment (the cluster's record keeps it)."""
        key = str(config.pop("reattach_key", ""))
        grace = float(config.pop("reattach_grace", 0) or 0)
        if not key or grace <= 0:
            return
        from .reattach import ADDRESS_VAR, Listener

        try:
            self.listener = Listener()
        except OSError as e:
            self._log(f"no re-attach socket ({e}): this node ends with its client")
            return
        self.reattach_key = bytes.fromhex(key)
        self.reattach_grace = grace
        os.environ[ADDRESS_VAR] = self.listener.name
        self.executors.agent_fds = (*self.executors.agent_fds, self.listener.fileno())
        self.sel.register(self.listener.fileno(), False, self._on_reattach)


class Agent(Reattachable):
    """The agent of one node: speaks the protocol on its stdin/stdout (see the module
    docstring), runs the executors through a :class:`Supervisor`."""

    def __init__(self) -> None:
        self.proto_in = 0
        self.proto_out = os.dup(1)
        os.dup2(2, 1)  # anything printed in this process goes to stderr, not the protocol
        self.client = Outbox(self.proto_out)
        self.client_reader = FrameReader()
        self.sel = Poller()
        self.sel.register(self.proto_in, False, self._on_client)
        self.executors = Supervisor(self.sel, self.client, (self.proto_in, self.proto_out))
        lanes = lane_socket()  # a Local client's (see lanes.py)
        if lanes is not None:
            self.executors.lanes = lanes
            self.executors.agent_fds = (self.proto_in, self.proto_out, lanes.fd)
        self.relay = Relay(self.sel, self.client, self.executors.submit_task)
        self.executors.inherited = self.relay.fds
        self.executors.answered = self.relay.answered
        self.config: Config | None = None
        self.builder: Any = None  # the environment build subprocess, while it runs
        self.last_seen = time.monotonic()
        self.heartbeat_timeout = _DEFAULT_HEARTBEAT_TIMEOUT
        self.next_beat = float("inf")  # when to send the next BEAT (once configured)
        self.stopping = False
        self.own_dir = True  # remove FLOTILLA_NODE_DIR at exit (not after SHUTDOWN)
        self.stop_deadline = 0.0
        self.done = False
        self.listener: Any = None  # the re-attach socket (a cluster's agent, see reattach.py)
        self.preflight: Any = None  # a group pool's head: the pre-flight's socket (preflight.py)
        self.reattach_key = b""
        self.reattach_grace = 0.0
        self.detached_until = 0.0  # > 0: the client is gone; a new one may come until then
        ex = self.executors
        self._on_frame: dict[int, Callable[[int, Body], object]] = {
            # kind -> handler(ident, body) of the client's frames (a PING only sets last_seen)
            Kind.TASK: ex.submit,
            Kind.DEFINE: ex.define,
            Kind.CONFIG: self._configure,
            Kind.INCLUDES: lambda _, body: self._start_build(bytes(body)),
            Kind.CANCEL: self._cancel,
            Kind.RESTART: self._restart,
            Kind.SHUTDOWN: self._shutdown,
            Kind.PYTHON: self._switch_python,
            Kind.STORED: ex.stored,
            Kind.CREDIT: ex.credit,
            Kind.FEED: lambda ident, body: ex.credit(ident, body, Kind.FEED),
            Kind.CLOSE: lambda ident, body: ex.credit(ident, body, Kind.CLOSE),
            Kind.MEMBERS: lambda _, body: ex.members(bytes(body)),
            Kind.FETCH: self.relay.fetch,
            Kind.BLOB: self.relay.chunk,
            Kind.TASKREF: self.relay.task,
            Kind.DROP: self.relay.drop,
        }
        self.volumes: Any = None  # the volumes helper (_node/volumes.py), while it runs
        self.pending_volumes: dict[str, Any] | None = None  # CONFIG's, until it starts
        self.sampler: Any = None  # the node's metrics (_node/metrics.py), once configured
        self.cloud: Any = None  # on a cloud instance: its watchdog's contact (see cloud.py)
        self.cloud_env = os.environ.get("FLOTILLA_CLOUD")  # kept for a switch of interpreter
        if "FLOTILLA_CLOUD" in os.environ:
            from .cloud import start

            self.cloud = start()  # its watchdog outlives the agent on purpose: no token
        self.token = f"{os.getpid()}.{os.urandom(8).hex()}"
        os.environ[TOKEN_VAR] = self.token  # inherited by the executors and all they start

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> None:
        _signal.signal(_signal.SIGTERM, lambda *_: self.begin_stop(grace=1.0))
        _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
        self._hello()
        try:
            while not self.done:
                wake = self._next_wakeup()
                for callback in self.sel.poll(max(0.0, wake - time.monotonic())):
                    callback()
                if self.stopping or self.detached_until or time.monotonic() >= wake:
                    self._check_deadlines()  # (else none is due: not on each call's frames)
                ex = self.executors
                if (ex.waiting or ex.unsent) and not self.client.queue:
                    ex.resume()
                if ex.deep or ex.policy.batch:  # (a queue: else nothing to pace)
                    ex.pace()
                if Outbox.queued or self.sel.writing:  # (else no watch to change)
                    self._watch_writes()
        finally:
            self._cleanup()

    def _next_wakeup(self) -> float:
        """The monotonic time by which :meth:`_check_deadlines` has something to do (a
        beat, a timeout, a relay's or the sampler's deadline), if nothing comes first."""
        wake = self.last_seen + self.heartbeat_timeout
        if self.next_beat < wake:
            wake = self.next_beat
        wake = self.relay.next_deadline(self.executors.next_deadline(wake))
        wake = starts_due(self.executors, wake)
        if self.sampler is not None:
            wake = min(wake, self.sampler.due)
        if self.stopping:
            wake = min(wake, self.stop_deadline)
        if self.detached_until:
            wake = min(wake, self.detached_until)
        return wake

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if self.stopping:
            if (self.executors.idle and self.builder is None) or now >= self.stop_deadline:
                self.done = True
            return
        if self.detached_until:
            if now >= self.detached_until:
                self._log(f"no client came back within {self.reattach_grace:.0f} s; exiting")
                if self.cloud is not None:  # nobody holds the instance: it ends now
                    self.cloud.hold(0.0)
                self.begin_stop(grace=1.0)
                return
            self.last_seen = now  # no heartbeat without a client
        elif now >= self.next_beat:
            self.client.send(frame(Kind.BEAT, 0))
            self.next_beat = now + self.heartbeat_timeout / 4
        if now - self.last_seen > self.heartbeat_timeout:
            for callback in self.sel.poll(0.0):  # what waits in stdin (e.g. after SIGSTOP)
                callback()
            if self.done or self.stopping or now - self.last_seen <= self.heartbeat_timeout:
                return
            self._log(f"no message from the client for {self.heartbeat_timeout:.0f} s; exiting")
            self.begin_stop(grace=1.0)
            return
        self.executors.check_timeouts(now)
        end_unstarted(self.executors, now)
        self.relay.check(now)
        if self.sampler is not None and now >= self.sampler.due:
            try:
                self.sampler.tick(now)
            except Exception as e:  # metrics never take the node down
                self._log(f"metrics are off on this node: {type(e).__name__}: {e}")
                self.sampler.close()
                self.sampler = None

    def _watch_writes(self) -> None:
        """Watch for writability exactly the outboxes that have something queued (the
        loop calls this only when one queued bytes since the last look or one is
        watched)."""
        Outbox.queued = False
        for box in [self.client, *self.executors.outboxes()]:
            if box.held:
                continue
            if box.queue and box.fd not in self.sel:
                self.sel.register(box.fd, True, box.flush)
            elif not box.queue and box.fd in self.sel:
                self.sel.unregister(box.fd)

    # -- client side -------------------------------------------------------------------
    def _hello(self, search: PythonSearch | None = None, again: bool = False) -> None:
        port = free_port_block(PORT_BLOCK)
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot_id = f.read().strip()
        except OSError:
            boot_id = ""
        hello: Hello = {
            "pid": os.getpid(),
            "host": os.uname().nodename,  # (gethostname(2)'s)
            "boot_id": boot_id,
            "python": sys.executable,
            "python_version": ".".join(map(str, sys.version_info[:3])),
            "port": port,
        }
        switched = os.environ.pop(SWITCH_VAR, "")
        if switched:  # this interpreter replaced another one: the client says so
            hello["switched_from"] = json.loads(switched)
        if search is not None:  # no Python of the client's minor version here
            hello["python_search"] = search
        if again:  # a re-attached client: what runs here, before what was kept for it
            hello["adopted"] = self.executors.adopted()
            again_frame = memoryview(b"".join(frame(Kind.HELLO, 0, dump(hello))))
            self.client.queue.appendleft(again_frame)
            return
        self.client.send(frame(Kind.HELLO, 0, dump(hello)))

    def _on_client(self) -> None:
        try:
            frames = self.client_reader.read(self.proto_in)
        except FrameError as e:
            self._log(f"the client's stream is corrupt ({e}); exiting")
            frames = None
        if frames is None:  # the client is gone
            self.sel.unregister(self.proto_in)
            if self.listener is not None and not self.stopping:
                self._detach()
                return
            self.client.broken = True
            self.begin_stop(grace=1.0)
            return
        self.last_seen = time.monotonic()
        if self.cloud is not None:
            self.cloud.touch(self.last_seen)
        handlers = self._on_frame
        for kind, ident, body in frames:
            handler = handlers.get(kind)
            if handler is not None:
                handler(ident, body)

    def _cancel(self, ident: int, _: Body) -> None:
        """CANCEL: stop a call, also one still waiting for its relayed payload."""
        if not self.relay.cancel(ident):
            self.executors.cancel(ident)

    def _restart(self, generation: int, cause: Body) -> None:
        """RESTART: every executor is replaced; the calls queued and running end ABORTED,
        and so do those still waiting for a relayed payload."""
        self.relay.abort(bytes(cause))
        self.executors.restart(generation, bytes(cause))

    def _switch_python(self, _: int, body: Body) -> None:
        """PYTHON: become a Python of the minor version asked for (see
        :mod:`.interpreter`): this process ``exec``s it, whose agent says HELLO again; when
        none is found (or installed), a new HELLO from this one says what was looked at."""
        from . import interpreter

        request = json.loads(bytes(body))
        minor = str(request["version"])
        found = interpreter.find(minor)
        if not found.path and request.get("install"):
            from .build import find_uv

            uv = find_uv(request["home"])
            installed = interpreter.install(minor, uv, request.get("mirror"))
            looked = found.looked + installed.looked
            found = interpreter.Found(installed.path, installed.version, looked, True)
        if not found.path or self.config is not None:
            self._hello({"wanted": minor, "looked": list(found.looked)})
            return
        left = {"python_version": interpreter.this_python(), "python": sys.executable}
        os.environ[SWITCH_VAR] = json.dumps({**left, "installed": found.installed})
        if self.cloud_env is not None:  # its watchdog runs: the new agent finds it there
            os.environ["FLOTILLA_CLOUD"] = self.cloud_env
        os.set_blocking(self.proto_out, True)
        self.client.flush()
        os.dup2(self.proto_out, 1)  # the protocol on stdout again, as the agent started
        sys.stderr.flush()
        try:
            os.execv(found.path, [found.path, "-m", "flotilla.agent"])
        except OSError as e:  # this agent goes on, and says so
            os.dup2(2, 1)
            os.set_blocking(self.proto_out, False)
            os.environ.pop(SWITCH_VAR, None)
            if self.cloud_env is not None:
                os.environ.pop("FLOTILLA_CLOUD", None)  # (the tasks do not inherit it)
            failed = [*found.looked, f"{found.path} (cannot be started: {e})"]
            self._hello({"wanted": minor, "looked": failed})

    def _configure(self, _: int, body: Body) -> None:
        """CONFIG: the pool's settings; then build the Image, or start the executors."""
        n = int.from_bytes(body[:4], "little")
        config = load_config(bytes(body[4 : 4 + n]))
        if self.config is not None:
            self._readopt(config)
            return
        blob = bytes(body[4 + n :])
        self.heartbeat_timeout = float(config.get("heartbeat_timeout", _DEFAULT_HEARTBEAT_TIMEOUT))
        self.next_beat = time.monotonic() + self.heartbeat_timeout / 4
        workdir = config.get("workdir")
        if workdir:
            os.makedirs(os.path.expanduser(workdir), exist_ok=True)
            os.chdir(os.path.expanduser(workdir))
        probe = config.get("shm_probe")
        shm_ok = False
        if probe:
            shm_ok = _read_probe(probe["name"]) == probe["token"].encode()
        # the client's names for its pool's files (flotilla-<pool id>-<owner>-, _client/shm.py)
        prefix = probe.get("prefix") if probe else None
        config["shm_prefix"] = str(prefix or f"flotilla-{config['pool_id']}-") if shm_ok else ""
        relay_key = str(config.pop("relay_key", ""))  # the relay's alone, not the tasks'
        if relay_key and not shm_ok and self.relay.listener is None:
            # a node apart from the client: large broadcasts may be relayed through it
            try:
                port = self.relay.listen(bytes.fromhex(relay_key))
            except OSError as e:  # the client sends this node its payloads itself
                self._log(f"cannot open a relay port ({e}); broadcasts come from the client")
            else:
                self.executors.ready_extra["relay_port"] = port
                if os.access("/dev/shm", os.W_OK):  # payloads the executors map
                    self.relay.shm_prefix = f"flotilla-{config['pool_id']}-relay-"
        # the volumes (credentials: for their helper alone) come after the environment,
        # whose Image may install the FUSE tool
        self.pending_volumes = config.pop("volumes", None)
        self._listen(config)
        if config.get("group"):  # a group pool: its head answers the nodes' pre-flight
            self._answer_preflight(config)
        self.config = config
        self._start_metrics(config)
        self.executors.configure(config, blob)
        image = config.get("image")
        if image:
            from .build import env_dir, interpreter_key, is_built

            # the Image's environment for this interpreter and what it already has
            image["hash"] = f"{image['hash']}-{interpreter_key()}"
            config["image_dir"] = env_dir(config["home"], image["hash"])
            if not is_built(config["home"], image["hash"]):
                need = bool(image["includes_sha256"])
                self.client.send(frame(Kind.BUILD, 0, json.dumps({"need_includes": need}).encode()))
                if not need:
                    self._start_build(b"")
                return
        self._environment_ready()

    def _answer_preflight(self, config: Config) -> None:
        """The head of a group pool: answer the other nodes' rendezvous pre-flight for as
        long as this agent lives (see :mod:`.preflight`), its executors without the socket."""
        info = json.loads(config["compute_pool"])
        if not info.get("is_head") or not info.get("head_port"):
            return
        from .preflight import PORT_OFFSET, accept, answer

        server = answer(int(info["head_port"]))
        if server is None:  # (whatever listens there answers the nodes)
            port = int(info["head_port"]) + PORT_OFFSET
            self._log(f"the pre-flight's port {port} is taken: the nodes' check may fail")
            return
        self.preflight = server
        self.executors.agent_fds = (*self.executors.agent_fds, server.fileno())
        self.sel.register(server.fileno(), False, lambda: accept(server))

    def _start_metrics(self, config: Config) -> None:
        """Sample the metrics CONFIG asks for (none: no sampler, no cost)."""
        specs = config.get("metrics")
        if not specs or self.sampler is not None:
            return
        from .metrics import Sampler, encode

        def watch(fd: int, callback: Callable[[], None] | None) -> None:
            if callback is None:
                self.sel.unregister(fd)
            else:
                self.sel.register(fd, False, callback)

        def send(body: dict[str, Any]) -> None:
            self.client.send(frame(Kind.METRICS, 0, encode(body)))

        try:
            self.sampler = Sampler(
                specs, str(config.get("metrics_scope", "host")), send, watch, os.getpid()
            )
        except Exception as e:  # metrics never keep a node from serving
            self._log(f"metrics are off on this node: {type(e).__name__}: {e}")

    # -- shutdown ----------------------------------------------------------------------
    def _shutdown(self, _: int, __: Body) -> None:
        """SHUTDOWN: the executors get ``shutdown_grace`` seconds to end by themselves.
        The client is there: it decides what becomes of the node's folder (a new agent may
        be started in it), so the agent leaves it."""
        self.own_dir = False
        self.begin_stop(grace=float((self.config or {}).get("shutdown_grace", 3.0)))

    def begin_stop(self, grace: float) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.stop_deadline = time.monotonic() + grace
        if self.builder is not None:  # it removes its half-built folder (see _cleanup)
            signal_group(self.builder.pid, _signal.SIGTERM)
        self.executors.stop()

    def _cleanup(self) -> None:
        if self.listener is not None:
            self.listener.close()
        if self.sampler is not None:
            self.sampler.close()
        self.relay.close()
        self.executors.kill_all()
        if self.builder is not None:  # a build stops on SIGTERM, removing its folder
            signal_group(self.builder.pid, _signal.SIGTERM)
            import subprocess

            try:
                self.builder.wait(BUILD_STOP_GRACE)
            except subprocess.TimeoutExpired:
                kill_group(self.builder.pid)
                self.builder.wait()
        marker = f"{TOKEN_VAR}={self.token}".encode()
        kill_all(lambda pid: has_env(pid, marker))  # what left the executors' groups
        self._stop_volumes()  # nothing writes there any more: write back, unmount
        self._remove_node_dir()
        if self.config and self.config.get("pool_id"):
            prefix = f"flotilla-{self.config['pool_id']}-"
            try:
                for name in os.listdir("/dev/shm"):
                    if name.startswith(prefix):
                        path = os.path.join("/dev/shm", name)
                        try:  # ours only: not what another user planted
                            if os.lstat(path).st_uid == os.geteuid():
                                os.unlink(path)
                        except OSError:
                            pass
            except OSError:
                pass
        self.client.flush()

    def _remove_node_dir(self) -> None:
        """Remove the node's own working folder (``FLOTILLA_NODE_DIR``: a provider that
        made one folder per node says so) when the agent ends without the client's
        SHUTDOWN (the client was killed, went silent, or the agent was signalled): a
        client killed without closing its pool leaves nothing behind."""
        folder = os.environ.pop(NODE_DIR_VAR, "")
        if folder and self.own_dir and os.path.isdir(folder) and not os.path.islink(folder):
            import shutil

            from .._system.mounts import unmount_under

            os.chdir("/")
            unmount_under(folder)  # never into a bucket: see volumes.py
            shutil.rmtree(folder, ignore_errors=True)


def _read_probe(name: str) -> bytes:
    """The content of the client's shared-memory probe ``name``, if it is a regular file
    (b"" otherwise: a link or a FIFO planted in the shared folder is neither followed nor
    waited on)."""
    import stat

    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(os.path.join("/dev/shm", name), flags)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return os.read(fd, 256)
    except OSError:
        return b""
    finally:
        os.close(fd)


def free_port_block(width: int) -> int:
    """A port ``p`` such that ``p .. p + width - 1`` can all be bound now, below the
    kernel's ephemeral range where it can be (the best of a few tries: the first port of
    the range alone if no whole block is found). A block among the ephemeral ports could
    be taken, before the head's process listens on it, by any socket bound to port 0 on
    the node: the relay's listener, a collective's own, a connection's source port. Its
    sockets are ``_socket``'s: ``socket``, whose import makes its enums (~2.5 ms), is not
    part of an agent's start (see ``relay.Relay.listen``)."""
    low = _ephemeral_start()
    spread = low - width - _BLOCKS_FROM
    if spread > 0:
        for _ in range(20):
            base = _BLOCKS_FROM + int.from_bytes(os.urandom(4), "big") % spread
            if all(_bindable(base + i) for i in range(width)):
                return base
    first = 0
    for _ in range(20):
        s = _socket.socket()  # TCP over IPv4
        try:
            s.bind(("", 0))
            base = int(s.getsockname()[1])
        finally:
            s.close()
        first = first or base
        if base + width <= 65536 and all(_bindable(base + i) for i in range(1, width)):
            return base
    return first


_BLOCKS_FROM = 20000
"""The lowest port a block starts at (above the ports well-known services listen on)."""


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (``ip_local_port_range``), or 0
    when it cannot be read (another system: the block is found among them)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", "rb") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(port: int) -> bool:
    s = _socket.socket()
    try:
        s.bind(("", port))
    except OSError:
        return False
    finally:
        s.close()
    return True


def main() -> None:
    """Entry point of ``python -m flotilla.agent``. What exists now (the interpreter and the
    node modules) lives as long as the process: it is frozen (``gc.freeze``), so that no
    collection, here or in an executor forked from here, walks it again (or touches its
    pages: a forked executor shares them), and the collector, which a start pauses while
    it imports (the SSH bootstrap does), runs again."""
    gc.freeze()
    gc.enable()
    Agent().run()
    os._exit(0)
