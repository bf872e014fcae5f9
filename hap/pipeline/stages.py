"""Cutting a program into pipeline stages, and splitting a batch into micro-batches.

A pipeline runs the data-parallel program (every activation split on its batch dim,
parameters whole) of each stage's contiguous range of nodes. Running micro-batch m's rows on
a device is then what one device of a data-parallel run does: the rule library's local
variants already compute exact partial results (a mean's part of the global denominator),
so the partial losses of all micro-batches on all devices sum to the one-device loss, and the
gradients summed over them to its gradients. A micro-batch on one device of a stage is a
*piece*: stage s of D_s devices runs M * D_s pieces, in the order (micro-batch, device).

What crosses a cut is a *crossing*: a tensor one stage produces and a later one reads, split
on a dim (its rows travel between the devices that hold them) or replicated (the first device
of the micro-batch sends it whole). Random ops stay exact: each node's random numbers are
drawn once per step, whole, in one device's order, and every piece takes its rows
(pipeline/runtime.py). A node that sums over the whole batch inside its pass (BatchNorm's
statistics, which its forward also writes into running statistics) is exact with one
micro-batch only: the stage's devices then hold the whole batch between them and sum over their
group, as data parallelism does. Some programs cannot be pipelined, and say so in one line:
such a node under several micro-batches, and partial sums crossing a cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..ir import Graph
from ..placement import P, R, Placement, S
from ..rules.nn import sums_in_pass
from ..rules.units import ShardClasses, round_sizes
from ..search.program import Step


@dataclass(frozen=True, slots=True)
class Crossing:
    """A tensor that stage `src` produces in `placement` and stages `dsts` read."""
    tensor: str
    placement: Placement
    src: int
    dsts: tuple[int, ...]
    requires_grad: bool


def stage_of_nodes(cuts: Sequence[int], nodes: int) -> list[int]:
    """The stage of every node when stage k starts at node cuts[k - 1] (cuts ascending, inside)."""
    cuts = list(cuts)
    if cuts != sorted(set(cuts)) or (cuts and (cuts[0] <= 0 or cuts[-1] >= nodes)):
        raise ValueError(f"pipeline cuts {cuts} must be distinct, ascending and inside the {nodes} nodes")
    out, stage = [], 0
    for i in range(nodes):
        while stage < len(cuts) and i >= cuts[stage]:
            stage += 1
        out.append(stage)
    return out


def stage_ranges(cuts: Sequence[int], nodes: int) -> list[tuple[int, int]]:
    """[first, last] node of every stage."""
    bounds = [0, *cuts, nodes]
    return [(bounds[k], bounds[k + 1] - 1) for k in range(len(bounds) - 1)]


def whole_batch_reason(graph: Graph, program: Sequence[Step]) -> str | None:
    """Why the program needs the whole batch in one pass (a pipeline of one micro-batch), or None."""
    for step in program:
        node = graph.nodes[step.node]
        if sums_in_pass(node, step.strategy, graph):
            what = "BatchNorm's statistics" if step.strategy.local == "sync_batch_norm" else "the loss's denominator"
            return f"{node.name} sums over the whole batch in its pass ({what})"
    if graph.buffer_updates:
        name = next(iter(graph.buffer_updates))
        return (f"the forward updates buffer {graph.tensors[name].target or name} once per pass (a pipeline would "
                "update it once per micro-batch)")
    return None


def data_parallel_obstacle(graph: Graph) -> str | None:
    """The first node that data parallelism (inputs split on dim 0, parameters whole, no
    collective on activations) cannot run, and why, or None where every node has a strategy.
    Walks the graph forward with the placements each tensor may have (R for D: the same
    values), as the rules offer them; a whole tensor may be sliced locally."""
    from ..rules import strategy_table

    may: dict[str, set[Placement]] = {}
    for name, t in graph.tensors.items():
        if t.producer < 0:
            may[name] = {S(0)} if name in graph.inputs and t.shape else {R}
    plain = lambda p: R if p.kind == "D" else p  # noqa: E731
    for node, strategies in zip(graph.nodes, strategy_table(graph)):
        fits = [st for st in strategies
                if all(plain(p) in may[x] or (p.is_shard and R in may[x]) for x, p in zip(node.inputs, st.inputs))]
        if not fits:
            held = ", ".join(f"{x} as {'/'.join(sorted(map(str, may[x])))}" for x in dict.fromkeys(node.inputs))
            where = f" in {node.scope}" if node.scope else ""
            return f"{node.name} ({node.op}{where}) has no strategy for {held}"
        for k, name in enumerate(node.outputs):
            may[name] = {plain(st.outputs[k]) for st in fits}
    return None


def check_pipelinable(graph: Graph, program: Sequence[Step], micro_batches: int | None = None) -> None:
    """ValueError, in one line, where micro-batches would change the mathematics (with
    micro_batches None: whatever their count). (Random ops do not: the runtime draws each node's
    random numbers once per step, whole, in one device's order, and gives every micro-batch its
    rows; but for a node whose draws depend on its input's values, bernoulli of probabilities,
    which cannot be drawn before the step: refused.)"""
    from ..rules.local import drawn_replicated
    from ..rules.nn import RECURRENT_STATES

    drawn = next((n for n in graph.nodes if drawn_replicated(n)), None)
    if drawn is not None:
        inside = "for its dropout between layers, inside the op" if drawn.op in RECURRENT_STATES else "from its input's values"
        raise ValueError(f"{drawn.name} ({drawn.op}) draws random numbers {inside}: a pipeline draws every node's "
                         "numbers whole before the step; train this model with hap.HAP")
    why = whole_batch_reason(graph, program)
    if why is not None and micro_batches is not None and micro_batches > 1:
        raise ValueError(f"{why}: a pipeline runs it exactly with 1 micro-batch only, not {micro_batches}")
    placed = {name: p for step in program
              for name, p in zip(graph.nodes[step.node].outputs, step.strategy.outputs)}
    for buf, new in graph.buffer_updates.items():
        if new in placed and not (placed[new] == R or placed[new].kind == "D"):
            how = "as partial sums over the devices" if placed[new] == P else f"split on dim {placed[new].dim}"
            raise ValueError(f"the program computes buffer {graph.tensors[buf].target or buf}'s new value {how} "
                             f"({placed[new]}), and a pipeline stage keeps its buffers whole on each device: train "
                             "this model with hap.HAP")
    for step in program:
        for ms in step.moves:
            if ms.move.communicates:
                node = graph.nodes[step.node]
                raise ValueError(f"the program moves {ms.tensor} by {ms.move.name} before {node.name}: a pipeline stage "
                                 "runs a program without collectives")


def updated_buffer_spans(graph: Graph) -> dict[str, tuple[int, int]]:
    """Per buffer the forward updates (by its target): the first and last node that reads it or
    computes its new value. A pipeline keeps such a span in one stage: that stage updates the
    buffer, and a stage that read it elsewhere would read last step's value."""
    spans = {}
    for buf, new in graph.buffer_updates.items():
        at = [*graph.tensors[buf].consumers, graph.tensors[new].producer]
        spans[graph.tensors[buf].target or buf] = (min(at), max(at))
    return spans


