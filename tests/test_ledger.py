"""Ranks that part ways in hap's calls (one rank saving a checkpoint, evaluating, clipping, or
running a step more: DDP's `if rank == 0:` habits) end the run within seconds, both calls
named, instead of waiting out the collective timeout; asymmetry that is no misuse (a call
that talks to no one, one rank pausing long) runs on. The ledger's counting is unit-tested
without a process group."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

from hap.runtime import ledger
from hap.runtime.launch import RankFailed, spawn
from torchrun_ranks import MLP  # (the torchrun tests' model too)

TIMEOUT_S = 60.0  # a parting the ledger missed would end in "timed out" after this, failing the test


# -- the ledger alone ---------------------------------------------------------------------------

@pytest.fixture
def kept():
    yield ledger.keep()
    ledger._LEDGER = None


def test_a_call_is_counted_once_at_its_first_collective_and_only_then(kept):
    with ledger.call("a"):
        pass  # talked to no one: a rank's own business
    with ledger.call("b"):
        ledger.talking()
        ledger.talking()
        with ledger.call("inner"):  # part of b
            ledger.talking()
    ledger.talking()  # outside any call (a backward's gradient sync)
    with ledger.call("c", now=True):
        pass
    with ledger.call("d"):
        ledger.rename("d of another shape")
        ledger.talking()
        ledger.rename("too late")
    ledger.returned()
    assert kept.calls == ((1, "b"), (2, "c"), (3, "d of another shape"), (4, ledger.RETURNED))


def test_another_threads_collectives_count_for_nothing(kept):
    def elsewhere():
        with ledger.call("x"):
            ledger.talking()
    with ledger.call("main"):
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
    assert kept.calls == ()


def test_a_backward_is_marked_on_the_thread_it_runs_on_where_no_call_is_open(kept):
    """A GPU's backward runs on the device's autograd thread: its start counts all the same."""
    def device_thread():
        ledger.mark("bwd")
    for _ in range(2):
        t = threading.Thread(target=device_thread)
        t.start()
        t.join()
        with ledger.call("fwd"):
            ledger.talking()
            device_thread()  # inside a call (a backward within clip_grad_norm_'s): part of it
    assert kept.calls == ((1, "bwd"), (2, "fwd"), (3, "bwd"), (4, "fwd"))


def test_only_the_latest_calls_are_kept(kept):
    for i in range(ledger.KEPT + 5):
        with ledger.call(f"c{i}", now=True):
            pass
    assert len(kept.calls) == ledger.KEPT and kept.calls[-1] == (ledger.KEPT + 5, f"c{ledger.KEPT + 4}")


def test_ranks_part_where_a_number_both_have_names_different_calls():
    mine = [(3, "fwd"), (4, "clip")]
    assert ledger.parted({0: [(3, "fwd"), (4, "clip"), (5, "fwd")], 1: mine}) is None  # rank 0 one call ahead
    assert ledger.parted({0: [(1, "wrap"), (2, "fwd")], 1: mine}) is None  # nothing in common
    said = ledger.parted({0: [(3, "fwd")], 1: mine, 2: [(4, "fwd")]})
    assert said.startswith("ranks 1 and 2 parted: rank 1's 4th call to all ranks is clip, rank 2's fwd: ")
    said = ledger.parted({0: [(12, "fwd")], 1: [(12, "save")]})
    assert said.startswith("ranks 0 and 1 parted: rank 0's 12th call to all ranks is fwd, rank 1's save: ")


def test_calls_that_raised_on_every_rank_are_alike_and_one_that_raised_on_one_rank_is_named():
    failed = ledger.failed_entry(IndexError("Target 7 is out of bounds.\nmore"))
    assert failed == f"{ledger.FAILED}: IndexError (Target 7 is out of bounds.)"
    other = ledger.failed_entry(ValueError("another message"))
    # a refusal on every rank (their messages may differ): no parting, whatever raised
    assert ledger.parted({0: [(3, "fwd"), (4, failed)], 1: [(3, "fwd"), (4, other)]}) is None
    assert ledger.parted({0: [(3, "fwd"), (4, failed)], 1: [(3, "fwd"), (4, "fwd")]}).startswith(
        "ranks 0 and 1 parted: rank 0's 4th call to all ranks is an exception out of its call before")
    # rank 0 still in its 3rd call (counted), rank 1's raised there: named once the reads agree
    every = {0: [(3, "fwd")], 1: [(3, "fwd"), (4, failed), (5, ledger.RETURNED)]}
    assert ledger.failed_behind(every, 0, 3) == (
        "rank 1's 3rd call to all ranks, fwd, raised IndexError (Target 7 is out of bounds.) there, while rank 0 "
        "waits in its own: an exception caught inside hap's call on some ranks alone leaves the collectives the "
        "ranks make in step, so the run cannot go on (let the exception end the run, or have every rank raise it)")
    assert ledger.failed_behind(every, 0, 2) is None  # (rank 0 in another call: the parting says it)
    assert ledger.failed_behind({0: [(3, "fwd")], 1: [(3, "fwd"), (4, "fwd")]}, 0, 3) is None  # (ahead: healthy)


def caught(rank, goes_on):
    """A label out of range in rank 1's rows (data parallel at 60/40) raises inside rank 1's
    forward alone; the loop catches it, then returns, or goes on to the next step (skipping bad
    batches): rank 0 waited out the collective timeout, or gloo aborted it (SIGABRT)."""
    dmodel, opt, batch = wrapped("dp-cp")
    step(dmodel, opt, batch)
    x, y = batch
    y = y.clone()
    y[-1] = 7  # of 4 classes
    for _ in range(2 if goes_on else 1):
        try:
            step(dmodel, opt, (x, y))
        except IndexError:
            opt.zero_grad()


@pytest.mark.parametrize("goes_on", [False, True])
def test_an_exception_caught_inside_a_call_on_one_rank_ends_the_run_naming_it(goes_on):
    with pytest.raises(RankFailed) as caught_:
        spawn(caught, 2, args=(goes_on,), timeout_s=TIMEOUT_S)
    headline = str(caught_.value).splitlines()[0]
    # (the wrapping is call 1, the first step's forward 2, its backward 3; rank 1's own check,
    # where it goes on, raises in its next call: spawn names the rank)
    assert re.match(r"(rank 1 failed: RuntimeError: )?rank 1's 4th call to all ranks, a training forward, dmodel\(\.\.\.\), raised IndexError "
                    r"\(Target 7 is out of bounds\.\) (there, while rank 0 waits in its own|on this rank alone, "
                    r"while rank 0 is still in its own): an exception caught inside hap's call", headline), headline


def test_a_rank_in_a_collective_of_its_own_behind_a_peers_call_is_named():
    # rank 1 has made 4 calls and waits in a barrier of its own; rank 0 is in its 5th
    every = {0: [(4, "bwd"), (5, "fwd")], 1: [(3, "fwd"), (4, "bwd")], 2: [(4, "bwd")]}
    said = ledger.waits_outside(every, 1, "barrier")
    assert said.startswith("ranks 0 and 1 parted: rank 0's 5th call to all ranks is fwd, while rank 1 waits in "
                           "torch.distributed's barrier(...) outside hap's calls: ")
    assert ledger.waits_outside(every, 0, "all_reduce") is None  # no peer ahead of rank 0: its own, on every rank
    assert ledger.waits_outside({0: [], 1: [(1, "wrap")]}, 0, "barrier").startswith(
        "ranks 1 and 0 parted: rank 1's 1st call to all ranks is wrap, ")  # (no call made yet)
    # in a collective over a group of the user's: only the group's ranks ahead count
    assert ledger.waits_outside(every, 1, "barrier", among=(1, 2)) is None  # rank 0, ahead, is not of it
    assert ledger.waits_outside(every, 1, "barrier", among=(0, 1)).startswith(
        "ranks 0 and 1 parted: rank 0's 5th call to all ranks is fwd, while rank 1 waits in torch.distributed's "
        "barrier(...) over ranks [0, 1] outside hap's calls: ")
    said = ledger.aborted_behind(every, 2)
    assert said.startswith("rank 2 was aborted between hap's calls (it had made 4), while rank 0's 5th call to all "
                           "ranks is fwd: ")
    assert ledger.aborted_behind(every, 0) is None
    said = ledger.left_behind(every, 0)
    assert said.startswith("rank 0's 5th call to all ranks, fwd, lost rank 1, which had made 4 and left between hap's "
                           "calls (dist.destroy_process_group() or the end of its process, on some ranks alone): ")
    assert ledger.left_behind(every, 1) is None  # no peer behind rank 1


def _frame_of_a_call():
    return sys._getframe()


def test_a_wait_outside_hap_ends_the_run_only_when_reads_in_a_row_find_the_same_collective_call():
    # A rank read in the last of a series of gathers every rank makes, just after a faster peer
    # began hap's next call, is in a new call of the gather at the next read, or past it (the run
    # on CI that ended a healthy 3-rank test); a lone collective is the same call read after read.
    assert ledger.Suspicion.SAME_READS == 3
    said = "ranks 1 and 0 parted: ..."
    one_call, next_call = _frame_of_a_call(), _frame_of_a_call()
    suspicion = ledger.Suspicion()
    assert suspicion.confirms(one_call, said) is None  # first read: not yet
    assert suspicion.confirms(next_call, said) is None  # another call of the collective: not the same wait
    assert suspicion.confirms(next_call, said) is None
    assert suspicion.confirms(next_call, said) == said  # the same call at three reads: ended
    assert suspicion.confirms(next_call, said) == said
    assert suspicion.confirms(next_call, None) is None  # (no peer ahead: nothing)
    assert suspicion.confirms(next_call, said) is None
    assert suspicion.confirms(next_call, said) is None
    assert suspicion.confirms(None, said) is None  # (out of the collective)
    assert suspicion.confirms(next_call, said) is None
    assert suspicion.confirms(next_call, said) is None
    suspicion.clear()  # a new call of hap's between reads
    assert suspicion.confirms(next_call, said) is None


def test_a_rank_in_a_message_to_one_peer_is_not_in_a_collective():
    """A rank in recv waits for its one peer, which may be behind while another is ahead: no
    parting to name (a barrier or all-reduce there is one). Functions made as if they were
    torch.distributed's (the file name is what the ledger reads), each waiting in a thread."""
    code = ("def recv(tensor=None, src=None, group=None):\n    release.wait()\n"
            "def barrier(group=None):\n    release.wait()\n")
    space = {"release": threading.Event()}
    exec(compile(code, os.path.join("torch", "distributed", "distributed_c10d.py"), "exec"), space)
    threads = {name: threading.Thread(target=space[name]) for name in ("recv", "barrier")}
    for t in threads.values():
        t.start()
    try:
        time.sleep(0.2)
        assert ledger.collective_waited_in(threads["recv"].ident) is None
        frame, among = ledger.collective_waited_in(threads["barrier"].ident)
        assert frame.f_code.co_name == "barrier" and among is None
    finally:
        space["release"].set()
        for t in threads.values():
            t.join()


