"""Documented one-line refusals: dict inputs, int32 labels."""
import torch, torch.nn as nn, hap, traceback

class DictIn(nn.Module):
    def __init__(self):
        super().__init__(); self.fc = nn.Linear(4, 3)
    def forward(self, batch):
        return nn.functional.cross_entropy(self.fc(batch["x"]), batch["y"])

m = DictIn()
try:
    hap.capture(m, ({"x": torch.randn(4, 4), "y": torch.randint(0, 3, (4,))},))
    print("dict: captured (no refusal)")
except Exception as e:
    print("dict:", type(e).__name__, str(e).splitlines()[0][:300], "| lines:", len(str(e).splitlines()))
