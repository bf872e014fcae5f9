"""The HAP paper's evaluation (section 7), simulated with hap's cost model.

    .venv/bin/python benchmarks/paper.py --out DIR [--quick]

Writes DIR/paper.md and PNG plots into DIR (plots need matplotlib; without it the Markdown
is still written and says so). Three experiments, all priced by the planner's cost model on
the paper's testbed as described in cluster files (nothing is measured on GPUs):

  a. Figs. 13/14: VGG19, ViT, BERT-base and BERT-MoE at 8-64 GPUs on paper-hetero-N (2 V100 +
     6 P100 machines) and paper-homo-N (8 P100 machines), weak scaling as in the paper: hap's
     plan against DP-EV, DP-CP, tensor parallelism (TP) and, for BERT-MoE, expert parallelism
     (EP), each found by the same search restricted to its family and priced by the same model.
  b. Fig. 17: BERT-MoE with 2-16 experts on 2 V100 + 2 P100 single GPUs (10.4 Gbps), tokens
     proportional to experts: hap against EP with the experts padded to a multiple of 4.
  c. Fig. 19: synthesis time of ViT against its layer count on paper-hetero-8.

--quick runs 8 and 32 GPUs, fewer expert counts and layer counts (about 3 minutes on a
2-core machine); the full run takes about 15. `report(out_dir, quick)` returns the Markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for synthesis_time, also when imported
from synthesis_time import PUBLISHED  # noqa: E402  the published prototype's synthesis seconds

from hap.balance.lp import BalanceError  # noqa: E402
from hap.capture import capture  # noqa: E402
from hap.cost.cluster import (P100, PAPER_BANDWIDTH, PAPER_LATENCY, V100, Cluster, Device,  # noqa: E402
                              fits_from_network, load_cluster)
from hap.models import MODELS, build, resolve  # noqa: E402
from hap.models.moe import capacity  # noqa: E402
from hap.planner import PlannerConfig, baseline_plan, plan  # noqa: E402

MODEL_NAMES = ("vgg19", "vit", "bert", "bert-moe")
BASELINES = ("dp_ev", "dp_cp", "tp", "ep")
LABELS = {"hap": "HAP", "dp_ev": "DP-EV", "dp_cp": "DP-CP", "tp": "TP", "ep": "EP"}
COLORS = {"hap": "tab:blue", "dp_ev": "tab:orange", "dp_cp": "tab:green", "tp": "tab:red", "ep": "tab:purple"}

# What the paper reports (section 7 text; the figures' data points are not in the text).
PAPER_HETERO = {  # section 7.2, heterogeneous 2 V100 + 6 P100 machines
    "vgg19": ("up to 2.41x over the DP baselines (32 GPUs)", 2.41, 32),
    "vit": ("similar to DP-CP", None, None),
    "bert": ("+28% (64 GPUs), consistently ahead of the baselines", 1.28, 64),
    "bert-moe": ("similar to DeepSpeed's expert parallelism", None, None),
}
# Section 7.3, homogeneous P100 machines: "up to 217%, 19%, 22%, and 13% speedup ... compared to the best baselines".
PAPER_HOMO = {"vgg19": 2.17, "vit": 0.19, "bert": 0.22, "bert-moe": 0.13}
PAPER_FIG17 = 0.64  # section 7.6: up to 64% faster than DeepSpeed (experts padded to a multiple of 4), 2 A100 + 2 P100
PAPER_FIG19 = "a few seconds for 24 layers, superlinear growth"  # section 7.8


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------------
# a. Figs. 13 / 14


@dataclass
class Point:
    """One planned configuration: seconds per iteration of hap and of each baseline."""

    model: str
    kind: str  # "hetero" or "homo"
    gpus: int
    hap: float | None  # None: no plan fits in memory
    winner: str = ""
    baselines: dict[str, tuple[float, bool]] = field(default_factory=dict)  # name -> (seconds, fits)

    def best_baseline(self, names=BASELINES) -> tuple[str, float] | None:
        fitting = [(k, s) for k, (s, fits) in self.baselines.items() if fits and k in names]
        return min(fitting, key=lambda kv: kv[1]) if fitting else None

    def speedup(self, names=BASELINES) -> float | None:
        best = self.best_baseline(names)
        return best[1] / self.hap if best and self.hap else None


def plan_point(graph, cluster, model: str, kind: str) -> Point:
    try:
        result = plan(graph, cluster)
    except BalanceError as e:
        say(f"  {model} on {cluster.name}: {e}")
        return Point(model, kind, cluster.gpus, None)
    b = {k: (v["seconds"], v["fits"]) for k, v in result.baselines.items()}
    return Point(model, kind, cluster.gpus, result.estimated_iteration_seconds, result.search["winner"], b)


def run_scaling(gpu_counts) -> list[Point]:
    """Plan every model at every GPU count on both clusters (one capture serves both)."""
    points = []
    for gpus in gpu_counts:
        for model in MODEL_NAMES:
            t0 = time.perf_counter()
            net, inputs = build(model, devices=gpus, device="meta")
            graph = capture(net, inputs, name=model)
            for kind in ("hetero", "homo"):
                points.append(plan_point(graph, load_cluster(f"paper-{kind}-{gpus}"), model, kind))
            say(f"  {model} at {gpus} GPUs: {time.perf_counter() - t0:.1f} s")
    return points


def ms(seconds: float | None, fits: bool = True) -> str:
    if seconds is None:
        return "no fit"
    return f"{seconds * 1e3:,.0f}" + ("" if fits else " †")


def ratio(x: float | None) -> str:
    return f"{x:.2f}x" if x else "–"


def scaling_table(points: list[Point], model: str) -> str:
    names = [k for k in BASELINES if any(k in p.baselines for p in points if p.model == model)]
    head = ["cluster", "GPUs", "HAP", *(LABELS[k] for k in names), "best baseline", "HAP vs best", "HAP vs DP-EV", "HAP's plan"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in (p for p in points if p.model == model):
        best = p.best_baseline()
        ev, ev_fits = p.baselines.get("dp_ev", (None, False))
        cells = [p.kind, str(p.gpus), ms(p.hap), *(ms(*p.baselines[k]) if k in p.baselines else "–" for k in names),
                 LABELS[best[0]] if best else "none fits", ratio(p.speedup()),
                 ratio(ev / p.hap if ev and p.hap else None) + ("" if ev_fits else " †"), p.winner.replace("hap from ", "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comparison_table(points: list[Point]) -> str:
    """The paper's quoted speed-ups next to ours."""
    lines = ["| model | cluster | paper reports | ours: HAP vs best baseline | ours: HAP vs best DP (DP-EV, DP-CP) |",
             "|---|---|---|---|---|"]
    for model in MODEL_NAMES:
        for kind in ("hetero", "homo"):
            mine = [p for p in points if p.model == model and p.kind == kind and p.hap]
            if not mine:
                continue
            if kind == "hetero":
                text, _, at = PAPER_HETERO[model]
            else:
                text, at = f"up to {PAPER_HOMO[model] * 100:.0f}% speedup over the best baseline (4 P100 machines, 8-32 GPUs)", None
            lines.append(f"| {model} | {kind} | {text} | {_range(mine, BASELINES, at)} | {_range(mine, ('dp_ev', 'dp_cp'), at)} |")
    return "\n".join(lines)


