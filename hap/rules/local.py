"""How one node runs on one device, given that device's local tensors.

Most ops run unchanged on their local shards. Three kinds need help:
  * ops that take a shape (view, reshape, expand, new_zeros, ...) get the local output shape;
  * ops whose strategy names a `local` variant run that variant, registered here with
    @variant by the rule family that needs it (e.g. a mean over a sharded dim divides the
    local sum by the global count, so that the local results add up to the global mean);
  * random ops (dropout, rand_like, attention with dropout) draw their random numbers for the
    whole tensor, exactly as one device would, and keep this device's part: with the same
    generator state on every device (the runtime keeps it so), sharded training then uses the
    very masks that single-device training would.

The planner's ground-truth checker and the runtime both execute nodes through run_node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .._torch import safe_softmax, schema_arg, schema_names
from ..ir import VIEW_OPS, Graph, Node, TensorRef
from ..placement import Placement
from . import RANDOM_OPS, Strategy


@dataclass(kw_only=True)
class LocalContext:
    device: int
    """This device's index."""
    world: int
    """Number of devices."""
    split: Callable[[str, int], list[int]]
    """Per-device sizes of a sharded (tensor, dim)."""
    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    """Sum of a tensor over all devices (a collective: every device must call it)."""
    noise: Callable[[Node, torch.device | str], object] | None = None
    """A random node's whole draw (`whole_noise`) on a device, drawn earlier (or timed); None:
    draw it now from torch's generator. A pipeline draws each once per step, in one device's order, for all
    its micro-batches."""

    def offset(self, tensor: str, dim: int) -> int:
        """Where this device's shard of (tensor, dim) starts."""
        return sum(self.split(tensor, dim)[: self.device])


VariantFn = Callable[[Node, Strategy, tuple, dict, LocalContext, Graph], object]
VARIANTS: dict[str, VariantFn] = {}

# Ops with a shape argument at this position: it becomes the local output shape.
SIZE_ARGS: dict[str, int] = {
    "aten.view.default": 1, "aten.reshape.default": 1, "aten._unsafe_view.default": 1,
    "aten.expand.default": 1, "aten.new_zeros.default": 1, "aten.new_ones.default": 1,
    "aten.new_empty.default": 1, "aten.new_full.default": 1, "aten.zeros.default": 0,
    "aten.ones.default": 0, "aten.full.default": 0, "aten.empty.memory_format": 0,
}


# A variant's own collectives, for the cost model: node, graph -> [(kind, bytes)] made in the
# forward and the backward. Variants not listed make none the cost model must see.
CollectivesFn = Callable[[Node, Graph], list[tuple[str, float]]]
VARIANT_COLLECTIVES: dict[str, CollectivesFn] = {}


def variant(name: str, collectives: CollectivesFn | None = None) -> Callable[[VariantFn], VariantFn]:
    def deco(fn: VariantFn) -> VariantFn:
        assert name not in VARIANTS, f"local variant {name} registered twice"
        VARIANTS[name] = fn
        if collectives is not None:
            VARIANT_COLLECTIVES[name] = collectives
        return fn

    return deco


def variant_collectives(node: Node, st: Strategy, graph: Graph) -> list[tuple[str, float]]:
    """The collectives (kind, bytes) that running `node` under `st` makes inside the node."""
    if st.local is None:
        return []
    _load_variants()
    found = VARIANT_COLLECTIVES.get(st.local)
    return found(node, graph) if found is not None else []


def local_shape(graph: Graph, tensor: str, p: Placement, ctx: LocalContext) -> tuple[int, ...]:
    shape = list(graph.tensors[tensor].shape)
    if p.kind == "S":
        shape[p.dim] = ctx.split(tensor, p.dim)[ctx.device]
    return tuple(shape)


