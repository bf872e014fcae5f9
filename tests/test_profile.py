"""hap profile: the line fits it rests on, the emulation it measures, and the cluster file it
writes (which the planner must read back)."""

import json
import time

import pytest
import torch
from gloo import run_ranks

from hap.cost.cluster import ClusterError, cluster_from_dict, local_cluster
from hap.runtime.collectives import Comm
from hap.runtime.emulate import Emulation
from hap.runtime.profile import bandwidth_of, fit_line, profile_cluster


def test_fit_line_recovers_an_exact_line():
    # t = 2e-5 + units / 1e9: at 0, 1e6 and 4e6 units, 20 us, 1.02 ms and 4.02 ms
    fit = fit_line([0.0, 1e6, 4e6], [2e-5, 1.02e-3, 4.02e-3])
    assert fit.const == pytest.approx(2e-5, rel=1e-6)
    assert 1 / fit.per_unit == pytest.approx(1e9, rel=1e-6)
    assert fit.worst_residual < 1e-9


def test_fit_line_never_goes_negative():
    # Falling times (noise): an unconstrained fit would give a negative slope; nnls gives 0,
    # and the constant minimises ((c - 3)/3)^2 + ((c - 1)/1)^2: c = (1/3 + 1) / (1/9 + 1) = 1.2
    fit = fit_line([1.0, 2.0], [3.0, 1.0])
    assert fit.per_unit == 0.0 and fit.const == pytest.approx(1.2)
    # no slope is no infinite bandwidth (1e15 B/s was written): the largest message's units over
    # its whole time, 2 / 1; a slope's is its inverse
    assert bandwidth_of(fit, [1.0, 2.0], [3.0, 1.0]) == 2.0
    assert bandwidth_of(fit_line([0.0, 1e6, 4e6], [2e-5, 1.02e-3, 4.02e-3]), [], []) == pytest.approx(1e9, rel=1e-6)


def test_fit_line_needs_two_sizes():
    with pytest.raises(ValueError, match="two different sizes"):
        fit_line([5.0, 5.0], [1.0, 1.0])


def test_emulated_debt_is_slept_before_the_next_collective():
    emu = Emulation(slowdown=3.0)
    emu.computed(0.01)  # 10 ms at full speed: 20 ms more owed
    emu.computed(0.01, passes=2)  # a backward: 40 ms more
    assert emu.debt == pytest.approx(0.06)
    t0 = time.perf_counter()
    emu.settle()
    slept = time.perf_counter() - t0
    # oversleep is credited, not lost (the bound on `slept` only catches unit errors: a busy
    # machine may oversleep by any amount)
    assert 0.06 <= slept < 1.0 and emu.debt == pytest.approx(0.06 - slept, abs=5e-3)


def test_a_timed_op_pays_its_emulated_slowness_in_every_sample():
    """A 50 us op on a 3x device times about 3x (loosely: a shared machine). Each sample
    used to carry the credit of the previous sample's oversleep, so samples of a small op ran
    at full speed: 1.0-4.8x in three runs."""
    import time

    from hap.runtime.profile import timed

    def busy():  # 50 us of computing, however loaded the machine
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 5e-5:
            pass

    ratio = timed(busy, Emulation(slowdown=3.0), 9) / timed(busy, None, 9)
    assert 2.5 < ratio < 4.0


def test_emulated_links_cost_their_modelled_time():
    spec = {"devices": [{"flops": 1e10, "memory": "1GiB", "count": 2}],
            "network": {"bandwidth": "100MB/s", "latency": "1ms", "emulate": True}}
    cluster = cluster_from_dict(spec)
    assert cluster.emulated_network == (1e8, 1e-3)
    emu = Emulation.for_rank(cluster, 0)
    t0 = time.perf_counter()
    emu.communicated("broadcast", 2e6)  # 1 ms latency + 2 MB at 100 MB/s = 21 ms (+ launch overhead)
    assert 0.021 <= time.perf_counter() - t0 < 1.0  # the upper bound only catches unit errors
    assert cluster_from_dict(cluster.to_dict()).emulated_network == (1e8, 1e-3)  # the file form round-trips


def test_cluster_file_reads_op_overhead_and_rejects_bad_slowdown():
    dev = cluster_from_dict({"devices": [{"flops": 1e10, "memory": "1GiB", "op_overhead": "30us", "slowdown": 2}]})
    assert dev.devices[0].op_overhead == pytest.approx(3e-5) and dev.devices[0].slowdown == 2
    with pytest.raises(ClusterError, match="slowdown must be at least 1"):
        cluster_from_dict({"devices": [{"flops": 1e10, "memory": "1GiB", "slowdown": 0.5}]})
    with pytest.raises(ClusterError, match="network.emulate must be true or false"):
        cluster_from_dict({"devices": [{"flops": 1e10, "memory": "1GiB", "count": 2}],
                           "network": {"bandwidth": "1GB/s", "emulate": "yes"}})


