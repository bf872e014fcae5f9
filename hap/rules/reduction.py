"""Reductions and scans along dims.

Law (independence): a reduction works along its reduced dims only, so a kept dim shards the
input and the output alike:  red(concat_j x_j along kept d) = concat_j red(x_j).
Law (linearity): sum is additive over a split of the reduced dim, and linear in its input:
    sum_i x[i] = sum_j sum_{i in shard j} x[i]    (S(d) reduced -> P)
    sum(x_1 + x_2) = sum(x_1) + sum(x_2)          (P -> P)
mean is sum / n with n the global count, so a shard's share is its local sum / n (the
"mean_over_shards" variant). max, argmax, var, norm, logsumexp, any, ... combine shards by
something other than a sum, so they only shard kept dims. Scans (cumsum) shard the dims
they do not scan; cumsum is linear (P -> P).
"""

from __future__ import annotations

import math

import torch

from .._torch import schema_arg
from ..ir import Graph, Node
from . import P, S, Strategy, ndim, norm_dim, register, shape_of
from .local import variant


def _get(node: Node, name: str):
    """An argument by its schema name: positional, keyword, or the schema's default."""
    return schema_arg(node.target, node.args, node.kwargs, name)


def reduced_dims(node: Node, graph: Graph) -> tuple[list[int], dict[int, int]] | None:
    """The reduced input dims and, for each kept dim, its output dim; None where the graph's
    output shape disagrees (an argument form not modeled here, e.g. any(x, dim=[]))."""
    shape = shape_of(graph, node.inputs[0])
    dims, keepdim = _get(node, "dim"), bool(_get(node, "keepdim"))
    if isinstance(dims, int):
        dims = [dims]
    if not dims:
        dims = range(len(shape))  # no dim (None or []): reduce everything
    reduced = sorted({norm_dim(d, len(shape)) for d in dims})
    kept = [d for d in range(len(shape)) if d not in reduced]
    out_dim = {d: d if keepdim else kept.index(d) for d in kept}
    expect = tuple(1 if d in reduced else n for d, n in enumerate(shape) if keepdim or d not in reduced)
    if expect != shape_of(graph, node.outputs[0]):
        return None
    return reduced, out_dim


def reduce_strategies(node: Node, graph: Graph, additive: bool = False, local: str | None = None) -> list[Strategy]:
    """Kept dims shard alike (all outputs); an additive reduction also turns a sharded reduced
    dim into a partial sum (run as `local`) and passes partial sums through."""
    if ndim(graph, node.inputs[0]) == 0 or (found := reduced_dims(node, graph)) is None:
        return []
    reduced, out_dim = found
    n_out = len(node.outputs)
    sts = [Strategy((S(d),), (S(o),) * n_out, f"dim{d}") for d, o in out_dim.items()]
    if additive:
        sts += [Strategy((S(d),), (P,), f"reduce{d}", local) for d in reduced]
        sts.append(Strategy((P,), (P,), "partial"))
    return sts


@register("aten.sum.default", "aten.sum.dim_IntList")
def sum_(node: Node, graph: Graph) -> list[Strategy]:
    # sum over a sharded dim = sum over devices of local sums; linear in x.
    return reduce_strategies(node, graph, additive=True)


@register("aten.mean.default", "aten.mean.dim")
def mean(node: Node, graph: Graph) -> list[Strategy]:
    # mean = sum / n: over a sharded dim each device divides its local sum by the global n.
    # A kept sharded dim needs no help: the local mean is over the same n elements.
    return reduce_strategies(node, graph, additive=True, local="mean_over_shards")


@variant("mean_over_shards")
def mean_over_shards(node, st, args, kwargs, ctx, graph):
    # sum_j (local sum_j / n) = global sum / n, with n = numel(x) / numel(out) from the graph.
    dims, _ = reduced_dims(node, graph)
    n = math.prod(shape_of(graph, node.inputs[0])) // math.prod(shape_of(graph, node.outputs[0]))
    return torch.sum(args[0], dims, keepdim=bool(_get(node, "keepdim")), dtype=kwargs.get("dtype")) / n


@register("aten.amax.default", "aten.amin.default", "aten.max.dim", "aten.min.dim", "aten.argmax.default",
          "aten.argmin.default", "aten.logsumexp.default", "aten.linalg_vector_norm.default",
          "aten.norm.ScalarOpt_dim", "aten.norm.ScalarOpt_dim_dtype", "aten.any.dim", "aten.any.dims",
          "aten.all.dim", "aten.all.dims")
def nonlinear_reduction(node: Node, graph: Graph) -> list[Strategy]:
    # Shards of a reduced dim combine by max / log-sum-exp / p-norm / or / and, none a sum:
    # only kept dims are sharded (values and indices alike for max.dim).
    return reduce_strategies(node, graph)


@register("aten.var.default", "aten.var.dim", "aten.var.correction", "aten.std.default", "aten.std.dim",
          "aten.std.correction", "aten.var_mean.dim", "aten.var_mean.correction", "aten.std_mean.dim",
          "aten.std_mean.correction")
def moments(node: Node, graph: Graph) -> list[Strategy]:
    # The variance of a split dim needs every shard's mean first: only kept dims are sharded.
    return reduce_strategies(node, graph)


def _scan(node: Node, graph: Graph) -> list[Strategy]:
    rank = ndim(graph, node.inputs[0])
    dim = norm_dim(_get(node, "dim"), rank)
    return [Strategy((S(k),), (S(k),), f"dim{k}") for k in range(rank) if k != dim]


@register("aten.cumsum.default")
def cumsum(node: Node, graph: Graph) -> list[Strategy]:
    # Rows of other dims scan independently; a prefix sum is linear: cumsum(x1 + x2) = ...
    return _scan(node, graph) + [Strategy((P,), (P,), "partial")]


@register("aten.cumprod.default", "aten.logcumsumexp.default")
def nonlinear_scan(node: Node, graph: Graph) -> list[Strategy]:
    return _scan(node, graph)
