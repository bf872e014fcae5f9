"""Collectives on uneven shards, each with its autograd dual (the moves of search/moves.py, run).

Every function takes this rank's local tensor in the move's source placement and returns the
local tensor in its destination placement; the backward pass runs the dual, which turns the
gradient from the destination's gradient form into the source's (placement.py: S(d) and P
tensors get a shard / the full gradient, R a partial sum over ranks, D the full gradient):

    move                forward                            backward (dual)
    all_gather   S->R   padded all-gather or broadcasts    reduce-scatter
    all_gather   S->D   padded all-gather or broadcasts    local slice
    all_reduce   P->R   all-reduce                         all-reduce
    all_reduce   P->D   all-reduce                         nothing
    reduce_scatter      P->S  reduce-scatter               padded all-gather
    all_to_all          S(a)->S(b)                         all-to-all S(b)->S(a)
    rebalance           S(d)->S(d), new sizes              rebalance back
    slice        R->S   local slice                        zero-pad: a partial gradient
    slice        D->S   local slice                        all-gather
    duplicate    R->D   nothing                            rank 0 keeps it, others zeros
    replicate    D->R   nothing                            all-reduce (Megatron's f)
    zero_partial R->P   rank 0 keeps it, others zeros      rank 0 keeps it, others zeros
    zero_partial D->P   rank 0 keeps it, others zeros      nothing

gloo and NCCL both reject an all_gather of unequal tensors, so uneven shards are gathered in
one of two ways the planner chooses between (HAP section 4.4): pad every shard to the
largest and trim (`padded`), or broadcast each rank's shard from its owner (`grouped`).
Shards of length 0 are allowed everywhere. `sizes` are the per-rank lengths of the sharded
dim, the same list on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
import torch.distributed as dist

from ..placement import R
from ..search.moves import AG_GROUPED, Move
from . import ledger, wire
from .emulate import Emulation

Gather = Literal["padded", "grouped"]


@dataclass(slots=True)
class WaitClock:
    """Seconds a rank spends inside collectives: waiting for the other ranks, then transferring.
    A step's wall time less this is the rank's busy time, what cost.calibrate.calibrate_nodes fits."""

    seconds: float = 0.0
    entered: float | None = None


@dataclass(frozen=True, slots=True)
class Comm:
    """The ranks a program runs on: a process group and this rank's place in it."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None
    """None: the default group."""
    emulation: Emulation | None = None
    """This rank's emulated slowness (local cluster); None: run at full speed."""
    clock: WaitClock | None = None
    """Where to add the seconds spent inside collectives; None: not counted."""

    @classmethod
    def default(cls, emulation: Emulation | None = None) -> "Comm":
        return cls(rank=dist.get_rank(), world=dist.get_world_size(), emulation=emulation)

    def before(self) -> None:
        """Called before every blocking collective (and before waiting on an asynchronous one):
        an emulated slow device arrives late; then the rank waits."""
        self.launching()
        if self.clock is not None:
            self.clock.entered = time.perf_counter()

    def launching(self) -> None:
        """Called before starting an asynchronous collective: the rank arrives (late, if an
        emulated slow device) but goes on computing."""
        if self.emulation is not None:
            self.emulation.settle()

    def on_wire(self, kind: str, volume: float, devices=None, occupies: bool = True) -> float:
        """An asynchronous collective over `devices` (None: all) starts: when its emulated link
        time will be over (0: links not emulated). occupies: see Emulation.on_wire."""
        return self.emulation.on_wire(kind, volume, devices, occupies) if self.emulation is not None else 0.0

    def off_wire(self, ready_at: float) -> None:
        """That collective is done here; wait out its emulated link time, and count the wait."""
        if self.emulation is not None:
            self.emulation.off_wire(ready_at)
        if self.clock is not None and self.clock.entered is not None:
            self.clock.seconds += time.perf_counter() - self.clock.entered
            self.clock.entered = None

    def after(self, kind: str, volume: float) -> None:
        """Called after every collective with its cost-model volume in bytes (emulated links)."""
        if self.emulation is not None:
            self.emulation.communicated(kind, volume)
        if self.clock is not None and self.clock.entered is not None:
            self.clock.seconds += time.perf_counter() - self.clock.entered
            self.clock.entered = None


