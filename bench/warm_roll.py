"""Hit rate per round around a rolling restart and a scale-in, with and without handoff.

Real agent processes on loopback (one per pod of a StatefulSet, each on its own port, so its
URL is its stable name in the ring; with a tenant's and the pool's peer token, as in a pod),
a steady load driven through ``PoolClient`` (rendezvous hashing over the agents' URLs, as
``kvpool drive`` does) that replays the same synthetic shared-prefix trace round after round,
and the two events of issue 27:

- **rolling restart**: each agent in turn, highest ordinal first, gets SIGTERM (it drains and
  hands off), exits, and is started again on the same port; the next one goes once the
  replacement is ready and ``--ready-pause`` seconds have passed (``minReadySeconds``);
- **scale-in**: the highest ordinal leaves the clients' ring and gets SIGTERM; it is not
  started again.

Three handoff modes:

- ``off``: no handoff peers (the baseline: a replacement starts empty);
- ``first-peer``: the hottest blocks go to the first peer that takes them (kvpool before
  issue 27: ``lifecycle.ring_aware: false``);
- ``ring``: ring-aware handoff (``server/rebalance.py``): on drain each chain goes to its owner
  among the ready peers; on start an agent takes back from its peers the chains it owns,
  before it reports ready.

Each round's block hit rate is what the agents answered (reused blocks over prompt blocks).
Reported per event: the round before, the rounds during (pooled), and the first two rounds
that start after the event is over. The goal: first round after >= 95% of the round before.

    python bench/warm_roll.py                     # 3 agents, all three modes
    python bench/warm_roll.py --modes ring --agents 4

Prints a table and writes ``bench/results/warm_roll.json`` and ``warm_roll.png``.
``tests/agent/test_warm_roll_process.py`` runs the ``ring`` mode of the same scenario as a
test (``run_scenario``).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvpool_agent.client import PoolClient
from kvpool_agent.drive import drive
from kvpool_agent.traces import Trace, TraceRequest

RESULTS = Path(__file__).resolve().parent / "results"
STARTUP_TIMEOUT = 120.0
MODES = ("off", "first-peer", "ring")
TPB = 16


def free_port(host: str) -> int:
    """A port free now and below the kernel's ephemeral range: an agent keeps its port across
    a restart, and a port from that range (what binding port 0 gives) may meanwhile become
    the local end of some client's connection, which fails the restarted agent's bind."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(10_000, low) if low > 11_000 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no free port on {host} below {low}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def shared_prefix_trace(
    groups: int = 32, per_group: int = 4, prefix_blocks: int = 8, suffix_blocks: int = 2
) -> Trace:
    """``groups`` prefixes of ``prefix_blocks`` blocks, each with ``per_group`` suffixes;
    one round replays every request once (interleaved over the groups)."""
    requests = []
    next_id = 0
    prefixes = []
    for _ in range(groups):
        prefixes.append(tuple(range(next_id, next_id + prefix_blocks)))
        next_id += prefix_blocks
    for k in range(per_group):
        for g in range(groups):
            suffix = tuple(range(next_id, next_id + suffix_blocks))
            next_id += suffix_blocks
            blocks = prefixes[g] + suffix
            requests.append(TraceRequest(float(k * groups + g), len(blocks) * TPB, 1, blocks))
    return Trace("shared-prefix", TPB, tuple(requests))


