"""End-to-end timings of the user's story on the loopback dev cluster (real control plane).

Starts its own dev cluster, ``helm install``s the chart and runs the operator under the
chart's ServiceAccount with real agents (``kvpool_dev.stack``), then measures:

1. ``kubectl apply`` -> all children created, -> every pod Ready with its agent serving, and
   -> the pool's Ready condition, for the CPU example pool and a 3-replica small pool;
2. 100 pools applied at once (replicas 1, no agents behind the pods) -> all reconciled:
   children created, ``status.observedGeneration`` current and Ready;
3. the block hit rate of a steady trace load before, during and after a rolling restart
   (a restart-field edit) with the ring-aware warm handoff (the default: each chain to its
   owner, and the replacement takes its own back), with the first-peer handoff
   (``lifecycle.ringAware: false``), and with no handoff (the baseline). The load ranks the
   pods by their names in the agents' ring (``Stack.ring``), as clients in a cluster rank
   the StatefulSet's DNS names.

    python bench/e2e_timings.py                 # about 7 minutes on the 2-core dev machine
    python bench/e2e_timings.py --repeats 1 --pools 20
    python bench/e2e_timings.py --rolls-only    # only part 3 (keeps the other parts' figures)
    python bench/e2e_timings.py --rolls-only --agent-mib 16 --handoffs ring-aware off \
        --out bench/results/e2e_timings_roomy.json   # agents that hold the whole slice

Prints a table and writes ``bench/results/e2e_timings.json`` and ``e2e_timings.png`` (or
``--out`` and its ``.png``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_agent.traces import Trace, load_trace
from kvpool_dev.build import ensure_built
from kvpool_dev.cluster import ClusterConfig, DevCluster, GpuNodeSpec
from kvpool_dev.poll import wait_until
from kvpool_dev.stack import EXAMPLES, Load, Stack, condition, get_json, story_trace

REPO = Path(__file__).resolve().parents[1]
console = Console()
RESULTS = REPO / "bench" / "results"
CHILDREN = ("statefulset/{n}", "service/{n}", "configmap/{n}-agent-config", "pdb/{n}")
SLICE = 300


AGENT_MIB = 8
"""The small pool's cache per agent: 8,192 blocks of 1 KiB, short of the slice's 10,592."""


def small_pool(
    namespace: str, name: str, replicas: int, warm_handoff: bool, mib: int = AGENT_MIB
) -> dict[str, Any]:
    """The e2e test's small pool: 1 KiB blocks, ``mib`` MiB per agent."""
    return {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "model": {
                "name": "tiny",
                "numLayers": 1,
                "numKvHeads": 1,
                "headDim": 16,
                "dtype": "float16",
            },
            "kvCacheConfig": {"tokensPerBlock": 16, "enablePartialReuse": False},
            "agent": {"device": "cpu", "cpuBudgetBytes": mib << 20},
            "rollout": {
                "maxUnavailable": 1,
                "warmHandoff": warm_handoff,
                "warmHandoffSeconds": 3,
            },
            "pod": {"resources": {"requests": {"cpu": "100m", "memory": "512Mi"}}},
        },
    }


def apply_docs(cluster: DevCluster, docs: list[dict[str, Any]], workdir: Path) -> float:
    path = workdir / f"apply-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    at = time.monotonic()
    cluster.kubectl("apply", "-f", str(path), timeout=300)
    return at


def delete_pool(stack: Stack, name: str) -> None:
    stack.cluster.kubectl("delete", "-n", stack.namespace, f"kvp/{name}", "--wait=true")
    wait_until(f"{name}'s agents gone", lambda: not stack.agent_urls(name), 60)


def children_exist(cluster: DevCluster, namespace: str, name: str) -> bool:
    return all(get_json(cluster, namespace, c.format(n=name)) for c in CHILDREN)


