"""The command line as a new user meets it: a cluster of GPUs this machine does not have is
refused in one line (or emulated when asked, saying so); progress is a line every tenth of the
steps when stdout is not a terminal; memory is shown in a unit that fits."""

import json
import os
import re

import pytest

import hap
from hap.cli import main
from hap.plan import size_text as _size


def test_train_refuses_gpus_not_on_this_machine(capsys):
    assert main(["train", "--model", "vit", "--cluster", "paper-hetero-8", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hap: error: cluster 'paper-hetero-8' describes 8 GPUs that are not on this machine")


def test_train_prints_a_line_every_tenth_of_the_steps(capfd):  # capfd: the ranks print, not this process
    assert main(["train", "--model", "vit", "--steps", "20", "--planner", "dp-ev"]) == 0
    out = capfd.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == [f"{k}/20" for k in range(2, 21, 2)]
    # hap train's SGD with momentum: its one state tensor per parameter is what the memory counts
    assert "memory per GPU (parameters, gradients, momentum state, activations):" in out and ("KiB" in out or "MiB" in out)


def test_sizes_read_in_a_unit_that_fits():
    assert [_size(b) for b in (512, 3 * 2**10, 5.5 * 2**20, 40 * 2**30)] == ["512 B", "3.0 KiB", "5.5 MiB", "40.0 GiB"]


def test_profiled_local_clusters_stay_local():
    from hap.cost.cluster import cluster_from_dict

    local = hap.load_cluster("local")
    assert local.local and not hap.load_cluster("paper-hetero-8").local
    assert cluster_from_dict(local.to_dict()).local


def test_planners_by_name(capsys):
    from hap.models import build
    from hap.planners import PLANNERS, make_plan, register

    assert list(PLANNERS)[:5] == ["astar", "dp-ev", "dp-cp", "tp", "ep"]
    model, inputs = build("vgg19", scale="small", hidden=64, batch=16)
    graph, cluster = hap.capture(model, inputs), hap.load_cluster("paper-hetero-8")
    plans = {name: make_plan(name, graph, cluster) for name in ("astar", "dp-ev", "dp-cp")}
    assert plans["dp-ev"].ratios == [[0.125] * 8] and plans["dp-cp"].ratios != plans["dp-ev"].ratios
    # the synthesis searches a space that holds both baselines: it is never slower than either
    assert plans["astar"].estimated_iteration_seconds <= min(p.estimated_iteration_seconds for p in plans.values())
    try:
        register("astar")(lambda *a: None)
    except ValueError as e:
        assert str(e) == "a planner named 'astar' is already registered"
    else:
        raise AssertionError("a second 'astar' was registered")

    for args, error in [(["--planner", "greedy"], "unknown planner 'greedy'; choose one of astar, dp-ev, dp-cp, tp, ep"),
                        (["--planner", "ep"], "--planner ep: baseline 'ep' (expert parallelism) needs expert layers, and this "
                                               "model has none")]:
        assert main(["plan", "--model", "vgg19", "--scale", "small", "--quiet", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"hap: error: {error}"), err
    assert main(["plan", "--model", "vgg19", "--scale", "small", "--quiet", "--planner", "dp-cp"]) == 0
    assert "winner: dp-cp" in capsys.readouterr().out


def test_sync_searches_resumes_and_its_plan_trains(tmp_path, capfd):
    """hap sync on a recommendation model with sparse tables, on an emulated two-machine cluster:
    its result and log, a second run that resumes (only the trials beyond the log's run), and
    hap train with the plan it wrote."""
    import json

    from hap.plan import Plan

    cluster = tmp_path / "b9.yaml"
    cluster.write_text(
        "name: tiny-b9\nlocal: true\nemulate: true\nalgorithm: ring\n"
        "devices: [{name: m60, count: 3, flops: 9e10, memory: 4GiB}]\n"
        "machines:\n"
        "  - {name: a, devices: 1, intra: {bandwidth: 200MB/s, latency: 10us}, nic: {bandwidth: 200Mbps, latency: 50us}}\n"
        "  - {name: b, devices: 2, intra: {bandwidth: 200MB/s, latency: 10us}, nic: {bandwidth: 500Mbps, latency: 50us}}\n")
    out = tmp_path / "sync"
    args = ["sync", "--model", "ncf-sparse", "--scale", "small", "--batch", "48", "--cluster", str(cluster),
            "--candidates", "20", "--out", str(out)]
    assert main([*args, "--trials", "5"]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["trials"] == 5 and set(result["baselines"]) == {"hap", "ddp", "tuned-ps", "horovod"}
    # the best trial and the best baseline measured 3 more times each; best: the lower median
    confirmed = result["confirmed"]
    assert len(confirmed["trial"]["seconds"]) == len(confirmed["baseline"]["seconds"]) == 3
    assert confirmed["trial"]["strategy"] == result["best_trial"]["strategy"]
    assert result["best"]["measured_seconds"] == min(confirmed["trial"]["median"], confirmed["baseline"]["median"])
    rows = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "trial" for r in rows) == 5 and all(r["seconds"] > 0 for r in rows)
    assert sum(r["kind"].startswith("confirm:") for r in rows) == 6
    assert main([*args, "--trials", "7"]) == 0  # resumes: the baselines from the log, 2 more trials
    rows2 = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert rows2[:len(rows)] == rows and [r["kind"] for r in rows2[len(rows):len(rows) + 2]] == ["trial", "trial"]
    assert len({json.dumps(r["strategy"]) for r in rows2 if r["kind"] == "trial"}) == 7  # no trial repeated
    plan = Plan.from_json(out / "plan.json")
    assert sum(e.sparse for e in plan.sync) == 4  # the four embedding tables
    said = capfd.readouterr().out  # each baseline's fastest step against the best trial's (it was the confirmed median)
    fastest = result["best_trial"]["measured_seconds"]  # (the first search's, printed first)
    for name, b in result["baselines"].items():
        assert f"{b['measured_seconds'] / fastest:.2f}x the best trial's" in said.split(f"  {name} ")[1].splitlines()[0]
    assert "best:" in said and "confirmed, alternately, median of 3: best trial" in said
    assert main(["train", "--model", "ncf-sparse", "--scale", "small", "--batch", "48", "--cluster", str(cluster),
                 "--plan", str(out / "plan.json"), "--steps", "2"]) == 0
    cap = capfd.readouterr()
    assert f"with the plan in {out / 'plan.json'}" in cap.out + cap.err and "per-iteration time: measured" in cap.out


def _one_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_training_settings_and_output_paths_are_refused_before_any_work(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    small = ["--model", "vit", "--scale", "small", "--cluster", "local"]
    cases = [
        (["train", *small, "--clip", "0"], "--clip must be a positive norm, got 0.0"),  # was ignored
        (["train", *small, "--clip", "-1"], "--clip must be a positive norm, got -1.0"),  # reversed the gradients
        (["train", *small, "--lr", "-0.1"], "--lr must be positive and finite, got -0.1"),
        (["train", *small, "--lr", "inf"], "--lr must be positive and finite, got inf"),  # (NaN from step 2)
        (["plan", *small, "--planner", "pp-exact", "--pipeline-stages", "0"], "--pipeline-stages must be positive, got 0"),
        (["plan", *small, "--micro-batches", "0"], "--micro-batches must be positive, got 0"),
        (["plan", *small, "--layers", "0"], "--layers must be a positive integer, got 0"),  # (the flag unnamed)
        (["plan", *small, "--hidden", "100"], "--hidden must be a multiple of the head width"),
        (["plan", *small, "--micro-batches", "4"], "--micro-batches is for the pipeline planners (pp-exact, dqn, "
                                                   "auto), not astar"),  # was ignored
        (["train", *small, "--planner", "dp-cp", "--schedule", "gpipe"], "--schedule is for the pipeline planners"),
        (["train", *small, "--plan", str(afile), "--pipeline-stages", "2"], "--pipeline-stages is for the pipeline "
                                                                            f"planners (pp-exact, dqn, auto), not the plan in {afile}"),
        (["train", *small, "--trace", str(afile)], f"--trace {afile} is a file; give a directory"),
        (["train", *small, "--checkpoint", str(afile)], f"--checkpoint {afile} is a file; give a directory"),
        (["plan", *small, "--json", str(tmp_path)], f"--json {tmp_path} is a directory; give a file name"),
        (["plan", *small, "--json", f"{tmp_path}/new.json/"], f"--json {tmp_path}/new.json/ ends in /; give a file "
                                                              "name"),  # made it a folder, failed after planning
        (["plan", *small, "--json", "/proc/hap.json"], "--json /proc/hap.json: cannot write it"),
        (["plan", *small, "--json", str(afile / "p.json")], f"--json {afile / 'p.json'}: cannot make the folder {afile}"),
        (["explain", str(afile), "-o", str(afile)], f"-o {afile} is a file; give a directory"),
        (["explain", str(afile), "-o", str(tmp_path / "made")], f"-o {tmp_path / 'made'}: layouts.txt there is a "
                                                               "directory; the command writes a file of that name"),
        # a trace's and a checkpoint's files: after all the training, a traceback and half-written files
        (["train", *small, "--trace", str(tmp_path / "made")], f"--trace {tmp_path / 'made'}: rank1.json there is a "
                                                                "directory; the command writes a file of that name"),
        (["train", *small, "--checkpoint", str(tmp_path / "made")], f"--checkpoint {tmp_path / 'made'}: latest there "
                                                                     "is a directory; the command writes a file of that name"),
        (["train", *small, "--plan", str(afile), "--planner", "dp-ev"], f"--plan trains the plan in {afile} as it is: "
                                                                        "--planner would be ignored"),
        (["plan", *small, "--planner", "dp-ev", "--segments", "3"], "--segments is for the planners astar, auto, "
                                                                    "not dp-ev"),
        (["train", *small, "--migration", "scatter-gather"], "--migration is for --straggler migrate, semi, "
                                                              "rebalance, not none"),
        (["sync", *small, "--out", str(tmp_path / "s"), "--seed", "-1"], "--seed must be a whole number of at least 0"),
        (["profile", "--cluster", "paper-hetero-8", "-o", str(tmp_path / "p.yaml")],
         "cluster 'paper-hetero-8' is not local (local: true): hap profile measures processes on this machine"),
    ]
    (tmp_path / "made" / "layouts.txt").mkdir(parents=True)  # (explain wrote timeline.json, then a traceback)
    (tmp_path / "made" / "rank1.json").mkdir()
    (tmp_path / "made" / "latest").mkdir()
    for argv, says in cases:
        assert _one_error(capsys, argv).startswith(f"hap: error: {says}")
        assert not (tmp_path / "explain").exists() and not (tmp_path / "new.json").exists()


def test_plan_files_are_read_and_written_with_one_line_errors(tmp_path, capsys):
    small = ["--model", "vit", "--scale", "small", "--cluster", "local", "--quiet"]
    named = tmp_path / "{plan}.json"  # (a name beginning with "{" was read as JSON text)
    assert main(["plan", *small, "--json", str(named)]) == 0
    capsys.readouterr()
    assert main(["explain", str(named), "-o", str(tmp_path / "x")]) == 0
    # the path said once (it said "nonexist.json: plan file nonexist.json: cannot read it")
    missing = tmp_path / "nonexist.json"
    assert _one_error(capsys, ["explain", str(missing), "-o", str(tmp_path / "y")]) == (
        f"hap: error: {missing}: cannot read it (No such file or directory)")
    if os.path.exists("/dev/full"):  # a full disk after all the planning: a traceback
        assert _one_error(capsys, ["plan", *small, "--json", "/dev/full"]) == (
            "hap: error: --json /dev/full: cannot write it: No space left on device")
    d = json.loads(named.read_text())
    (tmp_path / "big.json").write_text(json.dumps({**d, "estimated_iteration_seconds": 10**400}))  # (OverflowError)
    assert _one_error(capsys, ["explain", str(tmp_path / "big.json"), "-o", str(tmp_path / "z")]).startswith(
        f"hap: error: {tmp_path / 'big.json'}: malformed plan: its estimate")


def test_a_plan_for_another_model_or_batch_is_refused_before_the_ranks_start(tmp_path, capsys):
    small = ["--scale", "small", "--cluster", "local", "--quiet"]
    assert main(["plan", "--model", "ncf", *small, "--json", str(tmp_path / "ncf.json")]) == 0
    assert main(["plan", "--model", "vit", "--batch", "16", *small, "--json", str(tmp_path / "b16.json")]) == 0
    capsys.readouterr()
    train = ["train", "--model", "vit", "--scale", "small", "--cluster", "local", "--steps", "1", "--plan"]

    def refused(path) -> str:  # progress lines, then the error, and no rank started
        assert main([*train, str(path)]) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert "training" not in err and "Traceback" not in err and not out
        assert lines[-1].startswith("hap: error: ") and all(line.startswith("[hap]") for line in lines[:-1])
        return lines[-1]

    assert refused(tmp_path / "ncf.json").endswith("is a plan of model 'ncf', not of --model vit")
    renamed = json.loads((tmp_path / "ncf.json").read_text())  # (its name edited too: its graph tells)
    (tmp_path / "ncf-renamed.json").write_text(json.dumps({**renamed, "model": "vit"}))
    assert "plan does not match the model: node" in refused(tmp_path / "ncf-renamed.json")
    assert refused(tmp_path / "b16.json").endswith(
        "splits images dim 0 into [16, 0], this model into [8, 0]: a plan made for another model or batch")
    assert main(["plan", "--model", "vit", *small, "--json", str(tmp_path / "vit.json")]) == 0
    edited = json.loads((tmp_path / "vit.json").read_text())
    edited["sync"][0]["param"] = "p_nope"  # hand-edited: the ranks used to fail with tracebacks
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    capsys.readouterr()
    assert refused(tmp_path / "edited.json").endswith("synchronizes ['p_nope'], which are not parameters of this model")
    # hap sync names the file too (it said the plan's error alone)
    assert main(["sync", "--model", "vit", "--scale", "small", "--cluster", "local", "--plan", str(tmp_path / "edited.json"),
                 "--out", str(tmp_path / "searched")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hap: error: --plan {tmp_path / 'edited.json'}: the plan synchronizes ['p_nope'], which are not parameters "
        "of this model")
    reratioed = json.loads((tmp_path / "vit.json").read_text())  # ratios edited, shards kept: it blamed the model
    reratioed["stages"][0]["ratios"] = [[0.6, 0.4]]
    (tmp_path / "reratioed.json").write_text(json.dumps(reratioed))
    capsys.readouterr()
    assert re.search(r"into \[\d+, \d+\], but stage 0's ratios \[0\.6, 0\.4\] split it into \[\d+, \d+\]: its ratios or "
                     r"shards were edited$", refused(tmp_path / "reratioed.json"))
    dropped = json.loads((tmp_path / "vit.json").read_text())  # a parameter's sync entry deleted by hand
    gone = dropped["sync"].pop()["param"]
    (tmp_path / "dropped.json").write_text(json.dumps(dropped))
    capsys.readouterr()
    assert refused(tmp_path / "dropped.json").endswith(f"the plan's sync does not match its program: ['{gone}'] kept "
                                                       "whole but not synced")
    short = json.loads((tmp_path / "vit.json").read_text())  # a plan of a shallower model: its nodes are a prefix
    stage = short["stages"][0]
    stage["program"] = stage["program"][:-5]
    stage["nodes"] = [0, len(stage["program"]) - 1]
    stage["segments"] = [[0, len(stage["program"]) - 1]] if len(stage["segments"]) == 1 else stage["segments"]
    (tmp_path / "short.json").write_text(json.dumps(short))
    capsys.readouterr()
    assert re.search(r"short.json: the plan does not run node \w+ of this model's \d+: a plan made for another model$",
                     refused(tmp_path / "short.json"))


def test_a_plan_file_is_priced_on_the_cluster_it_trains_on(tmp_path, capfd):
    """A plan made for local-homo trained on local (same size, rank 1 three times slower): its
    summary and the measured over estimated ratio spoke of local-homo (2.2 ms, where local
    prices it at 7.5)."""
    small = ["--model", "vit", "--scale", "small"]
    assert main(["plan", *small, "--cluster", "local-homo", "--quiet", "--json", str(tmp_path / "p.json")]) == 0
    capfd.readouterr()
    assert main(["train", *small, "--cluster", "local", "--steps", "1", "--plan", str(tmp_path / "p.json")]) == 0
    out = "".join(capfd.readouterr())
    found = re.search(r"was made for cluster 'local-homo'; priced on 'local': ([\d.]+) ms per iteration "
                      r"\(it said ([\d.]+) ms\)", out)
    assert found and float(found[1]) > 2 * float(found[2])
    assert f"estimated iteration {float(found[1]):.1f} ms" in out
    # and its baselines are local's (they were local-homo's: "hap is 2.65x" over DP-EV where local says 1.35x)
    assert main(["plan", *small, "--cluster", "local", "--quiet", "--json", str(tmp_path / "here.json")]) == 0
    here = json.loads((tmp_path / "here.json").read_text())["baselines"]
    capfd.readouterr()
    shown = dict(re.findall(r"^  (dp_ev|dp_cp|tp) +([\d.]+) ms", out, re.M))
    assert shown.keys() == {"dp_ev", "dp_cp", "tp"}
    assert all(float(shown[k]) == round(here[k]["seconds"] * 1e3, 1) for k in shown), (shown, here)
    # a plan of the same cluster's name for other model knobs (it runs: the same program) is
    # priced again, and so are its baselines (they were the narrower model's)
    wide = [*small, "--hidden", "48"]
    assert main(["plan", *wide, "--cluster", "local", "--quiet", "--json", str(tmp_path / "wide.json")]) == 0
    want = json.loads((tmp_path / "wide.json").read_text())["baselines"]
    capfd.readouterr()
    assert main(["train", *wide, "--cluster", "local", "--steps", "1", "--plan", str(tmp_path / "here.json")]) == 0
    out = "".join(capfd.readouterr())
    assert "priced again" in out
    shown = dict(re.findall(r"^  (dp_ev|dp_cp|tp) +([\d.]+) ms", out, re.M))
    assert shown.keys() == {"dp_ev", "dp_cp", "tp"}
    assert all(float(shown[k]) == round(want[k]["seconds"] * 1e3, 1) for k in shown), (shown, want)


def test_profile_under_torchrun_is_refused(tmp_path, capsys, monkeypatch):
    # each torchrun process started its own local ranks, which hung on torchrun's rendezvous
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")
    assert _one_error(capsys, ["profile", "--cluster", "local", "-o", str(tmp_path / "p.yaml")]) == (
        "hap: error: hap profile starts its own local processes: run it directly, not under torchrun")


def test_an_output_through_a_dangling_link_is_written_through_it(tmp_path):
    # the up-front check created the link's target, then removed the link itself
    (tmp_path / "real").mkdir()
    (tmp_path / "link.json").symlink_to(tmp_path / "real" / "plan.json")
    assert main(["plan", "--model", "vit", "--scale", "small", "--cluster", "local", "--quiet",
                 "--json", str(tmp_path / "link.json")]) == 0
    assert (tmp_path / "link.json").is_symlink() and json.loads((tmp_path / "real" / "plan.json").read_text())["version"] == 2


def test_a_reader_that_goes_away_stops_hap_quietly():
    """`hap plan --listing | head` used to end in a BrokenPipeError traceback."""
    import os
    import subprocess
    import sys
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "hap", "clusters"], stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    os.close(r)  # the reader is gone before hap writes a line
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err, err.decode()


def test_every_model_option_reaches_the_model_in_every_command(monkeypatch):
    """hap sync built its model knobs from its own list, without --dropout: a search at dropout
    0.3 measured the model without it. So did --calibrate (it timed another model than the one
    planned, or refused: "runs other ops at the smaller batch")."""
    import hap.models
    from hap.cli import MODEL_KNOBS, _calibrated, _model_knobs, _parser

    given = ["--layers", "2", "--hidden", "16", "--batch", "8", "--seq", "4", "--experts", "2", "--scale", "small",
             "--dropout", "0.3"]
    for command in (["plan", "--cluster", "local"], ["train", "--cluster", "local"],
                    ["sync", "--cluster", "local", "--out", "o"]):
        args = _parser().parse_args([command[0], "--model", "bert-moe", *command[1:], *given])
        knobs = {"layers": 2, "hidden": 16, "batch": 8, "seq": 4, "experts": 2, "scale": "small", "dropout": 0.3}
        assert _model_knobs(args) == knobs == _model_knobs(vars(args)), command
    assert set(MODEL_KNOBS) == set(knobs)
    built = {}

    def build(name, **kwargs):
        built.update(kwargs)
        raise ValueError("stop here")
    monkeypatch.setattr(hap.models, "build", build)
    try:
        _calibrated(args, None, hap.load_cluster("local"), print)
    except ValueError:
        pass
    assert {k: built.get(k) for k in knobs} == knobs


def test_calibrating_one_device_is_refused_before_any_timing(tmp_path, capsys):
    one = tmp_path / "one.yaml"
    one.write_text("name: one\ndevices: [{name: cpu0, flops: 9e10, memory: 4GiB}]\nlocal: true\n")
    assert main(["train", "--model", "vit", "--scale", "small", "--cluster", str(one), "--steps", "1", "--calibrate"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "hap: error: --calibrate: calibration needs two devices at least; cluster 'one' has 1"


def test_a_repriced_plan_shows_its_two_prices_apart():
    """The "edited since it was planned" warning printed 12.34 ms twice where the prices
    differed below the display's two decimals."""
    from hap.cli import _distinct_ms

    assert _distinct_ms(0.01234, 0.02) == ("12.34", "20.00")
    assert _distinct_ms(0.012341, 0.012342) == ("12.341", "12.342")
    said, again = _distinct_ms(0.0123410001, 0.0123410002)  # beyond six decimals: shown as far as they go
    assert said == again == "12.341000"


def test_sync_refuses_a_pipeline_plan_naming_the_file(tmp_path, capsys):
    """hap sync's own check of a pipeline plan is AutoSync's (check_one_stage), before the model is captured."""
    small = ["--model", "vit", "--scale", "small", "--cluster", "local"]
    path = tmp_path / "piped.json"
    assert main(["plan", *small, "--planner", "pp-exact", "--pipeline-stages", "2", "--quiet", "--json", str(path)]) == 0
    capsys.readouterr()
    assert main(["sync", *small, "--plan", str(path), "--trials", "1", "--out", str(tmp_path / "sync")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hap: error: --plan {path}: synchronization strategies are for plans of one stage; this plan is a pipeline "
        "of 2 stages, which all-reduce every gradient whole")


def test_a_small_models_plan_is_of_the_graph_its_ranks_capture(tmp_path, capsys):
    """hap plan and hap sync captured on the meta device, whose graph of ViT without dropout has
    two views more than the CPU's that the ranks capture: `hap train --plan` refused the plan
    ("node _unsafe_view not in the graph") and every hap sync trial failed."""
    from hap import Plan, capture, load_cluster
    from hap.models import build
    from hap.sync import autosync

    knobs = {"scale": "small", "dropout": 0.0}
    ranks_graph = capture(*build("vit", devices=2, **knobs), name="vit")  # as a rank builds it: on the CPU
    assert main(["plan", "--model", "vit", "--scale", "small", "--dropout", "0", "--cluster", "local", "--quiet",
                 "--json", str(tmp_path / "p.json")]) == 0
    Plan.from_json(tmp_path / "p.json").check_fits(ranks_graph)  # what hap train checks before its ranks start
    graph = autosync._setting("vit", knobs, load_cluster("local"), None)[0]
    assert [n.op for n in graph.nodes] == [n.op for n in ranks_graph.nodes]


def test_a_plan_that_does_not_fit_the_clusters_memory_is_refused_before_the_ranks_start(tmp_path, capsys):
    """hap plan refused the small ViT on 600 KiB devices, but hap train --plan trained a plan
    made for bigger ones there, its summary saying 1.5 MiB a device."""
    small = ["--model", "vit", "--scale", "small"]
    assert main(["plan", *small, "--quiet", "--cluster", "local-homo", "--json", str(tmp_path / "p.json")]) == 0
    spec = hap.load_cluster("local-homo").to_dict()
    tight = tmp_path / "tight.yaml"
    tight.write_text(json.dumps({**spec, "name": "tight", "devices": [{**d, "memory": "600KiB"} for d in spec["devices"]]}))
    capsys.readouterr()
    assert main(["train", *small, "--cluster", str(tight), "--steps", "1", "--plan", str(tmp_path / "p.json")]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]  # (after progress lines; no rank started)
    assert re.match(rf"^hap: error: --plan {tmp_path / 'p.json'}: out of memory: the plan needs .*B on device \d \(cpu\d\), "
                    r"which has 600.0 KiB$", said), said


def test_a_resumed_bert_moe_of_another_expert_count_says_why(monkeypatch):
    """bert-moe's experts default to 2 per device: a checkpoint of a 2-device run met a model of
    8 experts on 4 devices, and the error named the shapes alone."""
    from types import SimpleNamespace

    import hap.runtime.checkpoint as ckpt
    from hap.cli import UserError, _check_checkpoint

    monkeypatch.setattr(ckpt, "verify", lambda path: None)

    def check(path, shapes, optional=None):
        raise ValueError("'blocks.1.ffn.w1' is (4, 32, 128) in checkpoint c/step-2 but (8, 32, 128) in the model")
    monkeypatch.setattr(ckpt, "check", check)
    graph = SimpleNamespace(nodes=[], tensors={})
    with pytest.raises(UserError, match=r"^--resume: 'blocks\.1\.ffn\.w1' is .* in the model \(bert-moe's experts are 2 per "
                                        r"device unless --experts says: 8 on these 4; give --experts as the "
                                        r"checkpoint's run had them\)$"):
        _check_checkpoint("c", graph, SimpleNamespace(model="bert-moe", experts=None), 4)
    with pytest.raises(UserError, match=r"in the model$"):  # --experts given: the shapes say it all
        _check_checkpoint("c", graph, SimpleNamespace(model="bert-moe", experts=8), 4)


def test_a_trace_prints_no_profiler_lines():
    # kineto wrote "USDT: ... profiler_start" and "profiler_stop" to every rank's stderr at each
    # traced run of `hap train --trace`; hap's profiler starts and stops without a line, and records.
    import os
    import subprocess
    import sys

    script = ("import torch\nfrom hap._torch import cpu_profiler\np = cpu_profiler()\nwith p:\n"
              "    torch.ones(3).add(1)\nprint(len(p.events()))\n")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 0
    assert "profiler_start" not in done.stderr and "USDT" not in done.stderr, done.stderr


def test_the_command_starts_without_torch():
    # The `hap` command's entry point imports nothing heavy: hap.cli.main is imported inside its
    # try, so a Ctrl-C while torch loads (about two seconds) ends the command in one line.
    import pathlib
    import subprocess
    import sys

    scripts = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert 'hap = "hap_command:main"' in scripts
    done = subprocess.run([sys.executable, "-c", "import sys, hap_command\nprint('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False"], done.stderr


@pytest.mark.parametrize("after, command", [(0.6, "hap"), (1.5, "hap"), (0.6, "python -m hap")])
def test_ctrl_c_while_the_command_loads_is_one_line(after, command):
    # `hap train` (and `python -m hap train`) interrupted in its first seconds (importing torch
    # and hap) ended in a 40-line KeyboardInterrupt traceback of the import; it now ends as a
    # later Ctrl-C does.
    import signal
    import subprocess
    import sys
    import time

    start = ["-m", "hap"] if command == "python -m hap" else \
        ["-c", "import sys\nfrom hap_command import main\nsys.exit(main())"]
    proc = subprocess.Popen([sys.executable, *start, "train", "--model", "vit", "--cluster", "local", "--steps", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
    time.sleep(after)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    # 130, or under `python -m` killed by SIGINT where the Ctrl-C landed in code exec() runs
    # (hap_command.interrupted: CPython's exit; 2 runs in 40, and a shell shows 130 for both)
    assert proc.returncode == 130 or (command == "python -m hap" and proc.returncode == -signal.SIGINT), (out, err)
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "hap: interrupted", err


def test_a_plan_of_another_model_name_and_a_model_too_large_to_build_are_one_line(tmp_path, capsys):
    """A plan whose "model" was edited trained the --model given and reported the other in its
    summary; a --batch too large for this machine's memory crashed in a 30-line traceback of
    torch's allocator (found by a helper's review)."""
    import json

    from hap.cli import main
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "vit", "--scale", "small", "--layers", "1", "--cluster", "local", "--quiet",
                 "--json", str(path)]) == 0
    capsys.readouterr()
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "model": "bert"}))
    assert main(["train", "--model", "vit", "--scale", "small", "--layers", "1", "--cluster", "local", "--steps", "1",
                 "--plan", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"hap: error: --plan {path} is a plan of model 'bert', not of --model vit", err
    assert main(["plan", "--model", "vit", "--scale", "small", "--layers", "1", "--cluster", "local", "--quiet",
                 "--batch", "100000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hap: error: --model vit at scale small with these sizes does not fit "
                                               "this machine's memory ("), err


def test_progress_prints_a_tenth_of_the_steps_this_run_trains(capsys):
    """A run resumed at step 300 of 310 printed only step 310 (a tenth of all 310 steps)."""
    from hap.cli import _Progress

    progress = _Progress(310, 300)  # (stdout is no terminal here: lines, not a bar)
    for _ in range(10):
        progress.step(1.0, 0.01, None)
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == [f"{k}/310" for k in range(301, 311)]
    progress = _Progress(20)
    for _ in range(20):
        progress.step(1.0, 0.01, None)
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == [f"{k}/20" for k in range(2, 21, 2)]


def test_a_calibrated_plan_priced_again_without_calibration_says_why(tmp_path, capsys):
    """hap train --calibrate --trace T, then --plan T/plan.json: priced without the calibration
    (3.05 ms where the plan said 8.87), it was blamed on edits; --calibrate was refused there."""
    import dataclasses

    from hap import capture, load_cluster, plan
    from hap.cli import _priced_here
    from hap.models import build
    from hap.planner import PlannerConfig

    cluster = load_cluster("local")
    model, inputs = build("vit", devices=2, scale="small")
    graph = capture(model, inputs)
    made = plan(graph, cluster)
    said = []
    for calibrated, why in ((True, "its estimate is of calibrated node times, this price not: add --calibrate"),
                            (None, "planned for other model knobs, batch or input shape")):
        edited = dataclasses.replace(made, estimated_iteration_seconds=made.estimated_iteration_seconds * 3,
                                     search={**made.search, "calibrated": calibrated})
        _priced_here("p.json", edited, graph, cluster, PlannerConfig(), said.append)
        assert f"priced again {made.estimated_iteration_seconds * 1e3:.2f} ms ({why}" in said[-1], said[-1]
    # and --calibrate with --plan is taken (it prices the plan), no longer refused as ignored
    capsys.readouterr()
    assert main(["train", "--model", "vit", "--scale", "small", "--cluster", "local", "--steps", "1", "--plan",
                 str(tmp_path / "none.json"), "--calibrate"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"hap: error: --plan {tmp_path / 'none.json'}: ")


def test_a_cache_path_taken_by_a_file_is_refused_before_calibrating(tmp_path, monkeypatch, capsys):
    # it failed after the whole calibration: "hap: error: .hap-cache: File exists"
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".hap-cache").write_text("")
    assert main(["train", "--model", "vit", "--scale", "small", "--cluster", "local", "--calibrate"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hap: error: --calibrate: .hap-cache is a file here; the node times are cached in a directory of that name")

