"""Every layout move on real gloo processes: forward and backward dual against the identity.

A move changes how a tensor is laid out, never its value, so for a global X and a global
gradient G: the output must hold X in the destination placement, and the input's gradient
must hold G in the source placement's gradient form (placement.py): S(d) a shard of G, P and D
the whole G, R parts that sum to G. Shards are uneven (60/40, and 3/0/2 with an empty shard),
partial values are split into random parts, and everything is float64 so equality is exact up
to summation order.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
from gloo import run_ranks

from hap.placement import D, P, R, S
from hap.runtime.collectives import Comm, run_move
from hap.search.moves import Move, moves_between, rebalance

SHAPE = (5, 4, 3)
SPLITS = {  # world -> per-dim shard sizes
    2: {0: (3, 2), 1: (3, 1), 2: (2, 1)},
    3: {0: (3, 0, 2), 1: (1, 2, 1), 2: (0, 1, 2)},
}
RESPLIT = {2: ((3, 2), (1, 4)), 3: ((3, 0, 2), (1, 3, 1))}  # dim 0: old sizes -> new sizes
PLACEMENTS = (S(0), S(1), S(2), R, D, P)


def cases(world):
    out = []
    for src, dst in itertools.product(PLACEMENTS, PLACEMENTS):
        for mv in moves_between(src, dst, needs_grad=True):
            out.append((mv, SPLITS[world].get(src.dim), SPLITS[world].get(dst.dim)))
    old, new = RESPLIT[world]
    out.append((rebalance(S(0)), old, new))
    return out


def parts(full, world, gen):
    """Random parts that sum to `full` (a partial-sum layout)."""
    noise = [torch.randn(full.shape, generator=gen, dtype=torch.float64) for _ in range(world - 1)]
    return [full - sum(noise, torch.zeros_like(full)), *noise]


def local(full, p, sizes, rank, partial_parts):
    """This rank's tensor when `full` is laid out as p (P and R use the given parts)."""
    if p.is_shard:
        return full.narrow(p.dim, sum(sizes[:rank]), sizes[rank]).clone()
    return partial_parts[rank].clone() if p.kind == "P" else full.clone()


def check_whole(t, full, p, sizes, comm):
    """Does this rank's t hold `full` laid out as p? (P: the sum over ranks.)"""
    if p.is_shard:
        return torch.allclose(t, full.narrow(p.dim, sum(sizes[:comm.rank]), sizes[comm.rank]), atol=1e-12)
    if p.kind == "P":
        total = t.detach().clone()
        dist.all_reduce(total)
        return torch.allclose(total, full, atol=1e-12)
    return torch.allclose(t, full, atol=1e-12)


GRAD_FORM = {"R": P, "D": D, "P": D}  # the gradient of R is a partial sum; of P and D whole


def worker(rank, world):
    comm = Comm.default()
    failures = []
    for i, (mv, src_sizes, dst_sizes) in enumerate(cases(world)):
        gen = torch.Generator().manual_seed(1000 + i)
        X = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
        G = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
        x_parts, g_parts = parts(X, world, gen), parts(G, world, gen)
        x = local(X, mv.src, src_sizes, rank, x_parts).requires_grad_(True)
        y = run_move(x, mv, comm, src_sizes, dst_sizes)
        what = f"{mv.name} {mv.src}->{mv.dst}"
        if not check_whole(y, X, mv.dst, dst_sizes, comm):
            failures.append(f"{what}: forward")
        g_form = mv.dst if mv.dst.is_shard else GRAD_FORM[mv.dst.kind]
        y.backward(local(G, g_form, dst_sizes, rank, g_parts))
        x_form = mv.src if mv.src.is_shard else GRAD_FORM[mv.src.kind]
        if x.grad is None or not check_whole(x.grad, G, x_form, src_sizes, comm):
            failures.append(f"{what}: backward")
    return {"cases": len(cases(world)), "failures": failures}


@pytest.mark.parametrize("world", [2, 3])
def test_every_move_and_its_dual_on_gloo(world, tmp_path):
    reports = run_ranks(worker, world, tmp_path)
    assert reports[0]["cases"] >= 30  # every placement pair's moves, both gather kinds, a rebalance
    assert all(not r["failures"] for r in reports), [r["failures"] for r in reports]


def test_moves_cover_every_runtime_collective():
    names = {mv.name for src, dst in itertools.product(PLACEMENTS, PLACEMENTS) for mv in moves_between(src, dst, True)}
    assert names == {"all_reduce", "all_gather", "grouped_broadcast", "reduce_scatter", "all_to_all", "slice",
                     "duplicate", "replicate", "zero_partial"}


def test_a_move_without_a_runtime_is_an_error():
    with pytest.raises(ValueError, match="no runtime for move 'teleport'"):
        run_move(torch.zeros(2), Move("teleport", R, D, None, None), Comm(rank=0, world=1))


def test_every_move_has_a_runtime_and_its_collectives_a_price():
    """The move registry: every move the search can make (between any two placements, with
    and without gradients, and the segment rebalance) runs through MOVE_RUNTIMES, and every
    collective it names, forward or dual, is priced by COLLECTIVE_PRICES."""
    from hap.cost.model import COLLECTIVE_PRICES
    from hap.placement import D, P, R, S
    from hap.runtime.collectives import MOVE_RUNTIMES
    from hap.search.moves import moves_between, rebalance

    places = [R, D, P, S(0), S(1), S(2)]
    made = {mv for a in places for b in places if a != b for g in (True, False) for mv in moves_between(a, b, g)}
    made |= {rebalance(S(0)), rebalance(S(1))}
    assert {mv.name for mv in made} == set(MOVE_RUNTIMES)  # no move without a runtime, no runtime unused
    kinds = {k for mv in made for k in (mv.fwd, mv.bwd) if k}
    assert kinds == set(COLLECTIVE_PRICES)
