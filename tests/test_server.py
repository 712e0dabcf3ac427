"""``flotilla server``: the HTTP API and the dashboard, on real processes (issue 39).

The server runs as ``flotilla server start --port 0`` would for a user (a daemon on a free
loopback port, its own FLOTILLA_HOME); an HTTP client (httpx) drives the API, real local
clusters run behind it, and the dashboard runs in Debian's headless Chromium through
selenium (``test_dashboard.py``). Every wait is for a condition, with a generous deadline.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from _procs import alive, wait_until
from test_cli import CLI
from test_security import OtherUser
from test_security import other_user as other_user  # the fixture

from flotilla._system import procs

DEADLINE = 240.0  # seconds a cluster may take to come up on a loaded machine


@dataclass
class Server:
    url: str
    token: str
    pid: int
    cli: CLI

    def client(self, **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60.0, **kw)


def start_server(cli: CLI) -> Server:
    done = cli.ok("server", "start", "--port", "0", timeout=120)
    found = re.search(r"running at (http://127\.0\.0\.1:\d+)", done.stdout)
    assert found, done.stdout
    info = json.loads((cli.home / "server" / "server.json").read_text())
    token = (cli.home / "server" / "token").read_text().strip()
    assert f"{found[1]}/?token={token}" in done.stdout  # the URL the browser opens once
    return Server(found[1], token, int(info["pid"]), cli)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    cli = CLI(tmp_path / "home", tmp_path)
    running = None
    try:
        running = start_server(cli)
        yield running
    finally:
        cli.clean_up()
        cli("server", "stop", timeout=60)
        if running is not None:
            assert wait_until(lambda: not alive(running.pid), timeout=60), "server left running"


def sse(
    client: httpx.Client,
    path: str,
    until: Any,
    timeout: float = DEADLINE,
    headers: dict[str, str] | None = None,
    ids: list[tuple[str, str]] | None = None,
) -> list[Any]:
    """The (event, data) pairs of an event stream, read until ``until(event, data)``;
    ``ids`` gets the (event, id) of those that carry an id."""
    seen: list[Any] = []
    deadline = time.monotonic() + timeout
    with client.stream("GET", path, timeout=httpx.Timeout(timeout), headers=headers) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        event, ident = "", ""
        for line in answer.iter_lines():
            if line.startswith("id: "):
                ident = line[4:]
            elif line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                seen.append((event, data))
                if ids is not None and ident:
                    ids.append((event, ident))
                ident = ""
                if until(event, data):
                    return seen
            assert time.monotonic() < deadline, f"no end in {path}: {seen[-5:]}"
    raise AssertionError(f"{path} ended before its condition: {seen[-5:]}")


TASK = """\
name: api-job
num_nodes: 2
run: |
  for i in 1 2 3 4 5; do echo "line $i of rank $FLOTILLA_NODE_RANK"; done
