"""Shared parameters and mutated buffers, without process groups: a tied embedding is one
parameter (one layout, its gradient synchronized and its state counted once), and the buffers
a forward mutates are the graph's buffer updates."""

import torch
import torch.nn as nn

import hap
from hap.cost.model import CostModel
from hap.rules import strategy_table
from hap.planner import baseline_plan
from hap.rules.units import ShardClasses
from hap.search.program import kept_placements, memory_terms, synced_bytes

V, H, B, L = 50, 16, 6, 5


class TiedLM(nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.mix = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)
        if tie:
            self.head.weight = self.emb.weight  # one parameter under two names

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.mix(self.emb(ids))))
        return nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (B, L), generator=gen), torch.randint(0, V, (B, L), generator=gen)


def priced_dp(tie: bool):
    graph = hap.capture(TiedLM(tie), inputs())
    cluster = hap.load_cluster("local-homo")
    plan = baseline_plan(graph, cluster, "dp-ev")
    program = plan.steps(graph)
    segment_of = [0] * len(graph.nodes)
    cost = CostModel(graph, cluster, ShardClasses(graph, enumerate(strategy_table(graph))))
    return graph, program, segment_of, cost


def test_tied_embedding_is_one_parameter_synced_once():
    graph, program, segment_of, cost = priced_dp(tie=True)
    weight = [p for p in graph.params if graph.tensors[p].shape == (V, H)]
    assert len(weight) == 1 and len(graph.params) == 3  # emb/head weight, mix weight and bias
    (w,) = weight
    assert len(graph.tensors[w].consumers) == 2  # the embedding and the output projection
    loads = [ld for st in program for ld in st.loads if ld.tensor == w]
    assert len(loads) == 2 and kept_placements(program, graph, segment_of)[w][0] == hap.placement.R
    # data parallel: every parameter kept whole, each gradient all-reduced once
    assert synced_bytes(program, graph, segment_of) == graph.param_bytes
    state = [t for t in memory_terms(program, cost, segment_of) if t[0] == w]
    assert len(state) == 1 and state[0][3] == graph.tensors[w].nbytes * cost.state_factor

    untied_graph, untied, untied_seg, _ = priced_dp(tie=False)
    # untied, the head has its own [V, H] weight: exactly that much more to synchronize
    assert synced_bytes(untied, untied_graph, untied_seg) == graph.param_bytes + V * H * 4


def test_batch_norm_statistics_are_buffer_updates():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(2, 3, 8, 8))  # materialize the lazy layer

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.net(x), y)

    graph = hap.capture(Loss(), (torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 1, 0])))
    targets = {graph.tensors[b].target: graph.tensors[new] for b, new in graph.buffer_updates.items()}
    assert set(targets) == {"net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"}
    assert targets["net.1.running_mean"].shape == (4,) and targets["net.1.num_batches_tracked"].dtype == "int64"


def test_synchronized_batch_norm_is_priced_as_its_all_reduces():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.head = nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.Linear(6, 2)

        def forward(self, x, y):
            h = self.bn(self.conv(x)).relu().mean((2, 3))
            return nn.functional.cross_entropy(self.head(h), y)

    graph = hap.capture(Net(), (torch.randn(8, 3, 10, 10), torch.randint(0, 2, (8,))))
    cluster = hap.load_cluster("local")
    plan = baseline_plan(graph, cluster, "dp-cp")  # data parallel: the batch norm must synchronize
    bn = [ins for ins in plan.program if "batch_norm" in ins.op]
    assert [ins.strategy for ins in bn] == ["sync-batch"]
    stage = next(s for s in plan.timeline["stages"] if any(c.startswith("sync_batch_norm(") for c in s["collectives"]))
    # forward and backward each all-reduce 2 float64 sums per channel: 2 * 6 * 8 bytes
    cost = CostModel(graph, cluster, ShardClasses(graph, enumerate(strategy_table(graph))))
    assert stage["comm"] == 2 * cost.comm("all_reduce", 2 * 6 * 8).const > 0


