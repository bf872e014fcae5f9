"""Per-iteration straggler mitigation for the tensor-parallel linear layers of a running plan.

    mit = Mitigator(dmodel, StragglerConfig(policy="zero-pri", schedule=parse_schedule("round-robin:chi=8,every=20", 4)), opt)
    for it, batch in enumerate(batches):
        mit.begin_step(it)                       # the schedule's slowdown, this iteration's work per layer
        loss = dmodel(*batch); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        mit.end_step()                           # measure; refresh and decide when a rank's time moved

Detection (seed 002, section III-A): every rank measures its busy time T_i (the step less its
time inside collectives) and matmul time M_i. When its T_i differs by more than `threshold`
from the value at the last refresh, it raises a flag that rides on the next forward's loss
all-reduce with every rank's share of columns pruned (no collective of its own; with
global_loss=False, an all-reduce of 1 + ranks numbers per step); at the end of that step
every rank all-gathers (T, M, FLOPs, share computed, FLOPs of its whole share, and under
rebalance a probed speed where it holds no columns) once and all take the same decision from
the same numbers. (While rebalance bridges a slowdown by
migration it refreshes every step.) Only the planned batch shape is mitigated: a step of
another shape runs its layers as planned.

Policies (`POLICIES`):
    none              measure only
    zero-rd/-pri      ZERO-resizing against T_avg, random or priority columns (Eq. 1)
    zero-pridiff-e/-r per-layer ratios from weight variation, gamma = 1/2 (E) or by Eq. 1 (R)
    migrate           migration (config.method) to the normal ranks, against T_min (exact)
    semi              Algorithm 2: one straggler splits its excess by Eq. 2, several by Eq. 3
    rebalance         migration as the exact bridge, then, once the lost time has paid for it
                      (ski rental), re-solve the load balance for the measured speeds and
                      reshard parameters and optimizer state (exact)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence, get_args

import torch
import torch.distributed as dist

from ..config import check_fields, instance, number, one_of, whole
from ..placement import P, R
from ..runtime.collectives import all_reduce, broadcast, every_rank, global_rank
from ..runtime import ledger, wire
from . import migrate
from .linear import Meter, Site, TPLinear, Work, _Ctx
from .migrate import Method, handover, receivers_of
from .policy import (Stats, balanced_migration, keep_after_resizing, matmul_speeds, migration_bound, pruning_floors,
                     rebalance_pays, rebalanced_time, semi_beta, stragglers_and_receivers, time_lost,
                     unmitigated)
from .prune import Lineage, PrioritySelector, RandomSelector
from .schedule import Schedule

log = logging.getLogger("hap")

Policy = Literal["none", "zero-rd", "zero-pri", "zero-pridiff-e", "zero-pridiff-r", "migrate", "semi", "rebalance"]
POLICIES: tuple[str, ...] = get_args(Policy)
EXACT = ("none", "migrate", "rebalance")
"""Policies that train exactly as one device (pruning ones do not)."""
MIGRATING = ("migrate", "semi", "rebalance")
"""Policies that migrate columns (StragglerConfig.method says how)."""


@dataclass(kw_only=True, slots=True)
class StragglerConfig:
    policy: Policy = "none"
    """How to react (module docstring)."""
    schedule: Schedule = field(default_factory=Schedule)
    """Emulated slowdowns (local cluster); Schedule() on real devices."""
    method: Method = "broadcast-reduce"
    """How migrated columns travel (migrate.py)."""
    threshold: float = 0.10
    """A rank asks for a refresh when its busy time moved by more than this fraction."""
    tolerance: float = 0.10
    """A rank is a straggler when slower than the target (T_avg or T_min) by more than this."""
    epoch: int = 20
    """Iterations per epoch: ZERO-Pri refreshes its weight-variation statistics once per epoch."""
    theta_iter: float = 1e-3
    """PriDiff: a column is a pruning candidate when it varied less than epoch * theta_iter."""
    alpha: float = 0.8
    """PriDiff: every layer prunes at least alpha * gamma."""
    gamma_e: float = 0.5
    """PriDiff-E: the empirical uniform ratio."""
    cap: float = 0.95
    """The most of a rank's columns a decision prunes or hands over (before rounding to whole columns)."""
    min_handover: float = 0.1
    """A decided handover of less than this share of a rank's columns is not made: it would pay
    the migration's collectives in every layer to save little."""
    handover: tuple[float, ...] | None = None
    """A fixed share of its columns each rank hands over every step (policy "migrate"; the
    Table I measurements); None: decided from the measured times."""
    warmup: int = 2
    """Steps measured before the first decision (the first ones pay one-time costs)."""
    seed: int = 0
    """Seeds the column selectors (ZERO-Rd's random columns), per rank."""

    def __post_init__(self):
        check_fields(self, policy=one_of(*POLICIES), method=one_of(*get_args(Method)), threshold=number(0, above=True),
                     tolerance=number(0), epoch=whole(1), theta_iter=number(0), alpha=number(0, 1),
                     gamma_e=number(0, 1, below=True), cap=number(0, 1, above=True, below=True), min_handover=number(0, 1),
                     warmup=whole(0), schedule=instance(Schedule), seed=whole(0, most=2**32 - 1))
        if self.handover is not None and (self.policy != "migrate" or any(not 0 <= x <= 1 for x in self.handover)):
            raise ValueError("StragglerConfig.handover is for policy 'migrate', one share in [0, 1] per rank, "
                             f"got {self.handover!r} with policy {self.policy!r}")


