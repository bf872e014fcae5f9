"""Matmul-like ops: one einsum-driven generator for linear, mm, bmm, matmul, addmm, einsum.

For an einsum with output subscripts `out`, every index letter gives one strategy:
  * a letter kept in the output (batch, rows, columns, experts, heads): shard it on every
    operand that has it, replicate operands that lack it; the output is sharded on it.
    Law: the computation is independent along a kept index, so
         einsum(A[..i_j..], B) = concat_j einsum(A_j, B)   (B has no i).
  * a contracted letter (the reduction dim): shard it on every operand that has it; the
    output is a partial sum.
    Law: sum_k A[i,k] B[k,j] = sum_devices (sum_{k in shard} A[i,k] B[k,j]).
An additive operand (linear's bias, addmm's input) follows the output: sharded where the
output is sharded on a letter it has, replicated where it lacks that letter, and a partial
sum when the output is one (b = b + 0 + ... + 0: the bias is added on one device only).
Replicated compute (R, and D for sufficient factor broadcasting) comes from the registry.
"""

from __future__ import annotations

from ..ir import Graph, Node
from . import P, R, S, Strategy, arg, ndim, register

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def einsum_strategies(operands: list[str], addend: str | None, out: str, names: dict[str, str] | None = None) -> list[Strategy]:
    """Strategies for out = einsum(operands) (+ addend). `names` labels letters ('column', ...)."""
    names = names or {}
    letters = dict.fromkeys(ch for s in operands for ch in s)
    found = []
    for ch in letters:
        if any(s.count(ch) > 1 for s in (*operands, addend or "")):
            continue  # a diagonal (einsum "bii->bi"): sharding one of its dims leaves the other whole
        if ch in out:
            ins = [S(s.index(ch)) if ch in s else R for s in operands]
            o = S(out.index(ch))
            if addend is not None:
                ins.append(S(addend.index(ch)) if ch in addend else R)
            found.append(Strategy(tuple(ins), (o,), names.get(ch, f"shard-{ch}")))
        else:
            holders = [s for s in operands if ch in s]
            if len(holders) < 1:
                continue
            ins = [S(s.index(ch)) if ch in s else R for s in operands]
            if addend is not None:
                ins.append(P)
            found.append(Strategy(tuple(ins), (P,), names.get(ch, f"reduce-{ch}")))
    # Partial-sum operands: einsum is linear in each operand, so a partial operand times
    # replicated others is a partial result:  (sum_j A_j) B = sum_j (A_j B).
    for i in range(len(operands)):
        ins = [P if k == i else R for k in range(len(operands))]
        if addend is not None:
            ins.append(P)
        found.append(Strategy(tuple(ins), (P,), f"partial-operand-{i}"))
    return found


def _batch_letters(n: int, taken: str) -> str:
    free = [c for c in _LETTERS if c not in taken]
    return "".join(free[:n])


@register("aten.linear.default")
def linear(node: Node, graph: Graph) -> list[Strategy]:
    # y[..., o] = sum_i x[..., i] W[o, i] + b[o]
    x = arg(node, 0, "input")
    lead = _batch_letters(ndim(graph, x) - 1, "io")
    has_bias = arg(node, 2, "bias") is not None
    names = {"i": "row", "o": "column"}
    if lead:
        names[lead[0]] = "batch"
    return einsum_strategies([lead + "i", "oi"], "o" if has_bias else None, lead + "o", names)


@register("aten.mm.default")
def mm(node: Node, graph: Graph) -> list[Strategy]:
    return einsum_strategies(["ik", "kj"], None, "ij", {"i": "rows", "k": "reduce", "j": "columns"})


@register("aten.bmm.default")
def bmm(node: Node, graph: Graph) -> list[Strategy]:
    return einsum_strategies(["bik", "bkj"], None, "bij", {"b": "batch", "i": "rows", "k": "reduce", "j": "columns"})


