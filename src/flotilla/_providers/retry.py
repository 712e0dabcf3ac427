"""Transient API errors, retried with backoff: the one place every provider's API calls go
through (Vast's REST API, AWS's botocore clients, kubectl, SLURM's commands).

An error is transient (:func:`transient`) when trying again later may well work: an HTTP
5xx or 429 answer, a timeout, a connection reset, refused or closed before the answer (a
server restarting, a load balancer dropping one request). Anything else (a refused key,
a missing resource, a bad request) is raised at once. :func:`retried` calls a function up
to :data:`ATTEMPTS` times, sleeping :data:`FIRST_DELAY` s (doubling, with jitter, at most
:data:`MAX_DELAY` s) between attempts, and raises the last error when it never worked.

A create retried after an error whose request may have reached the server must not create
twice: the caller passes the provider's idempotency token (AWS's ``ClientToken``), or the
create is found again by the pool's label when the pool is released (see ``ledger``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

logger = logging.getLogger("flotilla")

T = TypeVar("T")

ATTEMPTS = 5
FIRST_DELAY = 0.25
MAX_DELAY = 4.0

TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
"""HTTP statuses worth another try."""
TRANSIENT_CODES = frozenset(
    {
        # AWS (botocore's own list of transient and throttling error codes)
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "Unavailable",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "RequestLimitExceeded",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "TooManyRequestsException",
        "SlowDown",
        "EC2ThrottledException",
        "IDPCommunicationError",
    }
)
"""Error codes of an API's answer (AWS's `Error.Code`) worth another try."""
TRANSIENT_WORDS = (
    # kubectl, from the API server or the connection to it
    "(InternalError)",
    "(ServiceUnavailable)",
    "(Timeout)",
    "(TooManyRequests)",
    "connection reset by peer",
    "connection refused",
    "was refused - did you specify the right host or port",
    "i/o timeout",
    "TLS handshake timeout",
    "the server is currently unable to handle the request",
    "net/http: request canceled",
    "unexpected EOF",
    # SLURM's commands, while slurmctld restarts or is busy
    "Socket timed out on send/recv operation",
    "Unable to contact slurm controller",
    "Slurm temporarily unable to accept job",
)
"""Words of a command-line client's error message (kubectl, squeue) worth another try."""


def transient(e: BaseException) -> bool:
    """Whether ``e`` (raised by an API call) may go away when the call is tried again."""
    status = getattr(e, "status", None)
    if isinstance(status, int) and status:
        return status in TRANSIENT_STATUS
    response = getattr(e, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        http = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code.startswith("Insufficient"):  # no capacity (a 500): another zone may have
            return False
        return code in TRANSIENT_CODES or (isinstance(http, int) and http >= 500)
    module = type(e).__module__
    if module.startswith(("botocore", "urllib3")):  # no answer at all
        name = type(e).__name__
        return any(
            word in name
            for word in ("Connection", "Timeout", "EndpointConnection", "ProtocolError")
        )
    if isinstance(e, TimeoutError | ConnectionError | socket.timeout | ssl.SSLEOFError):
        return True
    reason = getattr(e, "reason", None)  # urllib's URLError wraps the socket's error
    if isinstance(reason, BaseException) and reason is not e:
        return transient(reason)
    return transient_words(str(e))


def transient_words(said: str) -> bool:
    """Whether a command-line client's error message (kubectl's, squeue's) says the
    failure is transient (:data:`TRANSIENT_WORDS`)."""
    said = said.lower()
    return any(word.lower() in said for word in TRANSIENT_WORDS)


def delays(attempts: int = ATTEMPTS) -> Iterator[float]:
    """The sleeps between ``attempts`` attempts: :data:`FIRST_DELAY`, doubling up to
    :data:`MAX_DELAY`, each stretched by a random 0-50 % (callers retrying at once
    spread out)."""
    delay = FIRST_DELAY
    for _ in range(attempts - 1):
        yield delay * random.uniform(1.0, 1.5)
        delay = min(MAX_DELAY, delay * 2)


def retried(
    call: Callable[[], T],
    what: str,
    *,
    is_transient: Callable[[BaseException], bool] = transient,
    attempts: int = ATTEMPTS,
) -> T:
    """``call()``, tried again after a transient error (:func:`transient`) with backoff
    (:func:`delays`), up to ``attempts`` times in all; the last error when it never
    worked. ``what`` names the call in the log."""
    waits = delays(attempts)
    while True:
        try:
            return call()
        except Exception as e:
            wait = next(waits, None) if is_transient(e) else None
            if wait is None:
                raise
            logger.info("%s: %s; trying again in %.2f s", what, e, wait)
        time.sleep(wait)


async def retried_async(
    call: Callable[[], Awaitable[T]],
    what: str,
    *,
    is_transient: Callable[[BaseException], bool] = transient,
    attempts: int = ATTEMPTS,
) -> T:
    """:func:`retried` of a coroutine function, sleeping on the event loop."""
    waits = delays(attempts)
    while True:
        try:
            return await call()
        except Exception as e:
            wait = next(waits, None) if is_transient(e) else None
            if wait is None:
                raise
            logger.info("%s: %s; trying again in %.2f s", what, e, wait)
        await asyncio.sleep(wait)
