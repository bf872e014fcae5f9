"""Random models x random plans x training-loop habits on gloo ranks, against one device.

    OMP_NUM_THREADS=1 .venv/bin/python tests/fuzz.py --seeds 0:100              # hap.HAP
    OMP_NUM_THREADS=1 .venv/bin/python tests/fuzz.py --seeds 0:60 --pipeline     # hap.Pipeline
    OMP_NUM_THREADS=1 .venv/bin/python tests/fuzz.py --seeds 0:60 --adam         # Adam too (eps 1e-3)
    OMP_NUM_THREADS=1 .venv/bin/python tests/fuzz.py --seeds 0:40 --kind bags    # nn.EmbeddingBag tables

A seed makes one case: a small model of odd sizes (a token model of attention, MLP and GLU
blocks with or without a tied head; an MLP with or without BatchNorm; a CNN with BatchNorm,
InstanceNorm or GroupNorm and ReLU or PReLU; torch's own Transformer encoder or decoder,
sequence first or batch first; an LSTM, GRU or RNN, one or two layers, one or two ways; with
--kind bags only, nn.EmbeddingBag tables of sum, mean or max bags), a cluster of 2-4 devices of
random speeds and bandwidth, a plan (hap's own for that cluster, or Megatron, TP or DP at
uneven shares; for --pipeline pp-exact's K stages and M micro-batches, GPipe or 1F1B) and a
loop (clipping, accumulation over two half batches, an eval pass, a shorter last batch, a
state-dict round trip), and dropout at 0.1 or 0.3 in half the cases (both sides draw from one
generator state). Three steps of SGD on the ranks must give one device's losses (and
gradient norms) and state. One line per seed: ok, FAIL with what differed, or the one-line
refusal a plan met (BatchNorm with several micro-batches is refused, rightly).

tests/test_fuzz.py runs a few fixed seeds in CI. Adam is left out there: it turns gradients
that are zero up to rounding (a bias before BatchNorm, a dead ReLU unit) into steps of the
learning rate, so rounding alone moves parameters by 1e-3. Widths are 4 and more: a LayerNorm
over 2 features is so ill-conditioned that float32 rounding grew about 1000x a step (a torch
decoder of width 2 with dropout: 1e-3 apart in 3 steps; in float64 within 6e-11, so rounding).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (gloo, run as a script)

STEPS = 3
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
TOL = dict(rtol=1e-4, atol=1e-5)


# -- models --------------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-norm residual block: attention, an MLP or a GLU."""

    def __init__(self, d: int, hidden: int, heads: int, kind: str, rng: random.Random):
        super().__init__()
        self.kind, self.norm, self.drop = kind, nn.LayerNorm(d), nn.Dropout(0.0)  # (p: the case's)
        if kind == "attn":
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True, bias=rng.random() < 0.7)
        elif kind == "mlp":
            self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d, bias=rng.random() < 0.5)
            self.act = rng.choice([nn.GELU(), nn.ReLU(), nn.Tanh(), nn.SiLU()])
        else:
            self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
            self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):  # [B, T, d] or [B, d]
        y = self.norm(x)
        if self.kind == "attn":
            y, _ = self.attn(y, y, y, need_weights=False)
        elif self.kind == "mlp":
            y = self.fc2(self.act(self.fc1(y)))
        else:
            y = self.down(F.silu(self.gate(y)) * self.up(y))
        return x + self.drop(y)


class TokenModel(nn.Module):
    def __init__(self, vocab, d, hidden, heads, kinds, tied, rng):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, 16, d) * 0.02) if rng.random() < 0.5 else None
        self.blocks = nn.ModuleList([Block(d, hidden, heads, k, rng) for k in kinds])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=not tied)
        if tied:
            self.head.weight = self.emb.weight
        self.pooled = rng.random() < 0.3  # one label per sequence from the mean over tokens

    def forward(self, ids, target):  # [B, T], [B, T]
        x = self.emb(ids)  # [B, T, d]
        if self.pos is not None:
            x = x + self.pos[:, : ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))  # [B, T, V]
        if self.pooled:
            return F.cross_entropy(logits.mean(1), target[:, 0])
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class VectorModel(nn.Module):
    def __init__(self, d_in, d, hidden, classes, blocks, rng):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList([Block(d, hidden, 1, "mlp", rng) for _ in range(blocks)])
        self.bn = nn.BatchNorm1d(d) if rng.random() < 0.4 else None
        self.out = nn.Linear(d, classes)

    def forward(self, x, y):  # [B, d_in], [B]
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        if self.bn is not None:
            x = self.bn(x)
        return F.cross_entropy(self.out(x), y)