@register("aten.addmm.default")
def addmm(node: Node, graph: Graph) -> list[Strategy]:
    # out = beta * bias + alpha * (m1 @ m2); bias broadcasts over rows when it is 1-D.
    bias_rank = ndim(graph, arg(node, 0, "self"))
    bias = "j" if bias_rank == 1 else "ij"[2 - bias_rank:]
    sts = einsum_strategies(["ik", "kj"], bias, "ij", {"i": "rows", "k": "reduce", "j": "columns"})
    # node.inputs order is (bias, m1, m2): move the addend placement to the front.
    return [Strategy((st.inputs[2], st.inputs[0], st.inputs[1]), st.outputs, st.name) for st in sts]


@register("aten.matmul.default")
def matmul(node: Node, graph: Graph) -> list[Strategy]:
    a_rank, b_rank = ndim(graph, node.inputs[0]), ndim(graph, node.inputs[1])
    if a_rank < 2 or b_rank < 2:
        return []  # vector cases: replicated only
    batch = max(a_rank, b_rank) - 2
    lead = _batch_letters(batch, "ikj")
    a = lead[batch - (a_rank - 2):] + "ik"
    b = lead[batch - (b_rank - 2):] + "kj"
    a_shape, b_shape = graph.tensors[node.inputs[0]].shape, graph.tensors[node.inputs[1]].shape
    # A broadcast (size-1) batch dim must not be sharded on that operand: rename it away.
    a = _drop_broadcast(a, a_shape, b, b_shape)
    b = _drop_broadcast(b, b_shape, a, a_shape)
    return einsum_strategies([a, b], None, lead + "ij", {"i": "rows", "k": "reduce", "j": "columns"})


def _drop_broadcast(sub: str, shape, other: str, other_shape) -> str:
    out = []
    for ch, n in zip(sub, shape):
        if ch in other and n == 1 and other_shape[other.index(ch)] != 1:
            out.append(_LETTERS[-1 - len(out)])  # a private letter: never sharded jointly
        else:
            out.append(ch)
    return "".join(out)


@register("aten.einsum.default")
def einsum(node: Node, graph: Graph) -> list[Strategy]:
    eq = arg(node, 0, "equation").replace(" ", "")
    lhs, _, out = eq.partition("->")
    subs = lhs.split(",")
    if "->" not in eq:
        return []  # implicit output: replicated only
    shapes = [graph.tensors[t].shape for t in node.inputs]
    if len(subs) != len(shapes):
        return []
    if "..." in eq:  # the ellipsis as letters of their own, right-aligned as it broadcasts
        spans = [len(shp) - len(s.replace("...", "")) for s, shp in zip(subs, shapes)]
        lead = _batch_letters(max(spans), eq)
        subs = [s.replace("...", lead[len(lead) - k:]) for s, k in zip(subs, spans)]
        out = out.replace("...", lead)
    for s, shp in zip(subs, shapes):
        for ch, n in zip(s, shp):
            # A letter whose size differs across operands is broadcasting: never shard it.
            for s2, shp2 in zip(subs, shapes):
                if ch in s2 and shp2[s2.index(ch)] != n:
                    return [st for st in einsum_strategies(subs, None, out) if _avoids(st, subs, ch)]
    return einsum_strategies(subs, None, out)


def _avoids(st: Strategy, subs: list[str], ch: str) -> bool:
    return all(p.kind != "S" or s[p.dim] != ch for s, p in zip(subs, st.inputs))


@register("aten.baddbmm.default")
def baddbmm(node: Node, graph: Graph) -> list[Strategy]:
    # out = beta * self + alpha * bmm(b1, b2); self broadcasts (Bloom's ALiBi bias [B*H, 1, S]):
    # a dim it lacks or holds once is a letter of its own, never split with the output's
    addend_shape, out_shape = graph.tensors[node.inputs[0]].shape, graph.tensors[node.outputs[0]].shape
    if len(addend_shape) > 3:
        return []
    addend = ""
    for pos, n in zip(range(3 - len(addend_shape), 3), addend_shape):
        if n not in (1, out_shape[pos]):
            return []
        addend += "bij"[pos] if n == out_shape[pos] else _LETTERS[-1 - pos]
    sts = einsum_strategies(["bik", "bkj"], addend, "bij", {"b": "batch", "i": "rows", "k": "reduce", "j": "columns"})
    return [Strategy((st.inputs[2], st.inputs[0], st.inputs[1]), st.outputs, st.name) for st in sts]
