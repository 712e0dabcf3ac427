"""An agent reached through the stdio pipes of a child process of the client.

The child is the agent itself (the local provider) or a command that runs it elsewhere and
relays its stdio (``ssh host ...`` for the SSH provider; ``srun``, ``docker exec`` and the
like for others). Writes are plain pipe writes from the caller's thread; reads happen on
the client's event loop.

Before the protocol starts, a remote start command may print answer lines (see
``bootstrap``): :meth:`PipeAgent.read_line` reads them, and whatever follows the answer is
handed to the frame reader when :meth:`PipeAgent.start_reading` is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import selectors
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .._wire.frames import Buffer, FrameError, FrameReader, advance
from .base import AgentProcess, FramesCallback, GiveUp

if TYPE_CHECKING:
    from .forks import ForkedAgent

_T = TypeVar("_T")
_NOISE_LIMIT = 1 << 16
"""Bytes of output (e.g. a chatty shell profile) kept while looking for an answer line."""
_ERR_TAIL = 8192
_EXIT_WAIT = 1.0
"""Seconds to wait, at end of output, for the process's exit status and last stderr bytes."""


SPIN = 250e-6
"""Seconds, at most, a caller waiting for one call's answer (``read_direct``) polls the
stream without sleeping, before it sleeps in ``poll``: waking a sleeping thread costs this
machine's kernel (a VM's idle CPU above all) more than a quick call's whole round trip.
The spin is adaptive (:meth:`PipeAgent._spin_window`): it lasts about twice as long as
the recent answers took, none at all after an answer slower than this, and none while
the machine has no idle core (the spin would take the CPU the node needs to answer). It
happens only in a lone call's wait: never on the loop thread, never in a batch."""
_SPIN_FIRST = SPIN / 2
"""The answer time a new agent's waiter assumes before it has seen one."""
_JOINED = 1 << 22
"""Writes up to this size are joined into one buffer first (a batch of thousands of small
frames), larger ones go out as the buffers they are (a large argument is not copied)."""

_Frames = list[tuple[int, int, bytes | bytearray]]
_loop_epolls: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, select.epoll | None] = (
    weakref.WeakKeyDictionary()
)
"""Per event loop: its epoll set (a descriptor of our own for it), for :meth:`read_direct`;
None when the loop does not run on epoll."""

StderrFilter = Callable[[bytes], bytes]
"""One step of an agent's stderr on its way to the client (``PipeAgent.stderr_filters``):
the bytes read in, what to pass on out (nothing: b"")."""


def _epoll_of(loop: asyncio.AbstractEventLoop) -> select.epoll | None:
    try:
        return _loop_epolls[loop]
    except KeyError:
        pass
    selector = getattr(loop, "_selector", None)
    epoll = None
    if isinstance(selector, selectors.EpollSelector):
        epoll = select.epoll.fromfd(os.dup(selector.fileno()))
    _loop_epolls[loop] = epoll
    return epoll