def lone_collective(rank, which):
    import torch.distributed as dist
    dmodel, opt, batch = wrapped("megatron")
    group = dist.new_group([0, 1]) if which == "group barrier" else None  # (made by every rank)
    step(dmodel, opt, batch)
    if rank == 1 and which == "destroy":
        dist.destroy_process_group()  # (early stopping on one rank)
        time.sleep(3.0)
        return
    if rank == 1:
        dist.barrier(group=group) if which.endswith("barrier") else dist.all_reduce(torch.ones(3))
    step(dmodel, opt, batch)


@pytest.mark.parametrize("which", ["barrier", "group barrier", "all_reduce", "destroy"])
def test_a_collective_of_the_users_own_on_one_rank_ends_the_run_naming_it(which):
    """rank 1 alone makes a collective of its own between two steps: a lone barrier waited out
    the collective timeout (its peer waits in the next step's forward), and one over a group of
    the user's did still; a lone all_reduce meets the forward's collective and gloo aborts rank
    1, which was told as a bare SIGABRT; rank 1 destroying its process group (stopping early)
    left rank 0 with gloo's "Connection reset by peer" alone."""
    with pytest.raises(RankFailed) as caught:
        spawn(lone_collective, 2, args=(which,), timeout_s=TIMEOUT_S)
    headline = str(caught.value).splitlines()[0]
    waits = ("ranks 0 and 1 parted: rank 0's 5th call to all ranks is a training forward, dmodel(...), while rank 1 "
             "waits in torch.distributed's barrier(...) outside hap's calls: ")
    aborted = ("rank 1 was aborted between hap's calls (it had made 4), while rank 0's 5th call to all ranks is a "
               "training forward, dmodel(...): ")
    left = ("rank 0 failed: rank 0's 5th call to all ranks, a training forward, dmodel(...), lost rank 1, which had made "
            "4 and left between hap's calls ")
    grouped = waits.replace("barrier(...) outside", "barrier(...) over ranks [0, 1] outside")
    assert headline.startswith({"barrier": waits, "group barrier": grouped, "all_reduce": aborted, "destroy": left}[which]), \
        headline


