"""Distributed training equals single-device training, model by model, on real gloo ranks.

Every built-in model at its small size (vit, vgg19, bert, bert-moe; dropout off: dropout is
tested on its own) and four models built only from torch.nn library modules
(nn.TransformerEncoder, a Conv2d/MaxPool2d/Linear CNN, nn.MultiheadAttention cross-attention,
nn.EmbeddingBag tables)
train on 2 ranks (ratios 0.5/0.5 and 0.8/0.2) and on 3 ranks (1/3 each and 0.55/0.3/0.15)
under programs of five families that force different collectives (see PROGRAMS and
`restriction`), run on hap's Executor, and under the plan hap.plan makes for a skewed
cluster, run through hap.HAP with the load balancer's ratios. In every case the loss and
every parameter's gradient (reassembled whole with Executor.whole) at every step, and the
parameters after STEPS optimizer steps (SGD with momentum, or Adam), equal one device's.

Each case records which collective kinds its program plans (moves, their backward duals, the
gradient all-reduce) and which ones the ranks really ran (torch.distributed calls counted
during the training steps, less hap.HAP's own all-reduce of the loss); a kind planned but
never run is a failure, and `test_every_collective_kind_is_used` asserts that together the
cases use every kind, so the file cannot silently stop covering one.

One spawn per world size runs all cases (the ranks share the program searches); a worker
reports failures instead of asserting, so that every rank finishes its collectives and all
failures are seen at once.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from gloo import run_ranks

import hap
from hap.capture import capture
from hap.cost.cluster import Cluster, Device, fits_from_network
from hap.cost.model import CostModel
from hap.models import MODELS, resolve
from hap.placement import R, S
from hap.planner import _dp, _params_only, _tp, segment_graph
from hap.rules import strategy_table
from hap.rules.nn import EMBEDDING_BAG
from hap.rules.units import ShardClasses
from hap.runtime.collectives import Comm, all_reduce
from hap.runtime.executor import Executor, leaf_values
from hap.search.astar import Restriction, synthesize
from hap.search.moves import AG_GROUPED, AG_PADDED

STEPS = 2
BATCH = 12
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
TOL = dict(rtol=1e-4, atol=1e-5)

# The collective kinds (the names moves use) and the torch.distributed call each one makes.
KINDS = {AG_PADDED: "all_gather", AG_GROUPED: "broadcast", "reduce_scatter": "reduce_scatter",
         "all_to_all": "all_to_all_single", "all_reduce": "all_reduce"}


# -- models built from torch.nn library modules ---------------------------------------------------

class EncoderClassifier(nn.Module):
    """Token classifier over nn.TransformerEncoder (post-LN layers, ReLU FFN)."""

    def __init__(self, vocab=50, d=32, heads=4, ffn=64, layers=2, classes=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens, labels):
        h = self.encoder(self.emb(tokens))  # [B, S, d]
        return F.cross_entropy(self.head(h.mean(1)), labels)

    @staticmethod
    def inputs(batch, gen):
        return torch.randint(0, 50, (batch, 12), generator=gen), torch.randint(0, 5, (batch,), generator=gen)


class SmallCNN(nn.Module):
    """Conv2d-ReLU-MaxPool2d twice, then a two-layer nn.Linear classifier (no batch norm)."""

    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x, labels):
        return F.cross_entropy(self.classifier(self.features(x)), labels)

    @staticmethod
    def inputs(batch, gen):
        return torch.randn(batch, 3, 16, 16, generator=gen), torch.randint(0, 10, (batch,), generator=gen)


class CrossAttention(nn.Module):
    """nn.MultiheadAttention from 7 queries to 9 keys/values of other widths, nn.LayerNorm, a GELU MLP."""

    def __init__(self, d=24, heads=3, classes=4):
        super().__init__()
        self.q = nn.Linear(6, d)
        self.kv = nn.Linear(10, d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, classes))

    def forward(self, x, ctx, labels):
        q, kv = self.q(x), self.kv(ctx)
        h, _ = self.attn(q, kv, kv, need_weights=False)  # [B, 7, d]
        return F.cross_entropy(self.mlp(self.norm(h + q)).mean(1), labels)

    @staticmethod
    def inputs(batch, gen):
        return (torch.randn(batch, 7, 6, generator=gen), torch.randn(batch, 9, 10, generator=gen),
                torch.randint(0, 4, (batch,), generator=gen))


class BagRecommender(nn.Module):
    """A recommendation model: nn.EmbeddingBag tables (sum with a padding id, max, mean) over fixed-size
    bags of ids, dense features through nn.Linear, an MLP over both, a click loss."""

    def __init__(self, vocab=40, d=8):
        super().__init__()
        self.items = nn.EmbeddingBag(vocab, d, mode="sum", padding_idx=0)
        self.tags = nn.EmbeddingBag(vocab, d, mode="max")
        self.words = nn.EmbeddingBag(vocab, d, mode="mean")
        self.dense = nn.Linear(5, d)
        self.mlp = nn.Sequential(nn.Linear(4 * d, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, items, tags, dense, clicks):
        h = torch.cat([self.items(items), self.tags(tags), self.words(tags), self.dense(dense)], 1)  # [B, 4d]
        return F.binary_cross_entropy_with_logits(self.mlp(h).squeeze(1), clicks)

    @staticmethod
    def inputs(batch, gen):
        return (torch.randint(0, 40, (batch, 6), generator=gen), torch.randint(0, 40, (batch, 3), generator=gen),
                torch.randn(batch, 5, generator=gen), torch.randint(0, 2, (batch,), generator=gen).float())


LIBRARY = {"nn-transformer": EncoderClassifier, "nn-cnn": SmallCNN, "nn-cross-attention": CrossAttention,
           "nn-bags": BagRecommender}
BUILT_IN = ["vit", "vgg19", "bert", "bert-moe", "ncf"]
# SGD with momentum, or Adam where no gradient is zero in theory: Adam turns the rounding noise
# of such a gradient (attention's key bias) into full-size steps (see test_module.py).
ADAM = {"vgg19", "nn-cnn"}


def build(name: str, world: int):
    """The model (seeded, training mode, dropout off) and STEPS batches."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name in LIBRARY:
        cls = LIBRARY[name]
        return cls().train(), [cls.inputs(BATCH, gen) for _ in range(STEPS)]
    info, cfg, _ = resolve(name, scale="small", devices=world)
    if hasattr(cfg, "dropout"):
        cfg = dataclasses.replace(cfg, dropout=0.0)
    return info.model(cfg).train(), [info.example_inputs(cfg, BATCH, gen) for _ in range(STEPS)]


