"""End-to-end planning: the Plan, its JSON, gradient semantics, unknown ops, the CLI."""

import dataclasses
import json
import re
import subprocess
import sys
from types import SimpleNamespace

from hypothesis import given, settings, strategies as hs
import pytest
import torch
import torch.nn as nn

from hap import Plan, capture, load_cluster, plan
from hap.cli import main
from hap.cost.cluster import Cluster, Device, fits_from_network
from hap.cost.model import CostModel
from hap.placement import S
from hap.planner import PlannerConfig, segment_graph
from hap.rules import strategies_for, strategy_table
from hap.rules.units import ShardClasses

torch.set_num_threads(1)


class MLP(nn.Module):
    def __init__(self, d=64, h=256):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, d))  # a length-1 dim: must never be "sharded"
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return (self.fc2(torch.relu(self.fc1(x * self.scale))) ** 2).mean()


@pytest.fixture(scope="module")
def graph():
    return capture(MLP(), (torch.randn(32, 64),))


@pytest.fixture(scope="module")
def result(graph):
    return plan(graph, load_cluster("paper-hetero-8"))


def test_breakdown_adds_up_to_the_estimate(result):
    """Every term once (the overlapped sync is shown beside them): the loss's all-reduce was in
    the estimate but in no term, so the terms of a plan on paper-hetero-8 added up to less."""
    for b, seconds in ((result.breakdown, result.estimated_iteration_seconds),
                       *((x["breakdown"], x["seconds"]) for x in result.baselines.values())):
        assert b["loss_and_rng_collectives"] > 0
        assert sum(v for k, v in b.items() if k != "gradient_sync_overlapped") == pytest.approx(seconds, rel=1e-9)


def test_plan_never_worse_than_baselines(result):
    for name in ("dp_ev", "dp_cp", "tp"):
        assert result.estimated_iteration_seconds <= result.baselines[name]["seconds"] * (1 + 1e-12)
    assert result.synthesis_seconds > 0
    assert all(abs(sum(r) - 1) < 1e-9 for r in result.ratios)


def test_an_edit_stays_marked_until_the_plan_is_priced_again(result, graph, tmp_path):
    from hap.planner import priced
    path = tmp_path / "plan.json"
    result.to_json(path)
    data = json.loads(path.read_text())
    # an edited estimate shows (it was outside the stamp: explain drew a 1000 ms "estimate")
    path.write_text(json.dumps({**data, "estimated_iteration_seconds": 1.0}))
    assert Plan.from_json(path).edited_since_written
    # edited ratios, saved again: still marked (saving re-stamped them as current)
    edited = {**data, "stages": [{**data["stages"][0], "ratios": [[1 / 8] * 8]}]}
    path.write_text(json.dumps(edited))
    Plan.from_json(path).to_json(tmp_path / "again.json")
    again = Plan.from_json(tmp_path / "again.json")
    assert again.edited_since_written
    # priced again, it is current
    cluster = load_cluster("paper-hetero-8")
    assert not priced(graph, cluster, again).edited_since_written
    # a plan at other ratios (a reshard) is marked until priced
    moved = result.with_ratios([[0.3, 0.7] + [0.0] * 6], list(result.stage.shards))
    assert moved.edited_since_written and not priced(graph, cluster, moved).edited_since_written
    # a file stamped with its content alone (before 2026-11-29) is not marked
    path.write_text(json.dumps({**data, "written": result.content_digest}))
    assert not Plan.from_json(path).edited_since_written


def test_json_round_trip(result, graph, tmp_path):
    path = tmp_path / "plan.json"
    result.to_json(path)
    data = json.loads(path.read_text())
    for key in ("version", "stages", "sync", "schedule", "synthesis_seconds", "estimated_iteration_seconds", "baselines",
                "timeline", "memory_bytes"):
        assert key in data
    assert set(data["baselines"]) >= {"dp_ev", "dp_cp"}
    again = Plan.from_json(path)
    assert again.to_dict() == {**result.to_dict(), "written": result.written_digest}  # the file says what it held
    assert again.to_dict() == dataclasses.asdict(again)  # (to_dict is asdict without its deep copies)
    assert data["written"] == result.written_digest and again.content_digest == result.content_digest
    assert again.digest == result.digest and not again.edited_since_written
    # JSON text (as agree_plan broadcasts it), longer than a file name may be: read as JSON
    assert len(result.to_json()) > 4096 and Plan.from_json(result.to_json()).to_dict() == again.to_dict()
    steps = again.steps(graph)
    assert [s.node for s in steps] == list(range(len(graph.nodes)))


def test_length_one_dims_are_never_sharded(graph, result):
    for node in graph.nodes:
        for st in strategies_for(node, graph):
            for name, p in zip((*node.inputs, *node.outputs), (*st.inputs, *st.outputs)):
                if p.is_shard:
                    assert graph.tensors[name].shape[p.dim] > 1
    # The [1, d] parameter is loaded whole: R (its gradient is summed), D or P, never S(0).
    loads = [p for ins in result.program for t, p in ins.loads if t == "p_scale"]
    assert loads and all(p in ("R", "D", "P") or p == "S(1)" for p in loads)


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.special.bessel_j0(self.fc(x)).sum()  # no sharding rule for bessel_j0


def test_unknown_op_runs_replicated_and_is_listed():
    g = capture(Odd(), (torch.randn(4, 8),))
    p = plan(g, load_cluster("local"))
    assert any("bessel_j0" in op for op in p.replicated_ops)
    entry = next(ins for ins in p.program if "bessel_j0" in ins.op)
    assert entry.strategy in ("replicated", "duplicated")


def test_segments_partition_in_order(graph):
    seg = segment_graph(graph, 2)
    assert seg == sorted(seg) and seg[0] == 0 and seg[-1] == 1
    p = plan(graph, load_cluster("paper-hetero-8"), PlannerConfig(segments=2))
    assert len(p.ratios) == 2 and len(p.segments) == 2


def test_more_segments_are_never_worse_than_one_and_equal_splits_move_nothing(graph):
    # BERT on paper-hetero-8 planned 12% slower with 2 segments than with 1 (the alternation
    # settled elsewhere, and re-splits between equal shares were priced as all-to-alls)
    from hap.runtime.collectives import Comm, resplit
    from hap.search.moves import rebalance
    from hap.search.program import NumericShares, move_price
    from hap.models import build
    cluster = load_cluster("paper-hetero-8")
    bert = capture(*build("bert", devices=8, device="meta"))
    one = plan(bert, cluster).estimated_iteration_seconds
    for segments in (2, 3):
        assert plan(bert, cluster, PlannerConfig(segments=segments)).estimated_iteration_seconds <= one * (1 + 1e-5)
    cost = CostModel(graph, cluster, ShardClasses(graph, enumerate(strategy_table(graph))))
    x = graph.inputs[0]
    even, cp = list(cluster.even()), list(cluster.compute_proportional())
    assert move_price(cost, NumericShares(cost, [even, even]), x, rebalance(S(0)), 0, 1) == (0.0, 0.0)
    assert min(move_price(cost, NumericShares(cost, [even, cp]), x, rebalance(S(0)), 0, 1)) > 0
    # the LP's relaxation prices it whatever the shares (its segments' shares are separate variables)
    assert min(move_price(cost, NumericShares(cost, [even, even], continuous=True), x, rebalance(S(0)), 0, 1)) > 0
    t = torch.arange(6.0)
    assert resplit(t, 0, [3, 3], [3, 3], Comm(rank=0, world=2)) is t  # no collective: no process group here