def _cores() -> int:
    """The cores this process may run on (its affinity: a container's or a ``taskset``'s
    share of the machine), else the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


_CORES = _cores()
_loadavg: list[int] = []  # a descriptor of /proc/loadavg, once opened; empty until then


def idle_core() -> bool:
    """Whether a core of this machine is idle for the calling thread: fewer other
    runnable threads than the cores it may run on (:func:`_cores`), as the kernel counts
    them right now (the fourth field of ``/proc/loadavg``, which counts the caller too).
    Where that count cannot be read, the one-minute load average stands in for it."""
    if not _loadavg:
        try:
            _loadavg.append(os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            _loadavg.append(-1)
    fd = _loadavg[0]
    if fd >= 0:
        try:  # read afresh at offset 0 each time: "1.20 0.90 0.80 3/412 9876"
            runnable = int(os.pread(fd, 128, 0).split(b" ", 4)[3].split(b"/")[0])
            return runnable - 1 < _CORES
        except (OSError, ValueError, IndexError):
            pass
    try:
        return os.getloadavg()[0] < _CORES
    except OSError:
        return True


class PipeAgent(AgentProcess):
    """An agent whose protocol channel is a child process's stdin/stdout.

    Attributes:
        proc: the child process (started with three pipes, in its own session), or an
            agent forked by a local pool's fork server (``forks.ForkedAgent``).
        err_tail: the last bytes the child wrote to stderr.
        stderr_filters: what the child's stderr passes through, in order, before
            :meth:`start_reading`'s ``on_stderr`` (the ssh process's own lines taken out,
            a cloud instance's interruption notices); ``err_tail`` keeps it unfiltered.
    """

    def __init__(
        self, proc: subprocess.Popen[bytes] | ForkedAgent, address: str, host: str
    ) -> None:
        assert proc.stdin and proc.stdout and proc.stderr
        self.proc = proc
        self.address = address
        self.host = host
        self.err_tail = b""
        self.stderr_filters: list[StderrFilter] = []
        self.lost_reason = ""  # why the stream was dropped, when it was not its end
        self._in = proc.stdin.fileno()
        os.set_blocking(self._in, False)  # writes wait in poll, and can be given up
        self._abandoned = False
        self._out = proc.stdout.fileno()
        self._reader = FrameReader()  # of stdout, once start_reading() is called
        self._read_lock = threading.Lock()  # one reader of stdout: the loop or read_direct
        self._answered = _SPIN_FIRST  # how long recent answers took (see _spin_window)
        self._held: select.epoll | None = None  # the loop's watch, taken off by hold_direct
        self._parked: select.epoll | None = None  # left off after a lone call (see watch)
        self._poller: select.poll | None = None  # read_direct's wait for stdout, made once
        self._holder = 0  # the thread that took it
        self._released = False  # stdout and stderr closed (see terminate)
        self._handed: list[_Frames] = []  # frames read_direct left for the loop, in order
        self._handed_error: str | None = None  # a corrupt stream read_direct met
        self._handed_over: Callable[[], None] = lambda: None  # delivers those on the loop
        self._err = proc.stderr.fileno()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early_out = bytearray()  # stdout read before start_reading()
        self._out_ended = False
        self._early_err: list[bytes] = []  # stderr read before start_reading()
        self._on_stderr: Callable[[bytes], None] = self._early_err.append
        self._err_ended: asyncio.Future[None] | None = None
        # a Local agent's lane socket, or the client's lanes made of it (_client/lanes.py):
        # closed with the agent's pipes
        self.lanes: socket.socket | Any = None

    # -- writing -----------------------------------------------------------------------
    def write(self, parts: Sequence[Buffer], give_up: GiveUp | None = None) -> None:
        """Write ``parts`` whole (see :meth:`AgentProcess.write`): the pipe is
        non-blocking, a wait for room is a ``poll`` of at most a tenth of a second, after
        which ``give_up`` is asked."""
        if self._abandoned:
            raise BrokenPipeError(errno.EPIPE, "an earlier write to the agent was abandoned")
        fd = self._in
        size = 0
        for p in parts:
            size += p.nbytes if isinstance(p, memoryview) else len(p)
        if size <= _JOINED:  # one copy, then one system call (more when the pipe is full)
            data = b"".join(parts)
            try:
                n = os.write(fd, data)
            except BlockingIOError:
                n = 0
            if n == size:
                return
            views = [memoryview(data)[n:]]
        else:  # large buffers are written where they are
            views = [memoryview(p).cast("B") for p in parts if len(p)]
        self.release_direct()  # a write that waits holds no one's reading (hold_direct)
        stalled_since = time.monotonic()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        while views:
            try:
                written = os.writev(fd, views[:512])
            except BlockingIOError:
                written = 0
            if written:
                stalled_since = time.monotonic()
            advance(views, written)
            if not views:
                return
            poller.poll(100)
            if give_up is not None and give_up(time.monotonic() - stalled_since):
                self._abandoned = True
                raise BrokenPipeError(errno.EPIPE, "the write to the agent was abandoned")

    def try_write(self, data: bytes) -> bool:
        if self._abandoned:
            raise BrokenPipeError(errno.EPIPE, "an earlier write to the agent was abandoned")
        if len(data) > select.PIPE_BUF:
            return False
        try:  # a pipe takes a write of at most PIPE_BUF bytes whole or not at all
            return os.write(self._in, data) == len(data)
        except BlockingIOError:
            return False

    # -- reading -----------------------------------------------------------------------
    async def read_line(self, marker: bytes) -> str | None:
        """The rest of the next stdout line that starts with ``marker``.

        Lines before it are dropped; what follows it stays for :meth:`start_reading`.
        Returns None when stdout ends first. Stderr is collected meanwhile (``err_tail``).
        """
        loop = asyncio.get_running_loop()
        self._read_stderr(loop)
        while True:
            line = self._take_line(marker)
            if line is not None:
                return line
            if self._out_ended:
                return None
            data = await _read_once(loop, self._out)
            if data:
                self._early_out += data
            else:
                self._out_ended = True

    def _take_line(self, marker: bytes) -> str | None:
        buf = self._early_out
        while True:
            end = buf.find(b"\n")
            if end < 0:
                if len(buf) > _NOISE_LIMIT:
                    del buf[: -len(marker)]
                return None
            line = bytes(buf[:end])
            del buf[: end + 1]
            if line.startswith(marker):
                return line[len(marker) :].decode(errors="replace").strip()

    def start_reading(
        self,
        loop: asyncio.AbstractEventLoop,
        on_frames: FramesCallback,
        on_stderr: Callable[[bytes], None],
    ) -> None:
        """Deliver stdout as frames and stderr as bytes on ``loop``, starting with what
        was read before. End of stdout is reported (``on_frames(None)``) once the process
        has exited and its stderr has ended, or after a second, so that messages about a
        lost node carry its exit status and last words."""
        self._loop = loop
        self._read_stderr(loop)
        early, self._early_err = self._early_err, []
        self._on_stderr = self._filtered(on_stderr)
        for data in early:
            self._on_stderr(data)
        reader = self._reader
        if self._early_out:
            frames = reader.feed(bytes(self._early_out))
            self._early_out.clear()
            if frames:
                on_frames(frames)
        if self._out_ended:
            loop.create_task(self._ended(on_frames))
            return

        def ended(corrupt: str = "") -> None:
            if self._out_ended:
                return
            if corrupt:  # the agent's stream is corrupt: the node is lost
                self.lost_reason = corrupt
            loop.remove_reader(self._out)
            self._out_ended = True
            loop.create_task(self._ended(on_frames))

        def deliver_handed() -> bool:
            """Deliver what read_direct left (under the lock); False if the stream ended."""
            handed, self._handed = self._handed, []
            for frames in handed:
                on_frames(frames)
            error, self._handed_error = self._handed_error, None
            if error is not None:
                ended(error)
                return False
            return True

        def readable() -> None:
            if not self._read_lock.acquire(blocking=False):
                return  # a caller reads it (read_direct), the loop's watch taken off
            try:
                if not deliver_handed():
                    return
                try:
                    frames = reader.read(self._out)
                except FrameError as e:
                    ended(str(e))
                    return
                except OSError:
                    frames = None
                if frames is None:
                    ended()
                else:  # also when only part of a frame came: the agent is alive
                    on_frames(frames)
            finally:
                self._read_lock.release()

        def handed_over() -> None:
            with self._read_lock:
                deliver_handed()

        self._handed_over = handed_over
        loop.add_reader(self._out, readable)

    def _filtered(self, on_stderr: Callable[[bytes], None]) -> Callable[[bytes], None]:
        """``on_stderr`` behind :attr:`stderr_filters` (called only when some bytes are
        left to pass on)."""
        filters = self.stderr_filters
        if not filters:
            return on_stderr

        def passed(data: bytes) -> None:
            for step in filters:
                data = step(data)
                if not data:
                    return
            on_stderr(data)

        return passed

    def hold_direct(self) -> bool:
        """Take the loop's watch of stdout off before a lone call is written (see
        :meth:`AgentProcess.hold_direct`), for this thread; False when the loop is
        reading right now. Only for as long as the write takes one system call: one that
        has to wait for room gives the watch back first (:meth:`write`), so the loop is
        never kept from the stream (nor :meth:`terminate` from its lock) while a write
        to a stalled agent waits."""
        epoll = self._watch_off()
        if epoll is None:
            return False
        self._holder = threading.get_ident()
        self._held = epoll
        return True

    def release_direct(self) -> None:
        epoll = self._held
        if epoll is not None and self._holder == threading.get_ident():
            self._held = None
            self._holder = 0
            self._watch_on(epoll)

    def read_direct(
        self,
        on_frames: FramesCallback,
        done: Callable[[], bool],
        budget: float,
        kinds: Collection[int],
        quiet: Callable[[], bool] | None = None,
    ) -> None:
        """Read stdout in this thread (not the event loop's: no hop between threads for a
        caller waiting for one result) and deliver its frames here, until ``done()`` or
        ``budget`` seconds have passed. The loop's watch of stdout is taken off meanwhile
        (one reader at a time: a lock), or was already by this thread
        (:meth:`hold_direct`: it is put back here). Frames of a kind not in ``kinds``
        (they are the loop's to handle), an error and the end of the stream are left to
        the loop, in order. Nothing happens when the loop is reading right now, or does
        not use epoll.

        When ``done()`` and ``quiet()`` (nothing else is awaited from the agent) at the
        end, the watch stays off (parked) until :meth:`watch`: the next lone call's
        reader takes it as it is, which saves the two changes of the loop's epoll set
        per call of a caller making lone calls one after another."""
        epoll = self._held
        if epoll is not None and self._holder == threading.get_ident():
            self._held = None
            self._holder = 0
        elif done():
            return
        else:
            epoll = self._watch_off()
        if epoll is None:
            return
        start = time.monotonic()
        park = False
        try:
            poller = self._poller
            if poller is None:
                poller = self._poller = select.poll()
                poller.register(self._out, select.POLLIN)
            deadline = start + budget
            spin = start + self._spin_window()
            while not done():
                ready: list[tuple[int, int]] = []
                while not ready and time.monotonic() < spin:  # see SPIN
                    ready = poller.poll(0)
                left = deadline - time.monotonic()
                if not ready and (left <= 0 or not poller.poll(left * 1000)):
                    return
                try:
                    frames = self._reader.read(self._out)
                except FrameError as e:
                    self._handed_error = str(e)  # the loop ends the stream, as if it read it
                    return
                except OSError:
                    return  # the loop reads again, and meets it
                if frames is None:
                    return  # the end: the loop reads it too (it stays)
                if all(kind in kinds for kind, _, _ in frames):
                    on_frames(frames)
                else:
                    self._handed.append(frames)
                    return
            park = quiet is not None and quiet()
        finally:
            took = time.monotonic() - start
            self._answered = took if took > SPIN else (self._answered + took) / 2
            self._watch_on(epoll, park)
        if park and quiet is not None and not quiet():  # a call sent meanwhile found the
            self.watch()  # read lock taken and the watch not yet parked: it is given back

    def watch(self) -> None:
        """Give the loop its watch of stdout back if a lone call's read left it off
        (:meth:`read_direct`'s ``quiet``); any thread, never waits. When the read lock is
        taken, its holder puts the watch back or reads, as it sees fit."""
        if self._parked is None or not self._read_lock.acquire(blocking=False):
            return
        try:
            epoll, self._parked = self._parked, None
            if epoll is not None:
                epoll.register(self._out, select.EPOLLIN)
        finally:
            self._read_lock.release()

    def _watch_off(self) -> select.epoll | None:
        """Take the loop's watch of stdout off (the loop no longer wakes for it) and hold
        the read lock, for :meth:`read_direct`; the loop's epoll set, for
        :meth:`_watch_on`. None, with nothing held: the loop is reading right now, the
        stream has ended, the loop does not use epoll, or frames an earlier direct read
        left are still the loop's to deliver (read here, later frames would pass them)."""
        loop = self._loop
        if loop is None or self._out_ended or not self._read_lock.acquire(blocking=False):
            return None
        taken = self._parked  # (off since the last lone call: nothing to change)
        if taken is not None:
            self._parked = None
            return taken
        try:
            epoll = _epoll_of(loop)
            if epoll is None or self._out_ended or self._handed or self._handed_error is not None:
                return None
            try:
                epoll.unregister(self._out)
            except OSError:
                return None
            taken = epoll
            return taken
        finally:
            if taken is None:
                self._read_lock.release()

    def _watch_on(self, epoll: select.epoll, park: bool = False) -> None:
        """Put the loop's watch back (before the loop gets the rest: what a direct read
        left it), or with ``park`` leave it off for the next lone call (see :meth:`watch`),
        and release the read lock."""
        try:
            if park:
                self._parked = epoll
                return
            epoll.register(self._out, select.EPOLLIN)
            if self._handed or self._handed_error is not None:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._handed_over)
        finally:
            self._read_lock.release()

    def _spin_window(self) -> float:
        """Seconds the next wait polls without sleeping (see SPIN): twice the recent
        answers' time, at most SPIN; none after a slow answer or with no core idle."""
        if self._answered > SPIN or not idle_core():
            return 0.0
        return min(SPIN, 2 * self._answered)

    def _read_stderr(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read stderr on ``loop`` from now on (once), into ``err_tail`` and the callback."""
        if self._err_ended is not None:
            return
        ended: asyncio.Future[None] = loop.create_future()
        self._err_ended = ended

        def on_data(data: bytes) -> None:
            self.err_tail = (self.err_tail + data)[-_ERR_TAIL:]
            self._on_stderr(data)

        read_chunks(loop, self._err, on_data, ended, None)

    async def _ended(self, on_frames: FramesCallback) -> None:
        await self.stderr_ended(_EXIT_WAIT)
        await self.wait(_EXIT_WAIT)
        on_frames(None)

    async def stderr_ended(self, timeout: float) -> None:
        """Wait up to ``timeout`` s until stderr has ended (being read): then ``err_tail``
        holds the child's last words, even when its stdout ended first."""
        if self._err_ended is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.shield(self._err_ended)

    # -- ending ------------------------------------------------------------------------
    async def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        delay = 0.001
        while self.proc.poll() is None:
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)
        return self.exit_status()

    def exit_status(self) -> int | None:
        return self.proc.poll()

    async def terminate(self) -> None:
        """End of stdin, then SIGTERM, then SIGKILL to the child's process group."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
                self.proc.send_signal(signal.SIGCONT)  # a stopped (frozen) agent acts on it
            if await self.wait(1.5) is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                await self.wait(1.0)
        if self._released:  # once only: the descriptor numbers may be another agent's now,
            return  # and removing the loop's reader of them would make it deaf to that one
        self._released = True
        if self.lanes is not None:
            self.lanes.close()
        # the loop's readers go before the descriptors close, also those a start left
        # (read_line, _read_stderr: no start_reading yet). A descriptor closed while still
        # watched leaves the loop a stale entry: the next pipe given that number is then
        # never watched (its registration finds the entry and does not reach epoll), and
        # that agent's stderr, ssh's own words on why it failed, is lost
        loop = self._loop or asyncio.get_running_loop()
        with self._read_lock:  # a read_direct puts the loop's watch back first
            self._parked = None  # (a later read_direct finds the descriptor closed)
            for fd in (self._out, self._err):
                with contextlib.suppress(Exception):
                    loop.remove_reader(fd)
        for stream in (self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()


def spawn(argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
    """Start ``argv`` with three unbuffered pipes in a new session (Ctrl-C reaches only
    the client, which then stops its pool in order)."""
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        bufsize=0,
        **kwargs,
    )


async def _read_once(loop: asyncio.AbstractEventLoop, fd: int) -> bytes:
    """One read of ``fd`` once it is readable; b"" at end of stream."""
    done: asyncio.Future[bytes] = loop.create_future()

    def on_data(data: bytes) -> None:
        if not done.done():
            done.set_result(data)

    read_chunks(loop, fd, on_data, done, b"")
    try:
        return await done
    finally:
        loop.remove_reader(fd)


def read_chunks(
    loop: asyncio.AbstractEventLoop,
    fd: int,
    on_data: Callable[[bytes], object],
    done: asyncio.Future[_T],
    at_end: _T,
) -> None:
    """Read ``fd`` on ``loop`` as it becomes readable, passing each chunk to ``on_data``;
    at end of stream (or a read error) stop reading and set ``done`` to ``at_end`` (unless
    it is set already). ``on_data`` may stop earlier with ``loop.remove_reader(fd)``."""

    def readable() -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            if not done.done():
                done.set_result(at_end)
            return
        on_data(data)

    loop.add_reader(fd, readable)
