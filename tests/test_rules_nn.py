"""Rules of hap/rules/nn.py against the ground-truth checker, on uneven splits.

Every strategy of every node of the ops under test is run on simulated devices with the
shard classes of the whole graph, and its forward values and gradients compared with one
device. Integer tensors (ids, targets, indices) carry the values the model really computes.
Capture and the single-op graphs cover the training-IR ops; core_graph covers their core-ATen
lowerings (native_layer_norm, convolution, _softmax, native_group_norm, ...).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hap.capture import capture, graph_from_exported
from hap.ir import Graph, Node, Tensor, TensorRef
from hap.placement import D, P, R, S
from hap.rules import strategies_for
from hap.rules.check import check_strategy
from hap.rules.local import substitute
from hap.rules.units import ShardClasses

torch.set_num_threads(1)
RATIOS = ([0.6, 0.4], [0.55, 0.3, 0.15], [0.0, 0.6, 0.4])  # the last: an idle rank 0, which holds P addends
aten = torch.ops.aten


@pytest.fixture(autouse=True)
def float64():
    """Models and examples in float64: summing random partial summands is then exact enough
    that any difference the checker sees is a rule's fault, not float32 rounding."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)

# ---------------------------------------------------------------------------------------------
# Helpers


def graph_values(graph: Graph, model: nn.Module, inputs) -> dict[str, torch.Tensor]:
    """Every tensor of the captured graph, computed on the real inputs."""
    state = model.state_dict()
    values = dict(zip(graph.inputs, inputs))
    values |= {t.name: state[t.target].detach().clone() for t in graph.tensors.values() if t.kind in ("param", "buffer")}
    for n in graph.nodes:
        out = n.target(*substitute(n.args, values), **substitute(n.kwargs, values))
        values |= zip(n.outputs, out if isinstance(out, (list, tuple)) else (out,))
    return {k: v.detach() for k, v in values.items()}


def core_graph(model: nn.Module, inputs) -> Graph:
    """The model in core ATen (native_layer_norm, convolution, _softmax, ...), as a lowering would give it."""
    ep = torch.export.export(model, tuple(inputs)).run_decompositions()
    return graph_from_exported(ep, type(model).__name__)


def op_graph(target, *args, **kwargs) -> tuple[Graph, dict[str, torch.Tensor]]:
    """A one-node graph of target(*args); tensors that require grad become parameters."""
    tensors: dict[str, Tensor] = {}
    values: dict[str, torch.Tensor] = {}

    def ref(a):
        if isinstance(a, torch.Tensor):
            name = f"t{len(values)}"
            values[name] = a.detach()
            tensors[name] = Tensor(name=name, shape=tuple(a.shape), dtype=str(a.dtype).removeprefix("torch."),
                                   itemsize=a.element_size(), kind="param" if a.requires_grad else "input",
                                   requires_grad=a.requires_grad, consumers=[0])
            return TensorRef(name)
        return type(a)(ref(x) for x in a) if isinstance(a, (list, tuple)) else a

    targs, tkwargs = ref(args), {k: ref(v) for k, v in kwargs.items()}
    out = target(*args, **kwargs)
    outs = out if isinstance(out, (list, tuple)) else (out,)
    names = [f"out{k}" for k in range(len(outs))]
    for name, o in zip(names, outs):
        tensors[name] = Tensor(name=name, shape=tuple(o.shape), dtype=str(o.dtype).removeprefix("torch."),
                               itemsize=o.element_size(), kind="activation", requires_grad=o.requires_grad, producer=0)
    node = Node(index=0, name="op", op=str(target), target=target, args=targs, kwargs=tkwargs,
                inputs=tuple(values), outputs=tuple(names))
    params = [n for n, t in tensors.items() if t.kind == "param"]
    graph = Graph(nodes=[node], tensors=tensors, inputs=[n for n in values if n not in params], params=params, loss=names[0])
    return graph, values


def check_ops(graph: Graph, values: dict[str, torch.Tensor], ops: set[str]) -> dict[str, list]:
    """Check every strategy of every node of `ops`; return the strategies found, by op."""
    found = {n.index: strategies_for(n, graph) for n in graph.nodes}
    classes = ShardClasses(graph, found.items())
    by_op: dict[str, list] = {}
    for n in graph.nodes:
        if n.op not in ops:
            continue
        by_op.setdefault(n.op, []).extend(found[n.index])
        inputs = {t: values[t] for t in n.inputs}
        for st in found[n.index]:
            for ratios in RATIOS:
                check_strategy(n, graph, st, ratios, classes, inputs=inputs)
    missing = ops - set(by_op)
    assert not missing, f"ops not in the graph: {missing}"
    return by_op


