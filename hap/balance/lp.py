"""Load balancing: the sharding ratios that minimise a fixed program's time (HAP section 5).

The LP is the program's one pricing walk (search/program.walk) run on linear expressions
instead of numbers. Shares are the variables B[s][j] (segment s, device j, each row summing to
1), and each maximum the walk takes becomes an epigraph variable:
    T    >= every device's forward (backward) computation of a stage
    M_s  >= B[s][j] for every j        (collectives are priced by the largest share)
    Z    >= M_a, M_b                    (a rebalance between segments a and b)
    X    >= 0 and every bucket's excess over the backward (overlapped gradient sync)
minimise  the walk's total (stages, collectives, X)  subject to  memory_j(B) <= capacity_j.
Minimising makes every epigraph variable tight where it matters, so the optimum's objective
is the walk's price of the optimal ratios (tests/test_pricing.py checks it against replay).

A device with no share of a node pays only the executor's bookkeeping for it (CostModel.
fixed_times), which is not linear in its share: the LP is solved for a pattern of idle
devices, first none; when devices come out idle, again with them fixed idle, until the pattern
repeats. The LP sees continuous shares; the plan's integer shard sizes are rounded afterwards
(section 5.1) and the plan is re-priced exactly. An infeasible or failed LP raises
BalanceError naming the cause, never returns a guess.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from ..cost.model import CostModel
from ..ir import size_text
from . import _highs
from ..search.program import Step, memory_terms, synced_params, walk


class BalanceError(ValueError):
    """The ratios LP has no solution; the message says why."""


@dataclass(slots=True)
class BalanceResult:
    ratios: list[list[float]]
    """ratios[segment][device], each row summing to 1."""
    objective: float
    """The LP's iteration time in seconds at `ratios` (continuous shares): the walk's price."""
    status: Literal["optimal"]
    message: str
    idle: list[tuple[int, int]]
    """(segment, device) pairs the final LP held idle (share 0)."""


class Lin:
    """A linear expression: sum of coefficient * variable, plus a constant."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: dict[int, float] | None = None, const: float = 0.0):
        self.terms, self.const = terms or {}, const

    def __add__(self, other):
        if isinstance(other, Lin):
            if not other.terms:
                return Lin(self.terms, self.const + other.const)
            terms = dict(self.terms)
            for v, c in other.terms.items():
                terms[v] = terms.get(v, 0.0) + c
            return Lin(terms, self.const + other.const)
        return self if other == 0 else Lin(self.terms, self.const + other)

    __radd__ = __add__

    def __mul__(self, k: float):
        return Lin({v: c * k for v, c in self.terms.items()}, self.const * k)

    __rmul__ = __mul__

    def __neg__(self):
        return self * -1.0

    def __sub__(self, other):
        return self + (-other)


class _Program:
    """Variables, objective and constraints `row . x <= rhs` of an LP in the making; a row
    stated twice (interchangeable devices state each of theirs alike) is kept once, at its
    tightest right-hand side."""

    def __init__(self):
        self.n = 0
        self.rows: list[dict[int, float]] = []
        self.rhs: list[float] = []
        self.fixed_zero: set[int] = set()
        self._row_index: dict[frozenset, int] = {}

    def var(self) -> int:
        self.n += 1
        return self.n - 1

    def at_least(self, v: int, value) -> None:
        """x_v >= value (a number or a Lin)."""
        if isinstance(value, Lin):  # value.terms . x - x_v <= -value.const
            row = dict(value.terms)
            row[v] = row.get(v, 0.0) - 1.0
            self.le(row, -value.const)
        else:
            self.le({v: -1.0}, -value)

    def le(self, row: dict[int, float], rhs: float) -> None:
        key = frozenset(row.items())
        i = self._row_index.get(key)
        if i is not None:
            self.rhs[i] = min(self.rhs[i], rhs)
            return
        self._row_index[key] = len(self.rows)
        self.rows.append(row)
        self.rhs.append(rhs)


