"""sky.Storage (Skyward's): upload / download / ls / exists / rm against a real S3
endpoint (moto's S3 server on loopback), signed by flotilla's standard-library client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

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