class AgentProcess:
    """One agent on ``host:port``, its config in ``work``; restarts keep the port."""

    def __init__(self, work: Path, ordinal: int, host: str, budget_bytes: int) -> None:
        self.ordinal = ordinal
        self.host, self.port = host, free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.config = work / f"agent-{ordinal}.yaml"
        self.log = work / f"agent-{ordinal}.log"
        self.budget = budget_bytes
        self.proc: subprocess.Popen[bytes] | None = None

    def write_config(self, lifecycle: dict[str, Any], auth: dict[str, str]) -> None:
        doc = {
            "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
            "kv_cache_config": {"tokens_per_block": TPB, "enable_partial_reuse": False},
            "device": "cpu",
            "cpu_budget_bytes": self.budget,
            "events": {"endpoint": "tcp://*:*", "replay_endpoint": None},
            "transfer": {"port": 0},  # several agents share the host
            "lifecycle": {"grace_period_s": 10.0, **lifecycle},
            "auth": auth,
        }
        self.config.write_text(yaml.safe_dump(doc))

    def start(self) -> AgentProcess:
        cmd = [sys.executable, "-m", "kvpool_cli", "agent", "--config", str(self.config)]
        cmd += ["--host", self.host, "--port", str(self.port)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"agent {self.ordinal} exited:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"agent {self.ordinal} not ready:\n{self.log.read_text()}")

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def credentials(work: Path) -> tuple[dict[str, str], str]:
    """A tenant and the pool's peer token, as the operator's Secret holds them: the agents
    serve only with tokens (the handoffs and handbacks present the peer token)."""
    from kvpool_agent.credentials import new_token, token_digest

    tenant = new_token()
    (work / "tenants.yaml").write_text(yaml.safe_dump({"default": token_digest(tenant)}))
    (work / "peer-token").write_text(new_token() + "\n")
    auth = {
        "tenants_file": str(work / "tenants.yaml"),
        "peer_token_file": str(work / "peer-token"),
    }
    return auth, tenant


def lifecycle_for(mode: str, agent: AgentProcess, urls: list[str]) -> dict[str, Any]:
    if mode == "off":
        return {"handoff_peers": []}
    if mode == "first-peer":
        return {"handoff_peers": urls, "ring_aware": False}
    if mode == "ring":
        return {"handoff_peers": urls, "ring_aware": True, "self_url": agent.url}
    raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")


@dataclass
class Round:
    index: int
    start: float
    end: float
    requests: int
    failed: int
    query_blocks: int
    hit_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0


@dataclass
class Load:
    """Replays ``trace`` round after round through a pool client, on a thread."""

    trace: Trace
    client: PoolClient
    rate: float | None = None
    rounds: list[Round] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    on_round: Callable[[Round], None] | None = None

    cut: threading.Event = field(default_factory=threading.Event)
    """Set: end the round now (it is kept, shorter) and start the next one at once."""

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            res = drive(
                self.trace,
                self.client,
                rate=self.rate,
                should_stop=lambda: self.stop.is_set() or self.cut.is_set(),
            )
            self.cut.clear()
            if self.stop.is_set():
                break
            r = Round(
                len(self.rounds),
                start,
                time.monotonic(),
                res.requests,
                res.failed,
                res.query_blocks,
                res.hit_blocks,
            )
            self.rounds.append(r)
            if self.on_round is not None:
                self.on_round(r)

    def start(self) -> Load:
        self.thread = threading.Thread(target=self.run, name="warm-roll-load", daemon=True)
        self.thread.start()
        return self

    def new_round(self) -> float:
        """End the running round and start the next one now; returns when it starts."""
        count = len(self.rounds)
        self.cut.set()
        while len(self.rounds) == count and self.thread is not None and self.thread.is_alive():
            time.sleep(0.001)
        return self.rounds[-1].end if len(self.rounds) > count else time.monotonic()

    def wait_rounds(self, n: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        target = len(self.rounds) + n
        while len(self.rounds) < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"load: {n} rounds not done within {timeout}s")
            time.sleep(0.05)

    def wait_rounds_after(self, t: float, n: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(r.start >= t for r in self.rounds) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"load: {n} rounds after the event not done in {timeout}s")
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=60)


