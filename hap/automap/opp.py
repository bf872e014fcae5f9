"""Auto-MAP's operator-partitioning (OPP, section 3.2) and data-parallel (ADP, section 3.3)
tasks on hap's IR, with propagation (propagate.py) as the derivation rules.

OPP. The data stay whole on every device; the search decides, for every dimension of every
trainable parameter that can be split across all devices, whether to split the parameter on
it (state 1) or not (0; -1: undecided). A parameter with no split dim is replicated. One
episode walks the dimensions in linkage-group order (largest first) and, after every
decision, propagation decides what it forces (a column-split weight forces the next linear's
row split); those dimensions are skipped. Rewards:
- "paper": +0.4 per dimension split and +0.1 per dimension replicated by the step (forced ones
  included), -1 and the episode ends on a conflict;
- "cost" (beyond the paper): 0 until the end, then (L_rep / L)^0.5, L the iteration time of
  the best hap program (A*) that keeps exactly these parameter layouts and moves tensors only
  by communication-free moves and the all-reduce of a partial sum, L_rep that of replicating
  every parameter; 0 when it does not fit memory, -1 on a conflict. (A* also lets a whole
  activation join a partial sum on one device, hap's free zero_partial, which propagation
  allows only for decided leaves: its family is slightly wider.)
The exact reference is A* over that family with the parameter layouts left free (`exact`):
when it is exhaustive, no assignment of layouts does better, so it bounds the DQN from below.

ADP. The parameters stay whole; the search decides, per dimension of every model input, whether
the data are split on it; the reward is the paper's (no linkage groups). The objective is the
number of tensors propagation leaves split; `batch_dims` returns what the search found, which
the planner's batch inputs (planner.batched_inputs: dim 0 of each input that carries the batch,
whole the others) check.

    env = OperatorEnvironment(graph, cluster, reward="cost")
    found = search_layout(env, episodes=300)      # LayoutResult: layout, seconds, ...
    ref = env.exact()                             # A*'s optimum over the same family
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..cost.cluster import Cluster
from ..cost.model import CostModel
from ..ir import Graph
from ..placement import Placement
from ..rules import strategy_table
from ..rules.units import ShardClasses
from ..search.astar import Frame, Restriction, SearchError, synthesize
from ..search.program import Step, kept_as, replay
from .dqn import Agent, DQNConfig
from .propagate import WHOLE, Domains, Propagation, layout_of

SPLIT_REWARD, REPLICATE_REWARD, CONFLICT_REWARD = 0.4, 0.1, -1.0
"""The paper's rewards (section 4.2)."""

Unit = tuple[str, int]
"""(tensor name, dim): one decision."""

DERIVATION_MOVES = frozenset({"all_reduce", "slice", "duplicate", "replicate", "zero_partial"})
"""The moves the priced programs may use: propagation's derivations (see propagate.py) and the
other communication-free moves, which A* cannot do without."""


def unit_status(prop: Propagation, doms: Domains, unit: Unit) -> int:
    """1: split on the dim, 0: not split on it, -1: undecided."""
    layouts = prop.layouts(doms, unit[0])
    if layouts == {2 + unit[1]}:
        return 1
    return 0 if 2 + unit[1] not in layouts else -1


@dataclass(slots=True)
class Episode:
    doms: Domains
    status: dict[Unit, int]
    position: int = 0
    done: bool = False
    conflict: bool = False
    total: float = 0.0