# ncf-sparse's tables have sparse gradients, which only replication computes (no restricted
# family here could shard them); hap.HAP trains it like one device in test_sync_runtime.py.
assert sorted(BUILT_IN + ["ncf-sparse"]) == sorted(MODELS), "a built-in model is missing here"


def optimizer(name, params):
    if name in ADAM:
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


# -- programs ------------------------------------------------------------------------------------

def restriction(family: str, graph) -> Restriction:
    """dp: parameters replicated (data parallel, the baseline's fallback where activations must
    communicate); tp: data inputs whole (Megatron-like); sharded: every weight matrix sharded;
    -batch: and the data split on the batch, so activations change layout (all-to-all);
    -grouped: uneven shards gathered by broadcasts only, never by the padded all-gather."""
    if family == "dp":
        return Restriction(name=family, allow_load=_params_only(_dp(graph)))
    if family == "tp":
        return _tp()
    batch = "-batch" in family
    # Weights first used by a node that also reads a data input stay free under -batch: with the
    # input already split on the batch no strategy could shard them too.
    first = {t for nd in graph.nodes if set(nd.inputs) & set(graph.inputs) for t in nd.inputs}
    big = {n for n in graph.params
           if len(graph.tensors[n].shape) >= 2 and graph.tensors[n].numel > 64 and not (batch and n in first)}

    def allow(kind, tensor, p):
        if kind == "param" and tensor in big:
            return p.is_shard
        if kind == "input" and batch:
            return p == S(0)
        return True

    grouped = family.endswith("-grouped")
    return Restriction(name=family, allow_load=allow, allow_move=(lambda mv: mv.fwd != AG_PADDED) if grouped else (lambda mv: True))


