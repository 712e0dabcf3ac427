"""``Volume``: a bucket's objects at a path on every node, for data that outlives the pool.

The client checks every volume before anything is provisioned (the bucket exists and the
credentials can list it, with boto3: the ``aws`` extra) and sends each node's agent the
volumes with the credentials it resolved (the standard AWS chain: environment, shared
files, SSO, instance role...) and the endpoint (``AWS_ENDPOINT_URL_S3``, else
``AWS_ENDPOINT_URL``). The credentials travel in the agent's configuration over its
protocol pipe, as secrets: they are redacted from everything the pool shows, never on a
command line or in a file. The node side is ``flotilla._node.volumes``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._errors import ConfigurationError, check_number

MODES = ("mount", "copy")
DEFAULT_SYNC_INTERVAL = 60.0


@dataclass(frozen=True)
class Volume:
    """A bucket (S3) whose objects under ``prefix`` appear at ``mount`` on every node
    before the pool's functions run.

    Args:
        bucket: the bucket's name, or ``s3://bucket/prefix``.
        mount: the path on each node; ``~`` is the node's home, a relative path is inside
            the node's working folder (on a local pool: each node's own folder). On a
            local pool, each node sees its own mount at an absolute path (a mount
            namespace of its own: root, or user namespaces; see ``_node.volumes``).
        prefix: the key prefix shown at ``mount`` ("" for the whole bucket).
        read_only: False to write back what the nodes write there.
        mode: ``"mount"``: a FUSE mount (s3fs or rclone) where the node has FUSE, else a
            copy; ``"copy"``: copied in before the functions run and, when writable, copied
            back every ``sync_interval`` seconds and when the pool closes.
        sync_interval: seconds between write-backs of a writable copied volume.
        storage: Skyward's: the :class:`~flotilla.Storage` holding the bucket (its endpoint
            and credentials, sent to the nodes); None: the client's environment (and
            boto3's credentials). The volumes of one pool share one storage.
    """

    bucket: str
    mount: str
    prefix: str = ""
    read_only: bool = True
    mode: str = "mount"
    sync_interval: float = DEFAULT_SYNC_INTERVAL
    storage: Any = None

    def __post_init__(self) -> None:
        from .storage import Storage

        if self.storage is not None and not isinstance(self.storage, Storage):
            raise ConfigurationError(
                f"Volume(storage=...) must be a flotilla.Storage, got {type(self.storage).__name__}"
            )
        if not isinstance(self.bucket, str) or not self.bucket.strip():
            raise ConfigurationError(f"Volume(bucket=...) must name a bucket, got {self.bucket!r}")
        if self.bucket.startswith("s3://"):
            name, _, prefix = self.bucket[5:].partition("/")
            if self.prefix and prefix:
                raise ConfigurationError(
                    f"Volume({self.bucket!r}, prefix={self.prefix!r}): give the prefix once"
                )
            object.__setattr__(self, "bucket", name)
            object.__setattr__(self, "prefix", self.prefix or prefix)
        elif "://" in self.bucket:
            raise ConfigurationError(
                f"Volume(bucket={self.bucket!r}): only S3 buckets (s3://...) are supported"
            )
        if not self.bucket or "/" in self.bucket:
            raise ConfigurationError(
                f"Volume(bucket={self.bucket!r}): a bucket name has no '/' "
                "(put the rest in prefix=...)"
            )
        if not isinstance(self.mount, str) or not self.mount.strip():
            raise ConfigurationError(f"Volume(mount=...) must be a path, got {self.mount!r}")
        if os.path.normpath(self.mount) in ("/", "~", "."):
            raise ConfigurationError(f"Volume(mount={self.mount!r}) cannot be a volume's path")
        if self.mode not in MODES:
            raise ConfigurationError(
                f"Volume(mode={self.mode!r}): one of {', '.join(repr(m) for m in MODES)}"
            )
        if not isinstance(self.read_only, bool):
            raise ConfigurationError("Volume(read_only=...) must be True or False")
        check_number(
            self.sync_interval,
            f"Volume(sync_interval=...) must be a positive number of seconds, "
            f"got {self.sync_interval!r}",
            above=0,
        )

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix.strip('/')}".rstrip("/")

    def to_node(self) -> dict[str, Any]:
        return {
            "bucket": self.bucket,
            "mount": self.mount,
            "prefix": self.prefix,
            "read_only": self.read_only,
            "mode": self.mode,
        }


def check_volumes(volumes: object, this_machine: bool = False) -> tuple[Volume, ...]:
    """The volumes as a tuple; ConfigurationError for anything that is not one, two at one
    path, or, for nodes on this machine (``this_machine``), an absolute path where this
    machine cannot give each node its own view of it (see :func:`private_view_refusal`)."""
    if isinstance(volumes, Volume | str | bytes) or not isinstance(volumes, Sequence):
        raise ConfigurationError(
            f"volumes= takes a list, e.g. volumes=[flotilla.Volume(...)], got {volumes!r}"
        )
    out: list[Volume] = []
    for v in volumes:
        if not isinstance(v, Volume):
            raise ConfigurationError(
                f"volumes must be flotilla.Volume(...) objects, got {type(v).__name__}"
            )
        out.append(v)
    paths = [os.path.normpath(v.mount) for v in out]
    for p in paths:
        if paths.count(p) > 1:
            raise ConfigurationError(f"two volumes are mounted at {p!r}")
    absolute = [v for v in out if is_absolute(v.mount)]
    if this_machine and absolute:
        why = private_view_refusal([resolved(v.mount) for v in absolute])
        if why is not None:
            raise ConfigurationError(
                f"Volume(mount={absolute[0].mount!r}): the nodes of a local pool each see "
                f"their own mount at an absolute path, in a mount namespace of their own, "
                f"and this machine cannot give them one: {why}; or give a relative path "
                "(each node's own folder)"
            )
    return tuple(out)


def is_absolute(mount: str) -> bool:
    """Whether a volume's path is the machine's (absolute, or under ``~``), not inside the
    node's working folder."""
    return os.path.isabs(os.path.expanduser(mount))