def _range(points: list[Point], names, at: int | None) -> str:
    """min-max speed-up over GPU counts, and the value at the paper's quoted GPU count."""
    ups = [(p.gpus, p.speedup(names)) for p in points if p.speedup(names)]
    if not ups:
        return "no baseline fits"
    lo, hi = min(u for _, u in ups), max(u for _, u in ups)
    text = f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}x-{hi:.2f}x (max at {max(ups, key=lambda gu: gu[1])[0]} GPUs)"
    at_value = dict(ups).get(at)
    return text + (f"; {at_value:.2f}x at {at} GPUs" if at_value else "")


def plot_scaling(points: list[Point], model: str, path: str, plt) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=False)
    for ax, kind in zip(axes, ("hetero", "homo")):
        mine = [p for p in points if p.model == model and p.kind == kind]
        series = [("hap", [(p.gpus, p.hap, True) for p in mine if p.hap])]
        series += [(k, [(p.gpus, *p.baselines[k]) for p in mine if k in p.baselines]) for k in BASELINES]
        for name, pts in series:
            if not pts:
                continue
            ax.plot([g for g, _, _ in pts], [s for _, s, _ in pts], marker="o", label=LABELS[name], color=COLORS[name],
                    linewidth=2.2 if name == "hap" else 1.2)
            bad = [(g, s) for g, s, fits in pts if not fits]
            if bad:  # hollow markers: does not fit in memory
                ax.plot(*zip(*bad), "o", markersize=9, markerfacecolor="white", markeredgecolor=COLORS[name])
        ax.set_title(f"{MODELS[model].title}, {'heterogeneous' if kind == 'hetero' else 'homogeneous'}", fontsize=9)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("per-iteration time (s, estimated)")
        ax.set_ylim(bottom=0)
        ax.set_xticks(sorted({p.gpus for p in mine}))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, title="hollow: out of memory", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -------------------------------------------------------------------------------------------
