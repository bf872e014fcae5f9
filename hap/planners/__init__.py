"""Planners by name. Each turns (graph, cluster, config) into a Plan that the one runtime runs
and the one cost model prices:

    from hap.planners import make_plan
    plan = make_plan("astar", graph, cluster)        # hap plan --planner astar (the default)

"astar" is hap's synthesis (A* over the rule library, ratios by the LP); "dp-ev", "dp-cp",
"tp", "ep" and "megatron" are the baselines as plans (data parallelism with even or
compute-proportional shares, tensor parallelism, expert parallelism, tensor parallelism with
every linear weight split). Further systems register their own entries
with `@register("name")`.
"""

from __future__ import annotations

from typing import Callable, Protocol

from ..cost.cluster import Cluster
from ..ir import Graph
from ..plan import Plan
from ..planner import PlannerConfig, baseline_plan, plan as synthesize_plan

Progress = Callable[[str], None]


class Planner(Protocol):
    def __call__(self, graph: Graph, cluster: Cluster, config: PlannerConfig, progress: Progress) -> Plan: ...


PLANNERS: dict[str, Planner] = {}
"""Name -> planner, in registration order (`hap plan --planner` offers them)."""


def register(name: str) -> Callable[[Planner], Planner]:
    """Register a planner under `name` (a ValueError if the name is taken)."""
    def add(planner: Planner) -> Planner:
        if name in PLANNERS:
            raise ValueError(f"a planner named {name!r} is already registered")
        PLANNERS[name] = planner
        return planner

    return add


def planner_named(name: str) -> Planner:
    """The planner registered as `name`; an unknown name is a ValueError listing the known ones."""
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(PLANNERS)}")
    return PLANNERS[name]


def make_plan(name: str, graph: Graph, cluster: Cluster, config: PlannerConfig | None = None,
              progress: Progress | None = None) -> Plan:
    """The plan of planner `name` (planner_named) for `graph` on `cluster`."""
    return planner_named(name)(graph, cluster, config or PlannerConfig(), progress or (lambda msg: None))


@register("astar")
def _astar(graph: Graph, cluster: Cluster, config: PlannerConfig, progress: Progress) -> Plan:
    return synthesize_plan(graph, cluster, config, progress=progress)


def _baseline(name: str) -> Planner:
    def planner(graph: Graph, cluster: Cluster, config: PlannerConfig, progress: Progress) -> Plan:
        return baseline_plan(graph, cluster, name, config)

    planner.__doc__ = f"The {name} baseline as a plan (planner.baseline_plan)."
    return planner


for _name in ("dp-ev", "dp-cp", "tp", "ep", "megatron"):
    register(_name)(_baseline(_name))
