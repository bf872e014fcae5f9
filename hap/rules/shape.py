"""Shape ops: views, permutations, slicing, splitting, concatenation, indexing, repetition.

Law (data movement): a shape op only moves elements, so a dim it carries over unchanged is
independent, and sharding it on the input shards the output alike:
    op(concat_j x_j along d) = concat_j op(x_j) along d'   (d' = where d lands in the output)
A dim the op slices, splits, concatenates, indexes or repeats is never sharded: the local op
would pick the wrong elements. Every shape op is linear, so partial sums pass through:
    op(x_1 + x_2) = op(x_1) + op(x_2)            (all tensor inputs P, index tensors R).
Views are the one subtle case: see view_pairs.
"""

from __future__ import annotations

import math

import torch

from ..ir import Graph, Node
from . import RULES, P, R, S, Strategy, arg, ndim, norm_dim, register, shape_of
from . import elementwise  # noqa: F401  (registers first: it owns alias, contiguous, clone, detach)
from .local import local_shape, variant


def _register_new(*ops: str):
    """register, skipping ops another family already covers."""
    return register(*[op for op in ops if op not in RULES])


def along(pairs, n_in: int = 1, n_out: int = 1) -> list[Strategy]:
    """For each (input dim, output dim) pair: every input S(i) -> every output S(o)."""
    return [Strategy((S(i),) * n_in, (S(o),) * n_out, f"dim{o}") for i, o in pairs]


def partial(n_in: int = 1, n_out: int = 1) -> Strategy:
    return Strategy((P,) * n_in, (P,) * n_out, "partial")


def _without(dim: int, rank: int) -> list[tuple[int, int]]:
    """Pairs for an op that drops `dim` (select, unbind): later dims move up by one."""
    return [(k, k - (k > dim)) for k in range(rank) if k != dim]


def _except(dim: int, rank: int) -> list[tuple[int, int]]:
    """Pairs for an op that works along `dim` and keeps every dim where it is."""
    return [(k, k) for k in range(rank) if k != dim]


# ---------------------------------------------------------------------------------------------
# Views


def view_pairs(src, dst) -> list[tuple[int, int]]:
    """The (input dim, output dim) pairs a view may shard together.

    Group the non-1 dims of both shapes into minimal blocks of equal products. Within a block
    only the outermost dims line up: a device's range of outer indices is one contiguous run
    of the block's flat elements, and so a range of outer indices of the other side, provided
    both are cut at multiples of gcd(outer lengths), which the shard class's granules ensure.
    ([B, S, H] -> [B*S, H]: B pairs with B*S, H with H; S, inside the merged dim, cannot.)
    """
    if math.prod(src) != math.prod(dst) or 0 in src:
        return []
    a = [d for d, n in enumerate(src) if n != 1]
    b = [d for d, n in enumerate(dst) if n != 1]
    pairs, i, j = [], 0, 0
    while i < len(a):
        first = (a[i], b[j])
        na, nb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while na != nb:  # grow the smaller side until the products meet
            if na < nb:
                na, i = na * src[a[i]], i + 1
            else:
                nb, j = nb * dst[b[j]], j + 1
        if math.gcd(src[first[0]], dst[first[1]]) > 1:  # gcd 1 would leave one granule: no split
            pairs.append(first)
    return pairs


# A shard may have length 1 where the whole tensor does not (squeeze would drop it), and
# unflatten's sizes are global: these run as a view to the local output shape.
LOCAL_VIEW = {"aten.unflatten.int", "aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims"}


@_register_new("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
               "aten.flatten.using_ints", "aten.unflatten.int", "aten.squeeze.default",
               "aten.squeeze.dim", "aten.squeeze.dims", "aten.unsqueeze.default")
