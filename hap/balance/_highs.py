"""HiGHS, called directly: the one place hap reaches into a private SciPy module.

scipy.optimize.linprog validates and converts its inputs on every call, which costs more than
the dual simplex itself on the load balancer's LPs (tens of variables, hundreds of rows); the
planner solves several per plan. SciPy >= 1.15 ships HiGHS's own Python binding as
scipy.optimize._highspy._core (the API of the `highspy` package, without its start-up banner).
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import numpy as np
from scipy.optimize._highspy import _core

Status = Literal["optimal", "infeasible", "failed"]


def solve(cost: Sequence[float], rows: Sequence[dict[int, float]], lower: Sequence[float], upper: Sequence[float],
          col_upper: Sequence[float]) -> tuple[Status, list[float], float, str]:
    """min cost . x  subject to  lower <= rows[i] . x <= upper[i]  and  0 <= x <= col_upper
    (math.inf: unbounded), by the dual simplex without presolve (on LPs this small presolve costs
    more than it saves; it is used to tell why where no optimum was found): (status, x, objective, HiGHS's model status in words)."""
    inf = _core.kHighsInf
    start, index, value = [0], [], []
    for row in rows:
        index += row.keys()
        value += row.values()
        start.append(len(index))
    lp = _core.HighsLp()
    lp.num_col_, lp.num_row_ = len(cost), len(rows)
    lp.col_cost_ = np.asarray(cost, dtype=float)
    lp.col_lower_ = np.zeros(len(cost))
    lp.col_upper_ = np.array([inf if math.isinf(u) else u for u in col_upper], dtype=float)
    lp.row_lower_ = np.array([-inf if math.isinf(b) else b for b in lower], dtype=float)
    lp.row_upper_ = np.array([inf if math.isinf(b) else b for b in upper], dtype=float)
    lp.a_matrix_.format_ = _core.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = len(cost), len(rows)
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = start, index, value
    h = _core._Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("presolve", "off")
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    if status != _core.HighsModelStatus.kOptimal:  # without presolve the simplex may not tell why: ask again with it
        h.setOptionValue("presolve", "on")
        h.clearSolver()
        h.run()
        status = h.getModelStatus()
    words = h.modelStatusToString(status)
    if status == _core.HighsModelStatus.kOptimal:
        return "optimal", list(h.getSolution().col_value), h.getInfo().objective_function_value, words
    if status == _core.HighsModelStatus.kInfeasible:
        return "infeasible", [], math.nan, words
    return "failed", [], math.nan, words
