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
A program Q' is dropped when a program with at least its properties costs no more for any
continuation (line 9 of Fig. 10), and the search stops when the best complete program costs
no more than the lowest score in the queue (line 5).

With layer cuts (`synthesize(cuts=...)`, what the planner uses) ecost also counts, for each
chunk between cuts still ahead, a lower bound on that chunk's cost; an optional width caps
the programs expanded per node once an exhaustive budget is spent (the result then says
whether the cap dropped any).
"""

from __future__ import annotations

import bisect
import gc
import heapq
import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..cost.model import CostModel
from ..ir import Graph, chunk_cuts  # noqa: F401  (chunk_cuts: part of this module's interface)
from ..placement import D, P, R, Placement, from_code
from ..rules import Strategy
from .moves import Move, moves_between, rebalance
from .program import Load, MoveStep, NumericShares, Step, move_price, node_times

CODE_BITS = 64  # property = tensor id * 64 + placement code
R_CODE = R.code
MAX_CODES = 3 + 8  # R, D, P and S(0..7): a superset of any tensor's placements is harmless in `_reach`
BOUND_EXPANSIONS_PER_NODE = 50  # budget of a chunk's lower-bound search



class SearchError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Restriction:
    """Limits the search to a family of programs (for baselines)."""

    name: str
    allow_load: Callable[[str, str, Placement], bool]
    """(tensor kind, tensor name, placement) -> may this leaf be loaded so."""
    allow_move: Callable[[Move], bool] = lambda mv: True
    """May this move be used. Moves that communicate in neither pass must stay allowed: the
    dominance test counts on R turning into D, P or a shard for free."""


@dataclass(slots=True)
class _Option:
    strategy: Strategy
    reqs: tuple[tuple[int, int], ...]  # (activation tensor id, placement code) needed
    loads: tuple[Load, ...]
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    sync_bytes: float  # gradient bytes this node makes the runtime all-reduce (first use of a parameter kept whole)
    outs: tuple[int, ...]  # properties produced
    inner: float = 0.0  # seconds of the collectives the strategy makes inside the node (a stage boundary)
    keeps: tuple = ()  # (parameter id, placement code, segment): a shared parameter first loaded sharded
    uses: tuple = ()  # (parameter id, placement code or -1 for several, segment): a later use of a shared parameter


class _Sync:
    """The walk's gradient-sync bookkeeping (search/program.walk) in a search state: backward
    seconds of closed stages (P) and of the open stage's opening collectives (C), the current
    chunk's anchor -(P + C) and bucket bytes, the seconds of closed buckets, and the largest
    excess of a bucket's end over the backward (a shared instance while nothing changes)."""
    __slots__ = ("done", "opening", "anchor", "bucket", "synced", "excess")

    def __init__(self, done=0.0, opening=0.0, anchor=0.0, bucket=0.0, synced=0.0, excess=-math.inf):
        self.done, self.opening, self.anchor, self.bucket, self.synced, self.excess = done, opening, anchor, bucket, synced, excess


class _State:
    __slots__ = ("k", "props", "comm", "shared", "closed", "fwd", "bwd", "sync", "parent", "step", "reach", "key", "bound")

    def __init__(self, k, props, comm, shared, closed, fwd, bwd, sync, parent, step):
        self.k, self.props, self.comm, self.shared = k, props, comm, shared
        self.closed, self.fwd, self.bwd, self.sync = closed, fwd, bwd, sync
        self.parent, self.step, self.reach, self.key, self.bound = parent, step, None, None, None

    @property
    def exposed(self) -> float:
        """Gradient sync seconds the backward cannot hide, as far as the program goes."""
        return self.sync.excess if self.sync is not None and self.sync.excess > 0 else 0.0


@dataclass(slots=True)
class SearchResult:
    program: list[Step]
    cost: float
    expanded: int
    generated: int
    seconds: float
    exhaustive: bool = True
    """False when the width limit dropped a program: `cost` is then not proven optimal."""


