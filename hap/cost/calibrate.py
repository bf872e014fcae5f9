"""Calibrate the cost model to a model on a cluster: the model's own node times, measured on
this machine and scaled per device by training runs on the cluster itself.

    timing, cached = calibrated_timing(graph, model, inputs, cluster, cache_dir=".hap-cache")
    graph.timing = timing                                   # the planner now prices from it

`measure_nodes` times every node alone (forward, backward) at two batch sizes, splitting each
into a fixed part and a part proportional to the node's share; `calibrate_nodes` runs the model
data parallel on every device of the cluster (hap's runtime, emulation included) and fits each
device's factors. `hap train --calibrate` caches the result per graph, cluster and torch version.
Hardware profiling (FLOP/s, bandwidths, collectives) is hap/runtime/profile.py's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..ir import Graph, NodeTiming, TensorRef
from .cluster import Cluster

log = logging.getLogger("hap")


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
    from ..runtime.executor import leaf_values

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
    from ..runtime.launch import spawn

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
    splits = [p.shard_sizes(graph.inputs[0], 0) for p in plans]
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
    n = len(timing.fwd)
    if n:  # node times without a fixed part (measured at one batch size): the measured one spread evenly
        timing = dataclasses.replace(timing, fwd_fixed=timing.fwd_fixed if sum(timing.fwd_fixed) else (1 / n,) * n,
                                     bwd_fixed=timing.bwd_fixed if sum(timing.bwd_fixed) else (1 / n,) * n)
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
        from ..capture import capture
        from ..plan import Plan
        from ..runtime.collectives import Comm, WaitClock
        from ..runtime.module import HAP

        self.inputs, self.clock = tuple(inputs), WaitClock()
        comm = Comm(rank=rank, world=dist.get_world_size(), clock=self.clock)
        self.runs = []
        graph = capture(model, tuple(inputs))  # (once for both plans)
        for text in plans:
            module = HAP(copy.deepcopy(model), cluster, inputs, plan=Plan.from_json(text), comm=comm, graph=graph)
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

def _check_cached(timing: NodeTiming, nodes: int, devices: int) -> None:
    """A ValueError unless a cached timing holds, for each of `nodes` nodes, finite
    non-negative seconds, and a finite non-negative scale per device of `devices`, not all zero."""
    def numbers(values, n, what):
        if len(values) != n or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                       and math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"{what}: {n} finite non-negative numbers expected")

    for what in ("fwd", "bwd", "fwd_fixed", "bwd_fixed"):
        numbers(getattr(timing, what), nodes, what)
    numbers([timing.device_flops], 1, "device_flops")
    if timing.device_scale is None:  # (calibration always scales: a cached file without is damaged)
        raise ValueError("device_scale: missing")
    if len(timing.device_scale) != devices:
        raise ValueError(f"device_scale: {devices} devices expected, got {len(timing.device_scale)}")
    for row in timing.device_scale:
        numbers(row, 4, "device_scale")
        if not any(row):  # every node of the device free
            raise ValueError("device_scale: a device's factors are all zero")


def calibrated_timing(graph: Graph, model: nn.Module, inputs: Sequence[torch.Tensor], cluster: Cluster,
                      cache_dir: str | None = None) -> tuple[NodeTiming, bool]:
    """The graph's node times on this cluster (measure_nodes at the full and a quarter batch,
    then calibrate_nodes), read from `cache_dir` where this graph was calibrated on this
    cluster before; and whether they came from the cache. The cache key is the graph's ops and
    its tensors' shapes, dtypes and requires_grad, the cluster spec, the torch version and the
    machine (its name, processor and the cores this process may use): another model, size,
    precision, frozen layer, cluster or machine measures anew; so does a damaged cache file (a
    warning). Nodes are timed on one thread, as each rank runs."""
    key = _timing_key(graph, cluster)
    path = os.path.join(cache_dir, f"timing-{key}.json") if cache_dir else None
    if path and os.path.exists(path):
        try:
            with open(path) as f:
                found = json.load(f)
            scale = found.pop("device_scale")
            timing = NodeTiming(**{k: tuple(v) if isinstance(v, list) else v for k, v in found.items()},
                                device_scale=tuple(map(tuple, scale)) if scale else None)
            _check_cached(timing, len(graph.nodes), cluster.size)
            return timing, True
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:  # damaged: measure anew
            log.warning("hap: the calibration cache %s is damaged (%s: %s); measuring again", path, type(e).__name__, e)
    speed = max(d.flops * d.slowdown for d in cluster.devices)  # the machine's, unslowed (every device may be emulated)
    small = tuple(t[: max(1, t.shape[0] // 4)] for t in inputs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank runs (on all threads, vgg19's nodes took half the time and the scales doubled)
    try:
        nodes = measure_nodes(graph, model, inputs, speed, small)
    finally:
        torch.set_num_threads(threads)
    timing = calibrate_nodes(nodes, model, inputs, cluster)
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(timing), f)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
    return timing, False


def _constant_args(node) -> str:
    """A node's arguments but its tensors (those the key gives by shape), as text."""
    def plain(x):
        if isinstance(x, TensorRef):
            return "T"
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in sorted(x.items())}
        return repr(x)

    return json.dumps([plain(node.args), plain(node.kwargs)])


def _timing_key(graph: Graph, cluster: Cluster) -> str:
    import hashlib

    # each node's op, its tensors and its other arguments (an embedding's sparse=True, a dropout's p)
    shape = [(n.op, [(graph.tensors[t].shape, graph.tensors[t].dtype, graph.tensors[t].requires_grad)
                     for t in (*n.inputs, *n.outputs)], _constant_args(n)) for n in graph.nodes]
    # and the machine: a cache made on another (or with fewer cores free: taskset) priced 1.6x low
    machine = [platform.node(), platform.machine(), platform.processor(), os.cpu_count(),
               len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None]
    text = json.dumps([shape, cluster.to_dict(), torch.__version__, machine], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