def named(strategies, name: str, inputs=None, outputs=None) -> bool:
    return any(st.name == name and (inputs is None or st.inputs == inputs) and (outputs is None or st.outputs == outputs)
               for st in strategies)


# ---------------------------------------------------------------------------------------------
# Models: each forward returns a scalar loss that depends on every parameter.

VOCAB, HIDDEN, HEADS, BATCH, SEQ, PAD, IGNORE = 10, 12, 3, 5, 4, 0, 7


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(VOCAB, HIDDEN, padding_idx=PAD)
        self.ln = nn.LayerNorm(HIDDEN)
        self.rms = nn.RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, targets, mask):
        h = self.ln(self.tok(ids) + self.pos(ids))
        q, k, v = self.qkv(self.rms(h)).view(BATCH, SEQ, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + (a + b).transpose(1, 2).reshape(BATCH, SEQ, HIDDEN)
        logits = self.head(h)
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=IGNORE)
        logp = F.log_softmax(logits, -1)
        return loss + F.nll_loss(logp.view(-1, VOCAB), targets.view(-1), reduction="sum") + F.softmax(logits, 1).var()


def lm_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    ids[0, :2] = PAD
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets[:, 0] = IGNORE  # some ignored targets on every device
    mask = torch.rand(BATCH, 1, SEQ, SEQ, generator=g) > 0.3
    mask[..., 0] = True  # no fully masked row
    return ids, targets, mask


class TinyCNN(nn.Module):
    def __init__(self, running_stats=True):
        super().__init__()
        self.conv = nn.Conv2d(6, 10, 3, padding=1)
        self.bn = nn.BatchNorm2d(10, track_running_stats=running_stats)
        self.gn = nn.GroupNorm(2, 10)
        self.conv1 = nn.Conv1d(10, 4, 3, bias=False)
        self.fc = nn.Linear(10, 10)
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, 10))

    def forward(self, img, labels):
        c = self.gn(self.bn(self.conv(img)))
        p = F.max_pool2d(c, 2) + F.avg_pool2d(c, 2, ceil_mode=True) + F.adaptive_avg_pool2d(c, (4, 4))
        seq = self.conv1(p.flatten(2)).square().mean()
        logits = self.fc(p.mean((2, 3)))
        return F.cross_entropy(logits, labels, weight=self.class_weight, label_smoothing=0.1) + seq


def cnn_inputs():
    g = torch.Generator().manual_seed(2)
    return torch.randn(BATCH, 6, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


class Losses(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(BATCH, 6))
        self.maps = nn.Parameter(torch.randn(BATCH, 3, 10))  # [N, C, d] logits
        self.register_buffer("pos_weight", torch.rand(6) + 0.5)

    def forward(self, y, probs, labels_2d, signs):
        x = self.w * 2
        return (F.mse_loss(x, y) + F.l1_loss(x, y, reduction="sum") + F.smooth_l1_loss(x, y, reduction="none").sum()
                + F.huber_loss(x, y, delta=0.5)
                + F.binary_cross_entropy_with_logits(x, y.sigmoid(), pos_weight=self.pos_weight)
                + F.binary_cross_entropy(x.sigmoid(), y.sigmoid(), weight=self.pos_weight) + F.soft_margin_loss(x, signs)
                + F.kl_div(F.log_softmax(x, 1), probs, reduction="sum")
                + F.cross_entropy(x, probs) + F.cross_entropy(x, probs, reduction="none").sum()
                + F.cross_entropy(self.maps, labels_2d, ignore_index=2))


def losses_inputs():
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 3, (BATCH, 10), generator=g)
    y = torch.randn(BATCH, 6, generator=g)
    return y, torch.rand(BATCH, 6, generator=g).softmax(1), labels, y.sign()


