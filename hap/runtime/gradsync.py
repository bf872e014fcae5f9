"""Gradient synchronization overlapped with the backward pass, as the plan's sync entries say.

Parameters kept whole (R) on every rank receive partial gradients that must be summed over
ranks. The plan lists, per parameter or per part of one (rows along dim 0), how (plan.SyncEntry)
and in which bucket. Buckets launch in the plan's order (every rank starts them in the same
order), each as soon as its gradients and every bucket before it are complete, so
communication runs while the backward computes the earlier layers' gradients; the last gradient
to arrive finishes them all and writes the sums back. A bucket's parts are flattened into one
message and synchronized by one of:

    all_reduce               one all-reduce                                          exact
    all_reduce, fp16         one all-reduce in half precision                        rounds each part
    all_reduce, powersgd     rank-r PowerSGD with error feedback (below)             low-rank
    ps                       reduce to the server device, which broadcasts the sum   exact
    hierarchical (either)    reduce inside each machine to one of its devices, then
                             across machines only those devices, then broadcast
                             inside each machine                                     exact

The first collective of a bucket overlaps the backward; what depends on its result (the
broadcast back, PowerSGD's second all-reduce) runs when the backward is done.

PowerSGD (Vogels et al., NeurIPS'19), per part viewed as a matrix M [rows, rest] of this rank's
gradient plus its error-feedback buffer e: P = M Q; all-reduce P; orthonormalize its columns
(P^); Q_r = M^T P^; all-reduce Q_r into Q; the synchronized gradient is P^ Q^T, this rank keeps
e = M - P^ Q_r^T for the next step, and Q starts the next step's power iteration. Q starts from
a normal draw seeded by the part's position, the same on every rank. A part whose matrix has a
side no longer than r is sent uncompressed (its factors would be no smaller).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..plan import SyncEntry
from .collectives import Comm


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
    """The process groups a strategy runs over, made once at start-up (runtime/module.py)."""
    comm: Comm
    machines: tuple[tuple[int, ...], ...]
    """The cluster's machines, as ranks."""
    made: dict[tuple[int, ...], object]
    """Process group per device group (the world's is comm.group)."""

    def group(self, devices: Sequence[int]):
        return self.made[tuple(devices)]

    def machine_of(self, rank: int) -> tuple[int, ...]:
        return next(m for m in self.machines if rank in m)

    def leaders(self, root: int | None) -> tuple[int, ...]:
        """One device per machine: the root where a machine has it, else the machine's first."""
        return tuple(root if root in m else m[0] for m in self.machines)

    def needed(self, sync: Sequence[SyncEntry]) -> list[tuple[int, ...]]:
        """The device groups `sync` runs over, besides the world: machines and leaders for the
        hierarchical entries."""
        out = []
        for e in sync:
            if e.hierarchical:
                out += [m for m in self.machines if len(m) > 1]
                leaders = self.leaders(e.server)
                if len(leaders) > 1:
                    out.append(tuple(sorted(leaders)))
        return out


class GradSync:
    def __init__(self, sync: Sequence[SyncEntry], params: dict[str, nn.Parameter], groups: Groups):
        """sync: the plan's entries (buckets numbered in launch order); params: this rank's
        parameters by graph name."""
        self.comm = groups.comm
        by_bucket: dict[int, list[SyncEntry]] = {}
        for e in sync:
            by_bucket.setdefault(e.bucket, []).append(e)
        self.buckets: list[list[Part]] = []
        self.synchronizers: list[_Synchronizer] = []
        for b in sorted(by_bucket):
            entries = by_bucket[b]
            self.buckets.append([Part(params[e.param], e.rows) for e in entries])
            self.synchronizers.append(_synchronizer(entries[0], groups, b))
        self.waiting_on = [{id(part.param) for part in bucket} for bucket in self.buckets]
        buckets_of: dict[int, list[int]] = {}
        for i, bucket in enumerate(self.buckets):
            for pid in self.waiting_on[i]:
                buckets_of.setdefault(pid, []).append(i)
        self.buckets_of = buckets_of
        self._reset()
        if self.comm.world > 1:
            for p in {id(part.param): part.param for bucket in self.buckets for part in bucket}.values():
                p.register_post_accumulate_grad_hook(self._arrived)

    def _reset(self) -> None:
        self.missing = [len(w) for w in self.waiting_on]
        self.launched = 0
        self.pending: list[tuple[int, object]] = []

    def _arrived(self, p: nn.Parameter) -> None:
        for i in self.buckets_of[id(p)]:
            self.missing[i] -= 1
        while self.launched < len(self.buckets) and self.missing[self.launched] == 0:
            i = self.launched
            flat = torch.cat([part.grad().reshape(-1) for part in self.buckets[i]])
            self.pending.append((i, self.synchronizers[i].launch(flat, self.buckets[i])))
            self.launched += 1
        if self.launched == len(self.buckets):
            self._finish()

    def _finish(self) -> None:
        for i, state in self.pending:
            flat = self.synchronizers[i].finish(state)
            parts = self.buckets[i]
            for part, piece in zip(parts, flat.split([part.grad().numel() for part in parts])):
                part.grad().copy_(piece.view_as(part.grad()))
        self._reset()