def test_a_tensor_split_at_another_segments_ratios_is_refused(graph):
    """A hand-edited plan whose tensors cross into a segment of other ratios without the
    re-split was taken, then every rank failed in a view of the wrong size."""
    from hap.planner import _dp, _plan_at

    seg = segment_graph(graph, 2)  # data parallel in both segments, at other shares
    planned = _plan_at(graph, load_cluster("local"), [[0.75, 0.25], [0.4, 0.6]], None,
                       lambda search, rs: search(rs, _dp(graph)), "dp", seg)
    planned.check_fits(graph)  # as planned: re-split where segment 1 starts
    stage = planned.stages[0]
    program = [dataclasses.replace(ins, moves=tuple(m for m in ins.moves if m.name != "rebalance")) for ins in stage.program]
    assert program != stage.program
    edited = dataclasses.replace(planned, stages=[dataclasses.replace(stage, program=program)])
    with pytest.raises(ValueError, match=r"^the plan runs \S+ \(segment 1\) on \S+ as S\(0\), split at segment 0's "
                                         r"ratios: it is re-split where a segment starts \(a hand-edited plan\?\)$"):
        edited.check_fits(graph)


def test_a_steps_moves_come_before_its_loads_in_the_split_walk():
    """The executor runs a step's moves, then its loads. The walk the plan check and the
    executor share recorded loads first: a step of segment 1 that loads x as S(0) and re-splits
    the x held from segment 0 was said to move a value split at segment 1's ratios."""
    from hap.placement import Placement
    from hap.search.moves import rebalance
    from hap.search.program import Load, MoveStep, Step, split_walk

    s0 = Placement("S", 0)
    graph = SimpleNamespace(nodes=[SimpleNamespace(outputs=("a",)), SimpleNamespace(outputs=("b",))])
    strategy = SimpleNamespace(outputs=(s0,))
    program = [Step(0, strategy, (Load("x", s0),), ()),
               Step(1, strategy, (Load("x", s0),), (MoveStep("x", rebalance(s0)),))]
    held = {}
    walked = [(seg, [src for _, src in moves]) for _, seg, moves in split_walk(program, graph, [0, 1], held)]
    assert walked == [(0, []), (1, [0])]
    assert held == {("x", s0): 1, ("a", s0): 0, ("b", s0): 1}
    # a move of what the same step loads: nothing held to move yet
    alone = [Step(1, strategy, (Load("x", s0),), (MoveStep("x", rebalance(s0)),))]
    assert [[src for _, src in moves] for _, _, moves in split_walk(alone, graph, [0, 1], {})] == [[None]]


def test_more_segments_where_memory_is_tight_are_never_worse_than_one():
    # the README's cluster file: BERT fits only by a baseline's program rebalanced, which the
    # one-segment candidate of --segments 2 left out (planned without baselines): out of memory
    from hap.cost.cluster import cluster_from_dict
    from hap.models import build
    cluster = cluster_from_dict({"name": "my-cluster", "network": {"bandwidth": "10.4Gbps", "latency": "30us"},
                                 "devices": [{"name": "v100", "count": 2, "flops": 3.86e12, "memory": "16GiB"},
                                             {"name": "p100", "count": 6, "flops": 2.15e12, "memory": "16GiB",
                                              "gpus": 8, "intra_bandwidth": "10GB/s"}]})
    bert = capture(*build("bert", devices=cluster.gpus, device="meta"))
    one = plan(bert, cluster)
    assert max(one.memory_bytes) > 0.99 * 16 * 2**30  # tight
    two = plan(bert, cluster, PlannerConfig(segments=2))
    assert two.estimated_iteration_seconds <= one.estimated_iteration_seconds * (1 + 1e-5)
    assert all(m <= 16 * 2**30 for m in two.memory_bytes)


def test_memory_infeasible_is_an_error(graph):
    tiny = Cluster(name="tiny", devices=(Device(name="a", flops=1e12, memory=1000.0),
                                         Device(name="b", flops=1e12, memory=1000.0)),
                   collectives=fits_from_network(2, 1e9, 1e-5))
    from hap.balance.lp import BalanceError
    from hap.planner import baseline_plan
    with pytest.raises(BalanceError, match=r"out of memory: .* needs [\d.]+ KiB on device \d \([ab]\), which has 1000 B"):
        plan(graph, tiny)
    # a baseline asked for by name is planned anyway, and says it does not fit
    assert "  DOES NOT FIT: device 0 needs" in baseline_plan(graph, tiny, "dp-ev").summary()
    assert "DOES NOT FIT" not in plan(graph, load_cluster("local")).summary()