def crossings(graph: Graph, program: Sequence[Step], stage_of: Sequence[int]) -> list[Crossing]:
    """Every tensor that crosses a cut, in the order its producer runs."""
    for target, (first, last) in updated_buffer_spans(graph).items():
        if stage_of[first] != stage_of[last]:
            raise ValueError(f"buffer {target} is read in stage {stage_of[first]} and updated in stage "
                             f"{stage_of[last]}: a pipeline keeps the two in one stage")
    placed: dict[str, Placement] = {}
    for step in program:
        node = graph.nodes[step.node]
        placed.update(zip(node.outputs, step.strategy.outputs))
    out = []
    for node in graph.nodes:
        for name in node.outputs:
            t = graph.tensors[name]
            dsts = tuple(sorted({stage_of[c] for c in t.consumers if stage_of[c] != stage_of[node.index]}))
            if not dsts:
                continue
            p = placed[name]
            if not (p.is_shard or p == R):
                raise ValueError(f"{name} would cross from stage {stage_of[node.index]} to {dsts[0]} in placement {p}: "
                                 "only tensors split on a dim or replicated can; cut elsewhere")
            out.append(Crossing(name, p, stage_of[node.index], dsts, t.requires_grad))
    return out


def micro_batch_granules(granules: int, micro_batches: int) -> list[int]:
    """Granules (batch rows, or groups of them) of each micro-batch: as even as integers allow."""
    if not 1 <= micro_batches <= granules:
        raise ValueError(f"{micro_batches} micro-batches do not fit a batch of {granules} "
                         f"{'row' if granules == 1 else 'rows'}: use 1 to {granules}")
    return round_sizes(granules, [1.0] * micro_batches)


