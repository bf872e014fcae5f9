"""A* synthesis: optimal against exhaustive enumeration, consistent with the exact pricing."""

import itertools
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as hs

from hap.capture import capture
from hap.cost.cluster import Cluster, Device, fits_from_network, paper_cluster
from hap.cost.model import CostModel
from hap.rules import strategy_table
from hap.rules.units import ShardClasses
from hap.search.astar import Frame, chunk_cuts, synthesize
from hap.search.moves import moves_between
from hap.search.program import Load, MoveStep, Step, replay

torch.set_num_threads(1)


class TwoLayer(nn.Module):
    def __init__(self, d_in=12, d_hidden=20, d_out=6):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out, bias=False)

    def forward(self, x):
        return torch.relu(self.fc2(torch.tanh(self.fc1(x)))).sum()


class Residual(nn.Module):
    def __init__(self, d=10):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return (x * 2 + self.fc(x)).sum()


@pytest.fixture(scope="module")
def graphs():
    return {
        "two_layer": capture(TwoLayer(), (torch.randn(16, 12),)),
        "residual": capture(Residual(), (torch.randn(8, 10),)),
    }


def make_cluster(speeds, bandwidth, latency=1e-5):
    devices = tuple(Device(name=f"d{i}", flops=s, memory=2**34) for i, s in enumerate(speeds))
    return Cluster(name="test", devices=devices, collectives=fits_from_network(len(devices), bandwidth, latency))


def brute_force(graph, strategies, cost, segment_of, ratios):
    """Cheapest program by enumerating every strategy and move choice, priced by replay."""
    tensors = graph.tensors
    best = [float("inf"), None]

    def rec(k, props, communicated, steps):
        if k == len(graph.nodes):
            c = replay(steps, cost, segment_of, ratios).seconds
            if c < best[0]:
                best[:] = [c, list(steps)]
            return
        node = graph.nodes[k]
        for st in strategies[k]:
            loads = tuple(dict.fromkeys(Load(t, p) for t, p in zip(node.inputs, st.inputs) if tensors[t].is_leaf))
            needs = list(dict.fromkeys((t, p) for t, p in zip(node.inputs, st.inputs) if not tensors[t].is_leaf))
            options = []
            for t, p in needs:
                if p in props.get(t, ()):
                    options.append([None])
                    continue
                cands = [(t, mv) for src in props.get(t, ()) for mv in moves_between(src, p, tensors[t].requires_grad)
                         if not (mv.fwd is not None and t in communicated)]
                options.append(cands)
            for combo in itertools.product(*options):
                new_props = {t: set(v) for t, v in props.items()}
                comm = set(communicated)
                moves = []
                for choice in combo:
                    if choice is None:
                        continue
                    t, mv = choice
                    new_props[t].add(mv.dst)
                    if mv.fwd is not None:
                        comm.add(t)
                    moves.append(MoveStep(t, mv))
                for t, p in zip(node.outputs, st.outputs):
                    new_props[t] = {p}
                rec(k + 1, new_props, comm, steps + [Step(k, st, loads, tuple(moves))])

    rec(0, {}, set(), [])
    return best


def setup(graph, cluster):
    strategies = strategy_table(graph)
    classes = ShardClasses(graph, enumerate(strategies))
    return strategies, CostModel(graph, cluster, classes), [0] * len(graph.nodes)


@pytest.mark.parametrize("name", ["two_layer", "residual"])
@pytest.mark.parametrize("speeds,bandwidth,ratios", [
    ((3e9, 1e9), 1e9, (0.75, 0.25)),     # compute-bound, skewed
    ((3e9, 1e9), 1e5, (0.6, 0.4)),       # communication-bound
    ((2e9, 2e9, 1e9), 1e7, (0.55, 0.3, 0.15)),
])
def test_astar_matches_exhaustive_enumeration(graphs, name, speeds, bandwidth, ratios):
    graph = graphs[name]
    strategies, cost, seg = setup(graph, make_cluster(speeds, bandwidth))
    optimum, _ = brute_force(graph, strategies, cost, seg, [ratios])
    found = synthesize(graph, strategies, cost, seg, [ratios])
    assert found.cost == pytest.approx(optimum, rel=1e-9)
    # The search's incremental price is the exact replay price of the program it returns.
    assert replay(found.program, cost, seg, [ratios]).seconds == pytest.approx(found.cost, rel=1e-9)


