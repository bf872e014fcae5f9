"""Layout changes between placements: each a named function returning the move or None.

A move turns one placement of a tensor into another. `fwd` is the collective it runs in the
forward pass and `bwd` its autograd dual in the backward pass (None: local, no communication).
The gradient forms (see placement.py) decide the duals:

    move                 forward                   backward (dual)
    all_reduce           P -> R   all-reduce       R's partial grad -> full grad: all-reduce
    all_reduce           P -> D   all-reduce       D's grad is already full: nothing
    all_gather(d)        S -> R   all-gather       partial grad -> shard: reduce-scatter
    all_gather(d)        S -> D   all-gather       full grad -> shard: local slice
    reduce_scatter(d)    P -> S   reduce-scatter   shard grad -> full grad: all-gather
    all_to_all(a, b)     S(a) -> S(b)              S(b) grad -> S(a) grad: all-to-all
    slice(d)             R -> S   local slice      shard grad zero-padded = partial grad: local
    slice(d)             D -> S   local slice      D needs the full grad: all-gather
    duplicate            R -> D   identity         full grad -> partial grad: device 0 keeps it, local
    replicate            D -> R   identity         partial grad -> full grad: all-reduce (Megatron's f)
    zero_partial         R|D -> P value on device 0, zeros elsewhere; grad of P is full: local

all_gather comes in two implementations, padded (one all-gather of equal, padded shards) and
grouped (one broadcast per device); the search tries both and keeps the cheaper under the
current ratios (HAP section 4.4).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..placement import D, P, Placement, R

AG_PADDED, AG_GROUPED = "all_gather_padded", "all_gather_grouped"


@dataclass(frozen=True, slots=True)
class Move:
    name: str
    src: Placement
    dst: Placement
    fwd: str | None
    """Forward collective: all_reduce, all_gather_padded, all_gather_grouped, reduce_scatter, all_to_all."""
    bwd: str | None
    """Backward collective (the dual), same names."""

    @property
    def communicates(self) -> bool:
        return self.fwd is not None or self.bwd is not None


def all_reduce(src: Placement, dst: Placement) -> Move | None:
    if src == P and dst in (R, D):
        return Move("all_reduce", src, dst, "all_reduce", "all_reduce" if dst == R else None)
    return None


def all_gather_padded(src: Placement, dst: Placement) -> Move | None:
    if src.is_shard and dst in (R, D):
        return Move("all_gather", src, dst, AG_PADDED, "reduce_scatter" if dst == R else None)
    return None


def all_gather_grouped(src: Placement, dst: Placement) -> Move | None:
    if src.is_shard and dst in (R, D):
        return Move("grouped_broadcast", src, dst, AG_GROUPED, "reduce_scatter" if dst == R else None)
    return None


def reduce_scatter(src: Placement, dst: Placement) -> Move | None:
    if src == P and dst.is_shard:
        return Move("reduce_scatter", src, dst, "reduce_scatter", AG_PADDED)
    return None


def all_to_all(src: Placement, dst: Placement) -> Move | None:
    if src.is_shard and dst.is_shard and src.dim != dst.dim:
        return Move("all_to_all", src, dst, "all_to_all", "all_to_all")
    return None


def slice_local(src: Placement, dst: Placement) -> Move | None:
    if src in (R, D) and dst.is_shard:
        return Move("slice", src, dst, None, AG_PADDED if src == D else None)
    return None


def duplicate(src: Placement, dst: Placement) -> Move | None:
    return Move("duplicate", src, dst, None, None) if (src, dst) == (R, D) else None


def replicate(src: Placement, dst: Placement) -> Move | None:
    return Move("replicate", src, dst, None, "all_reduce") if (src, dst) == (D, R) else None


def zero_partial(src: Placement, dst: Placement) -> Move | None:
    return Move("zero_partial", src, dst, None, None) if src in (R, D) and dst == P else None


MOVES = (all_reduce, all_gather_padded, all_gather_grouped, reduce_scatter, all_to_all, slice_local,
         duplicate, replicate, zero_partial)


def moves_between(src: Placement, dst: Placement, needs_grad: bool) -> list[Move]:
    """Every single move from src to dst. Without gradients R and D coincide (only R is used)."""
    return list(_moves_between(src, dst, needs_grad))


@functools.lru_cache(maxsize=None)
def _moves_between(src: Placement, dst: Placement, needs_grad: bool) -> tuple[Move, ...]:
    found = [mv for f in MOVES if (mv := f(src, dst)) is not None]
    if not needs_grad:
        found = [Move(m.name, m.src, m.dst, m.fwd, None) for m in found]
    return tuple(found)


def rebalance(p: Placement) -> Move:
    """At a segment boundary a sharded tensor is re-split to the next segment's ratios."""
    return Move("rebalance", p, p, "all_to_all", "all_to_all")
