"""Shard classes: which tensor dims must be split alike, and into how many granules.

A strategy that shards several dims at once (x on dim 0 and the output on dim 0; the merged
dim of a reshape and its outermost source dim) needs their shards to line up. We union all
dims a strategy shards together; a class of dims with lengths L1..Lk is split in
N = gcd(L1..Lk) granules, and a dim of length L gets (L / N) * n_j elements on device j,
where n = round_sizes(N, ratios). So the rows of a [B, S] tensor and of its [B*S] view are
split at the same sequence boundaries, and 12 heads and their 768 hidden features at the
same head boundaries, whatever the ratios.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from ..ir import Graph
from . import Strategy


def round_sizes(n: int, ratios: Sequence[float]) -> list[int]:
    """Integer sizes summing to n, nearest to n * ratios (HAP section 5.1).

    Start from the nearest integers; while the sum is off, move one unit on the shard whose
    rounding error grows least.
    """
    if n < 0:
        raise ValueError(f"cannot split a negative length {n}")
    total = float(sum(ratios))
    if not 0 < total < math.inf or any(r < 0 for r in ratios):
        raise ValueError(f"ratios must be non-negative with a positive, finite sum, got {list(ratios)}")
    ideal = [n * r / total for r in ratios]
    if not all(map(math.isfinite, ideal)):  # a share near the float limit: n * r overflows (and only then
        ideal = [r / total * n for r in ratios]  # this order, which rounds ties otherwise)
    sizes = [int(round(x)) for x in ideal]
    while (diff := sum(sizes) - n) != 0:
        step = -1 if diff > 0 else 1
        # Errors are compared at 1e-9 so that ties (exact in real arithmetic) go to the first shard.
        growth = [(round(abs(k + step - x) - abs(k - x), 9), j) for j, (k, x) in enumerate(zip(sizes, ideal)) if k + step >= 0]
        sizes[min(growth)[1]] += step
    return sizes


class ShardClasses:
    """Union-find over (tensor, dim) pairs, built from every strategy of every node."""

    def __init__(self, graph: Graph, strategies: Iterable[tuple[int, list[Strategy]]]):
        self._parent: dict[tuple[str, int], tuple[str, int]] = {}
        for node_index, sts in strategies:
            node = graph.nodes[node_index]
            for st in sts:
                dims = [(t, p.dim) for t, p in zip(node.inputs, st.inputs) if p.kind == "S"]
                dims += [(t, p.dim) for t, p in zip(node.outputs, st.outputs) if p.kind == "S"]
                for a in dims[1:]:
                    self._union(dims[0], a)
                if dims:
                    self._find(dims[0])
        self.granules: dict[tuple[str, int], int] = {}
        for key in list(self._parent):
            root = self._find(key)
            length = graph.tensors[key[0]].shape[key[1]]
            self.granules[root] = math.gcd(self.granules.get(root, 0), length)
        self._graph = graph
        self._rounded: dict[tuple[int, tuple[float, ...]], tuple[int, ...]] = {}

    def _find(self, a):
        parent = self._parent.setdefault(a, a)
        while parent != a:
            grand = self._parent.setdefault(parent, parent)
            self._parent[a] = grand
            a, parent = parent, grand
        return a

    def _union(self, a, b):
        ra, rb = self._find(a), self._find(b)
        if ra != rb:
            self._parent[rb] = ra

    def class_of(self, tensor: str, dim: int) -> tuple[str, int]:
        """The class representative; a dim no strategy shards is a class of its own."""
        return self._find((tensor, dim))

    def granule_count(self, tensor: str, dim: int) -> int:
        root = self.class_of(tensor, dim)
        # an empty dim (length 0) is one granule of nothing: every device's shard is empty
        return self.granules.get(root) or max(self._graph.tensors[tensor].shape[dim], 1)

    def split_sizes(self, tensor: str, dim: int, ratios: Sequence[float]) -> list[int]:
        n = self.granule_count(tensor, dim)
        unit = self._graph.tensors[tensor].shape[dim] // n
        return [unit * k for k in self.granules_per_device(n, ratios)]

    def granules_per_device(self, n: int, ratios: Sequence[float]) -> tuple[int, ...]:
        """round_sizes(n, ratios), remembered: a plan splits many dims of the same granule count."""
        key = (n, tuple(ratios))
        found = self._rounded.get(key)
        if found is None:
            found = self._rounded[key] = tuple(round_sizes(n, ratios))
        return found

    def shares(self, tensor: str, dim: int, ratios: Sequence[float]) -> tuple[float, ...]:
        """Fraction of the dim on each device after rounding."""
        n = self.granule_count(tensor, dim)
        return tuple(k / n for k in self.granules_per_device(n, ratios))