def test_heuristic_is_admissible_and_prunes(graphs):
    graph = graphs["two_layer"]
    strategies, cost, seg = setup(graph, make_cluster((3e9, 1e9), 1e8))
    with_h = synthesize(graph, strategies, cost, seg, [(0.7, 0.3)])
    without = synthesize(graph, strategies, cost, seg, [(0.7, 0.3)], heuristic=False)
    assert with_h.cost == pytest.approx(without.cost, rel=1e-12)
    assert with_h.expanded <= without.expanded


@settings(max_examples=20, deadline=None)
@given(r0=hs.floats(0.05, 0.95), log_bw=hs.floats(4, 11), slow=hs.floats(1, 5))
def test_astar_optimal_for_random_ratios_and_links(graphs, r0, log_bw, slow):
    graph = graphs["residual"]
    strategies, cost, seg = setup(graph, make_cluster((1e9 * slow, 1e9), 10 ** log_bw))
    ratios = [(r0, 1 - r0)]
    optimum, _ = brute_force(graph, strategies, cost, seg, ratios)
    assert synthesize(graph, strategies, cost, seg, ratios).cost == pytest.approx(optimum, rel=1e-9)


def test_machines_as_virtual_devices_cost_intra_machine_sync(graphs):
    graph = graphs["two_layer"]
    one = paper_cluster(8, heterogeneous=True)
    four = paper_cluster(32, heterogeneous=True)
    s1, c1, seg = setup(graph, one)
    s4, c4, _ = setup(graph, four)
    r = [one.compute_proportional()]
    p1 = synthesize(graph, s1, c1, seg, r)
    # The same program on machines of 4 GPUs: 4x the compute, plus intra-machine gradient sync.
    e1 = replay(p1.program, c1, seg, r)
    e4 = replay(p1.program, c4, seg, r)
    compute1 = e1.breakdown()["forward_compute"]
    assert e4.breakdown()["forward_compute"] == pytest.approx(compute1 / 4, rel=1e-9)
    assert e4.breakdown()["backward_compute"] > e1.breakdown()["backward_compute"] / 4


@pytest.mark.parametrize("name", ["two_layer", "residual"])
@pytest.mark.parametrize("speeds,bandwidth,ratios", [
    ((3e9, 1e9), 1e9, (0.75, 0.25)),
    ((3e9, 1e9), 1e5, (0.6, 0.4)),
    ((2e9, 2e9, 1e9), 1e7, (0.55, 0.3, 0.15)),
])
def test_layer_bounds_keep_the_search_optimal(graphs, name, speeds, bandwidth, ratios):
    """The searched lower bound of every layer ahead is admissible: the optimum stays the
    enumerated one, and the search's price is replay's."""
    graph = graphs[name]
    strategies, cost, seg = setup(graph, make_cluster(speeds, bandwidth))
    assert chunk_cuts(graph), "these graphs have layer boundaries"
    optimum, _ = brute_force(graph, strategies, cost, seg, [ratios])
    found = synthesize(graph, strategies, cost, seg, [ratios], layer_bounds=True)
    assert found.exhaustive
    assert found.cost == pytest.approx(optimum, rel=1e-9)
    assert replay(found.program, cost, seg, [ratios]).seconds == pytest.approx(found.cost, rel=1e-9)


@settings(max_examples=15, deadline=None)
@given(r0=hs.floats(0.0, 1.0), log_bw=hs.floats(4, 11), slow=hs.floats(1, 5))
def test_layer_bounds_optimal_for_random_ratios_and_links(graphs, r0, log_bw, slow):
    graph = graphs["two_layer"]
    strategies, cost, seg = setup(graph, make_cluster((1e9 * slow, 1e9), 10 ** log_bw))
    ratios = [(r0, 1 - r0)]
    optimum, _ = brute_force(graph, strategies, cost, seg, ratios)
    assert synthesize(graph, strategies, cost, seg, ratios, layer_bounds=True).cost == pytest.approx(optimum, rel=1e-9)