class ConvModel(nn.Module):
    def __init__(self, c_in, c, classes, rng):
        super().__init__()
        self.c1 = nn.Conv2d(c_in, c, 3, padding=1)
        self.norm = rng.choice([nn.BatchNorm2d(c), nn.InstanceNorm2d(c, affine=True), nn.GroupNorm(2, c), nn.Identity()])
        self.act = rng.choice([nn.ReLU(), nn.PReLU(c)])
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.fc = nn.Linear(c * 4, classes)

    def forward(self, x, y):  # [B, c_in, H, H], [B]
        x = self.act(self.norm(self.c1(x)))
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return F.cross_entropy(self.fc(F.adaptive_avg_pool2d(x, 2).flatten(1)), y)


class RecurrentModel(nn.Module):
    def __init__(self, vocab, d, hidden, cell, layers, bidirectional, classes):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[cell](d, hidden, num_layers=layers, batch_first=True,
                                                                          bidirectional=bidirectional)
        width = hidden * (2 if bidirectional else 1)
        self.act, self.out = nn.PReLU(), nn.Linear(width, classes)

    def forward(self, ids, y):  # [B, T], [B]
        h, _ = self.rnn(self.emb(ids))  # [B, T, width]
        return F.cross_entropy(self.out(self.act(h[:, -1])), y)


class TorchTransformer(nn.Module):
    """torch's own encoder or decoder (its self- and cross-attention), sequence or batch first."""

    def __init__(self, vocab, d, heads, ffn, batch_first, norm_first, activation, decoder, layers):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.batch_first, self.decoder = batch_first, decoder
        kw = dict(dropout=0.0, batch_first=batch_first, norm_first=norm_first, activation=activation)
        if decoder:
            self.body = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, heads, ffn, **kw), layers)
        else:
            self.body = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, ffn, **kw), layers,
                                              enable_nested_tensor=False)

    def forward(self, ids, target):  # [B, T], [B, T]
        x = self.emb(ids) if self.batch_first else self.emb(ids).transpose(0, 1)  # [B, T, d] or [T, B, d]
        h = self.body(x, x) if self.decoder else self.body(x)
        h = h if self.batch_first else h.transpose(0, 1)  # [B, T, d]
        return F.cross_entropy(self.head(h).flatten(0, 1), target.flatten())


