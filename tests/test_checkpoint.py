"""Sharded checkpoints (hap.runtime.checkpoint) on real gloo ranks: a checkpoint written under
one layout (a plan that shards parameters, buffers and so optimizer state unevenly, ratios,
a number of ranks) loads under another and training goes on exactly as on one device; a run
whose rank is killed resumes from its last checkpoint and ends where an uninterrupted run
does; a save that dies midway leaves the previous checkpoint the latest; `hap train
--checkpoint/--resume`; checkpoints of another model are one-line errors.

The model, an MLP with batch norm, has parameters, buffers (running statistics) and, under
the sharded layout, rows of each split [17, 7] (or [12, 7, 5, 0] on four ranks: a rank with
none). fc1 has no bias: batch norm makes its gradient zero in theory, which Adam would turn
from rounding noise into full steps."""

import copy
import dataclasses
import io
import json
import logging
import os
import warnings
import re
import shutil
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from gloo import run_ranks

import hap
from hap.placement import S
from hap.planner import baseline_plan, plan_for_layout
from hap.runtime import checkpoint
from hap.runtime.launch import RankFailed

CLUSTERS = {2: "local-homo", 4: "local-4"}
SHARDED = {"p_fc1_weight": S(0), "p_bn_weight": S(0), "p_bn_bias": S(0), "b_bn_running_mean": S(0),
           "b_bn_running_var": S(0), "p_fc2_weight": S(1)}
"""Megatron-style: fc1's rows, batch norm's channels and fc2's columns split alike."""


class MLP(nn.Module):
    def __init__(self, d=12, h=24, extra=False):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(d, h, bias=False), nn.BatchNorm1d(h), nn.Linear(h, d)
        self.out = nn.Linear(d, d) if extra else None

    def forward(self, x, y):
        z = self.fc2(torch.relu(self.bn(self.fc1(x))))
        return ((self.out(z) if self.out is not None else z) - y).pow(2).mean()


def batch(step):
    """The batch of a step: a function of the step index only, so a resumed run sees the same data."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(10, 12, generator=gen), torch.randn(10, 12, generator=gen)


def optimizer(params, kind):
    return torch.optim.Adam(params, lr=0.01) if kind == "adam" else torch.optim.SGD(params, lr=0.1, momentum=0.9)


def distributed(world, layout, **model_args):
    """The model under `layout`: ("sharded" or "dp", ratios)."""
    torch.manual_seed(0)
    model = MLP(**model_args).train()
    cluster = hap.load_cluster(CLUSTERS[world])
    graph = hap.capture(model, batch(0))
    kind, ratios = layout
    plan = plan_for_layout(graph, cluster, ratios, SHARDED) if kind == "sharded" else \
        baseline_plan(graph, cluster, "dp-cp", ratios=ratios)
    return hap.HAP(model, cluster, batch(0), plan=plan, graph=graph)


def whole(dmodel, opt):
    """The model's and the optimizer's state, whole, by the model's keys (a collective)."""
    optim = {}
    for name, p in dmodel.shards.items():
        optim[dmodel.graph.tensors[name].target] = {
            k: (dmodel.executor.whole(name, v) if v.dim() and v.shape == p.shape else v).tolist()
            for k, v in opt.state[p].items()}
    return {"model": {k: v.tolist() for k, v in dmodel.full_state_dict().items()}, "optim": optim}


def reference(steps, kind):
    """The same training on one device, plain torch."""
    torch.manual_seed(0)
    model = MLP().train()
    opt = optimizer(model.parameters(), kind)
    for step in range(steps):
        model(*batch(step)).backward()
        opt.step()
        opt.zero_grad()
    optim = {name: opt.state[p] for name, p in model.named_parameters()}
    return model.state_dict(), optim


def assert_like_reference(got, steps, kind):
    """Parameters, buffers and optimizer state as one device's after `steps`; the random
    generator as rank 0's was at the checkpoint (seeded 0, see train)."""
    torch.manual_seed(0)
    assert got["drawn"] == torch.rand(3).tolist()
    assert_state_like_reference(got, steps, kind)


def assert_state_like_reference(got, steps, kind):
    """Parameters, buffers and optimizer state (as `whole` gives them) as one device's after `steps`."""
    model, optim = reference(steps, kind)
    for key, v in model.items():
        assert torch.allclose(torch.tensor(got["model"][key], dtype=v.dtype), v, rtol=1e-4, atol=1e-5), key
    for key, state in optim.items():
        for k, v in state.items():
            assert torch.allclose(torch.tensor(got["optim"][key][k], dtype=v.dtype), v, rtol=1e-4, atol=1e-5), (key, k)


def train(rank, world, layout, kind, directory, steps, resume=False, every=None, die=None, keep=None):
    """Train to `steps` (from the latest checkpoint when resuming; resume="step-..." from that
    one), saving every `every` steps (keeping the last `keep`).
    die: (rank, step, where) -- that rank kills itself after that step, or ("save") inside
    the checkpoint's writer at the save of that step, or ("commit") raises just before the
    rename that makes it the latest."""
    dmodel = distributed(world, layout)
    opt = optimizer(dmodel.parameters(), kind)
    where = os.path.join(directory, resume) if isinstance(resume, str) else directory
    start, extra = checkpoint.load(dmodel, opt, where) if resume else (0, None)
    drawn = torch.rand(3).tolist()  # after a load: what rank 0's generator drew next at the save
    for step in range(start, steps):
        dmodel(*batch(step)).backward()
        opt.step()
        opt.zero_grad()
        if die is not None and die[:2] == (rank, step + 1):
            _inject(die[2])
        if every and (step + 1) % every == 0:
            torch.manual_seed(rank)  # the ranks' generators differ: a checkpoint keeps rank 0's
            checkpoint.save(dmodel, opt, directory, step + 1, extra={"seen": step + 1}, keep=keep)
    return {"start": start, "extra": extra, "drawn": drawn, **whole(dmodel, opt)}


