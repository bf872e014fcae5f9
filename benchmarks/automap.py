"""Auto-MAP's pipeline DQN against the exact optimal cut, on the paper's models and clusters.

    OMP_NUM_THREADS=1 python benchmarks/automap.py [--quick] --out out/bench-automap

PP, for every (model, cluster, K stages, M = 2K micro-batches): the exact partition's estimate
(pipeline/partition.py, dynamic programming) and the DQN's (automap/pipeline.py, online,
best cut its episodes met), both priced by pipeline/price.py, with the seconds each search
took. OPP, for every (model at --opp-layers layers, cluster): the cost-rewarded DQN's layout
(automap/opp.py) against A*'s optimum over the same family (exhaustive), and the layout of the
paper's reward priced by the same model. ADP: the batch dims the DQN finds against dim 0.
Writes DIR/automap.json ({cases: [{model, cluster, task, dqn_estimate, exact_estimate,
dqn_seconds, exact_seconds, ...}]}) and DIR/report.md. --quick: ViT and BERT on 8 GPUs,
fewer episodes (a few minutes).

--local-only: pipeline against data parallelism measured on this machine's local clusters
(local-homo, local). For small models whose estimates favour one or the other, `hap train`
runs data parallelism (dp-cp) and the 2-stage pipeline pp-exact picks (micro-batches by the
cost model), and the measured order is compared with the estimated one. Writes
DIR/automap-local.json ({runs: [{model, knobs, cluster, planner, estimated_ms, measured_ms}]})
and DIR/report-local.md (about 5 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hap.automap.opp import DataEnvironment, OperatorEnvironment, search_layout  # noqa: E402
from hap.automap.pipeline import search_cuts  # noqa: E402
from hap.automap.pipeline_infer import infer_cuts  # noqa: E402
from hap.capture import capture  # noqa: E402
from hap.cost.cluster import load_cluster  # noqa: E402
from hap.models import build  # noqa: E402
from hap.pipeline.partition import exact_partition  # noqa: E402
from hap.pipeline.plan import PipelineSpace  # noqa: E402
from hap.planner import PlannerConfig, batched_inputs  # noqa: E402


def run_case(space: PipelineSpace, K: int, episodes: int, budget: float, online: bool = True) -> dict:
    M = min(2 * K, space.granules)
    t0 = time.perf_counter()
    table = space.table(K, M)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    part = exact_partition(table)
    exact_s = time.perf_counter() - t0 + built
    _, inferred, infer_s = infer_cuts(table)
    _, network, _ = infer_cuts(table, polished=False)
    case = {"task": "PP", "K": K, "M": M, "exact_estimate": part.seconds, "exact_seconds": exact_s,
            "exact_cuts": list(part.cuts), "pivots": len(space.pivots), "inference_estimate": inferred,
            "inference_seconds": infer_s, "inference_gap": inferred / part.seconds - 1,
            "inference_unpolished_gap": network / part.seconds - 1}
    if online:
        res = search_cuts(table, episodes=episodes, budget_s=budget)
        case.update({"dqn_estimate": res.seconds, "dqn_greedy_estimate": res.greedy_seconds,
                     "dqn_seconds": res.search_seconds + built, "episodes": res.episodes, "dqn_cuts": list(res.cuts),
                     "gap": res.seconds / part.seconds - 1, "unpolished_gap": res.raw_seconds / part.seconds - 1})
    return case


def run_opp(graph, cluster, episodes: int, budget: float) -> dict:
    t0 = time.perf_counter()
    env = OperatorEnvironment(graph, cluster, reward="cost")
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    exact, fits, exhaustive = env.exact()
    exact_s = time.perf_counter() - t0 + built
    found = search_layout(env, episodes, budget)
    paper = search_layout(OperatorEnvironment(graph, cluster, reward="paper"), episodes, budget)
    return {"task": "OPP", "units": len(env.units), "exact_estimate": exact, "exact_exhaustive": exhaustive,
            "exact_fits": fits, "dqn_estimate": found.seconds, "dqn_seconds": found.search_seconds + built,
            "exact_seconds": exact_s, "episodes": found.episodes, "replicated_estimate": env.replicated,
            "paper_reward_estimate": paper.seconds, "paper_reward_return": paper.episode_return,
            "gap": found.seconds / exact - 1}


def run_adp(graph, devices: int, episodes: int) -> dict:
    env = DataEnvironment(graph, devices)
    found = search_layout(env, episodes)
    dims, batched = env.batch_dims(found.best), batched_inputs(graph)  # (the planner's: dim 0 of those that carry it)
    return {"task": "ADP", "batch_dims": dims,
            "matches_capture": all(d == (0 if name in batched else None) for name, d in dims.items()),
            "split_tensors": found.split_tensors, "tensors": len(graph.tensors), "dqn_seconds": found.search_seconds}


def _opp_sections(opp: list[dict], cases: list[dict], layers: int) -> list[str]:
    lines = ["", f"## Operator partitioning (models at {layers} layer(s); VGG19 whole)", "",
             "| model | cluster | decisions | A* optimum (ms) | exhaustive | DQN, cost reward (ms) | gap | DQN, paper reward (ms) "
             "| all replicated (ms) | A* (s) | DQN (s) | episodes |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in opp:
        lines.append(f"| {c['model']} | {c['cluster']} | {c['units']} | {c['exact_estimate'] * 1e3:.2f} | {c['exact_exhaustive']} | "
                     f"{c['dqn_estimate'] * 1e3:.2f} | {c['gap'] * 100:.2f}% | {c['paper_reward_estimate'] * 1e3:.2f} | "
                     f"{c['replicated_estimate'] * 1e3:.2f} | {c['exact_seconds']:.2f} | {c['dqn_seconds']:.1f} | {c['episodes']} |")
    lines += ["", f"OPP: DQN within 2% of A* on {sum(c['gap'] <= 0.02 for c in opp)} of {len(opp)} cases.", "",
              "## Data parallelism (ADP)", "", "| model | batch dims found | dim 0 of every input (capture) | tensors split |",
              "|---|---|---|---|"]
    for c in cases:
        if c["task"] == "ADP":
            lines.append(f"| {c['model']} | {c['batch_dims']} | {c['matches_capture']} | {c['split_tensors']} of {c['tensors']} |")
    return lines


# (model, `hap train` knobs): small models whose estimates favour the pipeline on one local
# cluster and data parallelism on the other, or the pipeline on both
LOCAL_CASES = [("ncf", ["--batch", "32"]), ("vgg19", ["--batch", "8", "--hidden", "1024", "--dropout", "0"]),
               ("vgg19", ["--batch", "64", "--dropout", "0"]), ("vit", ["--batch", "32", "--dropout", "0"]),
               ("bert", ["--batch", "16", "--dropout", "0"])]
LOCAL_PLANNERS = {"dp-cp": ["--planner", "dp-cp"], "pp-exact": ["--planner", "pp-exact", "--pipeline-stages", "2"]}
MEASURED = re.compile(r"per-iteration time: measured ([0-9.]+) ms .*estimated ([0-9.]+) ms")


def run_local(steps: int) -> list[dict]:
    """`hap train` with each planner of LOCAL_PLANNERS on each case and local cluster."""
    runs = []
    for cluster in ("local-homo", "local"):
        for model, knobs in LOCAL_CASES:
            for planner, flags in LOCAL_PLANNERS.items():
                cmd = [sys.executable, "-m", "hap", "train", "--model", model, "--scale", "small", *knobs,
                       "--cluster", cluster, "--steps", str(steps), *flags]
                done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                found = MEASURED.search(done.stdout)
                if done.returncode != 0 or found is None:
                    raise RuntimeError(f"{' '.join(cmd[2:])} failed:\n{done.stderr[-2000:]}")
                run = {"model": model, "knobs": " ".join(knobs), "cluster": cluster, "planner": planner,
                       "measured_ms": float(found.group(1)), "estimated_ms": float(found.group(2))}
                runs.append(run)
                print(f"{cluster:10s} {model:6s} {run['knobs']:28s} {planner:8s} estimated {run['estimated_ms']:7.1f} ms, "
                      f"measured {run['measured_ms']:7.1f} ms", flush=True)
    return runs


def local_report(runs: list[dict]) -> list[str]:
    lines = ["# Pipeline vs data parallelism, measured on local processes", "",
             "`hap train --scale small` on this machine's local clusters (2 processes, gloo), median ms per iteration.", "",
             "| cluster | model | knobs | DP estimated | PP estimated | estimate favours | DP measured | PP measured | "
             "measured favours | agree |", "|---|---|---|---|---|---|---|---|---|---|"]
    agree = pp_wins = pp_favoured = 0
    pairs = {}
    for r in runs:
        pairs.setdefault((r["cluster"], r["model"], r["knobs"]), {})[r["planner"]] = r
    for (cluster, model, knobs), by in pairs.items():
        dp, pp = by["dp-cp"], by["pp-exact"]
        est = "PP" if pp["estimated_ms"] < dp["estimated_ms"] else "DP"
        meas = "PP" if pp["measured_ms"] < dp["measured_ms"] else "DP"
        agree += est == meas
        pp_favoured += est == "PP"
        pp_wins += est == "PP" and meas == "PP"
        lines.append(f"| {cluster} | {model} | {knobs} | {dp['estimated_ms']:.1f} | {pp['estimated_ms']:.1f} | {est} | "
                     f"{dp['measured_ms']:.1f} | {pp['measured_ms']:.1f} | {meas} | {'yes' if est == meas else 'NO'} |")
    lines += ["", f"The measured order agrees with the estimated one on {agree} of {len(pairs)} cases; where the cost model "
              f"favours the pipeline it is measured faster on {pp_wins} of {pp_favoured}."]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=None, help="seconds per DQN search (default 40 quick, 280 full)")
    ap.add_argument("--opp-layers", type=int, default=1, help="layers of the models in the OPP cases")
    ap.add_argument("--inference-only", action="store_true",
                    help="PP cases with the exact cut and the shipped inference network only (no online DQN, no OPP/ADP)")
    ap.add_argument("--local-only", action="store_true",
                    help="only measure a 2-stage pipeline against data parallelism on the local clusters")
    ap.add_argument("--local-steps", type=int, default=30, help="training steps per local run")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.local_only:
        runs = run_local(args.local_steps)
        (out / "automap-local.json").write_text(json.dumps({"runs": runs}, indent=1))
        lines = local_report(runs)
        (out / "report-local.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    models = ["vit", "bert"] if args.quick else ["vgg19", "vit", "bert", "bert-moe"]
    clusters = ["paper-hetero-8"] if args.quick else ["paper-hetero-8", "paper-hetero-16"]
    episodes, budget = (1500, 40.0) if args.quick else (4000, 280.0)
    budget = args.budget or budget
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
                try:
                    case = {"model": name, "cluster": cname, **run_case(space, K, episodes, budget, not args.inference_only)}
                except ValueError as e:  # no cut into K stages fits memory: said, not a crash
                    cases.append({"model": name, "cluster": cname, "task": "PP", "K": K, "refused": str(e)})
                    print(f"{name:8s} {cname} K={K}: {e}", flush=True)
                    continue
                cases.append(case)
                online = (f", dqn {case['dqn_estimate'] * 1e3:.2f} ms ({case['dqn_seconds']:.1f} s, {case['episodes']} episodes), "
                          f"gap {case['gap'] * 100:.2f}%") if "gap" in case else ""
                print(f"{name:8s} {cname} K={K} M={case['M']}: exact {case['exact_estimate'] * 1e3:.2f} ms "
                      f"({case['exact_seconds']:.2f} s){online}, inference {case['inference_estimate'] * 1e3:.2f} ms "
                      f"({case['inference_seconds']:.3f} s), gap {case['inference_gap'] * 100:.2f}%", flush=True)
    for cname in ([] if args.inference_only else clusters):
        cluster = load_cluster(cname)
        for name in models:
            kw = {} if name == "vgg19" else {"layers": args.opp_layers}
            model, inputs = build(name, device="meta", devices=cluster.gpus, **kw)
            graph = capture(model, inputs, name=name)
            case = {"model": name, "cluster": cname, "layers": kw.get("layers"), **run_opp(graph, cluster, 1000, budget)}
            cases.append(case)
            print(f"{name:8s} {cname} OPP ({case['units']} decisions): A* {case['exact_estimate'] * 1e3:.2f} ms "
                  f"({case['exact_seconds']:.2f} s), dqn {case['dqn_estimate'] * 1e3:.2f} ms ({case['dqn_seconds']:.1f} s), "
                  f"gap {case['gap'] * 100:.2f}%, paper reward {case['paper_reward_estimate'] * 1e3:.2f} ms, "
                  f"replicated {case['replicated_estimate'] * 1e3:.2f} ms", flush=True)
            if cname == clusters[0]:
                adp = {"model": name, "cluster": cname, **run_adp(graph, cluster.gpus, 200)}
                cases.append(adp)
                print(f"{name:8s} ADP: batch dims {adp['batch_dims']} ({adp['split_tensors']} tensors split)", flush=True)
    name = "automap-inference" if args.inference_only else "automap"
    (out / f"{name}.json").write_text(json.dumps({"cases": cases}, indent=1, default=str))
    lines = ["# Auto-MAP pipeline DQN vs the exact cut", "",
             "DQN and inference: the cut found, then polished by a local search (pipeline/partition.polish); "
             "'unpolished': the DQN's or the network's own cut.", "",
             "| model | cluster | K | M | exact (ms) | DQN (ms) | gap | unpolished gap | DQN greedy (ms) | exact search (s) "
             "| DQN search (s) | episodes | inference (ms) | inference gap | unpolished | inference (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        if c["task"] != "PP":
            continue
        if "refused" in c:
            lines.append(f"| {c['model']} | {c['cluster']} | {c.get('K', '-')} | - | refused: {c['refused']} | | | | | | | | | | | |")
            continue
        online = (f"{c['dqn_estimate'] * 1e3:.2f} | {c['gap'] * 100:.2f}% | {c['unpolished_gap'] * 100:.2f}% | "
                  f"{c['dqn_greedy_estimate'] * 1e3:.2f} | {c['exact_seconds']:.2f} | {c['dqn_seconds']:.1f} | {c['episodes']}") \
            if "gap" in c else f"- | - | - | - | {c['exact_seconds']:.2f} | - | -"
        lines.append(f"| {c['model']} | {c['cluster']} | {c['K']} | {c['M']} | {c['exact_estimate'] * 1e3:.2f} | {online} | "
                     f"{c['inference_estimate'] * 1e3:.2f} | {c['inference_gap'] * 100:.2f}% | "
                     f"{c['inference_unpolished_gap'] * 100:.2f}% | {c['inference_seconds']:.3f} |")
    ok = [c for c in cases if "exact_estimate" in c and c["task"] == "PP"]
    within = sum(c.get("gap", 1.0) <= 0.02 for c in ok)
    raw = sum(c.get("unpolished_gap", 1.0) <= 0.02 for c in ok)
    online = [] if args.inference_only else [
        f"DQN within 2% of the exact optimum on {within} of {len(ok)} cases ({raw} before the polish); "
        "target: all, each in at most 5 minutes."]
    lines += ["", *online,
              f"Online inference (the shipped network, no retraining) within 5% on {sum(c['inference_gap'] <= 0.05 for c in ok)} "
              f"of {len(ok)} ({sum(c['inference_unpolished_gap'] <= 0.05 for c in ok)} before the polish), "
              f"at most {max((c['inference_seconds'] for c in ok), default=0):.3f} s per case; target: all, 1 s."]
    if not args.inference_only:
        lines += _opp_sections([c for c in cases if c["task"] == "OPP"], cases, args.opp_layers)
    (out / ("report-inference.md" if args.inference_only else "report.md")).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
