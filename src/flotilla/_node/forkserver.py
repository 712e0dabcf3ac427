"""The fork server of a local pool: one warm interpreter that forks the pool's agents
(standard library only).

``python -m flotilla._node.forkserver FD``: the Local provider starts this once per
pool (see ``_providers/forks.py``) instead of a fresh interpreter per node. It imports the
agent's modules and those every agent imports next (its executors', the metrics
sampler's), nothing of the user's and no third-party module (neither cloudpickle nor any
plugin, CUDA or torch), starts no thread and sets no signal handler; then, single-threaded,
it says ``R 0`` (ready) and serves requests on ``FD`` (a ``SOCK_SEQPACKET`` Unix socket):

* a request is one message: JSON ``{"cwd", "env"}`` with three descriptors, the agent's
  stdin, stdout and stderr, and maybe a fourth, its lane socket (given to the agent in
  ``FLOTILLA_LANES``, see :mod:`.lanes`). The server forks; the child closes every descriptor of the
  server (the socket, the pidfds of the other agents), takes the three as 0, 1 and 2,
  starts a session of its own (``setsid``, as ``start_new_session`` does for a spawned
  agent: Ctrl-C reaches the client only, and a kill of the agent's group is the agent's
  alone), moves to ``cwd``, replaces its environment with ``env`` and its import path with
  the one ``env``'s ``PYTHONPATH`` gives a fresh agent, shows ``python -m flotilla.agent``
  as its command line (``ps``, ``/proc/PID/cmdline``: what tools look for to find an
  agent, written over the server's longer one) and runs the agent's
  :func:`~flotilla._node.agent.main`. The reply, once the child is set up, is ``P <pid>``
  (or ``E <pid> <why>`` if it could not be: it then exits 70).
* When an agent ends, the server reaps it (a pidfd per agent) and says ``X <pid> <code>``
  (``Popen.returncode``'s meaning: negative for a signal).

An agent forked from here is the same process a fresh ``python -m flotilla.agent`` would
be, but for what its interpreter read at start (the environment's ``PYTHON*`` variables:
the server was started with the agents' environment, so they are the same). What the
agent and its executors do next is unchanged: each executor is forked from its agent, in
a process group of its own that dies with the agent, and the agent kills every process
that carries its token at exit. A plugin's environment (``CUDA_VISIBLE_DEVICES`` and the
like) is applied by the executor before the user's code is imported, as before: nothing
here imported it.

The server ends once the client closed the socket (the pool is released, or the client is
gone) and every agent it forked has ended: it outlives none of them and none outlives
their client (each reads the end of its stdin when the client goes).
"""

from __future__ import annotations

import ctypes
import os
import select
import socket
import sys

from .. import _info  # noqa: F401  (warm: what every agent and executor imports)
from .._system import fastjson as json
from .._wire import code, serialize  # noqa: F401
from . import agent, executor, feeds, hooks, lanes, metrics, storechannel  # noqa: F401

_MESSAGE = 1 << 20
"""The largest request (its environment) the server reads."""


def serve(fd: int) -> None:
    """Serve the requests of the socket ``fd`` (see the module docstring) until the client
    closed it and every agent forked here has ended."""
    control = socket.socket(fileno=fd)
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in given]  # the interpreter's own
    agents: dict[int, int] = {}  # pidfd -> pid
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    serving = True
    _say(control, "R 0")  # ready: imported
    while serving or agents:
        for ready, _ in poller.poll():
            if ready in agents:
                pid = agents.pop(ready)
                poller.unregister(ready)
                os.close(ready)
                _, status = os.waitpid(pid, 0)
                _say(control, f"X {pid} {os.waitstatus_to_exitcode(status)}")
                continue
            try:
                data, fds, _, _ = socket.recv_fds(control, _MESSAGE, 4)
            except OSError:
                data, fds = b"", []
            if not data or len(fds) not in (3, 4):
                for received in fds:
                    os.close(received)
                if not data:  # the client closed it: serve the agents' ends, then exit
                    serving = False
                    poller.unregister(fd)
                continue
            sys.stderr.flush()
            ready, set_up = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(ready)
                _agent(control, list(agents), json.loads(data), fds, base, set_up)
            os.close(set_up)
            for received in fds:
                os.close(received)
            pidfd = os.pidfd_open(pid)
            agents[pidfd] = pid
            poller.register(pidfd, select.POLLIN)
            with os.fdopen(ready, "rb") as said:  # its end once set up (or why it failed)
                failed = said.read().decode(errors="replace")
            _say(control, f"E {pid} {failed}" if failed else f"P {pid}")


def _say(control: socket.socket, line: str) -> None:
    try:
        control.send(line.encode())
    except OSError:  # the client is gone: its agents end by themselves
        pass


def _agent(
    control: socket.socket,
    pidfds: list[int],
    request: dict[str, object],
    fds: list[int],
    base: list[str],
    set_up: int,
) -> None:
    """In the forked child: become a node's agent (see the module docstring), closing
    ``set_up`` once set up (after writing why, if that failed); never returns."""
    try:
        control.close()
        for pidfd in pidfds:
            os.close(pidfd)
        os.setsid()
        for target, received in enumerate(fds[:3]):
            os.dup2(received, target)
        for received in fds[:3]:
            os.close(received)
        cwd = str(request["cwd"])
        os.chdir(cwd)
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update(env)
        if len(fds) == 4:  # the client's lane socket (see lanes.py)
            os.environ[lanes.VAR] = str(fds[3])
        path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [cwd, *path, *base]  # as ``python -m`` with that PYTHONPATH has it
        sys.argv[1:] = []
        _retitle([os.fsencode(sys.orig_argv[0]), b"-m", b"flotilla.agent"])
    except BaseException as e:
        os.write(set_up, f"{type(e).__name__}: {e}".encode()[:4000] or b"?")
        os._exit(70)
    try:
        os.close(set_up)
        agent.main()
    except BaseException:
        import traceback  # (not in every agent forked from here: see executor._formatted)

        traceback.print_exc()
    finally:
        os._exit(70)


def _retitle(argv: list[bytes]) -> None:
    """Show ``argv`` as this process's command line: written over the one it started with
    (``arg_start``..``arg_end`` of ``/proc/self/stat``, its own stack), the rest zeroed;
    nothing where it does not fit or cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49
    except (OSError, IndexError, ValueError):
        return
    text = b"\0".join(argv) + b"\0"
    if start and len(text) <= end - start:
        ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
    os._exit(0)
