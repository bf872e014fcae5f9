"""Gradient synchronization overlapped with the backward pass, as the plan's sync entries say.

Parameters kept whole (R) on every rank receive partial gradients that must be summed over
ranks. The plan lists, per parameter or per part of one (rows along dim 0), how (plan.SyncEntry)
and in which bucket. A bucket's parts are flattened into one message and synchronized by a
short sequence of collectives:

    all_reduce               all-reduce                                              exact
    all_reduce, fp16         all-reduce in half precision                            rounds each part
    all_reduce, powersgd     all-reduce P, then (after local math) Q (below)         low-rank
    ps                       reduce to the server; the server broadcasts the sum     exact
    hierarchical all_reduce  reduce inside each machine to its first device; all-reduce
                             among those devices; broadcast inside each machine      exact
    hierarchical ps          reduce inside each machine to its leader (the server on its
                             machine); reduce among the leaders to the server; the server
                             broadcasts to the leaders; they broadcast inside           exact
    sparse all_reduce        all-gather the row counts, then every rank's (index, row)
                             pairs padded to the most; each rank sums them              exact
    sparse ps                all-gather the row counts; gather the pairs to the server;
                             it broadcasts their coalesced sum (second lane)           exact

Buckets start in the plan's order (every rank in the same order), each once its gradients and
every bucket before it are complete, while the backward computes earlier layers' gradients;
each next collective of a bucket starts as soon as the one before it is done here, also during
the backward. Every process group carries its collectives in bucket order on every rank: the
second and later collectives of the sequences run on twin groups of the same devices (lane 1),
so a broadcast never overtakes a later bucket's reduce. When the last gradient has arrived the
rank waits for everything and writes the sums back.

PowerSGD (Vogels et al., NeurIPS'19), per part viewed as a matrix M [rows, rest] of this rank's
gradient plus its error-feedback buffer e: P = M Q; all-reduce P; orthonormalize its columns
(P^); Q_r = M^T P^; all-reduce Q_r into Q; the synchronized gradient is P^ Q^T, this rank keeps
e = M - P^ Q_r^T for the next step, and Q starts the next step's power iteration. Q starts from
a normal draw seeded by the bucket, the same on every rank. A part whose matrix has a side no
longer than r is sent uncompressed (its factors would be no smaller).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .._torch import at_backward_end
from ..plan import SyncEntry
from .collectives import Comm, first_order_only
from . import wire

Lane = tuple[tuple[int, ...], int]  # (devices, lane): a process group


@dataclass(slots=True)
class Part:
    """One synchronized piece of one parameter's gradient on this rank."""
    param: nn.Parameter
    rows: tuple[int, int] | None
    """(start, length) along dim 0; None: the whole gradient."""

    def grad(self) -> torch.Tensor:
        g = self.param.grad
        return g if self.rows is None else g.narrow(0, *self.rows)


@dataclass(frozen=True, slots=True)
class Groups:
    """The process groups strategies run over, made at start-up (runtime/module.py)."""
    comm: Comm
    machines: tuple[tuple[int, ...], ...]
    """The cluster's machines, as ranks."""
    made: dict[Lane, object]
    """Process group per (device group, lane); the world's lane 0 is comm.group."""

    def group(self, lane: Lane):
        return self.made[lane]

    def machine_of(self, rank: int) -> tuple[int, ...]:
        return next(m for m in self.machines if rank in m)

    def leaders(self, root: int | None) -> tuple[int, ...]:
        """One device per machine, in rank order: the root where a machine has it, else its first."""
        return tuple(sorted(root if root in m else m[0] for m in self.machines))

    def needed(self, sync: Sequence[SyncEntry]) -> list[Lane]:
        """The process groups `sync` runs over: the world's second lane, and machines and
        leaders (both lanes) for hierarchical entries."""
        world = tuple(range(self.comm.world))
        out: list[Lane] = [(world, 1)] if any(e.strategy == "ps" or e.compressor == "powersgd" or e.sparse
                                              for e in sync) else []
        for e in sync:
            if e.hierarchical:
                out += [(m, lane) for m in self.machines if len(m) > 1 for lane in (0, 1)]
                leaders = self.leaders(e.server)
                if len(leaders) > 1:
                    out += [(leaders, 0), (leaders, 1)]
        return out