class DecisionEnvironment:
    """One decision per (variable, dim) in a fixed order, the state the paper's: the decision
    vector (1 / 0 / -1) and the current position (one-hot)."""

    def __init__(self, prop: Propagation, variables: list[str], linkage: bool):
        self.prop = prop
        start, outcome = prop.initial()
        if outcome == "conflict":
            raise ValueError(f"{prop.graph.model_name}: the derivation rules conflict before any decision")
        self.start = start
        units = [(v, d) for v in variables for d in prop.splittable(v)]
        self.linkage = self._linkage(units) if linkage else {}
        size = {u: max(len(self.linkage.get((u, a), {})) for a in (0, 1)) if linkage else 0 for u in units}
        self.units = sorted(units, key=lambda u: -size[u])  # the paper: larger linkage groups first (stable)
        self.state_dim = 2 * len(self.units)

    def _linkage(self, units: list[Unit]) -> dict[tuple[Unit, int], dict[Unit, int]]:
        """(unit, action) -> the other units that decision alone decides: its linkage group."""
        groups = {}
        for u in units:
            for action in (0, 1):
                doms, outcome = self._apply(self.start, u, action)
                if outcome == "conflict":
                    groups[(u, action)] = {}
                    continue
                forced = {v: unit_status(self.prop, doms, v) for v in units if v != u}
                groups[(u, action)] = {v: s for v, s in forced.items()
                                       if s >= 0 and unit_status(self.prop, self.start, v) < 0}
        return groups

    def _apply(self, doms: Domains, unit: Unit, action: int):
        name, dim = unit
        return self.prop.decide(doms, name, dim) if action == 1 else self.prop.exclude(doms, name, dim)

    def reset(self) -> Episode:
        ep = Episode(self.start, {u: unit_status(self.prop, self.start, u) for u in self.units})
        self._advance(ep)
        return ep

    def _advance(self, ep: Episode) -> None:
        while ep.position < len(self.units) and ep.status[self.units[ep.position]] >= 0:
            ep.position += 1
        ep.done = ep.done or ep.position >= len(self.units)

    def state(self, ep: Episode) -> torch.Tensor:
        s = torch.zeros(self.state_dim)
        s[:len(self.units)] = torch.tensor([float(ep.status[u]) for u in self.units])
        if ep.position < len(self.units):
            s[len(self.units) + ep.position] = 1.0
        return s

    def step(self, ep: Episode, action: int) -> float:
        """Decide the current unit (1 split, 0 not); returns the paper's reward of the step."""
        assert not ep.done
        unit = self.units[ep.position]
        doms, outcome = self._apply(ep.doms, unit, action)
        if outcome == "conflict":
            ep.done = ep.conflict = True
            ep.total += CONFLICT_REWARD
            return CONFLICT_REWARD
        new = {u: unit_status(self.prop, doms, u) for u in self.units}
        gained = [new[u] for u in self.units if ep.status[u] < 0 <= new[u]]
        ep.doms, ep.status = doms, new
        self._advance(ep)
        r = SPLIT_REWARD * gained.count(1) + REPLICATE_REWARD * gained.count(0)
        ep.total += r
        return r


class LayoutPricer:
    """Iteration time of the best hap program for given parameter layouts, in the family OPP
    searches (data whole, derivation moves only): one cost model, one A* frame, a cache."""

    def __init__(self, graph: Graph, cluster: Cluster, optimizer: str = "adam", width: int | None = None,
                 width_after: float = 30.0):
        self.graph, self.cluster = graph, cluster
        # A*'s width cap after width_after expansions per node (PlannerConfig's); None: exhaustive,
        # however long a layout's search takes
        self.width, self.width_after = width, width_after
        self.strategies = strategy_table(graph)
        self.cost = CostModel(graph, cluster, ShardClasses(graph, enumerate(self.strategies)), optimizer)
        self.segment_of = [0] * len(graph.nodes)
        self.frame = Frame(graph, self.strategies, self.cost, self.segment_of)
        self.ratios = list(cluster.compute_proportional())
        self.capacity = [d.memory for d in cluster.devices]
        self.cache: dict[tuple, tuple[float, bool, list[Step] | None, bool]] = {}

    def restriction(self, layout: dict[str, int] | None) -> Restriction:
        def allow_load(kind, name, p: Placement):
            if kind == "param":  # the decisions are over trainable parameters: a frozen one stays whole
                return layout is None or layout_of(kept_as(p)) == layout.get(name, WHOLE)
            return p.kind in ("R", "D")

        return Restriction(name="operator partitioning", allow_load=allow_load,
                           allow_move=lambda mv: mv.name in DERIVATION_MOVES)

    def price(self, layout: dict[str, int] | None) -> tuple[float, bool, list[Step] | None, bool]:
        """(seconds, fits memory, program, exhaustive); inf seconds where no program exists."""
        key = None if layout is None else tuple(sorted(layout.items()))
        if key not in self.cache:
            try:
                res = synthesize(self.graph, self.strategies, self.cost, self.segment_of, [self.ratios],
                                 self.restriction(layout), layer_bounds=False, width=self.width,
                                 width_after=self.width_after, frame=self.frame)
            except SearchError:
                self.cache[key] = (math.inf, False, None, True)
            else:
                est = replay(res.program, self.cost, self.segment_of, [self.ratios])
                self.cache[key] = (est.seconds, est.fits(self.capacity), res.program, res.exhaustive)
        return self.cache[key]


