"""Auto-MAP's pipeline planner (seed 004, section 3.4): a DQN places the K - 1 cuts of a
pipeline one after another, online, rewarded by the cost model.

State (one vector): at every pivot (coarsened to SLOTS = 128 slots) the compute C before it as a
fraction of the whole (on the slowest device), the activation bytes A crossing it (scaled by
the largest crossing) and the parameter bytes W before it (fraction), which pivots are still
allowed, the previous cut (one-hot), the stage being ended (one-hot), and where that stage
would end if cut by compute in proportion to its device group's speed (the topology's
share). Action: the slot of the next cut after the previous one. Reward: at the last cut,
1 / sqrt(L / L_even), L the pipeline's estimated iteration time (pipeline/price.py) and
L_even that of the cut by speed-proportional compute (where that cut does not fit memory, a
finite stand-in: the largest stage time times K + M - 1); 0 before, and 0 for a cut that does
not fit memory. The planner returns the best pipeline its episodes met (the paper reports
the best plan found during exploration, too).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..cost.cluster import Cluster
from ..ir import Graph
from ..plan import Plan
from ..planner import PlannerConfig
from ..pipeline.partition import StageTable, nearest_to_fit, polish, shortfall
from ..pipeline.plan import PipelineSpace
from .dqn import Agent, DQNConfig

SLOTS = 128
MAX_STAGES = 8
POLISHED = 8  # the DQN's best distinct cuts that the local search starts from


@dataclass(frozen=True, slots=True)
class DQNResult:
    cuts: tuple[int, ...]
    """Node indices where stages 1..K-1 start."""
    seconds: float
    """L of `cuts`: the best of the DQN's best few cuts and its greedy cut, each polished
    (partition.polish)."""
    raw_seconds: float
    """L of the best cut the DQN met (its episodes' and its greedy cut), before the polish."""
    greedy_seconds: float
    """L of the trained network's own greedy cut (no exploration)."""
    episodes: int
    search_seconds: float


def cut_features(table) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[float]]:
    """At every pivot: compute before it (fraction, on the slowest device), bytes crossing it
    (fraction of the largest crossing), parameter bytes before it (fraction); and each stage's
    group speed. A table may provide its own (the generated ones of pipeline_infer.py)."""
    if hasattr(table, "cut_features"):
        return table.cut_features()
    pr, pos = table.pricer, table.positions
    slow = int(np.argmax(pr.work_f[-1] + pr.work_b[-1]))
    work = pr.work_f[:, slow] + pr.work_b[:, slow] + pr.fixed_f[:, slow] + pr.fixed_b[:, slow]
    C = work[pos[1:-1]] / max(work[-1], 1e-30)
    A = pr.cut_bytes[pos[1:-1]]
    A = A / max(A.max(), 1e-30)
    W = pr.params[pos[1:-1]] / max(pr.params[-1], 1e-30)
    speed = [sum(1.0 / pr.cost.inv_speed[d] for d in g) for g in table.groups]
    return C, A, W, speed


