"""The plugins' node-side hooks, entered by each executor before its first task (the plugins
arrive pickled: the node side imports none of them; see ``plugins._base`` for the hooks)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def enter_plugins(stack: ExitStack, plugins: list[Any]) -> None:
    """Enter each plugin's ``around_process`` context, in order, on ``stack``, with this
    process's ``instance_info()`` (``flotilla._info`` is imported only then: a pool without
    such hooks does without it).

    The hooks import frameworks (torch, jax...): hundreds of thousands of objects that live
    as long as the process. The cyclic garbage collector is paused meanwhile (its passes
    over them found nothing and cost a fifth of ``import torch``), and what exists
    afterwards is frozen (``gc.freeze``), so that later collections in the user's tasks do
    not walk it again either (:func:`collector_paused`).
    """
    with collector_paused():
        for plugin in plugins:
            hook = getattr(plugin, "around_process", None)
            if hook is None:
                continue
            from .._info import instance_info

            cm = hook(instance_info())
            if cm is not None:
                stack.enter_context(cm)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while the block makes objects that live as long
    as the process (imports), then freeze what exists (``gc.freeze``: no later collection
    walks it) and let the collector run again if it ran before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
