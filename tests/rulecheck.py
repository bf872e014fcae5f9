"""Shared by the rule tests: check every strategy of the nodes running given ops."""

from hap.rules import strategies_for
from hap.rules.check import check_strategy
from hap.rules.units import ShardClasses

RATIOS = ([0.6, 0.4], [0.55, 0.3, 0.15], [0.0, 0.6, 0.4])  # adversarial uneven splits; an idle rank 0


def check_ops(graph, ops) -> dict:
    """Check every strategy of every node running one of `ops` under RATIOS; return {op: [nodes]}."""
    table = [(n.index, strategies_for(n, graph)) for n in graph.nodes]
    classes = ShardClasses(graph, table)
    found = {op: [n for n in graph.nodes if n.op == op] for op in ops}
    assert all(found.values()), f"not captured: {[op for op, ns in found.items() if not ns]}"
    for nodes in found.values():
        for n in nodes:
            for st in table[n.index][1]:
                for ratios in RATIOS:
                    check_strategy(n, graph, st, ratios, classes)
    return found