def _check_sizes(x: torch.Tensor, dim: int, sizes: Sequence[int], comm: Comm) -> None:
    if len(sizes) != comm.world:
        raise ValueError(f"{len(sizes)} shard sizes for {comm.world} ranks")
    if x.shape[dim] != sizes[comm.rank]:
        raise ValueError(f"rank {comm.rank}: local dim {dim} has length {x.shape[dim]}, the split says {sizes[comm.rank]}")


def _with_length(shape: Sequence[int], dim: int, n: int) -> list[int]:
    """`shape` with dim `dim` of length n."""
    out = list(shape)
    out[dim] = n
    return out


# -- the raw collectives (no autograd) ------------------------------------------------------------

def gather_padded(x: torch.Tensor, dim: int, sizes: Sequence[int], comm: Comm) -> torch.Tensor:
    """The whole tensor on every rank: one all-gather of shards padded to the largest."""
    if comm.world == 1:  # one rank holds everything: nothing to exchange
        return x
    _check_sizes(x, dim, sizes, comm)
    top = max(sizes)
    padded = x.new_zeros(_with_length(x.shape, dim, top))
    padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    parts = [torch.empty_like(padded) for _ in range(comm.world)]
    comm.before()
    wire.all_gather(parts, padded, group=comm.group)
    comm.after("all_gather", comm.world * _nbytes(padded))
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim)


def gather_grouped(x: torch.Tensor, dim: int, sizes: Sequence[int], comm: Comm) -> torch.Tensor:
    """The whole tensor on every rank: each rank's shard broadcast from it, unpadded."""
    if comm.world == 1:  # one rank holds everything: nothing to exchange
        return x
    _check_sizes(x, dim, sizes, comm)
    parts = []
    for owner, n in enumerate(sizes):
        part = x.contiguous() if owner == comm.rank else x.new_empty(_with_length(x.shape, dim, n))
        if n:
            comm.before()
            wire.broadcast(part, src=global_rank(comm, owner), group=comm.group)
            comm.after("broadcast", _nbytes(part))
        parts.append(part)
    return torch.cat(parts, dim)


def all_reduce(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum over ranks, on every rank."""
    if comm.world == 1:  # one rank holds everything: nothing to exchange
        return x.clone()
    out = x.contiguous().clone()
    comm.before()
    wire.all_reduce(out, group=comm.group)
    comm.after("all_reduce", _nbytes(out))
    return out


def broadcast(x: torch.Tensor, src: int, comm: Comm) -> torch.Tensor:
    """Rank src's `x` on every rank, in place (src: a rank of comm's group)."""
    comm.before()
    wire.broadcast(x, src=global_rank(comm, src), group=comm.group)
    comm.after("broadcast", _nbytes(x))
    return x


def from_rank_0(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """A copy of rank 0's `x` on every rank (a collective; `x` itself is left as it is). Moved
    as bytes, so any dtype goes (gloo has no float8 or bool of its own)."""
    out = x.detach().clone().contiguous()
    if comm.world > 1:
        broadcast(out.reshape(-1).view(torch.uint8), 0, comm)
    return out


def reduce_scatter(x: torch.Tensor, dim: int, sizes: Sequence[int], comm: Comm) -> torch.Tensor:
    """This rank's shard of the sum over ranks of the whole tensors x."""
    if comm.world == 1:  # one rank holds everything: nothing to exchange
        return x
    if len(sizes) != comm.world or sum(sizes) != x.shape[dim]:
        raise ValueError(f"shard sizes {list(sizes)} do not split dim {dim} of length {x.shape[dim]} over {comm.world} ranks")
    parts = [p.contiguous() for p in x.split(list(sizes), dim)]
    out = x.new_empty(_with_length(x.shape, dim, sizes[comm.rank]))
    comm.before()
    wire.reduce_scatter(out, parts, group=comm.group)
    comm.after("reduce_scatter", comm.world * max(_nbytes(p) for p in parts))
    return out


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, src_sizes: Sequence[int], dst_sizes: Sequence[int],
               comm: Comm) -> torch.Tensor:
    """Sharded on src_dim -> sharded on dst_dim (src_dim whole, dst_dim split by dst_sizes).

    Rank j gets from rank i the block (i's rows of src_dim) x (j's rows of dst_dim); the blocks
    travel flattened, so any two dims and any uneven sizes go through one all_to_all_single."""
    if comm.world == 1:  # one rank holds everything: nothing to exchange
        return x
    _check_sizes(x, src_dim, src_sizes, comm)
    if len(dst_sizes) != comm.world or sum(dst_sizes) != x.shape[dst_dim]:
        raise ValueError(f"shard sizes {list(dst_sizes)} do not split dim {dst_dim} of length {x.shape[dst_dim]}")
    send = [b.reshape(-1) for b in x.split(list(dst_sizes), dst_dim)]
    block = _with_length(x.shape, dst_dim, dst_sizes[comm.rank])  # my rows of dst_dim
    recv_shapes = [_with_length(block, src_dim, n) for n in src_sizes]  # ... times rank i's rows of src_dim
    return _exchange(x, send, recv_shapes, src_dim, comm)