def substitute(obj, values: dict[str, torch.Tensor]):
    """obj (a node's args or kwargs) with every TensorRef replaced by its value. Exact type
    tests first: this runs for every node of every step."""
    kind = type(obj)
    if kind is TensorRef:
        return values[obj.name]
    if kind is tuple or kind is list:
        return kind([substitute(x, values) for x in obj])
    if kind is dict:
        return {k: substitute(v, values) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):  # torch.fx's immutable_list and other subclasses
        return kind(substitute(x, values) for x in obj)
    return obj


def run_node(node: Node, st: Strategy, values: dict[str, torch.Tensor], graph: Graph, ctx: LocalContext) -> tuple:
    """Run `node` under strategy `st` on this device's local input tensors (by tensor name)."""
    empty = _empty_outputs(node, st, values, graph, ctx)
    if isinstance(empty, Made):
        return empty
    values = values if empty is None else empty
    args = substitute(node.args, values)
    kwargs = substitute(node.kwargs, values)
    pos = SIZE_ARGS.get(node.op)
    if pos is not None:
        shape = list(local_shape(graph, node.outputs[0], st.outputs[0], ctx))
        if pos < len(args):
            args = (*args[:pos], shape, *args[pos + 1:])
        else:
            kwargs = {**kwargs, "size": shape}
    if st.local is not None:
        _load_variants()
        out = VARIANTS[st.local](node, st, args, kwargs, ctx, graph)
    elif is_random(node) and drawn_whole(node):
        random_op = _attention_with_dropout if node.op == ATTENTION else _random
        out = random_op(node, st, args, kwargs, ctx, graph)
    else:
        # A shard may be a strided slice of its tensor where the whole one was contiguous:
        # views are taken as reshapes (a view where possible, else a copy).
        target = torch.ops.aten.reshape.default if node.op in VIEW_OPS else node.target
        try:
            out = target(*args, **kwargs)
        except RuntimeError as e:  # say which node, under which strategy, on which device
            raise RuntimeError(f"{node.name} = {node.op} [{st}] on device {ctx.device}: {e}") from e
    return tuple(out) if isinstance(out, (list, tuple)) else (out,)


class Made(tuple):
    """Outputs made without computing (an idle device's empty or zero shards): an emulated slow
    device is not slower at this, as a slow GPU launches no kernel for it."""


def _empty_outputs(node: Node, st: Strategy, values: dict[str, torch.Tensor], graph: Graph, ctx: LocalContext):
    """A device with a zero ratio holds empty shards, and some ops refuse or misread empty
    operands. Returns None (run the op as it is), the outputs made directly (Made: where this
    device's shard of every output is empty, it has nothing to compute; they are tied to the
    inputs so that their gradients are zeros, not missing), or the inputs to run the op on
    instead (_fill_empty_contraction)."""
    if st.local is not None:  # a variant may call collectives, which every device must join: run it
        return None
    if is_random(node):  # an idle device still draws what one device draws: the generators stay as one
        return None
    if node.op == "aten.embedding.default" and len(node.args) > 4 and node.args[4]:
        return None  # torch looks up no ids; the gradient stays sparse (empty), as its sync expects
    if all(x.numel() for x in values.values() if isinstance(x, torch.Tensor)):  # the common case
        return None
    starved = [name for name, x in values.items() if isinstance(x, torch.Tensor) and x.numel() == 0]
    if not any(graph.tensors[name].numel for name in starved):  # empty on one device too
        return None
    shapes = [local_shape(graph, name, p, ctx) for name, p in zip(node.outputs, st.outputs)]
    if not shapes or not any(graph.tensors[name].numel for name in node.outputs):  # empty on one device too
        return None
    if any(math.prod(shape) for shape in shapes) and not all(p.kind == "P" for p in st.outputs):
        return None
    if any(p.kind == "P" for p in st.inputs):  # an additive term this device may owe
        return _fill_empty_contraction(node, st, values)
    # Partial sums over a contracted dim this device holds none of are zeros (an empty sum);
    # torch would instead contract nothing into a wrongly shaped result.
    ties = [x.sum() * 0 for x in values.values() if isinstance(x, torch.Tensor) and x.requires_grad]
    device = next((x.device for x in values.values() if isinstance(x, torch.Tensor)), None)
    outs = []
    for name, shape in zip(node.outputs, shapes):
        out = torch.zeros(shape, dtype=getattr(torch, graph.tensors[name].dtype), device=device)
        if ties and out.is_floating_point():
            out = out + sum(ties)
        outs.append(out)
    return Made(outs)


