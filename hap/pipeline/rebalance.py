"""Exact rebalancing of a running pipeline when a device slows down for good (or recovers).

    reb = Rebalancer(pipe, opt, batch, RebalanceConfig(schedule=parse_schedule("persistent:chi=4,rank=1", 2)),
                     make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    for it in range(steps):
        reb.begin_step(it)                 # this rank's emulated slowdown at `it` (all of its computing)
        loss = reb.pipe.train_step(*batch)
        if reb.opt is not None:
            reb.opt.step(); reb.opt.zero_grad()
        reb.end_step()                     # measure; maybe re-plan and move: reb.pipe and reb.opt are new

Detection: every step the ranks all-gather their busy seconds (Pipeline.last_step["compute"]:
forward and backward, an emulated device's sleep included, waiting not). A rank's reference is
the median of its first `window` steps under the current plan; when the median of its last
`window` steps is off it by more than `threshold`, its relative speed is divided by that
ratio and the references start again (a rank the plan leaves under SUBSTANTIAL of the busiest's
estimate, the loss alone, keeps its speed: measurable). A device slow from the start (before any reference)
is found at the first window by the plan's own estimate: each rank's busy seconds over the
plan's (its stage's forward and backward, M micro-batches), relative to the median rank's,
off by more than `start_threshold` (the estimate's own error between stages, op overheads
priced low on small stages, was within 0.35 on this CPU: off_plan).

Decision, the same on every rank: rank 0 runs pp-exact (the plan's stage count, micro-batches
and schedule) on the cluster at those speeds (planner.slowed_cluster) and prices the current
plan there too. The new plan is pending when it is faster by `gain`; it is taken once the time
lost since (each step's seconds times the fraction the new plan saves) has paid for the move
(ski rental: the last move's measured seconds; before any, the cluster's price of sending the
parameters and optimizer state once).

The move: a Pipeline of the new plan, whose cuts, device groups and shares may all differ,
given this one's parameters, buffers and optimizer state by checkpoint.hand_over (what saving
a checkpoint and loading it would do, sent between the ranks: no directory, so ranks on
machines that share no file system move too). Exact, as resuming is: loss, gradients and
parameters stay one device's.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Literal, Sequence

import torch
import torch.distributed as dist

from ..config import check_fields, instance, number, one_of, whole
from ..plan import Plan
from ..runtime import wire
from ..straggler.schedule import Schedule

log = logging.getLogger("hap")


@dataclass(kw_only=True, slots=True)
class RebalanceConfig:
    policy: Literal["none", "rebalance"] = "rebalance"
    """"none": emulate and measure only."""
    schedule: Schedule = field(default_factory=Schedule)
    """Emulated slowdowns (a pipeline's straggler is slowed in all of its computing)."""
    window: int = 3
    """Steps whose median busy time is compared with the reference (and makes it)."""
    threshold: float = 0.25
    """A rank's speed is re-measured when its busy time moved by more than this fraction."""
    start_threshold: float = 0.5
    """At the first window of the run's plan: a rank's busy time off the plan's estimate, relative
    to the other ranks', by more than this fraction is a device slow (or fast) from the start."""
    gain: float = 0.10
    """A new plan must be estimated faster than the current one by this fraction."""

    def __post_init__(self):
        check_fields(self, policy=one_of("none", "rebalance"), schedule=instance(Schedule), window=whole(1),
                     threshold=number(0, above=True), start_threshold=number(0, above=True), gain=number(0))


def changed_speeds(speeds: Sequence[float], reference: Sequence[float], recent: Sequence[float],
                   threshold: float, counted: Collection[int] | None = None) -> list[float] | None:
    """New relative speeds where a rank's recent busy seconds are off its reference by more than
    `threshold` (busy twice as long: half the speed), else None. A rank outside `counted` (None:
    every rank) keeps its speed: its busy seconds are no measure of it (measurable)."""
    ratios = [now / ref if ref > 0 and (counted is None or i in counted) else 1.0
              for i, (now, ref) in enumerate(zip(recent, reference))]
    if all(abs(r - 1.0) <= threshold for r in ratios):
        return None
    return [s / r if abs(r - 1.0) > threshold else s for s, r in zip(speeds, ratios)]


def off_plan(speeds: Sequence[float], planned: Sequence[float], measured: Sequence[float],
             threshold: float) -> list[float] | None:
    """New relative speeds where a rank's busy seconds over the plan's estimate of them
    (`planned`), relative to the median rank's, are off by more than `threshold`, else None.
    The plan's absolute scale cancels: only how the ranks compare counts. Ranks planned less
    than SUBSTANTIAL of the busiest's are left out (a stage of the loss alone, estimated at
    0.05 ms, is busy with the step's fixed costs: 20x its estimate on a healthy run), and at
    least two must remain.

    Of two, whether to move is decided against their mean (the median of two: the pair more
    than (1 + threshold) / (1 - threshold) apart, 3x at 0.5, as the estimate's error between
    stages is not), and the move is then measured from the faster, taken for healthy (a
    straggler is slower than planned, seldom faster): measured from their mean, a 6x straggler's
    healthy peer was 3.5x fast, and so every rank left out 3.5x slow."""
    counted = comparable(planned, measured)
    if len(counted) < 2:
        return None
    busy = {i: measured[i] / planned[i] for i in counted}
    middle = statistics.median(busy.values())
    if changed_speeds(speeds, [1.0] * len(speeds), _relative(busy, middle, len(planned)), threshold) is None:
        return None
    scale = middle if len(busy) > 2 else min(busy.values())
    return changed_speeds(speeds, [1.0] * len(speeds), _relative(busy, scale, len(planned)), threshold)


def _relative(busy: dict[int, float], scale: float, ranks: int) -> list[float]:
    """Each rank's busy seconds over plan relative to `scale` (1 for a rank not compared)."""
    return [busy[i] / scale if i in busy else 1.0 for i in range(ranks)]


SUBSTANTIAL = 0.25
"""off_plan compares the ranks planned at least this fraction of the busiest rank's seconds."""


def comparable(planned: Sequence[float], measured: Sequence[float]) -> list[int]:
    """The ranks off_plan compares: planned at least SUBSTANTIAL of the busiest's seconds, and busy."""
    top = max(planned, default=0.0)
    return [i for i, (p, m) in enumerate(zip(planned, measured)) if top > 0 and p >= SUBSTANTIAL * top and m > 0]


def measurable(plan: Plan, reference: Sequence[float]) -> list[int]:
    """The ranks whose busy seconds under `plan` measure their speed: those comparable by the
    plan's estimate (every rank where it holds none). A rank left the loss alone by a move (busy
    with the step's fixed costs) is not: its noise, read as a speed, can make a 6x straggler
    look fast again and move the model back onto it."""
    planned = planned_busy(plan)
    return comparable(planned, reference) if any(planned) else list(range(len(planned)))


def planned_busy(plan: Plan) -> list[float]:
    """Each rank's busy seconds per step as the plan estimates them: its stage's forward and
    backward per micro-batch (the stage's devices split each in proportion to their speeds:
    alike), times the micro-batches; 0 where the plan holds no estimate."""
    out = [0.0] * len(plan.devices)
    line = (plan.timeline or {}).get("pipeline")
    if not line or plan.schedule is None:
        return out
    for k, stage in enumerate(plan.stages):
        for d in stage.devices:
            out[d] = plan.schedule.micro_batches * (line["fwd"][k] + line["bwd"][k])
    return out


class Rebalancer:
    """The per-step controller a pipeline's training loop calls (module docstring)."""

    def __init__(self, pipe, opt: torch.optim.Optimizer | None, example_inputs: Sequence[torch.Tensor],
                 config: RebalanceConfig, make_optimizer: Callable[[list], torch.optim.Optimizer]):
        self.pipe, self.opt, self.config, self.make_optimizer = pipe, opt, config, make_optimizer
        self.inputs = tuple(example_inputs)
        self.comm = pipe.comm
        config.schedule.check(self.comm.world)  # (parsed for another number of ranks, it slowed no one or dropped chis)
        self._t0: float | None = None  # begin_step's clock (None: no step begun)
        self.static = pipe.emulation.slowdown  # the cluster file's emulated slowdown of this rank
        self.speeds = [1.0] * self.comm.world
        self.busy: list[list[float]] = []  # per step since the references started: every rank's busy seconds
        self.reference: list[float] | None = None
        self.pending: tuple[Plan, float] | None = None  # a plan faster by this fraction, waiting to pay
        self.lost = 0.0
        self.move_seconds: float | None = None
        self._first_cost: float | None = None
        self.iteration = 0
        self._fresh = True
        self._planned = planned_busy(pipe.plan)  # (the run's first plan only: later ones are made at measured speeds)
        self.start_untold = False
        """Whether a speed present from the start could not be told: fewer than two ranks carry
        enough planned work to compare (the other stages the loss alone)."""

    def begin_step(self, iteration: int) -> None:
        self.iteration = iteration
        self.pipe.emulation.slowdown = self.static * self.config.schedule.slowdown(self.comm.rank, iteration,
                                                                                      self.comm.world)
        self._t0 = time.perf_counter()

    def end_step(self) -> dict:
        """Measure the step; re-plan or move when it is time. Returns this step's record (the
        same `moved` on every rank). After a move `reb.opt` is another optimizer,
        `make_optimizer(groups)` over the new stage's parameters in the old optimizers' groups
        (checkpoint.groups_like: each group with its settings, so a torch optimizer takes the
        list as it is), with the state and settings of the old: a learning-rate scheduler or
        hook made over the old one stays with it (make it again where `moved` is set)."""
        if self._t0 is None:
            raise ValueError("Rebalancer.end_step without begin_step: call reb.begin_step(iteration) before the "
                             "step's train_step, and end_step after it")
        # every rank's busy seconds and the step's (the slowest rank's): the decisions below are
        # taken alike on every rank from these (a rank's own clock moved one and not another)
        mine = torch.tensor([self.pipe.last_step["compute"], time.perf_counter() - self._t0], dtype=torch.float64)
        self._t0 = None
        found = [torch.zeros_like(mine) for _ in range(self.comm.world)]
        wire.all_gather(found, mine, group=self.comm.group)
        busy = [float(x[0]) for x in found]
        seconds = max(float(x[1]) for x in found)
        if self._fresh:  # the first step under a plan allocates and warms caches: not its speed
            self._fresh = False
        elif self.pipe.last_step.get("planned_shape", True):  # (every rank's batch is of one shape)
            self.busy.append(busy)  # (a batch of another shape is not the speed the plan's estimate compares)
        record = {"iteration": self.iteration, "busy": busy, "speeds": list(self.speeds), "moved": None}
        window = self.config.window
        if self.reference is None and len(self.busy) >= window:
            self.reference = _medians(self.busy[-window:])
            speeds = off_plan(self.speeds, self._planned, self.reference, self.config.start_threshold) \
                if self._planned is not None else None
            self.start_untold = self._planned is not None and len(comparable(self._planned, self.reference)) < 2
            self._planned = None
            if speeds is not None:  # slow (or fast) from the start: no reference of its own to be off
                self.speeds, self.reference, self.busy = speeds, None, []
                record["speeds"] = list(speeds)
                if self.config.policy == "rebalance":
                    self._replan()
        elif self.reference is not None and len(self.busy) >= 2 * window:
            speeds = changed_speeds(self.speeds, self.reference, _medians(self.busy[-window:]), self.config.threshold,
                                    counted=measurable(self.pipe.plan, self.reference))
            if speeds is not None:
                self.speeds, self.reference, self.busy = speeds, None, []
                record["speeds"] = list(speeds)
                if self.config.policy == "rebalance":
                    self._replan()
        if self.pending is not None:
            plan, saves = self.pending
            self.lost += seconds * saves
            if self.lost >= self._move_cost():
                record["moved"] = self._move(plan)
        return record

    # -- deciding --------------------------------------------------------------------------------

    def _replan(self) -> None:
        """pp-exact at the measured speeds, on rank 0; pending when it beats the current plan."""
        found = None
        if self.comm.rank == 0:
            try:
                found = self._plan_at_speeds()
            except ValueError as e:  # no pipeline fits at these speeds: keep the current one (every rank hears it)
                found = str(e)
        box = [found]
        dist.broadcast_object_list(box, src=self._rank0(), group=self.comm.group)
        self.pending, self.lost = None, 0.0
        if isinstance(box[0], str):
            log.warning("hap pipeline rebalance: no new plan at speeds %s: %s", self.speeds, box[0])
            return
        text, current, better = box[0]
        if better < current * (1 - self.config.gain):
            self.pending = (Plan.from_json(text), 1 - better / current)

    def _plan_at_speeds(self) -> tuple[str, float, float]:
        from ..planner import PlannerConfig, slowed_cluster
        from .plan import exact_plan, priced_pipeline

        plan, graph = self.pipe.plan, self.pipe.graph
        config = PlannerConfig(pipeline_stages=len(plan.stages), micro_batches=plan.schedule.micro_batches,
                               schedule=plan.schedule.name)
        slowed = slowed_cluster(self.pipe.cluster, self.speeds, overheads=True)
        current = priced_pipeline(graph, slowed, plan, config).estimated_iteration_seconds
        better = exact_plan(graph, slowed, config)
        return better.to_json(), current, better.estimated_iteration_seconds

    def _move_cost(self) -> float:
        """Seconds a move takes: the last one's, measured; before any, the cluster's price of
        sending every parameter and its optimizer state once."""
        if self.move_seconds is not None:
            return self.move_seconds
        if self._first_cost is None:
            self._first_cost = self._send_state_seconds()
        return self._first_cost

    def _send_state_seconds(self) -> float:
        params = sum(p.numel() * p.element_size() for p in self.pipe.parameters())
        states = sum(t.numel() * t.element_size() for s in (self.opt.state.values() if self.opt else ())
                     for t in s.values() if torch.is_tensor(t))
        nbytes = torch.tensor([float(params + states)], dtype=torch.float64)
        wire.all_reduce(nbytes, group=self.comm.group)
        return self.pipe.cluster.fit("broadcast").time(float(nbytes))

    # -- moving ----------------------------------------------------------------------------------

    def _move(self, plan: Plan) -> dict:
        """This pipeline's state, handed over to a Pipeline of `plan` (a collective)."""
        from ..runtime.checkpoint import groups_like, hand_over
        from .runtime import Pipeline

        t0 = time.perf_counter()
        pipe = Pipeline(self.pipe.model, self.pipe.cluster, self.inputs, plan, comm=self.comm, graph=self.pipe.graph,
                        initial="handed over")  # (hand_over fills it: not broadcast first)
        groups = groups_like(self.pipe, self.opt, pipe)
        opt = self.make_optimizer(groups) if groups else None
        received = hand_over(self.pipe, self.opt, pipe, opt)
        pipe.tracing = self.pipe.tracing
        old = self.pipe.plan
        self.pipe, self.opt, self.pending, self.lost = pipe, opt, None, 0.0
        self.reference, self.busy, self._fresh = None, [], True
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        wire.all_reduce(took, op=dist.ReduceOp.MAX, group=self.comm.group)  # (the next move's price, alike on every rank)
        self.move_seconds = float(took)
        return {"from": _layout(old), "to": _layout(plan), "seconds": self.move_seconds, "received_bytes": received,
                "estimate": plan.estimated_iteration_seconds}

    def _rank0(self) -> int:
        from ..runtime.collectives import global_rank

        return global_rank(self.comm, 0)


def _medians(rows: list[list[float]]) -> list[float]:
    return [statistics.median(col) for col in zip(*rows)]


def _layout(plan: Plan) -> str:
    """Stages as `nodes a-b on ranks [..] at shares (..)`, for the log."""
    return "; ".join(f"nodes {st.nodes[0]}-{st.nodes[1]} on {st.devices} at "
                     f"({', '.join(f'{r:.2f}' for r in st.ratios[0])})" for st in plan.stages)
