"""sky.Storage (Skyward's): upload / download / ls / exists / rm against a real S3
endpoint (moto's S3 server on loopback), signed by flotilla's standard-library client."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from _s3 import S3Server, s3_env  # noqa: F401 - the s3_env fixture

import flotilla as sky


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    s = S3Server("127.0.0.1")
    yield s
    s.close()


def storage_of(server: S3Server) -> sky.Storage:
    return sky.Storage(
        endpoint=server.endpoint,
        access_key=server.env["AWS_ACCESS_KEY_ID"],
        secret_key=lambda: server.secret_key,  # a callable credential
    )


def test_upload_ls_exists_download_rm(server: S3Server, tmp_path: Path) -> None:
    bucket = server.bucket()
    (tmp_path / "iris.csv").write_text("a,b\n1,2\n")
    data = tmp_path / "dataset"
    (data / "sub").mkdir(parents=True)
    (data / "x.bin").write_bytes(b"\x00" * 3000)
    (data / "sub" / "y.txt").write_text("y")
    with storage_of(server) as s:
        s.upload(bucket, tmp_path / "iris.csv")
        s.upload(bucket, tmp_path / "iris.csv", key="copies/iris.csv")
        s.upload(bucket, data)  # a folder: under its name
        assert sorted(s.ls(bucket)) == [
            "copies/iris.csv",
            "dataset/sub/y.txt",
            "dataset/x.bin",
            "iris.csv",
        ]
        assert s.ls(bucket, "dataset/") == ["dataset/sub/y.txt", "dataset/x.bin"]
        assert s.exists(bucket, "iris.csv") and not s.exists(bucket, "nope.csv")
        s.download(bucket, "dataset/x.bin", tmp_path / "out" / "x.bin")
        assert (tmp_path / "out" / "x.bin").read_bytes() == b"\x00" * 3000
        s.rm(bucket, "iris.csv")  # one object
        s.rm(bucket, "dataset/")  # a prefix
    assert server.keys(bucket) == ["copies/iris.csv"]


def test_credentials_from_the_environment(
    server: S3Server,
    s3_env: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    bucket = server.bucket({"k": b"v"})
    s = sky.Storage(endpoint=server.endpoint)  # also usable without `with`
    assert s.ls(bucket) == ["k"]
    assert server.secret_key not in repr(s)


def test_an_async_credential_and_errors(server: S3Server) -> None:
    async def secret() -> str:
        await asyncio.sleep(0)
        return server.secret_key

    s = sky.Storage(server.endpoint, server.env["AWS_ACCESS_KEY_ID"], secret)
    bucket = server.bucket({"k": b"v"})
    assert s.exists(bucket, "k")
    with pytest.raises(sky.StorageError, match="NoSuchBucket") as err:
        s.ls("flotilla-no-such-bucket")
    assert err.value.status == 404
    with pytest.raises(FileNotFoundError):
        storage_of(server).upload("b", "/nonexistent/file")
    with pytest.raises(sky.ConfigurationError, match="endpoint"):
        sky.Storage(endpoint="s3.example.com")


def test_presets_fill_in_the_endpoint() -> None:
    assert sky.storage.S3(region="eu-west-1").endpoint == "https://s3.eu-west-1.amazonaws.com"
    r2 = sky.storage.R2(account_id="abc", access_key="k", secret_key="s")
    assert r2.endpoint == "https://abc.r2.cloudflarestorage.com"
    assert sky.storage.Hyperstack(access_key="k", secret_key="s").path_style
    assert sky.storage.Backblaze(region="us-west-004", key_id="k", app_key="s").endpoint == (
        "https://s3.us-west-004.backblazeb2.com"
    )
    assert sky.storage.GCS(access_key="k", secret_key="s").endpoint.startswith("https://storage")
    assert sky.storage.Wasabi(access_key="k", secret_key="s").region == "us-east-1"


# -- Volume(storage=...) ------------------------------------------------------------------------
@sky.function
def read_and_write(folder: str) -> str:
    import os
    from pathlib import Path

    text = Path(folder, "in.txt").read_text()
    node = sky.instance_info().node
    with open(os.path.join(folder, f"out-{node}.txt"), "w") as f:
        f.write(text.upper())
    return text


def test_a_volume_of_a_storage_uses_its_endpoint_and_credentials(
    server: S3Server,
    s3_env: None,  # noqa: F811 - no AWS_* variables: only the Storage says where and who
) -> None:
    bucket = server.bucket({"data/in.txt": b"hello"})
    storage = storage_of(server)
    vol = sky.Volume(bucket, "vol", prefix="data", read_only=False, mode="copy", storage=storage)
    with sky.Compute(nodes=2, volumes=[vol]) as pool:
        assert read_and_write("vol") @ pool == ["hello", "hello"]
    assert server.get(bucket, "data/out-0.txt") == b"HELLO"
    assert server.get(bucket, "data/out-1.txt") == b"HELLO"


def test_volumes_share_one_storage(server: S3Server) -> None:
    a = sky.Volume("b", "x", storage=storage_of(server))
    b = sky.Volume("b", "y", storage=storage_of(server))
    with pytest.raises(sky.ConfigurationError, match="share one storage"):
        sky.Compute(volumes=[a, b]).open()
    with pytest.raises(sky.ConfigurationError, match=r"flotilla\.Storage"):
        sky.Volume("b", "x", storage="s3://b")
    missing = sky.Volume("flotilla-no-such-bucket", "x", storage=storage_of(server))
    with pytest.raises(sky.ConfigurationError, match="cannot be read"):
        sky.Compute(volumes=[missing]).open()


# -- Hyperstack's short-lived keys ----------------------------------------------------------------
class HyperstackAPI:
    """A stand-in of Hyperstack's InfraHub API for object storage keys, after Skyward's
    client (``POST /object-storage/access-keys`` with ``{"region": ...}`` answers the key's
    ``id``, ``access_key`` and ``secret_key`` at the top level; ``DELETE
    /object-storage/access-keys/{id}``; the account's key in an ``api_key`` header). Records
    every request."""

    API_KEY = "hs-api-key-never-shown"

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.keys: dict[int, str] = {}  # live keys: id -> access key
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.requests.append(("POST", self.path, body))
                if self.headers.get("api_key") != api.API_KEY:
                    return self._send(401, {"message": "invalid api key"})
                ident = len(api.requests)
                api.keys[ident] = f"HSKEY{ident:04d}"
                self._send(
                    201,
                    {"id": ident, "access_key": api.keys[ident], "secret_key": "hs-secret"},
                )

            def do_DELETE(self) -> None:
                api.requests.append(("DELETE", self.path, None))
                ident = int(self.path.rsplit("/", 1)[1])
                if self.headers.get("api_key") != api.API_KEY or api.keys.pop(ident, None) is None:
                    return self._send(404, {"message": "no such key"})
                self._send(200, {"status": True})

            def _send(self, status: int, value: Any) -> None:
                data = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hyperstack() -> Iterator[HyperstackAPI]:
    api = HyperstackAPI()
    yield api
    api.close()


def test_hyperstack_without_keys_creates_a_short_lived_one_and_deletes_it(
    server: S3Server, hyperstack: HyperstackAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYPERSTACK_API_KEY", HyperstackAPI.API_KEY)
    bucket = server.bucket()
    (tmp_path / "a.txt").write_text("hello")
    storage = sky.storage.Hyperstack(endpoint=server.endpoint, api_url=hyperstack.url)
    assert hyperstack.requests == []  # nothing made before it is used
    with storage:
        storage.upload(bucket, tmp_path / "a.txt")
        assert storage.ls(bucket) == ["a.txt"]
        assert hyperstack.requests == [
            ("POST", "/v1/object-storage/access-keys", {"region": "CANADA-1"})
        ]
        assert list(hyperstack.keys) == [1]
    assert hyperstack.keys == {}  # deleted when the block ended
    assert hyperstack.requests[-1] == ("DELETE", "/v1/object-storage/access-keys/1", None)
    assert HyperstackAPI.API_KEY not in repr(storage)


def test_hyperstack_without_any_key_says_what_to_give(
    hyperstack: HyperstackAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HYPERSTACK_API_KEY", raising=False)
    with pytest.raises(sky.ConfigurationError, match="HYPERSTACK_API_KEY"):
        sky.storage.Hyperstack()
    with pytest.raises(sky.ConfigurationError, match="together"):
        sky.storage.Hyperstack(access_key="k")
    refused = sky.storage.Hyperstack(api_key="wrong", api_url=hyperstack.url)
    with pytest.raises(sky.StorageError, match="refused to create") as info, refused:
        pass
    assert info.value.status == 401
