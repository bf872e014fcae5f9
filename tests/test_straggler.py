"""Straggler mitigation (hap.straggler): pruning against its definition, the policy formulas on
hand-worked numbers, and on real gloo ranks migration (both methods, column- and row-parallel
layers, uneven shares) and rebalancing train exactly like one device."""

import time

import pytest
import torch
import torch.nn.functional as F
from gloo import run_ranks

from hap.straggler.migrate import Handover, handover, receivers_of
from hap.straggler.policy import (Stats, balanced_migration, keep_after_resizing, matmul_floor, matmul_speeds,
                                  migration_bound, pruning_floors, rebalanced_time, semi_beta, stragglers_and_receivers,
                                  time_lost, unmitigated)
from hap.straggler import StragglerConfig
from hap.straggler.prune import Lineage, PrioritySelector, PrunedLinear, RandomSelector, pruned_count
from hap.straggler.schedule import Schedule, parse_schedule


# -- pruning (ZERO-resizing) ------------------------------------------------------------------

def test_pruned_linear_forward_and_backward_match_the_masked_definition():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 6, generator=gen, requires_grad=True)
    w = torch.randn(4, 6, generator=gen, requires_grad=True)
    b = torch.randn(4, generator=gen, requires_grad=True)
    lin = Lineage.of("fc", "fc.weight", torch.tensor([0, 2, 3, 5]), 6)
    assert lin.pruned.tolist() == [1, 4]
    y = PrunedLinear.apply(x, w, b, lin)
    gy = torch.randn(y.shape, generator=gen)
    y.backward(gy)
    # definition: the pruned columns of input and weight are zero, the output keeps its shape
    mask = torch.tensor([1.0, 0, 1, 1, 0, 1])
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y2 = F.linear(x2 * mask, w2 * mask, b2)
    y2.backward(gy)
    assert y.shape == (2, 3, 4)
    assert torch.allclose(y, y2, atol=1e-6)
    assert torch.allclose(x.grad, x2.grad, atol=1e-6) and torch.allclose(w.grad, w2.grad, atol=1e-6)
    assert torch.allclose(b.grad, b2.grad, atol=1e-6)
    assert (w.grad[:, [1, 4]] == 0).all() and (x.grad[..., [1, 4]] == 0).all()  # zero imputation


def test_lineage_maps_each_pruned_gradient_column_back_to_its_weight_column():
    lin = Lineage.of("l", "w", torch.tensor([1, 4]), 5)
    g = torch.tensor([[10.0, 40.0], [11.0, 41.0]])
    full = lin.restore(g, 1)
    assert full.tolist() == [[0, 10, 0, 0, 40], [0, 11, 0, 0, 41]]
    assert lin.pruned.tolist() == [0, 2, 3]


def test_random_selector_prunes_round_gamma_k_and_keeps_one():
    sel = RandomSelector(0)
    w = torch.zeros(3, 10)
    assert len(sel.kept("l", w, 0.3)) == 7
    assert len(sel.kept("l", w, 1.0)) == 1  # never all of them
    assert len(sel.kept("l", w, 0.5, limit=4)) == 2 and sel.kept("l", w, 0.5, limit=4).max() < 4
    assert pruned_count(10, 0.26) == 3


def test_priority_selector_prunes_least_varied_and_keeps_pruned_statistics():
    sel = PrioritySelector(seed=0)
    w0 = torch.zeros(2, 4)
    sel.observe("l", w0)
    w1 = torch.tensor([[0.5, 0.1, 0.3, 0.9], [0.5, 0.1, 0.3, 0.9]])  # column variations 0.5, 0.1, 0.3, 0.9
    sel.observe("l", w1)
    kept = sel.kept("l", w1, 0.5)
    assert kept.tolist() == [0, 3]  # columns 1 and 2 varied least
    # next epoch: the pruned columns 1 and 2 did not move (zero gradient); kept ones moved a little
    w2 = w1 + torch.tensor([0.2, 0.0, 0.0, 0.05])
    sel.observe("l", w2)
    delta = sel.layers["l"].delta
    assert delta[1].item() == pytest.approx(0.1) and delta[2].item() == pytest.approx(0.3)  # kept, not 0
    assert delta[0].item() == pytest.approx(0.2) and delta[3].item() == pytest.approx(0.05)
    # variations now 0.2, 0.1 (kept), 0.3 (kept), 0.05: column 2 comes back, column 3 goes
    assert sel.kept("l", w2, 0.5).tolist() == [0, 2]


def test_pridiff_layer_ratio():
    sel = PrioritySelector(seed=0)
    sel.observe("l", torch.zeros(1, 10))
    sel.observe("l", torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]]))
    # 4 of 10 columns varied more than theta: gamma_k = 0.6, at least alpha * gamma
    assert sel.layer_ratio("l", 0.5, theta=0.02, alpha=0.8) == pytest.approx(0.6)
    assert sel.layer_ratio("l", 0.9, theta=0.02, alpha=0.8) == pytest.approx(0.72)
    # a rank that holds none of a layer's columns (a share of 0) prunes none (was a ZeroDivisionError)
    sel.observe("empty", torch.zeros(3, 0))
    sel.observe("empty", torch.zeros(3, 0))
    assert sel.layer_ratio("empty", 0.5, theta=0.02) == 0.0


