"""What a synchronization strategy costs: AutoSync's analytic model and hap's own.

AutoSync (supplement, sections 1-3) prices a strategy as T = max(Tcomp, Tsync):
- a parameter server j carries, for every variable part v on it (Eq. 2),
      sum_k Id(j,k) r_k^(1-Ip) c(m_v) / b_jk   (messages each way: x2, push and pull)
    + sum_k Id(j,k) r_k^(1-Ip) phi           (network overhead, per worker or per replica)
    + delta                                   (memory-copy and kernel latency)
  with k the other machines, r_k their devices, Ip hierarchical reduction, c(m) the message
  after compression; Tsync^PS is the most loaded server's time;
- a collective (Eq. 3) costs 2(w-1)/w c(m) / b_min + w phi + delta for an all-reduce over w
  devices whose ring's slowest link is b_min (per fusion group: one message); hierarchically,
  the reduce inside machines and the ring among one device per machine;
- Tsync = Tsync^PS + Tsync^CC; phi the network latency, delta the collectives' launch overhead.

hap's own pricing (`overlapped`) replays the plan's iteration with the strategy's buckets as the
runtime runs them (runtime/gradsync.py): each bucket's first collective starts once its gradients
are complete (at the backward of the stage where its earliest parameter is first used) and the
buckets before it have started, one collective at a time on the link; what depends on its result
runs after the backward, bucket after bucket. Every collective is priced over its device group on
the cluster's topology (CostModel.group_collective), as the emulated links also take them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..cost.model import CostModel
from ..cost.topology import LAUNCH_OVERHEAD
from ..ir import Graph
from ..plan import Plan, SyncEntry
from ..search.program import Estimate
from .strategy import Variables


@dataclass(frozen=True, slots=True)
class Bucket:
    """One launch unit of a strategy, as both prices see it."""
    entries: tuple[SyncEntry, ...]
    nbytes: float
    """The bytes of gradient it synchronizes (whole parts, before compression)."""
    first_use: int
    """The earliest first use among its parameters (it is complete when the backward passes it)."""


def buckets(entries: list[SyncEntry], variables: Variables) -> list[Bucket]:
    by_param = {v.param: v for v in variables.vars}
    out: dict[int, list[SyncEntry]] = {}
    for e in entries:
        out.setdefault(e.bucket, []).append(e)
    result = []
    for b in sorted(out):
        es = tuple(out[b])
        nbytes = sum(_part_bytes(by_param[e.param], e) for e in es)
        result.append(Bucket(es, nbytes, min(by_param[e.param].first_use for e in es)))
    return result


def _part_bytes(var, e: SyncEntry) -> float:
    """A part's gradient bytes; a sparse gradient's: every rank's rows with their indices."""
    return var.wire_bytes * (e.rows[1] / var.rows if e.rows is not None else 1.0)


def _summed_bytes(bucket: Bucket, variables: Variables) -> float:
    """What a server broadcasts for a sparse gradient's bucket (alone in it): the summed rows,
    not the padded ones it gathered."""
    return next(v for v in variables.vars if v.param == bucket.entries[0].param).summed_bytes


def message_bytes(bucket: Bucket, variables: Variables) -> tuple[float, float]:
    """Bytes of its first and second message: the gradient (half for fp16), or PowerSGD's two
    factors, P then Q (rank r: r * (rows + rest) elements per part, uncompressible parts whole)."""
    e = bucket.entries[0]
    if e.compressor == "fp16":
        return bucket.nbytes / 2, 0.0
    if e.compressor != "powersgd":
        return bucket.nbytes, 0.0
    by_param = {v.param: v for v in variables.vars}
    p = q = 0.0
    for part in bucket.entries:
        var = by_param[part.param]
        rows = part.rows[1] if part.rows is not None else var.rows
        rest = max(1, math.prod(var.shape[1:]))
        item = var.nbytes / max(1, math.prod(var.shape))
        if min(rows, rest) > part.low_rank:
            p += part.low_rank * rows * item
            q += part.low_rank * rest * item
        else:
            p += rows * rest * item
    return p, q


