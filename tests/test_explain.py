"""hap explain: the estimated iteration per device, layouts, and the measured one beside it."""

import dataclasses
import json

import pytest
import torch

from hap import capture, load_cluster, plan
from hap.cli import main
from hap.explain import SYNC, estimated_events, layouts, where_time_goes
from hap.models import build
from hap.plan import Plan

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def vit_plan():
    cluster = load_cluster("paper-hetero-8")
    model, inputs = build("vit", layers=2, devices=cluster.gpus, device="meta")
    return plan(capture(model, inputs), cluster)


def test_the_drawn_iteration_is_the_estimate(vit_plan):
    """The timeline rebuilt from the plan ends where the cost model's estimate does, and its
    gradient buckets overlap the backward as priced."""
    events, total = estimated_events(vit_plan)
    assert total == pytest.approx(vit_plan.estimated_iteration_seconds, rel=1e-9)
    assert max(e.start + e.seconds for e in events) == pytest.approx(total, rel=1e-9)
    sync = [e for e in events if e.lane == SYNC and e.device == 0]
    assert len(sync) == len(vit_plan.timeline["buckets"]) > 1
    backward_end = max(e.start + e.seconds for e in events if e.name.startswith("backward"))
    assert min(e.start for e in sync) < backward_end  # some sync runs during the backward
    for a, b in zip(sync, sync[1:]):
        assert b.start >= a.start + a.seconds - 1e-12  # one bucket at a time
    # the report's shares are of the estimate: the sync hidden under the backward has none (it
    # had its own, and the shares summed past 100%)
    report = where_time_goes(vit_plan)
    assert vit_plan.breakdown["gradient_sync_overlapped"] > 0
    assert any(line.startswith("  gradient sync overlapped") and line.endswith("(hidden)") for line in report)
    shares = [float(line.rstrip("%").split()[-1]) for line in report if line.endswith("%")]
    assert len(shares) == len(vit_plan.breakdown) - 1 and sum(shares) == pytest.approx(100, abs=0.5)


def test_layouts_name_every_parameter_and_its_sync(vit_plan):
    text = "\n".join(layouts(vit_plan))
    for e in vit_plan.sync:
        assert f"gradient: all-reduce in bucket {e.bucket}" in text and e.param in text
    assert "S(0)   [dim 0 seg 0: " in text  # the batch split, with its rows per device


def test_a_searched_sync_strategy_is_drawn_and_laid_out_as_priced(vit_plan):
    """A plan from hap sync (servers, a parameter split in two parts, one compressed): explain
    drew the base plan's all-reduce buckets and printed its breakdown, and every part read
    "all-reduce". Now the drawn iteration ends at the plan's estimate, the breakdown adds up to
    it, and each part is named with its rows and synchronizer."""
    from hap.cost.model import CostModel
    from hap.rules import strategy_table
    from hap.rules.units import ShardClasses
    from hap.search.program import replay
    from hap.sync.price import with_estimate
    from hap.sync.strategy import PartSync, SyncStrategy, Variables, VarSync, with_strategy

    cluster = load_cluster("paper-hetero-8")
    model, inputs = build("vit", layers=2, devices=cluster.gpus, device="meta")
    graph = capture(model, inputs)
    variables = Variables.of(vit_plan, graph, None)
    cost = CostModel(graph, cluster, ShardClasses(graph, enumerate(strategy_table(graph))))
    est = replay(vit_plan.steps(graph), cost, vit_plan.segment_of, vit_plan.ratios)
    split = variables.vars[0]
    strategy = SyncStrategy(tuple(
        VarSync(v.param, (PartSync(kind="ps", server=2), PartSync(kind="all_reduce", group=1, compressor="fp16")))
        if v is split else VarSync(v.param, (PartSync(kind="ps", server=3),)) for v in variables.vars))
    read = Plan.from_json(vit_plan.to_json())  # (a plan from a file, as `hap sync --plan` takes it)
    assert read.written and not read.edited_since_written
    synced = with_estimate(with_strategy(read, variables, strategy), graph, cost, est, searched="autosync")
    assert synced.estimated_iteration_seconds != vit_plan.estimated_iteration_seconds
    # priced with its new sync, it is current (it was marked edited since hap wrote it)
    assert not synced.edited_since_written and not Plan.from_json(synced.to_json()).edited_since_written
    events, total = estimated_events(synced)
    assert total == pytest.approx(synced.estimated_iteration_seconds, rel=1e-9)
    assert sum(v for k, v in synced.breakdown.items() if k != "gradient_sync_overlapped") == pytest.approx(total, rel=1e-9)
    sync = [e for e in events if e.lane == SYNC and e.device == 0]
    assert any("server 3" in e.name for e in sync) and any("all-reduce (fp16)" in e.name for e in sync)
    assert not any(e.name.startswith("all-reduce bucket") for e in sync)  # none of the base plan's buckets
    text = "\n".join(layouts(synced))
    line = next(x for x in text.splitlines() if x.startswith(split.param + " "))
    half = split.rows - split.rows // 2
    assert "gradient: " in line and f"rows 0-{half}: server 2 in bucket" in line
    assert f"rows {half}-{split.rows}: all-reduce (fp16) in bucket" in line