def _inject(where):
    """A failure where the test wants it (the worker's doing, not the product's)."""
    if where == "step":
        os.kill(os.getpid(), signal.SIGKILL)
    elif where == "full":  # its part of the checkpoint does not fit on the disk
        import torch.distributed.checkpoint as dcp

        def write_data(self, plan, planner):
            raise OSError(28, "No space left on device")

        dcp.FileSystemWriter.write_data = write_data
    elif where == "save":  # killed while writing its part of the checkpoint
        import torch.distributed.checkpoint as dcp

        def write_data(self, plan, planner):
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.FileSystemWriter.write_data = write_data
    else:  # every part written, then an error before the rename
        def commit(*args):
            raise OSError("injected: disk full")

        checkpoint._commit = commit


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint at step 3 of Adam training under the sharded layout at 0.7 / 0.3."""
    directory = tmp_path_factory.mktemp("ckpt")
    run_ranks(train, 2, tmp_path_factory.mktemp("reports"), ("sharded", [0.7, 0.3]), "adam", str(directory), 3, False, 3)
    return directory


@pytest.mark.parametrize("world, layout", [(2, ("sharded", [0.4, 0.6])), (2, ("dp", [0.4, 0.6])),
                                           (4, ("sharded", [0.5, 0.3, 0.2, 0.0]))],
                         ids=["other-ratios", "data-parallel", "four-ranks"])
def test_checkpoint_loads_under_another_layout(saved, tmp_path, world, layout):
    for got in run_ranks(train, world, tmp_path, layout, "adam", str(saved), 5, True):
        assert got["start"] == 3 and got["extra"] == {"seen": 3}
        assert_like_reference(got, 5, "adam")


def load_told(rank, world, path, verified):
    """Load checkpoint `path` under the sharded layout, told it was verified or not."""
    dmodel = distributed(world, ("sharded", [0.6, 0.4]))
    opt = optimizer(dmodel.parameters(), "adam")
    try:
        return checkpoint.load(dmodel, opt, path, verified=verified)[0]
    except ValueError as e:
        return str(e)


def test_a_checkpoint_verified_before_the_ranks_start_is_not_hashed_again(saved, tmp_path):
    """hap train hashes the checkpoint it resumes before starting the ranks, which hashed it all
    again as they loaded it. A wrong checksum on intact data tells whether a load hashed."""
    import shutil

    path = tmp_path / "step"
    shutil.copytree(os.path.join(saved, open(os.path.join(saved, "latest")).read().strip()), path)
    sums = json.loads((path / checkpoint.CHECKSUMS).read_text())
    data = sorted(k for k in sums if k.endswith(".distcp"))[0]
    sums[data] = "0" * 64
    (path / checkpoint.CHECKSUMS).write_text(json.dumps(sums))
    assert run_ranks(load_told, 2, tmp_path, str(path), True) == [3, 3]
    damaged = f"checkpoint {path} is damaged: {data} does not match its checksum"
    assert run_ranks(load_told, 2, tmp_path, str(path), False) == [damaged] * 2


def test_a_checkpoint_whose_checksums_are_gone_is_refused(saved, tmp_path):
    """Deleting checksums.json made a flipped byte load unchecked, as from a checkpoint older than
    checksums; a save now marks that it wrote them. A checkpoint without the mark still passes."""
    import shutil

    path = tmp_path / "step"
    shutil.copytree(os.path.join(saved, open(os.path.join(saved, "latest")).read().strip()), path)
    (path / checkpoint.CHECKSUMS).unlink()
    with pytest.raises(ValueError, match=rf"^checkpoint {path} is damaged: its checksums.json is missing$"):
        checkpoint.verify(str(path))
    older = tmp_path / "older"
    dcp.save({"step": 2, "model/w": torch.ones(4)}, storage_writer=dcp.FileSystemWriter(str(older)), no_dist=True)
    checkpoint.verify(str(older))


def test_killed_run_resumes_like_an_uninterrupted_one(tmp_path):
    directory = str(tmp_path / "ckpt")
    with pytest.raises(RankFailed, match="rank 1 died from signal SIGKILL"):
        run_ranks(train, 2, tmp_path, ("sharded", [0.7, 0.3]), "sgd", directory, 8, False, 2, (1, 5, "step"))
    assert checkpoint.latest(directory) == (os.path.join(directory, "step-00000004"), 4)
    for got in run_ranks(train, 2, tmp_path, ("dp", [0.4, 0.6]), "sgd", directory, 8, True, 2, None, 2):
        assert got["start"] == 4
        assert_like_reference(got, 8, "sgd")  # momentum buffers included
    assert sorted(os.listdir(directory)) == [".commits", "latest", "step-00000006", "step-00000008"]  # the last two kept


def test_keep_after_a_resume_from_an_earlier_step_keeps_the_checkpoint_resumed_from(tmp_path):
    """Steps 2 and 4 saved; a run resumed from step 2 saves step 3 with keep=2: it kept the
    replaced run's step 4 and removed step 2, the one it resumed from (a helper's review)."""
    directory = str(tmp_path / "ckpt")
    run_ranks(train, 2, tmp_path, ("dp", [0.6, 0.4]), "sgd", directory, 4, False, 2)
    for got in run_ranks(train, 2, tmp_path, ("dp", [0.6, 0.4]), "sgd", directory, 3, "step-00000002", 1, None, 2):
        assert got["start"] == 2
        assert_like_reference(got, 3, "sgd")
    assert sorted(os.listdir(directory)) == [".commits", "latest", "step-00000002", "step-00000003"]


def test_a_save_that_dies_leaves_the_previous_checkpoint(tmp_path):
    directory, empty_first = str(tmp_path / "ckpt"), ("sharded", [0.0, 1.0])  # rank 0 holds no rows: no shards
    with pytest.raises(RankFailed, match="rank 1 died from signal SIGKILL"):  # killed while writing step 4
        run_ranks(train, 2, tmp_path, empty_first, "sgd", directory, 4, False, 2, (1, 4, "save"))
    assert sorted(os.listdir(directory)) == [".commits", ".tmp-step-00000004", "latest", "step-00000002"]
    with pytest.raises(RankFailed, match="injected: disk full"):  # resumed, written in full, not renamed
        run_ranks(train, 2, tmp_path, empty_first, "sgd", directory, 4, True, 2, (0, 4, "commit"))
    assert os.path.exists(os.path.join(directory, ".tmp-step-00000004", ".metadata"))
    assert checkpoint.latest(directory)[1] == 2
    # a full disk: one line on every rank (it was DCP's 47-line CheckpointException, a BaseException), staging gone
    with pytest.raises(RankFailed, match=r"failed: ValueError: checkpoint save: writing \S+step-00000004 failed "
                                         r"\(OSError: \[Errno 28\] No space left on device\)\n"):
        run_ranks(train, 2, tmp_path, empty_first, "sgd", directory, 4, True, 2, (1, 4, "full"))
    assert sorted(os.listdir(directory)) == [".commits", "latest", "step-00000002"]
    for got in run_ranks(train, 2, tmp_path, ("sharded", [0.7, 0.3]), "sgd", directory, 2, True):
        assert got["start"] == 2
        assert_like_reference(got, 2, "sgd")


def powersgd_training(rank, world, directory, steps, resume=False, save_at=None, resync_at=None, compress=True,
                      forget=False):
    """SGD under data parallelism at uneven shares, both weights synchronized by PowerSGD of
    rank 1 (its error feedback carries most of each gradient; the vectors go whole); the
    parameters after `steps`, and the warnings a resume gave. forget: zero the error feedback
    after the load (as a resume did before checkpoints held it)."""
    shares = {2: [0.6, 0.4], 4: [0.4, 0.3, 0.2, 0.1]}[world]
    dmodel = distributed(world, ("dp", shares))
    if compress:
        dmodel.resync([dataclasses.replace(e, compressor="powersgd", low_rank=1) for e in dmodel.plan.sync])
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = checkpoint.load(dmodel, opt, directory)[0] if resume else 0
    if forget:
        for err, _ in dmodel.grad_sync.compressor_state().values():
            err.zero_()
    for step in range(start, steps):
        if step == resync_at:  # the same strategy again: a new GradSync, which takes the old one's state
            dmodel.resync(list(dmodel.plan.sync))
        dmodel(*batch(step)).backward()
        opt.step()
        opt.zero_grad()
        if step + 1 == save_at:
            checkpoint.save(dmodel, opt, directory, step + 1)
    return {"start": start, "model": {k: v.tolist() for k, v in dmodel.full_state_dict().items()},
            "warned": [str(w.message) for w in caught if "PowerSGD" in str(w.message)]}


def test_powersgd_error_feedback_resumes_on_another_number_of_ranks(tmp_path):
    """PowerSGD's next steps depend on the ranks' error feedback only through its sum (and Q:
    checkpoint._compressor_items), so a run of 2 ranks saved at step 3 and resumed on 4 ends
    where the uninterrupted run does, and the control, resumed with the error feedback at zero
    (as before checkpoints held it), does not. The uninterrupted run resyncs to the same
    strategy at step 3: had that dropped the error feedback, it would end where the control
    does. A resume that does not compress warns that it drops it."""
    directory = str(tmp_path / "ckpt")
    runs = {}
    for name, world, args in [("uninterrupted", 2, (6, False, None, 3)), ("saved", 2, (3, False, 3)), ("resumed", 4, (6, True)),
                              ("forgot", 2, (6, True, None, None, True, True)),
                              ("uncompressed", 2, (3, True, None, None, False))]:
        (tmp_path / name).mkdir()
        runs[name] = run_ranks(powersgd_training, world, tmp_path / name, directory, *args)
    expected = {k: torch.tensor(v) for k, v in runs["uninterrupted"][0]["model"].items()}

    def like_expected(got):
        return all(torch.allclose(torch.tensor(got["model"][k]), v, rtol=1e-4, atol=1e-5) for k, v in expected.items())

    assert runs["resumed"][0]["start"] == 3
    for got in runs["resumed"]:
        assert like_expected(got) and got["warned"] == []
    assert not like_expected(runs["forgot"][0])
    assert runs["uncompressed"][0]["warned"] == [
        f"checkpoint {directory}/step-00000003: PowerSGD's error feedback of 2 part(s) (fc1.weight/whole, ...) is "
        "dropped: this run does not compress them as the saved run did"]
    assert runs["uncompressed"][1]["warned"] == []


class Lookup(nn.Module):
    """An embedding with sparse gradients before a linear head."""

    def __init__(self):
        super().__init__()
        self.table, self.head = nn.Embedding(40, 6, sparse=True), nn.Linear(6, 1)

    def forward(self, ids, y):
        return (self.head(self.table(ids)).squeeze(-1) - y).pow(2).mean()


def lookups(step):
    gen = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, 40, (10,), generator=gen), torch.randn(10, generator=gen)


def sparse_momentum(rank, world, directory, steps, resume):
    """SGD with momentum, whose buffer of the sparse gradient is a sparse tensor: saved at
    step 2 on 2 ranks, resumed on 4."""
    torch.manual_seed(0)
    model, cluster = Lookup(), hap.load_cluster(CLUSTERS[world])
    graph = hap.capture(model, lookups(0))
    plan = baseline_plan(graph, cluster, "dp-cp", ratios=[0.6, 0.4] if world == 2 else None)
    dmodel = hap.HAP(model, cluster, lookups(0), plan=plan, graph=graph)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1, momentum=0.9)
    start = checkpoint.load(dmodel, opt, directory)[0] if resume else 0
    for step in range(start, steps):
        dmodel(*lookups(step)).backward()
        opt.step()
        opt.zero_grad()
    if not resume:
        checkpoint.save(dmodel, opt, directory, steps)
    return {k: v.tolist() for k, v in dmodel.full_state_dict().items()}


def test_sparse_momentum_is_checkpointed(tmp_path):
    """The save raised "unsupported memory format option Contiguous" on the sparse buffer
    (hap train --model ncf-sparse --checkpoint: nothing was saved)."""
    directory = str(tmp_path / "ckpt")
    run_ranks(sparse_momentum, 2, tmp_path, directory, 2, False)
    torch.manual_seed(0)
    model = Lookup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        model(*lookups(step)).backward()
        opt.step()
        opt.zero_grad()
    for got in run_ranks(sparse_momentum, 4, tmp_path, directory, 4, True):
        for key, v in model.state_dict().items():
            assert torch.allclose(torch.tensor(got[key]), v, rtol=1e-5, atol=1e-6), key


def wrong_checkpoints(rank, world, directory):
    dmodel = distributed(2, ("sharded", [0.7, 0.3]))
    opt = optimizer(dmodel.parameters(), "sgd")
    errors = {}
    try:
        checkpoint.load(dmodel, opt, os.path.join(directory, "empty"))
    except ValueError as e:
        errors["empty"] = str(e)
    checkpoint.save(dmodel, opt, directory, 0)  # no optimizer state yet: none is saved
    errors["again"] = checkpoint.save(dmodel, opt, directory, 0)  # the same step: a new name, then the latest
    for name, args in {"wider": {"h": 16}, "deeper": {"extra": True}}.items():
        other = distributed(2, ("dp", [0.5, 0.5]), **args)
        before = {k: v.clone() for k, v in other.full_state_dict().items()}
        try:
            checkpoint.load(other, optimizer(other.parameters(), "sgd"), directory)
        except ValueError as e:
            errors[name] = str(e)
        errors[name + " untouched"] = all(torch.equal(v, before[k]) for k, v in other.full_state_dict().items())
    # each rank its own directory or step (DDP's `if rank == 0` habits gone half way): refused on
    # every rank, before anything is written (rank 0 alone committed its directory, which then
    # lacked rank 1's part; a load gave every rank rank 0's checkpoint)
    for name, call in {"own directory": lambda: checkpoint.save(dmodel, opt, os.path.join(directory, f"r{rank}"), 1),
                       "own step": lambda: checkpoint.save(dmodel, opt, directory, 1 + rank),
                       "own load": lambda: checkpoint.load(dmodel, opt, os.path.join(directory, f"r{rank}"))}.items():
        try:
            call()
        except ValueError as e:
            errors[name] = str(e)
    errors["left"] = sorted(os.listdir(directory))
    # each rank its own extra= (its sampler's state, say): saved, rank 0's kept, and rank 0 says so
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("hap").addHandler(handler)
    elsewhere = os.path.join(directory, "extras")
    checkpoint.save(dmodel, opt, elsewhere, 5, extra={"sampler": rank})
    logging.getLogger("hap").removeHandler(handler)
    errors["own extra"] = [checkpoint.load(dmodel, opt, elsewhere), said]
    return errors


def test_checkpoint_of_another_model_is_an_error(tmp_path):
    directory = str(tmp_path / "ckpt")
    path = os.path.join(directory, "step-00000000.1")
    reports = run_ranks(wrong_checkpoints, 2, tmp_path, directory)
    for got in reports:
        assert got["again"] == path
        assert got["empty"] == f"no checkpoint in {directory}/empty"
        assert got["wider"] == f"'fc1.weight' is (24, 12) in checkpoint {path} but (16, 12) in the model"
        assert got["deeper"] == (f"checkpoint {path} has no 'out.weight', which the model needs "
                                 "(a checkpoint of another model?)")
        assert got["wider untouched"] and got["deeper untouched"]
        mine, other = os.path.abspath(os.path.join(directory, "r0")), os.path.abspath(os.path.join(directory, "r1"))
        assert got["own directory"] == (f"checkpoint save: the ranks were given different directories (rank 0: {mine}, "
                                        f"rank 1: {other}); a checkpoint is one directory on a filesystem every rank shares")
        assert got["own step"] == "checkpoint save: the ranks were given different steps (rank 0: 1, rank 1: 2)"
        assert got["own load"].startswith("checkpoint load: the ranks were given different directories (rank 0: ")
        assert [n for n in got["left"] if n != ".commits"] == ["latest", "step-00000000", "step-00000000.1"]  # nothing new
    for rank, got in enumerate(reports):
        (step, extra), said = got["own extra"]
        assert step == 5 and extra == {"sampler": 0}, rank  # rank 0's, on every rank
        assert said == ([] if rank else [
            "checkpoint save: ranks [1] were given another extra= than rank 0's: the checkpoint keeps rank 0's alone, "
            "which every rank's load returns (gather each rank's state into one extra first)"]), (rank, said)


def test_cli_resumes_where_it_stopped(tmp_path, capfd, monkeypatch):
    from hap.cli import main

    directory = str(tmp_path / "ckpt")

    def losses(*args):
        assert main(["train", "--model", "vit", *args]) == 0
        got = capfd.readouterr()
        out = got.out + got.err  # the ranks' steps, hap's notes
        return out, {int(s): loss for s, loss in re.findall(r"^step\s+(\d+)/\d+\s+loss (\S+)", out, re.M)}

    out, _ = losses("--steps", "4", "--checkpoint", directory, "--checkpoint-every", "2")
    assert f"checkpoint at step 2: {directory}/step-00000002" in out and "checkpoint at step 4" in out
    out, resumed = losses("--steps", "6", "--checkpoint", directory, "--resume", "--cluster", "local-4")  # 2 -> 4 ranks
    assert sorted(resumed) == [5, 6] and "checkpoint at step 6" in out
    assert "training steps 5-6 with" in out  # (it said "training 6 steps")
    _, straight = losses("--steps", "6")
    assert resumed == {5: straight[5], 6: straight[6]}
    for suffix in ("-a", "-b"):  # a given --lr replaces the checkpoint's (it was silently ignored)
        shutil.copytree(directory, directory + suffix)
    out, kept = losses("--steps", "8", "--checkpoint", directory + "-a", "--resume")
    assert "learning rate the checkpoint's" in out
    out, given = losses("--steps", "8", "--checkpoint", directory + "-b", "--resume", "--lr", "5")
    assert "learning rate 5.0 (replacing the checkpoint's)" in out
    assert given[7] == kept[7] and abs(float(given[8]) - float(kept[8])) > 1e-3
    shutil.copytree(directory, directory + "-c")  # a byte changed: refused before any rank starts (it was a rank's traceback)
    data = sorted((tmp_path / "ckpt-c" / "step-00000006").glob("*.distcp"))[0]
    changed = bytearray(data.read_bytes())
    changed[len(changed) // 2] ^= 0xFF
    data.write_bytes(bytes(changed))
    shutil.copytree(directory, directory + "-d")  # its `latest` pointer gone: the checkpoints there named
    os.remove(os.path.join(directory + "-d", "latest"))

    for args, error in [(["--checkpoint", directory + "-c", "--resume", "--steps", "8"],
                         f"--resume: checkpoint {directory}-c/step-00000006 is damaged: {data.name} does not match its "
                         "checksum (checkpoints there: step-00000004, step-00000002; --resume STEP resumes from one)"),
                        (["--checkpoint", directory + "-c", "--resume", "3", "--steps", "8"],
                         f"--resume 3: no such checkpoint in {directory}-c (checkpoints there: step-00000006, "
                         "step-00000004, step-00000002; --resume STEP resumes from one)"),
                        (["--resume"], "--resume needs --checkpoint DIR"),
                        (["--checkpoint", str(tmp_path / "none"), "--resume"], f"--resume: no checkpoint in {tmp_path}/none"),
                        (["--checkpoint", directory + "-d", "--resume", "--steps", "8"],
                         f"--resume: no checkpoint in {directory}-d (checkpoints there: step-00000006, step-00000004, "
                         "step-00000002; --resume STEP resumes from one)"),
                        (["--checkpoint", f"{directory}/step-00000006", "--resume"],  # (it said: no checkpoint in it)
                         f"--resume: {directory}/step-00000006 is a checkpoint itself: give --checkpoint the directory "
                         f"that holds it, {directory}"),
                        (["--checkpoint", directory, "--resume", "--steps", "6"],
                         f"--resume: the latest checkpoint in {directory} is at step 6, so --steps 6 leaves nothing to train"),
                        (["--checkpoint", directory, "--resume", "--steps", "8", "--layers", "1"], "which the model lacks")]:
        assert main(["train", "--model", "vit", *args]) == 2
        err = capfd.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("hap: error: ") and error in err, err
    # a checkpoint of another optimizer, or of none (the Python API's): refused before any rank
    # starts (it was a rank's traceback, after planning, advising load(dmodel, None, ...))
    assert checkpoint.saved_optimizer(f"{directory}/step-00000006") == "SGD"  # (hap train's own)
    for kind, held in (("Adam", "the state of optimizer class Adam"), (None, "no optimizer state")):
        with monkeypatch.context() as m:
            m.setattr(checkpoint, "saved_optimizer", lambda path, kind=kind: kind)
            assert main(["train", "--model", "vit", "--checkpoint", directory, "--resume", "--steps", "8"]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert err[-1] == (f"hap: error: --resume: checkpoint {directory}/step-00000006 holds {held}, and hap train "
                           "trains on with SGD (momentum 0.9) and its state: resume it with the Python API "
                           "(hap.runtime.checkpoint.load, your optimizer)"), err
        assert all(line.startswith(("[hap] building", "[hap] capturing")) for line in err[:-1]), err  # (before planning)
    # the latest damaged: an earlier one named (there was no way but editing DIR/latest)
    out, from_4 = losses("--steps", "6", "--checkpoint", directory + "-c", "--resume", "4")
    assert f"resuming from {directory}-c/step-00000004 (step 4)" in out and from_4 == {5: straight[5], 6: straight[6]}


def test_cli_pipeline_checkpoint_resumes_under_data_parallelism(tmp_path, capfd):
    """hap train with a 2-stage pipeline writes a checkpoint; resumed without a pipeline, the
    next steps' losses are the uninterrupted pipeline run's."""
    from hap.cli import main

    directory = str(tmp_path / "ckpt")
    pipeline = ["--dropout", "0", "--planner", "pp-exact", "--pipeline-stages", "2"]

    def losses(*args):
        assert main(["train", "--model", "vit", *args]) == 0
        got = capfd.readouterr()
        out = got.out + got.err  # the ranks' steps, hap's notes
        return out, {int(s): loss for s, loss in re.findall(r"^step\s+(\d+)/\d+\s+loss (\S+)", out, re.M)}

    out, _ = losses("--steps", "2", "--checkpoint", directory, *pipeline)
    assert f"checkpoint at step 2: {directory}/step-00000002" in out
    _, resumed = losses("--steps", "4", "--checkpoint", directory, "--resume", "--dropout", "0", "--planner", "dp-cp")
    _, straight = losses("--steps", "4", *pipeline)
    assert sorted(resumed) == [3, 4] and resumed == {3: straight[3], 4: straight[4]}  # 4: the momentum came along


def state_dicts(rank, world, directory, first):
    """dmodel.state_dict() / load_state_dict(): whole state dicts in, sharded ones through
    torch.distributed.checkpoint directly (saved under one layout, loaded under another)."""
    torch.manual_seed(7)
    other = MLP().train()
    other(*batch(0))  # running statistics that are not the initial ones
    dmodel = distributed(world, ("sharded", [0.7, 0.3] if first else [0.0, 1.0]))
    out = {}
    if first:
        out["whole"] = dmodel.load_state_dict(other.state_dict())
        out["whole equal"] = all(torch.equal(v, other.state_dict()[k]) for k, v in dmodel.full_state_dict().items())
        dcp.save(dmodel.state_dict(), checkpoint_id=directory, process_group=dmodel.comm.group)
        dmodel(*batch(1)).backward()  # the forward moves the statistics: the save holds the old ones
        shallow = copy.copy(dmodel.state_dict()["fc1.weight"])  # a new wrapper of the same rows
        out["shallow copy"] = [type(shallow).__name__, shallow.local_shards()[0].tensor.data_ptr() ==
                               dmodel.state_dict()["fc1.weight"].local_shards()[0].tensor.data_ptr()]
        for how, sd in {"torch.save": dmodel.state_dict(), "a deep copy": copy.deepcopy(dmodel.state_dict()),
                        "a shallow copy": {"fc1.weight": shallow}}.items():
            try:  # DDP's habit on rank 0: it saved this rank's rows alone, loadable nowhere
                torch.save(sd, io.BytesIO())
            except ValueError as e:
                out.setdefault("pickled", {})[how] = f"rank {rank}: {e}"
    else:
        sd = dmodel.state_dict()
        dcp.load(sd, checkpoint_id=directory, process_group=dmodel.comm.group)
        out["sharded"] = dmodel.load_state_dict(sd)
        out["sharded equal"] = all(torch.equal(v, other.state_dict()[k]) for k, v in dmodel.full_state_dict().items())
    state = other.state_dict()
    for name, bad in {"missing": {k: v for k, v in state.items() if k != "bn.running_var"},
                      "unknown": {**state, "fc3.weight": state["fc2.weight"]},
                      "misshapen": {**state, "fc2.weight": state["fc2.weight"].t()}}.items():
        before = {k: v.clone() for k, v in dmodel.full_state_dict().items()}
        try:
            dmodel.load_state_dict(bad)
        except ValueError as e:
            out[name] = str(e)
        out[name + " untouched"] = all(torch.equal(v, before[k]) for k, v in dmodel.full_state_dict().items())
    out["lenient"] = dmodel.load_state_dict({k: v for k, v in state.items() if k != "bn.running_var"}, strict=False)
    return out


def test_state_dict_whole_and_through_dcp(tmp_path):
    directory = str(tmp_path / "dcp")
    reports = run_ranks(state_dicts, 2, tmp_path, directory, True)
    told = "dmodel.state_dict() is each rank's part, for torch.distributed.checkpoint; save dmodel.full_state_dict() " \
           "(every rank calls it) or use hap.runtime.checkpoint.save"
    for rank, rows in enumerate(["0:17", "17:24"]):  # 24 rows at [0.7, 0.3]
        assert reports[rank].pop("pickled") == {how: f"rank {rank}: cannot pickle this rank's part of 'fc1.weight' of shape "
                                                     f"(24, 12) (it holds rows {rows} of dim 0): {told}"
                                                for how in ("torch.save", "a deep copy", "a shallow copy")}
    saved, = {json.dumps(r, sort_keys=True) for r in reports}
    assert json.loads(saved)["shallow copy"] == ["RankRows", True]
    loaded, = {json.dumps(r, sort_keys=True) for r in run_ranks(state_dicts, 2, tmp_path, directory, False)}
    saved, loaded = json.loads(saved), json.loads(loaded)
    assert saved["whole"] == [[], []] and saved["whole equal"]
    assert loaded["sharded"] == [[], []] and loaded["sharded equal"]  # [0.7, 0.3] -> [0.0, 1.0]
    for got in (saved, loaded):
        assert got["missing"] == "the state dict has no 'bn.running_var', which the model needs"
        assert got["unknown"] == "the state dict holds 'fc3.weight', which the model lacks"
        assert got["misshapen"] == "'fc2.weight' is (24, 12) in the state dict but (12, 24) in the model"
        assert got["missing untouched"] and got["unknown untouched"] and got["misshapen untouched"]
        assert got["lenient"] == [["bn.running_var"], []]


class WithIdleHead(torch.nn.Module):
    """A head the training loss never reads (a pooler, say): the graph has no node for it."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def forward(self, x, y):
        return ((self.fc(x) - y) ** 2).mean()