# -- policy formulas (hand-worked) -----------------------------------------------------------

def test_eq1_keep_after_resizing():
    # T_i = 0.9, T_avg = 0.5, M_i = 0.8: gamma = 0.5 of what it multiplies now
    assert keep_after_resizing(1.0, 0.9, 0.5, 0.8) == pytest.approx(0.5)
    assert keep_after_resizing(0.5, 0.7, 0.5, 0.4) == pytest.approx(0.25)
    assert keep_after_resizing(0.5, 0.3, 0.5, 0.4) == pytest.approx(0.75)  # faster: takes columns back
    assert keep_after_resizing(0.5, 0.1, 0.5, 0.4) == 1.0


def test_eq1_prunes_only_what_slow_multiplications_cost():
    # rank 1 multiplies 4x slower (0.4 s for the FLOPs rank 0 does in 0.1 s): it keeps 1/4 at
    # least, however large its excess; rank 2 multiplies as fast as rank 0 but lost 0.3 s
    # elsewhere (noise): Eq. 1 alone would prune it to the cap, the floor keeps it whole.
    stats = [Stats(busy=0.5, matmul=0.1, flops=1e9, own=1.0), Stats(busy=2.0, matmul=0.4, flops=1e9, own=1.0),
             Stats(busy=0.8, matmul=0.1, flops=1e9, own=1.0)]
    assert [matmul_floor(stats, r) for r in range(3)] == pytest.approx([1.0, 0.25, 1.0])
    # of 4, the norm is the second fastest: rank 3's undisturbed 0.05 s does not set it
    four = [*stats, Stats(busy=0.4, matmul=0.05, flops=1e9, own=1.0)]
    assert [matmul_floor(four, r) for r in range(4)] == pytest.approx([1.0, 0.25, 1.0, 1.0])
    t_avg = (0.5 + 2.0 + 0.8) / 3
    assert keep_after_resizing(1.0, 2.0, t_avg, 0.4) == pytest.approx(0.05)  # the cap, without the floor
    assert keep_after_resizing(1.0, 2.0, t_avg, 0.4, floor=matmul_floor(stats, 1)) == pytest.approx(0.25)
    assert keep_after_resizing(1.0, 0.8, t_avg, 0.1, floor=matmul_floor(stats, 2)) == 1.0


def test_the_floor_is_set_by_the_ranks_that_are_no_stragglers():
    # ranks 0 and 1 multiply 8x and 4x slower than rank 2: the upper median of all three is
    # rank 1's own speed, whose floor was then 1 (never pruned); against rank 2 it is 1/4
    stats = [Stats(busy=1.6, matmul=0.8, flops=1e9, own=1.0), Stats(busy=1.2, matmul=0.4, flops=1e9, own=1.0),
             Stats(busy=0.5, matmul=0.1, flops=1e9, own=1.0)]
    assert [matmul_floor(stats, r) for r in range(3)] == pytest.approx([0.5, 1.0, 1.0])
    assert [matmul_floor(stats, r, norm=[2]) for r in range(3)] == pytest.approx([0.125, 0.25, 1.0])


def test_a_pruning_ranks_floor_is_held_at_its_whole_share_reading():
    # rank 1 multiplies 4x slower at its whole share: floor 1/4. Pruned to 0.4 its products
    # are smaller and slower per FLOP (0.4e9 FLOPs in 0.2 s: read 1/5): the floor stays 1/4
    # (read as it stood, it fell step by step until the cap). Back at its whole share, and
    # normal again, the reading is its floor once more.
    whole = [0.0, 0.0]
    first = [Stats(busy=0.5, matmul=0.1, flops=1e9, own=1.0), Stats(busy=2.0, matmul=0.4, flops=1e9, own=1.0)]
    assert pruning_floors(first, [1.0, 1.0], [0.0, 0.0], whole, [0]) == pytest.approx([1.0, 0.25])
    assert whole == pytest.approx([1.0, 0.25])
    pruned = [first[0], Stats(busy=1.0, matmul=0.2, flops=0.4e9, own=0.4)]
    assert matmul_floor(pruned, 1, [0]) == pytest.approx(0.2)
    assert pruning_floors(pruned, [1.0, 0.4], [0.0, 0.0], whole, [0]) == pytest.approx([1.0, 0.25])
    assert whole == pytest.approx([1.0, 0.25])  # (not a whole share's reading: kept)
    recovered = [first[0], Stats(busy=0.5, matmul=0.1, flops=1e9, own=1.0)]
    assert pruning_floors(recovered, [1.0, 1.0], [0.0, 0.0], whole, [0]) == pytest.approx([1.0, 1.0])
    assert pruning_floors(pruned, [1.0, 0.4], [0.0, 0.0], whole, [0]) == pytest.approx([1.0, 1.0])  # held at 1 now


