"""Measure a cluster on itself and write the cluster file the planner consumes.

    hap profile --cluster local -o local-profiled.yaml      # local emulated ranks, gloo
    torchrun --nproc-per-node 8 -m hap profile --cluster cluster.yaml -o profiled.yaml   # GPUs, NCCL

Every rank measures its own device, emulation included (a device marked `slowdown` is timed
with its stretch, so the file says how fast the emulated device really is):
  - FLOP/s: matmul, convolution and attention at several sizes; time = c + flops / F by least
    squares per op family; the device's `flops` is the rate over the three together;
  - memory bandwidth: elementwise ops, time = c + bytes / BW;
  - op_overhead: seconds per node per pass of hap's executor on a chain of tiny nodes.
`measure_nodes` times a model's own nodes instead (graph.timing), which the cost model then
prices computation from: ops differ far more in speed than one FLOP/s rate says.
Rank 0 then times every collective the planner prices, with the runtime's own functions, over a
sweep of sizes (and uneven splits), each call right after 3 ms of computing as in training, and
fits time = alpha + volume / beta with the volumes of hap/cost/model.py. Each fit is a
non-negative least squares; its worst relative residual is reported.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from scipy.optimize import nnls

from ..cost.cluster import COLLECTIVES, Cluster
from ..ir import Graph, NodeTiming
from .collectives import Comm, WaitClock, all_reduce, all_to_all, gather_grouped, gather_padded, reduce_scatter
from .emulate import Emulation


@dataclass(frozen=True, slots=True)
class LineFit:
    const: float
    """Seconds at size 0."""
    per_unit: float
    """Seconds per unit (FLOP, byte)."""
    worst_residual: float
    """Largest |fit - measured| / measured over the sweep."""


def fit_line(units: Sequence[float], seconds: Sequence[float]) -> LineFit:
    """seconds ~ const + per_unit * units with both terms non-negative, least squares weighted
    by 1/seconds (so small and large sizes count alike)."""
    x, y = np.asarray(units, float), np.asarray(seconds, float)
    if len(x) < 2 or np.ptp(x) == 0:
        raise ValueError("a line fit needs at least two different sizes")
    w = 1.0 / y
    (const, per_unit), _ = nnls(np.stack([w, x * w], axis=1), np.ones_like(y))
    fitted = const + per_unit * x
    return LineFit(float(const), float(per_unit), float(np.max(np.abs(fitted - y) / y)))


def timed(fn: Callable[[], object], emulation: Emulation | None, repeats: int) -> float:
    """Median wall seconds of fn(), with this rank's emulated slowness paid inside each run."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if emulation is not None:
            emulation.computed(time.perf_counter() - t0)
            emulation.settle()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# -- computation ----------------------------------------------------------------------------------

def _compute_sweeps(quick: bool) -> dict[str, list[tuple[float, Callable]]]:
    """(FLOPs, op) per size for each op family; sizes small enough for a CPU core."""
    mm = [64, 128, 256] if quick else [64, 128, 256, 384, 512]
    conv = [8, 16, 32] if quick else [8, 16, 32, 48, 64]
    att = [32, 64, 128] if quick else [32, 64, 128, 192, 256]
    out: dict[str, list[tuple[float, Callable]]] = {"matmul": [], "conv": [], "attention": [], "elementwise": []}
    for n in mm:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out["matmul"].append((2.0 * n**3, lambda a=a, b=b: a @ b))
    for c in conv:
        x, w = torch.randn(8, c, 16, 16), torch.randn(c, c, 3, 3)
        out["conv"].append((2.0 * 8 * c * c * 9 * 16 * 16, lambda x=x, w=w: torch.nn.functional.conv2d(x, w, padding=1)))
    for s in att:
        q = torch.randn(4, 4, s, 32)
        out["attention"].append((4.0 * 4 * 4 * s * s * 32, lambda q=q: torch.nn.functional.scaled_dot_product_attention(q, q, q)))
    for n in ([2**14, 2**17, 2**20] if quick else [2**14, 2**16, 2**18, 2**20, 2**22]):
        a, b = torch.randn(n), torch.randn(n)
        out["elementwise"].append((3.0 * 4 * n, lambda a=a, b=b: a + b))  # bytes: two reads, one write
    return out


