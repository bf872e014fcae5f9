"""Built-in benchmark models: small variants run and capture, paper sizes have the paper's
parameter counts (counted on the meta device), knobs, the registry's errors, MoE routing."""


import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hap.capture import capture
from hap.models import MODELS, build, describe, param_count, resolve
from hap.models.moe import MoEFFN, capacity

torch.set_num_threads(1)

NAMES = ["vgg19", "vit", "bert", "bert-moe", "ncf", "ncf-sparse"]


@pytest.fixture(scope="module", params=NAMES)
def small(request):
    model, inputs = build(request.param, scale="small")
    return request.param, model, inputs


def test_registry_lists_the_paper_models():
    assert list(MODELS) == NAMES


def test_small_forward_backward(small):
    name, model, inputs = small
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    grads = {pname: p.grad.to_dense() if p.grad is not None and p.grad.is_sparse else p.grad
             for pname, p in model.named_parameters()}  # ncf-sparse's tables: sparse
    for pname, g in grads.items():
        assert g is not None and torch.isfinite(g).all(), pname
    assert any(g.abs().sum() > 0 for g in grads.values())
    assert any(p.grad.is_sparse for p in model.parameters()) == name.endswith("-sparse")


def test_small_is_small(small):
    """Small enough that the suite's many runs of it stay quick: counted, not timed (a timed
    bound fails on a busy machine). VGG19's small forward and backward is 314 MFLOP, NCF's
    tables 2.4M parameters."""
    name, model, inputs = small
    with FlopCounterMode(display=False) as counted:
        model(*inputs).backward()
    assert counted.get_total_flops() < 1e9, f"{name} small: {counted.get_total_flops() / 1e6:.0f} MFLOP"
    params = sum(p.numel() for p in model.parameters())
    assert params < 4e6, f"{name} small: {params} parameters"


def test_small_trains(small):
    name, model, inputs = small
    model.eval()  # no dropout: the loss on one batch must fall
    try:
        # Adam refuses sparse gradients; Adagrad takes them
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05) if name.endswith("-sparse") \
            else torch.optim.Adam(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(8):
            opt.zero_grad()
            loss = model(*inputs)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], losses
    finally:
        model.train()


def test_small_capture(small):
    name, model, inputs = small
    g = capture(model, inputs, name=name)
    assert g.tensors[g.loss].shape == () and g.tensors[g.loss].dtype == "float32"
    assert g.nodes and g.total_flops > 0
    assert len(g.inputs) == len(inputs)
    # Every parameter (the tied BERT decoder shares the embedding's) is a graph parameter.
    assert len(g.params) == len(list(model.parameters()))
    assert sum(g.tensors[p].numel for p in g.params) == sum(p.numel() for p in model.parameters())
    assert all(g.tensors[p].requires_grad for p in g.params)


@pytest.mark.parametrize("name", ["vit", "bert-moe"])
def test_meta_capture_matches_cpu(name):
    cpu = capture(*build(name, scale="small"))
    model, inputs = build(name, scale="small", device="meta")
    assert all(p.is_meta for p in model.parameters()) and all(t.is_meta for t in inputs)
    meta = capture(model, inputs)
    assert [n.op for n in meta.nodes] == [n.op for n in cpu.nodes]
    assert meta.total_flops == cpu.total_flops


# Paper targets in millions: VGG19 133M (torchvision's features + 25088-wide classifier give
# 139.6M), ViT ~54M, BERT-base ~110M; BERT-MoE from its shapes (below).
TARGETS = {"vgg19": 133.0, "vit": 54.0, "bert": 110.0}