@pytest.mark.parametrize("argv,message", [
    (["plan", "--model", "resnet"], "unknown model 'resnet'"),
    (["plan", "--model", "vit", "--cluster", "no-such-cluster"], "no cluster named 'no-such-cluster'"),
    (["plan", "--model", "vit", "--segments", "0"], "--segments must be at least 1"),
])
def test_cli_errors_are_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cli_zero_memory_device(tmp_path, capsys):
    f = tmp_path / "bad.yaml"
    f.write_text("devices:\n  - {name: gpu0, flops: 1e12, memory: 0}\n  - {name: gpu1, flops: 1e12, memory: 1GiB}\n"
                 "network: {bandwidth: 1GB/s}\n")
    assert main(["plan", "--model", "vit", "--cluster", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert "memory must be positive" in err and "gpu0" in err and len(err.splitlines()) == 1


def test_cli_plan_writes_json(tmp_path):
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "hap", "plan", "--model", "vit", "--scale", "small", "--cluster", "local",
                           "--json", str(out), "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["estimated_iteration_seconds"] > 0 and "dp_cp" in data["baselines"]
    assert "estimated iteration" in proc.stdout


def test_largest_params_leave_the_budget():
    # Parameters of 1600, 1024 and 256 bytes (400 + 256 + 64 floats); adam keeps 4x their
    # bytes: 6400 + 4096 + 1024 = 11520 in all.
    # A frozen parameter keeps its weights only: d, of 2000 bytes, counts 2000.
    from hap.planner import _largest_params

    def fake_cost(sizes, frozen=()):  # a graph with only parameters, priced by CostModel.state_bytes
        tensors = {n: SimpleNamespace(name=n, kind="param", nbytes=b, requires_grad=n not in frozen)
                   for n, b in sizes.items()}
        cost = SimpleNamespace(graph=SimpleNamespace(tensors=tensors), state_factor=4)
        cost.state_bytes = lambda name: CostModel.state_bytes(cost, name)
        return cost

    fake = fake_cost({"a": 1600, "b": 1024, "c": 256})
    assert _largest_params(fake, 11520) == set()
    assert _largest_params(fake, 5120) == {"a"}  # 11520 - 6400 = 5120 left
    assert _largest_params(fake, 5119) == {"a", "b"}  # 1024 left
    assert _largest_params(fake, 0) == {"a", "b", "c"}
    frozen = fake_cost({"a": 1600, "b": 1024, "c": 256, "d": 2000}, frozen={"d"})
    assert _largest_params(frozen, 5120 + 2000) == {"a"}  # d is not the largest state: 2000 < 6400


def test_memory_tight_cluster_shards_large_parameters(graph):
    """Replicated, the MLP's parameter state (33k floats, 4x for adam: 532 KB) exceeds each
    device's 400 KB, and the link is so slow that every unrestricted program replicates. The
    planner must then find a program with the large parameters sharded that fits."""
    tight = Cluster(name="tight", devices=(Device(name="a", flops=2e12, memory=400e3),
                                          Device(name="b", flops=1e12, memory=400e3)),
                    collectives=fits_from_network(2, 1e5, 1e-5))
    result = plan(graph, tight)
    assert all(m <= 400e3 for m in result.memory_bytes)
    assert "sharded parameters" in result.search["winner"]


def test_the_summary_says_whose_optimizer_state_the_memory_counts(graph, result, tmp_path):
    from hap.planner import priced

    assert "memory per GPU (parameters, gradients, adam state, activations): " in result.summary()
    # hap train prices a plan again for its SGD: no state tensor, less memory, and said so
    plain = priced(graph, load_cluster("paper-hetero-8"), result, PlannerConfig(optimizer="sgd"))
    assert "memory per GPU (parameters, gradients, activations): " in plain.summary()
    assert all(b < a for a, b in zip(result.memory_bytes, plain.memory_bytes))
    path = tmp_path / "plan.json"
    data = json.loads(result.to_json())
    data["search"]["optimizer"] = "lion"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="search optimizer 'lion' is none of adam, momentum, sgd"):
        Plan.from_json(path)


def test_a_fixed_familys_plan_says_its_own_search_was_width_limited(result):
    # a baseline's program is the best a search of its family found (it said "width-limited
    # search: best found, not proven optimal", as if of every program)
    said = dataclasses.replace(result, search={"winner": "megatron", "exhaustive": False, "family": True}).summary()
    assert "winner: megatron (its programs searched width-limited: the best found, not proven the best of them)" in said
    said = dataclasses.replace(result, search={"winner": "hap", "exhaustive": False}).summary()
    assert "winner: hap (width-limited search: best found, not proven optimal)" in said


def test_estimate_reprices_a_plan_exactly(graph, result):
    """planner.estimate replays a plan's program under the graph's and cluster's cost model: with
    nothing changed it gives the planner's own figure, and a slower cluster costs more."""
    from hap.planner import estimate

    cluster = load_cluster("paper-hetero-8")
    again = estimate(graph, cluster, result)
    assert again.seconds == pytest.approx(result.estimated_iteration_seconds, rel=1e-12)
    slower = tuple(dataclasses.replace(d, flops=d.flops / 2) for d in cluster.devices)
    assert estimate(graph, dataclasses.replace(cluster, devices=slower), result).seconds > again.seconds
    with pytest.raises(ValueError, match="the plan is for 8 devices, cluster 'local' has 2"):
        estimate(graph, load_cluster("local"), result)


def test_baseline_at_given_ratios(graph):
    """Data parallelism at any shares (what calibration trains): the batch splits 24/8 at
    0.75/0.25 on two devices, and shares that do not sum to 1 are refused."""
    from hap.cost.cluster import local_cluster
    from hap.planner import baseline_plan

    pair = local_cluster((1.0, 1.0), "pair")
    p = baseline_plan(graph, pair, "dp-ev", ratios=(0.75, 0.25))
    assert p.ratios == [[0.75, 0.25]] and p.shard_sizes(graph.inputs[0], 0) == [24, 8]
    assert p.search["winner"] == "dp-ev's program at the given ratios"
    with pytest.raises(ValueError, match="ratios must be 2 non-negative shares summing to 1"):
        baseline_plan(graph, pair, "dp-ev", ratios=(0.75, 0.5))


def test_plan_v2_is_typed_and_self_contained(graph, result):
    """Stages with a device group, per-(tensor, dim, segment) shard sizes, per-parameter sync
    in bucket order; every sharded tensor dim of the program has its sizes."""
    from hap.plan import Instruction, SyncEntry
    from hap.search.program import synced_params

    assert result.version == 2 and result.schedule is None and len(result.stages) == 1
    stage = result.stage
    assert stage.devices == list(range(8)) and stage.nodes == [0, len(graph.nodes) - 1]
    assert all(isinstance(ins, Instruction) for ins in stage.program)
    steps = result.steps(graph)
    seg = [0] * len(graph.nodes)
    assert {e.param for e in result.sync} == set(synced_params(steps, graph, seg))
    assert all(isinstance(e, SyncEntry) and e.strategy == "all_reduce" and e.devices == tuple(range(8)) for e in result.sync)
    assert [e.bucket for e in result.sync] == sorted(e.bucket for e in result.sync)  # launch order
    sharded = {(t, p.dim) for s in steps for t, p in zip(graph.nodes[s.node].inputs, s.strategy.inputs) if p.is_shard}
    assert sharded <= {(sh.tensor, sh.dim) for sh in stage.shards}
    for sh in stage.shards:
        assert sum(sh.sizes) == graph.tensors[sh.tensor].shape[sh.dim] and len(sh.sizes) == 8


def test_two_segments_keep_both_shard_sizes(graph):
    """Every sharded (tensor, dim, segment) has its sizes (Plan v1 kept one per tensor dim)."""
    from hap.cost.model import CostModel
    from hap.plan import shard_sizes
    from hap.planner import _dp
    from hap.rules import strategy_table
    from hap.rules.units import ShardClasses
    from hap.search.astar import synthesize

    strategies = strategy_table(graph)
    classes = ShardClasses(graph, enumerate(strategies))
    cost = CostModel(graph, load_cluster("local"), classes)
    seg = segment_graph(graph, 2)
    ratios = [[0.75, 0.25], [0.4, 0.6]]
    program = synthesize(graph, strategies, cost, seg, ratios, _dp(graph)).program  # the batch split in both
    shards = {(sh.tensor, sh.dim, sh.segment): list(sh.sizes) for sh in shard_sizes(program, graph, classes, seg, ratios)}
    assert shards[(graph.inputs[0], 0, 0)] == [24, 8]
    # fc1's output is made in segment 0 and re-split (rebalanced) for segment 1: both sizes kept
    assert shards[("linear", 0, 0)] == [24, 8] and shards[("linear", 0, 1)] == [13, 19]


def test_old_and_malformed_plans_are_one_line_errors(result, tmp_path):
    data = result.to_dict()
    with pytest.raises(ValueError, match="version-1 plan .* plan the model again") as e:
        Plan.from_dict({**data, "version": 1})
    assert len(str(e.value).splitlines()) == 1
    with pytest.raises(ValueError, match="malformed plan"):
        Plan.from_dict({k: v for k, v in data.items() if k != "stages"})
    with pytest.raises(ValueError, match="malformed plan: a JSON object is expected, not a list"):
        Plan.from_dict([1, 2])
    n = len(data["devices"])
    with pytest.raises(ValueError, match=f"do not split its {n - 1} devices once each"):  # a device dropped by hand
        Plan.from_dict({**data, "devices": data["devices"][:-1]})
    stage = {**data["stages"][0], "ratios": [row[:-1] for row in data["stages"][0]["ratios"]]}
    with pytest.raises(ValueError, match=f"stage 0 has {n} devices but ratios"):
        Plan.from_dict({**data, "stages": [stage]})
    negative = {**data["stages"][0], "ratios": [[-0.5, *row[1:-1], row[-1] + 0.5 + row[0]] for row in data["stages"][0]["ratios"]]}
    with pytest.raises(ValueError, match=r"stage 0's ratios .* must be finite shares at least 0, some positive, of "
                                         r"a finite sum$"):
        Plan.from_dict({**data, "stages": [negative]})  # trained until a rank failed; explain drew it
    huge = {**data["stages"][0], "ratios": [[1e308] * n]}  # finite, their sum not: "cannot convert float NaN to integer"
    with pytest.raises(ValueError, match=r"of a finite sum$"):
        Plan.from_dict({**data, "stages": [huge]})
    # nodes and segments shrunk to the first two nodes: an IndexError in check_fits
    short = {**data["stages"][0], "nodes": [0, 1], "segments": [[0, 1]]}
    with pytest.raises(ValueError, match=r"^malformed plan: stage 0 runs nodes \[0, 1\] with a program of \d+ "
                                         r"instructions, one per node$"):
        Plan.from_dict({**data, "stages": [short]})
    sh = {"tensor": "x", "dim": 0, "segment": 0, "sizes": [1] * n}
    for bad in ({**sh, "dim": "0"}, {**sh, "sizes": [1.5] * n}, {**sh, "sizes": [1]}):  # a TypeError in check_fits
        odd = {**data["stages"][0], "shards": [bad, *data["stages"][0]["shards"]]}
        with pytest.raises(ValueError, match=r"^malformed plan: stage 0 splits .* a dim and a whole number of rows per "
                                             r"device of the stage$"):
            Plan.from_dict({**data, "stages": [odd]})
    gap = {**data["stages"][0], "nodes": [1, data["stages"][0]["nodes"][1]]}  # failed inside the ranks
    with pytest.raises(ValueError, match=r"node ranges \[\[1, \d+\]\] must cover the model's nodes in order"):
        Plan.from_dict({**data, "stages": [gap]})
    for field, value in (("estimated_iteration_seconds", "fast"), ("breakdown", [1]), ("cluster", None)):
        with pytest.raises(ValueError, match=f"^malformed plan: {field} is "):  # summary() died on each
            Plan.from_dict({**data, field: value})
    # loaded, then explain raised IndexError on each (True == 1 read as version 1)
    with pytest.raises(ValueError, match=r"^plan format version True is not 2$"):
        Plan.from_dict({**data, "version": True})
    # a cluster file given for a plan: it said "plan format version None is not 2"
    with pytest.raises(ValueError, match=r"""^not a hap plan: a plan \(what `hap plan --json` writes\) has a "version" """
                                         r"""field, this object has 'name', 'devices', 'network'$"""):
        Plan.from_dict({"name": "mine", "devices": [], "network": {}})
    no_shares = {**data["stages"][0], "ratios": []}
    with pytest.raises(ValueError, match=r"^malformed plan: stage 0 has ratios \[\] for \[\[0, \d+\]\] segments: a row "
                                         "of shares per segment$"):
        Plan.from_dict({**data, "stages": [no_shares]})
    entry = {"param": "p_w", "bucket": 0, "devices": [0]}
    with pytest.raises(ValueError, match=r"^sync of p_w: bucket must be an integer, got '0'$"):
        Plan.from_dict({**data, "sync": [{**entry, "bucket": "0"}]})
    with pytest.raises(ValueError, match=r"^malformed plan: sync entry 0's devices must be a list, got str \"01\"$"):
        Plan.from_dict({**data, "sync": [{**entry, "devices": "01"}]})
    with pytest.raises(ValueError, match=r"^sync of p_w: devices must be device numbers, got \['0', '1'\]$"):
        Plan.from_dict({**data, "sync": [{**entry, "devices": ["0", "1"]}]})
    # nested objects named with their field, not in Python's words ("Instruction.__init__() got an
    # unexpected keyword argument 'zzz'", "'int' object is not iterable", "string indices must be integers")
    stage = data["stages"][0]
    ins = stage["program"][0]
    for change, says in [
            ({"stages": [{**stage, "program": [{**ins, "zzz": 1}]}]},
             r"stage 0's instruction 0 has a field 'zzz' it cannot have; its fields: node, op, "),
            ({"stages": [{**stage, "program": [{k: v for k, v in ins.items() if k != "op"}]}]},
             r"stage 0's instruction 0 has no field 'op'$"),
            ({"sync": [{**entry, "devices": 0}]}, r"sync entry 0's devices must be a list, got int 0$"),
            ({"sync": {"p_w": entry}}, r"sync must be a list, got dict "),
            ({"stages": {"0": stage}}, r"stages must be a list, got dict "),
            ({"stages": [{**stage, "program": ["add"]}]}, r"stage 0's instruction 0 must be an object, got str \"add\"$"),
            ({"schedule": "gpipe"}, r"its schedule must be an object, got str \"gpipe\"$"),
            ({"schedule": {"name": "gpipe", "micro_batches": 2}},
             r"a plan of one stage has no pipeline schedule; its schedule must be null$"),
            ({"cluster": {**data["cluster"], "name": 5}}, r"its cluster's name must be text, got 5$")]:
        with pytest.raises(ValueError, match=r"^malformed plan: " + says):
            Plan.from_dict({**data, **change})
    with pytest.raises(ValueError, match="needs a pipeline schedule"):
        dataclasses.replace(result, stages=result.stages * 2)
    for name, micro in (("zigzag", 4), ("1f1b", 0), ("gpipe", True)):
        bad = dataclasses.replace(result, stages=result.stages * 2, schedule=hap_schedule(name, micro)).to_dict()
        with pytest.raises(ValueError, match=rf"^malformed plan: pipeline schedule '{name}' of {micro} micro-batches"):
            Plan.from_dict(bad)
    pipeline = dataclasses.replace(result, stages=result.stages * 2, schedule=hap_schedule())
    with pytest.raises(ValueError, match="pipeline of 2 stages"):
        pipeline.ratios
    # each failed with an IndexError, KeyError or TypeError in the CLI, or inside the ranks
    st = data["stages"][0]
    for edit, message in (
            ({"stages": [{**st, "segments": [[0, 10]]}]}, r"stage 0's segments \[\[0, 10\]\] must cover its nodes"),
            ({"stages": [{**st, "shards": [{"tensor": "x", "dim": 0, "segment": 3, "sizes": [4] * n}]}]},
             r"stage 0 splits x in segment 3 of its 1"),
            ({"baselines": {"x": {}}}, "every baseline needs its seconds"),
            ({"stages": [{**st, "devices": st["devices"][::-1]}]}, r"a one-stage plan runs on its devices in rank order"),
            ({"search": {**data["search"], "gap": "big"}}, "search gap 'big' is not a number"),
            ({"estimated_iteration_seconds": -1.0}, "its estimate and its devices' memory must be finite positive"),
            # these were taken and shown as the plan's: inf ms, nan%, a baseline "0.00x"
            ({"estimated_iteration_seconds": float("inf")}, "its estimate and its devices' memory must be finite"),
            ({"breakdown": {**data["breakdown"], "forward_compute": float("nan")}}, "breakdown and memory_bytes must "
                                                                                     "hold finite numbers, none negative"),
            ({"memory_bytes": [-1.0] * n}, "breakdown and memory_bytes must hold finite numbers, none negative"),
            ({"baselines": {"x": {"seconds": 0.0}}}, "every baseline needs its seconds, a finite positive number"),
            ({"stages": [{**st, "program": [{**st["program"][0], "loads": [["x", "S(0)", "extra"]]}, *st["program"][1:]]}]},
             r"instruction '\w+' loads must be a list of \[tensor, placement\] pairs"),
            # these raised a TypeError or an AttributeError in hap train --plan and hap explain
            ({"replicated_ops": [1, None]}, "replicated_ops must be a list of op names"),
            ({"cluster": {**data["cluster"], "devices": "x"}}, "its cluster's devices must be a list of objects"),
            ({"stages": [{**st, "devices": [str(d) for d in st["devices"]]}]},
             r"the stages' device groups \[\['0', '1', .*\]\] must be lists of device numbers"),
            ({"stages": [{**st, "ratios": st["ratios"][0]}]}, r"stage 0's ratios \[.*\] must be a row of shares per segment")):
        with pytest.raises(ValueError, match="^malformed plan: " + message):
            Plan.from_dict({**data, **edit})
    # a sum's rounding is not an edit: hap sync wrote -2.3e-18 for a hidden sync, refused by the check above
    Plan.from_dict({**data, "breakdown": {**data["breakdown"], "gradient_sync_overlapped": -2.3e-18}})
    with pytest.raises(ValueError, match="^malformed plan: its JSON nests too deeply$"):  # a RecursionError
        Plan.from_json('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    # these said Python's words: "malformed plan: 'program'", "Plan.__init__() missing 1 required
    # keyword-only argument: 'cluster'", or a bare JSONDecodeError, FileNotFoundError, IsADirectoryError
    for edit, message in (({"stages": [{k: v for k, v in st.items() if k != "program"}]}, "stage 0 has no field 'program'"),
                          ({"sync": [{}]}, "sync entry 0 has no field 'param'"),
                          ({"cluster": None, "colour": 1}, "unknown field 'colour'")):
        with pytest.raises(ValueError, match="^malformed plan: " + message + "$"):
            Plan.from_dict({**data, **edit})
    with pytest.raises(ValueError, match="^malformed plan: no field 'cluster'$"):
        Plan.from_dict({k: v for k, v in data.items() if k != "cluster"})
    bad = tmp_path / "plan.json"
    bad.write_text("")
    for path, message in ((bad, "not valid JSON \\(Expecting value at line 1\\)"), (tmp_path / "none.json", "cannot read it "
                          "\\(No such file or directory\\)"), (tmp_path, "cannot read it \\(Is a directory\\)")):
        with pytest.raises(ValueError, match=f"^plan file {path}: {message}$"):
            Plan.from_json(path)


def test_a_shard_beyond_the_tensors_dims_or_a_share_near_the_float_limit_is_one_line(graph):
    """An IndexError and an OverflowError (n * share overflowed in round_sizes) in check_fits."""
    from hap.planner import baseline_plan
    from hap.rules.units import round_sizes

    result = baseline_plan(graph, load_cluster("local"), "dp-ev")  # the batch split: shards
    st = result.stages[0]
    sh = st.shards[0]
    wrong_dim = dataclasses.replace(sh, dim=len(graph.tensors[sh.tensor].shape))
    with pytest.raises(ValueError, match=rf"^the plan splits {sh.tensor} dim {wrong_dim.dim}, a tensor of "):
        dataclasses.replace(result, stages=[dataclasses.replace(st, shards=[wrong_dim, *st.shards[1:]])]).check_fits(graph)
    assert round_sizes(10, [1e308, 0.25]) == [10, 0] and round_sizes(10, [0.75, 0.25]) == [8, 2]
    # and only there the other order: ties and tiny shares round as they did (plan files hold them)
    assert round_sizes(3, [1 / 6] * 6) == [0, 0, 0, 1, 1, 1] and round_sizes(10, [1e-320, 3e-320]) == [2, 8]


def test_a_program_that_takes_what_it_does_not_hold_is_refused_before_it_runs(graph, result):
    """A placement edited by hand (an input taken as S(0) where its load is R, an output on a dim
    it lacks) passed every check and failed inside the ranks with a KeyError."""
    data = result.to_dict()
    st = data["stages"][0]
    first = st["program"][0]
    (name, p), = [(t, q) for t, q in first["inputs"] if t in graph.params][:1]
    other = "R" if p != "R" else "S(0)"
    taken = {**first, "inputs": [[t, other if t == name else q] for t, q in first["inputs"]]}
    with pytest.raises(ValueError, match=rf"^the plan runs {first['node']} on {name} as {re.escape(other)}, which it "
                                         r"does not hold so there \(a hand-edited plan\?\)$"):
        Plan.from_dict({**data, "stages": [{**st, "program": [taken, *st["program"][1:]]}]}).check_fits(graph)
    out, q = first["outputs"][0]
    no_dim = {**first, "outputs": [[out, "S(7)"]]}
    with pytest.raises(ValueError, match=rf"^the plan places {out} as S\(7\) at {first['node']}, a tensor of \d dims"):
        Plan.from_dict({**data, "stages": [{**st, "program": [no_dim, *st["program"][1:]]}]}).check_fits(graph)
    result.check_fits(graph)  # as planned: fits


def hap_schedule(name="1f1b", micro_batches=4):
    from hap.plan import Schedule

    return Schedule(name=name, micro_batches=micro_batches)


def test_megatron_splits_weights_that_autocast_casts_first():
    """Under autocast a linear layer reads a bfloat16 copy of its weight: the Megatron baseline
    splits the parameter behind the cast (it used to split nothing)."""
    import hap
    from hap.planner import baseline_plan

    class Autocast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.fc2(torch.relu(self.fc1(x)))
            return h.float().pow(2).mean()

    graph = hap.capture(Autocast(), (torch.randn(10, 16),))
    plan = baseline_plan(graph, hap.load_cluster("local"), "megatron", ratios=[0.6, 0.4])
    loads = {ld.tensor: ld.placement for st in plan.steps(graph) for ld in st.loads}
    assert loads["p_fc1_weight"].is_shard and loads["p_fc2_weight"].is_shard


def test_megatron_keeps_a_one_by_one_linear_whole():
    """A 1x1 weight has no dim to split: Megatron splits the other linears and keeps it whole
    (it found no allowed strategy for the 1x1 node and failed)."""
    from hap.planner import baseline_plan

    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.gate = torch.nn.Linear(8, 8), torch.nn.Linear(1, 1)

        def forward(self, x):  # x: [B, 8]
            return (self.fc(x) * torch.sigmoid(self.gate(x[:, :1]))).pow(2).mean()

    graph = capture(Gate(), (torch.randn(10, 8),))
    plan = baseline_plan(graph, load_cluster("local"), "megatron", ratios=[0.6, 0.4])
    loads = {ld.tensor: ld.placement for st in plan.steps(graph) for ld in st.loads}
    assert loads["p_fc_weight"].is_shard and not loads["p_gate_weight"].is_shard


@settings(max_examples=200, deadline=None)
@given(work=hs.lists(hs.floats(0, 1e9), min_size=2, max_size=40), segments=hs.integers(1, 6))
def test_every_segment_holds_a_node_however_the_work_lies(work, segments):
    # a first node with most of the FLOPs once put the first cut at node 0: no segment 0
    graph = SimpleNamespace(nodes=[SimpleNamespace(flops=w, bwd_flops=0.0) for w in work], tensors={})
    if len(work) < 2 * segments:  # too few nodes: a one-line error (it planned one segment, silently)
        with pytest.raises(ValueError, match=f"^{segments} segments: the model has {len(work)} nodes, enough for at "
                                             f"most {max(1, len(work) // 2)}$"):
            segment_graph(graph, segments)
        return
    seg = segment_graph(graph, segments)
    assert len(seg) == len(work) and seg == sorted(seg)
    assert set(seg) == set(range(segments))


class BigMLP(nn.Module):
    """0.8 MB of weights, 2.4 MB with gradients and momentum: more than a 1.5 MB device holds."""

    def __init__(self, d=256, frozen_first=False):
        super().__init__()
        self.l1, self.l2, self.l3, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 8)
        self.l1.requires_grad_(not frozen_first)

    def forward(self, x, y):
        h = torch.relu(self.l3(torch.relu(self.l2(torch.relu(self.l1(x))))))
        return nn.functional.cross_entropy(self.head(h), y)


def _small_memory(slowdowns, memory):
    from hap.cost.cluster import local_cluster
    c = local_cluster(slowdowns, "small-memory")
    return dataclasses.replace(c, devices=tuple(dataclasses.replace(d, memory=memory) for d in c.devices))


def test_where_replicas_do_not_fit_the_planners_shard_or_say_why():
    from hap.planners import make_plan
    graph = capture(BigMLP(), (torch.randn(12, 256), torch.randint(0, 8, (12,))))
    config = PlannerConfig(optimizer="momentum")
    # the sharded-parameter search split the data on the batch too, which a first layer whose
    # weight is sharded cannot take: astar said out of memory where Megatron's plan fits
    two = _small_memory((1.0, 3.0), 1.5e6)
    assert all(m <= 1.5e6 for m in make_plan("astar", graph, two, config).memory_bytes)
    three = _small_memory((1.0, 2.0, 3.0), 1.0e6)
    assert all(m <= 1.0e6 for m in make_plan("astar", graph, three, config).memory_bytes)
    # on 3 devices the pipeline planners tried 2, 4 and 8 stages where they divide 3: none
    pipe = make_plan("pp-exact", graph, three, config)
    assert len(pipe.stages) in (2, 3) and all(m <= 1.0e6 for m in pipe.memory_bytes)
    with pytest.raises(ValueError, match=r"^no planner found a plan \(astar: out of memory: .* on device \d .*; "
                                         r"pp-exact: .*\)$"):  # was: no planner found a plan
        make_plan("auto", graph, _small_memory((1.0, 2.0, 3.0), 2e5), config)
    # a knob auto's planners cannot honour is an error, not a silent fallback to the other planner
    big = _small_memory((1.0, 2.0), 1e9)
    with pytest.raises(ValueError, match=r"^auto: pp-exact cannot plan as asked: "):
        make_plan("auto", graph, big, PlannerConfig(micro_batches=1000))
    with pytest.raises(ValueError, match=r"^auto: astar cannot plan as asked: 500 segments: the model has"):
        make_plan("auto", graph, big, PlannerConfig(segments=500))
    # pipeline knobs for a pipeline that loses to astar: kept silently, now said
    said = []
    kept = make_plan("auto", graph, big, PlannerConfig(pipeline_stages=2, micro_batches=2), said.append)
    assert len(kept.stages) == 1 and set(kept.search["auto"]) == {"astar", "pp-exact"}
    assert said[-1] == ("auto: kept astar's plan, faster than the pipeline --pipeline-stages/--micro-batches asked "
                        "for (plan with --planner pp-exact for that pipeline)")
    assert f"  note: {said[-1]}" in kept.summary().splitlines()  # said under --quiet too
    said.clear()  # a schedule alone asks for a pipeline too (it was dropped without a word)
    kept = make_plan("auto", graph, big, PlannerConfig(schedule="gpipe"), said.append)
    assert len(kept.stages) == 1 and kept.search["note"] == said[-1] == (
        "auto: kept astar's plan, faster than the pipeline --schedule asked for (plan with --planner pp-exact for "
        "that pipeline)")
    said.clear()  # the default schedule, asked for by name, asks for a pipeline too (it was dropped silently)
    kept = make_plan("auto", graph, big, PlannerConfig(schedule="1f1b"), said.append)
    assert len(kept.stages) == 1 and kept.search["note"] == said[-1]
    with pytest.raises(ValueError, match=r"^PlannerConfig.schedule is for the planners pp-exact, dqn, auto, not astar"):
        make_plan("astar", graph, big, PlannerConfig(schedule="1f1b"))
    # one device: no pipeline ("pp-exact" made one of a stage, and auto kept it on a rounding tie with astar's)
    one = _small_memory((1.0,), 1e9)
    with pytest.raises(ValueError, match=r"^a pipeline needs 2 devices and a point to cut the model at least: 1 device, "):
        make_plan("pp-exact", graph, one, config)
    assert make_plan("auto", graph, one, config).search.get("planner", "astar") == "astar"
    with pytest.raises(ValueError, match=r"^auto: pp-exact cannot plan as asked: a pipeline needs 2 devices"):
        make_plan("auto", graph, one, PlannerConfig(pipeline_stages=1))


def test_a_knob_a_planner_does_not_read_is_refused():
    """make_plan and hap.plan ignored a pipeline knob given to astar (one stage, silently), or
    segments given to a pipeline planner; PlannerConfig took an unknown optimizer (a KeyError
    in the cost model) and hap.plan a cluster's name (an AttributeError)."""
    from hap.planners import make_plan
    graph = capture(BigMLP(), (torch.randn(12, 256), torch.randint(0, 8, (12,))))
    cluster = load_cluster("local")
    for name, config, message in (
            ("astar", PlannerConfig(pipeline_stages=2), "PlannerConfig.pipeline_stages is for the planners pp-exact, "
                                                        "dqn, auto, not astar"),
            ("dp-ev", PlannerConfig(schedule="gpipe"), "PlannerConfig.schedule is for the planners pp-exact, dqn, auto"),
            ("pp-exact", PlannerConfig(segments=3), "PlannerConfig.segments is for the planners astar, auto, not pp-exact")):
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            make_plan(name, graph, cluster, config)
    with pytest.raises(ValueError, match=r"^PlannerConfig.micro_batches is for the pipeline planners"):
        plan(graph, cluster, PlannerConfig(micro_batches=4))
    with pytest.raises(TypeError, match=r"^cluster must be a hap Cluster \(hap.load_cluster\('local'\), say\), got str$"):
        plan(graph, "local")
    # a model for a graph, or no example inputs: AttributeError and TypeError deep inside
    with pytest.raises(TypeError, match=r"^graph must be a hap Graph \(hap.capture\(model, example_inputs\)\), got BigMLP$"):
        plan(BigMLP(), cluster)
    with pytest.raises(TypeError, match=r"^graph must be a hap Graph .*, got BigMLP$"):
        make_plan("pp-exact", BigMLP(), cluster)
    from hap.capture import CaptureError
    with pytest.raises(CaptureError, match=r"^example inputs must be a tuple of tensors, one per forward argument, not NoneType$"):
        capture(BigMLP(), None)
    with pytest.raises(ValueError, match=r"^PlannerConfig.optimizer must be one of adam, momentum, sgd, got 'lamb'$"):
        PlannerConfig(optimizer="lamb")
    with pytest.raises(ValueError, match=r"^PlannerConfig.segments must be a whole number of at least 1, got 0$"):
        PlannerConfig(segments=0)
    for width in (0, -1, 2.5, "24", True):  # -1 meant no limit (18 s on a small ViT), 2.5 a pybind traceback
        with pytest.raises(ValueError, match=r"^PlannerConfig.width must be a whole number of at least 1 or None \(no limit\)"):
            PlannerConfig(width=width)
    for after in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match=r"^PlannerConfig.width_after must be a number of at least 0"):
            PlannerConfig(width_after=after)