class _TinyChain(nn.Module):
    """Many nodes that do almost nothing: the executor's fixed cost per node."""

    def __init__(self, nodes: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.nodes = nodes

    def forward(self, x):
        y = x * self.w
        for _ in range(self.nodes // 2 - 1):
            y = torch.tanh(y) + 1.0
        return y.sum()


def op_overhead(emulation: Emulation | None, repeats: int) -> float:
    """Seconds per node per pass of the executor, forward and backward averaged."""
    from ..capture import capture
    from ..cost.cluster import local_cluster
    from ..planner import baseline_plan
    from ..rules import strategy_table
    from ..rules.units import ShardClasses
    from .executor import Executor, leaf_values

    model, inputs = _TinyChain(200), (torch.randn(4),)
    graph = capture(model, inputs)
    program = baseline_plan(graph, local_cluster((1.0,), "one"), "dp-ev")
    ex = Executor(graph, program.steps(graph), ShardClasses(graph, enumerate(strategy_table(graph))),
                  [0] * len(graph.nodes), program.ratios, Comm(rank=0, world=1, emulation=emulation))
    values = leaf_values(graph, model, inputs)
    ex.shard_parameters(values)

    def step():
        ex.forward(values).backward()
        if emulation is not None:  # the executor stretched each node; pay for them now
            emulation.settle()

    return timed(step, None, repeats) / (2 * len(graph.nodes))


def profile_device(emulation: Emulation | None, quick: bool = False) -> dict:
    """This rank's device: flops (over matmul, conv, attention), mem_bandwidth, op_overhead, and
    the per-family rates for the report."""
    repeats = 5 if quick else 9
    report: dict = {}
    total_flops = total_seconds = 0.0
    for family, sweep in _compute_sweeps(quick).items():
        seconds = [timed(fn, emulation, repeats) for _, fn in sweep]
        fit = fit_line([u for u, _ in sweep], seconds)
        rate = 1.0 / fit.per_unit if fit.per_unit > 0 else float("inf")
        report[family] = {"rate": rate, "const": fit.const, "worst_residual": fit.worst_residual}
        if family != "elementwise":
            total_flops += sweep[-1][0]
            total_seconds += seconds[-1] - fit.const
    report["flops"] = total_flops / total_seconds
    report["mem_bandwidth"] = report["elementwise"]["rate"]
    report["op_overhead"] = op_overhead(emulation, repeats)
    return report


# -- communication --------------------------------------------------------------------------------

def _collective_runs(comm: Comm, quick: bool) -> dict[str, list[tuple[float, Callable]]]:
    """(volume in bytes as cost/model.py defines it, run) per size for each collective."""
    m = comm.world
    rows = [2**8, 2**11, 2**14] if quick else [2**8, 2**10, 2**12, 2**14, 2**16]
    skew = [max(1, m - j) for j in range(m)]  # uneven shards: m, m-1, ..., 1 parts
    out: dict[str, list[tuple[float, Callable]]] = {k: [] for k in COLLECTIVES}
    for n in rows:
        whole = torch.randn(n * sum(skew), 16)  # 64 bytes a row
        sizes = [n * s for s in skew]
        mine = whole[: sizes[comm.rank]].contiguous()
        row_bytes = 64
        out["all_reduce"].append((whole.numel() * 4, lambda t=whole: all_reduce(t, comm)))
        out["all_gather"].append((m * max(sizes) * row_bytes, lambda x=mine, s=sizes: gather_padded(x, 0, s, comm)))
        out["reduce_scatter"].append((m * max(sizes) * row_bytes, lambda t=whole, s=sizes: reduce_scatter(t, 0, s, comm)))
        out["broadcast"].append((whole.numel() * 4 / m, lambda t=whole[: len(whole) // m].contiguous(): _broadcast(t, comm)))
        cols = [16 // m + (1 if j < 16 % m else 0) for j in range(m)]
        out["all_to_all"].append((m * max(sizes) * row_bytes,
                                  lambda x=mine, s=sizes, c=cols: all_to_all(x, 0, 1, s, c, comm)))
    return out


def _timed_after_compute(run: Callable[[], object], repeats: int) -> float:
    """Median seconds of a collective called right after 3 ms of computing on every rank. In
    training collectives come between computations, and on a shared CPU that makes them 2-5x
    slower than back-to-back calls (measured here: a 32 KB all-reduce 0.37 -> 1.7 ms, 1.4 MB
    0.67 -> 3.4 ms): caches are cold and the transport's threads must be woken."""
    work = torch.randn(192, 192)
    run()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        while time.perf_counter() - t < 3e-3:
            work @ work
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _broadcast(t: torch.Tensor, comm: Comm) -> None:
    # one broadcast is the grouped all-gather of a tensor with a single non-empty shard
    sizes = [t.shape[0] if j == 0 else 0 for j in range(comm.world)]
    gather_grouped(t if comm.rank == 0 else t[:0], 0, sizes, comm)


def profile_collectives(comm: Comm, quick: bool = False) -> dict[str, dict]:
    """alpha, beta per collective (every rank calls it; timings are rank 0's)."""
    repeats = 5 if quick else 9
    fits = {}
    for kind, runs in _collective_runs(comm, quick).items():
        seconds = []
        for _, run in runs:
            dist.barrier(group=comm.group)
            seconds.append(_timed_after_compute(run, repeats))
        fit = fit_line([v for v, _ in runs], seconds)
        fits[kind] = {"alpha": fit.const, "beta": 1.0 / fit.per_unit if fit.per_unit > 0 else 1e15,
                      "worst_residual": fit.worst_residual}
    return fits


def profile_cluster(cluster: Cluster, comm: Comm, quick: bool = False) -> dict | None:
    """Every rank measures its device and joins the collectives; rank 0 returns the profiled
    cluster spec (cluster-file form) with a `report` of the raw rates, the others None."""
    emulation = Emulation.for_rank(cluster, comm.rank)
    comm = Comm(rank=comm.rank, world=comm.world, group=comm.group, emulation=emulation)
    # devices one at a time: ranks share this machine's cores, and a device is timed alone
    mine = None
    for r in range(comm.world):
        dist.barrier(group=comm.group)
        if r == comm.rank:
            mine = profile_device(emulation if emulation.slowdown > 1 else None, quick)
    reports = [None] * comm.world
    dist.all_gather_object(reports, mine, group=comm.group)
    fits = profile_collectives(comm, quick) if comm.world > 1 else {}
    if comm.rank != 0:
        return None
    devices = []
    for dev, rep in zip(cluster.devices, reports):
        devices.append({"name": dev.name, "flops": float(rep["flops"]), "memory": dev.memory, "gpus": dev.gpus,
                        "mem_bandwidth": float(rep["mem_bandwidth"]), "op_overhead": float(rep["op_overhead"]),
                        "slowdown": dev.slowdown, **({"intra_bandwidth": dev.intra_bandwidth} if dev.gpus > 1 else {})})
    spec = {"name": f"{cluster.name}-profiled", "devices": devices,
            "collectives": {k: {"alpha": f["alpha"], "beta": f["beta"]} for k, f in fits.items()}}
    if cluster.emulated_network is not None:
        bandwidth, latency = cluster.emulated_network
        spec["network"] = {"bandwidth": bandwidth, "latency": latency, "emulate": True}
    if cluster.local:
        spec["local"] = True
    spec["report"] = {"devices": reports, "collectives": fits}
    return spec


# -- a model's own nodes --------------------------------------------------------------------------

def measure_nodes(graph: Graph, model: nn.Module, inputs: Sequence[torch.Tensor], device_flops: float,
                  small_inputs: Sequence[torch.Tensor] | None = None, repeats: int = 5) -> NodeTiming:
    """Time every node of `graph` alone on this process, as one device runs it: forward, and
    backward from a gradient of ones (medians of `repeats`). With `small_inputs` (the same
    model's inputs at a fraction q of the batch) the model is timed at both sizes and each
    node's time split into fixed + share * work; without, all of it is work. device_flops is
    this process's FLOP/s (the profiled `flops` of a device like it), which scales the times to
    other devices. Set the result as graph.timing before planning."""
    from ..capture import capture

    fwd, bwd = _node_seconds(graph, model, inputs, repeats)
    zeros = (0.0,) * len(fwd)
    if small_inputs is None:
        return NodeTiming(fwd=tuple(fwd), bwd=tuple(bwd), fwd_fixed=zeros, bwd_fixed=zeros, device_flops=device_flops)
    small = capture(model, tuple(small_inputs))
    if [n.op for n in small.nodes] != [n.op for n in graph.nodes]:
        raise ValueError("the model runs other ops at the smaller batch: time it at full size only")
    q = small_inputs[0].shape[0] / inputs[0].shape[0]
    if not 0 < q < 1:
        raise ValueError(f"small_inputs must hold a smaller batch than inputs (fraction {q:g})")
    s_fwd, s_bwd = _node_seconds(small, model, small_inputs, repeats)

    def split(full, part):  # t(1) = c + w, t(q) = c + q w, each clipped to [0, t(1)]
        fixed = [min(max((p - q * f) / (1 - q), 0.0), f) for f, p in zip(full, part)]
        return tuple(f - c for f, c in zip(full, fixed)), tuple(fixed)

    (fwd_w, fwd_c), (bwd_w, bwd_c) = split(fwd, s_fwd), split(bwd, s_bwd)
    return NodeTiming(fwd=fwd_w, bwd=bwd_w, fwd_fixed=fwd_c, bwd_fixed=bwd_c, device_flops=device_flops)


def _node_seconds(graph: Graph, model: nn.Module, inputs: Sequence[torch.Tensor], repeats: int):
    from ..placement import R
    from ..rules import Strategy
    from ..rules.local import LocalContext, run_node
    from .executor import leaf_values

    values = leaf_values(graph, model, inputs)
    ctx = LocalContext(device=0, world=1, split=lambda t, d: [graph.tensors[t].shape[d]], all_reduce=lambda t: t)
    fwd, bwd = [], []
    for node in graph.nodes:
        whole = Strategy(tuple(R for _ in node.inputs), tuple(R for _ in node.outputs), "whole")
        leaves = {}
        for name in dict.fromkeys(node.inputs):
            v = values[name].detach()
            leaves[name] = v.requires_grad_(graph.tensors[name].requires_grad and v.is_floating_point())
        f_times, b_times = [], []
        for _ in range(repeats + 1):  # the first run warms up
            t0 = time.perf_counter()
            outs = run_node(node, whole, leaves, graph, ctx)
            t1 = time.perf_counter()
            diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
            if diff:
                torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
            f_times.append(t1 - t0)
            b_times.append(time.perf_counter() - t1)
            for v in leaves.values():
                v.grad = None
        fwd.append(statistics.median(f_times[1:]))
        bwd.append(statistics.median(b_times[1:]))
        values.update((name, out.detach() if isinstance(out, torch.Tensor) else out) for name, out in zip(node.outputs, outs))
    return fwd, bwd


def calibrate_nodes(timing: NodeTiming, model: nn.Module, inputs: Sequence[torch.Tensor], cluster: Cluster,
                    steps: int = 20, calibration: tuple[list[str], list[tuple[int, int]]] | None = None
                    ) -> NodeTiming:
    """`timing` (from measure_nodes) with per-device factors measured on the cluster itself.

    Every device of `cluster` (one local process each, launched here, emulation included) trains
    the model with hap's runtime, data parallel with an SGD step, all devices at once as in
    training, at two sets of batch shares taking turns (`calibration_shares`), so each device
    runs a larger and a smaller part. Each pass's busy time on a device, its wall time less
    the time it spends inside collectives (waiting for the others, transferring), is fitted
    as fixed + share * work, as measure_nodes fits single nodes, and the factors make the node
    times' fixed parts and work parts add up to these. Busy time holds what timing nodes one at
    a time, alone on the machine, misses: the executor's cost per node, an emulated device's
    stretch (its backward is charged twice its forward), cold caches between nodes, the
    gradient buckets' copies and the optimizer step (in the backward's fixed part: priced as if
    every device held every parameter, as data parallelism does, also for plans that shard
    them) and, on a CPU, the devices and the transport's threads slowing each other down:
    together 30-100% of a step on the local cluster. The inputs' dim 0 must be the batch; the
    cluster needs two devices at least (a single device's node times need no calibration).
    `calibration`: what calibration_plans returns, where the caller has it already."""
    from .launch import spawn

    plans, rows = calibration or calibration_plans(model, inputs, cluster)
    with tempfile.TemporaryDirectory(prefix="hap-calibrate-") as tmp:
        spawn(_calibrate_rank, cluster.size, args=(model, tuple(inputs), plans, cluster, steps, tmp), timeout_s=600)
        passes = [json.loads(open(os.path.join(tmp, f"rank{j}.json")).read()) for j in range(cluster.size)]
    return fit_calibration(timing, rows, inputs[0].shape[0], passes)


def calibration_plans(model: nn.Module, inputs: Sequence[torch.Tensor], cluster: Cluster
                      ) -> tuple[list[str], list[tuple[int, int]]]:
    """The two data-parallel plans (as JSON) the calibration trains, and each device's rows of
    the batch under them."""
    from ..capture import capture
    from ..planner import baseline_plan

    batch = inputs[0].shape[0]
    if cluster.size < 2:
        raise ValueError(f"calibration needs two devices at least; cluster {cluster.name!r} has {cluster.size}")
    if batch < 2 * cluster.size:
        raise ValueError(f"a batch of {batch} is too small to calibrate {cluster.size} devices on")
    graph = capture(model, tuple(inputs))
    plans = [baseline_plan(graph, cluster, "dp-ev", ratios=r) for r in calibration_shares(cluster)]
    splits = [p.splits.get(graph.inputs[0], {}).get("0") for p in plans]
    if None in splits:
        raise ValueError("calibration needs the model's first input split on dim 0 (the batch) by data parallelism")
    rows = list(zip(*splits))  # per device: its rows under each plan
    if any(min(r) == 0 or r[0] == r[1] for r in rows):
        raise ValueError(f"a batch of {batch} is too small to calibrate {cluster.size} devices on")
    return [p.to_json() for p in plans], rows


def calibration_shares(cluster: Cluster) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Two sets of batch shares, compute-proportional ones tilted 3:1 one way then the other
    (every other device gets more): each device's share differs between them, and together
    they span much of what plans give it (a fast device beside a 3x slower one: 90% and 50%;
    the slow one: 10% and 50%), so the fit seldom extrapolates far."""
    cp = cluster.compute_proportional()
    tilts = [(1.5, 0.5) if j % 2 == 0 else (0.5, 1.5) for j in range(cluster.size)]
    out = []
    for k in range(2):
        raw = [c * t[k] for c, t in zip(cp, tilts)]
        out.append(tuple(r / sum(raw) for r in raw))
    return out[0], out[1]


def fit_calibration(timing: NodeTiming, rows: Sequence[tuple[int, int]], batch: int, passes) -> NodeTiming:
    """`timing` with the device factors that make it add up to the measured passes: per device,
    per calibration plan, (forward, backward) busy seconds (CalibrationRuns.result), and its
    rows of the batch under each."""
    if any(min(own) <= 0 or own[0] == own[1] for own in rows):
        raise ValueError(f"every device needs two different, non-zero batch rows to fit; got {list(rows)}")
    sums = (sum(timing.fwd), sum(timing.fwd_fixed), sum(timing.bwd), sum(timing.bwd_fixed))
    scale = []
    for own, busy in zip(rows, passes):
        (s_big, t_big), (s_small, t_small) = sorted(((n / batch, t) for n, t in zip(own, busy)), reverse=True)
        factors = []
        for k in range(2):
            # t(s) = fixed + s * work through both points, neither part negative
            work = max((t_big[k] - t_small[k]) / (s_big - s_small), 0.0)
            fixed = max(t_big[k] - s_big * work, 0.0)
            work = (t_big[k] - fixed) / s_big
            factors += [_ratio(work, sums[2 * k]), _ratio(fixed, sums[2 * k + 1])]
        scale.append(tuple(factors))
    return dataclasses.replace(timing, device_scale=tuple(scale))


def _ratio(measured: float, modelled: float) -> float:
    return measured / modelled if modelled > 0 else 0.0


class CalibrationRuns:
    """On one rank of the cluster: the calibration plans' modules. Each call trains one step of
    each, in turn (every rank calls it together), and keeps this rank's busy seconds."""

    def __init__(self, model: nn.Module, inputs: Sequence[torch.Tensor], plans: Sequence[str], cluster: Cluster,
                 rank: int):
        from ..plan import Plan
        from .module import HAP

        self.inputs, self.clock = tuple(inputs), WaitClock()
        comm = Comm(rank=rank, world=dist.get_world_size(), clock=self.clock)
        self.runs = []
        for text in plans:
            module = HAP(copy.deepcopy(model), cluster, inputs, plan=Plan.from_json(text), comm=comm)
            self.runs.append((module, torch.optim.SGD(module.parameters(), lr=1e-3)))
        self.times: list[list[tuple[float, float]]] = [[] for _ in self.runs]

    def __call__(self, keep: bool = True) -> None:
        """One step of each plan (forward, backward, SGD step); keep=False: a warm-up."""
        clock = self.clock
        for (module, opt), got in zip(self.runs, self.times):
            dist.barrier()
            t0, c0 = time.perf_counter(), clock.seconds
            loss = module(*self.inputs)
            t1, c1 = time.perf_counter(), clock.seconds
            loss.backward()
            opt.step()
            opt.zero_grad()
            t2, c2 = time.perf_counter(), clock.seconds
            if keep:
                got.append((t1 - t0 - (c1 - c0), t2 - t1 - (c2 - c1)))

    def result(self) -> list[tuple[float, float]]:
        """Per plan, the median (forward, backward with the optimizer step) busy seconds."""
        return [(statistics.median(f for f, _ in got), statistics.median(b for _, b in got)) for got in self.times]


def _calibrate_rank(rank: int, model: nn.Module, inputs, plans: list[str], cluster: Cluster, steps: int,
                    out: str) -> None:
    """Train the calibration plans in turn on this rank; write its busy seconds per plan."""
    torch.set_num_threads(1)
    runs = CalibrationRuns(model, inputs, plans, cluster, rank)
    for i in range(steps + 2):  # two warm-up rounds; the plans take turns, so drift hits both alike
        runs(keep=i >= 2)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(runs.result(), f)


# -- calibrated node times, cached ---------------------------------------------------------------

def calibrated_timing(graph: Graph, model: nn.Module, inputs: Sequence[torch.Tensor], cluster: Cluster,
                      cache_dir: str | None = None) -> tuple[NodeTiming, bool]:
    """The graph's node times on this cluster (measure_nodes at the full and a quarter batch,
    then calibrate_nodes), read from `cache_dir` where this graph was calibrated on this
    cluster before; and whether they came from the cache. The cache key is the graph's ops and
    shapes, the cluster spec and the torch version: another model, size or cluster measures anew."""
    key = _timing_key(graph, cluster)
    path = os.path.join(cache_dir, f"timing-{key}.json") if cache_dir else None
    if path and os.path.exists(path):
        with open(path) as f:
            found = json.load(f)
        scale = found.pop("device_scale")
        return NodeTiming(**{k: tuple(v) if isinstance(v, list) else v for k, v in found.items()},
                          device_scale=tuple(map(tuple, scale)) if scale else None), True
    speed = max(d.flops for d in cluster.devices if d.slowdown == 1)
    small = tuple(t[: max(1, t.shape[0] // 4)] for t in inputs)
    timing = calibrate_nodes(measure_nodes(graph, model, inputs, speed, small), model, inputs, cluster)
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(timing), f)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
    return timing, False


def _timing_key(graph: Graph, cluster: Cluster) -> str:
    import hashlib

    shape = [(n.op, [graph.tensors[t].shape for t in (*n.inputs, *n.outputs)]) for n in graph.nodes]
    text = json.dumps([shape, cluster.to_dict(), torch.__version__], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