def idle_head(rank, world):
    torch.manual_seed(0)
    inputs = (torch.randn(10, 8), torch.randn(10, 8))
    dmodel = hap.HAP(WithIdleHead(), hap.load_cluster(CLUSTERS[world]), inputs)
    torch.manual_seed(1)
    pretrained = WithIdleHead().state_dict()
    out = {"keys": dmodel.load_state_dict(pretrained)}
    out["equal"] = {k: torch.equal(v, pretrained[k]) for k, v in dmodel.full_state_dict().items()}
    try:
        dmodel.load_state_dict({**pretrained, "head.weight": torch.zeros(3, 9)})
    except ValueError as e:
        out["misshapen"] = str(e)
    out["untouched"] = torch.equal(dmodel.full_state_dict()["head.weight"], pretrained["head.weight"])
    return out


def test_a_state_dict_loads_what_the_forward_never_reads(tmp_path):
    """The head's loaded values stayed behind (the initial ones came back from full_state_dict,
    and with no key reported missing or unexpected)."""
    for got in run_ranks(idle_head, 2, tmp_path):
        assert got["keys"] == [[], []]
        assert got["equal"] == {k: True for k in ("fc.weight", "fc.bias", "head.weight", "head.bias")}
        assert got["misshapen"] == "'head.weight' is (3, 9) in the state dict but (3, 8) in the model"
        assert got["untouched"]


