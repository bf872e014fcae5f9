"""Reduction rules: every offered strategy recomputes the op exactly on uneven simulated devices."""

import torch
import torch.nn as nn

from hap.capture import capture
from hap.placement import P, S
from hap.rules import strategies_for

import rulecheck

torch.set_num_threads(1)
SHAPE = (10, 12, 4)


class Fn(nn.Module):
    """loss = fn(x * w): the parameter w makes gradients flow through every op of fn."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn(SHAPE))

    def forward(self, x):
        return self.fn(x * self.w)


def check_ops(fn, ops) -> tuple:
    """Capture fn, check every strategy of every node running one of `ops`; return the graph
    and {op: [nodes]}."""
    graph = capture(Fn(fn), (torch.randn(SHAPE),))
    return graph, rulecheck.check_ops(graph, ops)


def offered(node, graph) -> dict:
    return {(st.inputs, st.outputs): st for st in strategies_for(node, graph)}


def test_sum():
    def fn(y):
        return (y.sum(1) ** 2).sum() + (y.sum((0, 2), keepdim=True) ** 2).sum() + (y.sum(-1) ** 2).sum() + y.sum()

    g, ops = check_ops(fn, ["aten.sum.dim_IntList", "aten.sum.default"])
    over1, over02, _ = ops["aten.sum.dim_IntList"]
    assert {((S(1),), (P,)), ((S(0),), (S(0),)), ((S(2),), (S(1),)), ((P,), (P,))} <= offered(over1, g).keys()
    assert {((S(1),), (S(1),)), ((S(0),), (P,)), ((S(2),), (P,))} <= offered(over02, g).keys()
    total = next(n for n in ops["aten.sum.default"] if n.inputs[0] == over1.inputs[0])
    assert {((S(d),), (P,)) for d in range(3)} <= offered(total, g).keys()


def test_mean_divides_by_the_global_count():
    def fn(y):
        return ((y.mean(1) ** 2).sum() + (y.mean((0, 2), keepdim=True) ** 2).sum() + y.mean()
                + y.mean(dtype=torch.float64).float())

    g, ops = check_ops(fn, ["aten.mean.dim", "aten.mean.default"])
    over1 = offered(ops["aten.mean.dim"][0], g)
    assert over1[((S(1),), (P,))].local == "mean_over_shards"
    assert over1[((S(0),), (S(0),))].local is None and ((P,), (P,)) in over1
    assert over1[((S(2),), (S(1),))].local is None
    assert offered(ops["aten.mean.default"][0], g)[((S(0),), (P,))].local == "mean_over_shards"


def test_max_min_arg():
    def fn(y):
        return (y.amax(1).sum() + y.amin((0, 2), keepdim=True).sum() + y.max(1).values.sum()
                + y.min(2, keepdim=True)[0].sum() + y.argmax(1).float().sum() + y.argmin(-1).float().sum())

    g, ops = check_ops(fn, ["aten.amax.default", "aten.amin.default", "aten.max.dim", "aten.min.dim",
                            "aten.argmax.default", "aten.argmin.default"])
    amax = offered(ops["aten.amax.default"][0], g).keys()
    assert ((S(0),), (S(0),)) in amax and ((S(2),), (S(1),)) in amax
    assert not any(ins in ((S(1),), (P,)) for ins, _ in amax)  # max of shards is no partial sum
    assert ((S(1),), (S(1),)) in offered(ops["aten.amin.default"][0], g)
    assert ((S(2),), (S(1), S(1))) in offered(ops["aten.max.dim"][0], g)


def test_moments_logsumexp_norms():
    def fn(y):
        return (y.var(1).sum() + y.std(2, keepdim=True).sum() + torch.var(y, 0, correction=0).sum()
                + y.logsumexp(1).sum() + y.norm(dim=1).sum() + torch.linalg.vector_norm(y, 3, dim=(0, 2)).sum())

    g, ops = check_ops(fn, ["aten.var.dim", "aten.std.dim", "aten.var.correction", "aten.logsumexp.default",
                            "aten.linalg_vector_norm.default"])
    var = offered(ops["aten.var.dim"][0], g).keys()
    assert ((S(0),), (S(0),)) in var and not any(ins == (S(1),) for ins, _ in var)
    assert ((S(1),), (S(0),)) in offered(ops["aten.var.correction"][0], g)
    assert ((S(2),), (S(1),)) in offered(ops["aten.logsumexp.default"][0], g)
    norm2, norm3 = ops["aten.linalg_vector_norm.default"]
    assert ((S(1),), (S(0),)) in offered(norm3, g) and ((S(2),), (S(1),)) in offered(norm2, g)


def test_scans():
    def fn(y):
        return (y.cumsum(1) ** 2).sum() + y.cumprod(2).sum() + y.logcumsumexp(0).sum()

    g, ops = check_ops(fn, ["aten.cumsum.default", "aten.cumprod.default", "aten.logcumsumexp.default"])
    cs = offered(ops["aten.cumsum.default"][0], g).keys()
    assert {((S(0),), (S(0),)), ((S(2),), (S(2),)), ((P,), (P,))} <= cs and ((S(1),), (S(1),)) not in cs
    assert ((S(2),), (S(2),)) not in offered(ops["aten.cumprod.default"][0], g)


def test_any_all():
    def fn(y):
        m = y > 0
        return y.sum() + m.any(1).float().sum() + m.all(2).float().sum() + torch.any(m, dim=(0, 1)).float().sum()

    g, ops = check_ops(fn, ["aten.any.dim", "aten.all.dim", "aten.any.dims"])
    assert ((S(0),), (S(0),)) in offered(ops["aten.any.dim"][0], g)
    assert ((S(2),), (S(0),)) in offered(ops["aten.any.dims"][0], g)
