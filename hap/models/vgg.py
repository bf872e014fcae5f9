"""VGG for CIFAR-10 shaped input, torchvision-style (no batch norm).

features: 3x3 conv + ReLU stacks with 2x2 max pools, AdaptiveAvgPool2d((7, 7)), then the
classifier Linear(512*7*7, 4096)-ReLU-Dropout-Linear(4096, 4096)-ReLU-Dropout-Linear(4096, 10).
On a 32x32 image the features end at 1x1 and the adaptive pool replicates it to 7x7, exactly
what torchvision's vgg19 does on CIFAR-sized input; that keeps the big 25088-wide classifier
(~139M parameters in all at the paper size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# Channels per conv layer in units of `width` (64 in VGG); "M" is a 2x2 max pool.
STAGES = {
    11: [1, "M", 2, "M", 4, 4, "M", 8, 8, "M", 8, 8, "M"],
    13: [1, 1, "M", 2, 2, "M", 4, 4, "M", 8, 8, "M", 8, 8, "M"],
    16: [1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M"],
    19: [1, 1, "M", 2, 2, "M", 4, 4, 4, 4, "M", 8, 8, 8, 8, "M", 8, 8, 8, 8, "M"],
}


@dataclass
class VGGConfig:
    layers: int = 19  # weight layers: 11, 13, 16 or 19 (convs + the 3 linear layers)
    width: int = 64  # channels of the first stage; later stages have 2x, 4x, 8x, 8x
    hidden: int = 4096  # classifier width
    image: int = 32  # input is 3 x image x image
    pool: int = 7  # AdaptiveAvgPool2d((pool, pool)) before the classifier
    classes: int = 10
    dropout: float = 0.5

    @classmethod
    def small(cls) -> VGGConfig:
        return cls(width=8, hidden=64)


class VGG(nn.Module):
    def __init__(self, cfg: VGGConfig):
        super().__init__()
        if cfg.layers not in STAGES:
            raise ValueError(f"vgg19 takes layers in {sorted(STAGES)} (VGG-11/13/16/19), got {cfg.layers}")
        self.cfg = cfg
        layers: list[nn.Module] = []
        c_in = 3
        for s in STAGES[cfg.layers]:
            if s == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                c_out = s * cfg.width
                layers += [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1), nn.ReLU(inplace=False)]
                c_in = c_out
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((cfg.pool, cfg.pool))
        self.classifier = nn.Sequential(
            nn.Linear(c_in * cfg.pool * cfg.pool, cfg.hidden),
            nn.ReLU(inplace=False),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.hidden, cfg.hidden),
            nn.ReLU(inplace=False),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.hidden, cfg.classes),
        )
        for m in self.modules():  # torchvision's init
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.features(images)  # [B, 8*width, image/32, image/32]
        x = self.avgpool(x)  # [B, 8*width, pool, pool]
        x = torch.flatten(x, 1)  # [B, 8*width*pool*pool]
        logits = self.classifier(x)  # [B, classes]
        return F.cross_entropy(logits, labels)


def example_inputs(cfg: VGGConfig, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(batch, 3, cfg.image, cfg.image, generator=gen)  # [B, 3, H, W]
    labels = torch.randint(0, cfg.classes, (batch,), generator=gen)  # [B]
    return images, labels
