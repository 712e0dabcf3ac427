"""Payload encoding: cloudpickle with pickle protocol 5 out-of-band buffers.

A payload is the pickle stream plus the large buffers it refers to (numpy arrays, torch
tensors, bytes-like objects of at least ``OUT_OF_BAND`` bytes), which are never copied into
the pickle stream. On the wire a payload is::

    u32 nbuf | u64 main_len | u16 shm_name_len | shm name | nbuf x (u8 where, u64 offset, u64 len)
    | main pickle | inline buffers

``where`` is 0 for a buffer that follows inline and 1 for one that lies in the shared
memory file ``shm name`` (same-host nodes only): a broadcast of a 100 MB array to four
local nodes writes it to shared memory once and each node maps it copy-on-write.
Decoding is zero-copy: buffers become views of the received frame or of the mapping.
"""

from __future__ import annotations

import _pickle as pickle  # pickle.py adds re, struct and its Python twin: ~1 ms of a start
import functools
import io
import mmap
import os
import stat
import struct
import sys
from collections.abc import Callable
from types import CodeType, FunctionType, ModuleType

from . import rebuild
from .code import reduce_code
from .frames import Buffer

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

OUT_OF_BAND = 64 * 1024  # buffers this large are not copied into the pickle stream
SHM_MIN = 1 << 20  # buffers this large go through shared memory between same-host nodes
SHM_DIR = "/dev/shm"
_ALIGN = 64

_HEAD = struct.Struct("<IQH")
PAYLOAD_HEAD = _HEAD
"""A payload's head: its buffers, the pickle's length, its file name's length."""
_BUF = struct.Struct("<BQQ")


class Pickled:
    """A pickled object: the pickle stream and its out-of-band buffers. (A plain class, not
    a dataclass, whose making compiles its methods: every executor's start imports this
    module.)"""

    __slots__ = ("buffers", "main")

    def __init__(self, main: bytes, buffers: tuple[memoryview, ...]) -> None:
        self.main = main
        self.buffers = buffers

    @property
    def shm_bytes(self) -> int:
        """Bytes that would travel through shared memory."""
        if not self.buffers:  # (most results: no sum to start, per call)
            return 0
        return sum(b.nbytes for b in self.buffers if b.nbytes >= SHM_MIN)


_SCALARS = frozenset({type(None), bool, int, float, complex, str})
_CONTAINERS = frozenset({tuple, list, dict})
_PLAIN_ITEMS = 64  # containers larger than this take cloudpickle's path (no scan)
_PLAIN_BYTES = 4096  # bytes objects up to this size are plain; larger ones may go out of band