def resplit(x: torch.Tensor, dim: int, old: Sequence[int], new: Sequence[int], comm: Comm) -> torch.Tensor:
    """Sharded on dim by `old` sizes -> sharded on dim by `new` sizes (a segment boundary)."""
    if comm.world == 1 or list(old) == list(new):  # nothing to exchange
        return x
    _check_sizes(x, dim, old, comm)
    if sum(old) != sum(new) or len(new) != comm.world:
        raise ValueError(f"cannot re-split sizes {list(old)} into {list(new)}")
    start = sum(old[: comm.rank])
    send, new_off = [], 0
    for n in new:  # the overlap of my rows [start, start + old) with each rank's new rows
        lo, hi = max(start, new_off), min(start + old[comm.rank], new_off + n)
        send.append(x.narrow(dim, lo - start, hi - lo).reshape(-1) if hi > lo else x.new_empty(0))
        new_off += n
    mine = sum(new[: comm.rank]), sum(new[: comm.rank + 1])
    recv_shapes, old_off = [], 0
    for n in old:  # the overlap of each rank's old rows with my new rows
        length = max(min(old_off + n, mine[1]) - max(old_off, mine[0]), 0)
        recv_shapes.append(_with_length(x.shape, dim, length))
        old_off += n
    return _exchange(x, send, recv_shapes, dim, comm)


def _exchange(x: torch.Tensor, send: list[torch.Tensor], recv_shapes: list, cat_dim: int, comm: Comm) -> torch.Tensor:
    """Send flat block j to rank j, receive a block of recv_shapes[i] from rank i, concatenate."""
    counts = [torch.Size(s).numel() for s in recv_shapes]
    out = x.new_empty(sum(counts))
    flat = torch.cat(send) if send else x.new_empty(0)
    comm.before()
    wire.all_to_all_single(out, flat, output_split_sizes=counts, input_split_sizes=[b.numel() for b in send],
                           group=comm.group)
    comm.after("all_to_all", comm.world * max(_nbytes(flat), _nbytes(out)))
    return torch.cat([b.reshape(s) for b, s in zip(out.split(counts), recv_shapes)], cat_dim)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def every_rank(value, comm: Comm) -> list:
    """Every rank's `value`, in rank order (a small collective: all_gather_object)."""
    out: list = [None] * comm.world
    ledger.talking(comm.group)
    dist.all_gather_object(out, value, group=comm.group)
    return out


def gather_or_refuse(value, refused: str | None, comm: Comm) -> list:
    """Every rank's `value` (any picklable object), in rank order; or, where any rank had to
    refuse (`refused`: its one-line ValueError message), that ValueError on every rank, so that
    none goes on into a collective the others never join. A collective."""
    every = every_rank((value, refused), comm)
    why = next((r for _, r in every if r is not None), None)
    if why is not None:
        raise ValueError(why)
    return [v for v, _ in every]


def global_rank(comm: Comm, rank: int) -> int:
    """Rank `rank` of the program's group as the default group numbers it (what src= and
    dst= of torch.distributed take)."""
    return rank if comm.group is None else dist.get_global_rank(comm.group, rank)


def _gather(x: torch.Tensor, dim: int, sizes: Sequence[int], how: Gather, comm: Comm) -> torch.Tensor:
    return (gather_grouped if how == "grouped" else gather_padded)(x, dim, sizes, comm)


