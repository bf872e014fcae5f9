"""Distributed programs and their cost under given sharding ratios.

A program is the single-device program's nodes in order, each preceded by the layout moves
its inputs need and with its leaf inputs (parameters, data) loaded in the placements its
strategy asks for:

    step  = moves before the node + loads (parameter-shard / placeholder-shard) + the node

Execution is split in stages at every move that communicates (HAP section 3.2): all devices
synchronise there. A stage costs its collectives plus, for the forward and the backward
separately, the largest computation time over devices. Stages also end at layer boundaries
(`ir.chunk_cuts`; an upper bound, exact where one device is the slowest throughout a layer),
where the gradients of the parameters kept whole are all-reduced, one bucket per layer chunk,
overlapped with the backward.

`walk` is the one pricing of a program. `replay` runs it on numbers (exact integer shard
sizes, or the ratios themselves); the load balancer runs it on linear expressions (its LP);
the search prices each step with the same `node_times` and `move_price` and assembles stages
and buckets as the walk does, step by step (tests/test_pricing.py checks all three agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from ..cost.model import CostModel
from ..ir import Graph
from ..placement import P, R, Placement
from ..rules import Strategy
from ..rules.nn import LOOKUPS
from .moves import Move

Ratios = Sequence[Sequence[float]]  # [segment][device]


@dataclass(frozen=True, slots=True)
class Load:
    tensor: str
    placement: Placement


@dataclass(frozen=True, slots=True)
class MoveStep:
    tensor: str
    move: Move


@dataclass(frozen=True, slots=True)
class Step:
    node: int
    strategy: Strategy
    loads: tuple[Load, ...]
    moves: tuple[MoveStep, ...]


@dataclass(slots=True)
class Stage:
    comm: Any = 0.0
    """Seconds of collectives (forward and backward) that open this stage."""
    comm_bwd: Any = 0.0
    """The part of `comm` the backward runs (after this stage's backward computation)."""
    collectives: list[str] = field(default_factory=list)
    fwd: list = field(default_factory=list)
    """Forward computation seconds per device."""
    bwd: list = field(default_factory=list)
    """Backward computation seconds per device."""

    @property
    def seconds(self) -> float:
        return self.comm + max(self.fwd, default=0.0) + max(self.bwd, default=0.0)


@dataclass(slots=True)
class Bucket:
    """One all-reduce of gradient sync: the parameters first used in one group of layer chunks."""
    bucket: int
    """Its number in CostModel.bucket_of (forward order)."""
    nbytes: float
    seconds: Any
    stage: int
    """The stage open where the bucket's chunks begin: its gradients are all there once the
    backward has computed this stage."""


@dataclass(slots=True)
class Estimate:
    seconds: float
    stages: list[Stage]
    grad_sync: float
    """Seconds of gradient sync the backward does not hide (on the iteration's critical path)."""
    memory: list[float]
    """Peak bytes per GPU on each device (weights, gradients, optimizer states, buffers, activations)."""
    buckets: list[Bucket] = field(default_factory=list)
    """The gradient all-reduces, in forward order of their layer chunks (the runtime launches
    them in the reverse order, as their gradients arrive)."""
    stage_of: dict[int, int] = field(default_factory=dict)
    """The stage each node runs in (by node index)."""
    step_collectives: float = 0.0
    """The loss's all-reduce and the random generator's broadcast (CostModel.step_overhead)."""

    def fits(self, capacity: Sequence[float]) -> bool:
        """Whether every device's memory holds its part: capacity[j] bytes per GPU of device j."""
        return all(m <= c for m, c in zip(self.memory, capacity))

    @property
    def forward_seconds(self) -> float:
        """A forward alone (evaluation): every stage's forward computation and collectives, and
        the loss's all-reduce; no backward, no gradient sync."""
        return sum(s.comm - s.comm_bwd + max(s.fwd, default=0.0) for s in self.stages) + self.step_collectives

    def breakdown(self) -> dict[str, float]:
        """Where the estimate goes: its terms add up to `seconds`, but for the overlapped gradient
        sync (shown beside them: hidden behind the backward)."""
        return {
            "forward_compute": sum(max(s.fwd, default=0.0) for s in self.stages),
            "backward_compute": sum(max(s.bwd, default=0.0) for s in self.stages),
            "communication": sum(s.comm for s in self.stages),
            "gradient_sync": self.grad_sync,
            "gradient_sync_overlapped": sum(b.seconds for b in self.buckets) - self.grad_sync,
            "loss_and_rng_collectives": self.step_collectives,
        }


# -- the algebra of shares ------------------------------------------------------------------------
#
# The walk below prices a program once for all its users. It never looks at the ratios itself:
# it asks an algebra for the devices' shares and for the maxima it needs. NumericShares answers
# with numbers (replay, and the search, which prices each step with the same functions);
# balance/lp.py answers with linear expressions in the ratios and epigraph variables, which
# turns the same walk into the load balancer's LP.


class NumericShares:
    """Shares as numbers: the exact integer shard sizes under `ratios` (what the runtime
    runs), or, with continuous=True, the ratios themselves (what the LP sees)."""

    def __init__(self, cost: CostModel, ratios: Ratios, continuous: bool = False):
        self.cost, self.ratios, self.continuous = cost, ratios, continuous
        self.priced: dict[tuple, tuple] = {}  # node_times of alike nodes
        self.moved: dict[tuple, tuple[float, float]] = {}  # move_price by (tensor, move, segments)
        self._of: dict[tuple[int, int], Sequence[float]] = {}  # (granule count, segment) -> shares
        self._top: dict[tuple[int, int], float] = {}  # (granule count, segment) -> the largest share
        self._active: dict[tuple[int, int], tuple[bool, ...]] = {}  # (granule count, segment) -> shares > 0
        self.read: set[tuple[int, int]] | None = None  # when a set: the (granule count, segment)s `of` is asked for
        self.columns: list[int] | None = None  # every device priced (cf. lp.LPShares.columns)

    def _key(self, tensor: str, dim: int, seg: int) -> tuple[int, int]:
        """What a tensor dim's shares depend on, noted in `read` when that is a set."""
        key = (self.cost.granules(tensor)[dim], seg)
        if self.read is not None:
            self.read.add(key)
        return key

    def of(self, tensor: str, dim: int, seg: int) -> Sequence[float]:
        if self.continuous:
            return self.ratios[seg]
        key = self._key(tensor, dim, seg)
        found = self._of.get(key)
        if found is None:
            found = self._of[key] = self.cost.shares(tensor, dim, self.ratios[seg])
        return found

    def active(self, tensor: str, dim: int, seg: int) -> tuple[bool, ...]:
        if self.continuous:
            return tuple(s > 0 for s in self.ratios[seg])
        key = self._key(tensor, dim, seg)
        found = self._active.get(key)
        if found is None:
            found = self._active[key] = tuple(s > 0 for s in self.of(tensor, dim, seg))
        return found

    def live(self, tensor: str, dim: int, seg: int) -> int:
        return sum(1 for s in self.of(tensor, dim, seg) if s > 0)

    def same_split(self, tensor: str, dim: int, seg_a: int, seg_b: int) -> bool:
        """Whether two segments split the tensor's dim into the same sizes (the runtime's re-split
        then moves nothing). Continuous shares answer as the LP does (lp.LPShares.same_split),
        whose relaxation they price."""
        if seg_a == seg_b:
            return True
        return not self.continuous and list(self.of(tensor, dim, seg_a)) == list(self.of(tensor, dim, seg_b))

    def largest(self, sharded: Sequence[tuple[str, int, int]]) -> float:
        if len(sharded) == 1:
            return self._largest_one(*sharded[0])
        return max(self._largest_one(t, d, s) for t, d, s in sharded)

    def _largest_one(self, tensor: str, dim: int, seg: int) -> float:
        if self.continuous:
            return max(self.ratios[seg])
        key = self._key(tensor, dim, seg)
        found = self._top.get(key)
        if found is None:
            found = self._top[key] = max(self.of(tensor, dim, seg))
        return found

    @staticmethod
    def vmax(values: Sequence[float]) -> float:
        return max(values)

    @staticmethod
    def positive_part(values: Sequence[float]) -> float:
        return max(0.0, *values)


def move_price(cost: CostModel, alg, tensor: str, mv: Move, seg_src: int, seg_dst: int):
    """Forward and backward seconds of a move (seg_src differs from seg_dst only for a rebalance).

    Collectives on a shard are priced by the largest share involved; a grouped all-gather
    (one broadcast per device holding rows) by how many devices hold rows."""
    memo = getattr(alg, "moved", None)  # (NumericShares remembers; the LP's algebra does not)
    if memo is not None and alg.read is None:  # (while `read` notes dependencies, price afresh)
        key = (tensor, mv, seg_src, seg_dst)
        found = memo.get(key)
        if found is None:
            found = memo[key] = _move_price(cost, alg, tensor, mv, seg_src, seg_dst)
        return found
    return _move_price(cost, alg, tensor, mv, seg_src, seg_dst)


def _move_price(cost: CostModel, alg, tensor: str, mv: Move, seg_src: int, seg_dst: int):
    if mv.name == "rebalance" and alg.same_split(tensor, mv.src.dim, seg_src, seg_dst):
        return 0.0, 0.0  # both segments split the tensor alike: nothing moves (collectives.resplit)
    fwd, bwd = move_terms(cost, tensor, mv, seg_src, seg_dst)
    return terms_seconds(cost, alg, fwd), terms_seconds(cost, alg, bwd)


def move_terms(cost: CostModel, tensor: str, mv: Move, seg_src: int, seg_dst: int, nbytes: int | None = None) -> tuple:
    """A move's forward and backward collectives as `collective_terms` (what move_price prices
    under any shares; a rebalance between segments split alike is free, which only the shares
    tell). nbytes: the tensor's, where the caller has it."""
    nbytes = cost.graph.tensors[tensor].nbytes if nbytes is None else nbytes
    return (collective_terms(cost, tensor, nbytes, mv.fwd, mv.src, mv.dst, seg_src, seg_dst),
            collective_terms(cost, tensor, nbytes, mv.bwd, mv.dst, mv.src, seg_dst, seg_src))


def collective_terms(cost: CostModel, tensor: str, nbytes: int, kind: str | None, src: Placement,
                     dst: Placement, seg_src: int, seg_dst: int) -> tuple | None:
    """What a collective's seconds are made of, whatever the shares (terms_seconds prices them):
    None (no collective); (None, nbytes, (tensor, dim, seg)): a grouped all-gather, one broadcast
    per device holding rows of that shard; (const, slope, sharded): const + slope * the largest
    share of the (tensor, dim, seg)s `sharded` (1 where none: the whole tensor)."""
    if kind is None:
        return None
    if kind == "all_gather_grouped":
        p, s = (src, seg_src) if src.is_shard else (dst, seg_dst)
        return None, nbytes, (tensor, p.dim, s)
    cc = cost.comm(kind, nbytes)
    return cc.const, cc.slope, tuple((tensor, p.dim, s) for p, s in ((src, seg_src), (dst, seg_dst)) if p.is_shard)


def terms_seconds(cost: CostModel, alg, terms: tuple | None):
    """The seconds of a collective's `collective_terms` under the shares `alg`."""
    if terms is None:
        return 0.0
    const, slope, sharded = terms
    if const is None:
        return cost.grouped_gather(slope, alg.live(*sharded))
    return linear_seconds(const, slope, alg.largest(sharded) if sharded else 1.0)


def linear_seconds(const, slope, largest):
    """A collective's seconds from its `collective_terms` (const, slope) and the largest share of
    its sharded operands (1.0: the whole tensor): floats here, arrays of every move at once in
    astar._MoveTable."""
    return const + slope * largest


def node_times(cost: CostModel, alg, k: int, st: Strategy, loads: Sequence[Load], seg: int):
    """Forward and backward seconds per device of node k under strategy st: its work at each
    device's share, its fixed cost (a device with no share only keeps books), and a machine's
    internal all-reduce of the gradients of the parameters it uses first (cost.first_used_by)."""
    key = node_key(cost, k, st, loads, seg)
    found = alg.priced.get(key)
    if found is None:
        found = alg.priced[key] = price_node(cost, alg, k, st, loads, seg)
    return found


def node_key(cost: CostModel, k: int, st: Strategy, loads: Sequence[Load], seg: int) -> tuple:
    """What node_times depend on but the shares: nodes alike (CostModel.node_class) under one
    strategy, loads placed alike, in one segment, cost the same."""
    return cost.node_class[k], st, tuple([ld.placement for ld in loads]), seg


def price_node(cost: CostModel, alg, k: int, st: Strategy, loads: Sequence[Load], seg: int):
    """node_times without its memo, for callers that price each (node class, strategy) once."""
    graph = cost.graph
    node = graph.nodes[k]
    # the devices priced: every one, or one of each interchangeable set (LPShares.columns)
    cols = alg.columns
    pick = (lambda xs: xs) if cols is None else (lambda xs: [xs[j] for j in cols])
    fwd, bwd = map(pick, cost.base_times(node))
    shard = cost.work_shard(node, st)
    active = None
    if shard is not None:
        frac = pick(alg.of(shard[0], shard[1], seg))
        fwd = [a * f for a, f in zip(fwd, frac)]
        bwd = [a * f for a, f in zip(bwd, frac)]
        active = alg.active(shard[0], shard[1], seg)  # (every device's: fixed_times reads them all)
    if cost.has_fixed:
        fixed_fwd, fixed_bwd = map(pick, cost.fixed_times(node, active))
        fwd = [a + c for a, c in zip(fwd, fixed_fwd)]
        bwd = [a + c for a, c in zip(bwd, fixed_bwd)]
    if active is not None and not all(active):  # (a device with no share of a random node draws its numbers)
        fwd = [a + c for a, c in zip(fwd, pick(cost.idle_draw(node, active)))]
    if cost.timing is None and any(cost.inv_mem_bw):
        whole = []
        for ld in loads:
            if graph.tensors[ld.tensor].kind != "param":
                continue
            if ld.placement.is_shard:  # each device reads and writes its shard
                pf, pb = map(pick, cost.param_seconds(node, ld.tensor))
                held = pick(alg.of(ld.tensor, ld.placement.dim, seg))
                fwd = [a + c * h for a, c, h in zip(fwd, pf, held)]
                bwd = [a + c * h for a, c, h in zip(bwd, pb, held)]
            else:
                whole.append(ld.tensor)
        if whole:  # whole on every device that computes a share of the node
            pf, pb = cost.whole_params_seconds(node, tuple(whole))
            if active is not None:
                pf, pb = [c if a else 0.0 for c, a in zip(pf, active)], [c if a else 0.0 for c, a in zip(pb, active)]
            fwd = [a + c for a, c in zip(fwd, pick(pf))]
            bwd = [a + c for a, c in zip(bwd, pick(pb))]
    reduced = cost.reduced_at(k) if any(cost.intra_grad) else ()
    if reduced:  # once per parameter, at its first use (a tied one's uses add up, then one reduce)
        left = set(reduced)
        for ld in loads:
            if ld.tensor in left:
                left.discard(ld.tensor)
                local = alg.of(ld.tensor, ld.placement.dim, seg) if ld.placement.is_shard else (1.0,) * cost.m
                bwd = [b + g * s for b, g, s in zip(bwd, pick(cost.grad_intra(graph.tensors[ld.tensor].nbytes)), pick(local))]
    return list(fwd), list(bwd)


@dataclass(slots=True)
class Walked:
    """A program priced by `walk`: numbers, or linear expressions under the LP's algebra."""
    total: Any
    """Iteration seconds but the per-step loss and generator syncs (CostModel.step_overhead)."""
    stages: list[Stage]
    exposed_sync: Any
    buckets: list[Bucket]
    stage_of: dict[int, int]


def walk(program: Sequence[Step], cost: CostModel, segment_of: Sequence[int], alg,
         synced: dict[str, int] | None = None) -> Walked:
    """Price a program: the one walk that replay, the load balancer's LP and (step by step,
    astar._Space.expand) the search share.

    Stages: a stage ends at every move that communicates and at every layer boundary (the
    first node of every chunk, cost.chunk_of); it costs its collectives plus the slowest
    device's forward and backward computation.

    Gradient sync, overlapped with the backward as the runtime runs it (runtime/gradsync.py):
    the trainable parameters the runtime keeps whole (`synced_params`) are all-reduced in one
    bucket per group of layer chunks (cost.bucket_of) of their first use. The backward runs the
    stages in reverse; a bucket is ready when the backward of the stage open at its start is done,
    and buckets are all-reduced one after another as they become ready. With W the backward's
    length, P_c + C_c the backward that follows chunk c's readiness (closed stages before it,
    plus the backward of the collectives opening its stage) and S_c the seconds of the buckets
    0..c, the last bucket ends at W + max_c (S_c - P_c - C_c): the iteration pays
    max(0, that excess) beyond its stages.

    synced: the program's `synced_params`, where the caller has them (they do not depend on the shares).
    """
    graph, chunk_of, bucket_of = cost.graph, cost.chunk_of, cost.bucket_of
    m = cost.m if alg.columns is None else len(alg.columns)  # the devices priced (node_times)
    sync_at: dict[int, float] = {}  # dense gradient bytes all-reduced, by node of first use
    sparse_at: dict[int, list[tuple]] = {}  # sparse gradients' (bytes, seconds), by node of first use
    looked_up = sparse_looked_up(program, cost, segment_of, alg)
    exact = getattr(alg, "continuous", True) is False  # integer shares: numbers, not the LP's expressions
    for name, node in (synced if synced is not None else synced_params(program, graph, segment_of)).items():
        if name in cost.sparse_rows:
            sparse_at.setdefault(node, []).append(cost.sparse_sync(name, looked_up[name], exact))
        else:
            sync_at[node] = sync_at.get(node, 0.0) + cost.sync_bytes(name)
    stages = [Stage(fwd=[0.0] * m, bwd=[0.0] * m)]
    total = 0.0
    backward_done = 0.0  # P: backward seconds of the closed stages, their collectives included
    opening_bwd = 0.0  # C: backward seconds of the collectives that opened the current stage
    anchor, anchor_stage = 0.0, 0  # -(P + C) where the current bucket began, and the stage open there
    bucket_bytes, synced, excess = 0.0, 0.0, []
    bucket_sparse: list[tuple] = []  # the open bucket's sparse gradients: each synced alone, after its dense ones
    buckets: list[Bucket] = []
    stage_of: dict[int, int] = {}

    def close(comm_fwd, comm_bwd, label: str | None) -> None:
        nonlocal total, backward_done, opening_bwd
        cur = stages[-1]
        slowest_bwd = alg.vmax(cur.bwd)
        total = total + alg.vmax(cur.fwd) + slowest_bwd + comm_fwd + comm_bwd
        backward_done = backward_done + slowest_bwd + opening_bwd
        opening_bwd = comm_bwd
        stages.append(Stage(comm=comm_fwd + comm_bwd, comm_bwd=comm_bwd, collectives=[label] if label else [],
                            fwd=[0.0] * m, bwd=[0.0] * m))

    def end_bucket(bucket: int) -> None:
        nonlocal bucket_bytes, synced, bucket_sparse
        if bucket_bytes or bucket_sparse:
            seconds = cost.grad_sync(bucket_bytes) + sum(sec for _, sec in bucket_sparse)
            nbytes = bucket_bytes + sum(b for b, _ in bucket_sparse)
            synced += seconds
            excess.append(synced + anchor)
            buckets.append(Bucket(bucket, nbytes, seconds, anchor_stage))
        bucket_bytes, bucket_sparse = 0.0, []

    prev_seg = segment_of[program[0].node] if program else 0
    prev_node = None
    for step in program:
        k, seg = step.node, segment_of[step.node]
        if prev_node is not None and chunk_of[k] != chunk_of[prev_node]:  # a layer boundary
            close(0.0, 0.0, None)
            if bucket_of[k] != bucket_of[prev_node]:
                end_bucket(bucket_of[prev_node])
                anchor, anchor_stage = -(backward_done + opening_bwd), len(stages) - 1
        prev_node = k
        for ms in step.moves:
            f, b = move_price(cost, alg, ms.tensor, ms.move, prev_seg if ms.move.name == "rebalance" else seg, seg)
            if ms.move.communicates:
                close(f, b, f"{ms.move.name}({ms.tensor})")
        prev_seg = seg
        node = graph.nodes[k]
        inner = cost.variant_comm(node, step.strategy)
        if inner:  # the node synchronizes the devices itself (synchronized batch norm)
            close(0.0, inner, f"{step.strategy.local}({node.name})")
        fwd, bwd = node_times(cost, alg, k, step.strategy, step.loads, seg)
        stage_of[k] = len(stages) - 1
        cur = stages[-1]
        cur.fwd = [a + b for a, b in zip(cur.fwd, fwd)]
        cur.bwd = [a + b for a, b in zip(cur.bwd, bwd)]
        bucket_bytes += sync_at.get(k, 0.0)
        bucket_sparse += sparse_at.get(k, [])
    if prev_node is not None:
        end_bucket(bucket_of[prev_node])
    cur = stages[-1]
    total = total + alg.vmax(cur.fwd) + alg.vmax(cur.bwd)
    exposed = alg.positive_part(excess) if excess else 0.0
    return Walked(total=total + exposed, stages=stages, exposed_sync=exposed, buckets=buckets, stage_of=stage_of)


def replay(program: Sequence[Step], cost: CostModel, segment_of: Sequence[int], ratios: Ratios,
           continuous: bool = False, alg: NumericShares | None = None, terms: list | None = None,
           synced: dict[str, int] | None = None) -> Estimate:
    """Price a program: stages, overlapped gradient sync and memory under `ratios` (integer
    shard sizes; continuous=True: the ratios themselves, as the LP sees them). A caller pricing
    many programs passes `alg`, NumericShares of these ratios that remembers what it priced,
    and the program's `memory_terms` and `synced_params` where it has them."""
    assert alg is None or alg.continuous == continuous  # (ratios of its share signature)
    w = walk(program, cost, segment_of, alg or NumericShares(cost, ratios, continuous), synced)
    return Estimate(seconds=w.total + cost.step_overhead, stages=w.stages, grad_sync=w.exposed_sync,
                    memory=memory(program, cost, segment_of, ratios, terms), buckets=w.buckets, stage_of=w.stage_of,
                    step_collectives=cost.step_overhead)


def sparse_looked_up(program: Sequence[Step], cost: CostModel, segment_of: Sequence[int], alg) -> dict:
    """Per parameter with a sparse gradient, the most ids any device looks up in it per step:
    each lookup's ids split as the program splits them (under `alg`: a number, or the LP's
    expression in the shares)."""
    graph, out = cost.graph, {}
    for step in program:
        node = graph.nodes[step.node]
        if node.op not in LOOKUPS or node.inputs[0] not in cost.sparse_rows:
            continue
        ids, placed = node.inputs[1], step.strategy.inputs[1]
        n = graph.tensors[ids].numel
        most = n * alg.largest([(ids, placed.dim, segment_of[step.node])]) if placed.is_shard else n
        out[node.inputs[0]] = out.get(node.inputs[0], 0.0) + most
    return out


def synced_params(program: Sequence[Step], graph: Graph, segment_of: Sequence[int]) -> dict[str, int]:
    """The trainable parameters whose gradients the runtime all-reduces (those kept whole, once
    however many nodes use them: a tied embedding), with the node of their first use."""
    first: dict[str, int] = {}
    for step in program:
        for ld in step.loads:
            first.setdefault(ld.tensor, step.node)
    return {name: first[name] for name, (p, _) in kept_placements(program, graph, segment_of).items()
            if p == R and graph.tensors[name].kind == "param" and graph.tensors[name].requires_grad}


def synced_bytes(program: Sequence[Step], graph: Graph, segment_of: Sequence[int]) -> float:
    """Bytes of the gradients the runtime synchronizes per step, whole (a sparse one sends only
    its rows: CostModel.sync_bytes prices that)."""
    return float(sum(graph.tensors[name].nbytes for name in synced_params(program, graph, segment_of)))


def sync_buckets(program: Sequence[Step], graph: Graph, segment_of: Sequence[int], bucket_of: Sequence[int]) -> list[list[str]]:
    """The runtime's gradient buckets in the order it launches them (their gradients' arrival:
    the last bucket of `bucket_of` (CostModel.bucket_of) first), parameters within one in
    reverse order of first use."""
    by_chunk: dict[int, list[str]] = {}
    for name, node in sorted(synced_params(program, graph, segment_of).items(), key=lambda kv: (-kv[1], kv[0])):
        by_chunk.setdefault(bucket_of[node], []).append(name)
    return [by_chunk[c] for c in sorted(by_chunk, reverse=True)]


def split_walk(program: Sequence[Step], graph: Graph, segment_of: Sequence[int], held: dict
               ) -> Iterator[tuple[Step, int, list[tuple[MoveStep, int | None]]]]:
    """Walk a program tracking, per (tensor, placement) it holds, the segment whose ratios split
    that value: the segment of the step that loaded, moved or produced it (`held`: what it holds
    at its start, updated in place). Yields per step the step, its segment, and its moves each
    with the segment its source was split at (None: the program does not hold the source there,
    a hand-edited plan). A step's outputs join `held` once the caller's turn is over, so the
    caller sees what the step takes its inputs from. The plan's check and the executor walk
    programs alike through it."""
    for step in program:
        seg = segment_of[step.node]
        moves = []
        for ms in step.moves:  # (the executor runs a step's moves, then its loads)
            moves.append((ms, held.get((ms.tensor, ms.move.src))))
            held[(ms.tensor, ms.move.dst)] = seg
        held.update(((ld.tensor, ld.placement), seg) for ld in step.loads)
        yield step, seg, moves
        held.update(((name, p), seg) for name, p in zip(graph.nodes[step.node].outputs, step.strategy.outputs))


def kept_as(loaded: Placement) -> Placement:
    """How a parameter or buffer loaded in one placement only is kept: so, except that one
    loaded as a partial sum (P: a bias joining a partial sum, whole on one device and zeros on
    the others) is kept whole (R), since each part would take the whole update. A tensor kept
    whole may therefore be loaded as P without a move."""
    return R if loaded == P else loaded


def kept_placements(program: Sequence[Step], graph: Graph, segment_of: Sequence[int]) -> dict[str, tuple[Placement, int]]:
    """How every device keeps each parameter and buffer the program loads: in the one
    placement it is loaded in (with that segment, for its sizes), or whole (R) where it is
    loaded in several or as a partial sum (whose parts would each take the whole update).
    The runtime keeps them so, and the cost model prices memory and gradient sync by it."""
    loaded: dict[str, set[tuple[Placement, int]]] = {}
    for step in program:
        for ld in step.loads:
            if graph.tensors[ld.tensor].kind in ("param", "buffer"):  # whole (R, D, P) is alike in every segment
                seg = segment_of[step.node] if ld.placement.is_shard else 0
                loaded.setdefault(ld.tensor, set()).add((ld.placement, seg))
    kept = {}
    for name, places in loaded.items():
        p, seg = next(iter(places)) if len(places) == 1 else (R, 0)
        p = kept_as(p)
        kept[name] = (p, seg if p.is_shard else 0)  # whole: alike in every segment
    return kept


def memory_terms(program: Sequence[Step], cost: CostModel, segment_of: Sequence[int]):
    """(tensor, placement, segment, bytes, per_gpu) for everything a device keeps.

    per_gpu: parameter state sits whole on every GPU of a machine (data parallel inside it),
    activations divide among them. A parameter loaded in several placements is kept whole.
    Activations are counted as all saved for the backward (an upper bound).
    """
    graph = cost.graph
    act_place: dict[str, set[tuple[Placement, int]]] = {}
    for step in program:
        seg = segment_of[step.node]
        node = graph.nodes[step.node]
        for name, p in zip(node.outputs, step.strategy.outputs):
            act_place.setdefault(name, set()).add((p, seg))
        for ms in step.moves:
            act_place.setdefault(ms.tensor, set()).add((ms.move.dst, seg))
    terms = []
    for name, (p, seg) in kept_placements(program, graph, segment_of).items():
        # kept once, however many nodes use it: a parameter with its gradient and optimizer state, a buffer alone
        t = graph.tensors[name]
        terms.append((name, p, seg, cost.state_bytes(name) if t.kind == "param" else t.nbytes, True))
    for name, places in act_place.items():
        for p, seg in places:
            terms.append((name, p, seg, graph.tensors[name].nbytes, False))
    return terms


def memory(program: Sequence[Step], cost: CostModel, segment_of: Sequence[int], ratios: Ratios,
           terms: list | None = None) -> list[float]:
    """Bytes per GPU on each device: weights, gradients, optimizer states, buffers and activations
    (`terms`: the program's memory_terms, where the caller has them)."""
    m = cost.m
    by_layout: dict[tuple, float] = {}  # (shares or None for whole, whole per GPU) -> bytes
    held = set()
    for name, p, seg, nbytes, whole_per_gpu in terms if terms is not None else memory_terms(program, cost, segment_of):
        local = cost.shares(name, p.dim, ratios[seg]) if p is not None and p.is_shard else None
        if (name, p, local, whole_per_gpu) in held:  # a re-split into the sizes it has is the same tensor (resplit)
            continue
        held.add((name, p, local, whole_per_gpu))
        by_layout[(local, whole_per_gpu)] = by_layout.get((local, whole_per_gpu), 0.0) + nbytes
    total = [0.0] * m
    for (local, whole_per_gpu), nbytes in by_layout.items():
        for j in range(m):
            total[j] += nbytes * (1.0 if local is None else local[j]) / (1 if whole_per_gpu else cost.gpus(j))
    return total


def listing(program: Sequence[Step], graph: Graph) -> list[str]:
    """One line per instruction, in program order."""
    lines = []
    for step in program:
        node = graph.nodes[step.node]
        for ms in step.moves:
            mv = ms.move
            how = mv.fwd or "local"
            dual = f", backward {mv.bwd}" if mv.bwd else ""
            lines.append(f"  {ms.tensor} | {mv.src} -> {mv.dst}   {mv.name} [{how}{dual}]")
        for ld in step.loads:
            kind = graph.tensors[ld.tensor].kind
            verb = "parameter-shard" if kind == "param" else "placeholder-shard"
            lines.append(f"  {ld.tensor} | {ld.placement}   {verb}")
        ins = ", ".join(f"{t}:{p}" for t, p in zip(node.inputs, step.strategy.inputs))
        outs = ", ".join(f"{t}:{p}" for t, p in zip(node.outputs, step.strategy.outputs))
        lines.append(f"{outs} = {node.op.removeprefix('aten.')}({ins})   # {step.strategy.name}")
    return lines
