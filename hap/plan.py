"""The Plan (format version 2): everything the runtime needs to train, and the estimates.

A plan is typed, self-contained plain data (names, placements as text, numbers), so a plan
written by `hap plan` is loaded by the runtime on every rank and checked against the graph
there; the runtime needs nothing else from the planner:

- stages: each a device group (ranks), the program it runs (one Instruction per node), its
  segments with their ratios, and the integer shard size of every sharded (tensor, dim,
  segment). One stage spans all devices today; several form a pipeline with a `schedule`.
- sync: per parameter the runtime keeps whole (or per part of it along dim 0), how its gradient
  is synchronized (all-reduce, possibly compressed, or a parameter server; hierarchically
  inside machines or not), in which bucket (launch order) and over which device group.
- the estimate (iteration seconds, breakdown, timeline, memory), the baselines priced by
  the same cost model, and how the search went.

Version-1 files (before stages) are refused with a one-line error: plan again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, get_args

from .cost.model import OPTIMIZER_STATES
from .ir import Graph, size_text  # noqa: F401 (size_text: plan.size_text too)
from .pipeline.schedule import SCHEDULES, ScheduleName
from .placement import Placement, parse
from .rules import Strategy
from .rules.units import ShardClasses
from .search.moves import Move
from .search.program import Load, MoveStep, Step, split_walk

FORMAT_VERSION = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveOp:
    """A layout change before a node: `name` (search.moves) turns `tensor` from src to dst with
    the forward collective `fwd` and the backward collective `bwd` (None: local)."""
    tensor: str
    name: str
    src: str
    dst: str
    fwd: str | None
    bwd: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Instruction:
    """One node of the program: its strategy, the placement of every input and output, the
    leaves it loads and the moves before it. Placements are in their text form (S(0), R, P, D)."""
    node: str
    op: str
    strategy: str
    local: str | None
    """The strategy's local variant (e.g. sync-batch), if any."""
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    loads: tuple[tuple[str, str], ...]
    moves: tuple[MoveOp, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSize:
    """The integer rows of every device of a stage on one sharded (tensor, dim) in one segment."""
    tensor: str
    dim: int
    segment: int
    sizes: tuple[int, ...]


@dataclass(slots=True, kw_only=True)
class PlanStage:
    """A program that a group of devices runs. A plan of several stages is a pipeline."""
    devices: list[int]
    """The device group: the ranks that run this stage, in the order its ratios list them."""
    nodes: list[int]
    """[first, last] index of the graph's nodes this stage runs."""
    segments: list[list[int]]
    """Per segment, [first node index, last node index]: regions with their own ratios."""
    ratios: list[list[float]]
    """ratios[segment][i]: the share of self.devices[i], from the load balancer."""
    program: list[Instruction]
    shards: list[ShardSize]
    """Every sharded (tensor, dim, segment) with its integer sizes per device."""


Synchronizer = Literal["all_reduce", "ps"]
Compressor = Literal["none", "fp16", "powersgd"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncEntry:
    """How the runtime synchronizes the gradient of one parameter it keeps whole, or of one
    part of it (rows along dim 0): the parts of a parameter cover it exactly."""
    param: str
    strategy: Synchronizer = "all_reduce"
    """all_reduce: summed by one collective per bucket; ps: reduced to the `server` device,
    which sends the sum back (runtime/gradsync.py). Both overlap the backward."""
    bucket: int
    """Buckets launch in this order, each once all its gradients have arrived; the entries of
    a bucket are fused into one message and must agree on how they are synchronized."""
    devices: tuple[int, ...]
    """The device group that sums it."""
    rows: tuple[int, int] | None = None
    """(start, length) along dim 0: this part of the parameter; None: all of it."""
    compressor: Compressor = "none"
    """all_reduce only: fp16 sends half precision; powersgd sends a rank-`low_rank`
    factorization with error feedback (both approximate: runtime/gradsync.py)."""
    low_rank: int = 1
    """PowerSGD's rank."""
    server: int | None = None
    """ps: the device that reduces and sends back."""
    hierarchical: bool = False
    """Reduce inside each machine first (to one device per machine), then across machines, then
    send back inside each machine: only one device per machine uses the network."""
    sparse: bool = False
    """The gradient is sparse (an embedding with sparse=True): all_reduce all-gathers every
    rank's (row indices, rows), ps gathers them to the server, which sends back their sum. Such
    an entry is its parameter's only one and alone in its bucket, uncompressed, not hierarchical."""

    @property
    def how(self) -> tuple:
        """What the entries of one bucket share."""
        return self.strategy, self.compressor, self.low_rank, self.server, self.hierarchical, self.devices, self.sparse

    @property
    def method(self) -> str:
        """How it is synchronized, in words: "all-reduce", "all-reduce (fp16)", "all-reduce
        (PowerSGD rank 2)", "server 2"; a sparse gradient's "rows all-gathered" or "rows to
        server 2"; ", hierarchical" where so."""
        if self.strategy == "ps":
            how = f"{'rows to ' if self.sparse else ''}server {self.server}"
        elif self.sparse:
            how = "rows all-gathered"
        else:
            how = "all-reduce" + {"none": "", "fp16": " (fp16)", "powersgd": f" (PowerSGD rank {self.low_rank})"}[self.compressor]
        return how + (", hierarchical" if self.hierarchical else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """How a plan of several stages pipelines its micro-batches."""
    name: ScheduleName
    micro_batches: int


def sync_mismatch(planned: set[str], whole: set[str]) -> str | None:
    """What is wrong where a plan's sync entries name other parameters than those its program
    keeps whole (and the runtime must synchronize), or None."""
    if planned == whole:
        return None
    extra, missing = sorted(planned - whole)[:3], sorted(whole - planned)[:3]
    return ("the plan's sync does not match its program:"
            + (f" {extra} synced but not parameters the program keeps whole" if extra else "")
            + (";" if extra and missing else "")
            + (f" {missing} kept whole but not synced" if missing else ""))


def _is_share(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < math.inf


def _same_split(stage: PlanStage, node: int, mv: MoveOp) -> bool:
    """Whether `mv`, before node `node`, is a rebalance between segments that split its tensor
    alike: the runtime moves nothing there and the estimate prices it at 0 (the summary counted
    it among the instructions)."""
    if mv.name != "rebalance":
        return False
    seg = next((k for k, (a, b) in enumerate(stage.segments) if a <= node <= b), 0)
    sizes = {sh.segment: sh.sizes for sh in stage.shards if sh.tensor == mv.tensor and f"S({sh.dim})" == mv.src}
    return seg > 0 and sizes.get(seg - 1) is not None and sizes.get(seg - 1) == sizes.get(seg)


def _is_file(text: str) -> bool:
    """Whether `text` names a file (JSON text, a name too long for the system, is not one)."""
    try:
        return Path(text).is_file()
    except OSError:  # (ENAMETOOLONG: a plan's JSON given as text)
        return False


def _number(x, positive: bool = True) -> bool:
    """Whether a plan file's x is a finite number (not a bool), positive or at least not negative
    (beyond a sum's rounding: plans written before breakdowns were clamped hold -2e-18)."""
    # (an int of 400 digits raised OverflowError in isfinite: one no float holds is not a number here)
    finite = math.isfinite(x) if isinstance(x, float) else isinstance(x, int) and abs(x) <= sys.float_info.max
    return finite and not isinstance(x, bool) and (x > 0 if positive else x >= -1e-12)


# the fields the runtime and summary() read, of the types they read them as (the timeline is
# explain's, which says when it cannot draw it)
_FIELD_TYPES = {"model": str, "cluster": dict, "devices": list, "estimated_iteration_seconds": (int, float),
                "breakdown": dict, "memory_bytes": list, "baselines": dict, "synthesis_seconds": (int, float),
                "replicated_ops": list, "search": dict, "written": str}


@dataclass(kw_only=True)
class Plan:
    model: str
    cluster: dict
    """The cluster spec (Cluster.to_dict())."""
    devices: list[str]
    stages: list[PlanStage]
    sync: list[SyncEntry]
    """Per synchronized parameter, in launch order."""
    schedule: Schedule | None
    """For more than one stage: the pipeline schedule; None for one stage."""
    estimated_iteration_seconds: float
    breakdown: dict[str, float]
    timeline: dict
    """The estimate, for `hap explain`: `stages` between collectives ({collectives, comm,
    comm_bwd, fwd and bwd per device} in seconds), gradient `buckets` ({bucket, bytes, seconds,
    stage}) and `step_sync` seconds (planner.timeline)."""
    memory_bytes: list[float]
    baselines: dict[str, dict]
    """dp_ev, dp_cp, tp: {seconds, memory_bytes, ratios, breakdown} under the same cost model."""
    synthesis_seconds: float
    replicated_ops: list[str]
    """Ops without a sharding rule: they run replicated (each listed once)."""
    search: dict = field(default_factory=dict)
    """How the plan was found: planner, rounds, expansions, which candidate won."""
    written: str = ""
    """The `written_digest` of the plan when hap wrote it (to_json; "" for a plan priced and not
    written since): a file whose content (cluster, stages, schedule, sync) or estimate was edited
    since no longer matches, and its estimate is then of the plan as hap priced it
    (`edited_since_written`)."""
    version: int = FORMAT_VERSION

    def __post_init__(self):
        if not self.stages:
            raise ValueError("a plan needs at least one stage")
        if len(self.stages) > 1 and self.schedule is None:
            raise ValueError(f"a plan of {len(self.stages)} stages needs a pipeline schedule")
        check_sync(self.sync, len(self.devices))

    # -- the one stage of a plan without pipeline ----------------------------------------------

    @property
    def stage(self) -> PlanStage:
        """The plan's stage, for a plan of one (every plan the runtime runs today)."""
        if len(self.stages) != 1:
            raise ValueError(f"this plan is a pipeline of {len(self.stages)} stages: run it with hap.Pipeline, not hap.HAP")
        return self.stages[0]

    @property
    def ratios(self) -> list[list[float]]:
        return self.stage.ratios

    @property
    def segments(self) -> list[list[int]]:
        return self.stage.segments

    @property
    def program(self) -> list[Instruction]:
        return self.stage.program

    def shard_sizes(self, tensor: str, dim: int, segment: int = 0) -> list[int] | None:
        """The plan's integer sizes of `tensor` on `dim` in `segment`, or None if not sharded so."""
        for sh in self.stage.shards:
            if (sh.tensor, sh.dim, sh.segment) == (tensor, dim, segment):
                return list(sh.sizes)
        return None

    def with_ratios(self, ratios: list[list[float]], shards: list[ShardSize]) -> "Plan":
        """This plan at other ratios (after a reshard); the estimate is the caller's to update
        (planner.priced): until then it is marked edited_since_written."""
        written = self.written if self.edited_since_written else self.written_digest
        return dataclasses.replace(self, stages=[dataclasses.replace(self.stage, ratios=ratios, shards=shards)],
                                   written=written)

    # -- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return _plain(self)

    def to_json(self, path: str | Path | None = None) -> str:
        """The plan as JSON (written to `path` where given), stamped with the digest of its
        content and estimate; a plan edited since hap priced it keeps its old stamp, so that
        saving it again does not make its stale estimate look current."""
        plain = self.to_dict()  # (the stamp and its check read its fields, not _plain of them again)
        written = self.written if _stale(self.written, plain.__getitem__) else _stamp(plain.__getitem__)
        text = json.dumps({**plain, "written": written}, indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        if not isinstance(d, dict):
            raise ValueError(f"malformed plan: a JSON object is expected, not a {type(d).__name__}")
        version = d.get("version")
        if "version" not in d:  # (a cluster file or another JSON given for a plan)
            raise ValueError(f"not a hap plan: a plan (what `hap plan --json` writes) has a \"version\" field, this "
                             f"object has {', '.join(map(repr, list(d)[:4])) or 'no fields'}"
                             f"{' ...' if len(d) > 4 else ''}")
        if isinstance(version, bool):  # (True == 1)
            raise ValueError(f"plan format version {version!r} is not {FORMAT_VERSION}")
        if version == 1:
            raise ValueError("this is a version-1 plan (before stages and per-parameter sync): plan the model again "
                             "with `hap plan`")
        if version != FORMAT_VERSION:
            raise ValueError(f"plan format version {version!r} is not {FORMAT_VERSION}")
        d = dict(d)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = next((k for k in d if k not in fields), None)
        missing = next((name for name, f in fields.items() if name not in d and f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING), None)
        if unknown or missing:  # (they were Python's words: "Plan.__init__() missing 1 required keyword-only ...")
            raise ValueError(f"malformed plan: {f'unknown field {unknown!r}' if unknown else f'no field {missing!r}'}")
        d["stages"] = [_stage_from_dict(st, k) for k, st in enumerate(_list(d["stages"], "stages"))]
        d["sync"] = [_object(SyncEntry, e, f"sync entry {i}", devices=lambda x: tuple(_list(x, f"sync entry {i}'s devices")),
                             rows=lambda x: None if x is None else tuple(_list(x, f"sync entry {i}'s rows")))
                     for i, e in enumerate(_list(d["sync"], "sync"))]
        if d.get("schedule") is not None:
            d["schedule"] = _object(Schedule, d["schedule"], "its schedule")
        try:
            plan = cls(**d)
        except (TypeError, AttributeError) as e:
            raise ValueError(f"malformed plan: {e}") from None
        plan._validate()
        return plan

    def _validate(self) -> None:
        """Fields of their types, the stages' device groups split the plan's devices once each,
        their node ranges follow one another from node 0, every stage has a share (finite, at
        least 0) per device of its group, and sync groups name the plan's devices: a ValueError
        otherwise."""
        for name, kind in _FIELD_TYPES.items():  # a hand-edited file: what summary() and the runtime read
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"malformed plan: {name} is a {type(value).__name__}")
        if not all(_number(v, positive=False) for v in [*self.breakdown.values(), *self.memory_bytes]):
            raise ValueError("malformed plan: breakdown and memory_bytes must hold finite numbers, none negative")
        if not isinstance(self.cluster.get("name"), str):  # (name: 5 printed "on 5")
            raise ValueError(f"malformed plan: its cluster's name must be text, got {_short(self.cluster.get('name'))}")
        if not all(isinstance(x, str) for x in self.replicated_ops):
            raise ValueError("malformed plan: replicated_ops must be a list of op names")
        cluster_devices = self.cluster.get("devices", [])
        if not isinstance(cluster_devices, list) or not all(isinstance(d, dict) for d in cluster_devices):
            raise ValueError("malformed plan: its cluster's devices must be a list of objects")
        sched = self.schedule
        if sched is not None and (sched.name not in SCHEDULES or not isinstance(
                sched.micro_batches, int) or isinstance(sched.micro_batches, bool) or sched.micro_batches < 1):
            raise ValueError(f"malformed plan: pipeline schedule {sched.name!r} of {sched.micro_batches!r} micro-batches "
                             "(gpipe or 1f1b, of 1 micro-batch at least)")
        if sched is not None and len(self.stages) == 1:  # (accepted, and ignored)
            raise ValueError("malformed plan: a plan of one stage has no pipeline schedule; its schedule must be null")
        n = len(self.devices)
        groups = [list(st.devices) if isinstance(st.devices, (list, tuple)) else st.devices for st in self.stages]
        if not all(isinstance(g, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in g) for g in groups):
            raise ValueError(f"malformed plan: the stages' device groups {groups} must be lists of device numbers")
        if sorted(d for g in groups for d in g) != list(range(n)):
            raise ValueError(f"malformed plan: the stages' device groups {groups} do not split its {n} devices once each")
        if len(groups) == 1 and groups[0] != list(range(n)):  # its ratios go to the ranks in order
            raise ValueError(f"malformed plan: a one-stage plan runs on its devices in rank order, not {groups[0]}")
        spans = [list(st.nodes) for st in self.stages]
        ok = all(len(sp) == 2 and all(isinstance(x, int) for x in sp) and sp[0] <= sp[1] for sp in spans)
        if not ok or spans[0][0] != 0 or any(b[0] != a[1] + 1 for a, b in zip(spans, spans[1:])):
            raise ValueError(f"malformed plan: the stages' node ranges {spans} must cover the model's nodes in order, "
                             "from node 0, without gaps")
        for k, st in enumerate(self.stages):
            if not isinstance(st.ratios, list) or not all(isinstance(row, list) for row in st.ratios):
                raise ValueError(f"malformed plan: stage {k}'s ratios {st.ratios} must be a row of shares per segment")
            if not isinstance(st.segments, list) or not st.segments or len(st.ratios) != len(st.segments):
                raise ValueError(f"malformed plan: stage {k} has ratios {st.ratios} for {st.segments!r} segments: a "
                                 "row of shares per segment")
            if any(len(row) != len(st.devices) for row in st.ratios):
                raise ValueError(f"malformed plan: stage {k} has {len(st.devices)} devices but ratios {st.ratios}")
            if not all(_is_share(x) for row in st.ratios for x in row) or not all(
                    0 < sum(row) < math.inf for row in st.ratios):
                raise ValueError(f"malformed plan: stage {k}'s ratios {st.ratios} must be finite shares at least 0, "
                                 "some positive, of a finite sum")
            if st.nodes[1] - st.nodes[0] + 1 != len(st.program):
                raise ValueError(f"malformed plan: stage {k} runs nodes {st.nodes} with a program of {len(st.program)} "
                                 "instructions, one per node")
        for k, st in enumerate(self.stages):
            segs = st.segments
            if not all(isinstance(x, list) and len(x) == 2 and all(isinstance(y, int) for y in x) for x in segs) \
                    or segs[0][0] != st.nodes[0] or segs[-1][1] != st.nodes[1] \
                    or any(b[0] != a[1] + 1 or a[0] > a[1] for a, b in zip(segs, segs[1:])):
                raise ValueError(f"malformed plan: stage {k}'s segments {segs} must cover its nodes {st.nodes} in "
                                 "order, without gaps")
            bad_shard = next((sh for sh in st.shards if not isinstance(sh.segment, int) or isinstance(sh.segment, bool)
                              or not 0 <= sh.segment < len(segs)), None)
            if bad_shard is not None:
                raise ValueError(f"malformed plan: stage {k} splits {bad_shard.tensor} in segment {bad_shard.segment!r} "
                                 f"of its {len(segs)}")
            whole = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
            pieces = None if len(self.stages) > 1 else len(st.devices)  # (a pipeline stage's: per micro-batch piece)
            bad_shard = next((sh for sh in st.shards if not whole(sh.dim) or not isinstance(sh.sizes, (list, tuple))
                              or len(sh.sizes) != (pieces or len(sh.sizes)) or not all(map(whole, sh.sizes))), None)
            if bad_shard is not None:
                raise ValueError(f"malformed plan: stage {k} splits {bad_shard.tensor} dim {bad_shard.dim!r} into "
                                 f"{list(bad_shard.sizes)!r}: a dim and a whole number of rows per device of the stage")
        if not all(isinstance(b, dict) and _number(b.get("seconds")) for b in self.baselines.values()):
            raise ValueError("malformed plan: every baseline needs its seconds, a finite positive number")
        if not all(_number(x) for x in (self.estimated_iteration_seconds,
                                        *[d.get("memory", 1) for d in self.cluster.get("devices", [])])):
            raise ValueError("malformed plan: its estimate and its devices' memory must be finite positive numbers")
        if self.search.get("gap") is not None and not isinstance(self.search["gap"], (int, float)):
            raise ValueError(f"malformed plan: search gap {self.search['gap']!r} is not a number")
        if self.search.get("optimizer", "sgd") not in OPTIMIZER_STATES:
            raise ValueError(f"malformed plan: search optimizer {self.search['optimizer']!r} is none of "
                             f"{', '.join(OPTIMIZER_STATES)}")
        bad = next((e for e in self.sync if not set(e.devices) <= set(range(n))), None)
        if bad is not None:
            raise ValueError(f"malformed plan: {bad.param} is synchronized over devices {list(bad.devices)} of {n}")
        if len(self.memory_bytes) not in (0, n):
            raise ValueError(f"malformed plan: memory_bytes has {len(self.memory_bytes)} entries for {n} devices")

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> "Plan":
        text, where = str(path_or_text), "malformed plan"
        # a Path, or text that is not JSON, or a file's name beginning with "{", is a file
        if isinstance(path_or_text, Path) or not text.lstrip().startswith("{") or _is_file(text):
            where = f"plan file {text}"
            try:
                text = Path(path_or_text).read_text()
            except OSError as e:  # (a bare FileNotFoundError, IsADirectoryError)
                raise ValueError(f"{where}: cannot read it ({e.strerror})") from None
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not a text file (a plan is JSON)") from None
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError(f"{where}: its JSON nests too deeply") from None
        except json.JSONDecodeError as e:  # (it said "Expecting value: line 1 column 1 (char 0)", naming no plan)
            raise ValueError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(data)

    @property
    def digest(self) -> str:
        """A hash of the stages and sync: ranks compare it at start-up."""
        return self._hash("stages", "sync")

    @property
    def content_digest(self) -> str:
        """A hash of everything the estimate prices: the cluster, devices, stages, schedule and sync."""
        return self._hash(*CONTENT_FIELDS)

    def _hash(self, *fields: str) -> str:
        return _digest({f: self._plain_field(f) for f in fields})

    @property
    def written_digest(self) -> str:
        """A hash of what to_json stamps as `written`: the content and its estimate together, so
        that an edit of either shows."""
        return _stamp(self._plain_field)

    @property
    def edited_since_written(self) -> bool:
        """Whether this plan's estimate may not be of its content: a file hap wrote, edited since
        (its content or its estimate), or a plan changed since it was priced (with_ratios); its
        estimate, breakdown and timeline are then of the plan as hap priced it. (Files written
        before 2026-11-29 stamped the content alone.)"""
        return _stale(self.written, self._plain_field)

    def _plain_field(self, name: str):
        return _plain(getattr(self, name))

    def device_groups(self) -> list[tuple[int, ...]]:
        """Every device group the plan names (stages, synchronization), once, in a fixed order:
        the runtime creates a process group for each at start-up."""
        groups = [tuple(st.devices) for st in self.stages] + [e.devices for e in self.sync]
        return sorted(set(groups))

    # -- rebinding to a graph ------------------------------------------------------------------

    @property
    def segment_of(self) -> list[int]:
        """The segment of every node, by node index."""
        return [s for s, (first, last) in enumerate(self.segments) for _ in range(first, last + 1)]

    def steps(self, graph: Graph, stage: int | None = None) -> list[Step]:
        """The program (of stage `stage`, for a pipeline) as Steps over `graph` (which must be
        the graph the plan was made for)."""
        by_name = {n.name: n for n in graph.nodes}
        steps = []
        for ins in (self.program if stage is None else self.stages[stage].program):
            node = by_name.get(ins.node)
            if node is None or node.op != ins.op:
                raise ValueError(f"plan does not match the model: node {ins.node} ({ins.op}) not in the graph")
            st = Strategy(tuple(parse(p) for _, p in ins.inputs), tuple(parse(p) for _, p in ins.outputs),
                          ins.strategy, ins.local)
            loads = tuple(Load(t, parse(p)) for t, p in ins.loads)
            moves = tuple(MoveStep(mv.tensor, Move(mv.name, parse(mv.src), parse(mv.dst), mv.fwd, mv.bwd))
                          for mv in ins.moves)
            steps.append(Step(node.index, st, loads, moves))
        return steps

    def check_fits(self, graph: Graph) -> None:
        """A one-line ValueError unless this plan is of `graph` and runs on it: it runs every node
        once, takes every tensor as it holds it there (_check_held: re-split where a segment of
        other sizes starts, on dims the tensor has), with strategies and moves the rules and the
        move catalogue give (_check_steps), splits tensors into the sizes this graph's batch gives
        (they change with the batch), and synchronizes what the runtime must (check_sync_fits)."""
        from .pipeline.stages import stage_pieces
        from .rules import strategy_table
        from .rules.units import ShardClasses

        try:
            stage_steps = [self.steps(graph, k) for k in range(len(self.stages))]
            program = [st for steps in stage_steps for st in steps]
            table = strategy_table(graph)
            classes = ShardClasses(graph, enumerate(table))
            pieces = None
            if self.schedule is not None:  # a pipeline stage's shards are its pieces'
                pieces = stage_pieces(graph, classes, program, [st.ratios[0] for st in self.stages],
                                      self.schedule.micro_batches)
        except ValueError as e:
            raise ValueError(f"{e} (a plan made for another model or batch? hap plan's --scale is paper by default, "
                             "hap train's small)") from None
        ran = sorted(step.node for step in program)
        if ran != list(range(len(graph.nodes))):
            missing = sorted(set(range(len(graph.nodes))) - set(ran))
            what = f"does not run node {graph.nodes[missing[0]].name}" if missing else "runs a node twice"
            raise ValueError(f"the plan {what} of this model's {len(graph.nodes)}: a plan made for another model")
        one = len(self.stages) == 1  # (a pipeline stage has one segment)
        segment_ratios = self.stages[0].ratios  # (apart from the shard loop's `ratios` below, reassigned)
        _check_held(graph, stage_steps, self.segment_of if one else None,
                    (lambda name, dim, seg: classes.split_sizes(name, dim, segment_ratios[seg])) if one else None)
        _check_steps(graph, program, table)
        self.check_sync_fits(graph, stage_steps)
        self.check_shards(graph, classes, pieces)

    def check_shards(self, graph: Graph, classes, pieces: list[list[float]] | None = None) -> None:
        """A one-line ValueError unless every shard size the plan states is the one this graph's
        rounding gives (classes: its ShardClasses; pieces: a pipeline's shares per stage,
        pipeline.stages.stage_pieces): the same model and batch, the same rounding on every rank."""
        for k, stage in enumerate(self.stages):
            for sh in stage.shards:
                ratios = stage.ratios[sh.segment] if pieces is None else pieces[k]
                if sh.tensor in graph.tensors and sh.dim >= len(graph.tensors[sh.tensor].shape):
                    raise ValueError(f"the plan splits {sh.tensor} dim {sh.dim}, a tensor of "
                                     f"{len(graph.tensors[sh.tensor].shape)} dims (a hand-edited plan?)")
                mine = classes.split_sizes(sh.tensor, sh.dim, ratios) if sh.tensor in graph.tensors else None
                if mine is not None and list(mine) != list(sh.sizes) and sum(mine) == sum(sh.sizes):
                    # (the same whole: it blamed another model or batch)
                    if pieces is None:
                        by = f"stage {k}'s ratios {list(ratios)}"
                        edited = "its ratios or shards were edited"
                    else:  # (a pipeline stage's pieces: every micro-batch over the stage's devices)
                        by = (f"stage {k}'s {len(ratios) // len(stage.devices)} micro-batches over its devices at "
                              f"{list(stage.ratios[0])}")
                        edited = "its schedule's micro-batches, its ratios or its shards were edited"
                    raise ValueError(f"the plan splits {sh.tensor} dim {sh.dim} into {list(sh.sizes)}, but {by} split "
                                     f"it into {list(mine)}: {edited}")
                if mine is None or list(mine) != list(sh.sizes):
                    raise ValueError(f"the plan splits {sh.tensor} dim {sh.dim} into {list(sh.sizes)}, this model "
                                     f"{'has no ' + sh.tensor if mine is None else 'into ' + str(list(mine))}: a plan "
                                     "made for another model or batch")

    def check_sync_fits(self, graph: Graph, stage_steps: list[list[Step]] | None = None) -> None:
        """A one-line ValueError unless the sync entries are those the runtime must run for this
        program of `graph`: every trainable parameter it keeps whole, once (whole, or in parts
        that cover its dim 0), over the devices that hold it -- all of a one-stage plan's; for
        a pipeline, those of the stages that use it, which all-reduce it whole -- and sparse
        where its gradient is (a one-stage plan's). stage_steps: self.steps(graph, k) per stage."""
        from .pipeline.plan import synced_groups
        from .rules.nn import sparse_gradient_rows
        from .search.program import synced_params

        unknown = sorted({e.param for e in self.sync} - set(graph.params))
        if unknown:
            raise ValueError(f"the plan synchronizes {unknown[:3]}, which are not parameters of this model")
        stage_steps = stage_steps or [self.steps(graph, k) for k in range(len(self.stages))]
        pipeline = len(self.stages) > 1
        if pipeline:
            groups = synced_groups(graph, stage_steps, [st.devices for st in self.stages])
        else:
            everyone = tuple(self.stages[0].devices)
            groups = {name: everyone for name in synced_params(stage_steps[0], graph, self.segment_of)}
        mismatch = sync_mismatch({e.param for e in self.sync}, set(groups))
        if mismatch:
            raise ValueError(mismatch)
        sparse = {} if pipeline else sparse_gradient_rows(graph)
        ends: dict[str, int] = {}  # (check_sync made a parameter's parts cover dim 0 from 0, without gaps)
        for e in self.sync:
            if tuple(e.devices) != groups[e.param]:
                raise ValueError(f"the plan synchronizes {e.param} over devices {list(e.devices)}, not over those that "
                                 f"hold it, {list(groups[e.param])}")
            if pipeline and (e.strategy, e.compressor, e.rows, e.hierarchical, e.sparse) != ("all_reduce", "none", None, False, False):
                raise ValueError(f"the plan synchronizes {e.param} by {e.method}{' in parts' if e.rows else ''}: a "
                                 "pipeline all-reduces every gradient whole, uncompressed, flat")
            if e.sparse != (e.param in sparse):
                raise ValueError(f"the plan synchronizes {e.param}'s gradient as {'sparse' if e.sparse else 'dense'}, "
                                 f"but this model's is {'sparse' if e.param in sparse else 'dense'}")
            if e.rows is not None:
                ends[e.param] = max(ends.get(e.param, 0), e.rows[0] + e.rows[1])
        for name, end in ends.items():
            shape = graph.tensors[name].shape
            if not shape:
                raise ValueError(f"the plan syncs rows of {name}, a number: it has none (sync it whole)")
            if end != shape[0]:
                raise ValueError(f"the plan syncs rows 0..{end} of {name}, which has {shape[0]}")

    # -- text ----------------------------------------------------------------------------------

    def _how(self) -> str:
        """' (planner, Q/B rounds)' as far as the search record says."""
        parts = [str(self.search["planner"])] if "planner" in self.search else []
        if "rounds" in self.search:
            parts.append(f"{self.search['rounds']} Q/B rounds")
        return f" ({', '.join(parts)})" if parts else ""

    def _memory_parts(self) -> str:
        """' (what memory_bytes counts)' where the search record names the optimizer priced."""
        optimizer = self.search.get("optimizer")
        if optimizer is None:
            return ""
        state = "" if optimizer == "sgd" else f", {optimizer} state"
        return f" (parameters, gradients{state}, activations)"

    def summary(self) -> str:
        lines = [f"model {self.model} on {self.cluster['name']} ({len(self.devices)} devices)",
                 f"  synthesis {self.synthesis_seconds:.2f} s{self._how()}, winner: {self.search.get('winner', '?')}"
                 + ("" if self.search.get("exhaustive", True) else
                    " (its programs searched width-limited: the best found, not proven the best of them)"
                    if self.search.get("family") else
                    f" ({'a DQN' if str(self.search.get('planner', '')).startswith('dqn') else 'width-limited'} "
                    "search: best found, not proven optimal"
                    + (f"; each of its searches' programs within {self.search['gap']:.0%} of that search's optimum" if self.search.get("gap") is not None else "")
                    + ")"),
                 f"  estimated iteration {self.estimated_iteration_seconds * 1e3:.1f} ms  ("
                 + ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.1f} ms" for k, v in self.breakdown.items()) + ")"]
        if self.search.get("note"):
            lines.append(f"  note: {self.search['note']}")
        for name, b in self.baselines.items():
            speedup = b["seconds"] / self.estimated_iteration_seconds if self.estimated_iteration_seconds else float("nan")
            lines.append(f"  {name:6s} {b['seconds'] * 1e3:9.1f} ms   hap is {speedup:.2f}x" + ("" if b.get("fits", True) else "  (does not fit in memory)"))
        if self.schedule is not None:
            lines.append(f"  pipeline: {len(self.stages)} stages, {self.schedule.micro_batches} micro-batches, {self.schedule.name}")
            for k, st in enumerate(self.stages):
                lines.append(f"  stage {k}: nodes {st.nodes[0]}-{st.nodes[1]} on devices {st.devices}, ratios "
                             + " ".join(f"{x:.3f}" for x in st.ratios[0]))
        else:
            for s, r in enumerate(self.ratios):
                lines.append(f"  ratios segment {s}: " + " ".join(f"{x:.3f}" for x in r))
                idle = self.idle_devices(s)
                if idle:
                    lines.append(f"  note: devices {idle} get none of any split tensor in segment {s} (at these "
                                 "ratios the dims the plan splits, batch rows, heads or features, have too few to reach them)")
        lines.append(f"  memory per GPU{self._memory_parts()}: {' '.join(size_text(b) for b in self.memory_bytes)}")
        caps = [d.get("memory") for d in self.cluster.get("devices", [])]
        over = [j for j, (b, cap) in enumerate(zip(self.memory_bytes, caps)) if cap and b > cap]
        if over:
            j = max(over, key=lambda j: self.memory_bytes[j] / caps[j])
            lines.append(f"  DOES NOT FIT: device {j} needs {size_text(self.memory_bytes[j])} of its {size_text(caps[j])} "
                         f"({len(over)} device{'s' if len(over) > 1 else ''} over)")
        kinds: dict[str, int] = {}
        for st in self.stages:
            for i, ins in enumerate(st.program):
                kinds[ins.strategy] = kinds.get(ins.strategy, 0) + 1
                for mv in ins.moves:
                    if (mv.fwd or mv.bwd) and not _same_split(st, st.nodes[0] + i, mv):
                        kinds[mv.name] = kinds.get(mv.name, 0) + 1
        lines.append("  instructions: " + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
        if self.replicated_ops:
            lines.append(f"  replicated (no sharding rule): {', '.join(self.replicated_ops)}")
        return "\n".join(lines)

    def idle_devices(self, segment: int) -> list[int]:
        """Devices of the one-stage plan given a share of `segment` but no element of any tensor
        it splits there (integer shard sizes: a batch of 2 rows over 4 devices leaves 2 idle)."""
        st = self.stage
        shards = [sh.sizes for sh in st.shards if sh.segment == segment]
        if not shards:
            return []
        return [st.devices[j] for j, r in enumerate(st.ratios[segment]) if r > 0 and all(sizes[j] == 0 for sizes in shards)]

    def listing(self) -> str:
        out = []
        for k, ins in ((k, ins) for k, st in enumerate(self.stages) for ins in st.program):
            if len(self.stages) > 1 and ins is self.stages[k].program[0]:
                out.append(f"# stage {k} on devices {self.stages[k].devices}")
            for mv in ins.moves:
                dual = f", backward {mv.bwd}" if mv.bwd else ""
                out.append(f"  {mv.tensor} | {mv.src} -> {mv.dst}   {mv.name} [{mv.fwd or 'local'}{dual}]")
            for t, p in ins.loads:
                out.append(f"  {t} | {p}   load")
            ins_text = ", ".join(f"{t}:{p}" for t, p in ins.inputs)
            outs_text = ", ".join(f"{t}:{p}" for t, p in ins.outputs)
            out.append(f"{outs_text} = {ins.op.removeprefix('aten.')}({ins_text})   # {ins.strategy}")
        return "\n".join(out)


def check_sync(sync: list[SyncEntry], devices: int) -> None:
    """ValueError, in one line, for sync entries the runtime cannot run: a device out of range, a
    server outside its group, a compressor on a parameter server or a hierarchical all-reduce, a
    bucket whose entries disagree on how they are synchronized, a sparse gradient split,
    compressed or sharing its bucket, a parameter whose parts overlap or leave gaps, a flag that
    is not a boolean."""
    how: dict[int, tuple] = {}
    parts: dict[str, list[tuple[int, int] | None]] = {}
    for e in sync:
        for field_, value in (("strategy", e.strategy), ("compressor", e.compressor)):
            known = get_args(Synchronizer if field_ == "strategy" else Compressor)
            if value not in known:
                raise ValueError(f"sync of {e.param}: unknown {field_} {value!r}; choose {', '.join(map(repr, known))}")
        if not isinstance(e.bucket, int) or isinstance(e.bucket, bool):
            raise ValueError(f"sync of {e.param}: bucket must be an integer, got {e.bucket!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in e.devices):
            raise ValueError(f"sync of {e.param}: devices must be device numbers, got {list(e.devices)}")
        if not isinstance(e.low_rank, int) or isinstance(e.low_rank, bool):
            raise ValueError(f"sync of {e.param}: PowerSGD rank must be an integer, got {e.low_rank!r}")
        for flag in ("hierarchical", "sparse"):
            if not isinstance(getattr(e, flag), bool):
                raise ValueError(f"sync of {e.param}: {flag} must be true or false, got {getattr(e, flag)!r}")
        if e.server is not None and (not isinstance(e.server, int) or isinstance(e.server, bool)):
            raise ValueError(f"sync of {e.param}: parameter server must be a device number, got {e.server!r}")
        if e.rows is not None and (len(e.rows) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                                for x in e.rows)):
            raise ValueError(f"sync of {e.param}: rows must be [start, length], got {list(e.rows)}")
        if not e.devices or min(e.devices) < 0 or max(e.devices) >= devices or len(set(e.devices)) != len(e.devices):
            raise ValueError(f"sync of {e.param}: devices {list(e.devices)} are not distinct devices of the plan's {devices}")
        if e.strategy == "ps" and e.server not in e.devices:
            raise ValueError(f"sync of {e.param}: parameter server {e.server} is not one of its devices {list(e.devices)}")
        if e.strategy != "ps" and e.server is not None:
            raise ValueError(f"sync of {e.param}: a server is named but the strategy is {e.strategy}")
        if e.compressor != "none" and e.strategy != "all_reduce":
            raise ValueError(f"sync of {e.param}: compressor {e.compressor} runs with all_reduce only, not {e.strategy}")
        if e.compressor != "none" and e.hierarchical:  # the rooted reduction sends gradients as they are
            raise ValueError(f"sync of {e.param}: compressor {e.compressor} runs with a flat all_reduce only, not "
                             "a hierarchical one")
        if e.low_rank < 1:
            raise ValueError(f"sync of {e.param}: PowerSGD rank must be at least 1, got {e.low_rank}")
        if e.sparse and (e.rows is not None or e.compressor != "none" or e.hierarchical):
            raise ValueError(f"sync of {e.param}: a sparse gradient is synchronized whole, uncompressed and not "
                             "hierarchically")
        if e.bucket in how and (e.sparse or how[e.bucket][-1]):
            raise ValueError(f"sync bucket {e.bucket}: a sparse gradient must be alone in its bucket ({e.param})")
        if how.setdefault(e.bucket, e.how) != e.how:
            raise ValueError(f"sync bucket {e.bucket}: its entries are synchronized differently ({e.param})")
        parts.setdefault(e.param, []).append(e.rows)
    for param, rows in parts.items():
        if None in rows:
            if rows.count(None) > 1:
                raise ValueError(f"sync of {param}: the whole parameter is listed {rows.count(None)} times")
            if len(rows) > 1:
                raise ValueError(f"sync of {param}: the whole parameter and parts of it are both listed")
            continue
        end = 0
        for start, length in sorted(rows):
            if start != end or length <= 0:
                raise ValueError(f"sync of {param}: its parts {sorted(rows)} do not cover dim 0 once, in order")
            end = start + length


def _pairs(value, what: str) -> tuple[tuple[str, str], ...]:
    """(name, placement text) pairs of an instruction, or a ValueError naming `what`."""
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(x, (list, tuple)) and len(x) == 2 and all(isinstance(y, str) for y in x) for x in value):
        raise ValueError(f"malformed plan: {what} must be a list of [tensor, placement] pairs, got {value!r}")
    return tuple(map(tuple, value))


def _object(cls, d, what: str, **converted):
    """A plan file's object `d` as dataclass `cls`: a ValueError naming `what` and the field
    where it is not an object, has a field cls has not, or lacks one cls needs (Python's words
    were "Instruction.__init__() got an unexpected keyword argument 'zzz'"). `converted`: fields
    made from d's by the given functions."""
    if not isinstance(d, dict):
        raise ValueError(f"malformed plan: {what} must be an object, got {type(d).__name__} {_short(d)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = next((k for k in d if k not in fields), None)
    if unknown is not None:
        raise ValueError(f"malformed plan: {what} has a field {unknown!r} it cannot have; its fields: {', '.join(fields)}")
    missing = next((name for name, f in fields.items() if name not in d and f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING), None)
    if missing is not None:
        raise ValueError(f"malformed plan: {what} has no field {missing!r}")
    made = {k: make(d[k]) for k, make in converted.items() if k in d}  # (their own errors name themselves)
    try:
        return cls(**{**d, **made})
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed plan: {what}: {e}") from None


def _list(x, what: str) -> list:
    if not isinstance(x, (list, tuple)):  # (a JSON array; a tuple where to_dict gave it)
        raise ValueError(f"malformed plan: {what} must be a list, got {type(x).__name__} {_short(x)}")
    return x


def _short(x) -> str:
    text = json.dumps(x) if isinstance(x, (dict, list, str, int, float, bool, type(None))) else repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _stage_from_dict(d, k: int) -> PlanStage:
    where = f"stage {k}"
    if not isinstance(d, dict):
        raise ValueError(f"malformed plan: {where} must be an object, got {type(d).__name__} {_short(d)}")
    program = []
    for i, ins in enumerate(_list(d.get("program", []), f"{where}'s program")):
        at = f"{where}'s instruction {i}"
        if isinstance(ins, dict):
            for key in ("inputs", "outputs", "loads"):
                if key in ins:
                    _pairs(ins[key], f"instruction {ins.get('node')!r} {key}")
        program.append(_object(Instruction, ins, at, inputs=lambda x: tuple(map(tuple, x)),
                               outputs=lambda x: tuple(map(tuple, x)), loads=lambda x: tuple(map(tuple, x)),
                               moves=lambda x: tuple(_object(MoveOp, mv, f"{at}'s move {j}")
                                                     for j, mv in enumerate(_list(x, f"{at}'s moves")))))
    shards = [_object(ShardSize, sh, f"{where}'s shard {i}", sizes=tuple)
              for i, sh in enumerate(_list(d.get("shards", []), f"{where}'s shards"))]
    return _object(PlanStage, d, where, program=lambda _: program, shards=lambda _: shards)


CONTENT_FIELDS = ("cluster", "devices", "stages", "schedule", "sync")
"""What a plan's estimate prices (Plan.content_digest)."""
ESTIMATE_FIELDS = ("estimated_iteration_seconds", "breakdown", "timeline", "memory_bytes")
"""The estimate (Plan.written_digest stamps it with the content)."""


def _stamp(field_of: Callable[[str], Any]) -> str:
    """The `written` stamp of a plan whose plain fields `field_of(name)` gives: its content and
    its estimate."""
    return _digest({f: field_of(f) for f in (*CONTENT_FIELDS, *ESTIMATE_FIELDS)})


def _stale(written: str, field_of: Callable[[str], Any]) -> bool:
    """Whether stamp `written` (none: a plan priced and not written since) is not of the plan
    whose plain fields `field_of(name)` gives: neither its stamp nor, as files stamped it before
    2026-11-29, its content alone."""
    return bool(written) and written not in (_stamp(field_of), _digest({f: field_of(f) for f in CONTENT_FIELDS}))


def _digest(fields: dict) -> str:
    """16 hex digits of the SHA-256 of plain fields (_plain) as sorted JSON."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


_LEAVES = frozenset({str, int, float, bool, type(None)})


def _plain(value):
    """A plan or plan field as JSON holds it: dataclasses as dicts, recursively, as
    dataclasses.asdict gives them but without deep-copying every number and string (5x faster;
    a plan's fields hold no mutable leaf)."""
    if type(value) in _LEAVES:
        return value
    if hasattr(type(value), "__dataclass_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _check_steps(graph: Graph, program: list[Step], table) -> None:
    """A one-line ValueError unless every step takes a strategy the rules give its node and
    every move is one the move catalogue has (search.moves): a hand-edited step (a partial sum
    relabelled duplicated, a collective renamed) would run silently wrong or be priced wrong."""
    from .search.moves import moves_between, rebalance

    for step in program:
        node = graph.nodes[step.node]
        if step.strategy not in table[step.node]:
            raise ValueError(f"the plan runs {node.name} ({node.op}) as {step.strategy}, which its rules do not give "
                             "(a plan made for another model, or hand-edited?)")
        for ms in step.moves:
            mv = ms.move
            if mv != rebalance(mv.src) and mv not in moves_between(mv.src, mv.dst, graph.tensors[ms.tensor].requires_grad):
                raise ValueError(f"the plan moves {ms.tensor} by {mv.name} {mv.src} -> {mv.dst} [{mv.fwd}, backward "
                                 f"{mv.bwd}], which is no move hap has (a hand-edited plan?)")


def _check_held(graph: Graph, programs: list[list[Step]], segment_of: list[int] | None = None,
                sizes: Callable[[str, int, int], list[int]] | None = None) -> None:
    """A ValueError where a stage's program takes a tensor in a placement it does not hold there
    (its loads, moves and outputs make what it holds; a pipeline stage starts with what earlier
    stages produced, as they produced it), or places one on a dim it lacks, or (a one-stage
    plan of several segments: `segment_of`; sizes(tensor, dim, segment) its shard sizes there)
    takes a tensor split at another segment's sizes without re-splitting it: a hand-edited plan
    the ranks would fail in."""
    produced: dict[str, Placement] = {}
    for program in programs:
        held = {(name, p): 0 for name, p in produced.items()}
        _walk_held(graph, program, held, segment_of or [0] * len(graph.nodes), sizes)
        for step in program:
            produced.update(zip(graph.nodes[step.node].outputs, step.strategy.outputs))


def _walk_held(graph: Graph, program: list[Step], held: dict, segment_of: list[int], sizes) -> None:
    """_check_held's walk of one stage's program, from what it holds at its start: (tensor,
    placement) -> the segment whose ratios split it."""
    def placed(tensor: str, p: Placement, node) -> None:
        if p.is_shard and p.dim >= len(graph.tensors[tensor].shape):
            raise ValueError(f"the plan places {tensor} as {p} at {node.name}, a tensor of "
                             f"{len(graph.tensors[tensor].shape)} dims (a hand-edited plan?)")

    for step, seg, moves in split_walk(program, graph, segment_of, held):
        node = graph.nodes[step.node]
        for ld in step.loads:
            placed(ld.tensor, ld.placement, node)
        for ms, src_seg in moves:
            if src_seg is None:
                raise ValueError(f"the plan moves {ms.tensor} from {ms.move.src} before {node.name}, where it does not "
                                 "hold it so (a hand-edited plan?)")
            placed(ms.tensor, ms.move.dst, node)
        for name, p in zip(node.inputs, step.strategy.inputs):
            placed(name, p, node)
            if (name, p) not in held:
                raise ValueError(f"the plan runs {node.name} on {name} as {p}, which it does not hold so there "
                                 "(a hand-edited plan?)")
            split = held[(name, p)]
            if p.is_shard and sizes is not None and split != seg and sizes(name, p.dim, split) != sizes(name, p.dim, seg):
                raise ValueError(f"the plan runs {node.name} (segment {seg}) on {name} as {p}, split at segment "
                                 f"{split}'s ratios: it is re-split where a segment starts (a hand-edited plan?)")
        for name, p in zip(node.outputs, step.strategy.outputs):
            placed(name, p, node)


def instructions(steps: list[Step], graph: Graph) -> list[Instruction]:
    """A program as the plan's instructions."""
    out = []
    for step in steps:
        node = graph.nodes[step.node]
        out.append(Instruction(
            node=node.name, op=node.op, strategy=step.strategy.name, local=step.strategy.local,
            inputs=tuple((t, str(p)) for t, p in zip(node.inputs, step.strategy.inputs)),
            outputs=tuple((t, str(p)) for t, p in zip(node.outputs, step.strategy.outputs)),
            loads=tuple((ld.tensor, str(ld.placement)) for ld in step.loads),
            moves=tuple(MoveOp(tensor=ms.tensor, name=ms.move.name, src=str(ms.move.src), dst=str(ms.move.dst),
                               fwd=ms.move.fwd, bwd=ms.move.bwd) for ms in step.moves)))
    return out


def shard_sizes(program: list[Step], graph: Graph, classes: ShardClasses, segment_of, ratios) -> list[ShardSize]:
    """Every (tensor, dim, segment) the program shards, with its integer sizes per device."""
    seen: dict[tuple[str, int, int], ShardSize] = {}

    def note(t, p, seg):
        if p.is_shard and (t, p.dim, seg) not in seen:
            seen[(t, p.dim, seg)] = ShardSize(tensor=t, dim=p.dim, segment=seg,
                                              sizes=tuple(classes.split_sizes(t, p.dim, ratios[seg])))

    for step in program:
        seg = segment_of[step.node]
        node = graph.nodes[step.node]
        for t, p in zip(node.inputs, step.strategy.inputs):
            note(t, p, seg)
        for t, p in zip(node.outputs, step.strategy.outputs):
            note(t, p, seg)
        for ms in step.moves:
            note(ms.tensor, ms.move.dst, seg)
    return list(seen.values())
