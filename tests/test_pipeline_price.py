"""The pipeline's price in one place (hap.pipeline.price): the exact partition's table prices
every stage as the plan's estimate does; a parameter several stages use (a tied embedding) is
held, and its gradient synchronized, by each of them; device layouts are found without listing
every one."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from test_pipeline import TiedLM  # an embedding whose weight is also the output projection


def _space(model, inputs, speeds, **config):
    import hap
    from hap.cost.cluster import local_cluster
    from hap.pipeline.plan import PipelineSpace
    from hap.planner import PlannerConfig
    return PipelineSpace(hap.capture(model, inputs), local_cluster(speeds, "local"), PlannerConfig(**config))


def _brute_force(space, K, M, groups):
    """(least estimate, its cuts) over every choice of K - 1 pivots, by PipelinePricer.estimate."""
    from hap.pipeline.partition import speed_ratios
    ratios = [speed_ratios(space.cost, g) for g in groups]
    return min((space.pricer.estimate(cuts, groups, ratios, M).seconds, cuts)
               for cuts in itertools.combinations(space.pivots, K - 1))


def _estimates_match_the_table(space, K, M, groups):
    """Every cut's table objective is its estimate, and the exact cut is the brute force's."""
    from hap.pipeline.partition import exact_partition, speed_ratios
    table = space.table(K, M, groups)
    ratios = [speed_ratios(space.cost, g) for g in groups]
    for cuts in itertools.combinations(range(1, len(table.positions) - 1), K - 1):
        est = space.pricer.estimate([int(table.positions[c]) for c in cuts], groups, ratios, M).seconds
        assert table.objective(cuts) == pytest.approx(est, rel=1e-12), cuts
    part = exact_partition(table)
    best, _ = _brute_force(space, K, M, groups)
    assert part.exact and part.seconds == pytest.approx(best, rel=1e-12)
    assert space.pricer.estimate(part.cuts, groups, ratios, M).seconds == pytest.approx(part.seconds, rel=1e-12)


# -- 1. the table is the estimate --------------------------------------------------------------

class _Crossings(torch.nn.Module):
    """Before node 7 three tensors cross: relu [12, 16] split on the batch (768 bytes for the
    whole batch, its gradient comes back), table * 2 [16] replicated with a gradient (64 bytes)
    and a float mask [16] replicated without (64 bytes)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.table = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Parameter(torch.randn(16))

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        pos = self.table * 2
        keep = (torch.arange(16) % 3 != 0).float()
        return ((self.b(h * keep + pos) - y) ** 2).mean()


@pytest.mark.parametrize("paper", [False, True])
def test_crossings_are_priced_as_the_runtime_routes_them(paper):
    """Per micro-batch (M = 2) from group [0, 1] to [2, 3], each pair of devices moves its rows,
    768 / 2 / 2 = 192 bytes, and the first device sends each replicated tensor whole to both
    devices of the next group: forward 192 bytes of rows then 2 x 128 whole, back 192 then
    2 x 64 (the mask has no gradient). They were priced as (768 + 128) / 2 / 2 bytes each way.
    Each tensor is a message of its own, with its own latency: the two whole tensors are two
    (they were priced as one message of 128 bytes, a pipeline's latency undercounted)."""
    import hap
    from hap.cost.cluster import local_cluster, paper_cluster
    from hap.pipeline.plan import PipelineSpace
    torch.manual_seed(0)
    graph = hap.capture(_Crossings(), (torch.randn(12, 16), torch.randn(12, 16)))
    cluster = paper_cluster(8, True) if paper else local_cluster((1.0,) * 4, "local")
    space = PipelineSpace(graph, cluster)
    assert [n.op for n in graph.nodes[6:8]] == ["aten._to_copy.default", "aten.mul.Tensor"]
    fwd, back = space.pricer.transfer(7, [0, 1], [2, 3], 2)
    if paper:  # per link
        send, link = cluster.topology.send, cluster.topology.link
        rows = max(send(i, j, 192) for i in (0, 1) for j in (2, 3))
        wholes = sum(send(0, j, 128) + link(0, j).latency for j in (2, 3))  # two messages to each
        assert (fwd, back) == pytest.approx((rows + wholes, rows + send(0, 2, 64) + send(0, 3, 64)))
    else:  # the measured fit
        fit = cluster.fit("broadcast")
        assert (fwd, back) == pytest.approx((fit.time(192) + 2 * (fit.time(128) + fit.alpha), fit.time(192) + 2 * fit.time(64)))
    est = space.pricer.estimate([7], [[0, 1], [2, 3]], [[0.5, 0.5], [0.5, 0.5]], 2)
    assert est.send + est.send_back == pytest.approx((fwd, back))
    assert est.stage_seconds[0] == pytest.approx(est.fwd[0] + est.bwd[0] + fwd + back)