def synthesize(graph: Graph, strategies: Sequence[Sequence[Strategy]], cost: CostModel, segment_of: Sequence[int],
               ratios: Sequence[Sequence[float]], restriction: Restriction | None = None,
               heuristic: bool = True, layer_bounds: bool = False,
               max_expansions: int = 5_000_000, width: int | None = None,
               width_after: float = 0.0, frame: Frame | None = None) -> SearchResult:
    """The cheapest program under `ratios` (per segment) in the canonical-order space.

    Programs are priced as `program.walk` prices them: stages end at communication and at
    layer boundaries (cost.chunk_of), so the costs of the chunks between boundaries add up.
    layer_bounds=True: the heuristic gains, for every chunk still ahead, the cost of that
    chunk's best program from the most favourable entry state (every placement of its inputs
    at hand): a lower bound that already counts the communication each layer cannot avoid.
    Identical chunks (transformer layers) share that bound, found once by the same A*.
    Without it, a chunk ahead is bounded by its cheapest computation alone.

    width=None keeps the search exhaustive (a proven optimum); an int caps the programs
    expanded per node index (see `_astar`) once the search has expanded `width_after` programs
    per node of the graph, and the result says whether the cap dropped any.
    """
    t0 = time.perf_counter()
    # The search allocates many small acyclic objects; with a large captured graph alive, the
    # cyclic collector's full passes would cost more than the search itself.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        space = _Space(graph, strategies, cost, segment_of, ratios, restriction, heuristic, layer_bounds, frame)
        start = _State(0, frozenset(), frozenset(), frozenset(), 0.0, space.zero, space.zero, _Sync(), None, None)
        best, best_cost = _astar(space, start, space.n, True, max_expansions, width, int(width_after * space.n))
    finally:
        if gc_was_enabled:
            gc.enable()
    # the step's own collectives but the gradients' (the loss's all-reduce, the generator's
    # broadcast) cost every program alike: the search leaves them out, the total has them
    total = best_cost + cost.step_overhead
    return SearchResult(_steps_to(space, best, start), total, space.expanded, space.generated,
                        time.perf_counter() - t0, space.exhaustive)


class Frame:
    """What every search of one graph shares, whatever the ratios: tensor ids, when tensors
    die, and per node and strategy its leaf loads, required placements and produced
    properties. The planner builds one and passes it to each of its searches."""

    def __init__(self, graph: Graph, strategies: Sequence[Sequence[Strategy]], cost: CostModel, segment_of: Sequence[int]):
        self.graph, self.strategies, self.segment_of = graph, strategies, list(segment_of)
        self.tid = tid = {name: i for i, name in enumerate(t for t in graph.tensors if graph.tensors[t].producer >= 0)}
        self.needs_grad = {i: graph.tensors[name].requires_grad for name, i in tid.items()}
        self.names = {i: name for name, i in tid.items()}
        self.loss_id = tid[graph.loss]
        self.dead_at = dead_at = _dead_sets(graph, tid, self.loss_id)
        # Trainable parameters used by several nodes: the search keeps their later loads in the
        # placement of the first (or the first whole), so that whether the runtime syncs them
        # is known at their first use, where their gradient bucket is (program.synced_params).
        self.shared = {name: i for i, name in enumerate(
            name for name, t in graph.tensors.items() if t.kind == "param" and t.requires_grad and len(t.consumers) > 1)}
        self.shared_done = [frozenset(i for name, i in self.shared.items() if graph.tensors[name].consumers[-1] == k)
                            for k in range(len(graph.nodes))]
        self.sync_rest = _sync_rest(cost)
        self.alike, self.choices = [], []
        for k, node in enumerate(graph.nodes):
            # Nodes alike in op, work and tensors (every layer's) are priced once per search.
            self.alike.append((id(strategies[k]), node.flops, node.bwd_flops, node.bytes_moved, segment_of[k],
                               tuple((graph.tensors[x].kind, graph.tensors[x].requires_grad, graph.tensors[x].nbytes,
                                      cost.granules(x)) for x in node.inputs),
                               tuple(cost.granules(x) for x in node.outputs)))
            choices = []
            for st in strategies[k]:
                loads, reqs = [], []
                for name, p in zip(node.inputs, st.inputs):
                    if graph.tensors[name].is_leaf:
                        loads.append(Load(name, p))
                    else:
                        reqs.append((tid[name], p.code))
                outs = tuple(tid[o] * CODE_BITS + p.code for o, p in zip(node.outputs, st.outputs)
                             if tid[o] not in dead_at[k] or tid[o] == self.loss_id)
                loads = tuple(dict.fromkeys(loads))
                choices.append((st, loads, tuple(dict.fromkeys(reqs)), outs, self._sync_choice(k, loads)))
            self.choices.append(choices)


    def _sync_choice(self, k: int, loads: Sequence[Load]) -> tuple[float, tuple, tuple]:
        """(bytes synced from here, shared parameters first loaded sharded, later uses of
        shared parameters) for a node's loads: the `kept_placements` rule, decided at first use."""
        graph, seg = self.graph, self.segment_of[k]
        places: dict[str, list[Placement]] = {}
        for ld in loads:
            t = graph.tensors[ld.tensor]
            if t.kind == "param" and t.requires_grad:
                places.setdefault(ld.tensor, []).append(ld.placement)
        sync, keeps, uses = 0.0, [], []
        for name, ps in places.items():
            t = graph.tensors[name]
            if t.consumers[0] == k:
                if len(ps) > 1 or ps[0].kind in ("R", "P"):
                    sync += t.nbytes
                elif name in self.shared:
                    keeps.append((self.shared[name], ps[0].code, seg))
            else:
                uses.append((self.shared[name], ps[0].code if len(ps) == 1 else -1, seg))
        return sync, tuple(keeps), tuple(uses)


