"""Keeping secret values out of everything that reaches the caller.

A secret is an ``env`` value wrapped in :class:`~flotilla.Secret` or stored under a name that
looks secret (``HF_TOKEN``, ``*_API_KEY``...), a plugin's token, or a task's ``secrets``.
Each flow towards a person has one redaction point, where every known secret value is
replaced by ``***``:

=========================  =============================================================
flow                       redaction point
=========================  =============================================================
task output lines          ``_PoolEvents.output`` (console and the CLI daemon's sink);
                           the CLI's ``Job.output`` for the job's own secrets
exceptions, tracebacks     ``Dispatcher.settle`` (:func:`redact_exception`), before a
                           future holds the error; node start-up errors in ``Node``
progress and build output  ``console.redact`` (start-up rows, bars, build output)
job reports, state files   ``Job.finish`` (the report; the state keeps its first line)
reprs                      ``Image``, ``Options`` (:func:`shown_env`), plugins (their own)
=========================  =============================================================

What redaction cannot catch: a *transformed* value. A task that prints the secret
base64-encoded, reversed, split over two lines, or one character at a time shows it in a
form that is not the value; so does a value shorter than :data:`MIN_CHARS` (not redacted, or
ordinary text would be blanked out). Redaction protects against accidents, not against
code that wants to leak a secret: such code could as well send it anywhere.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MIN_CHARS = 4
"""Shorter secret values are not redacted: they would blank out ordinary text."""
MASK = "***"
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|PRIVATE_?KEY|CREDENTIAL", re.I)


def looks_secret(name: str) -> bool:
    """Whether a variable or field named ``name`` holds a secret by its name alone."""
    return bool(_SECRET_NAME.search(name))


@dataclass(frozen=True, slots=True)
class Secret:
    """A value that must never be shown: in logs, progress, errors or files on disk.

    Wrap sensitive ``env`` values: ``Image(env={"WANDB_API_KEY": flotilla.Secret(key)})``.
    Variables whose names look secret (``HF_TOKEN``, ``*_PASSWORD``, ``*_API_KEY``...) are
    treated as secrets even when given as plain strings.
    """

    value: str = field(repr=False)

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


def is_secret(name: str, value: object) -> bool:
    """Whether an environment variable must be hidden."""
    return isinstance(value, Secret) or looks_secret(name)


def plain_env(env: Mapping[str, str | Secret]) -> dict[str, str]:
    """``env`` with secrets unwrapped, for the processes that need the values."""
    return {k: v.value if isinstance(v, Secret) else str(v) for k, v in env.items()}


def secret_values(env: Mapping[str, str | Secret]) -> list[str]:
    """The values to redact from anything shown to a person."""
    out = []
    for k, v in env.items():
        raw = v.value if isinstance(v, Secret) else str(v)
        if is_secret(k, v) and len(raw) >= MIN_CHARS:
            out.append(raw)
    return out


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret value (of at least MIN_CHARS) replaced by ``***``;
    longer values first, so that a secret containing another is hidden whole."""
    for s in sorted((s for s in secrets if len(s) >= MIN_CHARS), key=len, reverse=True):
        if s in text:
            text = text.replace(s, MASK)
    return text


def shown_env(env: Mapping[str, Any]) -> dict[str, Any]:
    """``env`` as reprs show it: secret values (wrapped, or by name) as ``***``."""
    return {k: MASK if is_secret(k, v) else v for k, v in env.items()}


def plugin_secrets(plugins: Iterable[Any]) -> list[str]:
    """Secret values plugins hold: dataclass fields that are a ``Secret`` or whose name
    looks secret (``plugins.huggingface(token=...)``)."""
    out: list[str] = []
    for plugin in plugins:
        if not dataclasses.is_dataclass(plugin):
            continue
        for f in dataclasses.fields(plugin):
            value = getattr(plugin, f.name, None)
            if isinstance(value, Secret):
                out.append(value.value)
            elif isinstance(value, str) and looks_secret(f.name):
                out.append(value)
    return [s for s in out if len(s) >= MIN_CHARS]


def _contains(text: str, secrets: Sequence[str]) -> bool:
    return any(s in text for s in secrets)


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__}>"


def redact_exception(exc: BaseException, secrets: Sequence[str]) -> BaseException:
    """``exc`` with secrets removed from everything it shows: its arguments, string
    attributes (``remote_traceback``, ``stderr_tail``...), notes (the remote traceback),
    and its cause and context, recursively. When its own ``__str__`` would still show a
    secret (computed from other state), a :class:`~flotilla.RemoteError` with the redacted
    text stands in for it, with the same node and traceback."""
    secrets = [s for s in secrets if len(s) >= MIN_CHARS]
    if not secrets:
        return exc
    seen: set[int] = set()
    return _redact_one(exc, secrets, seen)


def _redact_one(exc: BaseException, secrets: Sequence[str], seen: set[int]) -> BaseException:
    if id(exc) in seen:
        return exc
    seen.add(id(exc))
    args = []
    for a in exc.args:
        if isinstance(a, str):
            args.append(redact(a, secrets))
        elif _contains(_safe_repr(a), secrets):
            args.append(redact(_safe_repr(a), secrets))
        else:
            args.append(a)
    try:
        exc.args = tuple(args)
    except Exception:
        pass
    for name, value in list(vars(exc).items()):
        if isinstance(value, str) and _contains(value, secrets):
            try:
                setattr(exc, name, redact(value, secrets))
            except Exception:
                pass
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        notes[:] = [redact(n, secrets) if isinstance(n, str) else n for n in notes]
    for link in ("__cause__", "__context__"):
        inner = getattr(exc, link)
        if inner is not None:
            setattr(exc, link, _redact_one(inner, secrets, seen))
    try:
        shown = str(exc)
    except Exception:
        shown = ""
    if _contains(shown, secrets) or _contains(_safe_repr(exc), secrets):
        return _stand_in(exc, secrets, shown)
    return exc


def _stand_in(exc: BaseException, secrets: Sequence[str], shown: str) -> BaseException:
    from ._errors import RemoteError

    node = getattr(exc, "node", -1)
    tb = getattr(exc, "remote_traceback", "")
    stand_in = RemoteError(
        f"{type(exc).__module__}.{type(exc).__qualname__}",
        redact(shown, secrets),
        redact(tb if isinstance(tb, str) else "", secrets),
        node if isinstance(node, int) else -1,
    )
    for note in getattr(exc, "__notes__", None) or []:
        if isinstance(note, str):
            stand_in.add_note(redact(note, secrets))
    return stand_in
