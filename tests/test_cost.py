"""Cost model: FLOPs from torch's accounting, bytes (not elements), collectives, machines."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hap.capture import capture
from hap.cost.cluster import Cluster, Device, cluster_from_dict, fits_from_network
from hap.cost.model import CostModel
from hap.rules import strategy_table
from hap.rules.units import ShardClasses

torch.set_num_threads(1)


class ConvAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.proj = nn.Linear(16, 24)

    def forward(self, img, seq):
        y = self.conv(img).sum()
        q = self.proj(seq).view(2, 5, 2, 12).transpose(1, 2)  # [B, heads, S, head_dim]
        return y + F.scaled_dot_product_attention(q, q, q).sum()


@pytest.fixture(scope="module")
def graph():
    return capture(ConvAttn(), (torch.randn(2, 3, 6, 6), torch.randn(2, 5, 16)))


def node(graph, op):
    return next(n for n in graph.nodes if n.op == op)


def test_flops_follow_torch_accounting(graph):
    conv = node(graph, "aten.conv2d.default")
    # 2 * N * Cout * H * W * Cin * kh * kw: the kernel size counts (3x3 -> 9x a 1x1 conv).
    assert conv.flops == 2 * 2 * 8 * 6 * 6 * 3 * 3 * 3
    lin = node(graph, "aten.linear.default")
    assert lin.flops == 2 * 2 * 5 * 16 * 24
    assert lin.bwd_flops == lin.flops  # only the weight gradient: the input needs none
    sdpa = node(graph, "aten.scaled_dot_product_attention.default")
    assert sdpa.flops == 2 * (2 * 2 * 2 * 5 * 5 * 12)  # QK^T and AV


def test_bytes_not_elements(graph):
    t = graph.tensors[node(graph, "aten.linear.default").outputs[0]]
    assert t.nbytes == 4 * t.numel  # float32
    devs = (Device(name="a", flops=1e12, memory=2**34), Device(name="b", flops=1e12, memory=2**34))
    cl = Cluster(name="t", devices=devs, collectives=fits_from_network(2, 1e9, 0.0))
    cost = CostModel(graph, cl, ShardClasses(graph, enumerate(strategy_table(graph))))
    # all-reduce of n bytes on 2 devices over 1e9 B/s: 2 (m-1)/m * n / bw = n / 1e9 (+ launch).
    launch = cl.fit("all_reduce").alpha
    assert cost.comm("all_reduce", t.nbytes).const - launch == pytest.approx(t.nbytes / 1e9)


def test_padded_gather_vs_grouped_broadcast_crossover(graph):
    devs = tuple(Device(name=f"d{i}", flops=1e12, memory=2**34) for i in range(4))
    cl = Cluster(name="t", devices=devs, collectives=fits_from_network(4, 1e9, 1e-5))
    cost = CostModel(graph, cl, ShardClasses(graph, []))
    n = 4 * 2**20
    even = [0.25] * 4
    skewed = [0.85, 0.05, 0.05, 0.05]
    padded = lambda s: cost.comm_time("all_gather_padded", n, s)
    grouped = lambda s: cost.comm_time("all_gather_grouped", n, s)
    assert padded(even) < grouped(even)      # near-even: NCCL's all-gather wins
    assert grouped(skewed) < padded(skewed)  # skewed: padding wastes bandwidth, broadcasts win
    assert padded(skewed) == pytest.approx(padded(even) + 4 * (0.85 - 0.25) * n / cl.fit("all_gather").beta)


def test_machine_devices_divide_compute_and_add_intra_sync(graph):
    one = Device(name="g", flops=1e12, memory=2**34)
    machine = Device(name="m", flops=1e12, memory=2**34, gpus=4, intra_bandwidth=1e10)
    cl = Cluster(name="t", devices=(one, machine), collectives=fits_from_network(2, 1e9, 0.0))
    cost = CostModel(graph, cl, ShardClasses(graph, []))
    conv = node(graph, "aten.conv2d.default")
    fwd, bwd = cost.base_times(conv)
    assert fwd[1] == pytest.approx(fwd[0] / 4)
    # 2 (k-1)/k * bytes / intra_bw for a machine, nothing for a single GPU.
    assert cost.grad_intra(1e6) == pytest.approx((0.0, 2 * 3 / 4 * 1e6 / 1e10))


class TiedHead(nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.embed, self.head = nn.Embedding(100, 16), nn.Linear(16, 100, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids)).logsumexp(-1).mean()


def test_a_machine_reduces_a_tied_parameters_gradient_once():
    """A machine's GPUs all-reduce a tied table's gradient once, after its two uses add up; it
    was priced at every use (twice the table's intra-machine reduce)."""
    from hap.planner import baseline_plan
    from hap.search.program import NumericShares, node_times

    machine = Device(name="m", flops=1e12, memory=2**34, gpus=4, intra_bandwidth=1e10)
    cl = Cluster(name="t", devices=(machine, machine), collectives=fits_from_network(2, 1e9, 0.0))
    backward = {}
    for tie in (True, False):
        graph = capture(TiedHead(tie), (torch.randint(0, 100, (8, 4)),))
        cost = CostModel(graph, cl, ShardClasses(graph, enumerate(strategy_table(graph))))
        alg = NumericShares(cost, [[0.5, 0.5]])
        for step in baseline_plan(graph, cl, "dp-ev").steps(graph):
            backward[tie, graph.nodes[step.node].op] = node_times(cost, alg, step.node, step.strategy, step.loads, 0)[1]
    reduce = cost.grad_intra(100 * 16 * 4)[0]  # the table's gradient, once
    embedding, head = "aten.embedding.default", "aten.linear.default"
    assert backward[True, embedding][0] == pytest.approx(backward[False, embedding][0])  # reduced at its first use
    assert backward[True, head][0] == pytest.approx(backward[False, head][0] - reduce)  # not again at the head


def test_measured_node_times_replace_flops_and_split_fixed_from_work():
    from hap.ir import NodeTiming
    from hap.cost.calibrate import measure_nodes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    x = torch.randn(64, 64)

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, inp):
            return self.m(inp).pow(2).mean()

    wrapped = Wrapped()
    g = capture(wrapped, (x,))
    timing = measure_nodes(g, wrapped, (x,), device_flops=1e11, small_inputs=(x[:16],))
    assert len(timing.fwd) == len(g.nodes) and all(t >= 0 for t in timing.fwd + timing.fwd_fixed)
    assert sum(timing.fwd) + sum(timing.fwd_fixed) > 0 and sum(timing.bwd) + sum(timing.bwd_fixed) > 0
    # Priced from the timing: a device of 1e11 FLOP/s takes the measured seconds, one of
    # 2.5e10 four times them; the fixed part is not scaled by the share. Worked example with
    # set values: node 0 forward = 3 ms work + 1 ms fixed.
    n = len(g.nodes)
    g.timing = NodeTiming(fwd=(3e-3,) * n, bwd=(6e-3,) * n, fwd_fixed=(1e-3,) * n, bwd_fixed=(2e-3,) * n,
                          device_flops=1e11)
    devices = (Device(name="fast", flops=1e11, memory=2**30), Device(name="slow", flops=2.5e10, memory=2**30))
    cost = CostModel(g, Cluster(name="t", devices=devices, collectives=fits_from_network(2, 1e9, 0.0)),
                     ShardClasses(g, enumerate(strategy_table(g))))
    node = g.nodes[0]
    fwd, bwd = cost.base_times(node)
    assert fwd == pytest.approx((3e-3, 12e-3)) and bwd == pytest.approx((6e-3, 24e-3))
    fixed_fwd, fixed_bwd = cost.fixed_times(node)
    assert fixed_fwd == pytest.approx((1e-3, 4e-3)) and fixed_bwd == pytest.approx((2e-3, 8e-3))