def _plain(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` is small builtin data (scalars, short bytes, small tuples, lists
    and dicts of them): what the standard pickler writes exactly as cloudpickle would,
    with nothing by reference, no buffer out of band and no code object."""
    t = type(obj)
    if t in _SCALARS:
        return True
    if t is bytes:
        return len(obj) <= _PLAIN_BYTES
    if t not in _CONTAINERS or depth >= 4 or len(obj) > _PLAIN_ITEMS:
        return False
    scalars = _SCALARS
    if t is dict:
        for key, value in obj.items():
            if type(key) not in scalars and not _plain(key, depth + 1):
                return False
            if type(value) not in scalars and not _plain(value, depth + 1):
                return False
        return True
    for item in obj:  # noqa: SIM110 - a loop: all() over a generator costs more here
        if type(item) not in scalars and not _plain(item, depth + 1):
            return False
    return True


def pickle_obj(obj: Any) -> Pickled:
    """Pickle ``obj`` with cloudpickle, keeping large buffers out of band.

    Small builtin data (a no-op's arguments, a number returned) is pickled by the standard
    C pickler: the same stream, several times faster than building a cloudpickle pickler."""
    if _plain(obj):
        return Pickled(pickle.dumps(obj, 5), ())
    buffers: list[memoryview] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        view = buf.raw()
        if view.nbytes < OUT_OF_BAND:
            return True  # a true value means: serialize in band
        buffers.append(view)
        return False

    return Pickled(dumps(obj, keep), tuple(buffers))


def dumps(obj: Any, buffer_callback: Callable[[pickle.PickleBuffer], bool] | None = None) -> bytes:
    """cloudpickle's ``dumps`` (protocol 5), code objects sent as ``code`` sends them: with
    their file name and source lines, so remote tracebacks show the user's code."""
    with io.BytesIO() as file:
        _pickler()(file, protocol=5, buffer_callback=buffer_callback).dump(obj)
        return file.getvalue()


@functools.cache
def _pickler() -> type[pickle.Pickler]:
    """cloudpickle's pickler, code objects sent by ``code``, and cloudpickle's function
    reconstructors named as their twins in ``rebuild`` (the node unpickles a by-value
    function without importing cloudpickle)."""
    import cloudpickle

    twins = _twins(cloudpickle)

    class Pickler(cloudpickle.Pickler):  # type: ignore[misc]
        def reducer_override(self, obj: Any) -> Any:
            t = type(obj)
            if t is CodeType:
                reduced = reduce_code(obj)
                if reduced is not None:
                    return reduced
            elif t is FunctionType:
                reduced = twins.get(obj)
                if reduced is not None:
                    return reduced
            return super().reducer_override(obj)

    return Pickler


def _twins(cloudpickle: ModuleType) -> dict[Any, tuple[Any, tuple[str]]]:
    """The reduce value of each of ``cloudpickle``'s reconstructors that ``rebuild`` has a
    twin of: a call of ``rebuild.twin``. Empty for a series whose reconstructors were not
    compared with the twins (it is pickled as cloudpickle pickles it)."""
    if not rebuild.checked(str(getattr(cloudpickle, "__version__", ""))):
        return {}
    module = cloudpickle.cloudpickle
    return {getattr(module, name): (rebuild.twin, (name,)) for name in rebuild.TWINS}


def _inline(main: bytes) -> list[Buffer]:
    """The wire parts of a pickle with no buffer (:func:`encode`'s first case): one part,
    the header joined to it, when it is small."""
    head = _HEAD.pack(0, len(main), 0)
    return [head + main] if len(main) <= _PLAIN_BYTES else [head, main]


_NONE = _inline(pickle.dumps(None, 5))[0]
"""``encode(pickle_obj(None))``'s one part."""


def plain_parts(obj: Any) -> list[Buffer] | None:
    """``encode(pickle_obj(obj))`` in one step for small builtin data (a task's usual
    value: no out-of-band buffer, so no shared memory either); None for anything else.
    None itself (what a function without ``return`` returns) is pickled once for all."""
    if obj is None:
        return [_NONE]
    if type(obj) not in _SCALARS and not _plain(obj):
        return None
    return _inline(pickle.dumps(obj, 5))


def encode(p: Pickled, shm_name: str = "") -> list[Buffer]:
    """Wire parts of ``p``; buffers of ``SHM_MIN`` bytes or more lie in ``shm_name``.
    A small pickle with no buffer is one part (the header joined to it)."""
    if not p.buffers:
        return _inline(p.main)
    descriptors: list[Buffer] = []
    inline: list[Buffer] = []
    shm_offset = 0
    for view in p.buffers:
        if shm_name and view.nbytes >= SHM_MIN:
            descriptors.append(_BUF.pack(1, shm_offset, view.nbytes))
            shm_offset += _aligned(view.nbytes)
        else:
            descriptors.append(_BUF.pack(0, 0, view.nbytes))
            inline.append(view)
    name = shm_name.encode() if shm_offset else b""
    head = _HEAD.pack(len(p.buffers), len(p.main), len(name))
    return [head, name, *descriptors, p.main, *inline]


def shm_layout(p: Pickled) -> tuple[list[memoryview], int]:
    """``p``'s buffers that go through shared memory, and the size of the file that holds
    them (each at a 64-byte aligned offset, in order: see :func:`encode`)."""
    big = [b for b in p.buffers if b.nbytes >= SHM_MIN]
    if not big:
        return [], 0
    return big, sum(_aligned(b.nbytes) for b in big[:-1]) + big[-1].nbytes


def write_buffers(fd: int, big: list[memoryview]) -> None:
    """Write ``big`` (from :func:`shm_layout`) into the open file ``fd``."""
    offset = 0
    for view in big:
        flat = view.cast("B")
        done = 0
        while done < flat.nbytes:
            done += os.pwrite(fd, flat[done:], offset + done)
        offset += _aligned(view.nbytes)


def create_shm(prefix: str) -> tuple[str, int]:
    """A new, empty shared-memory file under an unpredictable name starting with
    ``prefix``, created new (never through a link or into a FIFO another user planted in
    the shared folder): its name and a descriptor open for writing. Raises OSError."""
    name = f"{prefix}{os.urandom(8).hex()}"  # (as secrets.token_hex, without its imports)
    flags = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY | os.O_CLOEXEC
    return name, os.open(os.path.join(SHM_DIR, name), flags, 0o600)


def write_shm(p: Pickled, prefix: str) -> str:
    """Write ``p``'s large buffers to a new shared-memory file; return its name ('' if none).

    Shared memory is an optimisation: when ``/dev/shm`` is missing, full or not writable,
    nothing is left behind, '' is returned (the buffers then travel through the pipe) and
    one warning per process says so."""
    big, _ = shm_layout(p)
    if not big:
        return ""
    try:
        name, fd = create_shm(prefix)
    except OSError as e:
        shm_unavailable(e)
        return ""
    try:
        write_buffers(fd, big)
    except OSError as e:  # typically ENOSPC: /dev/shm is full
        unlink_shm(name)
        shm_unavailable(e)
        return ""
    except BaseException:
        unlink_shm(name)
        raise
    finally:
        os.close(fd)
    return name


_warned = False


def shm_unavailable(e: OSError) -> None:
    """Say once per process that shared memory cannot be used (``e``: why)."""
    global _warned
    if not _warned:
        _warned = True
        print(
            f"flotilla: shared memory cannot be used ({SHM_DIR}: {e.strerror or e}); large "
            "buffers travel through the pipe instead (slower; free or enlarge /dev/shm)",
            file=sys.stderr,
            flush=True,
        )


def unlink_shm(name: str) -> None:
    """Remove a shared-memory file; already gone is fine."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def decode(body: Buffer, offset: int = 0, maps: list[mmap.mmap] | None = None) -> Any:
    """Unpickle a payload that starts at ``offset`` of ``body``; the mapping of its
    shared-memory file, if it has one, is added to ``maps`` (see :func:`unmap`)."""
    view = memoryview(body)
    nbuf, main_len, name_len = _HEAD.unpack_from(view, offset)
    pos = offset + _HEAD.size
    if not nbuf:  # the pickle stream alone (no buffer, so no shared memory either)
        return pickle.loads(view[pos + name_len : pos + name_len + main_len])
    name = bytes(view[pos : pos + name_len]).decode()
    pos += name_len
    descriptors = [_BUF.unpack_from(view, pos + i * _BUF.size) for i in range(nbuf)]
    pos += nbuf * _BUF.size
    main = view[pos : pos + main_len]
    pos += main_len
    shm: memoryview | None = None
    if name:
        shm = map_private(name)
        if maps is not None:
            maps.append(shm.obj)  # type: ignore[arg-type]  # (the mmap the view is of)
    buffers: list[memoryview] = []
    for where, shm_offset, length in descriptors:
        if where == 1:
            assert shm is not None
            buffers.append(shm[shm_offset : shm_offset + length])
        else:
            buffers.append(view[pos : pos + length])
            pos += length
    return pickle.loads(main, buffers=buffers)


def shm_name_of(body: Buffer, offset: int = 0) -> str:
    """The shared-memory file a payload refers to ('' if none)."""
    _, _, name_len = _HEAD.unpack_from(body, offset)
    if not name_len:
        return ""
    start = offset + _HEAD.size
    return bytes(memoryview(body)[start : start + name_len]).decode()


def map_private(name: str) -> memoryview:
    """Map a shared-memory file copy-on-write: writes stay private to this process."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{SHM_DIR}/{name} is not a regular file")
        size = info.st_size
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return memoryview(mapping)


def unmap(maps: list[mmap.mmap]) -> bool:
    """Close the mappings ``decode`` made; whether every one is closed, i.e. nothing (an
    array, a view of it) still shows their memory. One that is still viewed stays open
    (for its viewers): a later write to its file would show through it, in the pages its
    viewer did not write."""
    closed = True
    for mapping in maps:
        try:
            mapping.close()
        except BufferError:  # exported: something still views it
            closed = False
    return closed


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def describe_unpicklable(obj: Any, root: str) -> tuple[str, str, str] | None:
    """Find the innermost part of ``obj`` that cannot be pickled.

    Returns ``(path, type name, reason)``, e.g. ``("args[1]['x']", "_thread.lock", ...)``,
    or None when ``obj`` pickles fine.
    """

    def fails(o: Any) -> str | None:
        try:
            dumps(o, lambda b: False)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    def children(o: Any, path: str) -> list[tuple[Any, str]]:
        if isinstance(o, dict):
            return [(v, f"{path}[{k!r}]") for k, v in o.items()]
        if isinstance(o, list | tuple):
            return [(v, f"{path}[{i}]") for i, v in enumerate(o)]
        if isinstance(o, set | frozenset):
            return [(v, f"{path}{{{v!r}}}") for v in o]
        if callable(o) and getattr(o, "__closure__", None):
            names = o.__code__.co_freevars
            return [
                (c.cell_contents, f"{path}<closure {n}>")
                for n, c in zip(names, o.__closure__, strict=False)
            ]
        attrs = getattr(o, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(o, type):
            return [(v, f"{path}.{k}") for k, v in attrs.items()]
        return []

    def walk(o: Any, path: str, seen: set[int]) -> tuple[str, str, str] | None:
        reason = fails(o)
        if reason is None:
            return None
        if id(o) not in seen:
            seen.add(id(o))
            for child, child_path in children(o, path):
                found = walk(child, child_path, seen)
                if found is not None:
                    return found
        t = type(o)
        return path, f"{t.__module__}.{t.__qualname__}", reason

    return walk(obj, root, set())