def test_the_exact_cut_of_ncf_is_the_least_estimate():
    """ncf's embedding tables are most of its bytes: the gradient accumulation that stage_times
    adds for micro-batches after the first ((M - 1) / M * 3 * gradient bytes / bandwidth) was
    missing from the table, whose 'exact' cut (before node 1, 4.89 ms by the table) was
    estimated at 6.91 ms where the cut before node 3 is estimated at 6.65 ms."""
    from hap.cost.cluster import load_cluster
    from hap.models import build
    from hap.pipeline.plan import PipelineSpace, exact_plan
    from hap.planner import PlannerConfig
    import hap
    model, inputs = build("ncf", devices=2, scale="small")
    graph = hap.capture(model, inputs)
    config = PlannerConfig(pipeline_stages=2, micro_batches=8)
    space = PipelineSpace(graph, load_cluster("local-homo"), config)
    _estimates_match_the_table(space, 2, 8, [[0], [1]])
    lines = []
    plan = exact_plan(graph, load_cluster("local-homo"), config, progress=lines.append)
    best, cuts = _brute_force(space, 2, 8, [[0], [1]])
    assert [st.nodes[0] for st in plan.stages[1:]] == list(cuts)
    assert plan.estimated_iteration_seconds == pytest.approx(best)
    assert lines == [f"pp-exact: K=2 groups 1/1 M=8: {plan.estimated_iteration_seconds * 1e3:.2f} ms"]


def test_three_stages_of_ncf_on_uneven_devices():
    from hap.models import build
    model, inputs = build("ncf", devices=3, scale="small")
    space = _space(model, inputs, (1.0, 1.0, 0.5), pipeline_stages=3)
    for M in (2, 8):
        _estimates_match_the_table(space, 3, M, [[0], [1], [2]])
    _estimates_match_the_table(space, 2, 4, [[0, 1], [2]])


def test_a_synchronized_batch_norm_stage_pays_its_all_reduces_in_the_table():
    """The table left out inner_seconds (a synchronized BatchNorm's sums over its stage's
    group), which the estimate adds."""
    from test_pipeline import _bn_setup
    model, batches = _bn_setup()
    space = _space(model, batches[0], (1.0, 1.0, 0.5))
    bn = [n.index for n in space.graph.nodes if "batch_norm" in n.op]
    assert space.pricer.inner_seconds(0, bn[0], [0, 1]) > 0
    _estimates_match_the_table(space, 2, 1, [[0, 1], [2]])


# -- 2. parameters several stages use ------------------------------------------------------------

class SharedLayers(torch.nn.Module):
    """A tied embedding (input and output) and one block run as layers 2 and 4 (ALBERT-like)."""

    def __init__(self, vocab=300, hidden=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.shared = torch.nn.Linear(hidden, hidden)
        self.own = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(3))

    def forward(self, ids, labels):
        h = self.emb(ids)
        for layer in (self.own[0], self.shared, self.own[1], self.shared, self.own[2]):
            h = torch.relu(layer(h)) + h
        logits = h @ self.emb.weight.T
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _tokens(model, vocab):
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (8, 4))
    return model, (ids, ids.roll(-1, 1))


