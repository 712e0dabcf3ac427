"""The frame reader and writer on real pipes: a frame alone in a read (a lone call's, its
answer: parsed where it lies), frames split across reads or several in one read, and a
frame written whole by ``write_frame`` whatever its size."""

from __future__ import annotations

import os
import threading

from flotilla._wire.frames import FrameReader, Kind, frame, write_frame


def test_a_frame_alone_in_a_read_and_frames_split_or_joined_all_come_out_whole() -> None:
    r, w = os.pipe()
    try:
        reader = FrameReader()
        os.write(w, b"".join(frame(Kind.TASK, 7, b"abc")))  # alone: the fast path
        assert reader.read(r) == [(Kind.TASK, 7, b"abc")]
        os.write(w, b"".join(frame(Kind.RESULT, 8)))  # an empty body alone
        assert reader.read(r) == [(Kind.RESULT, 8, b"")]
        data = b"".join(frame(Kind.RESULT, 9, b"x" * 100))
        os.write(w, data[:5])  # less than a header
        assert reader.read(r) == []
        os.write(w, data[5:50])  # the header and part of the body
        assert reader.read(r) == []
        two = b"".join([*frame(Kind.STARTED, 10), *frame(Kind.RESULT, 10, b"ok")])
        os.write(w, data[50:] + two)  # the rest, then two whole frames in the same read
        assert reader.read(r) == [
            (Kind.RESULT, 9, b"x" * 100),
            (Kind.STARTED, 10, b""),
            (Kind.RESULT, 10, b"ok"),
        ]
        os.write(w, b"".join(frame(Kind.BEAT, 0)) + b"\x03")  # a frame and a byte of the next
        assert reader.read(r) == [(Kind.BEAT, 0, b"")]
        os.write(w, b"".join(frame(Kind.RESULT, 11, b"yz"))[1:])
        assert reader.read(r) == [(Kind.RESULT, 11, b"yz")]
        os.close(w)
        w = -1
        assert reader.read(r) is None
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_write_frame_writes_one_whole_frame_small_or_larger_than_a_pipe() -> None:
    r, w = os.pipe()
    got: list[tuple[int, int, bytes | bytearray]] = []

    def read() -> None:
        reader = FrameReader()
        while True:
            frames = reader.read(r)
            if frames is None:
                return
            got.extend(frames)

    reader_thread = threading.Thread(target=read)
    reader_thread.start()
    try:
        write_frame(w, Kind.RESULT, 1, b"\x00", b"small")
        big = os.urandom(300_000)  # more than a pipe holds: written in several steps
        write_frame(w, Kind.RESULT, 2, b"\x00", memoryview(big), b"tail")
    finally:
        os.close(w)
        reader_thread.join(60)
        os.close(r)
    assert got == [(Kind.RESULT, 1, b"\x00small"), (Kind.RESULT, 2, b"\x00" + big + b"tail")]
