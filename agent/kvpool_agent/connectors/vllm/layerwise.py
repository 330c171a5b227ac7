"""A step's loads and saves, layer by layer (no vLLM import: tested without it).

Loads (``LayerLoad``): a thread reads every request's leased blocks in a few layer ranges
(``layer_chunks``), in layer order (``streams`` ranges at once over the transfer port, each
on a connection of its own), into buffers of its own (host memory; the pages' GPU
when a same-node client maps a CUDA agent's arena there); the engine takes a layer
(``take``) when its attention is about to read it, copying that layer's landed blocks into
vLLM's pages itself. vLLM's pages are only ever written by the engine's thread, inside the
hook, so a read that is late, cut or abandoned can never land in them afterwards. A request
whose range for a layer had not landed when that layer was taken, or a layer never taken
before the step ended, fails the request's whole load (``finish``): vLLM recomputes it.

Saves (``LayerSave``): each layer's blocks to save are copied out of vLLM's pages as soon as
the forward pass has written them (one indexed copy per layer, into one host buffer for the
step); ``finish`` copies any layer the hooks did not see and splits the buffer per request.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvpool_agent.connectors.saves import StepBuffers
from kvpool_agent.connectors.stats import ConnectorStats
from kvpool_agent.dataplane.client import (
    KVClient,
    Lease,
    TransferConnectionError,
    TransferError,
)
from kvpool_agent.dataplane.shm import ShmClient

log = logging.getLogger("kvpool.connector.vllm")

TRANSFER_ERRORS = (TransferError, TransferConnectionError, OSError, ValueError)
"""What a read may fail with (ValueError: the agent's geometry does not fit the buffer)."""


def layer_chunks(layers: int, chunks: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` layer ranges, in order, splitting ``layers`` into ``min(chunks, layers)``
    nearly equal parts (at least one)."""
    n = max(1, min(chunks, layers))
    bounds = [i * layers // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


@dataclass
class LoadItem:
    """One request's load: pool blocks ``first ..`` into vLLM blocks ``block_ids``."""

    req_id: str
    block_ids: list[int]
    first: int
    lease: Lease | None
    count: int
    """Leading blocks of ``block_ids`` the lease covers (the rest fails at once)."""
    index: torch.Tensor | None = None
    """``block_ids[:count]`` as an index tensor on the pages' device."""
    kv: torch.Tensor | None = None
    """``[layers, count, 2, bs, heads, dim]``, filled range by range by the thread."""
    got: set[int] = field(default_factory=set)
    """Layer ranges fully received (written by the reading threads only, only ever grows)."""
    missed: bool = False
    """The engine took a layer whose range had not landed (decided by the engine only)."""


@dataclass
class LoadOutcome:
    loaded_blocks: int = 0
    failed_block_ids: list[int] = field(default_factory=list)
    failed_requests: set[str] = field(default_factory=set)
    untaken_layers: int = 0
    """Layers the engine never took although blocks were to land in them."""


class LayerLoad:
    """One step's loads (see the module docstring). ``start`` runs the reads on a thread;
    ``run`` runs them in the caller's thread (then every range has landed or failed)."""

    def __init__(
        self,
        items: list[LoadItem],
        layers: int,
        chunks: int,
        *,
        client: Callable[[], KVClient | None],
        usable: Callable[[], bool],
        timeout_s: float,
        stats: ConnectorStats,
        on_chunk: Callable[[int], object] | None = None,
        pin_memory: bool = False,
        pages_device: torch.device | None = None,
        streams: int = 1,
    ) -> None:
        self.items = items
        self.streams = max(1, streams)
        """Layer ranges read at once, each on a connection of its own (a same-node client
        has one connection: one range at a time)."""
        self.pin_memory = pin_memory
        """Read into page-locked buffers (pages on a GPU: uploads then run at DMA speed and
        do not wait for the host)."""
        self.pages_device = pages_device
        """The pages' GPU: a same-node client whose arena is there (a CUDA agent's) reads
        into buffers on it, so each block crosses no PCIe link."""
        self.layers = layers
        self.chunks = layer_chunks(layers, chunks)
        self.chunk_of = [c for c, (lo, hi) in enumerate(self.chunks) for _ in range(lo, hi)]
        self.landed = [threading.Event() for _ in self.chunks]
        self.deadline = time.monotonic() + timeout_s
        self.taken: set[int] = set()
        self.abandoned = False
        """The engine stopped waiting (deadline passed, or the step ended): no new reads."""
        self._client = client
        self._usable = usable
        self._stats = stats
        self._on_chunk = on_chunk
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> bool:
        """Some blocks are to land (else there is nothing to wait for)."""
        return any(item.count > 0 for item in self.items)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="kvpool-load", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Every range of every item, ranges in layer order (``streams`` of them at once),
        then the leases released. Never raises: whatever fails leaves its items without
        the range."""
        client: KVClient | None = None
        started = time.perf_counter()
        try:
            client = self._client()
            if client is None or not self._usable():
                return
            device = self._buffer_device(client)
            for item in self.items:
                if item.count > 0 and item.lease is not None:
                    geometry = client.geometry(item.lease.replica)
                    item.kv = geometry.empty_kv(
                        item.count, pin_memory=self.pin_memory, device=device
                    )[0]
            failed: set[int] = set()
            streams = 1 if isinstance(client, ShmClient) else min(self.streams, len(self.chunks))
            if streams == 1:
                for c in range(len(self.chunks)):
                    self._read_range(client, c, failed)
            else:
                with ThreadPoolExecutor(streams, thread_name_prefix="kvpool-load") as pool:
                    # Submitted in layer order: the first ranges are read first.
                    ranges = range(len(self.chunks))
                    reads = [pool.submit(self._read_range, client, c, failed) for c in ranges]
                    for read in reads:
                        read.result()
        except Exception:  # anything else: the items that did not land fail, the engine goes on
            log.exception("kvpool: load failed; vLLM recomputes it")
        finally:
            for event in self.landed:
                event.set()
            self._stats.add(load_transfer_s=time.perf_counter() - started)
            if client is not None:
                for item in self.items:
                    if item.lease is not None:
                        # A release that fails is harmless: the lease expires on its own.
                        with contextlib.suppress(*TRANSFER_ERRORS):
                            client.release(item.lease)

    def _read_range(self, client: KVClient, c: int, failed: set[int]) -> None:
        """Range ``c`` of every item not failed yet, one GET each; then announce it."""
        lo, hi = self.chunks[c]
        for i, item in enumerate(self.items):
            if item.kv is None or item.lease is None or i in failed or self.abandoned:
                continue
            try:
                client.get_into(
                    item.lease,
                    [item.kv[lo:hi]],
                    start=item.first,
                    count=item.count,
                    layers=(lo, hi),
                )
            except TRANSFER_ERRORS as err:
                failed.add(i)
                self._stats.add(load_chunk_errors=1)
                log.warning(
                    "kvpool: load of %s, layers %d..%d, failed (%s); vLLM recomputes it",
                    item.req_id,
                    lo,
                    hi - 1,
                    err,
                )
                continue
            item.got.add(c)
            self._stats.add(load_chunks=1)
        self.landed[c].set()
        if self._on_chunk is not None:
            self._on_chunk(c)

    def _buffer_device(self, client: KVClient) -> torch.device | None:
        """Where reads land: the pages' GPU when ``client`` maps the agent's arena on it,
        else host memory (None)."""
        if isinstance(client, ShmClient) and self.pages_device is not None:
            mapped = client.device
            if mapped is not None and mapped.type == "cuda" and mapped == self.pages_device:
                return mapped
        return None

    def take(self, layer: int) -> list[LoadItem]:
        """Wait (until the deadline) for ``layer``'s range; the items whose blocks of it
        landed. The others fail (``missed``). Engine thread only."""
        c = self.chunk_of[layer]
        event = self.landed[c]
        if not event.is_set():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0 or not event.wait(remaining):
                self.abandoned = True
        self.taken.add(layer)
        ready = []
        for item in self.items:
            if item.count <= 0 or item.missed:
                continue
            # ``got`` only grows, and the range's bytes are in ``kv`` before it does.
            if c in item.got and item.kv is not None:
                ready.append(item)
            else:
                item.missed = True
        return ready

    def finish(self) -> LoadOutcome:
        """What loaded and what failed, once the step's forward pass is over (no layer is
        taken after this; a read still under way is abandoned). Engine thread only."""
        self.abandoned = True
        untaken = self.layers - len(self.taken)
        out = LoadOutcome()
        for item in self.items:
            ok = item.count > 0 and not item.missed and untaken == 0
            loaded = item.count if ok else 0
            out.loaded_blocks += loaded
            if loaded < len(item.block_ids):
                out.failed_block_ids.extend(item.block_ids[loaded:])
                out.failed_requests.add(item.req_id)
        if self.pending:
            out.untaken_layers = untaken
        return out


def scatter_layer(view: torch.Tensor, index: torch.Tensor, kv: torch.Tensor) -> None:
    """Write one layer of landed blocks (``kv``: ``[n, 2, bs, heads, dim]`` in host memory)
    into the pages ``view`` at ``index``. On a GPU the upload is queued on the current
    stream, so the layer's attention, queued after it, reads the loaded blocks; a pinned
    ``kv`` stays alive until the copy has run (torch's pinned allocator records its use)."""
    if kv.device == view.device and kv.is_cuda:
        # Read on the load thread's stream into a buffer the engine's stream now uses: the
        # allocator must not hand it out again before this copy ran.
        kv.record_stream(torch.cuda.current_stream(view.device))
    view.index_copy_(0, index, kv.to(view.device, non_blocking=True))


@dataclass
class SavePart:
    req_id: str
    keys: list[bytes]
    first: int
    start: int
    """Offset of this request's blocks in the step's buffer."""
    count: int


class LayerSave:
    """One step's saves: ``blocks`` (every request's, concatenated) copied layer by layer
    into one buffer ``[layers, blocks, 2, bs, heads, dim]``: in host memory, or with
    ``on_device`` in the pages' own GPU (for a same-node CUDA agent, whose arena is there:
    the blocks then never cross PCIe, at the cost of GPU memory while the save is queued)."""

    def __init__(
        self,
        parts: list[SavePart],
        block_ids: Sequence[int],
        like: torch.Tensor,
        *,
        on_device: bool = False,
        buffers: StepBuffers | None = None,
    ) -> None:
        self.parts = parts
        self.index = torch.tensor(list(block_ids), dtype=torch.long, device=like.device)
        self.device = like.device
        self.on_device = on_device and like.device.type == "cuda"
        self.out: torch.Tensor | None = None
        self._shape = (len(block_ids), *like.shape[1:])
        self._dtype = like.dtype
        self._buffers = buffers if like.device.type == "cpu" else None
        """Where a CPU step's buffer comes from (pinned and device memory torch caches)."""
        self._flat: torch.Tensor | None = None
        self.copied: set[int] = set()

    def copy(self, views: Sequence[torch.Tensor], layer: int) -> bool:
        """Copy ``layer``'s blocks out of the pages (once); False when it was copied already.
        On a GPU the copy is queued on the current stream into pinned memory (ordered
        before anything later on that stream writes the pages); ``finish`` waits for it."""
        if layer in self.copied:
            return False
        if self.out is None:
            shape = (len(views), *self._shape)
            if self._buffers is not None:
                nbytes = math.prod(shape) * self._dtype.itemsize
                self._flat = self._buffers.take(nbytes)
                self.out = self._flat[:nbytes].view(self._dtype).view(shape)
            else:
                self.out = torch.empty(
                    shape,
                    dtype=self._dtype,
                    device=self.device if self.on_device else None,
                    pin_memory=self.device.type == "cuda" and not self.on_device,
                )
        view = views[layer]
        if self.device.type == "cpu" or self.on_device:
            torch.index_select(view, 0, self.index, out=self.out[layer])
        else:
            self.out[layer].copy_(view.index_select(0, self.index), non_blocking=True)
        self.copied.add(layer)
        return True

    def finish(self, views: Sequence[torch.Tensor]) -> list[tuple[SavePart, torch.Tensor]]:
        """Copy the layers not copied yet (their hooks did not run), wait for the copies;
        each part's ``[layers, count, ...]`` KV (no longer reading vLLM's pages)."""
        for layer in range(len(views)):
            self.copy(views, layer)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        assert self.out is not None
        out = self.out
        if len(self.parts) == 1:
            return [(self.parts[0], out)]
        return [(part, out[:, part.start : part.start + part.count]) for part in self.parts]

    def lend(self, users: int) -> Callable[[], None] | None:
        """After ``finish``: the callback each of the ``users`` saves cut from the step's
        buffer calls once it is sent (the last gives the buffer back); None when the buffer
        is not one of ``buffers``'."""
        if self._buffers is None or self._flat is None:
            return None
        return self._buffers.lend(self._flat, users)
