"""Run a test's worker on real gloo ranks (hap's own launcher) and collect what each found.

    reports = run_ranks(worker, world, tmp_path, *args)   # worker(rank, world, *args) -> dict

Workers report failures instead of asserting, so that every rank finishes its collectives
and the test sees all failures at once.
"""

import json
import os
import time

import torch

from hap.runtime.launch import spawn


def run_ranks(worker, world, tmp_path, *args, backend="gloo") -> list[dict]:
    spawn(_report, world, args=(worker, world, str(tmp_path), args), backend=backend)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _report(rank, worker, world, out_dir, args):
    report = worker(rank, world, *args)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def rank_device(rank: int, device: str) -> torch.device:
    """The device a worker's rank computes on: the CPU, or ("cuda") GPU rank mod the GPUs there
    are (ranks share a GPU when there are fewer GPUs than ranks: gloo then moves their tensors
    through host memory; NCCL needs a GPU per rank)."""
    if device == "cpu":
        return torch.device("cpu")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def to_device(batch, dev: torch.device):
    """A batch (a tensor, or a tuple of them) on dev."""
    return tuple(t.to(dev) for t in batch) if isinstance(batch, tuple) else batch.to(dev)


def still_running(pids: list[int], within_s: float = 30.0) -> list[int]:
    """Of `pids`, those still running after waiting up to within_s for them to end (an ended
    process its new parent has not reaped yet, a zombie, has ended)."""
    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    deadline = time.monotonic() + within_s
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if running(pid)]
