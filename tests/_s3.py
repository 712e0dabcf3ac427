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
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _hosts import SERVE_POLL, LabError, ensure_package

REGION = "us-east-1"


class S3Server:
    def __init__(self, addr: str = "127.0.0.1") -> None:
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = make_server(
            addr, 0, DomainDispatcherApplication(create_backend_app), threaded=True
        )
        self.thread = threading.Thread(
            target=self.server.serve_forever, args=(SERVE_POLL,), daemon=True
        )
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


class CheckingS3Server:
    """moto's S3 in its own process with authentication on (``INITIAL_NO_AUTH_ACTION_COUNT``:
    after the few unauthenticated calls that make an IAM user, every request must be
    signed with a known key and the right secret). ``key`` and ``secret`` are the user's
    (allowed s3:*); ``env`` points at the server with them."""

    def __init__(self, addr: str = "127.0.0.1") -> None:
        import subprocess
        import sys

        with socket.socket() as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
        exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3")
        self.proc = subprocess.Popen(
            [exe, "-H", addr, "-p", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.endpoint = f"http://{addr}:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection((addr, port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("moto_server did not listen") from None
                time.sleep(0.05)
        try:
            self._make_user()
        except BaseException:
            self.close()
            raise

    def _make_user(self) -> None:
        import boto3

        iam = boto3.client(
            "iam",
            region_name=REGION,
            endpoint_url=self.endpoint,
            aws_access_key_id="bootstrap",
            aws_secret_access_key="bootstrap",
        )
        iam.create_user(UserName="flotilla-test")
        policy = (
            '{"Version":"2012-10-17",'
            '"Statement":[{"Effect":"Allow","Action":"s3:*","Resource":"*"}]}'
        )
        iam.put_user_policy(UserName="flotilla-test", PolicyName="s3", PolicyDocument=policy)
        key = iam.create_access_key(UserName="flotilla-test")["AccessKey"]
        self.key, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            region_name=REGION,
            endpoint_url=self.endpoint,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
        )

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()
