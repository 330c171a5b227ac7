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
    parser.add_argument(
        "--allowed-image-prefix",
        action="append",
        default=[],
        metavar="PREFIX",
        help="run only pools whose spec.pod.image starts with PREFIX (repeatable; end it "
        "with '/' to allow one repository path, e.g. registry.example.com/kvpool/); "
        "default: any image",
    )
    parser.add_argument(
        "--allow-foreign-handoff-peers",
        action="store_true",
        help="let pools list handoff peers that are not their own pods (default: refused, "
        "since a handoff sends cache contents to the peer)",
    )
    parser.add_argument(
        "--allow-node-sockets",
        action="store_true",
        help="let pools set spec.pod.nodeSocket: the agents' transfer socket in a directory "
        "of their node (a hostPath volume, and an init container running as root that hands "
        "it to the agent's user); default: refused",
    )
    parser.add_argument(
        "--operator-namespace",
        default=None,
        help="the operator's own namespace, admitted by the pools' NetworkPolicies "
        "(default: $POD_NAMESPACE)",
    )
    parser.add_argument(
        "--operator-pod-labels",
        default=None,
        metavar="K=V[,K=V...]",
        help="labels of the operator's own pods, admitted by the pools' NetworkPolicies to "
        "scrape the agents' /metrics (the chart sets them)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    import os

    if args.timer_interval is not None:
        os.environ["KVPOOL_TIMER_INTERVAL"] = str(args.timer_interval)

    from kvpool_operator.policy import OperatorPolicy, parse_labels

    try:
        labels = parse_labels(args.operator_pod_labels or "")
    except ValueError as err:
        raise SystemExit(f"kvpool operator: --operator-pod-labels: {err}") from None
    policy = OperatorPolicy(
        allowed_image_prefixes=tuple(p for p in args.allowed_image_prefix if p),
        allow_foreign_handoff_peers=args.allow_foreign_handoff_peers,
        allow_node_sockets=args.allow_node_sockets,
        operator_namespace=args.operator_namespace or os.environ.get("POD_NAMESPACE") or None,
        operator_pod_labels=labels,
    )
    # kopf runs the handlers' start-up, which reads these back (OperatorPolicy.from_environment).
    os.environ.update(policy.to_environment())

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