def test_each_rank_reads_every_ranks_latest_calls_from_the_shared_file(tmp_path):
    path = str(tmp_path / "ledger")
    ledger.Slots.create(path, 3)
    first, second = ledger.Slots(path), ledger.Slots(path)  # (two ranks' maps of it)
    first.write(2, ((7, "fwd"), (8, "save")))
    second.write(0, ((1, "wrap"),))
    second.write(0, ((1, "wrap"), (2, "fwd")))
    assert ledger.read_all(path) == {0: [(1, "wrap"), (2, "fwd")], 1: [], 2: [(7, "fwd"), (8, "save")]}
    long = tuple((n, "x" * 1000) for n in range(1, 9))  # more than a slot holds: the latest that fit
    first.write(1, long)
    assert second.read(1) == list(long[-4:])
    assert ledger.whereabouts(ledger.read_all(path)) == ("rank 0: its 2nd, fwd; rank 1: its 8th, " + "x" * 1000 +
                                                         "; rank 2: its 8th, save")


@pytest.mark.parametrize("n, said", [(1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (11, "11th"), (12, "12th"),
                                     (13, "13th"), (21, "21st"), (22, "22nd"), (101, "101st"), (111, "111th")])
def test_ordinals(n, said):
    assert ledger._ordinal(n) == said


# -- ranks that part, and ranks that only seem to ------------------------------------------------

def wrapped(planner: str):
    import hap
    from hap.planner import baseline_plan
    torch.manual_seed(0)
    model, cluster = MLP(), hap.load_cluster("local")
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(12, 16, generator=gen), torch.randint(0, 4, (12,), generator=gen))
    plan = None if planner is None else baseline_plan(hap.capture(model, batch), cluster, planner, ratios=[0.6, 0.4])
    dmodel = hap.HAP(model, cluster, batch, plan=plan)  # (None: hap's plan, duplicated computation alone)
    return dmodel, torch.optim.SGD(dmodel.parameters(), lr=0.1), batch


