"""Neural-network layer ops: softmax, norms, embedding, attention, convolution, pooling,
losses, and the routing ops of mixture-of-experts layers (topk, one_hot, scatter, sort).

Each of these couples elements along some dims (the softmax dim, the normalized dims, the
attention sequence, a convolution window, the sorted dim) and is independent along the
others (batch, heads, channels). Rules shard only independent dims:
    f(concat_j x_j) = concat_j f(x_j)   along an independent dim,
with parameters that apply to every position replicated (their gradients summed). The
exceptions are noted at their rules: contracted channels give partial sums, the vocabulary-
parallel embedding and mean-reduced losses run local variants.
"""

from __future__ import annotations

import math

import torch

from ..ir import Graph, Node
from . import P, R, S, Strategy, arg, ndim, norm_dim, register, shape_of
from .local import variant

MEAN, SUM, NONE = 1, 2, 0  # at::Reduction


def _dim_name(d: int, names: tuple[str, ...] = ("batch",)) -> str:
    return names[d] if d < len(names) else f"dim{d}"


def _along(node: Node, d: int, name: str) -> Strategy:
    """The first input and every output sharded on d, the other inputs replicated."""
    ins = (S(d),) + (R,) * (len(node.inputs) - 1)
    return Strategy(ins, tuple(S(d) for _ in node.outputs), name)


def _is_float(graph: Graph, name: str) -> bool:
    return graph.tensors[name].dtype.startswith(("float", "bfloat"))


# ---------------------------------------------------------------------------------------------
# Softmax, sorting and top-k: coupled along one dim only.


@register("aten._softmax.default", "aten.softmax.int", "aten._log_softmax.default", "aten.log_softmax.int")
def softmax(node: Node, graph: Graph) -> list[Strategy]:
    # softmax(x, k)[i] = exp(x[i]) / sum_k exp(x[..k..]): rows along any other dim are independent.
    rank = ndim(graph, node.inputs[0])
    k = norm_dim(arg(node, 1, "dim"), rank)
    return [_along(node, d, _dim_name(d)) for d in range(rank) if d != k]


@register("aten.topk.default", "aten.sort.default", "aten.sort.stable", "aten.argsort.default", "aten.argsort.stable")
def sort_like(node: Node, graph: Graph) -> list[Strategy]:
    # topk/sort/argsort act on the slices along `dim` one at a time; values and indices
    # (positions within a slice) are unchanged when other dims are split.
    rank = ndim(graph, node.inputs[0])
    pos = 2 if node.op == "aten.topk.default" else 1
    dim = node.kwargs.get("dim", -1) if node.op.endswith(".stable") else arg(node, pos, "dim", -1)
    k = norm_dim(dim, rank)
    return [_along(node, d, _dim_name(d)) for d in range(rank) if d != k]


@register("aten.one_hot.default")
def one_hot(node: Node, graph: Graph) -> list[Strategy]:
    # one_hot(i)[..., c] = (i[...] == c): pointwise in i, with a new trailing class dim.
    if arg(node, 1, "num_classes", -1) < 0:
        return []  # the class count would come from each device's local maximum
    return [_along(node, d, _dim_name(d)) for d in range(ndim(graph, node.inputs[0]))]


@register("aten.scatter.src", "aten.scatter.value", "aten.scatter.reduce", "aten.scatter.value_reduce",
          "aten.scatter_add.default", "aten.scatter_reduce.two")
def scatter(node: Node, graph: Graph) -> list[Strategy]:
    # out[.., index[.., i, ..], ..] (op)= src[.., i, ..] along `dim`; every other dim d pairs
    # self, index and src elementwise, provided index spans self and src on d (it may be shorter).
    shapes = [shape_of(graph, t) for t in node.inputs]
    k = norm_dim(arg(node, 1, "dim"), len(shapes[0]))
    found = [Strategy(tuple(S(d) for _ in shapes), (S(d),), _dim_name(d))
             for d in range(len(shapes[0])) if d != k and len({s[d] for s in shapes}) == 1]
    if node.op == "aten.scatter_add.default":
        # Linear in (self, src) jointly:  scatter_add(a1 + a2, i, s1 + s2) = sum of the parts.
        found.append(Strategy((P, R, P), (P,), "partial"))
    return found


# ---------------------------------------------------------------------------------------------
# Normalization.


@register("aten.layer_norm.default", "aten.native_layer_norm.default", "aten.rms_norm.default",
          "aten._fused_rms_norm.default")
def layer_norm(node: Node, graph: Graph) -> list[Strategy]:
    # Statistics run over the trailing normalized dims, so each leading position is normalized
    # on its own; weight and bias span the normalized dims and stay whole. The saved mean/rstd
    # outputs have the leading dims too.   LN(concat_j x_j) = concat_j LN(x_j).
    lead = ndim(graph, node.inputs[0]) - len(arg(node, 1, "normalized_shape"))
    return [_along(node, d, _dim_name(d)) for d in range(lead)]


@register("aten.group_norm.default")
def group_norm(node: Node, graph: Graph) -> list[Strategy]:
    # Statistics are per (sample, group): samples are independent. Channel sharding is not
    # offered: shard classes may cut the channels finer than the groups.
    return [_along(node, 0, "batch")] if ndim(graph, node.inputs[0]) >= 2 else []


