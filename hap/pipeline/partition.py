"""Where a pipeline may be cut, onto which devices its stages go, and the exact optimal cut.

- Pivots: the node boundaries a stage may start at: layer boundaries (ir.chunk_cuts) where
  only batch-split or replicated tensors cross, thinned to at most `limit` evenly by compute
  (the paper's coarsening to 128).
- Device groups: K groups of consecutive ranks (`group_layouts`: equal sizes where K divides
  the devices, and the groups nearest to equal total speed), in rank order and, where the
  ranks are not in order of speed, in order of speed too (`device_layouts`: two fast GPUs
  listed apart may share a stage); the cut also adapts to a group's
  speed (a fast group takes a longer stage), and inside a group the devices split each
  micro-batch in proportion to their speed.
- exact_partition: the cuts minimizing PipelinePricer's L over all choices of K - 1 pivots,
  by dynamic programming over (stages placed, pivot) with Pareto sets of (sum of stage
  times, largest stage time, largest sync), since L = sum + (M - 1) max + max sync is not a
  sum of per-stage terms; once per placement of the parameters several stages may share,
  whose sync depends on which stages those are. Stages whose memory does not fit their
  devices are never chosen. Its table (StageTable) takes every term from the pricer, so the
  L it minimizes is the plan's estimate.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..cost.model import CostModel
from ..ir import chunk_cuts, size_text
from ..search.program import Step
from .price import PipelinePricer, iteration_seconds
from .stages import crossings, stage_of_nodes, updated_buffer_spans


def pivots(cost: CostModel, program: Sequence[Step], limit: int = 128) -> list[int]:
    """Valid stage starts (node indices > 0), at most `limit`, spread evenly by compute."""
    graph = cost.graph
    placed = {}
    for step in program:
        placed.update(zip(graph.nodes[step.node].outputs, step.strategy.outputs))
    ok, spans = [], updated_buffer_spans(graph).values()
    for c in chunk_cuts(graph):
        crossing = [t for t in graph.tensors.values()
                    if 0 <= t.producer < c and t.consumers and max(t.consumers) >= c]
        if all(placed[t.name].is_shard or placed[t.name].kind == "R" for t in crossing) and \
                not any(first < c <= last for first, last in spans):
            ok.append(c)
    if len(ok) <= limit:
        return ok
    flops = np.cumsum([n.flops + n.bwd_flops for n in graph.nodes])
    targets = np.linspace(0, flops[-1], limit + 2)[1:-1]
    chosen = sorted({min(ok, key=lambda c: abs(flops[c - 1] - x)) for x in targets})
    return chosen


def equal_groups(devices: int, stages: int) -> list[list[int]]:
    if stages < 1 or devices % stages:
        raise ValueError(f"{stages} pipeline stages do not divide {devices} devices into equal groups")
    per = devices // stages
    return [list(range(k * per, (k + 1) * per)) for k in range(stages)]


def group_layouts(speeds: Sequence[float], stages: int, limit: int = 6) -> list[list[list[int]]]:
    """Ways to give K stages groups of consecutive ranks (every rank once, every group
    non-empty), at most `limit`: equal groups first where K divides the devices, then the
    layouts whose groups' total speeds are nearest to equal (least largest over smallest, ties
    by the list of group sizes), so a group of slow devices may be larger than one of fast
    devices. Found best first (_nearest_layouts), not by sorting all C(m - 1, K - 1) layouts
    (2.6 million at 32 devices and 8 stages)."""
    m = len(speeds)
    if not 1 <= stages <= m:
        raise ValueError(f"{stages} pipeline stages cannot each have a device of the {m}")
    equal = equal_groups(m, stages) if m % stages == 0 else None
    skip = tuple(len(g) for g in equal) if equal else None
    found = _nearest_layouts(list(speeds), stages, max(0, limit - (equal is not None)), skip)
    layouts = [[list(range(a, a + size)) for a, size in zip(np.cumsum((0, *sizes[:-1])), sizes)] for sizes in found]
    return (([equal] if equal else []) + layouts)[:limit]


def device_layouts(speeds: Sequence[float], stages: int, limit: int = 6) -> list[list[list[int]]]:
    """group_layouts of the ranks in their order and, where that is not an order of speed, of the
    ranks in order of speed (fastest first) too, each group's ranks ascending, a layout found
    twice once: the devices of a cluster listed fast, slow, fast, slow may pair the fast ones."""
    found = group_layouts(speeds, stages, limit)
    m = len(speeds)
    if all(a >= b for a, b in zip(speeds, speeds[1:])) or all(a <= b for a, b in zip(speeds, speeds[1:])):
        return found  # (consecutive groups in order of speed are the rank order's, or its reverse's)
    order = sorted(range(m), key=lambda i: -speeds[i])
    for layout in group_layouts([speeds[i] for i in order], stages, limit):
        mapped = [sorted(order[i] for i in group) for group in layout]
        if mapped not in found:
            found.append(mapped)
    return found


def _nearest_layouts(speeds: list[float], K: int, count: int, skip: tuple[int, ...] | None) -> list[tuple[int, ...]]:
    """The `count` group sizes (K consecutive groups, other than `skip`) of least (largest over
    smallest group speed, sizes), in that order: a depth-first search, each group's end tried
    nearest to an equal share first, that drops a partial layout no completion of which can
    beat the worst one kept (the groups still to come share what remains: one holds at least
    its mean, one at most)."""
    m, kept = len(speeds), []  # sorted (spread, sizes)

    def walk(start: int, sizes: tuple[int, ...], lo: float, hi: float) -> None:
        rest = K - len(sizes) - 1  # groups after the next one
        if rest == 0:
            last = sum(speeds[start:])
            key = (max(hi, last) / min(lo, last), sizes + (m - start,))
            if key[1] != skip:
                bisect.insort(kept, key)
                del kept[count:]
            return
        target = sum(speeds[start:]) / (rest + 1)
        for end in sorted(range(start + 1, m - rest + 1), key=lambda e: abs(sum(speeds[start:e]) - target)):
            total = sum(speeds[start:end])
            h, l, mean = max(hi, total), min(lo, total), sum(speeds[end:]) / rest
            if len(kept) == count and max(h, mean) / min(l, mean) > kept[-1][0] * (1 + 1e-9):
                continue
            walk(end, sizes + (end - start,), l, h)

    if count > 0:
        walk(0, (), math.inf, 0.0)
    return [sizes for _, sizes in kept]


def speed_ratios(cost: CostModel, group: Sequence[int]) -> list[float]:
    """Shares of a micro-batch in proportion to the devices' speeds."""
    speed = [1.0 / cost.inv_speed[i] for i in group]
    return [s / sum(speed) for s in speed]


