"""AutoSync on the local emulated clusters: the strategy found against each baseline, measured.

    .venv/bin/python benchmarks/autosync.py [--quick] --out out/bench-autosync

Models: a CNN (VGG19, small, classifier 128 wide), a transformer encoder (BERT, 2 layers, 128
wide) and a recommendation model whose embedding tables dominate (NCF, small: 2.4M parameters),
with sparse embedding gradients (ncf-sparse) and, not in --quick, dense ones (ncf).
Clusters: after AutoSync's mixed clusters B9 and B12 (a 1-GPU machine with a slower network card
beside a multi-GPU machine), scaled to 3 local ranks with emulated links
(benchmarks/clusters/autosync-*.yaml). Each case runs `hap sync`'s loop (hap.sync.run) with the
trial budget below; the baselines are measured in the same runs.

Writes DIR/autosync.json ({cases: [{model, space, cluster, trials, best_measured_seconds (the
fastest measured, a trial's or a baseline's), best_kind, best_trial_seconds, baselines: {name:
seconds}, best_trial_over_best_baseline, ranking_accuracy}]}), each case's
trials, result, plan and plot under DIR/<model>-<cluster>/, and DIR/report.md. --quick: one
cluster, three models, 15 trials per case, 8 Horovod samples (under 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (model, knobs, compress): compress also searches fp16 and PowerSGD, which change training
MODELS = [("vgg19", {"scale": "small", "hidden": 128, "batch": 24}, False),
          ("bert", {"scale": "small", "layers": 2, "hidden": 128, "seq": 32, "batch": 16}, False),
          ("ncf-sparse", {"scale": "small", "batch": 256}, False),
          ("ncf", {"scale": "small", "batch": 256}, False),  # not in --quick
          ("ncf", {"scale": "small", "batch": 256}, True)]  # not in --quick


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="out/bench-autosync")
    ap.add_argument("--trials", type=int, help="trial budget per case (default 50, quick 15)")
    ap.add_argument("--clusters", nargs="+", metavar="NAME", help="cluster files under benchmarks/clusters "
                    "(default autosync-b9 autosync-b12; quick autosync-b9)")
    ap.add_argument("--models", nargs="+", metavar="NAME", help="only these models (vgg19, bert, ncf-sparse, ncf)")
    args = ap.parse_args()
    from hap.cost.cluster import load_cluster
    from hap.sync import AutoSyncConfig, SpaceConfig, run

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clusters = args.clusters or (["autosync-b9"] if args.quick else ["autosync-b9", "autosync-b12"])
    trials = args.trials or (15 if args.quick else 50)
    cases = []
    t0 = time.perf_counter()
    for cluster_name in clusters:
        cluster = load_cluster(HERE / "clusters" / f"{cluster_name}.yaml")
        for model, knobs, compress in (MODELS[:3] if args.quick else MODELS):
            if args.models and model not in args.models:
                continue
            case_dir = out / f"{model}{'-compress' if compress else ''}-{cluster_name}"
            if case_dir.exists():
                shutil.rmtree(case_dir)  # a benchmark measures afresh (hap sync itself resumes)
            config = AutoSyncConfig(trials=trials, horovod_samples=8 if args.quick else 20,
                                    candidates=100 if args.quick else 200, epochs=30 if args.quick else 60,
                                    space=SpaceConfig(compress=compress))
            r = run(model, knobs, cluster, case_dir, config, say=lambda m: print(m, flush=True))
            base = {n: b["measured_seconds"] for n, b in r["baselines"].items()}
            best_base = min(base.values())
            cases.append({"model": model, "knobs": knobs, "space": "compressed" if compress else "exact",
                          "cluster": cluster_name, "trials": r["trials"], "case_dir": case_dir.name,
                          "best_measured_seconds": r["best"]["measured_seconds"], "best_kind": r["best"]["kind"],
                          "best_trial_seconds": r["best_trial"]["measured_seconds"] if r["best_trial"] else None,
                          "baselines": base, "speedup_over_best_baseline": best_base / r["best"]["measured_seconds"],
                          "best_trial_over_best_baseline": best_base / r["best_trial"]["measured_seconds"]
                          if r["best_trial"] else None,
                          "confirmed": r["confirmed"],
                          "ranking_accuracy": r["ranking_accuracy"], "search_seconds": r["search_seconds"],
                          "best_strategy": r["best"]["text"]})
            (out / "autosync.json").write_text(json.dumps({"cases": cases}, indent=1))
    _report(out, cases, time.perf_counter() - t0, trials)
    print(f"wrote {out / 'autosync.json'} and {out / 'report.md'} ({time.perf_counter() - t0:.0f} s)")
    return 0


def _report(out: Path, cases: list[dict], seconds: float, trials: int) -> None:
    names = sorted({n for c in cases for n in c["baselines"]})
    lines = ["# AutoSync on the emulated mixed clusters", "",
             f"{len(cases)} cases, {trials} trials each, {seconds:.0f} s. Milliseconds per training step, measured "
             "(after 2 warm-up steps, blocks of 5 steps, each timed on its slowest rank, until 0.5 s: the median block's). "
             "The last column: the best baseline's time "
             "over the search's best trial (above 1: the search found a faster strategy).", "",
             "| model | space | cluster | trials | AutoSync best trial | " + " | ".join(names)
             + " | best trial vs best baseline | confirmed: trial, baseline (median of 3) |",
             "|---|---|---|---|---|" + "---|" * len(names) + "---|---|"]
    for c in cases:
        trial = f"{c['best_trial_seconds'] * 1e3:.1f}" if c["best_trial_seconds"] else "-"
        k = c.get("confirmed")
        again = (f"{k['trial']['median'] * 1e3:.1f}, {k['baseline']['name']} {k['baseline']['median'] * 1e3:.1f} "
                 f"({k['trial_over_baseline']:.2f}x)") if k else "-"
        lines.append(f"| {c['model']} | {c['space']} | {c['cluster']} | {c['trials']} | {trial} | "
                     + " | ".join(f"{c['baselines'][n] * 1e3:.1f}" for n in names)
                     + (f" | {c['best_trial_over_best_baseline']:.2f}x" if c["best_trial_over_best_baseline"] else " | -")
                     + f" | {again} |")
    lines += ["", "Pairwise ranking accuracy on each case's measured strategies, a random 30% held out (the "
              "learned simulators trained on the rest); forecast: trained on the first 70% measured, tested on the "
              "last 30% (the strategies the search itself picked):", "",
              "| model | space | cluster | hap | analytic | linear | rnn | gat | held out | forecast linear / rnn / gat |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        a = c["ranking_accuracy"]
        lines.append(f"| {c['model']} | {c['space']} | {c['cluster']} | " + " | ".join(_accuracy(a[k]) for k in
                                                                        ("hap", "analytic", "linear", "rnn", "gat"))
                     + f" | {a['held_out']} | " + " / ".join(_accuracy(a["forecast"][k]) for k in ("linear", "rnn", "gat"))
                     + " |")
    lines += ["", "-: no two of the test strategies differ by more than the ranking margin (no pair to rank).",
              "", "Space: exact (every strategy trains like one device) or compressed (fp16 and PowerSGD "
              "allowed too: they change training; the baselines are exact)."]
    lines += [""] + [f"![{c['case_dir']}]({c['case_dir']}/autosync.png)" for c in cases]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _accuracy(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.2f}"  # None (NaN in older results): no pair to rank


if __name__ == "__main__":
    sys.exit(main())