class BagModel(nn.Module):
    """nn.EmbeddingBag tables (sum, mean or max; a padding id; per-sample weights for a sum) over
    fixed-size bags, concatenated into an MLP."""

    def __init__(self, vocab, d, hidden, classes, tables, rng):
        super().__init__()
        self.modes = [rng.choice(["sum", "mean", "max"]) for _ in range(tables)]
        self.weighted = [mode == "sum" and rng.random() < 0.5 for mode in self.modes]
        self.bags = nn.ModuleList(nn.EmbeddingBag(vocab, d, mode=mode, padding_idx=rng.choice([None, 0]))
                                  for mode in self.modes)
        self.mlp = nn.Sequential(nn.Linear(tables * d, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, ids, weights, y):  # [B, L], [B, L], [B]
        h = torch.cat([bag(ids, per_sample_weights=weights if w else None) for bag, w in zip(self.bags, self.weighted)], 1)
        return F.cross_entropy(self.mlp(h), y)  # h: [B, tables * d]


# -- cases ---------------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class Case:
    seed: int
    model: nn.Module
    batches: list[tuple[torch.Tensor, ...]]
    world: int
    speeds: list[float]
    bandwidth: float
    family: str
    """hap, megatron, tp or dp-cp (hap.HAP); pp-exact (hap.Pipeline)."""
    ratios: list[float]
    """A baseline family's shares (megatron, tp)."""
    stages: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    loop: dict = dataclasses.field(default_factory=dict)
    """clip, accumulate, evaluate, shorter, reload: the training loop's habits."""
    dropout: float = 0.0
    """Every dropout's rate (nn.Dropout, attention's, a recurrent layer's between layers)."""
    text: str = ""


def _model(rng: random.Random, batch: int, kind: str | None):
    kind = kind or rng.choice(["token", "token", "vector", "conv", "torch", "recurrent"])
    if kind == "token":
        heads = rng.choice([1, 2, 3])
        d, vocab, seq = heads * rng.choice([4, 5, 6]), rng.choice([11, 17, 23, 32]), rng.choice([3, 5, 7])
        kinds = [rng.choice(["attn", "mlp", "glu"]) for _ in range(rng.randint(1, 3))]
        model = TokenModel(vocab, d, rng.choice([7, 12, 20]), heads, kinds, rng.random() < 0.5, rng)
        make = lambda: (torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)))  # noqa: E731
        text = f"token d{d} heads{heads} {'/'.join(kinds)}{' tied' if model.head.weight is model.emb.weight else ''}"
    elif kind == "vector":
        d_in, d, classes = rng.choice([5, 9, 16]), rng.choice([6, 10, 14]), rng.choice([3, 7])
        model = VectorModel(d_in, d, rng.choice([7, 11, 24]), classes, rng.randint(1, 3), rng)
        make = lambda: (torch.randn(batch, d_in), torch.randint(0, classes, (batch,)))  # noqa: E731
        text = f"vector d{d}{' batchnorm' if model.bn is not None else ''}"
    elif kind == "conv":
        c_in, c, classes, side = rng.choice([1, 3]), rng.choice([4, 6, 10]), rng.choice([3, 5]), rng.choice([4, 6, 8])
        model = ConvModel(c_in, c, classes, rng)
        make = lambda: (torch.randn(batch, c_in, side, side), torch.randint(0, classes, (batch,)))  # noqa: E731
        text = f"conv c{c} side{side} {type(model.norm).__name__} {type(model.act).__name__}"
    elif kind == "recurrent":
        cell, layers, bidirectional = rng.choice(["lstm", "gru", "rnn"]), rng.randint(1, 2), rng.random() < 0.4
        vocab, seq, classes = rng.choice([11, 17]), rng.choice([3, 5]), rng.choice([3, 5])
        model = RecurrentModel(vocab, rng.choice([4, 6]), rng.choice([3, 5]), cell, layers, bidirectional, classes)
        make = lambda: (torch.randint(0, vocab, (batch, seq)), torch.randint(0, classes, (batch,)))  # noqa: E731
        text = f"{cell} {layers} layers{' bidirectional' if bidirectional else ''}"
    elif kind == "bags":  # (only asked for: the default kinds' seeds stay as they were)
        vocab, size, classes = rng.choice([11, 17, 32]), rng.choice([1, 3, 4]), rng.choice([3, 5])
        model = BagModel(vocab, rng.choice([4, 6]), rng.choice([7, 12]), classes, rng.randint(1, 3), rng)
        make = lambda: (torch.randint(0, vocab, (batch, size)), torch.rand(batch, size),  # noqa: E731
                        torch.randint(0, classes, (batch,)))
        text = f"bags of {size} {'/'.join(m + ('-weighted' if w else '') for m, w in zip(model.modes, model.weighted))}"
    else:
        heads = rng.choice([1, 2, 3])
        d, vocab, seq = heads * rng.choice([4, 6]), rng.choice([11, 17]), rng.choice([3, 5])
        batch_first, norm_first, decoder = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.4
        model = TorchTransformer(vocab, d, heads, rng.choice([8, 14]), batch_first, norm_first,
                                 rng.choice(["relu", "gelu"]), decoder, rng.randint(1, 2))
        make = lambda: (torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)))  # noqa: E731
        text = (f"torch {'decoder' if decoder else 'encoder'} d{d} heads{heads} "
                f"{'batch' if batch_first else 'sequence'} first{' pre-norm' if norm_first else ''}")
    return model, [make() for _ in range(STEPS)], text


