"""Shape rules: every offered strategy recomputes the op exactly on uneven simulated devices."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as hs

from hap.capture import capture
from hap.placement import D, P, R, S
from hap.rules import strategies_for
from hap.rules.check import check_strategy
from hap.rules.units import ShardClasses

from rulecheck import RATIOS, check_ops

torch.set_num_threads(1)


class Fn(nn.Module):
    """loss = fn(x * w, *rest): the parameter w makes gradients flow through every op of fn."""

    def __init__(self, fn, shape):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn(shape))

    def forward(self, x, *rest):
        return self.fn(x * self.w, *rest)


def graph_of(fn, shape, *rest):
    return capture(Fn(fn, shape), (torch.randn(shape), *rest))


def offered(node, graph) -> set:
    return {(st.inputs, st.outputs) for st in strategies_for(node, graph)}


def test_view_family():
    def fn(y):  # y: [10, 6, 4]
        a = y.view(60, 4)
        b = y.reshape(20, 3, 4)  # 10*6 = 20*3: one block, split at multiples of gcd(10, 20)
        c = y.flatten(1).unflatten(1, (2, 12))
        d = y.view(10, 6, 2, 2)
        return a.sum() + (b * b).sum() + c.sum() + d.sum()

    g = graph_of(fn, (10, 6, 4))
    views = check_ops(g, ["aten.view.default"])["aten.view.default"]  # capture makes every one a view
    merge = views[0]
    assert {((S(0),), (S(0),)), ((S(2),), (S(1),)), ((P,), (P,))} <= offered(merge, g)
    assert not any(ins == (S(1),) for ins, _ in offered(merge, g))  # inside the merged dim
    assert ((S(0),), (S(0),)) in offered(views[1], g)
    split = views[4]
    assert ((S(2),), (S(2),)) in offered(split, g) and ((S(2),), (S(3),)) not in offered(split, g)


def test_squeeze_unsqueeze_keep_shards_of_length_one():
    # Dim 0 has length 4: on three devices one shard has a single row, which squeeze must keep.
    def fn(y):  # y: [4, 1, 10]
        return y.squeeze().sum() + y.squeeze(1).sum() + torch.squeeze(y, (1,)).sum() + y.unsqueeze(2).sum()

    g = graph_of(fn, (4, 1, 10))
    ops = check_ops(g, ["aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.unsqueeze.default"])
    assert ((S(2),), (S(1),)) in offered(ops["aten.squeeze.dim"][0], g)
    assert ((S(2),), (S(3),)) in offered(ops["aten.unsqueeze.default"][0], g)


def test_permutations():
    def fn(y):  # y: [10, 6, 4]
        return (y.permute(2, 0, 1).sum() + y.transpose(1, 2).sum() + y.mT.sum() + y[0].t().sum()
                + torch.movedim(y, 0, 2).sum())

    g = graph_of(fn, (10, 6, 4))
    ops = check_ops(g, ["aten.permute.default", "aten.transpose.int", "aten.t.default"])
    tr = offered(ops["aten.transpose.int"][0], g)
    assert {((S(1),), (S(2),)), ((S(2),), (S(1),)), ((S(0),), (S(0),)), ((P,), (P,))} <= tr
    assert ((S(0),), (S(1),)) in offered(ops["aten.permute.default"][0], g)


def test_expand_and_repeat():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(10, 1, 4))

        def forward(self, x):  # x: [10, 6, 4]
            e = self.w.expand(10, 6, 4)
            return (e * x).sum() + self.w.expand_as(x).sum() + self.w.repeat(1, 3, 2).sum() + (e.repeat(2, 1, 1) ** 2).sum()

    g = capture(M(), (torch.randn(10, 6, 4),))
    ops = check_ops(g, ["aten.expand.default", "aten.repeat.default"])
    ex = offered(ops["aten.expand.default"][0], g)
    assert {((S(0),), (S(0),)), ((R,), (S(1),)), ((P,), (P,))} <= ex
    rep = offered(ops["aten.repeat.default"][0], g)
    assert ((S(0),), (S(0),)) in rep and not any(outs == (S(2),) for _, outs in rep)


def test_slice_select_narrow_split():
    def fn(y):  # y: [10, 12, 4]
        parts = y.split(5, dim=1)
        sizes = torch.split(y, [7, 5], dim=1)
        return (y[:, 2:9].sum() + y[:, 3].sum() + y.narrow(2, 1, 2).sum() + (parts[0] * parts[1]).sum()
                + (sizes[0].sum() + sizes[1].sum()) + sum(c.sum() for c in y.chunk(3, dim=2))
                + sum((u * u).sum() for u in y.unbind(1)))

    g = graph_of(fn, (10, 12, 4))
    ops = check_ops(g, ["aten.slice.Tensor", "aten.select.int", "aten.split.Tensor", "aten.split_with_sizes.default",
                        "aten.unbind.int"])
    sl = offered(ops["aten.slice.Tensor"][0], g)
    assert ((S(0),), (S(0),)) in sl and ((S(1),), (S(1),)) not in sl
    assert ((S(2),), (S(1),)) in offered(ops["aten.select.int"][0], g)
    assert ((S(0),), (S(0),) * 12) in offered(ops["aten.unbind.int"][0], g)
    assert ((P,), (P, P, P)) in offered(ops["aten.split.Tensor"][0], g)


def test_pad_keeps_the_padded_dims_whole():
    """Hugging Face's causal LM loss pads its labels (F.pad(labels, (0, 1), value=-100)): the
    batch dim is carried, so the model stays data parallel; a nonzero fill is not linear."""
    def fn(y):  # y: [10, 12, 4]
        return ((F.pad(y, (0, 0, 1, 2)) ** 2).sum() + (F.pad(y, (1, 1), value=0.5) ** 2).sum()
                + (F.pad(y, (2, 0), mode="reflect") ** 2).sum())

    g = graph_of(fn, (10, 12, 4))
    found = check_ops(g, ["aten.pad.default"])["aten.pad.default"]
    zero, fill, reflect = (offered(n, g) - {((R,), (R,)), ((D,), (D,))} for n in found)
    assert set(zero) == {((S(0),), (S(0),)), ((S(2),), (S(2),)), ((P,), (P,))}  # dim 1 padded
    assert set(fill) == {((S(0),), (S(0),)), ((S(1),), (S(1),))}  # dim 2 padded; 0.5 + 0.5 is no 0.5
    assert set(reflect) == {((S(0),), (S(0),)), ((S(1),), (S(1),)), ((P,), (P,))}  # copies elements: linear


@pytest.mark.parametrize("op, args", [
    ("reshape", ((10, 6, 4), (20, 3, 4))), ("flatten", ((10, 6, 4), 1)), ("unflatten", ((10, 24), 1, (2, 12))),
    ("mT", ((10, 6, 4),)), ("expand_as", ((10, 1, 4), (10, 6, 4))), ("narrow", ((10, 12, 4), 2, 1, 2)),
    ("chunk", ((10, 12, 4), 3, 2))])
def test_ops_export_canonicalizes(op, args):
    # Capture's functional graph writes these as view, permute, expand, slice, split: their rules
    # still hold for graphs built otherwise.
    from test_rules_nn import op_graph

    overload = {"flatten": "using_ints", "unflatten": "int"}.get(op, "default")
    target = getattr(getattr(torch.ops.aten, op), overload)
    tensors = [torch.randn(a, requires_grad=True) if isinstance(a, tuple) and k == 0 else
               torch.randn(a) if isinstance(a, tuple) and op == "expand_as" else a for k, a in enumerate(args)]
    graph, _ = op_graph(target, *tensors)
    check_ops(graph, [str(target)])


def test_cat_stack():
    def fn(y):  # y: [10, 12, 4]
        return (torch.cat([y, y * 2, y], dim=1) ** 2).sum() + (torch.stack([y, -y], dim=1) ** 2).sum()

    g = graph_of(fn, (10, 12, 4))
    ops = check_ops(g, ["aten.cat.default", "aten.stack.default"])
    cat = offered(ops["aten.cat.default"][0], g)
    assert ((S(0),) * 3, (S(0),)) in cat and ((P,) * 3, (P,)) in cat
    assert not any(outs == (S(1),) for _, outs in cat)
    assert ((S(1), S(1)), (S(2),)) in offered(ops["aten.stack.default"][0], g)


def test_roll_keeps_the_rolled_dims_whole():
    def fn(y):  # y: [10, 12, 4]
        return (torch.roll(y, shifts=(3, -1), dims=(1, 2)) ** 2).sum() + (torch.roll(y, 5) ** 2).sum()

    g = graph_of(fn, (10, 12, 4))
    some, flat = (offered(n, g) - {((R,), (R,)), ((D,), (D,))} for n in check_ops(g, ["aten.roll.default"])["aten.roll.default"])
    assert some == {((S(0),), (S(0),)), ((P,), (P,))} and flat == {((P,), (P,))}


def test_tril_and_triu_split_the_dims_before_their_triangle():
    def fn(y):  # y: [6, 5, 5]; torch.multiply: mul's alias, which ConvBERT calls
        return (torch.tril(y, -1) ** 2).sum() + (torch.multiply(torch.triu(y, 1), y) ** 2).sum()

    g = graph_of(fn, (6, 5, 5))
    found = check_ops(g, ["aten.tril.default", "aten.triu.default", "aten.multiply.Tensor"])
    for node in found["aten.tril.default"] + found["aten.triu.default"]:
        assert offered(node, g) - {((R,), (R,)), ((D,), (D,))} == {((S(0),), (S(0),)), ((P,), (P,))}
    assert {((S(2), S(2)), (S(2),)), ((P, R), (P,)), ((R, P), (P,))} <= offered(found["aten.multiply.Tensor"][0], g)


def test_cat_skips_a_legacy_empty_operand():
    """A key-value cache's first step concatenates an empty (0,) tensor with the keys
    (Hugging Face's DynamicCache): torch.cat skips it, and so does the rule, which used to
    offer nothing, leaving data parallelism no program for Llama's cache."""
    def fn(y):  # y: [10, 12, 4]
        return (torch.cat([y.new_zeros(0), y * 2], dim=-2) ** 2).sum()

    g = graph_of(fn, (10, 12, 4))
    node = check_ops(g, ["aten.cat.default"])["aten.cat.default"][0]
    cat = offered(node, g)
    assert ((R, S(0)), (S(0),)) in cat and ((R, S(2)), (S(2),)) in cat and ((R, P), (P,)) in cat
    assert not any(outs == (S(1),) for _, outs in cat)


def test_indexing():
    def fn(y, idx, rows):  # y: [10, 12, 4], idx: [10, 5, 4] into dim 1, rows: [6, 2] into dim 1
        return ((torch.index_select(y, 1, rows[:, 0]) ** 2).sum() + (torch.gather(y, 1, idx) ** 2).sum()
                + (y[:, rows] ** 2).sum() + (y[rows[:, 0], :, rows[:, 1]] ** 2).sum())

    g = graph_of(fn, (10, 12, 4), torch.randint(0, 12, (10, 5, 4)), torch.randint(0, 4, (6, 2)))
    ops = check_ops(g, ["aten.index_select.default", "aten.gather.default", "aten.index.Tensor"])
    sel = offered(ops["aten.index_select.default"][0], g)
    assert {((S(0), R), (S(0),)), ((R, S(0)), (S(1),)), ((P, R), (P,))} <= sel
    assert ((S(1), R), (S(1),)) not in sel
    gat = offered(ops["aten.gather.default"][0], g)
    assert ((S(0), S(0)), (S(0),)) in gat and ((R, S(1)), (S(1),)) in gat
    assert ((S(2), S(2)), (S(2),)) in gat
    adjacent, spread = ops["aten.index.Tensor"]
    assert {((S(2), R), (S(3),)), ((R, S(0)), (S(1),))} <= offered(adjacent, g)
    assert ((S(1), R, R), (S(1),)) in offered(spread, g)  # non-adjacent: the index dims go first


def test_scatter_regions():
    def fn(y, src):  # y: [10, 12, 4]
        a = torch.select_scatter(y, src[:, 0] * 2, 1, 3)
        b = torch.slice_scatter(y, src * 3, 1, 2, 5)
        return (a * a).sum() + (b * b).sum()

    g = graph_of(fn, (10, 12, 4), torch.randn(10, 3, 4))
    ops = check_ops(g, ["aten.select_scatter.default", "aten.slice_scatter.default"])
    assert ((S(2), S(1)), (S(2),)) in offered(ops["aten.select_scatter.default"][0], g)
    assert ((P, P), (P,)) in offered(ops["aten.slice_scatter.default"][0], g)


def _shape(data, factors) -> list[int]:
    """Group consecutive factors into dims at random, with a length-1 dim somewhere maybe."""
    dims: list[int] = []
    for f in factors:
        if dims and data.draw(hs.booleans()):
            dims[-1] *= f
        else:
            dims.append(f)
    if data.draw(hs.booleans()):
        dims.insert(data.draw(hs.integers(0, len(dims))), 1)
    return dims


@settings(max_examples=25, deadline=None)
@given(hs.data())
def test_view_property(data):
    factors = data.draw(hs.lists(hs.sampled_from([2, 3, 4, 5]), min_size=1, max_size=4))
    src = _shape(data, factors)
    dst = _shape(data, data.draw(hs.permutations(factors)))
    method = data.draw(hs.sampled_from(["view", "reshape"]))
    g = graph_of(lambda y: (getattr(y, method)(dst) ** 2).sum(), tuple(src))
    table = [(n.index, strategies_for(n, g)) for n in g.nodes]
    classes = ShardClasses(g, table)
    for n in g.nodes:
        if n.op in ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"):
            for st in table[n.index][1]:
                for ratios in RATIOS:
                    check_strategy(n, g, st, ratios, classes)
            # The outermost non-1 dims always line up when their lengths share a factor.
            i = next(d for d, k in enumerate(src) if k > 1)
            o = next(d for d, k in enumerate(dst) if k > 1)
            if math.gcd(src[i], dst[o]) > 1:
                assert ((S(i),), (S(o),)) in offered(n, g)


def test_factories_shard_their_output_at_the_local_shape():
    """zeros/new_zeros/new_full/ones make a constant: any shard is the constant at the local
    shape, whatever the input's placement; the input shards alike only on a dim of the same
    length (coupling two dims would make them split alike). arange is whole only. T5's
    shift-right (new_zeros) and relative position buckets (arange, zeros) use them."""
    def fn(y, ids):  # y: [10, 12, 4], ids: [10, 12]
        a = y + ids.new_zeros(ids.shape).unsqueeze(-1) + torch.zeros(10, 12, 4)
        b = a * y.new_full((12, 4), 2.0) + torch.arange(4)
        return (b * b).sum() + torch.ones(3, 2).sum()

    g = graph_of(fn, (10, 12, 4), torch.randint(0, 5, (10, 12)))
    ops = check_ops(g, ["aten.new_zeros.default", "aten.zeros.default", "aten.new_full.default",
                        "aten.arange.start_step" if any(n.op == "aten.arange.start_step" for n in g.nodes)
                        else "aten.arange.default", "aten.ones.default"])
    new_zeros = offered(ops["aten.new_zeros.default"][0], g)
    assert {((S(0),), (S(0),)), ((S(1),), (S(1),)), ((R,), (S(1),)), ((S(0),), (R,))} <= new_zeros
    assert ((S(0),), (S(1),)) not in new_zeros  # would split the batch and the sequence alike
    assert ((S(0),), (S(0),)) not in offered(ops["aten.new_full.default"][0], g)  # [12, 4] from [10, 12, 4]
    assert {((), (S(d),)) for d in range(3)} <= offered(ops["aten.zeros.default"][0], g)
    arange = [n for n in g.nodes if n.op.startswith("aten.arange")][0]
    assert {st.outputs for st in strategies_for(arange, g)} == {(R,)}


def test_repeat_interleave_shards_the_repeated_dim_at_k_times_the_rows():
    """Rows [a, b) of x become rows [k a, k b): the repeated dim shards too (Mixtral's batched
    experts repeat each token once per chosen expert); a global output_size does not."""
    def fn(y):  # y: [10, 12, 4]
        return ((y.repeat_interleave(2, dim=0) ** 2).sum() + (y.flatten().repeat_interleave(3) ** 2).sum()
                + (y.repeat_interleave(3, dim=1, output_size=36) ** 2).sum())

    g = graph_of(fn, (10, 12, 4))
    ops = check_ops(g, ["aten.repeat_interleave.self_int"])
    along_rows, flat, sized = ops["aten.repeat_interleave.self_int"]
    assert {((S(0),), (S(0),)), ((S(2),), (S(2),)), ((P,), (P,))} <= offered(along_rows, g)
    assert ((S(0),), (S(0),)) in offered(flat, g)
    # output_size is the whole's along dim 1: the batch and the last dim carry it (Mamba2's heads)
    assert offered(sized, g) - {((R,), (R,)), ((D,), (D,))} == {((S(0),), (S(0),)), ((S(2),), (S(2),)), ((P,), (P,))}



class _Positional(nn.Module):
    """mask[arange(B)[:, None, None], arange(K)[None, None, :]] (transformers' padding mask)
    and h[arange(B), ids.argmax(-1)] (CLIP's pooler): each output row reads its own row."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 5, 3))

    def forward(self, mask, ids):  # mask [B, K] bool, ids [B, K]
        B, K = mask.shape
        m = mask[torch.arange(B)[:, None, None], torch.arange(K)[None, None, :]]  # [B, 1, K]
        pooled = self.w[torch.arange(B), ids.argmax(-1)]  # [B, 3]
        return (self.w.sum(-1).unsqueeze(1) * m).sum() + (pooled ** 2).sum()


def test_an_arange_index_keeps_each_row_on_its_device():
    """Data parallelism gathered the mask (and pipelines refused every model given an
    attention_mask): a row-for-row index now splits with its rows, each device indexing its own
    by their local positions. Checked with the real aranges, not random indices."""
    mask, ids = torch.rand(6, 5) > 0.3, torch.randn(6, 5)
    g = capture(_Positional(), (mask, ids))
    table = [(n.index, strategies_for(n, g)) for n in g.nodes]
    classes = ShardClasses(g, table)
    pad, pool = [n for n in g.nodes if n.op == "aten.index.Tensor"]
    values = {pad.inputs[1]: torch.arange(6)[:, None, None], pad.inputs[2]: torch.arange(5)[None, None, :]}
    values[pool.inputs[1]], values[pool.inputs[2]] = torch.arange(6), torch.randint(0, 5, (6,))
    values["mask"] = mask
    for node, wanted in ((pad, {((S(0), R, R), (S(0),)), ((S(1), R, R), (S(2),))}), (pool, {((S(0), R, S(0)), (S(0),))})):
        found = {(st.inputs, st.outputs): st for st in dict(table)[node.index] if st.local == "local_positions"}
        assert set(found) == wanted
        for st in found.values():
            for ratios in RATIOS:
                check_strategy(node, g, st, ratios, classes, inputs={t: values[t] for t in node.inputs if t in values})


def test_an_arange_of_another_length_is_no_row_for_row_index():
    def fn(y):  # y: [10, 12, 4]; arange(6) picks rows 0..5 of 10: not each row its own
        return (y[torch.arange(6)] ** 2).sum() + (y[:, torch.arange(12)] ** 2).sum()

    g = graph_of(fn, (10, 12, 4))
    short, full = [n for n in g.nodes if n.op == "aten.index.Tensor"]
    assert not [st for st in strategies_for(short, g) if st.local == "local_positions"]
    assert [(st.inputs, st.outputs) for st in strategies_for(full, g) if st.local == "local_positions"] == [((S(1), R), (S(1),))]


def test_a_strategy_pickled_in_another_process_hashes_as_one_made_here():
    # Strategy remembers its hash; a pickle must not carry it, since another process (a rank,
    # another PYTHONHASHSEED) hashes the strategy's name differently and memos would miss it.
    import pickle
    import subprocess
    import sys

    from hap.rules import Strategy

    made = subprocess.run(
        [sys.executable, "-c", "import pickle, sys; from hap.placement import R, S; from hap.rules import Strategy; "
         "sys.stdout.buffer.write(pickle.dumps(Strategy((S(0), R), (S(0),), 'batch')))"],
        capture_output=True, check=True, env={**__import__("os").environ, "PYTHONHASHSEED": "7"}).stdout
    loaded, here = pickle.loads(made), Strategy((S(0), R), (S(0),), "batch")
    assert loaded == here and hash(loaded) == hash(here)
    assert {here: 1}[loaded] == 1


def test_placements_are_values_whose_kind_is_checked():
    # Placements keep is_shard and code as fields and hash by their code: equal placements are
    # equal and hash alike however made (S(d) is made once per d; pickled ones are rebuilt), and
    # a kind that is none of S, R, D, P, or S of a negative dim, is one line naming it.
    import copy
    import pickle

    from hap.placement import Placement, from_code, parse

    assert [p.code for p in (R, D, P, S(0), S(2))] == [0, 1, 2, 3, 5]
    assert [p.is_shard for p in (R, D, P, S(1))] == [False, False, False, True]
    for p in (R, D, P, S(0), S(3)):
        for q in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p), Placement(p.kind, p.dim), from_code(p.code), parse(str(p))):
            assert q == p and hash(q) == hash(p) and q.code == p.code and q.is_shard == p.is_shard
    assert S(1) is S(1) and S(1) != S(2) and R != D
    with pytest.raises(ValueError, match=r"^not a placement kind: 'X' \(expected 'S', 'R', 'D' or 'P'\)$"):
        Placement("X")
    with pytest.raises(ValueError, match="non-negative dim, got -1"):
        S(-1)