def test_a_rank_without_columns_is_no_receiver_and_sets_no_pace():
    # rank 0 holds every column (10 ms busy, 1 ms of it matmul); rank 1 holds none (share 0,
    # 8x slow: its call overhead alone was timed as matmul). It used to set T_min (9 ms), make
    # rank 0 a straggler, and take 95% of rank 0's columns at "0 s per FLOP"
    busy_all = Stats(busy=0.010, matmul=0.001, flops=1e8, own=1.0, full_flops=1e8)
    idle = Stats(busy=0.009, matmul=0.0, flops=0.0, own=1.0, full_flops=0.0)
    t_min, slow, receivers = stragglers_and_receivers([busy_all, idle], 0.10)
    assert (t_min, slow, receivers) == (pytest.approx(0.010), [], [0])
    # among ranks that hold columns the slow one is still found, and only the others receive
    slow_one = Stats(busy=0.030, matmul=0.021, flops=1e8, own=1.0, full_flops=1e8)
    assert stragglers_and_receivers([busy_all, slow_one, idle], 0.10)[1:] == ([1], [0])


def test_ski_rental_counts_calm_steps_as_calm():
    # a slowdown first seen 20 steps after the last refresh: 50 ms over the rebalanced 100 ms,
    # counted for this step only (it counted 20 steps, 1 s, and resharded at the first slow step)
    assert time_lost(0.0, 0.150, 0.100, 20) == pytest.approx(0.050)
    # seen before (refreshed every step while migration bridges, or 3 steps ago): every step since counts
    assert time_lost(0.050, 0.150, 0.100, 1) == pytest.approx(0.100)
    assert time_lost(0.100, 0.150, 0.100, 3) == pytest.approx(0.250)
    assert time_lost(0.100, 0.090, 0.100, 3) == pytest.approx(0.100)  # no excess, nothing lost


def test_an_empty_shard_charges_no_matmul_time():
    """A rank with no columns of a layer multiplies nothing: the emulated straggler owes no
    sleep for the call and no matmul seconds (its call overhead, times chi, was charged)."""
    from hap.runtime.collectives import Comm
    from hap.runtime.emulate import Emulation
    from hap.straggler.linear import Meter
    comm = Comm(rank=0, world=2, emulation=Emulation())
    meter = Meter(comm, slowdown=8.0)
    meter.charge(0.001, 0.0)
    assert (meter.seconds, meter.flops, comm.emulation.debt) == (0.0, 0.0, 0.0)
    meter.charge(0.001, 2e6)
    assert meter.seconds == pytest.approx(0.008) and comm.emulation.debt == pytest.approx(0.007)
    with meter.timing(torch.device("cpu"), 0.0):  # timed, but nothing multiplied
        time.sleep(0.002)
    assert meter.seconds == pytest.approx(0.008)
    with meter.timing(torch.device("cpu"), 1e6):  # the host's clock, times chi
        time.sleep(0.002)
    assert meter.seconds >= 0.008 + 8 * 0.002 and meter.flops == 3e6
    assert comm.emulation.debt == pytest.approx(0.007 + 7 / 8 * (meter.seconds - 0.008))


def test_balanced_migration_equalizes_straggler_and_receiver():
    # straggler: 0.1 s other work, 0.8 s matmul for 8 GFLOP; receiver: 0.1 + 0.1 s for the same
    k = Stats(busy=0.9, matmul=0.8, flops=8e9, own=1.0, full_flops=8e9)
    r = Stats(busy=0.2, matmul=0.1, flops=8e9, own=1.0, full_flops=8e9)
    mu = balanced_migration([k, r], [0], [1])[0]
    # a = 0.8, b = 0.1: T* = (0.2 + 0.9 * 0.125) / 1.125 = 0.2778; mu = (0.9 - T*) / 0.8
    assert mu == pytest.approx((0.9 - 0.3125 / 1.125) / 0.8)
    assert 0.9 - mu * 0.8 == pytest.approx(0.2 + mu * 0.1)
    # while migrating, U (the unmitigated time) is still measured as 0.9
    moved = Stats(busy=0.9 - mu * 0.8, matmul=0.8 * (1 - mu), flops=8e9 * (1 - mu), own=1 - mu, full_flops=8e9)
    assert unmitigated(moved) == pytest.approx(0.9)


