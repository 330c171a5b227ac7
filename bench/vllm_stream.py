"""What the connector costs a vLLM engine serving a stream of requests the pool cannot help,
by how its sender batches saves (``save_coalesce_ms``), over the same-node path.

    python bench/vllm_stream.py [--lengths 1024 2048] [--runs 12] [--requests 8]
                                [--coalesce 0 50] [--lookups-only] [--python-exchange]
                                [--timeline]
                                [--out bench/results/vllm_stream.json]

``bench/vllm_connector.py`` times one request at a time and flushes its saves after each, so
a save is never sent with another there. Here each engine with the connector (one per
``--coalesce`` value, on the agent's Unix socket, each in a key namespace of its own) serves
runs of ``--requests`` new prompts, one after the other (``run_vllm.py``'s ``one_by_one``),
as an engine under light load does. Every run has a twin: as many new prompts of the same
length that turn the pool off for themselves (``kv_transfer_params``), run next to it in the
same engine, the order alternating. A run's time lasts until its saves are in the pool
(``flushed_s``), so a save sent late still counts against the run that made it.
``--python-exchange`` adds an engine whose same-node PUTs run PUT_SHM, the copy and COMMIT
in Python, as without the compiled core (``kvpool_native.shm_put``): the two compared in
the same run.
``--timeline`` also times each engine's steps and saves (``run_vllm.py``'s ``timeline``)
and says where the saves fall: a step from vLLM binding the connector's metadata to
``wait_for_save`` returning (the forward pass and the step's copies out), the gap from it to
the next step (vLLM's own work between steps, and the next request's arrival), and the
share of the sender's time on saves that fell inside steps.

Per engine and length: the median over runs of (run with the pool) / (run without) - 1; the
same for the requests alone ("served only": until the last output, before the run's last
saves are in), and the saves' tail (ms from the last output until they are in, with the
pool); and the CPU per request of the agent and of the engine process, and the engine's page
faults per request, in the runs with the pool less in those without. Real vLLM engines on CPU
(``.venv-vllm``, the tiny 2-layer model of ``tests/vllm_engine/run_vllm.py``): compare the
ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from plots import grouped_bars
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from vllm_connector import BLOCK, REPO, RUNNER, Engine, cpu_s, start_agent, tokens

OFF = {"kvpool": {"load": False, "save": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--runs", type=int, default=12, help="runs per engine, length and kind")
    parser.add_argument("--requests", type=int, default=8, help="requests per run")
    parser.add_argument("--coalesce", type=float, nargs="+", default=[0.0, 50.0])
    parser.add_argument(
        "--lookups-only",
        action="store_true",
        help="also an engine with `save: false` (the connector's lookups alone)",
    )
    parser.add_argument(
        "--python-exchange",
        action="store_true",
        help="also an engine whose same-node PUTs run their exchange in Python (not "
        "`kvpool_native.shm_put`), at the first --coalesce value",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="also time the engines' steps and saves: where the saves fall between steps",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/vllm_stream.json")
    args = parser.parse_args()
    console = Console()
    subprocess.run(["bash", str(REPO / "hack" / "vllm-venv.sh")], check=True)
    python = REPO / ".venv-vllm" / "bin" / "python"
    rng = random.Random(7)
    runs = [(n, r) for r in range(args.runs) for n in args.lengths]
    saved_blocks = len(args.coalesce) * len(runs) * args.requests * max(args.lengths) // BLOCK
    records: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name, Progress(console=console) as bar:
        tmp = Path(tmp_name)
        subprocess.run([str(python), str(RUNNER), "make-model", str(tmp / "model")], check=True)
        unix_socket = str(tmp / "agent.sock")
        agent, _url, _transfer = start_agent(tmp, 2 * saved_blocks, unix_socket)
        engines: list[Engine] = []
        try:
            base = {
                "model": str(tmp / "model"),
                "max_model_len": max(args.lengths) + 64,
                "timeline": args.timeline,
            }
            # (name, connector settings, engine spec beside them)
            variants: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
                (f"coalesce {ms:g} ms", {"save_coalesce_ms": ms}, {}) for ms in args.coalesce
            ]
            if args.python_exchange:
                ms = args.coalesce[0]
                variants.append(
                    (
                        f"coalesce {ms:g} ms, Python exchange",
                        {"save_coalesce_ms": ms},
                        {"python_exchange": True},
                    )
                )
            if args.lookups_only:
                variants.append(("lookups only", {"save": False}, {}))
            for i, (name, settings, spec) in enumerate(variants):
                extra = {"unix_socket": unix_socket, "model": f"tiny-llama-{i}", **settings}
                connector = {
                    "module": "kvpool_agent.connectors.vllm",
                    "class": "KvpoolConnector",
                    "extra": extra,
                }
                engines.append(Engine(python, tmp, name, {**base, **spec, "connector": connector}))
            warmup = {"name": "warmup", "prompts": [tokens(rng, 512)], "max_tokens": 1}
            for engine in engines:
                engine.ready()
                engine.phase(warmup)
            task = bar.add_task("runs, engines in turn", total=len(runs))
            for i, (n, r) in enumerate(runs):
                turn = i % len(engines)
                for engine in engines[turn:] + engines[:turn]:
                    kinds = ("on", "off") if r % 2 == 0 else ("off", "on")
                    for kind in kinds:
                        phase: dict[str, Any] = {
                            "name": f"{kind}-{n}-{r}",
                            "prompts": [tokens(rng, n) for _ in range(args.requests)],
                            "one_by_one": True,
                            "reset": True,
                            "max_tokens": 1,
                        }
                        if kind == "off":
                            phase["kv_transfer_params"] = OFF
                        agent0, engine0 = cpu_s(agent.pid), cpu_s(engine.proc.pid)
                        record = engine.phase(phase)
                        record["agent_cpu_s"] = cpu_s(agent.pid) - agent0
                        record["engine_cpu_s"] = cpu_s(engine.proc.pid) - engine0
                        record["kind"], record["tokens"] = kind, n
                        records.setdefault((engine.name, n), []).append(record)
                bar.advance(task)
        finally:
            for engine in engines:
                engine.stop()
            agent.kill()
            agent.wait()
    rows = summarize(records, args.requests)
    show(console, rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python bench/vllm_stream.py " + " ".join(sys.argv[1:])}
    meta |= {"runs": args.runs, "requests_per_run": args.requests}
    args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    plot(args.out.with_suffix(".png"), rows)
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    """Per length, the whole run's overhead and the requests' own (served only)."""
    lengths = sorted({row["tokens"] for row in rows})
    by = {(row["engine"], row["tokens"]): row for row in rows}
    grouped_bars(
        path,
        [label for n in lengths for label in (f"{n} tokens", f"{n}: served only")],
        {
            name: [
                100 * by[name, n][key] for n in lengths for key in ("overhead", "overhead_served")
            ]
            for name in dict.fromkeys(row["engine"] for row in rows)
        },
        "time with the pool over without, - 1 (%)",
        "The connector's cost on a stream of requests without a hit, by save batching",
    )


def summarize(
    records: dict[tuple[str, int], list[dict[str, Any]]], requests: int
) -> list[dict[str, Any]]:
    """Per engine and length: paired run ratios and the CPU per request, with - without."""
    rows = []
    for (name, n), recs in sorted(records.items(), key=lambda kv: kv[0][1]):
        on = [r for r in recs if r["kind"] == "on"]
        off = [r for r in recs if r["kind"] == "off"]
        ratios = [a["flushed_s"] / b["flushed_s"] for a, b in zip(on, off, strict=True)]
        q = statistics.quantiles(ratios, n=4)
        served = [a["elapsed_s"] / b["elapsed_s"] for a, b in zip(on, off, strict=True)]

        saved = on[-1]["worker_stats"]
        rows.append(
            {
                "engine": name,
                "tokens": n,
                "overhead": statistics.median(ratios) - 1,
                "overhead_iqr": [q[0] - 1, q[2] - 1],
                "overhead_served": statistics.median(served) - 1,
                "tail_ms": 1e3 * statistics.median(r["flushed_s"] - r["elapsed_s"] for r in on),
                "request_s_without": _per_request("flushed_s", off, requests),
                "agent_cpu_us": _added_us("agent_cpu_s", on, off, requests),
                "engine_cpu_us": _added_us("engine_cpu_s", on, off, requests),
                "engine_faults": _per_request("minor_faults", on, requests)
                - _per_request("minor_faults", off, requests),
                "save_requests": saved["save_requests"],
                "saved_blocks": saved["saved_blocks"],
                "node_saved_blocks": saved["node_saved_blocks"],
            }
        )
        if "timeline" in on[0]:
            rows[-1]["timeline"] = timeline_summary(on, off)
    return rows


def _spans(events: list[list[Any]], start: str, end: str) -> list[tuple[float, float]]:
    """(start, end) of each ``start`` event and the ``end`` event after it."""
    spans, opened = [], None
    for tag, t in events:
        if tag == start:
            opened = t
        elif tag == end and opened is not None:
            spans.append((opened, t))
            opened = None
    return spans


def _steps(events: list[list[Any]], after_saves: bool) -> tuple[list[float], list[float]]:
    """A run's step durations, and the gaps from a step to the next (``after_saves``: only
    after a step that queued a save)."""
    spans = _spans(events, "step", "step_end")
    queued = [t for tag, t in events if tag == "queued"]
    gaps = [
        nxt - end
        for (a, end), (nxt, _) in itertools.pairwise(spans)
        if not after_saves or any(a <= q <= end for q in queued)
    ]
    return [b - a for a, b in spans], gaps


def timeline_summary(on: list[dict[str, Any]], off: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the saves of the runs with the pool fell, against the runs without: medians of
    steps and of the gaps after them, of the saves (queued to sent, sending), and the share
    of the saves' sending time that fell inside steps (the rest fell in the gaps). ``None``
    where a run kind had none."""
    steps_on, gaps_on, steps_off, gaps_off, waits, sends = [], [], [], [], [], []
    inside = 0.0
    for run in off:
        steps, gaps = _steps(run["timeline"], after_saves=False)
        steps_off += steps
        gaps_off += gaps
    for run in on:
        events = run["timeline"]
        steps, gaps = _steps(events, after_saves=True)
        steps_on += steps
        gaps_on += gaps
        spans = _spans(events, "step", "step_end")
        queued = [t for tag, t in events if tag == "queued"]
        for q, (sent, done) in zip(queued, _spans(events, "save", "save_end"), strict=False):
            waits.append(sent - q)
            sends.append(done - sent)
            inside += sum(max(0.0, min(done, b) - max(sent, a)) for a, b in spans)

    def ms(values: list[float]) -> float | None:
        return 1e3 * statistics.median(values) if values else None

    return {
        "step_ms": ms(steps_on),
        "step_ms_without": ms(steps_off),
        "gap_after_save_ms": ms(gaps_on),
        "gap_ms_without": ms(gaps_off),
        "save_wait_ms": ms(waits),
        "save_ms": ms(sends),
        "saves": len(sends),
        "sending_in_steps": inside / sum(sends) if sends else None,
    }


