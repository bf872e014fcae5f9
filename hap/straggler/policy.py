"""The decisions of straggler mitigation, as pure functions of the times every rank measured
(the same on every rank after the refresh's all-gather, so every rank decides the same).

Notation of seed 002: T_i a rank's busy time in the last iteration (waiting excluded), M_i its
matmul time (emulated slowdown included), e the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True, slots=True)
class Stats:
    """One rank's last iteration."""

    busy: float
    """T_i: seconds not spent waiting in collectives."""
    matmul: float
    """M_i: seconds in its linear layers' multiplications (as slow as the device is)."""
    flops: float
    """FLOPs of those multiplications."""
    own: float
    """Share of its contraction columns it computed itself (1 - pruned - handed over)."""
    full_flops: float = 0.0
    """FLOPs of its whole share of the layers (what it would multiply unmitigated)."""
    probed: float = 0.0
    """A rank holding no columns: FLOPs per second of a probe multiplication it timed (its
    slowdown included), so that its speed is known and a reshard can give it columns again;
    0 where it holds some."""


def keep_after_resizing(keep: float, busy: float, target: float, matmul: float, cap: float = 0.95,
                        floor: float = 0.0) -> float:
    """Eq. 1, applied to the work a rank does now: it removes (T_i - target) / M_i of what it
    still multiplies, so its share of columns kept goes from `keep` to keep * (1 - that); a
    rank faster than the target takes columns back. Between max(1 - cap, floor) and 1, where
    `floor` is `matmul_floor`'s: pruning can only win back what slow multiplications cost."""
    if matmul <= 0:
        return keep
    gamma = (busy - target) / matmul  # Eq. 1 with target = T_avg (ZERO) or T_min (SEMI)
    return min(1.0, max(1.0 - cap, floor, keep * (1.0 - gamma)))


