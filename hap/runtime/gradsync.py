"""Gradient synchronization overlapped with the backward pass, as DDP does it.

Parameters kept whole (R) on every rank receive partial gradients that must be summed over
ranks. The plan groups them into buckets, one per layer chunk, in the order their gradients
arrive (search/program.sync_buckets, the buckets its cost model prices); a bucket's
all-reduce starts, asynchronously, as soon as it and every bucket before it are complete
(every rank starts them in the same order), so communication runs while the backward computes
the earlier layers' gradients. The last gradient to arrive waits for all of them and writes
the sums back.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .collectives import Comm

class GradSync:
    def __init__(self, buckets: Sequence[Sequence[nn.Parameter]], comm: Comm):
        """buckets: in the order they complete (their gradients' arrival), none empty."""
        assert all(buckets), "an empty gradient bucket"
        self.comm = comm
        self.buckets: list[list[nn.Parameter]] = [list(b) for b in buckets]
        params = [p for b in self.buckets for p in b]
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._reset()
        if comm.world > 1:
            for p in params:
                p.register_post_accumulate_grad_hook(self._arrived)

    def _reset(self) -> None:
        self.missing = [len(b) for b in self.buckets]
        self.launched = 0
        self.pending: list[tuple[int, torch.Tensor, dist.Work]] = []

    def _arrived(self, p: nn.Parameter) -> None:
        self.missing[self.bucket_of[id(p)]] -= 1
        while self.launched < len(self.buckets) and self.missing[self.launched] == 0:
            self._launch(self.launched)
            self.launched += 1
        if self.launched == len(self.buckets):
            self._finish()

    def _launch(self, i: int) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
        self.comm.launching()  # an emulated slow rank arrives late
        self.pending.append((i, flat, dist.all_reduce(flat, group=self.comm.group, async_op=True)))

    def _finish(self) -> None:
        for i, flat, work in self.pending:
            self.comm.before()  # the rank waits from here (an emulated one's debt was settled at launch)
            work.wait()
            self.comm.after("all_reduce", flat.numel() * flat.element_size())
            for p, part in zip(self.buckets[i], flat.split([p.numel() for p in self.buckets[i]])):
                p.grad.copy_(part.view_as(p.grad))
        self._reset()