def tp_linear_layers(graph, program) -> list[tuple[Any, str]]:
    """The program's tensor-parallel linear layers, each (its step, "column" or "row"): a
    parameter weight split on its output dim with the input whole (column), or on its input dim
    with the input split likewise and the output a partial sum (row). A computed weight (a tied
    one transposed) has no columns of a parameter to prune, hand over or watch: not one."""
    out = []
    for step in program:
        node = graph.nodes[step.node]
        if node.op != "aten.linear.default" or graph.tensors[node.inputs[1]].kind != "param":
            continue
        x_p, w_p = step.strategy.inputs[0], step.strategy.inputs[1]
        if w_p.is_shard and w_p.dim == 0 and x_p == R:
            out.append((step, "column"))
        elif w_p.is_shard and w_p.dim == 1 and x_p.is_shard and step.strategy.outputs[0] == P:
            out.append((step, "row"))
    return out


def no_layers_refusal(policy: str, schedule: str) -> str | None:
    """What a plan without tensor-parallel linear layers says to straggler `policy` and emulated
    `schedule` (None: neither needs one)."""
    if policy == "none" and schedule == "none":
        return None
    what = (f"straggler policy {policy!r}" if policy != "none"
            else f"straggler schedule {schedule!r} (it slows tensor-parallel linear layers)")
    return (f"{what}: the plan has no tensor-parallel linear layer "
            "(plan with --planner megatron, or a plan that splits linear weights)")


