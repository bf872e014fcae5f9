"""Random strategies under AutoSync's two knowledge constraints (supplement, section 6).

The sampler draws, per synchronized parameter, a number of parts (parameters at least
`SpaceConfig.part_bytes` large may be split, into at most `max_parts`, never more than their
rows), and per part the synchronizer: all-reduce or parameter server, hierarchical or not where
the cluster has machines of several devices, and (only with `compress`) fp16 or PowerSGD for an
all-reduce (a sparse gradient: whole, all-gathered or to a server, neither hierarchical nor
compressed). The odds of each choice are drawn per strategy first (a parameter server with
probability 0, 1/4, ..., 1; hierarchy 0, 1/2 or 1; splitting 0, 1/2 or 1), so that uniform
strategies (every part hierarchical all-reduce, say) are drawn as often as mixed ones. Two
fields are then filled by the constraints:

- load balance (c_lb, Algorithm 1): the parameter-server parts, largest first, each go to a device
  drawn from softmax(total load * bandwidth share - current load), so that servers carry load in
  proportion to their network bandwidth. Loads are in units of the mean part size (the logits of
  raw bytes would make the draw an argmax);
- adjacent merge (c_am, Algorithm 2): the all-reduce parts, in backprop order, fill N groups of
  about equal bytes one after the other (N drawn per strategy), so that each group's gradients
  arrive together.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from ..config import check_fields, flag, whole
from .strategy import PartSync, SyncStrategy, Variables, VarSync


@dataclass(kw_only=True, slots=True)
class SpaceConfig:
    compress: bool = False
    """Also try fp16 and PowerSGD all-reduces (approximate: they change the training)."""
    max_parts: int = 4
    """Most parts a parameter is split into."""
    part_bytes: int = 1 << 20
    """A parameter may be split only into parts at least this large."""
    max_groups: int = 8
    """Most all-reduce fusion groups (N of c_am is drawn from 1..max_groups)."""
    low_rank: int = 4
    """PowerSGD's rank, where it is tried."""

    def __post_init__(self):
        check_fields(self, compress=flag(), max_parts=whole(1), part_bytes=whole(1), max_groups=whole(1), low_rank=whole(1))


def bandwidths(variables: Variables, cost) -> list[float]:
    """Each device's network bandwidth (its machine's card): what c_lb balances by."""
    topo = cost.cluster.topology
    if topo is None:
        return [1.0] * variables.devices
    return [topo.machines[topo.machine_of(d)].nic.bandwidth for d in range(variables.devices)]


