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
           strategy on that device; or, where more, the same for the devices' speed-weighted
           mean (a node's cheapest mean over its strategies: a maximum is at least any mean).
           This never exceeds the true remainder's computation (a sum of per-stage maxima is at
           least the maximum of sums), and is not zero.
           Plus the communication no completion avoids (pending moves): a node ahead that
           needs tensors Q already holds runs one of its strategies, and each input that
           strategy needs in a placement Q neither holds nor reaches for free (from R) costs a
           chain of moves, at least the cheapest chain from a held placement (moves are priced
           one by one, each as a collective of its own; a tensor needed in two placements counts
           the dearer chain only). The least of that over the node's strategies is summed over
           nodes that share no held input, so no move is counted twice. Closing stages early
           only adds to the computation part.
A program Q' is dropped when a program with at least its properties costs no more for any
continuation (line 9 of Fig. 10), and the search stops when the best complete program costs
no more than the lowest score in the queue (line 5).

With layer cuts (`synthesize(cuts=...)`, what the planner uses) ecost also counts, for each
chunk between cuts still ahead, a lower bound on that chunk's cost; an optional width caps
the programs expanded per node once an exhaustive budget is spent (the result then says
whether the cap dropped any).

The search (Fig. 10 from a start state to a goal node) is best-first on cost + heuristic:

- Dominance (line 9): programs holding the same live tensors are compared. A program with at
  least another's properties up to free moves (R slices to any S, duplicates to D and
  zero-pads to P with no communication in either pass and no stage boundary, so holding R is
  as good as holding all of them), no more tensors it may not communicate and cannot do
  without (a tensor held in R needs no more communication), and no dearer for any
  continuation makes the other redundant. The table holds expanded programs only: a program
  is checked when generated and again when popped.
- "No dearer", a against b: the open stage closes at max_j(fwd_j + x_j) for whatever x follows,
  and max_j(a_j + x_j) <= max_j(b_j + x_j) + max_j(a_j - b_j)^+, so the stages cost a at most
  d = a.closed - b.closed + max(a.fwd - b.fwd)^+ + max(a.bwd - b.bwd)^+ more than b. Gradient
  sync adds max(0, E, K): E the excess so far, K that of buckets still to close
  (program.walk). K of the open bucket is synced + slope * bucket + anchor + what follows, K
  of later buckets the same with -(P + C) for the anchor, less the backward of the open stage,
  which differs by at most max(b.bwd - a.bwd)^+; the same continuation adds the same. As
  max(p, q) - max(p', q') <= max(p - p', q - q'), a is no dearer when d plus the largest of
  those differences (and of max(0, E)) is at most 0. When a's sync can no longer be exposed
  (its K bound is at most 0), only max(0, E) matters. A non-empty open bucket against an
  empty one is never no dearer.
- A program's score adds to its closed stages and the heuristic a lower bound of the exposed
  gradient sync: the excess so far, and the open bucket as if nothing more joined it.
- Width: where many small tensors each have several near-equally cheap placements (MoE
  routing masks), the programs below the optimum's score multiply; an optional cap on the
  programs expanded per node index (after an exhaustive budget) keeps the search linear there,
  and the result then says it is not a proven optimum, and how far from one it may be: no
  program through a dropped one costs less than its score, so the least dropped score bounds
  the optimum from below (SearchResult.lower_bound).
- Incumbents: programs known before the search (data parallelism's, an earlier search's) bound
  it from the start, as the best complete program found does (branch and bound).

The state walk itself (expansion, dominance, queue) is compiled (_core.cpp); this module builds
every number it reads: options priced by program.node_times, moves by program.move_price, the
heuristic, the gradient-sync constants.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np

from ..cost.model import CostModel
from ..ir import Graph, chunk_cuts  # noqa: F401  (chunk_cuts: part of this module's interface)
from ..placement import D, P, R, Placement, from_code
from ..rules import Strategy
from .moves import Move, moves_between, rebalance
from . import _core
from .program import (Estimate, Load, MoveStep, NumericShares, Step, kept_as, memory_terms, move_price, move_terms,
                      linear_seconds, node_key, price_node, replay, synced_params, terms_seconds)

CODE_BITS = 64  # property = tensor id * 64 + placement code
BOUND_EXPANSIONS_PER_NODE = 50  # budget of a chunk's lower-bound search


class SearchError(RuntimeError):
    pass


