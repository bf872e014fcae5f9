"""Vision Transformer for CIFAR-10 shaped input: 4x4 patches of a 32x32 image (64 patches + a
class token), pre-norm blocks, width 768, 12 heads, MLP 3072.

The paper size has 8 blocks: ~56.8M parameters (the paper's ViT is ~54M).
Attention runs F.scaled_dot_product_attention on [B, heads, S, head_dim] tensors made by
view + transpose from separate q, k and v projections, so the heads dimension shards
Megatron-style (q/k/v column-parallel, the output projection row-parallel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ViTConfig:
    layers: int = 8
    hidden: int = 768
    heads: int = 12
    mlp: int = 3072
    image: int = 32
    patch: int = 4
    classes: int = 10
    dropout: float = 0.1
    channels: int = 3
    pool: Literal["cls", "mean"] = "cls"
    """What the head reads: "cls" (the class token) or "mean" (all tokens averaged, which
    learns faster on small data)."""

    @classmethod
    def small(cls) -> ViTConfig:
        return cls(layers=2, hidden=32, heads=2, mlp=128, image=16)

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        assert hidden % heads == 0, (hidden, heads)
        self.heads = heads
        self.dropout = dropout
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape  # [B, S, H]
        nh, hd = self.heads, H // self.heads
        q = self.q(x).view(B, S, nh, hd).transpose(1, 2)  # [B, nh, S, hd]
        k = self.k(x).view(B, S, nh, hd).transpose(1, 2)  # [B, nh, S, hd]
        v = self.v(x).view(B, S, nh, hd).transpose(1, 2)  # [B, nh, S, hd]
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)  # [B, nh, S, hd]
        y = y.transpose(1, 2).reshape(B, S, H)  # [B, S, H]
        return self.proj(y)  # [B, S, H]


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # [B, S, H] -> [B, S, F] -> [B, S, H]


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = SelfAttention(cfg.hidden, cfg.heads, cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.mlp)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))  # [B, S, H]
        x = x + self.drop(self.mlp(self.ln2(x)))  # [B, S, H]
        return x


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        if cfg.image % cfg.patch:
            raise ValueError(f"image size {cfg.image} is not a multiple of the patch size {cfg.patch}")
        self.cfg = cfg
        self.patch_emb = nn.Conv2d(cfg.channels, cfg.hidden, kernel_size=cfg.patch, stride=cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden))
        self.pos_emb = nn.Parameter(torch.zeros(1, cfg.patches + 1, cfg.hidden))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.classes)
        nn.init.normal_(self.pos_emb, std=0.02)
        nn.init.normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(images), labels)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        B = images.shape[0]
        x = self.patch_emb(images)  # [B, H, image/patch, image/patch]
        x = x.flatten(2).transpose(1, 2)  # [B, P, H]
        cls = self.cls_token.expand(B, -1, -1)  # [B, 1, H]
        x = torch.cat([cls, x], dim=1) + self.pos_emb  # [B, P+1, H]
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)  # [B, P+1, H]
        x = self.ln_f(x[:, 0] if self.cfg.pool == "cls" else x.mean(1))  # [B, H]
        return self.head(x)  # [B, classes]


def example_inputs(cfg: ViTConfig, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(batch, cfg.channels, cfg.image, cfg.image, generator=gen)  # [B, C, H, W]
    labels = torch.randint(0, cfg.classes, (batch,), generator=gen)  # [B]
    return images, labels