def test_a_slowdown_under_one_is_refused_by_every_rank():
    """A cluster built in Python (not from a file) with a device faster than the machine (a
    planning model: local_cluster((1.0, 0.6), ...)) run on local processes: the executor of that
    device's rank alone refused it, and the other ranks waited for it in a collective until the
    timeout. Every rank now refuses any device's, before any collective."""
    fast = local_cluster((1.0, 0.6), "mine")
    for rank in (0, 1):
        with pytest.raises(ValueError, match=r"device 1 \(cpu1/0.6x\) of cluster 'mine': slowdown must be at least 1"):
            Emulation.for_rank(fast, rank)
    with pytest.raises(ValueError, match="slowdown must be at least 1, got 0.5"):  # one built directly
        Emulation(slowdown=0.5)


def profile_worker(rank, world, cluster_spec=None):
    cluster = local_cluster((1.0, 3.0), "local") if cluster_spec is None else cluster_from_dict(cluster_spec)
    spec = profile_cluster(cluster, Comm.default(), quick=True)
    return {"spec": spec}


def test_profiling_emulated_machines_keeps_them_emulated(tmp_path):
    """The profiled file of machines whose links are emulated keeps the machines and
    `emulate: true` beside the collectives measured under the emulation (it wrote one measured
    localhost machine instead: training on it ran unemulated, priced as emulated)."""
    link = {"bandwidth": "100MB/s", "latency": "100us"}
    given = {"name": "emu", "local": True, "emulate": True, "algorithm": "ring",
             "devices": [{"name": "cpu", "count": 2, "flops": 1e11, "memory": "4GiB"}],
             "machines": [{"name": m, "devices": 1, "intra": link, "nic": link} for m in ("a", "b")]}
    spec = run_ranks(profile_worker, 2, tmp_path, given)[0]["spec"]
    spec.pop("report")
    profiled, original = cluster_from_dict(spec), cluster_from_dict(given)
    assert profiled.emulate_links and profiled.measured_fits
    assert profiled.topology == original.topology


def test_profile_measures_the_emulated_slowdown(tmp_path):
    spec = run_ranks(profile_worker, 2, tmp_path)[0]["spec"]
    report = spec.pop("report")
    cluster = cluster_from_dict(spec)  # the file the planner reads
    fast, slow = cluster.devices
    # rank 1 is emulated 3x slower: its measured speed must show it (loosely: a shared machine)
    assert 1.8 < fast.flops / slow.flops < 5.0, report["devices"]
    assert slow.slowdown == 3.0 and slow.op_overhead > fast.op_overhead > 0
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        fit = cluster.fit(kind)
        assert fit.alpha > 0 and fit.beta > 0, (kind, fit)
    # the measured link between the two ranks: one machine, its link's latency and bandwidth
    link = cluster.topology.link(0, 1)
    assert cluster.topology.machines[0].devices == (0, 1) and cluster.measured_fits
    assert 0 < link.latency < 0.01 and link.bandwidth > 1e7, report["links"]


def test_calibration_measures_each_device_in_the_runtime():
    """calibrate_nodes runs the model on both local ranks at once: the emulated 3x device's
    passes come out several times the fast one's (loosely: a shared machine)."""
    from hap.capture import capture
    from hap.cost.cluster import load_cluster
    from hap.models import build
    from hap.cost.calibrate import calibrate_nodes, measure_nodes

    torch.manual_seed(0)
    model, batch = build("vit", scale="small", layers=1, hidden=32, batch=16)
    model.eval()  # no dropout: its whole-tensor noise is not what this measures
    graph = capture(model, batch)
    timing = measure_nodes(graph, model, batch, 1e11, tuple(t[:4] for t in batch))
    calibrated = calibrate_nodes(timing, model, batch, load_cluster("local"), steps=4)
    assert calibrated.fwd == timing.fwd and calibrated.device_scale is not None
    assert all(len(f) == 4 and min(f) >= 0 for f in calibrated.device_scale)

    def half(j, k):  # device j's calibrated pass k (0 forward, 1 backward) at share 1/2
        work, fixed = calibrated.device_scale[j][2 * k: 2 * k + 2]
        return work * sum((timing.fwd, timing.bwd)[k]) / 2 + fixed * sum((timing.fwd_fixed, timing.bwd_fixed)[k])

    # At share 1/2, which both devices ran (the second calibration plan), the fit passes through
    # the measured medians; at share 1 the slow device's fit (from shares 0.1 and 0.5)
    # extrapolates and a noisy machine can make it anything. Only a lower bound: on a tiny
    # model the emulated device's stretched bookkeeping per node and its backward, charged twice
    # the node's forward, make the ratio anything from 3 to 20.
    assert half(1, 0) / half(0, 0) > 1.5 and half(1, 1) / half(0, 1) > 1.5, calibrated.device_scale