class OperatorEnvironment(DecisionEnvironment):
    """OPP: decisions over the trainable parameters' dims, data whole."""

    def __init__(self, graph: Graph, cluster: Cluster, reward: Literal["paper", "cost"] = "cost", linkage: bool = True,
                 width: int | None = None, optimizer: str = "adam"):
        params = [p for p in graph.params if graph.tensors[p].requires_grad]
        super().__init__(Propagation(graph, cluster.size, params, data=graph.inputs), params, linkage)
        self.params = params
        self.reward_kind = reward
        self.pricer = LayoutPricer(graph, cluster, optimizer, width=width)  # (its state counts in memory)
        self.replicated = self.pricer.price({p: WHOLE for p in params})[0]

    def layout(self, ep: Episode) -> dict[str, int]:
        """Parameter -> layout code once the episode is done without conflict."""
        out = {}
        for p in self.params:
            ls = self.prop.layouts(ep.doms, p)
            splits = [c for c in ls if c >= 2]
            out[p] = splits[0] if len(ls) == 1 and splits else WHOLE
        return out

    def final_reward(self, ep: Episode) -> tuple[float, float]:
        """(cost reward, seconds) of a finished episode."""
        if ep.conflict:
            return CONFLICT_REWARD, math.inf
        seconds, fits, _, _ = self.pricer.price(self.layout(ep))
        if not math.isfinite(seconds):
            return CONFLICT_REWARD, math.inf
        return ((self.replicated / seconds) ** 0.5 if fits else 0.0), seconds

    def exact(self) -> tuple[float, bool, bool]:
        """A*'s optimum over the priced family with free parameter layouts: (seconds, fits,
        exhaustive); a lower bound on every layout the DQN can choose."""
        seconds, fits, _, exhaustive = self.pricer.price(None)
        return seconds, fits, exhaustive


class DataEnvironment(DecisionEnvironment):
    """ADP: decisions over the inputs' dims, parameters whole; the paper's reward."""

    def __init__(self, graph: Graph, devices: int):
        super().__init__(Propagation(graph, devices, graph.inputs, whole=graph.params), list(graph.inputs), linkage=False)

    def batch_dims(self, ep: Episode) -> dict[str, int | None]:
        out = {}
        for name in self.prop.graph.inputs:
            ls = self.prop.layouts(ep.doms, name)
            out[name] = next(iter(ls)) - 2 if len(ls) == 1 and min(ls) >= 2 else None
        return out


@dataclass(slots=True)
class LayoutResult:
    status: dict[Unit, int]
    """The decisions of the best episode."""
    episode_return: float
    """Its return under the paper's reward."""
    seconds: float
    """Its iteration time priced by hap's cost model (OPP; nan for ADP)."""
    split_tensors: int
    """Tensors propagation leaves split."""
    episodes: int
    """Episodes played, the final greedy one included."""
    search_seconds: float
    best: Episode | None = field(default=None, repr=False)


