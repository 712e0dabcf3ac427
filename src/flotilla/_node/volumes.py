"""A node's bucket volumes: ``python -m flotilla._node.volumes``, one helper per agent.

The agent starts this helper (its own session, without the agent's process token, so
that the agent's end-of-life sweep does not kill it before it has written back), writes
one JSON line to its stdin: ``{"volumes": [...], "credentials": {...}, "endpoint": ...,
"region": ..., "sync_interval": ...}`` and keeps the pipe open. The helper

* makes every volume appear at its path: a FUSE mount (``s3fs``, else ``rclone``) when
  the volume's mode is ``mount`` and the node has FUSE (``/dev/fuse`` and one of the
  tools), otherwise a copy of the objects under the prefix (``copy`` mode, and the
  fallback, said on stderr);
* prints ``::ready`` (or ``::error <why>`` and exits);
* for writable copied volumes, uploads the files that are new or changed every
  ``sync_interval`` seconds, and on a ``sync`` line (answered ``::synced``);
* at the end of its stdin (the agent stopped, or died: the pipe closes either way), on
  SIGTERM or SIGINT: uploads once more, unmounts the FUSE mounts, waits for the FUSE
  daemons to exit, and exits. Nothing is left: no mount, no daemon, no file with
  credentials.

Why a subprocess with a small standard-library S3 client (SigV4) rather than boto3 or
shipping bytes from the client: the node side imports only the standard library (a test
enforces it), nodes then need nothing installed for copy mode; the bytes go from the
bucket to each node directly (never through the client's link); and the agent's single
thread stays free for heartbeats while a large copy runs. The FUSE tools are Debian
packages run as subprocesses.

Nodes of one machine (the local provider) that mount at the same absolute path each get
their own view of it, as separate machines have: with ``"private": true`` in the spec, the
agent moves itself into a mount namespace of its own (:func:`private_namespace`: as root,
else in a user namespace mapping its user to itself) before it starts this helper and its
executors, which inherit it. A FUSE mount there is the node's own; a copy goes to a folder
of the node's (``.flotilla-volumes/N`` in its working folder) bind-mounted at the path, so
the nodes never write into one folder. No other process of the machine sees these mounts,
and they end with the namespace's last process at the latest. The path's folder is created
when missing and left (empty) afterwards: removing it while another node's namespace has a
mount on it would detach that mount.

Credentials reach this process on its stdin, never in argv or a file; the FUSE daemons
get them in their environment (readable only by their user and root, as every AWS SDK
reads them), never on their command line.

What each mode guarantees to a writer (the checkpoint recipe relies on it):

* ``mount`` (s3fs): a file is uploaded when it is closed (flushed); a rename is a copy of
  the whole object then a delete, and an S3 object appears whole or not at all, so
  "write ``ckpt.tmp``, close, rename to ``ckpt``" never leaves a partial ``ckpt``. A node
  lost before close loses that file's data, not the previous checkpoint.
* ``copy``: files reach the bucket at the next periodic sync or at the end (a node lost
  abruptly loses what changed since the last sync); each file is one PUT, whole or not at
  all; a file is uploaded only once its size and mtime have held still for one sync.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque

from .._system.s3 import S3, S3Error

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def resolve(path: str) -> str:
    """A volume's path on this node: ``~`` expanded, relative to the node's folder."""
    return os.path.abspath(os.path.expanduser(path))


_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_MNT_DETACH = 2


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def private_namespace() -> str | None:
    """Move this process into a mount namespace of its own, where mounts are private (none
    propagates to the machine's): as root a mount namespace; otherwise a user namespace
    too, that maps this user and group to themselves (files keep their owners, the
    processes their uid). The process must be single-threaded. None once done, else why
    it cannot be."""
    libc = _libc()
    if libc.unshare(_CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        if err != errno.EPERM or os.geteuid() == 0:
            return f"unshare(CLONE_NEWNS) failed: {os.strerror(err)}"
        uid, gid = os.geteuid(), os.getegid()
        if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS) != 0:
            err = ctypes.get_errno()
            return (
                f"not root, and this user cannot make a user namespace "
                f"(unshare(CLONE_NEWUSER): {os.strerror(err)})"
            )
        try:
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", f"{uid} {uid} 1"),
                ("gid_map", f"{gid} {gid} 1"),
            ):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError as e:
            return f"the user namespace's id maps could not be written: {e}"
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return f"making the mounts private failed: {os.strerror(ctypes.get_errno())}"
    return None


_CAP_SYS_ADMIN = 21
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_RAISE = 2


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def keep_mount_capability() -> None:
    """In a user namespace of :func:`private_namespace` (not root): let the programs this
    process executes keep the namespace's CAP_SYS_ADMIN (an ambient capability), which an
    exec drops for a user other than root, so that the volumes helper and its FUSE daemon
    can mount. Called in the helper's process before its exec: the executors, started by
    the agent, do not get it. Best effort: a mount then fails, saying so."""
    if os.geteuid() == 0:
        return
    libc = _libc()
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        return
    data[0].inheritable |= 1 << _CAP_SYS_ADMIN
    if libc.capset(ctypes.byref(header), data) == 0:
        libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_SYS_ADMIN, 0, 0)


def _bind(source: str, target: str) -> None:
    if _libc().mount(source.encode(), target.encode(), None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot bind {source} at {target}: {os.strerror(err)}")


def _detach(path: str) -> None:
    _libc().umount2(path.encode(), _MNT_DETACH)


def fuse_tool() -> str | None:
    """The FUSE tool this node can mount buckets with, or None (no FUSE here): s3fs, else
    rclone (``FLOTILLA_FUSE_TOOL`` on the node picks one)."""
    if not os.path.exists("/dev/fuse") or not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return None
    wanted = os.environ.get("FLOTILLA_FUSE_TOOL", "")
    for tool in [wanted] if wanted else ["s3fs", "rclone"]:
        if shutil.which(tool):
            return tool
    return None


class Volumes:
    """The volumes of one node (see the module docstring)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.s3 = S3(spec["credentials"], spec.get("region", ""), spec.get("endpoint"))
        self.copied: list[tuple[dict[str, Any], str, dict[str, tuple[int, int]]]] = []
        """(volume, local root, manifest: relative path -> (size, mtime_ns) in the bucket)"""
        self.mounts: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.binds: list[str] = []  # a private namespace's copies: bound at their paths
        self.pending: dict[str, tuple[int, int]] = {}  # changed at the last look: settling

    def setup(self) -> None:
        tool = fuse_tool()
        for index, vol in enumerate(self.spec["volumes"]):
            path = resolve(vol["mount"])
            os.makedirs(path, exist_ok=True)
            if vol.get("mode", "mount") == "mount" and tool is not None:
                self._mount(tool, vol, path)
                continue
            if vol.get("mode", "mount") == "mount":
                print(
                    f"flotilla volumes: no FUSE on this node (/dev/fuse and s3fs or rclone): "
                    f"s3://{vol['bucket']}/{vol.get('prefix', '')} is copied to {path}",
                    file=sys.stderr,
                    flush=True,
                )
            if self.spec.get("private") and os.path.isabs(os.path.expanduser(vol["mount"])):
                # the path is the machine's: the copy goes to this node's own folder
                own = os.path.abspath(os.path.join(".flotilla-volumes", str(index)))
                os.makedirs(own, exist_ok=True)
                _bind(own, path)
                self.binds.append(path)
            self._copy_in(vol, path)

    # -- copy mode -----------------------------------------------------------------------
    def _copy_in(self, vol: dict[str, Any], root: str) -> None:
        bucket, prefix = vol["bucket"], _dir_prefix(vol.get("prefix", ""))
        manifest: dict[str, tuple[int, int]] = {}
        for key, _size in self.s3.list(bucket, prefix):
            rel = key[len(prefix) :]
            if not rel or rel.endswith("/"):
                continue  # the prefix itself, folder markers
            local = os.path.join(root, *rel.split("/"))
            if not os.path.abspath(local).startswith(root + os.sep):
                continue  # a key with .. in it
            os.makedirs(os.path.dirname(local), exist_ok=True)
            self.s3.download(bucket, key, local)
            st = os.stat(local)
            manifest[rel] = (st.st_size, st.st_mtime_ns)
        self.copied.append((vol, root, manifest))

    def sync(self, final: bool = False) -> int:
        """Upload the writable copied volumes' new and changed files; how many. A file is
        uploaded once unchanged since the previous look (``final``: at once)."""
        sent = 0
        for vol, root, manifest in self.copied:
            if vol.get("read_only", True):
                continue
            prefix = _dir_prefix(vol.get("prefix", ""))
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                for name in sorted(filenames):
                    if ".flotilla-part-" in name:
                        continue
                    local = os.path.join(dirpath, name)
                    rel = os.path.relpath(local, root).replace(os.sep, "/")
                    try:
                        st = os.stat(local)
                    except OSError:
                        continue
                    seen = (st.st_size, st.st_mtime_ns)
                    if manifest.get(rel) == seen:
                        continue
                    marker = f"{root}\0{rel}"
                    if not final and self.pending.get(marker) != seen:
                        self.pending[marker] = seen  # still being written, maybe
                        continue
                    self.s3.upload(vol["bucket"], prefix + rel, local)
                    manifest[rel] = seen
                    self.pending.pop(marker, None)
                    sent += 1
        return sent

    # -- mount mode ----------------------------------------------------------------------
    def _mount(self, tool: str, vol: dict[str, Any], path: str) -> None:
        creds = self.spec["credentials"]
        endpoint = self.spec.get("endpoint") or ""
        region = self.spec.get("region") or "us-east-1"
        prefix = vol.get("prefix", "").strip("/")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS")}
        env.pop("FLOTILLA_NODE_TOKEN", None)
        env.update(
            AWS_ACCESS_KEY_ID=creds["access_key"],
            AWS_SECRET_ACCESS_KEY=creds["secret_key"],
            AWSACCESSKEYID=creds["access_key"],
            AWSSECRETACCESSKEY=creds["secret_key"],
        )
        if creds.get("token"):
            env.update(AWS_SESSION_TOKEN=creds["token"], AWSSESSIONTOKEN=creds["token"])
        if os.listdir(path):
            raise S3Error(
                f"cannot mount s3://{vol['bucket']}/{prefix} at {path}: the folder is not "
                "empty (a mount would hide its files): empty it, or choose another path"
            )
        read_only = vol.get("read_only", True)
        if tool == "s3fs":
            source = vol["bucket"] + (f":/{prefix}" if prefix else "")
            opts = [f"endpoint={region}"]
            if _s3fs_version() >= (1, 91):  # folders that exist only as key prefixes
                opts.append("compat_dir")
            if os.geteuid() == 0:  # the tasks may run as another user
                opts.append("allow_other")
            if endpoint:
                opts += [f"url={endpoint}", "use_path_request_style"]
            if read_only:
                opts.append("ro")
            argv = ["s3fs", source, path, "-f", "-o", ",".join(opts)]
        else:
            source = f":s3:{vol['bucket']}" + (f"/{prefix}" if prefix else "")
            argv = ["rclone", "mount", source, path, "--s3-provider", "Other", "--s3-env-auth"]
            # no VFS cache: a file is uploaded when it is closed (with a cache, rclone uploads
            # later, and an unmount drops what was not uploaded yet)
            argv += ["--s3-region", region, "--vfs-cache-mode", "off"]
            if endpoint:
                argv += ["--s3-endpoint", endpoint, "--s3-force-path-style"]
            if read_only:
                argv.append("--read-only")
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        tail: deque[str] = deque(maxlen=10)
        threading.Thread(target=_drain, args=(proc, tail), daemon=True).start()
        self.mounts.append((path, proc))
        deadline = time.monotonic() + 30
        while not os.path.ismount(path):
            if proc.poll() is not None:
                raise S3Error(
                    f"{tool} could not mount s3://{vol['bucket']}/{prefix} at {path} "
                    f"(exit code {proc.returncode}): {' / '.join(tail)}"
                )
            if time.monotonic() > deadline:
                raise S3Error(f"{tool} did not mount s3://{vol['bucket']} at {path} in 30 s")
            time.sleep(0.05)

    def teardown(self) -> None:
        """Write back, unmount, wait for the FUSE daemons: nothing left."""
        try:
            self.sync(final=True)
        finally:
            for path, proc in reversed(self.mounts):
                _unmount(path, proc)
            self.mounts.clear()
            for path in reversed(self.binds):
                _detach(path)
            self.binds.clear()


def _unmount(path: str, proc: subprocess.Popen[bytes]) -> None:
    """Unmount (the FUSE daemon then flushes and exits), lazily if busy; the daemon is
    killed if it does not exit."""
    for argv in (["fusermount", "-u", path], ["umount", path], ["umount", "-l", path]):
        if not os.path.ismount(path):
            break
        if shutil.which(argv[0]):
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _drain(proc: subprocess.Popen[bytes], tail: deque[str]) -> None:
    """Keep the last lines a FUSE daemon printed (its pipe never fills)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line.decode(errors="replace").strip())


def _s3fs_version() -> tuple[int, ...]:
    try:
        out = subprocess.run(["s3fs", "--version"], capture_output=True, text=True).stdout
    except OSError:
        return (0,)
    found = re.search(r"V(\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else (0,)


def _dir_prefix(prefix: str) -> str:
    """A key prefix as a folder: ``a/b`` -> ``a/b/``; empty stays empty."""
    prefix = prefix.strip("/")
    return f"{prefix}/" if prefix else ""


class _Stop(Exception):
    pass


def _on_signal(*_: object) -> None:
    raise _Stop


def main() -> None:
    if sys.argv[1:] == ["--probe"]:  # can this machine give a process a private namespace?
        why = private_namespace()
        print(f"::error {why}" if why else "::ready", flush=True)
        return
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal: the pipe tells us
    stdin = sys.stdin.buffer
    line = stdin.readline()
    if not line:
        return
    spec = json.loads(line)
    volumes = Volumes(spec)
    out = sys.stdout
    try:
        try:
            volumes.setup()
        except (S3Error, OSError) as e:
            out.write(f"::error {e}\n")
            out.flush()
            return
        out.write("::ready\n")
        out.flush()
        interval = float(spec.get("sync_interval") or 60.0)
        next_sync = time.monotonic() + interval
        fd = stdin.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], max(0.0, next_sync - time.monotonic()))
            if ready:
                data = os.read(fd, 4096)
                if not data:
                    return  # the agent is gone: teardown below
                if b"sync" in data:
                    _sync_quietly(volumes, final=True)
                    out.write("::synced\n")
                    out.flush()
                continue
            _sync_quietly(volumes, final=False)
            next_sync = time.monotonic() + interval
    except _Stop:
        return
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the teardown is not interrupted
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            volumes.teardown()
        except (S3Error, OSError) as e:
            print(f"flotilla volumes: writing back failed: {e}", file=sys.stderr, flush=True)


def _sync_quietly(volumes: Volumes, final: bool) -> None:
    try:
        volumes.sync(final=final)
    except (S3Error, OSError) as e:  # the next sync tries again
        print(f"flotilla volumes: sync failed: {e}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