def test_calibrated_scales_idle_devices_and_the_loss_all_reduce():
    """Worked example: one node, 3 ms forward work + 1 ms fixed, 6 + 2 ms backward, on a
    calibrated pair of devices (factors fast 1.5/2/1.25/1, slow 4/4/3/3)."""
    from hap.ir import NodeTiming
    from hap.search.program import NumericShares, node_times

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x).sum()

    g = capture(Net(), (torch.randn(4, 8),))
    n = len(g.nodes)
    g.timing = NodeTiming(fwd=(3e-3,) * n, bwd=(6e-3,) * n, fwd_fixed=(1e-3,) * n, bwd_fixed=(2e-3,) * n,
                          device_flops=1e11, device_scale=((1.5, 2.0, 1.25, 1.0), (4.0, 4.0, 3.0, 3.0)))
    devices = (Device(name="fast", flops=1e11, memory=2**30, op_overhead=1e-5),
               Device(name="slow", flops=2.5e10, memory=2**30, op_overhead=4e-5))
    cluster = Cluster(name="t", devices=devices, collectives=fits_from_network(2, 1e9, 5e-4))
    strategies = strategy_table(g)
    cost = CostModel(g, cluster, ShardClasses(g, enumerate(strategies)))
    mm = next(nd for nd in g.nodes if nd.op == "aten.linear.default")
    assert cost.base_times(mm) == (pytest.approx((4.5e-3, 12e-3)), pytest.approx((7.5e-3, 18e-3)))
    # calibrated: the executor's overhead is in the factors, op_overhead is not added again
    assert cost.fixed_times(mm) == (pytest.approx((2e-3, 4e-3)), pytest.approx((2e-3, 6e-3)))
    # split 1/0 on the batch: the slow device holds none of it and pays only the fastest
    # device's bookkeeping (1e-5 s per pass), not its own stretched fixed time
    batch = next(st for st in strategies[mm.index] if st.inputs[0].kind == "S" and st.inputs[0].dim == 0)
    fwd, bwd = node_times(cost, NumericShares(cost, [[1.0, 0.0]]), mm.index, batch, [], 0)
    assert fwd == pytest.approx((4.5e-3 + 2e-3, 1e-5)) and bwd == pytest.approx((7.5e-3 + 2e-3, 1e-5))
    # every step ends with the loss's scalar all-reduce: latency 5e-4 s (ring, 2 devices)
    assert cost.loss_sync == pytest.approx(cost.comm("all_reduce", 4.0).const) and cost.loss_sync > 5e-4
    with pytest.raises(ValueError, match="calibrated on 2 devices, the cluster has 1"):
        CostModel(g, Cluster(name="one", devices=devices[:1], collectives=fits_from_network(1, 1e9, 0.0)),
                  ShardClasses(g, enumerate(strategies)))