def idle_head_checkpointed(rank, world, directory, phase):
    """Save: pretrained values loaded, one step, a checkpoint. Load: a model built under a
    seed of each rank's own, the checkpoint loaded into it."""
    torch.manual_seed(0 if phase == "save" else 10 + rank)
    inputs = (torch.randn(10, 8, generator=torch.Generator().manual_seed(2)),
              torch.randn(10, 8, generator=torch.Generator().manual_seed(3)))
    dmodel = hap.HAP(WithIdleHead(), hap.load_cluster(CLUSTERS[world]), inputs)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1)
    out = {"started": dmodel.full_state_dict()["head.weight"].tolist()}  # rank 0's on every rank, as DDP starts
    if phase == "save":
        dmodel.load_state_dict({k: torch.full_like(v, 7.0) for k, v in WithIdleHead().state_dict().items()})
        dmodel(*inputs).backward()
        opt.step()
        checkpoint.save(dmodel, opt, directory, 1)
    else:
        checkpoint.load(dmodel, opt, directory)
    out["state"] = {k: v.tolist() for k, v in dmodel.full_state_dict().items()}
    return out


def test_a_checkpoint_keeps_what_the_forward_never_reads(tmp_path):
    """A head the loss never reads, loaded with pretrained values, was left out of checkpoints:
    a resume had the head of the model as built (nothing said so); and ranks built under other
    seeds each kept their own head."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    saved = run_ranks(idle_head_checkpointed, 2, tmp_path / "a", str(tmp_path / "ck"), "save")
    loaded = run_ranks(idle_head_checkpointed, 4, tmp_path / "b", str(tmp_path / "ck"), "load")
    assert saved[0]["state"]["head.weight"] == [[7.0] * 8] * 3
    assert loaded[1]["started"] == loaded[0]["started"] != loaded[0]["state"]["head.weight"]
    for got in loaded:
        assert got["state"] == saved[0]["state"]


def tied_loaded(rank, world):
    from test_shared_params import TiedLM, inputs
    torch.manual_seed(0)
    dmodel = hap.HAP(TiedLM(tie=True), hap.load_cluster("local"), inputs())
    state = {k: v.clone() for k, v in TiedLM(tie=True).state_dict().items()}
    state["emb.weight"].fill_(1.0), state["head.weight"].fill_(2.0)  # an untied file's two values
    dmodel.load_state_dict(state)
    reference = TiedLM(tie=True)
    reference.load_state_dict(state)
    full = dmodel.full_state_dict()
    return {"hap": [full["emb.weight"][0, 0].item(), full["head.weight"][0, 0].item()],
            "torch": reference.emb.weight[0, 0].item()}


def test_a_tied_parameter_given_two_values_keeps_the_last_as_torch_does(tmp_path):
    for got in run_ranks(tied_loaded, 2, tmp_path):
        assert got["hap"] == [got["torch"]] * 2 == [2.0, 2.0]  # hap kept the first name's (1.0)


class WithScratchBuffer(torch.nn.Module):
    """A buffer registered with persistent=False: state dicts leave it out, as torch's do."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.register_buffer("scale", torch.full((6,), 0.5), persistent=False)

    def forward(self, x):
        return (self.fc(x) * self.scale).pow(2).mean()