@register("aten.instance_norm.default")
def instance_norm(node: Node, graph: Graph) -> list[Strategy]:
    # Statistics per (sample, channel) over the spatial dims: samples and channels are
    # independent, weight and bias per channel. Running statistics, where the op keeps them,
    # average the whole batch's (and are updated in place): then nothing is offered.
    if ndim(graph, node.inputs[0]) < 3 or (arg(node, 3, "running_mean") is not None and arg(node, 5, "use_input_stats")):
        return []
    params = len(node.inputs) - 1  # the affine weight and bias, where given (running statistics: not in training)
    found = [Strategy((S(0),) + (R,) * params, (S(0),), "batch")]
    if arg(node, 3, "running_mean") is None:  # channels: weight and bias split with them
        found.append(Strategy((S(1),) + (S(0),) * params, (S(1),), "channel"))
    return found


@register("aten.native_group_norm.default")
def native_group_norm(node: Node, graph: Graph) -> list[Strategy]:
    # As group_norm; the op also takes the batch size N, which becomes the local one.
    st = _along(node, 0, "batch")
    return [Strategy(st.inputs, st.outputs, st.name, "local_batch_size")]


@variant("local_batch_size")
def _local_batch_size(node, st, args, kwargs, ctx, graph):
    return node.target(args[0], args[1], args[2], args[0].shape[0], *args[4:], **kwargs)


# Position of the `training` flag; None: always inference.
_BATCH_NORMS = {
    "aten.batch_norm.default": 5, "aten.native_batch_norm.default": 5, "aten._native_batch_norm_legit.default": 5,
    "aten._native_batch_norm_legit.no_stats": 3, "aten._native_batch_norm_legit_functional.default": 5,
    "aten._native_batch_norm_legit_no_training.default": None,
}


@register(*_BATCH_NORMS)
def batch_norm(node: Node, graph: Graph) -> list[Strategy]:
    # Statistics are per channel (dim 1) over every other dim: channels are independent, and
    # weight, bias, running and saved statistics (all [C]) follow the channel shards.
    # Sharding the batch would change the batch statistics: offered only in inference, where
    # the running statistics are used and the extra outputs are empty.
    x = graph.tensors[node.inputs[0]].shape
    if len(x) < 2:
        return []

    def channel(name: str):
        shape = shape_of(graph, name)
        if shape == x:
            return S(1)
        return S(0) if shape == (x[1],) else R if math.prod(shape) == 0 else None

    ins, outs = [channel(t) for t in node.inputs], [channel(t) for t in node.outputs]
    found = [Strategy(tuple(ins), tuple(outs), "channel")] if None not in ins + outs else []
    pos = _BATCH_NORMS[node.op]
    training = pos is not None and arg(node, pos, "training")
    batch = Strategy((S(0),) + (R,) * (len(node.inputs) - 1), (S(0),) + (R,) * (len(node.outputs) - 1), "batch")
    if not training and all(math.prod(shape_of(graph, t)) == 0 for t in node.outputs[1:]):
        found.append(batch)
    elif training and node.op in _SYNC_BATCH_NORMS:
        # Synchronized batch norm: each device sums its rows per channel; one all-reduce of
        # (sum x, sum x^2) gives every device the batch statistics one device computes,
        #   mean = sum_j s1_j / N,  var = sum_j s2_j / N - mean^2   (N: the global count),
        # and the backward all-reduces (sum dxhat, sum dxhat * xhat) the same way. The
        # statistics and the new running statistics come out whole on every device.
        found.append(Strategy(batch.inputs, batch.outputs, "sync-batch", "sync_batch_norm"))
    return found


# op -> positions of (weight, bias, running_mean, running_var, momentum, eps)
_SYNC_BATCH_NORMS = {
    "aten._native_batch_norm_legit_functional.default": (1, 2, 3, 4, 6, 7),
    "aten._native_batch_norm_legit.no_stats": (1, 2, None, None, 4, 5),
}


def _sync_batch_norm_collectives(node: Node, graph: Graph) -> list[tuple[str, float]]:
    channels = shape_of(graph, node.inputs[0])[1]
    return [("all_reduce", 2 * channels * 8)] * 2  # float64 sums, forward and backward


@variant("sync_batch_norm", collectives=_sync_batch_norm_collectives)
def _sync_batch_norm(node, st, args, kwargs, ctx, graph):
    x = args[0]
    w, b, rm, rv, momentum, eps = (args[i] if i is not None else None for i in _SYNC_BATCH_NORMS[node.op])
    whole = shape_of(graph, node.inputs[0])
    count = math.prod(whole) // whole[1]  # values per channel in the global batch
    xhat, mean, rstd, var = _SyncNormalize.apply(x, count, eps, ctx.all_reduce)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    out = xhat if w is None else xhat * w.reshape(shape)
    out = out if b is None else out + b.reshape(shape)
    outs = [out, mean.to(x.dtype), rstd.to(x.dtype)]
    if rm is not None:  # the running statistics take the unbiased variance, as torch does
        unbiased = var * count / max(count - 1, 1)
        outs += [((1 - momentum) * rm + momentum * mean).to(rm.dtype), ((1 - momentum) * rv + momentum * unbiased).to(rv.dtype)]
    return tuple(outs)


