"""Security and bad input, tried as an attacker and as an unlucky user would (issue 14).

Attacks by another local user run as a real second user, created and removed by the test
(``useradd``/``userdel``; skipped when not root). Its processes start from this
interpreter and drop to that user's ids before they touch anything (the interpreter lives
under /root, which that user cannot read). Everything else runs the real CLI and real
pools; resource limits (CPU seconds, address space) bound the hostile task files, so no
test depends on wall-clock timing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _procs import alive, session_folder, wait_until
from test_cli import CLI, SRC
from test_cli import cli as cli  # the fixture

from flotilla._errors import ConfigurationError
from flotilla._system.locks import exclusive
from flotilla._system.private import open_private_file, private_dir
from flotilla.cli.state import (
    ClusterRecord,
    ClusterState,
    JobStatus,
    Paths,
    all_names,
    load,
    locked,
    save,
)

SECRET = "s3cr3t-Value-9f8e7d6c"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (creates a user)")


# -- a second local user ---------------------------------------------------------------------
class OtherUser:
    """A real local user for the duration of a test."""

    def __init__(self, name: str) -> None:
        import pwd

        self.name = name
        entry = pwd.getpwnam(name)
        self.uid, self.gid = entry.pw_uid, entry.pw_gid

    def python(self, code: str, **kw: Any) -> subprocess.Popen[str]:
        """Run ``code`` as this user: this interpreter starts as root, imports what the
        code needs from the preamble, then drops to the user's ids before running it."""
        preamble = (
            "import os, sys, json, socket, fcntl, time\n"
            f"sys.path.insert(0, {SRC!r})\n"
            "os.setgroups([])\n"
            f"os.setgid({self.gid}); os.setuid({self.uid})\n"
        )
        env = {"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"}
        return subprocess.Popen(
            [sys.executable, "-c", preamble + textwrap.dedent(code)],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **kw,
        )

    def run(self, code: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        proc = self.python(code)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


USER_GONE_TIMEOUT = 120.0
"""Seconds the second user's teardown waits for its killed processes to be gone (on a
loaded machine they die slowly) and retries ``userdel``."""


@pytest.fixture
def other_user() -> Iterator[OtherUser]:
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a second local user")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed")
    name = f"flt{os.getpid()}"[:31]
    _make_user(name)
    try:
        yield OtherUser(name)
    finally:
        _remove_user(name)


def _make_user(name: str) -> None:
    """Create the local user ``name``, after removing it if an earlier test (or a killed
    session: ``flt<its pid>``) left it behind."""
    _remove_stale_users(name)
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )


def _remove_stale_users(name: str) -> None:
    """Remove this session's user if an earlier test left it behind, and the users of
    test sessions that are gone (``flt<pid>``), so that ``useradd`` cannot find it taken."""
    import pwd

    for entry in pwd.getpwall():
        found = re.fullmatch(r"flt(\d+)", entry.pw_name)
        if found and (entry.pw_name == name or not alive(int(found[1]))):
            _remove_user(entry.pw_name)


def _remove_user(name: str) -> None:
    """Kill the user's processes, wait until they are gone (reaping those that are this
    process's children), then ``userdel``, retried while it says the user is busy (exit
    8); fail if the user is still there after ``USER_GONE_TIMEOUT``."""
    import pwd

    def gone() -> bool:
        left = _processes_of(name)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)  # a child of this process: reap its zombie
        return not _processes_of(name)

    def deleted() -> bool:
        if not gone():
            return False
        done = subprocess.run(["userdel", name], capture_output=True, text=True)
        if done.returncode not in (0, 6):  # 6: no such user (gone already)
            return False
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return False
        return True

    assert wait_until(deleted, timeout=USER_GONE_TIMEOUT), (
        f"the test user {name} could not be removed: processes {_processes_of(name)}"
    )


def _processes_of(user: str) -> list[int]:
    """The processes of ``user`` (zombies too: userdel counts them), from /proc."""
    import pwd

    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        return []
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    out.append(int(entry))
    return sorted(out)