class Mitigator:
    @ledger.called("hap.straggler.Mitigator(dmodel, ...)")
    def __init__(self, dmodel, config: StragglerConfig, optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = ()):
        from ..pipeline.runtime import Pipeline

        if isinstance(dmodel, Pipeline):  # (hap train says so for --straggler on a pipeline plan)
            raise ValueError("the straggler Mitigator prunes or migrates the columns of hap.HAP's tensor-parallel layers; "
                             "a pipeline's stages are data parallel: rebalance it with hap.pipeline.rebalance.Rebalancer")
        if not isinstance(config, StragglerConfig):
            raise ValueError(f"Mitigator takes a StragglerConfig, got {type(config).__name__}")
        self.dmodel, self.config = dmodel, config
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        if not isinstance(optimizers, (list, tuple, type(None))) or \
                not all(isinstance(opt, torch.optim.Optimizer) for opt in optimizers or ()):
            got = [type(o).__name__ for o in optimizers] if isinstance(optimizers, (list, tuple)) else type(optimizers).__name__
            raise ValueError(f"Mitigator's optimizers must be a torch.optim.Optimizer or a list of them, got {got}")
        self.optimizers = list(optimizers or ())
        if config.policy == "rebalance" and not self.optimizers:
            raise ValueError("straggler policy 'rebalance' reshards the optimizer's state with the parameters: "
                             "pass the optimizer, Mitigator(dmodel, config, opt)")
        self.comm = dmodel.comm
        self.rank, self.world = self.comm.rank, self.comm.world
        config.schedule.check(self.world)  # (parsed for another number of ranks, it slowed no one or dropped chis)
        self.meter = Meter(self.comm)
        self.device = next(iter(dmodel.executor.params.values())).device  # where collectives' tensors live (NCCL: the GPU)
        self.selector = (RandomSelector(config.seed * 1009 + self.rank) if config.policy == "zero-rd"
                         else PrioritySelector(config.seed * 1009 + self.rank))
        self.keep = [1.0] * self.world  # per rank: share of its columns it does not prune
        self.whole_floor = [0.0] * self.world  # per rank: its matmul_floor at the last step it multiplied its whole share
        self.moved = [0.0] * self.world  # per rank: share of its columns it hands over
        self.receiving: list[int] | None = None  # ranks that take handed-over columns (None: all that hand none over)
        self.reference: float | None = None  # own busy time at the last refresh
        self.flag = 1.0  # ask for a refresh at the first step
        self.iteration = 0
        self.history: list[dict] = []
        self.lost = 0.0  # rebalance: seconds lost to a slowdown since it began
        self.pretest: dict | None = None
        self.reshard_seconds: float | None = None  # what the last reshard took (the slowest rank)
        self.beta: float | None = None  # SEMI's last Eq. 2 split (share of the excess migrated)
        self._last_refresh = 0
        self._pruned_now = 0.0  # share of its columns this rank prunes this step, all layers together
        self._ran = False  # whether this step ran the layers (the planned shape)
        self._shared = torch.zeros(1 + self.world, dtype=torch.float64)  # the step's sum (begin_step)
        self._due: list[float] | list[list[float]] | None = None  # rebalance: ratios decided, waiting for gradients to clear
        self._told_held = False
        self._t0: float | None = None  # begin_step's clock (None: no step begun)
        self._resharded_at_begin = 0
        self._agree()  # (before the layers are taken over: a refusal leaves dmodel as it was)
        self._install()
        dmodel.piggyback_size = len(self._shared)  # (every rank's sums alike in size, stepped or not)

    def _agree(self) -> None:
        """Every rank's config alike (one rank's policy otherwise left the others waiting for
        its collectives until the timeout, the mismatch unnamed): a one-line ValueError on every
        rank naming the first field that differs. A collective."""
        mine = {f.name: repr(getattr(self.config, f.name)) for f in dataclasses.fields(self.config)}
        every = every_rank(mine, self.comm)
        for r, theirs in enumerate(every):
            name = next((k for k in mine if theirs[k] != every[0][k]), None)
            if name is not None:
                raise ValueError(f"Mitigator: rank {r}'s StragglerConfig.{name} is {theirs[name]}, rank 0's "
                                 f"{every[0][name]}: every rank mitigates alike")

    # -- the layers ---------------------------------------------------------------------------
    def _install(self) -> None:
        """Find the program's tensor-parallel linear layers and run them through TPLinear."""
        ex = self.dmodel.executor
        self.sites: list[Site] = []
        for step, layout in tp_linear_layers(ex.graph, ex.program):
            node = ex.graph.nodes[step.node]
            weight, w_p, seg = node.inputs[1], step.strategy.inputs[1], ex.segment_of[step.node]
            n, k = ex.graph.tensors[weight].shape
            tokens = math.prod(ex.graph.tensors[node.inputs[0]].shape[:-1])
            if layout == "column":
                site = Site(step.node, node.name, weight, "column", tuple(ex.sizes(weight, w_p, seg)), (k,) * self.world, tokens)
            else:
                site = Site(step.node, node.name, weight, "row", (n,) * self.world, tuple(ex.sizes(weight, w_p, seg)), tokens)
            self.sites.append(site)
        self.work: dict[int, Work] = {s.node: Work() for s in self.sites}
        ex.overrides = {s.node: self._runner(s) for s in self.sites}
        if not self.sites:
            refused = no_layers_refusal(self.config.policy, self.config.schedule.kind)
            if refused:
                raise ValueError(refused)

    def _runner(self, site: Site):
        def run(inputs: list[torch.Tensor]) -> tuple:
            x, w = inputs[0], inputs[1]
            b = inputs[2] if len(inputs) > 2 else None
            if not self._ran:  # the step runs the planned shape: its pruning happens (the loss's sum carries it)
                self._ran = True
                self._shared[1 + self.rank] = self._pruned_now
            return (TPLinear.apply(x, w, b, _Ctx(site, self.work[site.node], self.meter)),)

        return run

    # -- the iteration ------------------------------------------------------------------------
    @ledger.called("mit.begin_step(...)")
    def begin_step(self, iteration: int) -> None:
        self.iteration = iteration
        self._resharded_at_begin = self._reshard_due() if self._due is not None else 0
        static = self.comm.emulation.slowdown if self.comm.emulation is not None else 1.0
        self.meter.slowdown = static * self.config.schedule.slowdown(self.rank, iteration, self.world)
        self.meter.reset()
        self._plan_work()
        # what the step's one sum tells every rank: [refresh flag, then per rank the share of its
        # columns it pruned this step, each rank's own filled in once its layers run: a step of
        # another shape runs them as planned, pruning nothing]
        self._shared, self._ran = torch.zeros(1 + self.world, dtype=torch.float64), False
        self._shared[0] = self.flag
        if self.dmodel.global_loss:
            self.dmodel.piggyback, self.dmodel.piggybacked = self._shared, None
        self._settle()  # the last step's optimizer update is not this step's time
        self._t0 = time.perf_counter()
        self._waited0 = self.comm.clock.seconds

    def _settle(self) -> None:
        """Wait for this rank's queued GPU work, so the host's clock reads the time it took."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @ledger.called("mit.end_step()")
    def end_step(self) -> dict:
        if self._t0 is None:
            raise ValueError("Mitigator.end_step without begin_step: call mit.begin_step(iteration) before the "
                             "step's forward, and end_step after its backward")
        self._settle()
        wall = time.perf_counter() - self._t0
        self._t0 = None
        busy = wall - (self.comm.clock.seconds - self._waited0)
        summed = self.dmodel.piggybacked if self.dmodel.global_loss else \
            all_reduce(self._shared.to(self.device), self.comm)
        if summed is None:
            raise ValueError("Mitigator.end_step: no forward since begin_step (the loss's all-reduce carries the "
                             "ranks' flags); run the step's forward and backward between them")
        wanted = float(summed[0]) > 0
        own = self._own_share()
        full = self._site_flops(self.rank)
        refresh = wanted and self.iteration >= self.config.warmup
        probe = refresh and full == 0 and self.config.policy == "rebalance"
        mine = Stats(busy=busy, matmul=self.meter.seconds, flops=self.meter.flops, own=own, full_flops=full,
                     probed=self._probe() if probe else 0.0)
        record = {"iteration": self.iteration, "rank": self.rank, "slowdown": self.meter.slowdown, "wall": wall,
                  "busy": busy, "matmul": mine.matmul, "pruned": self._pruned_now if self._ran else 0.0,
                  "pruned_by_rank": [float(x) for x in summed[1:]], "migrated": self.moved[self.rank],
                  "migrated_by_rank": list(self.moved), "refreshed": False, "resharded": self._resharded_at_begin,
                  "beta": self.beta}
        if refresh:
            stats = self._all_stats(mine)
            self.reference = busy
            record["refreshed"] = True
            record["resharded"] += self._decide(stats)
            self._last_refresh = self.iteration
        if (self.iteration + 1) % self.config.epoch == 0:
            ex = self.dmodel.executor
            for s in self.sites:
                self.selector.observe(s.layer, ex.params[s.weight])
        moved_ref = (self.reference is None or abs(busy - self.reference) > self.config.threshold * self.reference
                     or self.iteration + 1 == self.config.warmup)
        bridging = self.config.policy == "rebalance" and any(self.moved)  # ski rental counts every step
        self.flag = 1.0 if moved_ref or bridging else 0.0
        if record["pruned"] > 0:
            log.info("hap straggler: step %d rank %d pruned %.1f%% of its linear-layer columns", self.iteration, self.rank,
                     100 * record["pruned"])
        self.history.append(record)
        return record

    def _prunes(self) -> bool:
        return self.config.policy.startswith("zero") or self.config.policy == "semi"

    def _own_share(self) -> float:
        return max(1e-9, self.keep[self.rank] - self.moved[self.rank]) if self._prunes() else 1.0 - self.moved[self.rank]

    def _probe(self) -> float:
        """FLOPs per second of this rank's multiplications, for a rank that holds no columns (it
        waits for the others anyway): the largest layer's forward and backward products at an
        even share of its columns, timed warm, the best of repeats over at least a millisecond,
        its slowdown (emulated or real) included as in Meter. 0 where it fails (out of memory,
        say): the rank must still join the refresh's all-gather."""
        site = max(self.sites, key=lambda s: max(s.out_sizes) * max(s.columns))
        n, k, t = max(site.out_sizes), max(1, max(site.columns) // self.world), max(1, site.tokens)
        try:
            gen = torch.Generator(device=self.device).manual_seed(0)  # not the global generator: ranks draw alike
            x = torch.randn(t, k, generator=gen, device=self.device)  # [T, K/e]
            w = torch.randn(n, k, generator=gen, device=self.device)  # [N, K/e]
            best, spent = math.inf, 0.0
            for i in range(1000):
                t0 = time.perf_counter()
                y = x @ w.t()  # [T, N]
                _ = (y @ w, y.t() @ x)  # the backward's products: [T, K/e], [N, K/e]
                self._settle()
                took = time.perf_counter() - t0
                if i:  # the first is the warm-up
                    best, spent = min(best, took), spent + took
                    if spent >= 1e-3 and i >= 3:
                        break
        except (RuntimeError, MemoryError) as e:
            log.warning("hap straggler: step %d rank %d could not probe its speed (%s)", self.iteration, self.rank, e)
            return 0.0
        return 6.0 * t * n * k / max(best * self.meter.slowdown, 1e-12)

    def _all_stats(self, mine: Stats) -> list[Stats]:
        local = torch.tensor([mine.busy, mine.matmul, mine.flops, mine.own, mine.full_flops, mine.probed],
                             dtype=torch.float64, device=self.device)
        every = [torch.empty_like(local) for _ in range(self.world)]
        self.comm.before()
        wire.all_gather(every, local, group=self.comm.group)
        self.comm.after("all_gather", local.numel() * 8 * self.world)
        return [Stats(*map(float, t)) for t in every]

    # -- decisions (the same on every rank) ---------------------------------------------------
    def _decide(self, stats: list[Stats]) -> int:
        policy, cfg = self.config.policy, self.config
        t_avg = sum(s.busy for s in stats) / self.world
        t_min, slow, receivers = stragglers_and_receivers(stats, cfg.tolerance)  # T_min: the strict criterion
        if policy == "none":
            return 0
        floor = pruning_floors(stats, self.keep, self.moved, self.whole_floor, receivers) if self._prunes() \
            else [0.0] * self.world
        if policy.startswith("zero"):
            for r, s in enumerate(stats):
                if policy == "zero-pridiff-e":  # the empirical ratio while it would straggle unpruned
                    unpruned = s.busy + s.matmul * (1 / self.keep[r] - 1)
                    straggles = unpruned > t_avg * (1 + cfg.tolerance)
                    self.keep[r] = max(1 - cfg.gamma_e, floor[r]) if straggles else 1.0
                elif self.keep[r] < 1 or s.busy > t_avg * (1 + cfg.tolerance):  # noise is no straggler
                    self.keep[r] = keep_after_resizing(self.keep[r], s.busy, t_avg, s.matmul, cfg.cap, floor[r])
            return 0
        if policy in ("migrate", "rebalance"):
            self._migrate(stats, slow, receivers)
            return self._maybe_reshard(stats) if policy == "rebalance" else 0
        # semi: Algorithm 2
        for r in range(self.world):
            if r not in slow:
                self.moved[r], self.keep[r] = 0.0, 1.0
        if not slow:
            return 0
        full = {r: stats[r].full_flops * stats[r].matmul / stats[r].flops if stats[r].flops > 0 else 0.0 for r in slow}
        excess = {r: min(cfg.cap, 1.0 - floor[r], max(0.0, (unmitigated(stats[r]) - t_min) / full[r]))
                  if full[r] > 0 else 0.0 for r in slow}  # Eq. 1 against T_min, as a share of all its columns
        if len(slow) == 1:
            (k,) = slow
            self.receiving = receivers
            beta = self._beta(excess[k], stats, k)
            self.moved[k], self.keep[k] = beta * excess[k], 1.0 - (1 - beta) * excess[k]
            return 0
        unit = sum(self._site_flops(r) for r in range(self.world)) / self.world  # a rank's FLOPs: Phi1's fraction 1
        x = migration_bound(stats, lambda flops: self._phi1(flops / unit))
        self.beta = None  # Eq. 3, not Eq. 2
        migrating, resizing = slow[:x], slow[x:]
        self.receiving = receivers  # the pruning stragglers take no one's columns
        mu = balanced_migration(stats, migrating, receivers)
        for k in migrating:
            share = min(cfg.cap, mu.get(k, 0.0))
            self.moved[k], self.keep[k] = (share if share >= cfg.min_handover else 0.0), 1.0
        for r in resizing:
            self.moved[r], self.keep[r] = 0.0, 1.0 - excess[r]
        return 0

    def _migrate(self, stats: list[Stats], slow: list[int], receivers: list[int]) -> None:
        """Stragglers `slow` hand over the shares that balance them with `receivers`."""
        self.receiving = list(receivers)
        mu = balanced_migration(stats, slow, receivers)
        for r in range(self.world):
            share = min(self.config.cap, mu.get(r, 0.0))
            self.moved[r] = share if share >= self.config.min_handover else 0.0

    # -- SEMI's pre-test (Eq. 2 and 3) --------------------------------------------------------
    def _beta(self, excess: float, stats: list[Stats], k: int) -> float:
        """Eq. 2 for straggler k's excess (a share of its columns), with the pre-tested costs."""
        pre = self._pretest()
        per_flop = [s.matmul / s.flops if s.flops > 0 else 0.0 for s in stats]
        receiver_cost = max(per_flop[r] for r in range(self.world) if r != k)
        full_flops = stats[k].full_flops
        beta = semi_beta(excess, 1.0, self.world, pre["omega1"], lambda f: _line(pre["omega2"], f), self._phi1,
                         lambda f: f * full_flops * receiver_cost)
        log.info("hap straggler: step %d SEMI rank %d excess %.2f of its columns, beta %.2f", self.iteration, k, excess, beta)
        self.beta = beta
        return beta

    def _phi1(self, fraction: float) -> float:
        """Phi1: seconds per step to migrate this share of a rank's columns (pre-tested line)."""
        return max(0.0, _line(self._pretest()["phi1"], min(fraction, 1.0)))

    def _pretest(self) -> dict:
        """SEMI's pre-test on this run's layers, once (Algorithm 2 line 1), as per-step costs:
        Omega1, allocating the pruned matrices; Omega2(f), extracting the kept columns of every
        layer's input and weight and restoring the two gradients when f of the columns are
        pruned; Phi1(f), broadcasting f of the columns (weight, and input where it is split)
        and reducing the results, forward and backward. Each is measured at f = 1/4 and 3/4
        and taken as the line through them; the collectives run on every rank together, and
        the ranks agree on the mean."""
        if self.pretest is not None:
            return self.pretest
        ex = self.dmodel.executor
        layers = [(ex.params[s.weight].detach(), torch.zeros(max(1, s.tokens), s.columns[self.rank], device=self.device), s)
                  for s in self.sites]
        self._settle()  # (the inputs just made are not the pre-test's time)
        t0 = time.perf_counter()
        for w, x, _ in layers:
            torch.empty(w.shape[0], w.shape[1] // 2, device=self.device), torch.empty(x.shape[0], x.shape[1] // 2, device=self.device)
        self._settle()
        omega1 = time.perf_counter() - t0
        omega2, phi = [], []
        for f in (0.25, 0.75):
            t0 = time.perf_counter()
            for w, x, _ in layers:
                if w.shape[1] == 0:  # no columns here to prune
                    continue
                kept = torch.arange(max(1, round(w.shape[1] * (1 - f))), device=self.device)
                lin = Lineage.of("", "", kept, w.shape[1])
                for _ in range(2):  # forward and backward
                    x.index_select(-1, kept), w.index_select(1, kept)
                lin.restore(x.index_select(-1, kept), -1), lin.restore(w.index_select(1, kept), 1)
            self._settle()
            omega2.append(time.perf_counter() - t0)
            dist.barrier(group=self.comm.group)
            t0 = time.perf_counter()
            for _, _, s in layers:  # rank 0's sizes: the same numbers on every rank
                cols, tokens = max(1, round(s.columns[0] * f)), max(1, s.tokens)
                moved = s.out_sizes[0] * cols + (tokens * cols if s.kind == "row" else 0)
                for numel in (moved, tokens * s.out_sizes[0]):  # send the columns, collect the results
                    # migration's own collectives (its reduce is a gather and a sum at the straggler)
                    broadcast(torch.zeros(numel, device=self.device), 0, self.comm)
                    migrate.reduce(torch.zeros(numel, device=self.device), 0, self.comm)
            self._settle()
            phi.append(time.perf_counter() - t0)
        agreed = all_reduce(torch.tensor([omega1, *omega2, *phi], dtype=torch.float64, device=self.device), self.comm) / self.world
        omega1, o25, o75, p25, p75 = map(float, agreed)
        self.pretest = {"omega1": omega1, "omega2": _through((0.25, o25), (0.75, o75)), "phi1": _through((0.25, p25), (0.75, p75))}
        log.info("hap straggler: SEMI pre-test %s", self.pretest)
        return self.pretest

    # -- rebalance ----------------------------------------------------------------------------
    def _maybe_reshard(self, stats: list[Stats]) -> int:
        """Ski rental: while the shares do not fit the measured speeds, count the time lost to
        that (this step against the rebalanced estimate); reshard once it reaches what a
        reshard costs (estimated from the bytes to move, then as measured last time)."""
        speeds = matmul_speeds(stats, probed=True)
        if min(speeds) <= 0:
            return 0
        balanced = rebalanced_time(stats)  # every rank busy for this long at shares fitting the speeds
        if max(unmitigated(s) for s in stats) <= balanced * (1 + self.config.tolerance):
            self.lost = 0.0
            return 0
        slowest = max(s.busy for s in stats)
        self.lost = time_lost(self.lost, slowest, balanced, self.iteration - self._last_refresh)
        cost = self.reshard_seconds if self.reshard_seconds is not None else self._reshard_seconds(speeds)
        if not rebalance_pays(self.lost, cost):
            return 0
        from ..planner import rebalanced_ratios

        ratios = [rebalanced_ratios(self.dmodel.graph, self.dmodel.cluster, self.dmodel.plan, speeds) if self.rank == 0 else None]
        dist.broadcast_object_list(ratios, src=global_rank(self.comm, 0), group=self.comm.group)  # one solve: every rank must reshard to the very same numbers
        self._due = ratios[0]
        return self._reshard_due()

    def _reshard_due(self) -> int:
        """The reshard decided (`_due`), now if no rank holds gradients (a collective), timed;
        else left due, to the next begin_step: end_step may come before the optimizer's step,
        or between the micro-batches of an accumulated step, and a reshard then would lose
        their gradients (it had cleared them itself: a step's gradient lost, silently)."""
        mine = self._grads_held()
        held = all_reduce(torch.tensor([float(mine is not None)], dtype=torch.float64, device=self.device), self.comm)
        if float(held[0]) > 0:  # (on some rank: every rank takes the one decision)
            if not self._told_held and mine == "zeros":
                log.warning("hap straggler: step %d: a reshard is due, and waits for the gradients to be None "
                            "(zero_grad(set_to_none=True)); zeroed ones are gradients held", self.iteration)
                self._told_held = True
            return 0
        t0 = time.perf_counter()
        self.reshard_to(self._due)
        self._due = None
        self._settle()
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=self.device)
        self.comm.before()
        wire.all_reduce(took, op=dist.ReduceOp.MAX, group=self.comm.group)  # one cost, the same on every rank
        self.comm.after("all_reduce", 8)
        self.reshard_seconds = float(took[0])
        return 1

    def _grads_held(self) -> str | None:
        """Whether this rank's parameters hold gradients: "zeros" where all are zero (kept by
        zero_grad(set_to_none=False)), "held" where some are not, None where none are held."""
        grads = [p.grad for p in self.dmodel.parameters() if p.grad is not None]
        if not grads:
            return None
        return "zeros" if all(not g.any() for g in grads) else "held"

    def reshard_to(self, ratios) -> int:
        """Move the layers (parameters and optimizer state) to new ratios, exactly, between
        steps, after zero_grad(set_to_none=True) (dmodel.reshard refuses held gradients);
        migration and pruning start over from the new shares. A collective."""
        nbytes = self.dmodel.reshard(ratios, self.optimizers)
        log.info("hap straggler: step %d resharded to %s (rank %d moved %d bytes)", self.iteration,
                 [round(x, 3) for x in self.dmodel.plan.ratios[0]], self.rank, nbytes)
        self.moved, self.keep, self.receiving = [0.0] * self.world, [1.0] * self.world, None
        self.lost = 0.0
        self._install()
        self.reference, self.flag = None, 1.0
        return nbytes

    def _site_flops(self, r: int) -> float:
        """FLOPs of rank r's whole share of the layers, forward and backward."""
        return sum(6.0 * max(1, s.tokens) * s.out_sizes[r] * s.columns[r] for s in self.sites)

    def _reshard_seconds(self, speeds: Sequence[float]) -> float:
        """What moving the layers to ratios proportional to `speeds` would cost: the bytes that
        change hands (Executor.reshard_bytes: rows and their optimizer state), at the cluster's
        broadcast fit."""
        target = [s / sum(speeds) for s in speeds]
        nbytes = self.dmodel.executor.reshard_bytes([target] * len(self.dmodel.plan.ratios), self.optimizers)
        fit = self.dmodel.cluster.collectives.get("broadcast")
        return fit.time(nbytes) if fit is not None else nbytes / 1e9

    # -- this iteration's work ----------------------------------------------------------------
    def _plan_work(self) -> None:
        cfg, me = self.config, self.rank
        if cfg.handover is not None:
            if len(cfg.handover) != self.world:
                raise ValueError(f"a fixed handover needs one share per rank ({self.world}), got {len(cfg.handover)}")
            if all(x > 0 for x in cfg.handover):
                raise ValueError(f"a fixed handover {list(cfg.handover)} leaves no rank to take the columns")
            self.moved, self.receiving = list(cfg.handover), None
        ex = self.dmodel.executor
        handing = [r for r in range(self.world) if self.moved[r] > 0]
        taking = self.receiving if self.receiving is not None else [r for r in range(self.world) if r not in handing]
        refused = [r for r in range(self.world) if r in handing or r not in taking]
        receivers = {k: receivers_of(k, self.world, refused) for k in handing}
        pruning = self._prunes() and self.keep[me] < 1
        theta = cfg.epoch * cfg.theta_iter
        pruned = 0  # columns of its own it leaves out this step, over all layers
        for s in self.sites:
            hs = tuple(h for k in handing if (h := handover(k, s.columns[k], self.moved[k], receivers[k])) is not None)
            mine = next((h for h in hs if h.straggler == me), None)
            own_end = mine.start if mine is not None else s.columns[me]
            keep = lineage = None
            if not pruning:
                self.selector.forget(s.layer)  # computed whole: no column was pruned this time
            if pruning or mine is not None:
                w = ex.params[s.weight].detach()
                if pruning:
                    gamma = 1.0 - self.keep[me]
                    if cfg.policy in ("zero-pridiff-e", "zero-pridiff-r"):
                        gamma = self.selector.layer_ratio(s.layer, gamma, theta, cfg.alpha, cfg.cap)
                    # prune gamma of all columns, from the ones it still computes itself
                    share = min(1.0, gamma * s.columns[me] / max(own_end, 1))
                    keep = self.selector.kept(s.layer, w, share, limit=own_end)
                    pruned += own_end - keep.numel()
                else:
                    keep = torch.arange(own_end, device=w.device)
                lineage = Lineage.of(s.layer, s.weight, keep, s.columns[me])
            self.work[s.node] = Work(keep=keep, lineage=lineage, handovers=hs, method=cfg.method)
        self._pruned_now = pruned / max(1, sum(s.columns[me] for s in self.sites))


def _through(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """(intercept, slope) of the line through two points."""
    slope = (b[1] - a[1]) / (b[0] - a[0])
    return a[1] - slope * a[0], slope


def _line(coef: tuple[float, float], x: float) -> float:
    return coef[0] + coef[1] * x
