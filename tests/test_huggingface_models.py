"""``sky.plugins.huggingface(models=[...], token=...)`` (Skyward's signature): the models are
fetched into the hub's cache while the node's environment is built, with the token.

No hub is reachable here: a small stand-in of the hub's HTTP API serves one repository on
loopback, written from what ``huggingface_hub.snapshot_download`` asks (its source:
``repo_info`` -> ``GET /api/models/{repo}/revision/{rev}``, ``list_repo_tree`` ->
``GET /api/models/{repo}/tree/{sha}``, ``hf_hub_download`` -> ``HEAD`` then ``GET
/{repo}/resolve/{sha}/{file}`` with ``X-Repo-Commit`` and ``ETag``), reached through
``HF_ENDPOINT`` as a mirror would be. Real nodes (local provider) run the real build and
the real ``huggingface_hub``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import flotilla as sky
from flotilla._errors import ConfigurationError

pytest.importorskip("huggingface_hub")

TOKEN = "hf_St4ndInT0kenNeverShown"
SHA = "0123456789abcdef0123456789abcdef01234567"
FILES = {"config.json": b'{"hidden_size": 8}\n', "weights.bin": bytes(range(256)) * 64}


class Hub:
    """The stand-in hub: repository ``acme/tiny`` at commit :data:`SHA` with :data:`FILES`;
    every request is recorded (method, path, Authorization header)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def do_GET(self) -> None:
                self._answer(head=False)

            def _answer(self, head: bool) -> None:
                path = self.path.split("?", 1)[0]
                hub.requests.append((self.command, path, self.headers.get("Authorization", "")))
                repo = "/api/models/acme/tiny"
                if path == f"{repo}/revision/main":
                    siblings = [{"rfilename": name} for name in FILES]
                    self._json({"id": "acme/tiny", "sha": SHA, "siblings": siblings})
                elif path == f"{repo}/tree/{SHA}":
                    self._json(
                        [
                            {"type": "file", "path": name, "size": len(data), "oid": _oid(data)}
                            for name, data in FILES.items()
                        ]
                    )
                elif path.startswith(f"/acme/tiny/resolve/{SHA}/"):
                    name = path.rsplit("/", 1)[1]
                    data = FILES.get(name)
                    if data is None:
                        return self._missing()
                    self.send_response(200)
                    self.send_header("X-Repo-Commit", SHA)
                    self.send_header("ETag", f'"{_oid(data)}"')
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if not head:
                        self.wfile.write(data)
                else:
                    self._missing()

            def _json(self, value: Any) -> None:
                body = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _missing(self) -> None:
                body = b'{"error": "Repository not found"}'
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _oid(data: bytes) -> str:
    """A git blob id, as the hub gives for a file that is not in LFS."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def hub() -> Iterator[Hub]:
    h = Hub()
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh flotilla home (where nodes keep built environments)."""
    home = tmp_path / "home"
    monkeypatch.setenv("FLOTILLA_HOME", str(home))
    return home


@sky.function
def read_cached(name: str) -> bytes:
    """A model file from the hub's cache only (no network)."""
    from huggingface_hub import hf_hub_download

    with open(hf_hub_download("acme/tiny", name, local_files_only=True), "rb") as f:
        return f.read()


def test_models_are_fetched_into_the_cache_while_the_environment_is_built(
    hub: Hub, home: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "hf"
    image = sky.Image(env={"HF_ENDPOINT": hub.url, "HF_HOME": str(cache)})
    plugin = sky.plugins.huggingface(models=["acme/tiny"], token=TOKEN)
    with sky.Compute(nodes=1, image=image, plugins=[plugin]) as pool:
        fetched = [(m, p) for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
        assert sorted(p.rsplit("/", 1)[1] for _, p in fetched) == sorted(FILES)  # at build
        of_repo = [r for r in hub.requests if "acme/tiny" in r[1]]
        assert all(auth == f"Bearer {TOKEN}" for _, _, auth in of_repo), of_repo
        assert read_cached("config.json") >> pool == FILES["config.json"]
        assert read_cached("weights.bin") >> pool == FILES["weights.bin"]
        # the tasks read the cache: nothing of the repository was asked of the hub again
        assert [r for r in hub.requests if "acme/tiny" in r[1]] == of_repo
    snapshot = cache / "hub" / "models--acme--tiny" / "snapshots" / SHA
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(FILES)
    out, err = capfd.readouterr()
    assert TOKEN not in out + err


def test_a_model_the_hub_does_not_have_fails_the_start_naming_it(
    hub: Hub, home: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    image = sky.Image(env={"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")})
    plugin = sky.plugins.huggingface(models=["acme/absent"], token=TOKEN)
    with (
        pytest.raises(sky.ProvisionError, match="setup") as info,
        sky.Compute(nodes=1, image=image, plugins=[plugin]),
    ):
        pass
    assert "acme/absent" in str(info.value)
    out, err = capfd.readouterr()
    assert TOKEN not in str(info.value) + out + err


def test_skywards_signature_and_its_mistakes() -> None:
    plugin = sky.plugins.huggingface(models=["meta-llama/Llama-3.1-8B", "gpt2"], token=TOKEN)
    assert plugin.models == ("meta-llama/Llama-3.1-8B", "gpt2")
    assert TOKEN not in repr(plugin) and "***" in repr(plugin)
    assert sky.plugins.huggingface(["gpt2"]).models == ("gpt2",)  # positional, as Skyward's
    image = plugin.transform(sky.Image(), None)
    fetch = image.setup[-1]
    assert "snapshot_download" in fetch and '["meta-llama/Llama-3.1-8B", "gpt2"]' in fetch
    assert "huggingface_hub" in image.pip
    assert isinstance(image.env["HF_TOKEN"], sky.Secret)
    assert sky.plugins.huggingface().transform(sky.Image(), None).setup == ()  # no models
    with pytest.raises(ConfigurationError, match="token="):
        sky.plugins.huggingface("hf_abc")  # type: ignore[arg-type]  # the old positional token
    with pytest.raises(ConfigurationError, match="not a hub repository id"):
        sky.plugins.huggingface(models=["a b; rm -rf /"])
