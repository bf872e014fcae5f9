"""Load balancing: the sharding ratios that minimise a fixed program's time (HAP section 5).

For a fixed program the time is linear in the ratios B[s][j] (segment s, device j) once
three kinds of epigraph variables are added:
    T_i  >= time of stage i's computation on device j, for every j   (forward, backward)
    M_s  >= B[s][j] for every j          (collectives are priced by the largest share)
    Z_s  >= M_{s-1}, M_s                  (the all-to-all re-splitting at a segment boundary)
minimise  sum_i (T_fwd_i + T_bwd_i) + sum (const + slope * M or Z) + gradient sync
subject to sum_j B[s][j] = 1, B >= 0, memory_j(B) <= capacity_j.

The LP sees continuous shares; the plan's integer shard sizes are rounded afterwards
(section 5.1) and the plan is re-priced exactly. An infeasible or failed LP raises
BalanceError naming the cause, never returns a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from ..cost.model import CostModel
from ..search.program import Step, memory_terms, synced_bytes


class BalanceError(ValueError):
    """The ratios LP has no solution; the message says why."""


@dataclass(slots=True)
class BalanceResult:
    ratios: list[list[float]]
    """ratios[segment][device], each row summing to 1."""
    objective: float
    """The LP's estimate of the iteration time in seconds (continuous shares)."""
    status: Literal["optimal"]
    message: str


class _LP:
    def __init__(self):
        self.n = 0
        self.c: list[float] = []
        self.rows: list[dict[int, float]] = []
        self.rhs: list[float] = []
        self.const = 0.0

    def var(self, cost: float = 0.0) -> int:
        self.c.append(cost)
        self.n += 1
        return self.n - 1

    def le(self, coeffs: dict[int, float], rhs: float) -> None:
        self.rows.append(coeffs)
        self.rhs.append(rhs)