def _per_request(key: str, runs: list[dict[str, Any]], requests: int) -> float:
    return statistics.median(r[key] for r in runs) / requests


def _added_us(
    key: str, on: list[dict[str, Any]], off: list[dict[str, Any]], requests: int
) -> float:
    """CPU per request, runs with the pool less runs without (µs)."""
    return 1e6 * (_per_request(key, on, requests) - _per_request(key, off, requests))


def show(console: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(title="A stream of requests without a hit: with the pool against without")
    for col in (
        "engine",
        "prompt",
        "without, ms/request",
        "overhead (IQR)",
        "served only",
        "saves' tail, ms/run",
        "agent CPU µs/request",
        "engine CPU µs/request",
        "engine page faults/request",
    ):
        table.add_column(col, justify="right")
    for row in rows:
        lo, hi = row["overhead_iqr"]
        table.add_row(
            row["engine"],
            str(row["tokens"]),
            f"{1e3 * row['request_s_without']:.1f}",
            f"{100 * row['overhead']:+.1f}% ({100 * lo:+.1f} to {100 * hi:+.1f})",
            f"{100 * row['overhead_served']:+.1f}%",
            f"{row['tail_ms']:.2f}",
            f"{row['agent_cpu_us']:.0f}",
            f"{row['engine_cpu_us']:.0f}",
            f"{row['engine_faults']:.0f}",
        )
    console.print(table)
    timed = [row for row in rows if "timeline" in row]
    if not timed:
        return
    table = Table(title="Where the saves fell (medians, ms): steps and the gaps between them")
    for col in (
        "engine",
        "prompt",
        "step (without)",
        "gap after a saving step (without)",
        "save: queued to sent",
        "save: sending",
        "sending inside steps",
    ):
        table.add_column(col, justify="right")
    for row in timed:
        t = row["timeline"]
        table.add_row(
            row["engine"],
            str(row["tokens"]),
            f"{_ms(t['step_ms'])} ({_ms(t['step_ms_without'])})",
            f"{_ms(t['gap_after_save_ms'])} ({_ms(t['gap_ms_without'])})",
            _ms(t["save_wait_ms"]),
            _ms(t["save_ms"]),
            "-"
            if t["sending_in_steps"] is None
            else f"{100 * t['sending_in_steps']:.0f}% ({t['saves']} saves)",
        )
    console.print(table)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
