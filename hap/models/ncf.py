"""Neural collaborative filtering (NeuMF, He et al. 2017; MLPerf's recommendation benchmark), the
recommendation model of AutoSync's experiments: `ncf` with dense embedding gradients (NCF-dense),
`ncf-sparse` with sparse ones (only the rows a step looked up).

A user and an item each have two embeddings, one for generalized matrix factorization (their
elementwise product) and one for an MLP tower over their concatenation; a linear layer scores
[GMF ++ MLP] and the loss is binary cross entropy against clicked / not clicked. The embedding
tables dominate the parameters and cost almost no computation: gradient synchronization is the
step's bottleneck, which is what makes the model interesting for synchronization strategies.

Paper size (MLPerf, MovieLens-20M x16x32): 2.2M users, 855K items, 64 wide, MLP 256-128-64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class NCFConfig:
    users: int = 2_215_888
    items: int = 855_776
    hidden: int = 64
    """The GMF embedding width; the MLP's embeddings are twice as wide, its tower halves down to hidden."""
    layers: int = 3
    """MLP layers (256-128-64 at hidden 64)."""
    sparse: bool = False
    """Embeddings with sparse gradients (nn.Embedding(sparse=True)): a step's gradient holds only
    the rows it looked up, synchronized as (index, row) pairs (model `ncf-sparse`)."""

    @classmethod
    def small(cls) -> NCFConfig:
        return cls(users=20_000, items=5_000, hidden=32, layers=3)


class NCF(nn.Module):
    def __init__(self, cfg: NCFConfig):
        super().__init__()
        h = cfg.hidden
        self.user_gmf = nn.Embedding(cfg.users, h, sparse=cfg.sparse)
        self.item_gmf = nn.Embedding(cfg.items, h, sparse=cfg.sparse)
        self.user_mlp = nn.Embedding(cfg.users, 2 * h, sparse=cfg.sparse)
        self.item_mlp = nn.Embedding(cfg.items, 2 * h, sparse=cfg.sparse)
        widths = [4 * h] + [max(1, 4 * h // 2 ** (i + 1)) for i in range(cfg.layers)]  # 256, 128, 64, 32 at h = 64
        self.tower = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.score = nn.Linear(h + widths[-1], 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor, clicked: torch.Tensor) -> torch.Tensor:
        """users, items [B] int64, clicked [B] float (0 or 1) -> the mean binary cross entropy."""
        gmf = self.user_gmf(users) * self.item_gmf(items)  # [B, h]
        x = torch.cat([self.user_mlp(users), self.item_mlp(items)], dim=-1)  # [B, 4h]
        for layer in self.tower:
            x = F.relu(layer(x))  # [B, ...] down to [B, 4h / 2^layers]
        logits = self.score(torch.cat([gmf, x], dim=-1)).squeeze(-1)  # [B]
        return F.binary_cross_entropy_with_logits(logits, clicked)


def example_inputs(cfg: NCFConfig, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    users = torch.randint(0, cfg.users, (batch,), generator=gen)
    items = torch.randint(0, cfg.items, (batch,), generator=gen)
    clicked = torch.randint(0, 2, (batch,), generator=gen).float()
    return users, items, clicked