def test_calibration_refuses_a_batch_too_small_to_split():
    """Every device needs two batch sizes to fit fixed and per-share time: one row cannot give
    them, and the error says so before any rank starts."""
    from hap.cost.cluster import load_cluster
    from hap.ir import NodeTiming
    from hap.cost.calibrate import calibrate_nodes

    timing = NodeTiming(fwd=(1e-3,), bwd=(2e-3,), fwd_fixed=(0.0,), bwd_fixed=(0.0,), device_flops=1e11)
    with pytest.raises(ValueError, match="a batch of 1 is too small to calibrate 2 devices on"):
        calibrate_nodes(timing, torch.nn.Linear(2, 2), (torch.randn(1, 2),), load_cluster("local"))


def test_calibration_shares_tilt_every_device_both_ways():
    """Compute-proportional shares (3:1 here) tilted 3:1 each way: (3*1.5, 1*0.5) = (4.5, 0.5)
    -> (0.9, 0.1), and (3*0.5, 1*1.5) = (1.5, 1.5) -> (0.5, 0.5). A homogeneous pair gets
    (0.75, 0.25) and (0.25, 0.75): every device has two different shares."""
    from hap.cost.calibrate import calibration_shares

    hetero = cluster_from_dict({"devices": [{"name": "fast", "flops": 3e10, "memory": "1GiB"},
                                            {"name": "slow", "flops": 1e10, "memory": "1GiB"}],
                              "network": {"bandwidth": "1GB/s", "latency": "10us"}})
    a, b = calibration_shares(hetero)
    assert a == pytest.approx((0.9, 0.1)) and b == pytest.approx((0.5, 0.5))
    a, b = calibration_shares(local_cluster((1.0, 1.0), "pair"))
    assert a == pytest.approx((0.75, 0.25)) and b == pytest.approx((0.25, 0.75))


def test_fit_calibration_splits_each_pass_into_fixed_and_work():
    """A device measured at 12 and 4 of 16 rows: forward 7 ms and 3 ms, so t(s) = 1 ms + s * 8 ms
    (s = 0.75 and 0.25); backward 13 and 5 ms: 1 ms + s * 16 ms. The node times sum to 4 ms of
    work and 0.5 ms fixed forward, 8 and 2 ms backward: factors 2, 2, 2, 0.5."""
    from hap.ir import NodeTiming
    from hap.cost.calibrate import fit_calibration

    timing = NodeTiming(fwd=(1e-3, 3e-3), bwd=(2e-3, 6e-3), fwd_fixed=(0.5e-3, 0.0), bwd_fixed=(1e-3, 1e-3),
                        device_flops=1e11)
    fitted = fit_calibration(timing, [(12, 4), (4, 12)], 16, [[(7e-3, 13e-3), (3e-3, 5e-3)],
                                                              [(3e-3, 5e-3), (7e-3, 13e-3)]])
    assert fitted.device_scale[0] == pytest.approx((2.0, 2.0, 2.0, 0.5))
    assert fitted.device_scale[1] == fitted.device_scale[0]  # the smaller share first: the same fit
    with pytest.raises(ValueError, match="two different, non-zero batch rows"):
        fit_calibration(timing, [(8, 8)], 16, [[(7e-3, 13e-3), (7e-3, 13e-3)]])
    # node times without a fixed part (measured at one batch size): the measured 1 ms is spread
    # over the two nodes, 0.5 ms each (it was dropped: the calibrated forward 6 of 7 ms at 12 rows)
    bare = NodeTiming(fwd=(1e-3, 3e-3), bwd=(2e-3, 6e-3), fwd_fixed=(0.0, 0.0), bwd_fixed=(0.0, 0.0), device_flops=1e11)
    fitted = fit_calibration(bare, [(12, 4)], 16, [[(7e-3, 13e-3), (3e-3, 5e-3)]])
    assert fitted.fwd_fixed == fitted.bwd_fixed == (0.5, 0.5)
    assert fitted.device_scale[0] == pytest.approx((2.0, 1e-3, 2.0, 1e-3))  # 1 ms of the 1 s spread


