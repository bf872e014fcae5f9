"""BERT-base with a masked-LM loss, and BERT-MoE (every second FFN a top-2 MoE, see moe.py).

Post-LN blocks as in the original BERT: x = LN(x + Dropout(Attn(x))), x = LN(x + Dropout(FFN(x))).
Token + learned position embeddings (position ids are a non-persistent buffer), LayerNorm and
dropout 0.1; no token-type embeddings (inputs are single segments). The MLM head is BERT's:
Linear-GELU-LayerNorm, then a decoder tied to the token embedding plus a bias, with the
cross entropy taken over every position (the benchmark predicts all tokens, no masking).

Paper size: 12 layers, hidden 768, 12 heads, FFN 3072, vocab 33280, sequence 128:
~111.6M parameters. BERT-MoE at 16 experts: ~536.4M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .moe import MoEFFN
from .vit import MLP, SelfAttention


@dataclass
class BertConfig:
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    ffn: int = 3072
    vocab: int = 33280
    seq: int = 128
    max_pos: int = 512  # rows of the position embedding (raised to seq if seq is longer)
    dropout: float = 0.1
    experts: int = 0  # > 0: every second layer's FFN is a top-2 MoE with this many experts
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01

    @classmethod
    def small(cls) -> BertConfig:
        return cls(layers=2, hidden=32, heads=2, ffn=128, vocab=1000, seq=16, max_pos=16)

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer % 2 == 1


class Block(nn.Module):
    """Post-LN transformer block; its FFN is dense or a mixture of experts."""

    def __init__(self, cfg: BertConfig, moe: bool):
        super().__init__()
        self.attn = SelfAttention(cfg.hidden, cfg.heads, cfg.dropout)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=1e-12)
        if moe:
            self.ffn = MoEFFN(cfg.hidden, cfg.ffn, cfg.experts, cfg.capacity_factor, cfg.aux_loss_coef)
        else:
            self.ffn = MLP(cfg.hidden, cfg.ffn)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=1e-12)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.ln1(x + self.drop(self.attn(x)))  # [B, S, H]
        aux = None
        if isinstance(self.ffn, MoEFFN):
            y, aux = self.ffn(x)  # [B, S, H], scalar
        else:
            y = self.ffn(x)  # [B, S, H]
        x = self.ln2(x + self.drop(y))  # [B, S, H]
        return x, aux


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        max_pos = max(cfg.max_pos, cfg.seq)
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_emb = nn.Embedding(max_pos, cfg.hidden)
        self.register_buffer("pos_ids", torch.arange(max_pos), persistent=False)  # [max_pos]
        self.ln_emb = nn.LayerNorm(cfg.hidden, eps=1e-12)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe(i)) for i in range(cfg.layers))
        self.head_dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.head_ln = nn.LayerNorm(cfg.hidden, eps=1e-12)
        self.decoder_bias = nn.Parameter(torch.zeros(cfg.vocab))
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        B, S = ids.shape  # [B, S] token ids
        x = self.tok_emb(ids) + self.pos_emb(self.pos_ids[:S])  # [B, S, H]
        x = self.drop(self.ln_emb(x))  # [B, S, H]
        aux_loss = None
        for block in self.blocks:
            x, aux = block(x)  # [B, S, H]
            if aux is not None:
                aux_loss = aux if aux_loss is None else aux_loss + aux
        h = self.head_ln(F.gelu(self.head_dense(x)))  # [B, S, H]
        logits = F.linear(h, self.tok_emb.weight, self.decoder_bias)  # [B, S, V] decoder tied to the embedding
        loss = F.cross_entropy(logits.view(B * S, -1), labels.view(B * S))
        return loss if aux_loss is None else loss + aux_loss


def example_inputs(cfg: BertConfig, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=gen)  # [B, S]
    labels = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=gen)  # [B, S]
    return ids, labels