# (program family, ratios) per world; "hap" is hap.plan's own plan for the skewed CLUSTER, run
# through hap.HAP with the ratios the load balancer chose.
EVEN = {2: (0.5, 0.5), 3: (1 / 3, 1 / 3, 1 / 3)}
SKEWED = {2: (0.8, 0.2), 3: (0.55, 0.3, 0.15)}
IDLE = {2: (1.0, 0.0), 3: (0.6, 0.4, 0.0)}  # the last rank holds empty shards and computes nothing
# two segments with other ratios each: every live shard is re-split (all-to-all) where they meet
TWO_SEGMENTS = {2: ((0.7, 0.3), (0.35, 0.65)), 3: ((0.5, 0.3, 0.2), (0.2, 0.3, 0.5))}
RATIOS = {"even": EVEN, "skewed": SKEWED, "idle": IDLE, "two-segments": TWO_SEGMENTS}
PROGRAMS = [("dp", "skewed"), ("tp", "even"), ("sharded", "even"), ("sharded-grouped", "skewed"),
            ("sharded-batch-grouped", "skewed"), ("sharded", "idle"), ("dp", "two-segments"),
            ("sharded-batch-grouped", "two-segments"), ("hap", "planned")]


def segmentation(which, graph, world):
    """(segment of every node, ratios per segment) of a case."""
    if which == "two-segments":
        return segment_graph(graph, 2), [list(r) for r in TWO_SEGMENTS[world]]
    return [0] * len(graph.nodes), [list(RATIOS[which][world])]
CLUSTER_SPEEDS = {2: (3e9, 1e9), 3: (2e9, 2e9, 1e9)}
MODEL_NAMES = BUILT_IN + list(LIBRARY)


def cluster(speeds, bandwidth=1e11) -> Cluster:
    devices = tuple(Device(name=f"d{i}", flops=s, memory=2**34) for i, s in enumerate(speeds))
    return Cluster(name="test", devices=devices, collectives=fits_from_network(len(speeds), bandwidth, 1e-5))


# -- what the ranks really run -------------------------------------------------------------------

class Tally:
    """Counts the torch.distributed collectives called while on (in this process only)."""

    def __init__(self):
        self.on = False
        self.calls: dict[str, int] = {}
        for kind, fn in KINDS.items():
            setattr(dist, fn, self._wrap(kind, getattr(dist, fn)))

    def _wrap(self, kind, real):
        def counted(*args, **kwargs):
            if self.on:
                self.calls[kind] = self.calls.get(kind, 0) + 1
            return real(*args, **kwargs)

        return counted

    def start(self):
        self.calls, self.on = {}, True

    def stop(self) -> dict[str, int]:
        self.on = False
        return self.calls


def planned_kinds(program, ex: Executor) -> set[str]:
    kinds = {k for st in program for ms in st.moves for k in (ms.move.fwd, ms.move.bwd) if k}
    if ex.comm.world > 1 and any(ex.stored[n][0] == R and p.requires_grad for n, p in ex.params.items()):
        kinds.add("all_reduce")  # the gradient sync of parameters kept whole
    return kinds


# -- the worker ----------------------------------------------------------------------------------

def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"max abs diff {(a - b).abs().max().item():.3g} (max abs ref {b.abs().max().item():.3g})"


