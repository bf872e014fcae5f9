"""A* program synthesis (HAP Fig. 10) over the Hoare triples of the rule library.

A partial program is the steps for the first k nodes; its properties are the placements
held by the live activation tensors. Appending a step needs every activation input in the
placement the strategy asks for: either already a property, or made by one move (a
collective or a local slice) from a property. Leaf inputs are loaded directly in the needed
placement (parameter-shard / placeholder-shard fused into their consumer: section 4.5,
optimisation 1). Each tensor is communicated forward at most once (optimisation 2), and
properties of tensors with no consumers left are dropped (optimisation 3), so programs
that reach the same properties meet in one table entry.

Instructions are appended in the single-device program's order and moves directly before
the node that needs them: the search space is every assignment of strategies, moves and
collective implementations in that canonical order.

cost(Q)  = stages closed so far (communication + slowest device per stage);
ecost(Q) = for forward and backward separately, the largest over devices of the time it
           must still compute: the open stage plus, for every remaining node, its cheapest
           strategy on that device. This assumes free communication, never exceeds the true
           remainder (a sum of per-stage maxima is at least the maximum of sums), and is not
           zero.
A program Q' is dropped when a program with the same properties costs no more on every
device (line 9 of Fig. 10), and the search stops when the best complete program costs no
more than the lowest score in the queue (line 5).
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..cost.model import CostModel
from ..ir import Graph
from ..placement import Placement, from_code
from ..rules import Strategy
from .moves import Move, moves_between, rebalance
from .program import Load, MoveStep, Step, move_seconds, step_compute

CODE_BITS = 64  # property = tensor id * 64 + placement code


class SearchError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Restriction:
    """Limits the search to a family of programs (for baselines)."""

    name: str
    allow_load: Callable[[str, str, Placement], bool]
    """(tensor kind, tensor name, placement) -> may this leaf be loaded so."""
    allow_move: Callable[[Move], bool] = lambda mv: True


@dataclass(slots=True)
class _Option:
    strategy: Strategy
    reqs: tuple[tuple[int, int], ...]  # (activation tensor id, placement code) needed
    loads: tuple[Load, ...]
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    sync_bytes: float
    outs: tuple[int, ...]  # properties produced


class _State:
    __slots__ = ("k", "props", "comm", "synced", "closed", "fwd", "bwd", "parent", "step", "dead")

    def __init__(self, k, props, comm, synced, closed, fwd, bwd, parent, step):
        self.k, self.props, self.comm, self.synced = k, props, comm, synced
        self.closed, self.fwd, self.bwd = closed, fwd, bwd
        self.parent, self.step, self.dead = parent, step, False


@dataclass(slots=True)
class SearchResult:
    program: list[Step]
    cost: float
    expanded: int
    generated: int
    seconds: float


def synthesize(graph: Graph, strategies: Sequence[Sequence[Strategy]], cost: CostModel, segment_of: Sequence[int],
               ratios: Sequence[Sequence[float]], restriction: Restriction | None = None,
               heuristic: bool = True, max_expansions: int = 5_000_000) -> SearchResult:
    """The cheapest program under `ratios` (per segment) in the canonical-order space."""
    t0 = time.perf_counter()
    m = cost.m
    zero = (0.0,) * m
    nodes = graph.nodes
    n = len(nodes)
    tid = {name: i for i, name in enumerate(t for t in graph.tensors if graph.tensors[t].producer >= 0)}
    needs_grad = {i: graph.tensors[name].requires_grad for name, i in tid.items()}
    names = {i: name for name, i in tid.items()}
    loss_id = tid[graph.loss]
    dead_at = _dead_sets(graph, tid, loss_id)

    # Options per node under the segment's ratios; identical nodes share the computation.
    opts: list[list[_Option]] = []
    for k, node in enumerate(nodes):
        r = ratios[segment_of[k]]
        ok = []
        for st in strategies[k]:
            loads, reqs, allowed = [], [], True
            for name, p in zip(node.inputs, st.inputs):
                t = graph.tensors[name]
                if t.is_leaf:
                    if restriction and not restriction.allow_load(t.kind, name, p):
                        allowed = False
                    loads.append(Load(name, p))
                else:
                    reqs.append((tid[name], p.code))
            if not allowed:
                continue
            loads = tuple(dict.fromkeys(loads))
            fwd, bwd, sync_bytes = step_compute(cost, k, st, loads, r)
            outs = tuple(tid[o] * CODE_BITS + p.code for o, p in zip(node.outputs, st.outputs) if tid[o] not in dead_at[k] or tid[o] == loss_id)
            ok.append(_Option(st, tuple(dict.fromkeys(reqs)), loads, fwd, bwd, sync_bytes, outs))
        if not ok:
            raise SearchError(f"no allowed strategy for node {node.name} ({node.op})" + (f" under {restriction.name}" if restriction else ""))
        opts.append(ok)

    # Admissible heuristic: per device, the cheapest remaining computation.
    suffix_f = [zero] * (n + 1)
    suffix_b = [zero] * (n + 1)
    for k in range(n - 1, -1, -1):
        lf = tuple(min(o.fwd[j] for o in opts[k]) for j in range(m))
        lb = tuple(min(o.bwd[j] for o in opts[k]) for j in range(m))
        suffix_f[k] = tuple(a + b for a, b in zip(suffix_f[k + 1], lf))
        suffix_b[k] = tuple(a + b for a, b in zip(suffix_b[k + 1], lb))
    if not heuristic:
        suffix_f = suffix_b = [zero] * (n + 1)

    seg_start = {k for k in range(1, n) if segment_of[k] != segment_of[k - 1]}
    alpha_sync = cost.grad_sync(1.0) - cost.grad_sync(0.0) if m > 1 else 0.0
    sync_slope = cost.grad_sync(2.0) - cost.grad_sync(1.0) if m > 1 else 0.0
    alpha_sync -= sync_slope

    move_cache: dict[tuple, list] = {}

    def moves_for(t: int, dst: int, seg: int):
        key = (t, dst, seg)
        found = move_cache.get(key)
        if found is None:
            found = []
            dst_p = from_code(dst)
            for src in _codes_for(graph.tensors[names[t]]):
                if src == dst:
                    continue
                for mv in moves_between(from_code(src), dst_p, needs_grad[t]):
                    if restriction and not restriction.allow_move(mv):
                        continue
                    f, b = move_seconds(cost, names[t], mv, ratios[seg], ratios[seg])
                    found.append((src, mv, f, b))
            move_cache[key] = found
        return found

    def h(k, fwd, bwd):
        sf, sb = suffix_f[k], suffix_b[k]
        return max(map(float.__add__, fwd, sf)) + max(map(float.__add__, bwd, sb))

    start = _State(0, frozenset(), frozenset(), False, 0.0, zero, zero, None, None)
    counter = itertools.count()
    queue = [(h(0, zero, zero), next(counter), start)]
    table: dict[tuple, list[_State]] = {}
    best: _State | None = None
    best_cost = float("inf")
    expanded = generated = 0

    while queue:
        score, _, s = heapq.heappop(queue)
        if score >= best_cost:
            break
        if s.dead:
            continue
        k = s.k
        if k == n:
            final = s.closed + max(s.fwd) + max(s.bwd)
            if final < best_cost:
                best, best_cost = s, final
            continue
        expanded += 1
        if expanded > max_expansions:
            raise SearchError(f"search exceeded {max_expansions} expansions at node {k} of {n}")
        seg = segment_of[k]
        props, closed, fwd, bwd = s.props, s.closed, s.fwd, s.bwd
        pre_moves: tuple[MoveStep, ...] = ()
        if k in seg_start:  # re-split every sharded live tensor to the new segment's ratios
            for p in sorted(props):
                if p % CODE_BITS >= 3:
                    name, pl = names[p // CODE_BITS], from_code(p % CODE_BITS)
                    mv = rebalance(pl)
                    f, b = move_seconds(cost, name, mv, ratios[segment_of[k - 1]], ratios[seg])
                    closed += max(fwd) + max(bwd) + f + b
                    fwd = bwd = zero
                    pre_moves += (MoveStep(name, mv),)
        for opt in opts[k]:
            choices = []
            feasible = True
            for t, code in opt.reqs:
                if t * CODE_BITS + code in props:
                    continue
                cand = [c for c in moves_for(t, code, seg) if t * CODE_BITS + c[0] in props
                        and not (c[1].fwd is not None and t in s.comm)]
                if not cand:
                    feasible = False
                    break
                choices.append([(t, c) for c in cand])
            if not feasible:
                continue
            for combo in itertools.product(*choices) if choices else ((),):
                c_closed, c_fwd, c_bwd = closed, fwd, bwd
                new_props = set(props)
                comm = s.comm
                steps = list(pre_moves)
                for t, (src, mv, f, b) in combo:
                    if mv.communicates:
                        c_closed += max(c_fwd) + max(c_bwd) + f + b
                        c_fwd = c_bwd = zero
                    if mv.fwd is not None:
                        comm = comm | {t}
                    new_props.add(t * CODE_BITS + mv.dst.code)
                    steps.append(MoveStep(names[t], mv))
                c_fwd = tuple(map(float.__add__, c_fwd, opt.fwd))
                c_bwd = tuple(map(float.__add__, c_bwd, opt.bwd))
                synced = s.synced
                if opt.sync_bytes:
                    c_closed += opt.sync_bytes * sync_slope
                    if not synced:
                        c_closed += alpha_sync
                        synced = True
                new_props.update(opt.outs)
                dead = dead_at[k]
                if dead:
                    new_props = {p for p in new_props if p // CODE_BITS not in dead}
                    comm = comm - dead
                child = _State(k + 1, frozenset(new_props), comm, synced, c_closed, c_fwd, c_bwd, s,
                               Step(k, opt.strategy, opt.loads, tuple(steps)))
                generated += 1
                if _dominated_or_insert(table, child):
                    continue
                score = c_closed + h(k + 1, c_fwd, c_bwd)
                if score < best_cost:
                    heapq.heappush(queue, (score, next(counter), child))

    if best is None:
        raise SearchError("no complete program found")
    program = []
    s = best
    while s.parent is not None:
        program.append(s.step)
        s = s.parent
    program.reverse()
    return SearchResult(program, best_cost, expanded, generated, time.perf_counter() - t0)


def _dominated_or_insert(table: dict, child: _State) -> bool:
    """Fig. 10 lines 9-14: drop the child if a program with at least its properties (and no more
    tensors communicated) costs no more; drop queued programs the child so dominates."""
    # Only programs holding the same live tensors are compared (any of their placements).
    key = (child.k, child.synced, frozenset(p // CODE_BITS for p in child.props))
    entries = table.get(key)
    if entries is None:
        table[key] = [child]
        return False
    props, comm = child.props, child.comm
    c_fwd, c_bwd, c_closed = child.fwd, child.bwd, child.closed
    c_total = c_closed + max(c_fwd) + max(c_bwd)
    keep = []
    for e in entries:
        if e.dead:
            continue
        if props <= e.props and e.comm <= comm and _cheaper(e, c_closed, c_fwd, c_bwd):
            return True
        if e.props <= props and comm <= e.comm and (
                (c_closed <= e.closed and all(map(float.__le__, c_fwd, e.fwd)) and all(map(float.__le__, c_bwd, e.bwd)))
                or c_total <= e.closed):
            e.dead = True
        else:
            keep.append(e)
    keep.append(child)
    table[key] = keep
    return False


def _cheaper(e: _State, closed: float, fwd, bwd) -> bool:
    """e costs no more than (closed, fwd, bwd) for every continuation."""
    if e.closed + max(e.fwd) + max(e.bwd) <= closed:
        return True
    return e.closed <= closed and all(map(float.__le__, e.fwd, fwd)) and all(map(float.__le__, e.bwd, bwd))


def _dead_sets(graph: Graph, tid: dict[str, int], loss_id: int) -> list[frozenset[int]]:
    dead: list[set[int]] = [set() for _ in graph.nodes]
    for name, i in tid.items():
        t = graph.tensors[name]
        if i == loss_id:
            continue
        last = max(t.consumers) if t.consumers else t.producer
        dead[last].add(i)
    return [frozenset(d) for d in dead]


def _codes_for(t) -> range:
    return range(3 + len(t.shape))