def test_wait_clock_runs_from_before_to_after_and_not_for_launches():
    """Comm.before starts the clock and Comm.after stops it; Comm.launching (an asynchronous
    collective that the rank does not wait for yet) leaves it alone."""
    from hap.runtime.collectives import WaitClock

    clock = WaitClock()
    comm = Comm(rank=0, world=2, clock=clock)
    comm.launching()
    assert clock.entered is None and clock.seconds == 0.0
    comm.before()
    time.sleep(0.02)
    comm.after("all_reduce", 4)
    assert 0.02 <= clock.seconds < 0.2 and clock.entered is None
    comm.after("all_reduce", 4)  # no wait was started: nothing counted
    assert clock.seconds < 0.2


def test_calibration_needs_two_devices():
    from hap.ir import NodeTiming
    from hap.cost.calibrate import calibrate_nodes

    timing = NodeTiming(fwd=(1e-3,), bwd=(2e-3,), fwd_fixed=(0.0,), bwd_fixed=(0.0,), device_flops=1e11)
    with pytest.raises(ValueError, match="calibration needs two devices at least; cluster 'one' has 1"):
        calibrate_nodes(timing, torch.nn.Linear(2, 2), (torch.randn(8, 2),), local_cluster((1.0,), "one"))


def _clocked_all_reduce(rank, world):
    from hap.runtime.collectives import WaitClock, all_reduce

    clock = WaitClock()
    comm = Comm(rank=rank, world=world, clock=clock)
    if rank == 1:
        time.sleep(0.05)  # rank 0 arrives first and waits for rank 1
    all_reduce(torch.ones(4), comm)
    return clock.seconds


def test_wait_clock_counts_the_time_inside_collectives(tmp_path):
    """The clock a calibration subtracts from wall time: rank 0 waits ~50 ms inside the
    all-reduce for rank 1, which itself spends little there."""
    first, last = run_ranks(_clocked_all_reduce, 2, tmp_path)
    assert 0.04 < first < 1.0 and last < first


def test_calibration_cache_keys_precision_and_frozen_layers_and_survives_damage(tmp_path, monkeypatch):
    """The cache key tells a float32 model from its bfloat16 copy and from a copy with a frozen
    layer (they shared one: a bfloat16 model read float32 times). A damaged cache file is
    measured anew and replaced (it was a JSONDecodeError); a cluster whose every device is
    emulated slower measures at the machine's speed (it was max() of nothing)."""
    import copy

    from hap.capture import capture
    from hap.cost import calibrate
    from hap.ir import NodeTiming

    class Loss(torch.nn.Sequential):
        def forward(self, x):
            return super().forward(x).sum()

    model = Loss(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    x = (torch.randn(8, 4),)
    cluster = local_cluster((2.0, 3.0), "slow-pair")
    half = copy.deepcopy(model).to(torch.bfloat16)
    frozen = copy.deepcopy(model)
    frozen[0].requires_grad_(False)
    keys = {calibrate._timing_key(capture(model, x), cluster), calibrate._timing_key(capture(half, (x[0].bfloat16(),)), cluster),
            calibrate._timing_key(capture(frozen, x), cluster)}
    assert len(keys) == 3
    # an embedding that differs by sparse=True alone (ncf against ncf-sparse) shared a key: ncf-sparse
    # read ncf's dense-gradient times (4 ms of backward where it measures 1.7)
    ids = (torch.randint(0, 10, (8,)),)
    tables = [torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=sparse), torch.nn.Flatten(0)) for sparse in (False, True)]
    assert len({calibrate._timing_key(capture(Loss(*t), ids), cluster) for t in tables}) == 2

    # nor on a machine with other cores free to this process (taskset: the cache priced 1.6x low)
    graph = capture(model, x)
    mine = calibrate._timing_key(graph, cluster)
    monkeypatch.setattr(calibrate.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(calibrate.os, "cpu_count", lambda: 64)
    assert calibrate._timing_key(graph, cluster) != mine
    monkeypatch.undo()

    speeds, threads = [], []
    monkeypatch.setattr(calibrate, "measure_nodes", lambda graph, model, inputs, speed, small: (
        speeds.append(speed), threads.append(torch.get_num_threads())))
    torch.set_num_threads(2)  # the launcher's (the ranks run on one; so are the nodes timed)
    n = len(graph.nodes)
    monkeypatch.setattr(calibrate, "calibrate_nodes", lambda measured, model, inputs, cluster: NodeTiming(
        fwd=(1.0,) * n, bwd=(2.0,) * n, fwd_fixed=(0.0,) * n, bwd_fixed=(0.0,) * n, device_flops=9e10,
        device_scale=((1.0, 1.0, 1.0, 1.0),) * 2))
    path = tmp_path / f"timing-{calibrate._timing_key(graph, cluster)}.json"
    whole = {"fwd": [1.0] * n, "bwd": [2.0] * n, "fwd_fixed": [0.0] * n, "bwd_fixed": [0.0] * n, "device_flops": 9e10,
             "device_scale": [[1.0] * 4] * 2}
    # valid JSON, damaged all the same: one node's times; a negative time; 3 devices' scales for 2;
    # no scales, or a device's all zero (every node free: they were taken); nesting that overflowed json
    wrong = [{**whole, "fwd": [1.0]}, {**whole, "bwd": [-2.0] * n}, {**whole, "device_scale": [[1, 0, 1, 0]] * 3},
             {**whole, "device_scale": None}, {**whole, "device_scale": [[1.0] * 4, [0.0] * 4]}]
    for damage in ("{", "", '{"fwd": [1.0]}', *map(json.dumps, wrong), "[" * 100_000):
        path.write_text(damage)
        timing, cached = calibrate.calibrated_timing(graph, model, x, cluster, str(tmp_path))
        assert not cached and timing.fwd == (1.0,) * n
        assert calibrate.calibrated_timing(graph, model, x, cluster, str(tmp_path)) == (timing, True)  # replaced
    assert speeds == [pytest.approx(9e10)] * 9 and threads == [1] * 9 and torch.get_num_threads() == 2
    torch.set_num_threads(1)


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.fc(x), y)  # the mean over y's count


