"""Ground truth for rules: run a strategy on simulated devices and compare with one device.

For a node and a strategy, draw random full inputs, split them per the input placements
(S: the class's split sizes; R/D: whole; P: random summands), run the node on every
simulated device (threads, so that local variants may call all_reduce), and check that the
outputs reassemble to the single-device result. Then check gradients the same way: seed the
local output gradients in the dual form of each output placement, run autograd per device,
and reassemble the input gradients per the dual of each input placement:

    placement   forward value on device j      gradient on device j
    S(d)        shard j along d                shard j of the gradient
    P           summand j                      the full gradient
    R           the whole tensor               summand j of the gradient
    D           the whole tensor               the full gradient
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from ..ir import Graph, Node
from ..placement import Placement
from . import Strategy
from .local import LocalContext, is_random, run_node, substitute
from .units import ShardClasses


class RuleViolation(AssertionError):
    pass


def random_full(graph: Graph, name: str, gen: torch.Generator, int_high: int = 2) -> torch.Tensor:
    t = graph.tensors[name]
    dtype = getattr(torch, t.dtype)
    if dtype.is_floating_point:
        return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.rand(t.shape, generator=gen) > 0.5
    return torch.randint(0, int_high, t.shape, generator=gen, dtype=dtype)


def split_value(full: torch.Tensor, p: Placement, sizes_of, m: int, gen: torch.Generator) -> list[torch.Tensor]:
    """The per-device local values of a full tensor under placement p."""
    if p.kind == "S":
        return [x.clone() for x in torch.split(full, sizes_of(p.dim), dim=p.dim)]
    if p.kind == "P":
        noise = [torch.randn(full.shape, generator=gen, dtype=torch.float64).to(full.dtype) for _ in range(m - 1)]
        first = full - sum(noise) if noise else full.clone()
        return [first, *noise]
    return [full.clone() for _ in range(m)]


def combine(parts: Sequence[torch.Tensor], p: Placement) -> list[torch.Tensor]:
    """Candidates for the full value: one for S and P, one per device for R and D."""
    if p.kind == "S":
        return [torch.cat(list(parts), dim=p.dim)]
    if p.kind == "P":
        return [sum(parts[1:], parts[0])]
    return list(parts)


_GRAD_DUAL = {"S": "S", "P": "D", "R": "P", "D": "D"}


def _dual(p: Placement) -> Placement:
    return p if p.kind == "S" else Placement(_GRAD_DUAL[p.kind])


def check_strategy(node: Node, graph: Graph, st: Strategy, ratios: Sequence[float], classes: ShardClasses | None = None,
                   seed: int = 0, inputs: dict[str, torch.Tensor] | None = None, check_grad: bool = True,
                   rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Raise RuleViolation if `st` does not compute `node` exactly on len(ratios) devices."""
    m = len(ratios)
    classes = classes or ShardClasses(graph, [(node.index, [st])])
    gen = torch.Generator().manual_seed(seed)
    full = dict(inputs or {})
    for name in node.inputs:
        if name not in full:
            full[name] = random_full(graph, name, gen)
    grad_inputs = [n for n in dict.fromkeys(node.inputs) if full[n].is_floating_point() and graph.tensors[n].requires_grad]
    leaves = {n: full[n].detach().clone().requires_grad_(n in grad_inputs) for n in dict.fromkeys(node.inputs)}
    random_op = is_random(node)
    rng = torch.get_rng_state()  # random ops: every device draws what the reference draws
    ref = _call(node, leaves)

    def sizes(name):
        return lambda dim: classes.split_sizes(name, dim, ratios)

    place = dict(zip(node.inputs, st.inputs))
    for name in node.inputs:  # a tensor passed twice must be placed alike
        if place[name] != st.inputs[node.inputs.index(name)]:
            raise RuleViolation(f"{node.name}: {name} passed twice with different placements")
    local_in = {n: split_value(full[n], place[n], sizes(n), m, gen) for n in dict.fromkeys(node.inputs)}
    local_leaves = [{n: local_in[n][j].detach().clone().requires_grad_(n in grad_inputs) for n in local_in} for j in range(m)]
    if random_op:  # one device at a time, each from the reference's generator state
        outs = []
        for j in range(m):
            torch.set_rng_state(rng)
            outs.append(run_node(node, st, local_leaves[j], graph, _context(j, m, classes, ratios, None)))
    else:
        devices = _Devices(m)
        outs = _run_devices(node, st, graph, local_leaves, classes, ratios, devices)

    for k, (name, p) in enumerate(zip(node.outputs, st.outputs)):
        expect_shape = [list(graph.tensors[name].shape) for _ in range(m)]
        if p.kind == "S":
            for j, size in enumerate(classes.split_sizes(name, p.dim, ratios)):
                expect_shape[j][p.dim] = size
        for j in range(m):
            if list(outs[j][k].shape) != expect_shape[j]:
                raise RuleViolation(f"{node.name} [{st}]: device {j} output {name} has shape {list(outs[j][k].shape)}, expected {expect_shape[j]}")
        for cand in combine([o[k].detach() for o in outs], p):
            _close(cand, ref[k].detach(), f"{node.name} [{st}] output {name}", rtol, atol)

    if not check_grad or not grad_inputs:
        return
    diff_outputs = [k for k, name in enumerate(node.outputs) if ref[k].requires_grad]
    if not diff_outputs:
        return
    full_grads = {k: torch.randn(ref[k].shape, generator=gen, dtype=torch.float64).to(ref[k].dtype) for k in diff_outputs}
    torch.autograd.backward([ref[k] for k in diff_outputs], [full_grads[k] for k in diff_outputs])
    local_grads = {k: split_value(full_grads[k], _dual(st.outputs[k]), sizes(node.outputs[k]), m, gen) for k in diff_outputs}

    def backward(j):
        ks = [k for k in diff_outputs if outs[j][k].requires_grad]
        if ks:
            torch.autograd.backward([outs[j][k] for k in ks], [local_grads[k][j] for k in ks])

    if random_op:
        for j in range(m):
            backward(j)
    else:  # at once: a variant's backward may sum over devices too (synchronized batch norm)
        devices.run(backward, f"{node.name} [{st}] backward")
    for name in grad_inputs:
        expected = leaves[name].grad
        if expected is None:
            continue
        parts = [lv[name].grad if lv[name].grad is not None else torch.zeros_like(lv[name]) for lv in local_leaves]
        for cand in combine(parts, _dual(place[name])):
            _close(cand, expected, f"{node.name} [{st}] gradient of {name}", rtol, atol)


