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


def test_a_policy_needs_tensor_parallel_linear_layers(capfd):
    assert main([*VIT, "--planner", "dp-ev", "--straggler", "zero-pri", "--steps", "2"]) == 2
    out, err = capfd.readouterr()
    errors = [line for line in err.splitlines() if not line.startswith("[hap] ")]
    assert errors == ["hap: error: straggler policy 'zero-pri': the plan has no tensor-parallel linear layer "
                      "(plan with --planner megatron, or a plan that splits linear weights)"], err
    assert "Traceback" not in err and not any(line.startswith("step ") for line in out.splitlines())


@pytest.mark.parametrize("argv", [["--straggler", "fastest"], ["--migration", "carrier-pigeon"]])
def test_unknown_choices_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*VIT, *argv])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
