"""ZERO-resizing (seed 002, section III): a straggler prunes gamma of the contraction columns of
its linear layers, in the forward and the backward, and imputes zeros for what is missing.

For y = x W^T + b with x [..., K] and this rank's weight W [N, K] (column-parallel: K whole;
row-parallel: this rank's slice of K), pruning the columns P keeps C = {0..K-1} \\ P:

    y        = x[..., C] W[:, C]^T + b                   same shape as unpruned: [..., N]
    dL/dW    = restore(dY^T x[..., C])                   [N, K], zeros in the columns P
    dL/dx    = restore(dY W[:, C])                       [..., K], zeros in the columns P

`Lineage` (layer, matrix, P) is what maps column j of a pruned gradient back to column C[j] of
its weight (the paper's lookup table): without it the gradient could not update the weight.
Which columns: `RandomSelector` (ZERO-Rd), `PrioritySelector` (ZERO-Pri: the smallest weight
variation, with the incremental update that keeps pruned columns' statistics so a column
once pruned is not pruned forever), and `PrioritySelector.layer_ratio` (ZERO-PriDiff: per-layer
ratios from how many columns vary less than theta = N_iter * theta_iter).
Pruning is an approximation: training is no longer one device's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Lineage:
    """Which contraction columns of one layer's matrices were pruned this iteration."""

    layer: str
    """The linear node (graph node name)."""
    matrix: str
    """Its weight (graph tensor name); the input matrix prunes the same columns."""
    pruned: torch.Tensor
    """P: the pruned column indices, ascending (int64)."""
    kept: torch.Tensor
    """C: the other columns, ascending: column j of a pruned matrix is column kept[j] of the whole."""
    columns: int
    """K: the contraction length before pruning."""

    @classmethod
    def of(cls, layer: str, matrix: str, kept: torch.Tensor, columns: int) -> "Lineage":
        mask = torch.ones(columns, dtype=torch.bool, device=kept.device)
        mask[kept] = False
        return cls(layer, matrix, mask.nonzero().flatten(), kept, columns)

    def restore(self, pruned: torch.Tensor, dim: int) -> torch.Tensor:
        """A pruned matrix back to K columns along `dim`: its columns where the lineage says,
        zeros (the imputed value) in the pruned ones."""
        assert pruned.shape[dim] == len(self.kept), (tuple(pruned.shape), dim, len(self.kept))
        shape = list(pruned.shape)
        shape[dim] = self.columns
        return pruned.new_zeros(shape).index_copy_(dim, self.kept, pruned)


class PrunedLinear(torch.autograd.Function):
    """y = x[..., C] W[:, C]^T + b, gradients restored to full size by the lineage (module docstring)."""

    @staticmethod
    def forward(ctx, x, w, b, lineage: Lineage):
        xp = x.index_select(-1, lineage.kept)  # [..., |C|]
        wp = w.index_select(1, lineage.kept)  # [N, |C|]
        ctx.save_for_backward(xp, wp)
        ctx.lineage, ctx.has_bias = lineage, b is not None
        return F.linear(xp, wp, b)  # [..., N]

    @staticmethod
    def backward(ctx, gy):
        xp, wp = ctx.saved_tensors
        lin = ctx.lineage
        gx = lin.restore(gy @ wp, -1) if ctx.needs_input_grad[0] else None  # [..., K]
        g2 = gy.reshape(math.prod(gy.shape[:-1]), gy.shape[-1])  # [T, N]
        gw = lin.restore(g2.t() @ xp.reshape(g2.shape[0], xp.shape[-1]), 1) if ctx.needs_input_grad[1] else None  # [N, K]
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def pruned_count(columns: int, gamma: float) -> int:
    """Columns to prune for ratio gamma: round(gamma * K), keeping at least one."""
    return max(0, min(columns - 1, round(gamma * columns)))


class RandomSelector:
    """ZERO-Rd: prune uniformly random columns, drawn anew every iteration (seeded per rank)."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def kept(self, layer: str, w: torch.Tensor, gamma: float, limit: int | None = None) -> torch.Tensor:
        """The columns kept, among the first `limit` (default all) of w's, ascending."""
        k = w.shape[1] if limit is None else limit
        keep = k - pruned_count(k, gamma)
        return torch.randperm(k, generator=self.gen)[:keep].sort().values.to(w.device)

    def observe(self, layer: str, w: torch.Tensor) -> None:
        pass

    def forget(self, layer: str) -> None:
        pass


@dataclass
class _Variation:
    snapshot: torch.Tensor
    """The weight at the last statistics update."""
    delta: torch.Tensor | None = None
    """w_var_list: per column, the mean absolute change of its entries since the update before."""
    kept: torch.Tensor | None = None
    """The columns kept at the last selection (the priority list)."""


@dataclass
class PrioritySelector:
    """ZERO-Pri: keep the columns whose weights changed most (they matter most to the next
    updates), prune the ones that changed least. Statistics are refreshed once per epoch
    (`observe`), incrementally: a column pruned at the last selection keeps its old variation,
    since its zero-imputed gradient would make it look unchanged and so pruned again, forever
    (the paper's endless loop). Until the first refresh it picks at random."""

    seed: int
    layers: dict[str, _Variation] = field(default_factory=dict)

    def __post_init__(self):
        self.fallback = RandomSelector(self.seed)

    def observe(self, layer: str, w: torch.Tensor) -> None:
        """An epoch ended: refresh the layer's variation statistics from its weight now."""
        w = w.detach()
        st = self.layers.get(layer)
        if st is None or st.snapshot.shape != w.shape:  # first sight, or resharded: start over
            self.layers[layer] = _Variation(snapshot=w.clone())
            return
        delta = (w - st.snapshot).abs().mean(0)  # [K]: Algorithm 1 line 4
        if st.delta is not None and st.kept is not None:
            pruned = torch.ones_like(delta, dtype=torch.bool)
            pruned[st.kept] = False
            delta = torch.where(pruned, st.delta, delta)  # lines 6-7: pruned columns keep theirs
        st.delta, st.snapshot = delta, w.clone()

    def forget(self, layer: str) -> None:
        """The layer ran unpruned: no column's statistics are to be kept back at the next refresh."""
        st = self.layers.get(layer)
        if st is not None:
            st.kept = None

    def kept(self, layer: str, w: torch.Tensor, gamma: float, limit: int | None = None) -> torch.Tensor:
        """The columns kept, among the first `limit` (default all) of w's, ascending; the ones
        past `limit` (handed over, exact) count as kept for the statistics."""
        st = self.layers.get(layer)
        k = w.shape[1] if limit is None else limit
        if st is None or st.delta is None or st.delta.numel() != w.shape[1]:
            keep = self.fallback.kept(layer, w, gamma, limit)
        else:
            keep = st.delta[:k].topk(k - pruned_count(k, gamma)).indices.sort().values  # lines 12-14
        if st is not None:
            st.kept = torch.cat([keep, torch.arange(k, w.shape[1], device=keep.device)])
        return keep

    def layer_ratio(self, layer: str, gamma: float, theta: float, alpha: float = 0.8, cap: float = 0.95) -> float:
        """ZERO-PriDiff's ratio for one layer: the share of its columns that varied less than
        theta, at least alpha * gamma (Algorithm 1 lines 9-11), at most `cap`."""
        st = self.layers.get(layer)
        if st is None or st.delta is None:
            return min(gamma, cap)
        if st.delta.numel() == 0:  # this rank holds none of the layer's columns: nothing to prune
            return 0.0
        varied = int((st.delta > theta).sum())
        return min(cap, max(1.0 - varied / st.delta.numel(), alpha * gamma))