def piece_ratios(micro: Sequence[int], ratios: Sequence[float]) -> list[float]:
    """The share of the batch of every piece (micro-batch m on device d, in that order) of a
    stage whose devices split each micro-batch by `ratios`: exact multiples of 1 / granules, so
    that ShardClasses splits the batch at the same rows on every stage."""
    total = sum(micro)
    return [k / total for mb in micro for k in round_sizes(mb, ratios)]


def device_pieces(granules: int, micro_batches: int, ratios: Sequence[float]) -> list[list[float]]:
    """Per device, its share of the batch in each micro-batch, as the runtime splits them (whole
    granules per piece: piece_ratios). Summed, what the device computes (the ratio itself only
    where the granules divide evenly: 4 rows in 4 micro-batches at 50/50 give [1.0, 0.0]); the
    largest, what it holds of one micro-batch at most (10 rows in 4 at 50/50: 3 3 2 2 rows,
    0.2 of the batch in the first two, where the mean is 0.15)."""
    pieces = piece_ratios(micro_batch_granules(granules, micro_batches), ratios)
    n = len(ratios)
    return [pieces[d::n] for d in range(n)]


def device_shares(granules: int, micro_batches: int, ratios: Sequence[float]) -> list[float]:
    """Each device's share of the batch over all micro-batches (device_pieces, summed)."""
    return [sum(p) for p in device_pieces(granules, micro_batches, ratios)]


def check_aligned(classes: ShardClasses, crossings_: Sequence[Crossing],
                  pieces: Sequence[Sequence[float]], micro_batches: int) -> None:
    """Each micro-batch's rows of every split crossing must be the same on both sides of the cut
    (a tensor whose dim splits in coarser granules than the batch could round differently)."""
    for c in crossings_:
        if not c.placement.is_shard:
            continue
        spans = []
        for s in (c.src, *c.dsts):
            sizes = classes.split_sizes(c.tensor, c.placement.dim, pieces[s])
            per = len(sizes) // micro_batches
            spans.append([sum(sizes[m * per:(m + 1) * per]) for m in range(micro_batches)])
        if any(sp != spans[0] for sp in spans):
            raise ValueError(f"{c.tensor} splits into micro-batches differently on stages {c.src} and {c.dsts}: "
                             f"choose a micro-batch count that divides its dim {c.placement.dim}")


def row_ranges(sizes: Sequence[int], micro_batches: int, m: int) -> list[tuple[int, int]]:
    """(start, length) of every device's rows of micro-batch m, from the pieces' sizes."""
    per = len(sizes) // micro_batches
    start = sum(sizes[: m * per])
    out = []
    for n in sizes[m * per:(m + 1) * per]:
        out.append((start, n))
        start += n
    return out


def overlaps(src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """(source device, destination device, start, length) of every non-empty intersection of two
    splits of the same rows: what each source sends to each destination."""
    out = []
    for i, (a, n) in enumerate(src):
        for j, (b, k) in enumerate(dst):
            lo, hi = max(a, b), min(a + n, b + k)
            if hi > lo:
                out.append((i, j, lo, hi - lo))
    return out


def batch_granules(graph: Graph, classes: ShardClasses, program) -> int:
    """Granules of the batch: of the first data input the program loads split."""
    for step in program:
        for ld in step.loads:
            if ld.tensor in graph.inputs and ld.placement.is_shard:
                return classes.granule_count(ld.tensor, ld.placement.dim)
    raise ValueError("no data input is split on its batch: a pipeline needs a data-parallel program to cut")


def stage_pieces(graph: Graph, classes: ShardClasses, program: Sequence[Step], stage_ratios: Sequence[Sequence[float]],
                 micro_batches: int) -> list[list[float]]:
    """Per stage, the shares of its pieces (piece_ratios), which its shards are cut by: the
    batch (batch_granules of the whole `program`) in `micro_batches`, each split by the stage's ratios."""
    micro = micro_batch_granules(batch_granules(graph, classes, program), micro_batches)
    return [piece_ratios(micro, ratios) for ratios in stage_ratios]
