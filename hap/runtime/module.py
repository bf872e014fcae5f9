"""hap.HAP: a DDP-like wrapper that plans, shards and runs a model on every rank.

    dist.init_process_group("gloo")                      # or hap.runtime.launch.spawn(...)
    dmodel = hap.HAP(model, cluster, example_inputs)      # same seed, same model on every rank
    opt = torch.optim.Adam(dmodel.parameters())           # this rank's shards
    loss = dmodel(*batch); loss.backward(); opt.step()    # batch: the global batch

Rank 0 plans (or the plan given is used), every rank receives the same plan, checks that its
digest agrees with every other rank's and that the plan is for this many ranks, captures the
model itself and keeps only its part of each parameter. The returned loss has the value of the
global loss on every rank; its backward is exact, and the gradients of parameters kept whole
are all-reduced in buckets overlapped with the backward (gradsync.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..capture import capture
from ..cost.cluster import Cluster
from ..placement import R
from ..plan import Plan
from ..planner import PlannerConfig, _strategies, plan as make_plan
from ..rules.local import is_random
from ..rules.units import ShardClasses
from .collectives import Comm, all_reduce
from .emulate import Emulation
from .executor import Executor, leaf_values
from .gradsync import GradSync


class HAP(nn.Module):
    def __init__(self, model: nn.Module, cluster: Cluster, example_inputs: Sequence[torch.Tensor], plan: Plan | None = None,
                 config: PlannerConfig | None = None, comm: Comm | None = None,
                 init: Callable[[nn.Module], None] | None = None, global_loss: bool = True):
        """init: for a model built on the meta device (too large for one device), how to fill a
        submodule's parameters once materialized (default: its reset_parameters()). Submodules
        are materialized one at a time, in model.modules() order, and only this rank's part of
        each parameter is kept, so no rank ever holds the whole model.

        global_loss: forward returns the loss of the global batch on every rank (one scalar
        all-reduce per step); False returns this rank's part of it (the parts sum to the loss,
        and backward is the same), saving that all-reduce, as DDP returns each rank's own loss."""
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("hap.HAP needs torch.distributed initialized first (or use hap.runtime.launch.spawn)")
        comm = comm or Comm.default()
        if cluster.size != comm.world:
            raise ValueError(f"cluster {cluster.name!r} has {cluster.size} devices but {comm.world} ranks are running")
        if comm.emulation is None:  # the cluster's emulated slow devices and links (local cluster)
            comm = dataclasses.replace(comm, emulation=Emulation.for_rank(cluster, comm.rank))
        self.comm = comm
        self.model, self.global_loss = model, global_loss
        meta = any(p.is_meta for p in model.parameters())
        if meta:  # capture traces shapes only: give it the inputs on the model's device
            example_inputs = tuple(x.to("meta") for x in example_inputs)
        self.graph = graph = capture(model, tuple(example_inputs))
        self.plan = _agree(plan if plan is not None or comm.rank != 0 else make_plan(graph, cluster, config), comm)
        segment_of = [s for s, (first, last) in enumerate(self.plan.segments) for _ in range(first, last + 1)]
        classes = ShardClasses(graph, enumerate(_strategies(graph)))
        self.executor = ex = Executor(graph, self.plan.steps(graph), classes, segment_of, self.plan.ratios, comm)
        _check_splits(self.plan, ex)
        if meta:
            for values in _materialized(model, graph, init):
                ex.shard_parameters(values)
            self.shards = nn.ParameterDict(ex.params)
        else:
            self.shards = nn.ParameterDict(ex.shard_parameters(leaf_values(graph, model, example_inputs)))
        first_use = {}
        for i, step in enumerate(ex.program):
            for ld in step.loads:
                first_use.setdefault(ld.tensor, i)
        whole = [name for name, p in self.shards.items() if ex.stored[name][0] == R and p.requires_grad]
        whole.sort(key=lambda name: -first_use[name])  # gradients arrive last-used first
        self.grad_sync = GradSync([self.shards[name] for name in whole], comm)
        self._buffers = [(name, t.target) for name, t in graph.tensors.items() if t.kind == "buffer"]
        self._random = any(is_random(node) for node in graph.nodes)

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        """The loss of the global batch. Each input is given whole (the global batch) or as this
        rank's part of it (rows `input_slices()` names), which is all this rank then loads."""
        if self._random:  # random ops draw on every rank what one device would (rules/local.py)
            self._sync_rng()
        if len(batch) != len(self.graph.inputs):
            raise ValueError(f"the model takes {len(self.graph.inputs)} inputs, got {len(batch)}")
        values = dict(zip(self.graph.inputs, batch))  # parameters are the executor's shards
        values.update((name, self.model.get_buffer(target).detach()) for name, target in self._buffers)
        presliced = frozenset(self._given_as_part(batch))
        part = self.executor.forward(values, presliced)  # this rank's part of the loss
        if not self.global_loss:
            return part
        total = all_reduce(part.detach(), self.comm)
        return part + (total - part).detach()  # the global loss's value, the part's gradient

    def input_slices(self) -> list[tuple[int, int, int] | None]:
        """Per model input, the rows this rank needs: (dim, start, length) of the global batch, or
        None where it needs the whole input. A data loader reads just these rows per rank."""
        slices = self.executor.input_slices()
        return [slices[name] for name in self.graph.inputs]

    def local_batch(self, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part of a global batch (what `input_slices` names)."""
        return tuple(x if s is None else x.narrow(*s) for x, s in zip(batch, self.input_slices()))

    def _given_as_part(self, batch: Sequence[torch.Tensor]) -> list[str]:
        parts = []
        for name, x, s in zip(self.graph.inputs, batch, self.input_slices()):
            whole = tuple(self.graph.tensors[name].shape)
            if tuple(x.shape) == whole:
                continue
            mine = whole if s is None else tuple(s[2] if d == s[0] else n for d, n in enumerate(whole))
            if tuple(x.shape) != mine:
                raise ValueError(f"input {name}: shape {tuple(x.shape)} is neither the global batch's {whole} nor "
                                 f"this rank's part of it {mine}")
            parts.append(name)
        return parts

    def _sync_rng(self) -> None:
        state = torch.get_rng_state()
        self.comm.before()
        dist.broadcast(state, src=dist.get_global_rank(self.comm.group, 0) if self.comm.group else 0,
                       group=self.comm.group)
        self.comm.after("broadcast", state.numel())
        torch.set_rng_state(state)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: the norm of the global gradient
        (every rank's shards of sharded parameters, parameters kept whole counted once), the
        same on every rank; every local gradient is scaled by min(1, max_norm / (norm + 1e-6)).
        A collective: every rank calls it, after backward. Returns the total norm."""
        sharded, whole = [], []
        for name, p in self.shards.items():
            if p.grad is not None:
                (sharded if self.executor.stored[name][0].is_shard else whole).append(p.grad)
        mine = sharded + (whole if self.comm.rank == 0 else [])  # whole gradients are equal on all ranks
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max() for g in mine if g.numel()] or [torch.zeros(())])
            total = local.max().reshape(1)
            self.comm.before()
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.comm.group)
            self.comm.after("all_reduce", 4)
            total = total[0]
        else:
            local = sum((g.double().abs().pow(norm_type).sum() for g in mine), torch.zeros((), dtype=torch.float64))
            total = all_reduce(local.reshape(1), self.comm)[0].pow(1.0 / norm_type).float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in sharded + whole:
            g.mul_(coef)
        return total

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter reassembled whole, by the model's names (a collective: all ranks call it)."""
        return {self.graph.tensors[name].target: self.executor.whole(name, p.detach()) for name, p in self.shards.items()}


