"""Auto-MAP's propagation (seed 004, section 3.2) on hap's IR, with hap's rule library as the
derivation rules.

Every tensor has a *layout*: whole (W: R or D, the same forward values), partial (P) or split on
one dim (S(d)). A node may run one of its rule strategies when every input can take the
strategy's layout. The derivations that need no choice of the user are the only ones allowed
between a producer and a consumer:

    same layout       as is
    P -> W            the all-reduce that closes a contraction (Megatron's g)
    W -> S(d)         a local slice

Anything else (gathering a split tensor, re-splitting it on another dim, scattering a partial
sum) violates the derivation rules: a conflict. Decided variables (the parameters in the
operator-partitioning task, the inputs in the data-parallel one) are used exactly in their
decided layout, but that a whole one may join a partial sum as P (a bias added once, on one
device: hap's zero_partial). Propagation is arc consistency over these constraints: it narrows each
tensor's possible layouts and each node's strategies until nothing changes, and ends as the
paper's does: (1) not enough information (some decided variable still has several layouts),
(2) a conflict (a node has no strategy left), (3) everything inferred without conflict.

    prop = Propagation(graph, devices=8, decided=graph.params, data=graph.inputs)
    doms, outcome = prop.initial()
    doms, outcome = prop.decide(doms, "p_fc1_weight", 0)     # split on dim 0; None: whole
    doms, outcome = prop.exclude(doms, "p_fc2_weight", 1)    # not split on dim 1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

from ..ir import Graph
from ..placement import Placement
from ..rules import strategy_table

WHOLE, PARTIAL = 0, 1
"""Layout codes: W = 0, P = 1, S(d) = 2 + d."""

Outcome = Literal["insufficient", "conflict", "complete"]


def layout_of(p: Placement) -> int:
    return WHOLE if p.kind in ("R", "D") else PARTIAL if p.kind == "P" else 2 + p.dim


def layout_name(code: int) -> str:
    return "W" if code == WHOLE else "P" if code == PARTIAL else f"S({code - 2})"


def derivable(src: int, dst: int) -> bool:
    """May a tensor produced in layout src be consumed in layout dst without a conflict."""
    return src == dst or (src == PARTIAL and dst == WHOLE) or (src == WHOLE and dst >= 2)


def _stored(used: int) -> int:
    """The layout a decided variable must have to be used in layout `used`."""
    return WHOLE if used == PARTIAL else used


@dataclass(frozen=True, slots=True)
class Domains:
    """Possible layouts per tensor (by id) and the live strategies per node: one propagation state."""

    layouts: tuple[frozenset[int], ...]
    alive: tuple[frozenset[int], ...]


class Propagation:
    """Derivation over one graph. `decided`: the variables the search decides (used exactly in
    their layout); `whole`: leaves used whole (the parameters in data parallelism); `data`:
    leaves that are whole but may be sliced locally (the inputs in operator partitioning).
    Dims smaller than `devices` cannot be split across all devices."""

    def __init__(self, graph: Graph, devices: int, decided: Sequence[str], whole: Iterable[str] = (),
                 data: Iterable[str] = ()):
        self.graph = graph
        self.names = list(graph.tensors)
        self.tid = {n: i for i, n in enumerate(self.names)}
        self.decided = [self.tid[n] for n in decided]
        self.exact = set(self.decided) | {self.tid[n] for n in whole}
        table = strategy_table(graph)
        # per node: strategies as (input layouts, output layouts)
        self.strategies = [[(tuple(map(layout_of, s.inputs)), tuple(map(layout_of, s.outputs))) for s in sts]
                           for sts in table]
        self.node_inputs = [tuple(self.tid[t] for t in n.inputs) for n in graph.nodes]
        self.node_outputs = [tuple(self.tid[t] for t in n.outputs) for n in graph.nodes]
        self.users = [[] for _ in self.names]  # tensor id -> nodes reading or producing it
        for k, n in enumerate(graph.nodes):
            for t in {*self.node_inputs[k], *self.node_outputs[k]}:
                self.users[t].append(k)
        init, data = [], set(data)
        for name in self.names:
            t = graph.tensors[name]
            if name in data or (self.tid[name] in self.exact and name not in decided):
                init.append(frozenset({WHOLE}))
            else:
                init.append(frozenset({WHOLE, PARTIAL if not t.is_leaf else WHOLE,
                                       *(2 + d for d, size in enumerate(t.shape) if size >= devices)}))
        self.devices = devices
        self._init = Domains(tuple(init), tuple(frozenset(range(len(s))) for s in self.strategies))
        self._start: tuple[Domains, Outcome] | None = None

    def splittable(self, name: str) -> list[int]:
        """Dims of a decided variable that can be split across all devices."""
        return [c - 2 for c in sorted(self._init.layouts[self.tid[name]]) if c >= 2]

    def initial(self) -> tuple[Domains, Outcome]:
        """Propagation from no decision (rules alone may already narrow layouts)."""
        if self._start is None:
            self._start = self.run(self._init, range(len(self.strategies)))
        return self._start

    def restrict(self, doms: Domains, name: str, keep: frozenset[int]) -> tuple[Domains, Outcome]:
        """Narrow `name`'s layouts to `keep` and propagate."""
        t = self.tid[name]
        layouts = list(doms.layouts)
        layouts[t] = layouts[t] & keep
        if not layouts[t]:
            return Domains(tuple(layouts), doms.alive), "conflict"
        return self.run(Domains(tuple(layouts), doms.alive), self.users[t])

    def decide(self, doms: Domains, name: str, dim: int | None) -> tuple[Domains, Outcome]:
        """Split `name` on `dim` (None: keep it whole)."""
        return self.restrict(doms, name, frozenset({WHOLE if dim is None else 2 + dim}))

    def exclude(self, doms: Domains, name: str, dim: int) -> tuple[Domains, Outcome]:
        """`name` is not split on `dim` (replicated along it)."""
        return self.restrict(doms, name, doms.layouts[self.tid[name]] - {2 + dim})

    def run(self, doms: Domains, nodes: Iterable[int]) -> tuple[Domains, Outcome]:
        """Arc consistency from the given nodes until nothing changes."""
        layouts, alive = list(doms.layouts), list(doms.alive)
        work, queued = list(nodes), set(nodes)
        while work:
            k = work.pop()
            queued.discard(k)
            ins, outs, sts = self.node_inputs[k], self.node_outputs[k], self.strategies[k]
            keep = frozenset(i for i in alive[k] if self._fits(sts[i], ins, outs, layouts))
            if not keep:
                alive[k] = keep
                return Domains(tuple(layouts), tuple(alive)), "conflict"
            alive[k] = keep
            changed = set()
            for pos, t in enumerate(ins):
                if t in self.exact:
                    new = layouts[t] & {_stored(sts[i][0][pos]) for i in keep}
                else:
                    new = frozenset(src for src in layouts[t] if any(derivable(src, sts[i][0][pos]) for i in keep))
                if new != layouts[t]:
                    layouts[t] = new
                    changed.add(t)
            for pos, t in enumerate(outs):
                new = layouts[t] & {sts[i][1][pos] for i in keep}
                if new != layouts[t]:
                    layouts[t] = new
                    changed.add(t)
            for t in changed:
                if not layouts[t]:
                    return Domains(tuple(layouts), tuple(alive)), "conflict"
                for u in self.users[t]:
                    if u not in queued:
                        queued.add(u)
                        work.append(u)
        out = Domains(tuple(layouts), tuple(alive))
        return out, ("complete" if all(len(layouts[t]) == 1 for t in self.decided) else "insufficient")

    def _fits(self, st, ins, outs, layouts) -> bool:
        for need, t in zip(st[0], ins):
            if t in self.exact:
                if _stored(need) not in layouts[t]:
                    return False
            elif not any(derivable(src, need) for src in layouts[t]):
                return False
        return all(need in layouts[t] for need, t in zip(st[1], outs))

    def layouts(self, doms: Domains, name: str) -> frozenset[int]:
        return doms.layouts[self.tid[name]]

    def split_count(self, doms: Domains) -> int:
        """Tensors that can only be split (ADP's objective: the more, the better)."""
        return sum(1 for ls in doms.layouts if ls and all(c >= 2 for c in ls))