def step(dmodel, opt, batch) -> float:
    loss = dmodel(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def misuse(rank, how, out):
    from hap.runtime import checkpoint
    # sharded: full_state_dict, clipping, evaluation all talk; or duplicated computation alone
    # (no gradient summed, nothing sharded: a clip of its gradients talks all the same)
    dmodel, opt, batch = wrapped(None if how == "clip duplicated" else "megatron")
    step(dmodel, opt, batch)
    if rank == 0 and how == "clip duplicated":
        torch.nn.utils.clip_grad_norm_(dmodel.parameters(), 0.01)
    if rank == 0 and how == "save":
        checkpoint.save(dmodel, opt, out, 1)
    if rank == 0 and how == "evaluate":
        dmodel.eval()
        dmodel(*batch)
        dmodel.train()
    if rank == 0 and how == "clip":
        dmodel.clip_grad_norm_(1.0)
    if how == "backward":
        loss = dmodel(*batch)
        if rank == 0:
            loss.backward()
    if rank == 1 and how == "other shape":
        batch = tuple(x[:10] for x in batch)  # its part of the batch, say, as DistributedSampler's habit gives DDP
    for _ in range(2 if rank == 1 and how == "a step more" else 1):
        step(dmodel, opt, batch)


# The wrapping is call 1, the first step's forward 2, its backward 3, its optimizer's first
# step 4 (it agrees on the sharded parameters' optimizer state), then the misuse.
@pytest.mark.parametrize("how, said", [
    ("save", "rank 0's 5th call to all ranks is checkpoint.save(dmodel, ...), rank 1's a training forward, "
             "dmodel(...): "),
    ("evaluate", "rank 0's 5th call to all ranks is an evaluation forward, dmodel(...) in eval mode, rank 1's a "
                 "training forward, dmodel(...): "),
    ("clip", "rank 0's 5th call to all ranks is clip_grad_norm_ (dmodel's or torch's), rank 1's a training forward, "
             "dmodel(...): "),
    ("clip duplicated", "rank 0's 4th call to all ranks is clip_grad_norm_ (dmodel's or torch's), rank 1's a "
                        "training forward, dmodel(...): "),
    ("backward", "rank 0's 6th call to all ranks is a backward through dmodel's loss, rank 1's a training forward, "
                 "dmodel(...): "),
    ("a step more", "rank 0's 7th call to all ranks is the return from its function, rank 1's a training forward, "
                    "dmodel(...): "),
    ("other shape", "rank 0's 5th call to all ranks is a training forward, dmodel(...), rank 1's a training forward, "
                    "dmodel(...), of inputs not of the planned batch's shapes (a part, or another batch): "),
])
def test_ranks_that_part_end_the_run_naming_both_calls(how, said, tmp_path):
    with pytest.raises(RankFailed) as caught:
        spawn(misuse, 2, args=(how, str(tmp_path / "ckpt")), timeout_s=TIMEOUT_S)
    headline = str(caught.value).splitlines()[0]
    assert headline.startswith("ranks 0 and 1 parted: " + said), headline
    assert "habit, meets no partner)" in headline  # (then, where gloo aborted a rank first, its death)


def pipeline_state_on_rank_0(rank):
    import hap
    from hap.capture import capture
    from hap.cost.cluster import local_cluster
    from hap.pipeline.plan import PipelineSpace, assemble
    from hap.planner import PlannerConfig
    torch.manual_seed(0)
    model, cluster = MLP(), local_cluster((1.0, 1.0), "local")
    batch = (torch.randn(12, 16), torch.randint(0, 4, (12,)))
    graph = capture(model, batch)
    space = PipelineSpace(graph, cluster, PlannerConfig(schedule="1f1b"))
    pipe = hap.Pipeline(model, cluster, batch, assemble(space, [len(graph.nodes) // 2], [[0], [1]], [[1.0], [1.0]], 2,
                                                        0.0, {}))
    pipe.train_step(*batch)
    if rank == 0:
        pipe.full_state_dict()


def test_a_pipelines_state_gathered_on_rank_0_alone_ends_the_run():
    with pytest.raises(RankFailed) as caught:
        spawn(pipeline_state_on_rank_0, 2, timeout_s=TIMEOUT_S)
    headline = str(caught.value).splitlines()[0]
    assert headline.startswith("ranks 0 and 1 parted: rank 0's 3rd call to all ranks is pipe.full_state_dict(), "
                               "rank 1's the return from its function: "), headline


def lone_but_harmless(rank, out):
    """Under data parallelism full_state_dict talks to no one: rank 0 alone may call it, and
    pause (longer than the ledger waits before it reads its peers) while rank 1 waits."""
    dmodel, opt, batch = wrapped("dp-cp")
    losses = [step(dmodel, opt, batch)]
    if rank == 0:
        dmodel.full_state_dict()
        time.sleep(3 * ledger.STILL_S)
    losses.append(step(dmodel, opt, batch))
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"losses": losses, "calls": ledger._LEDGER.calls}, f)


