"""Fixed seeds of tests/fuzz.py: random models, plans and training loops on gloo ranks equal
one device (see that module; run it for more seeds)."""

import pytest
from gloo import run_ranks

from fuzz import make_case, run_cases

# Chosen to cover each kind of model, plan family and loop habit (tests/fuzz.py prints a seed's case):
# torch's encoder and decoder with the sequence first under Megatron, TP and hap's plan; LSTM and
# GRU; InstanceNorm, GroupNorm and PReLU; a tied head under Megatron and TP; BatchNorm; dropout
# (attention's too, under hap's plan, TP and Megatron); clipping, accumulation, eval passes, a
# shorter last batch and state-dict round trips.
HAP = {2: [0, 1, 3, 5, 6, 11, 23, 27, 28, 33, 54], 3: [9, 12, 18, 21, 26, 59]}
# GPipe and 1F1B, 2 and 3 stages, 1-4 micro-batches, attention's dropout; refused in one line:
# seed 5's BatchNorm with 2 micro-batches, seed 27's GRU with dropout between its layers
PIPELINE = {2: [6, 14, 15, 40, 46], 3: [0, 5, 7, 11, 16, 24, 27, 28, 33]}
REFUSED = {5: "a pipeline runs it exactly with 1 micro-batch only, not 2",
           27: "gru (aten.gru.input) draws random numbers for its dropout between layers, inside the op: a pipeline"}


def _check(reports, seeds, pipeline=False, refused=None):
    refused = refused or {}
    for seed in seeds:
        failures = sorted({f for rep in reports for f in rep[str(seed)]["failures"]})
        assert not failures, f"seed {seed} ({make_case(seed, pipeline).text}): " + "; ".join(failures)
        said = reports[0][str(seed)]["refused"]
        if seed in refused:
            assert said and refused[seed] in said, (seed, said)
        else:
            assert said is None, (seed, said)


@pytest.mark.parametrize("world", sorted(HAP))
def test_random_models_plans_and_loops_train_like_one_device(world, tmp_path):
    assert all(make_case(s).world == world for s in HAP[world])
    _check(run_ranks(run_cases, world, tmp_path, HAP[world], False, False, None), HAP[world])


@pytest.mark.parametrize("world", sorted(PIPELINE))
def test_random_models_in_pipelines_train_like_one_device(world, tmp_path):
    assert all(make_case(s, pipeline=True).world == world for s in PIPELINE[world])
    _check(run_ranks(run_cases, world, tmp_path, PIPELINE[world], True, False, None), PIPELINE[world], True, REFUSED)
