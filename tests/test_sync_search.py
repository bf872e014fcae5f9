"""AutoSync's parts without a process group: strategies as plan entries, the knowledge
constraints, candidate selection, the two prices, the learned simulators and the baselines."""

import dataclasses
import json
import random
import re
import zlib

import pytest
import torch
import torch.nn as nn

from hap.capture import capture
from hap.cost.cluster import cluster_from_dict
from hap.cost.model import CostModel
from hap.plan import SyncEntry, check_sync
from hap.planner import baseline_plan
from hap.rules import strategy_table
from hap.rules.units import ShardClasses
from hap.search.program import replay
from hap.sync import AutoSyncConfig, autosync, baselines, price
from hap.sync.sampler import SpaceConfig, _balance_servers, neighbour, sample, similarity
from hap.sync.select import select
from hap.sync.simulators import (FEATURES, MARGIN, Domain, Padded, Sample, Simulator, features, pairs,
                                 ranking_accuracy)
from hap.sync.strategy import PartSync, SyncStrategy, Variable, Variables, VarSync, with_strategy

torch.set_num_threads(1)
AR, PS = "all_reduce", "ps"


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 48)
        self.fc3 = nn.Linear(48, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x))))).pow(2).mean()


def two_machines(nic_a="1Gbps", nic_b="4Gbps"):
    """Machine a: device 0; machine b: devices 1 and 2."""
    fast = {"bandwidth": "10GB/s", "latency": "5us"}
    return cluster_from_dict({
        "name": "t", "algorithm": "ring",
        "devices": [{"name": "gpu", "count": 3, "flops": 1e12, "memory": "16GiB"}],
        "machines": [{"name": "a", "devices": 1, "intra": fast, "nic": {"bandwidth": nic_a, "latency": "20us"}},
                     {"name": "b", "devices": 2, "intra": fast, "nic": {"bandwidth": nic_b, "latency": "20us"}}]})


@pytest.fixture(scope="module")
def setting():
    cl = two_machines()
    graph = capture(MLP(), (torch.randn(64, 32),))
    plan = baseline_plan(graph, cl, "dp-ev")
    cost = CostModel(graph, cl, ShardClasses(graph, enumerate(strategy_table(graph))))
    est = replay(plan.steps(graph), cost, [0] * len(graph.nodes), plan.ratios)
    variables = Variables.of(plan, graph, [m.devices for m in cl.topology.machines])
    return cl, graph, plan, cost, est, variables


def uniform(variables, part: PartSync, parts: int = 1) -> SyncStrategy:
    return SyncStrategy(tuple(VarSync(v.param, (part,) * min(parts, v.rows)) for v in variables.vars))


# -- strategies and their plan entries --------------------------------------------------------------

def test_variables_in_backprop_order(setting):
    *_, variables = setting
    assert [v.target for v in variables.vars] == ["fc3.bias", "fc3.weight", "fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"] \
        or [v.first_use for v in variables.vars] == sorted((v.first_use for v in variables.vars), reverse=True)
    assert variables.machines == ((0,), (1, 2))


def test_entries_split_parts_and_order_buckets_by_readiness(setting):
    *_, variables = setting
    fc1 = next(v for v in variables.vars if v.target == "fc1.weight")  # 64 rows
    strategy = SyncStrategy(tuple(
        VarSync(v.param, (PartSync(kind=PS, server=1), PartSync(kind=PS, server=2), PartSync(kind=AR, group=1)))
        if v is fc1 else VarSync(v.param, (PartSync(kind=AR, group=0),)) for v in variables.vars))
    entries = variables.entries(strategy)
    parts = [e for e in entries if e.param == fc1.param]
    assert sorted(e.rows for e in parts) == [(0, 22), (22, 21), (43, 21)]  # as even as 64 rows allow
    # group 0 holds the last layers' gradients (first to arrive): it launches first; fc1's parts last
    assert entries[0].bucket == 0 and all(e.bucket == 0 for e in entries if e.param != fc1.param)
    assert len({e.bucket for e in parts}) == 3


def test_a_pipeline_plan_takes_no_strategy(setting):
    """with_strategy wrote a parameter-server strategy into a pipeline plan without a word;
    hap.Pipeline refused it only once its ranks had started."""
    from hap.planner import PlannerConfig
    from hap.planners import make_plan
    from hap.sync import with_strategy

    cl, graph, *_ = setting
    piped = make_plan("pp-exact", graph, cl, PlannerConfig(pipeline_stages=2))
    variables = Variables.of(piped, graph, [m.devices for m in cl.topology.machines])
    strategy = uniform(variables, PartSync(kind=PS, server=1))
    with pytest.raises(ValueError, match=r"^synchronization strategies are for plans of one stage; this plan is a "
                                         r"pipeline of 2 stages, which all-reduce every gradient whole$"):
        with_strategy(piped, variables, strategy)


def test_strategy_round_trips_and_prints(setting):
    *_, variables = setting
    s = uniform(variables, PartSync(kind=PS, server=2, hierarchical=True), parts=2)
    assert SyncStrategy.from_json(s.to_json()) == s
    assert "PS(2,h) | PS(2,h)" in str(s)
    with pytest.raises(ValueError, match="malformed sync strategy"):
        SyncStrategy.from_json([{"param": "x"}])


@pytest.mark.parametrize("entry,message", [
    (dict(strategy=PS, server=5), "parameter server 5 is not one of its devices"),
    (dict(strategy=PS, server=0, compressor="fp16"), "compressor fp16 runs with all_reduce only"),
    (dict(devices=(0, 0, 1)), "are not distinct devices"),
    (dict(low_rank=0, compressor="powersgd"), "PowerSGD rank must be at least 1"),
    (dict(server=1), "a server is named but the strategy is all_reduce"),
    (dict(strategy="allreduce"), "unknown strategy 'allreduce'; choose 'all_reduce', 'ps'"),  # it ran as all_reduce
    (dict(compressor="int8"), "unknown compressor 'int8'; choose 'none', 'fp16', 'powersgd'"),
    (dict(low_rank="2", compressor="powersgd"), "PowerSGD rank must be an integer, got '2'"),
    (dict(strategy=PS, server="1"), "parameter server must be a device number, got '1'"),
    (dict(rows=(0,)), r"rows must be \[start, length\], got \[0\]"),
    (dict(rows=(0, True)), r"rows must be \[start, length\], got \[0, True\]"),  # (it was taken as [0, 1])
    # the rooted reduction sent the gradient uncompressed, priced compressed
    (dict(compressor="powersgd", hierarchical=True), "compressor powersgd runs with a flat all_reduce only"),
    (dict(hierarchical="false"), "hierarchical must be true or false, got 'false'"),  # it ran hierarchical
    (dict(sparse="false"), "sparse must be true or false, got 'false'"),
])
def test_bad_sync_entries_get_one_line(entry, message):
    e = SyncEntry(**{"param": "w", "bucket": 0, "devices": (0, 1, 2), **entry})
    with pytest.raises(ValueError, match=message) as err:
        check_sync([e], 3)
    assert "\n" not in str(err.value)


