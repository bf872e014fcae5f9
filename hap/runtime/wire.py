"""Every tensor collective and message of hap's runtime, on tensors its backend takes.

NCCL takes GPU tensors only, also for the small host tensors hap shares (the random generator's
state, label counts, clipping norms). gloo's collectives take GPU tensors (copying them through
host memory itself: seen on torch 2.11 with CUDA tensors, all_gather, gather, scatter, reduce,
reduce_scatter and all_to_all_single gave the right values), but its send and recv hand the GPU
pointer to the socket ("writev: Bad address"). Where a tensor's device and the backend disagree,
the call runs on staged copies (host memory for gloo's messages, the current GPU for NCCL) and
the results are copied back (on wait(), for asynchronous ones). So ranks that share a GPU
(fewer GPUs than ranks: NCCL refuses two ranks on one GPU) run the same program over gloo as
ranks with a GPU each over NCCL. Where nothing disagrees each function is torch.distributed's.
Each collective (not a message) first tells this rank's ledger (ledger.talking): the call it is
in talks to all ranks. Under a store ledger (ranks torchrun started) a collective's or
message's failure, at the call or at wait(), is the parting the ranks' calls show, where they
show one (ledger.named): also outside hap's calls, in a backward.

    work = wire.irecv(buf, src, tag=3)  # buf: a CUDA tensor, the default group: gloo
    work.wait()                         # buf now holds the message
"""

from __future__ import annotations

import atexit
import time
from typing import Sequence

import torch
import torch.distributed as dist

from .._torch import launch_collective
from . import ledger


class Staged:
    """A collective run on staged copies: wait() waits for it, then copies each result back to
    its own tensor. The same interface as torch.distributed's Work, as far as hap uses it."""

    def __init__(self, work, back: list[tuple[torch.Tensor, torch.Tensor]], keep: torch.Tensor | None = None):
        self.work, self.back, self.done = work, back, False
        self.keep = keep  # a staged copy being sent: alive until the work completes

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self, timeout=None) -> bool:
        if self.work is not None:
            self.work.wait() if timeout is None else self.work.wait(timeout)
        if not self.done:
            for own, staged in self.back:
                own.copy_(staged)
            self.done = True
        return True


class Named:
    """A collective in flight whose failure at wait() is the parting behind it (ledger.named)."""

    def __init__(self, work):
        self.work = work

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout=None) -> bool:
        try:
            return self.work.wait() if timeout is None else self.work.wait(timeout)
        except Exception as e:
            _raise_named(e)


def _raise_named(error: Exception):
    found = ledger.named(error)
    if found is error:
        raise error
    raise found from error


EXIT_SETTLE_S = 0.05
"""How long a process that ran collectives gives the GIL away at its end (atexit)."""
_settle_registered = False


def _settle_backends() -> None:
    """Give the GIL away for a moment before the interpreter finalizes. A backend's worker thread
    frees a finished collective after its caller has moved on; where the caller dropped a tensor
    the collective still held, freeing it needs the GIL. A worker that asks for the GIL once
    finalization has begun is ended, and the process aborts ("terminate called without an active
    exception": seen once in 44 torchrun runs of tests/torchrun_ranks.py after launch_collective
    took the backward's context out of the works)."""
    time.sleep(EXIT_SETTLE_S)


def _run(collective, *args, **kwargs):
    """collective(*args, **kwargs); under a store ledger (ranks torchrun started) its failure, at
    the call or at wait(), is the parting behind it: a peer that died or left during a
    backward's gradient sync was told in gloo's words alone ("Connection closed by peer")."""
    global _settle_registered
    if not _settle_registered:
        atexit.register(_settle_backends)
        _settle_registered = True
    if not ledger.keeps_store():
        return launch_collective(collective, *args, **kwargs)
    try:
        work = launch_collective(collective, *args, **kwargs)
    except Exception as e:
        _raise_named(e)
    return Named(work) if work is not None else None


