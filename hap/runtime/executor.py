"""Run a synthesized program on one rank (HAP section 6): the same program on every rank, each
with its own shard sizes.

    ex = Executor(graph, program, classes, segment_of, ratios, Comm.default())
    params = ex.shard_parameters(leaf_values(graph, model, inputs))   # this rank's nn.Parameters
    loss = ex.forward(leaf_values(graph, model, batch))               # P-form: parts sum to the loss
    loss.backward(); ex.sync_gradients()                              # then any optimizer on params

Parameters live on each rank in one placement: the one the program loads them in, or, when it
loads one in several placements (or as a partial sum), whole (R), from which each load is a
local move (slice, duplicate, zero-partial). Gradients of parameters kept whole in R arrive
as partial sums and are all-reduced in one bucket by `sync_gradients`; sharded and duplicated
ones are already exact.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..ir import Graph, TensorRef, dtype_name, memory_layout
from ..placement import D, P, R, Placement
from ..rules import gradient_placement
from ..rules.local import SIZE_ARGS, LocalContext, Made, is_random, run_node, substitute, whole_noise
from ..rules.nn import counts_early, label_count
from ..rules.units import ShardClasses
from ..search.moves import Move, moves_between
from ..search.program import Step, kept_placements, split_walk
from .collectives import Comm, all_reduce, from_rank_0, gather_or_refuse, gather_padded, resplit, run_move
from . import wire


def per_element(state: str, shape: Sequence[int], param_shape: Sequence[int], param: str, sharded: bool) -> bool:
    """Whether optimizer state `state` of parameter `param`, a tensor of `shape`, holds one value
    per element of it (`param_shape`, as held here): momentum and Adam's moments, which are
    sharded, moved and saved with the parameter. A scalar (Adam's step) is not. Any other shape
    (Adafactor's factored row and column statistics) spans the parameter's elements: where hap
    shards the parameter each rank's would be of its own rows alone, not one device's, so a
    ValueError."""
    if tuple(shape) == tuple(param_shape):
        return True
    if math.prod(shape) == 1:  # a scalar, or a counter kept as shape (1,)
        return False
    if sharded:
        raise ValueError(f"optimizer state {state!r} of {param} is {tuple(shape)}, not one value per element of "
                         f"{tuple(param_shape)}: an optimizer whose statistics span a parameter (Adafactor's "
                         f"factored moments, say) is not exact where hap shards it; use one with per-element "
                         f"state (SGD, Adam, ...) or a plan that keeps {param} whole")
    return False


def check_inputs(batch: Sequence[torch.Tensor], graph: Graph) -> None:
    """A ValueError where the batch is not the example inputs' count, or naming the first input
    whose dtype is not the example's: the graph was captured for those (a wrong dtype failed
    deep in the executor in torch's words, or, an integer for another, computed otherwise than
    the model on one device); or, in a model that draws random numbers, whose memory layout is
    not the example's (random_layout_refusal)."""
    if len(batch) != len(graph.inputs):
        raise ValueError(f"the model takes {len(graph.inputs)} inputs, got {len(batch)}")
    for i, (name, x) in enumerate(zip(graph.inputs, batch)):
        want = graph.tensors[name].dtype
        got = dtype_name(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
        if got != want:
            raise ValueError(f"input {i} ({name}) is {got}, but the model was captured with {want} for it: give "
                             f"inputs of the example inputs' dtypes")
        refused = random_layout_refusal(graph, i, x)
        if refused:
            raise ValueError(f"{refused}: give inputs laid out as those it was captured on (x.contiguous(), "
                             "x.to(memory_format=torch.channels_last))")


def random_layout_refusal(graph: Graph, i: int, x: torch.Tensor) -> str | None:
    """Why input i, `x`, cannot run on `graph`, or None: where its memory layout is not the one
    the graph was captured with, one of them channels_last, and the graph draws random numbers.
    Each draw is made in the memory order of the captured tensor it masks
    (rules/local.whole_noise), which one device gets from its inputs' memory format (a
    channels_last image makes a convolution's output channels_last): a mask drawn in the other
    order is another mask. (Other strides, a sliced batch, leave the activations contiguous.)"""
    t = graph.tensors[graph.inputs[i]]
    if x.is_contiguous() and t.stride is None:  # (the common case, at no cost)
        return None
    have, captured = memory_layout(x), memory_layout(t)
    if have == captured or "channels_last" not in have + captured or not any(is_random(node) for node in graph.nodes):
        return None
    return (f"input {i} ({graph.inputs[i]}) is {have} in memory but was captured {captured}, and the model draws "
            "random numbers in the memory order the captured layout gives its tensors")


def leaf_values(graph: Graph, model: nn.Module, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole value of every leaf of `graph`: parameters and buffers of `model` by their
    qualified names (a tied parameter under any of its names), constants, and data inputs in
    the order the model takes them."""
    state = model_state(model)
    check_inputs(inputs, graph)
    values = {**graph.constants, **dict(zip(graph.inputs, inputs))}
    for name, t in graph.tensors.items():
        if t.kind in ("param", "buffer"):
            if t.target not in state:
                raise ValueError(f"the model has no parameter or buffer {t.target!r} (graph tensor {name})")
            values[name] = state[t.target].detach()
    return values


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` under every name it has (tied ones several times)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


class Executor:
    def __init__(self, graph: Graph, program: Sequence[Step], classes: ShardClasses, segment_of: Sequence[int],
                 ratios: Sequence[Sequence[float]], comm: Comm):
        """comm.emulation, if set, makes this rank an emulated slower device (see `_stretch`)."""
        if len(ratios[0]) != comm.world:
            raise ValueError(f"the plan is for {len(ratios[0])} devices, this run has {comm.world} ranks")
        self.graph, self.program, self.classes = graph, list(program), classes
        self.segment_of, self.ratios, self.comm = list(segment_of), ratios, comm
        emu = comm.emulation  # (its slowdown at least 1: Emulation says so)
        self.emulation = emu if emu is not None and emu.slowdown > 1 else None
        self.loads: dict[str, set[tuple[Placement, int]]] = {}
        for step in self.program:
            for ld in step.loads:
                self.loads.setdefault(ld.tensor, set()).add((ld.placement, self.segment_of[step.node]))
        self.kept = kept_placements(self.program, graph, self.segment_of)
        self.params: dict[str, nn.Parameter] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        """This rank's part of every buffer, kept like parameters; mutated ones are updated
        after each forward (graph.buffer_updates)."""
        self._presliced: frozenset[str] = frozenset()
        self._waited = 0.0  # seconds the current node spent in collectives
        self._drawn = 0.0  # seconds the current node spent drawing random numbers (under emulation)
        self._node = -1  # the node running now
        self._early: dict[int, tuple[torch.Tensor, dist.Work, float]] = {}  # node -> its all-reduce (and link's end), started early
        self._steps: list[tuple] | None = None  # built on the first forward (see _compiled)
        self._direct: dict[int, Callable] = {}  # node -> its direct call (_direct_call)
        self._early_counts: list[tuple] = []  # (node, strategy, segment) of losses that count early
        self.program_loads = {step.node: step.loads for step in self.program}
        self._strategy_of = {step.node: step.strategy for step in self.program}
        self._input_grads: dict[tuple[int, str], bool] = {}  # (node, data input) -> _summed_gradient
        self.param_alias: Callable[[torch.Tensor], torch.Tensor] = lambda param: param
        """A parameter kept whole -> the value this program computes with (GradSync.alias)."""
        self._aliases: dict[str, torch.Tensor] = {}  # this forward's (_from_graph)
        self.tracing = False
        """Label every node and move for torch.profiler (hap train --trace)."""
        self.stored: dict[str, tuple[Placement, int]] = {}
        """Per parameter and buffer: the placement (and segment, for its sizes) this rank keeps it in."""
        self._held_seg: dict[tuple[str, Placement], int] = {}  # segment whose sizes a held value has
        self.overrides: dict[int, Callable[[list[torch.Tensor]], tuple]] = {}
        """Node index -> what runs it instead of its op: takes the node's local inputs (in
        node.inputs order), returns its local outputs, and does its own emulated slowdown
        (hap.straggler's tensor-parallel linear layers)."""

    def sizes(self, tensor: str, p: Placement, seg: int) -> list[int] | None:
        return self.classes.split_sizes(tensor, p.dim, self.ratios[seg]) if p.is_shard else None

    def _local(self, full: torch.Tensor, tensor: str, p: Placement, seg: int) -> torch.Tensor:
        """This rank's slice of a whole leaf in placement p (S: a shard; R, D: whole)."""
        if not p.is_shard:
            return full
        sizes = self.sizes(tensor, p, seg)
        return full.narrow(p.dim, sum(sizes[: self.comm.rank]), sizes[self.comm.rank])

    def value_of(self, name: str) -> torch.Tensor:
        """This rank's part of parameter or buffer `name`, as it keeps it."""
        return self.params[name] if name in self.params else self.buffers[name]

    def stored_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole parameter or buffer, as it keeps it."""
        return self._local(full, name, *self.stored[name])

    def whole(self, param: str, local: torch.Tensor) -> torch.Tensor:
        """A parameter's (or its gradient's) whole value from this rank's part (a collective
        where the parameter is sharded: every rank calls it)."""
        p, seg = self.stored[param]
        return gather_padded(local.contiguous(), p.dim, self.sizes(param, p, seg), self.comm) if p.is_shard else local

    def shard_parameters(self, values: dict[str, torch.Tensor]) -> dict[str, nn.Parameter]:
        """Keep this rank's part of every parameter the program loads, and of every buffer, as
        `kept_placements` says (where that is whole (R) and a node loads a shard, the load is a
        local move), from rank 0's whole values (a collective): ranks that built the model
        under other seeds train rank 0's, as DDP starts. One whole copy at a time."""
        for name, t in self.graph.tensors.items():
            is_param = t.kind == "param" and name in self.kept
            if not (is_param or t.kind == "buffer") or name not in values:  # values may come a module at a time
                continue
            p, seg = self.kept.get(name, (R, 0))  # a buffer the forward only overwrites: whole
            self.stored[name] = (p, seg)
            whole = from_rank_0(values[name], self.comm)
            local = self._local(whole, name, p, seg)
            local = whole if local is whole else local.clone(memory_format=torch.contiguous_format)  # (the whole goes)
            if is_param:
                self.params[name] = nn.Parameter(local, requires_grad=t.requires_grad)
            else:
                self.buffers[name] = local
        return self.params

    def input_slices(self) -> dict[str, tuple[int, int, int] | None]:
        """Per data input, the part of it this rank reads: (dim, start, length), or None where
        the rank needs it whole (replicated, or loaded in several placements)."""
        out = {}
        for name in self.graph.inputs:
            places = self.loads.get(name, set())
            if len(places) != 1 or not next(iter(places))[0].is_shard:
                out[name] = None
                continue
            p, seg = next(iter(places))
            sizes = self.sizes(name, p, seg)
            out[name] = (p.dim, sum(sizes[: self.comm.rank]), sizes[self.comm.rank])
        return out

    def _load(self, tensor: str, p: Placement, seg: int, values: dict[str, torch.Tensor]) -> torch.Tensor:
        if tensor in self.params or tensor in self.buffers:
            held = self.value_of(tensor)
            q, q_seg = self.stored[tensor]
            if q == R and tensor in self.params and held.requires_grad and torch.is_grad_enabled():
                held = self._from_graph(tensor, held)
            if (q, q_seg) == (p, seg) or (p == q and not p.is_shard):
                return held
            assert q == R, f"{tensor} kept in {q} but loaded in {p}"
            return run_move(held, _free_move(p, self.graph.tensors[tensor].requires_grad), self.comm, None,
                            self.sizes(tensor, p, seg))
        if tensor not in values:
            if tensor not in self.graph.constants:
                raise ValueError(f"no value for leaf {tensor} ({self.graph.tensors[tensor].kind})")
            values = self.graph.constants
        if tensor in self._presliced:  # the caller loaded only this rank's part (input_slices)
            return values[tensor]
        if p == P:  # a data input as a partial sum: rank 0 holds it
            return values[tensor] if self.comm.rank == 0 else torch.zeros_like(values[tensor])
        x = values[tensor]
        if x.requires_grad and torch.is_grad_enabled() and (p.is_shard or self._summed_gradient(tensor)):
            # given whole to every rank (D): its gradient whole too (a shard's gathered; where
            # the node's strategy leaves a part of it on each rank (R), the parts all-reduced)
            return run_move(x, _free_move(p, True, src=D), self.comm, None, self.sizes(tensor, p, seg))
        return self._local(x, tensor, p, seg)

    def _from_graph(self, tensor: str, param: torch.Tensor) -> torch.Tensor:
        """The value of a parameter kept whole that this forward computes with: one alias per
        forward (param_alias), through which the gradient sync tells this program's gradient,
        which it sums over ranks, from one a term outside it added (a penalty on
        dmodel.parameters(), alike on every rank), which it must not."""
        found = self._aliases.get(tensor)
        if found is None:
            found = self._aliases[tensor] = self.param_alias(param)
        return found

    def _summed_gradient(self, tensor: str) -> bool:
        """Whether the node loading data input `tensor` (now, in R) leaves each rank a part of
        its gradient: the plan took it for data and wrote R for a rule's D (rules.gradient_placement)."""
        key = (self._node, tensor)
        found = self._input_grads.get(key)
        if found is None:
            node = self.graph.nodes[self._node]
            st = self._strategy_of[self._node]
            found = self._input_grads[key] = gradient_placement(node, self.graph, st, tensor, short_shards=True) == R
        return found

    def forward(self, values: dict[str, torch.Tensor], presliced: frozenset[str] = frozenset()) -> torch.Tensor:
        """Run the program on this rank; the loss comes back as this rank's part (partial sum):
        its backward() is exact, and `all_reduce` of it is the loss.

        presliced: data inputs given as this rank's part (see input_slices), not whole."""
        self._presliced = presliced
        self._aliases = {}
        self._start_early_counts(values)
        held: dict[tuple[str, Placement], torch.Tensor] = {}  # (tensor, placement) -> this rank's value
        for node, st, seg, moves, ctx in self._compiled():
            self._node = node.index
            for ms, src_sizes, dst_sizes in moves:
                x = held[(ms.tensor, ms.move.src)]
                if self.tracing:
                    with self._span(f"hap move {ms.move.name} {ms.tensor} {ms.move.src}->{ms.move.dst}"):
                        x = run_move(x, ms.move, self.comm, src_sizes, dst_sizes)
                else:
                    x = run_move(x, ms.move, self.comm, src_sizes, dst_sizes)
                held[(ms.tensor, ms.move.dst)] = x
            for ld in self.program_loads[node.index]:
                held[(ld.tensor, ld.placement)] = self._load(ld.tensor, ld.placement, seg, values)
            override = self.overrides.get(node.index)
            direct = self._direct.get(node.index) if self.emulation is None and not self.tracing else None
            if override is not None:
                with self._span(f"hap node {node.name} {node.op.removeprefix('aten.')} [{st.name}]"):
                    outs = override([held[(name, p)] for name, p in zip(node.inputs, st.inputs)])
            elif direct is not None:
                outs = direct(held)
            elif self.emulation is None and not self.tracing:
                outs = run_node(node, st, {name: held[(name, p)] for name, p in zip(node.inputs, st.inputs)},
                                self.graph, ctx)
            else:
                local = {name: held[(name, p)] for name, p in zip(node.inputs, st.inputs)}
                t0, self._waited, self._drawn = time.perf_counter(), 0.0, 0.0
                with self._span(f"hap node {node.name} {node.op.removeprefix('aten.')} [{st.name}]"):
                    outs = run_node(node, st, local, self.graph, ctx)
                if self.emulation is not None and not isinstance(outs, Made):
                    # only computing is stretched: time in the node's own collectives (a global
                    # count, say) is waiting for the other ranks
                    outs = self._stretch(outs, time.perf_counter() - t0 - self._waited, self._drawn)
            for name, p, out in zip(node.outputs, st.outputs, outs):
                held[(name, p)] = out
        self._update_buffers(held)
        loss_p = next(p for (name, p) in held if name == self.graph.loss)
        loss = held[(self.graph.loss, loss_p)]
        if loss_p == P:
            return loss
        # R or D: every rank holds the whole loss; as parts, rank 0 holds it and the others zero.
        return run_move(loss, _free_move(P, self.graph.tensors[self.graph.loss].requires_grad, src=loss_p), self.comm)

    def _compiled(self) -> list[tuple]:
        """Per step, what does not change between iterations: (node, strategy, segment, moves
        with their shard sizes, the node's local context)."""
        if self._steps is None:
            contexts = [LocalContext(device=self.comm.rank, world=self.comm.world, all_reduce=self._sum,
                                     split=lambda t, d, r=r: self.classes.split_sizes(t, d, r),
                                     noise=self._timed_noise if self.emulation is not None else None) for r in self.ratios]
            self._steps = []
            self._held_seg = {}
            for step, seg, walked in split_walk(self.program, self.graph, self.segment_of, self._held_seg):
                assert all(src_seg is not None for _, src_seg in walked), "a move from a placement not held (unchecked plan)"
                moves = [(ms, self.sizes(ms.tensor, ms.move.src, src_seg), self.sizes(ms.tensor, ms.move.dst, seg))
                         for ms, src_seg in walked]
                node = self.graph.nodes[step.node]
                self._steps.append((node, step.strategy, seg, moves, contexts[seg]))
                call = self._direct_call(node, step.strategy, seg)
                if call is not None:
                    self._direct[node.index] = call
                if self.comm.world > 1 and self._early_count_ok(node, step.strategy):
                    self._early_counts.append((node, step.strategy, seg))
        return self._steps

    def _direct_call(self, node, st, seg):
        """For a plain node (no local variant, no shape argument, not random, no empty shard on
        this rank, tensors only at the top level of its arguments): a call with its argument
        list built once, this step's tensors put in by position. The interpreter's per-node
        cost is most of what the executor adds over eager PyTorch."""
        if st.local is not None or node.op in SIZE_ARGS or is_random(node):
            return None
        place = dict(zip(node.inputs, st.inputs))
        if any(p.is_shard and self.sizes(name, p, seg)[self.comm.rank] == 0 for name, p in place.items()):
            return None
        template, slots = list(node.args), []
        for i, a in enumerate(node.args):
            if type(a) is TensorRef:
                slots.append((i, (a.name, place[a.name])))
            elif _has_ref(a):
                return None
        if _has_ref(node.kwargs):
            return None
        target, kwargs, rank = node.target, node.kwargs, self.comm.rank

        def call(held):
            args = template.copy()
            for i, key in slots:
                args[i] = held[key]
            try:
                out = target(*args, **kwargs)
            except RuntimeError as e:  # as run_node says it: which node, strategy, device
                raise RuntimeError(f"{node.name} = {node.op} [{st}] on device {rank}: {e}") from e
            return tuple(out) if isinstance(out, (list, tuple)) else (out,)

        return call

    def reshard(self, ratios: Sequence[Sequence[float]], optimizers: Sequence[torch.optim.Optimizer] = ()) -> int:
        """Between steps, move every sharded parameter and buffer to the shard sizes of new
        ratios (per segment, per rank), exactly: rows travel between ranks (collectives.resplit),
        nothing is recomputed. Parameters stay the same objects, so `optimizers` keep them;
        their per-parameter state of the parameter's shape (momentum, Adam's moments) moves
        with it. A collective: every rank calls it with the same ratios. Returns the bytes this
        rank sent and received."""
        # every rank checks, then all learn of any refusal and of ratios other than rank 0's: a
        # rank refusing (or moving other rows) alone would leave the others waiting in a resplit
        refused = None
        try:
            ratios = _checked_ratios(ratios, len(self.ratios), self.comm.world)
        except ValueError as e:
            refused = f"reshard: {e}"
        if refused is None and any(p.grad is not None for p in self.params.values()):
            refused = "reshard between steps: gradients must be cleared first (zero_grad(set_to_none=True))"
        every = gather_or_refuse(ratios if refused is None else None, refused, self.comm)
        bad = [r for r, other in enumerate(every) if other != every[0]]
        if bad:
            raise ValueError(f"reshard: ranks {bad} were given other ratios than rank 0's {every[0]}")
        sharded = [(name, p, seg) for name, (p, seg) in self.stored.items() if p.is_shard]
        old = {name: self.sizes(name, p, seg) for name, p, seg in sharded}
        old_ratios, self.ratios = self.ratios, ratios
        moved = [(name, p.dim, old[name], self.sizes(name, p, seg)) for name, p, seg in sharded]
        moved = [m for m in moved if m[2] != m[3]]
        try:
            states = self._states_to_move([name for name, *_ in moved], optimizers)
        except ValueError:
            self.ratios = old_ratios  # nothing moved
            raise
        nbytes = 0
        with torch.no_grad():
            for name, dim, before, after in moved:
                x = self.value_of(name)
                entries = states.get(name, [])
                nbytes += _rows_exchanged(before, after, self.comm.rank) * self._row_bytes(name, before) * (1 + len(entries))
                for state, key in entries:
                    state[key] = resplit(state[key].contiguous(), dim, before, after, self.comm)
                new = resplit(x.detach().contiguous(), dim, before, after, self.comm)
                if name in self.params:
                    x.data = new  # the same Parameter: the optimizers hold it
                else:
                    self.buffers[name] = new
        self._steps, self._direct, self._early_counts = None, {}, []  # sizes are compiled in: rebuild
        return nbytes

    def reshard_bytes(self, ratios: Sequence[Sequence[float]], optimizers: Sequence[torch.optim.Optimizer] = ()) -> int:
        """The bytes that would change hands, all ranks together, were reshard(ratios, optimizers)
        called now: the rows of every sharded parameter and buffer that move, and the optimizer
        state that moves with them. Moves nothing; not a collective."""
        ratios = _checked_ratios(ratios, len(self.ratios), self.comm.world)
        total = 0
        for name, (p, seg) in self.stored.items():
            if p.is_shard:
                before, after = self.sizes(name, p, seg), self.classes.split_sizes(name, p.dim, ratios[seg])
                if before == after:
                    continue
                sent = sum(_rows_exchanged(before, after, r) for r in range(self.comm.world)) // 2  # (each row counted twice)
                total += sent * self._row_bytes(name, before) * (1 + len(self._state_entries(name, optimizers)))
        return total

    def _row_bytes(self, name: str, sizes: Sequence[int]) -> int:
        """Bytes of one row (along its shard dim) of the parameter or buffer `name` split in `sizes`."""
        return self.value_of(name).element_size() * math.prod(self.graph.tensors[name].shape) // max(1, sum(sizes))

    def _state_entries(self, name: str, optimizers) -> list[tuple[dict, str]]:
        """The optimizer state entries of parameter `name` that are shaped like it (per_element):
        they move and are saved with it."""
        param, out = self.params.get(name), []
        for opt in optimizers:
            state = opt.state.get(param, {}) if param is not None else {}
            out += [(state, k) for k, v in sorted(state.items()) if isinstance(v, torch.Tensor)
                    and per_element(k, v.shape, param.shape, self.graph.tensors[name].target, True)]
        return out

    def _states_to_move(self, names: list[str], optimizers) -> dict[str, list[tuple[dict, str]]]:
        """Per moved parameter, the optimizer state entries shaped like it; every rank must hold
        the same entries (the resplits are collectives), or a ValueError before any moves."""
        out: dict[str, list[tuple[dict, str]]] = {name: [] for name in names}
        refused = None
        try:
            for name in names:
                out[name] = self._state_entries(name, optimizers)
        except ValueError as e:  # told to every rank, not left waiting in the gather
            refused = f"reshard: {e}"
        mine = [(name, key) for name, entries in out.items() for _, key in entries]
        every = gather_or_refuse(mine, refused, self.comm)
        if any(other != mine for other in every):
            raise ValueError("reshard: the ranks' optimizers hold different per-parameter state (step them alike first)")
        return out

    def _update_buffers(self, held: dict[tuple[str, Placement], torch.Tensor]) -> None:
        """Write every mutated buffer's new value into the buffer as this rank keeps it: a copy
        where the program holds the value in the buffer's own layout (BatchNorm's statistics
        under channel or synchronized batch sharding), else made whole (a gather or an
        all-reduce, the same calls on every rank) and sliced."""
        with torch.no_grad():
            for buf, new in self.graph.buffer_updates.items():
                if buf not in self.buffers:
                    continue
                q, q_seg = self.stored[buf]
                places = [p for (name, p) in held if name == new]
                assert places, f"the program never computes {new}, the new value of buffer {buf}"
                p = min(places, key=lambda p: (p != q, p.kind == "P", p.is_shard))
                x, seg = held[(new, p)].detach(), self._held_seg.get((new, p), q_seg)
                if p != q or self.sizes(new, p, seg) != self.sizes(buf, q, q_seg):
                    if p.is_shard:
                        x = gather_padded(x.contiguous(), p.dim, self.sizes(new, p, seg), self.comm)
                    elif p == P:
                        x = all_reduce(x, self.comm)
                    x = self._local(x, buf, q, q_seg)
                assert x.shape == self.buffers[buf].shape, f"buffer {buf}: new value {tuple(x.shape)}, kept {tuple(self.buffers[buf].shape)}"
                if torch.is_inference_mode_enabled():  # an inference tensor kept would break the next training step;
                    self.buffers[buf].copy_(x)  # one device updates it in place here too (nothing was saved)
                else:
                    self.buffers[buf] = x  # not copied in place: the backward may have saved the old value

    def _span(self, label: str):
        """A named span in the Chrome trace while one is recorded (torch.profiler), else nothing."""
        return torch.profiler.record_function(label) if self.tracing else contextlib.nullcontext()

    def _stretch(self, outs: tuple, seconds: float, drawn: float = 0.0) -> tuple:
        """Emulate a slower device (emulate.py): a node's forward adds (slowdown - 1) times its
        measured time to the debt slept before the next collective, its backward twice that,
        but for the `drawn` seconds of random numbers the forward drew (the whole tensor's, even
        for an empty shard: a dropout's backward only multiplies by the mask it drew)."""
        self.emulation.computed(seconds)
        grads = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not grads:
            return outs
        stretched = _OweInBackward.apply((self.emulation, 2 * max(0.0, seconds - drawn)), *(outs[i] for i in grads))
        out = list(outs)
        for i, t in zip(grads, stretched if isinstance(stretched, tuple) else (stretched,)):
            out[i] = t
        return tuple(out)

    def _timed_noise(self, node, device):
        """A random node's whole draw (rules.local.whole_noise), its seconds kept for _stretch."""
        t0 = time.perf_counter()
        drawn = whole_noise(node, self.graph, device)
        self._drawn += time.perf_counter() - t0
        return drawn

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        early = self._early.pop(self._node, None)
        if early is not None:  # started when the forward began (_start_early_counts)
            out, work, ready_at = early
            self.comm.before()
            work.wait()
            self.comm.off_wire(ready_at)  # an emulated link ran since the start, beside the forward
            out = out.reshape(t.shape)  # (sent as [1]: the count is a 0-dim tensor, and so is the loss it divides)
        else:
            out = all_reduce(t.detach(), self.comm)
        self._waited += time.perf_counter() - t0
        return out

    def _start_early_counts(self, values: dict[str, torch.Tensor]) -> None:
        """A loss's mean over class-index targets divides by the global count of its targets,
        an all-reduce in the middle of the forward where every rank would wait for the
        slowest. The count needs only the labels (data loaded up front), so start that
        all-reduce now, asynchronously, and collect it when the loss node asks (_sum)."""
        self._early = {}
        self._compiled()  # finds the losses that count early, once
        for node, st, seg in self._early_counts:
            self._node = node.index  # (the node loading them)
            local = _NoneForMissing((name, self._load(name, p, seg, values))
                                    for name, p in zip(node.inputs[1:], st.inputs[1:]))
            count = label_count(substitute(node.args, local), substitute(node.kwargs, local)).reshape(1)
            self.comm.launching()
            # its link time is latency, beside the forward's own collectives (as priced: early_count_seconds)
            ready_at = self.comm.on_wire("all_reduce", count.numel() * count.element_size(), occupies=False)
            self._early[node.index] = (count, wire.all_reduce(count, group=self.comm.group, async_op=True), ready_at)

    def _early_count_ok(self, node, st) -> bool:
        """The loss counts early when it is such a mean and its labels (and weights) are leaves
        this step loads itself."""
        if not counts_early(node, st, self.graph):
            return False
        loaded = {(ld.tensor, ld.placement) for ld in self.program_loads[node.index]}
        return all((name, p) in loaded for name, p in zip(node.inputs[1:], st.inputs[1:]))

    def sync_gradients(self) -> None:
        """All-reduce, in one bucket, the partial gradients of parameters kept whole (R)."""
        if self.comm.world == 1:
            return
        whole = [p for name, p in self.params.items() if self.stored[name][0] == R and p.requires_grad]
        for p in whole:  # a rank whose share reached no use of p (an idle rank) adds zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in whole]
        if not grads:
            return
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), self.comm)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def _has_ref(obj) -> bool:
    if isinstance(obj, TensorRef):
        return True
    if isinstance(obj, (list, tuple)):
        return any(_has_ref(x) for x in obj)
    if isinstance(obj, dict):
        return any(_has_ref(x) for x in obj.values())
    return False


