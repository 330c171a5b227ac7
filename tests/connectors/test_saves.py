"""The worker's save queue (``connectors/saves.py``): saves wait for more to go with them,
and nothing waits past a flush, a full batch or a close."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvpool_agent.connectors import saves as saves_module
from kvpool_agent.connectors.saves import Save, SaveQueue, StepBuffers
from kvpool_agent.dataplane.keys import KeyNamespace

NS = KeyNamespace("m", 0, 0)
LONG = 30.0
"""A wait no test sits out: what it sees happens because something ended the wait."""


def save(n: int, nbytes: int = 64) -> Save:
    return Save(NS, [b"%d" % n], 0, torch.zeros(nbytes, dtype=torch.uint8))


class Recorder:
    """A ``send`` that records what it was given (optionally holding until released)."""

    def __init__(self, *, hold: bool = False, fail: set[int] | None = None) -> None:
        self.sent: list[bytes] = []
        self.arrived = threading.Condition()
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.fail = fail or set()

    def __call__(self, s: Save) -> None:
        self.release.wait(LONG)
        with self.arrived:
            self.sent.append(s.keys[0])
            self.arrived.notify_all()
        if int(s.keys[0]) in self.fail:
            raise RuntimeError("a bug in send")

    def wait_for(self, n: int, timeout: float = 10.0) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.sent) >= n, timeout)


def test_saves_wait_for_more_and_a_flush_sends_them_in_order() -> None:
    sent = Recorder()
    q = SaveQueue(sent, max_pending=64, coalesce_s=LONG)
    for n in range(3):
        assert q.put(save(n))
    time.sleep(0.2)
    assert sent.sent == []  # still waiting for more
    started = time.monotonic()
    assert q.flush(10.0)
    assert time.monotonic() - started < 10.0
    assert sent.sent == [b"0", b"1", b"2"]
    q.close(5.0)


class CountingCondition(threading.Condition):
    """A condition that counts the wakes asked of it."""

    notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def test_saves_queued_during_the_wait_do_not_wake_the_sender() -> None:
    """The first save wakes the sender, which waits for more; the saves that come meanwhile
    join its batch without waking it (each wake took the engine's thread off its core)."""
    sent = Recorder()
    q = SaveQueue(sent, max_pending=64, coalesce_s=LONG)
    wakes = CountingCondition(q._lock)
    q._wake = wakes
    assert q.put(save(0))
    assert _until(lambda: not q._idle)  # the sender woke and waits for more
    for n in range(1, 5):
        assert q.put(save(n))
    assert wakes.notified == 1
    assert q.flush(10.0)  # the flush ends the wait: one more wake
    assert wakes.notified == 2
    assert sent.sent == [b"%d" % n for n in range(5)]
    q.close(5.0)


def test_without_a_wait_each_save_goes_at_once() -> None:
    sent = Recorder()
    q = SaveQueue(sent, max_pending=64, coalesce_s=0.0)
    assert q.put(save(0))
    assert sent.wait_for(1)
    q.close(5.0)


def test_half_the_bound_or_enough_bytes_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = Recorder()
    q = SaveQueue(sent, max_pending=4, coalesce_s=LONG)
    assert q.put(save(0)) and q.put(save(1))  # 2 = half of 4
    assert sent.wait_for(2)
    q.close(5.0)

    monkeypatch.setattr(saves_module, "COALESCE_BYTES", 1024)
    sent = Recorder()
    q = SaveQueue(sent, max_pending=64, coalesce_s=LONG)
    assert q.put(save(0, nbytes=1024))
    assert sent.wait_for(1)
    q.close(5.0)


def test_a_full_queue_refuses_and_keeps_what_it_holds() -> None:
    sent = Recorder(hold=True)
    q = SaveQueue(sent, max_pending=2, coalesce_s=0.0)
    assert q.put(save(0))
    assert _until(lambda: not q._items)  # the sender took it and holds in send
    assert q.put(save(1)) and q.put(save(2))
    assert not q.put(save(3))  # dropped: the caller counts it
    sent.release.set()
    assert q.flush(10.0)
    assert sent.sent == [b"0", b"1", b"2"]
    q.close(5.0)


def test_a_send_that_raises_does_not_stop_the_others() -> None:
    sent = Recorder(fail={1})
    q = SaveQueue(sent, max_pending=64, coalesce_s=LONG)
    for n in range(3):
        assert q.put(save(n))
    assert q.flush(10.0)
    assert sent.sent == [b"0", b"1", b"2"]
    assert q.put(save(3)) and q.flush(10.0)
    assert sent.sent[-1] == b"3"
    q.close(5.0)


def test_close_sends_what_is_queued_and_ends_the_thread() -> None:
    sent = Recorder()
    q = SaveQueue(sent, max_pending=64, coalesce_s=LONG)
    assert q.flush(1.0)  # nothing queued, no thread yet: at once
    assert q.put(save(0)) and q.put(save(1))
    thread = q._thread
    assert thread is not None and thread.is_alive()
    q.close(10.0)
    assert sent.sent == [b"0", b"1"]
    assert not thread.is_alive()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_save_in_gpu_memory_ends_the_wait() -> None:
    """A save in GPU memory (memory vLLM did not budget for) is sent without waiting for
    more, and takes the saves queued before it along."""
    sent = Recorder()
    q = SaveQueue(sent, max_pending=64, coalesce_s=LONG)
    assert q.put(save(0))
    assert _until(lambda: not q._idle)  # waiting for more
    on_gpu = Save(NS, [b"1"], 0, torch.zeros(64, dtype=torch.uint8, device="cuda"))
    assert q.put(on_gpu)
    assert sent.wait_for(2)
    assert sent.sent == [b"0", b"1"]
    q.close(5.0)


def _until(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return False


def test_step_buffers_come_back_best_fit_and_within_bounds() -> None:
    buffers = StepBuffers(keep=2, largest=1 << 20)
    small, large = buffers.take(100_000), buffers.take(600_000)
    assert small.numel() >= 100_000 and large.numel() >= 600_000
    buffers.give(large)
    buffers.give(small)
    assert buffers.take(50_000) is small  # the smallest that fits
    assert buffers.take(200_000) is large
    fresh = buffers.take(50_000)
    assert fresh is not small and fresh is not large
    huge = buffers.take(2 << 20)
    buffers.give(huge)  # larger than `largest`: not kept
    buffers.give(small)
    buffers.give(large)
    buffers.give(fresh)  # `keep` (2) reached: not kept
    got = [buffers.take(10) for _ in range(3)]
    assert any(b is small for b in got) and any(b is large for b in got)
    assert not any(b is huge or b is fresh for b in got)


def test_a_lent_buffer_comes_back_after_its_last_save_and_the_queue_calls_done() -> None:
    buffers = StepBuffers()
    buf = buffers.take(1 << 16)
    done = buffers.lend(buf, 2)
    sent = Recorder()
    q = SaveQueue(sent, max_pending=64, coalesce_s=LONG)
    assert q.put(Save(NS, [b"0"], 0, buf[:64], done))
    assert q.put(Save(NS, [b"1"], 0, buf[64:128], done))
    assert buffers.take(10) is not buf  # both saves still queued
    assert q.flush(10.0)
    assert buffers.take(10) is buf
    q.close(5.0)
