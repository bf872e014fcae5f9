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

A pipeline plan's timeline is its schedule as the cost model runs it (pipeline/schedule.simulate
on the stage times its estimate states): every micro-batch's forward and backward on each
stage's devices, the transfers between stages (one at a time on each link), each stage's
gradient all-reduce once its last backward and sends are done, then the loss's all-reduce.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from .pipeline.schedule import simulate
from .plan import Plan, PlanStage, size_text

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
    done_at, backward_start = {}, t
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
    for p in tl.get("sync", []):  # a searched strategy's buckets (hap sync), timed from the backward's start
        what = f"bucket {p['bucket']}: {p['method']} ({size_text(p['nbytes'])})"
        events += [Event(j, SYNC, what, backward_start + p["start"], p["seconds"]) for j in devices if p["seconds"] > 0]
        events += [Event(j, SYNC, f"{what}, after the backward", backward_start + p["then_start"], p["then"])
                   for j in devices if p["then"] > 0]
        sync_end = max(sync_end, backward_start + p["then_start"] + p["then"])
    t = max(t, sync_end)
    if tl["step_sync"] > 0:
        events += [Event(j, COMM, "loss all-reduce", t, tl["step_sync"]) for j in devices]
        t += tl["step_sync"]
    return events, t


def pipeline_events(plan: Plan) -> tuple[list[Event], float]:
    """A pipeline's estimated iteration as events per device, and its length in seconds: the
    schedule simulated as the estimate's `simulated` runs it (pipeline/schedule.simulate)."""
    tl = plan.timeline["pipeline"]
    name, M = _priced_schedule(plan)
    send, back = tl["send"], _send_back(tl)
    sim = simulate(name, M, tl["fwd"], tl["bwd"], send, back, tl["sync"])
    events: list[Event] = []
    for (kind, s, m), (start, end) in sorted(sim.runs.items(), key=lambda item: item[1]):
        devices = plan.stages[s].devices
        events += [Event(j, COMPUTE, f"{'forward' if kind == 'F' else 'backward'} micro-batch {m} (stage {s})",
                         start, end - start) for j in devices]
        moved = sim.transfers.get((kind, s, m))
        if moved is not None and moved[1] > moved[0]:  # asynchronous: the stage goes on computing
            what = f"micro-batch {m}'s activations to stage {s + 1}" if kind == "F" else \
                f"micro-batch {m}'s gradients to stage {s - 1}"
            events += [Event(j, COMM, what, moved[0], moved[1] - moved[0]) for j in devices]
    for s, (start, end) in enumerate(sim.synced):
        if end > start:
            events += [Event(j, SYNC, f"all-reduce stage {s}'s gradients", start, end - start)
                       for j in plan.stages[s].devices]
    t = sim.end
    tail = tl["simulated"] - t  # what the estimate adds after the syncs
    if tail > 1e-12:
        events += [Event(j, COMM, "loss all-reduce (and generator broadcasts)", t, tail) for j in range(len(plan.devices))]
        t += tail
    return events, t


def layouts(plan: Plan) -> list[str]:
    """Every tensor's placements in each stage's program (in order of first appearance) with
    its sizes per device where sharded, and how each parameter's gradient is synchronized."""
    synced: dict[str, list] = {}
    for e in plan.sync:
        synced.setdefault(e.param, []).append(e)
    if len(plan.stages) == 1:
        return _stage_layouts(plan.stage, synced)
    lines = []
    for k, stage in enumerate(plan.stages):
        lines.append(f"stage {k}: nodes {stage.nodes[0]}-{stage.nodes[1]} on devices {stage.devices} "
                     f"(micro-batch shares {', '.join(f'{r:.3f}' for r in stage.ratios[0])}; sizes per piece: "
                     "micro-batch by micro-batch, device by device)")
        lines += ["  " + line for line in _stage_layouts(stage, synced)]
    return lines


def _stage_layouts(stage: PlanStage, synced: dict) -> list[str]:
    places: dict[str, list[str]] = {}
    for ins in stage.program:
        for t, p in (*ins.loads, *ins.inputs, *ins.outputs, *((mv.tensor, mv.dst) for mv in ins.moves)):
            if p not in places.setdefault(t, []):
                places[t].append(p)
    sizes: dict[str, list[str]] = {}
    for sh in stage.shards:
        sizes.setdefault(sh.tensor, []).append(f"dim {sh.dim} seg {sh.segment}: {'/'.join(map(str, sh.sizes))}")
    width = max((len(t) for t in places), default=0)
    lines = []
    for t, ps in places.items():
        extra = f"   [{'; '.join(sizes[t])}]" if t in sizes else ""
        sync = ""
        if t in synced:
            sync = "   gradient: " + "; ".join(
                (f"rows {e.rows[0]}-{e.rows[0] + e.rows[1]}: " if e.rows is not None else "") + f"{e.method} in bucket "
                f"{e.bucket}" + (f" over devices {list(e.devices)}" if list(e.devices) != list(stage.devices) else "")
                for e in synced[t])
        lines.append(f"{t:<{width}}  {', '.join(ps)}{extra}{sync}")
    return lines