def test_a_tied_embedding_is_held_and_synchronized_by_both_its_stages():
    """Stage 1 (LayerNorm, the output projection) holds the embedding too: its weights,
    gradient and Adam's two moments (4 x 4000 x 64 x 4 B), and its gradient is summed over both
    stages' devices (the plan's sync entry), an all-reduce of 1,024,000 B over devices 0 and 1
    that each stage pays (their own buckets are of one device: free). Before, stage 1's memory
    lacked the embedding and the sync was priced 0; and the activations it receives."""
    from hap.pipeline.plan import assemble
    from hap.pipeline.schedule import in_flight
    space = _space(*_tokens(TiedLM(vocab=4000, hidden=64), 4000), (1.0, 1.0), pipeline_stages=2, micro_batches=2)
    graph, pricer = space.graph, space.pricer
    n = len(graph.nodes)
    cut = next(nd.index for nd in graph.nodes if nd.op == "aten.layer_norm.default")
    plan = assemble(space, [cut], [[0], [1]], [[1.0], [1.0]], 2, 0.0, {})
    emb, norm = 4000 * 64 * 4, 2 * 64 * 4  # fp32 embedding; LayerNorm's weight and bias
    received = 8 * 4 * 64 * 4  # h, [8, 4, 64] fp32 split on its batch, crosses the cut (it was left out)
    acts = (pricer.acts[n] - pricer.acts[cut] + received) * 1.0 / 2 * in_flight("1f1b", 2, 2, 1)  # share 1, M = 2
    assert plan.memory_bytes[1] - acts == pytest.approx(4 * (emb + norm), rel=1e-12)
    assert [(e.param, e.devices) for e in plan.sync if e.param == "p_emb_weight"] == [("p_emb_weight", (0, 1))]
    both = space.cost.group_collective("all_reduce", emb, [0, 1])
    assert both > 0 and plan.timeline["pipeline"]["sync"] == pytest.approx([both, both], rel=1e-12)


def test_each_stage_pays_the_sync_buckets_it_is_in():
    """Stages nodes 0-3 (embedding, layer 1) on device 0, 4-15 (the shared block twice, layers
    3 and 5) on devices 1 and 2, 16-20 (the output projection) on device 3: the embedding's
    gradient (300 x 32 x 4 = 38,400 B) is summed over devices 0 and 3, stage 1's own
    (3 x (32 x 32 + 32) x 4 = 12,672 B, the shared block once) over 1 and 2."""
    space = _space(*_tokens(SharedLayers(), 300), (1.0, 2.0, 1.0, 1.5), pipeline_stages=3, micro_batches=2)
    groups = [[0], [1, 2], [3]]
    plan = space.plan([4, 16], 3, 2, 0.0, {}, groups)
    cost = space.cost
    emb = cost.group_collective("all_reduce", 300 * 32 * 4, [0, 3])
    own = cost.group_collective("all_reduce", 3 * (32 * 32 + 32) * 4, [1, 2])
    assert plan.timeline["pipeline"]["sync"] == pytest.approx([emb, own, emb], rel=1e-12)
    # what runs: every bucket of the plan's sync entries, all-reduced over its devices by each
    # of them (runtime.Pipeline._sync_gradients), priced from the entries alone
    for k, st in enumerate(plan.stages):
        buckets: dict[tuple[int, ...], float] = {}
        for e in plan.sync:
            buckets[e.devices] = buckets.get(e.devices, 0.0) + space.graph.tensors[e.param].nbytes
        runs = sum(cost.group_collective("all_reduce", b, d) for d, b in buckets.items() if set(st.devices) <= set(d))
        assert plan.timeline["pipeline"]["sync"][k] == pytest.approx(runs, rel=1e-12)
    # every stage holds the parameters it loads, each once
    for k, st in enumerate(plan.stages):
        held = {ld.tensor for step in plan.steps(space.graph, k) for ld in step.loads
                if space.graph.tensors[ld.tensor].kind == "param"}
        a, b = st.nodes
        assert space.pricer.held(a, b)[1] == pytest.approx(sum(cost.state_bytes(p) for p in held), rel=1e-12)