def time_pool(stack: Stack, doc: dict[str, Any], replicas: int) -> dict[str, float]:
    """Seconds from apply to all children, and to every pod Ready with its agent serving."""
    name, ns = doc["metadata"]["name"], stack.namespace
    applied = apply_docs(stack.cluster, [doc], stack.workdir)
    wait_until("children", lambda: children_exist(stack.cluster, ns, name), 120, every=0.1)
    children = time.monotonic() - applied

    def all_ready() -> bool:
        sts = get_json(stack.cluster, ns, f"statefulset/{name}") or {}
        return (sts.get("status") or {}).get("readyReplicas") == replicas

    # Both: the StatefulSet counts every pod Ready, and every agent answers /readyz.
    stack.wait_agents_ready(name, replicas, timeout=180)
    wait_until("pods Ready", all_ready, 180, every=0.2)
    pods_ready = time.monotonic() - applied
    wait_until(
        "pool Ready",
        lambda: condition(stack.pool(name), "Ready") == "True",
        60,
        every=0.2,
    )
    pool_ready = time.monotonic() - applied
    delete_pool(stack, name)
    return {"children_s": children, "pods_ready_s": pods_ready, "pool_ready_s": pool_ready}


def time_many_pools(stack: Stack, count: int) -> dict[str, float]:
    """Apply ``count`` pools at once (replicas 1); seconds until all are reconciled."""
    ns = stack.namespace
    docs = [small_pool(ns, f"p{i:03d}", 1, True) for i in range(count)]
    applied = apply_docs(stack.cluster, docs, stack.workdir)

    def progress() -> tuple[int, int]:
        sts = get_json(stack.cluster, ns, "statefulsets") or {}
        pools = get_json(stack.cluster, ns, "kvcachepools") or {}
        created = len(sts.get("items", []))
        ready = sum(
            1
            for p in pools.get("items", [])
            if condition(p, "Ready") == "True"
            and (p.get("status") or {}).get("observedGeneration") == p["metadata"]["generation"]
        )
        return created, ready

    created_at = ready_at = None
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"{count} pools reconciling", total=count)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            created, ready = progress()
            bar.update(task, completed=ready)
            now = time.monotonic()
            if created >= count and created_at is None:
                created_at = now - applied
            if ready >= count:
                ready_at = now - applied
                break
            time.sleep(1.0)
    if created_at is None or ready_at is None:
        raise AssertionError(f"{count} pools did not reconcile in 600s: {progress()}")
    stack.cluster.kubectl("delete", "kvcachepools", "--all", "-n", ns, "--wait=false")
    return {"pools": count, "all_children_s": created_at, "all_ready_s": ready_at}


HANDOFFS = ("ring-aware", "first-peer", "off")
"""The rolls compared: ``lifecycle.ringAware`` on (the default) or off, and no handoff."""


def roll(
    stack: Stack, trace: Trace, handoff: str, rate: float, mib: int = AGENT_MIB
) -> dict[str, Any]:
    """A restart-field edit under a steady paced load; block hit rates in the round (one pass
    over the slice) before the edit, during the roll, and in the two rounds after it."""
    name = f"roll-{handoff}"
    warm_handoff = handoff != "off"
    doc = small_pool(stack.namespace, name, 2, warm_handoff, mib)
    if handoff == "first-peer":
        doc["spec"]["agent"]["lifecycle"] = {"ringAware": False}
    apply_docs(stack.cluster, [doc], stack.workdir)
    stack.wait_agents_ready(name, 2)
    old_uids = pod_uids(stack, name)
    with Load(stack, name, trace, rate=rate) as load:
        load.wait_rounds(2, timeout=300)  # warm
        edited = time.monotonic()
        stack.cluster.kubectl(
            "patch", "-n", stack.namespace, f"kvp/{name}", "--type=merge",
            "-p", json.dumps({"spec": {"agent": {"reservedDeviceBytes": 1}}}),
        )  # fmt: skip
        wait_until(
            "the roll",
            lambda: (
                condition(stack.pool(name), "Ready") == "True"
                and not (pod_uids(stack, name) & old_uids)
                and len(stack.agent_urls(name)) == 2
            ),
            300,
            every=0.5,
        )
        rolled = time.monotonic()
        round_s = SLICE / rate
        time.sleep(max(0.0, rolled + 2 * round_s - time.monotonic()))
    if load.error is not None:
        raise AssertionError(f"load failed: {load.error!r}")
    series = timeline(load, edited)
    delete_pool(stack, name)
    return {
        "handoff": handoff,
        "warm_handoff": warm_handoff,
        "agent_mib": mib,
        "rate": rate,
        "before": load.hit_rate(edited - round_s, edited),
        "during": load.hit_rate(edited, rolled),
        "first_round_after": load.hit_rate(rolled, rolled + round_s),
        "second_round_after": load.hit_rate(rolled + round_s, rolled + 2 * round_s),
        "roll_s": rolled - edited,
        "failed_during": load.failures(edited, rolled),
        "timeline": series,
        "rolled_at_s": rolled - edited,
    }