def test_a_pipelines_drawn_iteration_is_its_simulated_schedule():
    """A pp-exact plan of 3 stages on paper-hetero-8 (groups of unequal sizes): every device
    runs each micro-batch's forward and backward once, never two at a time; a stage's forward
    of a micro-batch starts after the stage before it finished it and sent it on; a link carries
    one transfer at a time (they were drawn stacked on it, 30 us each against 2.5 us of
    compute); a stage syncs once its gradients sent back have arrived (the sync was drawn
    before); and the drawn iteration is the estimate's simulated one (they differed by the
    slowest sync, which the estimate put after the whole flush)."""
    from hap.explain import COMM, COMPUTE, SYNC, pipeline_events
    from hap.planner import PlannerConfig
    from hap.planners import make_plan
    cluster = load_cluster("paper-hetero-8")
    model, inputs = build("vit", layers=4, devices=cluster.gpus, device="meta")
    p = make_plan("pp-exact", capture(model, inputs), cluster, PlannerConfig(pipeline_stages=3))
    tl, M = p.timeline["pipeline"], p.schedule.micro_batches
    events, total = pipeline_events(p)
    assert max(tl["sync"]) > 0 and total == pytest.approx(tl["simulated"], rel=1e-12)
    sent: dict[tuple, list] = {}
    for e in events:
        if e.lane == COMM and " to stage " in e.name and e.device in p.stages[0].devices + p.stages[1].devices:
            sent.setdefault((e.device, e.name.split("'s ")[1]), []).append(e)
    assert sent
    for (device, what), moves in sent.items():  # one link, one transfer at a time
        moves.sort(key=lambda e: e.start)
        for a, b in zip(moves, moves[1:]):
            assert b.start >= a.start + a.seconds - 1e-12, (device, what)
    for s, stage in enumerate(p.stages[1:], start=1):
        j = stage.devices[0]
        back = max(e.start + e.seconds for e in events if e.device == j and e.name.endswith(f"gradients to stage {s - 1}"))
        synced = [e for e in events if e.device == j and e.lane == SYNC]
        assert all(e.start >= back - 1e-12 for e in synced)
    ends = {}
    for s, stage in enumerate(p.stages):
        for j in stage.devices:
            mine = sorted((e for e in events if e.device == j and e.lane == COMPUTE), key=lambda e: e.start)
            assert sorted(e.name for e in mine) == sorted(f"{kind} micro-batch {m} (stage {s})"
                                                          for kind in ("forward", "backward") for m in range(M))
            for a, b in zip(mine, mine[1:]):
                assert b.start >= a.start + a.seconds - 1e-12
            ends.update({(s, e.name.split(" (")[0]): e for e in mine})
    for s in range(1, len(p.stages)):
        for m in range(M):
            before, after = ends[(s - 1, f"forward micro-batch {m}")], ends[(s, f"forward micro-batch {m}")]
            assert after.start >= before.start + before.seconds + tl["send"][s - 1] - 1e-12
    assert f"a pipeline of 3 stages, {M} micro-batches" in "\n".join(where_time_goes(p))
    # the plan's schedule edited by hand: the drawing is still of the schedule priced (it
    # simulated the edited one, 3x longer, under a note saying it drew the plan as priced)
    edited = dataclasses.replace(p, schedule=dataclasses.replace(p.schedule, micro_batches=3 * M),
                                 written=p.written_digest)
    assert edited.edited_since_written
    assert pipeline_events(edited)[1] == pytest.approx(tl["simulated"], rel=1e-12)
    assert f"a pipeline of 3 stages, {M} micro-batches" in "\n".join(where_time_goes(edited))
    assert layouts(p)[0].startswith("stage 0: nodes 0-")