@pytest.mark.parametrize("speeds", [(1.0, 1.0, 1.0, 1.0), (1.0, 2.0, 1.0, 1.5)])
def test_the_exact_cut_is_exact_where_stages_share_parameters(speeds):
    """Which stages share the embedding and the shared block decides their sync: the search
    runs per signature, and equals the brute force over every cut by the estimate (a search
    of the per-stage terms alone missed it: on equal speeds, groups 1/2/1, M = 2 it cut before
    nodes 4 and 7, 3.24 ms, where 18 and 19 take 2.63 ms)."""
    from hap.pipeline import partition
    from hap.pipeline.partition import exact_partition
    space = _space(*_tokens(SharedLayers(), 300), speeds, pipeline_stages=3)
    for groups in ([[0], [1, 2], [3]], [[0], [1], [2, 3]]):
        for M in (1, 2, 4):
            _estimates_match_the_table(space, 3, M, groups)
    table = space.table(3, 2, [[0], [1, 2], [3]])
    assert table.shared_intervals and len(table.signatures(partition.SIGNATURES)) > 1
    best = exact_partition(table)
    try:  # past the limit: the per-stage terms, polished by the whole L; not claimed exact
        partition.SIGNATURES, kept = 0, partition.SIGNATURES
        rough = exact_partition(table)
    finally:
        partition.SIGNATURES = kept
    assert not rough.exact and rough.seconds >= best.seconds * (1 - 1e-12)
    assert rough.seconds == pytest.approx(table.objective([list(table.positions).index(c) for c in rough.cuts]))


# -- 3. device layouts -----------------------------------------------------------------------------

def _all_layouts(speeds, stages, limit):
    """group_layouts as it was: every layout, sorted."""
    from hap.pipeline.partition import equal_groups
    m = len(speeds)
    layouts = []
    for bounds in itertools.combinations(range(1, m), stages - 1):
        edges = (0, *bounds, m)
        layouts.append([list(range(a, b)) for a, b in zip(edges, edges[1:])])
    layouts.sort(key=lambda lay: (max(t := [sum(speeds[i] for i in g) for g in lay]) / min(t), [len(g) for g in lay]))
    if m % stages == 0:
        layouts.remove(equal_groups(m, stages))
        layouts.insert(0, equal_groups(m, stages))
    return layouts[:limit]


def test_group_layouts_are_the_sorted_list_of_every_layout():
    from hap.pipeline.partition import group_layouts
    rng = random.Random(3)
    for m in range(1, 10):
        kinds = ([1.0] * m, [3.0, 3.0, *[1.0] * (m - 2)][:m], [rng.choice([1.0, 1.5, 2.0]) for _ in range(m)],
                 [rng.uniform(0.5, 4.0) for _ in range(m)])
        for speeds, K, limit in itertools.product(kinds, range(1, m + 1), (1, 2, 6, 40)):
            assert group_layouts(speeds, K, limit) == _all_layouts(speeds, K, limit), (speeds, K, limit)


def test_group_layouts_of_32_devices_in_8_stages_are_found_without_listing_them_all():
    """C(31, 7) = 2,629,575 layouts: listing and sorting them took 37 s and 3.3 GB. The search
    now goes best first, pruning, and sees a small fraction (counted, not timed: the machine
    is shared)."""
    from hap.pipeline import partition
    for speeds in ([1.0] * 32, [4.0] * 8 + [1.0] * 24, [random.Random(1).uniform(0.5, 4) for _ in range(32)]):
        seen = []
        insort = partition.bisect.insort
        partition.bisect.insort = lambda kept, key: (seen.append(key), insort(kept, key))
        try:
            layouts = partition.group_layouts(speeds, 8)
        finally:
            partition.bisect.insort = insort
        assert len(layouts) == 6 and layouts[0] == partition.equal_groups(32, 8)
        assert len(seen) < 10_000  # complete layouts the search reached, of 2.6 million
    # uniform speeds: after the equal groups, sizes of 3 to 5 (5/3, the least spread of any
    # other), the least list of sizes first: four 3s, then the 20 devices left in four 5s
    assert [len(g) for g in partition.group_layouts([1.0] * 32, 8)[1]] == [3, 3, 3, 3, 5, 5, 5, 5]


