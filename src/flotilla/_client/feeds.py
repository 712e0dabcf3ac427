"""Streamed arguments (Skyward's input streaming): a parameter annotated ``Iterator[T]``
is sent to the node value by value while the task runs, instead of pickled whole (a
generator argument works). The task gets an iterator (``_node/feeds.py``).

A thread per streamed argument reads the caller's iterable and sends FEED frames, a window
ahead of the node's CREDIT. Only for calls sent to one node (``>>``, ``>``, ``&``,
``map``); a broadcast pickles its arguments whole.
"""

from __future__ import annotations

import collections.abc
import contextlib
import inspect
import threading
import typing
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from .._node import feeds as node_feeds
from .._wire.frames import CREDIT_BODY, STREAM_WINDOW, Kind
from .._wire.serialize import encode, pickle_obj
from .function import PendingCall

Node = Any  # _client.node.Node
Submission = Any  # _client.node.Submission


class Placeholder:
    """Pickled in place of a streamed argument: a Feed on the node."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (node_feeds.receive, (self.index,))


_streamed: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()
"""streamed_parameters' answers, by function (resolving annotations costs tens of µs)."""


def streamed_parameters(fn: Any) -> tuple[str, ...]:
    """The names of ``fn``'s parameters annotated ``Iterator[T]`` (or ``Iterator``)."""
    try:
        return _streamed[fn]
    except (KeyError, TypeError):  # TypeError: not weakly referenceable, never cached
        pass
    try:
        hints = typing.get_type_hints(inspect.unwrap(fn))
    except Exception:
        return ()  # not cached: a name the annotations need may be defined later
    names = tuple(
        name
        for name, hint in hints.items()
        if name != "return"
        and (
            hint is collections.abc.Iterator or typing.get_origin(hint) is collections.abc.Iterator
        )
    )
    with contextlib.suppress(TypeError):
        _streamed[fn] = names
    return names


def split(call: PendingCall[Any]) -> tuple[PendingCall[Any], list[Iterable[Any]]]:
    """``call`` with its streamed arguments replaced by placeholders, and those arguments."""
    names = streamed_parameters(call.function.fn)
    if not names:
        return call, []
    try:
        bound = inspect.signature(inspect.unwrap(call.function.fn)).bind(*call.args, **call.kwargs)
    except TypeError:
        return call, []  # the node raises the same error
    sources: list[Iterable[Any]] = []
    for name in names:
        if name in bound.arguments:
            sources.append(bound.arguments[name])
            bound.arguments[name] = Placeholder(len(sources) - 1)
    return PendingCall(call.function, bound.args, bound.kwargs), sources


class Pump:
    """Sends one streamed argument of a call (a thread), a window ahead of the node."""

    def __init__(
        self, sub: Submission, index: int, source: Iterable[Any], cancel: Callable[[], None]
    ) -> None:
        self.sub = sub
        self.cancel = cancel
        self.target: tuple[Node, int] | None = None  # where the values go: its first node
        self.index = index
        self.source = source
        self.allowed = STREAM_WINDOW
        self.cond = threading.Condition()
        sub.future.add_done_callback(lambda _: self.credit(0))  # a waiting pump ends

    def start(self) -> None:
        threading.Thread(target=self._run, name="flotilla-feed", daemon=True).start()

    def credit(self, more: int) -> None:
        with self.cond:
            self.allowed += more
            self.cond.notify_all()

    def _send(self, kind: int, parts: list[Any]) -> bool:
        node, tid = self.sub.node, self.sub.tid
        if self.sub.future.done():
            return False
        body = b"".join([bytes((self.index, kind)), *(bytes(p) for p in parts)])
        if (
            (node, tid) != self.target
            or node is None
            or not node.send_control(Kind.FEED, ident=tid, body=body)
        ):  # its node was lost (and the call perhaps sent elsewhere):
            self.cancel()  # the values sent so far are gone with the node
            return False
        return True

    def _run(self) -> None:
        assert self.sub.placed is not None
        self.sub.placed.wait()  # sent to a node (Node.send), or ended
        self.target = (self.sub.node, self.sub.tid)
        sent = 0
        try:
            for value in self.source:
                with self.cond:
                    while sent >= self.allowed and not self.sub.future.done():
                        self.cond.wait()
                if not self._send(node_feeds.ITEM, encode(pickle_obj(value))):
                    return
                sent += 1
        except Exception as e:
            self._send(node_feeds.ERROR, [f"{type(e).__name__}: {e}".encode()])
            return
        self._send(node_feeds.END, [])


def prepare(sub: Submission) -> None:
    """Before ``sub`` is dispatched: its pumps start sending once it is on a node."""
    sub.placed = placed = threading.Event()
    sub.future.add_done_callback(lambda _: placed.set())


def start(sub: Submission, sources: list[Iterable[Any]], cancel: Callable[[], None]) -> None:
    """Start sending ``sub``'s streamed arguments (``prepare``d, then dispatched): each
    waits until the call is on its node; ``cancel`` stops the call. The pumps are in place
    before any value is sent, so the node's CREDIT frames always find them."""
    sub.pumps = [Pump(sub, i, source, cancel) for i, source in enumerate(sources)]
    for pump in sub.pumps:
        pump.start()


def on_credit(sub: Submission, body: bytes | bytearray) -> None:
    """The node's leave to send more of one of ``sub``'s streamed arguments."""
    pumps = getattr(sub, "pumps", None)
    if pumps and body[0] < len(pumps):
        pumps[body[0]].credit(CREDIT_BODY.unpack_from(body, 1)[0])
