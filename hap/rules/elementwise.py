"""Elementwise ops with broadcasting.

Law (pointwise independence): f(x)[i] depends on x[i] only, so for any output dim d
    f(concat_j x_j) = concat_j f(x_j)
and an operand that broadcasts along d (absent there, or of length 1) is needed whole on
every device. Linear ops also pass partial sums through:
    neg(A1 + A2) = neg(A1) + neg(A2);  (A1 + A2) + (B1 + B2) = (A1 + B1) + (A2 + B2);
    (A1 + A2) * c = A1 * c + A2 * c   for c replicated.
but a number added to a partial sum is not: (A1 + c) + (A2 + c) = A + 2c, so x + eps (RMSNorm's
mean(x^2) + eps) passes partial sums only for c = 0.
"""

from __future__ import annotations

from ..ir import Graph, Node, TensorRef
from . import P, R, S, Strategy, register

UNARY = [
    "relu", "gelu", "silu", "tanh", "sigmoid", "exp", "log", "sqrt", "rsqrt", "abs", "erf", "sin", "cos",
    "reciprocal", "square", "log1p", "expm1", "sign", "logical_not", "bitwise_not", "isnan", "hardtanh",
    "leaky_relu", "elu", "softplus", "mish", "hardswish", "hardsigmoid", "relu6", "zeros_like", "ones_like",
    "empty_like", "full_like", "rand_like", "randn_like", "dropout", "native_dropout", "feature_dropout",
    "alias", "lift_fresh_copy", "pow", "clamp", "clamp_min", "clamp_max", "floor", "ceil", "round", "trunc",
    "masked_fill", "type_as", "bernoulli", "exponential", "eq", "ne", "lt", "gt", "le", "ge", "add", "sub",
    "mul", "multiply", "div", "rsub", "remainder", "fmod", "where", "maximum", "minimum", "bitwise_and", "bitwise_or",
    "bitwise_xor", "logical_and", "logical_or", "logical_xor", "atan2", "copy", "lerp", "addcmul", "addcdiv",
    "gelu_backward", "threshold", "nan_to_num", "scalar_tensor", "fill", "floor_divide",
    "__and__", "__or__", "__xor__",  # what `mask & other` records (transformers' and_masks)
]
# Overload suffixes that are elementwise for the names above.
OVERLOADS = ["default", "Tensor", "Scalar", "self", "ScalarOther", "ScalarSelf", "Tensor_Scalar",
             "Tensor_Tensor", "Scalar_Tensor", "Tensor_Scalar", "dtype", "other", "p"]

# Linear in every tensor operand jointly: partial inputs give a partial output.
LINEAR_ALL = {"aten.add.Tensor", "aten.sub.Tensor", "aten.neg.default", "aten.clone.default",
              "aten.contiguous.default", "aten.alias.default", "aten._to_copy.default", "aten.to.dtype",
              "aten.to.dtype_layout", "aten.mul.Scalar", "aten.div.Scalar", "aten.where.self"}
# Linear in exactly one operand when the others are replicated (and not partial).
LINEAR_ONE = {"aten.mul.Tensor", "aten.multiply.Tensor", "aten.div.Tensor"}  # div: linear in the numerator only
PRODUCTS = {"aten.mul.Tensor", "aten.multiply.Tensor"}  # (multiply: torch.multiply, mul's alias)


def broadcast_strategies(node: Node, graph: Graph) -> list[Strategy]:
    out_shape = graph.tensors[node.outputs[0]].shape
    in_shapes = [graph.tensors[t].shape for t in node.inputs]
    found = []
    for d in range(len(out_shape)):
        ins = []
        for shp in in_shapes:
            k = d - (len(out_shape) - len(shp))  # right-aligned broadcasting
            ins.append(S(k) if k >= 0 and shp[k] == out_shape[d] and shp[k] > 1 else R)
        found.append(Strategy(tuple(ins), tuple(S(d) for _ in node.outputs), f"dim{d}"))
    n_in = len(node.inputs)
    # Partial sums pass through linear ops. Operands that broadcast would be added once per
    # device, so they must not broadcast (a + b with b smaller is only linear if b is partial too).
    if (node.op in LINEAR_ALL and all(graph.tensors[t].shape == out_shape for t in node.inputs) and n_in >= 1
            and not _adds_a_number(node)):
        cond = node.op == "aten.where.self"
        ins = tuple(R if (cond and i == 0) else P for i in range(n_in))
        found.append(Strategy(ins, tuple(P for _ in node.outputs), "partial"))
    if node.op in LINEAR_ONE and n_in == 1 and isinstance(node.args[0], TensorRef):  # x * c or x / c, not c / x
        found.append(Strategy((P,), (P,), "partial"))
    if node.op in LINEAR_ONE and n_in == 2:
        for i in ((0, 1) if node.op in PRODUCTS else (0,)):
            if graph.tensors[node.inputs[i]].shape == out_shape:
                ins = tuple(P if k == i else R for k in range(n_in))
                found.append(Strategy(ins, (P,), "partial"))
    return found


def _adds_a_number(node: Node) -> bool:
    """Whether an addition has a nonzero number for an operand (x + 1e-6): each device would add
    it to its summand. (where's number branches are where.ScalarOther, never linear here.)"""
    return node.op in ("aten.add.Tensor", "aten.sub.Tensor") and any(
        not isinstance(a, TensorRef) and a != 0 for a in node.args[:2])


def _register_all():
    import torch

    keys = []
    for name in UNARY + ["neg", "clone", "contiguous", "_to_copy", "to", "detach"]:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for ov in packet.overloads():
            if ov in OVERLOADS or name in ("to", "_to_copy", "clone", "contiguous", "detach", "neg"):
                keys.append(f"aten.{name}.{ov}")
    keys = [k for k in dict.fromkeys(keys) if not k.endswith((".out", "_out"))]
    # min and max of two tensors (their other overloads reduce: reduction.py)
    register(*keys, "aten.broadcast_tensors.default", "aten.min.other", "aten.max.other")(broadcast_strategies)


_register_all()


@register("aten.tril.default", "aten.triu.default")
def triangle_strategies(node: Node, graph: Graph) -> list[Strategy]:
    """tril and triu keep x[..., i, j] or zero it by j - i, positions in the last two dims: a
    shard there would be its own triangle, so only the dims before them split. Linear:
        tril(A1 + A2) = tril(A1) + tril(A2)"""
    dims = len(graph.tensors[node.outputs[0]].shape)
    return [Strategy((S(d),), (S(d),), f"dim{d}") for d in range(dims - 2)] + [Strategy((P,), (P,), "partial")]
