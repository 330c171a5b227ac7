"""``kvpool-dev``: the dev tooling's command line (not part of the shipped ``kvpool``).

- ``kvpool-dev cluster build|up|down|env|status``: build, start, stop and inspect the loopback
  control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok GPU nodes);
- ``kvpool-dev stack serve``: on a running cluster, ``helm install`` the chart and run the
  operator under its ServiceAccount and real agents for the pool pods, until a signal.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path


def _default_dir(name: str) -> Path:
    from kvpool_dev.build import cache_root

    return cache_root() / "devcluster" / "run" / name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool-dev", description="kvpool's dev tooling: a local control plane and stack."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_cluster_arguments(
        sub.add_parser(
            "cluster",
            help="local Kubernetes control plane on loopback (etcd, apiserver, kwok GPU nodes)",
        )
    )
    add_stack_arguments(
        sub.add_parser("stack", help="the chart, the operator and agents on a running cluster")
    )
    return parser


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = sub.add_parser("build", help="build and cache the binaries (no-op when cached)")
    build.add_argument(
        "--prune-go-cache",
        action="store_true",
        help="afterwards delete the Go module/build caches (the binaries stay)",
    )
    for action, text in (
        ("up", "start a cluster (builds first if needed)"),
        ("down", "stop a cluster started by `up`"),
        ("env", "print shell exports (KUBECONFIG, PATH) for a running cluster"),
        ("status", "print the state of a cluster as JSON"),
    ):
        p = sub.add_parser(action, help=text)
        p.add_argument("--name", default="kvpool-dev", help="cluster name (default kvpool-dev)")
        p.add_argument(
            "--dir",
            type=Path,
            default=None,
            help="state dir (default $KVPOOL_CACHE/devcluster/run/NAME)",
        )
        if action == "up":
            p.add_argument("--gpu-nodes", type=int, default=2, help="fake GPU nodes (default 2)")
            p.add_argument("--gpus-per-node", type=int, default=8, help="default 8")
            p.add_argument("--pod-cidr", default="", help="pod CIDR in 127.0.0.0/8")
            p.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops")
        if action == "down":
            p.add_argument("--purge", action="store_true", help="also delete the state dir")


def run_cluster(args: argparse.Namespace) -> int:
    from kvpool_dev.build import BuildError, ensure_built, prune_go_caches
    from kvpool_dev.cluster import ClusterError

    try:
        if args.action == "build":
            layout = ensure_built()
            if args.prune_go_cache:
                prune_go_caches(layout)
            print(layout.bin_dir)
            return 0
        state_dir: Path = args.dir or _default_dir(args.name)
        if args.action == "up":
            return _up(args, state_dir)
        if args.action == "down":
            return _down(state_dir, args.purge)
        if args.action == "env":
            return _env(state_dir)
        return _status(state_dir)
    except (BuildError, ClusterError) as err:
        print(f"kvpool-dev cluster {args.action}: {err}", file=sys.stderr)
        return 1


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser(
        "serve",
        help="helm install, the operator, agents for the pool pods; until SIGTERM (prints "
        'one JSON line {"ready": true, ...} when up)',
    )
    p.add_argument("--cluster-dir", type=Path, required=True, help="the cluster's state dir")
    p.add_argument("--namespace", default="default", help="namespace of the pools")
    p.add_argument("--workdir", type=Path, required=True, help="logs, kubeconfig, pod files")
    p.add_argument("--timer-interval", type=float, default=2.0, help="operator timer (s)")


def run_stack(args: argparse.Namespace) -> int:
    from kvpool_dev.stack import serve

    return serve(args.cluster_dir, args.namespace, args.workdir, args.timer_interval)


def _up(args: argparse.Namespace, state_dir: Path) -> int:
    from kvpool_dev.build import ensure_built
    from kvpool_dev.cluster import ClusterConfig, DevCluster, GpuNodeSpec

    layout = ensure_built()
    nodes = tuple(
        GpuNodeSpec(f"gpu-node-{i}", gpus=args.gpus_per_node) for i in range(args.gpu_nodes)
    )
    config = ClusterConfig(
        state_dir=state_dir,
        name=args.name,
        gpu_nodes=nodes,
        pod_cidr=args.pod_cidr,
        die_with_parent=args.foreground,
    )
    cluster = DevCluster(config, layout).start()
    print(f"# dev cluster {args.name} is up: {cluster.server}", file=sys.stderr)
    _print_env(cluster.env())
    if not args.foreground:
        print(f"# stop it with: kvpool-dev cluster down --dir {state_dir}", file=sys.stderr)
        return 0
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    cluster.stop()
    return 0


def _down(state_dir: Path, purge: bool) -> int:
    from kvpool_dev.cluster import ClusterState, stop_processes

    state = ClusterState.load(state_dir)
    stopped = stop_processes(state)
    state.pids = {}
    state.save()
    print(f"stopped: {', '.join(stopped) or 'nothing was running'}", file=sys.stderr)
    if purge:
        shutil.rmtree(state_dir)
    return 0


def _print_env(env: dict[str, str]) -> None:
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")


def _env(state_dir: Path) -> int:
    from kvpool_dev.cluster import DevCluster

    _print_env(DevCluster.attach(state_dir).env())
    return 0


def _status(state_dir: Path) -> int:
    from kvpool_dev.cluster import ClusterState, process_alive

    state = ClusterState.load(state_dir)
    report = {
        "name": state.name,
        "server": state.server,
        "kubeconfig": state.kubeconfig,
        "pod_cidr": state.pod_cidr,
        "components": {
            name: {"pid": pid, "running": process_alive(state, name)}
            for name, pid in state.pids.items()
        },
    }
    print(json.dumps(report, indent=2))
    return 0 if state.pids and all(process_alive(state, n) for n in state.pids) else 3


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "cluster":
        return run_cluster(args)
    return run_stack(args)


if __name__ == "__main__":
    sys.exit(main())