def state_dict_round_trips(rank, world, directory):
    torch.manual_seed(0)
    model, x = WithScratchBuffer(), torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    dmodel = hap.HAP(model, hap.load_cluster("local"), (x,))
    keys = sorted(dmodel.state_dict())
    dmodel.load_state_dict(model.state_dict())
    dmodel.load_state_dict(dmodel.state_dict())
    checkpoint.save(dmodel, None, directory, 3)
    step, _ = checkpoint.load(dmodel, None, directory)
    if rank == 0:  # a damaged pointer: rank 0 finds it, every rank is told
        with open(os.path.join(directory, "latest"), "w") as f:
            f.write("hello\n")
    torch.distributed.barrier()
    try:
        checkpoint.load(dmodel, None, directory)
        damaged = None
    except ValueError as e:
        damaged = str(e)
    return {"keys": keys, "model_keys": sorted(model.state_dict()), "step": step, "damaged": damaged}


def test_a_non_persistent_buffer_stays_out_of_state_dicts_and_checkpoints(tmp_path):
    """dmodel.state_dict() held it and load_state_dict asked for it: neither a state dict of the
    model nor one of dmodel's loaded (the two errors contradicted each other). Then a checkpoint
    left it out and its load asked for it: no such model could resume."""
    for got in run_ranks(state_dict_round_trips, 2, tmp_path, str(tmp_path / "ckpt")):
        assert got["keys"] == got["model_keys"] == ["fc.bias", "fc.weight"]
        assert got["step"] == 3
        assert got["damaged"] == f"{tmp_path / 'ckpt'}/latest names 'hello', not a checkpoint: the directory is damaged"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_damaged_checkpoint_directory_is_named_in_one_line(tmp_path):
    """`latest` naming nothing or a step that is gone, a garbled .metadata, a missing or cut
    data file: each a ValueError saying so (they were an assert, a FileNotFoundError, an
    UnpicklingError, and DCP's 80-line CheckpointException)."""
    step = tmp_path / "step-00000002"
    dcp.save({"step": 2, "model/w": torch.ones(64)}, storage_writer=dcp.FileSystemWriter(str(step)), no_dist=True)
    assert checkpoint.latest(str(tmp_path)) is None  # nothing committed yet
    checkpoint.check(str(step), {"w": (64,)})
    for pointer, says in (("hello", "names 'hello', not a checkpoint"), ("", "names '', not a checkpoint"),
                          ("step-00000099", "names step-00000099, which is not there")):
        (tmp_path / "latest").write_text(pointer + "\n")
        with pytest.raises(ValueError, match=f"latest {says}: the directory is damaged$"):
            checkpoint.latest(str(tmp_path))
    # these raised on the rank that read them (rank 0, in load) while the others waited for it
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()
    with pytest.raises(ValueError, match=r"latest does not read \(Is a directory\): the directory is damaged$"):
        checkpoint.latest(str(tmp_path))
    (tmp_path / "latest").rmdir()
    with pytest.raises(ValueError, match=r"metadata is a file, not a directory of checkpoints$"):
        checkpoint.latest(str(step / ".metadata"))
    (tmp_path / "latest").write_text("step-00000002\n")
    assert checkpoint.latest(str(tmp_path)) == (str(step), 2)
    data = next(p for p in step.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"is damaged: {data.name} is cut short$"):
        checkpoint.check(str(step), {"w": (64,)})
    data.unlink()
    with pytest.raises(ValueError, match=f"is damaged: {data.name} is missing$"):
        checkpoint.check(str(step), {"w": (64,)})
    (step / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"is damaged: its .metadata does not load \(UnpicklingError\)$"):
        checkpoint.check(str(step), {"w": (64,)})