def test_a_pipeline_plan_priced_again_is_its_estimate_until_edited():
    """planner.priced prices a pipeline by its pricer (it replayed the stages' programs as one
    data-parallel program): the plan as planned prices to its own estimate; its groups swapped
    (the slow device's stage on the fast one) price otherwise."""
    import dataclasses

    import hap
    from hap.cost.cluster import local_cluster
    from hap.pipeline.plan import exact_plan
    from hap.planner import PlannerConfig, priced
    from test_pipeline import _vit_setup
    model, batches = _vit_setup()
    graph, cluster = hap.capture(model, batches[0]), local_cluster((1.0, 3.0), "local")
    plan = exact_plan(graph, cluster, PlannerConfig(pipeline_stages=2))
    again = priced(graph, cluster, plan)
    assert again.estimated_iteration_seconds == pytest.approx(plan.estimated_iteration_seconds, rel=1e-12)
    assert again.timeline == plan.timeline and again.memory_bytes == plan.memory_bytes
    swapped = dataclasses.replace(plan, stages=[dataclasses.replace(st, devices=other.devices)
                                                for st, other in zip(plan.stages, plan.stages[::-1])])
    assert priced(graph, cluster, swapped).estimated_iteration_seconds > 1.2 * plan.estimated_iteration_seconds
    # shares are relative (the runtime splits [2.0] as [1.0]); they were priced as they were written
    doubled = dataclasses.replace(plan, stages=[dataclasses.replace(st, ratios=[[2 * x for x in r] for r in st.ratios])
                                                for st in plan.stages])
    assert priced(graph, cluster, doubled).estimated_iteration_seconds == pytest.approx(
        plan.estimated_iteration_seconds, rel=1e-12)
    assert priced(graph, cluster, doubled).memory_bytes == pytest.approx(plan.memory_bytes, rel=1e-12)



class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x, y):
        return ((self.b(torch.relu(self.a(x))) - y) ** 2).mean()


def test_devices_of_a_machine_share_its_network_card():
    """Stage 0 on machine A's 4 devices, stage 1 on machine B's 4, cards of 1 GB/s, inside 100
    GB/s, no latency: each pair of devices moves a quarter of a micro-batch's rows at once, but
    all four quarters leave through A's one card and enter through B's, so the rows take their
    whole bytes / 1 GB/s (they were priced a quarter of that, as if each device had a card).
    Inside one machine the four pairs each have their own link: a quarter / 100 GB/s."""
    import hap
    from hap.cost.cluster import cluster_from_dict
    from hap.pipeline.plan import PipelineSpace
    from hap.pipeline.price import row_flows
    card, inside = {"bandwidth": "1GB/s", "latency": "0us"}, {"bandwidth": "100GB/s", "latency": "0us"}
    cluster = cluster_from_dict({"devices": [{"flops": 1e13, "memory": "16GiB", "count": 8}],
                                 "machines": [{"name": "A", "devices": 4, "intra": inside, "nic": card},
                                              {"name": "B", "devices": 4, "intra": inside, "nic": card}]})
    graph = hap.capture(_Regression(), (torch.randn(16, 64), torch.randn(16, 64)))
    space = PipelineSpace(graph, cluster)
    cut = next(n.index for n in graph.nodes if n.op == "aten.relu.default") + 1
    rows = float(space.pricer.crossing_bytes[0, 0, cut]) / 2  # per micro-batch (M = 2)
    assert rows > 0 and float(space.pricer.crossing_bytes[1, 0, cut]) == 0  # (rows only)
    assert row_flows([0.25] * 4, [0.25] * 4) == [(i, i, 0.25) for i in range(4)]
    fwd, _ = space.pricer.transfer(cut, [0, 1, 2, 3], [4, 5, 6, 7], 2, [0.25] * 4, [0.25] * 4)
    assert fwd == pytest.approx(rows / 1e9)
    fwd, _ = space.pricer.transfer(cut, [0, 1], [2, 3], 2, [0.5, 0.5], [0.5, 0.5])
    assert fwd == pytest.approx(rows / 2 / 100e9)