def test_width_limit_is_reported(graphs):
    graph = graphs["residual"]
    strategies, cost, seg = setup(graph, make_cluster((3e9, 1e9), 1e6))
    full = synthesize(graph, strategies, cost, seg, [(0.6, 0.4)])
    narrow = synthesize(graph, strategies, cost, seg, [(0.6, 0.4)], width=1)
    assert full.exhaustive
    assert narrow.cost >= full.cost * (1 - 1e-12)
    assert narrow.expanded <= full.expanded
    assert not narrow.exhaustive  # one program per node cannot cover this graph's choices


@settings(max_examples=25, deadline=None)
@given(name=hs.sampled_from(["two_layer", "residual"]), r0=hs.floats(0.05, 0.95), log_bw=hs.floats(4, 10),
       width=hs.sampled_from([1, 2]))
def test_width_limited_search_proves_a_lower_bound(graphs, name, r0, log_bw, width):
    """The least score a width-limited search dropped bounds the optimum from below (scores never
    overestimate), its program from above; an exhaustive search's bound is its own cost."""
    graph = graphs[name]
    strategies, cost, seg = setup(graph, make_cluster((3e9, 1e9), 10 ** log_bw))
    ratios = [(r0, 1 - r0)]
    full = synthesize(graph, strategies, cost, seg, ratios)
    narrow = synthesize(graph, strategies, cost, seg, ratios, width=width)
    assert full.exhaustive and full.lower_bound == full.cost and full.gap == 0.0
    assert narrow.lower_bound <= full.cost * (1 + 1e-9) <= narrow.cost * (1 + 2e-9)
    assert narrow.gap >= narrow.cost / full.cost - 1 - 1e-9


def test_the_lower_bound_of_a_narrow_search_is_informative(graphs):
    # one program per node misses the optimum by far here, yet what it dropped scores at least
    # 90% of the optimum: the gap it reports is the real one, not a vacuous bound
    graph = graphs["two_layer"]
    strategies, cost, seg = setup(graph, make_cluster((3e9, 1e9), 1e5))
    full = synthesize(graph, strategies, cost, seg, [(0.6, 0.4)])
    narrow = synthesize(graph, strategies, cost, seg, [(0.6, 0.4)], width=1)
    assert not narrow.exhaustive and narrow.cost > 10 * full.cost
    assert 0.9 * full.cost < narrow.lower_bound <= full.cost


def test_an_incumbent_bounds_the_search_and_keeps_its_optimum(graphs):
    graph = graphs["two_layer"]
    strategies, cost, seg = setup(graph, make_cluster((3e9, 1e9), 1e5))
    ratios = [(0.6, 0.4)]
    full = synthesize(graph, strategies, cost, seg, ratios)
    worse = synthesize(graph, strategies, cost, seg, ratios, width=1).program  # a dearer program of the space
    bounded = synthesize(graph, strategies, cost, seg, ratios, incumbents=[worse])
    assert bounded.exhaustive and bounded.cost == pytest.approx(full.cost, rel=1e-12)
    assert bounded.expanded <= full.expanded
    # nothing is cheaper than the optimum: the search expands less and returns the incumbent itself
    same = synthesize(graph, strategies, cost, seg, ratios, incumbents=[worse, full.program])
    assert same.program == full.program and same.cost == pytest.approx(full.cost, rel=1e-12) and same.exhaustive
    assert same.expanded < full.expanded