def test_a_call_that_talks_to_no_one_and_a_long_pause_are_no_parting(tmp_path):
    spawn(lone_but_harmless, 2, args=(str(tmp_path),), timeout_s=TIMEOUT_S)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert got[0]["losses"] == got[1]["losses"] and got[0]["losses"][1] < got[0]["losses"][0]
    assert got[0]["calls"] == got[1]["calls"]  # rank 0's full_state_dict not among them
    assert [name for _, name in got[0]["calls"]] == ["hap.HAP(model, ...) (wrapping the model)"] + \
        ["a training forward, dmodel(...)", "a backward through dmodel's loss"] * 2


def late(rank):
    dmodel, opt, batch = wrapped("dp-cp")
    if rank == 0:
        time.sleep(10)
    step(dmodel, opt, batch)


def test_a_timeout_says_where_every_rank_was():
    with pytest.raises(RankFailed) as caught:
        spawn(late, 2, timeout_s=3)
    headline = str(caught.value).splitlines()[0]
    assert headline.startswith("rank 1: collective timed out after 3 s waiting for rank 0"), headline
    assert headline.endswith("; the ranks' last calls to all: rank 0: its 1st, hap.HAP(model, ...) (wrapping the "
                             "model); rank 1: its 2nd, a training forward, dmodel(...)")