def test_parts_must_cover_once_and_buckets_agree():
    base = dict(param="w", devices=(0, 1))
    with pytest.raises(ValueError, match="do not cover dim 0 once"):
        check_sync([SyncEntry(bucket=0, rows=(0, 4), **base), SyncEntry(bucket=1, rows=(3, 4), **base)], 2)
    with pytest.raises(ValueError, match="^sync of w: the whole parameter is listed 2 times$"):  # (it spoke of parts)
        check_sync([SyncEntry(bucket=0, **base), SyncEntry(bucket=1, **base)], 2)
    with pytest.raises(ValueError, match="synchronized differently"):
        check_sync([SyncEntry(bucket=0, **base), SyncEntry(bucket=0, param="v", devices=(0, 1), strategy=PS, server=0)], 2)


# -- the knowledge constraints ----------------------------------------------------------------------

def test_load_balance_gives_servers_load_by_bandwidth():
    # 42 equal parameter-server parts over cards of bandwidth 1 : 3 : 3. Algorithm 1's target is
    # the load so far split by bandwidth share, so the draws track 1/7, 3/7, 3/7 of the bytes
    # (an even draw would give each 1/3).
    variables = Variables(tuple(Variable(param=f"p{i}", target=f"p{i}", shape=(8, 128), nbytes=4096, first_use=i, sparse=False)
                                for i in range(42)), devices=3)
    rng = random.Random(0)
    load = [0.0, 0.0, 0.0]
    for _ in range(50):
        drafts = [(i, [{"kind": PS, "hierarchical": False}]) for i in range(42)]
        _balance_servers(variables, drafts, [1.0, 3.0, 3.0], rng)
        for i, draft in drafts:
            load[draft[0]["server"]] += variables.vars[i].nbytes
    share = [x / sum(load) for x in load]
    assert share[0] == pytest.approx(1 / 7, abs=0.03) and share[1] == pytest.approx(3 / 7, abs=0.04)


def test_sampled_strategies_mix_servers_and_all_reduces(setting):
    *_, variables = setting
    rng = random.Random(0)
    kinds = set()
    for _ in range(60):
        s = sample(variables, [1.0, 3.0, 3.0], rng, SpaceConfig(part_bytes=256, max_parts=4))
        for vs in s.vars:
            for p in vs.parts:
                kinds.add(p.kind)
                assert p.server in range(3)
    assert kinds == {PS, AR}


def test_adjacent_merge_fills_groups_in_backprop_order(setting):
    *_, variables = setting
    rng = random.Random(1)
    seen_groups = set()
    for _ in range(100):
        s = sample(variables, [1.0, 1.0, 1.0], rng, SpaceConfig(max_groups=3))
        groups = [p.group for vs in s.vars for p in vs.parts if p.kind == AR]
        assert groups == sorted(groups) and (not groups or groups[0] == 0)  # filled one after another
        seen_groups.add(max(groups, default=0))
    assert seen_groups >= {0, 1}


def test_sampler_draws_uniform_and_compressed_strategies_only_when_asked(setting):
    *_, variables = setting
    rng = random.Random(2)
    strategies = [sample(variables, [1.0, 1.0, 1.0], rng) for _ in range(200)]
    assert all(s.exact for s in strategies)
    kinds = [{(p.kind, p.hierarchical) for vs in s.vars for p in vs.parts} for s in strategies]
    assert {(AR, True)} in kinds and {(PS, False)} in kinds  # all-hierarchical all-reduce, all plain servers
    assert any(not s.exact for s in (sample(variables, [1.0] * 3, rng, SpaceConfig(compress=True)) for _ in range(50)))


def test_neighbours_change_one_parameter_and_stay_valid(setting):
    *_, cost, est, variables = setting
    rng = random.Random(3)
    space = SpaceConfig(part_bytes=256, max_parts=4)
    moved = set()
    for _ in range(200):
        parent = sample(variables, [1.0, 3.0, 3.0], rng, space)
        child = neighbour(parent, variables, [1.0, 3.0, 3.0], rng, space)
        changed = [i for i, (a, b) in enumerate(zip(parent.vars, child.vars)) if a != b]
        assert len(changed) <= 1 and [v.param for v in child.vars] == [v.param for v in parent.vars]
        if changed and len(parent.vars[changed[0]].parts) == len(child.vars[changed[0]].parts):
            diff = [(a, b) for a, b in zip(parent.vars[changed[0]].parts, child.vars[changed[0]].parts) if a != b]
            if len(diff) == 1:  # one part changed (else the parameter was re-drawn)
                a, b = diff[0]
                moved |= {f for f in ("kind", "server", "group", "hierarchical") if getattr(a, f) != getattr(b, f)}
        check_sync(variables.entries(child), 3)
        assert price.overlapped(variables.entries(child), variables, cost, est) > 0
    assert moved == {"kind", "server", "group", "hierarchical"}  # every kind of move was made


def test_similarity_counts_shared_choices(setting):
    *_, variables = setting
    a = uniform(variables, PartSync(kind=AR))
    assert similarity(a, a) == 1.0
    b = uniform(variables, PartSync(kind=PS, server=1))
    assert 0 < similarity(a, b) < 1  # same parts count, group; other kind, server


# -- Eq. 11 ----------------------------------------------------------------------------------------

