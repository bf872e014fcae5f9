"""Pipeline plans: the data-parallel program cut into stages, as a Plan the runtime runs.

    space = PipelineSpace(graph, cluster, PlannerConfig())
    plan = space.plan(cuts=[120, 240, 360], K=4, M=8, seconds=0.0, search={})     # 4 stages, cut before those nodes
    plan = exact_plan(graph, cluster, PlannerConfig(pipeline_stages=4))            # hap plan --planner pp-exact
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from ..cost.cluster import Cluster
from ..cost.model import CostModel
from ..ir import Graph
from ..plan import Plan, PlanStage, Schedule, SyncEntry, instructions, shard_sizes
from ..planner import PlannerConfig, baseline_plan, batched_inputs
from ..rules import has_rule, strategy_table
from ..rules.units import ShardClasses
from ..search.program import MoveStep, Step
from .partition import NoCutFits, StageTable, device_layouts, exact_partition, nearest_to_fit, pivots, shortfall, speed_ratios
from .price import PipelineEstimate, PipelinePricer
from .stages import (batch_granules, check_pipelinable, crossings, data_parallel_obstacle, micro_batch_granules,
                     piece_ratios, stage_of_nodes, stage_ranges, whole_batch_reason)


class PipelineSpace:
    """What every pipeline planner of one (graph, cluster) shares: the data-parallel program,
    its pricer, the pivots and the batch's granules."""

    def __init__(self, graph: Graph, cluster: Cluster, config: PlannerConfig | None = None, pivot_limit: int = 128):
        self.config = config = config or PlannerConfig()
        self.graph, self.cluster = graph, cluster
        self.program: list[Step] = baseline_plan(graph, cluster, "dp-ev", config).steps(graph)
        split = any(ld.tensor in graph.inputs and ld.placement.is_shard for step in self.program for ld in step.loads)
        if not split or any(ms.move.communicates for step in self.program for ms in step.moves):
            unknown = sorted({nd.op for nd in graph.nodes if not has_rule(nd.op)})
            obstacle = data_parallel_obstacle(graph)
            one_row = any(graph.tensors[name].shape[:1] == (1,) for name in graph.inputs)
            batched = [name for name in graph.inputs if name in batched_inputs(graph)]
            lead = graph.tensors[batched[0]].shape[0] if batched else None
            raise ValueError("data parallelism cannot run this model without moving activations between devices"
                             + (f" (ops without a rule: {', '.join(unknown)})" if unknown else "")
                             + (f": {obstacle}" if obstacle else "") + "; a pipeline cuts a data-parallel program"
                             # (a class-weight vector given first, or as long as the batch, is taken for the batch)
                             + (f"; split on the batch: {', '.join(batched)}, the inputs of the first input's "
                                f"leading size {lead} (give the batch first, of a size no other input has)"
                                if len(batched) < len(graph.inputs) or any(
                                    len(graph.tensors[n].shape) == 1 and graph.tensors[n].dtype.startswith("float")
                                    for n in batched) else "")  # (not for labels: integers)
                             # (export specializes dims of size 1: one row's graph is not the batch's general one)
                             + ("; this is a batch of 1 row, whose graph export specializes: plan with 2 rows at least"
                                if one_row else ""))
        check_pipelinable(graph, self.program, config.micro_batches or None)
        self.whole_batch = whole_batch_reason(graph, self.program)
        """Why every pipeline of this program runs 1 micro-batch (BatchNorm), or None."""
        self.classes = ShardClasses(graph, enumerate(strategy_table(graph)))
        self.cost = CostModel(graph, cluster, self.classes, config.optimizer)
        self.pricer = PipelinePricer(self.cost, self.program)
        self.pivots = pivots(self.cost, self.program, pivot_limit)
        self.granules = batch_granules(graph, self.classes, self.program)

    def stage_counts(self) -> list[int]:
        K, n = self.config.pipeline_stages, self.cluster.size
        most = min(n, len(self.pivots) + 1)
        if most < 2:  # (a one-stage "pipeline" is a one-stage plan: astar's)
            cuts = len(self.pivots)
            raise ValueError(f"a pipeline needs 2 devices and a point to cut the model at least: {n} device"
                             f"{'s' if n != 1 else ''}, {cuts} cut point{'s' if cuts != 1 else ''} in the model")
        if K:
            if K < 2 or K > most:
                raise ValueError(f"{K} pipeline stage{'s' if K != 1 else ''}: a pipeline here has 2 to {most} "
                                 f"({n} devices, {len(self.pivots)} cut points in the model)")
            return [K]
        # (groups need not be equal: group_layouts balances their speeds; and on up to 8 devices a
        # stage per device too)
        return [k for k in sorted({2, 4, 8, min(n, 8)}) if 2 <= k <= most]

    def layouts(self, K: int) -> list[list[list[int]]]:
        """The device groups the pipeline planners try for K stages (partition.device_layouts):
        pp-exact every one, the DQN the one it screens (automap.pipeline.screened_table)."""
        return device_layouts([1.0 / x for x in self.cost.inv_speed], K)

    def micro_batch_counts(self, K: int) -> list[int]:
        M = self.config.micro_batches
        if self.whole_batch:
            return [1]
        if M:
            micro_batch_granules(self.granules, M)  # a clear error where it cannot split
            return [M]
        return sorted({min(x, self.granules) for x in (K, 2 * K, 4 * K)})

    def groups_and_ratios(self, K: int, groups: Sequence[Sequence[int]] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """K device groups (default: the first layout) and each group's shares of a micro-batch."""
        groups = [list(g) for g in groups] if groups is not None else self.layouts(K)[0]
        return groups, [speed_ratios(self.cost, g) for g in groups]

    def table(self, K: int, M: int, groups: Sequence[Sequence[int]] | None = None) -> StageTable:
        groups, ratios = self.groups_and_ratios(K, groups)
        return StageTable(self.pricer, self.pivots, groups, ratios, M, self.config.pipeline_schedule)

    def plan(self, cuts: Sequence[int], K: int, M: int, seconds: float, search: dict,
             groups: Sequence[Sequence[int]] | None = None) -> Plan:
        groups, ratios = self.groups_and_ratios(K, groups)
        return assemble(self, cuts, groups, ratios, M, seconds, search)


def assemble(space: PipelineSpace, cuts: Sequence[int], groups: Sequence[Sequence[int]], ratios: Sequence[Sequence[float]],
             M: int, seconds: float, search: dict) -> Plan:
    """The Plan of the data-parallel program cut before nodes `cuts`, stage k on groups[k]."""
    graph, classes, config = space.graph, space.classes, space.config
    if len(groups) != len(cuts) + 1 or len(ratios) != len(groups):
        raise ValueError(f"{len(cuts)} cut{'s make' if len(cuts) != 1 else ' makes'} {len(cuts) + 1} stages; got "
                         f"{len(groups)} device groups and "
                         f"{len(ratios)} lists of shares")
    for k, (group, shares) in enumerate(zip(groups, ratios)):
        if len(shares) != len(group):
            raise ValueError(f"stage {k}: {len(shares)} shares for the {len(group)} devices {list(group)}")
    n = len(graph.nodes)
    stage_of = stage_of_nodes(cuts, n)
    crossings(graph, space.program, stage_of)  # a clear error for a cut that cannot be sent
    micro = micro_batch_granules(space.granules, M)
    stages = []
    ranges = stage_ranges(cuts, n)
    programs = stage_programs(graph, space.program, ranges)
    for k, ((a, b), steps) in enumerate(zip(ranges, programs)):
        pieces = piece_ratios(micro, ratios[k])
        stages.append(PlanStage(devices=list(groups[k]), nodes=[a, b], segments=[[a, b]], ratios=[list(ratios[k])],
                                program=instructions(steps, graph),
                                shards=shard_sizes(steps, graph, classes, [0] * n, [pieces])))
    buckets: dict[tuple[int, ...], int] = {}
    sync = []
    held = synced_groups(graph, programs, groups)
    for name in sorted(held, key=lambda x: graph.tensors[x].consumers[0]):
        sync.append(SyncEntry(param=name, bucket=buckets.setdefault(held[name], len(buckets)), devices=held[name]))
    est = space.pricer.estimate(cuts, groups, ratios, M, config.pipeline_schedule)
    return Plan(model=graph.model_name, cluster=space.cluster.to_dict(), devices=[d.name for d in space.cluster.devices],
                stages=stages, sync=sync, schedule=Schedule(name=config.pipeline_schedule, micro_batches=M),
                baselines={}, synthesis_seconds=seconds,
                replicated_ops=sorted({nd.op for nd in graph.nodes if not has_rule(nd.op)}), search=search,
                **_estimated(est, M, config.pipeline_schedule, space.pricer.step_collectives))


def synced_groups(graph: Graph, stage_steps: Sequence[Sequence[Step]], groups: Sequence[Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Per trainable parameter a pipeline uses, the devices that all-reduce its gradient: those
    of every stage that loads it (a tied embedding's first and last), in rank order."""
    users: dict[str, set[int]] = {}
    for k, steps in enumerate(stage_steps):
        for step in steps:
            for ld in step.loads:
                t = graph.tensors[ld.tensor]
                if t.kind == "param" and t.requires_grad:
                    users.setdefault(ld.tensor, set()).add(k)
    return {name: tuple(sorted(d for k in ks for d in groups[k])) for name, ks in users.items()}


def stage_programs(graph: Graph, program: Sequence[Step], ranges: Sequence[tuple[int, int]]) -> list[list[Step]]:
    """The program's steps of each stage (node range), each able to run on what its stage
    holds: what crosses a cut arrives as its producer made it, so a local move an earlier stage
    made of it (a whole tensor sliced to its rows, at its first use) is made again before its
    first use in a later stage (Bloom's ALiBi bias: a KeyError in the ranks before)."""
    made: dict[tuple[str, object], MoveStep] = {}
    produced: dict[str, object] = {}
    out = []
    for a, b in ranges:
        held = set(produced.items())  # the crossings, as produced

        def ensure(tensor, p, extra):
            if (tensor, p) in held:
                return
            ms = made.get((tensor, p))
            assert ms is not None and not ms.move.communicates, f"{tensor} {p} is neither held nor made locally"
            ensure(ms.tensor, ms.move.src, extra)
            extra.append(ms)
            held.add((tensor, p))

        steps = []
        for st in program:
            if not a <= st.node <= b:
                continue
            node, extra = graph.nodes[st.node], []
            held.update((ld.tensor, ld.placement) for ld in st.loads)
            for ms in st.moves:
                ensure(ms.tensor, ms.move.src, extra)
                extra.append(ms)
                held.add((ms.tensor, ms.move.dst))
                made.setdefault((ms.tensor, ms.move.dst), ms)
            for name, p in zip(node.inputs, st.strategy.inputs):
                ensure(name, p, extra)
            steps.append(dataclasses.replace(st, moves=tuple(extra)))
            for name, p in zip(node.outputs, st.strategy.outputs):
                held.add((name, p))
                produced[name] = p
        out.append(steps)
    return out


def _estimated(est: PipelineEstimate, M: int, schedule: str, step_collectives: float) -> dict:
    """A pipeline Plan's fields that state its estimate (the timeline names the schedule it
    priced: explain draws that one, whatever a hand edit made of the plan's)."""
    return dict(estimated_iteration_seconds=est.seconds, breakdown=breakdown(est, M, step_collectives),
                timeline={"pipeline": {"stage_seconds": list(est.stage_seconds), "fwd": list(est.fwd), "bwd": list(est.bwd),
                                       "send": list(est.send), "send_back": list(est.send_back), "sync": list(est.sync),
                                       "simulated": est.simulated, "schedule": schedule, "micro_batches": M}},
                memory_bytes=list(est.memory))


def priced_pipeline(graph: Graph, cluster: Cluster, plan: Plan, config: PlannerConfig | None = None) -> Plan:
    """A pipeline plan (its cuts, groups, shares, micro-batches and schedule as they are)
    priced again on `cluster`, as planning it there prices it (planner.priced's pipeline half)."""
    M, schedule = plan.schedule.micro_batches, plan.schedule.name
    config = PlannerConfig(optimizer=(config or PlannerConfig()).optimizer, micro_batches=M, schedule=schedule)
    space = PipelineSpace(graph, cluster, config)
    shares = [[x / sum(st.ratios[0]) for x in st.ratios[0]] for st in plan.stages]  # (relative, as the runtime splits)
    est = space.pricer.estimate([st.nodes[0] for st in plan.stages[1:]], [st.devices for st in plan.stages],
                                shares, M, schedule)
    return dataclasses.replace(plan, written="", **_estimated(est, M, schedule, space.pricer.step_collectives))


def breakdown(est: PipelineEstimate, M: int, step_collectives: float) -> dict[str, float]:
    """The estimate's terms (price.iteration_seconds), which add up to it: every stage's pass of
    one micro-batch (fill and drain), M - 1 more of the slowest (steady state), the gradient
    all-reduce after the flush, and the loss's all-reduce with the generator's broadcasts.
    Transfers are inside the stage times."""
    busy = sum(est.stage_seconds)
    steady = (M - 1) * max(est.stage_seconds)
    return {"pipeline_fill_and_drain": busy, "pipeline_steady": steady,
            "gradient_sync": max(0.0, est.seconds - busy - steady - step_collectives),  # (not -1e-19)
            "loss_and_rng_collectives": step_collectives}


def exact_plan(graph: Graph, cluster: Cluster, config: PlannerConfig | None = None,
               progress: Callable[[str], None] | None = None) -> Plan:
    """The pipeline of least estimated time over stage counts, device groups
    (PipelineSpace.layouts), micro-batch counts and cuts (exact_partition for each). The cut is
    exact (search.exhaustive) for each of the `search.layouts` groupings tried, which are not
    every way to group the devices."""
    t0 = time.perf_counter()
    space = PipelineSpace(graph, cluster, config)
    best, unfit, tried, exact = None, [], 0, True
    for K in space.stage_counts():
        for groups in space.layouts(K):
            tried += 1
            sizes = "/".join(str(len(g)) for g in groups)
            for M in space.micro_batch_counts(K):
                table = space.table(K, M, groups)
                try:
                    part = exact_partition(table)
                except NoCutFits:  # another layout's may
                    unfit.append(table)
                    continue
                exact = exact and part.exact
                if progress:
                    progress(f"pp-exact: K={K} groups {sizes} M={M}: {part.seconds * 1e3:.2f} ms")
                if best is None or part.seconds < best[0].seconds:
                    best = (part, K, M, groups)
    if best is None and not unfit:
        raise ValueError(f"{graph.model_name} cannot be cut into a pipeline on {cluster.size} devices")
    if best is None and len(unfit) > 1:
        raise NoCutFits(f"no pipeline fits the devices' memory in any of the {len(unfit)} layouts and micro-batch "
                        "counts tried" + shortfall(nearest_to_fit(unfit)))
    if best is None:
        raise NoCutFits(f"no cut into {len(unfit[0].groups)} stages fits the devices' memory" + shortfall(unfit[0]))
    part, K, M, groups = best
    return space.plan(part.cuts, K, M, time.perf_counter() - t0,
                      {"planner": "pp-exact", "winner": f"pipeline K={K} M={M} groups {[len(g) for g in groups]}",
                       "exhaustive": exact, "pivots": len(space.pivots), "explored": part.explored,
                       "layouts": tried}, groups)
