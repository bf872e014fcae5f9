"""Run a test's worker on real gloo ranks (hap's own launcher) and collect what each found.

    reports = run_ranks(worker, world, tmp_path, *args)   # worker(rank, world, *args) -> dict

Workers report failures instead of asserting, so that every rank finishes its collectives
and the test sees all failures at once.
"""

import json
import os

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