def test_rebalanced_time_uses_matmul_speeds():
    # rank 0: 1e9 FLOPs in 0.1 s (10 GFLOP/s), 0.05 s of other work; rank 1 eight times slower
    fast = Stats(busy=0.15, matmul=0.1, flops=1e9, own=1.0, full_flops=1e9)
    slow = Stats(busy=0.85, matmul=0.8, flops=1e9, own=1.0, full_flops=1e9)
    assert matmul_speeds([fast, slow]) == [1e10, 1.25e9]
    # 2e9 FLOPs at 11.25 GFLOP/s, after the 0.05 s of other work
    assert rebalanced_time([fast, slow]) == pytest.approx(0.05 + 2e9 / 1.125e10)
    # after a reshard to 8:1 shares the estimate does not move: a small share does not look fast
    after = [Stats(busy=0.05 + 0.1778, matmul=0.1778, flops=1.778e9, own=1.0, full_flops=1.778e9),
             Stats(busy=0.05 + 0.1778, matmul=0.1778, flops=0.222e9, own=1.0, full_flops=0.222e9)]
    assert rebalanced_time(after) == pytest.approx(rebalanced_time([fast, slow]), rel=1e-3)


def test_eq2_semi_beta():
    # gap(beta) = 0.01 + 0.02*0.5(1-b) - (0.005 + 0.01*0.5b) - 0.03*0.5b/2 = 0.015 - 0.0225 b
    beta = semi_beta(0.5, 1.0, 3, 0.01, lambda f: 0.02 * f, lambda f: 0.005 + 0.01 * f, lambda f: 0.03 * f)
    assert beta == pytest.approx(2 / 3, abs=1e-6)
    assert semi_beta(0.5, 1.0, 3, 0.0, lambda f: 0.0, lambda f: 1.0, lambda f: 0.0) == 0.0  # migrating never pays


def test_eq3_migration_bound():
    stats = [Stats(busy=t, matmul=0.0, flops=0.0, own=1.0, full_flops=1e9) for t in (0.8, 0.5, 0.2, 0.2)]
    # f(1) = 0.6 - 0.125 > 0; f(2) = 0.3 - 1.35e9/2 * 0.2/1e9 = 0.165 > 0; rank 3 is not slow
    assert migration_bound(stats, lambda g: 0.0) == 2
    # with 0.2 s of communication, f(2) = -0.035: only the slowest migrates
    assert migration_bound(stats, lambda g: 0.2) == 1


# -- schedules and handovers -------------------------------------------------------------------

def test_schedules():
    rr = parse_schedule("round-robin:chi=8,every=3", 4)
    assert [rr.slowdown(1, i, 4) for i in range(12)] == [1, 1, 1, 8, 8, 8, 1, 1, 1, 1, 1, 1]
    multi = parse_schedule("multi:chi=8/6", 4)
    assert [multi.slowdown(r, 5, 4) for r in range(4)] == [8, 6, 1, 1]
    per = parse_schedule("persistent:chi=4,rank=2,start=5", 4)
    assert per.slowdown(2, 4, 4) == 1 and per.slowdown(2, 5, 4) == 4 and per.slowdown(1, 9, 4) == 1
    assert Schedule().slowdown(0, 3, 2) == 1


def test_straggler_config_fields_are_checked():
    # a schedule given as text failed at the first step (AttributeError), a text seed at the
    # Mitigator's start (TypeError)
    with pytest.raises(ValueError, match="StragglerConfig.schedule must be a Schedule"):
        StragglerConfig(schedule="persistent:chi=8,rank=1")
    with pytest.raises(ValueError, match="StragglerConfig.seed must be a whole number of at least 0"):
        StragglerConfig(seed="x")


@pytest.mark.parametrize("text, says", [("sometimes:chi=8", "unknown straggler schedule"),
                                        ("round-robin:chi=0.5", "a number from 1 to 1000"),
                                        ("round-robin:chi=nan", "a number from 1 to 1000"),  # ran unslowed
                                        ("persistent:chi=1e9,rank=1", "a number from 1 to 1000"),  # timed out
                                        ("multi:chi=8/inf", "a number from 1 to 1000"),  # killed a rank
                                        ("round-robin:chi=8/4", "one chi"),
                                        ("persistent:chi=2,rank=7", "rank < 4"),
                                        ("round-robin:speed=3", "chi=, every="),
                                        # each of these was taken without a word and did nothing, or not what it said
                                        ("none:chi=8", "none takes no fields, not chi=$"),
                                        ("persistent:chi=8,rank=1,rank=0", "rank= given twice$"),
                                        ("persistent:chi=8,every=3", "persistent takes chi=, rank=, start=, not every=$"),
                                        ("multi:chi=8,rank=1", "multi takes chi=, start=, not rank=$"),
                                        ("round-robin", r"round-robin needs chi= \(how many times slower\)$")])
def test_bad_schedules_say_what_is_wrong(text, says):
    with pytest.raises(ValueError, match=says):
        parse_schedule(text, 4)