def around(rounds: list[Round], t0: float, t1: float) -> dict[str, Any]:
    """The round before ``t0``, the rounds overlapping ``[t0, t1]`` pooled, and the first
    two rounds starting after ``t1``."""
    before = [r for r in rounds if r.end <= t0]
    during = [r for r in rounds if r.end > t0 and r.start < t1]
    after = [r for r in rounds if r.start >= t1]
    if not before or len(after) < 2:
        raise ValueError("need a round before the event and two after it")
    q = sum(r.query_blocks for r in during)
    h = sum(r.hit_blocks for r in during)
    prior, first = before[-1].hit_rate, after[0].hit_rate
    return {
        "before": prior,
        "during": h / q if q else None,
        "during_rounds": len(during),
        "after_1": first,
        "after_2": after[1].hit_rate,
        "failed_requests": sum(r.failed for r in during + after[:2]),
        "event_s": t1 - t0,
        "after_1_over_before": first / prior if prior else None,
    }


@dataclass
class EventResult:
    """One event on a fresh pool: the figures around it and every round."""

    figures: dict[str, Any]
    rounds: list[dict[str, Any]]
    origin: float
    """When the load started (monotonic): the rounds' times are relative to it in the plot."""
    start: float
    end: float
    handoffs: list[str]
    """Where each drained agent's blocks went (its log's ``hottest blocks:``)."""


@dataclass
class ScenarioResult:
    mode: str
    agents: int
    restart: EventResult
    scale_in: EventResult


EVENTS = ("restart", "scale_in")


def run_event(
    work: Path,
    mode: str,
    event: str,
    *,
    agents: int = 3,
    trace: Trace | None = None,
    rate: float | None = None,
    ready_pause: float = 1.0,
    host: str = "127.0.0.1",
    budget_bytes: int = 16 << 20,
    log: Callable[[str], None] = lambda _: None,
    on_round: Callable[[Round], None] | None = None,
) -> EventResult:
    """Start ``agents`` fresh agents, warm them with load, then ``restart`` them all (highest
    ordinal first) or ``scale_in`` by one; the load keeps going throughout."""
    if event not in EVENTS:
        raise ValueError(f"event {event!r}: one of {', '.join(EVENTS)}")
    trace = trace or shared_prefix_trace()
    work.mkdir(parents=True, exist_ok=True)
    procs = [AgentProcess(work, i, host, budget_bytes) for i in range(agents)]
    urls = [p.url for p in procs]
    auth, tenant_token = credentials(work)
    for p in procs:
        p.write_config(lifecycle_for(mode, p, urls), auth)
    load: Load | None = None
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        client = PoolClient(
            urls, tokens_per_block=trace.block_size, timeout=30.0, token=tenant_token
        )
        load = Load(trace, client, rate=rate, on_round=on_round).start()
        origin = time.monotonic()
        load.wait_rounds(3)  # a cold round, then steady ones
        log(f"{mode}: warm, {event}")
        t0 = time.monotonic()
        if event == "restart":
            for p in reversed(procs):
                if p is not procs[-1]:
                    time.sleep(ready_pause)  # minReadySeconds before the next pod goes
                rc = p.terminate()
                if rc != 0:
                    raise RuntimeError(f"agent {p.ordinal} exited {rc}:\n{p.log.read_text()}")
                p.start().wait_ready()
                log(f"{mode}: agent {p.ordinal} restarted")
        else:
            gone = procs[-1]
            client.remove_replica(gone.url)  # the clients' ring changes as the pod is deleted
            rc = gone.terminate()
            if rc != 0:
                raise RuntimeError(f"agent {gone.ordinal} exited {rc}:\n{gone.log.read_text()}")
        t1 = load.new_round()  # the event is over: the next round starts now
        load.wait_rounds_after(t1, 2)
        load.close()
        handoffs = [
            line.split("hottest blocks: ", 1)[1].strip()
            for p in procs
            for line in p.log.read_text().splitlines()
            if "hottest blocks: " in line
        ]
        return EventResult(
            around(load.rounds, t0, t1),
            [{**asdict(r), "hit_rate": r.hit_rate} for r in load.rounds],
            origin,
            t0,
            t1,
            handoffs,
        )
    finally:
        if load is not None:
            load.close()
        for p in procs:
            p.kill()


