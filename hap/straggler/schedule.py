"""Dynamic stragglers on the emulated cluster: which rank is how much slower at which iteration.

As on the seed paper's testbed (seed 002, section V-A), a straggler's *linear-layer matrix
multiplications* take chi times as long; everything else runs at the machine's speed. The
schedules of its experiments:

    round-robin:chi=8,every=5      one straggler at a time, moving to the next rank every 5 iterations
    multi:chi=8/6/4/2              several at once: rank i slowed by the i-th chi (8, 6, 4, 2 on half of 8 ranks)
    persistent:chi=8,rank=1        one rank slowed from `start` on, for good
    none                           nobody

On real GPUs nothing is emulated: the schedule is "none" and the devices are as slow as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["none", "round-robin", "multi", "persistent"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    kind: Kind = "none"
    """Which pattern (module docstring)."""
    chi: tuple[float, ...] = (1.0,)
    """Slowdown of the straggler's matmuls (one value, or one per straggler for "multi")."""
    every: int = 5
    """round-robin: iterations before the straggler moves on to the next rank."""
    rank: int = 0
    """persistent: the slowed rank; round-robin: the first one."""
    start: int = 0
    """The first slowed iteration."""

    def __post_init__(self):
        problem = _problem(self.kind, self.chi, self.every, self.start)
        if problem:
            raise ValueError(f"Schedule(kind={self.kind!r}, chi={self.chi!r}, every={self.every!r}, "
                             f"start={self.start!r}): {problem}")

    def slowdown(self, rank: int, iteration: int, world: int) -> float:
        """How many times slower `rank`'s matmuls are at `iteration` (1: normal speed)."""
        if self.kind == "none" or iteration < self.start:
            return 1.0
        if self.kind == "persistent":
            return self.chi[0] if rank == self.rank else 1.0
        if self.kind == "round-robin":
            slow = (self.rank + (iteration - self.start) // self.every) % world
            return self.chi[0] if rank == slow else 1.0
        return self.chi[rank] if rank < len(self.chi) else 1.0  # multi

    def check(self, world: int, label: str = "") -> None:
        """A ValueError where the schedule does not fit `world` ranks (label: how the message
        names it; default its description)."""
        label = label or repr(self.describe())
        if self.kind == "multi" and len(self.chi) > world:
            raise ValueError(f"straggler schedule {label}: {len(self.chi)} stragglers on {world} ranks")
        if self.kind in ("persistent", "round-robin") and not (isinstance(self.rank, int) and 0 <= self.rank < world):
            raise ValueError(f"straggler schedule {label}: 0 <= rank < {world} is needed")

    def describe(self) -> str:
        chi = "/".join(f"{c:g}" for c in self.chi)
        if self.kind == "none":
            return "no straggler"
        if self.kind == "round-robin":
            return f"one straggler (chi {chi}) moving every {self.every} iterations"
        if self.kind == "persistent":
            return f"rank {self.rank} persistently {chi}x slower from iteration {self.start}"
        return f"stragglers with chi {chi} on ranks 0..{len(self.chi) - 1}"


_FIELDS = {"none": (), "round-robin": ("chi", "every", "rank", "start"), "persistent": ("chi", "rank", "start"),
           "multi": ("chi", "start")}
"""The fields each kind reads (multi slows ranks 0, 1, ... by its chis)."""


def parse_schedule(text: str, world: int) -> Schedule:
    """A schedule from its text form (module docstring); a ValueError names what is wrong."""
    kind, _, rest = text.strip().partition(":")
    if kind not in ("none", "round-robin", "multi", "persistent"):
        raise ValueError(f"unknown straggler schedule {kind!r}; choose none, round-robin, multi or persistent")
    takes = _FIELDS[kind]
    fields: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ("chi", "every", "rank", "start"):
            raise ValueError(f"straggler schedule {text!r}: expected chi=, every=, rank= or start=, got {item!r}")
        if key not in takes:  # it would do nothing (none:chi=8 slowed no one)
            raise ValueError(f"straggler schedule {text!r}: {kind} takes " + (", ".join(f"{k}=" for k in takes) or "no fields")
                             + f", not {key}=")
        if key in fields:
            raise ValueError(f"straggler schedule {text!r}: {key}= given twice")
        fields[key] = value
    if kind != "none" and "chi" not in fields:  # a bare round-robin slowed no one (chi 1)
        raise ValueError(f"straggler schedule {text!r}: {kind} needs chi= (how many times slower)")
    try:
        chi = tuple(float(c) for c in fields.get("chi", "1").split("/"))
        every, rank, start = int(fields.get("every", 5)), int(fields.get("rank", 0)), int(fields.get("start", 0))
    except ValueError:
        raise ValueError(f"straggler schedule {text!r}: chi must be numbers (8 or 8/6/4/2), every/rank/start integers") from None
    problem = _problem(kind, chi, every, start)
    if problem:
        raise ValueError(f"straggler schedule {text!r}: {problem}")
    schedule = Schedule(kind=kind, chi=chi, every=every, rank=rank, start=start)  # type: ignore[arg-type]
    schedule.check(world, repr(text))
    return schedule


CHI_MOST = 1000.0
"""The most an emulated slowdown may be (the paper's are 2 to 8). A slowed rank sleeps chi - 1
times each multiplication's time: at chi 1e9 it outwaited the collective timeout, and the run
failed after 2 minutes blaming that rank."""


def _problem(kind, chi, every, start) -> str | None:
    """What is wrong with a schedule's fields whatever the ranks (None: nothing)."""
    if kind not in _FIELDS:
        return f"kind must be one of {', '.join(_FIELDS)}"
    if not isinstance(chi, tuple) or not chi:
        return "chi must be a tuple of slowdowns, (8.0,) for one straggler (parse_schedule reads 'persistent:chi=8')"
    if not all(isinstance(c, (int, float)) and 1 <= c <= CHI_MOST for c in chi):
        return f"chi must be a number from 1 to {CHI_MOST:g} (a slowdown)"  # (nan and inf fail too)
    if kind != "multi" and len(chi) != 1:
        return f"{kind} takes one chi; several are for multi"
    if not isinstance(every, int) or not isinstance(start, int) or every < 1 or start < 0:
        return "every >= 1 and start >= 0 are needed (whole numbers)"
    return None