def test_a_restricted_search_ignores_incumbents_outside_its_family(graphs):
    from hap.planner import _dp
    graph = graphs["two_layer"]
    strategies, cost, seg = setup(graph, make_cluster((3e9, 1e9), 1e5))
    ratios = [(0.6, 0.4)]
    free = synthesize(graph, strategies, cost, seg, ratios).program
    dp = synthesize(graph, strategies, cost, seg, ratios, _dp(graph))
    assert not _dp(graph).admits(free, graph) and replay(free, cost, seg, ratios).seconds < dp.cost
    found = synthesize(graph, strategies, cost, seg, ratios, _dp(graph), incumbents=[free])
    assert _dp(graph).admits(found.program, graph) and found.cost == pytest.approx(dp.cost, rel=1e-12)


def test_width_applies_only_after_the_exhaustive_budget(graphs):
    """A search that finishes within `width_after` expansions per node never drops a program,
    so it stays exhaustive and optimal even with a width of 1."""
    graph = graphs["residual"]
    strategies, cost, seg = setup(graph, make_cluster((3e9, 1e9), 1e6))
    full = synthesize(graph, strategies, cost, seg, [(0.6, 0.4)])
    budgeted = synthesize(graph, strategies, cost, seg, [(0.6, 0.4)], width=1, width_after=full.expanded)
    assert budgeted.exhaustive and budgeted.cost == pytest.approx(full.cost, rel=1e-12)
    assert not synthesize(graph, strategies, cost, seg, [(0.6, 0.4)], width=1, width_after=0).exhaustive


@settings(max_examples=30, deadline=None)
@given(name=hs.sampled_from(["two_layer", "residual"]),
       first=hs.lists(hs.floats(0.05, 1.0), min_size=3, max_size=3),
       other=hs.lists(hs.floats(-0.03, 0.03), min_size=3, max_size=3),
       nudge=hs.lists(hs.floats(-0.03, 0.03), min_size=3, max_size=3))
def test_prices_reused_from_other_ratios_are_the_prices(graphs, name, first, other, nudge):
    # Frame.prices keeps a price from the nearest ratios it priced already (the fewest shares
    # rounding differently) where none of the shares the price reads rounds differently; nearby
    # ratios (the balanced ratios searched again) reuse most. Every price must equal the one a
    # fresh frame computes, whichever ratios were priced before and in what order.
    graph = graphs[name]
    strategies, cost, segment_of = setup(graph, make_cluster((3e9, 2e9, 1e9), 1e8))
    a = [x / sum(first) for x in first]
    b, c = ([max(0.01, x + d) for x, d in zip(a, delta)] for delta in (nudge, other))  # both near a
    b, c = [x / sum(b) for x in b], [x / sum(c) for x in c]
    warm = Frame(graph, strategies, cost, segment_of)
    warm.prices([c])
    warm.prices([a])
    fresh = Frame(graph, strategies, cost, segment_of)
    (opt_w, mov_w), (opt_f, mov_f) = warm.prices([b]), fresh.prices([b])
    assert [[(p.fwd, p.bwd) for p in row] for row in opt_w] == [[(p.fwd, p.bwd) for p in row] for row in opt_f]
    assert mov_w == mov_f