class _Space:
    """The search space: options per node under the ratios, moves, heuristic, and expansion."""

    def __init__(self, graph, strategies, cost, segment_of, ratios, restriction, heuristic, layer_bounds, frame=None):
        self.graph, self.cost, self.segment_of, self.ratios, self.restriction = graph, cost, segment_of, ratios, restriction
        self.m = m = cost.m
        self.zero = (0.0,) * m
        nodes = graph.nodes
        self.n = n = len(nodes)
        frame = frame or Frame(graph, strategies, cost, segment_of)
        assert frame.graph is graph and frame.strategies is strategies and frame.segment_of == list(segment_of)
        self.tid, self.needs_grad, self.names = frame.tid, frame.needs_grad, frame.names
        self.loss_id, self.dead_at, self.shared_done = frame.loss_id, frame.dead_at, frame.shared_done
        self.alg = alg = NumericShares(cost, ratios)
        self.expanded = self.generated = 0
        self.exhaustive = True

        # Options per node under the segment's ratios; alike nodes (every layer's) share the pricing.
        self.opts = opts = []
        priced: dict[tuple, tuple] = {}
        for k, node in enumerate(nodes):
            alike = frame.alike[k]
            ok = []
            for i, (st, loads, reqs, outs, (sync_bytes, keeps, uses)) in enumerate(frame.choices[k]):
                if restriction and not all(restriction.allow_load(graph.tensors[ld.tensor].kind, ld.tensor, ld.placement)
                                           for ld in loads):
                    continue
                found = priced.get((alike, i))
                if found is None:
                    fwd, bwd = node_times(cost, alg, k, st, loads, segment_of[k])
                    found = priced[(alike, i)] = (tuple(fwd), tuple(bwd))
                ok.append(_Option(st, reqs, loads, found[0], found[1], sync_bytes, outs, cost.variant_comm(node, st),
                                  keeps, uses))
            if not ok:
                raise SearchError(f"no allowed strategy for node {node.name} ({node.op})" + (f" under {restriction.name}" if restriction else ""))
            opts.append(ok)

        self.seg_start = {k for k in range(1, n) if segment_of[k] != segment_of[k - 1]}
        chunk, bucket = cost.chunk_of, cost.bucket_of
        self.bucket_end = [k + 1 == n or bucket[k + 1] != bucket[k] for k in range(n)]
        self.sync_slope, self.sync_alpha, self.sync_rest = cost.sync_slope, cost.sync_alpha, frame.sync_rest
        self._moves: dict[tuple, list] = {}
        if restriction:
            for dst in (D, P, Placement("S", 0)):
                for mv in moves_between(R, dst, True):
                    if not restriction.allow_move(mv):
                        raise ValueError(f"restriction {restriction.name!r} forbids the free move {mv.name} (R -> {dst})")
        self.cut_set = frozenset(k for k in range(1, n) if chunk[k] != chunk[k - 1])
        self._heuristic(heuristic, layer_bounds)

    def _heuristic(self, enabled: bool, layer_bounds: bool) -> None:
        """h(state at k) = open stage plus, per device, the cheapest computation left in the
        chunk (max over devices, forward and backward apart), plus the lower bound of every
        later chunk (its cheapest computation, or with layer_bounds its searched bound). At a
        chunk's start the open stage is empty and the chunk's own searched bound is used
        instead of its computation alone."""
        n, zero, opts = self.n, self.zero, self.opts
        self.suffix_f = suffix_f = [zero] * (n + 1)
        self.suffix_b = suffix_b = [zero] * (n + 1)
        self.future = future = [0.0] * (n + 1)
        if not enabled:
            return
        for k in range(n - 1, -1, -1):
            lf = tuple(map(min, *(o.fwd for o in opts[k]))) if len(opts[k]) > 1 else opts[k][0].fwd
            lb = tuple(map(min, *(o.bwd for o in opts[k]))) if len(opts[k]) > 1 else opts[k][0].bwd
            rest_f, rest_b = (zero, zero) if k + 1 in self.cut_set else (suffix_f[k + 1], suffix_b[k + 1])
            suffix_f[k] = tuple(map(float.__add__, rest_f, lf))
            suffix_b[k] = tuple(map(float.__add__, rest_b, lb))
        if not self.cut_set:
            return
        bounds = [0] + sorted(self.cut_set) + [n]
        live = _live_lists(self, bounds) if layer_bounds else {}
        lower: dict[tuple, float] = {}
        after = 0.0
        for lo, hi in reversed(list(zip(bounds, bounds[1:]))):
            for k in range(lo + 1, hi):
                future[k] = after
            if lo in self.seg_start or not layer_bounds:
                # Entering a segment re-splits every sharded live placement: with all of them at
                # hand the bound would pay for rebalances no real entry makes. Computation only.
                future[lo] = after
                after += max(suffix_f[lo]) + max(suffix_b[lo])
                continue
            key = _chunk_key(self, lo, hi, live)
            if key not in lower:
                lower[key] = self._chunk_bound(lo, hi, live[lo])
            after += lower[key]
            future[lo] = after
            suffix_f[lo] = suffix_b[lo] = zero  # a chunk start's state has no open stage

    def _chunk_bound(self, lo: int, hi: int, live_in: list[int]) -> float:
        """Cost of chunk [lo, hi) from the best conceivable entry: every placement of every live
        input at hand, none communicated yet, gradient sync already started. More properties
        never hurt (a move or strategy possible with fewer stays possible), so no real entry
        state does better."""
        props = frozenset(t * CODE_BITS + c for t in live_in for c in _codes_for(self.graph.tensors[self.names[t]]))
        start = _State(lo, props, frozenset(), frozenset(), 0.0, self.zero, self.zero, None, None, None)  # sync unpriced
        try:
            found = _astar(self, start, hi, False, BOUND_EXPANSIONS_PER_NODE * (hi - lo))
        except SearchError:  # too wide to bound cheaply: fall back to its computation alone
            return max(self.suffix_f[lo]) + max(self.suffix_b[lo])
        return found[1] if found else float("inf")


    def moves_for(self, t: int, dst: int, seg: int):
        """(src code, move, fwd s, bwd s) for every move making placement `dst` of tensor t."""
        key = (t, dst, seg)
        found = self._moves.get(key)
        if found is None:
            # Tensors alike in bytes, gradient and split granules (every layer's) share the work.
            name = self.names[t]
            tensor = self.graph.tensors[name]
            alike = (tensor.nbytes, self.needs_grad[t], self.cost.granules(name), dst, seg)
            found = self._moves.get(alike)
            if found is None:
                found = self._moves[alike] = self._new_moves(name, dst, seg)
            self._moves[key] = found
        return found

    def _new_moves(self, name: str, dst: int, seg: int) -> list:
        found = []
        dst_p = from_code(dst)
        for src in _codes_for(self.graph.tensors[name]):
            if src == dst:
                continue
            for mv in moves_between(from_code(src), dst_p, self.graph.tensors[name].requires_grad):
                if self.restriction and not self.restriction.allow_move(mv):
                    continue
                f, b = move_price(self.cost, self.alg, name, mv, seg, seg)
                found.append((src, mv, f, b))
        return found

    def h(self, k, fwd, bwd, with_future: bool = True) -> float:
        sf, sb = self.suffix_f[k], self.suffix_b[k]
        rest = max(map(float.__add__, fwd, sf)) + max(map(float.__add__, bwd, sb))
        return rest + self.future[k] if with_future else rest

    def expand(self, s: _State, emit: Callable[[_State], None]) -> None:
        """Every child of s: a strategy for node s.k, with the moves its inputs need. Stages
        and gradient buckets are assembled exactly as `program.walk` does."""
        self.expanded += 1
        k = s.k
        seg = self.segment_of[k]
        props, closed, fwd, bwd, sync = s.props, s.closed, s.fwd, s.bwd, s.sync
        zero, names = self.zero, self.names
        done, opening = (sync.done, sync.opening) if sync is not None else (0.0, 0.0)
        pre_moves: tuple[MoveStep, ...] = ()
        if k in self.seg_start:  # re-split every sharded live tensor to the new segment's ratios
            for p in sorted(props):
                if p % CODE_BITS >= 3:
                    name, pl = names[p // CODE_BITS], from_code(p % CODE_BITS)
                    mv = rebalance(pl)
                    f, b = move_price(self.cost, self.alg, name, mv, self.segment_of[k - 1], seg)
                    slowest = max(bwd)
                    closed += max(fwd) + slowest + f + b
                    done, opening = done + slowest + opening, b
                    fwd = bwd = zero
                    pre_moves += (MoveStep(name, mv),)
        dead = self.dead_at[k]
        cut = k + 1 in self.cut_set
        bucket_end = self.bucket_end[k]
        for opt in self.opts[k]:
            shared = s.shared
            if sync is not None and (opt.uses or opt.keeps):
                if not _shared_ok(shared, opt.uses):
                    continue
                shared = shared.union(opt.keeps) if opt.keeps else shared
                if self.shared_done[k]:
                    shared = frozenset(e for e in shared if e[0] not in self.shared_done[k])
            choices = []
            feasible = True
            for t, code in opt.reqs:
                if t * CODE_BITS + code in props:
                    continue
                cand = [(t, c) for c in self.moves_for(t, code, seg) if t * CODE_BITS + c[0] in props
                        and not (c[1].fwd is not None and t in s.comm)]
                if not cand:
                    feasible = False
                    break
                choices.append(cand)
            if not feasible:
                continue
            outs = opt.outs
            for combo in itertools.product(*choices) if choices else ((),):
                c_closed, c_fwd, c_bwd, c_done, c_opening = closed, fwd, bwd, done, opening
                comm = s.comm
                if combo:
                    new_props = set(props)
                    for t, (src, mv, f, b) in combo:
                        if mv.communicates:
                            slowest = max(c_bwd)
                            c_closed += max(c_fwd) + slowest + f + b
                            c_done, c_opening = c_done + slowest + c_opening, b
                            c_fwd = c_bwd = zero
                        if mv.fwd is not None:
                            comm = comm | {t}
                        new_props.add(t * CODE_BITS + mv.dst.code)
                    new_props.update(outs)
                else:
                    new_props = props.union(outs)
                if opt.inner:  # the node synchronizes the devices itself
                    slowest = max(c_bwd)
                    c_closed += max(c_fwd) + slowest + opt.inner
                    c_done, c_opening = c_done + slowest + c_opening, opt.inner
                    c_fwd = c_bwd = zero
                c_fwd = tuple(map(float.__add__, c_fwd, opt.fwd))
                c_bwd = tuple(map(float.__add__, c_bwd, opt.bwd))
                if dead:
                    new_props = frozenset(p for p in new_props if p // CODE_BITS not in dead)
                    comm = comm - dead
                elif combo:
                    new_props = frozenset(new_props)
                if cut:  # the stage ends at the layer boundary
                    slowest = max(c_bwd)
                    c_closed += max(c_fwd) + slowest
                    c_done, c_opening = c_done + slowest + c_opening, 0.0
                    c_fwd = c_bwd = zero
                c_sync = sync
                if sync is not None and (opt.sync_bytes or bucket_end or c_done != sync.done or c_opening != sync.opening):
                    c_sync = _Sync(c_done, c_opening, sync.anchor, sync.bucket + opt.sync_bytes, sync.synced, sync.excess)
                    if bucket_end:  # the bucket is complete; the next one begins
                        if c_sync.bucket:
                            c_sync.synced += self.cost.grad_sync(c_sync.bucket)
                            c_sync.excess = max(c_sync.excess, c_sync.synced + c_sync.anchor)
                            c_sync.bucket = 0.0
                        c_sync.anchor = -(c_done + c_opening)
                self.generated += 1
                # The Step is built only for the programs returned (see `step_of`).
                emit(_State(k + 1, new_props, comm, shared, c_closed, c_fwd, c_bwd, c_sync, s, (opt, combo, pre_moves)))

    def step_of(self, s: _State) -> Step:
        """The instruction that made s from its parent."""
        opt, combo, pre_moves = s.step
        moves = pre_moves + tuple(MoveStep(self.names[t], mv) for t, (src, mv, f, b) in combo)
        return Step(s.k - 1, opt.strategy, opt.loads, moves)


def _astar(space: _Space, start: _State, goal: int, with_future: bool, max_expansions: int, width: int | None = None,
           width_after: int = 0):
    """Fig. 10 from `start` to node `goal`: best-first on cost + heuristic, dominance pruning,
    stop when no score can beat the best complete program. Returns (state, cost) or None.

    The dominance table holds expanded programs only: a program is checked against it when
    generated and again when popped (something expanded meanwhile may dominate it), so the
    many programs generated but never expanded cost no comparisons.

    width: expand at most this many programs per node index. Where many small tensors each
    have several near-equally cheap placements (MoE routing masks), the programs below the
    optimum's score multiply; the width keeps the search linear there. A search that drops
    a program for width sets space.exhaustive = False, and the result is then only the best
    program found, not a proven optimum. The cap applies only after `width_after` expansions,
    so searches that finish within them stay exhaustive."""
    per_node = [0] * (space.n + 1)
    counter = itertools.count()
    h = space.h
    queue = [(start.closed + start.exposed + h(start.k, start.fwd, start.bwd, with_future), -start.k, next(counter), start)]
    table: dict[tuple, list[_State]] = {}
    best: _State | None = None
    best_cost = float("inf")
    limit = space.expanded + max_expansions
    width_from = space.expanded + width_after

    def push(child: _State) -> None:
        score = child.closed + child.exposed + h(child.k, child.fwd, child.bwd, with_future)
        if score < best_cost and not _dominated(space, table, child):  # deeper first among equal scores
            heapq.heappush(queue, (score, -child.k, next(counter), child))

    while queue:
        score, _, _, s = heapq.heappop(queue)
        if score >= best_cost:
            break
        if s.k == goal:
            final = s.closed + max(s.fwd) + max(s.bwd) + s.exposed
            if final < best_cost:
                best, best_cost = s, final
            continue
        if _dominated(space, table, s):
            continue
        if width is not None:
            if per_node[s.k] >= width and space.expanded >= width_from:
                space.exhaustive = False
                continue
            per_node[s.k] += 1
        _insert(space, table, s)
        if space.expanded >= limit:
            raise SearchError(f"search exceeded {max_expansions} expansions at node {s.k} of {space.n}")
        space.expand(s, push)
    if best is None:
        if with_future:
            raise SearchError("no complete program found")
        return None
    return best, best_cost


def _steps_to(space: _Space, s: _State, stop: _State | None) -> list[Step]:
    program = []
    while s is not stop and s.parent is not None:
        program.append(space.step_of(s))
        s = s.parent
    program.reverse()
    return program


# -- layer lower bounds -----------------------------------------------------------------------

def _live_lists(space: _Space, bounds: Sequence[int]) -> dict[int, list[int]]:
    """Activation ids live at each cut (produced before it, used at or after it), in id order."""
    bounds = sorted(bounds)
    out: dict[int, list[int]] = {b: [] for b in bounds}
    for i, name in sorted(space.names.items()):
        t = space.graph.tensors[name]
        if i == space.loss_id:
            continue
        last = max(t.consumers) if t.consumers else t.producer
        for b in bounds[bisect.bisect_right(bounds, t.producer):bisect.bisect_right(bounds, last)]:
            out[b].append(i)
    return out


def _chunk_key(space: _Space, lo: int, hi: int, live) -> tuple:
    """Everything the chunk search sees, with tensors numbered by first appearance."""
    local = {t: i for i, t in enumerate(live[lo])}

    def rid(t):
        if t not in local:
            local[t] = len(local)
        return local[t]

    nodes = []
    for k in range(lo, hi):
        opts = tuple((o.strategy, o.fwd, o.bwd, o.sync_bytes, tuple((rid(t), c) for t, c in o.reqs),
                      tuple(rid(p // CODE_BITS) * CODE_BITS + p % CODE_BITS for p in o.outs)) for o in space.opts[k])
        nodes.append((space.graph.nodes[k].op, space.segment_of[k], opts, tuple(sorted(rid(t) for t in space.dead_at[k]))))
    tensors = []
    for t in sorted(local, key=local.get):
        name = space.names[t]
        tt = space.graph.tensors[name]
        tensors.append((tt.shape, tt.dtype, tt.requires_grad,
                        space.cost.granules(name)))
    seg_in = space.segment_of[lo - 1] if lo in space.seg_start else None
    return (tuple(nodes), tuple(tensors), tuple(rid(t) for t in live[hi]), seg_in, hi == space.n)


def _table_key(s: _State) -> tuple:
    # Only programs holding the same live tensors are compared (any of their placements).
    if s.key is None:
        s.key = s.k, s.shared, frozenset(p // CODE_BITS for p in s.props)
    return s.key


def _reach(s: _State) -> frozenset:
    """s's properties plus those one free move away: R (the whole value, partial gradient)
    slices to any S, duplicates to D and zero-pads to P with no communication in either pass
    and no stage boundary, so holding R is as good as holding all of them."""
    if s.reach is None:
        extra = [p - R_CODE + c for p in s.props if p % CODE_BITS == R_CODE for c in range(MAX_CODES)]
        s.reach = s.props.union(extra) if extra else s.props
    return s.reach


def _bound(s: _State) -> frozenset:
    """The communicated tensors s may not communicate again and cannot do without: a tensor
    held in R needs no more communication (every placement is a free move away)."""
    if s.bound is None:
        s.bound = frozenset(t for t in s.comm if t * CODE_BITS + R_CODE not in s.props) if s.comm else s.comm
    return s.bound


def _dominated(space: _Space, table: dict, s: _State) -> bool:
    """Fig. 10 line 9: a program with at least s's properties (up to free moves), no more
    tensors it may not communicate, and no dearer for any continuation makes s redundant."""
    entries = table.get(_table_key(s))
    if not entries:
        return False
    reach, comm = _reach(s), s.comm
    for e in entries:
        if _bound(e) <= comm and reach <= (e.reach or _reach(e)) and _no_dearer(space, e, s):
            return True
    return False


def _insert(space: _Space, table: dict, s: _State) -> None:
    """Lines 12-14: add s, dropping the programs it dominates."""
    key = _table_key(s)
    reach, bound = _reach(s), _bound(s)
    table[key] = [e for e in table.get(key, ())
                  if not (bound <= e.comm and (e.reach or _reach(e)) <= reach and _no_dearer(space, s, e))] + [s]


def _no_dearer(space: _Space, a: _State, b: _State) -> bool:
    """a costs no more than b after any common continuation.

    Stages: the open stage closes at max_j(fwd_j + x_j) for whatever x follows, and
    max_j(a_j + x_j) <= max_j(b_j + x_j) + max_j (a_j - b_j)^+, so the stages cost a at most
    d = a.closed - b.closed + max(a.fwd - b.fwd)^+ + max(a.bwd - b.bwd)^+ more than b.

    Gradient sync adds max(0, E, K): E the excess so far, K that of buckets still to close
    (program.walk). K of the open bucket is synced + slope * bucket + anchor + what follows,
    K of later buckets the same with -(P + C) for the anchor, less the backward of the open
    stage, which differs by at most max(b.bwd - a.bwd)^+; the same continuation adds the same.
    As max(p, q) - max(p', q') <= max(p - p', q - q'), a is no dearer when d plus the largest
    of those differences (and of max(0, E)) is at most 0. When a's sync can no longer be
    exposed (its K bound is at most 0), only max(0, E) matters."""
    extra = a.closed - b.closed
    df = max(map(float.__sub__, a.fwd, b.fwd))
    if df > 0:
        extra += df
    db = max(map(float.__sub__, a.bwd, b.bwd))
    if db > 0:
        extra += db
    sa, sb = a.sync, b.sync
    if sa is None:
        return extra <= 0
    if sa.bucket and not sb.bucket:  # a's open bucket is non-empty whatever follows, b's may not
        return False
    gap = a.exposed - b.exposed
    queued_a = sa.synced + space.sync_slope * sa.bucket
    if queued_a + space.sync_alpha + space.sync_rest[a.k] + sa.anchor > 0:
        queued_b = sb.synced + space.sync_slope * sb.bucket
        open_bucket = queued_a + sa.anchor - queued_b - sb.anchor
        later = queued_a - sa.done - sa.opening - queued_b + sb.done + sb.opening + max(0.0, -min(map(float.__sub__, a.bwd, b.bwd)))
        gap = max(gap, open_bucket, later)
    return extra + gap <= 0


def _shared_ok(shared: frozenset, uses: tuple) -> bool:
    """Later uses of shared parameters load them as first loaded (unless that was whole)."""
    for pid, code, seg in uses:
        for e in shared:
            if e[0] == pid and (code, seg) != e[1:]:
                return False
    return True


def _sync_rest(cost: CostModel) -> list[float]:
    """Per node k, the most gradient sync a program can still add from k on, beyond its open
    bucket's latency: a bucket per later group, every trainable parameter first used from k."""
    n, bucket, first_use = len(cost.graph.nodes), cost.bucket_of, cost.first_use_bytes
    rest = [0.0] * (n + 1)
    synced_buckets = sorted({bucket[k] for k in range(n) if first_use[k]})
    bytes_from = 0.0
    for k in range(n - 1, -1, -1):
        bytes_from += first_use[k]
        later = len(synced_buckets) - bisect.bisect_right(synced_buckets, bucket[k])
        rest[k] = cost.sync_slope * bytes_from + cost.sync_alpha * later
    return rest


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