def _fill_empty_contraction(node: Node, st: Strategy, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Partial sums over a contracted dim this device holds none of, plus an additive term it
    may owe (linear's or a convolution's bias, loaded as P: rank 0's part is the bias). The
    empty sum is zero, but torch contracts nothing into a wrongly shaped result (a convolution
    over no input channels keeps no output channels). One zero slice in place of each empty
    shard contracts to the same zero, in the right shape, with the additive term added.
    Law: for out = f(x, W) + b, f linear in each sharded operand: f(x_{}, W_{}) = f(0, 0) = 0."""
    filled = dict(values)
    for name, p in zip(node.inputs, st.inputs):
        x = values.get(name)
        if isinstance(x, torch.Tensor) and p.is_shard and x.shape[p.dim] == 0:
            zero = x.new_zeros([1 if d == p.dim else n for d, n in enumerate(x.shape)])
            filled[name] = torch.cat([x, zero], p.dim)  # gradient: the empty shard's, empty
    return filled


def _load_variants() -> None:
    from . import _load_families

    _load_families()


# ---------------------------------------------------------------------------------------------
# Random ops: the whole tensor's random numbers, this device's part of them.

DROPOUTS = {"aten.dropout.default", "aten.native_dropout.default", "aten.feature_dropout.default"}
ATTENTION = "aten.scaled_dot_product_attention.default"


def is_random(node: Node) -> bool:
    """Whether the node draws random numbers (dropout in training with p > 0, rand_like,
    attention with dropout, any op torch tags nondeterministic_seeded)."""
    if node.op == ATTENTION:
        return attention_dropout(node.args, node.kwargs) > 0
    if node.op in DROPOUTS:  # (x, p, train)
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return float(p) > 0 and train is not False
    return node.op in RANDOM_OPS or _seeded(node)


def _seeded(node: Node) -> bool:
    """Whether torch tags the op nondeterministic_seeded and it draws here: attention kernels,
    recurrent layers, alpha dropout and RReLU carry the tag for draws that a rate of 0 (or
    train/training False) turns off."""
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    dropout_like = "dropout" in node.op  # (alpha_dropout's p is a rate; bernoulli's a probability)
    for name in ("dropout_p", "dropout", "train", "training") + (("p",) if dropout_like else ()):
        if name in schema_names(target) and not schema_arg(target, node.args, node.kwargs, name):
            return False
    return True


def drawn_whole(node: Node) -> bool:
    """Whether a random node's draws depend on its input's shape alone, so that each device
    can draw them whole and keep its part (_random); else (bernoulli of probabilities) the
    node runs replicated, every device drawing what one device draws."""
    return node.op == ATTENTION or node.op in DROPOUTS or node.op in RANDOM_OPS


def drawn_replicated(node: Node) -> bool:
    """Whether the node draws random numbers from its input's values (bernoulli of
    probabilities): it runs replicated, every device drawing what one device draws."""
    return is_random(node) and not drawn_whole(node)


def _part(whole: torch.Tensor, tensor: str, p: Placement, ctx: LocalContext) -> torch.Tensor:
    """This device's part of a whole tensor in placement p (S: its shard; else all of it)."""
    if p.kind != "S":
        return whole
    return whole.narrow(p.dim, ctx.offset(tensor, p.dim), ctx.split(tensor, p.dim)[ctx.device])


def whole_noise(node: Node, graph: Graph, device: torch.device | str = "cpu"):
    """The random numbers one device draws for a random node, whole, from torch's generator:
    a dropout's noise (mask / (1 - p); native_dropout: and its mask), the values of rand_like,
    randn_like or bernoulli, attention's noise over every (batch, head, query, key). Drawn from
    the CPU generator, which the ranks share, and moved to `device`: on GPUs the draws are those
    one CPU device makes, not those of one GPU's generator."""
    return _to(_noise_on_host(node, graph), device)


def _noise_on_host(node: Node, graph: Graph):
    if node.op == ATTENTION:
        q_shape, k_shape = graph.tensors[node.inputs[0]].shape, graph.tensors[node.inputs[1]].shape
        whole = torch.ones((*q_shape[:-1], k_shape[-2]), dtype=getattr(torch, graph.tensors[node.inputs[0]].dtype))
        return torch.ops.aten.dropout.default(whole, attention_dropout(node.args, node.kwargs), True)
    if not node.inputs:  # a factory (rand, randn): its arguments are constants
        return node.target(*node.args, **{**node.kwargs, "device": "cpu"})
    x = graph.tensors[node.inputs[0]]
    dtype = getattr(torch, x.dtype)  # the shape (and memory order: empty_like keeps strides) one device draws for
    whole = torch.ones(x.shape, dtype=dtype) if x.stride is None else torch.empty_strided(x.shape, x.stride, dtype=dtype).fill_(1)
    return node.target(whole, *node.args[1:], **node.kwargs)  # the arguments after the input are constants


def _to(drawn, device):
    return tuple(_to(d, device) for d in drawn) if isinstance(drawn, tuple) else drawn.to(device)


def _random(node: Node, st: Strategy, args: tuple, kwargs: dict, ctx: LocalContext, graph: Graph):
    out_name, out_p = node.outputs[0], st.outputs[0]
    x = args[0]  # a factory's: its size
    device = x.device if node.inputs else kwargs.get("device") or "cpu"
    drawn = ctx.noise(node, device) if ctx.noise else whole_noise(node, graph, device)
    if node.op not in DROPOUTS:  # rand_like, randn_like, bernoulli, rand, randn: the values depend on the shape only
        return _part(drawn, out_name, out_p, ctx)
    if node.op == "aten.native_dropout.default":
        noise, mask = drawn  # noise = mask / (1 - p)
        return x * _part(noise, out_name, out_p, ctx), _part(mask, node.outputs[1], st.outputs[1], ctx)
    # dropout is linear in x for a fixed mask, so a partial-sum x takes the whole mask too
    return x * _part(drawn, out_name, out_p, ctx)


def attention_dropout(args: tuple, kwargs: dict) -> float:
    return float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0))


