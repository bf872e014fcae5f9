"""Which candidates to run (AutoSync supplement, section 7, Eq. 11).

    min over K of the M candidates:  sum_i f(S_i) + alpha * sum_i sum_j sim(S_i, S_j)

trades a low predicted time (f, normalized to the best candidate's) against trying strategies
unlike each other; solved greedily (a submodular minimization): add, one at a time, the candidate
that raises the objective least.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .strategy import SyncStrategy


def select(candidates: Sequence[SyncStrategy], predicted: Sequence[float], k: int, alpha: float,
           sim: Callable[[int, int], float]) -> list[int]:
    """Indices of k candidates; `sim(i, j)` the similarity (0..1) of candidates i and j."""
    if len(candidates) != len(predicted):
        raise ValueError(f"{len(candidates)} candidates but {len(predicted)} predictions")
    if k < 0:
        raise ValueError(f"k must be at least 0, got {k}")
    best = min(predicted, default=1.0)
    scale = best if best > 0 else 1.0
    f = [p / scale for p in predicted]
    chosen: list[int] = []
    left = set(range(len(candidates)))
    while left and len(chosen) < k:
        i = min(left, key=lambda c: (f[c] + alpha * (1.0 + 2.0 * sum(sim(c, s) for s in chosen)), c))
        chosen.append(i)
        left.remove(i)
    return chosen
