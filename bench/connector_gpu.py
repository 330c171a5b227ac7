"""The vLLM connector's worker-side copies on a GPU: saves and loads of KV blocks between
vLLM-shaped CUDA pages and a real ``kvpool agent`` (CPU pools, the node's host tier).

No vLLM: the copies are the connector's own (``connectors/vllm/layerwise.py``), over pages
in FlashAttention's layout (one ``[pages, kv_heads, block_size, 2 * head_dim]`` bf16 tensor
per layer, Llama-8B-like: 32 layers x 8 kv heads x 128 dim x 16 tokens = 2 MiB a block).
Per request of ``--blocks`` blocks, the median of ``--reps``:

- save copy: ``LayerSave`` copies every layer's blocks out (device -> pinned host, queued on
  the current stream) and waits; against one contiguous device -> pinned copy of the bytes;
- save PUT: the saved buffer to the agent over the transfer port (new chain each time);
- load: lease, ``LayerLoad`` reads 4 layer ranges on its thread into host buffers while the
  engine thread uploads each landed layer (``scatter_layer``), then waits; with pinned
  buffers (what the connector uses on a GPU) and pageable ones (what it used before);
  against the GET alone into a pinned buffer, and one contiguous pinned -> device copy; the
  same over 8 layer ranges read 1, 2, 4 and 8 at once (``load_streams``), each on its own
  connection;
- same node, CUDA agent: a second agent with its primary tier on this GPU, mapped through
  CUDA IPC by ``ShmClient`` (what the connector's ``unix_socket`` setting opens): the save
  PUT (pinned host -> device arena), the save copy into a buffer on the GPU and its PUT
  (device to device: what the connector does for a same-node CUDA agent), and the load,
  which reads device to device into buffers on the pages' GPU; against one contiguous
  device -> device copy.

    python bench/connector_gpu.py [--blocks 128] [--reps 5]

Needs CUDA. Writes ``connector_gpu.json`` and ``connector_gpu.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from transfer import GEOMETRIES, NS, TPB, AgentProcess

from kvpool_agent.connectors.stats import ConnectorStats
from kvpool_agent.connectors.vllm.layerwise import (
    LayerLoad,
    LayerSave,
    LoadItem,
    SavePart,
    scatter_layer,
)
from kvpool_agent.connectors.vllm.layout import BlockLayout
from kvpool_agent.dataplane.client import KVClient, TransferClient
from kvpool_agent.dataplane.shm import ShmClient

console = Console()
MODEL = GEOMETRIES["2MiB"]
STREAMS = (1, 2, 4, 8)
"""``load_streams`` of the load rows over 8 layer ranges."""


def median_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: allocator, pinned cache, connections
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=128, help="blocks per request (2 MiB)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/connector_gpu.py needs a CUDA device")
    layers, heads, dim = MODEL["num_layers"], MODEL["num_kv_heads"], MODEL["head_dim"]
    n = args.blocks
    block_bytes = 2 * layers * heads * dim * TPB * 2
    nbytes = n * block_bytes
    pages_n = 2 * n + 8
    layout = BlockLayout.for_backend("FLASH_ATTN", TPB, heads, dim)
    pages = [
        torch.randn(pages_n, heads, TPB, 2 * dim, device="cuda").to(torch.bfloat16)
        for _ in range(layers)
    ]
    views = [layout.blocks_view(t) for t in pages]
    ids = torch.randperm(pages_n)[:n].tolist()
    dst_ids = torch.randperm(pages_n)[:n].tolist()
    dst_index = torch.tensor(dst_ids, device="cuda")
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    rows: dict[str, float] = {}
    counter = iter(range(1 << 30))

    with tempfile.TemporaryDirectory() as tmp, Progress(console=console) as bar:
        task = bar.add_task("connector on GPU", total=14 + len(STREAMS))
        agent = AgentProcess(Path(tmp), MODEL, 4 * nbytes, None)
        client = TransferClient([agent.address])
        gpu_agent = AgentProcess(Path(tmp), MODEL, 4 * nbytes, None, device="cuda")
        shm = ShmClient(gpu_agent.unix_socket)
        try:
            saved: dict[str, Any] = {}

            def save_copy() -> None:
                save = LayerSave([SavePart("r", [], 0, 0, n)], ids, views[0])
                for layer in range(layers):
                    save.copy(views, layer)
                ((_, kv),) = save.finish(views)
                saved["kv"] = kv

            rows["save copy (LayerSave)"] = median_s(save_copy, args.reps)
            bar.advance(task)
            rows["device -> pinned copy"] = median_s(lambda: pinned.copy_(flat), args.reps)
            bar.advance(task)

            def put() -> None:
                keys = [f"s{next(counter)}-{i}".encode() for i in range(n)]
                client.put(NS, keys, [saved["kv"]])

            rows["save PUT"] = median_s(put, args.reps)
            bar.advance(task)
            chain = [f"load-{i}".encode() for i in range(n)]
            client.put(NS, chain, [saved["kv"]])

            def load(
                pin: bool, via: KVClient = client, chunks: int = 4, streams: int = 1
            ) -> Callable[[], None]:
                def run() -> None:
                    lease = via.lease(NS, chain, ttl_s=60)
                    assert lease is not None and lease.count == n
                    item = LoadItem("r", dst_ids, 0, lease, n, dst_index)
                    job = LayerLoad(
                        [item], layers, chunks, client=lambda: via, usable=lambda: True,
                        timeout_s=60, stats=ConnectorStats(), pin_memory=pin,
                        pages_device=views[0].device, streams=streams,
                    )  # fmt: skip
                    job.start()
                    for layer in range(layers):
                        (got,) = job.take(layer)
                        assert got.kv is not None
                        scatter_layer(views[layer], dst_index, got.kv[layer])
                    outcome = job.finish()
                    assert outcome.loaded_blocks == n, outcome

                return run

            rows["load, pinned buffers"] = median_s(load(True), args.reps)
            bar.advance(task)
            rows["load, pageable buffers"] = median_s(load(False), args.reps)
            bar.advance(task)
            for streams in STREAMS:
                rows[f"load, pinned, 8 ranges, {streams} at a time"] = median_s(
                    load(True, chunks=8, streams=streams), args.reps
                )
                bar.advance(task)
            buf = client.empty_kv(n, pin_memory=True)

            def get_only() -> None:
                lease = client.lease(NS, chain, ttl_s=60)
                assert lease is not None
                client.get_into(lease, buf)
                client.release(lease)

            rows["GET alone (pinned)"] = median_s(get_only, args.reps)
            bar.advance(task)
            rows["pinned -> device copy"] = median_s(lambda: flat.copy_(pinned), args.reps)
            bar.advance(task)
            rows["pageable -> device copy"] = median_s(lambda: flat.copy_(pageable), args.reps)
            bar.advance(task)

            assert shm.device is not None and shm.device.type == "cuda"

            def put_same_node() -> None:
                keys = [f"n{next(counter)}-{i}".encode() for i in range(n)]
                shm.put(NS, keys, [saved["kv"]])

            rows["save PUT, same node (CUDA agent)"] = median_s(put_same_node, args.reps)
            bar.advance(task)

            def save_copy_on_device() -> None:
                save = LayerSave([SavePart("r", [], 0, 0, n)], ids, views[0], on_device=True)
                for layer in range(layers):
                    save.copy(views, layer)
                ((_, kv),) = save.finish(views)
                saved["on_device"] = kv

            rows["save copy, same node (buffer on the GPU)"] = median_s(
                save_copy_on_device, args.reps
            )
            bar.advance(task)

            def put_from_device() -> None:
                keys = [f"d{next(counter)}-{i}".encode() for i in range(n)]
                shm.put(NS, keys, [saved["on_device"]])

            rows["save PUT, same node, from the GPU buffer"] = median_s(put_from_device, args.reps)
            bar.advance(task)
            shm.put(NS, chain, [saved["kv"]])
            rows["load, same node (CUDA agent)"] = median_s(load(True, shm), args.reps)
            bar.advance(task)
            on_gpu = shm.empty_kv(n, device=shm.device)

            def get_same_node() -> None:
                lease = shm.lease(NS, chain, ttl_s=60)
                assert lease is not None
                shm.get_into(lease, on_gpu)
                shm.release(lease)

            rows["GET alone, same node (into device)"] = median_s(get_same_node, args.reps)
            bar.advance(task)
            other = torch.empty_like(flat)
            rows["device -> device copy"] = median_s(lambda: other.copy_(flat), args.reps)
            bar.advance(task)
        finally:
            client.close()
            shm.close()
            agent.stop()
            gpu_agent.stop()

    gbps = {name: nbytes / s / 1e9 for name, s in rows.items()}
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "blocks": n,
        "block_bytes": block_bytes,
        "bytes": nbytes,
        "seconds": rows,
        "gbps": gbps,
        "ratios": {
            "save copy / device->pinned": gbps["save copy (LayerSave)"]
            / gbps["device -> pinned copy"],
            "load pinned / GET alone": gbps["load, pinned buffers"] / gbps["GET alone (pinned)"],
            "load pinned / load pageable": gbps["load, pinned buffers"]
            / gbps["load, pageable buffers"],
            "load 8 ranges, 4 at a time / 1": gbps["load, pinned, 8 ranges, 4 at a time"]
            / gbps["load, pinned, 8 ranges, 1 at a time"],
            "same-node load / device->device": gbps["load, same node (CUDA agent)"]
            / gbps["device -> device copy"],
            "same-node load / load pinned (TCP)": gbps["load, same node (CUDA agent)"]
            / gbps["load, pinned buffers"],
            "same-node save PUT / save PUT (TCP)": gbps["save PUT, same node (CUDA agent)"]
            / gbps["save PUT"],
            "same-node save, GPU buffer / pinned buffer (copy + PUT)": (
                rows["save copy (LayerSave)"] + rows["save PUT, same node (CUDA agent)"]
            )
            / (
                rows["save copy, same node (buffer on the GPU)"]
                + rows["save PUT, same node, from the GPU buffer"]
            ),
        },
    }
    table = Table(title=f"connector copies on {result['device']}: {n} blocks of 2 MiB")
    table.add_column("what")
    table.add_column("ms", justify="right")
    table.add_column("GB/s", justify="right")
    for name, s in rows.items():
        table.add_row(name, f"{s * 1e3:.1f}", f"{gbps[name]:.2f}")
    console.print(table)
    for name, value in result["ratios"].items():
        console.print(f"{name}: {value:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "connector_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(gbps, result["device"], args.out / "connector_gpu.png")


def _plot(gbps: dict[str, float], device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(gbps)
    ax.barh(names, [gbps[k] for k in names], color="tab:blue")
    ax.invert_yaxis()
    ax.set_xlabel("GB/s")
    ax.set_title(f"vLLM connector copies, 2 MiB blocks ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