"""


def test_the_api_launches_follows_streams_measures_and_downs_a_cluster(server: Server) -> None:
    """Through the API alone: launch a 2-node local cluster (the task as the body), follow
    its events to both nodes READY, stream the job's output to its end, read the nodes'
    metrics (the cluster's JSON and Prometheus' text), then DELETE it (``down``)."""
    with server.client() as c:
        answer = c.post(
            "/api/v1/clusters",
            params={"cluster": "two", "nodes": "2"},
            content=TASK,
            headers={"Content-Type": "application/yaml"},
        )
        assert answer.status_code == 201, answer.text
        assert answer.json()["cluster"] == "two" and answer.json()["job"] == 1

        ready: set[int] = set()

        def both_ready(event: str, data: Any) -> bool:
            if event == "event" and data.get("type") == "NodeReady":
                ready.add(int(data["node"]))
            return ready == {0, 1}

        sse(c, "/api/v1/clusters/two/events", both_ready)

        lines: list[str] = []
        end: dict[str, Any] = {}

        def ended(event: str, data: Any) -> bool:
            if event == "output":
                lines.extend(data["lines"])
            if event == "end":
                end.update(data)
            return event == "end"

        ids: list[tuple[str, str]] = []
        frames = sse(c, "/api/v1/clusters/two/jobs/1/output", ended, ids=ids)
        assert end["status"] == "SUCCEEDED", (end, lines)
        for rank in (0, 1):
            assert sum(f"line 5 of rank {rank}" in line for line in lines) == 1, lines

        # a client that reconnects (Last-Event-ID) goes on where it stopped, no line twice
        first = frames[0][1]["lines"]
        assert ids[0][0] == "output" and ids[0][1].isdigit()
        after: list[str] = []

        def rest(event: str, data: Any) -> bool:
            after.extend(data.get("lines", []))
            return event == "end"

        resumed = {"Last-Event-ID": ids[0][1]}
        sse(c, "/api/v1/clusters/two/jobs/1/output", rest, headers=resumed)
        assert first + after == lines, (first, after, lines)
        events: list[tuple[str, str]] = []
        sse(c, "/api/v1/clusters/two/events", lambda e, d: e == "view", ids=events)
        marks = [ident for event, ident in events if event == "event"]
        later: list[tuple[str, str]] = []
        sse(
            c,
            "/api/v1/clusters/two/events",
            lambda e, d: e == "view",
            headers={"Last-Event-ID": marks[-1]},
            ids=later,
        )  # only what came after the last event seen (none, or a few newer)
        assert all(int(i) > int(marks[-1]) for e, i in later if e == "event"), (marks, later)

        detail = c.get("/api/v1/clusters/two").json()
        assert detail["state"] == "UP" and len(detail["nodes"]) == 2
        assert [n["node"] for n in detail["nodes"]] == [0, 1]
        assert all(detail["addresses"]) and len(detail["addresses"]) == 2
        assert detail["jobs"][0]["status"] == "SUCCEEDED"

        def sampled() -> bool:
            nodes = c.get("/api/v1/clusters/two").json()["nodes"]
            return all("cpu" in n["metrics"] and n["metrics"].get("mem_total") for n in nodes)

        assert wait_until(sampled, timeout=DEADLINE), c.get("/api/v1/clusters/two").text
        text = c.get("/metrics").text
        for node in (0, 1):
            assert re.search(
                rf'^flotilla_node_cpu_percent\{{cluster="two",node="{node}"\}} [0-9.e+-]+$',
                text,
                re.M,
            ), text
            assert f'flotilla_node_memory_total_bytes{{cluster="two",node="{node}"}}' in text
        assert 'flotilla_cluster_up{cluster="two",state="UP"} 1' in text
        assert c.get("/api/v1/clusters").json()["clusters"][0]["name"] == "two"
        assert (
            c.get("/api/v1/clusters/two/jobs/1/output", params={"follow": "0"}).text.count(
                "line 3 of rank"
            )
            == 2
        )

        ran = c.post(
            "/api/v1/clusters/two/exec", json={"command": "echo exec says $FLOTILLA_NODE_RANK"}
        )
        assert ran.status_code == 201 and ran.json()["job"] == 2, ran.text
        sse(c, "/api/v1/clusters/two/jobs/2/output", lambda event, data: event == "end")
        text = c.get("/api/v1/clusters/two/jobs/2/output", params={"follow": "0"}).text
        assert "exec says 0" in text and "exec says 1" in text, text
        every = sse(
            c,
            "/api/v1/events",
            lambda e, d: e == "event" and d["cluster"] == "two" and d["type"] == "NodeReady",
        )
        assert ("state", {"cluster": "two", "state": "UP"}) in every

        stopped = c.post("/api/v1/clusters/two/stop")
        assert stopped.status_code == 200, stopped.text
        assert c.get("/api/v1/clusters/two").json()["state"] == "STOPPED"
        again = c.post("/api/v1/clusters/two/exec", json={"command": "true"})
        assert again.status_code == 409 and "is STOPPED" in again.json()["error"], again.text
        started = c.post("/api/v1/clusters/two/start")
        assert started.status_code == 200, started.text
        assert c.get("/api/v1/clusters/two").json()["state"] in ("STARTING", "UP")

        down = c.delete("/api/v1/clusters/two")
        assert down.status_code == 200, down.text
        gone = c.get("/api/v1/clusters/two")
        assert gone.status_code == 404
        assert gone.json()["error"].startswith("there is no cluster 'two'")
        assert c.get("/api/v1/clusters").json() == {"clusters": []}


def test_a_running_python_pool_is_listed_and_drops_out_when_it_ends(server: Server) -> None:
    """A ``Compute`` registers (its entry in ``$FLOTILLA_HOME/pools``) while it runs: the
    server lists it, and no longer once the program has ended."""
    program = server.cli.task(
        "pool.py",
        """
        import sys, time
        import flotilla as sky
        with sky.Compute(nodes=1) as pool:
            print("up", flush=True)
            sys.stdin.readline()
        """,
    )
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, program],
        env=server.cli.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        with server.client() as c:
            assert wait_until(
                lambda: [p["pid"] for p in c.get("/api/v1/pools").json()["pools"]] == [proc.pid],
                timeout=60,
            ), c.get("/api/v1/pools").text
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.close()
            assert proc.wait(timeout=120) == 0
            assert c.get("/api/v1/pools").json() == {"pools": []}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_every_request_needs_the_token_and_the_browser_gets_a_cookie(server: Server) -> None:
    """No token or a wrong one: 401 on every route, the dashboard too, with nothing of the
    state. The printed URL sets an HttpOnly cookie and leaves the token out of the page's
    address; the token's file is 0600 in a 0700 folder."""
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for path in ("/", "/api/v1/clusters", "/metrics", "/openapi.json", "/static/app.js"):
            answer = anonymous.get(path)
            assert answer.status_code == 401, (path, answer.text)
            assert "Bearer" in answer.json()["error"]
        wrong = {"Authorization": "Bearer " + "x" * len(server.token)}
        assert anonymous.get("/api/v1/clusters", headers=wrong).status_code == 401
        assert anonymous.get("/?token=nope").status_code == 401
        assert anonymous.delete("/api/v1/clusters/x").status_code == 401

        opened = anonymous.get("/", params={"token": server.token})
        assert opened.status_code == 303 and opened.headers["location"] == "/"
        cookie = opened.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        page = anonymous.get("/")  # the cookie, kept by the client as a browser keeps it
        assert page.status_code == 200 and "flotilla" in page.text
        assert anonymous.get("/api/v1/clusters").status_code == 200

    token = server.cli.home / "server" / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    restarted = server.cli("server", "start", "--port", "0")
    assert restarted.returncode != 0 and "already runs" in restarted.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (creates a user)")
