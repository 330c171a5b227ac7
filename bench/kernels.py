"""Benchmark the kvpool kernels: decode attention bandwidth and batched block copies.

Decode attention can go no faster than reading its KV once, so its achieved bandwidth
(KV bytes read / time) is reported as a fraction of the device's measured copy rate
(bytes read + written by a large device-to-device copy, in the same run). Block copies
(offload device -> pinned host, onboard host -> device) are timed as one batched
``copy_blocks`` call, against a per-block copy loop and against the pinned copy rate of one
contiguous transfer of the same size.

    python bench/kernels.py                 # full grid, on a CUDA machine with flashinfer
    python bench/kernels.py --smoke         # tiny grid; runs the torch reference on CPU

Writes ``results.json`` and ``kernels.png`` under ``--out`` and prints the tables.
Goals: decode >= 85% of the copy rate at batch >= 64 and context >= 4k; batched copies
>= 80% of the pinned rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_kernels import PagedAttention, copy_blocks, new_pool

console = Console()


@dataclass
class DecodeResult:
    dtype: str
    batch: int
    context: int
    backend: str
    ms: float
    kv_gb: float
    gbps: float
    fraction_of_copy: float


@dataclass
class CopyResult:
    direction: str
    blocks: int
    mb: float
    batched_gbps: float
    staged_gbps: float
    loop_gbps: float
    pinned_gbps: float
    fraction_of_pinned: float
    speedup_vs_loop: float


def timed(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median seconds per call (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def device_copy_gbps(device: torch.device, nbytes: int, iters: int) -> float:
    """Bytes read + written per second by one large on-device copy: the bandwidth ceiling."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    secs = timed(lambda: dst.copy_(src), device, iters)
    return 2 * nbytes / secs / 1e9


def pinned_copy_gbps(device: torch.device, nbytes: int, to_device: bool, iters: int) -> float:
    """One contiguous pinned host <-> device transfer of ``nbytes``."""
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if to_device:
        secs = timed(lambda: dev.copy_(host, non_blocking=pin), device, iters)
    else:
        secs = timed(lambda: host.copy_(dev, non_blocking=pin), device, iters)
    return nbytes / secs / 1e9


