"""Planners by name. Each turns (graph, cluster, config) into a Plan that the one runtime runs
and the one cost model prices:

    from hap.planners import make_plan
    plan = make_plan("astar", graph, cluster)        # hap plan --planner astar (the default)
    plan = make_plan("pp-exact", graph, cluster, PlannerConfig(pipeline_stages=4))   # a pipeline

"pp-exact" and "dqn" cut the data-parallel program into a pipeline (exactly, or by
Auto-MAP's DQN); "dqn-opp" splits parameters with the data whole (Auto-MAP's operator
partitioning; A*'s space contains it); "auto" keeps the fastest estimate of astar and pp-exact.
"astar" is hap's synthesis (A* over the rule library, ratios by the LP); "dp-ev", "dp-cp",
"tp", "ep" and "megatron" are the baselines as plans (data parallelism with even or
compute-proportional shares, tensor parallelism, expert parallelism, tensor parallelism with
every linear weight split). Further systems register their own entries
with `@register("name")`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal, Protocol

from ..cost.cluster import Cluster
from ..ir import Graph
from ..plan import Plan
from ..planner import PlannerConfig, baseline_plan, check_graph_and_cluster, plan as synthesize_plan

Progress = Callable[[str], None]


class Planner(Protocol):
    def __call__(self, graph: Graph, cluster: Cluster, config: PlannerConfig, progress: Progress) -> Plan: ...


Knob = Literal["pipeline", "segments"]
"""PlannerConfig fields that only some planners read: "pipeline" (pipeline_stages,
micro_batches, schedule) and "segments"."""

PLANNERS: dict[str, Planner] = {}
"""Name -> planner, in registration order (`hap plan --planner` offers them)."""

KNOBS: dict[str, frozenset[Knob]] = {}
"""Name -> the optional knobs the planner reads (the command line refuses the others)."""


def register(name: str, reads: tuple[Knob, ...] = ()) -> Callable[[Planner], Planner]:
    """Register a planner under `name` (a ValueError if the name is taken) that reads the
    optional knobs `reads`."""
    def add(planner: Planner) -> Planner:
        if name in PLANNERS:
            raise ValueError(f"a planner named {name!r} is already registered")
        PLANNERS[name] = planner
        KNOBS[name] = frozenset(reads)
        return planner

    return add


def reading(knob: Knob) -> list[str]:
    """The planners that read `knob`, in registration order."""
    return [name for name in PLANNERS if knob in KNOBS[name]]


def planner_named(name: str) -> Planner:
    """The planner registered as `name`; an unknown name is a ValueError listing the known ones."""
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(PLANNERS)}")
    return PLANNERS[name]


def make_plan(name: str, graph: Graph, cluster: Cluster, config: PlannerConfig | None = None,
              progress: Progress | None = None) -> Plan:
    """The plan of planner `name` (planner_named) for `graph` on `cluster`. A knob of `config`
    the planner does not read (KNOBS) is a ValueError: it would be ignored."""
    planner, config = planner_named(name), config or PlannerConfig()
    asked = {"pipeline": config.pipeline_asked, "segments": ["segments"] if config.segments > 1 else []}
    for knob, fields in asked.items():
        if fields and knob not in KNOBS[name]:
            raise ValueError(f"PlannerConfig.{fields[0]} is for the planners {', '.join(reading(knob))}, not {name}")
    check_graph_and_cluster(graph, cluster)
    plan = planner(graph, cluster, config, progress or (lambda msg: None))
    plan.search = {**plan.search, "optimizer": config.optimizer}  # (whose state its memory counts)
    return plan


@register("astar", reads=("segments",))
def _astar(graph: Graph, cluster: Cluster, config: PlannerConfig, progress: Progress) -> Plan:
    one_stage = dataclasses.replace(config, pipeline_stages=0, micro_batches=0, schedule=None)  # (auto's)
    return synthesize_plan(graph, cluster, one_stage, progress=progress)


def _baseline(name: str) -> Planner:
    def planner(graph: Graph, cluster: Cluster, config: PlannerConfig, progress: Progress) -> Plan:
        return baseline_plan(graph, cluster, name, config)

    planner.__doc__ = f"The {name} baseline as a plan (planner.baseline_plan)."
    return planner


for _name in ("dp-ev", "dp-cp", "tp", "ep", "megatron"):
    register(_name)(_baseline(_name))


@register("pp-exact", reads=("pipeline",))
def _pp_exact(graph: Graph, cluster: Cluster, config: PlannerConfig, progress: Progress) -> Plan:
    """A pipeline (hap.pipeline): the exact optimal cut for each stage count (--pipeline-stages)."""
    from ..pipeline.plan import exact_plan
    return exact_plan(graph, cluster, config, progress)


@register("dqn", reads=("pipeline",))
def _dqn(graph: Graph, cluster: Cluster, config: PlannerConfig, progress: Progress) -> Plan:
    """A pipeline whose cuts Auto-MAP's DQN places (hap.automap.pipeline)."""
    from ..automap.pipeline import dqn_plan
    return dqn_plan(graph, cluster, config, progress)


@register("dqn-opp")
def _dqn_opp(graph: Graph, cluster: Cluster, config: PlannerConfig, progress: Progress) -> Plan:
    """Operator partitioning (data whole, parameters split) found by Auto-MAP's DQN (hap.automap.opp)."""
    from ..automap.opp import opp_plan
    return opp_plan(graph, cluster, config.optimizer, progress=progress)


@register("auto", reads=("pipeline", "segments"))
def _auto(graph: Graph, cluster: Cluster, config: PlannerConfig, progress: Progress) -> Plan:
    """The fastest estimate among hap's synthesis and the exact pipeline, priced by the one
    cost model (a pipeline that cannot run this model drops out, with the reason in progress;
    a planner that cannot honour a knob the config sets for it, segments or pipeline stages and
    micro-batches, is a ValueError)."""
    candidates, reasons = [], []
    asked = {"astar": config.segments > 1, "pp-exact": bool(config.pipeline_asked)}
    for name in ("astar", "pp-exact"):
        try:
            candidates.append(PLANNERS[name](graph, cluster, config, progress))
        except ValueError as e:
            if asked[name]:  # what the user asked of it (--segments, --pipeline-stages ...) cannot be: say so
                raise ValueError(f"auto: {name} cannot plan as asked: {e}") from None
            progress(f"auto: {name} has no plan: {e}")
            reasons.append(f"{name}: {e}")
    if not candidates:
        raise ValueError(f"no planner found a plan ({'; '.join(reasons)})")
    for p in candidates:
        progress(f"auto: {p.search.get('planner', 'astar')} {p.estimated_iteration_seconds * 1e3:.2f} ms")
    best = min(candidates, key=lambda p: p.estimated_iteration_seconds)
    kept = best.search.get("planner") or "astar"
    note = None  # the knobs were for a plan that lost: said, and kept in the plan (its summary says it too)
    if asked["pp-exact"] and kept != "pp-exact":
        knobs = "/".join("--" + f.replace("_", "-") for f in config.pipeline_asked)
        note = (f"auto: kept {kept}'s plan, faster than the pipeline {knobs} asked for "
                "(plan with --planner pp-exact for that pipeline)")
    elif asked["astar"] and kept != "astar":
        note = (f"auto: kept {kept}'s plan, faster than astar's of the --segments asked for (plan with --planner "
                "astar for those segments)")
    if note:
        progress(note)
    best.search = {**best.search, **({"note": note} if note else {}),
                   "auto": {(p.search.get("planner") or "astar"): p.estimated_iteration_seconds for p in candidates}}
    return best
