"""flotilla's exception hierarchy: every error flotilla raises, in one tree.

Every error flotilla raises derives from :class:`FlotillaError`. Lower-level errors
(subprocess, SSH, schedulers) are translated at the boundary into these classes, with the
root cause first in the message. Errors raised by *user code* on a node are re-raised with
their original type when it can be imported locally; otherwise as :class:`RemoteError`.

    FlotillaError                           flotilla.FlotillaError
    ├── ConfigurationError                  bad input (arguments, settings), detected
    │   (ValueError, TypeError)             before anything starts
    │   ├── TaskError                       cli/taskfile.py: a task file that cannot run
    │   │                                   as written (path, line, field)
    │   ├── ClusterRequiredError            a distributed collection used where there is
    │   │   (RuntimeError)                  no cluster pool (Skyward raises RuntimeError)
    │   └── CorruptStateError               cli/state.py: a cluster's state file is
    │                                       unreadable (only that cluster is affected)
    ├── SerializationError (TypeError)      a function/argument/result cannot be pickled
    ├── PoolClosedError (RuntimeError)      the pool is not running
    ├── ProvisionError                      the provider could not start or reach a node
    │   │                                   (``cause``: a ProvisionCause)
    │   ├── ApiError                        _providers/cloud/rest.py: a RunPod, Lambda or
    │   │   │                               Vast API call failed (``status``, ``code``)
    │   │   └── VastApiError                _providers/vast/api.py: a Vast API call failed
    │   │                                   (Vast's ``error`` code: ``code``)
    │   └── GcpApiError                     _providers/gcp/api.py: a Compute API call or
    │                                       operation failed (``status``, ``codes``)
    ├── RemoteError                         user exception whose type is not importable here
    ├── TaskTimeoutError (TimeoutError)     a call ran longer than its ``timeout``
    ├── WorkerDiedError                     the process running a call died under it
    │   └── NodeLostError                   the whole node (agent, connection) is gone
    ├── StaleGenerationError                cli/state.py: a cluster's record belongs to a
    │                                       later launch of its name (an old daemon must
    │                                       leave it alone)
    ├── StorageError                        storage.py: an object store request failed
    │                                       (``status``: the HTTP status)
    ├── EngineError (RuntimeError)          plugins/_daemons.py: a Ray or Dask daemon did
    │                                       not start on a node, or the client could not
    │                                       reach it (``pool.dask_client()``)
    └── CLIError                            cli/main.py: a command that cannot go on
                                            (``code``: the exit status)

The classes defined here are the public ones (exported by :mod:`flotilla`): they print as
``flotilla.WorkerDiedError`` (their ``__module__`` is ``flotilla``) and pickle by that name.
The command line's four, the cloud providers' API errors and the engines' EngineError live
in their modules and stay internal. Two lower-level exceptions
never leave their layer: ``_node.build.BuildError`` (an environment build step failed; the
agent reports it, and the client raises ProvisionError) and
``_providers.bootstrap.NoAnswer`` (a remote start command ended without answering; the
remote shell explains it as a ProvisionError, in ``_providers.launch``).
"""

from __future__ import annotations

import copyreg
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

_E = TypeVar("_E", bound=type)
_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]  # (missing from typeshed)


def _public(cls: _E) -> _E:
    """Name ``cls`` by its public path, ``flotilla.<name>``: tracebacks, ``repr`` and
    pickles then show the name users import, not this private module's."""
    cls.__module__ = "flotilla"
    return cls


@_public
class FlotillaError(Exception):
    """Base class of every error raised by flotilla itself."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle as ``cls(*args)``, which fails for keyword-only attributes
        # (``node=``...): rebuild without calling __init__, then set ``args`` (OSError's
        # __new__, under TaskTimeoutError, ignores them) and the attributes.
        return _NEWOBJ, (type(self), *self.args), {"args": self.args, **self.__dict__}


@_public
class ConfigurationError(FlotillaError, ValueError, TypeError):
    """Invalid configuration or arguments, detected before anything is provisioned.

    Also a ValueError and a TypeError: code that catches either for a bad argument
    (``Compute(nodes=0)``, ``Image(apt="x")``) keeps working."""


@_public
class ClusterRequiredError(ConfigurationError, RuntimeError):
    """A distributed collection (``sky.dict``, ``counter``, ``lock``...) used where there is
    no cluster pool: outside ``with sky.Compute(...)``, or in a pool with
    ``Options(cluster=False)``.

    Also a RuntimeError, which Skyward raises there: a Skyward program's
    ``except RuntimeError`` keeps working."""


@_public
class SerializationError(FlotillaError, TypeError):
    """A function, argument or result cannot be pickled.

    ``path`` says where the offending object sits (e.g. ``args[1]['x']``) and
    ``type_name`` is its type.
    """

    def __init__(self, message: str, *, path: str = "", type_name: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.type_name = type_name


@_public
class PoolClosedError(FlotillaError, RuntimeError):
    """An operation was attempted on a pool that is not running."""


@_public
class ProvisionCause(Enum):
    """Why an agent did not start on a machine (:attr:`ProvisionError.cause`), set where the
    remote shell's failure is translated (``_providers/launch.py``) and read by callers that
    decide what to do next (retry a booting instance, set a spare host aside).
    """

    SPAWN = "spawn"
    """The remote shell command (ssh, srun...) cannot be run on this machine."""
    UNREACHABLE = "unreachable"
    """The machine did not answer or refused the connection (it may still be booting)."""
    UNKNOWN_HOST = "unknown-host"
    """The machine's name does not resolve."""
    IDENTITY = "identity"
    """The machine's identity could not be verified (an unknown or changed host key)."""
    AUTH = "auth"
    """The machine refused the login."""
    LAUNCHER = "launcher"
    """The launcher refused to run the agent there (a SLURM step that cannot start)."""
    NODE = "node"
    """The machine lacks what the agent needs (Python, a safe working directory, space)."""
    NO_ANSWER = "no-answer"
    """The remote shell ended without answering, for no reason it stated."""
    TIMEOUT = "timeout"
    """The agent did not start within the pool's start timeout."""
    CAPACITY = "capacity"
    """The provider has nothing that fits the request now (no offer, no capacity, or
    only above ``max_hourly_cost``): nothing was provisioned; another provider may have."""


