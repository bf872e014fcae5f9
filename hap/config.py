"""Field checks shared by hap's config dataclasses (PlannerConfig, DQNConfig, SpaceConfig,
AutoSyncConfig, StragglerConfig, RebalanceConfig): one rule per field, one message shape.

    def __post_init__(self):
        check_fields(self, segments=whole(1), width=whole(1, none="no limit"), gamma=number(0, 1))
    # PlannerConfig(segments=0) -> ValueError: PlannerConfig.segments must be a whole number of at least 1, got 0

A rule is a small pure function: the value -> None where it holds, else what the field must be.
(Free-form fields, a path say, go unchecked here.)
"""

from __future__ import annotations

import math
from typing import Any, Callable

Rule = Callable[[Any], "str | None"]


def check_fields(config, **rules: Rule) -> None:
    """A ValueError naming the first field of `config` whose rule fails, its rule and its value."""
    for name, rule in rules.items():
        value = getattr(config, name)
        want = rule(value)
        if want is not None:
            raise ValueError(f"{type(config).__name__}.{name} must be {want}, got {value!r}")


def whole(least: int, none: str | None = None, note: str = "", most: int | None = None) -> Rule:
    """An int (not a bool) of at least `least` (and at most `most`); or None, where `none` says
    what None means. note: what a special value means, said in the message ("0: the planner's
    choice")."""
    want = (f"a whole number of at least {least}" + (f" and at most {most}" if most is not None else "")
            + (f" or None ({none})" if none else "") + (f" ({note})" if note else ""))

    def rule(value):
        if value is None and none is not None:
            return None
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= least and (most is None or value <= most)
        return None if ok else want
    return rule


def number(low: float | None = None, high: float | None = None, *, above: bool = False, below: bool = False) -> Rule:
    """A finite int or float (not a bool) in the interval from `low` to `high` (None: unbounded),
    open at `low` where `above`, at `high` where `below`."""
    if low is not None and high is not None:
        want = f"a number in {'(' if above else '['}{low}, {high}{')' if below else ']'}"
    elif low is not None:
        want = f"a number {'above' if above else 'of at least'} {low}"
    elif high is not None:
        want = f"a number {'below' if below else 'of at most'} {high}"
    else:
        want = "a finite number"

    def rule(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return want
        if low is not None and (value <= low if above else value < low):
            return want
        if high is not None and (value >= high if below else value > high):
            return want
        return None
    return rule


def flag() -> Rule:
    """True or False (not a truthy string such as "no")."""
    return lambda value: None if isinstance(value, bool) else "true or false"


def instance(kind: type) -> Rule:
    """An instance of `kind` (a nested config)."""
    return lambda value: None if isinstance(value, kind) else f"a {kind.__name__}"


def one_of(*choices: str, none: str | None = None) -> Rule:
    """One of `choices`; or None, where `none` says what None means."""
    want = f"one of {', '.join(choices)}" + (f" or None ({none})" if none else "")
    return lambda value: None if (isinstance(value, str) and value in choices) or (value is None and none) else want
