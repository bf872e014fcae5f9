"""Every synchronizer runs on real gloo ranks: uncompressed strategies (all-reduce groups,
parameter servers, hierarchical reduction, parameters split in uneven parts) train exactly like
one device; fp16 and PowerSGD do what their definitions say."""

import dataclasses

import pytest
import torch
import torch.nn as nn
from gloo import rank_device, run_ranks, to_device

import hap
from hap.capture import capture
from hap.cost.cluster import cluster_from_dict
from hap.planner import baseline_plan
from hap.runtime.collectives import Comm
from hap.runtime.gradsync import GradSync, Groups
from hap.sync.strategy import PartSync, SyncStrategy, Variables, VarSync, with_strategy

STEPS = 3
RATIOS = (0.6, 0.25, 0.15)  # uneven data-parallel shares


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 20)
        self.fc2 = nn.Linear(20, 16)
        self.fc3 = nn.Linear(16, 12, bias=False)

    def forward(self, x):
        return (self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x))))) ** 2).mean()


def cluster():
    """Three local ranks on two machines: rank 0 alone, ranks 1 and 2 together."""
    link = {"bandwidth": "10GB/s", "latency": "10us"}
    return cluster_from_dict({
        "name": "two-machines", "local": True,
        "devices": [{"name": "cpu", "count": 3, "flops": 9e10, "memory": "4GiB"}],
        "machines": [{"name": "a", "devices": 1, "intra": link, "nic": link},
                     {"name": "b", "devices": 2, "intra": link, "nic": link}]})


def data():
    torch.manual_seed(0)
    model = MLP()
    gen = torch.Generator().manual_seed(1)
    return model, [torch.randn(20, 12, generator=gen) for _ in range(STEPS)]


AR, PS = "all_reduce", "ps"


def strategies(variables: Variables) -> dict[str, SyncStrategy]:
    """Exact strategies over the MLP's five synchronized parameters, by name."""
    names = [v.param for v in variables.vars]  # backprop order: fc3.weight first
    big = next(v.param for v in variables.vars if v.target == "fc1.weight")  # [20, 12]: 20 rows

    def each(fn):
        return SyncStrategy(tuple(VarSync(n, fn(i, n)) for i, n in enumerate(names)))

    return {
        # two fusion groups against backprop order, fc1.weight in 3 parts in different groups
        "ar-groups": each(lambda i, n: (PartSync(kind=AR, group=0), PartSync(kind=AR, group=1), PartSync(kind=AR, group=0))
                          if n == big else (PartSync(kind=AR, group=(i + 1) % 2),)),
        # a server per parameter, fc1.weight in two parts on servers 1 and 2
        "servers": each(lambda i, n: (PartSync(kind=PS, server=1), PartSync(kind=PS, server=2)) if n == big
                        else (PartSync(kind=PS, server=i % 3),)),
        # hierarchical all-reduce and servers (2: not its machine's first device), mixed with flat ones
        "hierarchical": each(lambda i, n: (PartSync(kind=PS, server=0, hierarchical=True), PartSync(kind=AR, group=0))
                             if n == big else (PartSync(kind=AR, group=1, hierarchical=True),) if i % 2
                             else (PartSync(kind=PS, server=2, hierarchical=True),)),
    }