def test_selection_trades_predicted_time_for_diversity():
    """Candidates 0 and 1 are alike (similarity 1) and fast, 2 is unlike both and 20% slower.
    Without the similarity term the two fastest win; with alpha = 1 the second alike one costs
    1.01 + 2 * 1 against 1.2 + 2 * 0: candidate 2 is taken."""
    sims = {(0, 1): 1.0, (1, 0): 1.0}
    sim = lambda i, j: sims.get((i, j), 0.0)  # noqa: E731
    cands = [None] * 3
    assert select(cands, [1.0, 1.01, 1.2], 2, 0.0, sim) == [0, 1]
    assert select(cands, [1.0, 1.01, 1.2], 2, 1.0, sim) == [0, 2]
    with pytest.raises(ValueError, match="3 candidates but 2 predictions"):
        select(cands, [1.0, 2.0], 1, 0.1, sim)


# -- prices ----------------------------------------------------------------------------------------

def test_hap_price_of_the_plans_own_sync_is_its_estimate(setting):
    cl, graph, plan, cost, est, variables = setting
    assert price.overlapped(plan.sync, variables, cost, est) == pytest.approx(est.seconds, rel=1e-9)


def test_hierarchy_halves_what_crosses_the_slow_card(setting):
    """Ring over 3 devices through device 0's 1 Gbps card: 2 * 2/3 of the bytes cross it; the
    hierarchical all-reduce sends 2 * 1/2 of them between the two machines' leaders."""
    cl, graph, plan, cost, est, variables = setting
    flat = variables.entries(uniform(variables, PartSync(kind=AR)))
    hier = variables.entries(uniform(variables, PartSync(kind=AR, hierarchical=True)))
    n = sum(v.nbytes for v in variables.vars)
    bw = 1e9 / 8
    (first_flat, _), = [price.phases(b, variables, cost) for b in price.buckets(flat, variables)]
    b_hier, = price.buckets(hier, variables)
    inside, rest = price.phases(b_hier, variables, cost)
    assert first_flat == pytest.approx(4 / 3 * n / bw + 20e-6 + 4 * 20e-6, rel=1e-6)
    assert rest - inside < first_flat  # the leaders' all-reduce and the broadcast back beat the flat ring
    compute = 1.0  # compute-bound: Eq. 1 says the sync does not matter
    assert price.analytic(flat, variables, cost, compute) == compute


def test_analytic_parameter_server_is_eq2(setting):
    """One server (device 1) for everything: machine a (1 device) sends and receives every byte
    over the slower card (1 Gbps), plus phi; machine b holds the server; plus delta."""
    cl, graph, plan, cost, est, variables = setting
    entries = variables.entries(uniform(variables, PartSync(kind=PS, server=1)))
    t = price.analytic(entries, variables, cost, 0.0)
    nbytes = [v.nbytes for v in variables.vars]
    expected = sum(2 * n / (1e9 / 8) + 20e-6 + 20e-6 for n in nbytes)
    assert t == pytest.approx(expected, rel=1e-6)


# -- learned simulators ----------------------------------------------------------------------------

def synthetic(setting, count, seed):
    """Strategies whose 'measured' time is hap's overlap price: a known, learnable function."""
    cl, graph, plan, cost, est, variables = setting
    domain = Domain("mlp", variables, cost, est)
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        s = sample(variables, [1.0, 4.0, 4.0], rng, SpaceConfig(part_bytes=512))
        x, edges = features(domain, s)
        out.append(Sample("mlp", x, edges, price.overlapped(variables.entries(s), variables, cost, est)))
    return out


def test_pairs_skip_near_ties():
    s = [Sample("a", None, [], 1.0), Sample("a", None, [], 1.0 + MARGIN / 2), Sample("a", None, [], 2.0),
         Sample("b", None, [], 0.5)]
    assert sorted(pairs(s)) == [(0, 2), (1, 2)]  # not across domains, not within the margin
    assert ranking_accuracy([0.0, 1.0, 2.0, 9.0], s) == 1.0
    assert ranking_accuracy([3.0, 1.0, 2.0, 9.0], s) == 0.5
    assert ranking_accuracy([2.0, 2.0, 2.0, 9.0], s) == 0.5  # scored alike: a coin's half (it was 0)


def test_a_strategy_measured_again_is_no_pair_to_rank():
    """A search's log holds one strategy many times (DDP's buckets, Horovod's samples that fuse
    alike, the confirmations): its times differ by noise, no ranker can order its two
    samples, and every such pair counted as a miss (a search of 2 trials reported 0.00 for
    every ranker)."""
    s = [Sample("a", None, [], 1.0, "AR(0)"), Sample("a", None, [], 1.5, "AR(0)"), Sample("a", None, [], 2.0, "PS(1)")]
    assert sorted(pairs(s)) == [(0, 2), (1, 2)]
    assert ranking_accuracy([1.0, 1.0, 2.0], s) == 1.0
    assert pairs(s[:2]) == [] and ranking_accuracy([1.0, 1.0], s[:2]) != ranking_accuracy([1.0, 1.0], s[:2])  # nan


@pytest.mark.parametrize("kind", ["linear", "rnn", "gat"])
def test_a_batch_scores_each_strategy_as_it_alone(kind):
    """Simulators score a batch at once, each strategy padded to the longest's parts: padding
    must change no score or embedding (a strategy alone is a batch of one, unpadded)."""
    rng = random.Random(3)
    samples = []
    for k in range(9):
        n = rng.choice([1, 2, 5, 11])  # lengths 1 and 11 in one batch: the most padding
        edges = [(i, i + 1) for i in range(n - 1)] + [(rng.randrange(n), rng.randrange(n))]
        samples.append(Sample("d", torch.randn(n, FEATURES), edges + [(j, i) for i, j in edges], 1.0 + k, f"s{k}"))
    sim = Simulator(kind, seed=0)
    together, embedded = sim.scores(samples), sim.embeddings(samples)
    for s, score, h in zip(samples, together, embedded):
        assert score == pytest.approx(sim.scores([s])[0], abs=1e-6)
        assert torch.allclose(h, sim.embeddings([s])[0], atol=1e-6)
    some = [i for i, s in enumerate(samples) if s.x.shape[0] < 11][:3]  # training's rows, cut to their longest
    with torch.no_grad():
        cut = sim.net(Padded.of(samples).rows(some))[0].tolist()
    assert cut == pytest.approx([together[i] for i in some], abs=1e-6)


@pytest.mark.parametrize("kind", ["linear", "rnn", "gat"])
def test_simulators_learn_to_rank(setting, kind):
    train, test = synthetic(setting, 60, 0), synthetic(setting, 25, 1)
    sim = Simulator(kind, seed=0)
    before = ranking_accuracy(sim.scores(test), test)
    sim.train(train, epochs=40)
    after = ranking_accuracy(sim.scores(test), test)
    assert after >= 0.75 and after > before - 0.05, (kind, before, after)