def _materialized(model: nn.Module, graph, init: Callable[[nn.Module], None] | None):
    """For a meta-device model: each submodule's own parameters, made real and initialized, as
    {graph tensor: value}; then the submodule goes back to meta (only the shards stay). Buffers
    stay materialized: they are needed whole."""
    by_target = {t.target: name for name, t in graph.tensors.items() if t.kind in ("param", "buffer")}
    for prefix, sub in model.named_modules():
        own = list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False))
        if not any(t.is_meta for _, t in own):
            continue
        sub.to_empty(device="cpu", recurse=False)
        if init is not None:
            init(sub)
        elif hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
        else:
            raise ValueError(f"module {prefix or '(root)'} ({type(sub).__name__}) is on the meta device and has no "
                             "reset_parameters(): pass hap.HAP(..., init=fn) to initialize it")
        own = list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False))  # now real
        with torch.no_grad():
            values = {by_target[f"{prefix}.{n}" if prefix else n]: t.detach() for n, t in own
                      if (f"{prefix}.{n}" if prefix else n) in by_target}
        yield values
        for n, p in sub.named_parameters(recurse=False):  # free the whole values; the shards were copied
            setattr(sub, n, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))


def _agree(plan: Plan | None, comm: Comm) -> Plan:
    """Rank 0's plan on every rank; a rank that was given a different plan is an error."""
    mine = plan.to_json() if plan is not None else None
    box = [mine]
    dist.broadcast_object_list(box, src=0, group=comm.group)
    agreed = Plan.from_json(box[0])
    digests = [None] * comm.world
    dist.all_gather_object(digests, plan.digest if plan is not None else agreed.digest, group=comm.group)
    if len(set(digests)) > 1:
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        raise ValueError(f"ranks {bad} were given a plan (digest {digests[bad[0]]}) other than rank 0's ({digests[0]})")
    if len(agreed.devices) != comm.world:
        raise ValueError(f"the plan is for {len(agreed.devices)} devices but {comm.world} ranks are running")
    return agreed


def _check_splits(plan: Plan, ex: Executor) -> None:
    """The shard sizes this rank computes must be the plan's (same graph, same rounding). The
    plan lists one split per tensor dim, so only one-segment plans are checked."""
    if len(plan.ratios) != 1:
        return
    for tensor, dims in plan.splits.items():
        for dim, sizes in dims.items():
            mine = ex.classes.split_sizes(tensor, int(dim), plan.ratios[0])
            if list(mine) != list(sizes):
                raise ValueError(f"plan does not match the model: {tensor} dim {dim} split {sizes} in the plan, {mine} here")