# -- synchronizers: launch (during the backward) and finish (after it) ---------------------------

class _Synchronizer:
    def launch(self, flat: torch.Tensor, parts: list[Part]):
        raise NotImplementedError

    def finish(self, state) -> torch.Tensor:
        raise NotImplementedError


def _synchronizer(e: SyncEntry, groups: Groups, bucket: int) -> _Synchronizer:
    world = tuple(range(groups.comm.world))
    if e.devices != world:
        raise ValueError(f"sync of {e.param} over devices {list(e.devices)}: a parameter every rank keeps whole is "
                         f"synchronized over all {len(world)} ranks")
    if e.strategy == "ps":
        return _Rooted(groups, e.server, e.hierarchical)
    if e.hierarchical:
        return _Rooted(groups, None, True)
    if e.compressor == "powersgd":
        return _PowerSGD(groups.comm, e.low_rank, bucket)
    return _AllReduce(groups.comm, half=e.compressor == "fp16")


@dataclass
class _Async:
    """A collective in flight, and when its emulated link time is over."""
    work: dist.Work
    tensor: torch.Tensor
    kind: str
    ready_at: float


def _start(comm: Comm, kind: str, tensor: torch.Tensor, work: dist.Work, devices=None) -> _Async:
    return _Async(work, tensor, kind, comm.on_wire(kind, tensor.numel() * tensor.element_size(), devices))


def _wait(comm: Comm, op: _Async) -> torch.Tensor:
    comm.before()
    op.work.wait()
    comm.off_wire(op.ready_at)
    return op.tensor


class _AllReduce(_Synchronizer):
    def __init__(self, comm: Comm, half: bool):
        self.comm, self.half = comm, half

    def launch(self, flat, parts):
        msg = flat.half() if self.half else flat
        self.comm.launching()  # an emulated slow rank arrives late
        return flat.dtype, _start(self.comm, "all_reduce", msg, dist.all_reduce(msg, group=self.comm.group, async_op=True))

    def finish(self, state):
        dtype, op = state
        return _wait(self.comm, op).to(dtype)


class _Rooted(_Synchronizer):
    """Reduce to a root, then broadcast from it: a parameter server (root: the server), or a
    hierarchical all-reduce (root None: an all-reduce among one device per machine). With
    `hierarchical`, each machine first reduces to its leader (the root where it has it).

    Only the first reduce overlaps the backward; everything after it runs when the backward is
    done, bucket after bucket, so that every rank issues each group's collectives in one order."""

    def __init__(self, groups: Groups, root: int | None, hierarchical: bool):
        self.groups, self.root, self.hierarchical = groups, root, hierarchical
        self.comm = comm = groups.comm
        self.machine = groups.machine_of(comm.rank) if hierarchical else (comm.rank,)
        self.leaders = tuple(sorted(groups.leaders(root))) if hierarchical else tuple(range(comm.world))
        self.leader = next(r for r in self.leaders if r in self.machine)
        self.across = groups.group(self.leaders) if hierarchical and len(self.leaders) > 1 else comm.group

    def launch(self, flat, parts):
        self.comm.launching()
        if len(self.machine) > 1:  # first inside the machine, to its leader
            work = dist.reduce(flat, dst=self.leader, group=self.groups.group(self.machine), async_op=True)
            return _start(self.comm, "reduce", flat, work, self.machine)
        if not self.hierarchical:  # to the server, all at once
            return _start(self.comm, "reduce", flat, dist.reduce(flat, dst=self.root, group=self.across, async_op=True))
        return _Done(flat)

    def finish(self, state):
        flat = state.tensor if isinstance(state, _Done) else _wait(self.comm, state)
        is_leader = self.comm.rank == self.leader and len(self.leaders) > 1
        if self.hierarchical and is_leader:  # across machines, one device each
            if self.root is None:
                self._blocking("all_reduce", flat, lambda: dist.all_reduce(flat, group=self.across))
            else:
                self._blocking("reduce", flat, lambda: dist.reduce(flat, dst=self.root, group=self.across))
        if self.root is not None and is_leader:  # the server sends the sum back
            self._blocking("broadcast", flat, lambda: dist.broadcast(flat, src=self.root, group=self.across))
        if len(self.machine) > 1:
            g = self.groups.group(self.machine)
            self._blocking("broadcast", flat, lambda: dist.broadcast(flat, src=self.leader, group=g), self.machine)
        return flat

    def _blocking(self, kind, flat, run, devices=None):
        self.comm.before()
        ready_at = self.comm.on_wire(kind, flat.numel() * flat.element_size(), self.leaders if devices is None else devices)
        run()
        self.comm.off_wire(ready_at)


