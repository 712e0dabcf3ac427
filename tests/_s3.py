"""A real S3 endpoint on this machine: moto's S3 in server mode (HTTP, SigV4), as
``_aws.py`` starts moto for EC2.

``S3Server(addr)`` serves on ``addr`` (loopback for local pools, an SSH lab's bridge
address for its hosts); ``env`` holds the variables that point boto3, flotilla and the
nodes at it (``AWS_ENDPOINT_URL`` and test credentials with a secret key of its own, so
that tests can look for it in process lists and files). ``fuse_unavailable()`` says why
FUSE mounts cannot be tested here; ``ensure_fuse_tools()`` installs s3fs and rclone from
Debian (root only).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _hosts import LabError, ensure_package

REGION = "us-east-1"


class S3Server:
    def __init__(self, addr: str = "127.0.0.1") -> None:
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = make_server(
            addr, 0, DomainDispatcherApplication(create_backend_app), threaded=True
        )
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://{addr}:{self.server.server_port}"
        self.secret_key = "s3cret-" + secrets.token_hex(12)
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "AKIAFLOTILLATEST0001",
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            region_name=REGION,
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.secret_key,
        )

    def bucket(self, objects: dict[str, bytes] | None = None) -> str:
        """A new bucket holding ``objects`` (key -> bytes)."""
        name = "flotilla-test-" + secrets.token_hex(4)
        c = self.client()
        c.create_bucket(Bucket=name)
        for key, body in (objects or {}).items():
            c.put_object(Bucket=name, Key=key, Body=body)
        return name

    def get(self, bucket: str, key: str) -> bytes:
        return bytes(self.client().get_object(Bucket=bucket, Key=key)["Body"].read())

    def keys(self, bucket: str) -> list[str]:
        found = self.client().list_objects_v2(Bucket=bucket).get("Contents", [])
        return sorted(o["Key"] for o in found)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No AWS settings of this machine leak into a test (shared files, profiles)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/flotilla-test")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/flotilla-test")
    yield


def use(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)


def fuse_unavailable() -> str | None:
    """Why FUSE mounts cannot be tested here (None: they can; s3fs and rclone are then
    installed)."""
    if os.geteuid() != 0:
        return "FUSE mount tests install s3fs and mount: they need root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    try:
        ensure_fuse_tools()
    except LabError as e:
        return str(e)
    return None


def ensure_fuse_tools() -> None:
    ensure_package("fuse3", "/usr/bin/fusermount3")
    ensure_package("s3fs", "/usr/bin/s3fs")
    ensure_package("rclone", "/usr/bin/rclone")


def mounts_under(folder: str | Path) -> list[str]:
    """Mount points under ``folder`` (in this process's mount namespace)."""
    prefix = str(folder)
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    return [p for p in points if p.startswith(prefix)]


def processes_with(text: bytes) -> list[int]:
    """Pids whose command line contains ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found
