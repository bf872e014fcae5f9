"""Auto-MAP's pipeline DQN against the exact optimal cut, on the paper's models and clusters.

    OMP_NUM_THREADS=1 python benchmarks/automap.py [--quick] --out out/bench-automap

For every (model, cluster, K stages, M = 2K micro-batches): the exact partition's estimate
(pipeline/partition.py, dynamic programming) and the DQN's (automap/pipeline.py, online,
best cut its episodes met), both priced by pipeline/price.py, with the seconds each search
took. Writes DIR/automap.json ({cases: [{model, cluster, task, K, M, dqn_estimate,
exact_estimate, dqn_seconds, exact_seconds, ...}]}) and DIR/report.md. --quick: ViT and BERT
on 8 GPUs, fewer episodes (a few minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hap.automap.pipeline import search_cuts  # noqa: E402
from hap.capture import capture  # noqa: E402
from hap.cost.cluster import load_cluster  # noqa: E402
from hap.models import build  # noqa: E402
from hap.pipeline.partition import exact_partition  # noqa: E402
from hap.pipeline.plan import PipelineSpace  # noqa: E402
from hap.planner import PlannerConfig  # noqa: E402


def run_case(space: PipelineSpace, K: int, episodes: int, budget: float) -> dict:
    M = min(2 * K, space.granules)
    t0 = time.perf_counter()
    table = space.table(K, M)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    part = exact_partition(table)
    exact_s = time.perf_counter() - t0 + built
    res = search_cuts(table, episodes=episodes, budget_s=budget)
    return {"task": "PP", "K": K, "M": M, "exact_estimate": part.seconds, "dqn_estimate": res.seconds,
            "dqn_greedy_estimate": res.greedy_seconds, "exact_seconds": exact_s, "dqn_seconds": res.search_seconds + built,
            "episodes": res.episodes, "pivots": len(space.pivots), "exact_cuts": list(part.cuts), "dqn_cuts": list(res.cuts),
            "gap": res.seconds / part.seconds - 1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = ["vit", "bert"] if args.quick else ["vgg19", "vit", "bert", "bert-moe"]
    clusters = ["paper-hetero-8"] if args.quick else ["paper-hetero-8", "paper-hetero-16"]
    episodes, budget = (1500, 40.0) if args.quick else (4000, 280.0)
    cases = []
    for cname in clusters:
        cluster = load_cluster(cname)
        for name in models:
            model, inputs = build(name, device="meta", devices=cluster.gpus)
            graph = capture(model, inputs, name=name)
            try:
                space = PipelineSpace(graph, cluster, PlannerConfig())
            except ValueError as e:
                cases.append({"model": name, "cluster": cname, "task": "PP", "refused": str(e)})
                print(f"{name} on {cname}: {e}", flush=True)
                continue
            for K in (2, 4, 8):
                case = {"model": name, "cluster": cname, **run_case(space, K, episodes, budget)}
                cases.append(case)
                print(f"{name:8s} {cname} K={K} M={case['M']}: exact {case['exact_estimate'] * 1e3:.2f} ms "
                      f"({case['exact_seconds']:.2f} s), dqn {case['dqn_estimate'] * 1e3:.2f} ms ({case['dqn_seconds']:.1f} s, "
                      f"{case['episodes']} episodes), gap {case['gap'] * 100:.2f}%", flush=True)
    (out / "automap.json").write_text(json.dumps({"cases": cases}, indent=1))
    lines = ["# Auto-MAP pipeline DQN vs the exact cut", "",
             "| model | cluster | K | M | exact (ms) | DQN (ms) | gap | DQN greedy (ms) | exact search (s) | DQN search (s) | episodes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        if "refused" in c:
            lines.append(f"| {c['model']} | {c['cluster']} | - | - | refused: {c['refused']} | | | | | | |")
            continue
        lines.append(f"| {c['model']} | {c['cluster']} | {c['K']} | {c['M']} | {c['exact_estimate'] * 1e3:.2f} | "
                     f"{c['dqn_estimate'] * 1e3:.2f} | {c['gap'] * 100:.2f}% | {c['dqn_greedy_estimate'] * 1e3:.2f} | "
                     f"{c['exact_seconds']:.2f} | {c['dqn_seconds']:.1f} | {c['episodes']} |")
    ok = [c for c in cases if "gap" in c]
    within = sum(c["gap"] <= 0.02 for c in ok)
    lines += ["", f"DQN within 2% of the exact optimum on {within} of {len(ok)} cases; target: all, each in at most 5 minutes."]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
