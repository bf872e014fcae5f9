"""The GPU tier: training equals one device with every rank's tensors on a GPU.

With a GPU per rank the ranks talk NCCL; on a machine with fewer GPUs than ranks (one GPU, say)
they share the GPUs and talk gloo (wire.py sends its messages through host memory): the
runtime's every tensor still lives on the GPU, so a tensor made on the wrong device fails here. The
references train on GPU 0 in this process. Skipped where there is no CUDA device (CI's CPU
machines); run on a GPU machine with `bash benchmarks/gpu_tier.sh` (or `pytest tests/test_gpu.py`).
"""

import pytest
import torch
from gloo import rank_device, run_ranks, to_device

import test_module
import test_pipeline
import test_runtime
import test_sync_runtime

GPUS = torch.cuda.device_count()
pytestmark = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device (the GPU tier)")


def backend(world: int) -> str:
    return "nccl" if world <= GPUS else "gloo"


def on_gpu(setup):
    model, batches = setup()
    dev = torch.device("cuda", 0)
    return model.to(dev), [to_device(b, dev) for b in batches]


def assert_state(got: dict, model: torch.nn.Module, what):
    """Every parameter the ranks trained equals the reference's (and any buffer they report)."""
    assert {n for n, _ in model.named_parameters()} <= set(got), what
    for name, value in model.state_dict().items():
        if name in got:
            assert torch.allclose(torch.tensor(got[name]), value.detach().cpu(), rtol=1e-4, atol=1e-5), (what, name)


@pytest.mark.parametrize("world", [2, 3])
def test_programs_train_like_one_device_on_gpus(world, tmp_path):
    reports = run_ranks(test_runtime.worker, world, tmp_path, "cuda", backend=backend(world))
    assert all(not r["failures"] for r in reports), [r["failures"] for r in reports]
    assert len(reports[0]["programs"]) == len(test_runtime.CASES[world])
    assert len(set(reports[0]["moves"])) >= 4  # several kinds of collective ran


def test_hap_trains_vit_like_one_device_on_gpus(tmp_path):
    reports = run_ranks(test_module.train_hap, 2, tmp_path, "cuda", backend=backend(2))
    model, batches = on_gpu(test_module.small_vit)
    losses = test_module.train(model, batches)
    for got in reports:
        assert got["ratios"][0][0] > got["ratios"][0][1]
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        assert_state(got["params"], model, "hap")


@pytest.mark.parametrize("name", ["ar-groups", "servers", "hierarchical"])
def test_exact_sync_strategies_on_gpus(name, tmp_path):
    reports = run_ranks(test_sync_runtime.train_with, 3, tmp_path, name, "cuda", backend=backend(3))
    model, batches = on_gpu(test_sync_runtime.data)
    losses = test_sync_runtime.train(model, batches)
    for got in reports:
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        assert_state(got["params"], model, name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_trains_like_one_device_on_gpus(schedule, tmp_path):
    from hap.capture import capture
    model, batches = test_pipeline._vit_setup()
    n = len(capture(model, batches[0]).nodes)
    reports = run_ranks(test_pipeline.pipelined, 3, tmp_path, "vit", [n // 2], [[0, 1], [2]], [[0.6, 0.4], [1.0]],
                        3, schedule, "cuda", backend=backend(3))
    model, batches = on_gpu(test_pipeline._vit_setup)
    losses = test_module.train(model, batches)
    for got in reports:
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        assert_state(got["state"], model, schedule)


def test_wire_collectives_on_gpus(tmp_path):
    import test_wire
    reports = run_ranks(test_wire.wire_worker, 3, tmp_path, "cuda", backend=backend(3))
    assert all(not r["failures"] for r in reports), [r["failures"] for r in reports]
    # gloo's ranks sent their GPU messages through the host; NCCL's took them as they are
    assert all(r["staged"] == ("cpu" if backend(3) == "gloo" else None) for r in reports)


def test_hap_trains_over_nccl_on_every_gpu(tmp_path):
    # NCCL needs a GPU per rank: a rank on each GPU there is (a world of one on a one-GPU machine
    # still starts NCCL, its communicator and its collectives on CUDA tensors)
    from hap.cost.cluster import local_cluster
    cluster = local_cluster((1.0,) * GPUS, "gpus")
    reports = run_ranks(test_module.train_hap, GPUS, tmp_path, "cuda", cluster, backend="nccl")
    model, batches = on_gpu(test_module.small_vit)
    losses = test_module.train(model, batches)
    for got in reports:
        assert got["parts"] == pytest.approx(got["whole"], rel=1e-5)
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        assert_state(got["params"], model, "nccl")


def test_straggler_meter_times_gpu_multiplications():
    # CUDA runs a product asynchronously: the host's clock around it reads the launch alone
    # (microseconds); the meter's events read the product itself, as a synchronized clock does
    import time
    from hap.runtime.collectives import Comm
    from hap.straggler.linear import Meter
    dev = torch.device("cuda", 0)
    a, b = torch.randn(4096, 4096, device=dev), torch.randn(4096, 4096, device=dev)
    a @ b
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    a @ b
    torch.cuda.synchronize(dev)
    synced = time.perf_counter() - t0
    meter = Meter(Comm(rank=0, world=1))
    with meter.timing(dev, 2.0 * 4096 ** 3):
        a @ b
    assert len(meter.pending) == 1 and meter.flops == 2.0 * 4096 ** 3
    assert meter.seconds >= 0.5 * synced and not meter.pending


def own_samples_on_gpu(rank, world):
    dev = rank_device(rank, "cuda")
    model, batches, _ = test_module.dropout_bn()
    model, batches = model.to(dev), [to_device(b, dev) for b in batches]
    dmodel = test_module.skewed(model, batches[0], "megatron")
    dmodel(*batches[rank])  # each rank its own batch: on a GPU the verdict is read at the next forward
    refused = []
    try:
        dmodel(*batches[0])
    except ValueError as e:
        refused.append(str(e))
    dmodel(*batches[0])  # the same batch everywhere: on
    return {"refused": refused}


def test_ranks_given_different_batches_are_refused_on_gpus(tmp_path):
    for got in run_ranks(own_samples_on_gpu, 2, tmp_path, backend=backend(2)):
        assert len(got["refused"]) == 1 and got["refused"][0].startswith("the ranks were given different batches")