def view(node: Node, graph: Graph) -> list[Strategy]:
    # Row-major order is preserved: the outer dims of matching blocks split alike (view_pairs).
    # view/reshape get their local shape from local.SIZE_ARGS, the LOCAL_VIEW ops from local_view.
    pairs = view_pairs(shape_of(graph, node.inputs[0]), shape_of(graph, node.outputs[0]))
    local = "local_view" if node.op in LOCAL_VIEW else None
    return [Strategy((S(i),), (S(o),), f"dim{o}", local) for i, o in pairs] + [partial()]


@variant("local_view")
def local_view(node, st, args, kwargs, ctx, graph):
    # Removing, adding or splitting dims of a viewable tensor: view() does it on any shard.
    return args[0].view(local_shape(graph, node.outputs[0], st.outputs[0], ctx))


@_register_new("aten.view_as.default")
def view_as(node: Node, graph: Graph) -> list[Strategy]:
    # x.view_as(y) reads only y's shape (y gets no gradient): y is placed like the output, so
    # that its local shape is the local output shape.
    x, y = node.inputs
    sts = [Strategy((S(i), S(o)), (S(o),), f"dim{o}") for i, o in view_pairs(shape_of(graph, x), shape_of(graph, y))]
    return sts + [Strategy((P, P if x == y else R), (P,), "partial")]


# ---------------------------------------------------------------------------------------------
# Permutations


def _perm(node: Node, graph: Graph) -> list[int]:
    """perm[o] = the input dim that becomes output dim o, found by running the op on a meta
    tensor whose dims have the distinct lengths 2, 3, 4, ..."""
    probe = torch.empty([d + 2 for d in range(ndim(graph, node.inputs[0]))], device="meta")
    return [n - 2 for n in node.target(probe, *node.args[1:], **node.kwargs).shape]


@_register_new("aten.permute.default", "aten.transpose.int", "aten.t.default", "aten.numpy_T.default",
               "aten.mT.default", "aten.swapaxes.default", "aten.movedim.int", "aten.movedim.intlist")
def permute(node: Node, graph: Graph) -> list[Strategy]:
    # permute(x)[i_perm] = x[i]: input dim perm[o] is output dim o.
    return along((i, o) for o, i in enumerate(_perm(node, graph))) + [partial()]


# ---------------------------------------------------------------------------------------------
# Broadcasting and repetition


def _broadcast(src, dst) -> tuple[list[tuple[int, int]], list[int]]:
    """expand(src -> dst): the carried (input, output) dim pairs and the broadcast output dims."""
    lead = len(dst) - len(src)
    carried = [(k, k + lead) for k in range(len(src)) if src[k] == dst[k + lead]]
    broadcast = [d for d in range(len(dst)) if d < lead or src[d - lead] == 1 < dst[d]]
    return carried, broadcast


@_register_new("aten.expand.default", "aten.expand_as.default")
def expand(node: Node, graph: Graph) -> list[Strategy]:
    # Carried dims shard alike. A broadcast dim can be sharded on the output alone: each device
    # expands the whole x to its rows, and the gradient of x (the sum over the device's rows)
    # is a partial sum, which is what R means. (Not D: its gradient must be whole everywhere.)
    # expand's local size comes from local.SIZE_ARGS; x.expand_as(y) reads only y's shape, so
    # y is placed like the output (see view_as).
    x, y = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    carried, broadcast = _broadcast(shape_of(graph, x), shape_of(graph, node.outputs[0]))

    def ins(p, o):
        return (p,) if y is None else (p, o)

    sts = [Strategy(ins(S(i), S(o)), (S(o),), f"dim{o}") for i, o in carried]
    sts += [Strategy(ins(R, S(o)), (S(o),), f"broadcast{o}") for o in broadcast]
    return sts + [Strategy(ins(P, P if y == x else R), (P,), "partial")]


@_register_new("aten.repeat.default")
def repeat(node: Node, graph: Graph) -> list[Strategy]:
    # Tiling: only dims with repeat factor 1 are carried (new leading dims come first).
    reps = arg(node, 1, "repeats")
    lead = len(reps) - ndim(graph, node.inputs[0])
    return along((k - lead, k) for k in range(lead, len(reps)) if reps[k] == 1) + [partial()]


