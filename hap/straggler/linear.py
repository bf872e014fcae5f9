"""One tensor-parallel linear layer as the straggler runtime runs it: pruned, migrated, both, or
as planned. Every rank calls `TPLinear.apply` at the same point of the program and runs the same
collectives in the same order, forward and backward, whatever its role.

    column-parallel   x [..., K] whole (R),  W_r [N_r, K],  y_r [..., N_r]   (output split)
    row-parallel      x_r [..., K_r] split,  W_r [N, K_r],  y_r [..., N] a partial sum (P)

A rank computes its own columns `keep` (all of them, unless it prunes or hands some over); a
pruned column's gradient is imputed as zero (prune.py); a handed-over column's gradient is
computed by its receiver and sent back (migrate.py), so migration alone is exact.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from ..runtime.collectives import Comm, broadcast, first_order_only
from . import migrate
from .migrate import Handover, Method
from .prune import Lineage

Kind = Literal["column", "row"]


@dataclass(slots=True)
class Meter:
    """This rank's matmul clock for one iteration, with the schedule's emulated slowdown: time
    in the layers' own multiplications is charged `slowdown` times (the excess is slept off
    before the next collective, runtime/emulate.py), as on the paper's testbed. On a GPU the
    multiplications run asynchronously: they are timed by CUDA events, read when `seconds` is."""

    comm: Comm
    slowdown: float = 1.0
    charged: float = 0.0
    """Matmul seconds read so far this iteration, emulated slowdown included."""
    flops: float = 0.0
    """Multiply-add FLOPs this rank computed in them (its own columns and received ones)."""
    pending: list = field(default_factory=list)
    """CUDA (start, end) events of multiplications not yet read."""

    @property
    def seconds(self) -> float:
        """Matmul seconds this iteration, emulated slowdown included (M_i of Eq. 1)."""
        for start, end in self.pending:
            end.synchronize()
            self.charged += start.elapsed_time(end) / 1e3 * self.slowdown
        self.pending.clear()
        return self.charged

    def charge(self, seconds: float, flops: float) -> None:
        if flops == 0:  # an empty shard: no multiplication to slow (its call overhead is no matmul time)
            return
        self.charged += seconds * self.slowdown
        self.flops += flops
        emu = self.comm.emulation
        if emu is not None and self.slowdown > 1:
            emu.debt += (self.slowdown - 1) * seconds

    @contextmanager
    def timing(self, device: torch.device, flops: float):
        """Charge the multiplications run inside the block, `flops` of them: by the host's
        clock on a CPU; on a GPU by events on the current stream (an emulated slowdown there
        needs the time now, to owe its sleep: it waits for the block's kernels)."""
        if flops == 0:  # an empty shard: no multiplication to time (charge's rule)
            yield
            return
        if device.type != "cuda":
            t0 = time.perf_counter()
            yield
            self.charge(time.perf_counter() - t0, flops)
            return
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        if self.comm.emulation is not None and self.slowdown > 1:
            end.synchronize()
            self.charge(start.elapsed_time(end) / 1e3, flops)
        else:
            self.pending.append((start, end))
            self.flops += flops

    def reset(self) -> None:
        self.charged, self.flops = 0.0, 0.0
        self.pending.clear()


@dataclass(frozen=True, slots=True)
class Site:
    """A tensor-parallel linear node of the program."""

    node: int
    layer: str
    """The node's name (the lineage's layer)."""
    weight: str
    """The weight's graph tensor name."""
    kind: Kind
    out_sizes: tuple[int, ...]
    """N_r per rank (row-parallel: N on every rank)."""
    columns: tuple[int, ...]
    """K_r per rank: the contraction length each rank holds (column-parallel: K on every rank)."""
    tokens: int
    """T: the rows of the layer's input (the product of its leading dims), on every rank."""


@dataclass(slots=True)
class Work:
    """What this rank does at one site this iteration."""

    keep: torch.Tensor | None = None
    """Own contraction columns it computes (ascending); None: all of [0, K_r)."""
    lineage: Lineage | None = None
    """Set with `keep`: the columns it does not compute itself."""
    handovers: tuple[Handover, ...] = ()
    """Every straggler's handover at this site (the same on every rank)."""
    method: Method = "broadcast-reduce"

    @property
    def plain(self) -> bool:
        return self.keep is None and not self.handovers


@dataclass(slots=True)
class _Received:
    """A receiver's part of one handover, kept for the backward."""

    h: Handover
    lo: int
    hi: int
    w: torch.Tensor  # [N_k, hi - lo]
    x: torch.Tensor  # [..., hi - lo]


@dataclass(slots=True)
class _Ctx:
    site: Site
    work: Work
    meter: Meter
    received: list[_Received] = field(default_factory=list)


def _timed_linear(meter: Meter, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    with meter.timing(x.device, 2.0 * x.shape[:-1].numel() * w.numel()):
        y = F.linear(x, w, b)
    return y


class TPLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, c: _Ctx):
        work, comm, site = c.work, c.meter.comm, c.site
        if work.keep is None:
            y = _timed_linear(c.meter, x, w, b)  # [..., N_r]
        else:  # the columns are picked before the clock starts: the matmul alone is timed
            xk, wk = x.index_select(-1, work.keep), w.index_select(1, work.keep)
            y = _timed_linear(c.meter, xk, wk, b)
        for h in work.handovers:
            y = _forward_handover(c, h, x, w, y, site, comm, work.method)
        ctx.save_for_backward(x, w)
        ctx.c, ctx.has_bias = c, b is not None
        return y

    @staticmethod
    def backward(ctx, gy):
        first_order_only()
        x, w = ctx.saved_tensors
        c = ctx.c
        work, comm, site, meter = c.work, c.meter.comm, c.site, c.meter
        rows = math.prod(gy.shape[:-1])  # T tokens (explicit: a shard may be empty)
        g2 = gy.reshape(rows, gy.shape[-1])  # [T, N_r]
        wk, xk = (w, x) if work.keep is None else (w.index_select(1, work.keep), x.index_select(-1, work.keep))
        with meter.timing(gy.device, 4.0 * g2.shape[0] * wk.shape[0] * wk.shape[1]):  # the multiplications alone
            gxk = gy @ wk  # [..., |keep|]
            gwk = g2.t() @ xk.reshape(rows, xk.shape[-1])  # [N_r, |keep|]
        gx, gw = (gxk, gwk) if work.keep is None else (work.lineage.restore(gxk, -1), work.lineage.restore(gwk, 1))
        gb = g2.sum(0) if ctx.has_bias else None
        received = {id(r.h): r for r in c.received}
        for h in work.handovers:
            _backward_handover(c, h, received.get(id(h)), x, gy, gx, gw, site, comm, work.method)
        return gx, gw, gb, None


def _forward_handover(c: _Ctx, h: Handover, x, w, y, site: Site, comm: Comm, method: Method) -> torch.Tensor:
    """Straggler h.straggler's columns computed by the receivers and summed into its output."""
    me, k = comm.rank, h.straggler
    n_k, lead = site.out_sizes[k], x.shape[:-1]
    column = site.kind == "column"
    part = h.part(me)
    if method == "broadcast-reduce":
        numel = n_k * h.count + (0 if column else math.prod(lead) * h.count)
        if me == k:
            hand = slice(h.start, h.start + h.count)
            pieces = [w[:, hand].reshape(-1)] + ([] if column else [x[..., hand].reshape(-1)])
            buf = torch.cat(pieces)
        else:
            buf = x.new_empty(numel)
        broadcast(buf, k, comm)
        z = None
        if part is not None:
            lo, hi = part
            wh = buf[: n_k * h.count].view(n_k, h.count)[:, lo:hi]  # [N_k, hi - lo]
            xh = x[..., h.start + lo: h.start + hi] if column else buf[n_k * h.count:].view(*lead, h.count)[..., lo:hi]
            c.received.append(_Received(h, lo, hi, wh, xh))
            z = _timed_linear(c.meter, xh, wh)  # [..., N_k]: part of y_k
        if column:  # y_k is k's alone: reduce the parts to it
            t = y if me == k else (z if z is not None else y.new_zeros(*lead, n_k))
            migrate.reduce(t.contiguous() if me != k else t, k, comm)
            return t if me == k else y
        return y + z if z is not None else y  # row: partial sums, the layer's all-reduce adds them
    # scatter-gather: each receiver gets only its part, padded to the largest
    widest = max(hi - lo for lo, hi in map(h.part, h.receivers))
    x_cols = 0 if column else math.prod(lead)
    like = x.new_empty((n_k + x_cols) * widest)
    chunks = None
    if me == k:
        chunks = []
        for r in range(comm.world):
            p = h.part(r)
            chunk = x.new_zeros(n_k + x_cols, widest)
            if p is not None:
                cols = slice(h.start + p[0], h.start + p[1])
                chunk[:n_k, : p[1] - p[0]] = w[:, cols]
                if not column:
                    chunk[n_k:, : p[1] - p[0]] = x[..., cols].reshape(x_cols, -1)
            chunks.append(chunk.reshape(-1))
    mine = migrate.scatter(chunks, like, k, comm).view(n_k + x_cols, widest)
    z = y.new_zeros(*lead, n_k)
    if part is not None:
        lo, hi = part
        wh = mine[:n_k, : hi - lo]
        xh = x[..., h.start + lo: h.start + hi] if column else mine[n_k:, : hi - lo].reshape(*lead, hi - lo)
        c.received.append(_Received(h, lo, hi, wh, xh))
        z = _timed_linear(c.meter, xh, wh)
    parts = migrate.gather(z, k, comm)
    if me == k:
        return y + sum(parts[r] for r in h.receivers)
    return y


def _backward_handover(c: _Ctx, h: Handover, got: _Received | None, x, gy, gx, gw, site: Site, comm: Comm,
                       method: Method) -> None:
    """The gradients of the handed-over columns, computed by the receivers, into k's gx and gw."""
    me, k = comm.rank, h.straggler
    n_k, lead = site.out_sizes[k], x.shape[:-1]
    column = site.kind == "column"
    g_k = gy
    if column:  # receivers need k's output gradient (row-parallel: every rank holds it already)
        if method == "broadcast-reduce":
            g_k = gy.contiguous() if me == k else gy.new_empty(*lead, n_k)
            broadcast(g_k, k, comm)
        else:
            copies = [gy.contiguous()] * comm.world if me == k else None
            g_k = migrate.scatter(copies, gy.new_empty(*lead, n_k), k, comm)
    gw_part = gx_part = None
    if got is not None:
        g2 = g_k.reshape(math.prod(lead), n_k)
        with c.meter.timing(gy.device, 4.0 * g2.shape[0] * n_k * (got.hi - got.lo)):
            gw_part = g2.t() @ got.x.reshape(math.prod(lead), got.hi - got.lo)  # [N_k, hi - lo]
            gx_part = g_k @ got.w  # [..., hi - lo]
    if method == "broadcast-reduce" and column and got is not None:
        # x's gradient is a partial sum: add, the layer's all-reduce does the rest (reduce merging)
        gx[..., h.start + got.lo: h.start + got.hi] += gx_part
    # The rest goes to k alone, in disjoint column blocks per receiver: a reduce of those blocks
    # is their gather, for both methods.
    merged = method == "broadcast-reduce" and column
    t_rows = math.prod(lead)
    widest = max(hi - lo for lo, hi in map(h.part, h.receivers))
    chunk = gw.new_zeros(n_k + (0 if merged else t_rows), widest)
    if got is not None:
        chunk[:n_k, : got.hi - got.lo] = gw_part
        if not merged:
            chunk[n_k:, : got.hi - got.lo] = gx_part.reshape(t_rows, -1)
    parts = migrate.gather(chunk, k, comm)
    if me == k:
        for r in h.receivers:
            lo, hi = h.part(r)
            cols = slice(h.start + lo, h.start + hi)
            gw[:, cols] = parts[r][:n_k, : hi - lo]
            if not merged:
                gx[..., cols] += parts[r][n_k:, : hi - lo].reshape(*lead, hi - lo)
