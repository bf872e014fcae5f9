"""Hand-designed synchronization strategies AutoSync is measured against (supplement, section 8),
all expressed in the strategy space and run by the same runtime.

- ddp: PyTorch DDP's buckets: all-reduce, gradients in reverse order of first use (the order they
  arrive), a bucket closed once it holds 25 MB (the first one at 1 MB, as DDP does); a sparse
  gradient all-gathered alone (as DDP's sparse all-reduce on gloo, and Horovod, do).
- horovod: Horovod's tensor fusion autotuned: gradients that become ready within one cycle of the
  background thread, up to a fusion threshold, travel as one all-reduce; Bayesian optimization
  (a Gaussian process with expected improvement, 20 measured samples) over the threshold and the
  cycle time. Readiness comes from the plan's estimated backward.
- tuned-ps: the supplement's tuned parameter server: variables larger than a partition size are
  split into parts, every part goes to the server with the least load for its bandwidth, and
  machines of several devices reduce inside first (sparse gradients: whole, gathered to their
  server); the partition size is tuned by measuring a few (ByteScheduler's knob).
- hap: the plan's own sync (bucketed all-reduce, one bucket per group of layers).
"""

from __future__ import annotations

import math
import random
import warnings
from typing import Callable, Sequence

import numpy as np

from ..search.program import Estimate
from .price import backward_clock
from .strategy import PartSync, SyncStrategy, Variables, VarSync

DDP_BUCKET = 25 * 2**20
DDP_FIRST_BUCKET = 1 * 2**20


def ddp(variables: Variables) -> SyncStrategy:
    group, size, limit = 0, 0, DDP_FIRST_BUCKET
    out = []
    for v in variables.vars:  # backprop order: the order gradients arrive
        if size and size + v.wire_bytes > limit:
            group, size, limit = group + 1, 0, DDP_BUCKET
        out.append(VarSync(v.param, (PartSync(kind="all_reduce", group=group),)))  # sparse: all-gathered, alone
        size += v.wire_bytes
    return SyncStrategy(tuple(out))


def ready_times(variables: Variables, est: Estimate) -> list[float]:
    """When each variable's gradient is complete, in seconds into the backward (plan estimate)."""
    done_at, _ = backward_clock(est)
    return [done_at[est.stage_of[v.first_use]] for v in variables.vars]


def horovod_fusion(variables: Variables, est: Estimate, threshold: float, cycle: float) -> SyncStrategy:
    """Gradients fused per cycle of `cycle` seconds, each message at most `threshold` bytes."""
    ready = ready_times(variables, est)
    group, size, window = 0, 0.0, None
    out = []
    for v, t in zip(variables.vars, ready):
        tick = math.floor(t / cycle) if cycle > 0 else 0
        if window is not None and (tick != window or size + v.wire_bytes > threshold):
            group, size = group + 1, 0.0
        window = tick
        out.append(VarSync(v.param, (PartSync(kind="all_reduce", group=group),)))  # sparse: all-gathered, alone
        size += v.wire_bytes
    return SyncStrategy(tuple(out))


def bayesian_optimization(measure: Callable[[Sequence[float]], float], bounds: Sequence[tuple[float, float]],
                          samples: int = 20, initial: int = 5, seed: int = 0) -> tuple[list[float], float, list]:
    """Minimize measure(x) over the box `bounds`: `initial` random points, then each next point
    the candidate (of 500 random ones) with the most expected improvement under a Gaussian
    process (Matern kernel, noise fitted) of the measurements so far. Returns the best point,
    its value, and every (point, value) measured. Length scales stay above 1/20 of the box: below,
    the process explains every measurement as its own bump and the improvement is flat."""
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.gaussian_process.kernels import Matern, WhiteKernel
    from scipy.stats import norm

    if samples < 1 or initial < 0:
        raise ValueError(f"bayesian_optimization needs at least 1 sample and no negative initial count, got "
                         f"samples={samples}, initial={initial}")
    rng = random.Random(seed)
    lo = np.array([b[0] for b in bounds])
    hi = np.array([b[1] for b in bounds])
    draw = lambda: lo + (hi - lo) * np.array([rng.random() for _ in bounds])  # noqa: E731
    xs, ys = [], []
    for i in range(samples):
        if i < initial:
            x = draw()
        else:
            kernel = Matern(length_scale=0.3, length_scale_bounds=(0.05, 10.0), nu=2.5) + WhiteKernel(1e-3, (1e-6, 1.0))
            gp = GaussianProcessRegressor(kernel=kernel, normalize_y=True, random_state=seed)
            with warnings.catch_warnings():  # a bound reached is fine here, not worth a warning
                warnings.simplefilter("ignore", ConvergenceWarning)
                gp.fit((np.array(xs) - lo) / (hi - lo), np.array(ys))
            cands = np.array([draw() for _ in range(500)])
            mu, sd = gp.predict((cands - lo) / (hi - lo), return_std=True)
            best = min(ys)
            z = (best - mu) / np.maximum(sd, 1e-12)
            ei = (best - mu) * norm.cdf(z) + sd * norm.pdf(z)
            x = cands[int(np.argmax(ei))]
        xs.append(x)
        ys.append(measure(list(x)))
    k = int(np.argmin(ys))
    return list(xs[k]), ys[k], list(zip([list(x) for x in xs], ys))