def staging(group, tensors: Sequence[torch.Tensor | None], message: bool = False) -> torch.device | None:
    """The device a collective (or, `message`, a send or receive) of these tensors must run on
    over this group; None: where they are."""
    held = [t for t in tensors if t is not None]
    backend = dist.get_backend(group)
    if backend == "gloo" and message and any(t.device.type != "cpu" for t in held):
        return torch.device("cpu")
    if backend == "nccl" and any(t.device.type == "cpu" for t in held):
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _copy(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    return t.detach().to(dev, copy=True)


def _room(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=dev)


def _finish(work, back: list, async_op: bool):
    staged = Staged(work, back)
    if async_op:
        return staged
    staged.wait()
    return None


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """In place."""
    return _in_place(dist.all_reduce, t, group, async_op, op=op)


def broadcast(t: torch.Tensor, src: int, group=None, async_op: bool = False):
    """In place (src: a global rank)."""
    return _in_place(dist.broadcast, t, group, async_op, src=src)


def reduce(t: torch.Tensor, dst: int, group=None, async_op: bool = False):
    """In place: the sum lands in t on dst (elsewhere t is left as the backend leaves it)."""
    return _in_place(dist.reduce, t, group, async_op, dst=dst)


def _in_place(collective, t: torch.Tensor, group, async_op: bool, **how):
    ledger.talking(group)
    dev = staging(group, [t])
    if dev is None:
        return _run(collective, t, group=group, async_op=async_op, **how)
    staged = _copy(t, dev)
    return _finish(_run(collective, staged, group=group, async_op=async_op, **how), [(t, staged)], async_op)


def all_gather(outs: list[torch.Tensor], x: torch.Tensor, group=None, async_op: bool = False):
    ledger.talking(group)
    dev = staging(group, [x, *outs])
    if dev is None:
        return _run(dist.all_gather, outs, x, group=group, async_op=async_op)
    staged = [_room(o, dev) for o in outs]
    work = _run(dist.all_gather, staged, _copy(x, dev), group=group, async_op=async_op)
    return _finish(work, list(zip(outs, staged)), async_op)


def gather(x: torch.Tensor, outs: list[torch.Tensor] | None, dst: int, group=None, async_op: bool = False):
    ledger.talking(group)
    dev = staging(group, [x, *(outs or [])])
    if dev is None:
        return _run(dist.gather, x, outs, dst=dst, group=group, async_op=async_op)
    staged = [_room(o, dev) for o in outs] if outs is not None else None
    work = _run(dist.gather, _copy(x, dev), staged, dst=dst, group=group, async_op=async_op)
    return _finish(work, list(zip(outs, staged)) if outs is not None else [], async_op)


def scatter(out: torch.Tensor, chunks: list[torch.Tensor] | None, src: int, group=None, async_op: bool = False):
    ledger.talking(group)
    dev = staging(group, [out, *(chunks or [])])
    if dev is None:
        return _run(dist.scatter, out, chunks, src=src, group=group, async_op=async_op)
    staged = _room(out, dev)
    work = _run(dist.scatter, staged, [_copy(c, dev) for c in chunks] if chunks is not None else None, src=src,
                group=group, async_op=async_op)
    return _finish(work, [(out, staged)], async_op)


def reduce_scatter(out: torch.Tensor, parts: list[torch.Tensor], group=None, async_op: bool = False):
    ledger.talking(group)
    dev = staging(group, [out, *parts])
    if dev is None:
        return _run(dist.reduce_scatter, out, parts, group=group, async_op=async_op)
    staged = _room(out, dev)
    work = _run(dist.reduce_scatter, staged, [_copy(p, dev) for p in parts], group=group, async_op=async_op)
    return _finish(work, [(out, staged)], async_op)


def all_to_all_single(out: torch.Tensor, x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                      group=None, async_op: bool = False):
    ledger.talking(group)
    dev = staging(group, [out, x])
    if dev is None:
        return _run(dist.all_to_all_single, out, x, output_split_sizes=output_split_sizes,
                    input_split_sizes=input_split_sizes, group=group, async_op=async_op)
    staged = _room(out, dev)
    work = _run(dist.all_to_all_single, staged, _copy(x, dev), output_split_sizes=output_split_sizes,
                input_split_sizes=input_split_sizes, group=group, async_op=async_op)
    return _finish(work, [(out, staged)], async_op)


def isend(x: torch.Tensor, dst: int, tag: int = 0, group=None):
    dev = staging(group, [x], message=True)
    if dev is None:
        return _run(dist.isend, x, dst, group=group, tag=tag)
    staged = _copy(x, dev)
    return Staged(_run(dist.isend, staged, dst, group=group, tag=tag), [], keep=staged)


def irecv(buf: torch.Tensor, src: int, tag: int = 0, group=None):
    dev = staging(group, [buf], message=True)
    if dev is None:
        return _run(dist.irecv, buf, src, group=group, tag=tag)
    staged = _room(buf, dev)
    return Staged(_run(dist.irecv, staged, src, group=group, tag=tag), [(buf, staged)])
