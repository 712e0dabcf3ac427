"""flotilla's exception hierarchy.

Every error flotilla raises derives from :class:`FlotillaError`. Lower-level errors
(subprocess, SSH, schedulers) are translated at the boundary into these classes, with the
root cause first in the message. Errors raised by *user code* on a node are re-raised with
their original type when it can be imported locally; otherwise as :class:`RemoteError`.

    FlotillaError
    ├── ConfigurationError (ValueError)   bad input, detected before anything starts
    ├── SerializationError (TypeError)    a function/argument/result cannot be pickled
    ├── PoolClosedError (RuntimeError)    the pool is not running
    ├── ProvisionError                    the provider could not start a node
    ├── RemoteError                       user exception whose type is not importable here
    ├── TaskTimeoutError (TimeoutError)   a call ran longer than its ``timeout``
    └── WorkerDiedError                   the process running a call died under it
        └── NodeLostError                 the whole node (agent, connection) is gone
"""

from __future__ import annotations


class FlotillaError(Exception):
    """Base class of every error raised by flotilla itself."""


class ConfigurationError(FlotillaError, ValueError):
    """Invalid configuration, detected before anything is provisioned."""


class SerializationError(FlotillaError, TypeError):
    """A function, argument or result cannot be pickled.

    ``path`` says where the offending object sits (e.g. ``args[1]['x']``) and
    ``type_name`` is its type.
    """

    def __init__(self, message: str, *, path: str = "", type_name: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.type_name = type_name


class PoolClosedError(FlotillaError, RuntimeError):
    """An operation was attempted on a pool that is not running."""


class ProvisionError(FlotillaError):
    """The provider could not start or reach a node."""


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


class TaskTimeoutError(FlotillaError, TimeoutError):
    """A call ran longer than its ``timeout``; its process was stopped and replaced."""

    def __init__(self, message: str, *, node: int, timeout: float) -> None:
        super().__init__(message)
        self.node = node
        self.timeout = timeout


class WorkerDiedError(FlotillaError):
    """The process running a call died (crash, ``os._exit``, signal, OOM kill).

    ``exitcode`` is the exit status, ``signal`` the terminating signal's name (or None),
    ``stderr_tail`` the last lines the process wrote to stderr.
    """

    def __init__(
        self,
        message: str,
        *,
        node: int,
        exitcode: int | None = None,
        signal: str | None = None,
        stderr_tail: str = "",
    ) -> None:
        super().__init__(message)
        self.node = node
        self.exitcode = exitcode
        self.signal = signal
        self.stderr_tail = stderr_tail


class NodeLostError(WorkerDiedError):
    """A node's agent or its connection is gone; the node takes no more calls."""