@dataclass(frozen=True, slots=True)
class Partition:
    cuts: tuple[int, ...]
    seconds: float
    """PipelinePricer's L of these cuts."""
    explored: int
    """Pareto states the search kept (its work)."""
    exact: bool = True
    """Whether the cuts are the optimum (exact_partition: not past SIGNATURES signatures)."""


class StageTable:
    """t_k, sync_k and whether stage k fits, for every pair of positions (0, pivots..., n): the
    one table the exact search, the polish and the DQN's environment read. Each entry is the
    pricer's own (stage_times, transfer, sync, memory), so `objective` is the estimate's L.

    A parameter that several stages hold (a tied embedding) makes their gradient sync depend on
    which stages those are (PipelinePricer.shared_sync): `sync` holds the part each stage pays
    alone, `shared` the rest, by the stages that the `shared_intervals` fall in."""

    def __init__(self, pricer: PipelinePricer, points: Sequence[int], groups, ratios, M: int, schedule: str):
        from .schedule import in_flight
        self.pricer, self.points, self.groups, self.ratios, self.M = pricer, list(points), groups, ratios, M
        n = len(pricer.graph.nodes)
        pos = np.asarray([0, *points, n])
        self.positions = pos
        K, Q = len(groups), len(pos)
        cost = pricer.cost
        self.t = np.full((K, Q, Q), np.inf)
        self.sync = np.zeros((K, Q, Q))
        capacity = [d.memory for d in cost.cluster.devices]  # per GPU, as PipelinePricer.memory
        self.least: dict[int, float] = {}
        """Device -> the least memory (bytes) it needs as a device of its stage (the first stage
        starts at the model's first node, the last ends at its last)."""
        self.fill = np.full((K, Q, Q), np.inf)
        """[k, a, b]: the largest fraction of its memory a device of stage k from a to b needs."""
        self._fullest = np.zeros((K, Q, Q, 2))  # [k, a, b]: (that device, its bytes)
        least = self.least
        for k, g in enumerate(groups):
            # [a, b]: stage from position a to position b (exclusive)
            f, bw = pricer.stage_times(pos[:, None], pos[None, :] - 1, g, ratios[k], M)
            comp = f + bw
            send = np.asarray([sum(pricer.transfer(int(p), g, groups[k + 1], M, ratios[k], ratios[k + 1]))
                               if k + 1 < K and 0 < p < n else 0.0
                               for p in pos])  # forward and back
            live = in_flight(schedule, K, M, k)
            for a in range(Q):
                for b in range(a + 1, Q):
                    mem = pricer.memory(int(pos[a]), int(pos[b]) - 1, g, ratios[k], M, live)
                    i, x = max(zip(g, mem), key=lambda ix: ix[1] / capacity[ix[0]])
                    self.fill[k, a, b], self._fullest[k, a, b] = x / capacity[i], (i, x)
                    if (k > 0 or a == 0) and (k < K - 1 or b == Q - 1):  # a stage k could be
                        for i, x in zip(g, mem):
                            least[i] = min(least.get(i, x), x)
                    if all(x <= capacity[i] for i, x in zip(g, mem)):
                        self.t[k, a, b] = comp[a, b] + send[b]
                        self.sync[k, a, b] = pricer.sync(int(pos[a]), int(pos[b]) - 1, g)
        self.short = [(i, least[i], capacity[i]) for i in sorted(least) if least[i] > capacity[i]]
        """(device, least bytes, capacity) of each device that no stage it could hold fits."""
        self.shared_intervals = self._shared_intervals()
        """Intervals (position j to j + 1) holding a use of a trained parameter that nodes in
        other intervals use too: which stages these fall in decides which stages share it."""
        self._shared: dict[tuple[int, ...], np.ndarray] = {}

    def most_frugal(self) -> tuple[float, tuple[int, ...], int, float]:
        """The cut whose fullest device needs the least fraction of its memory, for errors where
        no cut fits: (that fraction, the cut's positions, the device, its bytes). A minimax
        dynamic program over (stages placed, position)."""
        K, Q = self.fill.shape[:2]
        best, back = self.fill[0, 0], []  # best[b]: the least fullest fraction of stages 0..k ending at b
        for k in range(1, K):
            through = np.maximum(best[:, None], self.fill[k])  # [a, b]
            back.append(through.argmin(axis=0))
            best = through.min(axis=0)
        cuts, b = [], Q - 1
        for k in range(K - 1, 0, -1):
            b = int(back[k - 1][b])
            cuts.append(b)
        cuts.reverse()
        bounds = [0, *cuts, Q - 1]
        k = max(range(K), key=lambda k: self.fill[k, bounds[k], bounds[k + 1]])
        device, need = self._fullest[k, bounds[k], bounds[k + 1]]
        return float(best[Q - 1]), tuple(cuts), int(device), float(need)

    def _shared_intervals(self) -> list[int]:
        out: set[int] = set()
        for nodes, amount in self.pricer.spread:
            found = np.unique(np.searchsorted(self.positions, nodes, side="right") - 1)
            if amount[2] and len(found) > 1:
                out.update(int(j) for j in found)
        return sorted(out)

    def signature(self, cuts_pos: Sequence[int]) -> tuple[int, ...]:
        """The stage of every shared interval under cuts (positions)."""
        found = np.searchsorted(np.asarray(cuts_pos, dtype=int), self.shared_intervals, side="right")
        return tuple(int(x) for x in found)

    def shared(self, signature: tuple[int, ...]) -> np.ndarray:
        """Per stage: the seconds of PipelinePricer.shared_sync where the shared intervals fall in
        the stages `signature` (the other nodes' stages do not change it: a parameter used in
        one interval alone is held by one stage)."""
        found = self._shared.get(signature)
        if found is None:
            per_interval = np.zeros(len(self.positions) - 1, dtype=int)
            for j, k in zip(self.shared_intervals, signature):
                per_interval[j:] = k  # signatures never decrease: the intervals after follow
            stage_of = np.repeat(per_interval, np.diff(self.positions))
            found = self._shared[signature] = np.asarray(self.pricer.shared_sync(stage_of, self.groups))
        return found

    def signatures(self, limit: int) -> list[tuple[int, ...]] | None:
        """Every signature some cut has (each stage holds an interval at least), or None where
        there are more than `limit`."""
        K, last, J = len(self.groups), len(self.positions) - 2, self.shared_intervals
        out: list[tuple[int, ...]] = []

        def walk(prefix: tuple[int, ...]) -> None:
            if len(out) > limit:
                return
            i = len(prefix)
            if i == len(J):
                out.append(prefix)
                return
            # interval j in stage k: stages 0..k-1 hold an interval each before it, k+1..K-1 after
            # it, and the stages after the previous shared interval's start between the two
            lo = max(prefix[-1] if i else 0, K - 1 - (last - J[i]))
            hi = min(K - 1, J[i], prefix[-1] + J[i] - J[i - 1] if i else K - 1)
            for k in range(lo, hi + 1):
                walk(prefix + (k,))

        walk(())
        return out if len(out) <= limit else None

    def allowed(self, signature: tuple[int, ...]) -> np.ndarray:
        """[k, a, b]: whether stage k from position a to b holds exactly the shared intervals
        `signature` puts in stage k."""
        K, Q = len(self.groups), len(self.positions)
        a, b = np.arange(Q)[:, None], np.arange(Q)[None, :]
        ok = np.ones((K, Q, Q), dtype=bool)
        for j, s in zip(self.shared_intervals, signature):
            inside = (a <= j) & (j < b)
            for k in range(K):
                ok[k] &= inside == (k == s)
        return ok

    def objective(self, cuts_pos: Sequence[int]) -> float:
        """L of the stages between consecutive positions (indices into `positions`)."""
        bounds = [0, *cuts_pos, len(self.positions) - 1]
        t = [self.t[k, a, b] for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        s = [self.sync[k, a, b] for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        if self.shared_intervals:
            s = [x + y for x, y in zip(s, self.shared(self.signature(cuts_pos)))]
        return iteration_seconds(t, s, self.M, self.pricer.step_collectives)


class NoCutFits(ValueError):
    """No cut of a stage table fits the devices' memory."""


SIGNATURES = 256
"""The most signatures (StageTable.signatures) exact_partition searches one by one."""


def exact_partition(table: StageTable) -> Partition:
    """The K - 1 cuts (positions) with the least L, or a ValueError when no cut fits memory.

    Where several stages may hold one parameter (StageTable.shared), its sync is not a sum of
    per-stage terms: the search runs once per signature (the stages the shared intervals fall
    in), over the cuts of that signature alone, whose shared sync is then a constant per stage.
    Past SIGNATURES of them it searches the per-stage terms alone and polishes that cut by the
    whole L (exact=False)."""
    runs, exact = _runs(table)
    best, explored = None, 0
    K, Q = len(table.groups), len(table.positions)
    even = tuple(round(Q * (k + 1) / K) for k in range(K - 1))  # (a bound for the first search)
    even = even if K > 1 and len(set(even)) == K - 1 and 1 <= even[0] and even[-1] <= Q - 2 else None
    if even is not None and math.isfinite(table.objective(even)):
        even = polish(table, even)[0]  # (a local search: a far tighter bound, at a fraction of the search)
    for extra, ok in runs:
        found, work = _search(table, extra, ok, [c for c in (even, best and best[1]) if c])
        explored += work
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    if best is None:
        raise NoCutFits(f"no cut into {len(table.groups)} stages fits the devices' memory" + shortfall(table))
    cuts_pos, seconds = best[1], table.objective(best[1])
    if not exact:
        cuts_pos, seconds = polish(table, cuts_pos)
    return Partition(tuple(int(table.positions[c]) for c in cuts_pos), seconds, explored, exact)


def _runs(table) -> tuple[list[tuple[np.ndarray, np.ndarray | None]], bool]:
    """The searches exact_partition makes, as (extra sync per stage, the stages allowed or None
    for all), and whether together they are exact."""
    K = len(table.groups)
    if not getattr(table, "shared_intervals", None):  # (or a table of another kind: pipeline_infer's)
        return [(np.zeros(K), None)], True
    signatures = table.signatures(SIGNATURES)
    if signatures is None:
        return [(np.zeros(K), None)], False
    return [(table.shared(sig), table.allowed(sig)) for sig in signatures], True


def _search(table, extra: np.ndarray, ok: np.ndarray | None, guesses: Sequence[Sequence[int]] = ()
            ) -> tuple[tuple[float, tuple[int, ...]] | None, int]:
    """The dynamic program over (stages placed, position) with Pareto sets, on stages that `ok`
    allows (None: all), stage k's sync raised by extra[k]: ((L, cut positions) or None, the
    Pareto states it kept). A state whose L so far (sum, slowest stage, largest sync: each only
    grows as stages are added) exceeds the L of a cut in `guesses` is dropped: no cut through
    it beats that one."""
    K, Q, M1 = len(table.groups), len(table.positions), table.M - 1
    times = (table.t if ok is None else np.where(ok, table.t, np.inf)).tolist()  # (Python floats: 3x faster here)
    syncs = (table.sync + np.asarray(extra)[:, None, None]).tolist()
    bound = min((_l_of(times, syncs, M1, cuts) for cuts in guesses), default=math.inf)
    # fronts[j]: Pareto set of (sum, max t, max sync, cut positions) over the first k stages ending at j
    fronts: dict[int, list[tuple]] = {0: [(0.0, 0.0, 0.0, ())]}
    explored = 0
    for k in range(K):
        last = k == K - 1
        nxt: dict[int, list[tuple]] = {}
        for a, front in fronts.items():
            ends = [Q - 1] if last else range(a + 1, Q - 1 - (K - k - 1) + 1)
            for b in ends:
                t = times[k][a][b]
                if not math.isfinite(t) or b <= a:
                    continue
                sy = syncs[k][a][b]
                cut = () if last else (b,)
                kept = [(s + t, max(mx, t), max(ms, sy), cuts + cut) for s, mx, ms, cuts in front]
                kept = [x for x in kept if x[0] + M1 * x[1] + x[2] <= bound]
                if kept:
                    nxt.setdefault(b, []).extend(kept)
        fronts = {b: _pareto(items) for b, items in nxt.items()}
        explored += sum(len(f) for f in fronts.values())
    final = fronts.get(Q - 1, [])
    if not final:
        return None, explored
    best = min(final, key=lambda x: x[0] + M1 * x[1] + x[2])
    return (best[0] + M1 * best[1] + best[2], best[3]), explored


def _l_of(times: list, syncs: list, M1: int, cuts: Sequence[int]) -> float:
    """L of a cut as _search prices it (inf where a stage is not allowed)."""
    stages = list(enumerate(zip([0, *cuts], [*cuts, len(times[0]) - 1])))
    return iteration_seconds([times[k][a][b] for k, (a, b) in stages], [syncs[k][a][b] for k, (a, b) in stages], M1 + 1)


def shortfall(table: StageTable) -> str:
    """Why no cut of `table` fits memory, in words (to follow "no cut ... fits the devices'
    memory"): the first device that no stage it could hold fits, or else what the most frugal
    cut (StageTable.most_frugal) needs on its fullest device."""
    devices = table.pricer.cost.cluster.devices
    if table.short:
        i, need, capacity = table.short[0]
        return (f": device {i} ({devices[i].name}, {size_text(capacity)}) needs at least {size_text(need)} for any "
                f"stage of {table.M} micro-batches it could hold")
    _, cuts, i, need = table.most_frugal()
    at = ", ".join(str(int(table.positions[c])) for c in cuts)
    return (f": the most frugal, {len(table.groups)} stages on groups {'/'.join(str(len(g)) for g in table.groups)} "
            f"cut at node{'s' if len(cuts) > 1 else ''} {at} with {table.M} micro-batches, needs "
            f"{size_text(need)} on device {i} ({devices[i].name}), which has {size_text(devices[i].memory)}")


def nearest_to_fit(tables: Sequence[StageTable]) -> StageTable:
    """Of tables none of whose cuts fits memory, the one whose most frugal cut comes nearest:
    the one an error names."""
    return min(tables, key=lambda table: table.most_frugal()[0])


def polish(table: StageTable, cuts_pos: Sequence[int], reach: int = 16) -> tuple[tuple[int, ...], float]:
    """A local search from cuts (positions into table.positions) to a cut no single move
    improves: a move takes one cut anywhere else (between its neighbours first), or shifts a
    run of consecutive cuts together by up to `reach` positions (the slowest stage then hands
    work down a chain of stages, which no one cut's move can do). Returns (positions, L)."""
    Q = len(table.positions)
    cuts, best = list(cuts_pos), table.objective(tuple(cuts_pos))
    K1 = len(cuts)

    def moves():
        for i in range(K1):
            lo, hi = (cuts[i - 1] + 1 if i else 1), (cuts[i + 1] - 1 if i + 1 < K1 else Q - 2)
            for p in range(lo, hi + 1):
                if p != cuts[i]:
                    yield cuts[:i] + [p] + cuts[i + 1:]
        for i in range(K1):  # one stage merged into its neighbour, another one split
            rest = cuts[:i] + cuts[i + 1:]
            for p in range(1, Q - 1):
                if p not in cuts:
                    yield sorted(rest + [p])
        for i in range(K1):
            for j in range(i + 1, K1):
                for d in (*range(-reach, 0), *range(1, reach + 1)):
                    trial = cuts[:i] + [c + d for c in cuts[i:j + 1]] + cuts[j + 1:]
                    if 1 <= trial[0] and trial[-1] <= Q - 2 and all(a < b for a, b in zip(trial, trial[1:])):
                        yield trial

    improved = True
    while improved:
        improved = False
        for trial in moves():
            value = table.objective(tuple(trial))
            if value < best * (1 - 1e-12):
                cuts, best, improved = trial, value, True
                break  # the neighbourhood of the new cut
    return tuple(cuts), best


def _pareto(items: list[tuple]) -> list[tuple]:
    """The items no other beats on all of (sum, max, sync), in order of sum."""
    items.sort(key=lambda x: (x[0], x[1], x[2]))
    kept: list[tuple] = []
    # those kept so far (each of no larger sum) that no other kept one beats on (max, sync): by
    # max ascending, so sync descending; an item is beaten iff the last of them with max <= its
    # max has sync <= its sync
    maxes: list[float] = []
    syncs: list[float] = []
    for it in items:
        i = bisect.bisect_right(maxes, it[1]) - 1
        if i >= 0 and syncs[i] <= it[2]:
            continue
        kept.append(it)
        j = bisect.bisect_left(maxes, it[1])
        end = j
        while end < len(maxes) and syncs[end] >= it[2]:  # beaten on (max, sync) by it now
            end += 1
        maxes[j:end], syncs[j:end] = [it[1]], [it[2]]
    return kept


def brute_force(table: StageTable) -> tuple[tuple[int, ...], float]:
    """Every choice of cuts (tests only: exponential)."""
    K, Q = len(table.groups), len(table.positions)
    best = (None, float("inf"))
    for cuts in itertools.combinations(range(1, Q - 1), K - 1):
        val = table.objective(cuts)
        if val < best[1]:
            best = (tuple(int(table.positions[c]) for c in cuts), val)
    return best


__all__ = ["pivots", "equal_groups", "group_layouts", "device_layouts", "speed_ratios", "StageTable", "exact_partition", "Partition", "polish", "brute_force",
           "stage_of_nodes", "crossings"]