def train(model, batches, lr=0.1):
    """SGD with momentum (it takes sparse gradients too); a batch is a tensor or a tuple of them."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x in batches:
        loss = model(*x) if isinstance(x, tuple) else model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_with(rank, world, name, device="cpu"):
    dev = rank_device(rank, device)
    model, batches = data()
    model, batches = model.to(dev), [to_device(b, dev) for b in batches]
    cl = cluster()
    graph = capture(model, (batches[0],))
    plan = baseline_plan(graph, cl, "dp-ev", ratios=RATIOS)
    variables = Variables.of(plan, graph, [m.devices for m in cl.topology.machines])
    plan = with_strategy(plan, variables, strategies(variables)[name])
    dmodel = hap.HAP(model, cl, (batches[0],), plan=plan, graph=graph)
    losses = train(dmodel, batches)
    return {"losses": losses, "params": {k: v.tolist() for k, v in dmodel.full_parameters().items()},
            "buckets": len({e.bucket for e in dmodel.plan.sync}), "parts": len(dmodel.plan.sync)}


@pytest.mark.parametrize("name", ["ar-groups", "servers", "hierarchical"])
def test_exact_strategies_train_like_one_device(name, tmp_path):
    reports = run_ranks(train_with, 3, tmp_path, name)
    model, batches = data()
    losses = train(model, batches)
    assert reports[0]["parts"] > 5  # a parameter really was split
    for got in reports:
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        for pname, p in model.named_parameters():
            assert torch.allclose(torch.tensor(got["params"][pname]), p.detach(), rtol=1e-4, atol=1e-6), (name, pname)


NEW_RATIOS = (0.2, 0.3, 0.5)


def searched_plan(graph, cl, ratios, name, searched="autosync"):
    """The data-parallel plan at `ratios` synchronized by strategy `name`, priced as `hap sync`
    prices the plan it saves."""
    from hap.planner import replayed
    from hap.sync.price import with_estimate

    plan = baseline_plan(graph, cl, "dp-ev", ratios=ratios)
    plan = with_strategy(plan, Variables.of(plan, graph, cl.machines), strategies(Variables.of(plan, graph, None))[name])
    cost, est = replayed(graph, cl, plan)
    return with_estimate(plan, graph, cost, est, searched)


def reshard_searched(rank, world):
    """One step of a plan from a sync search, a reshard, a resync, two more steps."""
    from hap.explain import estimated_events

    model, batches = data()
    cl = cluster()
    graph = capture(model, (batches[0],))
    dmodel = hap.HAP(model, cl, (batches[0],), plan=searched_plan(graph, cl, RATIOS, "servers"), graph=graph)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1, momentum=0.9)
    out, losses = {}, []
    for step, x in enumerate(batches):
        if step == 1:
            opt.zero_grad(set_to_none=True)
            dmodel.reshard(NEW_RATIOS, opt)
            out["resharded"] = dmodel.plan.to_dict()
            out["drawn"] = estimated_events(dmodel.plan)[1]
            dmodel.resync(searched_plan(graph, cl, NEW_RATIOS, "ar-groups").sync)
            out["resynced"] = dmodel.plan.to_dict()
        loss = dmodel(*dmodel.local_batch(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {**out, "losses": losses, "params": {k: v.tolist() for k, v in dmodel.full_parameters().items()}}


def test_a_searched_strategy_stays_priced_as_searched_through_reshard_and_resync(tmp_path):
    """reshard re-priced a plan from `hap sync` with its program's default all-reduce buckets
    (and kept the old ratios' memory): now its estimate, timeline and memory are those of the
    same strategy planned at the new ratios; resync prices the entries it switches to. The
    training stays exact throughout."""
    reports = run_ranks(reshard_searched, 3, tmp_path)
    model, batches = data()
    graph = capture(model, (batches[0],))
    cl = cluster()
    want = searched_plan(graph, cl, NEW_RATIOS, "servers")
    before = searched_plan(graph, cl, RATIOS, "servers")
    switched = searched_plan(graph, cl, NEW_RATIOS, "ar-groups", searched="resync")
    assert want.estimated_iteration_seconds != before.estimated_iteration_seconds
    assert want.estimated_iteration_seconds != switched.estimated_iteration_seconds
    losses = train(model, batches)
    for got in reports:
        plan = hap.Plan.from_dict(got["resharded"])
        assert plan.search["sync"] == "autosync" and plan.timeline["buckets"] == []
        assert plan.estimated_iteration_seconds == pytest.approx(want.estimated_iteration_seconds, rel=1e-12)
        assert got["drawn"] == pytest.approx(want.estimated_iteration_seconds, rel=1e-9)
        assert plan.breakdown == pytest.approx(want.breakdown, rel=1e-12)
        assert plan.memory_bytes == pytest.approx(want.memory_bytes) and plan.memory_bytes != before.memory_bytes
        again = hap.Plan.from_dict(got["resynced"])
        assert again.search["sync"] == "resync"
        assert again.estimated_iteration_seconds == pytest.approx(switched.estimated_iteration_seconds, rel=1e-12)
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        for pname, p in model.named_parameters():
            assert torch.allclose(torch.tensor(got["params"][pname]), p.detach(), rtol=1e-4, atol=1e-6), pname


def sampled(rank, world, seeds):
    """Strategies drawn by the sampler (parts, servers, groups, hierarchy mixed at random),
    switched between on one model (HAP.resync), each training from the same start."""
    import random

    from hap.sync.sampler import SpaceConfig, sample

    model, batches = data()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cl = cluster()
    graph = capture(model, (batches[0],))
    plan = baseline_plan(graph, cl, "dp-ev", ratios=RATIOS)
    variables = Variables.of(plan, graph, [m.devices for m in cl.topology.machines])
    dmodel = hap.HAP(model, cl, (batches[0],), plan=plan, graph=graph)
    out = {}
    for seed in seeds:
        strategy = sample(variables, [1.0, 2.0, 2.0], random.Random(seed), SpaceConfig(part_bytes=64, max_parts=3))
        dmodel.resync(variables.entries(strategy))
        dmodel.load_state_dict(start)
        out[seed] = {"losses": train(dmodel, batches), "strategy": str(strategy),
                     "params": {k: v.tolist() for k, v in dmodel.full_parameters().items()}}
    try:  # every rank names another strategy: refused at once, not left to time out in the collectives
        dmodel.resync(variables.entries(sample(variables, [1.0, 2.0, 2.0], random.Random(100 + rank),
                                               SpaceConfig(part_bytes=64, max_parts=3))))
        out["disagree"] = None
    except ValueError as e:
        out["disagree"] = str(e)
    try:  # refused while being made: the strategy before it goes on synchronizing (none did)
        dmodel.resync([dataclasses.replace(e, devices=(0, 1), server=None if e.server is None else 0)
                       for e in variables.entries(strategy)])
    except ValueError as e:
        out["refused"] = str(e)
    dmodel.load_state_dict(start)
    out["after refused"] = {"losses": train(dmodel, batches),
                            "params": {k: v.tolist() for k, v in dmodel.full_parameters().items()}}
    return out


def test_sampled_strategies_train_like_one_device(tmp_path):
    seeds = list(range(6))
    reports = run_ranks(sampled, 3, tmp_path, seeds)
    model, batches = data()
    losses = train(model, batches)
    kinds = set()
    for got in reports:
        assert "resync: ranks [1, 2] were given sync entries other than rank 0's" == got["disagree"]
        assert got["refused"].endswith("over devices [0, 1], not over those that hold it, [0, 1, 2]"), got["refused"]
        for seed in [*map(str, seeds), "after refused"]:
            kinds |= {k for k in ("PS(", "AR(", ",h", " | ") if k in got[seed].get("strategy", "")}
            assert got[seed]["losses"] == pytest.approx(losses, rel=1e-5), got[seed]["strategy"]
            for pname, p in model.named_parameters():
                assert torch.allclose(torch.tensor(got[seed]["params"][pname]), p.detach(), rtol=1e-4, atol=1e-6)
    assert kinds == {"PS(", "AR(", ",h", " | "}  # servers, all-reduces, hierarchy and split parameters all ran


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.t = nn.Linear(12, 4), nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return (self.fc(x) * self.t).pow(2).mean()


def rows_of_a_number(rank, world):
    torch.manual_seed(0)
    x = torch.randn(8, 12)
    model, cl = Scaled(), cluster()
    plan = baseline_plan(capture(model, (x,)), cl, "dp-ev")
    sync = [dataclasses.replace(e, rows=(0, 1)) if e.param == "p_t" else e for e in plan.sync]
    try:
        hap.HAP(model, cl, (x,), plan=dataclasses.replace(plan, sync=sync))
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


def test_rows_of_a_number_are_refused_when_wrapped(tmp_path):
    """A sync entry giving rows of a 0-d parameter was taken (as one row), then the backward
    failed inside a hook narrowing a number."""
    for got in run_ranks(rows_of_a_number, 3, tmp_path):
        assert got["refused"] == "the plan syncs rows of p_t, a number: it has none (sync it whole)"


def rank_gradient(rank: int, shape, step: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 * rank + step))


def compressed(rank, world, compressor, low_rank, dtype="float32"):
    """GradSync on one [6, 5] parameter whose gradient on each rank is a known draw: the
    synchronized gradient of each of 3 steps."""
    from hap.plan import SyncEntry

    comm = Comm.default()
    p = nn.Parameter(torch.zeros(6, 5, dtype=getattr(torch, dtype)))
    entry = SyncEntry(param="w", bucket=0, devices=tuple(range(world)), compressor=compressor, low_rank=low_rank)
    world_group = tuple(range(world))
    sync = GradSync([entry], {"w": p}, Groups(comm, tuple((r,) for r in range(world)),
                                              {(world_group, 0): None,
                                               (world_group, 1): torch.distributed.new_group(list(world_group))}))
    out = []
    for step in range(3):
        g = rank_gradient(rank, (6, 5), step).to(p.dtype)
        (sync.alias(p) * g).sum().backward()  # p.grad = g (the program's: through its alias), then synchronized
        out.append(p.grad.float().tolist())
        p.grad = None
    return {"synced": out}


def test_fp16_sums_half_precision_gradients(tmp_path):
    reports = run_ranks(compressed, 2, tmp_path, "fp16", 1)
    for step in range(3):
        exact = sum(rank_gradient(r, (6, 5), step) for r in range(2))
        halves = sum(rank_gradient(r, (6, 5), step).half().float() for r in range(2))
        for got in reports:
            got = torch.tensor(got["synced"][step])
            assert not torch.equal(got, exact)  # it is an approximation
            assert torch.allclose(got, halves, rtol=1e-3, atol=1e-3)  # of the half-precision sum


def powersgd_reference(world: int, r: int, steps: int) -> list[torch.Tensor]:
    """PowerSGD with error feedback, by its definition (gradsync.py), on the ranks' draws."""
    q = torch.randn(5, r, generator=torch.Generator().manual_seed(0))  # bucket 0's seed
    errors = [torch.zeros(6, 5) for _ in range(world)]
    out = []
    for step in range(steps):
        ms = [rank_gradient(k, (6, 5), step) + errors[k] for k in range(world)]
        p_hat = torch.linalg.qr(sum(m @ q for m in ms)).Q
        q_local = [m.T @ p_hat for m in ms]
        q = sum(q_local)
        out.append(p_hat @ q.T)
        errors = [m - p_hat @ ql.T for m, ql in zip(ms, q_local)]
    return out


def test_powersgd_is_its_definition(tmp_path):
    reports = run_ranks(compressed, 2, tmp_path, "powersgd", 2)
    expected = powersgd_reference(2, 2, 3)
    for step in range(3):
        exact = sum(rank_gradient(r, (6, 5), step) for r in range(2))
        for got in reports:
            got = torch.tensor(got["synced"][step])
            assert torch.allclose(got, expected[step], rtol=1e-4, atol=1e-5)
            assert torch.linalg.matrix_rank(got) <= 2 and not torch.allclose(got, exact, atol=1e-2)


def test_powersgd_of_a_bfloat16_parameter_orthonormalizes_in_float32(tmp_path):
    """torch has no QR of bfloat16 (nor float16): the backward of a bfloat16 model under
    PowerSGD raised NotImplementedError. Now its result is the definition's within bfloat16's
    rounding, of rank 2 within it."""
    expected = powersgd_reference(2, 2, 3)
    for got in run_ranks(compressed, 2, tmp_path, "powersgd", 2, "bfloat16"):
        for step in range(3):
            synced = torch.tensor(got["synced"][step])
            assert torch.allclose(synced, expected[step], rtol=0.05, atol=0.05)
            assert torch.linalg.matrix_rank(synced, rtol=0.02) <= 2


# -- sparse gradients ------------------------------------------------------------------------------

class Rec(nn.Module):
    """Two embedding tables with sparse gradients (ids repeat within a batch) and a dense scorer:
    one id per row, and a bag of two items per row (nn.EmbeddingBag, its bags split with the batch)."""

    def __init__(self):
        super().__init__()
        self.users = nn.Embedding(50, 6, sparse=True)
        self.items = nn.EmbeddingBag(30, 4, mode="sum", sparse=True)
        self.score = nn.Linear(10, 1)

    def forward(self, users, items, clicked):
        x = torch.cat([self.users(users), self.items(items)], dim=-1)  # [B, 10]
        return nn.functional.binary_cross_entropy_with_logits(self.score(x).squeeze(-1), clicked)


def rec_data():
    torch.manual_seed(0)
    model = Rec()
    gen = torch.Generator().manual_seed(1)
    return model, [(torch.randint(0, 12, (20,), generator=gen), torch.randint(0, 30, (20, 2), generator=gen),
                    torch.randint(0, 2, (20,), generator=gen).float()) for _ in range(STEPS)]


def sparse_train(rank, world, ratios, kinds):
    model, batches = rec_data()
    cl = cluster()
    graph = capture(model, batches[0])
    plan = baseline_plan(graph, cl, "dp-ev", ratios=ratios)
    default = [(e.param, e.sparse, e.bucket) for e in plan.sync]
    variables = Variables.of(plan, graph, [m.devices for m in cl.topology.machines])
    parts = {"users.weight": PartSync(kind=kinds[0], server=2), "items.weight": PartSync(kind=kinds[1], server=0)}
    strategy = SyncStrategy(tuple(VarSync(v.param, (parts.get(v.target, PartSync(kind=AR, hierarchical=True)),))
                                  for v in variables.vars))
    plan = with_strategy(plan, variables, strategy)
    dmodel = hap.HAP(model, cl, batches[0], plan=plan, graph=graph)
    sparse_seen = []  # the users table's gradient as each backward leaves it
    users = next(p for name, p in dmodel.shards.items() if "users" in name)
    users.register_post_accumulate_grad_hook(lambda p: sparse_seen.append(p.grad.is_sparse))
    losses = train(dmodel, batches, lr=0.5)
    return {"losses": losses, "params": {k: v.tolist() for k, v in dmodel.full_parameters().items()},
            "default": default, "sparse_entries": [e.param for e in dmodel.plan.sync if e.sparse],
            "sparse_seen": sparse_seen}


@pytest.mark.parametrize("ratios,kinds", [(RATIOS, (AR, PS)), (RATIOS, (PS, AR)), ((0.7, 0.3, 0.0), (AR, PS))],
                         ids=["gather-server", "server-gather", "idle-rank"])
def test_sparse_gradients_train_like_one_device(ratios, kinds, tmp_path):
    reports = run_ranks(sparse_train, 3, tmp_path, ratios, kinds)
    model, batches = rec_data()
    losses = train(model, batches, lr=0.5)
    for got in reports:
        # hap's own plan gives each table its own bucket, marked sparse; the runtime saw sparse gradients
        assert sorted((p, b) for p, sparse, b in got["default"] if sparse) and all(
            sum(1 for _, _, b2 in got["default"] if b2 == b) == 1 for _, sparse, b in got["default"] if sparse)
        assert len(got["sparse_entries"]) == 2 and got["sparse_seen"] and all(got["sparse_seen"])
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        for pname, p in model.named_parameters():
            assert torch.allclose(torch.tensor(got["params"][pname]), p.detach(), rtol=1e-4, atol=1e-6), pname


def _blocks_worker(rank, world):
    import time

    from hap.sync.trials import _timed_blocks
    calls = [0]

    def step():  # rank 1 is the slow one (10 ms a step); its 3rd step also stalls 0.5 s (a burst)
        calls[0] += 1
        if rank == 1:
            time.sleep(0.01 + (0.5 if calls[0] == 3 else 0.0))

    block = _timed_blocks(step, steps=2, min_seconds=0.6, max_blocks=20)
    return {"block": block, "steps": calls[0]}


def test_trials_take_the_median_block_of_the_slowest_rank(tmp_path):
    """Blocks of 2 steps until 0.6 s: rank 1's 20 ms blocks and one of 520 ms, so about 5 blocks
    whose mean is over 0.1 s; the median is a 20 ms block (rank 0's blocks take no time: the
    slowest rank's count). Every rank stops after as many blocks."""
    reports = run_ranks(_blocks_worker, 2, tmp_path)
    assert reports[0]["steps"] == reports[1]["steps"] >= 8
    assert reports[0]["block"] == reports[1]["block"]
    assert 0.02 <= reports[0]["block"] < 0.1


def test_an_empty_sparse_gradient_is_made_without_torchs_warning():
    """A backward that gives a sparse table no gradient (backward(inputs=...)) printed torch's
    "Sparse invariant checks are implicitly disabled" on every rank. (In a process of its own:
    torch warns once per process, so an earlier test's sparse tensor would hide it.)"""
    import subprocess
    import sys

    code = ("import warnings, torch\nfrom hap.runtime.gradsync import _empty_sparse\n"
            "with warnings.catch_warnings():\n    warnings.simplefilter('error')\n"
            "    g = _empty_sparse(torch.zeros(5, 3))\nprint(tuple(g.shape), g._nnz())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "(5, 3) 0", done.stderr[-500:]


def test_trial_ranks_switch_strategies_without_resyncs_warnings():
    """A --compress search printed resync's "drops PowerSGD's error feedback" at every switch of
    strategy (6 times in 3 trials): the trial ranks switch quietly; warnings after stay on."""
    import logging

    from hap.sync.trials import _quiet_resync

    class Kept(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    hap_log, kept = logging.getLogger("hap"), Kept()
    hap_log.addHandler(kept)
    try:
        with _quiet_resync():
            hap_log.warning("hap: resync drops PowerSGD's error feedback of 1 part(s)")
        hap_log.warning("after")
    finally:
        hap_log.removeHandler(kept)
    assert kept.messages == ["after"]
