"""How one node runs on one device, given that device's local tensors.

Most ops run unchanged on their local shards. Two kinds need help:
  * ops that take a shape (view, reshape, expand, new_zeros, ...) get the local output shape;
  * ops whose strategy names a `local` variant run that variant, registered here with
    @variant by the rule family that needs it (e.g. a mean over a sharded dim divides the
    local sum by the global count, so that the local results add up to the global mean).

The planner's ground-truth checker and the runtime both execute nodes through run_node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..ir import Graph, Node, TensorRef
from ..placement import Placement
from . import Strategy


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


def variant(name: str) -> Callable[[VariantFn], VariantFn]:
    def deco(fn: VariantFn) -> VariantFn:
        assert name not in VARIANTS, f"local variant {name} registered twice"
        VARIANTS[name] = fn
        return fn

    return deco


def local_shape(graph: Graph, tensor: str, p: Placement, ctx: LocalContext) -> tuple[int, ...]:
    shape = list(graph.tensors[tensor].shape)
    if p.kind == "S":
        shape[p.dim] = ctx.split(tensor, p.dim)[ctx.device]
    return tuple(shape)


def substitute(obj, values: dict[str, torch.Tensor]):
    if isinstance(obj, TensorRef):
        return values[obj.name]
    if isinstance(obj, (list, tuple)):
        return type(obj)(substitute(x, values) for x in obj)
    if isinstance(obj, dict):
        return {k: substitute(v, values) for k, v in obj.items()}
    return obj


def run_node(node: Node, st: Strategy, values: dict[str, torch.Tensor], graph: Graph, ctx: LocalContext) -> tuple:
    """Run `node` under strategy `st` on this device's local input tensors (by tensor name)."""
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
    else:
        out = node.target(*args, **kwargs)
    return tuple(out) if isinstance(out, (list, tuple)) else (out,)


def _load_variants() -> None:
    from . import _load_families

    _load_families()
