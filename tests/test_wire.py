"""wire.py's collectives on real ranks give torch.distributed's results, uneven sizes included,
synchronous and asynchronous. On the CPU (here, gloo) nothing is staged; test_gpu.py runs the
same worker with GPU tensors, where gloo's ranks stage their messages through host memory (and
NCCL's ranks their host tensors through the GPU)."""

import sys
import time

import torch
from gloo import rank_device, run_ranks

from hap._torch import _BACKWARD_CONTEXT as BACKWARD_CONTEXT
from hap.runtime import wire


def full(n, value, dev, dtype=torch.float32):
    return torch.full((n,), float(value), dtype=dtype, device=dev)


def wire_worker(rank, world, device="cpu"):
    dev = rank_device(rank, device)
    failures = []

    def check(name, got, want):
        if not torch.equal(got.cpu(), want.cpu()):
            failures.append(f"{name}: {got.tolist()} != {want.tolist()}")

    t = full(4, rank + 1, dev)
    wire.all_reduce(t)
    check("all_reduce", t, full(4, world * (world + 1) // 2, "cpu"))
    host = full(2, rank + 1, "cpu")  # a host tensor: NCCL takes it through the GPU
    wire.all_reduce(host)
    check("all_reduce on the host", host, full(2, world * (world + 1) // 2, "cpu"))
    t = full(3, rank, dev)
    wire.broadcast(t, src=1)
    check("broadcast", t, full(3, 1, "cpu"))
    t = full(3, rank + 1, dev)
    wire.reduce(t, dst=0)
    if rank == 0:
        check("reduce", t, full(3, world * (world + 1) // 2, "cpu"))
    parts = [torch.empty(3, device=dev) for _ in range(world)]
    work = wire.all_gather(parts, full(3, rank, dev), async_op=True)
    work.wait()
    for i, p in enumerate(parts):
        check(f"all_gather (async) part {i}", p, full(3, i, "cpu"))
    outs = [torch.empty(2, device=dev) for _ in range(world)] if rank == 1 else None
    wire.gather(full(2, 7 * rank, dev), outs, dst=1)
    for i, p in enumerate(outs or []):
        check(f"gather part {i}", p, full(2, 7 * i, "cpu"))
    out = torch.empty(2, device=dev)
    wire.scatter(out, [full(2, 10 * i, dev) for i in range(world)] if rank == 0 else None, src=0)
    check("scatter", out, full(2, 10 * rank, "cpu"))
    out = torch.empty(2, device=dev)
    wire.reduce_scatter(out, [full(2, 10 * rank + j, dev) for j in range(world)])
    check("reduce_scatter", out, full(2, sum(10 * i + rank for i in range(world)), "cpu"))
    # uneven all_to_all: rank i sends rank j (i + j + 1) values 100 i + j
    sends = [full(rank + j + 1, 100 * rank + j, dev) for j in range(world)]
    counts = [i + rank + 1 for i in range(world)]
    out = torch.empty(sum(counts), device=dev)
    wire.all_to_all_single(out, torch.cat(sends), counts, [s.numel() for s in sends])
    check("all_to_all_single", out, torch.cat([full(i + rank + 1, 100 * i + rank, "cpu") for i in range(world)]))
    # a ring of uneven point-to-point messages
    src = (rank - 1) % world
    buf = torch.empty(src + 2, device=dev)
    recv = wire.irecv(buf, src, tag=5)
    send = wire.isend(full(rank + 2, rank, dev), (rank + 1) % world, tag=5)
    recv.wait()
    send.wait()
    check("isend/irecv", buf, full(src + 2, src, "cpu"))
    staged = wire.staging(None, [full(1, 0, dev)], message=True)  # where a message of this rank's tensors goes
    return {"failures": failures, "staged": None if staged is None else staged.type}


def test_wire_collectives_on_cpu_ranks(tmp_path):
    reports = run_ranks(wire_worker, 3, tmp_path)
    assert all(not r["failures"] for r in reports), [r["failures"] for r in reports]
    assert all(r["staged"] is None for r in reports)  # gloo takes host tensors: nothing staged


def backward_worker(rank, world):
    """A collective launched in a backward (from a gradient hook, as hap's gradient sync does),
    its work kept past the backward's end."""
    kept, seen = {}, {}
    w = torch.nn.Parameter(torch.full((3,), float(rank + 1)))

    def hook(p):
        kept["context"] = torch._C._get_obj_in_tls(BACKWARD_CONTEXT)
        kept["work"] = wire.all_reduce(p.grad, async_op=True)
        seen["context kept"] = torch._C._get_obj_in_tls(BACKWARD_CONTEXT) is kept["context"]

    w.register_post_accumulate_grad_hook(hook)
    (w * w).sum().backward()  # its end takes the context out of the thread-local state
    kept["work"].wait()
    with_work = sys.getrefcount(kept["context"])
    del kept["work"]
    time.sleep(0.2)  # the backend's worker thread drops its reference to the work too
    seen["held by the work"] = with_work - sys.getrefcount(kept["context"])
    seen["grad"] = w.grad.tolist()
    return seen


def test_a_collective_in_a_backward_holds_no_python_object_of_the_backward(tmp_path):
    """torch's backward keeps the caller's contextvars in thread-local state, which a gloo work
    copies; the backend's worker thread frees the work, and a Python object in it needs the GIL
    then: at interpreter exit, that aborted the process (1 in about 6 torchrun runs)."""
    reports = run_ranks(backward_worker, 2, tmp_path)
    for r in reports:
        assert r["held by the work"] == 0 and r["context kept"], r
        assert r["grad"] == [2.0 * (1 + 2)] * 3  # d(w*w)/dw = 2w, summed over ranks (w = 1, 2)
