"""The rule library: Hoare triples for every op, generated from the graph.

A rule is a small pure function registered for one or more op keys. Given a node and the
graph, it returns the node's strategies: each is a Hoare triple
    { inputs[i] | in_placements[i] }  node  { outputs[k] | out_placements[k] }
with a short name ("batch", "column", "row", "heads", ...) and, where the op must run
differently on a shard than on the whole tensor, a `local` variant name that
hap.rules.local implements (e.g. "mean_over_shards" divides a local sum by the global count).

Two strategies hold for every deterministic op and are added here, not by rules:
    all inputs R -> all outputs R   (replicated compute, gradients summed later)
    all inputs D -> all outputs D   (duplicated compute, e.g. sufficient factor broadcasting)
An op without a registered rule gets only these two: it runs replicated and the plan says so.

One file per op family, each rule with its algebraic law as a comment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..ir import Graph, Node, TensorRef, node_signature
from ..placement import D, P, Placement, R, S

__all__ = ["Strategy", "register", "strategies_for", "has_rule", "RULES", "R", "D", "P", "S"]


@dataclass(frozen=True, slots=True)
class Strategy:
    inputs: tuple[Placement, ...]
    """One placement per entry of node.inputs."""
    outputs: tuple[Placement, ...]
    """One placement per entry of node.outputs."""
    name: str = ""
    """What the strategy is called in listings: 'batch', 'column', 'row', 'heads', 'vocab', ..."""
    local: str | None = None
    """A local implementation variant (see hap.rules.local), or None to run the op as is."""
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self):
        # computed once: the planner's memos hash strategies many thousand times a plan
        object.__setattr__(self, "_hash", hash((self.inputs, self.outputs, self.name, self.local)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # rebuilt, not restored: another process hashes strings with another seed
        return Strategy, (self.inputs, self.outputs, self.name, self.local)

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.inputs))
        outs = ", ".join(map(str, self.outputs))
        return f"{self.name or '?'}: ({ins}) -> ({outs})"


RuleFn = Callable[[Node, Graph], list[Strategy]]
RULES: dict[str, RuleFn] = {}

# Ops whose output depends on a random generator: replicated compute needs the same seed on
# every device and sharded compute a mask drawn for the whole tensor (the runtime's job). These
# draw values that depend on their input's shape only (rules/local._random draws them whole);
# any other op torch tags nondeterministic_seeded (bernoulli of probabilities, normal about
# given means, multinomial) runs replicated on the ranks' common generator (rules/local.is_random).
RANDOM_OPS = {"aten.dropout.default", "aten.native_dropout.default", "aten.bernoulli.p",
              "aten.rand_like.default", "aten.randn_like.default", "aten.feature_dropout.default",
              "aten.uniform.default", "aten.normal_functional.default", "aten.randint_like.default",
              "aten.randint_like.low_dtype", "aten.exponential.default", "aten.geometric.default",
              "aten.cauchy.default", "aten.log_normal.default",
              # factories: a tensor from nothing (stochastic depth's mask)
              "aten.rand.default", "aten.randn.default", "aten.randint.default", "aten.randint.low",
              "aten.randperm.default"}


def register(*ops: str) -> Callable[[RuleFn], RuleFn]:
    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            if op in RULES:
                raise ValueError(f"two rules registered for {op}")
            RULES[op] = fn
        return fn

    return deco


def has_rule(op: str) -> bool:
    _load_families()
    return op in RULES


def strategies_for(node: Node, graph: Graph, short_shards: bool = False) -> list[Strategy]:
    """All valid strategies of `node`: its rule's, then replicated and duplicated compute.

    short_shards: also those that shard dims shorter than 2, which the planner never chooses
    but a program planned for a longer dim may meet at run time (a last batch of one row
    under a batch-sharded plan: one device holds it, the others empty shards)."""
    out: list[Strategy] = []
    seen = set()
    facts = _tensor_facts(node, graph)
    for raw in _raw_strategies(node, graph):
        st = _canonical(raw, node, facts, short_shards)
        if st is not None and (st.inputs, st.outputs) not in seen:
            seen.add((st.inputs, st.outputs))
            out.append(st)
    return out


def _raw_strategies(node: Node, graph: Graph) -> list[Strategy]:
    """The rule's strategies as it wrote them, then replicated and duplicated compute."""
    _load_families()
    rule = RULES.get(node.op)
    found = rule(node, graph) if rule is not None else []
    if found:
        from .local import drawn_replicated  # (local reads the rules)

        if drawn_replicated(node):  # its draws depend on its inputs' values: one whole draw per device
            found = []
    return [*found, _uniform(node, R, "replicated"), _uniform(node, D, "duplicated")]


