"""The server's ASGI application: Starlette routes over ``api``, served by uvicorn.

``ENDPOINTS`` is the API's one description: the routes are made from it, and so is
``/openapi.json`` (docs/server.md lists the same, tested). Every request needs the token
(``Auth``); errors are JSON ``{"error": message}`` with the command line's message;
bodies are at most ``MAX_BODY`` bytes; event and output streams are Server-Sent Events.

Run as ``python -m flotilla.server.app --host H --port P`` (what ``flotilla server start``
starts), or through :func:`serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request, cookie_parser
from starlette.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from .._errors import ConfigurationError
from .._version import __version__
from ..cli.clusters import reattach_stale
from ..cli.observe import EVENTS, TOP
from ..cli.state import Paths, all_names, check_name, load
from . import api, control

MAX_BODY = 1 << 20
"""The largest request body (a task file) the server reads: 1 MiB; more is a 413."""
POLL = 0.25  # seconds between two looks at a followed file
KEEPALIVE = 15.0  # seconds between two comments on an idle stream (proxies close idle ones)
STATIC = Path(__file__).parent / "static"

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Endpoint:
    """One route of the API: what ``/openapi.json`` says of it and its handler."""

    method: str
    path: str
    summary: str
    handler: Handler
    query: tuple[tuple[str, str, str], ...] = ()  # (name, type, what)
    body: str = ""  # the request body's media type ('' for none)
    answer: str = "application/json"


class Streams:
    """The event and output streams open now (``flotilla_server_streams`` in /metrics)."""

    open = 0


# -- helpers ---------------------------------------------------------------------------------
def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "status": status}, status_code=status)


def _int(value: str | None, what: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise api.ApiError(400, f"{what} must be a whole number, got {value!r}") from None


async def _body(request: Request) -> bytes:
    """The request's body, refused (413) past ``MAX_BODY`` before it is all read."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY:
        raise api.ApiError(413, f"the body is {length} bytes; at most {MAX_BODY} are accepted")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise api.ApiError(413, f"the body is over {MAX_BODY} bytes, the most accepted")
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await _body(request)
    try:
        data = json.loads(raw or b"{}")
    except ValueError as e:
        raise api.ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise api.ApiError(400, f"the body must be a JSON object, not {type(data).__name__}")
    return data


