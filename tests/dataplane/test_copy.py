"""The compiled byte movers of the data plane (``kvpool_native.copy_spans``,
``kvpool_native.Receiver`` and ``kvpool_native.Sender``), against plain Python on the same
bytes."""

from __future__ import annotations

import mmap
import os
import socket
import threading
import time

import numpy as np
import pytest

native = pytest.importorskip("kvpool_native")
if not hasattr(native, "copy_spans"):  # an older build of the compiled core
    pytest.skip("kvpool_native has no copy_spans", allow_module_level=True)

from kvpool_agent.dataplane import server as server_module  # noqa: E402
from kvpool_agent.dataplane import shm as shm_module  # noqa: E402

copy_spans = native.copy_spans
Receiver = native.Receiver
Sender = native.Sender


def offsets(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def test_the_data_plane_uses_them() -> None:
    assert server_module.Receiver is Receiver
    assert server_module.Sender is Sender
    assert shm_module._copy_spans is copy_spans


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("size", [1, 100, 8 << 10, 96 << 10])
def test_copy_spans_scatters_like_slices(size: int, threads: int) -> None:
    rng = np.random.default_rng(size + threads)
    n = max(2, min(200, (16 << 20) // size))  # past 4 MiB (threads, streaming) for big pieces
    src = rng.integers(0, 256, n * size + 3, dtype=np.uint8)
    slots = rng.permutation(n + 5)[:n]
    dst = np.zeros((n + 5) * size + 7, dtype=np.uint8)
    d = slots.astype(np.int64) * size + 7
    s = np.arange(n, dtype=np.int64) * size + 3
    copy_spans(dst, d, src, s, size, threads)
    want = np.zeros_like(dst)
    for i in range(n):
        want[d[i] : d[i] + size] = src[s[i] : s[i] + size]
    assert np.array_equal(dst, want)


def test_copy_spans_between_a_mapping_and_arrays() -> None:
    fd = os.memfd_create("kvpool-test")
    try:
        os.ftruncate(fd, 1 << 20)
        m = mmap.mmap(fd, 1 << 20)
    finally:
        os.close(fd)
    src = bytes(range(256)) * 16  # 4 KiB
    copy_spans(m, offsets([4096 * 7, 0]), src, offsets([0, 2048]), 2048)
    assert m[4096 * 7 : 4096 * 7 + 2048] == src[:2048] and m[:2048] == src[2048:]
    out = bytearray(4096)
    copy_spans(out, offsets([2048, 0]), m, offsets([4096 * 7, 0]), 2048)
    assert bytes(out) == src
    r = Receiver()
    r.add(m, offsets([0]), 4096)
    with pytest.raises(BufferError):  # a receiver's buffers stay exported until it closes
        m.close()
    r.close()
    m.close()


def test_copy_spans_refuses_pieces_outside_the_buffers_and_copies_nothing() -> None:
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    for d, s in ((49, 0), (0, 49), (-1, 0), (0, -16), (1 << 62, 0)):
        with pytest.raises(ValueError, match="outside the buffer"):
            copy_spans(dst, offsets([0, d]), src, offsets([16, s]), 16)
    assert not dst.any()
    with pytest.raises(ValueError, match="destination offsets"):
        copy_spans(dst, offsets([0]), src, offsets([0, 16]), 16)
    with pytest.raises(BufferError, match="read-only"):
        copy_spans(b"\0" * 64, offsets([0]), src, offsets([0]), 16)
    with pytest.raises(BufferError, match="int64"):
        copy_spans(dst, np.zeros(1, dtype=np.int32), src, offsets([0]), 16)
    with pytest.raises(BufferError, match="contiguous"):
        copy_spans(dst[::2], offsets([0]), src, offsets([0]), 16)
    copy_spans(dst, offsets([48]), src, offsets([0]), 16)  # the last 16 bytes: inside
    assert np.array_equal(dst[48:], src[:16])


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    b.setblocking(False)
    return a, b


def test_receiver_fills_pieces_in_order_and_drops_drains() -> None:
    tx, rx = pair()
    data = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    buf = np.zeros(4 << 20, dtype=np.uint8)
    size = 64 << 10
    # 16 pieces to scattered slots, a drain longer than the scratch buffer, 16 more pieces
    slots = np.random.default_rng(2).permutation(64)[:32].astype(np.int64) * size
    r = Receiver()
    r.add(buf, slots[:16], size)
    r.drain((3 << 20) - 32 * size)
    r.add(memoryview(buf), slots[16:], size)
    assert r.total == 3 << 20 and r.received == 0 and not r.done
    assert r.take(data[:1000]) == 1000  # read ahead with a header
    sender = threading.Thread(target=tx.sendall, args=(data[1000:],))
    sender.start()
    while not r.done:
        r.recv(rx.fileno(), 0.1)
    sender.join()
    assert r.received == 3 << 20
    drained = (3 << 20) - 32 * size
    for i, at in enumerate(slots):
        wire = i * size if i < 16 else drained + i * size
        assert buf[at : at + size].tobytes() == data[wire : wire + size]
    r.close()
    tx.close()
    rx.close()


def test_receiver_returns_when_the_socket_would_block_and_on_a_closed_peer() -> None:
    tx, rx = pair()
    buf = bytearray(64)
    r = Receiver()
    r.add(buf, offsets([0]), 64)
    assert r.recv(rx.fileno()) == 0  # nothing there: at once
    start = time.monotonic()
    assert r.recv(rx.fileno(), 0.05) == 0  # waits at most that long
    assert time.monotonic() - start < 2
    tx.sendall(b"\x01" * 10)
    assert r.recv(rx.fileno(), 1.0) == 10 and not r.done
    assert r.take(b"\x02" * 100) == 54 and r.done  # only what the pieces hold
    assert bytes(buf) == b"\x01" * 10 + b"\x02" * 54
    r = Receiver()
    r.add(buf, offsets([0]), 64)
    tx.sendall(b"\x03" * 3)
    tx.close()
    with pytest.raises(ConnectionError, match="peer closed"):
        r.recv(rx.fileno(), 1.0)
    assert r.received == 3
    with pytest.raises(OSError):
        r.recv(-1)
    rx.close()


def test_receiver_refuses_pieces_outside_its_buffer() -> None:
    r = Receiver()
    with pytest.raises(ValueError, match="outside the buffer"):
        r.add(bytearray(100), offsets([0, 90]), 16)
    with pytest.raises(BufferError, match="read-only"):
        r.add(b"\0" * 100, offsets([0]), 16)
    assert r.total == 0 and r.done


def test_sender_sends_a_head_then_pieces_in_order() -> None:
    tx, rx = pair()
    tx.setblocking(False)
    rx.setblocking(True)
    arena = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
    size = 48 << 10
    slots = np.random.default_rng(4).permutation(80)[:40].astype(np.int64) * size
    head = b"head-of-the-reply"
    s = Sender()
    s.add(head)
    s.add(arena, slots, size)
    s.add(memoryview(b"tail"))
    assert s.total == len(head) + 40 * size + 4 and s.sent == 0 and not s.done
    # Nobody reads yet: a send that may not wait returns where the socket buffer is full.
    first = s.send(tx.fileno())
    assert 0 < first < s.total and s.sent == first and not s.done
    got = bytearray()
    total = s.total  # not read while a send runs: the sender is borrowed then

    def read() -> None:
        while len(got) < total:
            got.extend(rx.recv(1 << 20))

    reader = threading.Thread(target=read)
    reader.start()
    while not s.done:
        s.send(tx.fileno(), 0.1)
    reader.join()
    want = head + b"".join(arena[at : at + size].tobytes() for at in slots) + b"tail"
    assert bytes(got) == want and s.sent == s.total
    s.close()
    assert s.total == 0 and s.done
    tx.close()
    rx.close()


def test_sender_refuses_pieces_outside_its_buffer_and_meets_a_gone_peer() -> None:
    s = Sender()
    with pytest.raises(ValueError, match="outside the buffer"):
        s.add(b"\0" * 100, offsets([0, 90]), 16)
    with pytest.raises(BufferError, match="int64"):
        s.add(b"\0" * 100, np.zeros(1, dtype=np.int32), 16)
    assert s.total == 0 and s.done
    tx, rx = pair()
    rx.close()
    s.add(b"\1" * 64)
    with pytest.raises(BrokenPipeError):
        s.send(tx.fileno(), 1.0)
    tx.close()
