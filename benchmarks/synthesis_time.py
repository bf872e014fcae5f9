"""Synthesis time and plan quality of the planner on the paper's benchmark models.

    .venv/bin/python benchmarks/synthesis_time.py [--repeats 5] [--quick] [--layer-cuts]

Prints (1) synthesis seconds for ViT with 1..24 layers and for VGG19, BERT-base and BERT-MoE
on paper-hetero-8, next to the published implementation's figures measured on a machine like
this one (shared/notes/published-hap.md), and (2) for every model on paper-hetero-8 and
paper-hetero-32 the estimated iteration time of the plan against DP-EV, DP-CP and tensor
parallelism under the same cost model. Synthesis time is the planner's own clock (search,
balancing and baselines), not model capture. Medians of `--repeats` runs in one process (5, as
the published figures are medians of 5 runs; the first run of a process also pays one-time
set-up: importing the modules the planner loads lazily, about 10 ms).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from hap.balance.lp import BalanceError
from hap.capture import capture
from hap.cost.cluster import load_cluster
from hap.models import build
from hap.planner import PlannerConfig, plan

PUBLISHED = {("vit", 1): 0.022, ("vit", 4): 0.15, ("vit", 8): 0.53, ("vit", 12): 1.16, ("vit", 16): 2.06,
             ("vit", 24): 4.8, ("bert", None): 1.45, ("vgg19", None): 0.045, ("bert-moe", None): 3.1}


def timed_plan(graph, cluster, repeats, config=None):
    times, result = [], None
    for _ in range(repeats):
        result = plan(graph, cluster, config)
        times.append(result.synthesis_seconds)
    return statistics.median(times), result


def cuts_column(graph, cluster, repeats, plain) -> str:
    """Seconds with PlannerConfig(layer_cuts=True), measured right after the default's, and
    a check that the plan is the same."""
    secs, result = timed_plan(graph, cluster, repeats, PlannerConfig(layer_cuts=True))
    same = "" if result.estimated_iteration_seconds == plain.estimated_iteration_seconds else " (other plan!)"
    return f" {secs:8.3f}{same}"


def _faster(ours: float, published: float | None) -> str:
    return "" if published is None else ("yes" if ours < published else "NO")


def _kind(result) -> str:
    if result.search.get("exhaustive", True):
        return "exhaustive"
    gap = result.search.get("gap")
    return "width-limited" + ("" if gap is None else f", within {gap:.0%} (proven)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="ViT up to 8 layers, one repeat")
    ap.add_argument("--layer-cuts", action="store_true",
                    help="also time each model with PlannerConfig(layer_cuts=True) (the layer-bound heuristic)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    repeats = 1 if args.quick else args.repeats
    het8 = load_cluster("paper-hetero-8")

    print("Synthesis time on paper-hetero-8 (seconds; published = the Rust prototype, same machine class)")
    print(f"{'model':>10} {'layers':>6} {'nodes':>6} {'hap':>8} {'published':>9} {'faster':>6} {'per layer':>9}  search"
          + ("      with layer cuts" if args.layer_cuts else ""))
    rows = []
    layer_counts = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 12, 16, 24]
    for layers in layer_counts:
        model, inputs = build("vit", layers=layers, devices=het8.gpus, device="meta")
        graph = capture(model, inputs, name=f"vit-{layers}")
        secs, result = timed_plan(graph, het8, repeats)
        pub = PUBLISHED.get(("vit", layers))
        rows.append((layers, secs))
        print(f"{'vit':>10} {layers:6d} {len(graph.nodes):6d} {secs:8.3f} {pub if pub else '':>9} {_faster(secs, pub):>6} "
              f"{secs / layers:9.4f}  {_kind(result)}" + (cuts_column(graph, het8, repeats, result) if args.layer_cuts else ""),
              flush=True)
    for name in ("vgg19", "bert", "bert-moe"):
        model, inputs = build(name, devices=het8.gpus, device="meta")
        graph = capture(model, inputs, name=name)
        secs, result = timed_plan(graph, het8, repeats)
        pub = PUBLISHED[(name, None)]
        print(f"{name:>10} {'':6} {len(graph.nodes):6d} {secs:8.3f} {pub:>9} {_faster(secs, pub):>6} {'':9}  {_kind(result)}"
              + (cuts_column(graph, het8, repeats, result) if args.layer_cuts else ""), flush=True)
    if len(rows) >= 2:
        (l0, t0), (l1, t1) = rows[0], rows[-1]
        print(f"growth: {l1 / l0:.0f}x the layers took {t1 / t0:.1f}x the time")

    print("\nEstimated iteration time (ms) under one cost model; hap's plan vs baselines")
    print(f"{'model':>10} {'cluster':>16} {'hap':>9} {'dp_ev':>9} {'dp_cp':>9} {'tp':>9} {'vs dp_ev':>8} {'vs dp_cp':>8}  plan")
    worse = []
    for cluster_name in ("paper-hetero-8", "paper-hetero-32"):
        cluster = load_cluster(cluster_name)
        for name in ("vgg19", "vit", "bert", "bert-moe"):
            model, inputs = build(name, devices=cluster.gpus, device="meta")
            graph = capture(model, inputs, name=name)
            try:
                result = plan(graph, cluster)
            except BalanceError as e:
                print(f"{name:>10} {cluster_name:>16}  no plan: {e}", flush=True)
                continue
            b = result.baselines
            hap_s = result.estimated_iteration_seconds
            cell = {k: f"{b[k]['seconds'] * 1e3:.1f}" + ("" if b[k]["fits"] else "*") for k in ("dp_ev", "dp_cp", "tp")}
            print(f"{name:>10} {cluster_name:>16} {hap_s * 1e3:9.1f} {cell['dp_ev']:>9} {cell['dp_cp']:>9} {cell['tp']:>9} "
                  f"{b['dp_ev']['seconds'] / hap_s:7.2f}x {b['dp_cp']['seconds'] / hap_s:7.2f}x  {result.search['winner']}", flush=True)
            for k in ("dp_ev", "dp_cp", "tp"):
                if b[k]["fits"] and b[k]["seconds"] < hap_s * (1 - 1e-9):
                    worse.append(f"{name} on {cluster_name}: hap {hap_s:.4f} s > {k} {b[k]['seconds']:.4f} s")
    if worse:
        print("\nPLAN WORSE THAN A BASELINE:\n  " + "\n  ".join(worse))
        return 1
    print("* does not fit in the devices' memory (the plan must)")
    print("\nhap's plan is never slower than DP-EV, DP-CP or TP that fit in memory, under the cost model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