class CountsItsPickles:
    """An extra that counts how often it was pickled (a data loader's large state: once a save)."""
    times = 0

    def __init__(self, values):
        self.values = values

    def __getstate__(self):
        CountsItsPickles.times += 1
        return {"values": self.values}


def odd_states(rank, world, directory):
    dmodel = distributed(2, ("sharded", [0.7, 0.3]))
    out = {}
    adam = optimizer(dmodel.parameters(), "adam")
    dmodel(*batch(0)).backward()
    adam.step()
    adam.zero_grad(set_to_none=True)
    checkpoint.save(dmodel, adam, directory + "-counted", 1, extra=CountsItsPickles([0, 1, 2]))
    out["pickles"] = CountsItsPickles.times
    out["counted"] = checkpoint.load(dmodel, adam, directory + "-counted")[1].values
    checkpoint.save(dmodel, adam, directory, 1, extra=torch.arange(3))  # a bare tensor as extra
    out["extra"] = checkpoint.load(dmodel, adam, directory)[1].tolist()
    # a copy with one byte changed; one saved before checksums (unmarked, without them); one whose are gone
    for damage in ("a byte", "no checksums", "checksums gone"):
        copy = f"{directory}-{damage.replace(' ', '-')}"
        marker = checkpoint._CHECKSUMMED
        if damage == "no checksums":  # what a save wrote before it marked its checksums
            checkpoint._CHECKSUMMED = "unmarked"
        checkpoint.save(dmodel, adam, copy, 1)
        checkpoint._CHECKSUMMED = marker
        path = checkpoint.latest(copy)[0]
        if rank == 0:
            if damage == "a byte":
                data = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[-1]
                raw = bytearray(open(os.path.join(path, data), "rb").read())
                raw[-40] ^= 1
                open(os.path.join(path, data), "wb").write(bytes(raw))
            else:
                os.remove(os.path.join(path, checkpoint.CHECKSUMS))
        torch.distributed.barrier()
        try:
            out[damage] = checkpoint.load(dmodel, adam, copy)[0]
        except ValueError as e:
            out[damage] = str(e)
    try:
        checkpoint.save(dmodel, adam, directory, 7, extra=lambda: 0)
    except ValueError as e:
        out["unpicklable"] = str(e)
    try:
        checkpoint.load(dmodel, optimizer(dmodel.parameters(), "sgd"), directory)
    except ValueError as e:
        out["kind"] = str(e)
    ada = torch.optim.Adafactor(dmodel.parameters(), lr=0.01)  # factored moments over fc1's split rows
    dmodel(*batch(1)).backward()
    for what, call in {"step": ada.step, "save": lambda: checkpoint.save(dmodel, ada, directory, 2),
                       "reshard": lambda: dmodel.reshard([0.4, 0.6], [ada, adam])}.items():
        try:
            call()
        except ValueError as e:
            out[what] = str(e)
        ada.zero_grad(set_to_none=True)
    out["ratios"] = [dmodel.plan.ratios, dmodel.executor.ratios]
    out["rows"] = dmodel.shards["p_fc1_weight"].shape[0]
    out["latest"] = checkpoint.latest(directory)[1]
    out["staging"] = sorted(f for f in os.listdir(directory) if f.startswith(".tmp"))
    return out