def test_a_bias_loaded_as_a_partial_sum_is_kept_whole_and_a_layout_may_load_it_so():
    # Megatron's row-parallel mix layer adds its bias to a partial sum: the bias is loaded as P
    # (whole on one device, zeros on the others) but kept whole, and a program planned for that
    # kept layout (another shape of the same model) may load it as P again
    from hap.planner import plan_for_layout
    from hap.search.program import kept_as

    assert kept_as(hap.placement.P) == hap.placement.R and kept_as(hap.placement.S(1)) == hap.placement.S(1)
    mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.ReLU(), nn.Linear(4 * H, H))  # column- then row-parallel
    x, y = torch.randn(B, H), torch.randn(B, H)
    graph = hap.capture(_Regression(mlp), (x, y))
    cluster = hap.load_cluster("local-homo")
    plan = baseline_plan(graph, cluster, "megatron")
    segment_of = [0] * len(graph.nodes)
    program = plan.steps(graph)
    as_p = {ld.tensor for st in program for ld in st.loads if ld.placement == hap.placement.P}
    assert as_p and as_p <= set(graph.params)
    kept = {name: p for name, (p, _) in kept_placements(program, graph, segment_of).items()}
    assert all(kept[name] == hap.placement.R for name in as_p)
    replanned = plan_for_layout(graph, cluster, plan.stages[0].ratios[0], kept).steps(graph)
    assert {name: p for name, (p, _) in kept_placements(replanned, graph, segment_of).items()} == kept
    # in a plan of two segments a whole tensor is kept alike whichever segment loads it (loaded
    # as R in segment 1 it was (R, 1), as P (R, 0): a re-plan for eval was refused as "split otherwise")
    two = [0] * 2 + [1] * (len(graph.nodes) - 2)
    for layout in ({}, {name: hap.placement.R for name in graph.params}):
        steps = plan_for_layout(graph, cluster, [[0.6, 0.4], [0.3, 0.7]], layout, segment_of=two).steps(graph)
        held = kept_placements(steps, graph, two)
        assert all(seg == 0 for p, seg in held.values() if not p.is_shard)


class _Regression(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)


class SelfProducts(nn.Module):
    """One tensor given twice to a node: w @ w, h * h, x[rows, rows]."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.w = (nn.Parameter(torch.randn(12, 12)) for _ in range(3))

    def forward(self, x):
        h = x @ (self.a @ self.b) @ (self.w @ self.w)  # a @ b first: alike but for w given twice
        rows = torch.arange(x.shape[0])
        return (h * h).sum() + x[rows, rows].sum()


def test_a_tensor_given_twice_takes_one_placement():
    """The rules placed each argument alone: w @ w as (S(0), R), which a device holding one
    value of w cannot run (training failed: shapes cannot be multiplied); every strategy left
    runs like one device at uneven splits (tests/rulecheck.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from rulecheck import check_ops
    from hap.rules import strategies_for, strategy_table

    graph = hap.capture(SelfProducts(), (torch.randn(12, 12),))
    found = check_ops(graph, ["aten.matmul.default", "aten.mul.Tensor", "aten.index.Tensor"])
    twice = [n for nodes in found.values() for n in nodes if len(set(n.inputs)) < len(n.inputs)]
    assert len(twice) == 3  # w @ w, h * h, x[rows, rows]
    table = strategy_table(graph)  # (shared by alike nodes: a @ b's list must not serve w @ w)
    for n in twice:
        for st in [*strategies_for(n, graph), *table[n.index]]:
            assert len({(t, p) for t, p in zip(n.inputs, st.inputs)}) == len(set(n.inputs)), (n.op, str(st))
    ab = next(n for n in found["aten.matmul.default"] if len(set(n.inputs)) == 2 and n.inputs[0] == "p_a")
    assert any(st.inputs[0].is_shard for st in table[ab.index])  # and a @ b keeps its sharded strategies