# -- baselines -------------------------------------------------------------------------------------

def test_ddp_buckets_in_arrival_order(setting):
    *_, variables = setting
    s = baselines.ddp(variables)
    assert all(p.kind == AR for vs in s.vars for p in vs.parts)
    total = sum(v.nbytes for v in variables.vars)
    assert max(p.group for vs in s.vars for p in vs.parts) == (0 if total <= baselines.DDP_FIRST_BUCKET else 1)


def test_horovod_fusion_by_threshold_and_cycle(setting):
    cl, graph, plan, cost, est, variables = setting
    one = baselines.horovod_fusion(variables, est, threshold=1e12, cycle=1e3)
    assert {p.group for vs in one.vars for p in vs.parts} == {0}  # everything within one cycle and threshold
    each = baselines.horovod_fusion(variables, est, threshold=1.0, cycle=1e3)
    assert len({p.group for vs in each.vars for p in vs.parts}) == len(variables.vars)


def test_bayesian_optimization_finds_a_quadratics_minimum():
    calls = []

    def f(x):
        calls.append(x)
        return (x[0] - 0.3) ** 2 + (x[1] - 7.0) ** 2 / 100

    x, y, tried = baselines.bayesian_optimization(f, [(0.0, 1.0), (0.0, 10.0)], samples=15, seed=0)
    assert len(calls) == 15 and len(tried) == 15
    assert abs(x[0] - 0.3) < 0.15 and y == min(v for _, v in tried) and y < 0.03


def test_tuned_ps_partitions_and_balances(setting):
    *_, variables = setting
    s = baselines.tuned_ps(variables, [1.0, 2.0, 2.0], partition_bytes=2048)
    for v, vs in zip(variables.vars, s.vars):
        assert v.nbytes / len(vs.parts) <= 2048 or len(vs.parts) == v.rows
    load = [0.0] * 3
    for v, vs in zip(variables.vars, s.vars):
        for p in vs.parts:
            load[p.server] += v.nbytes / len(vs.parts)
    assert load[0] < load[1] and load[0] < load[2]  # the slow card serves least
    assert all(p.hierarchical for vs in s.vars for p in vs.parts)  # machine b has two devices



def test_the_plan_baseline_is_the_plans_own_sync(setting):
    """`hap sync --plan P` measures P's sync as the "hap" baseline: parts, servers, compressors
    and hierarchy, not default buckets."""
    *_, plan, _, _, variables = setting
    fc1 = next(v for v in variables.vars if v.target == "fc1.weight")  # 64 rows
    mine = SyncStrategy(tuple(
        VarSync(v.param, (PartSync(kind=PS, server=2, hierarchical=True), PartSync(kind=AR, group=1, compressor="fp16")))
        if v is fc1 else VarSync(v.param, (PartSync(kind=AR, group=0),)) for v in variables.vars))
    planned = with_strategy(plan, variables, mine)
    got = baselines.plan_sync(variables, planned.sync)
    assert variables.key(got) == variables.key(mine) and not got.exact
    assert variables.key(got) != variables.key(baselines.ddp(variables))
    uneven = [dataclasses.replace(e, rows=(0, 40)) if e.param == fc1.param and e.rows == (0, 32) else
              dataclasses.replace(e, rows=(40, 24)) if e.param == fc1.param else e for e in planned.sync]
    with pytest.raises(ValueError, match=r"rows \[\(0, 40\), \(40, 24\)\], not as a strategy does"):
        baselines.plan_sync(variables, uneven)
    # a strategy's own entries run as they are; a hand-made sync's buckets may not: said
    assert baselines.bucket_changes(variables, planned.sync, got) is None
    last = max(e.bucket for e in planned.sync)
    flipped = [dataclasses.replace(e, bucket=last - e.bucket) for e in planned.sync]  # launched the other way round
    assert baselines.bucket_changes(variables, flipped, got) == f"its {last + 1} buckets launch in the order they complete"
    # every parameter on server 1 in one bucket: a strategy's server parts are a bucket each
    one_bucket = [dataclasses.replace(e, strategy=PS, server=1, bucket=0, rows=None, compressor="none",
                                      hierarchical=False)
                  for e in with_strategy(plan, variables, baselines.ddp(variables)).sync]
    served = baselines.plan_sync(variables, one_bucket)
    assert baselines.bucket_changes(variables, one_bucket, served) == (
        f"its 1 bucket runs as {len(variables.vars)} (a parameter server's part is a bucket of its own)")


# -- sparse gradients ------------------------------------------------------------------------------

class Rec(nn.Module):
    def __init__(self):
        super().__init__()
        self.users = nn.Embedding(1000, 16, sparse=True)
        self.score = nn.Linear(16, 1)

    def forward(self, users):
        return self.score(self.users(users)).mean()


@pytest.fixture(scope="module")
def sparse_setting():
    cl = two_machines()
    graph = capture(Rec(), (torch.randint(0, 1000, (24,)),))
    plan = baseline_plan(graph, cl, "dp-ev")
    cost = CostModel(graph, cl, ShardClasses(graph, enumerate(strategy_table(graph))))
    return graph, plan, cost, Variables.of(plan, graph, [m.devices for m in cl.topology.machines])


def test_sparse_gradients_are_priced_by_the_rows_a_step_touches(sparse_setting):
    graph, plan, cost, variables = sparse_setting
    table = next(n for n in graph.params if graph.tensors[n].shape == (1000, 16))
    assert cost.sparse_rows == {table: 24}  # 24 ids looked up: at most 24 rows
    # 24 rows of 64 bytes with their 8-byte indices, all-gathered: an all-reduce of half that
    assert cost.sync_bytes(table) == 24 * (64 + 8) / 2
    var = next(v for v in variables.vars if v.param == table)
    assert var.sparse and var.wire_bytes == 24 * 72 and var.wire_bytes < var.nbytes
    # hap's own plan syncs the table alone in its bucket, marked sparse
    (entry,) = [e for e in plan.sync if e.param == table]
    assert entry.sparse and sum(1 for e in plan.sync if e.bucket == entry.bucket) == 1


