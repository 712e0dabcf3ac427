"""A task whose ``resources`` have alternatives (``any_of``, ``ordered``, accelerator sets):
a cluster tried on each candidate in turn (see ``flotilla._providers.fallback``).

Each candidate is a complete provider spec of its own backend (the one its ``infra``
names, else the one the command line names), kept in the cluster's state file; the daemon
makes a ``Fallback`` of them, each with its own per-node resources. ``any_of`` and
accelerator sets try the cheapest first, ``ordered`` and accelerator lists in order. The
console says which candidate failed and why, and which was chosen with its price.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import ConfigurationError
from .base import Backend, ProviderSpec, ShellCommand

if TYPE_CHECKING:
    from ..._providers.base import Provider
    from ..state import NodeRecord, Paths
    from ..taskfile import Task


@dataclass(frozen=True)
class FallbackSpec(ProviderSpec):
    """Candidates tried in turn.

    Attributes:
        candidates: each candidate's spec, as its state-file data (JSON text, ``kind``
            included), in the task's order.
        allocation: ``"ordered"`` or ``"cheapest"``.
    """

    kind = "fallback"

    candidates: tuple[str, ...] = ()
    allocation: str = "ordered"

    def specs(self) -> list[ProviderSpec]:
        from .registry import spec_from_dict

        return [spec_from_dict(json.loads(c)) for c in self.candidates]

    def describe(self) -> str:
        order = " then " if self.allocation == "ordered" else " or "
        return "(" + order.join(s.describe() for s in self.specs()) + ")"


def fallback_spec(
    chosen: Backend[Any] | None, default: Backend[Any], args: argparse.Namespace, task: Task
) -> FallbackSpec:
    """The spec of a task with candidates: each candidate's backend is ``chosen`` (the
    command line named one), else the one its ``infra`` names, else ``default``; the
    command line's flags of a backend apply to its candidates."""
    from .base import infra_name
    from .registry import BACKENDS

    specs = []
    for res in task.resources.candidates:
        b = chosen
        if b is None:
            name = infra_name(res.infra)
            b = next((x for x in BACKENDS if name and name in x.infra), default)
        if b is chosen or b.given_flags(args):
            spec = b.spec_from_args(args)
            spec = replace(spec, settings=(*spec.settings, *b.given_settings(args)))
        else:
            spec = b.spec_type()
        one = replace(task, resources=replace(res, candidates=()))
        specs.append(b.with_task(spec, one))
    return FallbackSpec(
        candidates=tuple(json.dumps(s.to_dict()) for s in specs),
        allocation="ordered" if task.resources.ordered else "cheapest",
    )


class FallbackBackend(Backend[FallbackSpec]):
    spec_type = FallbackSpec
    summary = "a task's resources.any_of / ordered: candidates tried in turn"
    hint_reason = "each candidate's provider reports them"

    def spec_from_args(self, args: argparse.Namespace) -> FallbackSpec:
        raise ConfigurationError(
            "candidates come from a task file's resources.any_of / resources.ordered or an "
            "accelerator set, not from --provider"
        )

    def spec_from_dict(self, data: Mapping[str, Any]) -> FallbackSpec:
        spec = FallbackSpec.from_fields(data)
        assert isinstance(spec, FallbackSpec)
        return spec

    def check_task(self, task: Task, spec: FallbackSpec, cluster_nodes: int) -> list[str]:
        from .registry import backend_for

        warnings: list[str] = []
        for res, one in zip(task.resources.candidates, spec.specs(), strict=False):
            b = backend_for(one)
            b.check_nodes(one, cluster_nodes)
            sub = replace(task, resources=replace(res, candidates=()))
            warnings += b.check_resources(sub, one, cluster_nodes)
        return warnings

    def make_provider(self, spec: FallbackSpec, nodes_dir: Path) -> Provider:
        from ..._providers.fallback import Candidate, Fallback
        from .registry import backend_for

        candidates = []
        for i, one in enumerate(spec.specs()):
            b = backend_for(one)
            wants = b.pool_resources(one)
            provider = b.make_provider(one, nodes_dir / f"candidate-{i}")
            candidates.append(Candidate(provider, wants.accelerator, wants.vcpus, wants.memory_gb))
        return Fallback(candidates, spec.allocation)

    def shell(
        self,
        paths: Paths,
        spec: FallbackSpec,
        nodes: Sequence[NodeRecord],
        node: int,
        command: str,
    ) -> ShellCommand:
        """The shell of the candidate whose nodes these are (the first that knows them)."""
        from .registry import backend_for

        errors = []
        for one in spec.specs():
            try:
                return backend_for(one).shell(paths, one, nodes, node, command)
            except ConfigurationError as e:
                errors.append(str(e))
        raise ConfigurationError("; ".join(errors) or "no candidate")


BACKEND = FallbackBackend()