class Gate(nn.Module):
    """GShard-style top-2 gating and dispatch over 4 experts."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, 4)

    def forward(self, x):
        gates = F.softmax(self.router(x), dim=-1)
        top, idx = torch.topk(gates, 2, dim=-1)
        mask = F.one_hot(idx, 4).to(gates.dtype)
        dispatch = torch.zeros_like(gates).scatter_add(1, idx, top) + torch.zeros_like(gates).scatter(1, idx, top)
        ranked, order = torch.sort(gates, dim=0, descending=True)
        rank = torch.argsort(gates, dim=1).to(gates.dtype)
        return (dispatch * mask.sum(1)).sum() + (ranked * order.to(gates.dtype)).sum() + (gates * rank).sum()


# ---------------------------------------------------------------------------------------------
# Tests on captured models


def test_language_model():
    model, inputs = TinyLM(), lm_inputs()
    graph = capture(model, inputs)
    ops = {"aten.embedding.default", "aten.layer_norm.default", "aten.rms_norm.default",
           "aten.scaled_dot_product_attention.default", "aten.cross_entropy_loss.default",
           "aten.log_softmax.int", "aten.nll_loss_nd.default", "aten.softmax.int"}
    found = check_ops(graph, graph_values(graph, model, inputs), ops)
    emb = found["aten.embedding.default"]
    assert named(emb, "batch", (R, S(0)), (S(0),)) and named(emb, "hidden", (S(1), R), (S(2),))
    assert named(emb, "vocab", (S(0), R), (P,))
    sdpa = found["aten.scaled_dot_product_attention.default"]
    assert named(sdpa, "batch") and named(sdpa, "heads")
    assert named(sdpa, "batch", (S(0), S(0), S(0), S(0))) and named(sdpa, "heads", (S(1), S(1), S(1), R))
    assert named(found["aten.cross_entropy_loss.default"], "batch", (S(0), S(0)), (P,))
    assert named(found["aten.nll_loss_nd.default"], "batch", (S(0), S(0)), (P,))
    assert named(found["aten.layer_norm.default"], "dim1", (S(1), R, R), (S(1),))
    assert not named(found["aten.softmax.int"], "dim1")  # the softmax dim is never sharded


def test_cnn():
    model, inputs = TinyCNN(), cnn_inputs()
    graph = capture(model, inputs)
    ops = {"aten.conv2d.default", "aten.conv1d.default", "aten._native_batch_norm_legit_functional.default", "aten.group_norm.default",
           "aten.max_pool2d.default", "aten.avg_pool2d.default", "aten.adaptive_avg_pool2d.default",
           "aten.cross_entropy_loss.default"}
    found = check_ops(graph, graph_values(graph, model, inputs), ops)
    conv = found["aten.conv2d.default"]
    assert named(conv, "batch", (S(0), R, R), (S(0),))
    assert named(conv, "out-channel", (R, S(0), S(0)), (S(1),))
    assert named(conv, "in-channel", (S(1), S(1), P), (P,))
    assert named(found["aten.conv1d.default"], "in-channel", (S(1), S(1)), (P,))
    bn = found["aten._native_batch_norm_legit_functional.default"]
    assert named(bn, "channel", (S(1), S(0), S(0), S(0), S(0)), (S(1), S(0), S(0), S(0), S(0)))
    # training batch norm shards the batch only with its statistics synchronized
    assert [st.name for st in bn if st.inputs[0] == S(0)] == ["sync-batch"]
    assert named(bn, "sync-batch", (S(0), R, R, R, R), (S(0), R, R, R, R))
    assert named(found["aten.max_pool2d.default"], "channel")
    assert named(found["aten.cross_entropy_loss.default"], "batch", (S(0), S(0), R), (P,))


def test_losses():
    model, inputs = Losses(), losses_inputs()
    graph = capture(model, inputs)
    ops = {"aten.mse_loss.default", "aten.l1_loss.default", "aten.smooth_l1_loss.default", "aten.huber_loss.default",
           "aten.binary_cross_entropy_with_logits.default", "aten.binary_cross_entropy.default",
           "aten.soft_margin_loss.default", "aten.kl_div.default", "aten.cross_entropy_loss.default"}
    found = check_ops(graph, graph_values(graph, model, inputs), ops)
    assert named(found["aten.smooth_l1_loss.default"], "dim1", outputs=(S(1),))
    bce = found["aten.binary_cross_entropy_with_logits.default"]
    assert named(bce, "dim1", (S(1), S(1), S(0)), (P,))
    ce = found["aten.cross_entropy_loss.default"]
    assert named(ce, "dim2", (S(2), S(1)), (P,))  # spatial sample dim of [N, C, d] logits
    assert all(st.inputs[0] != S(1) for st in ce)  # never the class dim


def test_moe_gating():
    model = Gate()
    inputs = (torch.randn(10, HIDDEN),)
    graph = capture(model, inputs)
    ops = {"aten.topk.default", "aten.one_hot.default", "aten.scatter_add.default", "aten.scatter.src",
           "aten.sort.default", "aten.argsort.default", "aten.softmax.int"}
    found = check_ops(graph, graph_values(graph, model, inputs), ops)
    assert named(found["aten.topk.default"], "batch", (S(0),), (S(0), S(0)))
    assert named(found["aten.scatter_add.default"], "partial", (P, R, P), (P,))
    assert not named(found["aten.scatter.src"], "dim1")
    assert named(found["aten.sort.default"], "dim1") and not named(found["aten.sort.default"], "batch")


def test_core_aten_lm():
    """The same layers lowered to core ATen, as a compiler would give them."""
    model, inputs = TinyLM(), lm_inputs()
    graph = core_graph(model, inputs)
    found = check_ops(graph, graph_values(graph, model, inputs),
                      {"aten.native_layer_norm.default", "aten._softmax.default", "aten._log_softmax.default"})
    assert named(found["aten.native_layer_norm.default"], "batch", outputs=(S(0), S(0), S(0)))


def test_core_aten_cnn():
    model, inputs = TinyCNN(running_stats=False), cnn_inputs()  # running stats would become graph outputs
    graph = core_graph(model, inputs)
    found = check_ops(graph, graph_values(graph, model, inputs),
                      {"aten.convolution.default", "aten._native_batch_norm_legit.no_stats",
                       "aten.native_group_norm.default", "aten.max_pool2d_with_indices.default"})
    assert named(found["aten.convolution.default"], "in-channel")
    assert named(found["aten.native_group_norm.default"], "batch")
    assert named(found["aten._native_batch_norm_legit.no_stats"], "channel", outputs=(S(1), S(0), S(0)))


# ---------------------------------------------------------------------------------------------
# Single ops that export does not emit for the models above


def _param(*shape):
    return torch.randn(*shape).requires_grad_()


def _check_op(target, *args, **kwargs):
    graph, values = op_graph(target, *args, **kwargs)
    return check_ops(graph, values, {str(target)})[str(target)]


def test_a_number_added_to_a_partial_sum_is_not_linear():
    """x + eps on a partial x would add eps once per device (RMSNorm's mean(x^2) + eps under
    tensor parallelism: wrong gradients, found on Hugging Face Llama): offered for 0 only;
    x * c and x / c stay linear, c / x is not."""
    x = _param(5, 6)
    for target, args, linear in ((aten.add.Tensor, (x, 0.1), False), (aten.sub.Tensor, (x, 0.1), False),
                                 (aten.add.Tensor, (0.1, x), False), (aten.add.Tensor, (x, 0.0), True),
                                 (aten.add.Tensor, (x, x * 2), True), (aten.mul.Tensor, (x, 3.0), True),
                                 (aten.div.Tensor, (x, 3.0), True), (aten.div.Tensor, (3.0, x), False)):
        found = _check_op(target, *args)
        assert any(st.name == "partial" for st in found) == linear, (target, args)


def test_embedding_variants():
    ids = torch.tensor([[0, 3, 9, 3], [5, 0, 1, 9], [2, 2, 8, 4]])
    weight = _param(VOCAB, 6)
    # padding row 8 lies off device 0 under both ratio sets: its owner must translate it
    vocab = _check_op(aten.embedding.default, weight, ids, 8)
    assert named(vocab, "vocab")
    freq = _check_op(aten.embedding.default, weight, ids, -1, True)
    assert {st.name for st in freq} == {"hidden", "replicated", "duplicated"}  # counts span the whole batch


@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False), ("max", False)])
def test_embedding_bag_splits_its_bags_features_and_vocabulary(mode, weighted):
    """nn.EmbeddingBag had no rule: every op after it ran duplicated, whole on every device.
    Given [B, L] ids (bags of L: export flattens them and makes the offsets), its bags split
    with the batch; its table splits on features, and for sum and mean on rows (partial
    sums). Checked numerically at uneven ratios, forward and backward, with padding ids and,
    for sum, per-sample weights."""

    class Bags(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(VOCAB, 6, mode=mode, padding_idx=None if plain else 2)

        def forward(self, ids, weights):
            return self.bag(ids, per_sample_weights=weights if weighted else None).square().mean()

    plain = mode == "sum" and not weighted  # (in float32 torch then keeps no offset2bag: [0])
    ids = torch.tensor([[0, 3, 9, 2], [5, 2, 2, 2], [2, 2, 8, 4], [7, 7, 1, 0], [6, 2, 9, 9]])  # [B=5, L=4]
    model, inputs = Bags().float(), (ids, torch.rand(5, 4, dtype=torch.float32))
    graph = capture(model, inputs)
    [op] = {n.op for n in graph.nodes if "embedding_bag" in n.op}
    found = check_ops(graph, graph_values(graph, model, inputs), {op})[op]
    assert named(found, "bags", outputs=(S(0), R if plain else S(0), S(0), S(0)))  # offset2bag: every id's bag
    assert named(found, "hidden") and named(found, "vocab") == (mode != "max")
    # offsets given as data may cut the ids anywhere: no bag split then
    mode_code = {"sum": 0, "mean": 1, "max": 2}[mode]
    flat, offsets = ids.flatten(), torch.tensor([0, 3, 3, 11, 12])
    psw = torch.rand(20) if weighted else None
    found = _check_op(aten.embedding_bag.padding_idx, _param(VOCAB, 6), flat, offsets, False, mode_code, False, psw, False, 2)
    assert {st.name for st in found} == {"hidden", "replicated", "duplicated"} | ({"vocab"} if mode != "max" else set())
    found = _check_op(aten._embedding_bag.default, _param(VOCAB, 6), flat, torch.tensor([0, 3, 3, 11, 12, 20]), False,
                      mode_code, False, psw, True, -1)  # the last offset included: 5 bags
    assert named(found, "hidden")
    # F.embedding_bag(..., padding_idx=-1): this overload's -1 is the last row (id 9, which
    # the ids hold), where _embedding_bag's -1 is none
    found = _check_op(aten.embedding_bag.padding_idx, _param(VOCAB, 6), flat, offsets, False, mode_code, False, psw,
                      False, -1)
    assert named(found, "hidden") and named(found, "vocab") == (mode != "max")
    if mode == "max":  # (torch: "max mode does not support sparse weights")
        return
    # a sparse gradient is synchronized whole (its (index, row) pairs): the table is not split
    model.bag.sparse = True
    graph = capture(model, inputs)
    [node] = [n for n in graph.nodes if n.op == op]
    assert {st.name for st in strategies_for(node, graph)} == {"bags", "replicated", "duplicated"}


@pytest.mark.parametrize("case", ["gqa", "mask4d", "flash_cpu", "math"])
def test_attention_variants(case):
    q, kv = _param(3, 4, 5, 2), _param(3, 4, 6, 2)
    if case == "gqa":
        found = _check_op(aten.scaled_dot_product_attention.default, q, _param(3, 2, 6, 2), _param(3, 2, 6, 2), enable_gqa=True)
        assert named(found, "heads", (S(1), S(1), S(1)))
    elif case == "mask4d":
        mask = torch.randn(3, 4, 5, 6)
        found = _check_op(aten.scaled_dot_product_attention.default, q, kv, kv, mask)
        assert named(found, "heads", (S(1), S(1), S(1), S(1)))
    elif case == "flash_cpu":
        found = _check_op(aten._scaled_dot_product_flash_attention_for_cpu.default, q, kv, kv, is_causal=True)
        assert named(found, "batch", outputs=(S(0), S(0)))
    else:
        found = _check_op(aten._scaled_dot_product_attention_math.default, q, kv, kv, torch.randn(5, 6))
        assert named(found, "heads", (S(1), S(1), S(1), R), (S(1), S(1)))


def test_batch_norm_variants():
    x, w, b = _param(5, 4, 3), _param(4), _param(4)
    mean, var = torch.randn(4), torch.rand(4) + 0.5
    inference = _check_op(aten.native_batch_norm.default, x, w, b, mean, var, False, 0.1, 1e-5)
    assert named(inference, "batch", outputs=(S(0), R, R)) and named(inference, "channel")
    functional = _check_op(aten._native_batch_norm_legit_functional.default, x, w, b, mean, var, True, 0.1, 1e-5)
    assert named(functional, "channel", outputs=(S(1), S(0), S(0), S(0), S(0)))
    assert not named(functional, "batch")
    # synchronized: statistics, running statistics and gradients exact at every ratio checked
    assert named(functional, "sync-batch", outputs=(S(0), R, R, R, R))
    no_stats = _check_op(aten._native_batch_norm_legit.no_stats, x, w, b, True, 0.1, 1e-5)
    assert named(no_stats, "sync-batch", outputs=(S(0), R, R))
    _check_op(aten._native_batch_norm_legit_no_training.default, x, w, b, mean, var, 0.1, 1e-5)


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_nll_loss_forward(reduction):
    logp = torch.randn(BATCH, 4, 3).log_softmax(1).requires_grad_()
    target = torch.tensor([[0, 1, 3], [3, 3, 2], [1, 0, 0], [2, 3, 1], [3, 2, 1]])
    weight = torch.tensor([0.5, 1.0, 1.5, 2.0])
    found = _check_op(aten.nll_loss2d_forward.default, logp.unsqueeze(-1).detach().requires_grad_(),
                      target.unsqueeze(-1), weight, reduction, 3)
    found += _check_op(aten.nll_loss_forward.default, logp[:, :, 0].detach().requires_grad_(), target[:, 0], weight, reduction, 3)
    assert named(found, "batch", outputs=(S(0), R) if reduction == 0 else (P, P))


def test_convolution_variants():
    x = torch.randn(4, 6, 7).requires_grad_()
    _check_op(aten.conv1d.default, x[0].detach().requires_grad_(), _param(10, 6, 3), _param(10))  # unbatched
    found = _check_op(aten.conv_transpose1d.default, x, _param(6, 10, 3), _param(10), [2])
    assert named(found, "out-channel", (R, S(1), S(0)), (S(1),)) and named(found, "in-channel", (S(1), S(0), P), (P,))
    grouped = _check_op(aten.conv1d.default, x, _param(4, 3, 3), None, [1], [0], [1], 2)
    assert {st.name for st in grouped} == {"batch", "partial-input", "partial-weight", "replicated", "duplicated"}


def test_misc_ops():
    x = torch.randn(5, 10, 6).requires_grad_()
    _check_op(aten._fused_rms_norm.default, x, [6], _param(6), 1e-6)
    _check_op(aten.adaptive_max_pool2d.default, x, [3, 2])
    _check_op(aten.argsort.stable, x.detach(), stable=True, dim=1)
    idx = torch.randint(0, 10, (5, 4, 6))
    found = _check_op(aten.scatter_reduce.two, x, 1, idx, torch.randn(5, 4, 6), "amax", include_self=False)
    assert named(found, "batch") and named(found, "dim2") and not named(found, "dim1")
    assert [st.name for st in _check_op(aten.one_hot.default, torch.tensor([1, 2, 0]), -1)] == ["replicated"]
    # T5's relative position buckets and shift-right: elementwise, never partial (fill would
    # write its value on every device's summand, min/floor_divide are not linear)
    for target, args in ((aten.fill.Tensor, (x, torch.tensor(3.0))), (aten.fill.Scalar, (x, 3.0)),
                         (aten.min.other, (x, torch.randn(10, 1))), (aten.max.other, (x, torch.randn(6))),
                         (aten.floor_divide.default, (idx, torch.tensor(3)))):
        found = _check_op(target, *args)
        assert named(found, "dim0") and not named(found, "partial"), target


def test_random_ops_draw_in_memory_order_as_one_device():
    """Eager dropout and randn_like draw in their input's memory order (empty_like keeps its
    strides): on a transposed view the draws land elsewhere than on a contiguous tensor of
    its shape. hap draws one device's numbers (whole_noise), so it must draw alike."""
    from hap.rules.local import is_random, whole_noise

    class M(nn.Module):
        def forward(self, x):
            h = x.t()  # [4, 6], strides (1, 4)
            return (F.dropout(h, 0.3) * torch.randn_like(h)).sum()

    x = torch.randn(6, 4)
    graph = capture(M(), (x,))
    randoms = [n for n in graph.nodes if is_random(n)]
    assert len(randoms) == 2
    torch.manual_seed(3)
    want = [F.dropout(torch.ones(6, 4).t(), 0.3), torch.randn_like(x.t())]  # one device's, in graph order
    torch.manual_seed(3)
    got = [whole_noise(n, graph) for n in randoms]
    got = [g[0] if isinstance(g, tuple) else g for g in got]  # native_dropout: (noise, mask)
    torch.manual_seed(3)
    assert not torch.equal(want[0], F.dropout(torch.ones(4, 6), 0.3))  # the memory order matters
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_einsum_shards_no_dim_of_a_diagonal():
    # "bii->bi" reads x[b, i, i]: sharding one i dim and not the other breaks the op (a rank
    # died with "subscript i is repeated ... sizes don't match"); b and the partial sum remain
    found = _check_op(aten.einsum.default, "bii->bi", [_param(4, 5, 5)])
    assert {st.name for st in found} >= {"shard-b", "partial-operand-0"}
    assert not any(st.name == "shard-i" for st in found)