def make_case(seed: int, pipeline: bool = False, kind: str | None = None) -> Case:
    """The case of `seed` (the same in every process: the ranks and the reference build it alike)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch = rng.choice([5, 7, 9, 12, 13])
    model, batches, text = _model(rng, batch, kind)
    world = rng.choice([2, 3, 4] if pipeline else [2, 2, 3])
    # slow devices and links, so that compute and communication both matter to the planner
    speeds, bandwidth = [rng.uniform(1e5, 5e6) for _ in range(world)], 10 ** rng.uniform(5, 9)
    ratios = rng.choice({2: [[0.63, 0.37], [0.41, 0.59], [0.8, 0.2]], 3: [[0.5, 0.3, 0.2], [0.25, 0.45, 0.3]],
                         4: [[0.4, 0.3, 0.2, 0.1]]}[world])
    loop = {"clip": rng.random() < 0.4, "accumulate": rng.random() < 0.3, "evaluate": rng.random() < 0.3,
            "shorter": rng.random() < 0.3, "reload": rng.random() < 0.25}
    if pipeline:
        stages, micro = rng.randint(2, world), rng.choice([1, 2, 3, 4])
        schedule = rng.choice(["gpipe", "1f1b"])
        loop = {"clip": loop["clip"]}  # (the other habits are hap.HAP's)
        case = Case(seed=seed, model=model, batches=batches, world=world, speeds=speeds, bandwidth=bandwidth,
                    family="pp-exact", ratios=ratios, stages=stages, micro_batches=micro, schedule=schedule, loop=loop,
                    text=f"{text}, batch {batch}, {world} ranks, {stages} stages x {micro} micro-batches {schedule}")
    else:
        family = rng.choice(["hap", "hap", "megatron", "tp", "dp-cp"])
        case = Case(seed=seed, model=model, batches=batches, world=world, speeds=speeds, bandwidth=bandwidth,
                    family=family, ratios=ratios, loop=loop, text=f"{text}, batch {batch}, {world} ranks, {family}"
                    + ("" if family in ("hap", "dp-cp") else f" at {ratios}")
                    + "".join(f", {k}" for k, on in loop.items() if on))
    case.dropout = rng.choice([0.0, 0.0, 0.1, 0.3])  # (drawn last: the cases without it stay as they were)
    if case.dropout:
        _set_dropout(model, case.dropout)
        case.text += f", dropout {case.dropout}"
    return case


def _set_dropout(model: nn.Module, p: float) -> None:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
        elif isinstance(m, nn.MultiheadAttention):
            m.dropout = p  # (attention's own, on its weights)
        elif isinstance(m, nn.RNNBase) and m.num_layers > 1:
            m.dropout = p


def case_cluster(case: Case):
    from hap.cost.cluster import Cluster, Device, fits_from_network
    devices = tuple(Device(name=f"d{i}", flops=s, memory=2**34) for i, s in enumerate(case.speeds))
    return Cluster(name="fuzz", devices=devices, collectives=fits_from_network(case.world, case.bandwidth, 1e-5))


def _optimizer(params, adam: bool) -> torch.optim.Optimizer:
    if adam:  # eps 1e-3: see the module docstring
        return torch.optim.Adam(params, lr=0.01, eps=1e-3, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def _compare_state(got: dict, reference: nn.Module, failures: list[str]) -> None:
    for name, want in reference.state_dict().items():
        if name not in got:
            failures.append(f"the state lacks {name}")
        elif want.is_floating_point() and not torch.allclose(got[name], want, **TOL):
            failures.append(f"{name}: max abs diff {(got[name] - want).abs().max().item():.3g}")
        elif not want.is_floating_point() and not torch.equal(got[name], want):
            failures.append(f"{name}: differs")


# -- the ranks ------------------------------------------------------------------------------------

def train_hap(case: Case, adam: bool = False) -> list[str]:
    """hap.HAP under the case's plan and loop beside one device's model; what differed."""
    import hap
    from hap.capture import capture
    from hap.planner import baseline_plan

    cluster, reference, failures = case_cluster(case), copy.deepcopy(case.model), []
    graph = capture(case.model, case.batches[0])  # (given to hap.HAP: captured once)
    plan = None if case.family == "hap" else baseline_plan(
        graph, cluster, case.family, ratios=case.ratios if case.family != "dp-cp" else None)
    dmodel = hap.HAP(case.model, cluster, case.batches[0], plan=plan, graph=graph)
    pairs = [(dmodel, _optimizer(dmodel.parameters(), adam)), (reference, _optimizer(reference.parameters(), adam))]
    for step, batch in enumerate(case.batches):
        if case.loop["shorter"] and step == STEPS - 1:  # an epoch's last, smaller batch
            batch = tuple(t[: max(2, t.shape[0] - 3)] for t in batch)
        parts = [tuple(t[: len(t) // 2] for t in batch), tuple(t[len(t) // 2:] for t in batch)] \
            if case.loop["accumulate"] else [batch]
        seen, drawn = [], torch.get_rng_state()  # (loss, norm) of hap's model, then of the reference
        for model, opt in pairs:
            torch.set_rng_state(drawn)  # dropout: both draw from the same state, as one device would
            loss = 0.0
            for part in parts:
                part_loss = model(*part) / len(parts)
                part_loss.backward()
                loss = loss + part_loss.detach()
            norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5) if case.loop["clip"] else torch.zeros(())
            opt.step()
            opt.zero_grad()
            seen.append((loss, norm))
        (loss, norm), (want, want_norm) = seen
        if not torch.allclose(loss, want, **LOSS_TOL):
            failures.append(f"step {step}: loss {loss.item():.7g}, one device {want.item():.7g}")
        if not torch.allclose(norm, want_norm, rtol=1e-4):
            failures.append(f"step {step}: gradient norm {norm.item():.6g}, one device {want_norm.item():.6g}")
        if case.loop["evaluate"]:
            for model in (dmodel, reference):
                model.eval()
            with torch.no_grad():
                got, want = dmodel(*case.batches[0]), reference(*case.batches[0])
            for model in (dmodel, reference):
                model.train()
            if not torch.allclose(got, want, **LOSS_TOL):
                failures.append(f"step {step}: eval loss {got.item():.7g}, one device {want.item():.7g}")
        if case.loop["reload"] and step == 0:  # a state-dict round trip between steps
            opt = pairs[0][1]
            state, opt_state = {k: v.clone() for k, v in dmodel.state_dict().items()}, copy.deepcopy(opt.state_dict())
            dmodel.load_state_dict(state)
            opt.load_state_dict(opt_state)
    _compare_state(dmodel.full_state_dict(), reference, failures)
    return failures


def train_pipeline(case: Case, adam: bool = False) -> list[str]:
    """hap.Pipeline under pp-exact's plan of the case's stages beside one device's model."""
    import hap
    from hap.capture import capture
    from hap.planner import PlannerConfig
    from hap.planners import make_plan

    cluster, reference, failures = case_cluster(case), copy.deepcopy(case.model), []
    config = PlannerConfig(pipeline_stages=case.stages, micro_batches=case.micro_batches, schedule=case.schedule)
    graph = capture(case.model, case.batches[0])
    pipe = hap.Pipeline(case.model, cluster, case.batches[0], make_plan("pp-exact", graph, cluster, config), graph=graph)
    params = list(pipe.parameters())
    opt, ref_opt = (_optimizer(params, adam) if params else None), _optimizer(reference.parameters(), adam)
    for step, batch in enumerate(case.batches):
        drawn = torch.get_rng_state()
        loss = pipe.train_step(*batch)
        norm = pipe.clip_grad_norm_(0.5) if case.loop["clip"] else torch.zeros(())
        if opt is not None:
            opt.step()
            opt.zero_grad()
        torch.set_rng_state(drawn)  # dropout: the reference draws from the state the pipeline drew from
        want = reference(*batch)
        want.backward()
        want_norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5) if case.loop["clip"] else torch.zeros(())
        ref_opt.step()
        ref_opt.zero_grad()
        if not torch.allclose(loss, want.detach(), **LOSS_TOL):
            failures.append(f"step {step}: loss {loss.item():.7g}, one device {want.item():.7g}")
        if not torch.allclose(norm.to(want_norm.dtype), want_norm, rtol=1e-4):
            failures.append(f"step {step}: gradient norm {norm.item():.6g}, one device {want_norm.item():.6g}")
    _compare_state(pipe.full_state_dict(), reference, failures)
    return failures


