"""A cloud's JSON API over HTTP(S), spoken with the standard library (no SDK to install):
one :class:`RestApi` per API and key, every call tried again on transient errors
(``retry``), the key never shown (not in ``repr``, not in errors), a refused key a
ConfigurationError naming where the key came from, anything else a :class:`ApiError`
(a ProvisionError with the HTTP status and the API's own error code).

How each API authenticates differs (``Authorization: Bearer`` for RunPod's REST API and
Lambda's; RunPod's GraphQL API also takes ``?api_key=``): :class:`RestApi` sends the
header, a provider adds query arguments. ``find_key`` reads a key the way a provider's
own tools do: the argument, then environment variables, then files.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from ..._errors import ConfigurationError, ProvisionCause, ProvisionError
from ..retry import TRANSIENT_STATUS, retried

TIMEOUT = 30.0


def find_key(
    given: str | None, argument: str, variables: Sequence[str], files: Sequence[str] = ()
) -> tuple[str, str]:
    """(the key, where it came from): ``given`` (described as ``argument``), else the
    first environment variable of ``variables`` set, else the first non-empty file of
    ``files``; ("", what was tried) when there is none."""
    if given:
        return given, argument
    for name in variables:
        value = os.environ.get(name, "").strip()
        if value:
            return value, name
    for path in files:
        try:
            with open(os.path.expanduser(path)) as f:
                key = f.read().strip()
        except OSError:
            continue
        if key:
            return key, path
    return "", ", ".join([argument, *variables, *files])


def credential(found: tuple[str, str], what: str, fix: str) -> tuple[str, str]:
    """``found``: (a credential, where it came from) as a provider's key lookup gives it.
    When it found none (an empty key, and what it tried), a ConfigurationError ``no
    {what}: looked in {what it tried}; {fix}``."""
    if not found[0]:
        raise ConfigurationError(f"no {what}: looked in {found[1]}; {fix}")
    return found


class _Final(Exception):
    """An error answer not worth another try, carrying its exception past ``retried``."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class ApiError(ProvisionError):
    """An API call failed; ``status`` is the HTTP status (0: no answer), ``code`` the
    API's own error code ("" when it gave none)."""

    def __init__(self, message: str, status: int, code: str, cause: ProvisionCause | None) -> None:
        super().__init__(message, cause=cause)
        self.status = status
        self.code = code