def test_ops_of_library_models_that_forced_gathers():
    """Each had no rule, so data parallelism gathered activations and the pipelines refused the
    model: LongT5's einsums with an ellipsis, Bloom's ALiBi bias broadcast into baddbmm,
    MobileViT's bilinear resize, and `mask & other` (transformers' and_masks, with every
    attention_mask)."""
    q, k = _param(2, 3, 4, 5, 6), _param(2, 3, 7, 5, 6)  # [..., q, h, d], [..., k, h, d]
    found = _check_op(aten.einsum.default, "...qhd,...khd->...hqk", [q, k])
    assert {st.inputs for st in found} >= {(S(0), S(0)), (S(1), S(1)), (S(3), S(3))}  # batch, block, head
    assert any(st.outputs == (P,) and st.inputs == (S(4), S(4)) for st in found)  # d: a partial sum
    found = _check_op(aten.einsum.default, "...nd,nd->...n", [_param(3, 4, 5), _param(4, 5)])  # ellipsis on one
    assert any(st.inputs == (S(0), R) and st.outputs == (S(0),) for st in found)
    found = _check_op(aten.einsum.default, "...ij,...jk->...ik", [_param(2, 3, 4, 5), _param(3, 5, 6)])  # right-aligned
    assert any(st.inputs == (S(1), S(0)) and st.outputs == (S(1),) for st in found)
    alibi = _param(6, 1, 7)  # [B*H, 1, S]: one row added to every query row
    found = _check_op(aten.baddbmm.default, alibi, _param(6, 4, 5), _param(6, 5, 7), beta=1.0, alpha=0.5)
    assert {(st.inputs, st.outputs) for st in found} >= {((S(0), S(0), S(0)), (S(0),)), ((R, S(1), R), (S(1),)),
                                                         ((S(2), R, S(2)), (S(2),))}
    x = _param(3, 4, 5, 6)
    found = _check_op(aten.upsample_bilinear2d.vec, x, [8, 9], False, None)
    assert {st.inputs for st in found} >= {(S(0),), (S(1),), (P,)}
    mask = torch.rand(4, 1, 5, 6) > 0.5
    found = _check_op(aten.__and__.Tensor, mask, torch.rand(4, 3, 5, 6) > 0.3)
    assert named(found, "dim0") and named(found, "dim3") and not named(found, "partial")