@_register_new("aten.repeat_interleave.self_int")
def repeat_interleave(node: Node, graph: Graph) -> list[Strategy]:
    # Each element k times in place along dim d (an int k): rows [a, b) of x become rows
    # [k a, k b) of the output, so d shards alike too (its shard class splits both at the same
    # granules: k times as many elements out), and the other dims are carried:
    #     repeat_interleave(concat_j x_j, k, d) = concat_j repeat_interleave(x_j, k, d)
    # Without a dim x is flattened first. A given output_size is the whole's length along d
    # (not a shard's): the other dims carry it as it is (Mamba2's B and C heads, [B, L, G, N]
    # -> [B, L, H, N] with output_size H).
    rank = ndim(graph, node.inputs[0])
    dim, size = arg(node, 2, "dim", None), arg(node, 3, "output_size", None)
    if not isinstance(arg(node, 1, "repeats"), int) or (dim is None and rank != 1):
        return [partial()]
    d = norm_dim(dim if dim is not None else 0, rank)
    return along((k, k) for k in range(rank) if size is None or k != d) + [partial()]


# ---------------------------------------------------------------------------------------------
# Slicing and splitting: the dim worked along stays whole.


@_register_new("aten.slice.Tensor")
def slice_(node: Node, graph: Graph) -> list[Strategy]:
    # A slice that keeps the whole dim (x[:, 1:] also slices dim 0 from 0 to the end in some
    # exports) is the identity there, and a slice from <= 0 to >= the end stays one locally.
    rank = ndim(graph, node.inputs[0])
    dim = norm_dim(arg(node, 1, "dim", 0), rank)
    whole = shape_of(graph, node.inputs[0])[dim] == shape_of(graph, node.outputs[0])[dim]
    return along((k, k) for k in range(rank) if k != dim or whole) + [partial()]