@dataclass
class Step:
    """One collective of a bucket's sequence: `run(flat)` starts it on `lane` and returns its
    work; `kind` and the lane's devices price its emulated link time."""
    lane: Lane
    kind: str
    run: Callable[[torch.Tensor], dist.Work]
    bytes: Callable[[torch.Tensor], float] = field(default=lambda t: t.numel() * t.element_size())
    before: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Local work on the message before the collective (PowerSGD's second factor)."""


@dataclass
class _Flight:
    """A bucket in synchronization: its message, its steps, the next one, the one in flight."""
    message: torch.Tensor
    steps: list[Step]
    state: object
    next: int = 0
    work: dist.Work | None = None
    ready_at: float = 0.0


class GradSync:
    def __init__(self, sync: Sequence[SyncEntry], params: dict[str, nn.Parameter], groups: Groups):
        """sync: the plan's entries (buckets numbered in launch order); params: this rank's
        parameters by graph name."""
        self.comm = groups.comm
        by_bucket: dict[int, list[SyncEntry]] = {}
        for e in sync:
            by_bucket.setdefault(e.bucket, []).append(e)
        self.buckets: list[list[Part]] = []
        self.entries: list[list[SyncEntry]] = []
        self.synchronizers: list[_Synchronizer] = []
        for b in sorted(by_bucket):
            entries = by_bucket[b]
            self.buckets.append([Part(params[e.param], e.rows) for e in entries])
            self.entries.append(entries)
            self.synchronizers.append(_synchronizer(entries[0], groups, b))
        # per process group, the buckets whose collectives it carries, in the order it carries them
        self.lane_queue: dict[Lane, list[int]] = {}
        for i, (sync, parts) in enumerate(zip(self.synchronizers, self.buckets)):
            for lane in sync.lanes(parts):
                self.lane_queue.setdefault(lane, []).append(i)
        self.waiting_on = [{id(part.param) for part in bucket} for bucket in self.buckets]
        self.buckets_of: dict[int, list[int]] = {}
        for i, pids in enumerate(self.waiting_on):
            for pid in pids:
                self.buckets_of.setdefault(pid, []).append(i)
        self._reset()
        self.hooks = []
        self.earlier: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        """Gradients of earlier backwards (accumulation), summed already, set aside for this one's sum."""
        self.arrived: set[int] = set()
        """The parameters this backward has given a gradient so far (ids)."""
        self.queued = False  # whether this backward's end is awaited (_backward_ended)
        self.from_graph: dict[int, torch.Tensor] = {}
        """This backward's gradient of each parameter (id) from the program, through its alias."""
        self.outside: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        """This backward's gradient of each parameter from terms outside the program, added after the sum."""
        self._aliased = {id(part.param) for sync, bucket in zip(self.synchronizers, self.buckets)
                         if not isinstance(sync, _Sparse) for part in bucket}
        if self.comm.world > 1:
            for p in {id(part.param): part.param for bucket in self.buckets for part in bucket}.values():
                self.hooks.append(p.register_hook(functools.partial(self._arriving, p)))
                self.hooks.append(p.register_post_accumulate_grad_hook(self._arrived))

    def alias(self, p: nn.Parameter) -> torch.Tensor:
        """The value of `p` the program computes with (one per forward): its backward hands the
        program's gradient to _arriving, which sums that over the ranks and adds the rest of
        p's gradient (a penalty on dmodel.parameters() outside the model, alike on every rank:
        summing it counted it once per rank) after the sum, once, as one device has it."""
        if id(p) not in self._aliased or self.comm.world == 1:
            return p
        return _FromGraph.apply(p, self.from_graph)

    def forward_begins(self) -> None:
        """At each forward. A backward still running here ended in an exception (Ctrl-C, a
        hook's error; torch drops its end, _backward_ended): its buckets' counts, the program's
        gradients it noted and its outside terms would be taken for the next backward's. They
        are dropped, the collectives it started finished (every rank started the same where the
        exception was alike), and the gradients it set aside (earlier backwards', summed) put back
        in .grad in place of its own; elsewhere what it wrote to .grad stays, as on one device
        after an exception (zero_grad before training on)."""
        if not self.queued:
            return
        self._progress(block=True)
        self.queued = False
        self.from_graph.clear()
        self.outside.clear()
        self.arrived.clear()
        for p, earlier in self.earlier.values():
            p.grad = earlier
        self.earlier.clear()
        self._reset()

    def close(self) -> None:
        """Stop synchronizing (another GradSync takes over)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def compressor_state(self) -> dict[tuple[str, tuple[int, int] | None], tuple[torch.Tensor, torch.Tensor | None]]:
        """What PowerSGD carries from step to step, per part it compresses (parameter, rows):
        this rank's error feedback and Q, in the plan's bucket order (a part it sends whole
        carries no error). The tensors themselves, not copies, valid until the next step (which
        replaces them)."""
        out = {}
        for sync, parts, entries in zip(self.synchronizers, self.buckets, self.entries):
            if isinstance(sync, _PowerSGD):
                sync.start(parts)
                out.update({(e.param, e.rows): (err, q) for e, err, q in zip(entries, sync.error, sync.q) if q is not None})
        return out

    def restore_compressor_state(self, state: dict[tuple[str, tuple[int, int] | None], tuple]) -> list:
        """Carry PowerSGD's state (as compressor_state gives it; a Q may be None) into the
        parts this sync compresses alike; returns the keys of `state` it could not take (a part
        not compressed here, or of another shape). A Q of another rank keeps its fresh draw."""
        mine = self.compressor_state()
        left = []
        for key, (err, q) in state.items():
            held = mine.get(key)
            if held is None or err.shape != held[0].shape:
                left.append(key)
                continue
            with torch.no_grad():
                held[0].copy_(err)
                if q is not None and q.shape == held[1].shape:
                    held[1].copy_(q)
        return left

    def _reset(self) -> None:
        self.missing = [len(w) for w in self.waiting_on]
        self.flights: list[_Flight] = []
        self.carried = {lane: 0 for lane in self.lane_queue}  # per process group: collectives started

    def _arriving(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """A backward's gradient is about to be added to p.grad (the backward's first also
        awaits its end: _backward_ended). Where p.grad holds an earlier backward's (gradient
        accumulation), that one is summed over the ranks already: summing it again would count
        it once per rank. It waits aside and is added back after this backward's own sum. So
        does the part of `grad` that did not come through the program (alias): _arrived takes
        it out of p.grad before the sum."""
        first_order_only()  # (create_graph=True: the sum below would cut p.grad from its graph)
        if not self.queued:
            at_backward_end(self._backward_ended)
            self.queued = True
        if p.grad is not None:
            self.earlier[id(p)] = (p, p.grad)
            p.grad = None
        if id(p) in self._aliased:
            mine = self.from_graph.pop(id(p), None)
            # (the program's alone: autograd hands its tensor on as it is, or the sum of its
            # aliases' where two forwards met, which may round apart from ours: equal, or not)
            if mine is not grad and (mine is None or not torch.equal(mine, grad)):
                self.outside[id(p)] = (p, grad if mine is None else grad - mine)

    def _arrived(self, p: nn.Parameter) -> None:
        outside = self.outside.get(id(p))
        if outside is not None:  # summed without it (added back in _put_back): p.grad holds this backward's alone
            p.grad.sub_(outside[1])
        self.arrived.add(id(p))
        for i in self.buckets_of[id(p)]:
            self.missing[i] -= 1
        self._launch(lambda i: self.missing[i] == 0)

    def _launch(self, ready: Callable[[int], bool]) -> None:
        """Start the buckets, in order, up to the first that is not `ready`; once all have
        started, wait for them and write the sums back."""
        while len(self.flights) < len(self.buckets) and ready(len(self.flights)):
            i = len(self.flights)
            message, steps, state = self.synchronizers[i].plan(self.synchronizers[i].flatten(self.buckets[i]),
                                                                self.buckets[i])
            self.flights.append(_Flight(message, steps, state))
            self.comm.launching()  # an emulated slow rank arrives late
        self._progress(block=False)
        if len(self.flights) == len(self.buckets):
            self._progress(block=True)
            for i, flight in enumerate(self.flights):
                self.synchronizers[i].write_back(self.buckets[i], flight.message, flight.state)
            self._put_back()
            self.arrived.clear()
            self._reset()

    def _put_back(self) -> None:
        """Gradients set aside (earlier backwards') back: added to this backward's sum, as one
        device accumulates, or alone where this backward gave none (torch.autograd.grad); and
        this backward's gradients from outside the program, added once."""
        for p, extra in self.outside.values():
            p.grad = extra.clone() if p.grad is None else p.grad.add_(extra)
        self.outside.clear()
        for p, earlier in self.earlier.values():
            p.grad = earlier if p.grad is None else earlier + p.grad if earlier.is_sparse else earlier.add_(p.grad)
        self.earlier.clear()

    def _backward_ended(self) -> None:
        """After a backward. Where it gave some synchronized parameters no gradient (used only
        under torch.no_grad, or left out of backward(inputs=...)), alike on every rank, their
        buckets never filled: they are summed now, those parameters counting zeros and their
        .grad left as it was (None on one device). Then what waits aside is put back."""
        self.queued = False
        self.from_graph.clear()  # (a parameter whose own gradient never came: backward(inputs=...))
        if not self.arrived:  # torch.autograd.grad: no .grad was written, nothing is summed or added
            self.outside.clear()
        if self.arrived:
            absent = {id(part.param): (part.param, part.param.grad, sync) for sync, bucket in
                      zip(self.synchronizers, self.buckets) for part in bucket if id(part.param) not in self.arrived}
            for p, _, sync in absent.values():
                p.grad = _empty_sparse(p) if isinstance(sync, _Sparse) else torch.zeros_like(p)
            self._launch(lambda i: True)
            for p, grad, _ in absent.values():
                p.grad = grad
        self._put_back()

    def _progress(self, block: bool) -> None:
        """Start every collective that may start: its bucket's previous one is done here, and
        its process group has carried the earlier buckets' collectives. With block, until all
        are done, waiting always on the earliest bucket's collective after starting all that
        may start: that one depends on no later bucket's, so no two ranks wait on each other."""
        while True:
            self._sweep()
            if not block:
                return
            waiting = [f for f in self.flights if f.work is not None]
            if not waiting:
                assert all(f.next == len(f.steps) for f in self.flights), "a collective that can never start"
                return
            self._done(waiting[0])

    def _sweep(self) -> None:
        """Harvest the collectives done here and start those that may start, until none does."""
        moved = True
        while moved:
            moved = False
            for i, f in enumerate(self.flights):
                if f.work is not None and f.work.is_completed() and time.perf_counter() >= f.ready_at:
                    self._done(f)
                    moved = True
                if f.work is None and f.next < len(f.steps) and self._turn(f.steps[f.next].lane) == i:
                    step = f.steps[f.next]
                    if step.before is not None:
                        f.message = step.before(f.message)
                    f.ready_at = self.comm.on_wire(step.kind, step.bytes(f.message), step.lane[0])
                    f.work = step.run(f.message)
                    self.carried[step.lane] += 1
                    moved = True

    def _done(self, f: _Flight) -> None:
        """Wait for a bucket's collective in flight (and its emulated link time); its next may start."""
        self.comm.before()
        f.work.wait()
        self.comm.off_wire(f.ready_at)
        f.work, f.next = None, f.next + 1

    def _turn(self, lane: Lane) -> int:
        """The bucket whose collective the process group carries next."""
        queue, done = self.lane_queue[lane], self.carried[lane]
        return queue[done] if done < len(queue) else -1


# -- synchronizers: the collectives of a bucket ---------------------------------------------------

class _Synchronizer:
    def lanes(self, parts: list[Part]) -> list[Lane]:
        """The process groups of its steps, in order (known before any gradient)."""
        raise NotImplementedError

    def flatten(self, parts: list[Part]) -> torch.Tensor:
        """The bucket's gradients as one flat tensor."""
        sparse = [part for part in parts if part.param.grad.is_sparse]
        if sparse:
            raise ValueError(f"a parameter's gradient is sparse ({tuple(sparse[0].param.shape)}) but the plan "
                             "synchronizes it as dense: plan again (its sync entry says sparse)")
        return torch.cat([part.grad().reshape(-1) for part in parts])

    def plan(self, flat: torch.Tensor, parts: list[Part]) -> tuple[torch.Tensor, list[Step], object]:
        """The message to send, the steps that synchronize it, and state for `result`."""
        raise NotImplementedError

    def result(self, message: torch.Tensor, state) -> torch.Tensor:
        """The synchronized flat gradient."""
        raise NotImplementedError

    def write_back(self, parts: list[Part], message: torch.Tensor, state) -> None:
        """Put the synchronized gradients in place of this rank's."""
        flat = self.result(message, state)
        for part, piece in zip(parts, flat.split([part.grad().numel() for part in parts])):
            part.grad().copy_(piece.view_as(part.grad()))


class _FromGraph(torch.autograd.Function):
    """Identity forward; backward notes the gradient that came through (GradSync.alias)."""

    @staticmethod
    def forward(ctx, p: torch.Tensor, sink: dict) -> torch.Tensor:
        ctx.sink, ctx.key = sink, id(p)
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        first_order_only()  # (before the sink is written: the next backward would find it)
        # one backward through two forwards' losses ((l1 + l2).backward()) meets two aliases of
        # p: the program's gradient is both (the last alone left the other unsummed)
        earlier = ctx.sink.get(ctx.key)
        ctx.sink[ctx.key] = grad if earlier is None else earlier + grad
        return grad, None


def _matrix_shape(part: Part) -> tuple[int, int]:
    """The matrix PowerSGD views a part's gradient as: [rows, the rest] ([1, 1] for a number)."""
    shape = part.param.shape
    if not shape:
        return (1, 1)
    rows = part.rows[1] if part.rows is not None else shape[0]
    return (rows, part.param.numel() // shape[0] if shape[0] else 0)


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """The Q of p's QR, in p's dtype: computed in float32 at least (torch has no QR of
    bfloat16 or float16, on CPU or CUDA)."""
    return torch.linalg.qr(p.to(torch.promote_types(p.dtype, torch.float32))).Q.to(p.dtype)


def _synchronizer(e: SyncEntry, groups: Groups, bucket: int) -> _Synchronizer:
    world = tuple(range(groups.comm.world))
    if e.devices != world:
        raise ValueError(f"sync of {e.param} over devices {list(e.devices)}: a parameter every rank keeps whole is "
                         f"synchronized over all {len(world)} ranks")
    if e.sparse:
        return _Sparse(groups, e.server if e.strategy == "ps" else None)
    if e.strategy == "ps" or e.hierarchical:
        return _Rooted(groups, e.server if e.strategy == "ps" else None, e.hierarchical)
    if e.compressor == "powersgd":
        return _PowerSGD(groups, e.low_rank, bucket)
    return _AllReduce(groups, half=e.compressor == "fp16")


class _AllReduce(_Synchronizer):
    def __init__(self, groups: Groups, half: bool):
        self.groups, self.half = groups, half
        self.lane = (tuple(range(groups.comm.world)), 0)

    def lanes(self, parts):
        return [self.lane]

    def plan(self, flat, parts):
        g = self.groups.group(self.lane)
        message = flat.half() if self.half else flat
        return message, [Step(self.lane, "all_reduce", lambda t: wire.all_reduce(t, group=g, async_op=True))], flat.dtype

    def result(self, message, dtype):
        return message.to(dtype)


class _Rooted(_Synchronizer):
    """Reduce to a root, then broadcast from it: a parameter server (root: the server), or a
    hierarchical all-reduce (root None: an all-reduce among one device per machine). With
    `hierarchical`, each machine first reduces to its leader (the root where it has it)."""

    def __init__(self, groups: Groups, root: int | None, hierarchical: bool):
        comm = groups.comm
        world = tuple(range(comm.world))
        machine = groups.machine_of(comm.rank) if hierarchical else (comm.rank,)
        leaders = groups.leaders(root) if hierarchical else world
        leader = next(r for r in leaders if r in machine)
        steps: list[Step] = []
        g = {lane: groups.group(lane) for lane in ((machine, 0), (machine, 1), (leaders, 0), (leaders, 1))
             if lane in groups.made}
        if len(machine) > 1:  # inside the machine, to its leader
            steps.append(Step((machine, 0), "reduce",
                              lambda t, g=g[(machine, 0)]: wire.reduce(t, dst=leader, group=g, async_op=True)))
        if comm.rank == leader and len(leaders) > 1:  # across machines, one device each
            if root is None:
                steps.append(Step((leaders, 0), "all_reduce",
                                  lambda t, g=g[(leaders, 0)]: wire.all_reduce(t, group=g, async_op=True)))
            else:
                steps.append(Step((leaders, 0), "reduce",
                                  lambda t, g=g[(leaders, 0)]: wire.reduce(t, dst=root, group=g, async_op=True)))
                steps.append(Step((leaders, 1), "broadcast",
                                  lambda t, g=g[(leaders, 1)]: wire.broadcast(t, src=root, group=g, async_op=True)))
        if len(machine) > 1:  # back inside the machine
            steps.append(Step((machine, 1), "broadcast",
                              lambda t, g=g[(machine, 1)]: wire.broadcast(t, src=leader, group=g, async_op=True)))
        self.steps = steps

    def lanes(self, parts):
        return [step.lane for step in self.steps]

    def plan(self, flat, parts):
        return flat, self.steps, None

    def result(self, message, state):
        return message


class _PowerSGD(_Synchronizer):
    def __init__(self, groups: Groups, rank: int, bucket: int):
        self.r, self.bucket = rank, bucket
        world = tuple(range(groups.comm.world))
        self.lanes_all = [(world, 0), (world, 1)]
        self.g = [groups.group(lane) for lane in self.lanes_all]
        self.error: list[torch.Tensor] | None = None
        self.q: list[torch.Tensor | None] = []

    def _compressible(self, part: Part) -> bool:
        return min(_matrix_shape(part)) > self.r

    def lanes(self, parts):
        return self.lanes_all if any(self._compressible(p) for p in parts) else self.lanes_all[:1]

    def start(self, parts: list[Part]) -> None:
        """Before the first step (or a restore): every part's error feedback at zero and its Q
        drawn from the bucket's seed, the same on every rank."""
        if self.error is not None:
            return
        shapes = [_matrix_shape(part) for part in parts]
        gen = torch.Generator().manual_seed(1_000_003 * self.bucket)
        like = [part.param for part in parts]
        self.error = [torch.zeros(shape, dtype=p.dtype, device=p.device) for shape, p in zip(shapes, like)]
        self.q = [torch.randn(shape[1], self.r, generator=gen, dtype=p.dtype).to(p.device)
                  if min(shape) > self.r else None for shape, p in zip(shapes, like)]

    def plan(self, flat, parts):
        grads = [part.grad().reshape(part.grad().shape[0], -1) if part.grad().dim() else part.grad().reshape(1, 1)
                 for part in parts]
        self.start(parts)
        ms = [g + e for g, e in zip(grads, self.error)]
        compressed = [(m, q) for m, q in zip(ms, self.q) if q is not None]
        plain = [m.reshape(-1) for m, q in zip(ms, self.q) if q is None]
        message = torch.cat([(m @ q).reshape(-1) for m, q in compressed] + plain) if ms else flat.new_zeros(0)
        state = {"ms": ms, "compressed": compressed, "plain": sum(p.numel() for p in plain)}

        def factor_q(msg):  # P summed: orthonormalize, then this rank's Q = M^T P^
            sizes = [m.shape[0] * self.r for m, _ in compressed]
            p_hat = [_orthonormal(p.view(m.shape[0], self.r)) for p, (m, _) in zip(msg[:sum(sizes)].split(sizes), compressed)]
            q_local = [m.T @ p for (m, _), p in zip(compressed, p_hat)]
            state.update(p_hat=p_hat, q_local=q_local, plain_sum=msg[sum(sizes):].clone())
            return torch.cat([q.reshape(-1) for q in q_local]) if q_local else msg.new_zeros(0)

        steps = [Step(self.lanes_all[0], "all_reduce", lambda t: wire.all_reduce(t, group=self.g[0], async_op=True))]
        if compressed:
            steps.append(Step(self.lanes_all[1], "all_reduce", lambda t: wire.all_reduce(t, group=self.g[1], async_op=True),
                              before=factor_q))
        else:
            state.update(p_hat=[], q_local=[])
        return message, steps, state

    def result(self, message, state):
        if not state["compressed"]:
            state["plain_sum"] = message
            q_sum = []
        else:
            q_sum = [q.view(ql.shape) for q, ql in zip(message.split([q.numel() for q in state["q_local"]]), state["q_local"])]
        out, plain_at, k, new_q = [], 0, 0, []
        for i, (m, q) in enumerate(zip(state["ms"], self.q)):
            if q is None:
                synced = state["plain_sum"][plain_at:plain_at + m.numel()].view_as(m)
                plain_at += m.numel()
                self.error[i] = torch.zeros_like(m)
                new_q.append(None)
            else:
                synced = state["p_hat"][k] @ q_sum[k].T
                self.error[i] = m - state["p_hat"][k] @ state["q_local"][k].T
                new_q.append(q_sum[k])
                k += 1
            out.append(synced.reshape(-1))
        self.q = new_q
        return torch.cat(out)


class _Sparse(_Synchronizer):
    """A sparse gradient (an embedding's rows, coalesced): every rank's (index, row) pairs are
    all-gathered, or gathered to a server, which sends back their sum. gloo and NCCL gather only
    equal sizes, so the ranks first all-gather their row counts and pad to the most. A message
    row holds the index's bits, then the gradient row; padding rows have index -1."""

    def __init__(self, groups: Groups, server: int | None):
        self.rank, self.server = groups.comm.rank, server
        self.world = groups.comm.world
        self.lanes_all = [(tuple(range(self.world)), 0), (tuple(range(self.world)), 1)]
        self.g = [groups.group(lane) for lane in self.lanes_all]

    def lanes(self, parts):
        return self.lanes_all if self.server is None else self.lanes_all + self.lanes_all[1:]

    def flatten(self, parts):
        grad = parts[0].param.grad
        if not grad.is_sparse:
            raise ValueError(f"the plan synchronizes a sparse gradient but this one ({tuple(grad.shape)}) is dense: "
                             "plan again (was the embedding made with sparse=False?)")
        return grad

    def plan(self, grad, parts):
        rows = _pack(grad.coalesce())  # [k, h + width]
        counts = [torch.zeros(1, dtype=torch.int64, device=rows.device) for _ in range(self.world)]
        state = {"rows": rows, "shape": grad.shape, "counts": counts}
        g0, g1 = self.g
        count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
        steps = [Step(self.lanes_all[0], "all_gather", lambda t: wire.all_gather(state["counts"], t, group=g0, async_op=True),
                      bytes=lambda t: 8.0 * self.world)]

        def padded(_):  # to the most rows any rank has (at least one)
            most = max(1, max(int(c) for c in state["counts"]))
            out = _padding(most, rows)
            out[:rows.shape[0]] = rows
            state["gathered"] = [torch.empty_like(out) for _ in range(self.world)]
            return out

        gathered = lambda t: t.numel() * t.element_size() * self.world  # noqa: E731  all_gather's volume V
        if self.server is None:
            steps.append(Step(self.lanes_all[1], "all_gather", before=padded, bytes=gathered,
                              run=lambda t: wire.all_gather(state["gathered"], t, group=g1, async_op=True)))
        else:
            mine = self.rank == self.server
            steps.append(Step(self.lanes_all[1], "all_gather", before=padded, bytes=gathered,  # a gather: V to one
                              run=lambda t: wire.gather(t, state["gathered"] if mine else None, dst=self.server,
                                                        group=g1, async_op=True)))

            def summed(_):  # on the server the coalesced sum, elsewhere room for it: every row sent, at most the table
                total = max(1, min(sum(int(c) for c in state["counts"]), state["shape"][0]))
                out = _padding(total, rows)
                if mine:
                    s = _unpack(torch.cat(state["gathered"]), state["shape"]).coalesce()
                    s = _pack(s)
                    out[:s.shape[0]] = s
                return out

            steps.append(Step(self.lanes_all[1], "broadcast", before=summed,
                              run=lambda t: wire.broadcast(t, src=self.server, group=g1, async_op=True)))
        return count, steps, state

    def write_back(self, parts, message, state):
        if self.server is None:
            message = torch.cat([g[:int(c)] for g, c in zip(state["gathered"], state["counts"])])
        parts[0].param.grad = _unpack(message, state["shape"]).coalesce()


def _empty_sparse(p: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of no rows for p."""
    return torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64, device=p.device),
                                   torch.zeros((0, *p.shape[1:]), dtype=p.dtype, device=p.device), p.shape,
                                   check_invariants=False)  # (valid: no rows; the default warned on every rank)


def _pack(grad: torch.Tensor) -> torch.Tensor:
    """A coalesced sparse [rows, ...] gradient as [k, h + width] rows: the int64 index's bits
    (h elements of the gradient's dtype), then the row."""
    k, size = grad.indices().shape[1], grad.element_size()
    if 8 % size:
        raise ValueError(f"sparse gradients of {grad.dtype} are not supported (the index packs into whole elements)")
    idx = grad.indices()[0].contiguous()  # [k]
    values = grad.values().reshape(k, math.prod(grad.shape[1:]))  # [k, width]
    return torch.cat([idx.view(values.dtype).reshape(k, 8 // size), values], dim=1)


def _padding(k: int, like: torch.Tensor) -> torch.Tensor:
    """k message rows of index -1."""
    h = 8 // like.element_size()
    out = like.new_zeros(k, like.shape[1])
    out[:, :h] = torch.full((k,), -1, dtype=torch.int64, device=like.device).view(like.dtype).reshape(k, h)
    return out


def _unpack(rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Message rows (padding dropped) as an uncoalesced sparse gradient of `shape`."""
    h = 8 // rows.element_size()
    idx = rows[:, :h].contiguous().view(torch.int64).reshape(-1)  # [k]
    keep = idx >= 0
    values = rows[keep, h:].reshape(-1, *shape[1:])
    return torch.sparse_coo_tensor(idx[keep].unsqueeze(0), values, shape, check_invariants=False)  # valid by construction
