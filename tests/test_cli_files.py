"""``flotilla cp``, ``download`` and ``rsync`` (``cli/cmd_files.py``): files to and from a
cluster's nodes through the channel ``flotilla ssh`` uses, on real local and SSH-lab
clusters (the container, AWS and SLURM labs' CLI tests copy too). What a node sends is
extracted safely: a crafted archive is refused, nothing written."""

from __future__ import annotations

import os
import stat
import subprocess
import textwrap
from pathlib import Path

from _hosts import Lab
from test_cli import CLI, ssh_flags
from test_cli import cli as cli  # the fixture
from test_cli import ssh_lab_fixture as ssh_lab_fixture  # the fixture


def tree(root: Path) -> dict[str, str]:
    """relative path -> content of every file below ``root``."""
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def make_files(base: Path) -> Path:
    data = base / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("alpha\n")
    (data / "sub" / "b.txt").write_text("beta\n")
    (data / ".hidden").write_text("dot\n")
    return data


def round_trip(cli: CLI, cluster: str, node: int, base: Path) -> None:
    """Up and down again through ``cp``/``download`` on node ``node``; checked by
    ``flotilla ssh`` on the node and by what comes back."""
    data = make_files(base)
    where = f"{cluster}/{node}"
    cli.ok("cp", str(data), f"{where}:up")  # a folder, as a new name
    cli.ok("cp", str(data / "a.txt"), f"{where}:up/sub/")  # a file into a folder
    cli.ok("cp", str(data / "a.txt"), f"{where}:renamed.txt")  # a file, as a new name
    seen = cli.ok("ssh", cluster, "--node", str(node), "--", "cat up/sub/b.txt up/sub/a.txt")
    assert seen.stdout == "beta\nalpha\n"
    assert cli.ok("ssh", cluster, "--node", str(node), "--", "cat renamed.txt").stdout == "alpha\n"
    back = base / "back"
    back.mkdir()
    cli.ok("cp", f"{where}:up", str(back / "copy"))  # as a new name
    cli.ok("download", where, "up/sub/b.txt", str(back))  # into a folder
    assert tree(back / "copy") == {
        ".hidden": "dot\n",
        "a.txt": "alpha\n",
        "sub/a.txt": "alpha\n",
        "sub/b.txt": "beta\n",
    }
    assert (back / "b.txt").read_text() == "beta\n"


def copy_check(cli: CLI, cluster: str, node: int, base: Path) -> None:
    """A file up to node ``node`` (read back there by ``flotilla ssh``) and down again:
    the other labs' CLI tests call it on their clusters (container, AWS, SLURM)."""
    base.mkdir(parents=True, exist_ok=True)
    (base / "up.txt").write_text(f"to {cluster}/{node}\n")
    cli.ok("cp", str(base / "up.txt"), f"{cluster}/{node}:copied.txt")
    seen = cli.ok("ssh", cluster, "--node", str(node), "--", "cat copied.txt")
    assert seen.stdout == f"to {cluster}/{node}\n"
    cli.ok("download", f"{cluster}/{node}", "copied.txt", str(base / "back.txt"))
    assert (base / "back.txt").read_text() == f"to {cluster}/{node}\n"


def test_cp_and_download_on_a_local_cluster(cli: CLI, tmp_path: Path) -> None:
    cli.ok("launch", "echo up", "-c", "files", "--nodes", "2")
    round_trip(cli, "files", 1, tmp_path / "t")
    rec = cli.record("files")
    assert rec is not None  # node 1's own folder got them, node 0's nothing
    assert (Path(rec.nodes[1].workdir) / "up" / "sub" / "b.txt").read_text() == "beta\n"
    assert not (Path(rec.nodes[0].workdir) / "up").exists()
    data = tmp_path / "t" / "data"
    inside = CLI(cli.home, data)  # the same home, run from inside the folder
    inside.env = cli.env
    inside.ok("cp", ".", "files/1:code")  # `.`: the folder, under its own name
    assert tree(Path(rec.nodes[1].workdir) / "code") == tree(data)
    cli.ok("cp", "files/1:code/.", str(tmp_path / "whole"))  # a folder's content
    assert tree(tmp_path / "whole") == tree(data)
    done = cli("cp", "files/1:", str(tmp_path / "wd"))  # flotilla's link out of the folder
    assert done.returncode != 0 and "links to" in done.stderr and "flotilla rsync" in done.stderr
    assert not (tmp_path / "wd").exists()
    cli.ok("cp", str(data / "a.txt"), "files:~/in-home.txt")
    home = cli.ok("ssh", "files", "--", "cat ~/in-home.txt").stdout
    assert home == "alpha\n"


def test_rsync_through_the_nodes_shell_channel(cli: CLI, tmp_path: Path) -> None:
    """``flotilla rsync`` both ways, rsync's own flags after ``--`` (``--delete``)."""
    cli.ok("launch", "echo up", "-c", "sync", "--nodes", "2")
    data = make_files(tmp_path)
    cli.ok("rsync", f"{data}/", "sync/1:mirror")
    rec = cli.record("sync")
    assert rec is not None
    mirror = Path(rec.nodes[1].workdir) / "mirror"
    assert tree(mirror) == tree(data)
    (data / "a.txt").unlink()
    (mirror / "extra.txt").write_text("node side\n")
    cli.ok("rsync", f"{data}/", "sync/1:mirror", "--", "--delete")
    assert tree(mirror) == tree(data)
    back = tmp_path / "back"
    cli.ok("rsync", "sync/1:mirror/", str(back))
    assert tree(back) == tree(data)


