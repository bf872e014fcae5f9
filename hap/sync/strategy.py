"""Synchronization strategies (AutoSync's strategy space) and how a plan carries them.

A strategy says, for every parameter whose gradient is synchronized (kept whole by the plan's
program), how many parts it is split into along dim 0 and how each part is synchronized:

    AR(g)            all-reduce in fusion group g: the parts of one group travel as one message,
                     the groups launch in order during the backward
    AR(g, fp16)      the same in half precision (approximate)
    AR(g, powersgd r)  rank-r PowerSGD with error feedback (approximate)
    PS(s)            to parameter server s (a device), which sums and sends back
    +h               hierarchical: inside each machine first, one device per machine across

Short text forms, as in `str(strategy)`: `fc1.weight: PS(0) | PS(2)` (two parts), `bias: AR(1,h)`.
A strategy becomes the plan's `sync` entries (plan.SyncEntry), which is all the runtime reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

from ..cost.model import CostModel, sparse_gradient_bytes, sparse_sent_rows
from ..ir import Graph
from ..plan import Compressor, Plan, SyncEntry, check_sync
from ..rules.nn import sparse_gradient_rows
from ..search.program import NumericShares, sparse_looked_up


@dataclass(frozen=True, slots=True, kw_only=True)
class PartSync:
    """How one part of a parameter's gradient is synchronized."""
    kind: Literal["all_reduce", "ps"]
    group: int = 0
    """all_reduce: the fusion group (groups launch in increasing order)."""
    compressor: Compressor = "none"
    low_rank: int = 1
    server: int = 0
    """ps: the device that reduces and sends back."""
    hierarchical: bool = False

    def __str__(self) -> str:
        h = ",h" if self.hierarchical else ""
        if self.kind == "ps":
            return f"PS({self.server}{h})"
        c = {"none": "", "fp16": ",fp16", "powersgd": f",powersgd {self.low_rank}"}[self.compressor]
        return f"AR({self.group}{c}{h})"

    @property
    def exact(self) -> bool:
        return self.compressor == "none"


@dataclass(frozen=True, slots=True)
class VarSync:
    """A parameter split into len(parts) parts along dim 0 (as even as rows allow), each with
    its synchronizer."""
    param: str
    parts: tuple[PartSync, ...]

    def __str__(self) -> str:
        return f"{self.param}: " + " | ".join(map(str, self.parts))


@dataclass(frozen=True, slots=True)
class SyncStrategy:
    """One synchronizer per part of every synchronized parameter (in the order `Variables` lists them)."""
    vars: tuple[VarSync, ...]

    def __str__(self) -> str:
        return "\n".join(map(str, self.vars))

    @property
    def exact(self) -> bool:
        return all(p.exact for v in self.vars for p in v.parts)

    def to_json(self) -> list:
        return [{"param": v.param, "parts": [_part_dict(p) for p in v.parts]} for v in self.vars]

    @classmethod
    def from_json(cls, data: list) -> "SyncStrategy":
        try:
            return cls(tuple(VarSync(v["param"], tuple(PartSync(**p) for p in v["parts"])) for v in data))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed sync strategy: {e}") from None


def _part_dict(p: PartSync) -> dict:
    return {k: getattr(p, k) for k in PartSync.__slots__}


@dataclass(frozen=True, slots=True)
class Variable:
    """A synchronized parameter as the strategy search sees it."""
    param: str
    """The graph's tensor name."""
    target: str
    """The model's name for it (state_dict key)."""
    shape: tuple[int, ...]
    nbytes: int
    first_use: int
    """Index of the first node that uses it: its gradient is complete when the backward passes there."""
    sparse: bool = False
    """Its gradient is sparse: an embedding's rows looked up in a step (rules.nn.sparse_gradient_rows)."""
    sparse_rows: float = 0
    """For a sparse gradient, the rows its all-gather carries in a step: every rank's, each
    padded to the most any rank holds (cost.model.sparse_sent_rows)."""
    summed_rows: float = 0
    """For a sparse gradient, the most rows of its sum (a server broadcasts it): one per id
    looked up in the step, at most the table (rules.nn.sparse_gradient_rows)."""

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def wire_bytes(self) -> float:
        """The bytes its gradient sends: all of it, or a sparse one's rows with their int64 indices."""
        return sparse_gradient_bytes(self.nbytes, self.rows, self.sparse_rows) if self.sparse else float(self.nbytes)

    @property
    def summed_bytes(self) -> float:
        """The bytes of its summed gradient: all of it, or a sparse one's summed rows with their indices."""
        return sparse_gradient_bytes(self.nbytes, self.rows, self.summed_rows) if self.sparse else float(self.nbytes)


