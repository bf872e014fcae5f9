"""Ranks started by torchrun, not hap's launcher (tests/test_ledger.py runs them):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/torchrun_ranks.py CASE OUT

CASE: "healthy" (rank 0 pauses longer than the ledger waits, then both go on), "save" (rank 0
alone saves a checkpoint after the first step, DDP's habit), "clip" (rank 0 alone clips the
gradients of the second of three steps: gloo aborts a rank that meets another collective than
its own) or
"a step more" (rank 0 runs a third step after rank 1 has ended) or "a backward alone" (rank 1
ends after its second forward, while rank 0's backward syncs gradients). Each rank writes
OUT/<rank>.json (its losses) when it gets to the end. The collective timeout is 10 minutes: the test's own
timeout ends a run whose ranks the ledger left waiting.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hap
from hap.planner import baseline_plan
from hap.runtime import checkpoint, ledger


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)


def main(case: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, cluster = MLP(), hap.load_cluster("local")
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(12, 16, generator=gen), torch.randint(0, 4, (12,), generator=gen))
    plan = baseline_plan(hap.capture(model, batch), cluster, "megatron", ratios=[0.6, 0.4])
    dmodel = hap.HAP(model, cluster, batch, plan=plan)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1)
    losses = []
    for i in range(3 if case == "clip" or (case == "a step more" and rank == 0) else 2):
        loss = dmodel(*batch)
        if i == 1 and rank == 1 and case == "a backward alone":
            sys.exit(0)
        loss.backward()
        if i == 1 and rank == 0 and case == "clip":
            torch.nn.utils.clip_grad_norm_(dmodel.parameters(), 0.01)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if i == 0 and rank == 0 and case == "healthy":
            time.sleep(3 * ledger.STILL_S)  # rank 1 waits in the next forward meanwhile
        if i == 0 and rank == 0 and case == "save":
            checkpoint.save(dmodel, opt, os.path.join(out, "ckpt"), 1)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"losses": losses, "calls": ledger._LEDGER.calls if ledger._LEDGER else None}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