def gradient_placement(node: Node, graph: Graph, st: Strategy, name: str, short_shards: bool = False) -> Placement:
    """The placement input `name` of `node` takes in `st` were it to carry a gradient. The
    planner took it for data (no gradient) and wrote R for the rule's D; given with
    requires_grad at run time (a saliency map's input), it is D where the strategy duplicates
    the computation over it (every device ends with its whole gradient), R where each device's
    is a part (summed over devices)."""
    i = node.inputs.index(name)
    if st.inputs[i] != R or graph.tensors[name].requires_grad:
        return st.inputs[i]
    facts = _tensor_facts(node, graph)
    for raw in _raw_strategies(node, graph):  # the first that gives st, as strategies_for keeps the first
        found = _canonical(raw, node, facts, short_shards)
        if found is not None and (found.inputs, found.outputs) == (st.inputs, st.outputs):
            return raw.inputs[i]  # (R or D: the rule's own)
    return st.inputs[i]


def strategy_table(graph: Graph) -> list[list[Strategy]]:
    """Per node (by index), its strategies (strategies_for); nodes with the same signature
    (ir.node_signature) share one list. The planner, the cost model and the runtime all read
    the rules through this."""
    memo: dict[tuple, list[Strategy]] = {}
    table = []
    for node in graph.nodes:
        key = node_signature(node, graph)
        if key not in memo:
            memo[key] = strategies_for(node, graph)
        table.append(memo[key])
    return table


def _uniform(node: Node, p: Placement, name: str) -> Strategy:
    return Strategy(tuple(p for _ in node.inputs), tuple(p for _ in node.outputs), name)


def _tensor_facts(node: Node, graph: Graph) -> tuple[list, list]:
    """Per input and per output of `node`: (name, shape, floating, requires_grad), what
    _canonical reads of each of the node's strategies."""
    def facts(name):
        t = graph.tensors[name]
        return name, t.shape, t.dtype.startswith(("float", "bfloat", "complex")), t.requires_grad
    return [facts(x) for x in node.inputs], [facts(x) for x in node.outputs]


def _canonical(st: Strategy, node: Node, facts: tuple[list, list], short_shards: bool = False) -> Strategy | None:
    """Check shape sanity, write R for D on tensors that carry no gradient, drop impossible ones
    (`facts`: _tensor_facts of the node)."""
    assert len(st.inputs) == len(node.inputs), f"{node.op}: rule gave {len(st.inputs)} input placements for {len(node.inputs)} inputs"
    assert len(st.outputs) == len(node.outputs), f"{node.op}: rule gave {len(st.outputs)} output placements for {len(node.outputs)} outputs"
    ins, outs = [], []
    for tensors, places, acc in ((facts[0], st.inputs, ins), (facts[1], st.outputs, outs)):
        for (name, shape, floating, requires_grad), p in zip(tensors, places):
            if p.is_shard:
                assert p.dim < len(shape), f"{node.op}: S({p.dim}) on rank-{len(shape)} tensor {name}"
                if shape[p.dim] < 2 and not short_shards:
                    return None  # a length-1 dim is never sharded: the tensor stays whole (and its gradient summed)
            elif p.kind == "P" and not floating:
                return None  # integer partial sums are not supported
            elif p.kind == "D" and not requires_grad:
                p = R
            acc.append(p)
    placed: dict[str, Placement] = {}
    for name, p in zip(node.inputs, ins):  # one tensor given twice (w @ w) is one value on a device: one placement
        if placed.setdefault(name, p) != p:
            return None
    ins, outs = tuple(ins), tuple(outs)
    return st if ins == st.inputs and outs == st.outputs else Strategy(ins, outs, st.name, st.local)


_loaded = False


def _load_families() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        from . import elementwise, matmul, nn, reduction, shape  # noqa: F401  (registers rules)


# ---------------------------------------------------------------------------------------------
# Small helpers for rule functions.


def arg(node: Node, pos: int, name: str, default=None):
    """The node's argument by position or keyword."""
    if pos < len(node.args):
        return node.args[pos]
    return node.kwargs.get(name, default)


def shape_of(graph: Graph, ref) -> tuple[int, ...]:
    return graph.tensors[ref.name if isinstance(ref, TensorRef) else ref].shape


def ndim(graph: Graph, ref) -> int:
    return len(shape_of(graph, ref))


def norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d