def test_explain_a_trained_plan_beside_its_traces(tmp_path, capsys):
    traces, out = tmp_path / "traces", tmp_path / "explain"
    assert main(["train", "--model", "vit", "--cluster", "local", "--steps", "4", "--trace", str(traces)]) == 0
    capsys.readouterr()
    assert main(["explain", str(traces / "plan.json"), "-o", str(out), "--trace", str(traces)]) == 0
    report = capsys.readouterr().out
    assert "measured step (last traced, per rank)" in report and "estimated iteration" in report
    trace = json.loads((out / "timeline.json").read_text())["traceEvents"]
    kinds = {e["pid"].split(":")[0] for e in trace}
    assert kinds == {"estimated", "measured"}
    measured = [e for e in trace if e["pid"].startswith("measured") and e["tid"] == "compute"]
    assert measured, "the executor's node spans are in the measured timeline"
    assert (out / "timeline.png").stat().st_size > 10_000 and (out / "layouts.txt").read_text()
    other = json.loads((traces / "plan.json").read_text())  # another plan: these traces are not its
    other["stages"][0]["ratios"] = [[0.5, 0.5] for _ in other["stages"][0]["ratios"]]
    (tmp_path / "other.json").write_text(json.dumps(other))
    capsys.readouterr()
    assert main(["explain", str(tmp_path / "other.json"), "-o", str(out), "--trace", str(traces)]) == 2
    assert capsys.readouterr().err.strip() == (f"hap: error: {traces} traced another plan ({traces}/plan.json, vit on "
                                               "local): explain that plan, or trace this one with hap train --plan ... "
                                               "--trace")
    # the same program on another cluster: drawn beside this measurement without a word, its
    # estimate priced for a cluster it did not run on
    other = json.loads((traces / "plan.json").read_text())
    other["cluster"]["name"] = "elsewhere"
    (tmp_path / "elsewhere.json").write_text(json.dumps(other))
    assert main(["explain", str(tmp_path / "elsewhere.json"), "-o", str(out), "--trace", str(traces)]) == 2
    assert capsys.readouterr().err.strip() == (f"hap: error: {traces} traced this plan on cluster 'local', this file "
                                               f"prices it on 'elsewhere': explain {traces}/plan.json, its estimate "
                                               "for the cluster it ran on")
    (traces / "rank1.json").write_text('{"traceEvents": [')
    assert main(["explain", str(traces / "plan.json"), "-o", str(out), "--trace", str(traces)]) == 2
    assert capsys.readouterr().err.strip() == (f"hap: error: {traces}/rank1.json is not a Chrome trace "
                                               "(JSONDecodeError): a damaged trace")