class Attention(nn.Module):
    """Multi-head self-attention: its q, k and v must meet in one placement at the attention."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):  # x: (B, T, d)
        b, t, d = x.shape

        def split(y):  # (B, T, d) -> (B, heads, T, d / heads)
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        y = nn.functional.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.out(y.transpose(1, 2).reshape(b, t, d)).sum()


@pytest.fixture(scope="module")
def attention():
    return capture(Attention(), (torch.randn(6, 4, 8),))



def _sdpa_inputs(graph, frame):
    k = next(i for i, nd in enumerate(graph.nodes) if "scaled_dot_product_attention" in nd.op)
    return k, [frame.tid[name] for name in graph.nodes[k].inputs[:3]]


def _cheapest_chain(frame, cost, ratios, name, held, code):
    """Least forward + backward seconds of one or two moves from a held placement to `code`
    (every intermediate placement priced), by enumeration."""
    from hap.placement import from_code
    from hap.search.program import NumericShares, move_price
    alg, tensor = NumericShares(cost, ratios), frame.graph.tensors[name]
    codes = range(3 + len(tensor.shape))

    def hop(a, b):
        return min((sum(move_price(cost, alg, name, mv, 0, 0)) for mv in
                    moves_between(from_code(a), from_code(b), tensor.requires_grad)), default=float("inf"))

    return min(min(hop(h, code), *(hop(h, via) + hop(via, code) for via in codes)) for h in held)


def test_pending_moves_bound_is_positive_and_admissible(attention):
    """With q held batch-split and k, v head-split, every strategy of the attention needs a
    move: the bound is positive and at most the cheapest strategy's cheapest moves."""
    from hap.search.astar import CODE_BITS, _Space
    graph = attention
    strategies, cost, seg = setup(graph, make_cluster((3e9, 2e9), 1e8))
    ratios = [(0.6, 0.4)]
    frame = Frame(graph, strategies, cost, seg)
    space = _Space(graph, strategies, cost, seg, ratios, None, True, False, frame)
    k, (q, kk, v) = _sdpa_inputs(graph, frame)
    S0, S1 = 3, 4  # batch and heads of (B, heads, T, d / heads)
    assert space.core.pending_at(k, [q * CODE_BITS + S0, kk * CODE_BITS + S0, v * CODE_BITS + S0]) == 0.0
    assert space.core.pending_at(k, [q * CODE_BITS, kk * CODE_BITS + S1, v * CODE_BITS + S1]) == 0.0  # R: free
    mixed = space.core.pending_at(k, [q * CODE_BITS + S0, kk * CODE_BITS + S1, v * CODE_BITS + S1])
    held = {q: [S0], kk: [S1], v: [S1]}
    exact = min(sum(_cheapest_chain(frame, cost, ratios, frame.names[t], held[t], p.code)
                    for t, p in zip((q, kk, v), st.inputs[:3]) if p.code not in held[t])
                for st in strategies[k])
    assert 0.0 < mixed <= exact * (1 + 1e-12)


@settings(max_examples=12, deadline=None)
@given(r0=hs.floats(0.1, 0.9), r1=hs.floats(0.1, 0.9), log_bw=hs.floats(5, 11))
def test_astar_with_pending_moves_matches_uniform_cost_search(attention, r0, r1, log_bw):
    """Uniform-cost search (no heuristic) is exact; the pending-move bound must not change the
    optimum, whatever the ratios and links."""
    graph = attention
    strategies, cost, seg = setup(graph, make_cluster((3e9, 2e9, 1e9), 10 ** log_bw))
    total = r0 + r1 + 0.5
    ratios = [(r0 / total, r1 / total, 0.5 / total)]
    frame = Frame(graph, strategies, cost, seg)
    informed = synthesize(graph, strategies, cost, seg, ratios, frame=frame)
    blind = synthesize(graph, strategies, cost, seg, ratios, heuristic=False, frame=frame)
    assert informed.cost == pytest.approx(blind.cost, rel=1e-9)
    assert replay(informed.program, cost, seg, ratios).seconds == pytest.approx(informed.cost, rel=1e-9)
    assert informed.expanded <= blind.expanded


@pytest.mark.parametrize("name", ["vgg19", "vit"])
def test_astar_matches_uniform_cost_search_on_paper_models(name):
    """The paper's models on the paper's heterogeneous cluster, where the optimum makes moves
    the heuristic sees pending (an inadmissible bound, e.g. the pending moves counted twice,
    returns dearer programs here): A* finds uniform-cost search's optimum, unrestricted and
    for tensor parallelism, at compute-proportional, even and skewed ratios."""
    from hap.models import build
    from hap.planner import _tp
    cluster = paper_cluster(8, heterogeneous=True)
    model, inputs = build(name, devices=cluster.gpus, device="meta", **({"layers": 1} if name == "vit" else {}))
    graph = capture(model, inputs, name=name)
    strategies, cost, seg = setup(graph, cluster)
    frame = Frame(graph, strategies, cost, seg)
    skewed = [0.3, 0.05, 0.2, 0.05, 0.1, 0.1, 0.15, 0.05]
    for ratios in (cluster.compute_proportional(), cluster.even(), skewed):
        for restriction in (None, _tp()):
            informed = synthesize(graph, strategies, cost, seg, [ratios], restriction, frame=frame)
            blind = synthesize(graph, strategies, cost, seg, [ratios], restriction, heuristic=False, frame=frame)
            assert informed.cost == pytest.approx(blind.cost, rel=1e-9), (ratios, restriction)
            assert informed.expanded < blind.expanded


