"""GShard-style top-2 mixture-of-experts FFN, the BERT-MoE model's sparse layer.

Each sequence is one routing group: per sequence, expert e takes at most
C = ceil(2 * S / E * capacity_factor) tokens; a token's first choice queues before any second
choice, and tokens past an expert's capacity are dropped (their FFN output is zero, the
residual carries them). Dispatch and combine are dense [B, S, E, C] masks built with one_hot
and cumsum, applied with einsum; the experts' weights are stacked [E, H, F] and [E, F, H], so
the expert dimension shards across devices (expert parallelism) like any other dimension.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def capacity(seq: int, experts: int, k: int = 2, capacity_factor: float = 1.25) -> int:
    """Slots per expert per sequence: ceil(k * S / E * capacity_factor)."""
    return math.ceil(k * seq * capacity_factor / experts)


class MoEFFN(nn.Module):
    hap_expert_params = ("w1", "w2")
    """Parameters stacked per expert on dim 0; capture records them in Graph.experts so the
    planner's expert-parallel baseline (GShard / DeepSpeed style) can shard them."""

    def __init__(self, hidden: int, ffn: int, experts: int, capacity_factor: float = 1.25, aux_loss_coef: float = 0.01):
        super().__init__()
        if experts < 2:
            raise ValueError(f"top-2 routing needs at least 2 experts, got {experts}")
        self.experts = experts
        self.capacity_factor = capacity_factor
        self.aux_loss_coef = aux_loss_coef
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ffn))  # [E, H, F]
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))  # [E, F, H]
        nn.init.normal_(self.gate.weight, std=0.02)
        nn.init.normal_(self.w1, std=0.02)
        nn.init.normal_(self.w2, std=0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H] -> (y [B, S, H], the weighted load-balancing loss, a scalar)."""
        B, S, H = x.shape
        E, C = self.experts, capacity(S, self.experts, 2, self.capacity_factor)

        # Routing: top-2 experts per token, weights renormalized over the two.
        probs = F.softmax(self.gate(x), dim=-1)  # [B, S, E]
        gates, idx = torch.topk(probs, k=2, dim=-1)  # [B, S, 2], [B, S, 2]
        gates = gates / gates.sum(dim=-1, keepdim=True)  # [B, S, 2]
        mask1 = F.one_hot(idx[:, :, 0], E)  # [B, S, E] int64, first choice
        mask2 = F.one_hot(idx[:, :, 1], E)  # [B, S, E] int64, second choice

        # GShard's load-balancing loss: E^2 * mean_e(fraction routed first to e * mean gate prob of e).
        aux = (probs.mean(dim=1) * mask1.to(x.dtype).mean(dim=1)).mean() * (E * E)  # scalar

        # Slot of each token in its expert's buffer, per sequence; second choices queue after all first.
        pos1 = torch.cumsum(mask1, dim=1) - 1  # [B, S, E]
        mask1 = mask1 * (pos1 < C)  # [B, S, E] overflowing tokens dropped
        pos2 = torch.cumsum(mask2, dim=1) - 1 + mask1.sum(dim=1, keepdim=True)  # [B, S, E]
        mask2 = mask2 * (pos2 < C)  # [B, S, E]
        slot1 = (pos1 * mask1).sum(dim=-1)  # [B, S]
        slot2 = (pos2 * mask2).sum(dim=-1)  # [B, S]
        disp1 = mask1.to(x.dtype).unsqueeze(-1) * F.one_hot(slot1, C).to(x.dtype).unsqueeze(2)  # [B, S, E, C]
        disp2 = mask2.to(x.dtype).unsqueeze(-1) * F.one_hot(slot2, C).to(x.dtype).unsqueeze(2)  # [B, S, E, C]
        dispatch = disp1 + disp2  # [B, S, E, C] 0/1
        combine = gates[:, :, 0, None, None] * disp1 + gates[:, :, 1, None, None] * disp2  # [B, S, E, C]

        # Experts.
        xe = torch.einsum("bsec,bsh->ebch", dispatch, x)  # [E, B, C, H]
        h = F.gelu(torch.einsum("ebch,ehf->ebcf", xe, self.w1))  # [E, B, C, F]
        ye = torch.einsum("ebcf,efh->ebch", h, self.w2)  # [E, B, C, H]
        y = torch.einsum("bsec,ebch->bsh", combine, ye)  # [B, S, H]
        return y, aux * self.aux_loss_coef