class _SyncNormalize(torch.autograd.Function):
    """xhat = (x - mean) * rstd with the batch statistics of every device's rows; returns
    (xhat, mean, rstd, biased var), the last three without gradient. Sums in float64: E[x^2] -
    mean^2 loses digits in float32."""

    @staticmethod
    def forward(ctx, x, count, eps, all_reduce):
        dims = [0, *range(2, x.dim())]
        xd = x.double()
        sums = all_reduce(torch.cat([xd.sum(dims), (xd * xd).sum(dims)]))  # [2C]
        mean, sq = sums.chunk(2)
        var = (sq / count - (mean / count) ** 2).clamp_min(0)
        mean = mean / count
        rstd = (var + eps).rsqrt()
        shape = (1, -1) + (1,) * (x.dim() - 2)
        xhat = (xd - mean.reshape(shape)) * rstd.reshape(shape)
        ctx.save_for_backward(xhat, rstd)
        ctx.count, ctx.all_reduce, ctx.dims, ctx.shape, ctx.dtype = count, all_reduce, dims, shape, x.dtype
        ctx.mark_non_differentiable(mean, rstd, var)
        return xhat.to(x.dtype), mean, rstd, var

    @staticmethod
    def backward(ctx, g, *_):
        #   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), means over the global batch
        from ..runtime.collectives import first_order_only  # (the rule's runtime half)
        first_order_only()
        xhat, rstd = ctx.saved_tensors
        gd = g.double()
        sums = ctx.all_reduce(torch.cat([gd.sum(ctx.dims), (gd * xhat).sum(ctx.dims)])) / ctx.count
        g_mean, gx_mean = (t.reshape(ctx.shape) for t in sums.chunk(2))
        dx = rstd.reshape(ctx.shape) * (gd - g_mean - xhat * gx_mean)
        return dx.to(ctx.dtype), None, None, None


# ---------------------------------------------------------------------------------------------
# Embedding.


@register("aten.embedding.default")
def embedding(node: Node, graph: Graph) -> list[Strategy]:
    # out[..., h] = W[ids[...], h]
    #   batch:  pointwise in ids, W whole (its gradient summed over devices);
    #   hidden: W sharded on h gives the output sharded on its last dim;
    #   vocab:  W sharded on rows; each device looks up the ids it holds and writes zeros for
    #           the others, so the outputs add up:  W[i] = sum_j [i in rows_j] W_j[i - lo_j].
    #   sparse gradients: W whole and only the ids split (each device's gradient holds the rows
    #           of its ids; the runtime sums them over devices as (index, row) pairs). A sharded W
    #           would have a sharded sparse gradient, which nothing here synchronizes.
    ids_rank = ndim(graph, node.inputs[1])
    freq = arg(node, 3, "scale_grad_by_freq", False)  # gradient scaled by each id's count in the whole batch
    if arg(node, 4, "sparse", False):
        return [] if freq else [Strategy((R, S(d)), (S(d),), _dim_name(d)) for d in range(ids_rank)]
    found = [Strategy((S(1), R), (S(ids_rank),), "hidden")]
    if not freq:
        found += [Strategy((R, S(d)), (S(d),), _dim_name(d)) for d in range(ids_rank)]
        if arg(node, 2, "padding_idx", -1) >= -1:
            found.append(Strategy((S(0), R), (P,), "vocab", "vocab_parallel"))
    return found


def sparse_gradient_rows(graph: Graph) -> dict[str, int]:
    """Parameters whose gradient is sparse (looked up by aten.embedding or a bag of embeddings
    with sparse=True, used nowhere else), with the most rows their gradients hold in a step on
    all devices together: one per id looked up, at most the table's rows. Any other use makes
    the gradient dense."""
    out: dict[str, int] = {}
    for name in graph.params:
        t = graph.tensors[name]
        uses = [graph.nodes[k] for k in t.consumers]
        if not t.requires_grad or not uses or len(t.shape) != 2:
            continue
        if all(n.inputs[0] == name and (n.op == "aten.embedding.default" and arg(n, 4, "sparse", False)
                                        or n.op in EMBEDDING_BAG and arg(n, 5, "sparse", False)) for n in uses):
            out[name] = min(t.shape[0], sum(graph.tensors[n.inputs[1]].numel for n in uses))
    return out


@variant("vocab_parallel")
def _vocab_parallel(node, st, args, kwargs, ctx, graph):
    weight, ids = args[0], args[1]
    lo, rows = ctx.offset(node.inputs[0], 0), weight.shape[0]
    local = ids - lo
    inside = (local >= 0) & (local < rows)
    pad = arg(node, 2, "padding_idx", -1)
    pad = pad - lo if pad >= 0 and 0 <= pad - lo < rows else -1  # the padding row lives on one device
    if rows == 0:  # an idle device: zeros, tied to W so that the backward reaches this node here too
        return weight.new_zeros((*ids.shape, weight.shape[1])) + weight.sum() * 0
    out = torch.ops.aten.embedding.default(weight, torch.where(inside, local, 0), pad)
    # A multiply, not indexing: out-of-range positions then send exactly zero gradient to row 0.
    return out * inside.unsqueeze(-1).to(out.dtype)