def matmul_floor(stats: Sequence[Stats], r: int, norm: Sequence[int] | None = None) -> float:
    """The least share of its columns rank r need multiply: its matmul speed over a normal
    rank's (the upper median of the speeds of the ranks `norm`, default all: the fastest of 2,
    the second fastest of 4; one rank that happened to run undisturbed does not set the norm;
    the mitigator's norm is the ranks that are no stragglers, so that with half of the ranks
    slow a straggler is not the norm). Eq. 1 charges a rank's whole excess to its
    multiplications; where the excess is elsewhere (noise in the other work of ranks sharing
    cores, a slow collective), pruning cannot remove it, and Eq. 1 alone would prune such a
    rank to the cap. A rank multiplying chi times slower keeps 1 / chi at least: then its
    multiplications take a normal rank's time."""
    speeds = matmul_speeds(stats)
    normal_speeds = [speeds[i] for i in (range(len(speeds)) if not norm else norm)]
    normal = sorted(normal_speeds, reverse=True)[(len(normal_speeds) - 1) // 2] if normal_speeds else 0.0
    return min(1.0, speeds[r] / normal) if normal > 0 else 0.0


def pruning_floors(stats: Sequence[Stats], keep: Sequence[float], moved: Sequence[float], whole: list[float],
                   norm: Sequence[int]) -> list[float]:
    """Each rank's matmul_floor against the ranks `norm` (the ones that are no stragglers), for
    the shares `keep` and `moved` the measured step ran. A rank that prunes (or hands over)
    multiplies smaller products, which run fewer FLOPs a second (their fixed costs stay): the
    speed read then is low, and as the floor it let pruning feed itself to the cap (4x slower,
    95% pruned, not 75%). So a pruning rank's floor is at least `whole[r]`, the one read at the
    last step it multiplied its whole share (kept up to date here, in place)."""
    out = []
    for r in range(len(stats)):
        read = matmul_floor(stats, r, norm)
        if keep[r] >= 1.0 and moved[r] <= 0.0:  # this step multiplied its whole share
            whole[r] = read
        out.append(read if keep[r] >= 1.0 else max(read, whole[r]))
    return out


def unmitigated(s: Stats) -> float:
    """U_i: a rank's busy time had it multiplied exactly its own share (nothing pruned, handed
    over or received), at the matmul speed it showed: its other work as measured plus its
    share's FLOPs at its seconds per FLOP. Independent of the current mitigation, so deciding
    by it does not oscillate."""
    per_flop = s.matmul / s.flops if s.flops > 0 else 0.0
    return s.busy - s.matmul + s.full_flops * per_flop


def balanced_migration(stats: Sequence[Stats], slow: Sequence[int], receivers: Sequence[int]) -> dict[int, float]:
    """Per straggler k, the share mu_k of its columns to hand over so that every straggler and
    the slowest receiver finish together at T*:

        U_k - mu_k a_k = T*,   U_r + sum_k mu_k b_k = T*
        a_k = k's full-share matmul seconds,  b_k = the same FLOPs at the receiver's speed / n

    so T* = (U_r + sum_k U_k b_k / a_k) / (1 + sum_k b_k / a_k)."""
    if not slow or not receivers:
        return {}
    r = max(receivers, key=lambda y: unmitigated(stats[y]))
    per_flop_r = stats[r].matmul / stats[r].flops if stats[r].flops > 0 else 0.0
    a = {k: stats[k].full_flops * stats[k].matmul / stats[k].flops if stats[k].flops > 0 else 0.0 for k in slow}
    b = {k: stats[k].full_flops * per_flop_r / len(receivers) for k in slow}
    ratio = {k: b[k] / a[k] if a[k] > 0 else 0.0 for k in slow}
    t_star = (unmitigated(stats[r]) + sum(unmitigated(stats[k]) * ratio[k] for k in slow)) / (1 + sum(ratio.values()))
    return {k: max(0.0, (unmitigated(stats[k]) - t_star) / a[k]) if a[k] > 0 else 0.0 for k in slow}


def stragglers_and_receivers(stats: Sequence[Stats], tolerance: float) -> tuple[float, list[int], list[int]]:
    """(T_min, the stragglers against it slowest first, the ranks that may take their columns).
    A rank holding no columns (a share of 0) multiplied nothing: it sets no T_min and takes
    no columns (it looked infinitely fast, and the rank doing all the work a straggler)."""
    held = [r for r, s in enumerate(stats) if s.full_flops > 0] or list(range(len(stats)))
    t_min = min(unmitigated(stats[r]) for r in held)
    slow = stragglers(stats, t_min, tolerance)
    return t_min, slow, [r for r in held if r not in slow]


def stragglers(stats: Sequence[Stats], target: float, tolerance: float) -> list[int]:
    """Ranks that, unmitigated, would be slower than `target` by more than `tolerance` (a
    fraction), slowest first."""
    slow = [r for r, s in enumerate(stats) if unmitigated(s) > target * (1 + tolerance)]
    return sorted(slow, key=lambda r: -unmitigated(stats[r]))


def semi_beta(gamma: float, columns: float, e: int, omega1: float, omega2: Callable[[float], float],
              phi1: Callable[[float], float], phi2: Callable[[float], float], iterations: int = 40) -> float:
    """Eq. 2: the share beta of a single straggler's excess L*gamma that migrates (the rest is
    pruned), where the straggler's extra cost of resizing equals a receiver's of migrating:

        Omega1 + Omega2(L gamma (1 - beta)) = Phi1(L gamma beta) + Phi2(L gamma beta / (e - 1))

    The left side falls and the right rises with beta, so bisection finds it; 0 or 1 where one
    side wins everywhere."""
    def gap(beta: float) -> float:
        moved = columns * gamma * beta
        return omega1 + omega2(columns * gamma * (1 - beta)) - phi1(moved) - phi2(moved / max(e - 1, 1))

    if gap(0.0) <= 0:
        return 0.0
    if gap(1.0) >= 0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def migration_bound(stats: Sequence[Stats], phi1: Callable[[float], float]) -> int:
    """Eq. 3 (Algorithm 2 lines 14-19): of the stragglers sorted slowest first, how many (x)
    should migrate. Gamma(x) = sum over the x slowest of F_k (T_k - T_min) / T_k is the work
    they hand over; it pays while the slowest's saving exceeds its communication Phi1 plus the
    slowest remaining rank's time for its 1/(e - x) share:

        f(x) = (T_x - T_min) - Phi1(Gamma(x)) - max_{y > x} Gamma(x) / (e - x) * T_y / F_y
    """
    t = [unmitigated(s) for s in stats]  # T_i as if unmitigated
    order = sorted(range(len(stats)), key=lambda r: -t[r])
    t_min = min(t)
    e = len(stats)
    x = 0
    for k in range(1, e):
        if t[order[k - 1]] <= t_min:
            break
        gamma = sum(stats[r].full_flops * (t[r] - t_min) / t[r] for r in order[:k])
        worst = max(gamma / (e - k) * t[y] / max(stats[y].full_flops, 1e-9) for y in order[k:])
        f = (t[order[k - 1]] - t_min) - phi1(gamma) - worst
        if f <= 0:
            break
        x = k
    return x


def matmul_speeds(stats: Sequence[Stats], probed: bool = False) -> list[float]:
    """Each rank's speed as measured: FLOPs per second in its layers' multiplications (0 for a
    rank holding no columns, or with probed=True its probe's, Stats.probed: rebalancing's
    view, which may give it columns again; pruning and migration leave such a rank out).
    Unlike share per busy second, it does not count the fixed per-node costs that do not
    shrink with a share, so a rank that was just given a small share does not look fast and
    pull its share back (rebalancing would oscillate)."""
    return [s.flops / s.matmul if s.matmul > 0 else (s.probed if probed else 0.0) for s in stats]


def rebalanced_time(stats: Sequence[Stats]) -> float:
    """The busy time every rank would have at shares fitting `matmul_speeds` (probed ones
    included): the most other work a rank does, plus all the layers' FLOPs at the ranks'
    summed speed."""
    speeds = matmul_speeds(stats, probed=True)
    other = max(s.busy - s.matmul for s in stats)
    return other + sum(s.full_flops for s in stats) / max(sum(speeds), 1e-9)


def time_lost(lost: float, slowest: float, balanced: float, steps: int) -> float:
    """The ski rental's count after a refresh that finds the shares off the measured speeds:
    `lost` so far plus this step's excess over the rebalanced time for each of the `steps`
    since the last refresh, where the slowdown was counted then already (lost > 0); a slowdown
    seen for the first time counts this step alone (the steps before it ran at the old speed,
    and counting them resharded at the first slow step)."""
    return lost + max(0.0, slowest - balanced) * (max(1, steps) if lost > 0 else 1)


def rebalance_pays(lost_seconds: float, reshard_seconds: float) -> bool:
    """Ski rental: reshard once the time lost to the slowdown since it began (over what the
    rebalanced run would take) has reached what resharding costs; until then migration
    bridges. Never more than twice the best choice in hindsight."""
    return lost_seconds >= reshard_seconds