# b. Fig. 17: uneven placement of experts


def fig17_cluster() -> Cluster:
    """2 V100 + 2 P100 single GPUs on the paper's 10.4 Gbps network (the paper used 2 A100 +
    2 P100; V100 is the fastest GPU with profiled numbers here)."""
    devices = tuple(Device(name=n, **spec) for n, spec in [("v100", V100)] * 2 + [("p100", P100)] * 2)
    return Cluster(name="fig17-2v100-2p100", devices=devices,
                   collectives=fits_from_network(len(devices), PAPER_BANDWIDTH, PAPER_LATENCY))


def moe_graph(experts: int, batch: int, padded_from: int | None = None):
    """BERT-MoE with `experts` experts and `batch` sequences. padded_from=E: the model of E real
    experts padded to `experts`, each expert keeping the capacity (tokens per sequence) it has
    with E, as a system that pads does; the padded experts' work is wasted."""
    info, cfg, _ = resolve("bert-moe", experts=experts, batch=batch)
    if padded_from is not None:
        slots = capacity(cfg.seq, padded_from, 2, cfg.capacity_factor)
        # capacity() = ceil(2 S cf / E): aim at slots - 0.5 so the ceiling lands exactly on slots.
        cfg = dataclasses.replace(cfg, capacity_factor=(slots - 0.5) * experts / (2 * cfg.seq))
        assert capacity(cfg.seq, experts, 2, cfg.capacity_factor) == slots
    gen = torch.Generator().manual_seed(0)
    inputs = tuple(t.to("meta") for t in info.example_inputs(cfg, batch, gen))
    with torch.device("meta"):
        model = info.model(cfg)
    return capture(model.train(), inputs, name=f"bert-moe-{experts}")


@dataclass
class ExpertPoint:
    experts: int
    padded: int
    hap: float
    placement: str  # hap's experts per device, or how it keeps them
    ep_padded: tuple[float, bool]
    ep_uneven: tuple[float, bool]  # EP priced on the real experts, integer shards differing by one
    dp_cp: tuple[float, bool]


def run_experts(expert_counts) -> list[ExpertPoint]:
    cluster = fig17_cluster()
    m = cluster.size
    capacity_bytes = min(d.memory for d in cluster.devices)
    out = []
    for e in expert_counts:
        t0 = time.perf_counter()
        batch = 8 * e  # tokens proportional to experts (section 7.6); 32 sequences per GPU at 16 experts
        graph = moe_graph(e, batch)
        result = plan(graph, cluster)
        padded = math.ceil(e / m) * m
        if padded == e:
            ep_padded = (result.baselines["ep"]["seconds"], result.baselines["ep"]["fits"])
        else:
            ep = baseline_plan(moe_graph(padded, batch, padded_from=e), cluster, "ep")
            ep_padded = (ep.estimated_iteration_seconds, max(ep.memory_bytes) <= capacity_bytes)
        split = result.shard_sizes(graph.experts[0], 0)
        out.append(ExpertPoint(e, padded, result.estimated_iteration_seconds, "/".join(map(str, split)) if split else "replicated",
                               ep_padded, *((result.baselines[k]["seconds"], result.baselines[k]["fits"]) for k in ("ep", "dp_cp"))))
        say(f"  {e} experts: {time.perf_counter() - t0:.1f} s")
    return out