def test_handover_renumbering_and_parts():
    assert receivers_of(1, 4) == (2, 3, 0)  # r' = (r + 4 - 1) mod 4
    assert receivers_of(1, 4, excluded=[3]) == (2, 0)
    h = Handover(straggler=1, start=3, count=7, receivers=(2, 3, 0))
    assert [h.part(r) for r in (2, 3, 0, 1)] == [(0, 3), (3, 5), (5, 7), None]
    assert handover(0, 10, 0.3, (1,)) == Handover(straggler=0, start=7, count=3, receivers=(1,))
    assert handover(0, 10, 0.01, (1,)) is None


# -- real ranks: migration and rebalancing are exact ------------------------------------------

STEPS = 4
SHARES = (0.5, 0.3, 0.2)


def _setup(hidden=32):
    from hap.models.digits import digits_split, epoch_batches, vit_for_digits

    train, _ = digits_split()
    torch.manual_seed(0)
    model = vit_for_digits(hidden=hidden, layers=1, heads=4, mlp=2 * hidden)
    return model, epoch_batches(train, 16, 0)[:STEPS]


def _reference() -> dict:
    model, batches = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # Adam would blow up the k bias: its true gradient is 0
    for images, labels in batches:
        model(images, labels).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def migrating(rank, world, method, shares, moved, reshard_at, receiving=None):
    import hap
    from hap.capture import capture
    from hap.cost.cluster import local_cluster
    from hap.planner import baseline_plan
    from hap.straggler import Mitigator, StragglerConfig

    model, batches = _setup()
    cluster = local_cluster((1.0,) * world, "local")
    graph = capture(model, batches[0])
    plan = baseline_plan(graph, cluster, "megatron", ratios=shares)
    dmodel = hap.HAP(model, cluster, batches[0], plan=plan, graph=graph)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1, momentum=0.9)
    mit = Mitigator(dmodel, StragglerConfig(policy="migrate", method=method), opt)
    kinds = sorted({s.kind for s in mit.sites})
    handed = 0
    for it, (images, labels) in enumerate(batches):
        if it == reshard_at:
            mit.reshard_to([0.2, 0.3, 0.5][:world] if world == 3 else [0.7, 0.3])
        mit.begin_step(it)
        mit.moved, mit.receiving = list(moved), receiving  # this step's handovers, as a decision would set them
        mit._plan_work()
        takers = {r for w in mit.work.values() for h in w.handovers for r in h.receivers}
        handed += sum(len(w.handovers) for w in mit.work.values())
        dmodel(images, labels, part=False).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mit.moved = [0.0] * world
        mit.end_step()
    state = dmodel.full_state_dict()
    return {"kinds": kinds, "handed": handed, "ratios": dmodel.plan.ratios[0], "takers": sorted(takers),
            "state": {k: v.tolist() for k, v in state.items()}}


@pytest.mark.parametrize("method", ["broadcast-reduce", "scatter-gather"])
def test_migration_trains_like_one_device(method, tmp_path):
    # rank 0 hands 60% of its columns to ranks 1 and 2; rank 2 hands 30% of its own to rank 1
    reports = run_ranks(migrating, 3, tmp_path, method, SHARES, (0.6, 0.0, 0.3), -1)
    ref = _reference()
    assert reports[0]["kinds"] == ["column", "row"]
    assert reports[0]["handed"] > 0
    for got in reports:
        for k, v in ref.items():
            assert torch.allclose(torch.tensor(got["state"][k]), v, rtol=1e-4, atol=1e-5), (method, k)


def test_only_the_named_receivers_take_columns(tmp_path):
    # SEMI with several stragglers: rank 0 migrates, rank 1 prunes (so takes nothing), rank 2 takes it all
    reports = run_ranks(migrating, 3, tmp_path, "broadcast-reduce", SHARES, (0.7, 0.0, 0.0), -1, [2])
    ref = _reference()
    assert reports[0]["takers"] == [2]
    for got in reports:
        for k, v in ref.items():
            assert torch.allclose(torch.tensor(got["state"][k]), v, rtol=1e-4, atol=1e-5), k


def test_rebalance_reshards_mid_run_and_trains_like_one_device(tmp_path):
    reports = run_ranks(migrating, 3, tmp_path, "broadcast-reduce", SHARES, (0.5, 0.0, 0.0), 2)
    ref = _reference()
    assert reports[0]["ratios"] != list(SHARES)  # the shares moved
    for got in reports:
        for k, v in ref.items():
            assert torch.allclose(torch.tensor(got["state"][k]), v, rtol=1e-4, atol=1e-5), k


def pretesting(rank, world, shares):
    import hap
    from hap.capture import capture
    from hap.cost.cluster import local_cluster
    from hap.planner import baseline_plan
    from hap.straggler import Mitigator, StragglerConfig

    model, batches = _setup()
    cluster = local_cluster((1.0,) * world, "local")
    graph = capture(model, batches[0])
    plan = baseline_plan(graph, cluster, "megatron", ratios=shares)
    dmodel = hap.HAP(model, cluster, batches[0], plan=plan, graph=graph)
    mit = Mitigator(dmodel, StragglerConfig(policy="semi"), torch.optim.SGD(dmodel.parameters(), lr=0.1))
    ex = dmodel.executor
    empty = sum(ex.params[s.weight].shape[1] == 0 for s in mit.sites)
    return {"pretest": {k: list(v) if isinstance(v, tuple) else v for k, v in mit._pretest().items()}, "empty": int(empty),
            "tokens": [s.tokens for s in mit.sites]}


