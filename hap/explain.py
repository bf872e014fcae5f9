"""Explain a plan: one iteration per device as estimated, the layout of every tensor, where the
time goes, and, given the Chrome traces of a `hap train --trace` run, the measured iteration
beside the estimate.

    hap explain plan.json -o explain/ [--trace traces/]

writes explain/timeline.png, explain/timeline.json (chrome://tracing or ui.perfetto.dev) and
explain/layouts.txt, and prints where the time goes.

The timeline follows the cost model's walk (search/program.walk): the forward runs the
stages in order (each opens with its collectives, then every device computes its part); the
backward runs them in reverse (computation, then the backward of the stage's opening
collectives); the gradient buckets are all-reduced one after another as the backward makes
them ready, on their own lane; the loss's all-reduce ends the step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .plan import Plan, size_text

COMPUTE, COMM, SYNC = "compute", "collectives", "gradient sync"


@dataclass(frozen=True, slots=True)
class Event:
    device: int
    lane: str
    name: str
    start: float
    """Seconds from the start of the iteration."""
    seconds: float


def estimated_events(plan: Plan) -> tuple[list[Event], float]:
    """The estimated iteration as events per device, and its length in seconds."""
    tl = plan.timeline
    stages, m = tl["stages"], len(plan.devices)
    devices = range(m)
    events: list[Event] = []
    t = 0.0
    for i, st in enumerate(stages):
        comm_fwd = st["comm"] - st["comm_bwd"]
        if comm_fwd > 0:
            events += [Event(j, COMM, ", ".join(st["collectives"]) or "collective", t, comm_fwd) for j in devices]
        t += comm_fwd
        events += [Event(j, COMPUTE, f"forward, stage {i}", t, st["fwd"][j]) for j in devices if st["fwd"][j] > 0]
        t += max(st["fwd"], default=0.0)
    done_at = {}
    for i in reversed(range(len(stages))):
        st = stages[i]
        events += [Event(j, COMPUTE, f"backward, stage {i}", t, st["bwd"][j]) for j in devices if st["bwd"][j] > 0]
        t += max(st["bwd"], default=0.0)
        done_at[i] = t
        if st["comm_bwd"] > 0:
            events += [Event(j, COMM, "backward of " + (", ".join(st["collectives"]) or "collective"), t, st["comm_bwd"])
                       for j in devices]
        t += st["comm_bwd"]
    sync_end = 0.0
    for b in reversed(tl["buckets"]):  # arrival order: the last layers' bucket first
        start = max(sync_end, done_at[b["stage"]])
        events += [Event(j, SYNC, f"all-reduce bucket {b['bucket']} ({size_text(b['bytes'])})", start, b["seconds"]) for j in devices]
        sync_end = start + b["seconds"]
    t = max(t, sync_end)
    if tl["step_sync"] > 0:
        events += [Event(j, COMM, "loss all-reduce", t, tl["step_sync"]) for j in devices]
        t += tl["step_sync"]
    return events, t


def layouts(plan: Plan) -> list[str]:
    """Every tensor's placements in the program (in order of first appearance) with its sizes
    per device where sharded, and how each parameter's gradient is synchronized."""
    places: dict[str, list[str]] = {}
    for ins in plan.program:
        for t, p in (*ins.loads, *ins.outputs, *((mv.tensor, mv.dst) for mv in ins.moves)):
            if p not in places.setdefault(t, []):
                places[t].append(p)
    sizes: dict[str, list[str]] = {}
    for sh in plan.stage.shards:
        sizes.setdefault(sh.tensor, []).append(f"dim {sh.dim} seg {sh.segment}: {'/'.join(map(str, sh.sizes))}")
    synced = {e.param: e.bucket for e in plan.sync}
    width = max((len(t) for t in places), default=0)
    lines = []
    for t, ps in places.items():
        extra = f"   [{'; '.join(sizes[t])}]" if t in sizes else ""
        sync = f"   gradient: all-reduce in bucket {synced[t]}" if t in synced else ""
        lines.append(f"{t:<{width}}  {', '.join(ps)}{extra}{sync}")
    return lines


def where_time_goes(plan: Plan, top: int = 5) -> list[str]:
    total = plan.estimated_iteration_seconds
    lines = [f"estimated iteration {total * 1e3:.2f} ms on {plan.cluster['name']} ({len(plan.devices)} devices)"]
    for key, value in plan.breakdown.items():
        lines.append(f"  {key.replace('_', ' '):<26} {value * 1e3:9.2f} ms  {100 * value / total if total else 0:5.1f}%")
    stages = plan.timeline["stages"]
    dear = sorted(range(len(stages)), key=lambda i: -(stages[i]["comm"] + max(stages[i]["fwd"]) + max(stages[i]["bwd"])))
    lines.append(f"  dearest stages (of {len(stages)}):")
    for i in dear[:top]:
        st = stages[i]
        slowest = max(range(len(st["fwd"])), key=lambda j: st["fwd"][j] + st["bwd"][j])
        what = ", ".join(st["collectives"]) or "computation only"
        lines.append(f"    stage {i}: {(st['comm'] + max(st['fwd']) + max(st['bwd'])) * 1e3:.2f} ms  ({what}; "
                     f"slowest device {slowest} ({plan.devices[slowest]}))")
    return lines


