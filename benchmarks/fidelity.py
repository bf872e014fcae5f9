"""Cost-model fidelity: the planner's estimated iteration time against the measured one.

    .venv/bin/python benchmarks/fidelity.py [--variants 22] [--steps 16] [--quick] [--out DIR]

Profiles the local cluster (`hap profile`: rank 1 emulated 3x slower), then for each variant
of the benchmark models (layers, hidden width, sequence length, batch) times its nodes
(profile.measure_nodes), calibrates those times on the cluster (profile.calibrate_nodes), plans
it with hap, and trains it for real on the two local ranks; every third variant also runs
data parallelism at even ratios, so the points cover other ratios than hap's. While a plan
trains, the calibration's own training steps take turns with its steps in the same processes
(profile.CalibrationRuns), and the plan is priced again with node times calibrated from them
(planner.estimate): on this shared machine the same model's times differ by up to 20% from
one set of processes to the next (eager VGG19's forward: 4.8 to 7.4 ms in three runs a minute
apart), and a calibration made in other processes, before the run, counts that as the model's
error. The planner's own estimate, and the figures for hap's plans alone (the DP-EV runs are
close to one of the calibration's own programs), are reported beside it. It prints estimated
vs measured per-iteration time, the Pearson correlation, the median and worst relative error,
and writes DIR/fidelity.md and a scatter plot (estimate against measurement, like HAP's Fig. 18)
to DIR/fidelity.png when matplotlib is installed.
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
    from hap.cost.calibrate import CalibrationRuns

    cluster = load_cluster(cluster_file)
    model, batch = build(name, knobs)
    calibrate = CalibrationRuns(model, batch, calibration, cluster, rank)
    step = sgd_step(HAP(model, cluster, batch, plan=Plan.from_json(plan_path)), batch)
    calibrate(keep=False)  # warm-up
    timed_steps(step, 2)
    times = []
    for _ in range((steps + 1) // 2):  # they take turns, so the machine's drift hits both alike
        calibrate()
        calibrate()
        dist.barrier()
        times += timed_steps(step, 2)
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"times": times[:steps], "calibration": calibrate.result()}, f)


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
    ap.add_argument("--steps", type=int, default=16,
                    help="measured iterations per run (after 2 warm-up), timed in pairs between calibration steps")
    ap.add_argument("--quick", action="store_true", help="10 variants, 12 steps each")
    ap.add_argument("--out", help="folder for the profiled cluster, plans, results and the plot")
    args = ap.parse_args()
    if args.quick:
        args.variants, args.steps = min(args.variants, 10), 12
    out_dir = args.out or tempfile.mkdtemp(prefix="hap-fidelity-")
    os.makedirs(out_dir, exist_ok=True)
    rows = measure(out_dir, args.variants, args.steps)
    summaries = summaries_of(rows)
    print(f"\n{len(rows)} runs (targets: Pearson >= 0.98, median relative error <= 15%)")
    width = max(map(len, summaries))
    for label, s in summaries.items():
        print(f"  {label:{width}s} Pearson {s['pearson']:.3f}  median {s['median_rel_error'] * 100:4.1f}%  "
              f"worst {s['worst_rel_error'] * 100:4.1f}%  ({s['runs']} runs)")
    with open(os.path.join(out_dir, "fidelity.json"), "w") as f:
        json.dump({"summaries": summaries, "rows": rows}, f, indent=1)
    summary = summaries[ESTIMATES[0]]
    plotted = _plot(rows, summary, os.path.join(out_dir, "fidelity.png"))
    with open(os.path.join(out_dir, "fidelity.md"), "w") as f:
        f.write(markdown(rows, summaries, plotted))
    print(f"results in {out_dir}")
    return 0


def measure(out_dir: str, n_variants: int, steps: int) -> list[dict]:
    """Plan and run every variant; a row per run with its estimates and measured median."""
    from hap.capture import capture
    from hap.cost.cluster import load_cluster
    from hap.planner import baseline_plan, estimate, plan
    from hap.cost.calibrate import calibration_plans, fit_calibration

    cluster_file = os.path.join(out_dir, "local-profiled.yaml")
    subprocess.run([sys.executable, "-m", "hap", "profile", "--cluster", "local", "-o", cluster_file], check=True,
                   stdout=sys.stderr)
    cluster = load_cluster(cluster_file)
    rows = []
    for i, (name, knobs) in enumerate(variants(n_variants)):
        model, batch = build(name, knobs)
        graph = capture(model, batch)
        calibration = calibration_plans(model, batch, cluster)
        base = graph.timing = node_timing(graph, model, batch, cluster, calibration)
        plans = {"hap": plan(graph, cluster)}
        if i % 3 == 2:
            plans["dp-ev"] = baseline_plan(graph, cluster, "dp-ev")
        for strategy, result in plans.items():
            measured, passes = _run(out_dir, f"{i}-{strategy}", result, calibration[0], cluster_file, name, knobs,
                                    steps)
            graph.timing = fit_calibration(base, calibration[1], batch[0].shape[0], passes)
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


ESTIMATES = ("priced with node times calibrated alongside the run", "the planner's own (calibrated before the run)")


def summaries_of(rows: list[dict]) -> dict[str, dict]:
    """The figures for both estimates, over every run and over hap's plans alone."""
    haps = [r for r in rows if r["strategy"] == "hap"]
    out = {}
    for label, key in zip(ESTIMATES, ("estimated", "planned")):
        out[label] = summarize(rows, key)
        out[f"{label}, hap's plans only"] = summarize(haps, key)
    return out