def where_time_goes(plan: Plan, top: int = 5) -> list[str]:
    total = plan.estimated_iteration_seconds
    lines = [f"estimated iteration {total * 1e3:.2f} ms on {plan.cluster['name']} ({len(plan.devices)} devices)"]
    for key, value in plan.breakdown.items():
        # (the sync hidden under the backward is not in the estimate: its share would sum past 100%)
        share = "  (hidden)" if key == "gradient_sync_overlapped" else f"{100 * value / total if total else 0:5.1f}%"
        lines.append(f"  {key.replace('_', ' '):<26} {value * 1e3:9.2f} ms  {share}")
    if len(plan.stages) > 1:
        return lines + _pipeline_time(plan)
    stages = plan.timeline["stages"]
    dear = sorted(range(len(stages)), key=lambda i: -(stages[i]["comm"] + max(stages[i]["fwd"]) + max(stages[i]["bwd"])))
    # ("stages" of the timeline are spans between collectives, not a pipeline's stages)
    lines.append(f"  dearest spans between collectives (of {len(stages)}):")
    for i in dear[:top]:
        st = stages[i]
        slowest = max(range(len(st["fwd"])), key=lambda j: st["fwd"][j] + st["bwd"][j])
        what = ", ".join(st["collectives"]) or "computation only"
        lines.append(f"    span {i}: {(st['comm'] + max(st['fwd']) + max(st['bwd'])) * 1e3:.2f} ms  ({what}; "
                     f"slowest device {slowest} ({plan.devices[slowest]}))")
    return lines


def _send_back(timeline: dict) -> list[float]:
    """A pipeline's seconds per stage of gradients sent back (plans written before 2026-11-27
    priced both ways alike: only `send`)."""
    return timeline.get("send_back", timeline["send"])


def _priced_schedule(plan: Plan) -> tuple[str, int]:
    """The schedule and micro-batches the plan's estimate priced (a hand edit of the plan's
    schedule leaves the estimate of the one priced; plans written before 2026-11-29 name it in
    the schedule alone)."""
    tl = plan.timeline["pipeline"]
    return tl.get("schedule", plan.schedule.name), tl.get("micro_batches", plan.schedule.micro_batches)


def _pipeline_time(plan: Plan) -> list[str]:
    tl = plan.timeline["pipeline"]
    name, M = _priced_schedule(plan)
    K = len(plan.stages)
    t = tl["stage_seconds"]
    pace = max(range(K), key=lambda s: t[s])
    more = f"{M - 1} more micro-batch{'' if M == 2 else 'es'} of its" if M > 1 else "one micro-batch:"
    lines = [f"  a pipeline of {K} stages, {M} micro-batch{'' if M == 1 else 'es'}, {name}; the schedule "
             f"simulated: {tl['simulated'] * 1e3:.2f} ms",
             f"  stage {pace} sets the pace ({more} {t[pace] * 1e3:.2f} ms); per micro-batch:"]
    for s, stage in enumerate(plan.stages):
        names = ", ".join(sorted({plan.devices[j] for j in stage.devices}))
        after = "" if s == K - 1 else (f", {tl['send'][s] * 1e3:.2f} ms to send on and "
                                       f"{_send_back(tl)[s] * 1e3:.2f} ms to get its gradients back")
        lines.append(f"    stage {s}: nodes {stage.nodes[0]}-{stage.nodes[1]} on devices {stage.devices} ({names}): "
                     f"forward {tl['fwd'][s] * 1e3:.2f} ms, backward {tl['bwd'][s] * 1e3:.2f} ms{after}; "
                     f"gradient sync {tl['sync'][s] * 1e3:.2f} ms")
    return lines


def _check_traced(plan: Plan, trace_dir: Path) -> None:
    """The trace must be of this plan where `hap train --trace` saved the plan it ran beside it."""
    saved = trace_dir / "plan.json"
    if not saved.exists():
        return
    try:
        traced = Plan.from_json(saved)
    except (OSError, ValueError) as e:
        raise ValueError(f"{saved}: {e}") from None
    if traced.digest != plan.digest or traced.schedule != plan.schedule:
        raise ValueError(f"{trace_dir} traced another plan ({saved}, {traced.model} on {traced.cluster['name']}): "
                         "explain that plan, or trace this one with hap train --plan ... --trace")
    if traced.content_digest != plan.content_digest:  # the same program, run (and priced) on another cluster
        raise ValueError(f"{trace_dir} traced this plan on cluster {traced.cluster['name']!r}, this file prices it "
                         f"on {plan.cluster['name']!r}: explain {saved}, its estimate for the cluster it ran on")