async def _task_body(request: Request) -> tuple[str, bool]:
    """A task from the body: YAML (any text), or JSON ``{"command": "..."}`` or
    ``{"task": {...}}``; (text, whether it is a shell command)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    if kind == "application/json":
        data = await _json_body(request)
        if isinstance(data.get("command"), str) and data["command"].strip():
            return data["command"], True
        if isinstance(data.get("task"), dict):
            import yaml

            return yaml.safe_dump(data["task"]), False
        raise api.ApiError(400, 'a JSON body needs "command" (a string) or "task" (an object)')
    raw = await _body(request)
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise api.ApiError(400, "the task must be UTF-8 text (a YAML task file)") from None
    if not text.strip():
        raise api.ApiError(400, "the body is empty: send the task file (YAML) as the body")
    return text, False


def _sync(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
    return asyncio.to_thread(fn, *args)


# -- reads -----------------------------------------------------------------------------------
async def health(request: Request) -> Response:
    return JSONResponse({"ok": True, "version": __version__, "pid": os.getpid()})


async def list_clusters(request: Request) -> Response:
    return JSONResponse({"clusters": await _sync(api.clusters)})


async def get_cluster(request: Request) -> Response:
    return JSONResponse(await _sync(api.cluster, request.path_params["name"]))


async def list_jobs(request: Request) -> Response:
    return JSONResponse({"jobs": await _sync(api.jobs, request.path_params["name"])})


async def get_job(request: Request) -> Response:
    name, job_id = request.path_params["name"], request.path_params["job"]
    return JSONResponse(await _sync(api.job, name, job_id))


async def list_managed(request: Request) -> Response:
    return JSONResponse({"jobs": await _sync(api.managed_jobs)})


async def get_managed(request: Request) -> Response:
    return JSONResponse(await _sync(api.managed_job, request.path_params["job"]))


async def list_pools(request: Request) -> Response:
    return JSONResponse({"pools": await _sync(api.pools)})


async def metrics(request: Request) -> Response:
    text = await _sync(api.prometheus, Streams.open)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_document())


# -- streams ---------------------------------------------------------------------------------
def _frame(event: str, data: Any, ident: int | None = None) -> bytes:
    """One Server-Sent Event; ``ident`` (a byte offset in the file followed) is what the
    client sends back as ``Last-Event-ID`` when it reconnects, to go on from there."""
    head = f"id: {ident}\n" if ident is not None else ""
    text = json.dumps(data, separators=(",", ":"))
    return f"{head}event: {event}\ndata: {text}\n\n".encode()


def _resume(request: Request) -> int:
    """Where a reconnecting client stopped (its ``Last-Event-ID``), or 0: the start."""
    given = request.headers.get("last-event-id", "").strip()
    return int(given) if given.isdigit() else 0


def _stream(source: AsyncIterator[bytes]) -> StreamingResponse:
    async def counted() -> AsyncIterator[bytes]:
        Streams.open += 1
        try:
            yield b": flotilla\n\n"
            async for chunk in source:
                yield chunk
        finally:
            Streams.open -= 1

    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(counted(), media_type="text/event-stream", headers=headers)


async def _output(
    path: Path, finished: Callable[[], dict[str, Any] | None], start: int = 0
) -> AsyncIterator[bytes]:
    """A log file's lines from byte ``start`` (``output`` events, a batch each, its id the
    offset past it), then ``end`` once ``finished`` says the job ended."""
    tail = api.Tail(path, start)
    idle = 0.0
    while True:
        lines = await _sync(tail.read)
        if lines:
            idle = 0.0
            yield _frame("output", {"lines": lines}, tail.position)
        end = await _sync(finished)
        if end is not None:
            rest = await _sync(tail.rest)
            if rest:
                yield _frame("output", {"lines": rest}, tail.offset)
            yield _frame("end", {"status": end.get("status"), "exit_code": end.get("exit_code")})
            return
        idle += POLL
        if idle >= KEEPALIVE:
            idle = 0.0
            yield b": keepalive\n\n"
        await asyncio.sleep(POLL)


async def job_output(request: Request) -> Response:
    name, job_id = request.path_params["name"], request.path_params["job"]
    node = _int(request.query_params.get("node"), "node")
    path = await _sync(api.job_log, name, job_id, node)
    if request.query_params.get("follow") in ("0", "false", "no"):
        lines = await _sync(api.Tail(path).rest)
        return PlainTextResponse("".join(line + "\n" for line in lines))
    return _stream(_output(path, lambda: api.job_finished(name, job_id), _resume(request)))


async def managed_output(request: Request) -> Response:
    job_id = request.path_params["job"]
    path = await _sync(api.managed_log, job_id)
    return _stream(_output(path, lambda: api.managed_finished(job_id), _resume(request)))


def _top_stamp(paths: Paths) -> int:
    try:
        return os.stat(paths.dir / TOP).st_mtime_ns
    except OSError:
        return 0


async def cluster_events(request: Request) -> Response:
    """The cluster's events (``event``: from its start, or from where ``Last-Event-ID``
    says a reconnecting client stopped), its state when it changes
    (``state``) and its view when its metrics or nodes change (``view``: as
    ``GET /api/v1/clusters/NAME``)."""
    name = request.path_params["name"]
    paths, _ = await _sync(api.record_of, name)
    start = _resume(request)

    async def source() -> AsyncIterator[bytes]:
        tail = api.Tail(paths.dir / EVENTS, start)
        state, stamp, idle = "", -1, 0.0
        while True:
            sent = False
            for line, end in await _sync(tail.entries):
                try:
                    yield _frame("event", json.loads(line), end)
                    sent = True
                except ValueError:
                    continue
            try:
                detail = None
                now = await _sync(_top_stamp, paths)
                if now != stamp:
                    stamp = now
                    detail = await _sync(api.cluster, name)
                    yield _frame("view", detail)
                    sent = True
                current = (detail or await _sync(api.summary_of, name))["state"]
            except api.ApiError:
                yield _frame("state", {"cluster": name, "state": "GONE"})
                return
            if current != state:
                state = current
                yield _frame("state", {"cluster": name, "state": state})
                sent = True
            idle = 0.0 if sent else idle + POLL * 2
            if idle >= KEEPALIVE:
                idle = 0.0
                yield b": keepalive\n\n"
            await asyncio.sleep(POLL * 2)

    return _stream(source())


def _states() -> dict[str, str]:
    out = {}
    for name in all_names():
        try:
            rec = load(Paths(name))
        except Exception:
            out[name] = "CORRUPT"
            continue
        if rec is not None:
            out[name] = rec.observed_state().value
    return out


async def all_events(request: Request) -> Response:
    """Every cluster's events (each with its ``cluster``) and states, as they come."""

    async def source() -> AsyncIterator[bytes]:
        tails: dict[str, api.Tail] = {}
        states: dict[str, str] = {}
        idle = 0.0
        while True:
            sent = False
            now = await _sync(_states)
            for name, state in now.items():
                if states.get(name) != state:
                    yield _frame("state", {"cluster": name, "state": state})
                    sent = True
                tail = tails.setdefault(name, api.Tail(Paths(name).dir / EVENTS))
                for line in await _sync(tail.read):
                    try:
                        yield _frame("event", {**json.loads(line), "cluster": name})
                        sent = True
                    except ValueError:
                        continue
            for name in set(states) - set(now):
                yield _frame("state", {"cluster": name, "state": "GONE"})
                tails.pop(name, None)
                sent = True
            states = now
            idle = 0.0 if sent else idle + 1.0
            if idle >= KEEPALIVE:
                idle = 0.0
                yield b": keepalive\n\n"
            await asyncio.sleep(1.0)

    return _stream(source())