@dataclass
class _Done:
    tensor: torch.Tensor


class _PowerSGD(_Synchronizer):
    def __init__(self, comm: Comm, rank: int, bucket: int):
        self.comm, self.r, self.bucket = comm, rank, bucket
        self.error: list[torch.Tensor] | None = None
        self.q: list[torch.Tensor | None] = []

    def _matrices(self, parts):
        return [part.grad().reshape(part.grad().shape[0], -1) if part.grad().dim() else part.grad().reshape(1, 1)
                for part in parts]

    def launch(self, flat, parts):
        grads = self._matrices(parts)
        if self.error is None:
            self.error = [torch.zeros_like(g) for g in grads]
            gen = torch.Generator().manual_seed(1_000_003 * self.bucket)
            self.q = [torch.randn(g.shape[1], self.r, generator=gen, dtype=g.dtype) if min(g.shape) > self.r else None
                      for g in grads]
        ms = [g + e for g, e in zip(grads, self.error)]
        ps = [m @ q for m, q in zip(ms, self.q) if q is not None]
        plain = [m.reshape(-1) for m, q in zip(ms, self.q) if q is None]
        msg = torch.cat([p.reshape(-1) for p in ps] + plain) if ps or plain else flat.new_zeros(0)
        self.comm.launching()
        return ms, _start(self.comm, "all_reduce", msg, dist.all_reduce(msg, group=self.comm.group, async_op=True))

    def finish(self, state):
        ms, op = state
        msg = _wait(self.comm, op)
        compressed = [(m, q) for m, q in zip(ms, self.q) if q is not None]
        sizes = [m.shape[0] * self.r for m, _ in compressed]
        p_parts, plain_flat = msg[:sum(sizes)], msg[sum(sizes):]
        p_hat = [torch.linalg.qr(p.view(m.shape[0], self.r)).Q for p, (m, _) in zip(p_parts.split(sizes), compressed)]
        q_local = [m.T @ p for (m, _), p in zip(compressed, p_hat)]
        if q_local:
            q_msg = torch.cat([q.reshape(-1) for q in q_local])
            self.comm.before()
            ready_at = self.comm.on_wire("all_reduce", q_msg.numel() * q_msg.element_size())
            dist.all_reduce(q_msg, group=self.comm.group)
            self.comm.off_wire(ready_at)
            q_sum = [q.view(ql.shape) for q, ql in zip(q_msg.split([q.numel() for q in q_local]), q_local)]
        out, plain_at, k = [], 0, 0
        new_q = []
        for i, (m, q) in enumerate(zip(ms, self.q)):
            if q is None:
                synced = plain_flat[plain_at:plain_at + m.numel()].view_as(m)
                plain_at += m.numel()
                self.error[i] = torch.zeros_like(m)
                new_q.append(None)
            else:
                synced = p_hat[k] @ q_sum[k].T
                self.error[i] = m - p_hat[k] @ q_local[k].T
                new_q.append(q_sum[k])
                k += 1
            out.append(synced.reshape(-1))
        self.q = new_q
        return torch.cat(out)