def test_sparse_gradients_are_never_split_or_compressed(sparse_setting):
    *_, variables = sparse_setting
    rng = random.Random(3)
    for _ in range(50):
        s = sample(variables, [1.0, 1.0, 1.0], rng, SpaceConfig(compress=True, part_bytes=64, max_parts=4))
        for v, vs in zip(variables.vars, s.vars):
            if v.sparse:
                assert len(vs.parts) == 1 and vs.parts[0].compressor == "none" and not vs.parts[0].hierarchical
        entries = variables.entries(s)
        sparse = [e for e in entries if e.sparse]
        assert len(sparse) == 1 and sum(1 for e in entries if e.bucket == sparse[0].bucket) == 1
    table = next(v for v in variables.vars if v.sparse)
    with pytest.raises(ValueError, match="a sparse gradient is synchronized whole"):
        variables.entries(SyncStrategy(tuple(VarSync(v.param, (PartSync(kind=AR, hierarchical=v is table),))
                                             for v in variables.vars)))


@pytest.mark.parametrize("entries,message", [
    ([dict(param="w", bucket=0, sparse=True, rows=(0, 4)), dict(param="w", bucket=1, sparse=True, rows=(4, 4))],
     "a sparse gradient is synchronized whole"),
    ([dict(param="w", bucket=0, sparse=True, compressor="fp16")], "a sparse gradient is synchronized whole"),
    ([dict(param="v", bucket=0), dict(param="w", bucket=0, sparse=True)], "a sparse gradient must be alone"),
    ([dict(param="w", bucket=0, sparse=True), dict(param="v", bucket=0)], "a sparse gradient must be alone"),
])
def test_bad_sparse_entries_get_one_line(entries, message):
    with pytest.raises(ValueError, match=message) as err:
        check_sync([SyncEntry(devices=(0, 1), **e) for e in entries], 2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_sparse_rows_pack_and_unpack_exactly(dtype, rows):
    from hap.runtime.gradsync import _pack, _padding, _unpack

    gen = torch.Generator().manual_seed(rows)
    idx = torch.randperm(40, generator=gen)[:rows].sort().values * 1000  # [rows], large ids too
    grad = torch.sparse_coo_tensor(idx.unsqueeze(0), torch.randn(rows, 3, 2, generator=gen).to(dtype), (40_000, 3, 2)).coalesce()
    message = torch.cat([_pack(grad), _padding(2, _pack(grad))])  # padded by two rows of index -1
    back = _unpack(message, grad.shape).coalesce()
    assert torch.equal(back.indices(), grad.indices()) and torch.equal(back.values(), grad.values())


@pytest.mark.parametrize("field, value, message", [
    ("per_round", 0, "AutoSyncConfig.per_round must be a whole number of at least 1, got 0"),  # the loop would never end
    ("candidates", 0, "AutoSyncConfig.candidates must be a whole number of at least 1, got 0"),
    ("local", 1.5, r"AutoSyncConfig.local must be a number in \[0, 1\], got 1.5"),
    ("confirm", -1, "AutoSyncConfig.confirm must be a whole number of at least 0, got -1"),
    ("min_timed_seconds", -0.1, "AutoSyncConfig.min_timed_seconds must be a number of at least 0, got -0.1"),
    # these failed only after the baselines or 10 trials had run
    ("horovod_samples", 0, "AutoSyncConfig.horovod_samples must be a whole number of at least 1, got 0"),
    ("simulator", "lstm", "AutoSyncConfig.simulator must be one of rnn, gat, linear, got 'lstm'"),
    ("similarity", "cosine", "AutoSyncConfig.similarity must be one of choices, embedding, got 'cosine'"),
    ("epochs", 0, "AutoSyncConfig.epochs must be a whole number of at least 1, got 0"),
    ("alpha", -5.0, "AutoSyncConfig.alpha must be a number of at least 0, got -5.0"),
])
def test_bad_autosync_config_gets_one_line(field, value, message):
    with pytest.raises(ValueError, match=message):
        AutoSyncConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("part_bytes", 0), ("max_groups", 0), ("max_parts", -3), ("low_rank", 0)])
def test_bad_space_config_gets_one_line(field, value):
    """part_bytes 0 divided by zero and max_groups 0 drew from an empty range; max_parts -3 was taken."""
    with pytest.raises(ValueError, match=rf"^SpaceConfig.{field} must be a whole number of at least 1, got {value}$"):
        SpaceConfig(**{field: value})


# -- the trial log ----------------------------------------------------------------------------------

def logged(key, strategy: SyncStrategy, seconds: float, kind="trial") -> str:
    return json.dumps({"domain": key, "model": "mlp", "knobs": {}, "cluster": "t", "kind": kind,
                       "strategy": strategy.to_json(), "seconds": seconds, "hap_estimate": seconds}) + "\n"


def test_strategies_that_run_alike_are_measured_and_ranked_as_one(setting, monkeypatch):
    """Groups numbered otherwise launch the same buckets: the search measured both (a trial
    spent on a strategy known), and ranked their two times, noise, as a pair (a helper's review:
    7 of 29 pairs)."""
    cl, graph, plan, cost, est, variables = setting
    a = SyncStrategy(tuple(VarSync(v.param, (PartSync(kind=AR, group=i),)) for i, v in enumerate(variables.vars)))
    b = SyncStrategy(tuple(VarSync(v.param, (PartSync(kind=AR, group=10 + 3 * i),)) for i, v in enumerate(variables.vars)))
    c = uniform(variables, PartSync(kind=PS, server=1))
    assert a != b and variables.key(a) == variables.key(b) != variables.key(c)
    domain = Domain("d", variables, cost, est)
    assert autosync._sample(domain, a).strategy == autosync._sample(domain, b).strategy
    assert pairs([autosync._sample(domain, a, 0.010), autosync._sample(domain, b, 0.020)]) == []
    drawn = iter([b, c])
    monkeypatch.setattr(autosync, "sample", lambda *args: next(drawn))
    history = [json.loads(logged("k", a, 0.01))]
    fresh = autosync._candidates(history, "k", variables, [1.0] * 3, random.Random(0),
                                 AutoSyncConfig(candidates=2, local=0.0))
    assert fresh == [c]