class LPShares:
    """The walk's algebra for the LP: shares are variables, maxima epigraph variables.

    Interchangeable devices (equal `device_key`s, equal capacities, idle alike) share one
    share variable: the LP is symmetric under swapping their shares and convex, so the average
    of an optimum over those swaps is an optimum too, and one with equal shares exists. Their
    constraints then coincide and the LP keeps each once. The walk prices one device of each
    such set alone (`columns`): the others' expressions are the same."""

    def __init__(self, lp: _Program, m: int, segments: int, idle: set[tuple[int, int]], keys: Sequence[tuple],
                 memo: dict | None = None):
        self.lp, self.m, self.idle = lp, m, idle
        self.B = []  # B[s][j]: the variable of device j's share in segment s
        for s in range(segments):
            var_of: dict[tuple, int] = {}
            row = []
            for j in range(m):
                key = (keys[j], (s, j) in idle)
                if key not in var_of:
                    var_of[key] = lp.var()
                row.append(var_of[key])
            self.B.append(row)
        self.columns = sorted({tuple(row[j] for row in self.B): j for j in reversed(range(m))}.values())
        """The first device of every interchangeable set (one share variable in every segment), in device order."""
        self.M = [lp.var() for _ in range(segments)]
        for s in range(segments):
            for j in range(m):
                lp.le({self.B[s][j]: 1.0, self.M[s]: -1.0}, 0.0)
                if (s, j) in idle:
                    lp.fixed_zero.add(self.B[s][j])
        self._shares = [[Lin({b: 1.0}) for b in row] for row in self.B]
        self._pairs: dict[tuple[int, int], Lin] = {}
        # node_times of alike nodes (expressions are never changed in place). Node prices read the
        # share variables alone, numbered alike in every LP of one layout (segments, idle devices,
        # device keys): the LPs of one `memo` (the planner's, one cost model's) share them.
        layout = (segments, frozenset(idle), tuple(keys))
        self.priced: dict[tuple, tuple] = {} if memo is None else memo.setdefault(layout, {})

    def of(self, tensor: str, dim: int, seg: int) -> list[Lin]:
        return self._shares[seg]

    def active(self, tensor: str, dim: int, seg: int) -> tuple[bool, ...]:
        return tuple((seg, j) not in self.idle for j in range(self.m))

    def live(self, tensor: str, dim: int, seg: int) -> int:
        return sum(self.active(tensor, dim, seg))

    def same_split(self, tensor: str, dim: int, seg_a: int, seg_b: int) -> bool:
        """Segments' shares are separate variables: a rebalance between them is priced as if
        they differed (an upper bound where the LP makes them equal)."""
        return seg_a == seg_b

    def largest(self, sharded) -> Lin:
        segs = sorted({s for _, _, s in sharded})
        if len(segs) == 1:
            return Lin({self.M[segs[0]]: 1.0})
        key = (segs[0], segs[-1])
        if key not in self._pairs:
            z = self.lp.var()
            for s in segs:
                self.lp.at_least(z, Lin({self.M[s]: 1.0}))
            self._pairs[key] = Lin({z: 1.0})
        return self._pairs[key]

    def vmax(self, values) -> Lin | float:
        if not any(isinstance(v, Lin) for v in values):
            return max(values)
        t = self.lp.var()
        for v in values:
            self.lp.at_least(t, v)
        return Lin({t: 1.0})

    def positive_part(self, values) -> Lin:
        x = self.lp.var()  # variables are non-negative
        for v in values:
            self.lp.at_least(x, v)
        return Lin({x: 1.0})