@settings(max_examples=25, deadline=None)
@given(cut=hs.floats(0.0, 1.0), r=hs.lists(hs.floats(0.05, 1.0), min_size=6, max_size=6), log_bw=hs.floats(4, 10),
       layer_bounds=hs.booleans())
def test_astar_matches_uniform_cost_search_across_segments(attention, cut, r, log_bw, layer_bounds):
    """Two segments with their own ratios, the second starting anywhere (inside a layer chunk
    too, where a chunk's searched bound would pay a rebalance per placement at hand): the
    heuristics (pending moves, layer bounds) keep uniform-cost search's optimum."""
    graph = attention
    strategies, cost, _ = setup(graph, make_cluster((3e9, 2e9, 1e9), 10 ** log_bw))
    n = len(graph.nodes)
    start = 1 + min(n - 2, int(cut * (n - 1)))
    seg = [0 if k < start else 1 for k in range(n)]
    ratios = [tuple(x / sum(r[:3]) for x in r[:3]), tuple(x / sum(r[3:]) for x in r[3:])]
    frame = Frame(graph, strategies, cost, seg)
    informed = synthesize(graph, strategies, cost, seg, ratios, layer_bounds=layer_bounds, frame=frame)
    blind = synthesize(graph, strategies, cost, seg, ratios, heuristic=False, frame=frame)
    assert informed.cost == pytest.approx(blind.cost, rel=1e-9)


def test_a_plan_states_how_far_its_width_limited_searches_may_be_from_optimal(graphs):
    from hap.planner import PlannerConfig, plan
    cluster = make_cluster((3e9, 1e9), 1e5)
    full = plan(graphs["two_layer"], cluster)
    assert full.search["exhaustive"] and full.search["gap"] == 0.0
    narrow = plan(graphs["two_layer"], cluster, PlannerConfig(width=1, width_after=0.0))
    assert not narrow.search["exhaustive"] and 0.0 < narrow.search["gap"] < math.inf
    assert "within" in narrow.summary() and "of that search's optimum" in narrow.summary()


@pytest.mark.parametrize("ratios", [(0.5, 0.3, 0.2), (0.45, 0.45, 0.1), (0.2, 0.2, 0.6)])
def test_frame_prices_every_move_as_move_price(ratios):
    # The frame prices every move class's moves at once (astar._MoveTable); the walk (replay,
    # the LP) prices each alone (program.move_price). They must agree to the bit, on a batch of
    # 7 rows and widths of 20 and 6, whose splits round differently: an all-to-all from S(0)
    # to S(1) then costs by the larger of two different largest shares.
    from hap.search.program import NumericShares, move_price

    graph = capture(TwoLayer(), (torch.randn(7, 12),))
    strategies, cost, segment_of = setup(graph, make_cluster((3e9, 2e9, 1e9), 1e8))
    frame = Frame(graph, strategies, cost, segment_of)
    _, moves = frame.prices([list(ratios)])
    alg = NumericShares(cost, [list(ratios)])
    both_sharded_apart = 0
    for c, (name, seg) in enumerate(frame.move_tensor):
        assert len(moves[c]) == len(frame.moves[c])
        for (_, mv), (f, b, allowed) in zip(frame.moves[c], moves[c]):
            assert (f, b, allowed) == (*move_price(cost, alg, name, mv, seg, seg), True), (name, mv)
            if mv.src.is_shard and mv.dst.is_shard and mv.fwd is not None:
                tops = {alg.largest([(name, p.dim, seg)]) for p in (mv.src, mv.dst)}
                both_sharded_apart += len(tops) > 1
    assert both_sharded_apart > 0  # (the case the larger of two shares decides)
