"""Pipeline schedules: the order in which each stage runs its micro-batches' forward (F) and
backward (B) passes, and the time that order takes.

The orders are the one fact both the runtime (pipeline/runtime.py runs them) and the cost model
(`makespan` simulates them) use.

- GPipe: every forward, then every backward. A stage keeps all M micro-batches' activations.
- 1F1B (PipeDream-flush): stage s of K first runs min(K - s - 1, M) forwards (warm-up), then
  alternates one forward and one backward, then runs the remaining backwards. Same bubble as
  GPipe, but a stage keeps at most K - s micro-batches' activations.
"""

from __future__ import annotations

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


def simulate(name: ScheduleName, micro_batches: int, fwd: Sequence[float], bwd: Sequence[float],
             send: Sequence[float] = (), send_back: Sequence[float] = ()) -> dict[tuple[str, int, int], tuple[float, float]]:
    """When every pass runs, (pass, stage, micro-batch) -> (start, end) seconds, when stage s
    takes fwd[s] per micro-batch forward and bwd[s] per backward, and handing a micro-batch's
    activations from stage s to s + 1 takes send[s] (its gradients back, send_back[s]; default
    send). A transfer overlaps the sender's next pass (asynchronous sends); the receiver waits
    for it."""
    K, M = len(fwd), micro_batches
    send = list(send) or [0.0] * (K - 1)
    send_back = list(send_back) or list(send)
    if len(bwd) != K or len(send) != K - 1 or len(send_back) != K - 1:
        raise ValueError(f"{K} stages need {K} backward times and {K - 1} transfer times")
    orders = [stage_order(name, K, M, s) for s in range(K)]
    runs: dict[tuple[str, int, int], tuple[float, float]] = {}
    free = [0.0] * K
    nxt = [0] * K
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(K):
            while nxt[s] < len(orders[s]):
                kind, m = orders[s][nxt[s]]
                if kind == "F":
                    dep = 0.0 if s == 0 else runs.get(("F", s - 1, m), (0.0, None))[1]
                    ready = None if dep is None else dep + (send[s - 1] if s else 0.0)
                    took = fwd[s]
                else:
                    own = runs.get(("F", s, m), (0.0, None))[1]
                    dep = own if s == K - 1 else runs.get(("B", s + 1, m), (0.0, None))[1]
                    ready = None if dep is None or own is None else max(own, dep + (send_back[s] if s < K - 1 else 0.0))
                    took = bwd[s]
                if ready is None:
                    break
                start = max(free[s], ready)
                free[s] = start + took
                runs[(kind, s, m)] = (start, free[s])
                nxt[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, "pipeline schedule deadlocks"
    return runs


def makespan(name: ScheduleName, micro_batches: int, fwd: Sequence[float], bwd: Sequence[float],
             send: Sequence[float] = (), send_back: Sequence[float] = ()) -> float:
    """Seconds from the first forward to the last backward (`simulate`'s last end)."""
    return max(end for _, end in simulate(name, micro_batches, fwd, bwd, send, send_back).values())
