"""Measured training speed on the local emulated cluster: hap vs DP-EV vs DP-CP, and hap's
data-parallel runtime vs torch DDP.

    .venv/bin/python benchmarks/runtime_speed.py [--node-timing] [--steps 2] [--rounds 20] [--quick] [--out DIR]

1. Profiles the clusters `local` (2 ranks, rank 1 emulated 3x slower) and `local-homo` with
   `hap profile` (measuring the emulation), so the planner prices this machine.
2. Heterogeneous: for VGG19, ViT and BERT at CPU-sized widths, plans hap on the profiled
   `local` and runs hap, DP-EV and DP-CP in the same two processes, interleaved in rounds so
   that the machine's noise hits all of them alike. Prints per-iteration medians and the ratios
   (targets: hap >= 1.3x DP-EV and not slower than DP-CP).
3. Homogeneous: the same models under hap's runtime running the pure data-parallel plan vs
   torch.nn.parallel.DistributedDataParallel (gloo), interleaved (target: within 10%).
Timings are wall-clock per iteration (forward, backward, SGD step) on rank 0, after warm-up.
Writes DIR/runtime.md (the tables in Markdown) and DIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

# CPU-sized benchmark models: large enough that compute, not per-op dispatch, dominates
MODELS = {
    "vgg19": dict(hidden=256, batch=32),
    "vit": dict(layers=4, hidden=128, batch=32),
    "bert": dict(layers=4, hidden=128, seq=64, batch=16),
}
STRATEGIES = ("dp-ev", "dp-cp", "hap")


def profile(cluster: str, out_dir: str) -> str:
    path = os.path.join(out_dir, f"{cluster}-profiled.yaml")
    subprocess.run([sys.executable, "-m", "hap", "profile", "--cluster", cluster, "-o", path], check=True,
                   stdout=sys.stderr)
    return path


def _model(name: str, devices: int):
    return model_without_dropout(name, devices=devices, **MODELS[name])


def model_without_dropout(name: str, **knobs):
    """A built-in model (small scale, seed 0) with dropout off: hap draws dropout masks for the
    whole tensor on every rank (exactly one device's masks), a fixed cost per rank that would
    blur the comparison of the strategies."""
    from hap.models import build

    torch.manual_seed(0)
    model, batch = build(name, scale="small", **knobs)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        elif isinstance(getattr(m, "dropout", None), float):  # attention's dropout_p
            m.dropout = 0.0
    return model, batch


def node_timing(graph, model, batch, cluster, calibration=None):
    """The graph's node times as this cluster runs them: each node timed alone on this process
    (as fast as the cluster's unslowed devices) at the full and a quarter batch, then
    calibrated on the cluster itself (with `calibration`, cost.calibrate.calibration_plans' result, if
    the caller has it)."""
    from hap.cost.calibrate import calibrate_nodes, measure_nodes

    speed = max(d.flops for d in cluster.devices if d.slowdown == 1)
    timing = measure_nodes(graph, model, batch, speed, tuple(t[: max(1, len(t) // 4)] for t in batch))
    return calibrate_nodes(timing, model, batch, cluster, calibration=calibration)


def timed_steps(step, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def sgd_step(module, batch):
    """One training step of `module` on `batch` (SGD): a closure for the timing loop."""
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step():
        module(*batch).backward()
        opt.step()
        opt.zero_grad()

    return step


def _time_interleaved(runs: dict, steps: int, rounds: int, rank: int, out: str) -> None:
    """Warm every run up, then time them in turns (`steps` each, `rounds` times) so that the
    machine's drift hits all alike; rank 0 writes {run: [seconds per step]} to `out`."""
    for step in runs.values():
        timed_steps(step, 3)
    times = {s: [] for s in runs}
    for _ in range(rounds):
        for s, step in runs.items():
            times[s] += timed_steps(step, steps)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)


def hetero_rank(rank: int, cluster_file: str, name: str, plans: dict, steps: int, rounds: int, out: str) -> None:
    from hap.cost.cluster import load_cluster
    from hap.plan import Plan
    from hap.runtime.module import HAP

    cluster = load_cluster(cluster_file)
    runs = {}
    for strategy, path in plans.items():
        model, batch = _model(name, cluster.gpus)
        runs[strategy] = sgd_step(HAP(model, cluster, batch, plan=Plan.from_json(path)), batch)
    _time_interleaved(runs, steps, rounds, rank, out)


def ddp_rank(rank: int, cluster_file: str, name: str, plan_path: str, steps: int, rounds: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hap.cost.cluster import load_cluster
    from hap.plan import Plan
    from hap.runtime.module import HAP

    cluster = load_cluster(cluster_file)
    model, batch = _model(name, cluster.gpus)
    dmodel = HAP(model, cluster, batch, plan=Plan.from_json(plan_path), global_loss=False)  # DDP's loss: local
    world = dist.get_world_size()
    ref, _ = _model(name, cluster.gpus)
    ddp = DDP(ref)
    local = tuple(t.chunk(world)[rank] for t in batch)  # DDP: each rank its even share
    _time_interleaved({"hap-dp": sgd_step(dmodel, batch), "ddp": sgd_step(ddp, local)}, steps, rounds, rank, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="iterations per strategy per round")
    ap.add_argument("--rounds", type=int, default=20, help="interleaved rounds (fine interleaving evens out drift)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    ap.add_argument("--out", help="folder for the profiled clusters, plans and results (default: a temp dir)")
    ap.add_argument("--part", choices=["all", "hetero", "homo"], default="all",
                    help="both comparisons, or only hap vs DP-EV/DP-CP, or only hap vs DDP")
    ap.add_argument("--node-timing", action="store_true",
                    help="price computation from each node's measured time (cost.calibrate.measure_nodes), calibrated on "
                         "the cluster (cost.calibrate.calibrate_nodes), not from FLOPs")
    ap.add_argument("--quick", action="store_true", help="6 rounds instead of 20")
    args = ap.parse_args()
    if args.quick:
        args.rounds = min(args.rounds, 6)

    out_dir = args.out or tempfile.mkdtemp(prefix="hap-bench-")
    os.makedirs(out_dir, exist_ok=True)
    hetero_file = profile("local", out_dir) if args.part != "homo" else None
    homo_file = profile("local-homo", out_dir) if args.part != "hetero" else None
    results = {"hetero": {}, "homo": {}}
    for name in args.models.split(","):
        if hetero_file is not None:
            _hetero(name, hetero_file, out_dir, args, results)
        if homo_file is not None:
            _homo(name, homo_file, out_dir, args, results)
        _report(results)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, "runtime.md"), "w") as f:
        f.write(markdown(results, args))
    print(f"results in {out_dir}")
    return 0


def _hetero(name: str, hetero_file: str, out_dir: str, args, results: dict) -> None:
    from hap.capture import capture
    from hap.cost.cluster import load_cluster
    from hap.planner import baseline_plan, plan
    from hap.runtime.launch import spawn

    cluster = load_cluster(hetero_file)
    model, batch = _model(name, cluster.gpus)
    graph = capture(model, batch)
    if args.node_timing:
        graph.timing = node_timing(graph, model, batch, cluster)
    plans, estimates = {}, {}
    for strategy in STRATEGIES:
        p = plan(graph, cluster) if strategy == "hap" else baseline_plan(graph, cluster, strategy)
        plans[strategy] = os.path.join(out_dir, f"{name}-{strategy}.json")
        p.to_json(plans[strategy])
        estimates[strategy] = p.estimated_iteration_seconds
        if strategy == "hap":
            print(f"[{name}] hap plan: {p.summary().splitlines()[0]}", file=sys.stderr)
    times_path = os.path.join(out_dir, f"{name}-hetero-times.json")
    spawn(hetero_rank, cluster.size, args=(hetero_file, name, plans, args.steps, args.rounds, times_path),
          timeout_s=600)
    times = json.loads(open(times_path).read())
    results["hetero"][name] = {s: {"median": statistics.median(t), "estimate": estimates[s]} for s, t in times.items()}


def _homo(name: str, homo_file: str, out_dir: str, args, results: dict) -> None:
    from hap.capture import capture
    from hap.cost.cluster import load_cluster
    from hap.planner import baseline_plan
    from hap.runtime.launch import spawn

    homo = load_cluster(homo_file)
    dp = baseline_plan(capture(*_model(name, homo.gpus)), homo, "dp-ev")
    dp_path = os.path.join(out_dir, f"{name}-homo-dp.json")
    dp.to_json(dp_path)
    times_path = os.path.join(out_dir, f"{name}-homo-times.json")
    spawn(ddp_rank, homo.size, args=(homo_file, name, dp_path, args.steps, args.rounds, times_path), timeout_s=600)
    times = json.loads(open(times_path).read())
    results["homo"][name] = {s: statistics.median(t) for s, t in times.items()}


def _report(results: dict) -> None:
    print("\nHeterogeneous: 2 local ranks, rank 1 emulated 3x slower (per-iteration medians, ms; estimate in brackets)")
    print(f"{'model':8s} {'dp-ev':>16s} {'dp-cp':>16s} {'hap':>16s}  {'hap vs dp-ev':>12s} {'hap vs dp-cp':>12s}")
    for name, r in results["hetero"].items():
        cells = " ".join(f"{r[s]['median'] * 1e3:7.1f} ({r[s]['estimate'] * 1e3:6.1f})" for s in STRATEGIES)
        print(f"{name:8s} {cells}  {r['dp-ev']['median'] / r['hap']['median']:11.2f}x "
              f"{r['dp-cp']['median'] / r['hap']['median']:11.2f}x")
    print("\nHomogeneous: 2 local ranks, hap running the data-parallel plan vs torch DDP (ms)")
    for name, r in results["homo"].items():
        print(f"{name:8s} hap-dp {r['hap-dp'] * 1e3:7.1f}  ddp {r['ddp'] * 1e3:7.1f}  hap/ddp {r['hap-dp'] / r['ddp']:.2f}")


def markdown(results: dict, args) -> str:
    """The two comparisons as Markdown tables."""
    lines = ["## Real runs on the local cluster (measured)", ""]
    if results["hetero"]:
        lines += ["2 local ranks, rank 1 emulated 3x slower; per-iteration medians in ms (forward, backward, SGD "
                  f"step), the strategies interleaved {args.steps} steps at a time for {args.rounds} rounds; the "
                  "plan's estimate in brackets. Targets: hap at least 1.3x DP-EV and not slower than DP-CP.", "",
                  "| model | DP-EV | DP-CP | hap | hap vs DP-EV | hap vs DP-CP |", "|---|---|---|---|---|---|"]
        for name, r in results["hetero"].items():
            cells = " | ".join(f"{r[s]['median'] * 1e3:.1f} ({r[s]['estimate'] * 1e3:.1f})" for s in STRATEGIES)
            lines.append(f"| {name} ({_knobs(name)}) | {cells} | {r['dp-ev']['median'] / r['hap']['median']:.2f}x | "
                         f"{r['dp-cp']['median'] / r['hap']['median']:.2f}x |")
        lines.append("")
    if results["homo"]:
        lines += ["Homogeneous (2 equal ranks): hap's runtime running the data-parallel plan vs torch DDP (target: "
                  "within 10%).", "", "| model | hap (ms) | DDP (ms) | hap / DDP |", "|---|---|---|---|"]
        for name, r in results["homo"].items():
            lines.append(f"| {name} | {r['hap-dp'] * 1e3:.1f} | {r['ddp'] * 1e3:.1f} | {r['hap-dp'] / r['ddp']:.2f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _knobs(name: str) -> str:
    return ", ".join(f"{k} {v}" for k, v in MODELS[name].items())


if __name__ == "__main__":
    sys.exit(main())