def test_extra_tensors_optimizer_kinds_and_state_spanning_a_shard(tmp_path):
    """`extra` may be a bare tensor (DCP took it for a tensor of its own and the load failed); an
    Adam checkpoint loaded into SGD is refused (SGD took Adam's state and failed with KeyError at
    its step); Adafactor, whose row and column moments span fc1's rows split 17/7, is refused at
    its first step, by save and by reshard (a save kept one rank's moments as everyone's; its
    losses were not one device's); a changed byte is refused by load (it loaded silently), a
    checkpoint without checksums loads, and an extra that does not pickle is refused on every
    rank (rank 0 alone raised, the others waited)."""
    directory = str(tmp_path / "ckpt")
    for rank, got in enumerate(run_ranks(odd_states, 2, tmp_path, directory)):
        assert got["extra"] == [0, 1, 2]
        assert got["counted"] == [0, 1, 2] and got["pickles"] == 1  # rank 0 pickled it twice, to compare and to save
        assert re.fullmatch(rf"checkpoint {directory}-a-byte/step-00000001 is damaged: __\d_0.distcp does not match "
                            "its checksum", got["a byte"]), got["a byte"]
        assert got["no checksums"] == 1  # (a checkpoint saved before checksums loads)
        assert got["checksums gone"] == f"checkpoint {directory}-checksums-gone/step-00000001 is damaged: its checksums.json is missing"
        assert got["unpicklable"].startswith("checkpoint save: extra does not pickle (")
        assert got["kind"] == (f"checkpoint {directory}/step-00000001 holds the state of optimizer class Adam, not SGD "
                               "(to start SGD afresh, load the model alone: load(dmodel, None, ...))")
        spans = ("optimizer state 'row_var' of fc1.weight is ({rows}, 1), not one value per element of ({rows}, 12): "
                 "an optimizer whose statistics span a parameter (Adafactor's factored moments, say) is not exact "
                 "where hap shards it; use one with per-element state (SGD, Adam, ...) or a plan that keeps "
                 "fc1.weight whole")
        assert got["step"] in (spans.format(rows=17), spans.format(rows=7))
        assert got["save"].startswith("checkpoint save: optimizer state 'row_var' of fc1.weight")
        assert re.match(r"reshard: optimizer state '(row|col)_var' of fc1.weight is ", got["reshard"])
        assert got["ratios"] == [[[0.7, 0.3]], [[0.7, 0.3]]] and got["rows"] == [17, 7][rank]  # nothing moved
        assert got["latest"] == 1 and got["staging"] == []  # nothing saved, nothing left behind


def adafactor_over_a_row(rank, world):
    dmodel = distributed(2, ("sharded", [0.7, 0.3]), h=3)  # fc1's 3 rows split 2/1
    ada = torch.optim.Adafactor(dmodel.parameters(), lr=0.01)
    dmodel(*batch(0)).backward()
    try:
        ada.step()
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"rows": dmodel.shards["p_fc1_weight"].shape[0], "refused": refused,
            "state": list(ada.state[dmodel.shards["p_fc1_weight"]]["col_var"].shape)}


def test_state_spanning_a_one_row_shard_is_refused_on_every_rank(tmp_path):
    """Adafactor's moments of fc1's 3 rows split 2/1: on the rank of one row they are (1, 1) and
    (1, 12), shaped like a scalar and like the shard, so that rank alone took them as per
    element and went on while the other refused (leaving it waiting in the next collective):
    the ranks agree at the optimizer's first step."""
    reports = run_ranks(adafactor_over_a_row, 2, tmp_path)
    assert [got["rows"] for got in reports] == [2, 1]
    assert reports[1]["state"] == [1, 12]  # per element to look at, on the rank of one row
    for got in reports:
        assert got["refused"] == ("optimizer state 'row_var' of fc1.weight is (2, 1), not one value per element of "
                                  "(2, 12): an optimizer whose statistics span a parameter (Adafactor's factored "
                                  "moments, say) is not exact where hap shards it; use one with per-element state "
                                  "(SGD, Adam, ...) or a plan that keeps fc1.weight whole")


