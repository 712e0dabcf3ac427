"""SLURM commands and jobs, as the SLURM provider (``provider``) uses them.

Queries (partitions, nodes, job states) run SLURM's own commands with this process's
environment minus the variables of a job it may run in, so that they address the cluster
(``SLURM_CONF`` is kept) and never the surrounding job. A :class:`Job` is the pool's
allocation: ``salloc`` with a holder command (see the provider's docstring for why), or a
job the program already runs in, which is never ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..._system.procs import die_with_parent, kill_all
from ..pipe import read_chunks
from ..retry import retried, transient_words
from .settings import parse_time

READY_MARKER = "FLOTILLA_SLURM_JOB"
SALLOC_EXIT_GRACE = 15
"""Seconds salloc gets to end by itself once its holder has ended (it relinquishes the job
within a second or two), before the holder's watchdog cancels the job and kills it."""
HOLDER = (
    f'echo "{READY_MARKER} $SLURM_JOB_ID $SLURM_JOB_NODELIST"; cat >/dev/null; '
    # the client closed stdin (release) or died: salloc should now relinquish the job and
    # exit. It may not: killed -9 at the wrong moment, a salloc whose client died was seen
    # to stay (parent PID 1) and spin once its controller was gone. A watchdog outlives
    # this shell by at most the grace: if the same salloc still runs then, it cancels
    # the job and kills salloc.
    "p=$PPID; t=$(cut -d' ' -f22 /proc/$p/stat 2>/dev/null); "
    "(trap '' HUP INT TERM; "
    f"timeout -s KILL {SALLOC_EXIT_GRACE} tail -s 0.2 --pid=$p -f /dev/null; "
    'if [ -n "$t" ] && [ "$(cut -d\' \' -f22 /proc/$p/stat 2>/dev/null)" = "$t" ]; then '
    'scancel "$SLURM_JOB_ID"; kill -KILL $p; fi) </dev/null >/dev/null 2>&1 &'
)
"""salloc's command: says the job runs, then holds it until the client closes stdin (the
client's end, even by kill -9, ends it); then makes sure salloc ends too (see above)."""
_PENDING_REPORT_EVERY = 30.0
"""Seconds between two console lines about a job that stays pending for the same reason."""
GONE_TIMEOUT = 10.0
"""Seconds release() waits for SLURM to stop listing a job before cancelling it again."""


def slurm_env() -> dict[str, str]:
    """This process's environment without the variables of a job it may run in (they
    would redirect srun/salloc into that job); SLURM_CONF is kept."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def fields(line: str) -> dict[str, str]:
    """``Key=Value Key2=Value2`` (scontrol -o) as a dict."""
    return {m[1]: m[2] for m in re.finditer(r"(\w+)=(\S*)", line)}


class _Busy(Exception):
    """A SLURM command that failed for a transient reason (see ``retry``)."""

    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        super().__init__(proc.stderr)
        self.proc = proc


def query(argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a SLURM query (tried again while the controller is busy or restarting, see
    ``retry``); ProvisionError when it cannot run or times out."""

    def once() -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=slurm_env(), timeout=timeout
        )
        if proc.returncode != 0 and transient_words(proc.stderr):
            raise _Busy(proc)
        return proc

    try:
        return retried(
            once,
            f"`{argv[0]}`",
            is_transient=lambda e: isinstance(e, _Busy),
        )
    except _Busy as e:
        return e.proc
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ProvisionError(f"`{' '.join(argv)}` failed: {e}") from e


def error_of(proc: subprocess.CompletedProcess[str]) -> str:
    text = (proc.stderr or proc.stdout).strip()
    return text.splitlines()[-1] if text else f"exit status {proc.returncode}"


def hostnames(nodelist: str) -> list[str]:
    """The node names of a SLURM host list (``n[1-3]``), in order."""
    proc = query(["scontrol", "show", "hostnames", nodelist])
    if proc.returncode != 0:
        raise ProvisionError(f"cannot expand the node list {nodelist!r}: {error_of(proc)}")
    return proc.stdout.split()