def balance(program: Sequence[Step], cost: CostModel, segment_of: Sequence[int], segments: int,
            memory_limit: Sequence[float] | None = None) -> BalanceResult:
    """Optimal ratios per segment for `program`; memory_limit defaults to each GPU's memory."""
    m = cost.m
    graph = cost.graph
    lp = _LP()
    B = [[lp.var() for _ in range(m)] for _ in range(segments)]
    M = [lp.var() for _ in range(segments)]
    for s in range(segments):
        for j in range(m):
            lp.le({B[s][j]: 1.0, M[s]: -1.0}, 0.0)

    def stage_vars():
        return lp.var(1.0), lp.var(1.0)

    fwd_rows: dict[int, dict[int, float]] = {}
    bwd_rows: dict[int, dict[int, float]] = {}
    fwd_const = [0.0] * m
    bwd_const = [0.0] * m
    T = stage_vars()
    stage_terms: list[tuple] = []  # (T pair, fwd coeff rows per device, consts) closed stages
    prev_seg = segment_of[program[0].node] if program else 0

    def close():
        nonlocal T, fwd_rows, bwd_rows, fwd_const, bwd_const
        stage_terms.append((T, fwd_rows, bwd_rows, fwd_const, bwd_const))
        T = stage_vars()
        fwd_rows, bwd_rows, fwd_const, bwd_const = {}, {}, [0.0] * m, [0.0] * m

    def add(rows, consts, seg, vec, sharded):
        for j, a in enumerate(vec):
            if a == 0.0:
                continue
            if sharded:
                row = rows.setdefault(j, {})
                row[B[seg][j]] = row.get(B[seg][j], 0.0) + a
            else:
                consts[j] += a

    def comm_cost(kind, nbytes, share_var):
        cc = cost.comm(kind, nbytes)
        lp.const += cc.const
        if cc.slope and share_var is not None:
            lp.c[share_var] += cc.slope
        elif cc.slope:
            lp.const += cc.slope  # a collective on a whole tensor: largest share 1

    for step in program:
        seg = segment_of[step.node]
        for ms in step.moves:
            mv = ms.move
            if not mv.communicates:
                continue
            close()
            nbytes = graph.tensors[ms.tensor].nbytes
            if mv.name == "rebalance":
                z = lp.var()
                lp.le({M[prev_seg]: 1.0, z: -1.0}, 0.0)
                lp.le({M[seg]: 1.0, z: -1.0}, 0.0)
                share = z
            else:
                share = M[seg] if (mv.src.is_shard or mv.dst.is_shard) else None
            for kind in (mv.fwd, mv.bwd):
                if kind is not None:
                    comm_cost(kind, nbytes, share)
        prev_seg = seg
        node = graph.nodes[step.node]
        inner = cost.variant_comm(node, step.strategy)
        if inner:  # the node synchronizes the devices itself
            close()
            lp.const += inner
        fwd, bwd = cost.base_times(node)
        sharded = cost.work_shard(node, step.strategy) is not None
        add(fwd_rows, fwd_const, seg, fwd, sharded)
        add(bwd_rows, bwd_const, seg, bwd, sharded)
        if cost.has_fixed:
            fixed_fwd, fixed_bwd = cost.fixed_times(node)
            add(fwd_rows, fwd_const, seg, fixed_fwd, False)
            add(bwd_rows, bwd_const, seg, fixed_bwd, False)
        for ld in step.loads:
            t = graph.tensors[ld.tensor]
            if t.kind == "param" and t.requires_grad:
                if any(cost.intra_grad):
                    add(bwd_rows, bwd_const, seg, cost.grad_intra(t.nbytes), ld.placement.is_shard)
    close()
    lp.const += cost.step_sync(synced_bytes(program, graph, segment_of))

    for (tf, tb), frows, brows, fc, bc in stage_terms:
        for t, rows, consts in ((tf, frows, fc), (tb, brows, bc)):
            for j in range(m):
                lp.le({**rows.get(j, {}), t: -1.0}, -consts[j])

    caps = list(memory_limit) if memory_limit is not None else [d.memory for d in cost.cluster.devices]
    mem_rows = [dict() for _ in range(m)]
    mem_const = [0.0] * m
    for name, p, seg, nbytes, whole in memory_terms(program, cost, segment_of):
        for j in range(m):
            a = nbytes / (1 if whole else cost.gpus(j))
            if p is not None and p.is_shard:
                mem_rows[j][B[seg][j]] = mem_rows[j].get(B[seg][j], 0.0) + a
            else:
                mem_const[j] += a
    for j in range(m):
        if mem_const[j] > caps[j]:
            dev = cost.cluster.devices[j]
            raise BalanceError(f"out of memory: device {j} ({dev.name}) needs {mem_const[j] / 2**30:.2f} GiB for the "
                               f"replicated part of this program alone but has {caps[j] / 2**30:.2f} GiB")
        if mem_rows[j]:
            lp.le(mem_rows[j], caps[j] - mem_const[j])

    A_eq = np.zeros((segments, lp.n))
    for s in range(segments):
        A_eq[s, B[s]] = 1.0
    rows, cols, vals = [], [], []
    for i, row in enumerate(lp.rows):
        for col, v in row.items():
            rows.append(i)
            cols.append(col)
            vals.append(v)
    A_ub = coo_matrix((vals, (rows, cols)), shape=(len(lp.rows), lp.n)).tocsr()
    res = linprog(np.array(lp.c), A_ub=A_ub, b_ub=np.array(lp.rhs), A_eq=A_eq, b_eq=np.ones(segments),
                  bounds=[(0, None)] * lp.n, method="highs")
    if res.status == 2:
        raise BalanceError("out of memory: no sharding ratios fit this program in the devices' memory "
                           f"({', '.join(f'{c / 2**30:.1f} GiB' for c in caps)})")
    if res.status != 0:
        raise BalanceError(f"ratio LP failed (HiGHS status {res.status}): {res.message}")
    ratios = []
    for s in range(segments):
        row = [max(0.0, float(res.x[v])) for v in B[s]]
        row = [x if x > 1e-9 else 0.0 for x in row]
        total = sum(row)
        ratios.append([x / total for x in row])
    return BalanceResult(ratios=ratios, objective=float(res.fun) + lp.const, status="optimal", message=res.message)
