"""Placements: how one distributed tensor relates to its single-device reference tensor.

A property `e | p` of the paper says: running the collective named by p on the distributed
tensor gives every device the reference tensor e. We name the placement p, with short text
forms in the style of DTensor:

    S(d)  sharded on dim d       (e | All-Gather(d));  gradient: sharded on d
    P     partial sum            (e | All-Reduce);     gradient: full on every device
    R     replicated             (e | Identity);       gradient: partial sum over devices
    D     duplicated             (e | Identity);       gradient: full on every device

R and D hold the same forward values. They differ in the form the gradient takes, which is
what makes gradient semantics exact: an R tensor consumed by sharded computation gets its
gradient contributions summed across devices (the usual data-parallel parameter), a D tensor
is consumed by computation that every device duplicates, so every device ends with the full
gradient and nothing is summed (sufficient factor broadcasting; Megatron's identity-backward).
For tensors that carry no gradient R and D are the same, and the planner writes R.

Split sizes of S(d) are not part of the placement: every (tensor, dim) belongs to a shard
class whose granule count is fixed by the graph (see rules/units.py), and the sizes follow
from the class and the segment's ratios.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Placement:
    """One placement. Use the module constants R, D, P and the constructor S(dim)."""

    kind: str  # "S", "R", "D" or "P"
    dim: int = -1  # the sharded tensor dim for kind "S"; -1 otherwise
    # derived once (the planner's memos hash placements and ask these many thousand times a plan)
    is_shard: bool = field(default=False, init=False, repr=False, compare=False)
    code: int = field(default=0, init=False, repr=False, compare=False)
    """A small int for hashing in the search: R=0, D=1, P=2, S(d)=3+d."""

    def __post_init__(self):
        shard = self.kind == "S"
        if not shard and self.kind not in _CODES:
            raise ValueError(f"not a placement kind: {self.kind!r} (expected 'S', 'R', 'D' or 'P')")
        object.__setattr__(self, "is_shard", shard)
        object.__setattr__(self, "code", 3 + self.dim if shard else _CODES[self.kind])

    def __hash__(self) -> int:
        return self.code

    def __reduce__(self):
        return Placement, (self.kind, self.dim)

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.kind == "S" else self.kind

    __str__ = __repr__


_CODES = {"R": 0, "D": 1, "P": 2}

R = Placement("R")
D = Placement("D")
P = Placement("P")


def S(dim: int) -> Placement:
    """Sharded on tensor dim `dim` (non-negative)."""
    found = _SHARDS.get(dim)
    if found is None:
        if dim < 0:
            raise ValueError(f"S(dim) needs a non-negative dim, got {dim}; normalize it first")
        found = _SHARDS[dim] = Placement("S", dim)
    return found


_SHARDS: dict[int, Placement] = {}  # S(d) made once per d: placements are values, and the rules ask often


def from_code(code: int) -> Placement:
    return (R, D, P)[code] if code < 3 else S(code - 3)


def parse(text: str) -> Placement:
    """Inverse of str(): 'R', 'D', 'P' or 'S(3)'."""
    text = text.strip()
    if text in ("R", "D", "P"):
        return {"R": R, "D": D, "P": P}[text]
    if text.startswith("S(") and text.endswith(")") and text[2:-1].isdigit():
        return S(int(text[2:-1]))
    raise ValueError(f"not a placement: {text!r} (expected R, D, P or S(<dim>))")
