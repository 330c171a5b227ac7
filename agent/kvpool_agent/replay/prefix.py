"""A trace as paths in a prefix tree of dense node numbers.

Hash ids are prefix-unique in the shipped traces, but nothing forces a trace to be: a node
here is keyed by (parent node, hash id), which is what the cache engine's radix tree does
with token content. Dense numbers let the simulators use flat lists instead of dicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool_agent.traces import Trace


@dataclass(frozen=True, slots=True)
class PrefixPaths:
    """Each request as the list of its tree nodes, plus each node's parent (-1 for roots)."""

    paths: list[list[int]]
    parent: list[int]

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def total_blocks(self) -> int:
        return sum(len(p) for p in self.paths)


def prefix_paths(trace: Trace) -> PrefixPaths:
    """Number the trace's blocks as prefix-tree nodes, in order of first appearance."""
    index: dict[tuple[int, int], int] = {}
    parent: list[int] = []
    paths: list[list[int]] = []
    for request in trace.requests:
        node = -1
        path: list[int] = []
        for h in request.hash_ids:
            key = (node, h)
            child = index.get(key)
            if child is None:
                child = index[key] = len(parent)
                parent.append(node)
            node = child
            path.append(node)
        paths.append(path)
    return PrefixPaths(paths, parent)
