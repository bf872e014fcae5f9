"""A real task that needs no download: scikit-learn's bundled handwritten digits (1797 8x8
grey images, 10 classes), split 80/20 into train and test with a fixed seed, for a small ViT.

    model = vit_for_digits()                        # 2 blocks, width 128, 4 heads, 2x2 patches, mean-pooled
    train, test = digits_split()                    # (images [n, 1, 8, 8], labels [n]) each
    batches = epoch_batches(train, batch=64, epoch=0, seed=0)
    accuracy(model, test)
"""

from __future__ import annotations

import torch

from .vit import ViT, ViTConfig


def vit_config(hidden: int = 128, layers: int = 2, heads: int = 4, mlp: int = 512) -> ViTConfig:
    return ViTConfig(layers=layers, hidden=hidden, heads=heads, mlp=mlp, image=8, patch=2, classes=10, dropout=0.0,
                     channels=1, pool="mean")


def vit_for_digits(**kw) -> ViT:
    return ViT(vit_config(**kw))


def digits_split(test_share: float = 0.2, seed: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(train, test), each (images [n, 1, 8, 8] scaled to mean 0 / std 1, labels [n])."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1)  # [1797, 1, 8, 8], values 0..16
    images = (images - images.mean()) / images.std()
    labels = torch.tensor(data.target, dtype=torch.long)  # [1797]
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(labels) * (1 - test_share))
    train, test = order[:cut], order[cut:]
    return (images[train], labels[train]), (images[test], labels[test])


def epoch_batches(data: tuple[torch.Tensor, torch.Tensor], batch: int, epoch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of full batches (the remainder dropped: every step has the planned shape), shuffled per epoch."""
    images, labels = data
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return [(images[order[i:i + batch]], labels[order[i:i + batch]]) for i in range(0, len(labels) - batch + 1, batch)]


@torch.no_grad()
def accuracy(model: ViT, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Share of `data` classified right by `model` (its head's argmax)."""
    images, labels = data
    was = model.training
    model.eval()
    logits = model.logits(images)  # [n, 10]
    model.train(was)
    return float((logits.argmax(-1) == labels).float().mean())