def _bert_moe_target(devices=8, H=768, F_=3072, layers=12):
    experts = 2 * devices
    dense_ffn = H * F_ + F_ + F_ * H + H
    moe_ffn = H * experts + experts * 2 * H * F_  # gate + stacked expert weights
    return (param_count("bert") + (layers // 2) * (moe_ffn - dense_ffn)) / 1e6


@pytest.mark.parametrize("name", NAMES)
def test_paper_param_counts(name):
    model, inputs = build(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    n = sum(p.numel() for p in model.parameters()) / 1e6
    target = TARGETS.get(name) or _bert_moe_target()
    assert abs(n - target) <= 0.10 * target, (name, n, target)
    assert n == pytest.approx(MODELS[name].paper_params_m, rel=1e-3)


@pytest.mark.parametrize("name", NAMES)
def test_meta_inputs_allocate_nothing_at_any_batch(name):
    """On meta the inputs were drawn on the CPU first: `hap plan --batch 1000000000` asked for
    3 TB and died with a traceback. Their shapes and dtypes are the CPU build's."""
    _, huge = build(name, scale="small", batch=10**9, device="meta")
    _, meta = build(name, scale="small", device="meta")
    _, cpu = build(name, scale="small")
    assert all(x.is_meta and x.shape[0] == 10**9 for x in huge)
    assert [(x.shape, x.dtype) for x in meta] == [(x.shape, x.dtype) for x in cpu]


def test_paper_shapes_and_batches():
    _, (img, lab) = build("vgg19", device="meta")
    assert tuple(img.shape) == (512, 3, 32, 32) and tuple(lab.shape) == (512,)
    _, (ids, lab) = build("bert", devices=4, device="meta")
    assert tuple(ids.shape) == (256, 128) and ids.dtype == torch.int64
    m, (ids, _) = build("bert-moe", device="meta")
    assert tuple(ids.shape) == (256, 128)  # 32 per GPU
    assert tuple(m.blocks[1].ffn.w1.shape) == (16, 768, 3072)  # 2 experts per GPU
    assert tuple(m.blocks[1].ffn.w2.shape) == (16, 3072, 768)
    assert not isinstance(m.blocks[0].ffn, MoEFFN) and isinstance(m.blocks[3].ffn, MoEFFN)
    vit = build("vit", device="meta")[0]
    assert len(vit.blocks) == 8 and vit.pos_emb.shape == (1, 65, 768)


def test_knobs():
    m, _ = build("vit", layers=24, hidden=1024, device="meta")
    assert len(m.blocks) == 24
    attn = m.blocks[0].attn
    assert attn.heads == 16 and m.blocks[0].mlp.fc1.out_features == 4096  # head width 64, FFN 4x
    m, (ids, _) = build("bert-moe", experts=4, seq=64, batch=6, devices=2, device="meta")
    assert m.blocks[1].ffn.experts == 4 and tuple(ids.shape) == (6, 64)
    _, cfg, batch = resolve("bert-moe", devices=2)
    assert cfg.experts == 4 and batch == 64
    _, cfg, batch = resolve("vit", scale="small")
    assert batch == 8 and cfg.hidden <= 64 and cfg.image <= 32
    assert len(build("vgg19", layers=11, device="meta")[0].features) == 8 * 2 + 5  # 8 conv+ReLU pairs, 5 pools
    _, a = build("bert", scale="small")
    _, b = build("bert", scale="small")
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # fixed generator seed


def test_unknown_and_bad_knobs():
    with pytest.raises(ValueError) as e:
        build("resnet")
    assert str(e.value) == "unknown model 'resnet'; choose from vgg19, vit, bert, bert-moe, ncf, ncf-sparse"
    with pytest.raises(ValueError, match="no 'seq' knob"):
        build("vit", seq=64)
    with pytest.raises(ValueError, match="no 'experts' knob"):
        build("bert", experts=4)
    with pytest.raises(ValueError, match="layers must be a positive integer"):
        build("bert", layers=0)
    with pytest.raises(ValueError, match="multiple of the head width"):
        build("bert", hidden=100, device="meta")
    with pytest.raises(ValueError, match="VGG-11/13/16/19"):
        build("vgg19", layers=12, device="meta")
    with pytest.raises(ValueError, match="at least 2"):
        build("bert-moe", experts=1, device="meta")
    with pytest.raises(ValueError) as e:  # (one layer: layer 0's FFN is dense, so no MoE at all)
        build("bert-moe", layers=1, experts=4, device="meta")
    assert str(e.value) == "bert-moe's MoE is every second layer's FFN, so it needs at least 2 layers, got 1"
    assert build("bert-moe", layers=2, experts=4, device="meta")[0].blocks[1].ffn.experts == 4
    with pytest.raises(ValueError, match="scale"):
        build("vit", scale="huge")


def test_describe():
    line = describe("bert")
    assert line.startswith("bert") and "111.6M params" in line and "12 layers" in line
    assert "hidden 768" in line and "batch 512" in line and "\n" not in line
    assert "16 experts" in describe("bert-moe")
    assert "batch 8" in describe("vit", scale="small")


# --- MoE routing against a token-by-token reference --------------------------------------


def _moe_reference(moe: MoEFFN, x: torch.Tensor) -> torch.Tensor:
    B, S, H = x.shape
    E, C = moe.experts, capacity(S, moe.experts, 2, moe.capacity_factor)
    probs = F.softmax(moe.gate(x), dim=-1)
    gates, idx = torch.topk(probs, 2, dim=-1)
    gates = gates / gates.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for b in range(B):
        load = [0] * E
        for k in range(2):  # all first choices queue before any second choice
            for s in range(S):
                e = int(idx[b, s, k])
                if load[e] < C:
                    load[e] += 1
                    h = F.gelu(x[b, s] @ moe.w1[e]) @ moe.w2[e]
                    y[b, s] += gates[b, s, k] * h
    return y


@pytest.mark.parametrize("capacity_factor", [8.0, 1.25, 0.5])
def test_moe_matches_reference(capacity_factor):
    torch.manual_seed(0)
    moe = MoEFFN(hidden=8, ffn=16, experts=4, capacity_factor=capacity_factor)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 1.0)  # uneven routing, so small capacities drop tokens
    x = torch.randn(3, 12, 8)
    y, aux = moe(x)
    assert y.shape == x.shape and aux.shape == () and aux > 0
    torch.testing.assert_close(y, _moe_reference(moe, x), rtol=1e-5, atol=1e-6)


def test_moe_capacity():
    assert capacity(128, 16) == 20  # ceil(2 * 128 / 16 * 1.25)
    assert capacity(16, 16) == 3


def test_a_knob_the_model_lacks_names_the_knobs_it_takes():
    """ViT's list left out --dropout, which it takes."""
    with pytest.raises(ValueError, match=r"^model 'vit' has no 'seq' knob; it takes layers, hidden, batch, dropout$"):
        resolve("vit", seq=10, scale="small")
