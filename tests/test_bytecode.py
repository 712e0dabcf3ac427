"""Nodes run flotilla's code from byte code the client compiled once (issue 42, item 1).

A node start used to compile the node modules from source wherever it found no byte code it
could use: with ``PYTHONDONTWRITEBYTECODE`` set (as on this machine) or an installation it
cannot write, every Local agent; and on each SSH host, the first start. ``_providers/
bytecode`` builds a compiled copy once per flotilla version and interpreter: Local agents
import from it, and the SSH bundle ships the byte code of the modules a start imports. The
node tests look, from inside a node's executor (forked from the agent: it has every module the agent
loaded), at the byte code of every flotilla and cloudpickle module loaded: it must be
hash-based byte code matching the source: checked-hash in a folder (the interpreter
verifies it against the source), unchecked-hash in the SSH bundle (a zip checked whole at
every start, whose hash covers each source with its byte code: an import reads no source).
A node that compiles for itself writes timestamp byte code, or none at all.
"""

from __future__ import annotations

import io
import marshal
import os
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
from _hosts import Lab, ssh_lab_fixture  # noqa: F401 - the ssh_lab fixture

import flotilla as sky
from flotilla._providers import bootstrap, bytecode
from flotilla._providers.local import Local

SRC = Path(__file__).resolve().parent.parent / "src"
CHECKED_HASH = 0b11
"""The flags of a checked-hash ``.pyc`` (PEP 552); a timestamp one has 0."""
UNCHECKED_HASH = 0b01
"""The flags of an unchecked-hash ``.pyc``: the interpreter does not read its source."""


@sky.function
def loaded_byte_code() -> tuple[list[str], dict[str, str]]:
    """(modules looked at, module -> what is wrong with its byte code). A module imported
    from a folder has its ``.pyc`` in ``__pycache__``; from the SSH bundle (a zip), beside
    its source in the zip, and ``__file__`` names the ``.pyc`` only when it was used."""
    import importlib.util
    import sys

    # a function by value no longer imports cloudpickle (_wire/rebuild.py); a class by value
    # or a result cloudpickle pickles does: its byte code is checked as the rest
    import cloudpickle  # noqa: F401

    seen: list[str] = []
    wrong: dict[str, str] = {}
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if name.split(".")[0] not in ("flotilla", "cloudpickle") or spec is None:
            continue
        if not spec.has_location:
            continue
        origin = str(spec.origin)
        zipped = type(spec.loader).__name__ == "zipimporter"
        if not origin.endswith(".py") and not zipped:
            continue
        seen.append(name)
        try:
            if zipped:
                if not origin.endswith(".pyc"):
                    raise OSError(f"imported from its source {origin}")
                data = spec.loader.get_data(origin)[:16]
                source = spec.loader.get_data(origin[:-1])
            else:
                with open(spec.cached, "rb") as f:
                    data = f.read(16)
                with open(spec.origin, "rb") as f:
                    source = f.read()
        except (OSError, TypeError) as e:
            wrong[name] = f"no byte code ({e})"
            continue
        flags = int.from_bytes(data[4:8], "little")
        want = 0b01 if zipped else 0b11  # unchecked-hash in the bundle, else checked-hash
        if flags != want:
            wrong[name] = f"flags {flags:#b}, not {want:#b}"
        elif data[8:16] != importlib.util.source_hash(source):
            wrong[name] = "byte code of another source"
    return seen, wrong


def assert_all_compiled(seen: list[str], wrong: dict[str, str]) -> None:
    assert "flotilla._node.agent" in seen and "flotilla._node.supervisor" in seen
    assert "cloudpickle" in seen
    assert wrong == {}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this test's own (the compiled copy is built in it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "flotilla" / "code"


