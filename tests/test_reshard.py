"""dmodel.reshard(ratios, optimizers) between steps, on real gloo ranks: parameters, buffers
and every optimizer's per-parameter state move to the new shard sizes exactly, so 2 steps at
ratios A, a reshard to B and 2 more steps equal 4 steps on one device; bad calls are one-line
errors. The model and layouts are test_checkpoint's (an MLP with batch norm, Megatron-style
sharding or data parallelism)."""

import pytest
from gloo import run_ranks
from test_checkpoint import assert_state_like_reference, batch, distributed, optimizer, whole

STEPS = 4


def train_and_reshard(rank, world, layout, new_ratios, kind, validate=False):
    import torch
    dmodel = distributed(world, layout)
    opt = optimizer(dmodel.parameters(), kind)
    out = {}
    loss = None  # held, as a loop that logs it holds it
    for step in range(STEPS):
        if step == STEPS // 2:
            if validate:  # an eval forward between: its loss holds no graph (it used to hide the training loss's)
                dmodel.eval()
                with torch.no_grad():
                    dmodel(*batch(step))
                dmodel.train()
            out["predicted"] = dmodel.executor.reshard_bytes(new_ratios, [opt])  # (what a straggler policy prices)
            out["bytes"] = dmodel.reshard(new_ratios, opt)
            out["ratios"] = dmodel.plan.ratios
            out["fc1 rows"] = dmodel.plan.shard_sizes("p_fc1_weight", 0)
            out["x rows"] = dmodel.input_slices()[0]
            from hap.explain import estimated_events
            out["estimate"] = [dmodel.plan.estimated_iteration_seconds, estimated_events(dmodel.plan)[1]]
        loss = dmodel(*dmodel.local_batch(*batch(step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {**out, **whole(dmodel, opt)}


def test_megatron_layout_reshards_with_adam_state(tmp_path):
    # [0.7, 0.3] splits 24 rows [17, 7]; [0.0, 1.0] gives rank 1 all 24: rank 0 sends 17 rows of
    # fc1.weight (12 floats), fc2.weight's columns (12), bn's weight, bias (1) with Adam's two
    # moments each, and of the two running statistics (1): 17 * 4 B * (3*12 + 3*12 + 3 + 3 + 1 + 1).
    reports = run_ranks(train_and_reshard, 2, tmp_path, ("sharded", [0.7, 0.3]), [0.0, 1.0], "adam", True)
    for got in reports:
        assert got["bytes"] == got["predicted"] == 17 * 4 * 80  # (17 rows change hands, sent by 0 to 1)
        assert got["ratios"] == [[0.0, 1.0]] and got["fc1 rows"] == [0, 24]
        assert got["estimate"][1] == pytest.approx(got["estimate"][0], rel=1e-9)  # the timeline is the new ratios'
        assert_state_like_reference(got, STEPS, "adam")


def test_data_parallel_on_four_ranks_reshards_the_batch(tmp_path):
    reports = run_ranks(train_and_reshard, 4, tmp_path, ("dp", [0.5, 0.3, 0.2, 0.0]), [0.1, 0.2, 0.3, 0.4], "sgd")
    assert [got["x rows"] for got in reports] == [[0, 0, 1], [0, 1, 2], [0, 3, 3], [0, 6, 4]]  # (dim, start, rows) of 10
    for got in reports:
        assert got["bytes"] == 0  # data parallel keeps parameters whole: nothing moves
        assert_state_like_reference(got, STEPS, "sgd")


def test_megatron_layout_on_four_ranks_with_an_idle_rank(tmp_path):
    reports = run_ranks(train_and_reshard, 4, tmp_path, ("sharded", [0.5, 0.3, 0.2, 0.0]), [0.0, 0.25, 0.25, 0.5], "sgd")
    for got in reports:
        assert_state_like_reference(got, STEPS, "sgd")  # momentum included
        assert got["predicted"] == sum(r["bytes"] for r in reports) / 2 > 0  # each byte: sent once, received once


def bad_reshards(rank, world):
    dmodel = distributed(2, ("sharded", [0.7, 0.3]))
    opt = optimizer(dmodel.parameters(), "sgd")
    errors = {}
    for name, ratios in {"ranks": [0.5, 0.3, 0.2], "negative": [1.5, -0.5], "zero": [0.0, 0.0],
                         "segments": [[0.5, 0.5], [0.5, 0.5]]}.items():
        try:
            dmodel.reshard(ratios, opt)
        except ValueError as e:
            errors[name] = str(e)
    # one rank alone refusing, or moving other rows, would leave the other waiting in a resplit
    for name, ratios in {"disagree": [[0.75, 0.25], [0.25, 0.75]], "one-refuses": [[0.5, 0.5], [0.5, 0.3, 0.2]]}.items():
        try:
            dmodel.reshard(ratios[rank], opt)
        except ValueError as e:
            errors[name] = str(e)
    errors["rows"] = dmodel.plan.shard_sizes("p_fc1_weight", 0)  # nothing moved
    dmodel(*batch(0)).backward()
    try:
        dmodel.reshard([0.5, 0.5], opt)
    except ValueError as e:
        errors["grads"] = str(e)
    opt.step()  # momentum now held for fc1's rows
    opt.zero_grad(set_to_none=True)
    try:
        dmodel.reshard([0.5, 0.5])  # the optimizer forgotten: its momentum would stay at the old rows
    except ValueError as e:
        errors["optimizer"] = str(e)
    errors["rows after"] = dmodel.plan.shard_sizes("p_fc1_weight", 0)
    return errors


def test_bad_reshards_are_one_line_errors(tmp_path):
    for got in run_ranks(bad_reshards, 2, tmp_path):
        assert got == {
            "ranks": "reshard: ratios [0.5, 0.3, 0.2] for 3 ranks, this run has 2",
            "negative": "reshard: ratios [1.5, -0.5] must be non-negative with a positive sum",
            "zero": "reshard: ratios [0.0, 0.0] must be non-negative with a positive sum",
            "segments": "reshard: ratios for 2 segments, the plan has 1",
            "disagree": "reshard: ranks [1] were given other ratios than rank 0's [[0.75, 0.25]]",
            "one-refuses": "reshard: ratios [0.5, 0.3, 0.2] for 3 ranks, this run has 2",
            "rows": [17, 7],
            "grads": "reshard between steps: gradients must be cleared first (zero_grad(set_to_none=True))",
            "optimizer": "reshard: SGD keeps state of fc1.weight, whose rows move: pass it, dmodel.reshard(ratios, "
                         "optimizers=[opt]), so that its state moves with them",
            "rows after": [17, 7]}


def held_graph(rank, world):
    """The accumulation idiom keeps loss / 2, whose graph holds the parameters at their old
    shapes: reshard says so (the next backward used to fail inside autograd); released, the
    training goes on."""
    dmodel = distributed(2, ("sharded", [0.7, 0.3]))
    opt = optimizer(dmodel.parameters(), "sgd")
    half = dmodel(*batch(0)) / 2
    half.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    try:
        dmodel.reshard([0.4, 0.6], opt)
        refused = None
    except ValueError as e:
        refused = str(e)
    del half
    dmodel.reshard([0.4, 0.6], opt)
    dmodel(*batch(1)).backward()
    return {"refused": refused, "rows": dmodel.plan.shard_sizes("p_fc1_weight", 0)}


def test_reshard_while_an_old_graph_is_held_says_what_to_do(tmp_path):
    for got in run_ranks(held_graph, 2, tmp_path):
        assert got["refused"].startswith("reshard: a tensor computed from an earlier step's loss (say loss / 2")
        assert got["rows"] == [10, 14]