def summarize(rows: list[dict], key: str = "estimated") -> dict:
    """Pearson, median and worst relative error of `key` (the estimate priced with node times
    measured alongside the run, or "planned": the one the planner gave) against the measurement."""
    est = [r[key] for r in rows]
    meas = [r["measured"] for r in rows]
    errors = [abs(e - m) / m for e, m in zip(est, meas)]
    return {"runs": len(rows), "variants": len({json.dumps({k: r[k] for k in r if k not in ("strategy", "ratios",
            "estimated", "planned", "measured")}) for r in rows}), "pearson": pearson(est, meas),
            "median_rel_error": statistics.median(errors), "worst_rel_error": max(errors)}


def markdown(rows: list[dict], summaries: dict[str, dict], plotted: bool) -> str:
    first = summaries[ESTIMATES[0]]
    lines = ["## Cost-model fidelity (local cluster, measured)", "",
             f"{first['variants']} model variants, {first['runs']} runs on 2 local ranks (rank 1 emulated 3x slower), "
             "planned on the profiled cluster with node times calibrated on it. Two estimates per run: the plan "
             "priced again with node times calibrated in the same processes, taking turns with its measured steps "
             "(on this shared machine the same model's times differ by up to 20% from one set of processes to the "
             "next), and the planner's own, from the calibration made before the run. The DP-EV runs are close to "
             "one of the calibration's own data-parallel programs, so the figures for hap's plans alone are given "
             "too. Targets: Pearson at least 0.98 (the paper reports 0.970), median relative error at most 15%.", "",
             "| estimate | Pearson | median error | worst error | runs |", "|---|---|---|---|---|"]
    for label, s in summaries.items():
        lines.append(f"| {label} | {s['pearson']:.3f} | {s['median_rel_error'] * 100:.1f}% | "
                     f"{s['worst_rel_error'] * 100:.1f}% | {s['runs']} |")
    lines.append("")
    if plotted:
        lines += ["![estimated vs measured](fidelity.png)", ""]
    lines += ["| model | knobs | plan | ratios | estimated (ms) | error | when planned (ms) | error | measured (ms) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        knobs = ", ".join(f"{k} {r[k]}" for k in ("layers", "hidden", "seq", "batch") if k in r)
        m = r["measured"]
        lines.append(f"| {r['model']} | {knobs} | {r['strategy']} | {'/'.join(f'{x:.2f}' for x in r['ratios'])} | "
                     f"{r['estimated'] * 1e3:.1f} | {(r['estimated'] - m) / m * 100:+.0f}% | "
                     f"{r['planned'] * 1e3:.1f} | {(r['planned'] - m) / m * 100:+.0f}% | {m * 1e3:.1f} |")
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
        mine = [r for r in rows if r["model"] == model]
        if mine:
            measured = [r["measured"] * 1e3 for r in mine]
            dots = ax.scatter(measured, [r["estimated"] * 1e3 for r in mine], label=model, s=18)
            ax.scatter(measured, [r["planned"] * 1e3 for r in mine], s=18, facecolors="none",
                       edgecolors=dots.get_facecolor())
    ax.scatter([], [], s=18, facecolors="none", edgecolors="grey", label="as planned")
    top = max(max(r["measured"], r["estimated"], r["planned"]) for r in rows) * 1e3 * 1.05
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