def node_addresses(names: Sequence[str]) -> dict[str, str]:
    """Node name -> NodeAddr (as SLURM knows it)."""
    proc = query(["scontrol", "-o", "show", "node", ",".join(names)])
    if proc.returncode != 0:
        raise ProvisionError(f"cannot look up the nodes {','.join(names)}: {error_of(proc)}")
    out = {}
    for line in proc.stdout.splitlines():
        f = fields(line)
        if "NodeName" in f:
            out[f["NodeName"]] = f.get("NodeAddr") or f["NodeName"]
    return out


def node_states(names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Node name -> (State, first word of Reason); empty when SLURM cannot be asked."""
    try:
        proc = query(["scontrol", "-o", "show", "node", ",".join(names)], timeout=10.0)
    except ProvisionError:
        return {}
    out = {}
    for line in proc.stdout.splitlines():
        f = fields(line)
        if "NodeName" in f:
            out[f["NodeName"]] = (f.get("State", ""), f.get("Reason", ""))
    return out


def gres_offer(gres: str) -> list[tuple[str, int]]:
    """GPU (type, count) pairs of a node's Gres string (``gpu:a100:8(S:0-1),gpu:v100:2``)."""
    out = []
    for entry in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = entry.strip().split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        kind = parts[1] if len(parts) > 2 else ""
        with contextlib.suppress(ValueError):
            out.append((kind.lower(), int(parts[-1])))
    return out


@dataclass(frozen=True)
class Partition:
    """What validation needs of a partition.

    Attributes:
        name: partition name.
        nodes: number of nodes in it.
        max_time: its MaxTime in seconds (None: unlimited).
        default_time: its DefaultTime in seconds (None: none).
        gpus: the GPU (type, count) offers of its nodes.
    """

    name: str
    nodes: int
    max_time: int | None
    default_time: int | None
    gpus: tuple[tuple[str, int], ...]


def parse_limit(text: str | None) -> int | None:
    if not text or text.upper() in ("UNLIMITED", "NONE", "INFINITE"):
        return None
    try:
        return parse_time(text)
    except ConfigurationError:
        return None


def format_time(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def say(message: str) -> None:
    """A console line about the job (queue state, choices made for the user)."""
    with contextlib.suppress(Exception):
        sys.stderr.write(f"flotilla: {message}\n")
        sys.stderr.flush()


class Job:
    """A SLURM job a pool uses: its id, nodes, and (when the pool made it) the salloc
    holding it."""

    def __init__(self, job_id: str, salloc: subprocess.Popen[bytes] | None, nodes: list[str]):
        self.id = job_id
        self.salloc = salloc
        self.nodes = nodes

    @property
    def owned(self) -> bool:
        return self.salloc is not None

    @classmethod
    async def submit(
        cls, argv: list[str], queue_timeout: float | None, outlives: bool = False
    ) -> Job:
        """Run salloc with the holder; return once the job runs. While it is pending, say
        so with SLURM's reason; on timeout, failure or cancellation, cancel it.
        ``outlives``: the job may outlive the client (its agents wait for a new one)."""
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=slurm_env(),
                start_new_session=True,
                # SIGTERM when the client (salloc's creating thread) dies, so that a
                # pending salloc revokes its request even when the client is killed -9.
                # Not when the job may outlive the client: salloc cancels a running job
                # on SIGTERM too (slurm_complete_job in its handler); a request still
                # pending when such a client dies is given back by the holder as soon as
                # it runs (nothing holds its input then).
                preexec_fn=partial(die_with_parent, signal.SIGTERM, None)
                if sys.platform == "linux" and not outlives
                else None,
            )
        except OSError as e:
            raise ProvisionError(f"cannot run salloc: {e}") from e
        job = cls("", proc, [])
        try:
            await job._wait_granted(argv, queue_timeout)
        except BaseException:
            await job.release()
            raise
        return job

    async def _wait_granted(self, argv: list[str], queue_timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        proc = self.salloc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        stderr = bytearray()
        err_done = loop.create_future()
        out_line = loop.create_future()
        _read_lines(loop, proc.stderr.fileno(), stderr, err_done, self._on_salloc_line)
        _read_first_line(loop, proc.stdout.fileno(), READY_MARKER.encode(), out_line)
        started = time.monotonic()
        last: tuple[str, str] | None = None
        reported = 0.0
        name = next(a.split("=", 1)[1] for a in argv if a.startswith("--job-name="))
        while not out_line.done():
            await asyncio.wait(
                [out_line, err_done], timeout=1.0, return_when=asyncio.FIRST_COMPLETED
            )
            if out_line.done():
                break
            waited = time.monotonic() - started
            if err_done.done() or proc.poll() is not None:
                await asyncio.wait([err_done], timeout=1.0)
                raise ProvisionError(_salloc_error(self.id, stderr.decode(errors="replace")))
            if queue_timeout is not None and waited > queue_timeout:
                why = f" ({last[0]}, reason: {last[1]})" if last else ""
                raise ProvisionError(
                    f"SLURM job {self.id or '(not yet numbered)'} ({name}) did not start within "
                    f"queue_timeout={queue_timeout:g} s{why}; it was cancelled"
                )
            if self.id:
                state = await loop.run_in_executor(None, job_state, self.id)
                if state is not None and state[0] == "PENDING":
                    now = time.monotonic()
                    if state != last or now - reported >= _PENDING_REPORT_EVERY:
                        say(
                            f"SLURM job {self.id} ({name}) is {state[0]} (reason: {state[1]}), "
                            f"waited {waited:.0f} s"
                        )
                        last, reported = state, now
        result = out_line.result()
        if result is None:
            await asyncio.wait([err_done], timeout=1.0)
            raise ProvisionError(_salloc_error(self.id, stderr.decode(errors="replace")))
        words = result.split()
        self.id = words[0] if words else self.id
        if len(words) < 2:
            raise ProvisionError(f"SLURM job {self.id} started without nodes")
        self.nodes = await loop.run_in_executor(None, hostnames, words[1])

    def _on_salloc_line(self, line: str) -> None:
        found = re.search(r"[Jj]ob allocation (\d+)", line)
        if found and not self.id:
            self.id = found[1]

    async def release(self) -> None:
        """End the job (only if the pool made it) and wait until SLURM no longer lists it."""
        proc = self.salloc
        if proc is None:
            return
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()  # the holder exits, salloc relinquishes the job
        if self.id:
            state = await loop.run_in_executor(None, job_state, self.id)
            if state is not None and state[0] == "PENDING":
                await loop.run_in_executor(None, query, ["scancel", self.id])
        elif proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)  # not numbered yet: salloc revokes it
        if await _wait_exit(proc, 2.0) is None:
            if self.id:
                await loop.run_in_executor(None, query, ["scancel", self.id])
            if await _wait_exit(proc, 3.0) is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await _wait_exit(proc, 1.0)
        if proc.poll() is not None:  # salloc ended: its holder's watchdog has no more to do
            kill_all(partial(_in_session, proc.pid))
        for stream in (proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        if self.id:
            deadline = time.monotonic() + GONE_TIMEOUT
            while await loop.run_in_executor(None, job_state, self.id) is not None:
                if time.monotonic() > deadline:
                    await loop.run_in_executor(None, query, ["scancel", self.id])
                    say(f"SLURM job {self.id} is still listed after release; cancelled it")
                    break
                await asyncio.sleep(0.02)


def _in_session(session: int, pid: int) -> bool:
    """Whether ``pid`` belongs to the session ``session`` (salloc's: it leads its own)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[3]) == session
    except (OSError, ValueError, IndexError):
        return False


def job_state(job_id: str) -> tuple[str, str] | None:
    """(state, reason) of a job while SLURM lists it as pending/running/completing; None
    once it is gone."""
    try:
        proc = query(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], timeout=10.0)
    except ProvisionError:
        return None
    line = proc.stdout.strip().splitlines()[:1]
    if proc.returncode != 0 or not line:
        return None
    state, _, reason = line[0].partition("|")
    return state, reason


def _salloc_error(job_id: str, stderr: str) -> str:
    """salloc's failure, root cause first."""
    cause, output = _cause("salloc", stderr)
    job = f" (job {job_id})" if job_id else ""
    return f"SLURM refused the pool's allocation{job}: {cause or 'salloc exited'}{output}"


def srun_error(host: str, job_id: str, status: int | None, stderr: str) -> ProvisionError:
    """The error for an agent step that ended before the agent ran: srun's cause first
    (with the node and job), what to do, then srun's last lines."""
    cause, output = _cause("srun", stderr)
    cause = cause or f"srun exited with status {status}"
    low = cause.lower()
    if any(w in low for w in ("invalid job id", "already completing", "completed", "expired")):
        todo = (
            f"the pool's job {job_id} ended before its agents started (cancelled with scancel, "
            "out of time or preempted): open the pool again"
        )
    elif any(w in low for w in ("node configuration", "not available", "more processors")):
        todo = (
            f"the step asks for more than job {job_id} holds on {host}: check the job's "
            f"resources (`scontrol show job {job_id}`) against Slurm(gres=..., sbatch_args=...)"
        )
    else:
        todo = (
            f"check the job (`scontrol show job {job_id}`) and the node (`scontrol show node "
            f"{host}`), and slurmd's log on {host}"
        )
    return ProvisionError(
        f"{host}: SLURM could not start the agent's step in job {job_id}: {cause}; {todo}{output}",
        cause=ProvisionCause.LAUNCHER,
    )


def _cause(command: str, stderr: str) -> tuple[str, str]:
    """(root cause, its output block) of a SLURM command's stderr: the first error line
    without the command's prefix ("" when there is none), and the last lines of the output
    under a header ("" when it said nothing)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()] or lines[-1:]
    cause = errors[0].removeprefix(f"{command}: error: ") if errors else ""
    output = f"\n--- {command}'s output ---\n" + "\n".join(lines[-10:]) if lines else ""
    return cause, output


def _read_lines(
    loop: asyncio.AbstractEventLoop,
    fd: int,
    buf: bytearray,
    done: asyncio.Future[None],
    on_line: Callable[[str], None],
) -> None:
    """Collect ``fd`` into ``buf`` on ``loop``, calling ``on_line`` per line; ``done`` at EOF."""
    os.set_blocking(fd, False)
    partial = bytearray()

    def on_data(data: bytes) -> None:
        buf.extend(data)
        del buf[:-8192]
        partial.extend(data)
        *lines, rest = partial.split(b"\n")
        partial[:] = rest
        for line in lines:
            on_line(line.decode(errors="replace"))

    read_chunks(loop, fd, on_data, done, None)


def _read_first_line(
    loop: asyncio.AbstractEventLoop, fd: int, marker: bytes, done: asyncio.Future[str | None]
) -> None:
    """Set ``done`` to the rest of the first line of ``fd`` starting with ``marker`` (None at
    EOF), then stop reading."""
    os.set_blocking(fd, False)
    buf = bytearray()

    def on_data(data: bytes) -> None:
        buf.extend(data)
        for line in bytes(buf).split(b"\n")[:-1]:
            if line.startswith(marker):
                loop.remove_reader(fd)
                if not done.done():
                    done.set_result(line[len(marker) :].decode(errors="replace").strip())
                return

    read_chunks(loop, fd, on_data, done, None)


async def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.01)
    return proc.returncode