class CutEnvironment:
    """Placing K - 1 cuts on the pivots of a StageTable, one per step."""

    def __init__(self, table: StageTable):
        self.table = table
        self.K = len(table.groups)
        Q = len(table.positions)
        self.pivots = Q - 2
        if self.pivots > SLOTS or self.K > MAX_STAGES:
            raise ValueError(f"at most {SLOTS} pivots and {MAX_STAGES} stages, got {self.pivots} and {self.K}")
        C, A, W, speed = cut_features(table)
        self.features = np.zeros(3 * SLOTS, dtype=np.float32)
        for i, arr in enumerate((C, A, W)):
            self.features[i * SLOTS:i * SLOTS + self.pivots] = arr
        self.ideal = np.cumsum(speed) / sum(speed)  # fraction of compute before the end of stage k
        self.compute = C
        self.reference = table.objective(self.proportional_cut())
        """L of the speed-proportional cut (inf where it does not fit memory)."""
        finite = table.t[np.isfinite(table.t)] if hasattr(table, "t") else np.array([])
        # the reward's scale: that L, or where it does not fit, a finite stand-in of the same order
        self.scale = self.reference if math.isfinite(self.reference) else \
            float(finite.max() * (self.K + table.M - 1)) if finite.size else 1.0
        self.state_dim = 5 * SLOTS + MAX_STAGES + 1
        self.sharpness = 0.5
        """The reward's power of L_even / L: 0.5 is the paper's 1 / sqrt(L)."""

    def proportional_cut(self) -> tuple[int, ...]:
        """The cut by compute in proportion to the groups' speeds (increasing positions)."""
        cuts, prev = [], 0
        for k in range(self.K - 1):
            lo, hi = prev + 1, self.pivots - (self.K - 2 - k)
            best = min(range(lo, hi + 1), key=lambda p: abs(self.compute[p - 1] - self.ideal[k]))
            cuts.append(best)
            prev = best
        return tuple(cuts)

    def allowed(self, k: int, prev: int) -> torch.Tensor:
        """Slots (pivot index - 1) allowed for the end of stage k after position prev."""
        mask = torch.zeros(SLOTS, dtype=torch.bool)
        mask[prev:self.pivots - (self.K - 2 - k)] = True
        return mask

    def state(self, k: int, prev: int) -> torch.Tensor:
        mask = self.allowed(k, prev).float().numpy()
        one_prev = np.zeros(SLOTS, dtype=np.float32)
        if prev:
            one_prev[prev - 1] = 1
        stage = np.zeros(MAX_STAGES, dtype=np.float32)
        stage[k] = 1
        return torch.from_numpy(np.concatenate([self.features, mask, one_prev, stage, [self.ideal[k]]]).astype(np.float32))

    def reward(self, cuts: tuple[int, ...]) -> tuple[float, float]:
        L = self.table.objective(cuts)
        return ((self.scale / L) ** self.sharpness if math.isfinite(L) else 0.0), L


def play_episode(env: CutEnvironment, agent: Agent, greedy: bool = False) -> tuple[tuple[int, ...], float, float]:
    """Place the K - 1 cuts with the agent (epsilon-greedy and learning, unless greedy);
    returns (cut pivots, L, reward)."""
    prev, cuts = 0, []
    none = torch.zeros(SLOTS, dtype=torch.bool)
    r = L = math.nan
    for k in range(env.K - 1):
        s, mask = env.state(k, prev), env.allowed(k, prev)
        a = agent.act(s, mask, greedy=greedy)
        cuts.append(a + 1)
        last = k == env.K - 2
        if last:
            r, L = env.reward(tuple(cuts))
            s2, m2 = s, none
        else:
            r, s2, m2 = 0.0, env.state(k + 1, a + 1), env.allowed(k + 1, a + 1)
        if not greedy:
            agent.remember(s, a, r, s2, m2, last)
            agent.learn()
        prev = a + 1
    return tuple(cuts), L, r


def search_cuts(table: StageTable, episodes: int = 3000, budget_s: float = 60.0, seed: int = 0) -> DQNResult:
    """Train a DQN online on one (model, cluster, K, M) and return the best cut it met after a
    local search (partition.polish) from each of the `POLISHED` best distinct cuts it met and
    its greedy cut (a near-best cut may lie in the better basin); the result keeps the best
    L the DQN met itself too."""
    t0 = time.perf_counter()
    env = CutEnvironment(table)
    steps = episodes * (env.K - 1)
    # gamma 1, not the paper's 0.6: the only reward comes after K - 1 cuts, and 0.6^6 would all but hide
    # it from the first cut of an 8-stage pipeline
    agent = Agent(env.state_dim, SLOTS, DQNConfig(depth=2, hidden=128, lr=1e-3, gamma=1.0,
                                                  epsilon_steps=max(1, int(0.8 * steps)),
                                                  seed=seed))
    met: dict[tuple, float] = {}  # distinct cuts the DQN met -> L, the best few kept
    done_episodes = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(episodes):
            if time.perf_counter() - t0 > budget_s:
                break
            cuts, L, _ = play_episode(env, agent)
            met[tuple(cuts)] = L
            if len(met) > 4 * POLISHED:
                met = dict(sorted(met.items(), key=lambda kv: kv[1])[:POLISHED])
            done_episodes += 1
        greedy, _, _ = play_episode(env, agent, greedy=True)
    greedy_L = table.objective(tuple(greedy))
    met[tuple(greedy)] = greedy_L
    raw = min(met.values())
    # every start is polished, one that does not fit too (a move that fits is a step down from
    # inf); the speed-proportional cut too, which is no cut of the DQN's (raw does not count it)
    starts = [c for c, _ in sorted(met.items(), key=lambda kv: kv[1])[:POLISHED]]
    starts = list(dict.fromkeys(starts + [tuple(greedy), tuple(env.proportional_cut())]))
    L, polished = min((polish(table, c)[::-1] for c in starts), key=lambda x: x[0])
    cuts = tuple(int(table.positions[c]) for c in polished)
    return DQNResult(cuts, L, raw, greedy_L, done_episodes, time.perf_counter() - t0)