def run_scenario(work: Path, mode: str, **kwargs: Any) -> ScenarioResult:
    """A rolling restart, then a scale-in, each on a fresh warm pool (so that what one
    event left in the caches does not flatter the other)."""
    restart = run_event(work / "restart", mode, "restart", **kwargs)
    scale_in = run_event(work / "scale-in", mode, "scale_in", **kwargs)
    return ScenarioResult(mode, kwargs.get("agents", 3), restart, scale_in)


# ----------------------------------------------------------------------------- report


def report(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for event in ("restart", "scale_in"):
        title = "rolling restart" if event == "restart" else "scale-in (one agent removed)"
        table = Table(title=f"block hit rate per round around a {title}")
        for col in ("handoff", "round before", "during", "1st after", "2nd after", "1st/before"):
            table.add_column(col, justify="right" if col != "handoff" else "left")
        table.add_column("event", justify="right")
        table.add_column("failed", justify="right")
        for res in results:
            e = res[event]["figures"]
            during = "-" if e["during"] is None else f"{e['during']:.1%}"
            table.add_row(
                res["mode"],
                f"{e['before']:.1%}",
                f"{during} ({e['during_rounds']})",
                f"{e['after_1']:.1%}",
                f"{e['after_2']:.1%}",
                f"{e['after_1_over_before']:.1%}",
                f"{e['event_s']:.1f} s",
                str(e["failed_requests"]),
            )
        console.print(table)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    n = results[0]["agents"] if results else 0
    titles = {"restart": f"rolling restart ({n} agents)", "scale_in": f"scale-in ({n} -> {n - 1})"}
    for ax, event in zip(axes, EVENTS, strict=True):
        for res in results:
            e = res[event]
            t0 = e["start"]
            xs = [r["start"] - t0 for r in e["rounds"]]
            ys = [r["hit_rate"] for r in e["rounds"]]
            (line,) = ax.step(xs, ys, where="post", marker=".", label=res["mode"])
            ax.axvspan(0, e["end"] - t0, color=line.get_color(), alpha=0.08)
        ax.set_title(titles[event])
        ax.set_xlabel("seconds since the event began (shaded: the event); one step per round")
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("block hit rate of the round starting there")
    axes[0].legend(title="handoff")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    from rich.console import Console
    from rich.progress import Progress

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    parser.add_argument(
        "--rate", type=float, default=40.0, help="requests/s of the load (0: as fast as it goes)"
    )
    parser.add_argument("--ready-pause", type=float, default=1.0)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--output", type=Path, default=RESULTS / "warm_roll.json")
    args = parser.parse_args()
    console = Console()
    trace = shared_prefix_trace(groups=args.groups)
    results = []
    modes = [m for m in args.modes.split(",") if m]
    with Progress(console=console) as progress, tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            task = progress.add_task(f"{mode}: rounds", total=None)

            def tick(r: Round, task: Any = task, mode: str = mode) -> None:
                progress.update(
                    task, advance=1, description=f"{mode}: round {r.index} {r.hit_rate:.1%}"
                )

            res = run_scenario(
                Path(tmp) / mode,
                mode,
                agents=args.agents,
                trace=trace,
                rate=args.rate or None,
                ready_pause=args.ready_pause,
                log=progress.console.log,
                on_round=tick,
            )
            results.append(asdict(res))
    report(results)
    doc = {
        "command": " ".join(["python", "bench/warm_roll.py", *sys.argv[1:]]),
        "agents": args.agents,
        "trace": {
            "requests_per_round": len(trace.requests),
            "blocks_per_round": trace.total_blocks,
            "unique_blocks": trace.unique_blocks(),
            "tokens_per_block": trace.block_size,
        },
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc, indent=1))
    png = args.output.with_suffix(".png")
    plot(results, png)
    console.print(f"wrote {args.output} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