def test_traces_of_another_pipeline_schedule_are_refused(tmp_path):
    """A pipeline traced under GPipe was drawn beside its 1F1B plan: the check compared stages
    and sync, not the schedule."""
    import dataclasses

    from hap.explain import _check_traced
    from hap.planner import PlannerConfig
    from hap.planners import make_plan
    cluster = load_cluster("local-4")
    model, inputs = build("vit", layers=2, devices=cluster.gpus, device="meta")
    piped = make_plan("pp-exact", capture(model, inputs), cluster, PlannerConfig(pipeline_stages=2, schedule="1f1b"))
    piped.to_json(tmp_path / "plan.json")
    _check_traced(piped, tmp_path)
    gpipe = dataclasses.replace(piped, schedule=dataclasses.replace(piped.schedule, name="gpipe"))
    with pytest.raises(ValueError, match=f"^{tmp_path} traced another plan"):
        _check_traced(gpipe, tmp_path)


def test_explain_errors_are_one_line(tmp_path, capsys, vit_plan):
    assert main(["explain", str(tmp_path / "missing.json"), "-o", str(tmp_path / "out" / "here")]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # a failed command leaves no empty output folder (it made out/here)
    (tmp_path / "kept").mkdir()
    assert main(["explain", str(tmp_path / "missing.json"), "-o", str(tmp_path / "kept")]) == 2
    assert (tmp_path / "kept").is_dir()  # (the user's own folder stays)
    capsys.readouterr()
    path = tmp_path / "plan.json"
    vit_plan.to_json(path)
    assert main(["explain", str(path), "-o", str(tmp_path / "x"), "--trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no trace for rank 0" in err and len(err.splitlines()) == 1
    assert main(["explain", str(path), "-o", str(tmp_path / "x"), "--trace", str(path)]) == 2  # a file for the folder
    assert capsys.readouterr().err.strip() == (f"hap: error: --trace {path} is not a folder of traces (`hap train "
                                               "--trace DIR` writes DIR/rank<r>.json)")
    for timeline in ({}, {"stages": "x"}, []):  # hand-edited, or an older version's list: the plan loads
        edited = {**vit_plan.to_dict(), "timeline": timeline}
        (tmp_path / "edited.json").write_text(json.dumps(edited))
        assert main(["explain", str(tmp_path / "edited.json"), "-o", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hap: error: malformed plan: its timeline cannot be drawn (") and len(err.splitlines()) == 1


@pytest.mark.parametrize("trace, why", [
    ({"traceEvents": [{"ph": "X", "name": "hap step 1", "ts": 0, "dur": -5000}]},
     r"event 0 has ts 0 and dur -5000: a finite start and a length at least 0"),  # (drawn as a -5 ms step)
    ({"traceEvents": None}, "no list of traceEvents"),
    ([], "no list of traceEvents"),
    ({"traceEvents": [7]}, "event 0 is not an object"),
    ({"traceEvents": [{"ph": "X", "name": "hap step 1", "dur": 5}]}, "event 0 has no numeric ts and dur"),
    ({"traceEvents": [{"ph": "X", "name": "hap step 1", "ts": 0, "dur": 9},
                      {"ph": "X", "name": "node", "ts": "3", "dur": 1}]}, "event 1 has no numeric ts and dur"),
])
def test_a_damaged_trace_is_named_in_one_line(tmp_path, trace, why):
    """Each of these raised TypeError or KeyError from inside explain."""
    from hap.explain import measured_events

    (tmp_path / "rank0.json").write_text(json.dumps(trace))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/rank0.json is not a Chrome trace \({why}\): a damaged trace$"):
        measured_events(tmp_path, 1)


def test_explain_says_when_a_plan_file_was_edited_after_hap_wrote_it(tmp_path, capsys, vit_plan):
    path = tmp_path / "plan.json"
    vit_plan.to_json(path)
    assert main(["explain", str(path), "-o", str(tmp_path / "x")]) == 0
    assert "edited" not in capsys.readouterr().out  # as written: its estimate is its own
    d = json.loads(path.read_text())
    shares = d["stages"][0]["ratios"][0]
    shares[0], shares[1] = shares[1] + 0.1, shares[0] - 0.1  # the user moves shares by hand
    path.write_text(json.dumps(d))
    assert main(["explain", str(path), "-o", str(tmp_path / "x")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("note: this plan was edited after hap priced it: its estimate, and what is drawn, are of the "
                          "plan as hap priced it")