class RestApi:
    """Calls to one JSON API with one key.

    Args:
        name: the API in messages ("RunPod API").
        url: its base URL (paths are appended).
        key: the key, sent as ``Authorization: Bearer``.
        source: where the key came from (a variable, an argument), in a refusal.
        error_code: reads the API's error code and message from a decoded error answer.
        capacity: tells an error answer that means "no capacity there now" (its cause is
            then ProvisionCause.CAPACITY: the caller tries elsewhere).
        error_type: the class of its errors (a provider's own :class:`ApiError`).
    """

    def __init__(
        self,
        name: str,
        url: str,
        key: str,
        source: str,
        error_code: Callable[[Any], tuple[str, str]] | None = None,
        capacity: Callable[[int, str, str], bool] | None = None,
        error_type: type[ApiError] = ApiError,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self._key = key
        self.source = source
        self._error_code = error_code or _error_code
        self._capacity = capacity or (lambda status, code, msg: False)
        self.error_type = error_type
        self.calls = 0

    def __repr__(self) -> str:
        return f"RestApi({self.name!r}, url={self.url!r})"

    def plain(self, text: str) -> str:
        """``text`` without the key in it."""
        return text.replace(self._key, "***") if self._key else text

    def call(
        self,
        method: str,
        path: str,
        what: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        url: str | None = None,
        auth: bool = True,
    ) -> Any:
        """``method`` ``{url}{path}`` with the JSON ``body``; the decoded answer
        (:meth:`decode`). ApiError saying ``what`` failed; ConfigurationError when the key
        is refused. ``auth=False``: no ``Authorization`` header (a token request)."""
        target = f"{(url or self.url).rstrip('/')}{path}"
        if query:
            target += "?" + urllib.parse.urlencode(query)
        data = json.dumps(body).encode() if body is not None else None
        try:
            return self._send(method, target, what, data, auth)
        except ConfigurationError:
            if not (auth and self.renew()):
                raise
            return self._send(method, target, what, data, auth)

    def renew(self) -> bool:
        """After a refusal: forget the credential made from the key (an API with tokens
        overrides it) and say whether the call is worth trying once more."""
        return False

    def _send(self, method: str, target: str, what: str, data: bytes | None, auth: bool) -> Any:
        """:meth:`call` of the full URL ``target`` with the encoded body ``data``."""
        headers = {"Accept": "application/json"}
        if auth:
            headers["Authorization"] = self.authorization()
        if data is not None:
            headers["Content-Type"] = "application/json"

        def once() -> Any:
            self.calls += 1
            req = urllib.request.Request(target, data=data, method=method, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as e:
                error = self.error(what, e.code, e.read())
                if getattr(error, "cause", None) is ProvisionCause.CAPACITY:
                    raise _Final(error) from None  # "no capacity" (even as a 5xx): at once
                if e.code not in TRANSIENT_STATUS:
                    raise _Final(error) from None
                e.flotilla_error = error  # type: ignore[attr-defined]  # if it never works
                raise
            return self.decode(raw)

        try:  # 5xx, 429, timeouts and resets: tried again (``retry``)
            return retried(once, f"{self.name} ({self.url}): {what}")
        except _Final as e:
            raise e.error from None
        except urllib.error.HTTPError as e:  # a transient error, every time
            raise getattr(e, "flotilla_error", None) or self.error(what, e.code, b"") from None
        except (OSError, ValueError) as e:
            raise self.error_type(
                f"{self.name} ({self.url}): cannot {what}: {self.plain(str(e))}",
                0,
                "",
                ProvisionCause.UNREACHABLE,
            ) from None

    def delete(self, path: str, what: str, body: Any = None) -> None:
        """``DELETE`` ``path`` (as :meth:`call`); one already gone (404) is no error."""
        try:
            self.call("DELETE", path, what, body)
        except ApiError as e:
            if e.status != 404:
                raise

    def authorization(self) -> str:
        """The ``Authorization`` header of a call (an API with tokens overrides it)."""
        return f"Bearer {self._key}"

    def decode(self, raw: bytes) -> Any:
        """A successful answer's body, decoded (JSON; an API that answers some calls with
        plain text overrides it)."""
        return json.loads(raw) if raw else {}

    def error(self, what: str, status: int, raw: bytes | Any) -> Exception:
        """The exception for an error answer (``raw``: its body, or its decoded JSON)."""
        if isinstance(raw, bytes):
            try:
                answer: Any = json.loads(raw)
            except ValueError:
                answer = {"message": raw[:200].decode(errors="replace")}
        else:
            answer = raw
        code, msg = self._error_code(answer)
        msg = self.plain(msg)
        if status in (401, 403):
            return ConfigurationError(
                f"{self.name} ({self.url}) refused the API key from {self.source} "
                f"({status}: {msg}) when asked to {what}: check {self.source}"
            )
        cause = ProvisionCause.CAPACITY if self._capacity(status, code, msg) else None
        return self.error_type(
            f"{self.name}: cannot {what} ({status}{', ' + code if code else ''}: {msg})",
            status,
            code,
            cause,
        )


def _error_code(answer: Any) -> tuple[str, str]:
    """(code, message) of an error answer: ``{"error": {"code", "message"}}`` (Lambda),
    ``{"error": "...", "message": ...}``, ``{"errors": [{"message"}]}`` (GraphQL)."""
    if not isinstance(answer, dict):
        return "", str(answer)[:200]
    error = answer.get("error")
    if isinstance(error, dict):
        return str(error.get("code", "")), str(error.get("message", "") or error)
    errors = answer.get("errors")
    if isinstance(errors, list) and errors:
        first = errors[0] if isinstance(errors[0], dict) else {"message": errors[0]}
        return str(first.get("code", "")), str(first.get("message", ""))
    message = answer.get("message") or answer.get("msg") or error or ""
    return (str(error) if error and message != error else ""), str(message)