def _attention_with_dropout(node: Node, st: Strategy, args: tuple, kwargs: dict, ctx: LocalContext, graph: Graph):
    """Attention by its definition (torch's math path, which CPU training with dropout takes),
    its dropout noise drawn for all (batch, head, query, key) and sliced like q."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    a = {**dict(zip(names, args)), **kwargs}
    q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
    if a.get("enable_gqa") and k.shape[-3] != q.shape[-3]:  # each k/v head serves a run of q heads, as torch repeats
        # them (a device's q heads are whole runs of its k/v heads: rules.nn.attention)
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)  # [.., H, S, E]
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)  # [.., H, S, Ev]
    # scaled as torch's math path scales (q and k each by the root of the scale), so that a
    # device's rows round as one device's do (q @ k^T * scale differs in the last bits, which
    # small models' training amplified past 1e-3 within 3 steps)
    root = math.sqrt(a.get("scale") or 1.0 / math.sqrt(q.shape[-1]))
    scores = (q * root) @ (k.transpose(-2, -1) * root)  # [.., L, S]
    if a.get("is_causal"):
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = safe_softmax(scores, dim=-1)  # (a query whose keys are all masked: zeros, as torch's, not NaN)
    noise = ctx.noise(node, q.device) if ctx.noise else whole_noise(node, graph, q.device)  # every score's noise
    return _part(noise, node.inputs[0], st.inputs[0], ctx).mul(weights) @ v
