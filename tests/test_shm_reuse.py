"""A large argument's shared-memory file is written again for the next large argument
(issue 22), but only once no process shows its memory any more: an array a task kept, a
failed, cancelled or scribbling task never sees a later call's data, and the files go
with the pool. Real local pools; the file a node maps is seen in its ``/dev/shm``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest
from _procs import wait_until

import flotilla as sky
from flotilla._client import shm
from flotilla._wire.serialize import SHM_DIR, pickle_obj

N = 2_500_000  # float64: 20 MB, well above the shared-memory threshold


def pool_files(pool_id: str) -> list[tuple[str, int]]:
    """The pool's files in ``/dev/shm``: (name, inode)."""
    prefix = f"flotilla-{pool_id}-"
    found = []
    for name in sorted(os.listdir(SHM_DIR)):
        if name.startswith(prefix):
            try:
                found.append((name, os.stat(os.path.join(SHM_DIR, name)).st_ino))
            except FileNotFoundError:
                pass
    return found


@sky.function
def look(array: np.ndarray) -> tuple[float, int, float, float, list[tuple[str, int]]]:
    """What this node got (sum, size, first, last) and the pool's files it sees."""
    from flotilla import instance_info

    seen = pool_files(instance_info().pool_id)
    return float(array.sum()), int(array.size), float(array[0]), float(array[-1]), seen


def facts(array: np.ndarray) -> tuple[float, int, float, float]:
    return float(array.sum()), int(array.size), float(array[0]), float(array[-1])


def _store() -> object:
    """A module of this node's process that outlives the calls (a module global)."""
    import sys
    import types

    return sys.modules.setdefault("_kept_by_the_test", types.ModuleType("_kept_by_the_test"))


@sky.function
def keep(array: np.ndarray) -> list[tuple[str, int]]:
    """Keep ``array`` in a module global of the node; the pool's files it sees."""
    from flotilla import instance_info

    _store().kept = array  # type: ignore[attr-defined]
    return pool_files(instance_info().pool_id)


@sky.function
def kept() -> tuple[float, int, float, float]:
    """What the array kept by :func:`keep` (or in a kept traceback) shows now."""
    store = _store()
    array = getattr(store, "kept", None)
    if array is None:
        array = store.traceback.tb_frame.f_locals["array"]  # type: ignore[attr-defined]
    return facts(array)


@sky.function
def scribble(array: np.ndarray) -> float:
    """Write into the (copy-on-write) array: 1 more everywhere; its sum then."""
    array += 1
    return float(array.sum())


@sky.function
def fail(array: np.ndarray, keep_traceback: bool) -> None:
    """Raise with ``array`` in the traceback (its frame); keep that traceback in a module
    global of the node if ``keep_traceback``."""
    try:
        raise ValueError(f"no thanks: {float(array.sum())}")
    except ValueError as e:
        if keep_traceback:
            _store().traceback = e.__traceback__  # type: ignore[attr-defined]
        raise


@sky.function
def head(array: np.ndarray) -> np.ndarray:
    """A 160 kB slice of the array: a result sent inline, as a view of the arguments."""
    return array[:20_000]


@sky.function
def fork_and_keep(array: np.ndarray) -> int:
    """Fork a child that keeps the array (it reads it once told to, see :func:`ask_child`)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(write_end)
        answer = os.read(read_end, 4096).decode()  # the file to answer in
        Path(answer).write_text(repr(facts(array)))
        os._exit(0)
    os.close(read_end)
    _store().child = (pid, write_end)  # type: ignore[attr-defined]
    return pid


@sky.function
def ask_child(folder: str) -> tuple[float, int, float, float]:
    """What the array the child of :func:`fork_and_keep` kept shows now."""
    pid, write_end = _store().child  # type: ignore[attr-defined]
    answer = Path(folder, str(pid))
    os.write(write_end, str(answer).encode())
    os.waitpid(pid, 0)
    got: tuple[float, int, float, float] = eval(answer.read_text())
    return got


@sky.function
def wait_forever(array: np.ndarray, markers: str) -> None:
    """Say it runs (a marker file), with the pool's file it sees; then wait to be cancelled."""
    import threading

    from flotilla import instance_info

    name = pool_files(instance_info().pool_id)[0][0]
    Path(markers, str(os.getpid())).write_text(name)
    threading.Event().wait()