@needs_root
def test_the_second_user_is_made_over_a_leftover_and_removed_with_its_processes() -> None:
    """The second user's fixture (issue 43): a user left behind by an earlier test (its
    ``userdel`` ran while processes it had just killed still existed: exit 8) made every
    later ``useradd`` fail (exit 9); now it is removed first. The teardown removes the
    user even with a process still running and a zombie, waiting until they are gone."""
    import pwd

    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed")
    name = f"flt{os.getpid()}"[:31]
    _remove_stale_users(name)
    subprocess.run(["useradd", "--no-create-home", name], check=True, capture_output=True)
    _make_user(name)  # over the leftover
    user = OtherUser(name)
    zombie = user.python("pass")
    assert wait_until(lambda: _state(zombie.pid) == "Z", timeout=60.0)  # exited, not reaped
    sleeper = user.python("time.sleep(600)")
    both = sorted([zombie.pid, sleeper.pid])
    assert wait_until(lambda: _processes_of(name) == both, timeout=60.0)  # as the user now
    _remove_user(name)
    with pytest.raises(KeyError):
        pwd.getpwnam(name)
    assert not alive(sleeper.pid)
    for proc in (zombie, sleeper):
        proc.communicate()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2]


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A stand-in for /tmp that this test owns: world-writable with the sticky bit."""
    folder = session_folder("shared")
    os.chmod(folder, 0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- private folders -------------------------------------------------------------------------
def test_private_folders_are_created_0700_and_refused_when_not_private(tmp_path: Path) -> None:
    made = private_dir(tmp_path / "a" / "b")
    assert os.stat(made).st_mode & 0o777 == 0o700

    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    private_dir(loose)  # ours and not writable by others: tightened
    assert os.stat(loose).st_mode & 0o777 == 0o700

    writable = tmp_path / "writable"
    writable.mkdir()
    os.chmod(writable, 0o777)
    with pytest.raises(ConfigurationError, match=r"writable by others .*Fix: remove it"):
        private_dir(writable)

    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ConfigurationError, match="symlink"):
        private_dir(tmp_path / "link")


def test_a_lock_file_planted_as_a_symlink_is_refused_and_its_target_untouched(
    tmp_path: Path,
) -> None:
    locks = private_dir(tmp_path / "locks")
    victim = tmp_path / "victim"
    (locks / "sync.lock").symlink_to(victim)
    with pytest.raises(ConfigurationError, match="symlink"), exclusive(locks / "sync.lock"):
        pass
    assert not victim.exists()
    fifo = locks / "fifo.lock"
    os.mkfifo(fifo)
    with pytest.raises(ConfigurationError, match="not a regular file"):
        os.close(open_private_file(fifo))


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_files_planted_in_dev_shm_by_another_user_are_never_opened(
    other_user: OtherUser, tmp_path: Path, planted: str
) -> None:
    """Another user plants a symlink (to a file of ours) or a FIFO at every name of the
    pool's shared-memory probe that can be predicted: the pool starts, uses shared memory,
    and the file the link points to is untouched."""
    import flotilla as sky
    from flotilla._wire.serialize import SHM_DIR

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    tmp_path.chmod(0o755)
    pool = sky.Compute(nodes=1)
    names = [f"{pool._shm_prefix}probe", f"{pool._shm_prefix}probe-"]
    paths = [os.path.join(SHM_DIR, n) for n in names]
    if planted == "symlink":
        code = f"for p in {paths!r}: os.symlink({str(victim)!r}, p)"
    else:
        code = f"for p in {paths!r}: os.mkfifo(p, 0o666)"
    done = other_user.run(code)
    assert done.returncode == 0, done.stderr
    try:
        with pool:
            assert pool._nodes[0].shm  # the probe was read: shared memory is used

            @sky.function
            def size(data: bytes) -> int:
                return len(data)

            assert size(b"x" * 4_000_000) @ pool == [4_000_000]
        assert victim.read_bytes() == b"precious"
        for path in paths:  # not ours: left alone
            assert os.lstat(path).st_uid == other_user.uid
    finally:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@needs_root
def test_folders_of_another_user_are_refused(other_user: OtherUser, shared_tmp: Path) -> None:
    theirs = shared_tmp / "their-home"
    done = other_user.run(f"os.mkdir({str(theirs)!r}, 0o700)")
    assert done.returncode == 0, done.stderr
    with pytest.raises(ConfigurationError) as err:
        private_dir(theirs)
    assert str(theirs) in str(err.value)
    assert f"belongs to uid {other_user.uid}" in str(err.value)


@needs_root
def test_socket_folder_takeover_is_harmless(
    tmp_path: Path, other_user: OtherUser, shared_tmp: Path
) -> None:
    """The old fallback for long FLOTILLA_HOME paths was $TMPDIR/flotilla-<uid>: another
    user who made that folder first could replace the socket. There is no fallback now:
    the socket stays in the (long) home, reached through its folder's descriptor."""
    planted = shared_tmp / f"flotilla-{os.getuid()}"
    done = other_user.run(f"os.mkdir({str(planted)!r}); os.chmod({str(planted)!r}, 0o777)")
    assert done.returncode == 0, done.stderr
    home = tmp_path / ("h" * 60) / ("o" * 60) / "home"
    runner = CLI(home, tmp_path, tmpdir=shared_tmp)
    try:
        out = runner.ok("launch", "-c", "long", "echo hello from $SKYPILOT_NODE_RANK")
        assert "hello from 0" in out.stdout
        assert len(str(Paths("long", home).socket)) > 108  # too long for a plain bind
        assert Paths("long", home).socket.is_socket()
        assert os.listdir(planted) == []  # nothing of ours went to the attacker's folder
        out = runner.ok("exec", "long", "echo again")
        assert "again" in out.stdout
    finally:
        runner.clean_up()