def test_semi_pretest_runs_where_a_rank_holds_no_columns(tmp_path):
    # rank 1's share is 0: none of its layers has a column to prune (it crashed the pre-test)
    reports = run_ranks(pretesting, 2, tmp_path, (1.0, 0.0))
    assert reports[1]["empty"] > 0
    assert reports[0]["pretest"] == reports[1]["pretest"]  # the ranks agree on the mean
    assert reports[0]["pretest"]["omega1"] >= 0
    # each layer prices its own rows: the patch and block layers one per patch of the 16 images,
    # the head (after mean pooling) one per image (every layer took the first layer's count)
    *blocks, head = reports[0]["tokens"]
    assert head == 16 and len(set(blocks)) == 1 and blocks[0] > 16 and blocks[0] % 16 == 0


class TiedAutoencoder(torch.nn.Module):
    """The decoder's weight is the encoder's, transposed: a linear whose weight is computed."""

    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(8, 6)

    def forward(self, x):
        h = torch.tanh(self.enc(x))  # [B, 6]
        return (torch.nn.functional.linear(h, self.enc.weight.t()) - x).pow(2).mean()  # [B, 8]


def tied_migrating(rank, world):
    import hap
    from hap.capture import capture
    from hap.cost.cluster import local_cluster
    from hap.planner import baseline_plan
    from hap.straggler import Mitigator, StragglerConfig

    torch.manual_seed(0)
    model = TiedAutoencoder()
    batches = [torch.randn(10, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    cluster = local_cluster((1.0,) * world, "local")
    example = (batches[0],)
    dmodel = hap.HAP(model, cluster, example, plan=baseline_plan(capture(model, example), cluster, "megatron",
                                                                 ratios=[0.6, 0.4]))
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1)
    from hap.straggler import parse_schedule

    refused = []
    for config, optimizers in [(StragglerConfig(policy="rebalance"), ()),
                               (StragglerConfig(policy="migrate"), None),  # (it was a TypeError)
                               (StragglerConfig(policy="migrate"), [opt, "adam"]),
                               (StragglerConfig(policy="migrate"), "adam"),
                               # parsed for 4 ranks: on 2 it slowed no one / dropped chis
                               (StragglerConfig(schedule=parse_schedule("persistent:chi=8,rank=3", 4)), opt),
                               (StragglerConfig(schedule=parse_schedule("multi:chi=8/4/2", 4)), opt)]:
        try:
            Mitigator(dmodel, config, optimizers)
            refused.append(None)
        except ValueError as e:
            refused.append(str(e))
    mit = Mitigator(dmodel, StragglerConfig(policy="migrate"), opt)
    for it, x in enumerate(batches):
        mit.begin_step(it)
        mit.moved = [0.5, 0.0]  # rank 0 hands half its columns over, as a decision would
        mit._plan_work()
        dmodel(x, part=False).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mit.end_step()
    return {"sites": [s.weight for s in mit.sites], "refused": refused,
            "state": {k: v.tolist() for k, v in dmodel.full_state_dict().items()}}


def test_a_computed_linear_weight_is_left_to_the_plan(tmp_path):
    """The tied decoder's weight is not a parameter: the Mitigator leaves that layer as the plan
    runs it (it failed with a KeyError at the first decision) and migrates the encoder exactly;
    'rebalance' without the optimizer is refused up front (it failed inside torch later)."""
    reports = run_ranks(tied_migrating, 2, tmp_path)
    torch.manual_seed(0)
    model = TiedAutoencoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        model(torch.randn(10, 8, generator=torch.Generator().manual_seed(i))).backward()
        opt.step()
        opt.zero_grad()
    for got in reports:
        assert got["sites"] == ["p_enc_weight"]
        assert got["refused"] == [
            "straggler policy 'rebalance' reshards the optimizer's state with the parameters: "
            "pass the optimizer, Mitigator(dmodel, config, opt)",
            None,
            "Mitigator's optimizers must be a torch.optim.Optimizer or a list of them, got ['SGD', 'str']",
            "Mitigator's optimizers must be a torch.optim.Optimizer or a list of them, got str",
            "straggler schedule 'rank 3 persistently 8x slower from iteration 0': 0 <= rank < 2 is needed",
            "straggler schedule 'stragglers with chi 8/4/2 on ranks 0..2': 3 stragglers on 2 ranks"]
        for k, v in model.state_dict().items():
            assert torch.allclose(torch.tensor(got["state"][k]), v, rtol=1e-5, atol=1e-6), k


def pridiff_reporting(rank, world):
    import hap
    from hap.capture import capture
    from hap.cost.cluster import local_cluster
    from hap.planner import baseline_plan
    from hap.straggler import Mitigator, StragglerConfig

    model, batches = _setup()
    cluster = local_cluster((1.0,) * world, "local")
    graph = capture(model, batches[0])
    plan = baseline_plan(graph, cluster, "megatron", ratios=(0.6, 0.4))
    dmodel = hap.HAP(model, cluster, batches[0], plan=plan, graph=graph)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1, momentum=0.9)
    mit = Mitigator(dmodel, StragglerConfig(policy="zero-pridiff-e", epoch=1), opt)
    steps = []
    for it, (images, labels) in enumerate(batches):
        mit.keep = [1.0, 0.5]  # rank 1 prunes half, as a decision would set it; PriDiff then sets each layer's ratio
        mit.begin_step(it)
        kept = [(s.columns[rank], mit.work[s.node].keep) for s in mit.sites]
        real = sum(n - len(k) for n, k in kept if k is not None) / sum(n for n, _ in kept)
        dmodel(images, labels, part=False).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        record = mit.end_step()
        steps.append({"real": real, "pruned": record["pruned"], "by_rank": record["pruned_by_rank"]})
    images, labels = batches[0]
    mit.keep = [1.0, 0.5]
    mit.begin_step(len(batches))
    dmodel(images[:8], labels[:8], part=False).backward()  # another shape: its layers run as planned
    opt.zero_grad(set_to_none=True)
    record = mit.end_step()
    return {"steps": steps, "other_shape": [record["pruned"], record["pruned_by_rank"]]}