@_register_new("aten.pad.default", "aten.constant_pad_nd.default")
def pad(node: Node, graph: Graph) -> list[Strategy]:
    # The padded (or cropped) dims, the last len(pad) / 2, stay whole; the others are carried.
    # Padding with zeros, like reflect, replicate and circular padding, which copy elements, is
    # linear; a nonzero fill is not (every device's summand would carry it).
    rank = ndim(graph, node.inputs[0])
    amounts = arg(node, 1, "pad")
    padded = {rank - 1 - i for i in range(len(amounts) // 2) if amounts[2 * i] or amounts[2 * i + 1]}
    if node.op == "aten.pad.default":
        mode, fill = arg(node, 2, "mode", "constant"), arg(node, 3, "value", None)
    else:
        mode, fill = "constant", arg(node, 2, "value", 0)
    return along((k, k) for k in range(rank) if k not in padded) + ([partial()] if mode != "constant" or not fill else [])


@_register_new("aten.roll.default")
def roll(node: Node, graph: Graph) -> list[Strategy]:
    # The rolled dims stay whole (Swin's shifted windows roll height and width); the others
    # are carried. Without dims, roll works on the flattened tensor: nothing is carried.
    rank = ndim(graph, node.inputs[0])
    dims = arg(node, 2, "dims", [])
    rolled = {norm_dim(d, rank) for d in dims} if dims else set(range(rank))
    return along((k, k) for k in range(rank) if k not in rolled) + [partial()]


@_register_new("aten.narrow.default")
def narrow(node: Node, graph: Graph) -> list[Strategy]:
    rank = ndim(graph, node.inputs[0])
    return along(_except(norm_dim(arg(node, 1, "dim"), rank), rank)) + [partial()]


@_register_new("aten.select.int")
def select(node: Node, graph: Graph) -> list[Strategy]:
    rank = ndim(graph, node.inputs[0])
    return along(_without(norm_dim(arg(node, 1, "dim"), rank), rank)) + [partial()]


@_register_new("aten.split.Tensor", "aten.split.sizes", "aten.split.default", "aten.split_with_sizes.default",
               "aten.unsafe_split.Tensor", "aten.chunk.default")
def split(node: Node, graph: Graph) -> list[Strategy]:
    # Every piece is sharded alike on the other dims; the split sizes are along `dim`, unchanged.
    rank, n_out = ndim(graph, node.inputs[0]), len(node.outputs)
    dim = norm_dim(arg(node, 2, "dim", 0), rank)
    return along(_except(dim, rank), n_out=n_out) + [partial(n_out=n_out)]


@_register_new("aten.unbind.int")
def unbind(node: Node, graph: Graph) -> list[Strategy]:
    rank, n_out = ndim(graph, node.inputs[0]), len(node.outputs)
    dim = norm_dim(arg(node, 1, "dim", 0), rank)
    return along(_without(dim, rank), n_out=n_out) + [partial(n_out=n_out)]


@_register_new("aten.select_scatter.default", "aten.slice_scatter.default")
def scatter_region(node: Node, graph: Graph) -> list[Strategy]:
    # x with a region along `dim` replaced by src: linear in (x, src) jointly, and independent
    # along every other dim (src lacks `dim` for select_scatter).
    rank = ndim(graph, node.inputs[0])
    dim = norm_dim(arg(node, 2, "dim", 0), rank)
    drops = node.op == "aten.select_scatter.default"
    src_dim = dict(_without(dim, rank) if drops else _except(dim, rank))
    sts = [Strategy((S(k), S(s)), (S(k),), f"dim{k}") for k, s in src_dim.items()]
    return sts + [partial(n_in=2)]


# ---------------------------------------------------------------------------------------------
# Concatenation


@_register_new("aten.cat.default")
def cat(node: Node, graph: Graph) -> list[Strategy]:
    # torch.cat skips legacy empty 1-D operands of other ranks (a key-value cache's first
    # step: cat([empty (0,), keys [B, H, S, D]])): they hold nothing, so they stay replicated.
    ranks = [ndim(graph, t) for t in node.inputs]
    rank = max(ranks)
    skipped = [r != rank and shape_of(graph, t) == (0,) for t, r in zip(node.inputs, ranks)]
    if any(r != rank and not sk for r, sk in zip(ranks, skipped)):
        return []
    dim = norm_dim(arg(node, 1, "dim", 0), rank)
    return [Strategy(tuple(R if sk else p for sk, p in zip(skipped, st.inputs)), st.outputs, st.name)
            for st in along(_except(dim, rank), n_in=len(ranks)) + [partial(n_in=len(ranks))]]


@_register_new("aten.stack.default")
def stack(node: Node, graph: Graph) -> list[Strategy]:
    # stack = cat of unsqueezed inputs: input dim k lands at k, or k + 1 at and after `dim`.
    rank, n_in = ndim(graph, node.inputs[0]), len(node.inputs)
    dim = norm_dim(arg(node, 1, "dim", 0), rank + 1)
    return along(((k, k + (k >= dim)) for k in range(rank)), n_in=n_in) + [partial(n_in=n_in)]


# ---------------------------------------------------------------------------------------------
# Indexing: x is linear in the looked-up values, never in the (integer) indices.


@_register_new("aten.index_select.default")
def index_select(node: Node, graph: Graph) -> list[Strategy]:
    # out = x[..., idx, ...] along dim: other dims are independent (x sharded, idx whole);
    # idx entries are independent too (x whole, idx sharded: an embedding lookup).
    rank = ndim(graph, node.inputs[0])
    dim = norm_dim(arg(node, 1, "dim"), rank)
    sts = [Strategy((S(k), R), (S(k),), f"dim{k}") for k in range(rank) if k != dim]
    if ndim(graph, node.inputs[1]) == 1:
        sts.append(Strategy((R, S(0)), (S(dim),), "index"))
    return sts + [Strategy((P, R), (P,), "partial")]


@_register_new("aten.gather.default")
def gather(node: Node, graph: Graph) -> list[Strategy]:
    # out[i][j] = x[idx[i][j]][j] (dim 0): out takes idx's shape and reads x at the same
    # position off `dim`, so a dim k != dim shards x and idx alike where their lengths agree;
    # along `dim` idx alone may be sharded (x whole).
    x, idx = (shape_of(graph, t) for t in node.inputs)
    dim = norm_dim(arg(node, 1, "dim"), len(x))
    sts = [Strategy((S(k), S(k)), (S(k),), f"dim{k}") for k in range(len(x)) if k != dim and x[k] == idx[k]]
    sts.append(Strategy((R, S(dim)), (S(dim),), "index"))
    return sts + [Strategy((P, R), (P,), "partial")]


@_register_new("aten.index.Tensor")
def index(node: Node, graph: Graph) -> list[Strategy]:
    # x[..., i1, ..., ik, ...] with integer index tensors of one broadcast shape b. Dims not
    # indexed are independent (x sharded, indices whole). The indexed dims become b's dims: in
    # place when the indexed dims are adjacent, else in front (NumPy's rule). Indices of equal
    # shapes may be sharded on a dim of b with x whole (a lookup).
    x, out = shape_of(graph, node.inputs[0]), shape_of(graph, node.outputs[0])
    indices = arg(node, 1, "indices")
    pos = [d for d, t in enumerate(indices) if t is not None]
    if not pos or any(graph.tensors[t].dtype in ("bool", "uint8") for t in node.inputs[1:]):
        return []  # boolean masks: data-dependent shapes, replicated only
    shapes = [shape_of(graph, indices[d]) for d in pos]
    b = len(torch.broadcast_shapes(*shapes))
    rest = [d for d in range(len(x)) if d not in pos]
    first = pos[0] if pos == list(range(pos[0], pos[-1] + 1)) else 0
    after = [d for d in rest if d >= first]
    out_of = {d: d for d in rest if d < first} | {d: first + b + k for k, d in enumerate(after)}
    if len(out) != len(rest) + b or any(out[o] != x[d] for d, o in out_of.items()):
        return []
    n_idx = len(node.inputs) - 1
    sts = [Strategy((S(d),) + (R,) * n_idx, (S(o),), f"dim{o}") for d, o in out_of.items()]
    if all(s == shapes[0] for s in shapes):
        sts += [Strategy((R,) + (S(k),) * n_idx, (S(first + k),), f"index{k}") for k in range(b)]
    sts += _positional_rows(graph, x, indices, pos, shapes, b, first)
    return sts + [Strategy((P,) + (R,) * n_idx, (P,), "partial")]


def _positional_rows(graph: Graph, x, indices, pos, shapes, b: int, first: int) -> list[Strategy]:
    # x[..., arange(n) along output dim o, ...] (transformers' padding mask: mask[batch_idx,
    # kv_idx]; CLIP's pooler: h[batch_idx, ids.argmax(-1)]) reads row i of dim d for output row
    # i: d and o split alike, and each device indexes its own rows by their local positions
    # (variant "local_positions"); another index that varies along o is split alike (its
    # values, positions in other dims, stay), one that does not is whole:
    #     out[o = i] = x[d = i, ..., J[i]]
    #     =>  out[o in rows_j] = x_j[d = i - start_j, ..., J_j[i - start_j]]
    found = []
    for k, d in enumerate(pos):
        along = _arange_dim(graph, indices[d].name, x[d])
        if along is None:
            continue
        at = b - len(shapes[k]) + along  # its dim in the indices' broadcast shape
        ins = [S(d)]
        for j, s in enumerate(shapes):
            mine = at - (b - len(s))  # the same dim in index j's own shape
            ins.append(R if j == k or mine < 0 or s[mine] == 1 else S(mine))
        found.append(Strategy(tuple(ins), (S(first + at),), f"positions{d}", "local_positions"))
    return found


_SAME_VALUES = {"aten.unsqueeze.default", "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                "aten.expand.default", "aten._to_copy.default", "aten.clone.default", "aten.alias.default",
                "aten.lift_fresh_copy.default", "aten.to.dtype"}


def _arange_dim(graph: Graph, name: str, n: int) -> int | None:
    """The dim along which tensor `name` holds 0, 1, ..., n - 1 (constant along its other
    dims), where it is made so from aten.arange(n) through views, unsqueezes, expands and
    copies; else None."""
    t = graph.tensors[name]
    if t.producer < 0:
        return None
    node = graph.nodes[t.producer]
    if node.op.startswith("aten.arange"):
        start, end, step = ((0, arg(node, 0, "end"), 1) if node.op == "aten.arange.default" else
                            (arg(node, 0, "start"), arg(node, 1, "end"), arg(node, 2, "step", 1)))
        return 0 if (start, end, step) == (0, n, 1) and len(t.shape) == 1 else None
    if node.op not in _SAME_VALUES or not node.inputs:
        return None
    src = graph.tensors[node.inputs[0]].shape
    inner = _arange_dim(graph, node.inputs[0], n)
    if inner is None:
        return None
    if node.op == "aten.expand.default":
        lead = len(t.shape) - len(src)
        return inner + lead if t.shape[inner + lead] == n else None
    if node.op in ("aten._to_copy.default", "aten.clone.default", "aten.alias.default",
                   "aten.lift_fresh_copy.default", "aten.to.dtype"):
        return inner
    # a view that only adds or drops dims of length 1: the arange's dim is its one longer dim
    if [m for m in src if m != 1] != [n] or [m for m in t.shape if m != 1] != [n]:
        return None
    return next(i for i, m in enumerate(t.shape) if m == n)


@variant("local_positions")
def local_positions(node, st, args, kwargs, ctx, graph):
    # the arange index rebuilt at this device's rows: 0, 1, ..., its row count - 1
    x, indices = args[0], list(args[1])
    d = int(st.name.removeprefix("positions"))
    ref = arg(node, 1, "indices")[d]
    whole = graph.tensors[ref.name].shape
    along = _arange_dim(graph, ref.name, graph.tensors[node.inputs[0]].shape[d])
    rows = x.shape[d]
    view = [rows if i == along else 1 for i in range(len(whole))]
    local = [rows if i == along else m for i, m in enumerate(whole)]
    indices[d] = torch.arange(rows, device=x.device).view(view).expand(local)
    return torch.ops.aten.index.Tensor(x, indices)


@_register_new("aten.zeros.default", "aten.ones.default", "aten.full.default", "aten.empty.memory_format",
               "aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default",
               "aten.new_empty.default", "aten.arange.default", "aten.arange.start", "aten.arange.start_step")
def factory(node: Node, graph: Graph) -> list[Strategy]:
    # A tensor made from a shape alone (new_zeros reads only its input's dtype and device):
    # every element is one constant, so any shard of it is that constant at the local shape
    # (local.SIZE_ARGS), whatever the input's placement:
    #     zeros(n)[rows j] = zeros(n_j)
    # The input is sharded alike only on a dim of the same length at the same place
    # (x.new_zeros(x.shape)): a strategy sharding two dims makes them split alike (units.py).
    # arange's elements are their positions: a shard would need its offset, so it is made
    # whole on every device (the replicated strategy every op has).
    if node.op.startswith("aten.arange"):
        return []
    out = shape_of(graph, node.outputs[0])
    if not node.inputs:
        return [Strategy((), (S(d),), f"dim{d}") for d in range(len(out))]
    x = shape_of(graph, node.inputs[0])
    alike = [d for d in range(len(out)) if len(x) == len(out) and x[d] == out[d]]
    return ([Strategy((S(d),), (S(d),), f"dim{d}") for d in alike]
            + [Strategy((R,), (S(d),), f"made{d}") for d in range(len(out))]
            + [Strategy((S(k),), (R,), f"whole{k}") for k in range(len(x))])
