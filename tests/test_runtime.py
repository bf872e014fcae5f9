"""Programs run on real gloo ranks equal single-device training: loss, every parameter's
gradient, and the parameters after several optimizer steps, for uneven ratios and programs
that use different collectives."""

import pytest
import torch
import torch.nn as nn
from gloo import rank_device, run_ranks

from hap.capture import capture
from hap.cost.cluster import Cluster, Device, fits_from_network
from hap.cost.model import CostModel
from hap.placement import S
from hap.rules import strategy_table
from hap.planner import _tp
from hap.rules.units import ShardClasses
from hap.runtime.collectives import Comm, all_reduce
from hap.runtime.executor import Executor, leaf_values
from hap.search.astar import Restriction, synthesize


class MLP(nn.Module):
    def __init__(self, d=12, h=20):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, d))  # a length-1 dim: never sharded, always synced
        self.fc1 = nn.Linear(d, h)
        self.norm = nn.LayerNorm(h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return (self.fc2(torch.relu(self.norm(self.fc1(x * self.scale)))) ** 2).mean()


# (device FLOP/s, link bytes/s, ratios, restriction): each leads the search to other programs.
# "sharded": weights must be sharded, data whole or split (Megatron-like layers, reductions);
# "sharded-batch": the same with the batch split (all-to-alls between the two layouts).
CASES = {
    2: [((3e9, 1e9), 1e11, (0.8, 0.2), None),
        ((3e9, 1e9), 1e4, (0.6, 0.4), None),
        ((1e9, 1e9), 1e11, (0.6, 0.4), "tp"),
        ((3e9, 1e9), 1e11, (0.6, 0.4), "sharded"),
        ((3e9, 1e9), 1e11, (0.8, 0.2), "sharded-batch"),
        ((3e9, 1e9), 1e11, (0.8, 0.2), "sharded-batch-no-gather"),
        ((3e9, 1e9), 1e11, (0.6, 0.4), "sharded-no-gather"),
        ((3e9, 1e9), 1e11, (1.0, 0.0), "sharded")],  # rank 1 holds empty shards and computes nothing
    3: [((2e9, 2e9, 1e9), 1e11, (0.55, 0.3, 0.15), None),
        ((2e9, 2e9, 1e9), 1e11, (0.55, 0.3, 0.15), "sharded"),
        ((2e9, 2e9, 1e9), 1e11, (0.55, 0.3, 0.15), "sharded-batch"),
        ((2e9, 2e9, 1e9), 1e11, (0.55, 0.3, 0.15), "sharded-batch-no-gather")],
}


def restriction(name, graph):
    if name is None:
        return None
    if name == "tp":
        return _tp()
    # the linear weights (not the [1, 12] scale, not the layer norm's affine parameters)
    big = {n for n in graph.params if len(graph.tensors[n].shape) == 2 and graph.tensors[n].numel > 12}

    def allow(kind, tensor, p):
        if kind == "param" and tensor in big:
            return p.is_shard
        if kind == "input" and name.startswith("sharded-batch"):
            return p == S(0)
        return True

    # "...-no-gather": activations change layout by all-to-all, reduce-scatter or all-reduce only
    no_gather = name.endswith("-no-gather")
    return Restriction(name=name, allow_load=allow,
                       allow_move=lambda mv: not (no_gather and mv.name in ("all_gather", "grouped_broadcast")))


STEPS = 3


def worker(rank, world, device="cpu"):
    """device "cuda": the GPU tier (test_gpu.py)."""
    comm = Comm.default()
    dev = rank_device(rank, device)
    torch.manual_seed(0)
    model = MLP().to(dev)
    batches = [torch.randn(20, 12).to(dev) for _ in range(STEPS)]
    graph = capture(model, (batches[0],))
    strategies = strategy_table(graph)
    classes = ShardClasses(graph, enumerate(strategies))
    seg = [0] * len(graph.nodes)
    report = {"failures": [], "moves": [], "programs": []}
    for speeds, bandwidth, ratios, rule in CASES[world]:
        devices = tuple(Device(name=f"d{i}", flops=s, memory=2**34) for i, s in enumerate(speeds))
        cost = CostModel(graph, Cluster(name="t", devices=devices, collectives=fits_from_network(world, bandwidth, 1e-5)),
                         classes)
        program = synthesize(graph, strategies, cost, seg, [ratios], restriction(rule, graph), layer_bounds=True).program
        report["moves"] += sorted({ms.move.name for st in program for ms in st.moves})
        report["programs"].append(sorted({str(ld.placement) for st in program for ld in st.loads if ld.tensor in graph.params}))
        what = f"{ratios} {rule or 'hap'}"

        reference = MLP().to(dev)
        reference.load_state_dict(model.state_dict())
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        ex = Executor(graph, program, classes, seg, [ratios], comm)
        params = ex.shard_parameters(leaf_values(graph, model, (batches[0],)))
        opt = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
        for step, x in enumerate(batches):
            ref_loss = reference(x)
            ref_loss.backward()
            loss = ex.forward(leaf_values(graph, model, (x,)))
            loss.backward()
            ex.sync_gradients()
            if not torch.allclose(all_reduce(loss.detach(), comm), ref_loss.detach(), rtol=1e-5, atol=1e-6):
                report["failures"].append(f"{what} step {step}: loss")
            for name, p in params.items():
                ref = dict(reference.named_parameters())[graph.tensors[name].target].grad
                if not torch.allclose(ex.whole(name, p.grad), ref, rtol=1e-4, atol=1e-6):
                    report["failures"].append(f"{what} step {step}: gradient of {graph.tensors[name].target}")
            if len(params) != len(list(reference.parameters())):
                report["failures"].append(f"{what}: {len(params)} of {len(list(reference.parameters()))} parameters kept")
            opt.step(); opt.zero_grad()
            ref_opt.step(); ref_opt.zero_grad()
        for name, p in params.items():
            ref = dict(reference.named_parameters())[graph.tensors[name].target]
            if not torch.allclose(ex.whole(name, p.detach()), ref.detach(), rtol=1e-4, atol=1e-6):
                report["failures"].append(f"{what}: {graph.tensors[name].target} after {STEPS} steps")
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_programs_train_like_one_device(world, tmp_path):
    reports = run_ranks(worker, world, tmp_path)
    assert all(not r["failures"] for r in reports), [r["failures"] for r in reports]
    # The cases really differ: several kinds of collective, sharded parameters somewhere.
    assert len(set(reports[0]["moves"])) >= 4
    assert any(any(p.startswith("S(") for p in prog) for prog in reports[0]["programs"])


def test_an_idle_device_makes_its_outputs_without_computing():
    """A device with ratio 0 holds an empty batch shard: its linear's output is made directly
    (Made, which the emulation does not stretch: a slow GPU launches nothing for it), empty,
    and tied to the inputs so that their gradients are zeros."""
    from hap.rules.local import LocalContext, Made, run_node

    model = MLP()
    x = torch.randn(6, 12)
    graph = capture(model, (x,))
    fc1 = next(n for n in graph.nodes if n.op == "aten.linear.default")
    st = next(s for s in strategy_table(graph)[fc1.index] if s.inputs[0] == S(0) and s.inputs[1].kind == "R")
    ctx = LocalContext(device=1, world=2, split=lambda t, d: [graph.tensors[t].shape[d], 0], all_reduce=lambda t: t)
    w = model.fc1.weight.detach().requires_grad_()
    values = {fc1.inputs[0]: torch.zeros(0, 12), fc1.inputs[1]: w, fc1.inputs[2]: model.fc1.bias.detach()}
    outs = run_node(fc1, st, values, graph, ctx)
    assert isinstance(outs, Made) and outs[0].shape == (0, 20)
    outs[0].sum().backward()
    assert w.grad is not None and not w.grad.any()
    busy = LocalContext(device=0, world=2, split=ctx.split, all_reduce=ctx.all_reduce)
    whole = {**values, fc1.inputs[0]: x}
    assert not isinstance(run_node(fc1, st, whole, graph, busy), Made)