def test_pridiff_reports_what_it_prunes_layer_by_layer(tmp_path):
    """The records (the log, hap train's progress line and summary) said PriDiff pruned the
    uniform gamma, 50%, where its per-layer ratios pruned 40% or 93% of the columns."""
    reports = run_ranks(pridiff_reporting, 2, tmp_path)
    for got in reports:  # a step of another shape prunes nothing, and says so
        assert got["other_shape"] == [0.0, [0.0, 0.0]]
    reports = [got["steps"] for got in reports]
    for rank, steps in enumerate(reports):
        for step, other in zip(steps, reports[1 - rank]):
            assert step["pruned"] == pytest.approx(step["real"], abs=1e-12)
            assert step["by_rank"] == other["by_rank"] and step["by_rank"][0] == 0.0
    ranks1 = reports[1]
    assert ranks1[0]["pruned"] == pytest.approx(0.5, abs=0.05)  # no statistics yet: the uniform ratio
    assert any(abs(s["pruned"] - 0.5) > 0.05 for s in ranks1[1:])  # the layers' own ratios
    assert [s["by_rank"][1] for s in ranks1] == pytest.approx([s["pruned"] for s in ranks1])


def test_a_rank_without_columns_is_probed_for_its_speed():
    # rank 1 holds no columns; its probe ran at 8e9 FLOP/s, rank 0's layers at 1e9 (8x slow):
    # shares fitting the speeds would take 13.1 ms (2 ms of other work, 1e8 FLOPs at 9e9
    # FLOP/s), not rank 0's 102 ms. With no speed for rank 1 (0) rebalancing was off for good.
    busy_all = Stats(busy=0.102, matmul=0.100, flops=1e8, own=1.0, full_flops=1e8)
    idle = Stats(busy=0.001, matmul=0.0, flops=0.0, own=1.0, full_flops=0.0, probed=8e9)
    assert matmul_speeds([busy_all, idle], probed=True) == [pytest.approx(1e9), 8e9]
    assert rebalanced_time([busy_all, idle]) == pytest.approx(0.002 + 1e8 / 9e9)
    # pruning does not see the probe: the one rank doing the work keeps all its columns (with
    # the probe as the norm, ZERO pruned 94% of them because the other rank sat idle)
    assert matmul_speeds([busy_all, idle]) == [pytest.approx(1e9), 0.0]
    assert matmul_floor([busy_all, idle], 0) == 1.0


def idle_rank_rebalancing(rank, world, steps):
    import hap
    from hap.capture import capture
    from hap.planner import baseline_plan
    from hap.straggler import Mitigator, StragglerConfig, parse_schedule

    model, batches = _setup()
    cluster = hap.load_cluster("local-homo")
    graph = capture(model, batches[0])
    plan = baseline_plan(graph, cluster, "megatron", ratios=(1.0, 0.0))
    dmodel = hap.HAP(model, cluster, batches[0], plan=plan, graph=graph)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1, momentum=0.9)
    mit = Mitigator(dmodel, StragglerConfig(policy="rebalance", schedule=parse_schedule("persistent:chi=8,rank=0", world)),
                    opt)
    for it in range(steps):
        images, labels = batches[it % len(batches)]
        mit.begin_step(it)
        dmodel(images, labels, part=False).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mit.end_step()
    return {"ratios": dmodel.plan.ratios[0], "state": {k: v.tolist() for k, v in dmodel.full_state_dict().items()},
            "drawn": torch.rand(2).tolist()}