@dataclass(frozen=True, slots=True)
class Variables:
    """The parameters a plan synchronizes, in backprop order (gradients arriving first, first),
    and the devices and machines of the cluster."""
    vars: tuple[Variable, ...]
    devices: int
    machines: tuple[tuple[int, ...], ...] = field(default=())

    @classmethod
    def of(cls, plan: Plan, graph: Graph, machines: Sequence[Sequence[int]] | None = None,
           cost: CostModel | None = None) -> "Variables":
        """The variables of `plan`; with `cost` (of `graph`), a sparse gradient's rows are
        padded as the plan's shares pad them (a plan of one stage; a pipeline's as if unpadded)."""
        synced = {e.param for e in plan.sync}
        sparse = cost.sparse_rows if cost is not None else sparse_gradient_rows(graph)  # (the cost model holds them)
        n = len(plan.devices)
        sent = dict(sparse)  # without a cost model: every rank's rows, unpadded
        if cost is not None and sparse and len(plan.stages) == 1:
            looked_up = sparse_looked_up(plan.steps(graph), cost, plan.segment_of, NumericShares(cost, plan.ratios))
            sent = {name: n * sparse_sent_rows(graph.tensors[name].shape[0], cost.sparse_ids[name],
                                               looked_up.get(name, rows), n) for name, rows in sparse.items()}
        out = []
        for name in synced:
            t = graph.tensors[name]
            out.append(Variable(param=name, target=t.target or name, shape=tuple(t.shape), nbytes=t.nbytes,
                                first_use=min(t.consumers), sparse=name in sparse, sparse_rows=sent.get(name, 0),
                                summed_rows=sparse.get(name, 0)))
        out.sort(key=lambda v: (-v.first_use, v.param))
        return cls(tuple(out), n, tuple(tuple(m) for m in machines) if machines else tuple((d,) for d in range(n)))

    def split(self, var: Variable, parts: int) -> list[tuple[int, int]]:
        """`parts` row ranges, as even as the rows allow (the first ones one longer)."""
        base, extra = divmod(var.rows, parts)
        out, start = [], 0
        for i in range(parts):
            length = base + (i < extra)
            out.append((start, length))
            start += length
        return out

    def key(self, strategy: SyncStrategy) -> tuple[SyncEntry, ...]:
        """What the runtime runs for `strategy` (its sync entries): two strategies of one key
        synchronize alike (groups numbered otherwise, a sparse parameter's group, which buckets
        it alone anyway), so a search measures one of them once."""
        return tuple(self.entries(strategy))

    def entries(self, strategy: SyncStrategy) -> list[SyncEntry]:
        """The plan's sync entries of a strategy, buckets numbered in launch order.

        Every all-reduce group, and every parameter-server part, is one bucket. A bucket can
        start once all its gradients have arrived, so buckets launch in the order in which they
        complete: by the first use of their earliest-used parameter, latest first (ties: groups
        in their order, then servers' parts in backprop order)."""
        by_name = {v.param: v for v in self.vars}
        if {v.param for v in strategy.vars} != set(by_name):
            missing = sorted(set(by_name) ^ {v.param for v in strategy.vars})[:3]
            raise ValueError(f"the strategy does not cover exactly the synchronized parameters: {missing}")
        world = tuple(range(self.devices))
        units: dict[tuple, list[tuple[str, tuple[int, int] | None, PartSync]]] = {}
        for order, vs in enumerate(strategy.vars):
            var = by_name[vs.param]
            if not 1 <= len(vs.parts) <= var.rows:
                raise ValueError(f"{vs.param}: {len(vs.parts)} parts of a parameter with {var.rows} rows")
            if var.sparse and (len(vs.parts) > 1 or vs.parts[0].compressor != "none" or vs.parts[0].hierarchical):
                raise ValueError(f"{vs.param}: a sparse gradient is synchronized whole, uncompressed, not hierarchically")
            ranges = [None] if len(vs.parts) == 1 else self.split(var, len(vs.parts))
            for i, (rows, part) in enumerate(zip(ranges, vs.parts)):
                if var.sparse:  # alone in its bucket
                    key = ("sparse", order, 0)
                elif part.kind == "all_reduce":
                    key = ("ar", part.group, part.compressor, part.low_rank, part.hierarchical)
                else:
                    key = ("ps", order, i)
                units.setdefault(key, []).append((vs.param, rows, part))
        ready = {key: min(by_name[p].first_use for p, _, _ in members) for key, members in units.items()}
        order = sorted(units, key=lambda key: (-ready[key], key[0], key[1:]))
        entries = []
        for bucket, key in enumerate(order):
            for param, rows, part in units[key]:
                entries.append(SyncEntry(param=param, strategy=part.kind, bucket=bucket, devices=world, rows=rows,
                                         compressor=part.compressor, low_rank=part.low_rank,
                                         server=part.server if part.kind == "ps" else None,
                                         hierarchical=part.hierarchical, sparse=by_name[param].sparse))
        check_sync(entries, self.devices)
        return entries


def with_strategy(plan: Plan, variables: Variables, strategy: SyncStrategy) -> Plan:
    """The plan synchronizing its gradients by `strategy` (the estimate is the caller's)."""
    import dataclasses

    check_one_stage(plan)
    return dataclasses.replace(plan, sync=variables.entries(strategy))


def check_one_stage(plan: Plan) -> None:
    """A one-line ValueError for a pipeline plan: AutoSync's strategies are for plans of one
    stage (a pipeline's stages all-reduce every gradient whole, uncompressed, flat, over the
    stages that hold it; hap.Pipeline refused a strategy only once it started)."""
    if len(plan.stages) > 1:
        raise ValueError(f"synchronization strategies are for plans of one stage; this plan is a pipeline of "
                         f"{len(plan.stages)} stages, which all-reduce every gradient whole")