def _own(x: torch.Tensor, dim: int, sizes: Sequence[int], comm: Comm) -> torch.Tensor:
    return x.narrow(dim, sum(sizes[: comm.rank]), sizes[comm.rank])


# -- autograd: each forward with its dual ----------------------------------------------------------

HIGHER_ORDER = ("a gradient of a gradient (backward or autograd.grad with create_graph=True: a gradient penalty, "
                "a Hessian-vector product) is not supported through hap's collectives: their backwards are not "
                "differentiable, so its gradient would be silently wrong")


def first_order_only() -> None:
    """In a backward that communicates: refuse create_graph=True (grad mode is on there only
    then), whose second backward would not see the collectives (a penalty on an input's
    gradient was dropped as a constant, or its parameter gradients 5-50% off)."""
    if torch.is_grad_enabled():
        raise NotImplementedError(HIGHER_ORDER)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, how, grad_partial, comm):
        ctx.args = dim, sizes, grad_partial, comm
        return _gather(x, dim, sizes, how, comm)

    @staticmethod
    def backward(ctx, g):
        first_order_only()
        dim, sizes, grad_partial, comm = ctx.args
        # R's gradient is a partial sum: add the ranks' parts and keep mine. D's is whole: slice.
        gx = reduce_scatter(g, dim, sizes, comm) if grad_partial else _own(g, dim, sizes, comm).contiguous()
        return gx, None, None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grad_partial, comm):
        ctx.args = grad_partial, comm
        return all_reduce(x, comm)

    @staticmethod
    def backward(ctx, g):
        first_order_only()
        grad_partial, comm = ctx.args
        # P's gradient is whole on every rank: sum R's partial gradient, pass D's through.
        return (all_reduce(g, comm) if grad_partial else g), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, comm):
        ctx.args = dim, sizes, comm
        return reduce_scatter(x, dim, sizes, comm)

    @staticmethod
    def backward(ctx, g):
        first_order_only()
        dim, sizes, comm = ctx.args
        return gather_padded(g.contiguous(), dim, sizes, comm), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, src_sizes, dst_sizes, comm):
        ctx.args = src_dim, dst_dim, src_sizes, dst_sizes, comm
        return all_to_all(x, src_dim, dst_dim, src_sizes, dst_sizes, comm)

    @staticmethod
    def backward(ctx, g):
        first_order_only()
        src_dim, dst_dim, src_sizes, dst_sizes, comm = ctx.args
        return all_to_all(g.contiguous(), dst_dim, src_dim, dst_sizes, src_sizes, comm), None, None, None, None, None


class _Resplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, old, new, comm):
        ctx.args = dim, old, new, comm
        return resplit(x, dim, old, new, comm)

    @staticmethod
    def backward(ctx, g):
        first_order_only()
        dim, old, new, comm = ctx.args
        return resplit(g.contiguous(), dim, new, old, comm), None, None, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, grad_partial, comm):
        ctx.args = dim, sizes, grad_partial, comm, x.shape
        return _own(x, dim, sizes, comm).contiguous()

    @staticmethod
    def backward(ctx, g):
        first_order_only()
        dim, sizes, grad_partial, comm, shape = ctx.args
        if grad_partial:  # R: my shard's gradient, zeros elsewhere, sums to the whole gradient
            gx = g.new_zeros(shape)
            _own(gx, dim, sizes, comm).copy_(g)
        else:  # D: every rank needs the whole gradient
            gx = gather_padded(g.contiguous(), dim, sizes, comm)
        return gx, None, None, None, None


class _SameValues(torch.autograd.Function):
    """R <-> D: the same values, another gradient form. replicate (D -> R): R's partial
    gradients are summed into D's whole one. duplicate (R -> D): D's gradient is whole on every
    rank; as R's partial gradient it must count once, so rank 0 keeps it and the others zeros."""

    @staticmethod
    def forward(ctx, x, to_r, comm):
        ctx.args = to_r, comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        first_order_only()
        to_r, comm = ctx.args
        if to_r:
            return all_reduce(g, comm), None, None
        return (g if comm.rank == 0 else torch.zeros_like(g)), None, None