# -- ranks torchrun started (a store ledger) -----------------------------------------------------

def torchrun(case: str, out, env: dict | None = None, monitor_s: float = 0.1) -> subprocess.CompletedProcess:
    """tests/torchrun_ranks.py CASE on 2 ranks; a run the ledger left waiting fails the test at
    TIMEOUT_S (the ranks' collective timeout is 10 minutes). monitor_s: how often torchrun looks
    for a failed rank, to end the others (its default 0.1 s)."""
    script = os.path.join(os.path.dirname(__file__), "torchrun_ranks.py")
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--monitor-interval", str(monitor_s), script, case, str(out)]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun ends its ranks (each in a session of its own) on SIGTERM
            proc.communicate(timeout=30)
            raise
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


def test_ranks_torchrun_started_that_part_end_naming_both_calls(tmp_path):
    run = torchrun("save", tmp_path)
    assert run.returncode != 0
    said = "ranks 0 and 1 parted: rank 0's 5th call to all ranks is checkpoint.save(dmodel, ...), rank 1's a " \
           "training forward, dmodel(...): "
    # (either rank may find it first) on its stderr, and in torchrun's summary from its error file
    assert f"hap: rank 0: {said}" in run.stderr or f"hap: rank 1: {said}" in run.stderr, run.stderr[-3000:]
    assert f"RuntimeError: {said}" in run.stderr, run.stderr[-3000:]
    assert not (tmp_path / "0.json").exists() and not (tmp_path / "1.json").exists()


@pytest.mark.parametrize("case, said", [
    ("clip", "rank 0's 7th call to all ranks is clip_grad_norm_ (dmodel's or torch's), rank 1's a training forward, "
             "dmodel(...): "),
    ("a step more", "rank 0's 7th call to all ranks is a training forward, dmodel(...), rank 1's the end of its "
                    "process: "),
    # outside hap's calls: the backward's collectives (the executor's, the gradient sync) were
    # told in gloo's words alone
    ("a backward alone", "rank 0's 6th call to all ranks is a backward through dmodel's loss, rank 1's the end of its "
                         "process: "),
])
def test_a_collective_a_peer_left_raises_the_parting_under_torchrun(case, said, tmp_path):
    """A lone clip of sharded gradients meets the peer's forward: gloo aborts one rank (SIGABRT),
    the other's collective fails (the connection closed); a rank that ended leaves the one still
    stepping with the same. The failed call now raises the parting, where the peers' calls
    show it (they are written to the store as they are counted: a rank that dies in a call has
    written it), instead of gloo's words alone. (Where gloo aborted a rank, torchrun ends the
    others within its monitor interval, 0.1 s by default: on a loaded machine the survivor was
    once ended before it said so. Here torchrun looks every 2 s.)"""
    run = torchrun(case, tmp_path, monitor_s=2.0)
    assert run.returncode != 0
    assert f"RuntimeError: ranks 0 and 1 parted: {said}" in run.stderr, run.stderr[-3000:]