EMBEDDING_BAG = ("aten.embedding_bag.padding_idx", "aten.embedding_bag.default", "aten._embedding_bag.default",
                 "aten._embedding_bag_forward_only.default")
BAG_SUM, BAG_MEAN, BAG_MAX = 0, 1, 2  # embedding_bag's `mode`
LOOKUPS = frozenset({"aten.embedding.default", *EMBEDDING_BAG})
"""Ops that read only the rows of their table that they look up (the cost model prices so)."""


@register(*EMBEDDING_BAG)
def embedding_bag(node: Node, graph: Graph) -> list[Strategy]:
    # out[b, h] = reduce_{i in bag b} psw[i] * W[ids[i], h], bag b = ids[offsets[b]:offsets[b+1]];
    # outputs (out, offset2bag, bag_size, max_indices), the last three from the ids alone.
    #   hidden: W sharded on h, every bag reduced per feature:  out S(1), max_indices [B, H] S(1).
    #   bags:   fixed-size bags (nn.EmbeddingBag given [B, L] ids: export flattens them and makes
    #           offsets = arange(0, B*L, L)), so B bags split at bag boundaries split the ids into
    #           whole bags: ids S(0) and out S(0) in one shard class (L ids per row). Offsets
    #           given as data may cut the ids anywhere: not split.
    #   vocab:  W sharded on rows (sum and mean): each device reduces the ids it holds, the
    #           others weighted 0, a mean's over the whole bag's count:  out P.
    #   sparse gradients: W whole and the bags split (each device's gradient holds the rows of its
    #           ids, summed over devices as (index, row) pairs), as aten.embedding's.
    mode, freq = arg(node, 4, "mode", BAG_SUM), arg(node, 3, "scale_grad_by_freq", False)
    weighted = arg(node, 6, "per_sample_weights", None) is not None
    rest = (R,) * (len(node.inputs) - 1)
    big = (S(1),) if mode == BAG_MAX else (R,)  # max_indices: [B, H] in max mode, [B] otherwise
    sparse = arg(node, 5, "sparse", False)
    found = [] if sparse else [Strategy((S(1), *rest), (S(1), R, R, *big), "hidden")]
    if _fixed_bags(node, graph) and not freq:  # (an id's count over the whole batch scales its gradient)
        o2b = S(0) if shape_of(graph, node.outputs[1])[0] else R  # offset2bag: every id's bag, [0] where not kept
        found.append(Strategy((R, S(0), R) + ((S(0),) if weighted else ()), (S(0), o2b, S(0), S(0)), "bags", "bag_rows"))
    if mode != BAG_MAX and not freq and not sparse:
        found.append(Strategy((S(0), *rest), (P, R, R, R), "vocab", "bag_vocab_parallel"))
    return found


def _fixed_bags(node: Node, graph: Graph) -> int | None:
    """L where the bags are the ids' consecutive runs of L (offsets made by arange(0, N, L) for
    N = L * bags ids, the last offset not included), else None."""
    ids, offsets = (graph.tensors[t] for t in node.inputs[1:3])
    if len(ids.shape) != 1 or arg(node, 7, "include_last_offset", False) or offsets.producer < 0:
        return None
    made = graph.nodes[offsets.producer]
    if made.op != "aten.arange.start_step" or len(made.args) < 3 or not all(type(a) is int for a in made.args[:3]):
        return None
    start, end, step = made.args[:3]
    n = ids.shape[0]
    return step if start == 0 and end == n and step > 0 and n % step == 0 and offsets.shape[0] == n // step else None


