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
``flush`` or ``close``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
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
    and the next save goes on."""

    def __init__(
        self, send: Callable[[Save], None], *, max_pending: int, coalesce_s: float
    ) -> None:
        self._send = send
        self.coalesce_s = coalesce_s
        self._batch_most = max(1, max_pending // 2)
        self._queue: queue.Queue[Save | _Marker] = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def put(self, save: Save) -> bool:
        """Queue ``save``; False (nothing queued) when ``max_pending`` saves wait already."""
        try:
            self._queue.put_nowait(save)
        except queue.Full:
            return False
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpool-save", daemon=True)
                self._thread.start()
        return True

    def flush(self, timeout_s: float) -> bool:
        """Send what waits now and wait until every queued save was sent (or failed); False
        on timeout."""
        deadline = time.monotonic() + timeout_s
        if self._thread is not None:
            # A full queue ends the wait by itself (half of it fills a batch).
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(_FLUSH)
        done = self._queue.all_tasks_done  # notified by the sender's task_done
        with done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                done.wait(left)
        return True

    def close(self, timeout_s: float) -> None:
        """Send what is queued (waiting at most ``timeout_s``), then end the sender."""
        thread = self._thread
        if thread is None:
            return
        self.flush(timeout_s)
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=1.0)
        thread.join(timeout=5)
        self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, _Marker):
                self._queue.task_done()
                if item is _STOP:
                    return
                continue
            batch = [item]
            del item
            stop = self._gather(batch)
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
                    self._queue.task_done()
            if stop:
                self._queue.task_done()
                return

    def _gather(self, batch: list[Save]) -> bool:
        """Take more saves into ``batch`` until the wait ends; True if ``close`` was asked."""
        deadline = time.monotonic() + self.coalesce_s
        nbytes = batch[0].nbytes
        while not (
            batch[-1].kv.is_cuda or nbytes >= COALESCE_BYTES or len(batch) >= self._batch_most
        ):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                item = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if item is _STOP:
                return True
            if isinstance(item, _Marker):
                self._queue.task_done()
                break
            batch.append(item)
            nbytes += item.nbytes
        return False
