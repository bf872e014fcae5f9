"""hap explain: the estimated iteration per device, layouts, and the measured one beside it."""

import json

import pytest
import torch

from hap import capture, load_cluster, plan
from hap.cli import main
from hap.explain import SYNC, estimated_events, layouts, where_time_goes
from hap.models import build

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


def test_layouts_name_every_parameter_and_its_sync(vit_plan):
    text = "\n".join(layouts(vit_plan))
    for e in vit_plan.sync:
        assert f"gradient: all-reduce in bucket {e.bucket}" in text and e.param in text
    assert "S(0)   [dim 0 seg 0: " in text  # the batch split, with its rows per device


def test_a_pipelines_drawn_iteration_is_its_simulated_schedule():
    """A pp-exact plan of 3 stages on paper-hetero-8 (groups of unequal sizes): every device
    runs each micro-batch's forward and backward once, never two at a time; a stage's forward
    of a micro-batch starts after the stage before it finished it and sent it on; and the drawn
    iteration ends no later than the estimate's simulation, which waits for the slowest
    gradient sync after the whole flush."""
    from hap.explain import COMPUTE, pipeline_events
    from hap.planner import PlannerConfig
    from hap.planners import make_plan
    cluster = load_cluster("paper-hetero-8")
    model, inputs = build("vit", layers=4, devices=cluster.gpus, device="meta")
    p = make_plan("pp-exact", capture(model, inputs), cluster, PlannerConfig(pipeline_stages=3))
    tl, M = p.timeline["pipeline"], p.schedule.micro_batches
    events, total = pipeline_events(p)
    assert max(tl["sync"]) > 0 and total <= tl["simulated"] + 1e-12
    assert total >= tl["simulated"] - max(tl["sync"]) - 1e-12
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
    assert "a pipeline of 3 stages" in "\n".join(where_time_goes(p))
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
    (traces / "rank1.json").write_text('{"traceEvents": [')
    assert main(["explain", str(traces / "plan.json"), "-o", str(out), "--trace", str(traces)]) == 2
    assert capsys.readouterr().err.strip() == (f"hap: error: {traces}/rank1.json is not a Chrome trace "
                                               "(JSONDecodeError): a damaged trace")


def test_explain_errors_are_one_line(tmp_path, capsys, vit_plan):
    assert main(["explain", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    path = tmp_path / "plan.json"
    vit_plan.to_json(path)
    assert main(["explain", str(path), "-o", str(tmp_path / "x"), "--trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no trace for rank 0" in err and len(err.splitlines()) == 1
    for timeline in ({}, {"stages": "x"}, []):  # hand-edited, or an older version's list: the plan loads
        edited = {**vit_plan.to_dict(), "timeline": timeline}
        (tmp_path / "edited.json").write_text(json.dumps(edited))
        assert main(["explain", str(tmp_path / "edited.json"), "-o", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hap: error: malformed plan: its timeline cannot be drawn (") and len(err.splitlines()) == 1