@variant("bag_rows")
def _bag_rows(node, st, args, kwargs, ctx, graph):
    """This device's whole bags: its ids' runs of L, offsets counted from its first id, and
    offset2bag (the bag of every id) numbered as the whole batch numbers them."""
    size = _fixed_bags(node, graph)
    assert size is not None, f"{node.name}: bags split without fixed-size bags"
    ids = args[1]
    first = ctx.offset(node.inputs[1], 0) // size  # this device's first bag
    offsets = args[2][first:first + ids.shape[0] // size] - first * size
    out = node.target(*args[:2], offsets, *args[3:], **kwargs)
    o2b = out[1] + first if st.outputs[1].is_shard else out[1]
    return (out[0], o2b, *out[2:])


@variant("bag_vocab_parallel")
def _bag_vocab_parallel(node, st, args, kwargs, ctx, graph):
    """Sum or mean of the ids this device's rows hold, every other id weighted 0 (a mean's
    weights over the whole bag's count): the devices' outputs add up to the whole bag's. The
    ids' outputs (offset2bag, bag_size, max_indices) are the whole op's, from a table of no
    columns."""
    weight, ids, offsets = args[:3]
    psw = args[6] if len(args) > 6 else kwargs.get("per_sample_weights")
    rows_whole = graph.tensors[node.inputs[0]].shape[0]
    pad = arg(node, 8, "padding_idx", None)
    if pad is not None and pad < 0 and node.op == "aten.embedding_bag.padding_idx":
        pad += rows_whole  # (this overload counts a negative id from the end; the others read it as none)
    pad = None if pad is None or pad < 0 else pad
    last = arg(node, 7, "include_last_offset", False)
    whole = node.target(weight.new_empty((rows_whole, 0)), *args[1:], **kwargs)
    lo, rows = ctx.offset(node.inputs[0], 0), weight.shape[0]
    if rows == 0:  # an idle device: zeros, tied to W so that the backward reaches this node here too
        return (weight.new_zeros((offsets.shape[0] - last, weight.shape[1])) + weight.sum() * 0, *whole[1:])
    local = ids - lo
    inside = (local >= 0) & (local < rows)
    counted = ids != pad if pad is not None else torch.ones_like(inside)
    scale = (inside & counted).to(weight.dtype)
    if psw is not None:
        scale = scale * psw
    if arg(node, 4, "mode", BAG_SUM) == BAG_MEAN:  # over the bag's ids but the padding ones
        starts = offsets[:-1] if last else offsets
        bag = torch.bucketize(torch.arange(ids.shape[0], device=ids.device), starts, right=True) - 1
        count = torch.zeros(starts.shape[0], dtype=weight.dtype, device=ids.device).index_add_(0, bag, counted.to(weight.dtype))
        scale = scale / count.clamp(min=1)[bag]
    out = torch.ops.aten._embedding_bag.default(weight, torch.where(inside, local, 0), offsets, False, BAG_SUM, False,
                                                scale, last, -1)[0]
    return (out, *whole[1:])


# ---------------------------------------------------------------------------------------------
# Attention.


@register("aten.scaled_dot_product_attention.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
          "aten._scaled_dot_product_attention_math.default", "aten._scaled_dot_product_efficient_attention.default")
def attention(node: Node, graph: Graph) -> list[Strategy]:
    # out = softmax(q k^T * scale + mask) v mixes positions along the sequence dims (the last
    # two) only; every leading (batch, head) index is an independent attention problem.
    # Masks broadcast against the scores [.., L, S]: sharded where they have the full dim,
    # replicated where they broadcast. With grouped-query attention the q heads are a whole
    # multiple of the k/v heads; shard classes split both at k/v-head boundaries.
    q, k, v = (shape_of(graph, t) for t in node.inputs[:3])
    rank = len(q)
    if rank < 3 or len(k) != rank or len(v) != rank:
        return []
    gqa = bool(node.kwargs.get("enable_gqa", False))
    names = ("batch", "heads") if rank == 4 else ("batch",)
    found = []
    for d in range(rank - 2):
        heads_grouped = gqa and d == rank - 3 and k[d] == v[d] and q[d] % k[d] == 0
        if not (q[d] == k[d] == v[d] or heads_grouped):
            continue
        masks = [_mask_place(shape_of(graph, t), d, rank, q[d]) for t in node.inputs[3:]]
        if None in masks:
            continue
        outs = tuple(S(d) if ndim(graph, o) > d else R for o in node.outputs)  # rank-0 outputs: RNG state
        found.append(Strategy((S(d), S(d), S(d), *masks), outs, _dim_name(d, names)))
    return found


def _mask_place(shape: tuple[int, ...], d: int, rank: int, size: int):
    k = d - (rank - len(shape))  # right-aligned broadcasting against the scores
    if k < 0 or shape[k] == 1:
        return R
    return S(k) if shape[k] == size else None


# ---------------------------------------------------------------------------------------------
# Convolution.

# op -> (position of `transposed` or a fixed bool, position of `groups`)
_CONVS = {
    "aten.conv1d.default": (False, 6), "aten.conv2d.default": (False, 6), "aten.conv3d.default": (False, 6),
    "aten.conv1d.padding": (False, 6), "aten.conv2d.padding": (False, 6), "aten.conv3d.padding": (False, 6),
    "aten.conv_transpose1d.default": (True, 6), "aten.conv_transpose2d.input": (True, 6),
    "aten.conv_transpose3d.input": (True, 6), "aten.convolution.default": (6, 8), "aten._convolution.default": (6, 8),
    "aten._convolution.deprecated": (6, 8),
}


@register(*_CONVS)
def convolution(node: Node, graph: Graph) -> list[Strategy]:
    # out[n, o, p] = sum_{i, k} x[n, i, p + k] W[o, i, k] + b[o]    (W[i, o, k] when transposed)
    #   batch:       independent samples, W and b whole;
    #   out-channel: W and b sharded on o give out sharded on o;
    #   in-channel:  x and W sharded on the contracted i give a partial sum (b on one device);
    #   partial:     linear in x and in W, so a partial operand gives a partial output.
    # Grouped convolutions tie channel shards to group boundaries: batch only.
    transposed, groups_pos = _CONVS[node.op]
    if not isinstance(transposed, bool):
        transposed = arg(node, transposed, "transposed")
    groups = arg(node, groups_pos, "groups", 1)
    x, w = node.inputs[0], node.inputs[1]
    bias = len(node.inputs) > 2
    batched = ndim(graph, x) == ndim(graph, w)  # unbatched input: [C, spatial...]
    c = 1 if batched else 0
    w_out, w_in = (1, 0) if transposed else (0, 1)

    def st(x_p, w_p, b_p, out_p, name):
        return Strategy((x_p, w_p, b_p) if bias else (x_p, w_p), (out_p,), name)

    found = [st(S(0), R, R, S(0), "batch")] if batched else []
    if groups == 1:
        found += [st(R, S(w_out), S(0), S(c), "out-channel"), st(S(c), S(w_in), P, P, "in-channel")]
    found += [st(P, R, P, P, "partial-input"), st(R, P, P, P, "partial-weight")]
    return found


# ---------------------------------------------------------------------------------------------
# Pooling.

_POOLS = {  # op -> number of trailing spatial dims
    **{f"aten.{k}_pool{n}d.default": n for k in ("max", "avg") for n in (1, 2, 3)},
    **{f"aten.adaptive_{k}_pool{n}d.default": n for k in ("max", "avg") for n in (1, 2, 3)},
    **{f"aten.max_pool{n}d_with_indices.default": n for n in (1, 2, 3)},
    "aten._adaptive_avg_pool2d.default": 2, "aten._adaptive_avg_pool3d.default": 3,
}


@register(*_POOLS)
def pool(node: Node, graph: Graph) -> list[Strategy]:
    # Windows slide over the trailing spatial dims only: every (batch, channel) plane is pooled
    # on its own, and max-pool indices are positions within a plane. Average pooling is linear,
    # so partial sums pass through:  avg(x1 + x2) = avg(x1) + avg(x2).
    lead = ndim(graph, node.inputs[0]) - _POOLS[node.op]
    names = ("batch", "channel") if lead == 2 else ("channel",)
    found = [_along(node, d, _dim_name(d, names)) for d in range(lead)]
    if "avg" in node.op:
        found.append(Strategy((P,), (P,), "partial"))
    return found


_RESIZES = {  # op -> number of trailing spatial dims
    f"aten.{name}.{overload}": n
    for name, n in (("upsample_nearest1d", 1), ("upsample_nearest2d", 2), ("upsample_nearest3d", 3),
                    ("_upsample_nearest_exact1d", 1), ("_upsample_nearest_exact2d", 2), ("_upsample_nearest_exact3d", 3),
                    ("upsample_linear1d", 1), ("upsample_bilinear2d", 2), ("upsample_bicubic2d", 2),
                    ("upsample_trilinear3d", 3))
    for overload in ("default", "vec")
}


@register(*_RESIZES)
def resize(node: Node, graph: Graph) -> list[Strategy]:
    # Interpolation resizes the trailing spatial dims of every (batch, channel) plane on its
    # own, each output pixel a fixed weighted sum of input pixels: leading dims split alike,
    # and it is linear, so partial sums pass through:  up(x1 + x2) = up(x1) + up(x2).
    lead = ndim(graph, node.inputs[0]) - _RESIZES[node.op]
    names = ("batch", "channel") if lead == 2 else ("channel",)
    return [_along(node, d, _dim_name(d, names)) for d in range(lead)] + [Strategy((P,), (P,), "partial")]


@register("aten.pixel_shuffle.default", "aten.pixel_unshuffle.default", "aten.im2col.default", "aten.col2im.default")
def plane_rearrange(node: Node, graph: Graph) -> list[Strategy]:
    # Each sample's (channel, height, width) block is rearranged on its own (pixel shuffles,
    # unfold's and fold's patch columns): the dims before it split alike. (The channel dims
    # mix with the kernel or upscale factor: not offered.)
    trailing = {"aten.im2col.default": 3, "aten.col2im.default": 2}.get(node.op, 3)
    lead = ndim(graph, node.inputs[0]) - trailing
    return [_along(node, d, _dim_name(d)) for d in range(max(lead, 0))]


@register("aten.channel_shuffle.default", "aten.native_channel_shuffle.default")
def channel_shuffle(node: Node, graph: Graph) -> list[Strategy]:
    # out[n, c', ...] = x[n, perm(c'), ...]: the channels permute within each position, every
    # other dim (batch, spatial) is independent.
    return [_along(node, d, _dim_name(d)) for d in range(ndim(graph, node.inputs[0])) if d != 1]


@register("aten.prelu.default")
def prelu(node: Node, graph: Graph) -> list[Strategy]:
    # prelu(x, a) = max(0, x) + a[c] * min(0, x), elementwise, with a per channel (dim 1) or one
    # number: any dim splits with a whole, the channel dim with a split alike where a has one per
    # channel.
    rank, per_channel = ndim(graph, node.inputs[0]), math.prod(shape_of(graph, node.inputs[1])) > 1
    return [Strategy((S(d), S(0) if d == 1 and per_channel else R), (S(d),), _dim_name(d, ("batch", "channel")))
            for d in range(rank)]


@register("aten._prelu_kernel.default")
def prelu_kernel(node: Node, graph: Graph) -> list[Strategy]:
    # As prelu, with a already shaped to broadcast against x ([1, C, 1, ...] in a core-ATen
    # graph): a splits with x on every dim where it is longer than 1.
    x, a = (shape_of(graph, t) for t in node.inputs)
    if len(a) != len(x):
        return []
    return [Strategy((S(d), S(d) if a[d] > 1 else R), (S(d),), _dim_name(d, ("batch", "channel"))) for d in range(len(x))]


@register("aten.bilinear.default")
def bilinear(node: Node, graph: Graph) -> list[Strategy]:
    # out[.., o] = sum_ij x1[.., i] W[o, i, j] x2[.., j] + b[o]: positions (every dim but the
    # features) are independent; W's rows and b give the output features.
    rank, bias = ndim(graph, node.inputs[0]), len(node.inputs) > 3
    if shape_of(graph, node.inputs[0])[:-1] != shape_of(graph, node.inputs[1])[:-1]:
        return []
    found = [Strategy((S(d), S(d), R) + ((R,) if bias else ()), (S(d),), _dim_name(d)) for d in range(rank - 1)]
    found.append(Strategy((R, R, S(0)) + ((S(0),) if bias else ()), (S(rank - 1),), "out-feature"))
    return found


@register("aten.cosine_similarity.default")
def cosine_similarity(node: Node, graph: Graph) -> list[Strategy]:
    # cos(x1, x2)[..] = <x1, x2> / max(|x1| |x2|, eps) along `dim`, which the output drops:
    # every other dim is independent (equal shapes only: broadcasting is not offered).
    a, b = (shape_of(graph, t) for t in node.inputs[:2]) if len(node.inputs) == 2 else (None, None)
    if a is None or a != b:
        return []
    k = norm_dim(arg(node, 2, "dim", 1), len(a))
    return [Strategy((S(d), S(d)), (S(d if d < k else d - 1),), _dim_name(d)) for d in range(len(a)) if d != k]


# ---------------------------------------------------------------------------------------------
# Recurrent layers.

RECURRENT_STATES = {"aten.lstm.input": 2, "aten.gru.input": 1, "aten.rnn_tanh.input": 1, "aten.rnn_relu.input": 1}
"""The recurrent layers' ops, and how many state tensors (h, c) each takes."""


@register(*RECURRENT_STATES)
def recurrent(node: Node, graph: Graph) -> list[Strategy]:
    # h_t = cell(x_t, h_{t-1}; W) per sample: samples are independent, the weights shared.
    #   input [B, T, F] (batch_first) or [T, B, F], states [layers * directions, B, H] -> output
    #   like the input, final states like the states; the weights whole (gradients summed).
    # Not offered with dropout between layers in training (a draw over the whole batch) or for an
    # unbatched (2-dim) input.
    layers, dropout, train, batch_first = (arg(node, i, n) for i, n in ((4, "num_layers"), (5, "dropout"),
                                                                        (6, "train"), (8, "batch_first")))
    if ndim(graph, node.inputs[0]) != 3 or (dropout and train and layers > 1):
        return []
    states = RECURRENT_STATES[node.op]
    b = 0 if batch_first else 1
    ins = (S(b),) + (S(1),) * states + (R,) * (len(node.inputs) - 1 - states)
    return [Strategy(ins, (S(b),) + (S(1),) * (len(node.outputs) - 1), "batch")]


# ---------------------------------------------------------------------------------------------
# Losses.
#
# A loss is independent along its sample dims, and its reduction decides the output:
#   none: the per-sample losses, sharded like the samples;
#   sum:  sum over samples = sum over devices of local sums, a partial sum;
#   mean: sum / normalizer, a partial sum when each device divides its local sum by the GLOBAL
#         normalizer (local variant "loss_mean"). The normalizer is the element count, or for
#         class-index targets the summed class weight of the non-ignored targets: data
#         dependent, so each device counts its own and all-reduces the counts.
# Class-sharded (vocabulary-parallel) cross entropy is not offered: its log-softmax needs
# differentiable max/sum all-reduces.

_CLASS_LOSSES = {"aten.cross_entropy_loss.default", "aten.nll_loss.default", "aten.nll_loss_nd.default",
                 "aten.nll_loss2d.default", "aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default"}
_POINTWISE_LOSSES = {"aten.mse_loss.default": 2, "aten.l1_loss.default": 2, "aten.smooth_l1_loss.default": 2,
                     "aten.huber_loss.default": 2, "aten.soft_margin_loss.default": 2, "aten.kl_div.default": 2,
                     "aten.binary_cross_entropy.default": 3, "aten.binary_cross_entropy_with_logits.default": 4}


def _reduction(node: Node) -> int:
    return arg(node, 3 if node.op in _CLASS_LOSSES else _POINTWISE_LOSSES[node.op], "reduction", MEAN)


def _reduced(node: Node, name: str, ins: tuple, out_shard) -> Strategy:
    """The strategy with input placements `ins` whose per-sample output is `out_shard`."""
    red = _reduction(node)
    main = out_shard if red == NONE else P
    extra = (R,) if red == NONE else (P,)  # nll_loss_forward's total_weight: 0 for none, else a sum
    outs = (main, *extra[: len(node.outputs) - 1])
    return Strategy(ins, outs, name, "loss_mean" if red == MEAN else None)


@register(*_CLASS_LOSSES)
def class_loss(node: Node, graph: Graph) -> list[Strategy]:
    # input [N, C, d...] with target [N, d...] (class indices) or [N, C, d...] (probabilities);
    # every dim but the class dim 1 is a sample dim.
    x_rank = ndim(graph, node.inputs[0])
    if x_rank < 2:
        return []  # unbatched [C]: a single sample
    probs = _is_float(graph, node.inputs[1])
    weight_trains = any(graph.tensors[t].requires_grad for t in node.inputs[2:])
    if weight_trains and not probs and _reduction(node) == MEAN:
        return []  # the normalizer would depend on a trained weight, and its gradient is not a sum
    found = []
    for a in [0, *range(2, x_rank)]:
        t = a if probs or a == 0 else a - 1  # the sample dim in the target and per-sample output
        ins = (S(a), S(t), *(R,) * (len(node.inputs) - 2))  # class weights whole
        found.append(_reduced(node, _dim_name(a), ins, S(a if a == 0 else a - 1)))
    return found


@register(*_POINTWISE_LOSSES)
def pointwise_loss(node: Node, graph: Graph) -> list[Strategy]:
    # l = f(x, y[, weight, pos_weight]) elementwise with broadcasting, then reduced: every dim of
    # x is a sample dim; operands that broadcast along it stay whole.
    shapes = [shape_of(graph, t) for t in node.inputs]
    x = shapes[0]
    if tuple(torch.broadcast_shapes(*shapes)) != x:
        return []
    found = []
    for d in range(len(x)):
        ins = tuple(_broadcast_place(s, d, len(x)) for s in shapes)
        found.append(_reduced(node, _dim_name(d), ins, S(d)))
    return found


def _broadcast_place(shape: tuple[int, ...], d: int, rank: int):
    k = d - (rank - len(shape))
    return S(k) if k >= 0 and shape[k] > 1 else R


def _loss_mean_collectives(node: Node, graph: Graph) -> list[tuple[str, float]]:
    """The mean's all-reduce of a class-index loss's count (float64) where the runtime waits for
    it inside the forward: nll_loss_forward's total weight, or a count of targets the step
    computes (labels shifted in the model). One the runtime starts as the forward starts
    (`starts_early`) runs beside it: CostModel.variant_comm prices what the forward leaves of it."""
    if node.op not in _CLASS_LOSSES or _is_float(graph, node.inputs[1]) or starts_early(node, graph):
        return []
    return [("all_reduce", 8.0)]


def starts_early(node: Node, graph: Graph) -> bool:
    """Whether hap.HAP's runtime starts a split class-index loss's count as the forward starts
    (executor._start_early_counts): its one all-reduce is the count (counts_early), and the
    targets and weights it counts are the step's own inputs, not values the forward computes."""
    return (node.op in _CLASS_LOSSES and len(node.outputs) == 1 and not _is_float(graph, node.inputs[1])
            and all(graph.tensors[t].kind != "activation" for t in node.inputs[1:]))


@variant("loss_mean", collectives=_loss_mean_collectives)
def _loss_mean(node, st, args, kwargs, ctx, graph):
    pos = 3 if node.op in _CLASS_LOSSES else _POINTWISE_LOSSES[node.op]
    if pos < len(args):
        args = (*args[:pos], SUM, *args[pos + 1:])
    else:
        kwargs = {**kwargs, "reduction": SUM}
    out = node.target(*args, **kwargs)
    if isinstance(out, (tuple, list)):  # nll_loss_forward: (local sum, local total weight)
        return out[0] / ctx.all_reduce(out[1]), out[1]
    return out / _normalizer(node, graph, args, kwargs, ctx, out.dtype)


def _normalizer(node, graph, args, kwargs, ctx, dtype) -> float | torch.Tensor:
    """The global denominator of the mean: static from the graph's shapes, or all-reduced."""
    x = graph.tensors[node.inputs[0]]
    if node.op not in _CLASS_LOSSES:
        return float(x.numel)
    if _is_float(graph, node.inputs[1]):  # probabilities: mean over the samples
        return float(x.numel // x.shape[1])
    return ctx.all_reduce(label_count(args, kwargs)).to(dtype)


def label_count(args: tuple, kwargs: dict) -> torch.Tensor:
    """This device's part of a class-index loss's mean denominator: the summed class weight of
    its non-ignored targets, in float64 (exact at any batch size). It needs only the target
    and weight, which the runtime may have before the logits: `counts_early`."""
    target = args[1]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    ignore = target == (args[4] if len(args) > 4 else kwargs.get("ignore_index", -100))
    if weight is None:
        return (~ignore).sum().double()
    return (weight[target.masked_fill(ignore, 0)] * ~ignore).sum().double()


def sums_in_pass(node: Node, st: Strategy, graph: Graph) -> bool:
    """Whether running the node under `st` sums over every device's rows of the batch inside
    the forward or backward (ctx.all_reduce): a synchronized batch norm's statistics, a class
    loss's denominator that `counts_early` cannot take from the targets alone."""
    if st.local == "sync_batch_norm":
        return True
    return (st.local == "loss_mean" and node.op in _CLASS_LOSSES and not _is_float(graph, node.inputs[1])
            and not counts_early(node, st, graph))


def counts_early(node: Node, st: Strategy, graph: Graph) -> bool:
    """Whether the node's only all-reduce is label_count's (a mean over class-index targets),
    so that a runtime may start it as soon as the target is loaded."""
    return (st.local == "loss_mean" and node.op in _CLASS_LOSSES and len(node.outputs) == 1
            and not _is_float(graph, node.inputs[1]))