def test_a_search_without_compression_never_meets_a_compressed_strategy(setting, tmp_path):
    """A search with --compress keyed its rows like one without, so the one without took its
    (faster) compressed trials for parents and returned one: an approximate strategy the user
    never asked for. The keys now differ; rows logged before they did are left out."""
    cl, graph, plan, *_ , variables = setting
    exact = uniform(variables, PartSync(kind=AR))
    fp16 = uniform(variables, PartSync(kind=AR, compressor="fp16"))
    key = autosync._domain_key("mlp", {}, cl, plan)
    assert autosync._domain_key("mlp", {}, cl, plan, compress=True) != key
    log = tmp_path / "trials.jsonl"
    log.write_text(logged(key, fp16, 0.001) + logged(key, exact, 0.002) + logged("other", fp16, 0.001))
    kept = autosync._history(log, key, compress=False)
    assert [(t["domain"], t["seconds"]) for t in kept] == [(key, 0.002), ("other", 0.001)]
    assert len(autosync._history(log, key, compress=True)) == 3


def test_an_unfinished_last_row_is_dropped_and_a_damaged_row_named(setting, tmp_path):
    """A search stopped while writing a row could not resume (its log was refused); a row that is
    JSON but not a trial failed with KeyError."""
    cl, graph, plan, *_, variables = setting
    row = logged("k", uniform(variables, PartSync(kind=AR)), 0.002)
    log = tmp_path / "trials.jsonl"
    log.write_text(row + row[:40])
    said = []
    assert len(autosync._load(log, said.append)) == 1
    assert said == [f"[autosync] {log}:2: dropped an unfinished last line (a search stopped while writing it)"]
    assert log.read_text() == row  # the next row starts on a line of its own
    every = "domain, model, knobs, cluster, kind, strategy, seconds, hap_estimate"  # (one without its estimate failed
    # in the plots, at the end; one without its model in result.json, after the search's every measurement)
    for bad, missing in (("{}", every), ("[]", every),
                         (row.replace('"seconds": 0.002', '"seconds": "fast"').strip(), "seconds"),
                         (row.replace('"model": "mlp", ', "").strip(), "model")):
        log.write_text(row + bad + "\n")
        with pytest.raises(ValueError, match=rf"^{re.escape(str(log))}:2: not a trial row \(no {missing}\): a trial "
                                             "log holds one trial per line$"):
            autosync._load(log)
    log.write_text(row + row[:40] + "\n" + row)  # a broken line inside the log is not an unfinished write
    with pytest.raises(ValueError, match=r":2: not a JSON line"):
        autosync._load(log)
    log.write_text(row.strip())  # a whole last row without its newline: the next row was glued to it
    assert len(autosync._history(log, "k", compress=True)) == 1 and log.read_text() == row


def test_baselines_stopped_midway_resume_where_they_stopped(setting):
    """A search stopped among its baselines took Horovod's tuning cut short for finished (4 of
    its 20 runs), or measured and logged hap's, DDP's and the tuned servers' again. Each run
    logged is now taken from the log: resumed, the baselines are the uninterrupted ones'."""
    from hap.sync.sampler import bandwidths

    cl, graph, plan, cost, est, variables = setting
    config = AutoSyncConfig(horovod_samples=6, seed=3)
    bw = bandwidths(variables, cost)

    def measuring(history, calls):
        def measure(named, tried):
            calls.extend(kind for kind, _ in named)
            times = [0.01 + 1e-6 * (zlib.crc32(json.dumps([kind, how]).encode()) % 1000) for (kind, _), how in zip(named, tried)]
            history.extend({"domain": "k", "kind": kind, "strategy": s.to_json(), "seconds": t, "knobs_tried": how}
                           for (kind, s), t, how in zip(named, times, tried))
            return times
        return measure

    whole, calls = [], []
    own = baselines.plan_sync(variables, plan.sync)
    straight = autosync._baselines(variables, own, est, bw, measuring(whole, calls), whole, "k", config, lambda m: None)
    assert len(calls) == len(whole) and 1 <= calls.count("baseline:horovod") < 6
    # no strategy run twice: Horovod's thresholds that give buckets measured already (hap's, say)
    # take their time (the least of 20 runs of one strategy beat its one run by noise)
    ran = [variables.key(SyncStrategy.from_json(t["strategy"])) for t in whole]
    assert len(set(ran)) == len(ran)
    for stop in (3, len(whole) - 4):  # among the first baselines; midway through Horovod's tuning
        history, again = whole[:stop], []
        resumed = autosync._baselines(variables, own, est, bw, measuring(history, again), history, "k", config,
                                      lambda m: None)
        assert again == calls[stop:]  # each run once, in the same order
        assert {n: b["strategy"] for n, b in resumed.items()} == {n: b["strategy"] for n, b in straight.items()}


def test_other_searches_trials_train_the_simulators(tmp_path):
    """The log's trials of other searches (another model, cluster or plan) were documented to
    train the simulators but never did: each search now writes what it searched beside the log,
    and a later search rebuilds those domains and learns from their trials, ranked within each."""
    from hap.cost.cluster import load_cluster
    from hap.sync.sampler import bandwidths

    cluster = load_cluster("local-homo")
    knobs = {"scale": "small"}
    graph, plan, variables, cost, est = autosync._setting("vit", knobs, cluster, None)
    other = autosync._domain_key("vit", knobs, cluster, plan)
    autosync._save_domain(tmp_path, other, "vit", knobs, cluster, plan)
    rng = random.Random(0)
    strategies = [sample(variables, bandwidths(variables, cost), rng) for _ in range(3)]
    history = [json.loads(logged(other, s, 0.01 * (i + 1))) for i, s in enumerate(strategies)]
    history += [json.loads(logged("lost", strategies[0], 0.5)), json.loads(logged("mine", strategies[1], 0.2)),
                json.loads(logged(other, strategies[0], 0.009, kind="confirm:trial"))]
    said = []
    got = autosync._other_samples(history, "mine", tmp_path, said.append)
    assert [s.seconds for s in got] == [0.01, 0.02, 0.03]  # the other search's, without its confirmations
    assert all(s.domain.endswith(f"[{other}]") for s in got)
    assert [s.x.shape[0] for s in got] == [len(variables.entries(s)) for s in strategies]
    assert said[0].startswith("[autosync] 1 measured strategies of another search (lost) left out of training: "
                              "FileNotFoundError")
    assert said[1] == "[autosync] 3 measured strategies of 1 other search train the simulators too"


