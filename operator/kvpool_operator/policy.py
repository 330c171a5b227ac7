"""What the operator lets a pool ask for, beyond what the CRD validates.

A pool's author is not necessarily trusted with the cluster: the agent pods run the image the
pool names and send cache contents to the handoff peers it lists. The operator's own options
(``kvpool operator`` flags, chart values) bound both; a pool outside them is not applied and
is marked Degraded with a warning event naming the field.

``kvpool operator`` passes its flags to the handlers through environment variables (kopf
imports the handlers before any of our code runs), read once per operator start by
``OperatorPolicy.from_environment``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpool_operator.children import OperatorPeer, node_socket_dir, own_peer_url, peer_urls
from kvpool_operator.models import KVCachePool
from kvpool_operator.status import Problem

log = logging.getLogger(__name__)

ENV_IMAGE_PREFIXES = "KVPOOL_ALLOWED_IMAGE_PREFIXES"
"""JSON list of allowed image prefixes; unset or empty: any image."""
ENV_FOREIGN_PEERS = "KVPOOL_ALLOW_FOREIGN_HANDOFF_PEERS"
"""``1``: pools may list handoff peers outside the pool."""
ENV_NODE_SOCKETS = "KVPOOL_ALLOW_NODE_SOCKETS"
"""``1``: pools may set spec.pod.nodeSocket (a hostPath volume, a root init container)."""
ENV_OPERATOR_NAMESPACE = "KVPOOL_OPERATOR_NAMESPACE"
ENV_POD_NAMESPACE = "POD_NAMESPACE"
"""The operator's namespace when KVPOOL_OPERATOR_NAMESPACE is unset (the chart sets it)."""
ENV_OPERATOR_POD_LABELS = "KVPOOL_OPERATOR_POD_LABELS"
"""``k=v,k=v``: labels of the operator's pods, admitted by each pool's NetworkPolicy."""

IMAGE_NOT_ALLOWED = "ImageNotAllowed"
HANDOFF_PEER_NOT_ALLOWED = "HandoffPeerNotAllowed"
NODE_SOCKET_NOT_ALLOWED = "NodeSocketNotAllowed"


def parse_labels(text: str) -> dict[str, str]:
    """``a=b,c=d`` -> ``{"a": "b", "c": "d"}``; ValueError naming a malformed pair."""
    labels: dict[str, str] = {}
    for pair in (p.strip() for p in text.split(",")):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"label {pair!r}: expected KEY=VALUE")
        labels[key.strip()] = value.strip()
    return labels


def format_labels(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


@dataclass(frozen=True)
class OperatorPolicy:
    """The operator's bounds on pools, and what it knows about its own pods."""

    allowed_image_prefixes: tuple[str, ...] = ()
    """``spec.pod.image`` must start with one of these; empty: any image."""
    allow_foreign_handoff_peers: bool = False
    """False: ``spec.agent.lifecycle.handoffPeers`` may name only the pool's own pods."""
    allow_node_sockets: bool = False
    """False: ``spec.pod.nodeSocket`` is refused (it mounts a directory of the node)."""
    operator_namespace: str | None = None
    operator_pod_labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def operator_peer(self) -> OperatorPeer | None:
        """The operator's pods for the pools' NetworkPolicies; None when not known (an
        operator run outside the cluster: nothing to admit)."""
        if not self.operator_namespace or not self.operator_pod_labels:
            return None
        return OperatorPeer(self.operator_namespace, dict(self.operator_pod_labels))

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> OperatorPolicy:
        env = os.environ if env is None else env
        raw = env.get(ENV_IMAGE_PREFIXES, "").strip()
        prefixes = json.loads(raw) if raw else []
        if not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes):
            raise ValueError(f"{ENV_IMAGE_PREFIXES} must be a JSON list of strings")
        namespace = env.get(ENV_OPERATOR_NAMESPACE) or env.get(ENV_POD_NAMESPACE) or None
        return cls(
            allowed_image_prefixes=tuple(p for p in prefixes if p),
            allow_foreign_handoff_peers=env.get(ENV_FOREIGN_PEERS, "") in ("1", "true"),
            allow_node_sockets=env.get(ENV_NODE_SOCKETS, "") in ("1", "true"),
            operator_namespace=namespace,
            operator_pod_labels=parse_labels(env.get(ENV_OPERATOR_POD_LABELS, "")),
        )

    def to_environment(self) -> dict[str, str]:
        """The variables ``from_environment`` reads back (what ``kvpool operator`` sets)."""
        env = {
            ENV_IMAGE_PREFIXES: json.dumps(list(self.allowed_image_prefixes)),
            ENV_FOREIGN_PEERS: "1" if self.allow_foreign_handoff_peers else "0",
            ENV_NODE_SOCKETS: "1" if self.allow_node_sockets else "0",
        }
        if self.operator_namespace:
            env[ENV_OPERATOR_NAMESPACE] = self.operator_namespace
        if self.operator_pod_labels:
            env[ENV_OPERATOR_POD_LABELS] = format_labels(self.operator_pod_labels)
        return env

    def violation(self, pool: KVCachePool) -> Problem | None:
        """The first thing in the pool the operator will not run, or None."""
        image = pool.spec.pod.image
        prefixes = self.allowed_image_prefixes
        if prefixes and not any(image.startswith(p) for p in prefixes):
            return Problem(
                IMAGE_NOT_ALLOWED,
                f"spec.pod.image {image!r} is not allowed: the operator runs only images "
                f"starting with {', '.join(repr(p) for p in prefixes)}",
            )
        if pool.spec.pod.node_socket and not self.allow_node_sockets:
            return Problem(
                NODE_SOCKET_NOT_ALLOWED,
                "spec.pod.nodeSocket is not allowed: it mounts a directory of the node "
                f"({node_socket_dir(pool)}) and runs an init container as root to hand it to "
                "the agent; the operator must be started with --allow-node-sockets (chart "
                "value operator.allowNodeSockets)",
            )
        if not self.allow_foreign_handoff_peers:
            peers = pool.spec.agent.lifecycle.handoff_peers
            for i, url in enumerate(peers):
                if not own_peer_url(pool, url):
                    example = peer_urls(pool, 1)[0]
                    return Problem(
                        HANDOFF_PEER_NOT_ALLOWED,
                        f"spec.agent.lifecycle.handoffPeers[{i}] {url!r} is not a pod of this "
                        f"pool: handoff sends cache contents, so peers must be the pool's own "
                        f"pods (like {example}), or leave handoffPeers empty to have the "
                        "operator list them",
                    )
        return None