@pytest.fixture
def pool() -> Iterator[sky.Compute]:
    with sky.Compute(nodes=2) as pool:
        yield pool


def settled(pool: sky.Compute) -> list[str]:
    """Wait until the client is done with its files (a call's futures are settled first,
    its file goes back or away just after): every one left is kept for the next call.
    The kept ones."""
    files = pool._dispatcher.shm_files
    assert wait_until(lambda: {n for n, _ in pool_files(pool.pool_id)} == set(files.kept))
    return files.kept


def assert_kept_intact(
    pool: sky.Compute, left: list[str], later: np.ndarray, kept_from: np.ndarray
) -> None:
    """No file was kept for reuse while a node still mapped it (``left``: the files kept
    after that call); the broadcast of ``later`` shows its own data, and the array kept
    from ``kept_from`` still shows its own."""
    for *got, _ in look(later) @ pool:
        assert tuple(got) == pytest.approx(facts(later))
    for got in kept() @ pool:
        assert got == pytest.approx(facts(kept_from))
    assert left == [], "a file still mapped was kept for reuse"


def test_broadcasts_in_a_row_write_one_file_and_each_node_sees_each_ones_data(
    pool: sky.Compute,
) -> None:
    """Three broadcasts of different arrays (the second larger, the third smaller) go
    through the same file (name and inode); every node sees each one's own data."""
    arrays = [
        np.full(N, 1.5),
        np.arange(2 * N, dtype=np.float64),  # larger
        np.linspace(-7.0, 3.0, N // 3),  # smaller
    ]
    used = set()
    for array in arrays:
        for *got, seen in look(array) @ pool:
            assert tuple(got) == pytest.approx(facts(array))
            assert len(seen) == 1, seen  # the one file of the arguments
            used.add(seen[0])
        assert settled(pool) == [seen[0][0]], "the file was not kept for the next call"
    assert len(used) == 1, used  # the same file every time, never a new one


def test_an_array_a_task_keeps_never_shows_a_later_broadcasts_data(pool: sky.Compute) -> None:
    """A task keeps its array (in a module global of its node): its file is not written
    again (removed as before), so the array still shows the first data after a second
    broadcast of the same size, read back by a third call."""
    first, second = np.full(N, 2.5), np.arange(N, dtype=np.float64)
    look(first) @ pool  # a file kept: the next broadcast's
    (name,) = settled(pool)
    for seen in keep(first) @ pool:
        assert [n for n, _ in seen] == [name]
    assert_kept_intact(pool, settled(pool), later=second, kept_from=first)


def test_a_task_that_writes_into_its_array_leaves_the_next_broadcast_its_own_data(
    pool: sky.Compute,
) -> None:
    """A task writes into its copy-on-write array (its node's own pages): the file is
    written again for the next broadcast, which every node sees whole."""
    first, second = np.full(N, 4.0), np.arange(N, dtype=np.float64)
    assert scribble(first) @ pool == pytest.approx([float(first.sum()) + N] * 2)
    assert (first == 4.0).all()  # the client's array is untouched
    (name,) = settled(pool)
    for *got, seen in look(second) @ pool:
        assert tuple(got) == pytest.approx(facts(second))
        assert [n for n, _ in seen] == [name]
    assert settled(pool) == [name]
    assert scribble(second) @ pool == pytest.approx([float(second.sum()) + N] * 2)


def test_a_slice_of_the_arguments_returned_is_sent_and_the_file_written_again(
    pool: sky.Compute,
) -> None:
    """A task returns a small slice of its array (sent inline, a view of the mapping until
    it is sent): it arrives whole and the file is kept for the next broadcast."""
    first, second = np.arange(N, dtype=np.float64), np.full(N, 8.0)
    for got in head(first) @ pool:
        np.testing.assert_array_equal(got, first[:20_000])
    (name,) = settled(pool)
    for got in head(second) @ pool:
        np.testing.assert_array_equal(got, second[:20_000])
    assert settled(pool) == [name]


def test_a_process_a_task_forked_never_shows_a_later_broadcasts_data(
    pool: sky.Compute, tmp_path: Path
) -> None:
    """A task forks a child that outlives it (the child has the mapping too, which the
    task's process cannot see): the file is not written again; the child still sees the
    first data after a second broadcast."""
    first, second = np.full(N, 1.25), np.arange(N, dtype=np.float64)
    look(first) @ pool  # a file kept: the next broadcast's
    settled(pool)
    fork_and_keep(first) @ pool
    left = settled(pool)
    for *got, _ in look(second) @ pool:
        assert tuple(got) == pytest.approx(facts(second))
    for got in ask_child(str(tmp_path)) @ pool:
        assert got == pytest.approx(facts(first))
    assert left == [], "a file a forked child maps was kept for reuse"


def test_a_failed_task_never_shows_a_later_broadcasts_data(pool: sky.Compute) -> None:
    """A task raises with its array in the traceback: the caller gets the error, the next
    broadcast its own data. One that keeps that traceback (so the array) keeps seeing
    the first data: its file is not written again."""
    first, second, third = np.full(N, 3.0), np.arange(N, dtype=np.float64), np.full(N, -1.0)
    with pytest.raises(ValueError, match=f"no thanks: {float(first.sum())}"):
        fail(first, False) @ pool
    (name,) = settled(pool)
    for *got, seen in look(second) @ pool:
        assert tuple(got) == pytest.approx(facts(second))
        assert [n for n, _ in seen] == [name]
    assert settled(pool) == [name]
    with pytest.raises(ValueError, match=f"no thanks: {float(second.sum())}"):
        fail(second, True) @ pool
    assert_kept_intact(pool, settled(pool), later=third, kept_from=second)


def test_a_cancelled_broadcasts_file_is_not_written_again(
    pool: sky.Compute, tmp_path: Path
) -> None:
    """Cancelled calls (their processes are stopped, maybe not gone yet): their file is
    removed, never written again; the next broadcast gets its own data."""
    first, second = np.full(N, 5.0), np.arange(N, dtype=np.float64)
    futures = pool.submit_broadcast(wait_forever(first, str(tmp_path)))

    def written() -> list[str]:  # a marker is made empty, then written: wait for both texts
        return [text for m in tmp_path.iterdir() if (text := m.read_text())]

    assert wait_until(lambda: len(written()) == 2, timeout=30)
    (name,) = set(written())
    pool.cancel(futures)
    for future in futures:
        with pytest.raises(CancelledError):
            future.result(timeout=30)
    assert settled(pool) == [], "a cancelled call's file was kept for reuse"
    for *got, seen in look(second) @ pool:
        assert tuple(got) == pytest.approx(facts(second))
        assert name not in [n for n, _ in seen]


def test_the_pool_removes_the_files_it_kept_when_it_closes() -> None:
    with sky.Compute(nodes=2) as pool:
        look(np.full(N, 6.0)) @ pool
        assert len(settled(pool)) == 1, "the file was not kept for the next call"
    assert pool_files(pool.pool_id) == []
    fds = Path("/proc/self/fd")
    held = [_readlink(fd) for fd in fds.iterdir()]
    assert not [link for link in held if f"flotilla-{pool.pool_id}-" in link], held


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


# -- the kept files themselves (real files in /dev/shm, no pool) ------------------------


@pytest.fixture
def files() -> Iterator[shm.Files]:
    prefix = shm.pool_prefix("0badc0de")
    files = shm.Files(prefix)
    try:
        yield files
    finally:
        files.close()
        shm.remove_pool_files(prefix)


def read(name: str, n: int) -> np.ndarray:
    return np.fromfile(os.path.join(SHM_DIR, name), dtype=np.float64, count=n)


def test_at_most_two_files_are_kept_and_the_oldest_goes(files: shm.Files) -> None:
    written = [files.write(pickle_obj(np.full(N, float(i)))) for i in range(3)]
    names = [f.name for f in written if f is not None]
    assert len(names) == 3 and len(set(names)) == 3  # all three in use: three files
    for f in written:
        assert f is not None
        files.give(f, reusable=True)
    assert files.kept == names[1:]
    assert not os.path.exists(os.path.join(SHM_DIR, names[0]))
    again = files.write(pickle_obj(np.full(N // 2, 9.0)))
    assert again is not None and again.name in names[1:]
    assert os.path.getsize(os.path.join(SHM_DIR, again.name)) == N // 2 * 8
    assert (read(again.name, N // 2) == 9.0).all()
    files.give(again, reusable=False)  # (still mapped somewhere): removed
    assert not os.path.exists(os.path.join(SHM_DIR, again.name))
    assert len(files.kept) == 1


def test_no_more_than_the_byte_cap_is_kept() -> None:
    prefix = shm.pool_prefix("0badcafe")
    files = shm.Files(prefix, cap=N * 8 + N * 4)  # one 20 MB file and a half
    try:
        a = files.write(pickle_obj(np.full(N, 1.0)))
        b = files.write(pickle_obj(np.full(N, 2.0)))
        assert a is not None and b is not None
        files.give(a, reusable=True)
        files.give(b, reusable=True)
        assert files.kept == [b.name]
        assert not os.path.exists(os.path.join(SHM_DIR, a.name))
    finally:
        files.close()
        shm.remove_pool_files(prefix)
    assert not os.path.exists(os.path.join(SHM_DIR, b.name))


def test_a_kept_file_whose_name_was_removed_is_never_written_again(files: shm.Files) -> None:
    """An agent of the pool removes the pool's files when it exits: a kept file whose name
    is gone (anyone could make a new file of that name) is dropped, a new one made."""
    first = files.write(pickle_obj(np.full(N, 1.0)))
    assert first is not None
    files.give(first, reusable=True)
    os.unlink(os.path.join(SHM_DIR, first.name))
    planted = os.path.join(SHM_DIR, first.name)
    Path(planted).write_bytes(b"someone else's")
    try:
        second = files.write(pickle_obj(np.full(N, 2.0)))
        assert second is not None and second.name != first.name
        assert Path(planted).read_bytes() == b"someone else's"
        assert (read(second.name, N) == 2.0).all()
        files.give(second, reusable=False)
    finally:
        os.unlink(planted)


def test_a_file_kept_longer_than_keep_idle_is_removed(files: shm.Files) -> None:
    """An idle pool gives its shared memory back: the pool's heartbeat tick trims."""
    first = files.write(pickle_obj(np.full(N, 1.0)))
    second = files.write(pickle_obj(np.full(N, 2.0)))
    assert first is not None and second is not None
    files.give(first, reusable=True)
    files.give(second, reusable=True)
    second.kept_at = first.kept_at + shm.KEEP_IDLE  # given back a minute later
    files.trim(first.kept_at + shm.KEEP_IDLE)  # not yet: kept exactly KEEP_IDLE s
    assert files.kept == [first.name, second.name]
    files.trim(first.kept_at + shm.KEEP_IDLE + 1)
    assert files.kept == [second.name]
    assert not os.path.exists(os.path.join(SHM_DIR, first.name))
    assert os.path.exists(os.path.join(SHM_DIR, second.name))


def test_an_idle_pool_removes_its_kept_files(
    pool: sky.Compute, monkeypatch: pytest.MonkeyPatch
) -> None:
    look(np.full(N, 1.0)) @ pool
    assert settled(pool)  # kept for the next call
    monkeypatch.setattr(shm, "KEEP_IDLE", 0.0)  # idle from now on: the next tick trims
    assert wait_until(lambda: not pool_files(pool.pool_id) and not settled(pool))