def test_bad_endpoints_are_refused_before_anything_runs(cli: CLI, tmp_path: Path) -> None:
    cli.ok("launch", "echo up", "-c", "ends")
    for args, said in (
        (["cp", "a", "b"], "one side must be a cluster's node"),
        (["cp", "ends:a", "ends:b"], "one side must be a cluster's node"),
        (["cp", str(tmp_path), "ends/3:x"], "cluster ends has nodes 0 to 0"),
        (["cp", str(tmp_path / "nothing"), "ends:x"], "no such file or folder"),
        (["cp", "ends:missing.txt", str(tmp_path)], "failed: "),
        (["cp", "nope:x", str(tmp_path)], "nope"),
        (["rsync", "a", "b"], "one side must be a cluster's node"),
    ):
        done = cli(*args)
        assert done.returncode != 0 and said in done.stderr, (args, done.stderr)
    assert not (tmp_path / "missing.txt").exists()


def test_a_crafted_archive_from_a_node_is_refused_writing_nothing(cli: CLI, tmp_path: Path) -> None:
    """A node whose ``tar`` sends a member named ``../escaped``: the download is refused
    and nothing is written outside (or inside) the destination."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    tar = fake / "tar"
    tar.write_text(
        textwrap.dedent(
            """\
            #!/usr/bin/env python3
            import io, sys, tarfile
            with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as t:
                data = b"pwned"
                info = tarfile.TarInfo("../escaped")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
            """
        )
    )
    tar.chmod(tar.stat().st_mode | stat.S_IXUSR)
    cli.ok("launch", "echo up", "-c", "evil")
    dest = tmp_path / "dest"
    dest.mkdir()
    path = f"{fake}{os.pathsep}{os.environ['PATH']}"
    done = cli("cp", "evil:anything", str(dest), env={"PATH": path})  # the node's shell: local
    assert done.returncode != 0 and "refused what the node sent" in done.stderr, done.stderr
    assert not (tmp_path / "escaped").exists() and list(dest.iterdir()) == []


def test_cp_and_rsync_on_an_ssh_cluster_and_ssh_name_through_the_include(
    cli: CLI, ssh_lab: Lab, tmp_path: Path
) -> None:
    """Over ssh with the cluster's key and pinned host keys (the lab's known_hosts); with
    ``--yes`` launch adds the Include line to ~/.ssh/config, through which plain ``ssh
    far-worker1`` reaches node 1."""
    hosts = ssh_lab.hosts[:2]
    home = tmp_path / "user"
    home.mkdir()
    cli.env["HOME"] = str(home)
    flags = ssh_flags(ssh_lab, hosts, tmp_path / "wd")
    cli.ok("launch", "echo up", "-c", "far", "--nodes", "2", "--yes", *flags)
    config = home / ".ssh" / "config"
    assert config.read_text().splitlines()[1] == f"Include {cli.home / 'ssh'}/*.config"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    plain = subprocess.run(
        ["ssh", "-F", str(config), "-o", "BatchMode=yes", "far-worker1", "hostname"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.stdout.split() == [hosts[1].hostname], plain.stderr
    round_trip(cli, "far", 1, tmp_path / "t")
    data = tmp_path / "t" / "data"
    cli.ok("rsync", f"{data}/", "far/1:mirror")
    listed = cli.ok("ssh", "far", "--node", "1", "--", "cat mirror/sub/b.txt; hostname")
    assert listed.stdout.split() == ["beta", hosts[1].hostname]


def test_the_include_line_is_added_once_at_the_top_when_asked(cli: CLI, tmp_path: Path) -> None:
    home = tmp_path / "user"
    (home / ".ssh").mkdir(parents=True)
    config = home / ".ssh" / "config"
    config.write_text("Host old\n  HostName 10.0.0.1\n")
    config.chmod(0o640)
    env = {"HOME": str(home)}
    done = cli("ssh-config", env=env)  # nobody to ask: refused, untouched
    assert done.returncode == 2 and "add -y/--yes" in done.stderr
    assert config.read_text() == "Host old\n  HostName 10.0.0.1\n"
    cli.ok("ssh-config", "-y", env=env)
    lines = config.read_text().splitlines()
    assert lines[1] == f"Include {cli.home / 'ssh'}/*.config"  # before any Host block
    assert lines[-2:] == ["Host old", "  HostName 10.0.0.1"]
    assert stat.S_IMODE(config.stat().st_mode) == 0o640
    again = cli.ok("ssh-config", "-y", env=env)
    assert "includes the clusters' hosts" in again.stdout
    assert config.read_text().count("Include ") == 1


def test_an_ssh_block_is_the_login_of_flotilla_ssh() -> None:
    from flotilla.cli.backends.base import ssh_block

    login = ["-i", "/k", "-o", "UserKnownHostsFile=/kh", "-p", "2222", "root@1.2.3.4"]
    assert ssh_block("c-worker1", login, "/w") == (
        "Host c-worker1\n  HostName 1.2.3.4\n  User root\n  IdentityFile /k\n"
        "  UserKnownHostsFile /kh\n  Port 2222\n  # working directory: /w\n"
    )
