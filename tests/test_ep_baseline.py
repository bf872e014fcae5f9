"""The expert-parallel baseline (EP): which parameters are experts, the family's programs, and
plan() treating EP as a candidate. Planning only, no process group."""

import pytest
import torch
import torch.nn as nn

from hap import capture, plan
from hap.cost.cluster import Cluster, Device, fits_from_network
from hap.models.moe import MoEFFN
from hap.placement import R
from hap.planner import baseline_plan

torch.set_num_threads(1)


class TinyMoE(nn.Module):
    """A linear layer, then a top-2 MoE FFN: x [B, S, H] -> scalar loss."""

    def __init__(self, experts: int, hidden: int = 16, ffn: int = 64):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.moe = MoEFFN(hidden, ffn, experts)

    def forward(self, x):
        y, aux = self.moe(torch.relu(self.inp(x)))
        return (y**2).mean() + aux


class Undeclared(nn.Module):
    """Stacked [E, H, F] weights that no module declares as experts."""

    def __init__(self, experts: int = 4, hidden: int = 16, ffn: int = 64):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, ffn) * 0.02)

    def forward(self, x):  # x [B, S, H]
        return torch.einsum("bsh,ehf->bsef", x, self.w1).pow(2).mean()


def cluster(speeds, memory=2**34, bandwidth=1e9) -> Cluster:
    devices = tuple(Device(name=f"d{i}", flops=s, memory=memory) for i, s in enumerate(speeds))
    return Cluster(name="test", devices=devices, collectives=fits_from_network(len(speeds), bandwidth, 1e-5))


def moe_graph(experts: int):
    torch.manual_seed(0)
    return capture(TinyMoE(experts), (torch.randn(12, 8, 16),), name=f"tiny-moe-{experts}")


@pytest.fixture(scope="module")
def graph4():
    return moe_graph(4)


THREE = (2e12, 1e12, 1e12)


def test_capture_records_declared_expert_params(graph4):
    assert sorted(graph4.tensors[p].target for p in graph4.experts) == ["moe.w1", "moe.w2"]
    assert all(graph4.tensors[p].shape[0] == 4 for p in graph4.experts)
    # Detection is by declaration (MoEFFN.hap_expert_params), not by name or shape.
    undeclared = capture(Undeclared(), (torch.randn(2, 3, 16),))
    assert undeclared.experts == []


def test_plan_prices_ep_only_for_graphs_with_experts(graph4):
    result = plan(graph4, cluster(THREE))
    assert set(result.baselines) == {"dp_ev", "dp_cp", "tp", "ep"}
    for b in result.baselines.values():
        if b["fits"]:
            assert result.estimated_iteration_seconds <= b["seconds"] * (1 + 1e-12)
    dense = capture(Undeclared(), (torch.randn(2, 3, 16),))
    assert "ep" not in plan(dense, cluster(THREE)).baselines
    with pytest.raises(ValueError, match=r"^baseline 'ep' \(expert parallelism\) needs expert layers, and this model has none"):
        baseline_plan(dense, cluster(THREE), "ep")


def test_ep_program_shards_experts_and_moves_tokens_by_all_to_all(graph4):
    result = baseline_plan(graph4, cluster(THREE), "ep")
    assert result.ratios == [[1 / 3] * 3]
    moves = []
    for step in result.steps(graph4):
        for ld in step.loads:
            t = graph4.tensors[ld.tensor]
            if ld.tensor in graph4.experts:
                assert ld.placement.is_shard and ld.placement.dim == 0, ld
            elif t.kind == "param":
                assert ld.placement == R, ld
            elif t.kind == "input":
                assert ld.placement.is_shard and ld.placement.dim == 0, ld
        moves += [ms.move for ms in step.moves if ms.move.communicates]
    # Tokens go to the experts' devices and come back: at least two all-to-alls, nothing else.
    assert len(moves) >= 2 and {mv.name for mv in moves} == {"all_to_all"}


@pytest.mark.parametrize("experts, sizes", [(6, [2, 2, 2]), (4, [2, 1, 1])])
def test_ep_even_ratios_integer_expert_shards(experts, sizes):
    """Even ratios give equal expert counts when E is a multiple of the devices; otherwise
    the integer shards differ by one (the cost model prices the larger)."""
    graph = moe_graph(experts)
    result = baseline_plan(graph, cluster(THREE), "ep")
    for p in graph.experts:
        assert result.shard_sizes(p, 0) == sizes


def test_plan_falls_back_to_ep_when_only_ep_fits():
    """With memory between EP's need and replicated data parallelism's, plan() returns a
    program that fits and is never slower than EP."""
    big = moe_graph(6)  # experts dominate the parameters
    ep = baseline_plan(big, cluster(THREE), "ep")
    dp = baseline_plan(big, cluster(THREE), "dp-ev")
    assert max(ep.memory_bytes) < max(dp.memory_bytes)
    memory = (max(ep.memory_bytes) + min(dp.memory_bytes)) / 2
    result = plan(big, cluster(THREE, memory=memory))
    assert not result.baselines["dp_ev"]["fits"] and result.baselines["ep"]["fits"]
    assert max(result.memory_bytes) <= memory
    assert result.estimated_iteration_seconds <= result.baselines["ep"]["seconds"] * (1 + 1e-12)
