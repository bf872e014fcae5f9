"""The paper's benchmark models (HAP, EuroSys'24, Table 1), each a plain nn.Module whose
forward(*inputs) returns the scalar training loss, with example inputs built in code.

    model, inputs = build("vit", layers=24, devices=8)          # paper width, 24 blocks, batch 512
    model, inputs = build("bert-moe", device="meta")            # shapes only, nothing allocated
    model, inputs = build("bert", scale="small")                # tiny, for tests and CPU training

| name     | paper size                                                   | params  | global batch |
|----------|--------------------------------------------------------------|---------|--------------|
| vgg19    | torchvision VGG19 (no BN) on 3x32x32, 10 classes             | 139.6M  | 64 per GPU   |
| vit      | 8 pre-norm blocks, 768 wide, 12 heads, MLP 3072, 4x4 patches | 56.8M   | 64 per GPU   |
| bert     | BERT-base, post-LN, vocab 33280, seq 128, MLM over all tokens| 111.6M  | 64 per GPU   |
| bert-moe | bert with every second FFN a top-2 MoE of 2 experts per GPU  | 536.4M* | 32 per GPU   |
| ncf      | NeuMF (MLPerf recommendation): 2.2M users, 855K items, 64 wide | 589.8M  | 256 per GPU  |
| ncf-sparse | ncf with sparse embedding gradients (nn.Embedding(sparse=True)) | 589.8M  | 256 per GPU  |

(* at 8 GPUs: 16 experts.) Knobs left as None take the paper's value (or the small one with
scale="small"). `hidden` scales the heads (64 wide at paper size) and the FFN (4x) with it;
for vgg19 it is the classifier width and `layers` picks VGG-11/13/16/19.

Pass device="meta" to get parameters and example inputs on the meta device: torch.export
and hap.capture work on it (verified with torch 2.13), so planning never allocates weights.
Parameters and inputs must be on the same device (meta parameters with real inputs fail).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from . import bert, ncf, vgg, vit

KNOBS = ("layers", "hidden", "seq", "experts")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    title: str
    knobs: tuple[str, ...]
    """Knobs the model takes besides batch."""
    batch_per_gpu: int
    """Global batch = batch_per_gpu * devices at the paper size."""
    paper_params_m: float
    """Parameter count at the paper size and 8 GPUs, in millions (what build makes)."""
    config: Callable[[str], Any]
    """scale ("paper" or "small") -> the default config dataclass."""
    model: type[nn.Module]
    example_inputs: Callable[[Any, int, torch.Generator], tuple[torch.Tensor, ...]]


def _paper_or_small(cls, **paper):
    return lambda scale: cls.small() if scale == "small" else cls(**paper)


MODELS: dict[str, ModelInfo] = {
    "vgg19": ModelInfo("vgg19", "VGG19 (CIFAR-10)", ("layers", "hidden"), 64, 139.6,
                       _paper_or_small(vgg.VGGConfig), vgg.VGG, vgg.example_inputs),
    "vit": ModelInfo("vit", "ViT (CIFAR-10, 4x4 patches)", ("layers", "hidden"), 64, 56.8,
                     _paper_or_small(vit.ViTConfig), vit.ViT, vit.example_inputs),
    "bert": ModelInfo("bert", "BERT-base (MLM)", ("layers", "hidden", "seq"), 64, 111.6,
                      _paper_or_small(bert.BertConfig), bert.Bert, bert.example_inputs),
    "bert-moe": ModelInfo("bert-moe", "BERT-MoE (top-2, every second layer)", ("layers", "hidden", "seq", "experts"),
                          32, 536.4, _paper_or_small(bert.BertConfig), bert.Bert, bert.example_inputs),
    "ncf": ModelInfo("ncf", "NCF (NeuMF, MLPerf recommendation)", ("layers", "hidden"), 256, 589.8,
                     _paper_or_small(ncf.NCFConfig), ncf.NCF, ncf.example_inputs),
    "ncf-sparse": ModelInfo("ncf-sparse", "NCF, sparse embedding gradients", ("layers", "hidden"), 256, 589.8,
                            lambda scale: dataclasses.replace(_paper_or_small(ncf.NCFConfig)(scale), sparse=True),
                            ncf.NCF, ncf.example_inputs),
}


def _info(name: str) -> ModelInfo:
    if name not in MODELS:
        raise ValueError(f"unknown model '{name}'; choose from {', '.join(MODELS)}")
    return MODELS[name]


def _positive(knob: str, v: int | None) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"{knob} must be a positive integer, got {v!r}")


def resolve(name: str, *, layers: int | None = None, hidden: int | None = None, batch: int | None = None,
            seq: int | None = None, experts: int | None = None, devices: int = 8,
            scale: str = "paper", dropout: float | None = None) -> tuple[ModelInfo, Any, int]:
    """The model's info, its config with the knobs applied, and the global batch."""
    info = _info(name)
    if scale not in ("paper", "small"):
        raise ValueError(f"scale must be 'paper' or 'small', got {scale!r}")
    given = {"layers": layers, "hidden": hidden, "seq": seq, "experts": experts}
    for knob, v in (*given.items(), ("batch", batch), ("devices", devices)):
        _positive(knob, v)
    for knob, v in given.items():
        if v is not None and knob not in info.knobs:
            takes = (*info.knobs, "batch", *(("dropout",) if hasattr(info.config(scale), "dropout") else ()))
            raise ValueError(f"model '{name}' has no '{knob}' knob; it takes {', '.join(takes)}")

    cfg = info.config(scale)
    changes: dict[str, Any] = {}
    if layers is not None:
        changes["layers"] = layers
    if hidden is not None:
        changes["hidden"] = hidden
        if hasattr(cfg, "heads"):  # transformers: keep the head width and the FFN ratio
            head_dim = cfg.hidden // cfg.heads
            if hidden % head_dim:
                raise ValueError(f"hidden must be a multiple of the head width {head_dim}, got {hidden}")
            changes["heads"] = hidden // head_dim
            ffn_field = "ffn" if hasattr(cfg, "ffn") else "mlp"
            changes[ffn_field] = getattr(cfg, ffn_field) * hidden // cfg.hidden
    if seq is not None:
        changes["seq"] = seq
    if name == "bert-moe":
        changes["experts"] = experts if experts is not None else 2 * devices
        if changes["experts"] < 2:
            raise ValueError(f"bert-moe routes each token to 2 experts; experts must be at least 2, got {changes['experts']}")
        layers_now = changes.get("layers", cfg.layers)
        if layers_now < 2:  # (every second layer's FFN is the MoE: one layer has none)
            raise ValueError(f"bert-moe's MoE is every second layer's FFN, so it needs at least 2 layers, got {layers_now}")
    if dropout is not None:
        if not hasattr(cfg, "dropout"):
            raise ValueError(f"model '{name}' has no dropout")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        changes["dropout"] = dropout
    cfg = dataclasses.replace(cfg, **changes)
    if batch is None:
        batch = 8 if scale == "small" else info.batch_per_gpu * devices
    return info, cfg, batch