def test_a_frozen_parameter_holds_no_gradient_or_optimizer_state():
    # every parameter was priced at weights + gradient + optimizer states: a fine-tuning setup
    # that fits was refused (3.2 MB estimated, 0.8 MB held)
    from hap.cost.model import CostModel
    from hap.search.program import memory_terms
    graph = capture(BigMLP(frozen_first=True), (torch.randn(12, 256), torch.randint(0, 8, (12,))))
    plan_ = plan(graph, load_cluster("local"), PlannerConfig(optimizer="adam"))
    cost = CostModel(graph, load_cluster("local"), ShardClasses(graph, enumerate(strategy_table(graph))), "adam")
    terms = {name: nbytes for name, _, _, nbytes, _ in memory_terms(plan_.steps(graph), cost, plan_.segment_of)}
    w1, w2 = graph.params[0], graph.params[2]  # l1.weight (frozen) and l2.weight, 256 x 256 floats each
    assert graph.tensors[w1].target == "l1.weight" and graph.tensors[w2].target == "l2.weight"
    assert (terms[w1], terms[w2]) == (256 * 256 * 4, 256 * 256 * 4 * 4)  # adam: weights, gradient, 2 moments


def test_dqn_opp_keeps_a_frozen_parameter_whole():
    # its decisions are over the trainable parameters: a frozen one was a KeyError
    from hap.planners import make_plan
    graph = capture(BigMLP(d=16, frozen_first=True), (torch.randn(12, 16), torch.randint(0, 8, (12,))))
    found = make_plan("dqn-opp", graph, load_cluster("local"))
    assert "l1.weight" not in {graph.tensors[p].target for p in found.search["split_parameters"]}


