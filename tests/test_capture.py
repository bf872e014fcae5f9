"""Capture: the graph IR marks what needs gradients per output, and FLOPs come from torch."""

import torch
import torch.nn as nn

from hap.capture import capture

torch.set_num_threads(1)


class BroadcastPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 1))

    def forward(self, x):
        a, b = torch.broadcast_tensors(self.w, x)  # a follows w (trainable), b follows x (data)
        return (a * b).sum()


def test_multi_output_nodes_mark_gradients_per_output():
    graph = capture(BroadcastPair(), (torch.randn(4, 3),))
    node = next(n for n in graph.nodes if n.op == "aten.broadcast_tensors.default")
    assert [graph.tensors[o].requires_grad for o in node.outputs] == [True, False]


def test_loss_params_and_flops():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x).sum()

    graph = capture(Wrap(), (torch.randn(5, 8),))
    assert graph.tensors[graph.loss].shape == ()
    assert len(graph.params) == 4
    linears = [n for n in graph.nodes if n.op in ("aten.linear.default", "aten.addmm.default")]
    # torch's counter: 2 * batch * in * out per matmul forward; backward 2x that (input and weight grads)
    assert sorted(n.flops for n in linears) == [2 * 5 * 16 * 1, 2 * 5 * 8 * 16]
    first = next(n for n in linears if n.flops == 2 * 5 * 8 * 16)
    second = next(n for n in linears if n.flops == 2 * 5 * 16 * 1)
    assert second.bwd_flops == 2 * (2 * 5 * 16 * 1)  # grads of its input and its weight
    assert first.bwd_flops == 2 * 5 * 8 * 16  # the weight's grad only: the data x needs none