def search_layout(env: DecisionEnvironment, episodes: int = 300, budget_s: float = 120.0, seed: int = 0,
                  config: DQNConfig | None = None) -> LayoutResult:
    """Train a DQN online on `env` for `episodes` episodes (or `budget_s`), then play one greedy
    episode; return the best finished episode (OPP with reward "cost": the fastest that fits
    memory; otherwise the highest paper return, ties broken by more split tensors). The first
    episode replicates everything."""
    t0 = time.perf_counter()
    by_cost = isinstance(env, OperatorEnvironment) and env.reward_kind == "cost"
    cfg = config or DQNConfig(depth=2, hidden=128, lr=5e-4, gamma=1.0 if by_cost else 0.6,
                              epsilon_steps=max(1, int(0.6 * episodes * max(1, len(env.units)) / 3)), seed=seed)
    agent = Agent(env.state_dim, 2, cfg)
    allowed = torch.ones(2, dtype=torch.bool)
    none = torch.zeros(2, dtype=torch.bool)
    best, best_key, done = None, None, 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # episode 0 replicates every dimension (the known-good start, as the pipeline search
        # starts from the speed-proportional cut); the last is the trained network's own
        for i in range(episodes + 1):
            greedy = i == episodes
            if not greedy and time.perf_counter() - t0 > budget_s:
                greedy = True
            ep = env.reset()
            while not ep.done:
                s = env.state(ep)
                a = 0 if i == 0 else agent.act(s, allowed, greedy=greedy)
                r = env.step(ep, a)
                if by_cost:  # the cost reward replaces the paper's: 0 until the end
                    r = env.final_reward(ep)[0] if ep.done else 0.0
                if not greedy:
                    agent.remember(s, a, r, env.state(ep), none if ep.done else allowed, ep.done)
                    agent.learn()
            if ep.conflict:
                key = (False, -math.inf)
            elif by_cost:
                seconds, fits = env.pricer.price(env.layout(ep))[:2]
                key = (fits, -seconds)  # a layout that fits beats any that does not
            else:
                key = (ep.total, env.prop.split_count(ep.doms))
            if best_key is None or key > best_key:
                best, best_key = ep, key
            done += 1
            if greedy:
                break
    seconds = math.nan
    if isinstance(env, OperatorEnvironment) and not best.conflict:
        seconds = env.final_reward(best)[1]
    return LayoutResult(dict(best.status), best.total, seconds, env.prop.split_count(best.doms), done,
                        time.perf_counter() - t0, best)


def opp_plan(graph: Graph, cluster: Cluster, optimizer: str = "adam", episodes: int = 1000, budget_s: float = 280.0,
             progress=None):
    """hap plan --planner dqn-opp: the operator-partitioning plan the cost-rewarded DQN finds,
    as a Plan the runtime runs (data whole, parameters split as found, derivation moves only)."""
    from ..planner import PlannerConfig, assemble_one
    t0 = time.perf_counter()
    # each layout's A* width-capped as the planner's searches are: an exhaustive search of a hard
    # layout could outlast the whole budget (the benchmark, comparing with A*'s optimum, keeps it)
    env = OperatorEnvironment(graph, cluster, reward="cost", width=PlannerConfig().width, optimizer=optimizer)
    if progress:
        progress(f"dqn-opp: training the DQN on {graph.model_name}'s parameter dims for up to {episodes} episodes or "
                 f"{budget_s:.0f} s (each layout it meets priced by A*)")
    found = search_layout(env, episodes, budget_s)
    if not math.isfinite(found.seconds):
        raise ValueError(f"{graph.model_name}: no operator-partitioning layout the DQN met has a program")
    layout = env.layout(found.best)
    seconds, fits, program, _ = env.pricer.price(layout)
    if not fits:
        raise ValueError(f"{graph.model_name}: the best operator-partitioning layout found does not fit the devices' memory")
    if progress:
        progress(f"dqn-opp: {seconds * 1e3:.2f} ms after {found.episodes} episodes ({found.search_seconds:.1f} s); "
                 f"all replicated {env.replicated * 1e3:.2f} ms")
    split = {p: f"S({c - 2})" for p, c in layout.items() if c >= 2}
    return assemble_one(env.pricer.cost, program, env.pricer.ratios, time.perf_counter() - t0,
                        {"planner": "dqn-opp", "winner": "operator partitioning", "exhaustive": False,
                         "episodes": found.episodes, "split_parameters": split})
