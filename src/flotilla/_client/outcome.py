"""What a RESULT frame becomes on the client: a value, or the exception to raise."""

from __future__ import annotations

import contextlib
import json
import pickle
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future, wait
from typing import Any

from .._errors import RemoteError, SerializationError, TaskTimeoutError, WorkerDiedError
from .._wire.exits import describe_exit
from .._wire.frames import Status
from .._wire.serialize import decode, shm_name_of, unlink_shm
from .function import Function
from .futures import Batch
from .loop import wait_slice
from .node import Node


def outcome(
    node: Node, fn: Function[..., Any], timeout: float, status: int, body: bytes | bytearray
) -> tuple[Any, BaseException | None]:
    """``(value, None)`` for a result of ``fn``, ``(None, exception)`` for a failure."""
    if status == Status.OK:
        value = decode(body, 1)
        shm = shm_name_of(body, 1)
        if shm:  # a large result came through shared memory; it is mapped now
            unlink_shm(shm)
        return value, None
    fn_name = fn.name
    if status == Status.ERROR:
        return None, remote_exception(decode(body, 1), node.rank)
    if status == Status.CANCELLED:
        return None, CancelledError()
    if status == Status.TIMEOUT:
        return None, TaskTimeoutError(
            f"{fn_name}(...) ran longer than its timeout of {timeout:g} s on {node.name}; "
            "its process was stopped and replaced",
            node=node.rank,
            timeout=timeout,
        )
    if status == Status.ABORTED:
        return None, stopped_by_restart(node, fn_name, bytes(body[1:]).decode(errors="replace"))
    if status == Status.DIED:
        death = json.loads(bytes(body[1:]))
        how, sig = describe_exit(death.get("exitcode"))
        how = death.get("reason") or how  # the agent ended it, and says why
        tail = death.get("stderr_tail", "").rstrip()
        msg = f"{node.name}: the process running {fn_name}(...) {how}"
        if tail:
            msg += f"\n--- last lines of its stderr ---\n{tail}"
        return None, WorkerDiedError(
            msg, node=node.rank, exitcode=death.get("exitcode"), signal=sig, stderr_tail=tail
        )
    return None, RemoteError("flotilla.ProtocolError", f"unknown status {status}", "", node.rank)


def stopped_by_restart(node: Node, fn_name: str, cause: str) -> WorkerDiedError:
    """The error of a call of ``node`` that the restart of the pool's group stopped (its
    ``cause``: what broke the group, e.g. another rank's exception)."""
    return WorkerDiedError(
        f"{node.name}: {fn_name}(...) was stopped because {cause}; the pool's processes "
        "form one group (a plugin's collective), so all of them were restarted",
        node=node.rank,
        restarted=True,
    )


def remote_exception(described: tuple[bytes | None, str, str, str], node: int) -> BaseException:
    """Rebuild a task's exception with its own type, or a RemoteError when that is impossible.

    The remote traceback is the exception's cause (see ``tracebacks``), and its
    ``remote_traceback`` attribute with ``node``.
    """
    data, type_name, message, tb = described
    if type_name == "flotilla.SerializationError":
        return SerializationError(f"{message} (on node {node})")
    exc: Any = None
    if data is not None:
        try:
            exc = pickle.loads(data)
        except Exception:
            exc = None
    if not isinstance(exc, Exception):  # not rebuildable here, or SystemExit & co.
        return RemoteError(type_name, message, tb, node)
    from .tracebacks import RemoteTraceback, user_frames

    shown = user_frames(tb)
    exc.__cause__ = RemoteTraceback(shown, node)  # printed first: the user's frames lead
    exc.add_note(f"(the remote traceback (node {node}) is above)")
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, "node", node)  # noqa: B010
        setattr(exc, "remote_traceback", tb)  # noqa: B010
    return exc


def _settled(waited: tuple[set[Future[Any]], set[Future[Any]]]) -> bool:
    """Whether a ``wait(..., FIRST_EXCEPTION)`` that may have timed out ended as one that
    did not: every future done, or one failed."""
    done, pending = waited
    return not pending or any(not f.cancelled() and f.exception() is not None for f in done)


def results(futures: list[Future[Any]]) -> list[Any]:
    """Wait for every future; raise the first failure as soon as it happens: the root
    cause, when several are in. A process or node that ended (a WorkerDiedError of its
    own) comes before a raised exception (in a group, its peers' collectives fail because
    it ended), and both before a call stopped by the group restart they caused."""
    batch = getattr(futures[0], "batch", None) if futures else None
    if not isinstance(batch, Batch) or not batch.wait(futures):
        while not _settled(wait(futures, wait_slice(), FIRST_EXCEPTION)):  # (Ctrl-C: loop.wait)
            pass
    failures = [e for f in futures if f.done() and (e := f.exception()) is not None]
    if failures:
        causes = [e for e in failures if not getattr(e, "restarted", False)]
        deaths = [e for e in causes if isinstance(e, WorkerDiedError)]
        raise (deaths or causes or failures)[0]
    return [f.result() for f in futures]