@needs_root
def test_a_flotilla_home_made_by_another_user_is_refused_before_anything_starts(
    tmp_path: Path, other_user: OtherUser, shared_tmp: Path
) -> None:
    home = shared_tmp / "home"
    done = other_user.run(f"os.mkdir({str(home)!r}); os.chmod({str(home)!r}, 0o777)")
    assert done.returncode == 0, done.stderr
    runner = CLI(home, tmp_path)
    out = runner("launch", "-c", "x", "echo hi")
    assert out.returncode == 2, out.stderr
    assert f"{home}: this folder belongs to uid {other_user.uid}" in out.stderr
    assert "Fix:" in out.stderr
    assert os.listdir(home) == []  # no state, lock or socket was created in it


@needs_root
def test_sync_lock_cannot_be_blocked_or_redirected_by_another_user(
    cli: CLI, other_user: OtherUser, shared_tmp: Path
) -> None:
    """The sync lock used to sit at a predictable name in the shared temp folder: another
    user could hold it (every sync blocked forever) or plant a symlink there (root then
    created a file where that user chose). Both are attempted; the sync goes through."""
    cli.env["TMPDIR"] = str(shared_tmp)
    mount = cli.cwd / "mounted"  # an absolute node path: written under the sync lock
    victim = shared_tmp / "victim"
    digest = hashlib.sha256(str(mount).encode()).hexdigest()[:20]
    old_name = shared_tmp / f"flotilla-sync-{os.getuid()}-{digest}.lock"
    holder = other_user.python(
        f"""
        fd = os.open({str(old_name)!r}, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.symlink({str(victim)!r}, {str(shared_tmp / "flotilla-sync-0-planted.lock")!r})
        print("holding", flush=True)
        sys.stdin.read()
        """
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "holding", holder.stderr
        (cli.cwd / "data.txt").write_text("payload\n")
        task = cli.task(
            "mount.yaml",
            f"""\
            file_mounts:
              {mount}: data.txt
            run: cat {mount}
            """,
        )
        out = cli.ok("launch", task, "-c", "sync", "--nodes", "2", timeout=90)
        assert out.stdout.count("payload") == 2
        assert not victim.exists()
        lock_dir = cli.home / "locks"
        assert os.stat(lock_dir).st_mode & 0o777 == 0o700
        assert [p.name for p in lock_dir.iterdir()] == [f"{digest}.lock"]
    finally:
        holder.kill()
        holder.communicate()


@needs_root
def test_a_client_of_another_user_cannot_talk_to_the_daemon(
    tmp_path: Path, other_user: OtherUser
) -> None:
    """Even with its folders opened up (a misplaced socket), the daemon refuses a
    connection whose peer credentials are another user's: nothing is submitted."""
    home = session_folder("sec")
    runner = CLI(home, tmp_path)
    try:
        runner.ok("launch", "-c", "mine", "echo first")
        paths = Paths("mine", home)
        before = load(paths)
        assert before is not None and before.next_job == 2

        # the folders as they are: the other user cannot even reach the socket
        done = other_user.run(
            f"""
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect({str(paths.socket)!r})
            except OSError as e:
                print("cannot connect:", e.strerror)
            """
        )
        assert "cannot connect: Permission denied" in done.stdout, done.stderr

        # opened up: it reaches the socket, and the daemon refuses it
        for folder in (home, paths.clusters):
            os.chmod(folder, 0o755)
        os.chmod(paths.socket, 0o777)
        job = {"name": "evil", "run": "touch /tmp/pwned", "num_nodes": 1}
        done = other_user.run(
            f"""
            s = socket.socket(socket.AF_UNIX)
            s.connect({str(paths.socket)!r})
            try:
                s.sendall(
                    json.dumps({{"op": "submit", "job": {job!r}, "attach": True}}).encode()
                    + b"\\n"
                )
            except OSError:
                pass  # the daemon may have answered and closed already
            print(s.makefile("rb").readline().decode())
            """
        )
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout.strip().splitlines()[0])
        assert answer["ev"] == "error"
        assert "refused" in answer["message"]
        after = load(paths)
        assert after is not None and after.next_job == 2  # no job was accepted
        assert runner.ok("queue", "mine").stdout.count("\n") == 2  # header + job 1
    finally:
        runner.clean_up()
        shutil.rmtree(home, ignore_errors=True)


