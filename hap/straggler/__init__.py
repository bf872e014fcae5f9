"""Runtime straggler mitigation for tensor-parallel linear layers (seed 002: ZERO-resizing and
SEMI-migration), plus exact online rebalancing.

    schedule.py   emulated dynamic stragglers (round-robin, several, persistent)
    prune.py      ZERO-resizing: pruned linear with zero imputation and lineage; Rd, Pri, PriDiff
    migrate.py    handovers and their collectives: broadcast-reduce, scatter-gather
    linear.py     one tensor-parallel linear layer run pruned / migrated / plain (TPLinear)
    policy.py     Eq. 1, 2, 3 and the migration and rebalance rules, as pure functions
    mitigator.py  the per-iteration controller a training loop calls (Mitigator)
    run.py        a training run of a model under a policy (hap train --straggler, benchmarks)
"""

from .mitigator import EXACT, MIGRATING, POLICIES, Mitigator, StragglerConfig
from .schedule import Schedule, parse_schedule

__all__ = ["EXACT", "MIGRATING", "POLICIES", "Mitigator", "StragglerConfig", "Schedule", "parse_schedule"]