def _context(j, m, classes, ratios, all_reduce) -> LocalContext:
    return LocalContext(device=j, world=m, split=lambda t, d: classes.split_sizes(t, d, ratios), all_reduce=all_reduce)


def _call(node: Node, values: dict[str, torch.Tensor]) -> tuple:
    out = node.target(*substitute(node.args, values), **substitute(node.kwargs, values))
    return tuple(out) if isinstance(out, (list, tuple)) else (out,)


class _Devices:
    """m simulated devices, one thread each, with a sum over devices that every device must
    call (a device that skips one fails the check, it does not hang it)."""

    def __init__(self, m: int):
        self.m = m
        self.barrier = threading.Barrier(m, timeout=120)
        self.slots: list = [None] * m

    def all_reduce_for(self, j: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.slots[j] = t.detach()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0]).clone()
            self.barrier.wait()
            return total

        return all_reduce

    def run(self, fn, what: str) -> list:
        """fn(j) on every device at once; the results in device order."""
        results: list = [None] * self.m
        errors: list = [None] * self.m

        def work(j):
            try:
                results[j] = fn(j)
            except BaseException as e:  # reported below, on the caller's thread
                errors[j] = e
                self.barrier.abort()

        threads = [threading.Thread(target=work, args=(j,)) for j in range(self.m)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for j, e in enumerate(errors):
            if e is not None and not isinstance(e, threading.BrokenBarrierError):
                raise RuleViolation(f"{what}: device {j} failed: {type(e).__name__}: {e}") from e
        self.barrier.reset()
        return results


def _run_devices(node, st, graph, local_leaves, classes, ratios, devices: _Devices) -> list[tuple]:
    return devices.run(lambda j: run_node(node, st, local_leaves[j], graph,
                                          _context(j, devices.m, classes, ratios, devices.all_reduce_for(j))),
                       f"{node.name} [{st}]")


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float, atol: float) -> None:
    if actual.shape != expected.shape:
        raise RuleViolation(f"{what}: shape {list(actual.shape)} != single-device {list(expected.shape)}")
    if expected.is_floating_point():
        ok = torch.allclose(actual.double(), expected.double(), rtol=rtol, atol=atol)
    else:
        ok = torch.equal(actual, expected)
    if not ok:
        err = (actual.double() - expected.double()).abs().max().item()
        raise RuleViolation(f"{what}: differs from single device (max abs error {err:.3g})")