def test_ops_of_torch_layers_that_forced_gathers():
    """torch.nn layers whose op had no rule, so data parallelism gathered activations there and
    the pipelines refused the model: LSTM, GRU and RNN, InstanceNorm, PixelShuffle and
    PixelUnshuffle, ChannelShuffle, PReLU, Bilinear, Unfold and Fold, CosineSimilarity."""
    x = _param(5, 4, 6)  # [B, T, F]
    for batch_first, layers in ((True, 1), (False, 2)):
        lstm = nn.LSTM(6, 3, num_layers=layers, batch_first=batch_first)
        params = [p.detach().clone().requires_grad_() for p in lstm._flat_weights]
        h = [_param(layers, 5 if batch_first else 4, 3) for _ in range(2)]  # [layers, B, H]
        found = _check_op(aten.lstm.input, x, h, params, True, layers, 0.0, True, False, batch_first)
        b = 0 if batch_first else 1
        assert [st.inputs[:3] + st.outputs for st in found if st.name == "batch"] == [(S(b), S(1), S(1), S(b), S(1), S(1))]
    lstm = nn.LSTM(6, 4, proj_size=2, batch_first=True)  # h0 [1, B, 2], c0 [1, B, 4]
    params = [p.detach().clone().requires_grad_() for p in lstm._flat_weights]
    found = _check_op(aten.lstm.input, x, [_param(1, 5, 2), _param(1, 5, 4)], params, True, 1, 0.0, True, False, True)
    assert named(found, "batch")
    gru = nn.GRU(6, 3, num_layers=2)
    params = [p.detach().clone().requires_grad_() for p in gru._flat_weights]
    found = _check_op(aten.gru.input, x, _param(2, 4, 3), params, True, 2, 0.0, True, False, False)
    assert named(found, "batch", outputs=(S(1), S(1)))
    found = _check_op(aten.gru.input, x, _param(2, 4, 3), params, True, 2, 0.5, True, False, False)
    assert not named(found, "batch")  # dropout between the layers draws over the whole batch
    rnn = nn.RNN(6, 3)
    params = [p.detach().clone().requires_grad_() for p in rnn._flat_weights]
    assert named(_check_op(aten.rnn_tanh.input, x, _param(1, 5, 3), params, True, 1, 0.0, True, False, True), "batch")
    img, w, b = _param(4, 3, 5, 6), _param(3), _param(3)
    found = _check_op(aten.instance_norm.default, img, w, b, None, None, True, 0.1, 1e-5, False)
    assert named(found, "batch", (S(0), R, R)) and named(found, "channel", (S(1), S(0), S(0)))
    found = _check_op(aten.instance_norm.default, img, None, None, torch.zeros(3), torch.ones(3), True, 0.1, 1e-5, False)
    assert not named(found, "batch")  # running statistics average the whole batch
    assert named(_check_op(aten.pixel_shuffle.default, _param(3, 8, 2, 3), 2), "batch")
    assert named(_check_op(aten.pixel_unshuffle.default, _param(3, 2, 4, 6), 2), "batch")
    assert {st.inputs for st in _check_op(aten.channel_shuffle.default, _param(3, 6, 2, 5), 2)} == {(S(0),), (S(2),), (S(3),), (R,), (D,)}
    found = _check_op(aten.prelu.default, _param(4, 3, 5), _param(3))
    assert named(found, "channel", (S(1), S(0))) and named(found, "batch", (S(0), R))
    assert named(_check_op(aten.prelu.default, _param(4, 3), _param(1)), "channel", (S(1), R))
    found = _check_op(aten._prelu_kernel.default, _param(4, 3, 5), _param(1, 3, 1))  # (a core-ATen graph's)
    assert named(found, "channel", (S(1), S(1))) and named(found, "batch", (S(0), R))
    found = _check_op(aten.bilinear.default, _param(4, 5, 3), _param(4, 5, 2), _param(6, 3, 2), _param(6))
    assert named(found, "batch", (S(0), S(0), R, R)) and named(found, "out-feature", (R, R, S(0), S(0)), (S(2),))
    assert named(_check_op(aten.im2col.default, _param(3, 2, 5, 5), [2, 2], [1, 1], [0, 0], [1, 1]), "batch")
    assert named(_check_op(aten.col2im.default, _param(3, 8, 16), [5, 5], [2, 2], [1, 1], [0, 0], [1, 1]), "batch")
    found = _check_op(aten.cosine_similarity.default, _param(4, 5, 3), _param(4, 5, 3), 1)
    assert {(st.inputs, st.outputs) for st in found} >= {((S(0), S(0)), (S(0),)), ((S(2), S(2)), (S(1),))}


