"""Measure a cluster on itself and write the cluster file the planner consumes.

    hap profile --cluster local -o local-profiled.yaml      # local emulated ranks, gloo

It starts one local process per device of a local cluster (`local: true`) and measures them
on this machine's CPU; it does not profile GPUs.

Every rank measures its own device, emulation included (a device marked `slowdown` is timed
with its stretch, so the file says how fast the emulated device really is):
  - FLOP/s: matmul, convolution and attention at several sizes; time = c + flops / F by least
    squares per op family; the device's `flops` is the rate over the three together;
  - memory bandwidth: elementwise ops, time = c + bytes / BW;
  - op_overhead: seconds per node per pass of hap's executor on a chain of tiny nodes.
(hap/cost/calibrate.py times a model's own nodes instead, graph.timing, which the cost model
then prices computation from: ops differ far more in speed than one FLOP/s rate says.)
Rank 0 then times every collective the planner prices, with the runtime's own functions, over a
sweep of sizes (and uneven splits), each call right after 3 ms of computing as in training, and
fits time = alpha + volume / beta with the volumes of hap/cost/model.py. Each fit is a
non-negative least squares; its worst relative residual is reported.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from scipy.optimize import nnls

from ..cost.cluster import COLLECTIVES, Cluster
from .collectives import Comm, all_reduce, all_to_all, gather_grouped, gather_padded, reduce_scatter
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


def bandwidth_of(fit: LineFit, units: Sequence[float], seconds: Sequence[float]) -> float:
    """Units per second of a line fit; where noise left it no slope (the largest message no
    slower than the smallest), the largest message's units over its whole time: a bound from
    below, where 1 / 0 wrote a link of 1e15 B/s (hap profile --quick on a busy machine)."""
    if fit.per_unit > 0:
        return 1.0 / fit.per_unit
    big = max(range(len(units)), key=lambda i: units[i])
    return units[big] / seconds[big]


def timed(fn: Callable[[], object], emulation: Emulation | None, repeats: int, min_sample: float = 2e-3) -> float:
    """Wall seconds of fn(): the least of `repeats` samples (on a shared machine noise only adds
    time), with this rank's emulated slowness paid inside each. A sample runs fn() often enough
    to take `min_sample` and then sleeps its debt off at once, which it owes in full, whatever
    an earlier sample overslept: a sleep of a few microseconds overshoots by about its own
    length, and the credit for it (carried, as training carries it) let later samples of a
    small op run at full speed (a 3x device measured 1.3x)."""
    fn()
    t0 = time.perf_counter()
    fn()
    inner = max(1, math.ceil(min_sample / max(time.perf_counter() - t0, 1e-9)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        if emulation is not None:
            emulation.debt = 0.0
            emulation.computed(time.perf_counter() - t0)
            emulation.settle()
        samples.append((time.perf_counter() - t0) / inner)
    return min(samples)


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
    # one row: a collective's latency measured nearly alone (without it a line through the larger
    # sizes alone could cross zero above 0 bytes, and a latency of 0 was fitted on a noisy machine)
    rows = [1, 2**8, 2**11, 2**14] if quick else [1, 2**8, 2**10, 2**12, 2**14, 2**16]
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
        volumes = [v for v, _ in runs]
        fit = fit_line(volumes, seconds)
        fits[kind] = {"alpha": fit.const, "beta": bandwidth_of(fit, volumes, seconds), "worst_residual": fit.worst_residual}
    return fits


def profile_links(comm: Comm, quick: bool = False) -> dict[tuple[int, int], dict]:
    """Point-to-point links: for every pair of ranks, latency and bandwidth from ping-pongs of
    several sizes (half a round trip each). Every rank calls it; rank 0 gets them all."""
    sizes = [2**10, 2**16, 2**20]
    repeats = 3 if quick else 7
    mine: dict[str, dict] = {}
    for a in range(comm.world):
        for b in range(a + 1, comm.world):
            seconds = []
            for nbytes in sizes:
                t = torch.zeros(nbytes // 4)
                dist.barrier(group=comm.group)
                if comm.rank not in (a, b):
                    continue
                samples = []
                for _ in range(repeats + 1):  # the first warms the connection
                    t0 = time.perf_counter()
                    if comm.rank == a:
                        dist.send(t, b, group=comm.group)
                        dist.recv(t, b, group=comm.group)
                    else:
                        dist.recv(t, a, group=comm.group)
                        dist.send(t, a, group=comm.group)
                    samples.append((time.perf_counter() - t0) / 2)
                seconds.append(statistics.median(samples[1:]))
            if comm.rank == a:
                fit = fit_line(sizes, seconds)
                mine[f"{a},{b}"] = {"latency": max(fit.const, 0.0), "bandwidth": bandwidth_of(fit, sizes, seconds)}
    parts = [None] * comm.world
    dist.all_gather_object(parts, mine, group=comm.group)
    return {tuple(int(x) for x in key.split(",")): link for part in parts for key, link in part.items()}


def local_topology(links: dict[tuple[int, int], dict], world: int, name: str = "localhost") -> dict:
    """The cluster file's `machines` and `links` for ranks on one machine: the median measured
    link between any two, and the pairs more than 25% slower or faster as overrides."""
    bandwidths = sorted(x["bandwidth"] for x in links.values())
    latencies = sorted(x["latency"] for x in links.values())
    typical = {"bandwidth": bandwidths[len(bandwidths) // 2], "latency": latencies[len(latencies) // 2]}
    odd = [{"between": [a, b], **x} for (a, b), x in sorted(links.items())
           if abs(x["bandwidth"] / typical["bandwidth"] - 1) > 0.25]
    return {"machines": [{"name": name, "devices": world, "intra": typical, "nic": typical}], "links": odd}


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
    links = profile_links(comm, quick) if comm.world > 1 else {}
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
    elif cluster.emulate_links:  # the emulated machines stay, and emulated (the collectives were measured so)
        spec.update({k: v for k, v in cluster.to_dict().items() if k in ("machines", "links", "algorithm", "emulate")})
    elif links:  # the measured collectives price the plan; the links describe the machine
        spec.update(local_topology(links, comm.world))
    if cluster.local:
        spec["local"] = True
    spec["report"] = {"devices": reports, "collectives": fits, "links": {f"{a}-{b}": x for (a, b), x in links.items()}}
    return spec


# -- a model's own nodes --------------------------------------------------------------------------