def run_cases(rank: int, world: int, seeds: list[int], pipeline: bool, adam: bool, kind: str | None) -> dict:
    """A gloo worker: every case of `seeds` (all of `world` ranks) in turn; per seed its failures,
    or the one-line refusal (ValueError) its plan met."""
    out = {}
    for seed in seeds:
        case = make_case(seed, pipeline, kind)
        assert case.world == world, (seed, case.world, world)
        try:
            out[seed] = {"failures": (train_pipeline if pipeline else train_hap)(case, adam), "refused": None}
        except ValueError as e:  # hap's one-line refusals (a plan the case cannot run)
            out[seed] = {"failures": [], "refused": f"{type(e).__name__}: {e}"}
        except Exception:
            out[seed] = {"failures": [f"raised {traceback.format_exc(limit=-3)}"], "refused": None}
    return out


def main() -> int:
    from gloo import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0:20", help="FIRST:END (END excluded)")
    ap.add_argument("--pipeline", action="store_true", help="hap.Pipeline under pp-exact plans")
    ap.add_argument("--adam", action="store_true", help="Adam (eps 1e-3) instead of SGD with momentum")
    ap.add_argument("--kind", choices=["token", "vector", "conv", "torch", "recurrent", "bags"],
                    help="only this kind of model (bags: only when asked for)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    first, end = map(int, args.seeds.split(":"))
    failed = 0
    for seed in range(first, end):
        case = make_case(seed, args.pipeline, args.kind)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            reports = run_ranks(run_cases, case.world, Path(tmp), [seed], args.pipeline, args.adam, args.kind)
        failures = sorted({f for rep in reports for f in rep[str(seed)]["failures"]})
        refused = reports[0][str(seed)]["refused"]
        status = "FAIL" if failures else "refused" if refused else "ok"
        failed += bool(failures)
        print(f"[{seed}] {status} {time.perf_counter() - t0:.1f}s {case.text}"
              + (f": {refused}" if refused and not failures else "") + "".join(f"\n    {f}" for f in failures[:8]), flush=True)
    print(f"{end - first} cases, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
