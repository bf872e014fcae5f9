"""The planner: alternate program synthesis and load balancing (HAP section 3.1).

    B(0) = compute-proportional ratios
    Q(s) = argmin_Q t(Q, B(s-1))      A* synthesis         (search/astar.py)
    B(s) = argmin_B t(Q(s), B)        linear programming   (balance/lp.py)

until the program repeats (converged, or oscillating between programs seen before). The
alternation is run from compute-proportional and from even ratios, every (Q, B) pair met is
priced exactly (integer shards), and the cheapest pair that fits in memory is returned; the
ratios returned are always the ones the returned program was priced with. Data parallelism
with even and compute-proportional ratios (DP-EV, DP-CP) and Megatron-style tensor
parallelism (inputs whole, parameters sharded) are found by the same search restricted to
those families and priced by the same model, and are candidates too: the plan never costs
more than any of them. Graphs with expert weights (Graph.experts, declared by MoE modules) also
get expert parallelism (EP, as in GShard and DeepSpeed-MoE): data parallel with even ratios,
each expert weight sharded on its expert dim with even ratios, tokens moved to and from the
experts by all-to-all.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from .balance.lp import BalanceError, balance
from .config import check_fields, flag, number, one_of, whole
from .cost.cluster import Cluster
from .cost.model import CostModel
from .ir import Graph, size_text
from .placement import Placement
from .plan import Plan, PlanStage, SyncEntry, instructions, shard_sizes
from .rules import has_rule, strategy_table
from .rules.units import ShardClasses
from .search.astar import Frame, Restriction, SearchError, paused_gc, synthesize
from .search.program import Estimate, Step, kept_as, memory, replay, sync_buckets


@dataclass(kw_only=True, slots=True)
class PlannerConfig:
    segments: int = 1
    """Model segments with their own ratios (contiguous, FLOP-balanced); all-to-all at boundaries."""
    max_rounds: int = 6
    """Most Q/B alternations from each starting point."""
    optimizer: Literal["adam", "momentum", "sgd"] = "adam"
    """Optimizer whose state the memory estimate counts."""
    heuristic: bool = True
    """Use the admissible A* heuristic (False: uniform-cost search, for comparison)."""
    baselines: bool = True
    """Also price DP-EV, DP-CP and tensor parallelism."""
    width: int | None = 24
    """Most programs the search expands per node index once it has used its exhaustive budget
    (`width_after`); None: no limit. Searches that never drop a program for it are exhaustive,
    i.e. proven optimal in their space (the plan's `search.exhaustive` says whether all were);
    wide routing code such as MoE gating reaches it and stays fast."""
    width_after: float = 30.0
    """Programs per graph node a search may expand before the width cap applies. ViT, BERT and
    VGG19 need at most about 25 (small models more per node than deep ones), so their plans are
    proven optimal. After one search of a plan outgrows it, the plan's later searches apply
    the cap from the start."""
    pipeline_stages: int = 0
    """Pipeline planners (pp-exact, dqn): stages K (0: the best of 2, 4, 8 and, on up to 8
    devices, one stage per device; groups need not be equal)."""
    micro_batches: int = 0
    """Pipeline planners: micro-batches per iteration (0: the best of K, 2 K and 4 K, at most the
    batch's rows)."""
    schedule: Literal["gpipe", "1f1b"] | None = None
    """Pipeline planners: the schedule (None: the planner's choice, 1f1b; `pipeline_schedule`)."""
    layer_cuts: bool = False
    """Bound the cost of every layer ahead by a search of that layer alone (the A* heuristic,
    see search.astar.synthesize) in the unrestricted searches; False bounds it by its
    computation. The plan is the same either way where the searches are exhaustive. Off by
    default: measured on ViT (1 to 24 layers), VGG19, BERT and BERT-MoE on paper-hetero-8, the
    layer searches cost more than the expansions they save (benchmarks/synthesis_time.py
    --layer-cuts compares)."""

    def __post_init__(self):
        from .cost.model import OPTIMIZER_STATES

        check_fields(self, optimizer=one_of(*OPTIMIZER_STATES), segments=whole(1), max_rounds=whole(1),
                     pipeline_stages=whole(0, note="0: the planner's choice"),
                     micro_batches=whole(0, note="0: the planner's choice"), schedule=one_of("gpipe", "1f1b", none="1f1b"),
                     width=whole(1, none="no limit"), width_after=number(0), heuristic=flag(), baselines=flag(),
                     layer_cuts=flag())

    @property
    def pipeline_asked(self) -> list[str]:
        """The pipeline knobs given (those only the pipeline planners read)."""
        return ([f for f in ("pipeline_stages", "micro_batches") if getattr(self, f)]
                + (["schedule"] if self.schedule is not None else []))

    @property
    def pipeline_schedule(self) -> Literal["gpipe", "1f1b"]:
        """The schedule a pipeline planner uses."""
        return self.schedule or "1f1b"


def batched_inputs(graph: Graph) -> frozenset[str]:
    """The data inputs that carry the batch on dim 0: those whose leading size is the first
    input's (the model's first argument holds the batch, where masks of another size may
    outnumber it). The others (a class-weight vector, a mask of one row) are whole on every
    device under data parallelism."""
    lead = [graph.tensors[name].shape[:1] for name in graph.inputs if graph.tensors[name].shape]
    return frozenset(name for name in graph.inputs if lead and graph.tensors[name].shape[:1] == lead[0])


def _dp(graph: Graph) -> Restriction:
    batched = batched_inputs(graph)

    def allow_load(kind, name, p):
        if kind == "param":
            return p.kind == "R"
        if kind == "input":
            return p.kind == "S" and p.dim == 0 if name in batched else p.kind == "R"
        return p.kind == "R"

    return Restriction(name="data parallelism", allow_load=allow_load, allow_move=lambda mv: not mv.communicates)


def _ep(graph: Graph) -> Restriction:
    """Expert parallelism: expert weights sharded on the expert dim (dim 0), every other
    parameter replicated, inputs split on the batch (batched_inputs); the only collective on activations is
    all-to-all (dispatching tokens to the experts' devices and back).

    With even ratios and E experts not a multiple of the device count the integer shards
    differ by one expert (round_sizes) and the cost model prices the devices holding more.
    Systems built on even expert parallelism cannot do that: they pad E up to a multiple of
    the device count, which this does not model (benchmarks/paper.py prices the padded model).
    """
    experts, batched = frozenset(graph.experts), batched_inputs(graph)

    def allow_load(kind, name, p):
        if kind == "param":
            return (p.kind == "S" and p.dim == 0) if name in experts else p.kind == "R"
        if kind == "input":
            return p.kind == "S" and p.dim == 0 if name in batched else p.kind == "R"
        return p.kind == "R"

    return Restriction(name="expert parallelism", allow_load=allow_load,
                       allow_move=lambda mv: not mv.communicates or mv.name == "all_to_all")


def _baselines(graph: Graph, cluster: Cluster):
    """(name, restriction, ratios) of every baseline family that applies to the graph."""
    dp = _dp(graph)
    out = [("dp_ev", dp, cluster.even()), ("dp_cp", dp, cluster.compute_proportional()), ("tp", _tp(), cluster.even())]
    if graph.experts:
        out.append(("ep", _ep(graph), cluster.even()))
    return out


def _through_casts(graph: Graph, name: str) -> str:
    """The tensor `name` is a dtype cast of (autocast casts a linear layer's weight first), or itself."""
    t = graph.tensors[name]
    while t.producer >= 0 and graph.nodes[t.producer].op in ("aten._to_copy.default", "aten.to.dtype"):
        t = graph.tensors[graph.nodes[t.producer].inputs[0]]
    return t.name


def _params_only(r: Restriction):
    """Keep a restriction's rule for parameters, free the data inputs."""
    return lambda kind, name, p: r.allow_load(kind, name, p) if kind == "param" else True


def _tp() -> Restriction:
    return Restriction(name="tensor parallelism", allow_load=lambda kind, name, p: kind == "param" or p.kind in ("R", "D"))


def _megatron(graph: Graph) -> Restriction:
    """Megatron-style tensor parallelism: every linear layer's weight split (on its output or
    its input features, the search pairs them), data whole on every device. The plan that
    straggler mitigation (hap.straggler) works on. A weight with no dim longer than 1 (a 1x1
    linear) has nothing to split and stays whole."""
    weights = frozenset(w for w in (_through_casts(graph, n.inputs[1]) for n in graph.nodes if n.op == "aten.linear.default")
                        if max(graph.tensors[w].shape, default=1) > 1)

    def allow_load(kind, name, p):
        if kind == "param":
            return p.is_shard if name in weights else True
        return p.kind in ("R", "D")

    return Restriction(name="Megatron tensor parallelism", allow_load=allow_load)


def segment_graph(graph: Graph, segments: int) -> list[int]:
    """Contiguous segments of about equal FLOPs, each cut where the fewest bytes are live."""
    n = len(graph.nodes)
    if segments < 1:
        raise ValueError(f"segments must be at least 1, got {segments}")
    if segments == 1:
        return [0] * n
    if n < 2 * segments:  # a segment of one node has nothing to re-split for (it planned one segment, silently)
        raise ValueError(f"{segments} segments: the model has {n} nodes, enough for at most {max(1, n // 2)}")
    work = [nd.flops + nd.bwd_flops + 1.0 for nd in graph.nodes]
    total = sum(work)
    live = _live_bytes(graph)
    cuts, acc, k = [], 0.0, 0
    for s in range(1, segments):
        target = total * s / segments
        while k < n and acc + work[k] < target:
            acc += work[k]
            k += 1
        lo, hi = (cuts[-1] + 1 if cuts else 1), n - (segments - s)  # every segment keeps a node at least
        at, reach = min(max(k, lo), hi), n // (4 * segments)
        window = range(max(lo, at - reach), min(hi, at + reach) + 1)
        cuts.append(min(window, key=lambda i: (live[i], abs(i - at))))
    seg, out = 0, []
    for i in range(n):
        while seg < len(cuts) and i >= cuts[seg]:
            seg += 1
        out.append(seg)
    return out


def _live_bytes(graph: Graph) -> list[float]:
    """Bytes of activations produced before node i and used at or after it."""
    delta = [0.0] * (len(graph.nodes) + 1)
    for t in graph.tensors.values():
        if t.producer >= 0 and t.consumers:
            delta[t.producer + 1] += t.nbytes
            delta[max(t.consumers) + 1] -= t.nbytes
    out, acc = [], 0.0
    for i in range(len(graph.nodes)):
        acc += delta[i]
        out.append(acc)
    return out


def check_graph_and_cluster(graph, cluster) -> None:
    """A one-line TypeError unless `graph` is a captured Graph and `cluster` a Cluster."""
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a hap Graph (hap.capture(model, example_inputs)), got {type(graph).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a hap Cluster (hap.load_cluster({cluster!r}), say), got {type(cluster).__name__}")


def plan(graph: Graph, cluster: Cluster, config: PlannerConfig | None = None,
         progress: Callable[[str], None] | None = None) -> Plan:
    """Synthesize the fastest program and ratios for `graph` on `cluster` (one stage: a
    pipeline knob of `config` is a ValueError; hap.planners.make_plan("pp-exact", ...) reads them)."""
    config = config or PlannerConfig()
    if config.pipeline_asked:
        raise ValueError(f"PlannerConfig.{config.pipeline_asked[0]} is for the pipeline planners "
                         "(hap.planners.make_plan('pp-exact', ...)); hap.plan synthesizes one stage")
    check_graph_and_cluster(graph, cluster)
    with paused_gc():
        result = _plan(graph, cluster, config, progress)
    result.search = {**result.search, "optimizer": config.optimizer}  # (whose state its memory counts)
    return result


def _plan(graph: Graph, cluster: Cluster, config: PlannerConfig, progress: Callable[[str], None] | None) -> Plan:
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    strategies = strategy_table(graph)
    classes = ShardClasses(graph, enumerate(strategies))
    cost = CostModel(graph, cluster, classes, config.optimizer)
    segment_of = segment_graph(graph, config.segments)
    g = max(segment_of) + 1
    capacity = [d.memory for d in cluster.devices]

    candidates: list[tuple[float, str, list[Step], list[list[float]], Estimate]] = []
    stats = {"rounds": 0, "expanded": 0, "generated": 0, "exhaustive": True, "gap": 0.0}

    frame = Frame(graph, strategies, cost, segment_of)

    def price(name, program, ratios):
        est = frame.replay(program, ratios)  # the alternation meets pairs again; the searches priced some
        candidates.append((est.seconds, name, program, ratios, est))
        return est

    found: dict[tuple, list[Step]] = {}  # (share signature, restriction) -> the program searched for
    known: list[list[Step]] = []  # every program found so far: each search starts bounded by the cheapest

    def search(ratios, restriction=None):
        # Ratios that round alike price alike (CostModel.share_signature): one search serves both.
        # The proven cheapest program of the whole space, where it is of a restricted family, is
        # the family's cheapest too.
        sig = cost.share_signature(ratios)
        if (sig, restriction) in found:
            return found[(sig, restriction)]
        if restriction is not None and (sig, None) in found and restriction.admits(found[(sig, None)], graph):
            return found[(sig, None)]
        # Once a search of this graph outgrew its exhaustive budget, the next ones would too:
        # they apply the width cap from the start.
        # A restricted family (a baseline's) leaves so few programs that bounding its layers by
        # searches of their own costs more than it saves.
        budget = config.width_after if stats["exhaustive"] else 0.0
        res = synthesize(graph, strategies, cost, segment_of, ratios, restriction, heuristic=config.heuristic,
                         layer_bounds=config.layer_cuts and restriction is None, width=config.width, width_after=budget,
                         frame=frame, incumbents=known)
        if res.program not in known:
            known.append(res.program)
        stats["exhaustive"] = stats["exhaustive"] and res.exhaustive
        # the most one of hap's own (unrestricted) searches' programs may cost beyond its optimum
        # (None: unbounded); a baseline family's search bounds only that family
        if restriction is None:
            stats["gap"] = None if stats["gap"] is None or not math.isfinite(res.gap) else max(stats["gap"], res.gap)
        stats["expanded"] += res.expanded
        stats["generated"] += res.generated
        if res.exhaustive:  # only a proven optimum stands for another search
            found[(sig, restriction)] = res.program
        return res.program

    # Data parallelism's program first: as an incumbent it bounds every search from the start,
    # so a search expands only programs that may beat it.
    # (the baselines' own restriction object: the search memo knows restrictions by identity,
    # so the dp_ev baseline below finds this search's program instead of searching again)
    families = _baselines(graph, cluster)
    _baseline_program(search, [list(cluster.even()) for _ in range(g)], families[0][1])
    starts = {"cp": cluster.compute_proportional(), "ev": cluster.even()}
    seen = set()  # programs already balanced, by any chain: balancing again would repeat its work
    for start_name, start in starts.items():
        ratios = [list(start) for _ in range(g)]
        for rnd in range(config.max_rounds):
            stats["rounds"] += 1
            program = search(ratios)
            est = price(f"hap from {start_name}, round {rnd + 1}", program, ratios)
            say(f"round {rnd + 1} from {start_name}: program priced {est.seconds * 1e3:.2f} ms at its input ratios")
            key = tuple(program)
            if key in seen:
                break  # converged, or back to a program already balanced
            seen.add(key)
            try:
                ratios = _balanced(program, cost, segment_of, g, capacity, frame=frame)
            except BalanceError as e:
                say(f"  load balancer: {e}")
                break
            est = price(f"hap from {start_name}, round {rnd + 1} balanced", program, ratios)
            say(f"  balanced ratios {', '.join(f'{x:.3f}' for x in ratios[0])}: {est.seconds * 1e3:.2f} ms")

    searched = len(candidates)  # the alternation's candidates come first
    baselines = {}
    if config.baselines:
        for name, restriction, ratios in families:
            rs = [list(ratios) for _ in range(g)]
            program = _baseline_program(search, rs, restriction)
            est = price(name, program, rs)
            baselines[name] = {"seconds": est.seconds, "memory_bytes": est.memory, "ratios": rs[0], "breakdown": est.breakdown(),
                               "fits": est.fits(capacity)}
            say(f"{name}: {est.seconds * 1e3:.2f} ms")
            # Its program with balanced ratios is a hap candidate too: the alternation's B step
            # from another Q. It matters where the searched programs need more memory than a
            # baseline's (expert parallelism for a large MoE): the balancer respects capacity.
            if tuple(program) not in seen:
                seen.add(tuple(program))
                try:
                    balanced = _balanced(program, cost, segment_of, g, capacity, frame=frame)
                except BalanceError as e:
                    say(f"  {name} balanced: {e}")
                else:
                    est = price(f"hap: {name} program balanced", program, balanced)
                    say(f"  {name} program balanced: {est.seconds * 1e3:.2f} ms")

    if g > 1:  # one segment's plan, every segment at its ratios, is in this space: never do worse
        one = _plan(graph, cluster, dataclasses.replace(config, segments=1), None)  # (its baselines' programs
        # balanced are candidates: where memory is tight they may be the only ones that fit)
        price("hap with one ratio set for every segment", one.steps(graph), [list(one.ratios[0]) for _ in range(g)])
    feasible = [c for c in candidates if c[4].fits(capacity)]
    if not any(c[4].fits(capacity) for c in candidates[:searched]):
        # The search minimises time and ignores memory. When none of its programs fits (a
        # baseline's may: it is no reason to stop looking), search again with the
        # largest parameters sharded (enough that the rest, replicated, takes at most an eighth
        # of the smallest device) and the data split on the batch, and let the balancer fit it.
        big = _largest_params(cost, min(capacity) / 8)
        say(f"no searched program fits in memory: searching with {len(big)} large parameters sharded")
        for split_batch in (True, False):  # the data split on the batch too, or as the search likes
            # (a first layer whose weight is sharded may need its input whole)
            frugal = Restriction(name="sharded parameters", allow_load=lambda kind, name, p, split_batch=split_batch: (
                (p.is_shard or name not in big) if kind == "param"
                else (not split_batch or (p.kind == "S" and p.dim == 0)) if kind == "input" else True))
            for start in (cluster.compute_proportional(), cluster.even()):
                ratios = [list(start) for _ in range(g)]
                try:
                    program = search(ratios, frugal)
                    price("hap with sharded parameters", program, ratios)
                    ratios = _balanced(program, cost, segment_of, g, capacity, frame=frame)
                    price("hap with sharded parameters, balanced", program, ratios)
                except (SearchError, BalanceError) as e:
                    say(f"  {e}")
            if any(c[4].fits(capacity) for c in candidates):
                break
        feasible = [c for c in candidates if c[4].fits(capacity)]
    if not feasible and g > 1 and all(m <= c for m, c in zip(one.memory_bytes, capacity)):
        say(f"no program of {g} segments fits in memory; one segment's does")  # (priced there without re-splits)
        return dataclasses.replace(one, baselines=baselines, synthesis_seconds=time.perf_counter() - t0)
    if not feasible:
        worst = min(candidates, key=lambda c: max(m / cap for m, cap in zip(c[4].memory, capacity)))
        j = max(range(len(capacity)), key=lambda j: worst[4].memory[j] / capacity[j])
        need, has = size_text(worst[4].memory[j]), size_text(capacity[j])
        close = f" ({worst[4].memory[j] - capacity[j]:.0f} bytes too many)" if need == has else ""
        raise BalanceError(f"out of memory: the most frugal program found needs {need} on device {j} "
                           f"({cluster.devices[j].name}), which has {has}{close}")
    seconds, winner, program, ratios, est = min(feasible, key=lambda c: c[0])
    return _assemble(cost, segment_of, program, ratios, est, baselines, time.perf_counter() - t0,
                     {**stats, "winner": winner, "candidates": len(candidates)})


def _balanced(program: Sequence[Step], cost: CostModel, segment_of: Sequence[int], g: int,
              capacity: Sequence[float], tries: int = 4, frame: Frame | None = None) -> list[list[float]]:
    """The load balancer's ratios for `program` whose whole-row shards fit memory. The LP meets
    capacity with continuous shares; rounding them to whole rows may put a device at its limit a
    row over it (the plan was then dropped as not fitting, a slower one taken). Such a device's
    capacity is lowered by its overflow and the LP solved again, a few times at most (a
    BalanceError from the first solve only: later, the last ratios are returned, and the
    planner's memory filter decides). With the planner's `frame`, the memory is its replay's,
    which the planner then prices as a candidate (memory alone cost VGG19's planning 1 ms)."""
    caps = list(capacity)
    facts = frame.facts(program) if frame is not None else None
    memo = frame.lp_prices if frame is not None else None
    ratios = balance(program, cost, segment_of, g, caps, facts, memo).ratios
    for _ in range(tries - 1):
        held = frame.replay(program, ratios).memory if frame is not None else memory(program, cost, segment_of, ratios)
        over = [m - c for m, c in zip(held, capacity)]
        if max(over) <= 0:
            break
        caps = [cap - o * 1.01 if o > 0 else cap for cap, o in zip(caps, over)]
        try:
            ratios = balance(program, cost, segment_of, g, caps, facts, memo).ratios
        except BalanceError:
            break
    return ratios


def baseline_plan(graph: Graph, cluster: Cluster, name: Literal["dp-ev", "dp-cp", "tp", "ep", "megatron"],
                  config: PlannerConfig | None = None, ratios: Sequence[float] | None = None) -> Plan:
    """One baseline as a Plan the runtime runs like any other (for measured comparisons): data
    parallelism with even (DP-EV) or compute-proportional (DP-CP) batch shares, tensor
    parallelism (TP; "megatron": with every linear weight split) or, for graphs with expert
    weights, expert parallelism (EP). `ratios`
    replaces the family's shares per device (data parallelism at any shares, say)."""
    families = {key.replace("_", "-"): (restriction, ratios) for key, restriction, ratios in _baselines(graph, cluster)}
    families["megatron"] = (_megatron(graph), cluster.even())
    if name == "ep" and not graph.experts:
        raise ValueError("baseline 'ep' (expert parallelism) needs expert layers, and this model has none "
                         f"(a module's hap_expert_params); choose {', '.join(families)}")
    if name not in families:
        raise ValueError(f"unknown baseline {name!r} for this graph; choose {', '.join(families)}")
    restriction, start = families[name]
    if ratios is not None:
        if len(ratios) != cluster.size or min(ratios) < 0 or not math.isclose(sum(ratios), 1.0, abs_tol=1e-6):
            raise ValueError(f"ratios must be {cluster.size} non-negative shares summing to 1, got {list(ratios)}")
        start = tuple(ratios)
    winner = name if start is families[name][1] else f"{name}'s program at the given ratios"
    return _plan_at(graph, cluster, [list(start)], config, lambda search, rs: _baseline_program(search, rs, restriction), winner)


def baselines_on(graph: Graph, cluster: Cluster, names: Sequence[str], config: PlannerConfig | None = None) -> dict:
    """The baseline families `names` (as Plan.baselines names them: dp_ev, dp_cp, tp, ep)
    planned and priced on `cluster`, recorded as plan() records them: for a plan taken to
    another cluster, whose baselines were priced on the one it was made for."""
    capacity = [d.memory for d in cluster.devices]
    out = {}
    for name in names:
        p = baseline_plan(graph, cluster, name.replace("_", "-"), config)
        out[name] = {"seconds": p.estimated_iteration_seconds, "memory_bytes": list(p.memory_bytes),
                     "ratios": list(p.ratios[0]), "breakdown": dict(p.breakdown),
                     "fits": all(m <= c for m, c in zip(p.memory_bytes, capacity))}
    return out


def plan_for_layout(graph: Graph, cluster: Cluster, ratios: Sequence[float] | Sequence[Sequence[float]],
                    kept: dict[str, Placement], config: PlannerConfig | None = None,
                    segment_of: Sequence[int] | None = None) -> Plan:
    """The fastest program for `graph` at fixed `ratios` that keeps every parameter and buffer
    in the given placement (`kept`, by graph tensor name), so that it runs on state already
    sharded so: another input shape of a model already training. For a plan of several
    segments, `ratios` per segment and `segment_of`, every node's segment (contiguous, each
    segment at least one node)."""
    def allow_load(kind, name, p):
        return name not in kept or kept[name] == kept_as(p)

    keep = Restriction(name="the parameters' layout", allow_load=allow_load)
    rs = [list(r) for r in ratios] if ratios and isinstance(ratios[0], Sequence) else [list(ratios)]
    segment_of = list(segment_of) if segment_of is not None else [0] * len(graph.nodes)
    if len(segment_of) != len(graph.nodes) or sorted(set(segment_of)) != list(range(len(rs))) \
            or segment_of != sorted(segment_of):
        raise ValueError(f"segment_of must give each of the graph's {len(graph.nodes)} nodes one of the {len(rs)} "
                         "segments of the ratios, in order, each segment at least one node")
    return _plan_at(graph, cluster, rs, config, lambda search, rs: search(rs, keep), "planned for this shape", segment_of)


def assemble_one(cost: CostModel, program: list[Step], ratios: Sequence[float], seconds: float, search: dict) -> Plan:
    """The one-segment Plan of a program other planners found (the operator-partitioning DQN),
    priced by the same replay."""
    segment_of = [0] * len(cost.graph.nodes)
    rs = [list(ratios)]
    return _assemble(cost, segment_of, program, rs, replay(program, cost, segment_of, rs), {}, seconds, search)


def _plan_at(graph: Graph, cluster: Cluster, rs: list[list[float]], config: PlannerConfig | None,
             find: Callable, winner: str, segment_of: list[int] | None = None) -> Plan:
    """A plan at fixed ratios (per segment; `segment_of`: every node's, default one segment)
    whose program `find(search, ratios)` finds, where search(ratios, restriction) runs the
    synthesis."""
    config = config or PlannerConfig()
    t0 = time.perf_counter()
    strategies = strategy_table(graph)
    classes = ShardClasses(graph, enumerate(strategies))
    cost = CostModel(graph, cluster, classes, config.optimizer)
    segment_of = segment_of if segment_of is not None else [0] * len(graph.nodes)
    exhaustive = []

    def search(ratios, restriction):
        res = synthesize(graph, strategies, cost, segment_of, ratios, restriction, layer_bounds=config.layer_cuts,
                         width=config.width)
        exhaustive.append(res.exhaustive)
        return res.program

    program = find(search, rs)
    est = replay(program, cost, segment_of, rs)
    return _assemble(cost, segment_of, program, rs, est, {}, time.perf_counter() - t0,
                     {"winner": winner, "exhaustive": all(exhaustive), "family": True})


def estimate(graph: Graph, cluster: Cluster, plan: Plan, config: PlannerConfig | None = None) -> Estimate:
    """A plan's program priced again under this graph's node times and this cluster (say, times
    measured anew): the same replay that priced it when it was planned."""
    return replayed(graph, cluster, plan, config)[1]


def priced(graph: Graph, cluster: Cluster, plan: Plan, config: PlannerConfig | None = None) -> Plan:
    """`plan` with its estimate (seconds, breakdown, timeline, memory) priced again, as
    `estimate` prices it; a plan whose sync entries came from elsewhere than its program's
    buckets (plan.search["sync"]: `hap sync`, `resync`) with them, as sync.price prices them; a
    pipeline's by its pricer (pipeline.plan.priced_pipeline). Its search record names the
    optimizer whose state the memory now counts."""
    plan = dataclasses.replace(plan, search={**plan.search, "optimizer": (config or PlannerConfig()).optimizer})
    if len(plan.stages) > 1:
        from .pipeline.plan import priced_pipeline  # (the pipeline plans with the planner)

        return priced_pipeline(graph, cluster, plan, config)
    cost, est = replayed(graph, cluster, plan, config)
    plan = dataclasses.replace(plan, estimated_iteration_seconds=est.seconds, breakdown=est.breakdown(),
                               timeline=timeline(est), memory_bytes=list(est.memory), written="")  # (priced now)
    if "sync" not in plan.search:
        return plan
    from .sync.price import with_estimate  # (hap.sync plans with the planner)

    return with_estimate(plan, graph, cost, est, searched=plan.search["sync"])


def replayed(graph: Graph, cluster: Cluster, plan: Plan, config: PlannerConfig | None = None) -> tuple[CostModel, Estimate]:
    """The cost model of this graph, cluster and optimizer, and the plan's program replayed on it."""
    if len(plan.devices) != cluster.size:
        raise ValueError(f"the plan is for {len(plan.devices)} devices, cluster {cluster.name!r} has {cluster.size}")
    classes = ShardClasses(graph, enumerate(strategy_table(graph)))
    cost = CostModel(graph, cluster, classes, (config or PlannerConfig()).optimizer)
    return cost, replay(plan.steps(graph), cost, plan.segment_of, plan.ratios)


def rebalanced_ratios(graph: Graph, cluster: Cluster, plan: Plan, speeds: Sequence[float],
                      config: PlannerConfig | None = None) -> list[list[float]]:
    """The load balancer (balance.lp) re-solved for the plan's own program on devices whose
    speeds are now `speeds` (relative, one per device: 0.125 for one running at an eighth of
    the others): each device's compute and memory throughput scaled by its speed over the
    fastest. What runtime straggler mitigation reshards to when a slowdown persists."""
    slowed = slowed_cluster(cluster, speeds)
    classes = ShardClasses(graph, enumerate(strategy_table(graph)))
    cost = CostModel(graph, slowed, classes, (config or PlannerConfig()).optimizer)
    segment_of = plan.segment_of
    return _balanced(plan.steps(graph), cost, segment_of, len(plan.segments), [d.memory for d in slowed.devices])


def slowed_cluster(cluster: Cluster, speeds: Sequence[float], overheads: bool = False) -> Cluster:
    """`cluster` with each device's compute and memory throughput scaled by its relative speed
    (`speeds`, one per device, the fastest standing for its nominal speed): what the planners
    see of devices measured running slower than their cluster file says. overheads=True also
    stretches each device's cost per node, for speeds measured over all of a device's
    computing (a pipeline's), not its multiplications alone."""
    if len(speeds) != cluster.size or min(speeds) <= 0:
        raise ValueError(f"speeds must be {cluster.size} positive numbers, got {list(speeds)}")
    top = max(speeds)
    devices = tuple(dataclasses.replace(d, flops=d.flops * s / top, mem_bandwidth=d.mem_bandwidth * s / top,
                                        op_overhead=d.op_overhead * (top / s if overheads else 1.0))
                    for d, s in zip(cluster.devices, speeds))
    return dataclasses.replace(cluster, devices=devices)


def _baseline_program(search, ratios, restriction: Restriction) -> list[Step]:
    """The cheapest program of a baseline's family. Where the family has none (data parallelism
    forbids all communication, and some graphs need it on activations), only its rule for
    parameters is kept."""
    try:
        return search(ratios, restriction)
    except SearchError:
        return search(ratios, Restriction(name=restriction.name, allow_load=_params_only(restriction)))


def _assemble(cost: CostModel, segment_of, program, ratios, est, baselines, seconds, search) -> Plan:
    """The Plan of a program priced by `cost` (whose graph, cluster and shard classes it is)."""
    graph, cluster, classes = cost.graph, cost.cluster, cost.classes
    devices = list(range(cluster.size))
    sync: list[SyncEntry] = []
    for bucket in sync_buckets(program, graph, segment_of, cost.bucket_of):
        dense = [name for name in bucket if name not in cost.sparse_rows]
        for group in ([dense] if dense else []) + [[name] for name in bucket if name in cost.sparse_rows]:
            b = len({e.bucket for e in sync})  # a sparse gradient goes alone, after its bucket's dense ones
            sync += [SyncEntry(param=name, bucket=b, devices=tuple(devices), sparse=name in cost.sparse_rows)
                     for name in group]
    stage = PlanStage(devices=devices, nodes=[0, len(graph.nodes) - 1], segments=_segment_ranges(segment_of), ratios=ratios,
                      program=instructions(program, graph), shards=shard_sizes(program, graph, classes, segment_of, ratios))
    return Plan(
        model=graph.model_name, cluster=cluster.to_dict(), devices=[d.name for d in cluster.devices],
        stages=[stage], sync=sync, schedule=None,
        estimated_iteration_seconds=est.seconds, breakdown=est.breakdown(),
        timeline=timeline(est),
        memory_bytes=est.memory, baselines=baselines, synthesis_seconds=seconds,
        replicated_ops=sorted({n.op for n in graph.nodes if not has_rule(n.op)}), search=search,
    )


def timeline(est: Estimate) -> dict:
    """An estimate as the plan keeps it: per stage its collectives (forward and backward
    seconds) and each device's computation; per gradient bucket its seconds and the stage
    whose backward it waits for; the loss's and generator's per-step syncs (`hap explain`
    draws the iteration from these)."""
    return {
        "stages": [{"collectives": s.collectives, "comm": s.comm, "comm_bwd": s.comm_bwd, "fwd": list(s.fwd), "bwd": list(s.bwd)}
                   for s in est.stages],
        "buckets": [{"bucket": b.bucket, "bytes": b.nbytes, "seconds": b.seconds, "stage": b.stage} for b in est.buckets],
        "step_sync": est.seconds - sum(s.seconds for s in est.stages) - est.grad_sync,
    }


def _largest_params(cost: CostModel, budget: float) -> set[str]:
    """The parameters with the most state, as few as leave at most `budget` bytes for the rest."""
    params = sorted((name for name, t in cost.graph.tensors.items() if t.kind == "param"), key=lambda n: -cost.state_bytes(n))
    rest = sum(cost.state_bytes(name) for name in params)
    chosen = set()
    for name in params:
        if rest <= budget:
            break
        chosen.add(name)
        rest -= cost.state_bytes(name)
    return chosen


def _segment_ranges(segment_of: list[int]) -> list[list[int]]:
    ranges: list[list[int]] = []
    for i, s in enumerate(segment_of):
        if s == len(ranges):
            ranges.append([i, i])
        ranges[s][1] = i
    return ranges


