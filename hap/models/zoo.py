"""Models from a popular model library (Hugging Face transformers), randomly initialized in tiny
configurations, nothing downloaded: what a new user hands hap. Each is wrapped so that its
forward takes tensors and returns the library's training loss, unchanged otherwise.

    model, batches = build("llama", steps=2)       # needs `pip install transformers torch==2.13.0`
    loss = model(*batches[0])

| name    | architecture                                                        |
|---------|---------------------------------------------------------------------|
| bert    | encoder classifier (BertForSequenceClassification), dropout on       |
| gpt2    | decoder LM, output projection tied to the input embedding            |
| llama   | decoder LM: RMSNorm, rotary embeddings, grouped-query attention      |
| mixtral | mixture-of-experts decoder LM (top-2 of 4 experts), GQA, rotary      |
| t5      | encoder-decoder (T5ForConditionalGeneration), relative position bias |
| vit     | vision transformer classifier (ViTForImageClassification)            |
| resnet  | CNN with BatchNorm (ResNetForImageClassification)                    |
| convnext| CNN with depthwise convolutions, LayerNorm and layer scale (ConvNext) |
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

VOCAB, SEQ, BATCH, IMAGE = 96, 16, 8, 32


class LibraryModel(nn.Module):
    """A library model whose forward takes keyword tensors: called with them in `keys` order,
    it returns the library's loss."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.m, self.keys = model, keys

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.m(**dict(zip(self.keys, tensors))).loss


def _tokens(gen, steps, labels: Callable | None = None):
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        out.append((ids, labels(gen) if labels else ids.clone()))
    return out


def _images(gen, steps, classes):
    return [(torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen), torch.randint(0, classes, (BATCH,), generator=gen))
            for _ in range(steps)]


def _bert(T, gen, steps):
    cfg = T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=64, num_labels=3)
    batches = _tokens(gen, steps, lambda g: torch.randint(0, 3, (BATCH,), generator=g))
    return LibraryModel(T.BertForSequenceClassification(cfg), ("input_ids", "labels")), batches


def _gpt2(T, gen, steps):
    cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                       eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return LibraryModel(T.GPT2LMHeadModel(cfg), ("input_ids", "labels")), _tokens(gen, steps)


def _llama(T, gen, steps):
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    return LibraryModel(T.LlamaForCausalLM(cfg), ("input_ids", "labels")), _tokens(gen, steps)


def _llama_padded(T, gen, steps):
    """Llama given an attention_mask: rows of different lengths, right-padded, their padding
    ignored by the loss (-100), as a batch of sentences comes."""
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    batches = []
    for ids, _ in _tokens(gen, steps):
        lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=gen)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()  # [B, T]: 1 for tokens, 0 for padding
        batches.append((ids * mask, mask, ids.masked_fill(mask == 0, -100)))
    return LibraryModel(T.LlamaForCausalLM(cfg), ("input_ids", "attention_mask", "labels")), batches


def _gpt2_left_padded(T, gen, steps):
    """GPT-2 with dropout given an attention_mask of left padding, as batches for generation
    come: a padded query sees no key at all under the causal mask (attention's safe softmax
    gives it zeros, where a plain softmax gives NaN)."""
    cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                       eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    batches = []
    for ids, _ in _tokens(gen, steps):
        pads = torch.randint(0, SEQ // 2, (BATCH,), generator=gen)
        mask = (torch.arange(SEQ)[None, :] >= pads[:, None]).long()  # [B, T]: 0 for the leading padding
        batches.append((ids * mask, mask, ids.masked_fill(mask == 0, -100)))
    return LibraryModel(T.GPT2LMHeadModel(cfg), ("input_ids", "attention_mask", "labels")), batches


def _mixtral(T, gen, steps, experts_implementation: str | None = None):
    cfg = T.MixtralConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=64,
                          **({"experts_implementation": experts_implementation} if experts_implementation else {}))
    return LibraryModel(T.MixtralForCausalLM(cfg), ("input_ids", "labels")), _tokens(gen, steps)


def _t5(T, gen, steps):
    cfg = T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                     decoder_start_token_id=0, dropout_rate=0.0)
    batches = _tokens(gen, steps, lambda g: torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g))
    return LibraryModel(T.T5ForConditionalGeneration(cfg), ("input_ids", "labels")), batches


def _vit(T, gen, steps):
    cfg = T.ViTConfig(image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, num_labels=5)
    return LibraryModel(T.ViTForImageClassification(cfg), ("pixel_values", "labels")), _images(gen, steps, 5)


def _resnet(T, gen, steps):
    cfg = T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5)
    return LibraryModel(T.ResNetForImageClassification(cfg), ("pixel_values", "labels")), _images(gen, steps, 5)


def _convnext(T, gen, steps):
    cfg = T.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5, patch_size=4)
    return LibraryModel(T.ConvNextForImageClassification(cfg), ("pixel_values", "labels")), _images(gen, steps, 5)


ZOO: dict[str, Callable] = {"bert": _bert, "gpt2": _gpt2, "llama": _llama, "mixtral": _mixtral, "t5": _t5,
                            "vit": _vit, "resnet": _resnet, "convnext": _convnext}
VARIANTS: dict[str, Callable] = {
    # each token times each of its experts, per token (transformers' "batched_mm" experts): data
    # parallel, where the default sorts all the batch's tokens by expert
    "mixtral-batched": lambda T, gen, steps: _mixtral(T, gen, steps, "batched_mm"),
    "llama-padded": _llama_padded,
    "gpt2-left-padded": _gpt2_left_padded,
}


def build(name: str, steps: int = 2, seed: int = 0) -> tuple[nn.Module, list[tuple[torch.Tensor, ...]]]:
    """The model `name` (same weights for the same seed, in training mode) and `steps` batches."""
    if name not in ZOO and name not in VARIANTS:
        raise ValueError(f"unknown zoo model {name!r}; choose from {', '.join([*ZOO, *VARIANTS])}")
    import transformers

    transformers.logging.set_verbosity_error()  # config notices about unused token ids
    torch.manual_seed(seed)
    model, batches = {**ZOO, **VARIANTS}[name](transformers, torch.Generator().manual_seed(seed), steps)
    return model.train(), batches