def test_a_batch_too_small_for_the_shares_says_which_devices_idle():
    """A batch of 2 over 4 devices at even shares runs as 1/1/0/0 rows: the summary printed the
    shares alone, as if all four worked."""
    from hap import capture, load_cluster
    from hap.planner import baseline_plan

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.fc(x).pow(2).mean()

    cluster = load_cluster("local-4")
    small = baseline_plan(capture(Net(), (torch.randn(2, 4),)), cluster, "dp-ev")
    assert small.ratios == [[0.25] * 4] and small.idle_devices(0) == [2, 3]
    assert "note: devices [2, 3] get none of any split tensor in segment 0" in small.summary()
    large = baseline_plan(capture(Net(), (torch.randn(8, 4),)), cluster, "dp-ev")
    assert large.idle_devices(0) == [] and "note: devices" not in large.summary()


def test_steps_the_rules_and_moves_do_not_give_are_refused(graph):
    """A Megatron plan edited by hand: the row-parallel linear's partial-sum output relabelled
    duplicated (its all-reduce dropped), or a move's collective renamed, passed every check and
    trained to a wrong loss, or was priced without its collective. A plan for another model is
    said to be one (it was blamed on hand-editing)."""
    from hap.planner import baseline_plan

    cluster = load_cluster("local")
    megatron = baseline_plan(graph, cluster, "megatron")
    data = megatron.to_dict()
    st = data["stages"][0]
    k, ins = next((k, ins) for k, ins in enumerate(st["program"]) if ins["moves"])
    forged = {**ins, "moves": [{**ins["moves"][0], "fwd": None}, *ins["moves"][1:]]}
    with pytest.raises(ValueError, match=r"^the plan moves \S+ by \w+ .*, which is no move hap has \(a hand-edited "
                                         r"plan\?\)$"):
        Plan.from_dict({**data, "stages": [{**st, "program": [*st["program"][:k], forged, *st["program"][k + 1:]]}]}
                       ).check_fits(graph)
    renamed = {**st["program"][0], "strategy": "bogus"}
    with pytest.raises(ValueError, match=r"^the plan runs \w+ \(aten\.\S+\) as bogus: .* which its rules do not give"):
        Plan.from_dict({**data, "stages": [{**st, "program": [renamed, *st["program"][1:]]}]}).check_fits(graph)
    megatron.check_fits(graph)  # as made: fits
    with pytest.raises(ValueError, match=r"^the plan does not run node \w+ of this model's \d+: a plan made for "
                                         r"another model$"):
        megatron.check_fits(capture(TwoMLPs(), (torch.randn(32, 64),)))