def test_ranks_torchrun_started_that_pause_run_on(tmp_path):
    run = torchrun("healthy", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert got[0]["losses"] == got[1]["losses"]
    assert got[0]["calls"] == got[1]["calls"]  # a store ledger was kept, alike on both
    assert [name for _, name in got[0]["calls"]] == ["hap.HAP(model, ...) (wrapping the model)"] + \
        ["a training forward, dmodel(...)", "a backward through dmodel's loss", "an optimizer's first step, optimizer.step()",
         "a training forward, dmodel(...)", "a backward through dmodel's loss"]


def test_the_store_ledger_is_off_with_HAP_LEDGER_0(tmp_path):
    run = torchrun("healthy", tmp_path, {"HAP_LEDGER": "0"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "0.json").read_text())["calls"] is None


def test_store_slots_read_only_what_their_ledger_wrote():
    store = torch.distributed.HashStore()
    first, later = ledger.StoreSlots(store, 2, "hap-ledger/1/"), ledger.StoreSlots(store, 2, "hap-ledger/2/")
    assert first.read(1) == []  # nothing written yet: no wait
    first.write(1, ((1, "wrap"), (2, "fwd")))
    assert first.read(1) == [(1, "wrap"), (2, "fwd")] and later.read(1) == []
    assert first.read_every() == {0: [], 1: [(1, "wrap"), (2, "fwd")]}
    first.write(0, ((1, "wrap"),))  # every rank written: one round trip
    assert first.read_every() == {0: [(1, "wrap")], 1: [(1, "wrap"), (2, "fwd")]}


@pytest.mark.parametrize("error, said", [(None, "the end of its process"),
                                         (KeyError("x"), "the end of its process on KeyError: 'x'")])
def test_a_store_ledgers_rank_names_its_end(error, said, monkeypatch):
    """(Under NCCL a peer's end does not end a collective waiting for it: the ledger does.)"""
    slots = ledger.StoreSlots(torch.distributed.HashStore(), 2, "hap-ledger/1/")
    kept = ledger.Ledger(1, slots, group=object())
    kept.add("fwd")
    monkeypatch.setattr(ledger, "_LEDGER", kept)
    monkeypatch.setattr(sys, "last_value", error, raising=False)
    ledger._process_ends()
    assert slots.read(1) == [(1, "fwd"), (2, said)]
    ledger._process_ends()  # once only
    assert len(slots.read(1)) == 2


OWN_LAUNCHER = """\
import datetime, socket, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, {tests!r})


def work(rank, port):
    import hap
    from hap.runtime import ledger
    from torchrun_ranks import MLP
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    batch = (torch.randn(12, 16), torch.randint(0, 4, (12,)))
    dmodel = hap.HAP(MLP(), hap.load_cluster("local"), batch)
    dmodel(*batch).backward()
    print(f"rank {{rank}} ledger {{ledger._LEDGER}}", flush=True)
    dist.destroy_process_group()
    if rank == 1:
        time.sleep(3)  # still, after rank 0 (the store's host) has ended


if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(work, args=(port,), nprocs=2)
"""


def test_ranks_of_the_users_own_launcher_keep_no_ledger_and_end_quietly(tmp_path):
    """Their store lives in rank 0's process: a store ledger there printed torch's broken-pipe
    warnings (with 20 frames of C++) as a healthy run ended, rank 1 reading it after rank 0 left."""
    (tmp_path / "own.py").write_text(OWN_LAUNCHER.format(tests=os.path.dirname(__file__)))
    run = subprocess.run([sys.executable, "own.py"], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    # (the two ranks' lines may interleave)
    assert "rank 0 ledger None" in run.stdout and "rank 1 ledger None" in run.stdout, run.stdout
    assert "TCPStore" not in run.stderr and "Broken pipe" not in run.stderr, run.stderr[-3000:]
