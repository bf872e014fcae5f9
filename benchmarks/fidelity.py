"""Cost-model fidelity: the planner's estimated iteration time against the measured one.

    .venv/bin/python benchmarks/fidelity.py [--variants 22] [--steps 16] [--quick] [--out DIR]

Profiles the local cluster (`hap profile`: rank 1 emulated 3x slower), then for each variant
of the benchmark models (layers, hidden width, sequence length, batch) times its nodes
(profile.measure_nodes), calibrates those times on the cluster (profile.calibrate_nodes), plans
it with hap, and trains it for real on the two local ranks; every third variant also runs
data parallelism at even ratios, so the points cover other ratios than hap's. While a plan
trains, the calibration's own training steps take turns with its steps in the same processes
(profile.CalibrationRuns), and the plan is priced again with node times calibrated from them
(planner.estimate): this machine's speed drifts by about 20% over minutes, and a calibration
made minutes before the run would count that drift as the model's error. The planner's own
estimate is reported beside it. It prints estimated vs measured per-iteration time, the Pearson
correlation, the median and worst relative error, and writes DIR/fidelity.md and a scatter plot
(estimate against measurement, like HAP's Fig. 18) to DIR/fidelity.png when matplotlib is
installed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

from runtime_speed import model_without_dropout, node_timing, sgd_step, timed_steps  # this folder is on sys.path as a script

VARIANT_KNOBS = {
    "vit": [dict(layers=l, hidden=h, batch=b) for l, h, b in itertools.product((2, 4), (64, 128), (16, 32))],
    "bert": [dict(layers=l, hidden=h, seq=s, batch=16) for l, h, s in itertools.product((2, 4), (64, 128), (32, 64))],
    "vgg19": [dict(hidden=h, batch=b) for h, b in itertools.product((128, 256, 512), (16, 32))],
}


def variants(n: int) -> list[tuple[str, dict]]:
    """n variants, taken round-robin over the models so every model is represented."""
    pools = [[(name, knobs) for knobs in pool] for name, pool in VARIANT_KNOBS.items()]
    out = [v for group in itertools.zip_longest(*pools) for v in group if v is not None]
    return out[:n]


def build(name: str, knobs: dict):
    """The model with dropout off (as runtime_speed.py times it) and its batch."""
    return model_without_dropout(name, devices=2, **knobs)


def run_rank(rank: int, cluster_file: str, name: str, knobs: dict, plan_path: str, calibration: list[str], steps: int,
             out: str) -> None:
    """Train the plan, and between its steps the calibration's plans (profile.CalibrationRuns),
    so that the node times the estimate is priced with are measured alongside."""
    import torch.distributed as dist

    from hap.cost.cluster import load_cluster
    from hap.plan import Plan
    from hap.runtime.module import HAP
    from hap.runtime.profile import CalibrationRuns

    cluster = load_cluster(cluster_file)
    model, batch = build(name, knobs)
    calibrate = CalibrationRuns(model, batch, calibration, cluster, rank)
    step = sgd_step(HAP(model, cluster, batch, plan=Plan.from_json(plan_path)), batch)
    calibrate(keep=False)  # warm-up
    timed_steps(step, 2)
    times = []
    for _ in range(max(1, steps // 2)):  # they take turns, so the machine's drift hits both alike
        calibrate()
        calibrate()
        dist.barrier()
        times += timed_steps(step, 2)
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"times": times, "calibration": calibrate.result()}, f)


def pearson(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", type=int, default=22, help="how many model variants (at most %d)" %
                    sum(len(v) for v in VARIANT_KNOBS.values()))
    ap.add_argument("--steps", type=int, default=16, help="measured iterations per run (after 2 warm-up)")
    ap.add_argument("--quick", action="store_true", help="10 variants, 12 steps each")
    ap.add_argument("--out", help="folder for the profiled cluster, plans, results and the plot")
    args = ap.parse_args()
    if args.quick:
        args.variants, args.steps = min(args.variants, 10), 12
    out_dir = args.out or tempfile.mkdtemp(prefix="hap-fidelity-")
    os.makedirs(out_dir, exist_ok=True)
    rows = measure(out_dir, args.variants, args.steps)
    summary, planned = summarize(rows), summarize(rows, "planned")
    print(f"\n{len(rows)} runs: Pearson {summary['pearson']:.3f} (target >= 0.98), median relative error "
          f"{summary['median_rel_error'] * 100:.1f}% (target <= 15%), worst {summary['worst_rel_error'] * 100:.1f}%"
          f"\n  the planner's own estimates (node times measured minutes before): Pearson {planned['pearson']:.3f}, "
          f"median {planned['median_rel_error'] * 100:.1f}%, worst {planned['worst_rel_error'] * 100:.1f}%")
    with open(os.path.join(out_dir, "fidelity.json"), "w") as f:
        json.dump({"summary": summary, "planned": planned, "rows": rows}, f, indent=1)
    plotted = _plot(rows, summary, os.path.join(out_dir, "fidelity.png"))
    with open(os.path.join(out_dir, "fidelity.md"), "w") as f:
        f.write(markdown(rows, summary, planned, plotted))
    print(f"results in {out_dir}")
    return 0


def measure(out_dir: str, n_variants: int, steps: int) -> list[dict]:
    """Plan and run every variant; a row per run with its estimates and measured median."""
    from hap.capture import capture
    from hap.cost.cluster import load_cluster
    from hap.planner import baseline_plan, estimate, plan
    from hap.runtime.profile import calibration_plans, fit_calibration

    cluster_file = os.path.join(out_dir, "local-profiled.yaml")
    subprocess.run([sys.executable, "-m", "hap", "profile", "--cluster", "local", "-o", cluster_file], check=True,
                   stdout=sys.stderr)
    cluster = load_cluster(cluster_file)
    rows = []
    for i, (name, knobs) in enumerate(variants(n_variants)):
        model, batch = build(name, knobs)
        graph = capture(model, batch)
        graph.timing = node_timing(graph, model, batch, cluster)
        plans = {"hap": plan(graph, cluster)}
        if i % 3 == 2:
            plans["dp-ev"] = baseline_plan(graph, cluster, "dp-ev")
        calibration = calibration_plans(model, batch, cluster)
        for strategy, result in plans.items():
            measured, passes = _run(out_dir, f"{i}-{strategy}", result, calibration[0], cluster_file, name, knobs,
                                    steps)
            graph.timing = fit_calibration(graph.timing, calibration[1], batch[0].shape[0], passes)
            est = estimate(graph, cluster, result).seconds
            planned = result.estimated_iteration_seconds
            rows.append({"model": name, **knobs, "strategy": strategy, "ratios": result.ratios[0], "estimated": est,
                         "planned": planned, "measured": measured})
            print(f"{len(rows):2d} {name:6s} {json.dumps(knobs):44s} {strategy:5s} ratios "
                  f"{'/'.join(f'{r:.2f}' for r in result.ratios[0])}  estimated {est * 1e3:7.1f} ms  measured "
                  f"{measured * 1e3:7.1f} ms  ({(est - measured) / measured * 100:+.0f}%; when planned "
                  f"{planned * 1e3:.1f} ms, {(planned - measured) / measured * 100:+.0f}%)", flush=True)
    return rows


def _run(out_dir: str, tag: str, result, calibration: list[str], cluster_file: str, name: str, knobs: dict,
         steps: int) -> tuple[float, list]:
    """Median measured seconds per iteration of one plan on the local ranks, and every rank's
    calibration passes measured alongside."""
    from hap.runtime.launch import spawn

    plan_path = os.path.join(out_dir, f"plan{tag}.json")
    result.to_json(plan_path)
    out = os.path.join(out_dir, f"times{tag}")
    world = len(result.ratios[0])
    spawn(run_rank, world, args=(cluster_file, name, knobs, plan_path, calibration, steps, out), timeout_s=600)
    got = [json.loads(open(f"{out}.rank{j}").read()) for j in range(world)]
    return statistics.median(got[0]["times"]), [g["calibration"] for g in got]


def summarize(rows: list[dict], key: str = "estimated") -> dict:
    """Pearson, median and worst relative error of `key` (the estimate priced with node times
    measured alongside the run, or "planned": the one the planner gave) against the measurement."""
    est = [r[key] for r in rows]
    meas = [r["measured"] for r in rows]
    errors = [abs(e - m) / m for e, m in zip(est, meas)]
    return {"runs": len(rows), "variants": len({json.dumps({k: r[k] for k in r if k not in ("strategy", "ratios",
            "estimated", "planned", "measured")}) for r in rows}), "pearson": pearson(est, meas),
            "median_rel_error": statistics.median(errors), "worst_rel_error": max(errors)}


def markdown(rows: list[dict], summary: dict, planned: dict, plotted: bool) -> str:
    lines = ["## Cost-model fidelity (local cluster, measured)", "",
             f"{summary['variants']} model variants, {summary['runs']} runs on 2 local ranks (rank 1 emulated 3x "
             "slower), planned on the profiled cluster with calibrated node times. Each plan's estimate is its "
             "program priced with node times calibrated in the same processes, taking turns with its measured "
             "steps, so that this machine's drift (±20% over minutes) is not counted as the model's error.", "",
             f"**Pearson {summary['pearson']:.3f}** (target >= 0.98; the paper reports 0.970), **median relative "
             f"error {summary['median_rel_error'] * 100:.1f}%** (target <= 15%), worst "
             f"{summary['worst_rel_error'] * 100:.1f}%.", "",
             f"The planner's own estimates, from node times calibrated minutes before the run: Pearson "
             f"{planned['pearson']:.3f}, median {planned['median_rel_error'] * 100:.1f}%, worst "
             f"{planned['worst_rel_error'] * 100:.1f}%.", ""]
    if plotted:
        lines += ["![estimated vs measured](fidelity.png)", ""]
    lines += ["| model | knobs | plan | ratios | estimated (ms) | when planned (ms) | measured (ms) | error |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        knobs = ", ".join(f"{k} {r[k]}" for k in ("layers", "hidden", "seq", "batch") if k in r)
        lines.append(f"| {r['model']} | {knobs} | {r['strategy']} | {'/'.join(f'{x:.2f}' for x in r['ratios'])} | "
                     f"{r['estimated'] * 1e3:.1f} | {r['planned'] * 1e3:.1f} | {r['measured'] * 1e3:.1f} | "
                     f"{(r['estimated'] - r['measured']) / r['measured'] * 100:+.0f}% |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], summary: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    for model in VARIANT_KNOBS:
        pts = [(r["measured"] * 1e3, r["estimated"] * 1e3) for r in rows if r["model"] == model]
        if pts:
            ax.scatter(*zip(*pts), label=model, s=18)
    top = max(max(r["measured"], r["estimated"]) for r in rows) * 1e3 * 1.05
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8)
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured iteration time (ms)")
    ax.set_ylabel("estimated iteration time (ms)")
    ax.set_title(f"Pearson {summary['pearson']:.3f}, median error {summary['median_rel_error'] * 100:.0f}%")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return True


if __name__ == "__main__":
    sys.exit(main())