class TwoMLPs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = MLP(), MLP()

    def forward(self, x):
        return self.a(x) + self.b(x)


class Reused(nn.Module):
    """One layer applied 12 times: its weight loaded duplicated in both segments of two."""

    def __init__(self):
        super().__init__()
        self.layer, self.out = nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x, y):
        for _ in range(12):
            x = torch.tanh(self.layer(x))
        return nn.functional.cross_entropy(self.out(x), y)


def test_a_parameter_loaded_whole_in_two_segments_is_kept_once():
    """Loaded duplicated in two segments, the reused weight counted as loaded in two placements:
    kept whole and all-reduced, which made two segments 2x slower than one (whose plan is a
    candidate)."""
    from hap.cost.cluster import cluster_from_dict
    from hap.search.program import synced_params

    gen = torch.Generator().manual_seed(0)
    graph = capture(Reused(), (torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)))
    cluster = cluster_from_dict({"name": "c", "network": {"bandwidth": "10Gbps", "latency": "30us"},
                                 "devices": [{"name": "a", "flops": 2e12, "memory": "16GiB"},
                                             {"name": "b", "flops": 1e12, "memory": "16GiB"}]})
    one, two = plan(graph, cluster), plan(graph, cluster, PlannerConfig(segments=2))
    assert two.estimated_iteration_seconds <= one.estimated_iteration_seconds * (1 + 1e-9)
    assert synced_params(one.steps(graph), graph, segment_graph(graph, 2)) == synced_params(one.steps(graph), graph,
                                                                                          one.segment_of)