class _NoneForMissing(dict):
    """Values by tensor name; tensors not at hand yet (the logits) read as None."""

    def __missing__(self, key):
        return None


class _OweInBackward(torch.autograd.Function):
    """Identity; its backward adds a node's emulated backward time to the debt."""

    @staticmethod
    def forward(ctx, owed, *xs):
        ctx.owed = owed
        return tuple(x.view_as(x) for x in xs) if len(xs) > 1 else xs[0].view_as(xs[0])

    @staticmethod
    def backward(ctx, *gs):
        emulation, seconds = ctx.owed
        emulation.computed(seconds)
        return (None, *gs)


def _free_move(dst: Placement, needs_grad: bool, src: Placement = R) -> Move:
    """The move from a whole tensor (R or D) to dst that needs no communication forward."""
    found = [mv for mv in moves_between(src, dst, needs_grad) if mv.fwd is None]
    assert found, f"no local move {src} -> {dst}"
    return found[0]


def _checked_ratios(ratios, segments: int, world: int) -> list[list[float]]:
    """Ratios per segment as the executor takes them: one list per segment (or one list for a
    one-segment plan), one non-negative share per rank, some share positive."""
    rows = [list(map(float, ratios))] if ratios and not isinstance(ratios[0], (list, tuple)) else [list(map(float, r)) for r in ratios]
    if len(rows) != segments:
        raise ValueError(f"ratios for {len(rows)} segments, the plan has {segments}")
    for r in rows:
        if len(r) != world:
            raise ValueError(f"ratios {r} for {len(r)} ranks, this run has {world}")
        if any(x < 0 or x != x for x in r) or sum(r) <= 0:
            raise ValueError(f"ratios {r} must be non-negative with a positive sum")
    return [[x / sum(r) for x in r] for r in rows]


def _rows_exchanged(before: Sequence[int], after: Sequence[int], rank: int) -> int:
    """Rows rank sends plus rows it receives when shards of sizes `before` become `after`."""
    def span(sizes):
        start = sum(sizes[:rank])
        return start, start + sizes[rank]

    (a0, a1), (b0, b1) = span(before), span(after)
    kept = max(0, min(a1, b1) - max(a0, b0))
    return (a1 - a0 - kept) + (b1 - b0 - kept)