def early_count_worker(rank, world):
    """The order in which a data-parallel step puts its collectives on the emulated link and
    its loss waits for the count of its targets."""
    import hap
    from hap.planner import baseline_plan
    from hap.runtime.executor import Executor

    events = []
    on_wire, wait = Emulation.on_wire, Executor._sum

    def recorded_on_wire(self, kind, volume, devices=None, occupies=True):
        events.append(f"{kind} {volume:g}{'' if occupies else ' beside'}")
        return on_wire(self, kind, volume, devices, occupies)

    def recorded_wait(self, t):
        events.append("loss waits")
        return wait(self, t)

    Emulation.on_wire, Executor._sum = recorded_on_wire, recorded_wait
    cluster = cluster_from_dict({"name": "emu", "local": True, "devices": [{"name": "cpu", "count": 2, "flops": 1e10,
                                                                           "memory": "1GiB"}],
                                 "network": {"bandwidth": "1GB/s", "latency": "1ms", "emulate": True}})
    torch.manual_seed(0)
    net = Classifier()
    x, y = torch.randn(10, 8), torch.randint(0, 4, (10,))
    dmodel = hap.HAP(net, cluster, (x, y), plan=baseline_plan(hap.capture(net, (x, y)), cluster, "dp-ev"))
    events.clear()
    dmodel(x, y).backward()
    return {"events": events}


def test_an_early_count_of_targets_takes_its_link_time_beside_the_forward(tmp_path):
    """A mean over class-index targets divides by their count over every rank, all-reduced
    (8 bytes) as the step starts. Its emulated link time began only once the loss waited for it,
    so a slow link was paid in full after the forward instead of beside it (as the cost model
    prices it: CostModel.early_count_seconds)."""
    events = run_ranks(early_count_worker, 2, tmp_path)[0]["events"]
    # started with the step, before the loss waits; beside the link's other traffic (a latency, which
    # the forward's own collectives need not queue behind)
    assert events.index("all_reduce 8 beside") < events.index("loss waits"), events


def test_a_slow_devices_backward_owes_nothing_for_the_numbers_its_forward_drew():
    """A dropout's forward draws the whole tensor's numbers, on an idle rank too; its backward
    only multiplies by the mask. The emulation owed twice the forward's time for the backward,
    draws included: an idle 3x-slow rank slept 9 ms per step of dropout it never ran."""
    from types import SimpleNamespace

    from hap.runtime.executor import Executor
    emu = Emulation(slowdown=3.0)
    x = torch.ones(4, requires_grad=True)
    (out,) = Executor._stretch(SimpleNamespace(emulation=emu), (x * 2,), 0.010, drawn=0.008)
    assert emu.debt == pytest.approx(2 * 0.010)  # the forward, draws and all, at 3x
    out.sum().backward()
    assert emu.debt == pytest.approx(2 * 0.010 + 2 * 2 * 0.002)  # the backward: twice the rest, at 3x