def balance(program: Sequence[Step], cost: CostModel, segment_of: Sequence[int], segments: int,
            memory_limit: Sequence[float] | None = None, facts: tuple[list, dict] | None = None,
            memo: dict | None = None) -> BalanceResult:
    """Optimal ratios per segment for `program`; memory_limit defaults to each GPU's memory.
    facts: the program's (memory_terms, synced_params), where the caller has them (astar.Frame.facts);
    memo: a dict the caller keeps for every LP of one cost model, which then share node prices."""
    caps = list(memory_limit) if memory_limit is not None else [d.memory for d in cost.cluster.devices]
    facts = facts or (memory_terms(program, cost, segment_of), synced_params(program, cost.graph, segment_of))
    idle: set[tuple[int, int]] = set()
    for _ in range(cost.m * segments + 1):
        result = _solve(program, cost, segment_of, segments, caps, idle, facts, memo)
        now = {(s, j) for s, row in enumerate(result.ratios) for j, x in enumerate(row) if x == 0.0}
        if now <= idle:
            return result
        idle = now  # price those devices idle, as replay does, and solve again
    return result


def _solve(program, cost: CostModel, segment_of, segments: int, caps: list[float], idle,
           facts: tuple[list, dict] | None = None, memo: dict | None = None) -> BalanceResult:
    facts = facts or (memory_terms(program, cost, segment_of), synced_params(program, cost.graph, segment_of))
    m = cost.m
    lp = _Program()
    alg = LPShares(lp, m, segments, idle, [(cost.device_key(j), caps[j]) for j in range(m)], memo)
    objective = walk(program, cost, segment_of, alg, facts[1]).total + cost.step_overhead
    if not isinstance(objective, Lin):
        objective = Lin({}, objective)
    _memory_rows(lp, alg.B, facts[0], cost, caps, alg.columns)

    c = np.zeros(lp.n)
    for v, k in objective.terms.items():
        c[v] += k
    # rows: the inequalities, then one "shares sum to 1" equality per segment
    rows = lp.rows + [dict(Counter(alg.B[s])) for s in range(segments)]
    lower = [-math.inf] * len(lp.rows) + [1.0] * segments
    upper = lp.rhs + [1.0] * segments
    col_upper = [0.0 if v in lp.fixed_zero else math.inf for v in range(lp.n)]
    status, x, value, words = _highs.solve(c, rows, lower, upper, col_upper)
    if status == "infeasible":
        raise BalanceError("out of memory: no sharding ratios fit this program in the devices' memory "
                           f"({', '.join(size_text(c) for c in caps)})")
    if status != "optimal":
        raise BalanceError(f"ratio LP failed (HiGHS: {words})")
    ratios = []
    for s in range(segments):
        row = [max(0.0, x[v]) for v in alg.B[s]]
        row = [x if x > 1e-9 else 0.0 for x in row]
        total = sum(row)
        ratios.append([x / total for x in row])
    return BalanceResult(ratios=ratios, objective=value + objective.const, status="optimal",
                         message=words, idle=sorted(idle))


def _memory_rows(lp: _Program, B, terms: list, cost: CostModel, caps: list[float], columns: Sequence[int]) -> None:
    """memory_j(B) <= capacity_j, from the program's memory_terms (what `program.memory` sums),
    for the devices `columns` (LPShares.columns: an interchangeable device's row is the same)."""
    mem_rows: dict[int, dict[int, float]] = {j: {} for j in columns}
    mem_const = dict.fromkeys(columns, 0.0)
    for name, p, seg, nbytes, whole in terms:
        for j in columns:
            a = nbytes / (1 if whole else cost.gpus(j))
            if p is not None and p.is_shard:
                mem_rows[j][B[seg][j]] = mem_rows[j].get(B[seg][j], 0.0) + a
            else:
                mem_const[j] += a
    for j in columns:
        if mem_const[j] > caps[j]:
            dev = cost.cluster.devices[j]
            raise BalanceError(f"out of memory: device {j} ({dev.name}) needs {size_text(mem_const[j])} for the "
                               f"replicated part of this program alone but has {size_text(caps[j])}")
        if mem_rows[j]:
            lp.le(mem_rows[j], caps[j] - mem_const[j])
