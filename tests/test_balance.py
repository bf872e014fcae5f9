"""Load balancer LP and integer rounding, on problems solved by hand."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as hs

from hap.balance.lp import BalanceError, balance
from hap.capture import capture
from hap.cost.cluster import Cluster, Device, fits_from_network
from hap.cost.model import CostModel
from hap.placement import D, R, S
from hap.rules import strategy_table
from hap.rules import Strategy
from hap.rules.units import ShardClasses, round_sizes
from hap.search.moves import all_gather_padded
from hap.search.program import Load, MoveStep, Step, memory, replay

torch.set_num_threads(1)
B, IN, OUT = 64, 32, 48


class Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(IN, OUT, bias=False)

    def forward(self, x):
        return self.w(x).sum()


@pytest.fixture(scope="module")
def graph():
    return capture(Proj(), (torch.randn(B, IN),))


def cluster(bandwidth, memory=2**40):
    # Device 0 is 3x faster than device 1; no memory-bound costs.
    devs = (Device(name="fast", flops=3e9, memory=memory), Device(name="slow", flops=1e9, memory=memory))
    return Cluster(name="t", devices=devs, collectives=fits_from_network(2, bandwidth, 0.0))


def batch_then_gather(graph):
    """x S(0), W R -> y S(0); all-gather y to D; sum duplicated."""
    lin, total = graph.nodes
    x, w = lin.inputs
    y = lin.outputs[0]
    return [
        Step(0, Strategy((S(0), R), (S(0),), "batch"), (Load(x, S(0)), Load(w, R)), ()),
        Step(1, Strategy((D,), (D,), "duplicated"), (), (MoveStep(y, all_gather_padded(S(0), D)),)),
    ]


def model_for(graph, cl):
    return CostModel(graph, cl, ShardClasses(graph, enumerate(strategy_table(graph))))


def test_compute_bound_gives_compute_proportional_ratios(graph):
    # cost(b0) = C * max(b0/3, 1-b0) + k * max(b0, 1-b0): with k < C the optimum is b0 = 3/4.
    cost = model_for(graph, cluster(bandwidth=1e15))
    res = balance(batch_then_gather(graph), cost, [0, 0], 1)
    assert res.ratios[0] == pytest.approx([0.75, 0.25], abs=1e-6)


def test_communication_bound_gives_even_ratios(graph):
    # The padded all-gather costs k * max share with k = 2 * bytes(y) / beta, beta = bw * 2 / (2-1).
    # Pick the bandwidth so that k = 2C: on [1/2, 3/4] the slope is -C + k > 0, so b0 = 1/2.
    flops = graph.nodes[0].flops + graph.nodes[0].bwd_flops
    C = flops / 1e9
    nbytes = B * OUT * 4
    bw = 2 * nbytes / (2 * C) / 2
    cost = model_for(graph, cluster(bandwidth=bw))
    res = balance(batch_then_gather(graph), cost, [0, 0], 1)
    assert res.ratios[0] == pytest.approx([0.5, 0.5], abs=1e-6)
    # The LP objective matches the exact replay at its ratios (shares here round exactly).
    est = replay(batch_then_gather(graph), cost, [0, 0], res.ratios)
    assert est.seconds == pytest.approx(res.objective, rel=1e-6)


def test_memory_cap_binds(graph):
    # memory_j = const + b_j * (bytes(x) + bytes(y)); cap device 0 at b0 = 0.6.
    prog = batch_then_gather(graph)
    probe = model_for(graph, cluster(1e15))
    m0 = memory(prog, probe, [0, 0], [[0.0, 1.0]])[0]
    m1 = memory(prog, probe, [0, 0], [[1.0, 0.0]])[0]
    cap = m0 + 0.6 * (m1 - m0)
    res = balance(prog, probe, [0, 0], 1, memory_limit=[cap, 2**40])
    assert res.ratios[0][0] == pytest.approx(0.6, abs=1e-6)


def test_infeasible_memory_is_a_clear_error(graph):
    prog = batch_then_gather(graph)
    cost = model_for(graph, cluster(1e15))
    with pytest.raises(BalanceError, match=r"out of memory: device 0 \(fast\)"):
        balance(prog, cost, [0, 0], 1, memory_limit=[100.0, 2**40])
    whole = memory(prog, cost, [0, 0], [[0.5, 0.5]])
    with pytest.raises(BalanceError, match="out of memory"):
        # Each device could hold the replicated part but not half of the sharded part.
        balance(prog, cost, [0, 0], 1, memory_limit=[min(whole) * 0.9999, min(whole) * 0.9999])


def test_round_sizes_by_hand():
    assert round_sizes(10, [0.6, 0.4]) == [6, 4]
    # 12 * (.55, .3, .15) = (6.6, 3.6, 1.8) -> (7, 4, 2) sums to 13; taking one from shard 0 or 1
    # adds 0.2 error, from shard 2 adds 0.6: the first of the cheapest, shard 0, gives it back.
    assert round_sizes(12, [0.55, 0.3, 0.15]) == [6, 4, 2]
    assert round_sizes(3, [0.5, 0.5, 0.0]) in ([2, 1, 0], [1, 2, 0])
    with pytest.raises(ValueError):
        round_sizes(4, [0.0, 0.0])


@settings(max_examples=200, deadline=None)
@given(n=hs.integers(0, 500), ratios=hs.lists(hs.floats(0, 1), min_size=1, max_size=9).filter(lambda r: sum(r) > 1e-3))
def test_round_sizes_sum_and_error(n, ratios):
    sizes = round_sizes(n, ratios)
    total = sum(ratios)
    assert sum(sizes) == n and all(s >= 0 for s in sizes)
    assert all(abs(s - n * r / total) < 1 + 1e-9 for s, r in zip(sizes, ratios))