@contextlib.contextmanager
def paused_gc():
    """Planning allocates many small acyclic objects; with a large captured graph alive, the
    cyclic collector's full passes would cost more than the planning itself."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True, slots=True, kw_only=True)
class Restriction:
    """Limits the search to a family of programs (for baselines)."""

    name: str
    allow_load: Callable[[str, str, Placement], bool]
    """(tensor kind, tensor name, placement) -> may this leaf be loaded so."""
    allow_move: Callable[[Move], bool] = lambda mv: True
    """May this move be used. Moves that communicate in neither pass must stay allowed: the
    dominance test counts on R turning into D, P or a shard for free."""

    def admits(self, program: Sequence[Step], graph: Graph) -> bool:
        """Whether `program` is of this family: every load and move it makes is allowed (the
        re-splits at segment starts always are). The cheapest program of a wider space that is
        of the family is the cheapest of the family."""
        return all(self.allow_load(graph.tensors[ld.tensor].kind, ld.tensor, ld.placement)
                   for step in program for ld in step.loads) and \
            all(self.allow_move(ms.move) for step in program for ms in step.moves if ms.move.name != "rebalance")


@dataclass(slots=True)
class SearchResult:
    program: list[Step]
    cost: float
    expanded: int
    generated: int
    seconds: float
    exhaustive: bool = True
    """False when the width limit dropped a program: `cost` is then not proven optimal."""
    lower_bound: float = 0.0
    """A proven lower bound of the optimum's cost: `cost` itself when exhaustive, else the
    least score of the programs the width cap dropped (the score never overestimates what a
    program's completions cost), if lower."""

    @property
    def gap(self) -> float:
        """How much dearer than the optimum `cost` may be at most, as a fraction of it."""
        return self.cost / self.lower_bound - 1.0 if self.lower_bound > 0 else math.inf


def synthesize(graph: Graph, strategies: Sequence[Sequence[Strategy]], cost: CostModel, segment_of: Sequence[int],
               ratios: Sequence[Sequence[float]], restriction: Restriction | None = None,
               heuristic: bool = True, layer_bounds: bool = False,
               max_expansions: int = 5_000_000, width: int | None = None,
               width_after: float = 0.0, frame: Frame | None = None,
               incumbents: Sequence[Sequence[Step]] = ()) -> SearchResult:
    """The cheapest program under `ratios` (per segment) in the canonical-order space.

    Programs are priced as `program.walk` prices them: stages end at communication and at
    layer boundaries (cost.chunk_of), so the costs of the chunks between boundaries add up.
    layer_bounds=True: the heuristic gains, for every chunk still ahead, the cost of that
    chunk's best program from the most favourable entry state (every placement of its inputs
    at hand): a lower bound that already counts the communication each layer cannot avoid.
    Identical chunks (transformer layers) share that bound, found once by the same A*.
    Without it, a chunk ahead is bounded by its cheapest computation alone.

    width=None keeps the search exhaustive (a proven optimum); an int caps the programs
    expanded per node index (see the module docstring) once the search has expanded `width_after` programs
    per node of the graph, and the result says whether the cap dropped any.

    incumbents: programs of the same space known already (a baseline's, an earlier search's).
    The cheapest of them under `ratios` bounds the search from the start (branch and bound):
    programs whose score reaches it are never expanded, and it is the result where nothing
    cheaper exists, still a proven optimum.
    """
    t0 = time.perf_counter()
    with paused_gc():
        space = _Space(graph, strategies, cost, segment_of, ratios, restriction, heuristic, layer_bounds, frame)
        # (replay prices a sparse gradient's sync padded at the ratios, the search at even shares
        # (CostModel.sync_bytes): for a model with one, the incumbents' bound is in replay's price,
        # and the search keeps an incumbent where it finds nothing it prices cheaper)
        known = min(((space.frame.replay(p, ratios).seconds - cost.step_overhead, i) for i, p in enumerate(incumbents)
                     if restriction is None or restriction.admits(p, graph)), default=(math.inf, -1))
        found = space.run(0, (), True, space.n, True, max_expansions, width, int(width_after * space.n), upper=known[0])
        exhaustive = space.core.exhaustive
        if found is None and known[1] < 0 and not exhaustive:
            # the cap kept only programs that dead-end (a restricted family's, say, that can
            # neither communicate nor compute what the dropped ones could): search them all
            found = space.run(0, (), True, space.n, True, max_expansions, None, 0, upper=known[0])
            exhaustive = True
    if found is None and known[1] >= 0:
        found = list(incumbents[known[1]]), known[0]
    if found is None:
        raise SearchError("no complete program found")
    program, best_cost = found
    # the step's own collectives but the gradients' (the loss's all-reduce, the generator's
    # broadcast) cost every program alike: the search leaves them out, the total has them
    total = best_cost + cost.step_overhead
    lower = min(best_cost, space.dropped) + cost.step_overhead
    return SearchResult(program, total, space.core.expanded, space.core.generated, time.perf_counter() - t0,
                        exhaustive, lower)


class Frame:
    """What every search of one graph shares, whatever the ratios: tensor ids, when tensors
    die, per node and strategy its leaf loads, required placements and produced properties,
    the classes of nodes and moves priced alike, the layer chunks' shapes, and the prices
    already found per ratios. The planner builds one and passes it to each of its searches."""

    def __init__(self, graph: Graph, strategies: Sequence[Sequence[Strategy]], cost: CostModel, segment_of: Sequence[int]):
        self.graph, self.strategies, self.cost, self.segment_of = graph, strategies, cost, list(segment_of)
        n = len(graph.nodes)
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
                            for k in range(n)]
        self.seg_start = {k for k in range(1, n) if segment_of[k] != segment_of[k - 1]}
        chunk = cost.chunk_of
        self.cut_set = frozenset(k for k in range(1, n) if chunk[k] != chunk[k - 1])
        # Nodes alike (CostModel.node_class) with one strategy list and segment: priced once per ratios.
        classes: dict[tuple, int] = {}
        self.alike, self.alike_node, self.choices = [], [], []
        for k, node in enumerate(graph.nodes):
            key = (cost.node_class[k], id(strategies[k]), segment_of[k])
            if key not in classes:
                classes[key] = len(self.alike_node)
                self.alike_node.append(k)
            self.alike.append(classes[key])
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
                choices.append(_Choice(st, loads, tuple(dict.fromkeys(reqs)), outs, cost.variant_comm(node, st),
                                       *self._sync_choice(k, loads)))
            self.choices.append(choices)
        self.every_choice = [list(range(len(choices))) for choices in self.choices]  # an unrestricted search's `allowed`
        # Moves, by class: tensors alike in bytes, gradient and split granules (every layer's)
        # have the same moves to a placement, priced alike.
        move_classes: dict[tuple, int] = {}
        self.move_class: dict[tuple[int, int, int], int] = {}
        self.moves: list[list[tuple[int, Move]]] = []  # per class: (source code, move)
        self.move_tensor: list[tuple[str, int]] = []  # per class: a tensor and segment to price it by
        consumers: dict[int, set[int]] = {}  # activation id -> nodes that need it (the pending-move bound)
        wanted: dict[tuple[int, int, int], None] = {}  # (tensor, code, segment) to reach, in order
        for k, choices in enumerate(self.choices):
            seg = segment_of[k]
            for ch in choices:
                for t, code in ch.reqs:
                    wanted[(t, code, seg)] = None
                    consumers.setdefault(t, set()).add(k)
        # R, D and P are priced as destinations too: chains of moves pass through them
        for t, seg in dict.fromkeys((t, seg) for t, _, seg in list(wanted)):
            for code in (R.code, D.code, P.code):
                wanted.setdefault((t, code, seg))
        tensor_key: dict[int, tuple] = {}
        for t, code, seg in wanted:
            if t not in tensor_key:
                name = self.names[t]
                tensor = graph.tensors[name]
                tensor_key[t] = (tensor.nbytes, tensor.requires_grad, cost.granules(name))
            key = (tensor_key[t], code, seg)
            if key not in move_classes:
                move_classes[key] = len(self.moves)
                name = self.names[t]
                tensor, dst = graph.tensors[name], from_code(code)
                self.moves.append([(src, mv) for src in _codes_for(tensor) if src != code
                                   for mv in moves_between(from_code(src), dst, tensor.requires_grad)])
                self.move_tensor.append((name, seg))
            self.move_class[(t, code, seg)] = move_classes[key]
        # per move class, each move's (forward, backward) collective_terms: priced under every ratios
        self.move_table = _MoveTable([[move_terms(cost, name, mv, seg, seg, nbytes) for _, mv in moves]
                                      for moves, (name, seg) in zip(self.moves, self.move_tensor)
                                      for nbytes in (graph.tensors[name].nbytes,)])
        self.sync_rest = _sync_rest(cost)
        bucket = cost.bucket_of
        self.core = _core.Frame(
            cost.m, [[_core.Option(c.reqs, c.outs, c.sync_bytes, c.inner, c.keeps, c.uses) for c in choices]
                     for choices in self.choices],
            self.alike, self.segment_of, [k in self.seg_start for k in range(n)], [k + 1 in self.cut_set for k in range(n)],
            [k + 1 == n or bucket[k + 1] != bucket[k] for k in range(n)], [sorted(d) for d in dead_at],
            [sorted(d) for d in self.shared_done], [(t, code, seg, c) for (t, code, seg), c in self.move_class.items()],
            [[(src, mv.communicates, mv.fwd is not None) for src, mv in moves] for moves in self.moves],
            cost.sync_slope, cost.sync_alpha, self.sync_rest, cost.grad_sync)
        ids = range(len(tid))
        self.core.set_consumers([sorted(consumers.get(t, ())) for t in ids],
                                [sorted({segment_of[k] for k in consumers.get(t, ())}) for t in ids],
                                [len(_codes_for(graph.tensors[self.names[t]])) for t in ids])
        self.bounds = [0] + sorted(self.cut_set) + [n]
        self.live = _live_lists(self, self.bounds + sorted(self.seg_start))
        self._chunk_class: dict[int, int] | None = None
        # shared parameters each chunk uses again, and every way their first uses may load them
        self.chunk_shared = {lo: {u[0] for k in range(lo, hi) for c in self.choices[k] for u in c.uses}
                             for lo, hi in zip(self.bounds, self.bounds[1:])}
        self.shared_configs = _shared_configs(self.choices)
        self.chunk_syncs = {lo: any(cost.first_use_bytes[k] for k in range(lo, hi)) for lo, hi in zip(self.bounds, self.bounds[1:])}
        self._prices: dict[tuple, tuple[list, list]] = {}
        self._replayed: dict[tuple, Estimate] = {}
        self._facts: dict[tuple, tuple[list, dict]] = {}  # program -> its memory_terms and synced_params (facts)
        self._shares: dict[tuple, NumericShares] = {}  # share signature -> its NumericShares
        self._priced: list[tuple[Sequence[Sequence[float]], list]] = []  # ratios priced, and their node prices
        # per option of each price class: the (granule count, segment) shares its price reads
        self._option_deps: list[list[frozenset]] = []
        self.lp_prices: dict = {}  # the planner's LPs' shared node prices (balance.lp.balance's memo)

    @property
    def chunk_class(self) -> dict[int, int]:
        """Per chunk start, its class: chunks alike (every layer's) share a class and so their
        bounds (only the layer-bound heuristic asks)."""
        if self._chunk_class is None:
            keys: dict[tuple, int] = {}
            self._chunk_class = {lo: keys.setdefault(self._chunk_key(lo, hi), len(keys))
                                 for lo, hi in zip(self.bounds, self.bounds[1:])}
        return self._chunk_class

    def replay(self, program: Sequence[Step], ratios: Sequence[Sequence[float]]) -> Estimate:
        """program.replay, once per program and share signature (ratios that round alike price
        alike): the planner prices its candidates, and each search its incumbents, through it."""
        steps, sig = tuple(program), self.cost.share_signature(ratios)
        found = self._replayed.get((steps, sig))
        if found is None:
            terms, synced = self.facts(steps)
            found = self._replayed[(steps, sig)] = replay(program, self.cost, self.segment_of, ratios,
                                                          alg=self.shares(ratios), terms=terms, synced=synced)
        return found

    def facts(self, program: Sequence[Step]) -> tuple[list, dict[str, int]]:
        """A program's memory_terms and synced_params, found once: they are alike under any ratios."""
        steps = tuple(program)
        found = self._facts.get(steps)
        if found is None:
            found = self._facts[steps] = (memory_terms(program, self.cost, self.segment_of),
                                          synced_params(program, self.graph, self.segment_of))
        return found

    def shares(self, ratios: Sequence[Sequence[float]]) -> NumericShares:
        """NumericShares of `ratios`, one per share signature: what one program priced at the
        ratios (a node, a move), every other finds priced."""
        sig = self.cost.share_signature(ratios)
        found = self._shares.get(sig)
        if found is None:
            found = self._shares[sig] = NumericShares(self.cost, [list(r) for r in ratios])
        return found

    def prices(self, ratios: Sequence[Sequence[float]]) -> tuple[list, list[list[tuple[float, float, bool]]]]:
        """Per price class the (forward, backward) seconds of each option, and per move class
        those of each move (and True: allowed where nothing restricts), under `ratios`: computed
        once per ratios (per share signature)."""
        key = self.cost.share_signature(ratios)
        found = self._prices.get(key)
        if found is None:
            cost, alg = self.cost, self.shares(ratios)
            # A node's price reads the shares of a few granule counts only (noted at the first
            # ratios priced): where none of those rounds differently from the nearest ratios
            # priced already (the fewest shares changed: a balanced round's ratios are near its
            # input's), it is that price again. Moves are priced all at once (_MoveTable).
            base, changed = None, set()
            if self._priced:
                base, changed = min(((p, cost.changed_shares(p[0], ratios)) for p in self._priced),
                                    key=lambda pc: len(pc[1]))
            nodes = self._price_rows(
                [[(k, c) for c in self.choices[k]] for k in self.alike_node], None if base is None else base[1],
                self._option_deps, changed, alg,
                lambda kc: price_node(cost, alg, kc[0], kc[1].strategy, kc[1].loads, self.segment_of[kc[0]]))
            for k, row in zip(self.alike_node, nodes):  # programs replayed at these ratios find them priced
                for c, times in zip(self.choices[k], row):
                    alg.priced.setdefault(node_key(cost, k, c.strategy, c.loads, self.segment_of[k]), times)
            moves = self.move_table.prices(cost, alg)
            found = self._prices[key] = ([[_core.Price(*times) for times in row] for row in nodes], moves)
            self._priced.append((tuple(map(tuple, ratios)), nodes))
        return found

    def move_prices(self, ratios: Sequence[Sequence[float]], restriction: Restriction | None) -> list[list[tuple]]:
        """Per move class, each move's (forward s, backward s, allowed by `restriction`) under
        `ratios`, as a search's space takes them."""
        moves = self.prices(ratios)[1]
        if restriction is None:
            return moves
        return [[(f, b, restriction.allow_move(mv)) for (f, b, _), (_, mv) in zip(prices, self.moves[c])]
                for c, prices in enumerate(moves)]

    @staticmethod
    def _price_rows(rows: list[list], first: list[list] | None, deps: list[list[frozenset]], changed: set,
                    alg: NumericShares, price: Callable) -> list[list]:
        """price(item) for every item of every row; from the second ratios priced on, the price
        under earlier ratios (`first`) where none of the shares it read (`deps`, noted at the
        first ratios: alg.read) rounds differently now (`changed`)."""
        out = []
        for r, items in enumerate(rows):
            row, read = [], [] if first is None else deps[r]
            for i, item in enumerate(items):
                if first is not None and changed.isdisjoint(read[i]):
                    row.append(first[r][i])
                    continue
                alg.read = set() if first is None else None
                row.append(price(item))
                if first is None:
                    read.append(frozenset(alg.read))
            if first is None:
                deps.append(read)
            out.append(row)
        alg.read = None
        return out

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
                if len(ps) > 1 or kept_as(ps[0]) == R:  # kept whole: synced
                    sync += self.cost.sync_bytes(name)
                elif name in self.shared:  # (a whole placement is alike in every segment)
                    keeps.append((self.shared[name], ps[0].code, seg if ps[0].is_shard else 0))
            else:
                uses.append((self.shared[name], ps[0].code if len(ps) == 1 else -1,
                             seg if len(ps) == 1 and ps[0].is_shard else 0))
        return sync, tuple(keeps), tuple(uses)

    def _chunk_key(self, lo: int, hi: int) -> tuple:
        """Everything a chunk's bound search sees but the ratios, with tensors numbered by
        first appearance: chunks with equal keys (every layer's) have equal bounds."""
        local = {t: i for i, t in enumerate(self.live[lo])}

        def rid(t):
            if t not in local:
                local[t] = len(local)
            return local[t]

        nodes = []
        for k in range(lo, hi):
            opts = tuple((c.strategy, c.inner, tuple((rid(t), code) for t, code in c.reqs),
                          tuple(rid(p // CODE_BITS) * CODE_BITS + p % CODE_BITS for p in c.outs)) for c in self.choices[k])
            nodes.append((self.alike[k], opts, tuple(sorted(rid(t) for t in self.dead_at[k]))))
        tensors = []
        for t in sorted(local, key=local.get):
            tt = self.graph.tensors[self.names[t]]
            tensors.append((tt.shape, tt.dtype, tt.requires_grad, self.cost.granules(self.names[t])))
        seg_in = self.segment_of[lo - 1] if lo in self.seg_start else None
        return tuple(nodes), tuple(tensors), tuple(rid(t) for t in self.live[hi]), seg_in, hi == len(self.graph.nodes)


class _Choice(NamedTuple):
    """A strategy of a node as the search sees it (a named tuple: a frame makes hundreds)."""
    strategy: Strategy
    loads: tuple[Load, ...]
    reqs: tuple[tuple[int, int], ...]  # (activation tensor id, placement code) needed
    outs: tuple[int, ...]  # properties produced
    inner: float  # seconds of the collectives the strategy makes inside the node (a stage boundary)
    sync_bytes: float  # gradient bytes this node makes the runtime all-reduce (first use of a parameter kept whole)
    keeps: tuple  # (parameter id, placement code, segment): a shared parameter first loaded sharded
    uses: tuple  # (parameter id, placement code or -1 for several, segment): a later use of a shared parameter


class _MoveTable:
    """Every move class's moves' collective_terms (forward and backward, in class and move
    order) as arrays, priced under any ratios at once: terms_seconds over all of them, const +
    slope * the largest share of the (up to two) sharded operands, 1 where none; a grouped
    all-gather (a price by how many devices hold rows) alone. The same operations in the same
    order as terms_seconds (linear_seconds): the same floats."""

    def __init__(self, rows: Sequence[Sequence[tuple]]):
        self.counts = [len(row) for row in rows]
        self.refs: dict[tuple, int] = {}  # (tensor, dim, segment) -> its index in `tops` (0: the whole, 1.0)
        const, slope, first, second = [], [], [], []
        self.grouped: list[tuple[int, tuple]] = []  # (flat index, its collective_terms)
        for row in rows:
            for pair in row:
                for terms in pair:
                    if terms is not None and terms[0] is None:
                        self.grouped.append((len(const), terms))
                    linear = terms is not None and terms[0] is not None
                    ids = [self.refs.setdefault(ref, len(self.refs) + 1) for ref in terms[2]] if linear else []
                    const.append(terms[0] if linear else 0.0)
                    slope.append(terms[1] if linear else 0.0)
                    first.append(ids[0] if ids else 0)
                    second.append(ids[-1] if ids else 0)
        self.const, self.slope = np.array(const), np.array(slope)
        self.first, self.second = np.array(first, dtype=np.intp), np.array(second, dtype=np.intp)

    def prices(self, cost: CostModel, alg: NumericShares) -> list[list[tuple[float, float, bool]]]:
        """Per move class, each move's (forward s, backward s, True) under the shares `alg`."""
        tops = np.array([1.0] + [alg.largest([ref]) for ref in self.refs])
        flat = linear_seconds(self.const, self.slope, np.maximum(tops[self.first], tops[self.second])).tolist()
        for i, terms in self.grouped:
            flat[i] = terms_seconds(cost, alg, terms)
        out, pos = [], 0
        for n in self.counts:
            part = flat[pos:pos + 2 * n]
            out.append(list(zip(part[0::2], part[1::2], itertools.repeat(True))))
            pos += 2 * n
        return out


class _Space:
    """One search's space: the frame under the ratios and a restriction, its heuristic."""

    def __init__(self, graph, strategies, cost, segment_of, ratios, restriction, heuristic, layer_bounds, frame=None):
        frame = frame or Frame(graph, strategies, cost, segment_of)
        assert frame.graph is graph and frame.strategies is strategies and frame.segment_of == list(segment_of)
        self.frame, self.graph, self.cost, self.segment_of, self.ratios = frame, graph, cost, segment_of, ratios
        self.n = len(graph.nodes)
        if restriction:
            for dst in (D, P, Placement("S", 0)):
                for mv in moves_between(R, dst, True):
                    if not restriction.allow_move(mv):
                        raise ValueError(f"restriction {restriction.name!r} forbids the free move {mv.name} (R -> {dst})")
        self.dropped = math.inf
        if restriction is None:
            self.allowed = allowed = frame.every_choice
        else:
            self.allowed = allowed = []
            for k, node in enumerate(graph.nodes):
                ok = [i for i, c in enumerate(frame.choices[k]) if all(
                    restriction.allow_load(graph.tensors[ld.tensor].kind, ld.tensor, ld.placement) for ld in c.loads)]
                if not ok:
                    raise SearchError(f"no allowed strategy for node {node.name} ({node.op}) under {restriction.name}")
                allowed.append(ok)
        options, _ = frame.prices(ratios)
        self.core = _core.Space(frame.core, options, allowed, frame.move_prices(ratios, restriction))
        if frame.seg_start:  # every sharded placement of a tensor live at a segment start can be re-split there
            alg = frame.shares(ratios)
            for k in sorted(frame.seg_start):
                for t in frame.live[k]:
                    name = frame.names[t]
                    for code in _codes_for(graph.tensors[name])[3:]:
                        f, b = move_price(cost, alg, name, rebalance(from_code(code)), segment_of[k - 1], segment_of[k])
                        self.core.set_rebalance(t, code, k, f, b)
        if heuristic:
            self.core.use_pending()
        self._heuristic(heuristic, layer_bounds, restriction is not None)

    def run(self, k: int, props, with_sync: bool, goal: int, with_future: bool, max_expansions: int,
            width: int | None = None, width_after: int = 0, shared=(), sync_price: float = 0.0,
            forward_only: bool = False, upper: float = math.inf) -> tuple[list[Step], float] | None:
        """The cheapest program from node k holding `props` to node `goal` (the module docstring's search):
        its steps and cost, or None when there is none cheaper than `upper`. Afterwards `self.dropped` is the least
        score of the programs the width cap dropped (inf: none). with_sync: price gradient sync from an
        empty bucket (the whole program's search) or leave it unpriced but for `sync_price`
        seconds per byte, and with forward_only only the stages' forward parts (a chunk's
        bound); shared: how shared parameters were first loaded, (parameter id, placement code,
        segment) each."""
        res = self.core.search(k, list(props), list(shared), with_sync, goal, with_future, max_expansions,
                               -1 if width is None else width, width_after, sync_price, forward_only, upper)
        self.dropped = res.dropped
        if res.status == 2:
            raise SearchError(f"search exceeded {max_expansions} expansions at node {res.at_node} of {self.n}")
        if res.status == 1:
            return None
        return [self._step(*entry) for entry in res.path], res.cost

    def _step(self, k: int, option: int, combo, rebalanced) -> Step:
        """The instruction the search took at node k: rebalances (at a segment start), moves, the node."""
        fr = self.frame
        choice = fr.choices[k][option]
        seg = self.segment_of[k]
        moves = tuple(MoveStep(fr.names[p // CODE_BITS], rebalance(from_code(p % CODE_BITS))) for p in rebalanced)
        moves += tuple(MoveStep(fr.names[t], fr.moves[fr.move_class[(t, code, seg)]][i][1]) for t, code, i in combo)
        return Step(k, choice.strategy, choice.loads, moves)

    def _heuristic(self, enabled: bool, layer_bounds: bool, restricted: bool) -> None:
        """h(state at k) = open stage plus, per device, the cheapest computation left in the
        chunk (max over devices, forward and backward apart), plus the lower bound of every
        later chunk (its cheapest computation, or with layer_bounds its searched bound). At a
        chunk's start the open stage is empty and the chunk's own searched bound is used
        instead of its computation alone. A chunk that uses a shared parameter again is
        bounded once per way its first use may have loaded it (Frame.shared_configs): a tied
        embedding first loaded sharded fixes how the output layer loads it, and the bound of
        a program says so."""
        if not enabled:
            return
        core, frame = self.core, self.frame
        # The slowest device computes at least any weighted mean of the devices' times; weighted
        # by speed, a node's mean is its work over the cluster's speed whatever the strategy's
        # shares, where the per-device least (each device its own cheapest strategy) is not.
        core.set_weights(self.cost.cluster.compute_proportional())
        core.compute_suffix()
        if not frame.cut_set:
            return
        chunks = list(zip(frame.bounds, frame.bounds[1:]))
        # a chunk that a segment start begins or cuts through is bounded by its computation: its
        # search from every placement at hand would pay the rebalance of each of them
        searched = [lo for lo, hi in chunks if layer_bounds and not any(lo <= k < hi for k in frame.seg_start)]
        computation = {lo: core.suffix_max(lo) for lo, _ in chunks}
        for lo in searched:
            core.clear_suffix(lo)  # a chunk start's state has no open stage
        lower: dict[tuple, float] = {}
        slope = self.cost.grad_sync_least_slope
        bucket = self.cost.bucket_of

        def bound(lo, hi, used, price, forward_only=False):
            key = (frame.chunk_class[lo], tuple(tuple(self.allowed[k]) for k in range(lo, hi)) if restricted else None, used,
                   price, forward_only)
            if key not in lower:
                lower[key] = self._chunk_bound(lo, hi, used, 0.0 if forward_only else computation[lo], price, forward_only)
            return lower[key]

        for constraints in frame.shared_configs:
            future, ahead, beyond = [0.0] * (self.n + 1), [0.0] * (self.n + 1), [-math.inf] * (self.n + 1)
            after, extra = 0.0, {}  # extra[b]: what the chunks from here on add at least to bucket b's sync
            later = _Beyond()
            for lo, hi in reversed(chunks):
                for k in range(lo + 1, hi):
                    future[k], ahead[k], beyond[k] = after, extra.get(bucket[k], 0.0), later.after(bucket[k])
                if lo not in searched:
                    # Entering a segment re-splits every sharded live placement: with all of them at
                    # hand the bound would pay for rebalances no real entry makes. Computation only
                    # (also without layer bounds).
                    future[lo], ahead[lo], beyond[lo] = after, extra.get(bucket[lo], 0.0), later.after(bucket[lo])
                    after += computation[lo]
                    later.prepend(bucket[lo], computation[lo], computation[lo], 0.0)
                    continue
                used = tuple(c for c in constraints if c[0] in frame.chunk_shared[lo])
                stages = bound(lo, hi, used, 0.0)
                with_sync, forward = stages, 0.0
                if frame.chunk_syncs[lo] and slope > 0:
                    with_sync = max(stages, bound(lo, hi, used, slope))
                    forward = bound(lo, hi, used, slope, forward_only=True)
                after += stages
                extra[bucket[lo]] = extra.get(bucket[lo], 0.0) + with_sync - stages
                later.prepend(bucket[lo], stages, with_sync, forward)
                future[lo], ahead[lo], beyond[lo] = after, extra[bucket[lo]], later.after(bucket[lo])
            core.set_future(list(constraints), future, ahead, beyond)

    def _chunk_bound(self, lo: int, hi: int, constraints: tuple, computation: float, sync_price: float,
                     forward_only: bool = False) -> float:
        """Cost of chunk [lo, hi) (with forward_only, its stages' forward parts) from the best
        conceivable entry: every placement of every live input at hand, none communicated yet,
        shared parameters loaded as `constraints` say, and each byte of gradient it makes the
        runtime sync priced `sync_price`. More properties never hurt (a move or strategy
        possible with fewer stays possible), so no real entry state does better. A chunk too
        wide to bound cheaply is bounded by `computation`."""
        props = [t * CODE_BITS + c for t in self.frame.live[lo] for c in _codes_for(self.graph.tensors[self.frame.names[t]])]
        try:
            found = self.run(lo, props, False, hi, False, BOUND_EXPANSIONS_PER_NODE * (hi - lo), shared=constraints,
                             sync_price=sync_price, forward_only=forward_only)
        except SearchError:
            return computation
        return found[1] if found else float("inf")


# -- layer lower bounds -----------------------------------------------------------------------

def _live_lists(frame: Frame, bounds: Sequence[int]) -> dict[int, list[int]]:
    """Activation ids live at each cut (produced before it, used at or after it), in id order."""
    bounds = sorted(set(bounds))
    out: dict[int, list[int]] = {b: [] for b in bounds}
    for i, name in sorted(frame.names.items()):
        t = frame.graph.tensors[name]
        if i == frame.loss_id:
            continue
        last = max(t.consumers) if t.consumers else t.producer
        for b in bounds[bisect.bisect_right(bounds, t.producer):bisect.bisect_right(bounds, last)]:
            out[b].append(i)
    return out


class _Beyond:
    """Over the chunks ahead, added nearest last, the most over gradient buckets b of: the
    forward parts with sync (F1) of the chunks ahead before b, the stages with sync (L1) of b's
    chunks, and the stages (L0) of the chunks after b (the bound `beyond` of _core.cpp)."""

    def __init__(self):
        self.bucket = math.inf  # the nearest bucket ahead
        self.nearest = -math.inf  # that bucket's value
        self.farther = -math.inf  # the most of the farther buckets' values
        self.stages = 0.0  # L0 of every chunk ahead

    def prepend(self, bucket: int, stages: float, with_sync: float, forward: float) -> None:
        if bucket < self.bucket:  # a new nearest bucket
            self.farther = max(self.farther, self.nearest)
            self.bucket, self.nearest = bucket, with_sync + self.stages
        else:
            self.nearest += with_sync
        self.farther += forward
        self.stages += stages

    def after(self, bucket: int) -> float:
        """The most over the buckets ahead after `bucket` (-inf: none)."""
        return max(self.farther, self.nearest) if self.bucket > bucket else self.farther


MAX_SHARED_CONFIGS = 64  # beyond, the heuristic bounds chunks with shared parameters loaded any way


def _shared_configs(choices) -> list[tuple]:
    """Every combination of how the shared parameters' first uses may load them sharded (one
    (parameter id, placement code, segment) per parameter so loaded; the empty one first:
    loaded whole or not yet, any later load is possible)."""
    firsts: dict[int, set] = {}
    for node_choices in choices:
        for c in node_choices:
            for keep in c.keeps:
                firsts.setdefault(keep[0], set()).add(keep)
    if math.prod(len(ways) + 1 for ways in firsts.values()) > MAX_SHARED_CONFIGS:
        return [()]
    combos = itertools.product(*([None, *sorted(ways)] for ways in firsts.values()))
    return sorted({tuple(c for c in combo if c is not None) for combo in combos}, key=len)


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
