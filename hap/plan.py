"""The Plan: a synthesized program, its ratios and its estimates, readable and JSON round-trippable.

Everything in a Plan is plain data (names, placements as text, numbers), so a plan written by
`hap plan` can be loaded by the runtime on every rank and checked against the graph there.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .ir import Graph
from .placement import parse
from .rules import Strategy
from .rules.units import ShardClasses
from .search.moves import Move
from .search.program import Load, MoveStep, Step

FORMAT_VERSION = 1


@dataclass(kw_only=True)
class Plan:
    model: str
    cluster: dict
    """The cluster spec (Cluster.to_dict())."""
    devices: list[str]
    segments: list[list[int]]
    """Per segment, [first node index, last node index]."""
    ratios: list[list[float]]
    """ratios[segment][device] from the load balancer."""
    program: list[dict]
    """Per node: strategy, placements of inputs and outputs, leaf loads and preceding moves."""
    splits: dict[str, dict[str, list[int]]]
    """tensor -> dim (as text) -> integer shard sizes per device, for every sharded tensor dim."""
    estimated_iteration_seconds: float
    breakdown: dict[str, float]
    stages: list[dict]
    memory_bytes: list[float]
    baselines: dict[str, dict]
    """dp_ev, dp_cp, tp: {seconds, memory_bytes, ratios, breakdown} under the same cost model."""
    synthesis_seconds: float
    replicated_ops: list[str]
    """Ops without a sharding rule: they run replicated (each listed once)."""
    search: dict = field(default_factory=dict)
    """How the plan was found: rounds, expansions, which candidate won."""
    version: int = FORMAT_VERSION

    # -- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"plan format version {d.get('version')} is not {FORMAT_VERSION}")
        return cls(**d)

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> "Plan":
        text = str(path_or_text)
        if not text.lstrip().startswith("{"):
            text = Path(path_or_text).read_text()
        return cls.from_dict(json.loads(text))

    @property
    def digest(self) -> str:
        """A hash of the program and ratios: ranks compare it at start-up."""
        key = json.dumps({"program": self.program, "ratios": self.ratios, "segments": self.segments}, sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    # -- rebinding to a graph ------------------------------------------------------------------

    def steps(self, graph: Graph) -> list[Step]:
        """The program as Steps over `graph` (which must be the graph the plan was made for)."""
        by_name = {n.name: n for n in graph.nodes}
        steps = []
        for ins in self.program:
            node = by_name.get(ins["node"])
            if node is None or node.op != ins["op"]:
                raise ValueError(f"plan does not match the model: node {ins['node']} ({ins['op']}) not in the graph")
            st = Strategy(tuple(parse(p) for _, p in ins["inputs"]), tuple(parse(p) for _, p in ins["outputs"]),
                          ins["strategy"], ins.get("local"))
            loads = tuple(Load(t, parse(p)) for t, p in ins["loads"])
            moves = tuple(MoveStep(mv["tensor"], Move(mv["name"], parse(mv["src"]), parse(mv["dst"]), mv["fwd"], mv["bwd"]))
                          for mv in ins["moves"])
            steps.append(Step(node.index, st, loads, moves))
        return steps

    # -- text ----------------------------------------------------------------------------------

    def summary(self) -> str:
        lines = [f"model {self.model} on {self.cluster['name']} ({len(self.devices)} devices)",
                 f"  synthesis {self.synthesis_seconds:.2f} s, {self.search.get('rounds', '?')} Q/B rounds, winner: {self.search.get('winner', '?')}"
                 + ("" if self.search.get("exhaustive", True) else " (width-limited search: best found, not proven optimal)"),
                 f"  estimated iteration {self.estimated_iteration_seconds * 1e3:.1f} ms  ("
                 + ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.1f} ms" for k, v in self.breakdown.items()) + ")"]
        for name, b in self.baselines.items():
            speedup = b["seconds"] / self.estimated_iteration_seconds if self.estimated_iteration_seconds else float("nan")
            lines.append(f"  {name:6s} {b['seconds'] * 1e3:9.1f} ms   hap is {speedup:.2f}x" + ("" if b.get("fits", True) else "  (does not fit in memory)"))
        for s, r in enumerate(self.ratios):
            lines.append(f"  ratios segment {s}: " + " ".join(f"{x:.3f}" for x in r))
        lines.append(f"  memory per GPU: {' '.join(_size(b) for b in self.memory_bytes)}")
        kinds: dict[str, int] = {}
        for ins in self.program:
            kinds[ins["strategy"]] = kinds.get(ins["strategy"], 0) + 1
            for mv in ins["moves"]:
                if mv["fwd"] or mv["bwd"]:
                    key = f"{mv['name']}"
                    kinds[key] = kinds.get(key, 0) + 1
        lines.append("  instructions: " + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
        if self.replicated_ops:
            lines.append(f"  replicated (no sharding rule): {', '.join(self.replicated_ops)}")
        return "\n".join(lines)

    def listing(self) -> str:
        out = []
        for ins in self.program:
            for mv in ins["moves"]:
                dual = f", backward {mv['bwd']}" if mv["bwd"] else ""
                out.append(f"  {mv['tensor']} | {mv['src']} -> {mv['dst']}   {mv['name']} [{mv['fwd'] or 'local'}{dual}]")
            for t, p in ins["loads"]:
                out.append(f"  {t} | {p}   load")
            ins_text = ", ".join(f"{t}:{p}" for t, p in ins["inputs"])
            outs_text = ", ".join(f"{t}:{p}" for t, p in ins["outputs"])
            out.append(f"{outs_text} = {ins['op'].removeprefix('aten.')}({ins_text})   # {ins['strategy']}")
        return "\n".join(out)


def _size(nbytes: float) -> str:
    """Bytes in the unit that fits: 812 KiB, 3.4 MiB, 15.2 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def program_to_dicts(steps: list[Step], graph: Graph) -> list[dict]:
    out = []
    for step in steps:
        node = graph.nodes[step.node]
        out.append({
            "node": node.name, "op": node.op, "strategy": step.strategy.name, "local": step.strategy.local,
            "inputs": [[t, str(p)] for t, p in zip(node.inputs, step.strategy.inputs)],
            "outputs": [[t, str(p)] for t, p in zip(node.outputs, step.strategy.outputs)],
            "loads": [[ld.tensor, str(ld.placement)] for ld in step.loads],
            "moves": [{"tensor": ms.tensor, "name": ms.move.name, "src": str(ms.move.src), "dst": str(ms.move.dst),
                       "fwd": ms.move.fwd, "bwd": ms.move.bwd} for ms in step.moves],
        })
    return out


def shard_splits(program: list[Step], graph: Graph, classes: ShardClasses, segment_of, ratios) -> dict:
    """Plan.splits: tensor -> dim (as text) -> integer shard sizes per device, for every tensor dim
    the program shards (the sizes of the last segment that shards it)."""
    out: dict[str, dict[str, list[int]]] = {}

    def note(t, p, seg):
        if p.is_shard:
            out.setdefault(t, {})[str(p.dim)] = classes.split_sizes(t, p.dim, ratios[seg])

    for step in program:
        seg = segment_of[step.node]
        node = graph.nodes[step.node]
        for t, p in zip(node.inputs, step.strategy.inputs):
            note(t, p, seg)
        for t, p in zip(node.outputs, step.strategy.outputs):
            note(t, p, seg)
    return out