def resolved(mount: str) -> str:
    return os.path.abspath(os.path.expanduser(mount))


def private_view_refusal(paths: Sequence[str]) -> str | None:
    """Why the nodes of this machine cannot each have their own mounts at ``paths`` (a
    mount namespace each, see ``_node.volumes``) and what to do, or None: a process tries
    to make one, as the nodes' agents will, and without root each path's folder must
    exist or be creatable by this user."""
    import subprocess
    import sys

    try:
        done = subprocess.run(
            [sys.executable, "-m", "flotilla._node.volumes", "--probe"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"the check could not run ({e})"
    answer = done.stdout.strip()
    if answer != "::ready":
        why = answer.removeprefix("::error ") or f"the check failed: {done.stderr.strip()}"
        return (
            f"{why}. Run as root, or allow user namespaces (sysctl "
            "user.max_user_namespaces > 0; kernel.unprivileged_userns_clone=1 where it "
            "exists; on Ubuntu, kernel.apparmor_restrict_unprivileged_userns=0)"
        )
    if os.geteuid() != 0:
        for path in paths:
            parent = path
            while not os.path.exists(parent):
                parent = os.path.dirname(parent)
            if not os.path.isdir(path) and not os.access(parent, os.W_OK):
                return (
                    f"{path} does not exist and this user cannot create it in {parent}: "
                    "create it first (empty), or run as root"
                )
    return None


def endpoint() -> str | None:
    """The S3 endpoint the environment names (``AWS_ENDPOINT_URL_S3``, else
    ``AWS_ENDPOINT_URL``), or None for AWS's own."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def namespace_entry(pid: int) -> tuple[str, ...]:
    """The ``nsenter`` words that run a command in the mount namespace of process ``pid``
    (a local node's agent, whose volumes at absolute paths are its own: see
    ``_node.volumes``), with its user namespace when it has one of its own; () when it
    shares this process's (or it cannot be told, or nsenter is missing)."""
    import shutil

    try:
        theirs = os.readlink(f"/proc/{pid}/ns/mnt")
        own_user = os.readlink(f"/proc/{pid}/ns/user") != os.readlink("/proc/self/ns/user")
        if theirs == os.readlink("/proc/self/ns/mnt"):
            return ()
    except OSError:
        return ()
    if shutil.which("nsenter") is None:
        return ()
    user = ("--user", "--preserve-credentials") if own_user else ()
    return ("nsenter", f"--target={pid}", *user, "--mount", "--")


def node_spec(
    volumes: Sequence[Volume], this_machine: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """Check that every volume's bucket can be read with the credentials this process
    has, before anything is provisioned; the nodes' volume configuration and the secrets
    in it (to redact). ConfigurationError naming the bucket and the credential. Nodes on
    this machine (``this_machine``) with a volume at an absolute path are told to mount in
    a namespace of their own (``"private"``)."""
    spec, secrets = _node_spec(volumes)
    if this_machine and any(is_absolute(v.mount) for v in volumes):
        spec["private"] = True
    return spec, secrets


def _node_spec(volumes: Sequence[Volume]) -> tuple[dict[str, Any], list[str]]:
    storages = {id(v.storage): v.storage for v in volumes}
    if len(storages) > 1:
        raise ConfigurationError(
            "the volumes of one pool share one storage: give every Volume the same "
            "storage= (or none)"
        )
    storage = next(iter(storages.values()))
    if storage is not None:
        return _storage_spec(storage, volumes)
    try:
        import boto3
        import botocore.exceptions
    except ImportError:
        raise ConfigurationError(
            "volumes need boto3 on this machine: pip install 'flotilla[aws]'"
        ) from None
    session = boto3.Session()
    creds = session.get_credentials()
    if creds is None:
        raise ConfigurationError(
            f"no AWS credentials found for {volumes[0].url} (looked in the environment, "
            "~/.aws/credentials and config, SSO, the instance's role): set AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        )
    frozen = creds.get_frozen_credentials()
    region = session.region_name or "us-east-1"
    url = endpoint()
    who = f"access key {_masked(frozen.access_key)} (from {creds.method})"
    client = session.client("s3", region_name=region, endpoint_url=url)
    where = f" at {url}" if url else ""
    for v in volumes:
        try:
            client.list_objects_v2(Bucket=v.bucket, Prefix=v.prefix.lstrip("/"), MaxKeys=1)
        except botocore.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "") or str(e)
            why = {
                "NoSuchBucket": "does not exist",
                "AccessDenied": "cannot be read (access denied)",
                "InvalidAccessKeyId": "cannot be read: the access key is not known",
                "SignatureDoesNotMatch": "cannot be read: the secret key is wrong",
            }.get(code, f"cannot be read ({code})")
            raise ConfigurationError(
                f"volume {v.url}: bucket {v.bucket!r}{where} {why}; {who}"
            ) from None
        except botocore.exceptions.BotoCoreError as e:
            raise ConfigurationError(
                f"volume {v.url}: bucket {v.bucket!r}{where} cannot be reached ({e}); {who}"
            ) from None
    return _spec(volumes, frozen.access_key, frozen.secret_key, frozen.token, region, url)


def _storage_spec(storage: Any, volumes: Sequence[Volume]) -> tuple[dict[str, Any], list[str]]:
    """:func:`node_spec` for volumes of a ``Storage``: its endpoint and credentials."""
    from ._system.s3 import S3Error

    client = storage._client()
    for v in volumes:
        query = {"list-type": "2", "prefix": v.prefix.lstrip("/"), "max-keys": "1"}
        try:
            client.request("GET", v.bucket, query=query).close()
        except S3Error as e:
            raise ConfigurationError(
                f"volume {v.url}: bucket {v.bucket!r} at {storage.endpoint or 'AWS S3'} "
                f"cannot be read ({e}); access key {_masked(client.key)}"
            ) from None
    return _spec(volumes, client.key, client.secret, client.token, client.region, storage.endpoint)


def _spec(
    volumes: Sequence[Volume],
    key: str,
    secret: str,
    token: str | None,
    region: str | None,
    endpoint: str | None,
) -> tuple[dict[str, Any], list[str]]:
    """The spec of :func:`node_spec` (the helper's stdin) and its secrets."""
    spec: dict[str, Any] = {
        "volumes": [v.to_node() for v in volumes],
        "credentials": {"access_key": key, "secret_key": secret, "token": token or ""},
        "region": region,
        "endpoint": endpoint,
        "sync_interval": min(v.sync_interval for v in volumes),
    }
    return spec, [s for s in (secret, token) if s]


def _masked(key: str) -> str:
    return f"{key[:4]}...{key[-4:]}" if len(key) > 12 else "****"
