"""A model with a custom op of its own library (torch.library.custom_op), registered when this
module is imported: tests/test_capture.py pickles its graph into a process that has not."""

import torch
import torch.nn as nn


@torch.library.custom_op("haptest::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@doubled.register_fake
def _(x):
    return torch.empty_like(x)


class Doubling(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(doubled(x)).pow(2).mean()  # (the op on the input: no gradient through it)