def test_a_device_with_no_share_of_a_random_node_still_draws_its_numbers():
    """Every device draws a random node's whole tensor of numbers and keeps its part
    (rules/local.py): one holding no rows of a dropout still draws them all. It was priced at
    its bookkeeping alone: a hunt's idle 3x-slow rank drew 9 ms per step against 0.8 ms without
    dropout, none of it in the estimate."""
    from hap.search.program import NumericShares, node_times

    class Dropped(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return F.dropout(self.fc(x), 0.5).sum()

    g = capture(Dropped(), (torch.randn(64, 16),))
    devices = (Device(name="a", flops=1e11, memory=2**30, op_overhead=1e-5, mem_bandwidth=1e10),
               Device(name="b", flops=5e10, memory=2**30, op_overhead=1e-5, mem_bandwidth=5e9))
    cluster = Cluster(name="t", devices=devices, collectives=fits_from_network(2, 1e9, 5e-4))
    strategies = strategy_table(g)
    cost = CostModel(g, cluster, ShardClasses(g, enumerate(strategies)))
    for op, random in (("aten.native_dropout.default", True), ("aten.linear.default", False)):
        node = next(nd for nd in g.nodes if nd.op == op)
        batch = next(st for st in strategies[node.index] if st.inputs[0].kind == "S" and st.inputs[0].dim == 0)
        fwd, bwd = node_times(cost, NumericShares(cost, [[1.0, 0.0]]), node.index, batch, [], 0)
        whole = cost.base_times(node)[0][1]  # device b's forward of the whole node
        assert fwd[1] == pytest.approx(cost.idle + (whole if random else 0.0)) and bwd[1] == pytest.approx(cost.idle)
        assert whole > 0


def test_random_ops_price_the_generator_broadcast():
    """hap.HAP broadcasts rank 0's generator state (5056 bytes) every step of a model with
    dropout: one broadcast, alpha + bytes / beta = 1e-3 + 5056 / 1e8 s here; without dropout, or
    on one device, nothing."""
    from hap.cost.cluster import Fit

    class Net(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.fc, self.p = nn.Linear(8, 8), p

        def forward(self, x):
            return F.dropout(self.fc(x), self.p).sum()

    fits = {**fits_from_network(2, 1e9, 5e-4), "broadcast": Fit(alpha=1e-3, beta=1e8)}
    devices = (Device(name="a", flops=1e11, memory=2**30), Device(name="b", flops=1e11, memory=2**30))

    def cost_of(p, devs):
        g = capture(Net(p), (torch.randn(4, 8),))
        cluster = Cluster(name="t", devices=devs, collectives=fits)
        return CostModel(g, cluster, ShardClasses(g, enumerate(strategy_table(g))))

    assert cost_of(0.5, devices).rng_sync == pytest.approx(1e-3 + 5056 / 1e8)
    assert cost_of(0.5, devices).step_overhead == pytest.approx(cost_of(0.5, devices).loss_sync + 1e-3 + 5056 / 1e8)
    assert cost_of(0.0, devices).rng_sync == 0.0 and cost_of(0.5, devices[:1]).rng_sync == 0.0


class Lookup(nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        self.table = nn.Embedding(100, 8, sparse=sparse)
        self.head = nn.Linear(8, 4)

    def forward(self, ids):
        return self.head(self.table(ids)).sum()


@pytest.mark.parametrize("sparse", [False, True])
def test_whole_parameters_cost_their_bytes_whatever_the_share(sparse):
    from hap.search.program import Load, NumericShares, price_node

    graph = capture(Lookup(sparse), (torch.randint(0, 100, (10,)),))
    devs = tuple(Device(name=f"d{i}", flops=1e12, memory=2**34, mem_bandwidth=1e9) for i in range(2))
    cl = Cluster(name="t", devices=devs, collectives=fits_from_network(2, 1e9, 0.0))
    table = strategy_table(graph)
    cost = CostModel(graph, cl, ShardClasses(graph, enumerate(table)))
    alg = NumericShares(cost, [[0.6, 0.4]])  # 10 rows: 6 and 4
    for op, weight_bytes in (("aten.linear.default", 8 * 4 * 4), ("aten.embedding.default", 100 * 8 * 4)):
        k = node(graph, op).index
        n = graph.nodes[k]
        params = [t for t in n.inputs if graph.tensors[t].kind == "param"]
        # the batch split 60/40, every parameter whole
        st = next(s for s in table[k] if cost.work_shard(n, s) is not None
                  and all(p.kind == "R" for t, p in zip(n.inputs, s.inputs) if t in params))
        loads = [Load(t, p) for t, p in zip(n.inputs, st.inputs) if t in params]
        fwd, bwd = price_node(cost, alg, k, st, loads, 0)
        base_f, base_b = cost.base_times(n)
        wb = sum(graph.tensors[t].nbytes for t in params)
        assert weight_bytes <= wb  # the bias, too, for the linear
        if op == "aten.linear.default":
            # each device reads every weight once forward, and again backward with its gradient written
            assert fwd == pytest.approx([0.6 * base_f[0] + wb / 1e9, 0.4 * base_f[1] + wb / 1e9])
            assert bwd == pytest.approx([0.6 * base_b[0] + 2 * wb / 1e9, 0.4 * base_b[1] + 2 * wb / 1e9])
        else:
            # the lookup reads its rows only (with the work); the dense gradient is table-sized, a sparse one is not
            written = 0 if sparse else wb
            assert fwd == pytest.approx([0.6 * base_f[0], 0.4 * base_f[1]])
            assert bwd == pytest.approx([0.6 * base_b[0] + written / 1e9, 0.4 * base_b[1] + written / 1e9])
        # the work itself no longer counts the parameter bytes
        moved = n.bytes_moved - wb
        assert base_f[0] == pytest.approx(n.flops / 1e12 + moved / 1e9)


@pytest.mark.parametrize("ratios, sent", [([0.6, 0.4], 6), ([0.5, 0.5], 5)])
def test_sparse_gradient_sync_is_padded_to_the_busiest_ranks_rows(ratios, sent):
    from hap.planner import baseline_plan
    from hap.search.program import replay

    graph = capture(Lookup(True), (torch.randint(0, 100, (10,)),))
    devs = tuple(Device(name=f"d{i}", flops=1e12, memory=2**34) for i in range(2))
    cl = Cluster(name="t", devices=devs, collectives=fits_from_network(2, 1e9, 0.0))
    cost = CostModel(graph, cl, ShardClasses(graph, enumerate(strategy_table(graph))))
    program = baseline_plan(graph, cl, "dp-ev").steps(graph)
    est = replay(program, cost, [0] * len(graph.nodes), [ratios])
    (bucket,) = est.buckets  # the head's 36 floats (144 bytes), all-reduced, then the table's rows
    # 10 ids split `ratios`: the busiest rank holds `sent` rows of 8 floats with an int64 index
    # (40 bytes); gloo gathers equal sizes, so both ranks send `sent` pairs: 2 * sent * 40 bytes
    # all-gathered (480 at 60/40, 400 at 50/50), where the bytes of 10 pairs were priced before.
    assert bucket.nbytes == 144 + 2 * sent * 40
    # the network's all-reduce: 20 us + V / 1 GB/s; its all-gather: 20 us + V / 2 GB/s, first
    # of the row counts (8 bytes per rank), then of the pairs
    head = 20e-6 + 144 / 1e9
    assert bucket.seconds == pytest.approx(head + 20e-6 + 2 * 8 / 2e9 + 20e-6 + 2 * sent * 40 / 2e9, rel=1e-9)


def test_a_sparse_gradient_sends_at_most_the_tables_rows():
    from hap.planner import baseline_plan
    from hap.search.program import replay

    graph = capture(Lookup(True), (torch.randint(0, 100, (150,)),))  # 150 ids, a table of 100 rows
    devs = tuple(Device(name=f"d{i}", flops=1e12, memory=2**34) for i in range(2))
    cl = Cluster(name="t", devices=devs, collectives=fits_from_network(2, 1e9, 0.0))
    cost = CostModel(graph, cl, ShardClasses(graph, enumerate(strategy_table(graph))))
    program = baseline_plan(graph, cl, "dp-ev").steps(graph)
    # the busiest rank looks up 90 ids at 60/40 (at most 90 rows), 135 at 90/10 (at most the
    # table's 100 rows): 2 ranks send that many pairs of 40 bytes
    for ratios, sent in (([0.6, 0.4], 90), ([0.9, 0.1], 100)):
        est = replay(program, cost, [0] * len(graph.nodes), [ratios])
        assert [b.nbytes for b in est.buckets] == [144 + 2 * sent * 40]
    # 8 ranks of 16 or so ids each send their ids' rows, not the table (the busiest: 19 of 150)
    devs8 = tuple(Device(name=f"d{i}", flops=1e12, memory=2**34) for i in range(8))
    cl8 = Cluster(name="t", devices=devs8, collectives=fits_from_network(8, 1e9, 0.0))
    cost8 = CostModel(graph, cl8, ShardClasses(graph, enumerate(strategy_table(graph))))
    est = replay(baseline_plan(graph, cl8, "dp-ev").steps(graph), cost8, [0] * len(graph.nodes), [[1 / 8] * 8])
    assert [b.nbytes for b in est.buckets] == [144 + 8 * 19 * 40]


def test_a_groups_collectives_are_priced_as_the_whole_clusters_are():
    """Over every device, a group's all-reduce is the gradient all-reduce (machines of several
    GPUs gather to one GPU and broadcast back, also in a group: paper-hetero-16 has them); on a
    cluster of measured fits, a group's all-gather is the all-gather's fit (it was the broadcast's)."""
    from hap.cost.cluster import load_cluster

    graph = capture(Lookup(False), (torch.randint(0, 100, (10,)),))
    for name in ("paper-hetero-16", "paper-hetero-8"):
        cl = load_cluster(name)
        cost = CostModel(graph, cl, ShardClasses(graph, enumerate(strategy_table(graph))))
        assert cost.group_collective("all_reduce", 1e8, range(cl.size)) == pytest.approx(cost.grad_sync(1e8), rel=1e-9)
    local = load_cluster("local")
    cost = CostModel(graph, local, ShardClasses(graph, enumerate(strategy_table(graph))))
    for kind in ("all_gather", "broadcast"):
        assert cost.group_collective(kind, 1e6, [0, 1]) == pytest.approx(local.fit(kind).time(1e6), rel=1e-12)
    assert local.fit("all_gather").time(1e6) != local.fit("broadcast").time(1e6)


def test_buckets_are_large_enough_for_the_algorithm_that_runs_them():
    """Gradient buckets end where the all-reduce's latency is at most a quarter of its time.
    Hand-worked: a tree at 1 us + b / 1e8 and a ring at 100 us + b / 1e9, the faster taken per
    size, cross at b = 11,000 bytes. The tree's own bound, 3 * 1e-6 * 1e8 = 300 bytes, holds only
    up to there; from then on the ring runs, whose bound is 3 * 1e-4 * 1e9 = 300,000 bytes. The
    chord at 1-2 bytes (the tree's) gave 300."""
    from hap.cost.model import enough_bucket_bytes
    both = lambda b: min(1e-6 + b / 1e8, 1e-4 + b / 1e9)  # noqa: E731
    assert enough_bucket_bytes(both) == pytest.approx(300_000, rel=1e-6)
    assert enough_bucket_bytes(lambda b: 2e-4 + b / 7.4e8) == pytest.approx(444_000, rel=1e-6)  # one line: 3 alpha / slope
    assert enough_bucket_bytes(lambda b: 0.0) == 0.0  # one device: nothing to wait for


def test_auto_topology_buckets_fit_the_ring_that_runs_them(graph):
    # 8 machines of one device at 10 Gbps, 30 us: "auto" runs the ring at bucket sizes, so
    # buckets are what "ring" makes them (they were 7.5x smaller, latency 72% of their time)
    from hap.cost.model import enough_bucket_bytes
    def cluster(algorithm):
        return cluster_from_dict({"devices": [{"name": "g", "count": 8, "flops": "1TFLOPS", "memory": "16GiB"}],
                                  "machines": [{"name": f"m{i}", "devices": 1, "nic": {"bandwidth": "10Gbps", "latency": "30us"}}
                                               for i in range(8)], "algorithm": algorithm})
    classes = ShardClasses(graph, enumerate(strategy_table(graph)))
    auto, ring = (enough_bucket_bytes(CostModel(graph, cluster(a), classes).grad_sync) for a in ("auto", "ring"))
    assert auto == pytest.approx(ring, rel=1e-6) and ring > 9e5


class Classifier(nn.Module):
    def __init__(self, shifted=False):
        super().__init__()
        self.fc, self.shifted = nn.Linear(64, 4), shifted

    def forward(self, x, y):  # y: [B, 2] targets; the loss takes one column (computed) or all of them (loaded)
        logits = self.fc(x)  # [B, 2, 4]
        targets = y[:, 1] if self.shifted else y
        return F.cross_entropy((logits[:, 1] if self.shifted else logits.transpose(1, 2)), targets)


@pytest.mark.parametrize("shifted", [False, True])
def test_a_loss_count_is_priced_as_the_runtime_waits_for_it(shifted):
    """Split, a mean over class-index targets divides by their count on every device: an 8-byte
    all-reduce. hap.HAP starts it with the step when the targets are inputs, so only what the
    forward leaves of it is waited for; a count of targets the forward computes is waited for
    whole. It was priced at nothing either way (an emulated 20 ms link measured 1.4x the estimate)."""
    graph = capture(Classifier(shifted), (torch.randn(16, 2, 64), torch.randint(0, 4, (16, 2))))
    loss = next(n for n in graph.nodes if n.op == "aten.cross_entropy_loss.default")
    split = next(st for st in strategy_table(graph)[loss.index] if st.local == "loss_mean")
    classes = ShardClasses(graph, enumerate(strategy_table(graph)))
    for latency, flops, fast in ((1e-2, 1e9, False), (1e-9, 1e6, True)):  # a slow link; then a slow forward
        cluster = Cluster(name="c", devices=(Device(name="a", flops=flops, memory=1e9),) * 2,
                          collectives=fits_from_network(2, 1e9, latency))
        cost = CostModel(graph, cluster, classes)
        count = cost.comm("all_reduce", 8.0).const
        # the least forward before the loss: each node split in proportion to speed (views cost nothing)
        forward = sum(1 / sum(1 / f for f in cost.base_times(n)[0]) for n in graph.nodes[: loss.index]
                      if min(cost.base_times(n)[0]) > 0)
        assert 0 < forward
        if shifted:
            assert cost.variant_comm(loss, split) == pytest.approx(count)
        else:
            assert cost.variant_comm(loss, split) == pytest.approx(0.0 if fast else count - forward)
            assert fast or count > forward  # (the slow link leaves some of it)