def test_a_local_node_imports_only_checked_byte_code(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # the node may write none
    with sky.Compute(provider=Local(workdir=str(tmp_path)), nodes=1) as pool:
        seen, wrong = loaded_byte_code() >> pool
    assert_all_compiled(seen, wrong)
    assert len(os.listdir(cache)) == 1  # one entry, for this flotilla and interpreter


def test_the_ssh_bundle_ships_the_byte_code_of_a_nodes_start(cache: Path) -> None:
    bundle = bootstrap.build_bundle(bootstrap.node_packages())
    with zipfile.ZipFile(io.BytesIO(bundle.data)) as z:
        names = z.namelist()
        agent = z.read("flotilla/_node/agent.pyc")
        byte_code = [z.read(n) for n in names if n.endswith(".pyc")]
    assert "flotilla/_node/agent.pyc" in names and "cloudpickle/cloudpickle.pyc" in names
    assert "flotilla/_client/node.py" in names and "flotilla/_client/node.pyc" not in names
    assert not [n for n in names if "__pycache__" in n]
    code = marshal.loads(agent[16:])  # named by its place in the bundle, not the client's
    assert code.co_filename == "flotilla/_node/agent.py"
    # unchecked: a start's imports do not read and hash the sources the zip's hash covers
    assert {int.from_bytes(b[4:8], "little") for b in byte_code} == {UNCHECKED_HASH}
    assert bootstrap.build_bundle(bootstrap.node_packages()) == bundle  # reproducible


def test_the_bundle_stores_at_its_head_the_byte_code_every_start_imports(cache: Path) -> None:
    """The byte code of :data:`bytecode.STORED` is stored (uncompressed, first: the head every
    start imports from, read as it is), the other modules' deflated; and STORED is what a start
    imports of flotilla: the agent, its metrics, its executor's modules, a cloud helper."""
    bundle = bootstrap.build_bundle(bootstrap.node_packages())
    with zipfile.ZipFile(io.BytesIO(bundle.data)) as z:
        members = z.infolist()
    stored = [m.filename for m in members if m.compress_type == zipfile.ZIP_STORED]
    assert stored == [m.filename for m in members[: len(stored)]]  # the head
    assert sorted(stored) == sorted(f"{name}.pyc" for name in bytecode.STORED)
    later = [m.filename for m in members if m.filename.endswith(".pyc")][len(stored) :]
    assert "cloudpickle/cloudpickle.pyc" in later and "flotilla/_node/volumes.pyc" in later
    probe = (
        f"import sys; sys.path.insert(0, {str(SRC)!r}); before = set(sys.modules)\n"
        "import flotilla.agent, flotilla._node.metrics, flotilla._node.cloud\n"
        "from flotilla._node import processes; processes.warm()\n"
        "from flotilla._node.hooks import enter_plugins\n"
        "print(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    packages = {"flotilla", "flotilla._node", "flotilla._system", "flotilla._wire"}
    started = {m.replace(".", "/") + ("/__init__" if m in packages else "") for m in out}
    assert {m for m in started if m.startswith("flotilla")} == set(bytecode.STORED)


@sky.function
def openssl_loaded() -> list[str]:
    """The modules of OpenSSL's start (hashlib's) this executor has: what the agent had."""
    return [m for m in ("hashlib", "_hashlib") if m in sys.modules]


def test_an_ssh_hosts_first_start_compiles_nothing(
    ssh_lab: Lab, cache: Path, tmp_path: Path
) -> None:
    """A first start imports byte code only, and installs the bundle without ``hashlib``
    (the upload is checked by its CRC-32, as every later start checks the file)."""
    workdir = str(tmp_path / "first-start")  # no bundle there yet: a first start
    provider = ssh_lab.provider(ssh_lab.hosts[:1], workdir=workdir)
    uploads = bootstrap.stats.uploads
    with sky.Compute(provider=provider, nodes=1) as pool:
        seen, wrong = loaded_byte_code() >> pool
        assert openssl_loaded() >> pool == []
    assert_all_compiled(seen, wrong)
    assert bootstrap.stats.uploads == uploads + 1


@pytest.mark.parametrize("damage", ["other bundle", "flipped byte", "cut short"])
def test_the_installer_refuses_an_upload_that_is_not_the_bundle(
    tmp_path: Path, damage: str
) -> None:
    """The installer (``bootstrap._EXTRACT``, as a first start runs it) writes nothing when
    what it read does not unpack to the bundle whose CRC-32 the start command names."""
    bundle = bootstrap.client_bundle()
    packed = bytearray(bundle.data)
    if damage == "other bundle":  # another zip of the same length
        packed = bytearray(bundle.data[1:] + b"\0")
    elif damage == "flipped byte":
        packed[len(packed) // 2] ^= 0x10
    else:
        packed = packed[: len(packed) // 2]
    lib = tmp_path / "lib"
    argv = [str(lib), bundle.hash, str(len(packed)), str(bundle.crc)]
    done = subprocess.run(
        [sys.executable, "-c", bootstrap._EXTRACT, *argv], input=bytes(packed), capture_output=True
    )
    assert done.returncode == 1
    assert b"does not match its CRC-32" in done.stderr
    assert not lib.exists() or os.listdir(lib) == []
    ok = subprocess.run(
        [
            sys.executable,
            "-c",
            bootstrap._EXTRACT,
            str(lib),
            bundle.hash,
            str(len(bundle.data)),
            str(bundle.crc),
        ],
        input=bundle.data,
        capture_output=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert (lib / bundle.hash).read_bytes() == bundle.data


def _package(root: Path, text: str) -> dict[str, str]:
    (root / "pkg").mkdir(parents=True, exist_ok=True)
    (root / "pkg" / "__init__.py").write_text(text)
    return {"pkg": str(root / "pkg")}


def test_the_compiled_copy_is_built_once_per_source(cache: Path, tmp_path: Path) -> None:
    packages = _package(tmp_path / "src", "X = 1\n")
    first = bytecode.compiled(packages)["pkg"]
    pyc = Path(first) / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc"
    built = pyc.stat()
    bytecode._made.clear()  # as another client process would
    assert bytecode.compiled(packages)["pkg"] == first
    assert (pyc.stat().st_ino, pyc.stat().st_mtime_ns) == (built.st_ino, built.st_mtime_ns)
    _package(tmp_path / "src", "X = 2\n")  # an edited source: another copy
    bytecode._made.clear()
    second = bytecode.compiled(packages)["pkg"]
    assert second != first and (Path(second) / "__init__.py").read_text() == "X = 2\n"
    assert sorted(os.listdir(cache)) == sorted(
        os.path.basename(os.path.dirname(p)) for p in (first, second)
    )


def test_a_cache_others_can_write_is_not_used(cache: Path, tmp_path: Path) -> None:
    packages = _package(tmp_path / "src", "X = 1\n")
    cache.mkdir(parents=True)
    cache.chmod(0o777)  # anyone could put code there that every node would run
    bytecode._made.clear()
    assert bytecode.compiled(packages) == packages  # the sources, as they are
    assert os.listdir(cache) == []


def _kept(packages: dict[str, str]) -> list[Path]:
    entry = bytecode.entry_of(packages)
    assert entry is not None
    return sorted(Path(entry).glob(f"{bootstrap.KEPT_PREFIX}*"))


def test_a_clients_bundle_is_kept_and_rebuilt_when_the_code_changes(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client process reads the bundle the first one built (no tar + gzip per process),
    and an edited source gets a bundle of its own."""
    packages = bytecode.compiled(_package(tmp_path / "src", "X = 1\n"))
    first = bootstrap.kept_bundle(packages)
    (kept,) = _kept(packages)
    assert kept.read_bytes() == first.data and kept.stat().st_mode & 0o077 == 0
    assert first.crc == zlib.crc32(first.data)

    def no_build(packages: dict[str, str]) -> bootstrap.Bundle:
        raise AssertionError("built again")

    with monkeypatch.context() as m:
        m.setattr(bootstrap, "build_bundle", no_build)
        read = bootstrap.kept_bundle(packages)
    assert read == first  # read, not built
    bytecode._made.clear()
    edited = bytecode.compiled(_package(tmp_path / "src", "X = 2\n"))
    second = bootstrap.kept_bundle(edited)
    assert second.hash != first.hash
    with zipfile.ZipFile(io.BytesIO(second.data)) as z:
        assert z.read("pkg/__init__.py") == b"X = 2\n"


def test_a_kept_bundle_that_does_not_match_its_hash_is_built_again(
    cache: Path, tmp_path: Path
) -> None:
    packages = bytecode.compiled(_package(tmp_path / "src", "X = 1\n"))
    good = bootstrap.kept_bundle(packages)
    (kept,) = _kept(packages)
    kept.write_bytes(good.data[:-1] + bytes([good.data[-1] ^ 1]))  # one bit changed
    assert bootstrap.kept_bundle(packages) == good
    assert [p.read_bytes() for p in _kept(packages)] == [good.data]


@sky.function
def tampered() -> bool:
    """Whether the altered bundle's extra module is importable here."""
    import importlib.util

    return importlib.util.find_spec("flotilla._tampered") is not None


def test_a_damaged_bundle_on_a_host_is_replaced_not_imported(ssh_lab: Lab, tmp_path: Path) -> None:
    """The bundle a host keeps is checked against its hash at every start: altered, it is
    uploaded again (never imported)."""
    host = ssh_lab.hosts[0]
    workdir = tmp_path / "damaged"
    provider = ssh_lab.provider([host], workdir=str(workdir))
    with sky.Compute(provider=provider, nodes=1) as pool:
        assert not tampered() >> pool  # the first start: uploaded
    bundle = bootstrap.client_bundle()
    kept = host.path(workdir / "lib" / bundle.hash)
    altered = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(bundle.data)) as good,
        zipfile.ZipFile(altered, "w") as bad,
    ):
        for info in good.infolist():
            bad.writestr(info, good.read(info))
        bad.writestr("flotilla/_tampered.py", "X = 1\n")
    kept.write_bytes(altered.getvalue())
    uploads = bootstrap.stats.uploads
    with sky.Compute(provider=provider, nodes=1) as pool:
        assert not tampered() >> pool
    assert bootstrap.stats.uploads == uploads + 1
    assert kept.read_bytes() == bundle.data  # replaced whole