def test_keep_orders_checkpoints_by_save_and_checksums_catch_a_changed_byte(tmp_path, monkeypatch):
    """keep= removed the newer checkpoint past step 99,999,999 (names sorted as text), and a
    resumed run's own checkpoints where a later step was saved before the resume; a byte
    changed in a data file loaded silently (DCP checks sizes only)."""
    for step in (99_999_999, 100_000_000, 100_000_001):
        staging = tmp_path / f".tmp-step-{step}"
        staging.mkdir()
        dcp.save({"step": step, "model/w": torch.arange(64.0)}, storage_writer=dcp.FileSystemWriter(str(staging)),
                 no_dist=True)
        sums = {f.name: checkpoint._sha256(str(f)) for f in staging.iterdir()}  # (save: each rank hashes a share)
        checkpoint._commit(str(staging), str(tmp_path), step, 2, sums)
    assert sorted(e.name for e in tmp_path.iterdir()) == [".commits", "latest", "step-100000000", "step-100000001"]
    again = tmp_path / "again"  # one step saved three times, then an earlier step (a run restarted)
    again.mkdir()
    for step in (5, 5, 5, 3):
        staging = again / ".tmp-step"
        staging.mkdir()
        (staging / "x").write_text(str(step))
        checkpoint._commit(str(staging), str(again), step, 2, {})
    # the third save of step 5 replaced the first (names alternated 5, 5.1, 5), and keep then
    # dropped it as the oldest
    assert sorted(e.name for e in again.iterdir()) == [".commits", "latest", "step-00000003", "step-00000005.2"]
    for step in (4, 5):  # the run resumed from step 3 goes on: keep=2 keeps its own newest two, not the
        staging = again / ".tmp-step"  # abandoned run's step 5.2 (it was kept, and step 4 dropped, by step)
        staging.mkdir()
        (staging / "x").write_text(str(step))
        checkpoint._commit(str(staging), str(again), step, 2, {})
    assert sorted(e.name for e in again.iterdir()) == [".commits", "latest", "step-00000004", "step-00000005"]
    copied = tmp_path / "copied"  # a copy (cp -r, a backup restored) gives the files other times: the order holds
    shutil.copytree(again, copied)
    for path in (copied / "step-00000004").rglob("*"):
        os.utime(path, ns=(2**62, 2**62))  # step 4's files now look newer than step 5's
    staging = copied / ".tmp-step"
    staging.mkdir()
    checkpoint._commit(str(staging), str(copied), 6, 2, {})
    assert sorted(e.name for e in copied.iterdir()) == [".commits", "latest", "step-00000005", "step-00000006"]
    # what optimizer a checkpoint holds, read before any rank starts: none; an older hap's, unsaid
    for items, kind in (({"step": 1}, None), ({"step": 1, "optim/param_groups": [{"lr": 0.1}]}, ""),
                        ({"step": 1, "optim/param_groups": [{"lr": 0.1}], "optim/kind": "Adam"}, "Adam")):
        where = tmp_path / f"opt-{kind}"
        dcp.save(items, storage_writer=dcp.FileSystemWriter(str(where)), no_dist=True,
                 planner=dcp.DefaultSavePlanner(flatten_state_dict=False))  # (as save writes them)
        assert checkpoint.saved_optimizer(str(where)) == kind
    # a step saved again: a resume by its step takes the last save (it took step-00000006, the
    # replaced run's); and a stray file where a save stages is no obstacle
    (copied / ".tmp-step-00000006").write_text("stray")
    staging = copied / ".tmp-step"
    staging.mkdir()
    checkpoint._commit(str(staging), str(copied), 6, None, {})
    assert [os.path.basename(p) for p, _ in checkpoint.checkpoints(str(copied))] == [
        "step-00000006.1", "step-00000006", "step-00000005"]
    assert not (copied / ".tmp-step-00000006").exists()
    # the log before the pointer: a crash between the two leaves the new checkpoint logged (the
    # pointer first left it unlogged, and keep= then took it for the oldest and removed it)
    staging.mkdir()
    with monkeypatch.context() as m:
        m.setattr(checkpoint.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("crashed")))
        with pytest.raises(OSError, match="crashed"):
            checkpoint._commit(str(staging), str(copied), 7, None, {})
    assert (copied / ".commits").read_text().splitlines()[-1] == "step-00000007"
    path = str(tmp_path / "step-100000001")
    checkpoint.verify(path)
    data = next(p for p in (tmp_path / "step-100000001").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[-40] ^= 1  # inside the tensor's bytes: same size, DCP would load it
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"^checkpoint {path} is damaged: {data.name} does not match its checksum$"):
        checkpoint.verify(path)
    (tmp_path / "step-100000001" / checkpoint.CHECKSUMS).write_text("{}")  # emptied: it loaded unchecked
    with pytest.raises(ValueError, match=rf"^checkpoint {path} is damaged: its checksums.json does not list \.metadata$"):
        checkpoint.verify(path)


def whose_optimizer_state(rank, world, directory):
    """2 steps at 50/50 (rank 0's shards and rank 1's of a size), each rank's opt.state_dict()
    saved; then loaded back: each rank's own (2 more steps: one device's 4), rank 0's on every
    rank, and one device's (whole tensors)."""
    dmodel = distributed(world, ("sharded", [0.5, 0.5]))
    opt = optimizer(dmodel.parameters(), "sgd")
    one = MLP()
    one_opt = optimizer(one.parameters(), "sgd")
    for step in range(2):
        for m, o in ((dmodel, opt), (one, one_opt)):
            m(*batch(step)).backward()
            o.step()
            o.zero_grad()
    torch.save(opt.state_dict(), os.path.join(directory, f"opt{rank}.pt"))
    torch.distributed.barrier()
    try:  # DDP's habit, torch.save(model.state_dict()): the model hap wrapped is not what trained
        dmodel.model.state_dict()
        stale = None
    except ValueError as e:
        stale = str(e)
    dmodel.model.load_state_dict(dmodel.full_state_dict())  # hap's values loaded into it: saved as they are
    loaded = {k: v.tolist() for k, v in dmodel.model.state_dict().items()}
    refused = {}
    for label, saved in (("rank 0", torch.load(os.path.join(directory, "opt0.pt"))), ("one device", one_opt.state_dict())):
        opt.load_state_dict(saved)
        try:
            opt.step()  # (no gradients: a step would change nothing but it is checked first)
            refused[label] = None
        except ValueError as e:
            refused[label] = str(e)
        if label == "rank 0":  # moved by a reshard as if it were this rank's: refused on every rank
            try:
                dmodel.reshard([0.6, 0.4], [opt])
                refused["reshard"] = None
            except ValueError as e:
                refused["reshard"] = str(e)
    opt.load_state_dict(torch.load(os.path.join(directory, f"opt{rank}.pt")))
    for step in range(2, 4):
        dmodel(*batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return {"refused": refused, "stale": stale, "loaded": loaded, **whole(dmodel, opt)}


def test_an_optimizer_state_dict_of_another_rank_or_one_device_is_refused(tmp_path):
    """DDP's habit: rank 0 saves opt.state_dict() and every rank loads it. Where hap shards
    parameters, each rank's state holds its own rows; at equal shard sizes rank 1 stepped on
    with rank 0's momentum, silently. One device's whole state failed inside torch's step.
    And torch.save(model.state_dict()) of the model hap wrapped saved its untrained values."""
    got = run_ranks(whose_optimizer_state, 2, tmp_path, str(tmp_path))
    assert got[0]["refused"]["rank 0"] is None
    # (one layout: the same digest of the shards' shapes)
    assert re.match(r"SGD's state was saved on rank 0 of 2, 4 sharded parameters of 312 elements \(layout (\w{8})\); "
                    r"this is rank 1 of 2, 4 sharded parameters of 312 elements \(layout \1\): the state of sharded "
                    "parameters is each rank's own rows", got[1]["refused"]["rank 0"])
    for r in got:
        assert re.match(r"model.state_dict\(\) of the model hap wrapped holds its values from before training "
                        r"\(\S+ differs from hap's\): hap trains copies of the parameters", r["stale"])
        for key, want in reference(2, "sgd")[0].items():  # one device's after the 2 steps
            assert torch.allclose(torch.tensor(r["loaded"][key], dtype=want.dtype), want, rtol=1e-4, atol=1e-5), key
        assert r["refused"]["reshard"] == got[1]["refused"]["rank 0"]
        assert re.match(r"SGD's state 'momentum_buffer' of \S+ is \(\d+, \d+\), this rank's shard \(\d+, \d+\): state "
                        "saved by one device", r["refused"]["one device"])
    assert_state_like_reference(got[0], 4, "sgd")  # each rank's own state round trips
