"""Prioritized experience replay (Schaul et al., 2016) on a sum tree, as Auto-MAP uses it
(seed 004, section 4: alpha 0.2, beta 0.6, 2000 transitions).

A transition i is drawn with probability p_i^alpha / sum_j p_j^alpha and weighted by
(N P(i))^-beta / max_j (N P(j))^-beta, which undoes the bias of drawing it more often.

    buf = PrioritizedReplay(capacity=2000, alpha=0.2, beta=0.6, seed=0)
    buf.add(transition)                        # new ones get the largest priority seen
    idx, batch, weights = buf.sample(32)
    buf.update(idx, td_errors)                 # priority |delta| + eps
"""

from __future__ import annotations

import random
from typing import Any, Sequence


class SumTree:
    """Leaves hold non-negative priorities; each inner node the sum of its two children, so
    the total is the root and `find` descends to the leaf whose prefix-sum interval holds a
    value, in O(log n)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.size = 1
        while self.size < capacity:
            self.size *= 2
        self.nodes = [0.0] * (2 * self.size)  # nodes[1] is the root; leaf i is nodes[size + i]

    @property
    def total(self) -> float:
        return self.nodes[1]

    def __getitem__(self, i: int) -> float:
        return self.nodes[self.size + i]

    def set(self, i: int, priority: float) -> None:
        if not 0 <= i < self.capacity:
            raise IndexError(f"leaf {i} outside 0..{self.capacity - 1}")
        if priority < 0 or priority != priority:
            raise ValueError(f"a priority must be a non-negative number, got {priority}")
        j = self.size + i
        self.nodes[j] = priority
        j //= 2
        while j:
            self.nodes[j] = self.nodes[2 * j] + self.nodes[2 * j + 1]
            j //= 2

    def find(self, value: float) -> int:
        """The leaf i with prefix(i) <= value < prefix(i) + p_i (value in [0, total))."""
        j = 1
        while j < self.size:
            left = self.nodes[2 * j]
            if value < left or self.nodes[2 * j + 1] == 0.0:
                j = 2 * j
            else:
                value -= left
                j = 2 * j + 1
        return j - self.size


class PrioritizedReplay:
    def __init__(self, capacity: int = 2000, alpha: float = 0.2, beta: float = 0.6, eps: float = 1e-3, seed: int = 0):
        self.tree, self.capacity = SumTree(capacity), capacity
        self.alpha, self.beta, self.eps = alpha, beta, eps
        self.items: list[Any] = []
        self.next = 0  # where the next transition goes (oldest overwritten first)
        self.top = 1.0  # the largest priority seen: new transitions are drawn at least once soon
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: Any) -> None:
        if len(self.items) < self.capacity:
            self.items.append(item)
        else:
            self.items[self.next] = item
        self.tree.set(self.next, self.top ** self.alpha)
        self.next = (self.next + 1) % self.capacity

    def sample(self, n: int) -> tuple[list[int], list[Any], list[float]]:
        """n transitions by priority (stratified: one from each of n equal slices of the
        total), with their normalized importance weights."""
        if not self.items:
            raise ValueError("sample from an empty replay buffer")
        total, count = self.tree.total, len(self.items)
        idx = [min(self.tree.find(self.rng.uniform(k * total / n, (k + 1) * total / n)), count - 1) for k in range(n)]
        probs = [self.tree[i] / total for i in idx]
        weights = [(count * p) ** -self.beta for p in probs]
        top = max(weights)
        return idx, [self.items[i] for i in idx], [w / top for w in weights]

    def update(self, idx: Sequence[int], errors: Sequence[float]) -> None:
        for i, e in zip(idx, errors):
            p = abs(float(e)) + self.eps
            self.top = max(self.top, p)
            self.tree.set(i, p ** self.alpha)