class Deep(nn.Module):
    def __init__(self, n=4, d=512):
        super().__init__()
        self.layers, self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(n)), nn.Linear(d, 10)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return nn.functional.cross_entropy(self.out(x), y)


def test_balanced_ratios_fit_after_rounding_to_whole_rows():
    """The LP put the slow device exactly at its capacity; whole-row shards were 0.1% over, every
    balanced candidate was dropped and planning said out of memory, though the planner's own
    memory-frugal program fits at other ratios. Now the device's capacity is lowered by its
    overflow and the LP solved again."""
    from hap.cost.cluster import cluster_from_dict

    gen = torch.Generator().manual_seed(0)
    graph = capture(Deep(), (torch.randn(16, 512, generator=gen), torch.randint(0, 10, (16,), generator=gen)))
    state = sum(t.nbytes for t in graph.tensors.values() if t.kind == "param") * 4  # weights, grads, Adam's moments
    caps = [int(state * 0.8), int(state * 0.4)]
    cluster = cluster_from_dict({"name": "c", "network": {"bandwidth": "10Gbps", "latency": "30us"}, "devices": [
        {"name": "d0", "flops": 4e12, "memory": f"{caps[0]}B"}, {"name": "d1", "flops": 1e12, "memory": f"{caps[1]}B"}]})
    found = plan(graph, cluster)
    assert all(m <= c for m, c in zip(found.memory_bytes, caps))


