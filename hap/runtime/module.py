"""hap.HAP: a DDP-like wrapper that plans, shards and runs a model on every rank.

    dist.init_process_group("gloo")                      # or hap.runtime.launch.spawn(...)
    dmodel = hap.HAP(model, cluster, example_inputs)      # same seed, same model on every rank
    opt = torch.optim.Adam(dmodel.parameters())           # this rank's shards
    loss = dmodel(*batch); loss.backward(); opt.step()    # batch: the global batch

Rank 0 plans (or the plan given is used), every rank receives the same plan, checks that its
digest agrees with every other rank's and that the plan is for this many ranks, captures the
model itself and keeps only its part of each parameter. The returned loss has the value of the
global loss on every rank; its backward is exact, and the gradients of parameters kept whole
are all-reduced in one bucket as soon as the last of them has been accumulated.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..capture import capture
from ..cost.cluster import Cluster
from ..placement import R
from ..plan import Plan
from ..planner import PlannerConfig, _strategies, plan as make_plan
from ..rules.units import ShardClasses
from .collectives import Comm, all_reduce
from .executor import Executor, leaf_values


class HAP(nn.Module):
    def __init__(self, model: nn.Module, cluster: Cluster, example_inputs: Sequence[torch.Tensor], plan: Plan | None = None,
                 config: PlannerConfig | None = None, comm: Comm | None = None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("hap.HAP needs torch.distributed initialized first (or use hap.runtime.launch.spawn)")
        self.comm = comm = comm or Comm.default()
        if cluster.size != comm.world:
            raise ValueError(f"cluster {cluster.name!r} has {cluster.size} devices but {comm.world} ranks are running")
        self.model = model
        self.graph = graph = capture(model, tuple(example_inputs))
        self.plan = _agree(plan if plan is not None or comm.rank != 0 else make_plan(graph, cluster, config), comm)
        segment_of = [s for s, (first, last) in enumerate(self.plan.segments) for _ in range(first, last + 1)]
        classes = ShardClasses(graph, enumerate(_strategies(graph)))
        slowdown = cluster.devices[comm.rank].slowdown  # emulated on the local cluster (1: none)
        self.executor = ex = Executor(graph, self.plan.steps(graph), classes, segment_of, self.plan.ratios, comm, slowdown)
        _check_splits(self.plan, ex)
        self.shards = nn.ParameterDict(ex.shard_parameters(leaf_values(graph, model, example_inputs)))
        self._whole = [p for name, p in self.shards.items() if ex.stored[name][0] == R and p.requires_grad]
        self._arrived = 0
        for p in self._whole:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        part = self.executor.forward(leaf_values(self.graph, self.model, batch))  # this rank's part of the loss
        total = all_reduce(part.detach(), self.comm)
        return part + (total - part).detach()  # the global loss's value, the part's gradient

    def _on_grad(self, _param: torch.Tensor) -> None:
        self._arrived += 1
        if self._arrived == len(self._whole):
            self._arrived = 0
            self.executor.sync_gradients()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter reassembled whole, by the model's names (a collective: all ranks call it)."""
        return {self.graph.tensors[name].target: self.executor.whole(name, p.detach()) for name, p in self.shards.items()}


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
