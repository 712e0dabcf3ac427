"""Calls made ready to send: the pool's :class:`Encoder` pickles each function once per pool
and each call's arguments once (in shared memory when the nodes can read them there and it
is worth it), and makes their submissions. What cannot be sent fails here, before any call
of a batch is sent (SerializationError)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from .._errors import SerializationError
from .._wire.frames import Buffer
from .._wire.serialize import describe_unpicklable, encode, pickle_obj
from . import shm
from .function import Function, PendingCall
from .futures import Batch, CallFuture
from .node import Payload, Submission
from .ranks import Ranks

Encoded = tuple[int, list[Buffer], Payload]
"""A call ready to be submitted: its function's key, the function's wire form, and its
arguments."""


class Encoder:
    """Turns a pool's calls into :class:`Submission` objects.

    Attributes:
        ranks: the pool's nodes (whether one reads shared memory) and its cancellable
            calls (``by_future``), see ``ranks.py``.
        shm_files: large arguments' files, kept for reuse (``shm.py``).
    """

    def __init__(self, ranks: Ranks, shm_prefix: str) -> None:
        self.ranks = ranks
        self.shm_files = shm.Files(shm_prefix)
        self._functions: dict[int, tuple[int, list[Buffer], Function[..., Any]]] = {}
        self.laned: dict[int, tuple[int, list[Buffer], Function[..., Any]]] = {}
        """:meth:`cached`'s answers for the functions whose calls may take a lane (no
        streamed argument, not a generator function: ``lanes.send``), by ``id``; kept by
        ``lanes.send``."""

    def function(self, fn: Function[..., Any]) -> tuple[int, list[Buffer]]:
        """The pool's key of ``fn`` and its wire form (pickled once per pool)."""
        cached = self._functions.get(id(fn))
        if cached is None or cached[2] is not fn:
            try:
                pickled = pickle_obj(fn.fn)
            except Exception as e:
                found = describe_unpicklable(fn.fn, fn.name)
                where = f": {found[0]} (type {found[1]}) cannot be pickled" if found else ""
                raise SerializationError(
                    f"function {fn.name} cannot be sent to the pool{where} ({e}); "
                    f"create such objects inside the function instead of capturing them",
                    path=found[0] if found else fn.name,
                    type_name=found[1] if found else "",
                ) from None
            cached = (len(self._functions) + 1, encode(pickled), fn)
            self._functions[id(fn)] = cached
        return cached[0], cached[1]

    def cached(self, fn: Function[..., Any]) -> tuple[int, list[Buffer]] | None:
        """The pool's key of ``fn`` and its wire form if it was pickled already."""
        cached = self._functions.get(id(fn))
        if cached is None or cached[2] is not fn:
            return None
        return cached[0], cached[1]

    def payload(self, call: PendingCall[Any], fn_key: int, shared: bool) -> Payload:
        """The call's arguments, pickled; in shared memory if ``shared`` and worth it."""
        try:
            pickled = pickle_obj((fn_key, call.args, call.kwargs))
        except Exception as e:
            found = describe_unpicklable(call.args, "args") or describe_unpicklable(
                call.kwargs, "kwargs"
            )
            path, type_name = (found[0], found[1]) if found else ("arguments", "")
            raise SerializationError(
                f"cannot send {call.function.name}(...) to the pool: {path} of type {type_name} "
                f"cannot be pickled ({e}); pass something picklable, "
                "or create it inside the function",
                path=path,
                type_name=type_name,
            ) from None
        file = None
        if shared and pickled.shm_bytes and any(n.shm for n in self.ranks.nodes):
            file = self.shm_files.write(pickled)
        return Payload(pickled, file, self.shm_files)

    def submission(
        self,
        call: PendingCall[Any],
        payload: Payload,
        fn_key: int,
        define: list[Buffer],
        pinned: bool,
        batch: Batch | None = None,
    ) -> Submission:
        """A call's submission; its future one of ``batch``'s."""
        fut: Future[Any] = CallFuture(batch)
        payload.acquire()
        fn = call.function
        sub = Submission(call, fut, fn_key, define, payload, fn.retries, fn.timeout or 0.0, pinned)
        self.ranks.by_future[id(fut)] = sub
        return sub

    def encode(self, calls: Sequence[PendingCall[Any]]) -> list[Encoded]:
        """Each call's function key and wire form, and its arguments pickled: what can
        fail (SerializationError) fails here, before any call of a batch is sent."""
        out = []
        for call in calls:
            key, define = self.function(call.function)
            out.append((key, define, self.payload(call, key, shared=False)))
        return out

    def prepare(
        self,
        calls: Sequence[PendingCall[Any]],
        encoded: Sequence[Encoded],
        batch: Batch | None = None,
    ) -> list[Submission]:
        """Submissions of ``calls`` (``encoded`` by :meth:`encode`), their futures of
        ``batch``."""
        return [
            self.submission(call, payload, key, define, pinned=False, batch=batch)
            for call, (key, define, payload) in zip(calls, encoded, strict=True)
        ]
