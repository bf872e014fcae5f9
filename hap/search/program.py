"""Distributed programs and their cost under given sharding ratios.

A program is the single-device program's nodes in order, each preceded by the layout moves
its inputs need and with its leaf inputs (parameters, data) loaded in the placements its
strategy asks for:

    step  = moves before the node + loads (parameter-shard / placeholder-shard) + the node

Execution is split in stages at every move that communicates (HAP section 3.2): all devices
synchronise there. A stage costs its collectives plus, for the forward and the backward
separately, the largest computation time over devices. The gradients of replicated
parameters are all-reduced in one bucket after the backward.

`replay` prices a fixed program under any ratios with exact integer shard sizes; the search
prices the same steps incrementally with the same functions, so the two always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..cost.model import CostModel
from ..ir import Graph
from ..placement import P, R, Placement
from ..rules import Strategy
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
    comm: float = 0.0
    """Seconds of collectives (forward and backward) that open this stage."""
    collectives: list[str] = field(default_factory=list)
    fwd: list[float] = field(default_factory=list)
    """Forward computation seconds per device."""
    bwd: list[float] = field(default_factory=list)
    """Backward computation seconds per device."""

    @property
    def seconds(self) -> float:
        return self.comm + max(self.fwd, default=0.0) + max(self.bwd, default=0.0)


@dataclass(slots=True)
class Estimate:
    seconds: float
    stages: list[Stage]
    grad_sync: float
    memory: list[float]
    """Peak bytes per GPU on each device (weights, gradients, optimizer states, activations)."""

    def breakdown(self) -> dict[str, float]:
        return {
            "forward_compute": sum(max(s.fwd, default=0.0) for s in self.stages),
            "backward_compute": sum(max(s.bwd, default=0.0) for s in self.stages),
            "communication": sum(s.comm for s in self.stages),
            "gradient_sync": self.grad_sync,
        }


def move_seconds(cost: CostModel, tensor: str, mv: Move, ratios_before: Sequence[float], ratios: Sequence[float]) -> tuple[float, float]:
    """Forward and backward seconds of a move; ratios_before differ from ratios only for rebalances."""
    nbytes = cost.graph.tensors[tensor].nbytes

    def seconds(kind: str | None, src: Placement, dst: Placement, r_src, r_dst) -> float:
        if kind is None:
            return 0.0
        shares = []
        if src.is_shard:
            shares.append(max(cost.shares(tensor, src.dim, r_src)))
        if dst.is_shard:
            shares.append(max(cost.shares(tensor, dst.dim, r_dst)))
        if kind == "all_gather_grouped":
            sh = cost.shares(tensor, (src if src.is_shard else dst).dim, r_src if src.is_shard else r_dst)
            return cost.comm_time(kind, nbytes, sh)
        return cost.comm(kind, nbytes).at(max(shares, default=1.0))

    fwd = seconds(mv.fwd, mv.src, mv.dst, ratios_before, ratios)
    bwd = seconds(mv.bwd, mv.dst, mv.src, ratios, ratios_before)
    return fwd, bwd


def step_compute(cost: CostModel, step_node: int, st: Strategy, loads: Sequence[Load], ratios: Sequence[float]):
    """(forward per device, backward per device, bytes of replicated-parameter gradients). The
    search's view of gradient sync, one step at a time: a parameter loaded R at its first use.
    Pricing a whole program counts what the runtime syncs instead (`synced_bytes`)."""
    graph = cost.graph
    node = graph.nodes[step_node]
    fwd, bwd = cost.base_times(node)
    shard = cost.work_shard(node, st)
    frac = None
    if shard is not None:
        frac = cost.shares(shard[0], shard[1], ratios)
        fwd = tuple(a * f for a, f in zip(fwd, frac))
        bwd = tuple(a * f for a, f in zip(bwd, frac))
    if cost.has_fixed:
        fixed_fwd, fixed_bwd = cost.fixed_times(node, frac)
        fwd = tuple(a + c for a, c in zip(fwd, fixed_fwd))
        bwd = tuple(a + c for a, c in zip(bwd, fixed_bwd))
    sync_bytes = 0.0
    for ld in loads:
        t = graph.tensors[ld.tensor]
        if t.kind != "param" or not t.requires_grad:
            continue
        if ld.placement.kind == "R" and t.consumers[0] == step_node:  # a shared parameter: once
            sync_bytes += t.nbytes
        local = cost.shares(ld.tensor, ld.placement.dim, ratios) if ld.placement.is_shard else (1.0,) * cost.m
        if any(cost.intra_grad):
            bwd = tuple(b + g * s for b, g, s in zip(bwd, cost.grad_intra(t.nbytes), local))
    return fwd, bwd, sync_bytes


def replay(program: Sequence[Step], cost: CostModel, segment_of: Sequence[int], ratios: Ratios,
           cuts: Sequence[int] = ()) -> Estimate:
    """Price a program exactly: stages, gradient sync and memory under `ratios`.

    cuts: also start a stage before these nodes (the layer-cut search's pricing, an upper
    bound on the exact cost)."""
    m = cost.m
    stages = [Stage(fwd=[0.0] * m, bwd=[0.0] * m)]
    prev_seg = segment_of[program[0].node] if program else 0
    cut_set = set(cuts)
    for step in program:
        seg = segment_of[step.node]
        if step.node in cut_set:
            stages.append(Stage(fwd=[0.0] * m, bwd=[0.0] * m))
        for ms in step.moves:
            before = ratios[prev_seg] if ms.move.name == "rebalance" else ratios[seg]
            f, b = move_seconds(cost, ms.tensor, ms.move, before, ratios[seg])
            if ms.move.communicates:
                stages.append(Stage(comm=f + b, collectives=[f"{ms.move.name}({ms.tensor})"], fwd=[0.0] * m, bwd=[0.0] * m))
        prev_seg = seg
        inner = cost.variant_comm(cost.graph.nodes[step.node], step.strategy)
        if inner:  # the node synchronizes the devices itself (synchronized batch norm)
            stages.append(Stage(comm=inner, collectives=[f"{step.strategy.local}({cost.graph.nodes[step.node].name})"],
                                fwd=[0.0] * m, bwd=[0.0] * m))
        fwd, bwd, _ = step_compute(cost, step.node, step.strategy, step.loads, ratios[seg])
        cur = stages[-1]
        cur.fwd = [a + b for a, b in zip(cur.fwd, fwd)]
        cur.bwd = [a + b for a, b in zip(cur.bwd, bwd)]
    grad_sync = cost.step_sync(synced_bytes(program, cost.graph, segment_of))
    total = sum(s.seconds for s in stages) + grad_sync
    return Estimate(seconds=total, stages=stages, grad_sync=grad_sync, memory=memory(program, cost, segment_of, ratios))


def kept_placements(program: Sequence[Step], graph: Graph, segment_of: Sequence[int]) -> dict[str, tuple[Placement, int]]:
    """How every device keeps each parameter and buffer the program loads: in the one
    placement it is loaded in (with that segment, for its sizes), or whole (R) where it is
    loaded in several or as a partial sum (whose parts would each take the whole update).
    The runtime keeps them so, and the cost model prices memory and gradient sync by it."""
    loaded: dict[str, set[tuple[Placement, int]]] = {}
    for step in program:
        for ld in step.loads:
            if graph.tensors[ld.tensor].kind in ("param", "buffer"):
                loaded.setdefault(ld.tensor, set()).add((ld.placement, segment_of[step.node]))
    kept = {}
    for name, places in loaded.items():
        p, seg = next(iter(places)) if len(places) == 1 else (R, 0)
        kept[name] = (R, 0) if p == P else (p, seg)
    return kept


def synced_bytes(program: Sequence[Step], graph: Graph, segment_of: Sequence[int]) -> float:
    """Bytes of gradient the step all-reduces: each trainable parameter kept whole, once however
    many nodes use it (a tied embedding)."""
    return float(sum(graph.tensors[name].nbytes for name, (p, _) in kept_placements(program, graph, segment_of).items()
                     if p == R and graph.tensors[name].kind == "param" and graph.tensors[name].requires_grad))


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
        if graph.tensors[name].kind == "param":  # kept once, however many nodes use it
            terms.append((name, p, seg, graph.tensors[name].nbytes * cost.state_factor, True))
    for name, places in act_place.items():
        for p, seg in places:
            terms.append((name, p, seg, graph.tensors[name].nbytes, False))
    return terms


def memory(program: Sequence[Step], cost: CostModel, segment_of: Sequence[int], ratios: Ratios) -> list[float]:
    """Bytes per GPU on each device: weights, gradients, optimizer states and activations."""
    m = cost.m
    total = [0.0] * m
    for name, p, seg, nbytes, whole_per_gpu in memory_terms(program, cost, segment_of):
        local = cost.shares(name, p.dim, ratios[seg]) if p is not None and p.is_shard else (1.0,) * m
        total = [a + nbytes * s / (1 if whole_per_gpu else cost.gpus(j)) for j, (a, s) in enumerate(zip(total, local))]
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