def test_a_resplit_into_the_same_sizes_is_counted_in_memory_once(graph):
    """A segment's re-split into the sizes a tensor already has returns that very tensor
    (collectives.resplit): memory counted it a second time."""
    from hap.planner import _dp, _plan_at
    from hap.search.program import memory

    cluster = load_cluster("local")
    seg = segment_graph(graph, 2)
    planned = _plan_at(graph, cluster, [[0.75, 0.25], [0.4, 0.6]], None,
                       lambda search, rs: search(rs, _dp(graph)), "dp", seg)
    program = planned.steps(graph)
    bare = [dataclasses.replace(step, moves=tuple(m for m in step.moves if m.move.name != "rebalance")) for step in program]
    assert bare != program
    cost = CostModel(graph, cluster, ShardClasses(graph, enumerate(strategies_for(n, graph) for n in graph.nodes)))
    same, other = [[0.75, 0.25]] * 2, [[0.75, 0.25], [0.4, 0.6]]
    assert memory(program, cost, seg, same) == memory(bare, cost, seg, same)
    assert memory(program, cost, seg, other)[0] > memory(bare, cost, seg, other)[0]  # both splits live


class WithTable(nn.Module):
    """A 1 MiB buffer (a lookup table, a causal mask, a rotary cache) beside small layers."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(64, 64), nn.Linear(64, 10)
        self.register_buffer("table", torch.randn(4096, 64))

    def forward(self, x, idx, y):
        return nn.functional.cross_entropy(self.head(self.lin(x) + self.table[idx]), y)


def test_memory_counts_the_buffers_every_device_keeps():
    """Every device keeps the table whole: 1 MiB on each. Plans left buffers out (93 KB said,
    1.1 MB held after a step in a hunt's run), so a plan that could not fit was taken."""
    from hap.pipeline.plan import PipelineSpace
    from hap.planner import baseline_plan
    example = (torch.randn(20, 64), torch.randint(0, 4096, (20,)), torch.randint(0, 10, (20,)))
    graph = capture(WithTable(), example)
    cluster = load_cluster("local")
    assert all(m > 2 ** 20 for m in baseline_plan(graph, cluster, "dp-cp", ratios=[0.6, 0.4]).memory_bytes)
    assert all(m > 2 ** 20 for m in plan(graph, cluster).memory_bytes)
    space = PipelineSpace(graph, cluster)
    assert all(m > 2 ** 20 for m in space.pricer.memory(0, 2, [0], [1.0], 2, 1))
    tight = dataclasses.replace(cluster, devices=tuple(dataclasses.replace(d, memory=3e5) for d in cluster.devices))
    with pytest.raises(ValueError, match="out of memory"):
        plan(graph, tight)


def test_check_shards_says_in_one_line_which_shard_is_not_this_models():
    """Plan.check_shards, which check_fits, hap.HAP and the pipeline runtime call (each had its
    own copy, and the runtimes' raised IndexError on a dim the tensor lacks or did not check
    the tensor), on a plan edited three ways."""
    from hap.planners import make_plan

    graph = capture(BigMLP(), (torch.randn(12, 256), torch.randint(0, 8, (12,))))
    classes = ShardClasses(graph, enumerate(strategy_table(graph)))
    tp = make_plan("megatron", graph, load_cluster("local"))
    tp.check_shards(graph, classes)

    def edited(**change):
        d = tp.to_dict()
        d["stages"][0]["shards"][0].update(change)
        return Plan.from_dict(d)
    name = tp.stages[0].shards[0].tensor
    for bad, says in ((edited(dim=7), rf"^the plan splits {name} dim 7, a tensor of 2 dims \(a hand-edited plan\?\)$"),
                      (edited(tensor="p_nope"), r"^the plan splits p_nope dim 0 into .*, this model has no p_nope: a plan"),
                      (edited(sizes=[1, 2]), rf"^the plan splits {name} dim 0 into \[1, 2\], this model into \[")):
        with pytest.raises(ValueError, match=says):
            bad.check_shards(graph, classes)


def test_a_pipeline_plan_whose_micro_batches_were_edited_says_so():
    """It blamed stage 0's ratios [0.25, 0.25, 0.25, 0.25] (its pieces), where the file says
    [1.0] and its schedule's micro-batches were what changed."""
    from hap.planners import make_plan

    graph = capture(BigMLP(), (torch.randn(12, 256), torch.randint(0, 8, (12,))))
    pipe = make_plan("pp-exact", graph, load_cluster("local-homo"), PlannerConfig(pipeline_stages=2, micro_batches=2))
    pipe.check_fits(graph)
    d = pipe.to_dict()
    d["schedule"]["micro_batches"] = 4
    with pytest.raises(ValueError, match=r"^the plan splits \w+ dim 0 into \[6, 6\], but stage 0's 4 micro-batches "
                                         r"over its devices at \[1\.0\] split it into \[3, 3, 3, 3\]: its schedule's "
                                         r"micro-batches, its ratios or its shards were edited$"):
        Plan.from_dict(d).check_fits(graph)


def test_a_rebalance_between_segments_split_alike_is_not_counted_as_an_instruction():
    # vit (small) on local-4 in 2 segments: both at 0.5/0.5/0/0, a rebalance between them that
    # moves nothing (priced 0, skipped at runtime) was listed as "rebalance x1"
    from hap.models import build
    from hap.planner import PlannerConfig
    model, inputs = build("vit", scale="small")
    p = plan(capture(model, inputs), load_cluster("local-4"), PlannerConfig(segments=2))
    stage = p.stage
    moved = [(i, mv) for i, ins in enumerate(stage.program) for mv in ins.moves if mv.name == "rebalance"]
    assert moved and p.ratios[0] == p.ratios[1]
    line = next(x for x in p.summary().splitlines() if x.startswith("  instructions: "))
    assert "rebalance" not in line
    # the second segment's sizes of the moved tensor edited to differ: it is a move again
    i, mv = moved[0]
    shards = [dataclasses.replace(sh, sizes=tuple(reversed(sh.sizes))) if sh.tensor == mv.tensor and sh.segment == 1
              else sh for sh in stage.shards]
    edited = dataclasses.replace(p, stages=[dataclasses.replace(stage, shards=shards)])
    assert "rebalance x1" in next(x for x in edited.summary().splitlines() if x.startswith("  instructions: "))