def test_sparse_rows_are_padded_to_the_busiest_ranks_at_the_plans_shares():
    cl = cluster_from_dict({
        "name": "t",
        "devices": [{"name": "fast", "count": 1, "flops": 2e12, "memory": "16GiB"},
                    {"name": "slow", "count": 2, "flops": 1e12, "memory": "16GiB"}],
        "network": {"bandwidth": "1GB/s", "latency": "20us"}})
    graph = capture(Rec(), (torch.randint(0, 1000, (24,)),))
    plan = baseline_plan(graph, cl, "dp-cp")  # batch shares 2:1:1, 12, 6 and 6 of the 24 ids
    assert plan.shard_sizes(graph.inputs[0], 0) == [12, 6, 6]
    cost = CostModel(graph, cl, ShardClasses(graph, enumerate(strategy_table(graph))))
    table = next(v for v in Variables.of(plan, graph, None, cost).vars if v.sparse)
    # every rank sends as many (index, row) pairs as the busiest: 3 * 12 pairs of 72 bytes
    assert table.sparse_rows == 36 and table.wire_bytes == 36 * 72
    # without the cost model, the 24 pairs unpadded (what was priced before)
    assert next(v for v in Variables.of(plan, graph).vars if v.sparse).wire_bytes == 24 * 72


def test_analytic_hierarchical_waits_for_the_slowest_machine_not_the_largest():
    """Machine a: 2 devices joined at 1 GB/s; machine b: 3 devices at 10 GB/s. Inside, each
    machine's ring runs at once: a's 2 * 1/2 * n / 1 GB/s ends after b's 2 * 2/3 * n / 10 GB/s.
    Between the leaders: 2 * 1/2 * n over the 1 GB/s cards. It priced b's ring alone, the largest,
    whatever a's link."""
    def cluster(intra_a):
        nic = {"bandwidth": "1GB/s", "latency": "20us"}
        return cluster_from_dict({
            "name": "t", "algorithm": "ring", "devices": [{"name": "gpu", "count": 5, "flops": 1e12, "memory": "16GiB"}],
            "machines": [{"name": "a", "devices": 2, "intra": {"bandwidth": intra_a, "latency": "5us"}, "nic": nic},
                         {"name": "b", "devices": 3, "intra": {"bandwidth": "10GB/s", "latency": "5us"}, "nic": nic}]})
    graph = capture(MLP(), (torch.randn(64, 32),))
    times = {}
    for intra_a in ("1GB/s", "100GB/s"):
        cl = cluster(intra_a)
        plan = baseline_plan(graph, cl, "dp-ev")
        cost = CostModel(graph, cl, ShardClasses(graph, enumerate(strategy_table(graph))))
        variables = Variables.of(plan, graph, [m.devices for m in cl.topology.machines])
        entries = variables.entries(uniform(variables, PartSync(kind=AR, hierarchical=True)))
        (bucket,) = price.buckets(entries, variables)
        n = price.message_bytes(bucket, variables)[0]
        times[intra_a] = price.analytic(entries, variables, cost, 0.0), n
    (slow, n), (fast, _) = times["1GB/s"], times["100GB/s"]
    between = 2 * 1 / 2 * n / 1e9 + 2 * 20e-6 + price.LAUNCH_OVERHEAD
    assert slow == pytest.approx(n / 1e9 + between, rel=1e-6)
    assert fast == pytest.approx(4 / 3 * n / 1e10 + between, rel=1e-6)


def test_a_search_that_cannot_write_or_would_measure_nothing_is_refused_before_any_work(tmp_path):
    """trials.jsonl a directory was an IsADirectoryError traceback, plan.json one after the whole
    search; trials=0 without baselines started the trial ranks and ended in min() of nothing."""
    from hap.cost.cluster import load_cluster

    cluster = load_cluster("local-homo")
    (tmp_path / "a" / "trials.jsonl").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"trials.jsonl is a directory; the search writes a file there$"):
        autosync.run("vit", {"scale": "small"}, cluster, tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "domains").write_text("")
    with pytest.raises(ValueError, match=r"domains is a file; the search writes a directory there$"):
        autosync.run("vit", {"scale": "small"}, cluster, tmp_path / "b")
    with pytest.raises(ValueError, match=r"^trials=0 with baselines=False measures nothing"):
        autosync.run("vit", {"scale": "small"}, cluster, tmp_path / "c", AutoSyncConfig(trials=0, baselines=False))
    # as hap sync refuses them (the API measured CPU processes for a V100 cluster's result; a
    # TypeError from inside the model registry; a FileExistsError)
    with pytest.raises(ValueError, match=r"^cluster 'paper-hetero-8' is not local: the search measures strategies on "
                                         r"local processes"):
        autosync.run("vit", {"scale": "small"}, load_cluster("paper-hetero-8"), tmp_path / "e")
    with pytest.raises(ValueError, match=r"^vit: got an unexpected keyword argument 'bogus'$"):
        autosync.run("vit", {"scale": "small", "bogus": 1}, cluster, tmp_path / "f")
    (tmp_path / "g").write_text("")
    with pytest.raises(ValueError, match=r"/g is a file; the search writes into a directory there$"):
        autosync.run("vit", {"scale": "small"}, cluster, tmp_path / "g")
    # one device: it searched (and measured) strategies that synchronize nothing
    spec = cluster.to_dict()
    one = cluster_from_dict({**spec, "name": "one", "devices": spec["devices"][:1]})
    with pytest.raises(ValueError, match=r"^cluster 'one' has one device: there are no gradients to synchronize"):
        autosync.run("vit", {"scale": "small"}, one, tmp_path / "d")
    # a given plan whose sync is no strategy, or compresses in a search without compression (its
    # "hap" baseline is that plan's sync: the search would have returned it)
    _, plan, variables, *_ = autosync._setting("vit", {"scale": "small"}, cluster, None)
    fp16 = SyncStrategy(tuple(VarSync(v.param, (PartSync(kind=AR, compressor="fp16"),)) for v in variables.vars))
    with pytest.raises(ValueError, match=r"^the plan's sync compresses gradients, which a search without compression"):
        autosync.run("vit", {"scale": "small"}, cluster, tmp_path / "h", plan=with_strategy(plan, variables, fp16))
    two = next(v for v in variables.vars if v.rows >= 2)
    halves = dataclasses.replace(plan, sync=[e for e in plan.sync if e.param != two.param] + [
        dataclasses.replace(next(e for e in plan.sync if e.param == two.param), rows=rows)
        for rows in ((0, two.rows - 1), (two.rows - 1, 1))])
    with pytest.raises(ValueError, match=r"rows \[.*\], not as a strategy does"):
        autosync.run("vit", {"scale": "small"}, cluster, tmp_path / "i", plan=halves)