def check_training(what, model_name, model, batches, ex: Executor, params, step_fn, failures):
    """Train a copy of `model` on one device and the distributed program side by side; compare
    the loss and every whole gradient at every step and the whole parameters at the end.
    step_fn(batch) runs the distributed forward and backward and returns the global loss and the
    kinds of collective the program ran. Returns those kinds (all steps) and the trained copy."""
    graph = ex.graph
    reference = copy.deepcopy(model)
    ref_params = dict(reference.named_parameters())
    ref_opt = optimizer(model_name, reference.parameters())
    opt = optimizer(model_name, params.values())
    if len(params) != len(ref_params):
        failures.append(f"{what}: {len(params)} of {len(ref_params)} parameters kept")
    ran: set[str] = set()
    for step, batch in enumerate(batches):
        ref_loss = reference(*batch)
        ref_loss.backward()
        loss, kinds = step_fn(batch)
        ran |= kinds
        if not torch.allclose(loss, ref_loss.detach(), **LOSS_TOL):
            failures.append(f"{what} step {step}: loss {loss.item():.7g} vs {ref_loss.item():.7g}")
        for name, p in params.items():
            target = graph.tensors[name].target
            ref = ref_params[target].grad
            if p.grad is None:
                failures.append(f"{what} step {step}: no gradient for {target}")
                ex.whole(name, torch.zeros_like(p))  # keep the collectives in step with the other ranks
                continue
            got = ex.whole(name, p.grad)
            if not torch.allclose(got, ref, **TOL):
                failures.append(f"{what} step {step}: gradient of {target}: {_diff(got, ref)}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for name, p in params.items():
        target = graph.tensors[name].target
        got, ref = ex.whole(name, p.detach()), ref_params[target].detach()
        if not torch.allclose(got, ref, **TOL):
            failures.append(f"{what}: {target} after {STEPS} steps: {_diff(got, ref)}")
    return ran, reference


def make_program(family, which, graph, strategies, classes, world):
    """A program (list of Steps) of the family under its ratios, or for "hap" the Plan hap.plan
    makes for the skewed CLUSTER; an error's text where there is none."""
    try:
        if family == "hap":
            # Without the baselines as candidates (the restricted cases run those families): hap's
            # own Q/B alternation, and planning stays short.
            return hap.plan(graph, cluster(CLUSTER_SPEEDS[world], bandwidth=1e9), hap.PlannerConfig(baselines=False))
        seg, ratios = segmentation(which, graph, world)
        # compute proportional to the ratios (an idle rank: a slow device, not a zero-speed one)
        cost = CostModel(graph, cluster([max(r, 0.1) * 3e9 for r in ratios[0]]), classes)
        return synthesize(graph, strategies, cost, seg, ratios, restriction(family, graph),
                          width=24, width_after=8.0).program
    except Exception as e:  # a family with no program for a model is a failure too
        return f"{type(e).__name__}: {e}"


def _searcher(i: int, family: str, world: int) -> int:
    return world - 1 if family == "hap" else i % (world - 1)


def worker(rank, world):
    comm = Comm.default()
    tally = Tally()
    report = {"failures": [], "cases": [], "seconds": {}}
    for model_name in MODEL_NAMES:
        t0 = time.perf_counter()
        model, batches = build(model_name, world)
        graph = capture(model, tuple(batches[0]))
        strategies = strategy_table(graph)
        classes = ShardClasses(graph, enumerate(strategies))
        # The ranks share the searches (each is deterministic) and swap the programs: the last
        # rank plans (the longest job), the others synthesize the restricted programs.
        mine = {i: make_program(family, which, graph, strategies, classes, world)
                for i, (family, which) in enumerate(PROGRAMS) if _searcher(i, family, world) == rank}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        programs = {i: prog for part in gathered for i, prog in part.items()}
        report["seconds"][f"{model_name} capture and search"] = time.perf_counter() - t0
        for i, (family, which) in enumerate(PROGRAMS):
            what = f"{model_name} {family} {which}"
            t0 = time.perf_counter()
            if isinstance(programs[i], str):
                report["failures"].append(f"{what}: no program: {programs[i]}")
                continue
            if family == "hap":
                ran, planned, ratios, loads = run_hap(what, model_name, model, batches, graph, programs[i], world, comm,
                                                      tally, report["failures"])
            else:
                seg, ratios = segmentation(which, graph, world)
                ran, planned, loads = run_program(what, model_name, model, batches, graph, programs[i], classes, seg,
                                                  ratios, comm, tally, report["failures"])
                ratios = ratios[0]
            missing = planned - ran
            if missing:
                report["failures"].append(f"{what}: the program plans {sorted(missing)} but the ranks never ran it")
            steps = programs[i] if isinstance(programs[i], list) else programs[i].steps(graph)
            moves = sorted({ms.move.name for st in steps for ms in st.moves})
            bags = sorted({st.strategy.name for st in steps if graph.nodes[st.node].op in EMBEDDING_BAG})
            report["cases"].append({"model": model_name, "program": family, "which": which, "ratios": list(ratios),
                                    "moves": moves, "bags": bags,
                                    "planned": sorted(planned), "ran": sorted(ran), "param_loads": loads})
            report["seconds"][what] = time.perf_counter() - t0
    return report


def _param_loads(program, graph) -> list[str]:
    return sorted({str(ld.placement) for st in program for ld in st.loads if ld.tensor in graph.params})


def run_program(what, model_name, model, batches, graph, program, classes, seg, ratios, comm, tally, failures):
    """The program on hap's Executor (ratios per segment), as test_runtime.py runs it."""
    ex = Executor(graph, program, classes, seg, ratios, comm)
    params = ex.shard_parameters(leaf_values(graph, model, batches[0]))

    def step_fn(batch):
        tally.start()
        part = ex.forward(leaf_values(graph, model, batch))  # this rank's part of the loss
        part.backward()
        ex.sync_gradients()
        kinds = set(tally.stop())
        return all_reduce(part.detach(), comm), kinds

    ran, _ = check_training(what, model_name, model, batches, ex, params, step_fn, failures)
    return ran, planned_kinds(program, ex), _param_loads(program, graph)


def run_hap(what, model_name, model, batches, graph, plan, world, comm, tally, failures):
    """hap.HAP given hap.plan's plan (and the graph it was made for: not captured again): the
    loss it returns is the global one, whole parameters' gradients are synced by its hooks,
    full_parameters() reassembles the trained model."""
    dmodel = hap.HAP(copy.deepcopy(model), cluster(CLUSTER_SPEEDS[world], bandwidth=1e9), batches[0], plan=plan, comm=comm,
                     graph=graph)
    ex = dmodel.executor

    def step_fn(batch):
        tally.start()
        loss = dmodel(*batch)
        loss.backward()
        calls = tally.stop()
        calls["all_reduce"] = calls.get("all_reduce", 0) - 1  # hap.HAP's of the loss it returns: not the program's
        return loss.detach(), {k for k, n in calls.items() if n > 0}

    ran, reference = check_training(what, model_name, model, batches, ex, dict(dmodel.shards.items()), step_fn, failures)
    full = dmodel.full_parameters()
    for name, ref in reference.named_parameters():
        if name not in full:
            failures.append(f"{what}: full_parameters() lacks {name}")
        elif not torch.allclose(full[name], ref.detach(), **TOL):
            failures.append(f"{what}: full_parameters()[{name!r}]: {_diff(full[name], ref.detach())}")
    program = dmodel.plan.steps(dmodel.graph)
    return ran, planned_kinds(program, ex), dmodel.plan.ratios[0], _param_loads(program, dmodel.graph)


# -- the tests -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """world -> the ranks' reports (one spawn per world size, shared by the tests)."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_ranks(worker, world, tmp_path_factory.mktemp(f"world{world}"))
        return cache[world]

    return get


def used(case) -> set[str]:
    """Kinds the program planned and the ranks ran."""
    return set(case["planned"]) & set(case["ran"])


@pytest.mark.parametrize("world", [2, 3])
def test_training_equals_one_device(world, runs):
    reports = runs(world)
    failures = [f"rank {r}: {f}" for r, rep in enumerate(reports) for f in rep["failures"]]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    cases = reports[0]["cases"]
    assert [(c["model"], c["program"], c["which"]) for c in cases] == [(m, f, w) for m in MODEL_NAMES for f, w in PROGRAMS]
    for c in cases:
        assert math.isclose(sum(c["ratios"]), 1.0, rel_tol=1e-9)
        if c["program"].startswith("sharded"):
            assert any(p.startswith("S(") for p in c["param_loads"]), c  # weights really sharded
    # Two segments re-split their shards where they meet (where a shard is live there).
    resplit = [c["model"] for c in cases if c["which"] == "two-segments" and "rebalance" in c["moves"]]
    assert len(resplit) >= 3, resplit
    # The planner's own plans are skewed like the cluster (the slowest device gets least).
    for c in cases:
        if c["program"] == "hap":
            assert c["ratios"][-1] < c["ratios"][0], c


def test_embedding_bags_split_each_way(runs):
    """The nn-bags cases run nn.EmbeddingBag split by its bags (with the batch), its features
    and its vocabulary (partial sums), not only whole."""
    ran = {name for world in (2, 3) for c in runs(world)[0]["cases"] if c["model"] == "nn-bags" for name in c["bags"]}
    assert {"bags", "hidden", "vocab"} <= ran, ran


def test_every_collective_kind_is_used(runs):
    by_kind = {k: [] for k in KINDS}
    for world in (2, 3):
        for c in runs(world)[0]["cases"]:
            for k in used(c):
                by_kind[k].append(f"{c['model']} {c['program']} (world {world})")
    for k, cases in by_kind.items():  # shown with pytest -rP
        print(f"{k}: {len(cases)} cases, e.g. {', '.join(cases[:3])}")
    assert all(by_kind.values()), {k: len(v) for k, v in by_kind.items()}
