"""AutoSync in hap: per-parameter synchronization strategies (all-reduce groups, parameter
servers, partitioning, hierarchical reduction, compression) searched by simulators and trial
runs (seed 001, the AutoSync supplement). A strategy becomes the plan's sync entries, which
the runtime runs (runtime/gradsync.py).

    strategy.py    the strategy space and its plan entries
    price.py       AutoSync's analytic model (Eq. 1-3) and hap's overlap-aware price
    sampler.py     random strategies under the load-balance and adjacent-merge constraints
    simulators.py  learned simulators (linear, RNN, GAT) trained by pairwise ranking
    select.py      candidate selection (Eq. 11)
    trials.py      strategies measured on the (local, emulated) cluster
    baselines.py   DDP, Horovod autotuned, tuned parameter server, hap's default
    autosync.py    the loop, its log, result and plots (hap sync)
"""

from .autosync import AutoSyncConfig, run
from .sampler import SpaceConfig
from .strategy import PartSync, SyncStrategy, Variables, VarSync, with_strategy

__all__ = ["AutoSyncConfig", "SpaceConfig", "PartSync", "SyncStrategy", "Variables", "VarSync", "run", "with_strategy"]