# -- actions ---------------------------------------------------------------------------------
async def launch(request: Request) -> Response:
    name = request.query_params.get("cluster") or f"flotilla-{os.urandom(2).hex()}"
    nodes = _int(request.query_params.get("nodes"), "nodes")
    try:
        check_name(name)
    except ConfigurationError as e:
        raise api.ApiError(400, str(e)) from None
    text, is_command = await _task_body(request)
    return JSONResponse(await _sync(api.launch, text, is_command, name, nodes), status_code=201)


async def exec_job(request: Request) -> Response:
    name = request.path_params["name"]
    nodes = _int(request.query_params.get("nodes"), "nodes")
    await _sync(api.record_of, name)
    text, is_command = await _task_body(request)
    return JSONResponse(await _sync(api.exec_, name, text, is_command, nodes), status_code=201)


async def cancel_job(request: Request) -> Response:
    name, job_id = request.path_params["name"], request.path_params["job"]
    return JSONResponse(await _sync(api.cancel, name, job_id))


async def cancel_managed(request: Request) -> Response:
    return JSONResponse(await _sync(api.cancel_managed, request.path_params["job"]))


def _lifecycle(action: str) -> Handler:
    async def handler(request: Request) -> Response:
        return JSONResponse(await _sync(api.lifecycle, action, request.path_params["name"]))

    handler.__name__ = f"{action}_cluster"
    return handler


# -- the dashboard ---------------------------------------------------------------------------
async def dashboard(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})


