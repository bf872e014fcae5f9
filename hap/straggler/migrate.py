"""Lightweight workload migration (seed 002, section IV-A): a straggler hands the last `count`
contraction columns of a tensor-parallel linear layer to the normal ranks, exactly.

For y_k = x_k W_k^T on straggler k, the columns H = [start, start + count) are split among the
receivers; receiver r computes z_r = x_k[..., H_r] W_k[:, H_r]^T, and since the contraction is
a sum, y_k = x_k[..., C] W_k[:, C]^T + sum_r z_r. Two ways to move the data:

    broadcast-reduce   k broadcasts W_k[:, H] (and x_k[..., H] where x is split, row-parallel);
                       each receiver takes its part; the results come back by a reduce to k.
                       Row-parallel outputs are partial sums anyway: a receiver adds z_r to its
                       own, and the layer's existing all-reduce does the reduce (the paper's
                       reduce merging). In the backward the same holds for the input gradient of
                       a column-parallel layer (a partial sum over ranks, all-reduced anyway).
                       The backward's other results are disjoint column blocks (each receiver's
                       columns of k's weight and input gradients): their reduce is a gather of
                       the blocks. A reduce runs as a gather and a sum at k (`reduce`).
    scatter-gather     k scatters each receiver only its part (padded to the largest, as gloo
                       and NCCL need); the results are gathered to k, which adds them up.

Receivers are found by the paper's renumbering r' = (r + e - k) mod e: in that order, the
first receiver takes the first columns. Only the ranks the decision names receive (never a
rank that hands over, nor, in SEMI, one that prunes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from ..runtime.collectives import Comm, global_rank
from ..runtime import wire

Method = Literal["broadcast-reduce", "scatter-gather"]
METHODS: tuple[Method, ...] = ("broadcast-reduce", "scatter-gather")


@dataclass(frozen=True, slots=True)
class Handover:
    """One straggler's migrated columns of one layer and who computes them."""

    straggler: int
    start: int
    """The first handed-over contraction column (the straggler keeps [0, start))."""
    count: int
    receivers: tuple[int, ...]
    """In renumbered order; receiver i computes the i-th part (`part`)."""

    def part(self, rank: int) -> tuple[int, int] | None:
        """[lo, hi) within the handed-over columns that `rank` computes, or None."""
        if rank not in self.receivers:
            return None
        i, n = self.receivers.index(rank), len(self.receivers)
        base, extra = divmod(self.count, n)
        lo = i * base + min(i, extra)
        return lo, lo + base + (i < extra)


def receivers_of(straggler: int, world: int, excluded: Sequence[int] = ()) -> tuple[int, ...]:
    """The ranks that take a straggler's columns, by r' = (r + e - k) mod e, without `excluded`."""
    order = sorted(range(world), key=lambda r: (r + world - straggler) % world)
    return tuple(r for r in order if r != straggler and r not in excluded)


def handover(straggler: int, columns: int, fraction: float, receivers: tuple[int, ...]) -> Handover | None:
    """Hand over round(fraction * columns) of the straggler's last contraction columns (None:
    nothing to hand over, or nobody to take it)."""
    count = max(0, min(columns, round(fraction * columns)))
    if count == 0 or not receivers:
        return None
    return Handover(straggler=straggler, start=columns - count, count=count, receivers=receivers)


def reduce(t: torch.Tensor, dst: int, comm: Comm) -> torch.Tensor:
    """Sum `t` over ranks into rank dst's `t` (in place there), as a gather and a sum at dst:
    gloo's reduce costs 3-4x a gather of as many bytes here (about as much as an all-reduce)."""
    parts = gather(t, dst, comm)
    if comm.rank == dst:
        t.copy_(torch.stack(parts).sum(0))
    return t


def scatter(chunks: list[torch.Tensor] | None, like: torch.Tensor, src: int, comm: Comm) -> torch.Tensor:
    """Rank src's chunks[r] to each rank r (all of `like`'s shape); returns this rank's."""
    out = torch.empty_like(like)
    comm.before()
    wire.scatter(out, chunks if comm.rank == src else None, src=global_rank(comm, src), group=comm.group)
    comm.after("scatter", out.numel() * out.element_size() * comm.world)
    return out


def gather(t: torch.Tensor, dst: int, comm: Comm) -> list[torch.Tensor] | None:
    """Every rank's `t` (same shape) at rank dst, in rank order; None elsewhere."""
    out = [torch.empty_like(t) for _ in range(comm.world)] if comm.rank == dst else None
    comm.before()
    wire.gather(t.contiguous(), out, dst=global_rank(comm, dst), group=comm.group)
    comm.after("gather", t.numel() * t.element_size() * comm.world)
    return out
