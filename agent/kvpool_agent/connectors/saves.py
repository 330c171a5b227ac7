"""A worker's saves on their way to the pool: the queue between the engine's thread, which
copies new blocks out of vLLM's pages, and the sender thread that stores them.

The sender does not send each save the moment it is queued. It waits up to ``coalesce_s``
after the first for more, then sends them back to back. An agent (and the sender itself)
that sat idle while the engine computed pays for the wake-up, its code and data gone cold,
on every request it handles. In a stream of 1k-token requests on the 2-core development
machine, a same-node save cost the agent about 1.1 ms of CPU sent at once and 0.8 ms with a
50 ms wait (``bench/vllm_stream.py``). A save reaches the pool at most that much later.

The wait ends early for a save in GPU memory (those buffers are memory vLLM did not budget
for), once the batch holds ``COALESCE_BYTES`` or half of the queue's bound, and on
``flush`` or ``close``. Only the first save of a batch, and what ends a wait, wakes the
sender: the saves queued meanwhile join the batch without a wake (the woken sender took a
core from vLLM's compute threads each time: 5.6 to 6.2 wakes of the sender per 1k-token
request before, 3.9 to 4.2 after, its replies' waits included).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpool_agent.dataplane.keys import KeyNamespace

log = logging.getLogger("kvpool.connector")

COALESCE_BYTES = 16 << 20
"""A batch this large is sent without waiting for more: per-request costs are small against
its copies already."""


@dataclass(frozen=True, slots=True)
class Save:
    """Blocks ``first..`` of the chain ``keys``, every layer, copied out of vLLM's pages;
    ``done`` (if set) is called once the save was sent or failed: its buffer is free."""

    ns: KeyNamespace
    keys: list[bytes]
    first: int
    kv: torch.Tensor
    done: Callable[[], None] | None = None

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class StepBuffers:
    """Host buffers for the steps' saves, handed out again once every save cut from one was
    sent. A buffer allocated and freed at every step churns the engine process's heap: its
    allocator gives pages back to the kernel and takes fresh ones, and vLLM's own tensors then
    fault them in and zero them. On the development machine a vLLM engine on CPU took 76 more
    page faults per 1k-token request with saves on than off, and 1 with the buffers reused
    (``bench/vllm_stream.py`` counts them; ``perf`` put them in vLLM's model code)."""

    def __init__(self, *, keep: int = 4, largest: int = 64 << 20) -> None:
        self.keep = keep
        self.largest = largest
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of at least ``nbytes`` (contents undefined)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        size = max(1 << 16, 1 << (max(nbytes, 1) - 1).bit_length())  # step sizes vary
        return torch.empty(size, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        """Take ``buffer`` back (nothing may use it any more); kept if there is room."""
        if buffer.numel() > self.largest:
            return
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buffer)

    def lend(self, buffer: torch.Tensor, users: int) -> Callable[[], None]:
        """A callback for each of ``users`` saves cut from ``buffer``: the last call gives the
        buffer back."""
        left = users
        lock = threading.Lock()

        def done() -> None:
            nonlocal left
            with lock:
                left -= 1
                last = left == 0
            if last:
                self.give(buffer)

        return done


class _Marker:
    """A queue item that is not a save."""


_FLUSH = _Marker()
"""Ends the sender's wait for more saves."""
_STOP = _Marker()
"""Ends the sender thread, after what it holds is sent."""


class SaveQueue:
    """Saves queued for one sender thread (started on the first ``put``), which calls
    ``send`` for each, in order. ``send`` counts its own failures; what it raises is logged
    and the next save goes on.

    A ``put`` wakes the sender only when it must: to start a batch, or to end a batch's wait
    early. The saves that come during the wait join the batch without waking it."""

    def __init__(
        self, send: Callable[[Save], None], *, max_pending: int, coalesce_s: float
    ) -> None:
        self._send = send
        self.coalesce_s = coalesce_s
        self._max_pending = max_pending
        self._batch_most = max(1, max_pending // 2)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        """The sender waits on it: for a first save, then for its batch's wait to end."""
        self._finished = threading.Condition(self._lock)
        """``flush`` waits on it for the queued saves to be sent."""
        self._items: deque[Save | _Marker] = deque()
        self._bytes = 0
        """Bytes of the saves in ``_items``."""
        self._urgent = 0
        """Saves in GPU memory and markers in ``_items``: while there is one, no wait."""
        self._unsent = 0
        """Saves queued or being sent."""
        self._idle = True
        """The sender waits for a first save: a ``put`` must wake it."""
        self._thread: threading.Thread | None = None

    def put(self, save: Save) -> bool:
        """Queue ``save``; False (nothing queued) when ``max_pending`` saves wait already."""
        with self._lock:
            if len(self._items) >= self._max_pending:
                return False
            self._items.append(save)
            self._bytes += save.nbytes
            self._unsent += 1
            self._urgent += save.kv.is_cuda
            if self._idle or self._full():
                self._wake.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpool-save", daemon=True)
                self._thread.start()
        return True

    def flush(self, timeout_s: float) -> bool:
        """Send what waits now and wait until every queued save was sent (or failed); False
        on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._unsent:
                self._mark(_FLUSH)
            while self._unsent:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._finished.wait(left)
        return True

    def close(self, timeout_s: float) -> None:
        """Send what is queued (waiting at most ``timeout_s``), then end the sender."""
        thread = self._thread
        if thread is None:
            return
        self.flush(timeout_s)
        with self._lock:
            self._mark(_STOP)
        thread.join(timeout=5)
        self._thread = None

    def _mark(self, marker: _Marker) -> None:
        """Under the lock: queue ``marker``, which ends the sender's wait."""
        self._items.append(marker)
        self._urgent += 1
        self._wake.notify()

    def _full(self) -> bool:
        """Under the lock: whether what is queued ends the wait for more."""
        return (
            bool(self._urgent)
            or self._bytes >= COALESCE_BYTES
            or len(self._items) >= self._batch_most
        )

    def _run(self) -> None:
        while True:
            batch, stop = self._gather()
            batch.reverse()
            while batch:
                save = batch.pop()
                try:
                    self._send(save)
                except Exception:  # a bug in ``send``: the saves after it still go
                    log.exception("kvpool: a save of %d blocks failed", len(save.keys) - save.first)
                finally:
                    if save.done is not None:
                        save.done()
                    del save  # its buffer goes once sent, not after the next wait
                    with self._lock:
                        self._unsent -= 1
                        if not self._unsent:
                            self._finished.notify_all()
            if stop:
                return

    def _gather(self) -> tuple[list[Save], bool]:
        """Wait for a save, then up to ``coalesce_s`` for more unless what is queued ends the
        wait; the batch is the saves before the first marker, at most half the queue's
        bound. True with it when ``close`` asked the sender to end."""
        with self._lock:
            self._idle = True
            while not self._items:
                self._wake.wait()
            self._idle = False
            deadline = time.monotonic() + self.coalesce_s
            while not self._full():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(left)
            batch: list[Save] = []
            stop = False
            while self._items and len(batch) < self._batch_most:
                item = self._items.popleft()
                if isinstance(item, _Marker):
                    self._urgent -= 1
                    stop = item is _STOP
                    break
                batch.append(item)
                self._bytes -= item.nbytes
                self._urgent -= item.kv.is_cuda
            return batch, stop