class _ZeroPartial(torch.autograd.Function):
    """R|D -> P: rank 0 holds the value, the others zeros, so the sum over ranks is the value."""

    @staticmethod
    def forward(ctx, x, grad_partial, comm):
        ctx.args = grad_partial, comm
        return x.clone() if comm.rank == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        first_order_only()
        grad_partial, comm = ctx.args
        # P's gradient is whole on every rank. As R's partial gradient only rank 0 keeps it
        # (x feeds the output only there); D takes it whole.
        if grad_partial and comm.rank != 0:
            return torch.zeros_like(g), None, None
        return g, None, None


MoveRuntime = Callable[[torch.Tensor, Move, Comm, Sequence[int] | None, Sequence[int] | None], torch.Tensor]
MOVE_RUNTIMES: dict[str, MoveRuntime] = {}
"""Move name (search/moves.py) -> how a rank runs it: an autograd Function whose backward is the
move's dual. Every move the search can make has one (tests/test_collectives.py checks)."""


def runs(*names: str):
    """Register the runtime of the moves `names`."""
    def register(fn: MoveRuntime) -> MoveRuntime:
        for name in names:
            MOVE_RUNTIMES[name] = fn
        return fn
    return register


def run_move(x: torch.Tensor, mv: Move, comm: Comm, src_sizes: Sequence[int] | None = None,
             dst_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Apply one layout move of a program to this rank's local tensor.

    src_sizes / dst_sizes: the per-rank lengths of the sharded dim of the source / destination
    placement (needed where that placement is S; for a rebalance, the old and new split)."""
    run = MOVE_RUNTIMES.get(mv.name)
    if run is None:
        raise ValueError(f"no runtime for move {mv.name!r} ({mv.src} -> {mv.dst})")
    return run(x, mv, comm, src_sizes, dst_sizes)


@runs("all_gather", "grouped_broadcast")
def _run_all_gather(x, mv, comm, src_sizes, dst_sizes):  # S -> R | D; dual: reduce-scatter | slice
    how: Gather = "grouped" if mv.fwd == AG_GROUPED else "padded"
    return _AllGather.apply(x, mv.src.dim, _sizes(src_sizes, "source"), how, mv.dst == R, comm)


@runs("all_reduce")
def _run_all_reduce(x, mv, comm, src_sizes, dst_sizes):  # P -> R | D; dual: all-reduce | nothing
    return _AllReduce.apply(x, mv.dst == R, comm)


@runs("reduce_scatter")
def _run_reduce_scatter(x, mv, comm, src_sizes, dst_sizes):  # P -> S; dual: all-gather
    return _ReduceScatter.apply(x, mv.dst.dim, _sizes(dst_sizes, "destination"), comm)


@runs("all_to_all")
def _run_all_to_all(x, mv, comm, src_sizes, dst_sizes):  # S(a) -> S(b); dual: all-to-all back
    return _AllToAll.apply(x, mv.src.dim, mv.dst.dim, _sizes(src_sizes, "source"), _sizes(dst_sizes, "destination"), comm)


@runs("rebalance")
def _run_rebalance(x, mv, comm, src_sizes, dst_sizes):  # S(d) at one split -> S(d) at another
    return _Resplit.apply(x, mv.src.dim, _sizes(src_sizes, "source"), _sizes(dst_sizes, "destination"), comm)


@runs("slice")
def _run_slice(x, mv, comm, src_sizes, dst_sizes):  # R | D -> S; dual: local | all-gather
    return _Slice.apply(x, mv.dst.dim, _sizes(dst_sizes, "destination"), mv.src == R, comm)


@runs("duplicate", "replicate")
def _run_same_values(x, mv, comm, src_sizes, dst_sizes):  # R <-> D; dual: local | all-reduce
    return _SameValues.apply(x, mv.name == "replicate", comm)


@runs("zero_partial")
def _run_zero_partial(x, mv, comm, src_sizes, dst_sizes):  # R | D -> P; dual: local
    return _ZeroPartial.apply(x, mv.src == R, comm)


def _sizes(sizes: Sequence[int] | None, which: str) -> tuple[int, ...]:
    if sizes is None:
        raise ValueError(f"this move needs the {which} shard sizes")
    return tuple(int(n) for n in sizes)