class _Deep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return ((x - y) ** 2).mean()


@pytest.mark.parametrize("machines, groups", [((3, 3), [[0, 1], [2, 3], [4, 5]]), ((2, 2), [[0], [1], [2], [3]])])
def test_the_emulated_links_sleep_each_cuts_price(machines, groups):
    """Every rank's emulated wait for a micro-batch's rows (Pipeline._arrived over the routes of
    Pipeline._routes, single-process stand-ins for the ranks), the most over a stage's devices,
    is the price of its cut (send forward, send_back backward), with cards of 1 GB/s shared
    by a machine's devices and 100 GB/s inside. Every cut's card bytes were charged to every
    receiver: twice the price on 3 stages of 2 machines, and 100x a cut inside one machine."""
    import types

    import hap
    from hap.cost.cluster import cluster_from_dict
    from hap.pipeline import runtime
    from hap.pipeline.plan import PipelineSpace, assemble
    from hap.pipeline.stages import crossings, stage_of_nodes, stage_pieces
    from hap.planner import PlannerConfig
    card, inside = {"bandwidth": "1GB/s", "latency": "0us"}, {"bandwidth": "100GB/s", "latency": "0us"}
    cluster = cluster_from_dict({"name": "t", "local": True, "emulate": True,
                                 "devices": [{"name": "cpu", "count": sum(machines), "flops": 1e10, "memory": "4GiB"}],
                                 "machines": [{"name": f"m{k}", "devices": d, "nic": card, "intra": inside}
                                              for k, d in enumerate(machines)]})
    M, K = 2, len(groups)
    graph = hap.capture(_Deep(), (torch.randn(16, 64), torch.randn(16, 64)))
    space = PipelineSpace(graph, cluster, PlannerConfig(schedule="gpipe", micro_batches=M))
    cuts = [n.index + 1 for n in graph.nodes if n.op == "aten.relu.default"][: K - 1]
    plan = assemble(space, cuts, groups, [[1 / len(g)] * len(g) for g in groups], M, 0.0, {})
    program = [st for k in range(K) for st in plan.steps(graph, k)]
    crossed = crossings(graph, program, stage_of_nodes(cuts, len(graph.nodes)))
    pieces = stage_pieces(graph, space.classes, program, [st.ratios[0] for st in plan.stages], M)
    slept = {}
    for rank in range(cluster.size):
        s = next(k for k, g in enumerate(groups) if rank in g)
        waits = []
        emulation = types.SimpleNamespace(links=cluster.topology, occupy=lambda x, w=waits: w.append(x) or 0.0,
                                          off_wire=lambda t: None)
        me = types.SimpleNamespace(plan=plan, comm=types.SimpleNamespace(rank=rank), M=M, K=K, s=s, crossings=crossed,
                                   emulation=emulation, devices=groups[s], d=groups[s].index(rank))
        for name in ("_tag", "_card_loads", "_stage_of_tag"):
            setattr(me, name, types.MethodType(getattr(runtime.Pipeline, name), me))
        sends, recvs, me._cards = runtime.Pipeline._routes(me, graph, crossed, space.classes, pieces)
        for backward, transfers in ((False, recvs[0]), (True, sends[0])):
            received = []
            for tr in transfers:
                shape = list(graph.tensors[crossed[tr.crossing].tensor].shape)
                shape[crossed[tr.crossing].placement.dim] = tr.length
                received.append((tr, torch.empty(shape)))
            waits.clear()
            runtime.Pipeline._arrived(me, received, 0, backward=backward)
            slept[(rank, backward)] = waits[0] if waits else 0.0
    line = plan.timeline["pipeline"]
    for k in range(K - 1):
        assert max(slept[(r, False)] for r in groups[k + 1]) == pytest.approx(line["send"][k], rel=1e-9)
        assert max(slept[(r, True)] for r in groups[k]) == pytest.approx(line["send_back"][k], rel=1e-9)