def test_another_local_user_reaches_the_port_but_gets_nothing(
    server: Server, other_user: OtherUser
) -> None:
    """A second local user reaches the port but cannot read the token, and its own
    server's token gets a 401 with no cluster, path or secret in it."""
    port = int(server.url.rsplit(":", 1)[1])
    done = other_user.run(  # (its interpreter has only what the preamble imported)
        f"""
        try:
            open({str(server.cli.home / "server" / "token")!r}).read()
            print("read our token")
        except PermissionError:
            print("cannot read the token")
        theirs = os.urandom(32).hex()  # the token of a server of their own
        for auth in ("Authorization: Bearer " + theirs + "\\r\\n", ""):
            s = socket.socket()
            s.connect(("127.0.0.1", {port}))
            s.sendall(
                ("GET /api/v1/clusters HTTP/1.1\\r\\nHost: x\\r\\n" + auth
                 + "Connection: close\\r\\n\\r\\n").encode()
            )
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
            print(answer.decode())
        """
    )
    assert done.returncode == 0, done.stderr
    assert "cannot read the token" in done.stdout
    assert done.stdout.count("HTTP/1.1 401 Unauthorized") == 2, done.stdout
    assert "not authenticated" in done.stdout and '"clusters"' not in done.stdout
    assert server.token not in done.stdout