# -- AutoSync's analytic model -------------------------------------------------------------------

def analytic(entries: list[SyncEntry], variables: Variables, cost: CostModel, compute_seconds: float) -> float:
    """T = max(Tcomp, Tsync), Eq. 1-3 of AutoSync's supplement, on the cluster's topology."""
    topo = cost.cluster.topology
    machines = variables.machines
    phi = _latency(cost)
    servers: dict[int, float] = {}
    collective = 0.0
    for b in buckets(entries, variables):
        e = b.entries[0]
        first, second = message_bytes(b, variables)
        if e.sparse:  # every rank's rows: all-gathered (each receives the others'), or in to a server and the sum out
            w = variables.devices
            if e.strategy == "ps":
                out = _summed_bytes(b, variables)
                servers[e.server] = servers.get(e.server, 0.0) + (w - 1) / w * (first + out) / _ring_bandwidth(
                    topo, range(w), cost) + w * phi + LAUNCH_OVERHEAD
            else:
                collective += (w - 1) / w * first / _ring_bandwidth(topo, range(w), cost) + w * phi + LAUNCH_OVERHEAD
            continue
        if e.strategy == "ps":
            j = e.server
            home = next(m for m in machines if j in m)
            t = LAUNCH_OVERHEAD
            for m in machines:
                if m is home:
                    continue
                copies = 1 if e.hierarchical else len(m)
                bw = _bandwidth(topo, j, m[0], cost)
                t += copies * (2 * first / bw + phi)
            servers[j] = servers.get(j, 0.0) + t
        else:
            w = variables.devices
            if e.hierarchical:
                leaders = [m[0] for m in machines]
                # each machine's ring at once: the slowest one (not the largest) ends it
                t = max((2 * (len(m) - 1) / len(m) * first / _ring_bandwidth(topo, m, cost) for m in machines if len(m) > 1),
                        default=0.0)
                if len(leaders) > 1:
                    t += 2 * (len(leaders) - 1) / len(leaders) * first / _ring_bandwidth(topo, leaders, cost)
                t += len(leaders) * phi + LAUNCH_OVERHEAD
            else:
                t = 2 * (w - 1) / w * (first + second) / _ring_bandwidth(topo, range(w), cost) + w * phi + LAUNCH_OVERHEAD
            collective += t
    return max(compute_seconds, max(servers.values(), default=0.0) + collective)


def _latency(cost: CostModel) -> float:
    topo = cost.cluster.topology
    if topo is None:
        return cost.cluster.fit("all_reduce").alpha
    return max(m.nic.latency for m in topo.machines)


def _bandwidth(topo, a: int, b: int, cost: CostModel) -> float:
    if topo is None:
        return cost.cluster.fit("broadcast").beta
    return topo.link(a, b).bandwidth


def _ring_bandwidth(topo, group, cost: CostModel) -> float:
    if topo is None:
        return cost.cluster.fit("broadcast").beta
    return topo.ring_link(list(group)).bandwidth


# -- hap's own: the runtime's overlap, on the plan's iteration ------------------------------------

def phases(bucket: Bucket, variables: Variables, cost: CostModel) -> tuple[float, float]:
    """Seconds of a bucket's first collective (overlapping the backward) and of what follows it
    after the backward, as runtime/gradsync.py runs it (the slowest machine's where they differ)."""
    e = bucket.entries[0]
    first, second = message_bytes(bucket, variables)
    world = range(variables.devices)
    price = cost.group_collective
    if e.sparse:  # the row counts, then the rows: all-gathered, or gathered to the server, which sends the sum
        gather = price("all_gather", 8.0 * variables.devices, world) + price("all_gather", first, world)
        return gather, price("broadcast", _summed_bytes(bucket, variables), world) if e.strategy == "ps" else 0.0
    if not e.hierarchical:
        if e.strategy == "ps":
            return price("reduce", first, world), price("broadcast", first, world)
        return price("all_reduce", first, world), price("all_reduce", second, world) if second else 0.0
    machines = variables.machines
    leaders = [e.server if e.server is not None and e.server in m else m[0] for m in machines]
    inside = max((price("reduce", first, m) for m in machines), default=0.0)
    back = max((price("broadcast", first, m) for m in machines), default=0.0)
    if e.strategy == "ps":
        across = price("reduce", first, leaders) + price("broadcast", first, leaders)
    else:
        across = price("all_reduce", first, leaders)
    return inside, across + back