@_public
class ProvisionError(FlotillaError):
    """The provider could not start or reach a node.

    ``cause`` says why, when an agent did not start (None for other failures: no capacity,
    an API error...).
    """

    def __init__(self, message: str, *, cause: ProvisionCause | None = None) -> None:
        super().__init__(message)
        self.cause = cause


@_public
class RemoteError(FlotillaError):
    """An exception raised on a node whose type cannot be rebuilt locally.

    ``type_name`` is the remote exception's qualified type name, ``remote_traceback`` its
    formatted traceback, ``node`` the rank of the node it was raised on.
    """

    def __init__(self, type_name: str, message: str, remote_traceback: str, node: int) -> None:
        super().__init__(f"{type_name}: {message} (raised on node {node})")
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback
        self.node = node


@_public
class TaskTimeoutError(FlotillaError, TimeoutError):
    """A call ran longer than its ``timeout``; its process was stopped and replaced.

    A trap: it is a ``TimeoutError``, and on Python 3.11+ so is
    ``concurrent.futures.TimeoutError``, which ``fut.result(timeout=...)`` raises when you
    stop waiting (the call goes on). ``except TimeoutError`` catches both: catch this class
    first, or check ``fut.done()``, to tell "the call timed out" from "I stopped waiting".
    """

    def __init__(self, message: str, *, node: int, timeout: float) -> None:
        super().__init__(message)
        self.node = node
        self.timeout = timeout


@_public
class WorkerDiedError(FlotillaError):
    """The process running a call died (crash, ``os._exit``, signal, OOM kill).

    ``exitcode`` is the exit status, ``signal`` the terminating signal's name (or None),
    ``stderr_tail`` the last lines the process wrote to stderr. ``restarted`` is True when
    the process was stopped because the pool's group was restarted: the cause is another
    rank's failure, which a broadcast raises in preference.
    """

    def __init__(
        self,
        message: str,
        *,
        node: int,
        exitcode: int | None = None,
        signal: str | None = None,
        stderr_tail: str = "",
        restarted: bool = False,
    ) -> None:
        super().__init__(message)
        self.node = node
        self.exitcode = exitcode
        self.signal = signal
        self.stderr_tail = stderr_tail
        self.restarted = restarted


@_public
class NodeLostError(WorkerDiedError):
    """A node's agent or its connection is gone; the node takes no more calls."""


def check_number(
    value: object, message: str, *, whole: bool = False, or_none: bool = False, **bounds: float
) -> None:
    """The check of a numeric option: raise ``ConfigurationError(message)`` unless ``value``
    is a number (an int when ``whole``; never a bool) within the ``bounds`` given:
    ``above`` (value > it), ``at_least`` (>=), ``at_most`` (<=), ``below`` (<); so no NaN
    where a bound is. With ``or_none``, None passes too."""
    if value is None and or_none:
        return
    if isinstance(value, bool) or not isinstance(value, int if whole else int | float):
        raise ConfigurationError(message)
    for name, bound in bounds.items():
        if not _WITHIN[name](value, bound):
            raise ConfigurationError(message)


_WITHIN: dict[str, Callable[[float, float], bool]] = {
    "above": lambda value, bound: value > bound,
    "at_least": lambda value, bound: value >= bound,
    "at_most": lambda value, bound: value <= bound,
    "below": lambda value, bound: value < bound,
}
"""The bounds of :func:`check_number`."""


def check_text(value: object, message: str, *, or_none: bool = False) -> None:
    """The check of a text option: raise ``ConfigurationError(message)`` unless ``value`` is
    a string with more than white space in it (or None, with ``or_none``)."""
    if value is None and or_none:
        return
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(message)