def screened_table(space: PipelineSpace, K: int, M: int) -> StageTable:
    """The table of the device layout (of those pp-exact tries, PipelineSpace.layouts) whose
    speed-proportional cut, after the local search (partition.polish), is least: the grouping
    the DQN then places its cuts for. A cheap screen (a table and a polish per layout), not a
    proof: the DQN's cut may do better on a layout whose proportional cut did worse."""
    best = None
    for groups in space.layouts(K):
        table = space.table(K, M, groups)
        _, seconds = polish(table, CutEnvironment(table).proportional_cut())
        if best is None or seconds < best[0]:
            best = (seconds, table)
    return best[1]


def dqn_plan(graph: Graph, cluster: Cluster, config: PlannerConfig | None = None,
             progress: Callable[[str], None] | None = None, episodes: int = 3000, budget_s: float = 240.0) -> Plan:
    """The best pipeline the DQN finds over stage and micro-batch counts (hap plan --planner dqn),
    each on the device layout screened for it (screened_table)."""
    t0 = time.perf_counter()
    space = PipelineSpace(graph, cluster, config)
    if space.config.pipeline_stages > MAX_STAGES:  # (its network's state has a slot per stage)
        raise ValueError(f"the DQN places at most {MAX_STAGES} stages, got {space.config.pipeline_stages}: "
                         "pp-exact plans any count")
    choices = [(K, M) for K in space.stage_counts() for M in space.micro_batch_counts(K)]  # (none: stage_counts says why)
    best, tables, frugal = None, [], False
    for K, M in choices:
        table = screened_table(space, K, M)
        tables.append(table)
        budget = (budget_s - (time.perf_counter() - t0)) / (len(choices) - choices.index((K, M)))
        res = search_cuts(table, episodes, budget)
        sizes = "/".join(str(len(g)) for g in table.groups)
        if progress:
            found = f"{res.seconds * 1e3:.2f} ms" if math.isfinite(res.seconds) else "no cut that fits memory"
            progress(f"dqn: K={K} groups {sizes} M={M}: {found} after {res.episodes} episodes ({res.search_seconds:.1f} s)")
        if best is None or res.seconds < best[0].seconds:
            best = (res, K, M, table)
    res, K, M, table = best
    if not math.isfinite(res.seconds):
        # no cut the DQN met fits: the one that needs the least of its fullest device's memory
        # is the plan where it fits, else what the error names
        table = nearest_to_fit(tables)
        fill, cuts_pos, _, _ = table.most_frugal()
        if fill > 1.0:
            raise ValueError(f"no pipeline the DQN met fits the devices' memory, nor any cut of the {len(tables)} "
                             f"layout{'s' if len(tables) > 1 else ''} it tried" + shortfall(table))
        K, M, frugal = len(table.groups), table.M, True
        res = dataclasses.replace(res, cuts=tuple(int(table.positions[c]) for c in cuts_pos),
                                  seconds=table.objective(cuts_pos))
        if progress:
            progress(f"dqn: no cut it met fits memory; the most frugal cut does (K={K} M={M}): {res.seconds * 1e3:.2f} ms")
    groups = table.groups
    return space.plan(res.cuts, K, M, time.perf_counter() - t0,
                      {"planner": "dqn", "winner": f"pipeline K={K} M={M} groups {[len(g) for g in groups]}",
                       "exhaustive": False, "episodes": res.episodes, "greedy_seconds": _finite(res.greedy_seconds),
                       "unpolished_seconds": _finite(res.raw_seconds), "most_frugal_cut": frugal}, groups)


def _finite(seconds: float) -> float | None:
    """A plan's figure as JSON can hold it: None for a cut that fits no device (inf)."""
    return seconds if math.isfinite(seconds) else None
