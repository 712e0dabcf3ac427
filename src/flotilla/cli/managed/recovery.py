"""``job_recovery`` (as SkyPilot has it, under ``resources:``) and what the controller does
after an attempt of a managed job ended badly.

Accepted forms, the same as SkyPilot's::

    resources:
      job_recovery: FAILOVER            # a strategy name (any case); EAGER_NEXT_REGION too
    resources:
      job_recovery:
        strategy: EAGER_NEXT_REGION     # optional; null means the default
        max_restarts_on_errors: 3       # restarts after the program failed (default 0)
        recover_on_exit_codes: [33, 34] # or one code: always restart, not counted

Two kinds of failure, told apart by the controller:

* **a node was lost** (its agent killed, its host gone, preempted): the program did not
  fail, so this never counts against ``max_restarts_on_errors``; the cluster is recovered
  and the job runs again, without limit (as SkyPilot does);
* **the program failed** (``setup`` or ``run`` exited non-zero on some node): restarted
  when one of the exit codes is in ``recover_on_exit_codes`` (not counted, but backing off:
  1 s before the first such restart in a row, doubled each time, at most 60 s), otherwise
  while fewer than ``max_restarts_on_errors`` restarts were made.

The strategies differ in where a recovered job goes. ``FAILOVER`` keeps the machines that
survived and replaces only the lost ones when the provider can (else relaunches the whole
cluster); ``EAGER_NEXT_REGION`` (SkyPilot's default) tears the whole cluster down and
relaunches it, since a preemption often means the place is short of machines. The local
and SSH providers have no regions: both relaunch on the same provider.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..._errors import ConfigurationError

STRATEGIES = ("FAILOVER", "EAGER_NEXT_REGION")
DEFAULT_STRATEGY = "EAGER_NEXT_REGION"
_FIELDS = ("strategy", "max_restarts_on_errors", "recover_on_exit_codes")


@dataclass(frozen=True)
class JobRecovery:
    """How a managed job recovers (the task file's ``resources.job_recovery``).

    Attributes:
        strategy: "FAILOVER" or "EAGER_NEXT_REGION" (see the module docstring).
        max_restarts_on_errors: restarts allowed after the program itself failed.
        recover_on_exit_codes: exit codes (0-255) after which the job is always restarted,
            without counting against ``max_restarts_on_errors``.
    """

    strategy: str = DEFAULT_STRATEGY
    max_restarts_on_errors: int = 0
    recover_on_exit_codes: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "max_restarts_on_errors": self.max_restarts_on_errors,
            "recover_on_exit_codes": list(self.recover_on_exit_codes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobRecovery:
        return cls(
            strategy=str(data.get("strategy", DEFAULT_STRATEGY)),
            max_restarts_on_errors=int(data.get("max_restarts_on_errors", 0)),
            recover_on_exit_codes=tuple(int(c) for c in data.get("recover_on_exit_codes", ())),
        )


def _strategy(value: Any, where: str) -> str:
    if value is None:
        return DEFAULT_STRATEGY
    if not isinstance(value, str):
        raise ConfigurationError(
            f"`{where}` must be a strategy name ({' or '.join(STRATEGIES)}), "
            f"got {type(value).__name__} {value!r}"
        )
    name = value.strip().upper().replace("-", "_")
    if name not in STRATEGIES:
        raise ConfigurationError(
            f"`{where}`: {value!r} is not a recovery strategy: use {' or '.join(STRATEGIES)}"
        )
    return name


def _exit_code(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise ConfigurationError(f"`{where}`: exit codes are whole numbers 0-255, got {value!r}")
    return value


def parse_job_recovery(value: Any, where: str = "resources.job_recovery") -> JobRecovery:
    """The ``job_recovery`` field's value (a strategy name, a mapping, or None) checked and
    made a JobRecovery; a ConfigurationError naming ``where`` and the fix otherwise."""
    if value is None:
        return JobRecovery()
    if isinstance(value, str):
        return JobRecovery(strategy=_strategy(value, where))
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"`{where}` must be a strategy name or a mapping with {', '.join(_FIELDS)}, "
            f"got {type(value).__name__}"
        )
    unknown = [str(k) for k in value if k not in _FIELDS]
    if unknown:
        raise ConfigurationError(
            f"`{where}`: unknown field {unknown[0]!r} (it takes {', '.join(_FIELDS)})"
        )
    restarts = value.get("max_restarts_on_errors", 0)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ConfigurationError(
            f"`{where}.max_restarts_on_errors` must be a whole number, 0 or more, got {restarts!r}"
        )
    codes_value = value.get("recover_on_exit_codes")
    codes: list[int] = []
    if codes_value is not None:
        items = codes_value if isinstance(codes_value, list) else [codes_value]
        for item in items:
            code = _exit_code(item, f"{where}.recover_on_exit_codes")
            if code in codes:
                raise ConfigurationError(
                    f"`{where}.recover_on_exit_codes` lists {code} twice: list each code once"
                )
            codes.append(code)
    return JobRecovery(
        strategy=_strategy(value.get("strategy"), f"{where}.strategy"),
        max_restarts_on_errors=restarts,
        recover_on_exit_codes=tuple(codes),
    )


class Cause(Enum):
    """Why an attempt of a managed job ended without success."""

    NODE_LOST = "node lost"
    """A node's agent, process or host went away under the job: not the program's fault."""
    PROGRAM_FAILED = "program failed"
    """``setup`` or ``run`` exited non-zero (or was killed by a signal) on some node."""


@dataclass(frozen=True)
class Decision:
    """What to do after a failed attempt.

    Attributes:
        recover: True: run the job again (after recovering the cluster if nodes were
            lost); False: the job fails.
        counted: whether this restart counts against ``max_restarts_on_errors``.
        reason: the decision in words, for the job's log and its failure report.
    """

    recover: bool
    counted: bool
    reason: str
    delay: float = 0.0
    """Seconds to wait before the job runs again (restarts on exit codes back off)."""


EXIT_CODE_BACKOFF = 1.0
"""Seconds before the first restart on a code of ``recover_on_exit_codes``; doubled for
each one in a row (a program that always exits so restarts ever more slowly)..."""
EXIT_CODE_BACKOFF_CAP = 60.0
"""...up to this many seconds between two restarts."""


@dataclass
class RecoveryPolicy:
    """Applies a JobRecovery to a job's successive failures (one per job).

    Attributes:
        recovery: the job's settings.
        restarts_on_errors: restarts made so far because the program failed (counted ones).
        recoveries: every recovery so far (node losses and restarts alike): ``jobs queue``
            shows it.
    """

    recovery: JobRecovery
    restarts_on_errors: int = 0
    recoveries: int = 0
    exit_code_streak: int = 0  # restarts on recover_on_exit_codes in a row

    def decide(self, cause: Cause, exit_codes: list[int]) -> Decision:
        """The decision after an attempt failed for ``cause`` (``exit_codes``: the failing
        nodes' statuses, 0-255, for PROGRAM_FAILED). Updates the counters."""
        rec = self.recovery
        if cause is Cause.NODE_LOST:
            decision = Decision(True, False, "a node was lost: recovering (not counted)")
        else:
            codes = ", ".join(map(str, exit_codes)) or "?"
            matched = [c for c in exit_codes if c in rec.recover_on_exit_codes]
            if matched:
                delay = min(EXIT_CODE_BACKOFF * 2.0**self.exit_code_streak, EXIT_CODE_BACKOFF_CAP)
                self.exit_code_streak += 1
                decision = Decision(
                    True,
                    False,
                    f"exit code {matched[0]} is in recover_on_exit_codes: restarting in "
                    f"{delay:g} s (not counted)",
                    delay,
                )
            elif self.restarts_on_errors < rec.max_restarts_on_errors:
                n = self.restarts_on_errors + 1
                decision = Decision(
                    True,
                    True,
                    f"the program failed (exit code {codes}): restart {n} of "
                    f"max_restarts_on_errors={rec.max_restarts_on_errors}",
                )
            elif rec.max_restarts_on_errors == 0:
                decision = Decision(
                    False,
                    False,
                    f"the program failed (exit code {codes}) and job_recovery allows no "
                    "restarts on errors (set resources.job_recovery.max_restarts_on_errors "
                    "to restart it)",
                )
            else:
                decision = Decision(
                    False,
                    False,
                    f"the program failed (exit code {codes}) after "
                    f"{self.restarts_on_errors} restart(s): max_restarts_on_errors="
                    f"{rec.max_restarts_on_errors} reached",
                )
        if decision.delay == 0.0:
            self.exit_code_streak = 0
        if decision.recover:
            self.recoveries += 1
            if decision.counted:
                self.restarts_on_errors += 1
        return decision