def timeline(load: Load, origin: float, bucket: float = 2.0) -> list[tuple[float, float]]:
    """(seconds since the edit, hit rate) per bucket of finished requests."""
    buckets: dict[int, list[int]] = {}
    for tick in list(load.ticks):
        key = int((tick.at - origin) // bucket)
        acc = buckets.setdefault(key, [0, 0])
        acc[0] += tick.blocks
        acc[1] += tick.hits
    return [(k * bucket, h / b) for k, (b, h) in sorted(buckets.items()) if b]


def pod_uids(stack: Stack, name: str) -> set[str]:
    pods = get_json(stack.cluster, stack.namespace, "pods", "-l", f"kvpool.io/pool={name}")
    return {p["metadata"]["uid"] for p in (pods or {}).get("items", [])}


def plot(rolls: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rolls:
        xs = [x for x, _ in r["timeline"]]
        ys = [y for _, y in r["timeline"]]
        label = _handoff_label(r)
        (line,) = ax.plot(xs, ys, label=label)
        ax.axvline(r["rolled_at_s"], color=line.get_color(), linestyle=":", linewidth=1)
    ax.axvline(0, color="grey", linewidth=1)
    ax.set_xlabel("seconds since the restart-field edit (dotted: roll done)")
    ax.set_ylabel("block hit rate (2 s buckets)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Rolling restart of a 2-agent pool under a steady trace load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report_file(path: Path) -> None:
    """Print the tables of an earlier run's JSON."""
    report(json.loads(path.read_text()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="apply->Ready runs per pool")
    parser.add_argument("--pools", type=int, default=100, help="pools applied at once")
    parser.add_argument(
        "--rate", type=float, default=15.0, help="requests/s of the load during the rolls"
    )
    parser.add_argument(
        "--report", type=Path, help="only print the tables of an earlier run's JSON"
    )
    parser.add_argument(
        "--rolls-only",
        action="store_true",
        help="measure only the rolling restarts (the other figures are kept from the last run)",
    )
    parser.add_argument(
        "--handoffs", nargs="+", choices=HANDOFFS, default=list(HANDOFFS), help="rolls to run"
    )
    parser.add_argument(
        "--agent-mib",
        type=int,
        default=AGENT_MIB,
        help="cache per agent in the rolls (16: one agent holds the whole slice)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "e2e_timings.json")
    args = parser.parse_args()
    if args.report is not None:
        report_file(args.report)
        return 0
    trace = load_trace(story_trace()).head(SLICE)
    RESULTS.mkdir(parents=True, exist_ok=True)
    layout = ensure_built()
    out: Path = args.out
    results: dict[str, Any] = {"repeats": args.repeats}
    if args.rolls_only:
        results = json.loads(out.read_text()) if out.is_file() else {}
    with tempfile.TemporaryDirectory(prefix="kvpool-e2e-bench-") as tmp:
        work = Path(tmp)
        nodes = (GpuNodeSpec("gpu-node-0", gpus=8), GpuNodeSpec("gpu-node-1", gpus=8))
        config = ClusterConfig(state_dir=work / "cluster", gpu_nodes=nodes, die_with_parent=True)

        with DevCluster(config, layout) as cluster:
            for ns in ("bench", "bench-many"):
                cluster.kubectl("create", "namespace", ns)
                cluster.wait_service_account(ns, timeout=60)
            stack = Stack(
                cluster, "bench", work / "stack", release="kvpool", release_namespace="kvpool"
            )
            many = Stack(
                cluster, "bench-many", work / "many", release="kvpool-many",
                release_namespace="kvpool-many", agents=False, timer_interval=10.0,
            )  # fmt: skip
            with stack, many:
                if not args.rolls_only:
                    measure_apply(stack, many, args, results)
                rolls = []
                for handoff in args.handoffs:
                    console.log(f"rolling restart, handoff {handoff}")
                    rolls.append(roll(stack, trace, handoff, args.rate, args.agent_mib))
                results["rolls"] = rolls
    report(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results["rolls"], out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def measure_apply(
    stack: Stack, many: Stack, args: argparse.Namespace, results: dict[str, Any]
) -> None:
    """Parts 1 and 2: apply -> Ready of single pools, and of many pools at once."""
    results["helm_install_s"] = stack.timings["helm_install_s"]
    results["operator_credential"] = stack.credential
    example = yaml.safe_load((EXAMPLES / "cpu-dev.yaml").read_text())
    example["metadata"]["namespace"] = "bench"
    runs: dict[str, list[dict[str, float]]] = {"cpu-dev (1 replica)": []}
    runs["small pool (3 replicas)"] = []
    for i in range(args.repeats):
        console.log(f"apply -> Ready, run {i + 1}/{args.repeats}")
        runs["cpu-dev (1 replica)"].append(time_pool(stack, example, 1))
        small = small_pool("bench", f"small{i}", 3, True)
        runs["small pool (3 replicas)"].append(time_pool(stack, small, 3))
    results["apply"] = runs
    console.log(f"{args.pools} pools at once")
    results["many"] = time_many_pools(many, args.pools)


def report(results: dict[str, Any]) -> None:
    """The tables of the parts ``results`` holds (a rolls-only run to a new file has no
    apply figures)."""
    if "apply" in results:
        table = Table(title="apply -> children / pods Ready / pool Ready (median of runs, s)")
        for col in ("pool", "runs", "children", "pods Ready", "pool Ready"):
            table.add_column(col)
        for pool, runs in results["apply"].items():

            def med(key: str, runs: list[dict[str, float]] = runs) -> str:
                return f"{statistics.median(r[key] for r in runs):.2f}"

            table.add_row(
                pool, str(len(runs)), med("children_s"), med("pods_ready_s"), med("pool_ready_s")
            )
        console.print(table)
    if "many" in results:
        many = results["many"]
        console.print(
            f"{many['pools']} pools applied at once: all children after "
            f"{many['all_children_s']:.1f}s, all reconciled and Ready after "
            f"{many['all_ready_s']:.1f}s ({many['all_ready_s'] / many['pools']:.2f}s per pool)"
        )
    rolls = results.get("rolls") or []
    if not rolls:
        return
    rate = rolls[0]["rate"]
    mib = rolls[0].get("agent_mib", AGENT_MIB)
    table = Table(
        title=f"block hit rate around a rolling restart (2 agents of {mib} MiB, {rate:g} "
        f"requests/s, a round = {SLICE} requests)"
    )
    cols = ("handoff", "round before", "during", "1st round after", "2nd round after", "roll s")
    for col in (*cols, "failed"):
        table.add_column(col)
    base = next((r for r in rolls if not r["warm_handoff"]), None)
    for r in rolls:
        during = _pct(r["during"])
        if base is not None:
            ratio = (r["during"] or 0.0) / max(base["during"] or 0.0, 1e-9)
            during += f" ({ratio:.2f}x baseline)"
        table.add_row(
            _handoff_label(r),
            _pct(r["before"]),
            during,
            _pct(r["first_round_after"]),
            _pct(r["second_round_after"]),
            f"{r['roll_s']:.0f}",
            str(r["failed_during"]),
        )
    console.print(table)


def _handoff_label(roll: dict[str, Any]) -> str:
    """Rolls of older result files have only ``warm_handoff`` (the first-peer handoff then)."""
    handoff = roll.get("handoff") or ("first-peer" if roll["warm_handoff"] else "off")
    return {"off": "no handoff (baseline)"}.get(handoff, f"{handoff} handoff")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


if __name__ == "__main__":
    sys.exit(main())
