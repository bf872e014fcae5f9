"""Batches of other shapes on real gloo ranks: after the planned batch, a last smaller batch of
an epoch (5 rows, then 1 row) and a shorter sequence train exactly like one device: the plan's
program at its ratios where the graph is the same, a program planned for the shape on the
same parameter layout where export's graph changes (1 row); a shape the model cannot run is a
one-line error."""

import pytest
import torch
import torch.nn as nn
from gloo import run_ranks
from test_module import train

import hap
from hap.models import zoo
from hap.plan import Plan
from hap.planner import baseline_plan
from hap.runtime.launch import RankFailed


def batches():
    """llama-style decoder batches: the planned 8 x 16, then 5 x 16, 1 x 16, 8 x 8 and 3 x 16
    tokens (rank 1's part of the planned batch is 3 x 16 too: given whole on both ranks, it is a
    global batch; rank 1 alone could not tell), the planned again and 5 x 16 again."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 16), (5, 16), (1, 16), (8, 8), (3, 16), (8, 16), (5, 16)]
    return [(ids, ids.clone()) for ids in (torch.randint(0, zoo.VOCAB, s, generator=gen) for s in shapes)]


def train_ranks(rank, world, plan_json, kept, graph):
    from hap.runtime import module

    torch.set_num_threads(1)
    module.SHAPES_KEPT = kept
    model, _ = zoo.build("llama")
    data = batches()
    dmodel = hap.HAP(model, hap.load_cluster("local"), data[0], plan=Plan.from_json(plan_json), graph=graph)
    losses = train(dmodel, data)
    state = {k: v.tolist() for k, v in dmodel.full_state_dict().items()}
    return {"losses": losses, "state": state, "shapes": [(list(map(list, s["shapes"])), s["run"]) for s in dmodel.shapes]}


@pytest.mark.parametrize("kept", [32, 3])
def test_other_batch_shapes_train_like_one_device(kept, tmp_path):
    """Each shape is captured once while kept; with 3 kept (SHAPES_KEPT) the least recently used,
    5 x 16, was dropped by the 3 after it and is captured again."""
    model, _ = zoo.build("llama")
    data = batches()
    graph = hap.capture(model, data[0])
    plan = baseline_plan(graph, hap.load_cluster("local"), "dp-cp", ratios=[0.6, 0.4])  # 5 rows: 3 + 2; 1 row: 1 + 0
    reports = run_ranks(train_ranks, 2, tmp_path, plan.to_json(), kept, graph)
    want_losses = train(model, data)
    again = [[[5, 16], [5, 16]]] if kept == 3 else []
    for got in reports:
        assert [s[0] for s in got["shapes"]] == [[[5, 16], [5, 16]], [[1, 16], [1, 16]], [[8, 8], [8, 8]],
                                                 [[3, 16], [3, 16]], *again]
        assert [s[1].startswith("the plan's program") for s in got["shapes"]] == [True, False, True, True] + [True] * len(again)
        assert got["losses"] == pytest.approx(want_losses, rel=1e-5)
        for key, value in model.state_dict().items():
            assert torch.allclose(torch.tensor(got["state"][key], dtype=value.dtype), value, rtol=1e-4, atol=1e-6), key


class EvenBatches(nn.Module):
    """A model that cannot take an odd number of rows (it pairs them up)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] % 2:
            raise ValueError("rows come in pairs")
        return self.a(x.reshape(-1, 2, 4)).square().mean()


def refuse_ranks(rank, world):
    torch.manual_seed(0)
    dmodel = hap.HAP(EvenBatches(), hap.load_cluster("local"), (torch.randn(8, 4),))
    dmodel(torch.randn(6, 4))  # another shape it can run
    dmodel(torch.randn(5, 4))
    return {}


def test_a_shape_the_model_cannot_run_is_one_line(tmp_path):
    with pytest.raises(RankFailed) as err:
        run_ranks(refuse_ranks, 2, tmp_path)
    first = str(err.value).splitlines()[0]
    assert "inputs of shape ((5, 4),): the plan for ((8, 4),) cannot run them" in first and "rows come in pairs" in first