def build(name: str, *, layers: int | None = None, hidden: int | None = None, batch: int | None = None,
          seq: int | None = None, experts: int | None = None, devices: int = 8, scale: str = "paper",
          device: str | torch.device | None = None, dropout: float | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model (in training mode) and its example inputs, both on `device` (default CPU).

    device="meta" allocates nothing, whatever the batch; hap.capture works on the result.
    Example inputs are random images / token ids and labels from a torch.Generator seeded 0
    (made on the CPU, then moved).
    """
    info, cfg, batch = resolve(name, layers=layers, hidden=hidden, batch=batch, seq=seq, experts=experts,
                               devices=devices, scale=scale, dropout=dropout)
    dev = torch.device(device if device is not None else "cpu")
    gen = torch.Generator().manual_seed(0)
    if dev.type == "meta":  # shapes only: one row's inputs tell them (dim 0 is the batch)
        inputs = tuple(torch.empty((batch, *t.shape[1:]), dtype=t.dtype, device=dev)
                       for t in info.example_inputs(cfg, 1, gen))
    else:
        inputs = tuple(t.to(dev) for t in info.example_inputs(cfg, batch, gen))
    with dev:
        model = info.model(cfg)
    return model.train(), inputs


def capture_device(scale: str | None) -> str | None:
    """Where to build a model for capturing the graph a plan is made for: a small one as the
    local ranks build it, on the CPU (None), for the meta device's graph can differ from theirs
    (ViT without dropout: attention's output strides give two more views); a paper-size one on
    the meta device, allocating nothing."""
    return None if scale == "small" else "meta"


def changing_knobs(name: str, devices: int = 8, **knobs) -> dict:
    """`knobs` less those that change nothing (a value the model takes by default, the paper
    scale): the same model keys the same AutoSync search whichever way it was asked for."""
    kept, built = dict(knobs), resolve(name, devices=devices, **knobs)[1:]
    for knob in sorted(knobs):
        fewer = {k: v for k, v in kept.items() if k != knob}
        if resolve(name, devices=devices, **fewer)[1:] == built:
            kept = fewer
    return kept


def param_count(name: str, **knobs) -> int:
    """Parameters of the model, counted on the meta device (nothing allocated)."""
    model, _ = build(name, device="meta", **knobs)
    return sum(p.numel() for p in model.parameters())


def describe(name: str, **knobs) -> str:
    """One line: parameters (millions), layers, hidden width and batch at these knobs."""
    info, cfg, batch = resolve(name, **knobs)
    model, _ = build(name, device="meta", **knobs)
    params = sum(p.numel() for p in model.parameters())
    count = f"{params / 1e6:.1f}M" if params >= 1e6 else f"{params / 1e3:.1f}K"
    parts = [f"{count} params", f"{cfg.layers} layers", f"hidden {cfg.hidden}"]
    if hasattr(cfg, "seq"):
        parts.append(f"seq {cfg.seq}")
    if getattr(cfg, "experts", 0):
        parts.append(f"{cfg.experts} experts")
    parts.append(f"batch {batch}")
    scale = knobs.get("scale", "paper")
    return f"{name} ({info.title}{', small' if scale == 'small' else ''}): {', '.join(parts)}"


__all__ = ["MODELS", "ModelInfo", "build", "describe", "param_count", "resolve"]