# -- hostile task files ----------------------------------------------------------------------
def _laughs(levels: int, indent: str = "") -> str:
    """A "billion laughs": level k is a list of 9 aliases of level k-1 (9**levels nodes)."""
    lines = [f"{indent}l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for k in range(1, levels):
        lines.append(f"{indent}l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


HOSTILE = {
    "alias bomb in a key": (  # the old loader turned this key into a 2.5 GB string first
        _laughs(9) + "? [*l8, *l8, *l8, *l8, *l8, *l8, *l8, *l8, *l8]\n: 1\nrun: echo\n",
        ":10: a field name must be a string, not a list",
    ),
    "alias bomb in a value": (
        "run: echo\nenvs:\n" + _laughs(9, "  "),
        ": aliases (*name) would expand the file by",
    ),
    "recursive alias": (
        "run: echo\nx: &a [*a]\n",
        ":2: an alias refers to a node that contains it",
    ),
    "deep flow nesting": ("run: " + "[" * 50000 + "]" * 50000 + "\n", ":1: nested deeper than 64"),
    "deep block nesting": (
        "run:\n" + "".join(" " * i + "-\n" for i in range(1, 200)),
        ": nested deeper than 64",
    ),
    "python tag": (
        "run: !!python/object/apply:os.system ['touch /tmp/pwned']\n",
        ":1: the tag !!python/object/apply:os.system is not allowed",
    ),
    "unknown tag": ("run: !vault abc\n", ":1: the tag !vault is not allowed"),
    "complex key": (
        "? {a: 1}\n: 1\nrun: echo\n",
        ":1: a field name must be a string, not a mapping",
    ),
    "numeric key": ("run: echo\n3: x\n", ":2: a field name must be a string, got '3'"),
    "huge number": (
        "num_nodes: " + "9" * 6000 + "\nrun: echo\n",
        ":1: a number of 6000 characters",
    ),
    "merge key": ("base: &b {run: x}\n<<: *b\n", ":2: merge keys (<<) are not supported"),
}


def _load_limited(path: Path) -> subprocess.CompletedProcess[str]:
    """Load a task file in a child with 1 CPU second and a bounded address space."""
    code = textwrap.dedent(
        f"""
        import resource, sys
        from flotilla.cli.taskfile import TaskError, load_task
        import yaml  # imported before the limits: the loader's own cost is what is bounded
        used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with open("/proc/self/status") as f:
            size = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_CPU, (1, 1))
        resource.setrlimit(resource.RLIMIT_AS, (size + 64 * 2**20,) * 2)
        try:
            load_task({str(path)!r})
        except TaskError as e:
            print(e)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            print("grew", rss - used, file=sys.stderr)
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": SRC},
    )


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_task_files_are_refused_with_file_and_line(tmp_path: Path, case: str) -> None:
    text, expected = HOSTILE[case]
    path = tmp_path / "task.yaml"
    path.write_text(text)
    done = _load_limited(path)
    assert done.returncode == 0, f"killed or crashed (limits: 1 CPU s, bounded memory):\n{done}"
    message = done.stdout.strip()
    assert message.startswith(f"{path}:"), message
    assert expected in message
    assert len(message) < 400  # a clear line, not a dump of the document
    grew = int(done.stderr.split("grew")[-1])
    assert grew < 8 * 2**20, f"{case}: the loader grew by {grew} bytes"


def test_non_utf8_task_file_names_the_line_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "task.yaml"
    path.write_bytes(b"name: t\nrun: echo caf\xe9\n")
    done = _load_limited(path)
    assert f"{path}:2: the file is not UTF-8: byte 0xe9" in done.stdout


# -- secrets ---------------------------------------------------------------------------------
def test_secrets_never_reach_the_callers_output_errors_or_reprs(tmp_path: Path) -> None:
    """A task prints the secret (stdout and stderr), raises an exception carrying it in
    its message, its arguments and an attribute its __str__ shows; the client prints the
    errors with their remote tracebacks and the reprs of Options, Image and plugins."""
    script = tmp_path / "client.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys, traceback
            import flotilla as sky

            class Custom(Exception):
                def __init__(self, value):
                    super().__init__("custom")
                    self.value = value
                def __str__(self):
                    return "custom failure with " + self.value

            @sky.function
            def leak(kind):
                value = os.environ["DB_PASSWORD"] if kind != "hf" else os.environ["HF_TOKEN"]
                print("stdout has", value, flush=True)
                print("stderr has", value, file=sys.stderr, flush=True)
                if kind == "custom":
                    raise Custom(value)
                raise RuntimeError(f"connect failed for {{value}}", {{"password": value}})

            image = sky.Image(env={{"API_KEY": "{SECRET}-image"}})
            opts = sky.Options(env={{"DB_PASSWORD": sky.Secret("{SECRET}")}})
            hf = sky.plugins.huggingface(token="{SECRET}-hf")
            print(repr(opts), repr(image), repr(hf))
            with sky.Compute(nodes=2, image=image, options=opts, plugins=[hf]) as pool:
                for kind in ("plain", "custom", "hf"):
                    try:
                        leak(kind) @ pool
                    except Exception as e:
                        traceback.print_exception(e)
                        print("message:", e, getattr(e, "remote_traceback", ""))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": SRC},
        cwd=tmp_path,
    )
    both = done.stdout + done.stderr
    assert done.returncode == 0, both
    assert SECRET not in both
    assert "stdout has ***" in done.stdout and "stderr has ***" in done.stderr
    assert "connect failed for ***" in both
    assert "custom failure with ***" in both
    # shown, redacted (the node whose failure arrived first: either of the two)
    assert re.search(r"remote traceback \(node [01]\) is above", both) and "in leak" in both
    assert "DB_PASSWORD': '***'" in both and "API_KEY': '***'" in both


def test_secret_from_the_environment_reaches_the_job_and_no_command_line(cli: CLI) -> None:
    """``--secret KEY`` takes the value from the client's environment: the job gets it,
    no process on the machine has it on its command line while the job runs, and it is
    in none of the output, logs or files flotilla keeps."""
    digest = hashlib.sha256(SECRET.encode()).hexdigest()
    task = cli.task(
        "secret.yaml",
        f"""\
        secrets:
          MY_TOKEN: null
        run: |
          echo "token is $MY_TOKEN"
          test "$(printf %s "$MY_TOKEN" | sha256sum | cut -d' ' -f1)" = {digest} && echo SAME
          for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f 2>/dev/null; echo; done \\
            | grep -c -F -f <(printenv MY_TOKEN) | sed 's/^/cmdlines with it: /'
          echo "failing with $MY_TOKEN" >&2
          exit 3
        """,
    )
    out = cli("launch", task, "-c", "sec", "--secret", "MY_TOKEN", env={"MY_TOKEN": SECRET})
    assert out.returncode == 3, out.stderr
    assert "SAME" in out.stdout
    assert "cmdlines with it: 0" in out.stdout  # (grep reads the value from a pipe)
    assert "token is ***" in out.stdout
    assert "failing with ***" in out.stderr
    assert "warning" not in out.stderr
    logs = cli("logs", "sec")
    assert "token is ***" in logs.stdout
    for text in (out.stdout, out.stderr, logs.stdout, logs.stderr):
        assert SECRET not in text
    for path in cli.home.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_secret_given_on_the_command_line_warns_and_secret_files_work(cli: CLI) -> None:
    secret_file = cli.cwd / "secrets.env"
    secret_file.write_text(f"# comment\n\nFROM_FILE={SECRET}-file\n")
    os.chmod(secret_file, 0o600)
    task = cli.task("t.yaml", 'run: echo "[$FROM_FILE] [$INLINE]"\n')
    out = cli.ok(
        "launch", task, "-c", "sf", "--secret-file", str(secret_file), "--secret", "INLINE=abcdef"
    )
    assert "[***] [***]" in out.stdout
    assert "warning: --secret INLINE=VALUE puts the value on the command line" in out.stderr
    bad = cli.cwd / "bad.env"
    bad.write_text("JUSTAKEY\n")
    out = cli("launch", task, "-c", "sf", "--secret-file", str(bad))
    assert out.returncode == 2 and f"{bad}:1: expected KEY=VALUE" in out.stderr


# -- state robustness ------------------------------------------------------------------------
def test_a_corrupt_state_file_affects_only_its_cluster(cli: CLI) -> None:
    good = Paths("good", cli.home)
    with locked(good):
        save(
            good,
            ClusterRecord(
                name="good",
                provider={"kind": "local"},
                num_nodes=2,
                state=ClusterState.STOPPED.value,
                created=1.0,
            ),
        )
    (cli.home / "clusters" / "truncated.json").write_text('{"name": "truncated", "prov')
    (cli.home / "clusters" / "malformed.json").write_text('{"name": 5, "jobs": "many"}')
    (cli.home / "clusters" / "wrongtype.json").write_text("[1, 2, 3]")
    out = cli.ok("status")
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[1:] if line}
    assert rows["good"][3] == "STOPPED"
    for name in ("truncated", "malformed", "wrongtype"):
        assert rows[name][3] == "CORRUPT"
        assert f"`flotilla down {name}` removes it" in out.stdout
    assert "Traceback" not in out.stderr
    done = cli.ok("down", "truncated", "malformed", "wrongtype")
    assert "down" in done.stderr
    assert all_names(cli.home) == ["good"]


def test_queue_on_a_killed_daemon_shows_its_jobs_lost(cli: CLI) -> None:
    flag = cli.cwd / "running"
    task = cli.task("long.yaml", f"run: touch {flag}; while true; do sleep 1; done\n")
    cli.ok("launch", task, "-c", "dead", "-d")
    assert wait_until(flag.exists, timeout=60)
    rec = load(Paths("dead", cli.home))
    assert rec is not None
    os.kill(rec.pid, signal.SIGKILL)
    assert wait_until(lambda: not alive(rec.pid), timeout=10)
    out = cli.ok("queue", "dead")
    assert out.stdout.splitlines()[1].split()[2] == JobStatus.LOST.value


# 30 CLI commands: ~1 minute on an idle machine, past the default 120 s deadline with two
# busy loops per core; each command keeps its own 90 s deadline (a hang still fails fast)
@pytest.mark.timeout(900)
def test_launch_right_after_down_of_the_same_name_always_succeeds(cli: CLI) -> None:
    for i in range(15):
        out = cli.ok("launch", "-c", "again", f"echo round {i}", timeout=90)
        assert f"round {i}" in out.stdout
        rec = load(Paths("again", cli.home))
        assert rec is not None and rec.generation == i + 1
        cli.ok("down", "again", timeout=90)
        assert load(Paths("again", cli.home)) is None


def test_an_old_daemon_cannot_touch_a_newer_cluster_of_the_same_name(cli: CLI) -> None:
    from flotilla.cli.state import StaleGenerationError, delete, update

    cli.ok("launch", "-c", "gen", "echo one")
    paths = Paths("gen", cli.home)
    rec = load(paths)
    assert rec is not None
    with pytest.raises(StaleGenerationError), update(paths, rec.generation - 1):
        pass
    assert not delete(paths, rec.generation - 1)
    assert load(paths) is not None and paths.dir.exists()


# -- requests that cannot be met -------------------------------------------------------------
def test_more_local_nodes_than_the_machine_holds_are_refused_before_anything_starts(
    cli: CLI,
) -> None:
    task = cli.task("big.yaml", "num_nodes: 100000000000\nrun: echo\n")
    out = cli("launch", task, "-c", "big", timeout=60)
    assert out.returncode == 2, out.stderr
    assert "100000000000 local nodes need about" in out.stderr and "ulimit -n" in out.stderr
    assert all_names(cli.home) == []  # nothing was started or recorded


def test_too_few_file_descriptors_is_a_clear_error_with_the_fix(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import resource
        import flotilla as sky
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        try:
            sky.Compute(nodes=50).open()
        except sky.ConfigurationError as e:
            print(e)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    assert "50 local nodes need about" in done.stdout, done.stderr
    assert "its limit is 64" in done.stdout and "ulimit -n" in done.stdout


def test_emfile_while_starting_becomes_a_provision_error() -> None:
    import errno

    from flotilla._errors import ProvisionError
    from flotilla._providers.limits import out_of_files

    err = out_of_files(OSError(errno.EMFILE, "Too many open files"))
    assert isinstance(err, ProvisionError) and "ulimit -n" in str(err)
    assert out_of_files(OSError(errno.ENOENT, "x")) is None