def test_bad_input_gets_a_clear_4xx_and_the_server_stays_up(server: Server) -> None:
    """Malformed JSON, an unknown cluster, a bad name, a task the CLI refuses, a huge body,
    an unknown path: each a JSON error with what was wrong; then the server still answers."""
    with server.client() as c:
        unknown = c.get("/api/v1/clusters/nope")
        assert unknown.status_code == 404
        assert "there is no cluster 'nope'" in unknown.json()["error"]
        assert "flotilla launch -c nope" in unknown.json()["error"]
        assert c.get("/api/v1/clusters/nope/events").status_code == 404
        assert c.delete("/api/v1/clusters/nope").status_code == 404
        bad = c.get("/api/v1/clusters/9bad!")
        assert bad.status_code == 404 and "not a valid cluster name" in bad.json()["error"]

        broken = c.post(
            "/api/v1/clusters",
            params={"cluster": "j"},
            content=b'{"command": ',
            headers={"Content-Type": "application/json"},
        )
        assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]
        listed = c.post(
            "/api/v1/clusters", content=b"[1]", headers={"Content-Type": "application/json"}
        )
        assert listed.status_code == 400 and "JSON object" in listed.json()["error"]
        named = c.post("/api/v1/clusters", params={"cluster": "-x"}, content=TASK)
        assert named.status_code == 400 and "not a valid cluster name" in named.json()["error"]
        nodes = c.post("/api/v1/clusters", params={"nodes": "two"}, content=TASK)
        assert nodes.status_code == 400 and "nodes must be a whole number" in nodes.json()["error"]

        refused = c.post(  # the CLI's own check, with the CLI's message
            "/api/v1/clusters", params={"cluster": "y"}, content="run: echo\nnum_nodes: -3\n"
        )
        assert refused.status_code == 400, refused.text
        direct = server.cli.task("bad.yaml", "run: echo\nnum_nodes: -3\n")
        said = server.cli("launch", direct, "-c", "y").stderr.replace(direct, "task")
        assert refused.json()["error"] in said, (refused.json(), said)

        huge = c.post("/api/v1/clusters", content=b"#" * (3 << 20))
        assert huge.status_code == 413 and "at most" in huge.json()["error"]
        assert c.get("/api/v1/nothing").status_code == 404
        assert c.get("/api/v1/nothing").json()["error"] == "no such path: /api/v1/nothing"
        assert c.put("/api/v1/clusters").status_code == 405
        assert c.get("/api/v1/clusters").json() == {"clusters": []}
        assert c.get("/api/v1/health").json()["ok"] is True


def _streams(c: httpx.Client) -> int:
    found = re.search(r"^flotilla_server_streams (\d+)$", c.get("/metrics").text, re.M)
    assert found
    return int(found[1])


def test_a_slow_client_holding_streams_blocks_nobody_and_leaks_nothing(server: Server) -> None:
    """Clients that open event streams and never read them: the server goes on answering
    everyone else, and once they hang up, their streams are gone (none left open)."""
    slow = []
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.sendall(
            f"GET /api/v1/events HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {server.token}\r\n\r\n".encode()
        )
        slow.append(s)
    try:
        with server.client() as c:
            assert wait_until(lambda: _streams(c) == 5, timeout=60), _streams(c)
            for _ in range(20):
                assert c.get("/api/v1/clusters").status_code == 200
            assert c.get("/api/v1/health").json()["ok"]
    finally:
        for s in slow:
            s.close()
    with server.client() as c:
        assert wait_until(lambda: _streams(c) == 0, timeout=60), _streams(c)


def test_the_openapi_description_matches_the_routes_and_the_docs(server: Server) -> None:
    """``/openapi.json`` lists every route the server answers (each one answered), and
    docs/server.md's API reference lists exactly those."""
    from flotilla.server.app import ENDPOINTS

    with server.client() as c:
        document = c.get("/openapi.json").json()
    described = {(m.upper(), p) for p, ops in document["paths"].items() for m in ops}
    assert described == {(e.method, e.path) for e in ENDPOINTS}
    docs = (Path(__file__).resolve().parent.parent / "docs" / "server.md").read_text()
    listed = set(re.findall(r"^\| `(GET|POST|DELETE) (/[^`]*)` \|", docs, re.M))
    assert listed == described, (described - listed, listed - described)


def test_server_status_and_stop(tmp_path: Path) -> None:
    """``status`` says where the server runs (exit 0) or that none does (exit 1); ``stop``
    ends it and its record; the token stays for the next start."""
    cli = CLI(tmp_path / "home", tmp_path)
    assert cli("server", "status").returncode == 1
    running = start_server(cli)
    try:
        status = cli.ok("server", "status")
        assert running.url in status.stdout and running.token not in status.stdout
        cli.ok("server", "stop")
        assert wait_until(lambda: not alive(running.pid), timeout=60)
        assert not (cli.home / "server" / "server.json").exists()
        assert cli("server", "status").returncode == 1
        again = start_server(cli)
        assert again.token == running.token and again.pid != running.pid
        port = again.url.rsplit(":", 1)[1]
        other = CLI(tmp_path / "other", tmp_path)  # another home, the same port: refused
        taken = other("server", "start", "--port", port)
        assert taken.returncode != 0 and "Address already in use" in taken.stderr, taken.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in taken.stderr
        assert other("server", "status").returncode == 1
    finally:
        cli("server", "stop")
        info = cli.home / "server" / "server.json"
        assert wait_until(lambda: not procs.alive(running.pid), timeout=60)
        assert not info.exists()  # the second server, stopped too