def random_cache(
    pages: int, page: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    cache = torch.empty((pages, 2, page, heads, dim), dtype=dtype, device=device)
    if dtype.itemsize == 1:
        # Finite positive fp8 values: bytes 0..0x7d avoid e4m3's NaN (0x7f).
        cache.view(torch.uint8).random_(0, 0x7E)
    else:
        cache.normal_()
    return cache


def bench_decode(
    batch: int,
    context: int,
    kv_dtype: torch.dtype,
    args: argparse.Namespace,
    device: torch.device,
    copy_gbps: float,
) -> DecodeResult | None:
    page, heads, qo_heads, dim = args.page_size, args.kv_heads, args.qo_heads, args.head_dim
    pages_per_seq = -(-context // page)
    pages = batch * pages_per_seq
    kv_bytes = batch * context * 2 * heads * dim * kv_dtype.itemsize
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if pages * 2 * page * heads * dim * kv_dtype.itemsize > 0.8 * free:
            console.print(f"[yellow]skip decode b={batch} ctx={context}: needs more memory")
            return None
    q_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = random_cache(pages, page, heads, dim, kv_dtype, device)
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    indices = torch.randperm(pages, generator=gen).to(torch.int32)  # scattered pages
    indptr = torch.arange(0, pages + 1, pages_per_seq, dtype=torch.int32)
    last = torch.full((batch,), context - (pages_per_seq - 1) * page, dtype=torch.int32)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, qo_heads, dim, dtype=q_dtype, device=device)
    attn = PagedAttention(backend=args.backend)
    attn.plan(
        qo_indptr, indptr, indices.to(device), last, qo_heads, heads, dim, page,
        q_dtype=q_dtype, kv_dtype=kv_dtype, device=device,
    )  # fmt: skip
    secs = timed(lambda: attn.run(q, cache, k_scale=0.5, v_scale=0.5), device, args.iters)
    gbps = kv_bytes / secs / 1e9
    return DecodeResult(
        dtype=str(kv_dtype).removeprefix("torch."),
        batch=batch,
        context=context,
        backend=attn.backend_in_use,
        ms=secs * 1e3,
        kv_gb=kv_bytes / 1e9,
        gbps=gbps,
        fraction_of_copy=gbps / copy_gbps,
    )


def bench_copies(
    blocks: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> list[CopyResult]:
    """Offload and onboard ``blocks`` scattered blocks of a layer-major pool."""
    layers, page, heads, dim = args.copy_layers, args.page_size, args.kv_heads, args.head_dim
    pool_blocks = blocks * 2
    dev = new_pool(layers, pool_blocks, page, heads, dim, dtype=dtype, device=device)
    dev.normal_()
    host = new_pool(
        layers, pool_blocks, page, heads, dim, dtype=dtype, pin_memory=device.type == "cuda"
    )
    gen = torch.Generator().manual_seed(blocks)
    dev_ids = torch.randperm(pool_blocks, generator=gen)[:blocks].tolist()
    host_ids = torch.randperm(pool_blocks, generator=gen)[:blocks].tolist()
    nbytes = blocks * dev[:, 0].numel() * dev.element_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def loop(src: torch.Tensor, dst: torch.Tensor, s_ids: list[int], d_ids: list[int]) -> None:
        for s, d in zip(s_ids, d_ids, strict=True):
            dst[:, d].copy_(src[:, s], non_blocking=True)
        sync()

    def batched(src: torch.Tensor, dst: torch.Tensor, s_ids: list[int], d_ids: list[int]) -> None:
        copy_blocks(src, dst, s_ids, d_ids)
        sync()

    def staged(src: torch.Tensor, dst: torch.Tensor, s_ids: list[int], d_ids: list[int]) -> None:
        copy_blocks(src, dst, s_ids, d_ids, via="staged")
        sync()

    results = []
    for direction, src, dst, s_ids, d_ids, to_device in (
        ("offload", dev, host, dev_ids, host_ids, False),
        ("onboard", host, dev, host_ids, dev_ids, True),
    ):
        t_batch = timed(lambda: batched(src, dst, s_ids, d_ids), device, args.iters)  # noqa: B023
        t_staged = timed(lambda: staged(src, dst, s_ids, d_ids), device, args.iters)  # noqa: B023
        t_loop = timed(lambda: loop(src, dst, s_ids, d_ids), device, max(args.iters // 2, 1))  # noqa: B023
        pinned = pinned_copy_gbps(device, nbytes, to_device, args.iters)
        batched_gbps = nbytes / t_batch / 1e9
        results.append(
            CopyResult(
                direction=direction,
                blocks=blocks,
                mb=nbytes / 1e6,
                batched_gbps=batched_gbps,
                staged_gbps=nbytes / t_staged / 1e9,
                loop_gbps=nbytes / t_loop / 1e9,
                pinned_gbps=pinned,
                fraction_of_pinned=batched_gbps / pinned,
                speedup_vs_loop=t_loop / t_batch,
            )
        )
    return results


def decode_table(rows: list[DecodeResult], copy_gbps: float) -> Table:
    table = Table(title=f"Decode attention (device copy rate {copy_gbps:.0f} GB/s)")
    for col in ("kv dtype", "batch", "context", "backend", "ms", "KV GB", "GB/s", "of copy"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.dtype, str(r.batch), str(r.context), r.backend, f"{r.ms:.3f}",
            f"{r.kv_gb:.3f}", f"{r.gbps:.0f}", f"{r.fraction_of_copy:.0%}",
        )  # fmt: skip
    return table


def copy_table(rows: list[CopyResult]) -> Table:
    table = Table(title="Block copies (one batched call vs a per-block loop)")
    cols = ("direction", "blocks", "MB", "batched GB/s", "staged GB/s", "loop GB/s", "pinned GB/s")
    for col in (*cols, "of pinned", "x loop"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.direction, str(r.blocks), f"{r.mb:.1f}", f"{r.batched_gbps:.2f}",
            f"{r.staged_gbps:.2f}", f"{r.loop_gbps:.2f}", f"{r.pinned_gbps:.2f}",
            f"{r.fraction_of_pinned:.0%}", f"{r.speedup_vs_loop:.1f}",
        )  # fmt: skip
    return table


def plot(decode: list[DecodeResult], copies: list[CopyResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for dtype, style in (("bfloat16", "-"), ("float8_e4m3fn", "--"), ("float32", ":")):
        for batch in sorted({r.batch for r in decode}):
            pts = [r for r in decode if r.dtype == dtype and r.batch == batch]
            if pts:
                ax1.plot(
                    [r.context for r in pts],
                    [r.fraction_of_copy for r in pts],
                    style,
                    marker="o",
                    label=f"{dtype} b={batch}",
                )
    ax1.axhline(0.85, color="grey", lw=0.8)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("context (tokens)")
    ax1.set_ylabel("KV bytes read / time, fraction of copy rate")
    ax1.set_title("Decode attention")
    ax1.legend(fontsize=7)
    labels = [f"{r.direction}\n{r.blocks} blk" for r in copies]
    xs = range(len(copies))
    width = 0.2
    bars = (
        ("batched (direct)", [r.batched_gbps for r in copies]),
        ("batched (staged)", [r.staged_gbps for r in copies]),
        ("per-block loop", [r.loop_gbps for r in copies]),
        ("pinned copy", [r.pinned_gbps for r in copies]),
    )
    for i, (label, values) in enumerate(bars):
        ax2.bar([x + (i - 1.5) * width for x in xs], values, width, label=label)
    ax2.set_xticks(list(xs), labels)
    ax2.set_ylabel("GB/s")
    ax2.set_title("Offload / onboard")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--smoke", action="store_true", help="tiny grid (runs on CPU)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "flashinfer"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float8_e4m3fn"])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--qo-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--copy-layers", type=int, default=32)
    p.add_argument("--copy-blocks", type=int, nargs="+", default=[64, 512])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("bench/results/kernels"))
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.contexts = [1, 4], [64, 256]
        args.dtypes = ["float32", "float8_e4m3fn"] if not torch.cuda.is_available() else args.dtypes
        args.kv_heads, args.qo_heads, args.head_dim = 2, 8, 64
        args.copy_layers, args.copy_blocks, args.iters = 4, [16, 64], 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        # Tiny CPU ops are fastest single-threaded; a shared machine makes thread pools spin.
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    console.print(
        f"[bold]kvpool kernels benchmark[/] on {name} ({'smoke' if args.smoke else 'full'})"
    )
    copy_gbps = device_copy_gbps(device, (1 << 30) if device.type == "cuda" else 64 << 20, 10)
    console.print(f"device copy rate: {copy_gbps:.1f} GB/s (read + write)")
    decode: list[DecodeResult] = []
    copies: list[CopyResult] = []
    grid = [(d, b, c) for d in args.dtypes for b in args.batches for c in args.contexts]
    with Progress(console=console) as progress:
        task = progress.add_task("decode", total=len(grid))
        for dtype_name, batch, context in grid:
            progress.update(task, description=f"decode {dtype_name} b={batch} ctx={context}")
            r = bench_decode(batch, context, getattr(torch, dtype_name), args, device, copy_gbps)
            if r is not None:
                decode.append(r)
            progress.advance(task)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        task = progress.add_task("copies", total=len(args.copy_blocks))
        copy_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        for blocks in args.copy_blocks:
            progress.update(task, description=f"copies {blocks} blocks")
            copies.extend(bench_copies(blocks, args, device, copy_dtype))
            progress.advance(task)
    console.print(decode_table(decode, copy_gbps))
    console.print(copy_table(copies))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "device": name,
        "smoke": args.smoke,
        "copy_gbps": copy_gbps,
        "decode": [asdict(r) for r in decode],
        "copies": [asdict(r) for r in copies],
    }
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    plot(decode, copies, args.out / "kernels.png")
    console.print(f"wrote {args.out / 'results.json'} and {args.out / 'kernels.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