def experts_table(points: list[ExpertPoint]) -> str:
    lines = ["| experts | padded to | HAP | HAP's experts per GPU (V100/V100/P100/P100) | EP, padded | HAP vs padded EP "
             "| EP unpadded (uneven integer shards) | DP-CP |", "|" + "---|" * 8]
    for p in points:
        lines.append(f"| {p.experts} | {p.padded} | {ms(p.hap)} | {p.placement} | {ms(*p.ep_padded)} | "
                     f"{ratio(p.ep_padded[0] / p.hap)} | {ms(*p.ep_uneven)} | {ms(*p.dp_cp)} |")
    return "\n".join(lines)


def plot_experts(points: list[ExpertPoint], path: str, plt) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    xs = [p.experts for p in points]
    ax.plot(xs, [p.hap for p in points], marker="o", linewidth=2.2, label="HAP", color=COLORS["hap"])
    ax.plot(xs, [p.ep_padded[0] for p in points], marker="s", label="EP, experts padded to a multiple of 4",
            color=COLORS["ep"])
    ax.plot(xs, [p.ep_uneven[0] for p in points], linestyle=":", marker=".", label="EP unpadded (not realizable)",
            color="gray")
    ax.set_xlabel("experts")
    ax.set_ylabel("per-iteration time (s, estimated)")
    ax.set_title("BERT-MoE on 2 V100 + 2 P100, tokens proportional to experts", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -------------------------------------------------------------------------------------------
# c. Fig. 19: synthesis time


def run_synthesis(layer_counts, repeats: int) -> list[tuple[int, int, float, float]]:
    """(layers, graph nodes, hap's own synthesis seconds, with the baselines) for ViT on
    paper-hetero-8; medians of `repeats` runs."""
    cluster = load_cluster("paper-hetero-8")
    out = []
    for layers in layer_counts:
        net, inputs = build("vit", layers=layers, devices=cluster.gpus, device="meta")
        graph = capture(net, inputs, name=f"vit-{layers}")
        alone = statistics.median(plan(graph, cluster, PlannerConfig(baselines=False)).synthesis_seconds for _ in range(repeats))
        full = statistics.median(plan(graph, cluster).synthesis_seconds for _ in range(repeats))
        out.append((layers, len(graph.nodes), alone, full))
        say(f"  vit-{layers}: {alone:.2f} s")
    return out


def synthesis_table(rows) -> str:
    lines = ["| ViT layers | graph nodes | HAP synthesis (s) | with the 3 baselines (s) | published prototype (s) |",
             "|---|---|---|---|---|"]
    for layers, nodes, alone, full in rows:
        pub = PUBLISHED.get(("vit", layers))
        lines.append(f"| {layers} | {nodes} | {alone:.2f} | {full:.2f} | {pub if pub is not None else '–'} |")
    return "\n".join(lines)


def plot_synthesis(rows, path: str, plt) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r[0] for r in rows], [r[2] for r in rows], marker="o", label="hap (this)")
    pub = [(layers, PUBLISHED[("vit", layers)]) for layers, *_ in rows if ("vit", layers) in PUBLISHED]
    if pub:
        ax.plot(*zip(*pub), marker="s", linestyle="--", label="published prototype")
    ax.set_xlabel("ViT layers")
    ax.set_ylabel("synthesis time (s)")
    ax.set_title("Synthesis time on paper-hetero-8", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -------------------------------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def report(out_dir: str, quick: bool) -> str:
    """Run the three experiments, write out_dir/paper.md and the plots, return the Markdown."""
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(1)
    plt = _pyplot()
    t0 = time.perf_counter()
    gpu_counts = (8, 32) if quick else (8, 16, 24, 32, 64)
    say("Figs. 13/14: scaling")
    points = run_scaling(gpu_counts)
    say("Fig. 17: experts")
    experts = run_experts((2, 3, 4, 6) if quick else range(2, 17))
    say("Fig. 19: synthesis time")
    synth = run_synthesis((1, 2, 4, 8) if quick else (1, 2, 4, 8, 12, 16, 24), 1 if quick else 3)

    md = [_intro(quick, plt is not None)]
    md.append("## Figs. 13 and 14: per-iteration time, heterogeneous and homogeneous\n\n" + _scaling_notes())
    md.append("### The paper's quoted speed-ups and ours\n\n" + comparison_table(points) + "\n\n" + _comparison_notes(points))
    for model in MODEL_NAMES:
        md.append(f"### {MODELS[model].title}\n\nEstimated milliseconds per iteration († does not fit in memory; "
                  "speed-ups are over baselines that fit).\n\n" + scaling_table(points, model))
        if plt:
            plot_scaling(points, model, os.path.join(out_dir, f"fig13-14-{model}.png"), plt)
            md.append(f"![{model}](fig13-14-{model}.png)")
    md.append("## Fig. 17: uneven placement of experts\n\n" + _experts_notes(experts) + "\n\n" + experts_table(experts))
    if plt:
        plot_experts(experts, os.path.join(out_dir, "fig17-experts.png"), plt)
        md.append("![experts](fig17-experts.png)")
    md.append("## Fig. 19: synthesis time\n\n" + _synthesis_notes() + "\n\n" + synthesis_table(synth))
    if plt:
        plot_synthesis(synth, os.path.join(out_dir, "fig19-synthesis.png"), plt)
        md.append("![synthesis](fig19-synthesis.png)")
    md.append(f"Total run time {time.perf_counter() - t0:.0f} s.")
    text = "\n\n".join(md) + "\n"
    with open(os.path.join(out_dir, "paper.md"), "w") as f:
        f.write(text)
    return text


def _intro(quick: bool, plots: bool) -> str:
    return ("# HAP section 7, simulated\n\n"
            "Every time below is hap's cost-model **estimate** (hap/cost/model.py) for the paper's testbed, "
            "not a measurement: FLOP/s are the published artifact's profiled values (V100 3.86e12, P100 2.15e12), "
            "links 10.4 Gbps between machines, ring-algorithm collectives. The paper's numbers are measured on GPUs "
            "with PyTorch DDP, DeepSpeed and TAG; ours compare plans under one model, so only the direction and rough "
            "size of the differences are comparable."
            + (" Quick run: 8 and 32 GPUs, fewer expert and layer counts." if quick else "")
            + ("" if plots else " **matplotlib is not installed: plots were skipped.**"))


def _scaling_notes() -> str:
    return ("Weak scaling as in the paper: global batch 64 per GPU (32 for BERT-MoE), BERT-MoE with 2 experts per GPU. "
            "Clusters: `paper-hetero-N` (2 V100 + 6 P100 machines) and `paper-homo-N` (8 P100 machines), N/8 GPUs "
            "used per machine; a machine is one device to the planner, its GPUs data parallel inside it. "
            "The paper's homogeneous runs used 4 P100 machines (8-32 GPUs); ours keep 8 machines at every size. "
            "Baselines, each the cheapest program of its family under the same cost model: DP-EV and DP-CP (data "
            "parallel, even and compute-proportional batch shares), TP (Megatron-style: parameters sharded, "
            "activations whole), EP (BERT-MoE only: DP-EV with the experts sharded evenly, tokens moved by "
            "all-to-all; the stand-in for DeepSpeed-MoE; experts are a multiple of the machines here, so no padding). "
            "The paper's TAG baseline is not modelled. HAP's plan is never slower than a baseline that fits, "
            "because the planner keeps the baselines as candidates; 'HAP's plan' names the candidate that won.")


def _comparison_notes(points: list[Point]) -> str:
    return ("Why ours differ: (1) these are estimates: the cost model charges no kernel inefficiency for small "
            "shards (plans that shard layers look as cheap as their FLOPs) and does not overlap communication with "
            "computation (the gradient all-reduce follows the backward), which favours plans that communicate "
            "little. (2) Our TP baseline is strong on VGG19 (it shards the 25088x4096 classifier, as the paper's "
            "HAP does), so the speed-up over the best baseline is far lower than over data parallelism, which "
            "is what the paper's 2.41x compares with. (3) On the homogeneous cluster the cost model finds nothing "
            "better than data parallelism for ViT and BERT-base, so the paper's 19% and 22% (over DDP and DeepSpeed, "
            "measured) are not reproduced; our homogeneous cluster also has 8 machines, not the paper's 4. "
            + _moe_note(points))


def _moe_note(points: list[Point]) -> str:
    """Where BERT-MoE's plan is the EP baseline because nothing else fits."""
    ep_only = sorted({f"{p.gpus}" for p in points if p.model == "bert-moe" and p.winner == "ep"
                      and not any(fits for k, (_, fits) in p.baselines.items() if k != "ep")}, key=int)
    if not ep_only:
        return ""
    return ("(4) BERT-MoE grows with the GPUs (2 experts each): at " + ", ".join(ep_only) + " GPUs no data- or "
            "tensor-parallel program fits in 16 GiB and hap's own search finds none that fits either (its "
            "memory fallback is weak), so its plan is the EP baseline (the paper reports HAP's own strategy "
            "performing like DeepSpeed's).")


def _experts_notes(points: list[ExpertPoint]) -> str:
    best = max(points, key=lambda p: p.ep_padded[0] / p.hap)
    return ("BERT-MoE (12 layers, every second FFN a top-2 MoE) with 2-16 experts on 2 V100 + 2 P100 single GPUs "
            "joined by 10.4 Gbps (the paper used 2 A100 + 2 P100; no profiled A100 numbers here, so the fast GPU "
            "is a V100, a smaller speed gap than the paper's). Tokens grow with the experts (8 sequences of 128 "
            "per expert), so each expert's load is constant. Expert parallelism needs the experts to be a "
            "multiple of the 4 GPUs: EP, padded is priced on the model with the experts padded up to the next "
            "multiple of 4, every expert keeping the real model's capacity (tokens per sequence), so the padded "
            "experts' compute and all-to-all traffic are wasted, as in DeepSpeed. 'EP unpadded' is what the even "
            "baseline costs on the real experts with integer shards that differ by one (rounding decides which GPUs "
            "get the extra expert; the busiest sets the time): not a system that exists, shown for reference. "
            f"Paper: up to {PAPER_FIG17 * 100:.0f}% faster than padded EP. Ours: up to "
            f"{(best.ep_padded[0] / best.hap - 1) * 100:.0f}% (at {best.experts} experts).")


def _synthesis_notes() -> str:
    return ("ViT (hidden 768, 12 heads, CIFAR-10 4x4 patches, batch 512) with 1-24 layers, planned for paper-hetero-8 "
            f"(the paper's figure; synthesis time does not depend on the device count). Paper: {PAPER_FIG19}. "
            "'HAP synthesis' is the planner's own clock with the baselines off (search + load balancing, all "
            "Q/B rounds); the next column adds the three baseline searches. Published prototype: the Rust "
            "implementation on a machine like this one (shared/notes/published-hap.md). Timed on a shared "
            "2-core machine at low priority, so these are upper bounds.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for paper.md and the plots")
    ap.add_argument("--quick", action="store_true", help="fewer configurations (about 3 minutes)")
    args = ap.parse_args()
    report(args.out, args.quick)
    print(f"wrote {os.path.join(args.out, 'paper.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