def tuned_ps(variables: Variables, bandwidth: Sequence[float], partition_bytes: float) -> SyncStrategy:
    """Parameter servers balanced by bandwidth and load; parts of at most `partition_bytes`."""
    hierarchical = any(len(m) > 1 for m in variables.machines)
    parts: list[tuple[float, int, int]] = []  # (bytes, variable index, part index)
    counts = []
    for i, v in enumerate(variables.vars):
        k = 1 if v.sparse else max(1, min(v.rows, math.ceil(v.nbytes / partition_bytes)))
        counts.append(k)
        parts += [(v.wire_bytes / k, i, j) for j in range(k)]
    load = [0.0] * len(bandwidth)
    server: dict[tuple[int, int], int] = {}
    for size, i, j in sorted(parts, key=lambda p: (-p[0], p[1], p[2])):  # largest first, to the least loaded
        s = min(range(len(bandwidth)), key=lambda d: ((load[d] + size) / bandwidth[d], d))
        server[(i, j)] = s
        load[s] += size
    return SyncStrategy(tuple(VarSync(v.param, tuple(PartSync(kind="ps", server=server[(i, j)],
                                                              hierarchical=hierarchical and not v.sparse)
                                                     for j in range(counts[i])))
                              for i, v in enumerate(variables.vars)))


def plan_sync(variables: Variables, entries) -> SyncStrategy:
    """The plan's own synchronization as a strategy: each parameter's parts with their
    synchronizer, compressor, server and hierarchy; every all-reduce bucket one group (the
    plan of `hap sync --plan P` is P's sync, not default buckets).

    ValueError when the entries are no strategy's: a parameter's parts not along dim 0 as even
    as its rows allow (`Variables.split`), or summed by fewer than every device."""
    world = tuple(range(variables.devices))
    parts: dict[str, list] = {}
    for e in entries:
        if tuple(e.devices) != world:
            raise ValueError(f"{e.param}: the plan sums its gradient over devices {list(e.devices)}; "
                             f"a synchronization strategy sums over all {variables.devices}")
        parts.setdefault(e.param, []).append(e)
    out = []
    for v in variables.vars:
        mine = sorted(parts.get(v.param, ()), key=lambda e: e.rows[0] if e.rows else 0)
        rows = [e.rows for e in mine]
        if not mine or (rows != [None] and rows != variables.split(v, len(mine))):
            raise ValueError(f"{v.param}: the plan synchronizes it in rows {rows}, not as a strategy "
                             f"does (whole, or {len(mine)} parts as even as its {v.rows} rows allow)")
        out.append(VarSync(v.param, tuple(
            PartSync(kind=e.strategy, group=e.bucket if e.strategy == "all_reduce" else 0, compressor=e.compressor,
                     low_rank=e.low_rank, server=e.server if e.server is not None else 0,
                     hierarchical=e.hierarchical) for e in mine)))
    return SyncStrategy(tuple(out))


def bucket_changes(variables: Variables, entries, strategy: SyncStrategy) -> str | None:
    """How a plan's sync `entries` run as `strategy` (plan_sync's) differently, in words, or
    None: a strategy makes every parameter server's part its own bucket and launches buckets
    in the order they complete (Variables.entries), where a hand-made sync may do neither."""
    def buckets(es) -> list[frozenset]:
        found: dict[int, set] = {}
        for e in es:
            found.setdefault(e.bucket, set()).add((e.param, e.rows))
        return [frozenset(found[b]) for b in sorted(found)]

    given, mine = buckets(entries), buckets(variables.entries(strategy))
    if given == mine:
        return None
    its = f"its {len(given)} bucket{'s' if len(given) > 1 else ''}"
    if set(given) == set(mine):  # (the same buckets, in another order)
        return f"{its} launch in the order they complete"
    return f"{its} run{'s' if len(given) == 1 else ''} as {len(mine)} (a parameter server's part is a bucket of its own)"