def sample(variables: Variables, bandwidth: list[float], rng: random.Random, config: SpaceConfig | None = None) -> SyncStrategy:
    config = config or SpaceConfig()
    hierarchical_possible = any(len(m) > 1 for m in variables.machines)
    p_ps = rng.choice((0.0, 0.25, 0.5, 0.75, 1.0))
    p_hier = rng.choice((0.0, 0.5, 1.0)) if hierarchical_possible else 0.0
    p_split = rng.choice((0.0, 0.5, 1.0))
    drafts: list[tuple[int, list[dict]]] = []  # per variable: its index, one dict per part
    for i, var in enumerate(variables.vars):
        most = min(config.max_parts, var.rows, max(1, var.nbytes // config.part_bytes))
        splits = [k for k in (2, 4, 8, 16) if k <= most and not var.sparse]
        parts = rng.choice(splits) if splits and rng.random() < p_split else 1
        draft = []
        for _ in range(parts):
            kind = "ps" if rng.random() < p_ps else "all_reduce"
            d = {"kind": kind, "hierarchical": rng.random() < p_hier and not var.sparse}
            if kind == "all_reduce" and config.compress and not var.sparse:
                d["compressor"] = rng.choice(("none", "fp16", "powersgd"))
                if d["compressor"] != "none":
                    d["hierarchical"] = False
                    d["low_rank"] = config.low_rank
            draft.append(d)
        drafts.append((i, draft))
    _balance_servers(variables, drafts, bandwidth, rng)
    _merge_adjacent(variables, drafts, rng.randint(1, config.max_groups))
    return SyncStrategy(tuple(VarSync(variables.vars[i].param, tuple(PartSync(**d) for d in draft)) for i, draft in drafts))


def neighbour(strategy: SyncStrategy, variables: Variables, bandwidth: list[float], rng: random.Random,
              config: SpaceConfig | None = None) -> SyncStrategy:
    """A strategy one choice away from `strategy` (hap's addition to AutoSync's sampler, to
    search around the best strategies measured): one parameter re-drawn (parts and
    synchronizers, from a fresh sample), or one part changed: all-reduce <-> parameter server
    (the server drawn by bandwidth; the group of the first all-reduce part), another server, the
    next or the previous fusion group (merging into or splitting from a neighbour), hierarchy
    toggled."""
    config = config or SpaceConfig()
    vars_ = list(strategy.vars)
    i = rng.randrange(len(vars_))
    var, vs = variables.vars[i], vars_[i]
    if rng.random() < 0.25:  # re-draw the parameter whole
        vars_[i] = sample(variables, bandwidth, rng, config).vars[i]
        return SyncStrategy(tuple(vars_))
    j = rng.randrange(len(vs.parts))
    part = vs.parts[j]
    hierarchical_possible = any(len(m) > 1 for m in variables.machines) and not var.sparse and part.exact
    moves = ["kind", "hierarchical" if hierarchical_possible else "kind"]
    moves += ["server"] if part.kind == "ps" and len(bandwidth) > 1 else ["group-up", "group-down"]
    move = rng.choice(moves)
    if move == "kind" and part.kind == "all_reduce":
        server = rng.choices(range(len(bandwidth)), weights=bandwidth)[0]
        new = PartSync(kind="ps", server=server, hierarchical=part.hierarchical)
    elif move == "kind":
        groups = [p.group for v in vars_ for p in v.parts if p.kind == "all_reduce"]
        new = PartSync(kind="all_reduce", group=groups[0] if groups else 0, hierarchical=part.hierarchical)
    elif move == "server":
        new = dataclasses.replace(part, server=rng.choice([d for d in range(len(bandwidth)) if d != part.server]))
    elif move == "hierarchical":
        new = dataclasses.replace(part, hierarchical=not part.hierarchical)
    else:
        new = dataclasses.replace(part, group=max(0, part.group + (1 if move == "group-up" else -1)))
    vars_[i] = VarSync(vs.param, vs.parts[:j] + (new,) + vs.parts[j + 1:])
    return SyncStrategy(tuple(vars_))


def _part_size(variables: Variables, i: int, parts: int) -> float:
    return variables.vars[i].wire_bytes / parts


def _balance_servers(variables: Variables, drafts, bandwidth: list[float], rng: random.Random) -> None:
    """c_lb: servers for the parameter-server parts, largest first, by bandwidth share."""
    ps = [(_part_size(variables, i, len(draft)), d) for i, draft in drafts for d in draft if d["kind"] == "ps"]
    if not ps:
        return
    unit = sum(size for size, _ in ps) / len(ps)
    share = [b / sum(bandwidth) for b in bandwidth]
    load = [0.0] * len(bandwidth)
    for size, d in sorted(ps, key=lambda x: -x[0]):
        total = sum(load)
        logits = [(total * s - cur) / unit for s, cur in zip(share, load)]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        j = rng.choices(range(len(bandwidth)), weights=weights)[0]
        d["server"] = j
        load[j] += size


def _merge_adjacent(variables: Variables, drafts, groups: int) -> None:
    """c_am: all-reduce parts in backprop order fill `groups` groups of about equal bytes."""
    ar = [(_part_size(variables, i, len(draft)), d) for i, draft in drafts for d in draft if d["kind"] == "all_reduce"]
    if not ar:
        return
    average = sum(size for size, _ in ar) / groups
    g, load = 0, 0.0
    for size, d in ar:  # variables are in backprop order already
        if load >= average and g < groups - 1:
            g, load = g + 1, 0.0
        d["group"] = g
        load += size


def similarity(a: SyncStrategy, b: SyncStrategy) -> float:
    """How many synchronization choices two strategies share, over all choices (0..1): per
    parameter its number of parts, and per part its kind, server, group, hierarchy, compressor."""
    same = total = 0
    for va, vb in zip(a.vars, b.vars):
        total += 1
        same += len(va.parts) == len(vb.parts)
        for pa, pb in zip(va.parts, vb.parts):
            for field in ("kind", "server", "group", "hierarchical", "compressor"):
                total += 1
                same += getattr(pa, field) == getattr(pb, field)
    return same / total if total else 1.0
