"""``kvpool operator``: run the KVCachePool operator (kopf)."""

from __future__ import annotations

import argparse

HELP = "Run the KVCachePool operator: reconcile pools, roll config changes, autoscale."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; globs allowed)",
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="watch every namespace (default)"
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="no peering: run alone without coordinating with other operator replicas",
    )
    parser.add_argument(
        "--peering",
        default=None,
        help="name of the kopf peering object for leader election between replicas",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority: with several replicas, the highest one works, the rest wait",
    )
    parser.add_argument(
        "--liveness",
        default=None,
        help="serve kopf's liveness probe at this URL, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument(
        "--timer-interval",
        type=float,
        default=None,
        help="seconds between per-pool timer runs (status, metrics, autoscaling); default 10",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    import os

    if args.timer_interval is not None:
        os.environ["KVPOOL_TIMER_INTERVAL"] = str(args.timer_interval)

    import kopf

    from kvpool_operator import handlers

    kopf.configure(verbose=args.verbose)
    kopf.run(
        standalone=args.standalone,
        peering_name=args.peering,
        priority=args.priority,
        namespaces=list(args.namespace),
        clusterwide=not args.namespace,
        liveness_endpoint=args.liveness,
        registry=handlers.registry,
    )
    return 0