def backward_clock(est: Estimate) -> tuple[dict[int, float], float]:
    """Seconds into the backward (last stage first) at which each stage's backward computation
    is done, and the backward's length (its collectives included)."""
    clock, done_at = 0.0, {}
    for i in reversed(range(len(est.stages))):
        clock += max(est.stages[i].bwd)
        done_at[i] = clock
        clock += est.stages[i].comm_bwd
    return done_at, clock


@dataclass(frozen=True, slots=True)
class Phases:
    """One bucket as `overlapped` runs it, in seconds from the start of the backward."""
    bucket: int
    method: str
    """SyncEntry.method of its entries."""
    nbytes: float
    stage: int
    """The stage whose backward completes its gradients."""
    start: float
    seconds: float
    """Its first collective, overlapping the backward."""
    then_start: float
    then: float
    """What depends on that collective's result, after the backward."""


def schedule(entries: list[SyncEntry], variables: Variables, cost: CostModel, est: Estimate) -> tuple[list[Phases], float]:
    """Every bucket's phases in launch order, and the backward's end with the sync's tail (seconds
    from the start of the backward): the first collectives one at a time on the link, each once
    its gradients are complete and the buckets before it have started; the rest after the
    backward, bucket after bucket."""
    done_at, backward = backward_clock(est)
    launched = wire = 0.0
    firsts = []
    for b in buckets(entries, variables):
        first, then = phases(b, variables, cost)
        stage = est.stage_of[b.first_use]
        launched = max(launched, done_at[stage])
        start = max(wire, launched)
        wire = start + first
        firsts.append((b, stage, start, first, then))
    end, out = backward, []
    for b, stage, start, first, then in firsts:
        then_start = max(end, start + first)
        end = then_start + then
        out.append(Phases(b.entries[0].bucket, b.entries[0].method, b.nbytes, stage, start, first, then_start, then))
    return out, end


def overlapped(entries: list[SyncEntry], variables: Variables, cost: CostModel, est: Estimate) -> float:
    """The plan's iteration seconds with its gradients synchronized by `entries`."""
    _, end = schedule(entries, variables, cost, est)
    _, backward = backward_clock(est)
    forward = est.seconds - est.grad_sync - backward - cost.step_overhead
    return forward + end + cost.step_overhead


def with_estimate(plan: Plan, graph: Graph, cost: CostModel, est: Estimate, searched: str) -> Plan:
    """`plan` estimated with its gradients synchronized by its own sync entries, as `overlapped`
    prices them: its seconds, breakdown and timeline (the buckets' phases, which `hap explain`
    draws). `est` is the replay of its program under `cost`; `searched` says where the entries
    came from (plan.search["sync"]: planner.priced prices such a plan this way from then on)."""
    variables = Variables.of(plan, graph, cost.cluster.machines, cost)
    phased, end = schedule(plan.sync, variables, cost, est)
    _, backward = backward_clock(est)
    exposed = max(0.0, end - backward)
    breakdown = {**est.breakdown(), "gradient_sync": exposed,  # (max: not -2e-18, a rounding of a sum)
                 "gradient_sync_overlapped": max(0.0, sum(p.seconds + p.then for p in phased) - exposed)}
    timeline = {**plan.timeline, "buckets": [], "sync": [dataclasses.asdict(p) for p in phased]}
    return dataclasses.replace(plan, estimated_iteration_seconds=overlapped(plan.sync, variables, cost, est),
                               breakdown=breakdown, timeline=timeline, search={**plan.search, "sync": searched},
                               written="")  # (priced now: a plan read from a file is current again)