def measured_events(trace_dir: str | Path, devices: int) -> tuple[list[Event], list[float]]:
    """The last traced step of every rank (`hap train --trace`: DIR/rank<r>.json, steps marked
    "hap step N"), as events from the step's start: the step itself, hap's collectives and
    emulated delays, and the nodes the executor labelled. Also each rank's step seconds."""
    events, steps = [], []
    if not Path(trace_dir).is_dir():  # (a file given: "no trace for rank 0: plan.json/rank0.json")
        raise ValueError(f"--trace {trace_dir} is not a folder of traces (`hap train --trace DIR` writes DIR/rank<r>.json)")
    for r in range(devices):
        path = Path(trace_dir) / f"rank{r}.json"
        if not path.exists():
            raise ValueError(f"no trace for rank {r}: {path} (run `hap train --trace {trace_dir}`)")
        raw = _complete_events(path)
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


def _complete_events(path: Path) -> list[dict]:
    """A Chrome trace's complete events ("ph": "X"), each with a numeric start and length; a
    ValueError naming the file where it is not such a trace."""
    def damaged(why: str) -> ValueError:
        return ValueError(f"{path} is not a Chrome trace ({why}): a damaged trace")

    try:
        trace = json.loads(path.read_text())
    except ValueError as e:
        raise damaged(type(e).__name__) from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise damaged("no list of traceEvents")
    out = []
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise damaged(f"event {i} is not an object")
        if e.get("ph") != "X":
            continue
        if not all(isinstance(e.get(k), (int, float)) and not isinstance(e.get(k), bool) for k in ("ts", "dur")):
            raise damaged(f"event {i} has no numeric ts and dur")
        if not (math.isfinite(e["ts"]) and math.isfinite(e["dur"]) and e["dur"] >= 0):  # (a -5 ms step was drawn)
            raise damaged(f"event {i} has ts {e['ts']} and dur {e['dur']}: a finite start and a length at least 0")
        out.append(e)
    return out


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
        ax.set_title(f"{title}: {span * 1e3:.2f} ms" + (f" (estimate {plan.estimated_iteration_seconds * 1e3:.2f} ms)"
                                                          if title == "measured" else ""))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", ncols=len(colors), fontsize="small")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def explain(plan: Plan, out_dir: str | Path, trace_dir: str | Path | None = None) -> list[str]:
    """Write timeline.png, timeline.json and layouts.txt under out_dir; return the text report."""
    os.makedirs(out_dir, exist_ok=True)
    try:
        estimated, total = (pipeline_events if len(plan.stages) > 1 else estimated_events)(plan)
        report = where_time_goes(plan)
    except (KeyError, IndexError, TypeError, ValueError) as e:  # a hand-edited (or older) plan file: the runtime reads no timeline
        raise ValueError(f"malformed plan: its timeline cannot be drawn ({type(e).__name__}: {e})") from None
    if trace_dir:
        _check_traced(plan, Path(trace_dir))
    measured, steps = measured_events(trace_dir, len(plan.devices)) if trace_dir else ([], [])
    Path(out_dir, "timeline.json").write_text(json.dumps(chrome_trace(estimated, measured, plan)))
    Path(out_dir, "layouts.txt").write_text("\n".join(layouts(plan)) + "\n")
    draw(estimated, total, measured, plan, Path(out_dir, "timeline.png"))
    if len(plan.stages) > 1:
        report.append(f"  drawn: {total * 1e3:.2f} ms, the schedule simulated as the runtime runs it (a micro-batch's "
                      "transfers overlap the next computation, one at a time on each link; each stage's gradient "
                      "sync starts when its own last backward and sends are done), the `simulated` the plan reports; "
                      "the estimate, the pipeline formula the planners minimise, puts every transfer "
                      "on the critical path and syncs after the whole flush")
    if plan.edited_since_written:
        report.insert(0, "note: this plan was edited after hap priced it: its estimate, and what is drawn, are of the "
                         "plan as hap priced it (`hap train --plan` prices it again where it runs)")
    if steps:
        report.append(f"  measured step (last traced, per rank): {', '.join(f'{s * 1e3:.2f}' for s in steps)} ms; "
                      f"estimate {plan.estimated_iteration_seconds * 1e3:.2f} ms")
    return report