def test_knobs_that_change_nothing_key_the_same_search(setting, tmp_path):
    """`hap sync --layers 2`, 2 being the small ViT's default, keyed a search of its own, so it
    neither resumed nor learned from the same model's trials logged without the flag."""
    from hap.models import changing_knobs, resolve

    small = resolve("vit", scale="small")[1]
    assert changing_knobs("vit", 2, scale="small", layers=small.layers, dropout=small.dropout) == {"scale": "small"}
    assert changing_knobs("vit", 2, scale="paper", layers=8, batch=128) == {}  # paper: 8 blocks, 64 a device
    assert changing_knobs("vit", 2, scale="small", layers=small.layers + 1, dropout=small.dropout / 2) == {
        "scale": "small", "layers": small.layers + 1, "dropout": small.dropout / 2}
    assert changing_knobs("bert-moe", 4, experts=8) == {}  # 2 experts a device by default
    assert changing_knobs("bert-moe", 4, experts=6) == {"experts": 6}
    # a log keyed as the knobs were given (before they were dropped) is resumed as this search's
    variables = setting[-1]
    log = tmp_path / "trials.jsonl"
    log.write_text(logged("as-given", uniform(variables, PartSync(kind=AR)), 0.002)
                   + logged("other", uniform(variables, PartSync(kind=AR)), 0.001))
    rows = autosync._history(log, "key", compress=False, aliases=("as-given",))
    assert [t["domain"] for t in rows] == ["key", "other"]


def test_an_accuracy_with_no_pair_to_rank_is_null_in_result_json(setting):
    """result.json held NaN (not JSON) for an accuracy with no pair to rank: here two rows, one
    held out."""
    cl, graph, plan, cost, est, variables = setting
    domain = Domain("t", variables, cost, est)
    rows = [json.loads(logged("k", uniform(variables, PartSync(kind=AR)), s)) for s in (0.001, 0.002)]
    acc = autosync._held_out(rows, domain, AutoSyncConfig(epochs=1))
    assert acc["held_out"] == 1 and acc["hap"] is None and acc["rnn"] is None and acc["forecast"]["gat"] is None
    json.dumps(acc, allow_nan=False)  # (a ValueError on NaN)


def test_trial_ranks_end_once_their_search_is_killed(tmp_path):
    """hap sync's trial rank 0 waits on a queue for the next strategies, the others in a
    broadcast; a search killed where its children ignore the interrupt torch sends them left
    them waiting for ever (11 minutes and on, in a hunt's run). They end with it now
    (launch.start_ranks), here started with SIGINT ignored."""
    import signal
    import subprocess
    import sys

    from gloo import still_running

    script = tmp_path / "search.py"
    script.write_text(
        "import sys, time\n"
        "import hap\n"
        "from hap.models import build\n"
        "from hap.sync.trials import TrialCluster, Workload\n"
        "if __name__ == '__main__':\n"
        "    cluster = hap.load_cluster('local')\n"
        "    model, batch = build('vit', scale='small', devices=2)\n"
        "    plan = hap.plan(hap.capture(model, batch), cluster)\n"
        "    with TrialCluster(Workload(model='vit', knobs={'scale': 'small'}, cluster=cluster.to_dict(),\n"
        "                               plan=plan.to_dict())) as trials:\n"
        "        print(*(p.pid for p in trials.procs), flush=True)\n"
        "        time.sleep(600)\n")
    search = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    ranks = [int(pid) for pid in search.stdout.readline().split()]  # (the ranks are ready, rank 0 waits)
    assert len(ranks) == 2
    search.kill()
    search.wait()
    assert still_running(ranks) == []


def test_a_plan_made_for_another_cluster_is_searched_and_written_for_this_one():
    # hap sync --cluster local-homo --plan P (P made for local) wrote a plan naming local, with
    # local-homo's estimate: hap train then took it for another cluster's, or for edited
    from hap.cost.cluster import load_cluster
    from hap.sync.autosync import _setting

    knobs = {"scale": "small"}
    _, made, *_ = _setting("ncf-sparse", knobs, load_cluster("local"), None)
    assert made.cluster["name"] == "local"
    homo = load_cluster("local-homo")
    _, plan, _, _, est = _setting("ncf-sparse", knobs, homo, made)
    assert plan.cluster == homo.to_dict() and plan.devices == [d.name for d in homo.devices]
    assert plan.sync == made.sync and est.seconds > 0


def test_the_plans_own_sync_is_measured_as_it_is_and_written_where_it_wins(tmp_path, monkeypatch):
    """hap sync --plan P whose sync no strategy runs as it is (every parameter on one server, in
    one bucket: a strategy makes a bucket of each part): baseline "hap" measured the strategy
    form (one bucket per parameter), and wrote that where it won, not P's sync."""
    import dataclasses as dc
    import json

    import hap.sync.autosync as autosync
    from hap.cost.cluster import load_cluster

    cluster = load_cluster("local")
    _, made, variables, _, _ = autosync._setting("ncf-sparse", {"scale": "small"}, cluster, None)
    served = [dc.replace(e, strategy=PS, server=1, bucket=0, rows=None, compressor="none", hierarchical=False)
              for e in made.sync if not e.sparse]
    sparse = [dc.replace(e, bucket=1 + i) for i, e in enumerate(e for e in made.sync if e.sparse)]  # (each alone)
    mine = dc.replace(made, sync=served + sparse)
    ran = []

    class Trials:  # P's sync as it is is the fastest; every other run slower
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def measure(self, runs):
            ran.extend(runs)
            return [1.0 if run == mine.sync else 2.0 for run in runs]

    monkeypatch.setattr(autosync, "TrialCluster", Trials)
    config = autosync.AutoSyncConfig(trials=2, per_round=2, candidates=4, horovod_samples=2, confirm=1)
    said = []
    result = autosync.run("ncf-sparse", {"scale": "small"}, cluster, tmp_path, config, plan=mine, say=said.append)
    assert any(run == mine.sync for run in ran)
    assert result["best"]["kind"] == "baseline:hap"
    written = json.loads((tmp_path / "plan.json").read_text())["sync"]
    assert [(e["param"], e["bucket"], e["strategy"]) for e in written] == [(e.param, e.bucket, e.strategy) for e in mine.sync]
    assert any("baseline hap runs the plan's sync as it is" in line for line in said)
