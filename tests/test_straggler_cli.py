"""hap train --straggler: a migrating run on emulated stragglers says what it migrated, step by
step and in a summary line; a malformed schedule, or a policy on a plan without tensor-parallel
linear layers, is refused in one line."""

import re

import pytest

from hap.cli import main

VIT = ["train", "--model", "vit", "--scale", "small", "--cluster", "local"]


def test_migrate_on_a_persistent_straggler(capfd):  # capfd: the ranks print, not this process
    assert main([*VIT, "--planner", "megatron", "--straggler", "migrate",
                 "--straggler-schedule", "persistent:chi=4,rank=1", "--steps", "4"]) == 0
    out, err = capfd.readouterr()
    assert "[hap] stragglers: rank 1 persistently 4x slower from iteration 0; mitigated by migrate (exact)" in err
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and any(re.search(r"rank 1 migrated \d+%", line) for line in steps), out
    summary = [line for line in out.splitlines() if line.startswith("straggler migrate: ")]
    assert len(summary) == 1, out
    migrated = int(re.search(r"migration on (\d+)", summary[0]).group(1))
    assert 0 < migrated <= 4 and "pruning on 0 of 4 steps" in summary[0], summary
    assert "per-iteration time: measured" in out


def test_a_malformed_schedule_is_refused_before_any_rank_starts(capsys, monkeypatch):
    import hap.runtime.launch

    def spawn(*args, **kwargs):
        raise AssertionError("ranks were spawned")

    monkeypatch.setattr(hap.runtime.launch, "spawn", spawn)
    assert main([*VIT, "--planner", "megatron", "--straggler", "zero-pri", "--straggler-schedule", "sometimes:chi=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hap: error: --straggler-schedule: ") and "'sometimes'" in err[0], err
    assert main([*VIT, "--straggler-schedule", "persistent:chi=8,rank=2"]) == 2  # local has ranks 0 and 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'persistent:chi=8,rank=2'" in err[0], err


@pytest.mark.parametrize("argv,what", [
    (["--straggler", "zero-pri"], "straggler policy 'zero-pri'"),
    (["--straggler-schedule", "persistent:chi=8,rank=1"],
     "straggler schedule 'persistent' (it slows tensor-parallel linear layers)")])
def test_a_policy_needs_tensor_parallel_linear_layers(argv, what, capsys, monkeypatch):
    """Refused before any rank starts (the ranks refused it, after `training ... on 2 local
    processes` and the mitigation's line had been printed)."""
    import hap.runtime.launch

    def spawn(*args, **kwargs):
        raise AssertionError("ranks were spawned")

    monkeypatch.setattr(hap.runtime.launch, "spawn", spawn)
    assert main([*VIT, "--planner", "dp-ev", *argv, "--steps", "2"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("[hap] ")]
    assert errors == [f"hap: error: {what}: the plan has no tensor-parallel linear layer "
                      "(plan with --planner megatron, or a plan that splits linear weights)"], err
    assert "[hap] training" not in err


def test_the_tensor_parallel_linear_layers_of_a_plan():
    """What the mitigator works on (and the CLI checks for): Megatron's column and row layers,
    none in data parallelism."""
    import hap
    from hap.models import build
    from hap.planner import baseline_plan
    from hap.straggler.mitigator import tp_linear_layers

    model, example = build("vit", scale="small", devices=2)
    graph, cluster = hap.capture(model, example), hap.load_cluster("local")
    layouts = [layout for _, layout in tp_linear_layers(graph, baseline_plan(graph, cluster, "megatron").steps(graph))]
    assert layouts and set(layouts) == {"column", "row"} and layouts.count("column") >= layouts.count("row")
    assert tp_linear_layers(graph, baseline_plan(graph, cluster, "dp-ev").steps(graph)) == []


@pytest.mark.parametrize("argv", [["--straggler", "fastest"], ["--migration", "carrier-pigeon"]])
def test_unknown_choices_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*VIT, *argv])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