@pytest.mark.parametrize("case", ["plain", "masked-row", "gqa"])
def test_attention_dropout_rows_are_one_devices_bit_for_bit(case):
    """A device's rows of attention with dropout (drawn whole, hap's own math) equal one
    device's bit for bit in float32, output and gradients: scaled as torch's math path scales,
    q and k each by the root of the scale. (q @ k^T * scale differed in the last bits, which a
    small Transformer's training amplified to 1e-3 within 3 steps of SGD.) masked-row: a query
    whose keys are all masked (left padding) attends to nothing, zeros as torch's safe softmax
    gives, not NaN (a padded GPT-2's loss was NaN). gqa: grouped-query attention (4 q heads, 2
    k/v heads) split on the heads at 60/40 (it was a NotImplementedError at the first step)."""
    from hap.rules.check import _context
    from hap.rules.local import run_node
    gen = torch.Generator().manual_seed(3)
    q, k, v, g = (torch.randn(5, 4 if case == "gqa" else 2, 7, 3, dtype=torch.float32, generator=gen) for _ in range(4))
    if case == "gqa":
        k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    mask = None
    if case == "masked-row":
        mask = torch.ones(7, 7, dtype=torch.bool).tril()
        mask[:, :2] = False  # queries 0 and 1 see no key
    kwargs = {"enable_gqa": True} if case == "gqa" else {}
    graph, values = op_graph(aten.scaled_dot_product_attention.default, q, k.requires_grad_(), v, mask, 0.3, **kwargs)
    node = graph.nodes[0]
    dim = 1 if case == "gqa" else 0
    st = next(s for s in strategies_for(node, graph) if s.inputs[:3] == (S(dim),) * 3)
    classes = ShardClasses(graph, [(0, [st])])
    state = torch.get_rng_state()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    want = aten.scaled_dot_product_attention.default(*leaves, mask, 0.3, **kwargs)
    want_grads = torch.autograd.grad(want, leaves, g)
    assert want.isfinite().all() and (case != "masked-row" or (want[:, :, :2] == 0).all())
    sizes = [classes.split_sizes(name, dim, [0.6, 0.4]) for name in node.inputs[:3]]
    assert case != "gqa" or sizes[0] == [2, 2] and sizes[1] == [1, 1]
    outs, grads, starts = [], [], [0, 0, 0]
    for j in range(2):
        torch.set_rng_state(state)  # each device draws every row's noise from the same state
        local = [t.detach().narrow(dim, starts[i], sizes[i][j]).requires_grad_() for i, t in enumerate((q, k, v))]
        inputs = dict(zip(node.inputs, local + ([mask] if mask is not None else [])))
        out = run_node(node, st, inputs, graph, _context(j, 2, classes, [0.6, 0.4], None))[0]
        outs.append(out)
        grads.append(torch.autograd.grad(out, local, g.narrow(dim, starts[0], sizes[0][j])))
        starts = [starts[i] + sizes[i][j] for i in range(3)]
    assert torch.equal(torch.cat(outs, dim), want)
    for i in range(3):
        assert torch.equal(torch.cat([gr[i] for gr in grads], dim), want_grads[i]), "qkv"[i]