_NAME = ("name", "string", "the cluster")
ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("GET", "/api/v1/health", "the server answers: its version and pid", health),
    Endpoint(
        "GET", "/api/v1/clusters", "every cluster: state, provider, nodes, jobs", list_clusters
    ),
    Endpoint(
        "POST",
        "/api/v1/clusters",
        "launch a task (`flotilla launch TASK -c NAME -d`): the body is the task file "
        '(YAML), or JSON {"command": "..."}',
        launch,
        query=(("cluster", "string", "the cluster's name"), ("nodes", "integer", "its nodes")),
        body="application/yaml",
    ),
    Endpoint(
        "GET",
        "/api/v1/clusters/{name}",
        "one cluster: its nodes (phase, address, latest metrics), addresses, phase, jobs",
        get_cluster,
    ),
    Endpoint("DELETE", "/api/v1/clusters/{name}", "`flotilla down NAME`", _lifecycle("down")),
    Endpoint("POST", "/api/v1/clusters/{name}/stop", "`flotilla stop NAME`", _lifecycle("stop")),
    Endpoint("POST", "/api/v1/clusters/{name}/start", "`flotilla start NAME`", _lifecycle("start")),
    Endpoint(
        "POST",
        "/api/v1/clusters/{name}/exec",
        '`flotilla exec NAME TASK -d`: the body is a task file (YAML) or JSON {"command": "..."}',
        exec_job,
        query=(("nodes", "integer", "nodes to run on"),),
        body="application/yaml",
    ),
    Endpoint(
        "GET",
        "/api/v1/clusters/{name}/events",
        "Server-Sent Events: the cluster's events (`event`), state (`state`), view (`view`)",
        cluster_events,
        answer="text/event-stream",
    ),
    Endpoint(
        "GET", "/api/v1/clusters/{name}/jobs", "the cluster's jobs (`flotilla queue`)", list_jobs
    ),
    Endpoint("GET", "/api/v1/clusters/{name}/jobs/{job}", "one job", get_job),
    Endpoint(
        "GET",
        "/api/v1/clusters/{name}/jobs/{job}/output",
        "Server-Sent Events: the job's output (`output`: a batch of lines) until `end`; "
        "?follow=0: the output so far as text",
        job_output,
        query=(
            ("node", "integer", "only this node's output"),
            ("follow", "boolean", "0: what there is, as text"),
        ),
        answer="text/event-stream",
    ),
    Endpoint(
        "POST",
        "/api/v1/clusters/{name}/jobs/{job}/cancel",
        "`flotilla cancel NAME JOB`",
        cancel_job,
    ),
    Endpoint(
        "GET", "/api/v1/managed-jobs", "the managed jobs (`flotilla jobs queue`)", list_managed
    ),
    Endpoint("GET", "/api/v1/managed-jobs/{job}", "one managed job", get_managed),
    Endpoint(
        "GET",
        "/api/v1/managed-jobs/{job}/output",
        "Server-Sent Events: the managed job's output until `end`",
        managed_output,
        answer="text/event-stream",
    ),
    Endpoint(
        "POST", "/api/v1/managed-jobs/{job}/cancel", "`flotilla jobs cancel JOB`", cancel_managed
    ),
    Endpoint(
        "GET",
        "/api/v1/pools",
        "the running Python pools (each `Compute` with metrics on, while it runs)",
        list_pools,
    ),
    Endpoint(
        "GET",
        "/api/v1/events",
        "Server-Sent Events: every cluster's events and states",
        all_events,
        answer="text/event-stream",
    ),
    Endpoint(
        "GET",
        "/metrics",
        "Prometheus text: per-cluster and per-node gauges",
        metrics,
        answer="text/plain",
    ),
    Endpoint("GET", "/openapi.json", "this API's OpenAPI description", openapi),
)


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 description of ``ENDPOINTS``."""
    paths: dict[str, Any] = {}
    error = {
        "description": "an error: the message the command line prints",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    for e in ENDPOINTS:
        params = [
            {
                "name": p,
                "in": "path",
                "required": True,
                "schema": {"type": "integer" if p == "job" else "string"},
            }
            for p in _path_params(e.path)
        ]
        params += [
            {"name": n, "in": "query", "required": False, "schema": {"type": t}, "description": d}
            for n, t, d in e.query
        ]
        operation: dict[str, Any] = {
            "operationId": e.handler.__name__,
            "summary": e.summary,
            "parameters": params,
            "security": [{"bearer": []}, {"cookie": []}],
            "responses": {"200": {"description": "done", "content": {e.answer: {}}}, "4XX": error},
        }
        if e.body:
            operation["requestBody"] = {
                "content": {e.body: {"schema": {"type": "string"}}, "application/json": {}}
            }
        paths.setdefault(e.path, {})[e.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "flotilla", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": {
                "Error": {
                    "type": "object",
                    "properties": {"error": {"type": "string"}, "status": {"type": "integer"}},
                }
            },
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "cookie": {"type": "apiKey", "in": "cookie", "name": control.COOKIE},
            },
        },
    }


# -- authentication ----------------------------------------------------------------------------
class Auth:
    """Every request needs the token: ``Authorization: Bearer <token>`` or the
    ``flotilla_token`` cookie. ``GET /?token=<token>`` (the URL ``server start`` prints)
    sets the cookie (HttpOnly, SameSite=Strict) and sends the browser on to ``/`` without
    the token in its address."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    def _valid(self, given: str) -> bool:
        return bool(given) and hmac.compare_digest(given.encode(), self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = cookie_parser(headers.get("cookie", "")).get(control.COOKIE, "")
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if scope["path"] == "/" and "token" in query:
            if self._valid(query["token"][0]):
                response: Response = Response(status_code=303, headers={"Location": "/"})
                response.set_cookie(
                    control.COOKIE,
                    query["token"][0],
                    httponly=True,
                    samesite="strict",
                    path="/",
                )
                await response(scope, receive, send)
                return
            given = ""
        if not self._valid(given.strip()):
            response = JSONResponse(
                {
                    "error": "not authenticated: send `Authorization: Bearer <token>` "
                    f"(the token is in {control.token_path()}, readable only by its owner), "
                    "or open the URL `flotilla server start` printed",
                    "status": 401,
                },
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _wrap(handler: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except api.ApiError as e:
            return _error(e.status, e.message)

    wrapped.__name__ = handler.__name__
    return wrapped


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    detail = exc.detail if exc.status_code != 404 else f"no such path: {request.url.path}"
    return _error(exc.status_code, str(detail))


async def _crash(request: Request, exc: Exception) -> Response:
    return _error(500, f"the server failed: {type(exc).__name__}: {exc}")


def create_app(token: str) -> ASGIApp:
    """The application, every route behind :class:`Auth` with ``token``."""
    routes: list[Any] = [
        Route(
            e.path.replace("{job}", "{job:int}"),
            _wrap(e.handler),
            methods=[e.method],
            name=e.handler.__name__ + ":" + e.method,
        )
        for e in ENDPOINTS
    ]
    routes.append(Route("/", dashboard, methods=["GET"]))
    routes.append(Mount("/static", StaticFiles(directory=STATIC), name="static"))
    app = Starlette(
        routes=routes, exception_handlers={HTTPException: _http_error, Exception: _crash}
    )
    return Auth(app, token)


def serve(host: str, port: int, announce: Callable[[str], None] | None = None) -> None:
    """Listen on ``host``:``port`` (0: a free port) until SIGTERM or Ctrl-C, recorded in
    ``<home>/server/server.json`` meanwhile."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"flotilla server: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    sock.listen(512)  # connections wait in the backlog from now on, until uvicorn serves
    actual = int(sock.getsockname()[1])
    config = uvicorn.Config(
        create_app(control.token()),
        log_level="warning",
        timeout_graceful_shutdown=2,
        access_log=False,
    )
    control.write_info(host, actual)
    if announce is not None:
        announce(control.url(host, actual))

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)  # uvicorn, done, raises the signal it caught again: end here

    signal.signal(signal.SIGTERM, stop)
    # the clusters whose daemon died while their nodes ran: new daemons re-attach to them
    threading.Thread(target=reattach_stale, name="flotilla-reattach", daemon=True).start()
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C in the foreground: uvicorn has shut down
        pass
    finally:
        control.clear_info()
        sock.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flotilla.server.app")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=control.DEFAULT_PORT)
    p.add_argument("--announce", action="store_true", help="print the URLs once it listens")
    args = p.parse_args(argv)
    secret = control.token()
    serve(
        args.host,
        args.port,
        (lambda where: control.announce(where, secret)) if args.announce else None,
    )


if __name__ == "__main__":
    main()
