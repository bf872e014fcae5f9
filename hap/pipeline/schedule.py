"""Pipeline schedules: the order in which each stage runs its micro-batches' forward (F) and
backward (B) passes, and the time that order takes.

The orders are the one fact both the runtime (pipeline/runtime.py runs them) and the cost model
(`simulate` runs them with their transfers and gradient syncs) use.

- GPipe: every forward, then every backward. A stage keeps all M micro-batches' activations.
- 1F1B (PipeDream-flush): stage s of K first runs min(K - s - 1, M) forwards (warm-up), then
  alternates one forward and one backward, then runs the remaining backwards. Same bubble as
  GPipe, but a stage keeps at most K - s micro-batches' activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[ScheduleName, ...] = ("gpipe", "1f1b")
Op = tuple[Literal["F", "B"], int]


def stage_order(name: ScheduleName, stages: int, micro_batches: int, stage: int) -> list[Op]:
    """The (pass, micro-batch) sequence stage `stage` of `stages` runs in one iteration."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if not 0 <= stage < stages or micro_batches < 1:
        raise ValueError(f"no stage {stage} of {stages} with {micro_batches} micro-batches")
    M = micro_batches
    if name == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    warmup = min(stages - stage - 1, M)
    ops: list[Op] = [("F", m) for m in range(warmup)]
    for m in range(warmup, M):  # steady state: the forward of m, then the oldest backward
        ops += [("F", m), ("B", m - warmup)]
    return ops + [("B", m) for m in range(M - warmup, M)]


def in_flight(name: ScheduleName, stages: int, micro_batches: int, stage: int) -> int:
    """The most micro-batches whose activations the stage holds at once (forwarded, not yet
    backwarded): what its activation memory scales with."""
    live = peak = 0
    for kind, _ in stage_order(name, stages, micro_batches, stage):
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


Run = tuple[str, int, int]
"""(pass "F" or "B", stage, micro-batch)."""


@dataclass(frozen=True, slots=True)
class Simulated:
    """One iteration of a pipeline schedule, as `simulate` runs it (seconds from its start)."""

    runs: dict[Run, tuple[float, float]]
    """Every pass's (start, end)."""
    transfers: dict[Run, tuple[float, float]]
    """Every pass's transfer on, (start, end): a forward's activations to the next stage, a
    backward's gradients to the one before."""
    synced: tuple[tuple[float, float], ...]
    """Per stage, its gradient sync's (start, end): once its last pass and every transfer it
    sent are done, as the runtime waits for its sends before syncing."""

    @property
    def flushed(self) -> float:
        """When the last pass ends."""
        return max(end for _, end in self.runs.values())

    @property
    def end(self) -> float:
        """When the last stage's gradient sync ends (the flush where no stage syncs)."""
        return max(self.flushed, *(end for _, end in self.synced))


def simulate(name: ScheduleName, micro_batches: int, fwd: Sequence[float], bwd: Sequence[float],
             send: Sequence[float] = (), send_back: Sequence[float] = (), sync: Sequence[float] = ()) -> Simulated:
    """One iteration when stage s takes fwd[s] per micro-batch forward and bwd[s] per backward,
    handing a micro-batch's activations from stage s to s + 1 takes send[s] (its gradients back,
    send_back[s]; default send), and its gradient sync sync[s] (default none). A transfer
    overlaps the sender's next pass (asynchronous sends) but waits for the link: one transfer
    at a time each way between two stages, in the order they were sent, as a process group
    sends them; the receiver waits for it."""
    K, M = len(fwd), micro_batches
    send = list(send) or [0.0] * (K - 1)
    send_back = list(send_back) or list(send)
    sync = list(sync) or [0.0] * K
    if len(bwd) != K or len(send) != K - 1 or len(send_back) != K - 1 or len(sync) != K:
        raise ValueError(f"{K} stages need {K} backward times, {K - 1} transfer times and {K} sync times")
    orders = [stage_order(name, K, M, s) for s in range(K)]
    runs: dict[Run, tuple[float, float]] = {}
    transfers: dict[Run, tuple[float, float]] = {}
    free = [0.0] * K
    link_on, link_back = [0.0] * K, [0.0] * K  # when the link s -> s + 1 (s -> s - 1) is next free
    nxt = [0] * K
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(K):
            while nxt[s] < len(orders[s]):
                kind, m = orders[s][nxt[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else transfers.get(("F", s - 1, m), (None, None))[1]
                    took = fwd[s]
                else:
                    own = runs.get(("F", s, m), (0.0, None))[1]
                    dep = own if s == K - 1 else transfers.get(("B", s + 1, m), (None, None))[1]
                    ready = None if dep is None or own is None else max(own, dep)
                    took = bwd[s]
                if ready is None:
                    break
                start = max(free[s], ready)
                free[s] = start + took
                runs[(kind, s, m)] = (start, free[s])
                if kind == "F" and s < K - 1:
                    begin = max(free[s], link_on[s])
                    link_on[s] = begin + send[s]
                    transfers[(kind, s, m)] = (begin, link_on[s])
                if kind == "B" and s > 0:
                    begin = max(free[s], link_back[s])
                    link_back[s] = begin + send_back[s - 1]
                    transfers[(kind, s, m)] = (begin, link_back[s])
                nxt[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, "pipeline schedule deadlocks"
    synced = []
    for s in range(K):
        done = max([free[s], *(end for (_, k, _), (_, end) in transfers.items() if k == s)])
        synced.append((done, done + sync[s]))
    return Simulated(runs, transfers, tuple(synced))