def test_a_foreground_server_answers_and_ends_with_ctrl_c(tmp_path: Path) -> None:
    """``--foreground``: the command itself serves (the URL printed once it listens) and
    Ctrl-C (SIGINT) ends it, its record removed."""
    import signal
    import subprocess
    import sys

    cli = CLI(tmp_path / "home", tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "flotilla", "server", "start", "--foreground", "--port", "0"],
        env=cli.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"running at (http://127\.0\.0\.1:\d+)", line)
        assert found, (line, proc.stderr.read() if proc.poll() is not None else "")
        token = (cli.home / "server" / "token").read_text().strip()
        answer = httpx.get(
            found[1] + "/api/v1/health", headers={"Authorization": f"Bearer {token}"}, timeout=60
        )
        assert answer.json()["pid"] == proc.pid
        assert cli.ok("server", "status").stdout.count(found[1]) >= 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert not (cli.home / "server" / "server.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_no_secret_value_is_served(server: Server) -> None:
    """A job given a secret (``--secret``) that prints it: the cluster, its jobs, the
    job's output (streamed and as text), its events and /metrics never carry the value."""
    secret = "s3cr3t-Value-" + os.urandom(6).hex()
    server.cli.ok(
        "launch",
        "-c",
        "sec",
        "--secret",
        "MY_TOKEN",
        "echo got $MY_TOKEN",
        env={"MY_TOKEN": secret},
    )
    with server.client() as c:
        lines: list[str] = []

        def ended(event: str, data: Any) -> bool:
            lines.extend(data.get("lines", []))
            return event == "end"

        sse(c, "/api/v1/clusters/sec/jobs/1/output", ended)
        assert any("got ***" in line for line in lines), lines
        served = [
            c.get(path).text
            for path in (
                "/api/v1/clusters",
                "/api/v1/clusters/sec",
                "/api/v1/clusters/sec/jobs",
                "/api/v1/clusters/sec/jobs/1/output?follow=0",
                "/metrics",
            )
        ]
        events = sse(c, "/api/v1/clusters/sec/events", lambda e, d: e == "view")
    assert all(secret not in text for text in served)
    assert secret not in json.dumps(events) and secret not in json.dumps(lines)


def test_a_managed_job_is_listed_followed_and_its_output_streamed(server: Server) -> None:
    """``flotilla jobs launch -d``: the API lists the managed job, streams its output to
    the end, and reports it SUCCEEDED."""
    task = server.cli.task("managed.yaml", "name: managed\nrun: echo managed says hi\n")
    done = server.cli.ok("jobs", "launch", task, "-d", timeout=180)
    assert done.returncode == 0
    with server.client() as c:
        listed = c.get("/api/v1/managed-jobs").json()["jobs"]
        assert [(j["id"], j["name"]) for j in listed] == [(1, "managed")]
        lines: list[str] = []

        def ended(event: str, data: Any) -> bool:
            lines.extend(data.get("lines", []))
            return event == "end"

        events = sse(c, "/api/v1/managed-jobs/1/output", ended)
        assert events[-1] == ("end", {"status": "SUCCEEDED", "exit_code": 0}), events[-3:]
        assert any("managed says hi" in line for line in lines), lines
        assert c.get("/api/v1/managed-jobs/1").json()["state"] == "SUCCEEDED"
        missing = c.get("/api/v1/managed-jobs/7")
        assert missing.status_code == 404 and "no managed job 7" in missing.json()["error"]


def test_the_command_line_works_without_the_server_extra(tmp_path: Path) -> None:
    """Without Starlette and uvicorn (hidden from the interpreter), every other command
    runs as before and loads neither; ``server start`` says which extra to install and
    starts nothing."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('starlette', 'uvicorn'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
    )
    cli = CLI(tmp_path / "home", tmp_path)
    cli.env["PYTHONPATH"] = str(hide) + os.pathsep + cli.env["PYTHONPATH"]
    assert "no clusters" in cli.ok("status").stdout
    assert "server" in cli.ok("--help").stdout
    refused = cli("server", "start", "--port", "0")
    assert refused.returncode == 2, refused.stderr
    assert "pip install 'flotilla[server]'" in refused.stderr
    assert not (cli.home / "server" / "server.json").exists()
    import subprocess
    import sys

    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from flotilla.cli.parser import build_parser; build_parser(); "
            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('starlette', 'uvicorn')))",
        ],
        env=cli.env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.strip() == "[]", loaded.stderr
