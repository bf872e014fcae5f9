"""Trial runs: strategies measured on the real cluster (here: local ranks, slow devices and links
emulated as the cluster file says), by training steps of the real model.

The ranks stay up for all the trials of a search: they build the model and hap.HAP once (the
base plan), and for each strategy switch their gradient sync to it (HAP.resync), run `warmup`
steps, then time blocks of `steps` steps until `min_seconds` have passed (a fast step's time
varies by about itself). A trial's time is the median block's, each block timed on its slowest
rank, per step.

    with TrialCluster(workload) as cluster:
        seconds = cluster.measure([entries_a, entries_b])   # plan.SyncEntry lists
"""

from __future__ import annotations

import contextlib
import logging
import queue
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..ir import Graph
from ..plan import Plan, SyncEntry


@dataclass(kw_only=True)
class Workload:
    """What the ranks train: a model of hap.models, its knobs, the cluster and the base plan."""
    model: str
    knobs: dict = field(default_factory=dict)
    """Keyword arguments of hap.models.build (scale, layers, hidden, batch, ...)."""
    cluster: dict
    """Cluster.to_dict() of the cluster the ranks emulate."""
    plan: dict
    """Plan.to_dict(): the program the strategies synchronize the gradients of."""
    steps: int = 5
    warmup: int = 2
    min_seconds: float = 0.0
    """Time at least this long (in blocks of `steps` steps, at most 20 blocks; the median block counts)."""


class TrialsFailed(RuntimeError):
    pass


class TrialCluster:
    def __init__(self, workload: Workload, timeout_s: float = 600.0, graph: Graph | None = None):
        """graph: the workload's model captured (hap.capture), given to the ranks' hap.HAP; None:
        each rank captures it."""
        from ..runtime.launch import rendezvous, start_ranks

        self.workload, self.timeout_s = workload, timeout_s
        self.world = len(workload.plan["devices"])
        ctx = mp.get_context("forkserver")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self._store = rendezvous(timeout_s)  # served while the trial ranks run
        self.procs = start_ranks(_serve, (self.world, self._store.port, asdict(workload), self.commands,
                                          self.results, timeout_s, graph), self.world)
        self._expect("ready")

    def measure(self, syncs: Sequence[Sequence[SyncEntry]]) -> list[float]:
        """Seconds per training step with each strategy's sync entries."""
        self.commands.put([[asdict(e) for e in entries] for entries in syncs])
        return self._expect("measured")

    def close(self) -> None:
        if any(p.is_alive() for p in self.procs):
            self.commands.put(None)
            deadline = time.monotonic() + 30
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _expect(self, what: str):
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                kind, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"rank {dead[0]} died (exit code {self.procs[dead[0]].exitcode})" if dead else \
                        f"no answer in {self.timeout_s:.0f} s"
                    raise TrialsFailed(f"trial ranks failed: {why}") from None
                continue
            if kind == "error":
                self.close()
                raise TrialsFailed(f"trial ranks failed: {value}")
            assert kind == what, (kind, what)
            return value


def _timed_blocks(step, steps: int, min_seconds: float, max_blocks: int = 20) -> float:
    """The median time of blocks of `steps` steps, each block's time the slowest rank's, timed
    until they add up to `min_seconds` (at most `max_blocks`). The median, not the mean: on a
    shared machine another process's burst slows one block, not the strategy (a collective:
    every rank decides alike, on the slowest rank's times)."""
    blocks, total = [], 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        blocks.append(took.item())
        total += took.item()
        if total >= min_seconds or len(blocks) >= max_blocks:
            return statistics.median(blocks)


def _serve(rank: int, world: int, port: int, workload: dict, commands, results, timeout_s: float,
           graph: Graph | None) -> None:
    from datetime import timedelta

    import hap
    from ..cost.cluster import cluster_from_dict
    from ..models import build
    from ..runtime import launch

    torch.set_num_threads(1)
    try:
        launch._TIMEOUT = timedelta(seconds=timeout_s)
        launch.join_group("gloo", rank, world, port, timeout_s)
        w = Workload(**workload)
        torch.manual_seed(0)
        model, batch = build(w.model, devices=world, **w.knobs)
        cluster = cluster_from_dict(w.cluster)
        dmodel = hap.HAP(model, cluster, batch, plan=Plan.from_dict(w.plan), graph=graph)
        opt = torch.optim.SGD(dmodel.parameters(), lr=1e-3)
        local = dmodel.local_batch(*batch)

        def step():
            loss = dmodel(*local, part=True)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        if rank == 0:
            results.put(("ready", None))
        while True:
            box = [commands.get() if rank == 0 else None]  # (a killed hap sync ends us: launch.start_ranks)
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            measured = []
            for entries in box[0]:
                with _quiet_resync():  # (a trial's PowerSGD starts afresh: its dropped error feedback is no news)
                    dmodel.resync([SyncEntry(**{**e, "devices": tuple(e["devices"]),
                                                "rows": tuple(e["rows"]) if e["rows"] is not None else None})
                                   for e in entries])
                for _ in range(w.warmup):
                    step()
                dist.barrier()
                measured.append(_timed_blocks(step, w.steps, w.min_seconds) / w.steps)
            if rank == 0:
                results.put(("measured", measured))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # the driver hears of it, the other ranks from their sockets
        results.put(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


@contextlib.contextmanager
def _quiet_resync():
    """hap's warnings off while a trial rank switches strategies (resync's "drops PowerSGD's
    error feedback" printed at every switch of a --compress search)."""
    hap_log = logging.getLogger("hap")
    level = hap_log.level
    hap_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hap_log.setLevel(level)