def measured_events(trace_dir: str | Path, devices: int) -> tuple[list[Event], list[float]]:
    """The last traced step of every rank (`hap train --trace`: DIR/rank<r>.json, steps marked
    "hap step N"), as events from the step's start: the step itself, hap's collectives and
    emulated delays, and the nodes the executor labelled. Also each rank's step seconds."""
    events, steps = [], []
    for r in range(devices):
        path = Path(trace_dir) / f"rank{r}.json"
        if not path.exists():
            raise ValueError(f"no trace for rank {r}: {path} (run `hap train --trace {trace_dir}`)")
        raw = [e for e in json.loads(path.read_text()).get("traceEvents", []) if e.get("ph") == "X"]
        marks = [e for e in raw if str(e.get("name", "")).startswith("hap step ")]
        if not marks:
            raise ValueError(f"{path} has no 'hap step' spans: record it with this version's `hap train --trace`")
        step = max(marks, key=lambda e: e["ts"])
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        steps.append(step["dur"] / 1e6)
        events.append(Event(r, "step", step["name"], 0.0, step["dur"] / 1e6))
        for e in raw:
            name = str(e.get("name", ""))
            if e is step or not (t0 <= e["ts"] and e["ts"] + e.get("dur", 0) <= t1):
                continue
            lane = _measured_lane(name)
            if lane is not None:
                events.append(Event(r, lane, name, (e["ts"] - t0) / 1e6, e.get("dur", 0) / 1e6))
    return events, steps


def _measured_lane(name: str) -> str | None:
    low = name.lower()
    if "emulated" in low:
        return "emulated"
    if any(k in low for k in ("all_reduce", "allreduce", "all_gather", "allgather", "broadcast", "reduce_scatter",
                              "all_to_all", "alltoall", "gloo", "nccl")):
        return COMM
    if low.startswith("hap node "):  # the executor's labels (moves are collectives or local slices)
        return COMPUTE
    if low.startswith("hap move "):
        return COMM
    return None


def chrome_trace(estimated: list[Event], measured: list[Event], plan: Plan) -> dict:
    """Both iterations in one Chrome trace: a process per device and kind (estimate, measured),
    a thread per lane."""
    out = []
    for kind, evs in (("estimated", estimated), ("measured", measured)):
        for e in evs:
            out.append({"name": e.name, "ph": "X", "ts": e.start * 1e6, "dur": e.seconds * 1e6,
                        "pid": f"{kind}: device {e.device} ({plan.devices[e.device]})", "tid": e.lane})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def draw(estimated: list[Event], total: float, measured: list[Event], plan: Plan, path: str | Path) -> None:
    """A per-device timeline (PNG): the estimate, and the measured step below it if given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = len(plan.devices)
    colors = {COMPUTE: "tab:blue", COMM: "tab:red", SYNC: "tab:green", "emulated": "tab:gray", "step": "lightgray"}
    offsets = {"step": -0.3, COMPUTE: -0.2, COMM: 0.0, SYNC: 0.2, "emulated": 0.2}
    panels = [("estimated", estimated)] + ([("measured", measured)] if measured else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.2 + 0.7 * m * len(panels)), squeeze=False)
    for ax, (title, evs) in zip(axes[:, 0], panels):
        for e in evs:
            ax.broken_barh([(e.start * 1e3, e.seconds * 1e3)], (e.device + offsets.get(e.lane, 0) - 0.09, 0.18),
                           color=colors.get(e.lane, "black"))
        ax.set_yticks(range(m), [f"{j}: {plan.devices[j]}" for j in range(m)])
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        span = max((e.start + e.seconds for e in evs), default=total)
        ax.set_title(f"{title}: {span * 1e3:.2f} ms" + (f" (estimate {total * 1e3:.2f} ms)" if title == "measured" else ""))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", ncols=len(colors), fontsize="small")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def explain(plan: Plan, out_dir: str | Path, trace_dir: str | Path | None = None) -> list[str]:
    """Write timeline.png, timeline.json and layouts.txt under out_dir; return the text report."""
    if len(plan.stages) > 1:
        raise ValueError(f"hap explain draws one-stage plans; this is a pipeline of {len(plan.stages)} stages "
                         "(its Chrome traces from `hap train --trace` open in chrome://tracing or ui.perfetto.dev)")
    os.makedirs(out_dir, exist_ok=True)
    estimated, total = estimated_events(plan)
    measured, steps = measured_events(trace_dir, len(plan.devices)) if trace_dir else ([], [])
    Path(out_dir, "timeline.json").write_text(json.dumps(chrome_trace(estimated, measured, plan)))
    Path(out_dir, "layouts.txt").write_text("\n".join(layouts(plan)) + "\n")
    draw(estimated, total, measured, plan, Path(out_dir, "timeline.png"))
    report = where_time_goes(plan)
    if steps:
        report.append(f"  measured step (last traced, per rank): {', '.join(f'{s * 1e3:.2f}' for s in steps)} ms; "
                      f"estimate {total * 1e3:.2f} ms")
    return report
