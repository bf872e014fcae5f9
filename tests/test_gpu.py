"""The GPU tier: the equivalence of test_runtime.py on NCCL, each rank on its own GPU.

Skipped where this machine has fewer than two CUDA devices (CI's CPU machines); run on a GPU
machine with `pytest tests/test_gpu.py`.
"""

import pytest
import torch
from gloo import run_ranks

from test_runtime import CASES, worker

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL tier)")


@pytest.mark.parametrize("world", [w for w in (2, 3) if w <= torch.cuda.device_count()])
def test_programs_train_like_one_device_on_nccl(world, tmp_path):
    reports = run_ranks(worker, world, tmp_path, "cuda", backend="nccl")
    assert all(not r["failures"] for r in reports), [r["failures"] for r in reports]
    assert len(reports[0]["programs"]) == len(CASES[world])