def test_rebalance_gives_columns_back_to_a_rank_that_holds_none(tmp_path):
    """A rank resharded to a share of 0 showed no speed, so rebalancing stopped for good: a
    straggler moving onto the one rank still holding columns did all the work while the other
    sat idle. Here rank 0 holds every column and runs 8x slow; rank 1, holding none, is
    probed and given columns, and training stays exact."""
    steps = 12
    reports = run_ranks(idle_rank_rebalancing, 2, tmp_path, steps)
    assert reports[0]["ratios"][1] > 0.3, reports[0]["ratios"]
    assert reports[0]["drawn"] == reports[1]["drawn"]  # the probe drew from the global generator on rank 1 alone
    model, batches = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for it in range(steps):
        model(*batches[it % len(batches)]).backward()
        opt.step()
        opt.zero_grad()
    for got in reports:
        for k, v in model.state_dict().items():
            assert torch.allclose(torch.tensor(got["state"][k]), v, rtol=1e-4, atol=1e-5), k


def held_gradients(rank, world, mode):
    """rebalance under a persistent 8x straggler on rank 1, the step's end_step called before
    the optimizer's step ("late") or around each of two accumulated micro-batches ("micro"):
    the reshard end_step decides waits for the gradients to be cleared. First, refusals: a
    policy of rank 0's own, an end_step without begin_step, and reshard_to while gradients are
    held."""
    import hap
    from hap.capture import capture
    from hap.cost.cluster import local_cluster
    from hap.planner import baseline_plan
    from hap.straggler import Mitigator, StragglerConfig, parse_schedule

    model, batches = _held_setup()
    cluster = local_cluster((1.0,) * world, "local")
    graph = capture(model, batches[0])
    dmodel = hap.HAP(model, cluster, batches[0], plan=baseline_plan(graph, cluster, "megatron"), graph=graph)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1)
    refused = []
    try:
        Mitigator(dmodel, StragglerConfig(policy="migrate" if rank == 0 else "none"), opt)
    except ValueError as e:
        refused.append(str(e))
    config = StragglerConfig(policy="rebalance", schedule=parse_schedule("persistent:chi=8,rank=1", world))
    mit = Mitigator(dmodel, config, opt)
    try:
        mit.end_step()
    except ValueError as e:
        refused.append(str(e))
    resharded = []
    for it in range(HELD_STEPS):
        for m in range(2 if mode == "micro" else 1):
            mit.begin_step(2 * it + m if mode == "micro" else it)
            (dmodel(*batches[2 * it + m], part=False) / 2).backward() if mode == "micro" else \
                dmodel(*batches[it], part=False).backward()
            if mit.end_step()["resharded"]:
                resharded.append(it)
        if it == 1 and mode == "late":
            try:
                mit.reshard_to([0.7, 0.3])
            except ValueError as e:
                refused.append(str(e))
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = dmodel.full_state_dict()
    return {"refused": refused, "resharded": resharded, "ratios": dmodel.plan.ratios[0],
            "state": {k: v.tolist() for k, v in state.items()}}


HELD_STEPS = 8


def _held_setup():
    from hap.models.digits import digits_split, epoch_batches, vit_for_digits

    train, _ = digits_split()
    torch.manual_seed(0)
    return vit_for_digits(hidden=32, layers=1, heads=4, mlp=64), epoch_batches(train, 16, 0)[:2 * HELD_STEPS]


@pytest.mark.parametrize("mode", ["late", "micro"])
def test_a_rebalance_decided_while_gradients_are_held_waits_for_them_and_stays_exact(mode, tmp_path):
    """The reshard had cleared the gradients itself, and the step's (or the micro-batch's)
    gradient was lost: 9.8e-3 and 4.1e-3 from one device, silently."""
    reports = run_ranks(held_gradients, 2, tmp_path, mode)
    model, batches = _held_setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for it in range(HELD_STEPS):
        for m in range(2 if mode == "micro" else 1):
            (model(*batches[2 * it + m]) / 2).backward() if mode == "micro" else model(*batches[it]).backward()
        opt.step()
        opt.zero_grad()
    for got in reports:
        assert got["refused"][:2] == [
            "Mitigator: rank 1's StragglerConfig.policy is 'none', rank 0's 'migrate': every rank mitigates alike",
            "Mitigator.end_step without begin_step: call mit.begin_step(iteration) before the step's forward, and "
            "end_step after its backward"]
        if mode == "late":
            assert got["refused"][2] == "reshard between steps: gradients must be cleared first (zero_grad(set_to_none=True))"
        assert got["resharded"] and got["ratios"][1] < 0.5, (got["resharded"], got["ratios"])  # rank 1's share shrank
        for k, v in model.state_dict().items():
            assert torch.allclose(torch.tensor(got["state"][k]), v, rtol=1e-4, atol=1e-6), k
