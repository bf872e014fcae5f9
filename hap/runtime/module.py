"""hap.HAP: a DDP-like wrapper that plans, shards and runs a model on every rank.

    dist.init_process_group("gloo")                      # or hap.runtime.launch.spawn(...)
    dmodel = hap.HAP(model, cluster, example_inputs)      # same seed, same model on every rank
    opt = torch.optim.Adam(dmodel.parameters())           # this rank's shards
    loss = dmodel(*batch); loss.backward(); opt.step()    # batch: the global batch

Rank 0 plans (or the plan given is used), every rank receives the same plan, checks that its
digest agrees with every other rank's and that the plan is for this many ranks, captures the
model itself (or takes the graph given, `graph=`: captured once by a launcher, checked against
the model) and keeps only its part of each parameter and buffer. The returned loss has the
value of the global loss on every rank; its backward is exact, the gradients of parameters kept
whole are all-reduced in buckets overlapped with the backward (gradsync.py), and the buffers the
model mutates (BatchNorm's statistics) are updated as on one device. `full_state_dict()` gives
the trained state whole, under the model's own keys. A batch of another shape runs the plan's
program at the plan's ratios, or one planned for it on the same layout (`shapes` lists them).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import math
import weakref
import zlib
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .._torch import is_view, route_clip_grad_norm, route_grad_scaler, tree_unflatten, versions
from ..capture import adopt, capture, example_tuple
from ..cost.cluster import Cluster
from ..ir import Graph
from ..placement import R
from ..plan import Plan, shard_sizes
from ..planner import PlannerConfig, estimate, plan as make_plan, plan_for_layout, priced
from ..rules import strategies_for, strategy_table
from ..rules.local import is_random
from ..rules.units import ShardClasses
from ..search.astar import SearchError
from .collectives import Comm, WaitClock, all_reduce, broadcast, every_rank, gather_or_refuse, global_rank
from . import ledger, wire
from .emulate import Emulation
from .executor import Executor, check_inputs, leaf_values, model_state, per_element
from .gradsync import GradSync, Groups
from .launch import collective_timeout
from .mirror import MirrorsModel, module_modes

log = logging.getLogger("hap")

SHAPES_KEPT = 32
"""Executors of input shapes other than the planned one a model keeps (captured again when met
after being dropped)."""


_DDP_ONLY = {
    "no_sync": "gradient accumulation is exact without it (several backwards, then one optimizer step: each "
               "backward's gradients are summed over the ranks once)",
    "module": "the wrapped model is dmodel.model",
    "join": "every rank runs the same steps (give each the same number of batches: a rank running a step more "
            "ends the run naming both ranks' calls)",
    "require_backward_grad_sync": "each backward's gradients are summed over the ranks (accumulation is exact)",
    "register_comm_hook": "how gradients are synchronized is the plan's (its sync entries; `hap sync` searches "
                          "strategies, compression included)",
}
"""DistributedDataParallel's attributes that hap.HAP has not, and why each is not needed."""


class HAP(MirrorsModel):
    @ledger.called("hap.HAP(model, ...) (wrapping the model)")
    def __init__(self, model: nn.Module, cluster: Cluster, example_inputs: Sequence[torch.Tensor], plan: Plan | None = None,
                 config: PlannerConfig | None = None, comm: Comm | None = None,
                 init: Callable[[nn.Module], None] | None = None, global_loss: bool = True, graph: Graph | None = None):
        """init: for a model built on the meta device (too large for one device), how to fill a
        submodule's parameters once materialized (default: its reset_parameters()). Submodules
        are materialized one at a time, in model.modules() order, and only this rank's part of
        each parameter is kept, so no rank ever holds the whole model.

        global_loss: forward returns the loss of the global batch on every rank (one scalar
        all-reduce per step); False returns this rank's part of it (the parts sum to the loss,
        and backward is the same), saving that all-reduce, as DDP returns each rank's own loss.
        The step's checks ride on that all-reduce: without it, the ranks' inputs, the wrapped
        model's later changes and load_state_dict on some ranks only go unchecked (what the ranks
        hold whole is compared once, at the first step).

        graph: the model already captured on these inputs (hap.capture(model, example_inputs):
        the graph the plan was made for, pickled to the ranks), not captured again; a ValueError
        names what differs where it is another model's or other inputs'. The graph's computation
        is what runs: the model is checked for its parameters, buffers and modules' modes, not
        for its forward's code (a rank's model with an activation of its own is not seen)."""
        super().__init__()
        if not isinstance(model, nn.Module):  # (it was an AttributeError: 'function' object has no attribute 'parameters')
            raise TypeError(f"hap.HAP wraps a torch.nn.Module whose forward returns the loss, got {type(model).__name__}")
        comm = rank_comm(cluster, comm, "hap.HAP")
        if comm.emulation is None:  # the cluster's emulated slow devices and links (local cluster)
            comm = dataclasses.replace(comm, emulation=Emulation.for_rank(cluster, comm.rank))
        if comm.clock is None:  # time inside collectives: a step less it is this rank's busy time
            comm = dataclasses.replace(comm, clock=WaitClock())
        self.comm, self.cluster = comm, cluster
        object.__setattr__(self, "model", model)  # not a submodule: parameters() are this rank's shards only
        self.global_loss = global_loss
        self.piggyback: torch.Tensor | None = None
        """Numbers to sum over ranks with the next forward's loss (global_loss): a flag every
        rank needs, at no extra collective. The sums land in `piggybacked`."""
        self.piggybacked: torch.Tensor | None = None
        self.piggyback_size = 0
        """How many numbers every forward's sum carries besides the loss (a Mitigator's: set on
        every rank at once): a rank with no piggyback this step sends zeros, so the sums agree in
        size (a Mitigator stepped on some ranks alone had aborted gloo, the mismatch unnamed)."""
        self._losses: list[weakref.ref] = []  # the losses forward returned with a graph, alive (see reshard)
        self._step_check: StepCheck | None = None  # the last forward's, where a GPU's verdict is read later
        self._compare_alike = True  # at the next step: what the ranks hold whole (an initialization after wrapping)
        self._sums = 0  # the loss's sums over ranks so far (spot_check_due)
        self._loaded = False  # load_state_dict since the last step (on every rank, or a ValueError)
        example_inputs = example_tuple(example_inputs)
        meta = any(p.is_meta for p in model.parameters())
        if meta:  # capture traces shapes only: give it the inputs on the model's device
            example_inputs = tuple(x.to("meta") for x in example_inputs)
        if graph is None:
            graph = capture(model, example_inputs)
        else:
            graph = adopt(graph, model, example_inputs)
        self.graph = graph
        self._state_keys = state_keys(model, graph)
        if plan is None and comm.rank == 0:
            try:
                plan = make_plan(graph, cluster, config)
            except (ValueError, TypeError, SearchError) as e:  # told to the others, waiting for the plan
                plan = e
        self.plan = agree_plan(plan, comm, graph, {"global_loss": (f"global_loss={global_loss}", global_loss),
                                                   **cluster_setting(cluster)})
        segment_of = self.plan.segment_of
        classes = ShardClasses(graph, enumerate(strategy_table(graph)))
        self.plan.check_shards(graph, classes)  # (this rank's rounding: the same on every rank)
        self.executor = ex = Executor(graph, self.plan.steps(graph), classes, segment_of, self.plan.ratios, comm)
        ex.param_alias = self._param_alias
        if meta:
            for values in _materialized(model, graph, init):
                ex.shard_parameters(values)
        else:
            ex.shard_parameters(leaf_values(graph, model, example_inputs))
        self.shards = dict(model_named_by_graph(ex.params, graph))  # by graph tensor name, in the model's order
        # children: the model's modules holding these shards, so walks of the module (parameters(),
        # named_parameters(), a library's weight-decay groups, AveragedModel's pairing) are the model's
        sharded = {name: p for name, p in self.shards.items() if ex.stored[name][0].is_shard}
        self.mirror_model(model, held_by_original(model, graph, self.shards), frozenset(held_by_original(model, graph, sharded)))
        from .checkpoint import sync_idle
        sync_idle(self)  # the parameters no node uses: rank 0's, as the others
        self.groups: dict = {}  # process groups by (devices, lane), made at start-up and by resync
        self.grad_sync: GradSync | None = None
        self.resync(self.plan.sync)
        self._random = any(is_random(node) for node in graph.nodes)
        self._meta = meta
        self._by_shape: dict[tuple, Executor] = {input_shapes(graph): ex}
        self._parts: dict[int, tuple] = {}  # rank -> its part of the planned batch (shapes)
        self.shapes: list[dict] = []
        """Input shapes (and eval mode) met besides the planned one, in order: {shapes, run, estimated_seconds, training}."""
        _watch_optimizers({id(p): (p, graph.tensors[name].target) for name, p in ex.params.items() if ex.stored[name][0].is_shard},
                          comm)
        self.train(model.training)  # the model's mode, as DDP keeps it (a model fine-tuned in eval mode)
        watch_wrapped(model)
        # gradients not alike on every rank (shards), or alike but not synced (duplicated
        # computation: a clip on one rank alone trains that rank's copies apart unseen): torch's
        # clip_grad_norm_ of them is a collective, so a clip on some ranks alone is a parting
        synced = {e.param for e in self.plan.sync}
        if comm.world > 1 and any(ex.stored[name][0].is_shard or (name not in synced and p.requires_grad)
                                  for name, p in ex.params.items()):
            spread_gradients(self)
        self._wrapped = WrappedWatch.of(model, graph, ex.params, functools.partial(_held_part, ex))

    @torch.compiler.disable  # torch.compile(dmodel) runs it as it is: tracing its Python would recompile every step
    def forward(self, *batch: torch.Tensor, part: bool | None = None, **named) -> torch.Tensor:
        """The loss of the global batch. Each input is given whole (the global batch) or as this
        rank's part of it (rows `input_slices()` names), which is all this rank then loads. A
        batch of another shape (the last, smaller batch of an epoch; another sequence length)
        is given whole: the plan's program runs it at the plan's ratios (captured once per
        shape, reported in `shapes`).

        part: whether the inputs are this rank's part of the planned batch; None: told by every
        rank's shapes together (a small collective where they are not the planned batch's; with
        equal parts on every rank they could be either: say part=True or part=False)."""
        if named:
            raise TypeError(f"hap.HAP takes the model's inputs by position, in the order of the example inputs "
                            f"(got {', '.join(map(repr, named))} by name)")
        with ledger.call("a training forward, dmodel(...)" if self.training else
                         "an evaluation forward, dmodel(...) in eval mode"):
            return self._forward(batch, part)

    def _forward(self, batch: tuple[torch.Tensor, ...], part: bool | None) -> torch.Tensor:
        if self.grad_sync is not None:
            self.grad_sync.forward_begins()
        check, self._step_check = self._step_check, None
        if check is not None:
            check.verify()
            self._compare_alike = check.compare_next(self._compare_alike)
        changed = self._follow_original()
        if changed and not self.global_loss:  # (no sum to tell the others by)
            raise ValueError(changed)
        if self._random:  # random ops draw on every rank what one device would (rules/local.py)
            self._sync_rng()
        check_inputs(batch, self.graph)
        if torch.is_grad_enabled():
            check_trainable(self.shards, self.graph)
        values = dict(zip(self.graph.inputs, batch))  # parameters and buffers are the executor's
        ex, presliced = self._executor_for(batch, part) if self.training else self._evaluator_for(batch, part)
        part = ex.forward(values, presliced)  # this rank's part of the loss
        self._sums += self.global_loss
        spot = not self._compare_alike and self.global_loss and spot_check_due(self._sums)
        alike = self._alike() if self._compare_alike else self._alike(synced_only=True) if spot else ()
        loaded, self._loaded = self._loaded, False
        if not self.global_loss:
            if alike:
                self._compare_once(alike, part.device)
            self._keep_loss(part)
            return self._as_returned(part)
        given = self.piggyback if self.piggyback is not None else torch.zeros(self.piggyback_size, dtype=torch.float64)
        total, summed, check = sum_step(part, given, [None if name in presliced else x for name, x in
                                                      zip(self.graph.inputs, batch)], changed, self.comm, loaded, alike)
        total = total.to(part.dtype)
        if self.piggyback is not None:
            self.piggybacked, self.piggyback = summed.to(given.dtype), None
        self._step_check = check.now_or_later()
        if self._step_check is None:
            self._compare_alike = check.compare_next(self._compare_alike)
        loss = part + (total - part).detach()  # the global loss's value, the part's gradient
        self._keep_loss(loss)
        return self._as_returned(loss)

    def _compare_once(self, alike: list[tuple[str, torch.Tensor]], device: torch.device) -> None:
        """Without the loss's all-reduce (global_loss=False), the first step's comparison of
        what the ranks hold whole, by a sum of its own (once: no step sums the loads after)."""
        check = sum_step(torch.zeros((), device=device), torch.zeros(0, dtype=torch.float64), [], None, self.comm,
                         alike=alike)[2]
        check.verify()
        self._compare_alike = False

    def _alike(self, synced_only: bool = False) -> list[tuple[str, torch.Tensor]]:
        """(state-dict key, tensor) of every parameter and buffer every rank holds whole, for
        sum_step to compare; synced_only: the parameters whose gradients the ranks sum (the same
        update on every rank, bit for bit: a spot check's, where a tensor each rank computes
        itself, a GPU's atomics in its gradient, may drift apart by rounding over many steps)."""
        if self.comm.world == 1:
            return []
        ex, tensors = self.executor, self.graph.tensors
        synced = {e.param for e in self.plan.sync} if synced_only else None
        params = [(tensors[name].target, p) for name, p in ex.params.items()
                  if not ex.stored[name][0].is_shard and (synced is None or name in synced)]
        buffers = [] if synced_only else [(tensors[name].target, b) for name, b in ex.buffers.items()
                                          if name in ex.stored and not ex.stored[name][0].is_shard]
        # the optimizers' settings first: where they differ, the copies below differ for it
        return [(OPTIMIZER_SETTINGS, optimizer_settings(self.parameters()))] + params + buffers

    def _follow_original(self) -> str | None:
        """model.train() or model.eval() on the model hap.HAP wrapped, since the last forward, is
        followed, as DDP's wrapped module is (dmodel.train() and dmodel.eval() switch it too);
        a module's own mode changed is a ValueError. Returns WrappedWatch.changed_values()."""
        self.refuse_shell_mode_change()
        modes, params = self._wrapped.walk()
        mode = self._wrapped.switched(modes)
        if mode is not None:
            nn.Module.train(self, mode)
            self.mirror_modes(self.model)
        return self._wrapped.changed_values(params)

    def apply(self, fn):
        """Refused: `fn` (an initialization, DDP's module.apply habit) would reach this rank's
        shards alone, each rank drawing its own rows otherwise than one device draws the whole."""
        raise ValueError("dmodel.apply(fn) would reach this rank's shards of the parameters alone, not the model's "
                         "layers: initialize the model before wrapping it, or load weights into hap with "
                         "dmodel.load_state_dict(...)")

    def _follow_mode(self, mode: bool) -> None:
        """dmodel.train(mode): the model hap.HAP wrapped is put in it too (WrappedWatch.set)."""
        if "_wrapped" in self.__dict__:
            self._wrapped.set(mode)

    def _as_returned(self, loss: torch.Tensor):
        """The loss in the structure the model's forward returns it in ((loss,), {"loss": loss})."""
        return loss if self.graph.returns is None else tree_unflatten([loss], self.graph.returns)

    def _keep_loss(self, loss: torch.Tensor) -> None:
        """Remember a returned loss that holds a graph (a training step's; an eval forward's
        under torch.no_grad holds none), for reshard to let its graph go."""
        if loss.grad_fn is not None:
            self._losses = [ref for ref in self._losses if ref() is not None] + [weakref.ref(loss)]
            loss.register_hook(_backward_begins)  # (every rank backpropagates every step: its gradient sync)

    def input_slices(self) -> list[tuple[int, int, int] | None]:
        """Per model input, the rows this rank needs: (dim, start, length) of the global batch, or
        None where it needs the whole input. A data loader reads just these rows per rank."""
        slices = self.executor.input_slices()
        return [slices[name] for name in self.graph.inputs]

    def local_batch(self, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part of the planned global batch (what `input_slices` names). A batch of
        another shape has no parts: it is given whole, `dmodel(*batch)` (a ValueError here)."""
        planned = input_shapes(self.graph)
        key = tuple(tuple(x.shape) for x in batch)
        if key != planned:
            raise ValueError(f"local_batch cuts the planned batch {planned}, not {key}: give a batch of another "
                             "shape whole, dmodel(*batch)")
        return tuple(x if s is None else x.narrow(*s) for x, s in zip(batch, self.input_slices()))

    def _executor_for(self, batch: Sequence[torch.Tensor], part: bool | None) -> tuple[Executor, frozenset[str]]:
        """The executor for these inputs, and which of them are this rank's part: the planned
        shape (whole, or this rank's part of it), or another global batch shape (a last, smaller
        batch; another sequence length), met before or new."""
        key = tuple(tuple(x.shape) for x in batch)
        mine = self._part_shapes(self.comm.rank)
        if part:
            if key != mine:
                raise ValueError(f"inputs of shape {key} are not this rank's part {mine} of the planned batch")
            return self.executor, self._sliced(batch)
        planned = input_shapes(self.graph)
        if key == planned:
            return self.executor, frozenset()
        # Not the planned batch: this rank's part, or a global batch of another shape (a last,
        # smaller batch), which may be the same shape. The ranks decide together, from every
        # rank's shapes, so that all run the same collectives next.
        ledger.rename("a training forward, dmodel(...), of inputs not of the planned batch's shapes (a part, or "
                      "another batch)")
        seen = every_rank(key, self.comm)
        parts = part is None and all(k == self._part_shapes(r) for r, k in enumerate(seen))
        if parts and len(set(seen)) == 1:
            raise ValueError(f"inputs of shape {key} are every rank's part of the planned batch and could be a "
                             "global batch too: call dmodel(*batch, part=True) or part=False")
        if parts:
            return self.executor, self._sliced(batch)
        if len(set(seen)) > 1:
            raise ValueError(f"ranks were given inputs of different shapes {sorted(set(seen))}: give every rank the "
                             f"whole batch, or each rank its part of the planned {planned} (part=True)")
        return self._kept(key, lambda: self._reuse_plan(batch, key)), frozenset()

    def _kept(self, key: tuple, make: Callable[[], Executor]) -> Executor:
        """The executor of input shapes `key`, made by make() where it is not kept; at most
        SHAPES_KEPT besides the planned shape's are kept, the least recently used going first (a
        loader of many sequence lengths would keep a graph for each). Every rank meets the same
        shapes, so all drop the same."""
        ex = self._by_shape.pop(key, None)
        made = ex is None
        self._by_shape[key] = ex = make() if made else ex  # the most recently used last
        if made:
            others = [k for k in self._by_shape if k != input_shapes(self.graph)]
            for k in others[: max(0, len(others) - SHAPES_KEPT)]:
                del self._by_shape[k]
        return ex

    def _part_shapes(self, rank: int) -> tuple:
        """Rank `rank`'s part of the planned batch: its inputs' shapes."""
        if rank in self._parts:
            return self._parts[rank]
        out = []
        for name in self.graph.inputs:
            shape = list(self.graph.tensors[name].shape)
            places = self.executor.loads.get(name, set())
            if len(places) == 1 and next(iter(places))[0].is_shard:
                p, seg = next(iter(places))
                shape[p.dim] = self.executor.sizes(name, p, seg)[rank]
            out.append(tuple(shape))
        self._parts[rank] = tuple(out)
        return self._parts[rank]

    def _sliced(self, batch: Sequence[torch.Tensor]) -> frozenset[str]:
        """The inputs given as this rank's rows (not of their planned whole shape)."""
        return frozenset(n for n, x in zip(self.graph.inputs, batch) if x.shape != self.graph.tensors[n].shape)

    def _evaluator_for(self, batch: Sequence[torch.Tensor], part: bool | None) -> tuple[Executor, frozenset[str]]:
        """In eval mode (dmodel.eval()): the executor of the model's eval graph at these inputs'
        shape (no dropout; BatchNorm reads its running statistics and leaves them), captured once
        per shape, parameters and buffers shared with the training executor."""
        key = ("eval", tuple(tuple(x.shape) for x in batch))
        whole = "in eval mode give every rank the whole batch"
        if part:
            raise ValueError(f"inputs of shape {key[1]} given as this rank's part (part=True): {whole}")
        # The ranks tell parts from a whole batch together, as in training (a whole batch whose
        # rows are one rank's share is a whole batch; a rank deciding alone refused it alone), and
        # capture a new shape together: they must all be given it.
        other = part is None and key[1] != input_shapes(self.graph)
        if other or key not in self._by_shape:
            seen = [k for _, k in every_rank(key, self.comm)]
            if other and all(k == self._part_shapes(r) for r, k in enumerate(seen)):
                raise ValueError(f"inputs of shape {key[1]} are this rank's part of the planned batch: {whole} "
                                 "(part=False where it is one)")
            if len(set(seen)) > 1:
                raise ValueError(f"ranks were given inputs of different shapes {sorted(set(seen))} in "
                                 f"eval mode: {whole}")
        return self._kept(key, lambda: self._reuse_plan(batch, key[1], training=False)), frozenset()

    def _reuse_plan(self, batch: Sequence[torch.Tensor], key: tuple, training: bool = True) -> Executor:
        """Run a batch of another shape (the global batch, given to every rank: _executor_for
        checked), or in eval mode, with the plan's program at the plan's ratios: captured at
        this shape and mode once, its shards cut by the same shares, parameters and buffers
        shared with the planned executor. Where the program cannot run this graph, the graph
        is planned keeping the parameters' layout; where that fails, a one-line ValueError."""
        planned = input_shapes(self.graph)
        inputs = tuple(x.to("meta") for x in batch) if self._meta else tuple(batch)
        base = self.executor
        try:
            with _buffers_on_meta(self.model) if self._meta else contextlib.nullcontext():
                graph = capture(self.model, inputs, training=training)
            plan, how = self.plan, "the plan's program at its ratios"
            if not _runs(plan, graph):  # the graph changed with the shape: plan it, keeping the layout
                kept = {name: p for name, (p, _) in base.stored.items()}  # every rank plans; they must agree
                segment_of = _segments_like(self.graph, base.segment_of, graph)
                plan = agree_plan(plan_for_layout(graph, self.cluster, self.plan.ratios, kept, segment_of=segment_of),
                                  self.comm, graph)
                how = f"a program planned for it in {plan.synthesis_seconds:.2f} s"
            ex = Executor(graph, plan.steps(graph), ShardClasses(graph, enumerate(strategy_table(graph))),
                          plan.segment_of, plan.ratios, self.comm)
            for name, (p, seg) in base.stored.items():
                if ex.kept.get(name, (p, seg)) != (p, seg) or ex.sizes(name, p, seg) != base.sizes(name, p, seg):
                    raise ValueError(f"{self.graph.tensors[name].target} would be split otherwise")
        except (ValueError, SearchError) as e:
            mode = "" if training else " in eval mode"
            raise ValueError(f"inputs of shape {key}{mode}: the plan for {planned} cannot run them: {e}") from None
        ex.params, ex.buffers, ex.stored, ex.tracing = base.params, base.buffers, base.stored, base.tracing
        ex.param_alias = base.param_alias
        self._add_unplanned_params(ex, key, training)
        priced = estimate(graph, self.cluster, plan)
        seconds = priced.seconds if training else priced.forward_seconds  # (eval: a forward, no backward or sync)
        self.shapes.append({"shapes": key, "run": how, "estimated_seconds": seconds, "training": training})
        log.info("hap: inputs of shape %s%s run %s (estimated %.1f ms per %s)", key, "" if training else " in eval mode",
                 how, seconds * 1e3, "step" if training else "forward")
        return ex

    def _add_unplanned_params(self, ex: Executor, key: tuple, training: bool) -> None:
        """Parameters that `ex`'s graph uses and the planned one does not (a calibration layer
        used in eval mode alone: "no value for leaf p_calib_weight"): whole on every rank, the
        model's own tensors (rank 0's values on every rank since the wrapping). In training a
        ValueError: hap trains (and sums the gradients of) what the planned graph uses."""
        # (a parameter no node of `ex` reads, a BERT pooler under a token head, is no such use)
        extra = [name for name, t in ex.graph.tensors.items()
                 if t.kind == "param" and t.consumers and name not in ex.params]
        if not extra:
            return
        if training:
            raise ValueError(f"inputs of shape {key} use parameter {ex.graph.tensors[extra[0]].target}, which the "
                             f"planned batch's graph does not: hap trains the parameters the planned graph uses (plan "
                             "with a batch that uses it, or use it in eval mode alone)")
        state = model_state(self.model)
        held = {name: state[ex.graph.tensors[name].target] for name in extra}
        ex.params = {**ex.params, **held}
        ex.stored = {**ex.stored, **{name: (R, 0) for name in extra}}

    def _sync_rng(self) -> None:
        torch.set_rng_state(broadcast(torch.get_rng_state(), 0, self.comm))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in _DDP_ONLY:  # (DDP's habits: a bare AttributeError left the user guessing)
                raise AttributeError(f"hap.HAP has no {name} (DistributedDataParallel's): {_DDP_ONLY[name]}") from None
            raise

    def grad_scaler(self, **kwargs) -> torch.amp.GradScaler:
        """A loss scaler for mixed precision (torch.amp.GradScaler, its kwargs) on this model's
        device, which skips a step on every rank when any rank's gradient shard overflows, as any
        plain GradScaler does whose optimizer steps this model's parameters (spread_gradients).
        (It was torch's ShardedGradScaler, whose CPU update grows the scale to inf, where one
        device's stays finite, and then skips every step.)"""
        device = next((p.device.type for p in self.shards.values()), "cpu")
        return torch.amp.GradScaler(device, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: the norm of the global gradient
        (every rank's shards of sharded parameters, parameters kept whole counted once), the
        same on every rank; every local gradient is scaled by min(1, max_norm / (norm + 1e-6)).
        A collective: every rank calls it, after backward. Returns the total norm.
        (torch.nn.utils.clip_grad_norm_(dmodel.parameters(), ...) does the same: spread_gradients.)"""
        return clip_spread_(self, max_norm, norm_type)

    def spread_grads(self) -> tuple[list[tuple[torch.Tensor, bool]], torch.dtype | None]:
        """This rank's gradients, each with whether this rank counts it in the global norm (its
        shards of sharded parameters, and on rank 0 alone those kept whole, equal on every
        rank); and the norm's dtype (None: the gradients')."""
        return [(p.grad, self.executor.stored[name][0].is_shard or self.comm.rank == 0)
                for name, p in self.shards.items() if p.grad is not None], None

    @ledger.called("dmodel.reshard(...)")
    def reshard(self, ratios: Sequence[float] | Sequence[Sequence[float]],
                optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = ()) -> int:
        """Between steps, give every rank a new share of the work: parameters, buffers and each
        optimizer's per-parameter state move to the shard sizes of `ratios` (one share per
        rank; per segment for a plan of several), exactly, and the plan says so from then on
        (`plan.ratios`, its shard sizes, its estimate). A collective: every rank calls it with
        the same ratios, after zero_grad(set_to_none=True). Returns the bytes this rank sent
        and received."""
        optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        refused = _optimizer_left_behind(self.shards.values(), optimizers)
        refused = refused or next((why for why in map(whose_state, optimizers) if why is not None), None)
        gather_or_refuse(None, refused, self.comm)  # (a state not this rank's would move as if it were)
        # The last step's graph, alive while the caller holds its loss, keeps each parameter's
        # gradient accumulator with the old shape, which the next backward would meet: let it go
        # (the loss keeps its value; a graph already backpropagated is of no further use).
        for ref in self._losses:
            last = ref()
            if last is not None and last.grad_fn is not None and not is_view(last):  # a view cannot detach in place
                last.detach_()
        self._losses = []
        ex = self.executor
        nbytes = ex.reshard(ratios, optimizers)
        stamp_state(optimizers)  # their state is this rank's at the new layout
        self._check_no_old_graph()
        plan = self.plan.with_ratios(ex.ratios, shard_sizes(ex.program, self.graph, ex.classes, ex.segment_of, ex.ratios))
        self.plan = priced(self.graph, self.cluster, plan)
        self._by_shape = {input_shapes(self.graph): ex}  # other shapes' executors were cut at the old shares
        self._parts = {}
        log.info("hap: resharded to %s (%d bytes moved on rank %d)", ex.ratios, nbytes, self.comm.rank)
        return nbytes

    def _check_no_old_graph(self) -> None:
        """After a reshard: a graph of an earlier step that something still holds (loss / 2,
        kept by the loop) keeps each parameter's gradient accumulator at its old shape, which
        the next backward would meet with a cryptic autograd error; a gradient taken here (no
        .grad touched) meets it now, and says what to do."""
        for p in self.shards.values():
            if not p.requires_grad:
                continue
            try:
                torch.autograd.grad(p.view_as(p).sum(), [p])
            except RuntimeError as e:
                if "invalid gradient" not in str(e):
                    raise
                raise ValueError("reshard: a tensor computed from an earlier step's loss (say loss / 2, kept by the "
                                 "training loop) is still alive, and its graph holds the parameters at their old "
                                 "shapes: release it before reshard (del it, or keep loss.item())") from None

    def _param_alias(self, param: torch.Tensor) -> torch.Tensor:
        """What the executors compute with for a parameter kept whole (GradSync.alias)."""
        return param if self.grad_sync is None else self.grad_sync.alias(param)

    @ledger.called("dmodel.resync(...)")
    def resync(self, sync) -> None:
        """Synchronize gradients by other sync entries (plan.SyncEntry: a strategy of
        hap.sync) from the next backward on; the plan says so from then on. A collective: every
        rank calls it with the same entries, between steps (it may make process groups)."""
        sync = list(sync)
        plan = dataclasses.replace(self.plan, sync=sync)
        bad = unlike_rank_0(every_rank(plan.digest, self.comm))  # they would wait in each other's collectives
        if bad:
            raise ValueError(f"resync: ranks {bad} were given sync entries other than rank 0's")
        machines = self.cluster.machines
        self.groups = _device_groups(plan, self.comm, Groups(self.comm, machines, {}).needed(sync), self.groups)
        plan.check_sync_fits(self.graph, [self.executor.program])
        # made before the old one goes: a refused one (a ValueError) leaves the old sync running
        grad_sync = GradSync(sync, dict(self.shards), Groups(self.comm, machines, self.groups))
        if self.grad_sync is not None:
            # PowerSGD's error feedback goes on where a part stays compressed alike, else it is dropped
            dropped = grad_sync.restore_compressor_state(self.grad_sync.compressor_state())
            if dropped and self.comm.rank == 0:
                log.warning("hap: resync drops PowerSGD's error feedback of %d part(s) (%s%s): the new entries do not "
                            "compress them alike", len(dropped), dropped[0][0], ", ..." if len(dropped) > 1 else "")
            self.grad_sync.close()
        self.grad_sync = grad_sync
        if sync != self.plan.sync:  # priced with these entries from now on
            plan = priced(self.graph, self.cluster, dataclasses.replace(plan, search={**plan.search, "sync": "resync"}))
        self.plan = plan

    @ledger.called("dmodel.full_parameters()")
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter reassembled whole, by the model's names (a collective: all ranks call it)."""
        return {self.graph.tensors[name].target: self.executor.whole(name, p.detach()) for name, p in self.shards.items()}

    @ledger.called("dmodel.full_state_dict()")
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model's state dict, whole, under the keys of `model.state_dict()` (a tied
        parameter under each of its names): it loads into the original model, which then
        evaluates as the distributed one. A collective: all ranks call it; every rank gets it."""
        ex, out, whole, original = self.executor, {}, {}, wrapped_state(self.model)
        for key, name in self._state_keys.items():
            if name is None or name not in ex.stored:  # not used by the forward: never trained, as on one device
                out[key] = original[key].detach().clone()
                continue
            if name not in whole:
                whole[name] = ex.whole(name, ex.value_of(name).detach()).clone()
            out[key] = whole[name]
        return out

def clip_by_global_norm(counted: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], max_norm: float,
                        norm_type: float, comm: Comm, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over ranks: the norm of `counted` on every rank together
    (each gradient element counted by exactly one rank), then each of this rank's `grads`
    scaled by min(1, max_norm / (norm + 1e-6)). A collective. Returns the total norm, in `dtype`
    (default: the gradients', as torch's; a rank that may hold none must say it)."""
    total = global_norm(counted, grads, norm_type, comm, dtype)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


@ledger.called("clip_grad_norm_ (dmodel's or torch's)")
def clip_spread_(owner: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    """clip_by_global_norm of a wrapper's gradients (`owner.spread_grads()`, over `owner.comm`):
    the clip_grad_norm_ of hap.HAP and hap.Pipeline."""
    grads, dtype = owner.spread_grads()
    return clip_by_global_norm([g for g, counted in grads if counted], [g for g, _ in grads], max_norm, norm_type,
                               owner.comm, dtype)


def global_norm(counted: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], norm_type: float, comm: Comm,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """The norm of `counted` on every rank together (clip_by_global_norm), in `dtype` (default:
    the first of `grads`'). A collective."""
    dtype = dtype or next((g.dtype for g in grads if g.is_floating_point()), torch.float32)
    if math.isinf(norm_type):
        # in float64 on every rank (one with no gradients to count has no dtype to go by), exact for the max
        total = torch.stack([g.abs().max().double() for g in counted if g.numel()]
                            or [torch.zeros((), dtype=torch.float64)]).max().reshape(1)
        comm.before()
        wire.all_reduce(total, op=dist.ReduceOp.MAX, group=comm.group)
        comm.after("all_reduce", 8)
        total = total[0].to(dtype)
    else:
        local = sum((g.double().abs().pow(norm_type).sum() for g in counted), torch.zeros((), dtype=torch.float64))
        total = all_reduce(local.reshape(1), comm)[0].pow(1.0 / norm_type).to(dtype)
    return total


_SPREAD: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
"""Every live wrapper whose gradients are spread over its ranks (spread_gradients)."""


def spread_gradients(owner: nn.Module) -> None:
    """From now on torch.nn.utils.clip_grad_norm_ given `owner`'s gradients clips by their norm
    over all of its ranks, as `owner.clip_grad_norm_` does (a collective then: every rank calls
    it), and a plain torch.amp.GradScaler stepping an optimizer of `owner`'s parameters skips a
    step on every rank where one rank's gradients overflow. Each rank holds its shards of
    sharded parameters (hap.HAP) or its stage's parameters (hap.Pipeline), so torch's norm and
    inf check of them alone would differ by rank, and so would the parameters after the step.
    `owner` has `comm` and `spread_grads()`: its local gradients, each with whether this rank
    counts it, and the norm's dtype."""
    _SPREAD.add(owner)
    route_clip_grad_norm(_spread_norm)
    route_grad_scaler(_agree_found_inf)


@ledger.called("a GradScaler's step")
def _agree_found_inf(optimizer: torch.optim.Optimizer, found: list[torch.Tensor]) -> None:
    """A plain torch.amp.GradScaler's inf flags of `optimizer` summed over the ranks of the spread
    wrapper whose parameters it steps, so that every rank skips a step one rank's shard
    overflows (a collective; dmodel.grad_scaler() is such a scaler)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owner = next((o for o in list(_SPREAD) if any(id(p) in held for p in o.parameters())), None)
    if owner is None:
        return
    total = torch.stack([f.double().cpu() for f in found]).sum().reshape(1) if found else torch.zeros(1, dtype=torch.float64)
    total = all_reduce(total, owner.comm)
    for f in found:
        f.fill_(float(total[0]))


@ledger.called("clip_grad_norm_ (dmodel's or torch's)")
def _spread_norm(grads: list, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor | None:
    """The norm torch.nn.utils.clip_grad_norm_ clips `grads` by where they are a spread
    wrapper's (spread_gradients), else None (torch's own)."""
    owners, dtypes = {}, {}
    for owner in list(_SPREAD):
        pairs, dtypes[id(owner)] = owner.spread_grads()
        for g, counted in pairs:
            owners[id(g)] = (owner, counted)
    found = [owners.get(id(g)) for g in grads]
    if not grads:  # a stage holding no gradient: its owner's norm is a collective all the same
        empty = [owner for owner in list(_SPREAD) if not owner.spread_grads()[0]]
        # (which owner's, an empty list does not tell; where several wrappers hold none here, their
        # norms are the same collective if they share the ranks and the norm's dtype: a second
        # pipeline kept alive had made this rank skip it, and the ranks parted)
        if empty and len({(id(o.comm.group), o.comm.world, dtypes[id(o)]) for o in empty}) == 1:
            return global_norm([], [], norm_type, empty[0].comm, dtypes[id(empty[0])])
    if not any(found):
        return None
    mixed = not all(found) or len({id(owner) for owner, _ in found}) > 1
    if mixed:
        raise ValueError("torch.nn.utils.clip_grad_norm_ was given the gradients of a hap model, spread over its ranks, "
                         "together with others: clip each model's apart (dmodel.clip_grad_norm_)")
    owner = found[0][0]
    total = global_norm([g for g, (_, counted) in zip(grads, found) if counted], grads, norm_type, owner.comm,
                        dtypes[id(owner)])
    if error_if_nonfinite and not torch.isfinite(total):  # the same on every rank, as torch words it
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                           "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                           "anyway, set `error_if_nonfinite=False`")
    return total


_SHARDED: dict[int, tuple[weakref.ref, str, Comm | None]] = {}
"""Every live hap.HAP's sharded parameters by id: (the parameter, its state-dict key, the ranks
sharing it), watched by _check_optimizer_state (by id: a tensor's == is elementwise, so no weak
dictionary of them)."""
_WRAPPED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
"""The parameters of every model a live hap.HAP wrapped, by id: hap trains copies of them (its
shards), so an optimizer built over these (DDP's habit) would step nothing."""
_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, set[int]]" = weakref.WeakKeyDictionary()
_watching = False


_STEPPED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
"""Every live optimizer that has stepped: the spot checks compare the settings of those stepping
a wrapper's parameters (optimizer_settings)."""

IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")
"""Optimizer settings that choose how the update is computed, not what it is: not compared."""


def optimizer_settings(params) -> torch.Tensor:
    """A digest of the settings (learning rate, momentum, betas, weight decay, maximize, ...) and
    class of every optimizer that has stepped any of `params`, one number per parameter group,
    sorted: alike on ranks whose optimizers are set alike, in whatever order they were made,
    and some number apart where any setting differs, however little (a digest, not the numbers,
    whose sum would hide a small learning rate's difference). Each rank's optimizers step the
    parameters every rank holds whole with the same update only where these are alike."""
    held = {id(p) for p in params}
    digests = []
    for opt in list(_STEPPED):
        if not any(id(p) in held for group in opt.param_groups for p in group["params"]):
            continue
        for group in opt.param_groups:
            settings = [(key, _plain(group[key])) for key in sorted(group_settings(group))
                        if key not in IMPLEMENTATION_FLAGS]
            digests.append(float(zlib.crc32(repr((type(opt).__qualname__, settings)).encode())))
    return torch.tensor(sorted(digests), dtype=torch.float64)


def _plain(value):
    """A setting as plain Python values, alike on ranks set alike: numbers (by repr, exactly),
    strings and None as they are, tuples (betas) item by item, a small tensor (a capturable
    learning rate) by its values, not its device; anything else by its type alone (its repr may
    hold an address of its rank's own)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, torch.Tensor):
        return tuple(value.detach().cpu().reshape(-1).tolist()) if value.numel() <= 16 else tuple(value.shape)
    return type(value).__qualname__


def _note_stepped(opt: torch.optim.Optimizer, args, kwargs) -> None:
    _STEPPED.add(opt)


def _watch_optimizers(sharded: dict[int, tuple[torch.Tensor, str]], comm: Comm | None = None) -> None:
    """From now on, after every torch optimizer's step, refuse state that spans one of these
    sharded parameters, shared by the ranks of `comm` (checkpoint and reshard refuse it too; see
    executor.per_element)."""
    global _watching
    for key, (param, label) in sharded.items():
        _SHARDED[key] = (weakref.ref(param, lambda _, key=key: _SHARDED.pop(key, None)), label, comm)
    if not _watching:
        register_optimizer_step_pre_hook(_check_whose_state)
        register_optimizer_step_post_hook(_check_optimizer_state)
        register_optimizer_step_post_hook(_note_stepped)
        _watching = True


def watch_wrapped(model: nn.Module) -> None:
    """From now on an optimizer over `model`'s own parameters is refused at its first step: the
    wrapper (hap.HAP, hap.Pipeline) trains copies of them."""
    _WRAPPED.update((id(p), p) for p in model.parameters())
    _watch_optimizers({})


@ledger.called("an optimizer's first step, optimizer.step()")
def _check_optimizer_state(opt: torch.optim.Optimizer, args, kwargs) -> None:
    """A ValueError after the first step of an optimizer over a wrapped model's own parameters
    (see watch_wrapped), or of one that holds a sharded parameter and whose state is not per
    element of its parameter: for a sharded one (Adafactor's factored
    moments) each rank's statistics would be of its own rows; one larger than its parameter
    (LBFGS's flat vectors, kept under its first parameter) spans the others, sharded ones too.
    Each parameter is checked once per optimizer. At the first step the ranks sharing the
    parameters agree (a collective): a shard of one row can look per element on its rank alone
    (Adafactor's (1, 1) and (1, K) moments of a (1, K) shard), and a rank refusing alone would
    leave the others waiting in the next collective. State first made at a later step is
    checked on each rank alone. At the first step the optimizer's update is also probed for
    reading more than each element (_not_per_element)."""
    checked, comm = _CHECKED.get(opt), None
    if checked is None:  # the first step
        params = [p for group in opt.param_groups for p in group["params"]]
        if any(_WRAPPED.get(id(p)) is p and p.grad is None for p in params):
            raise ValueError(f"{type(opt).__name__} holds the parameters of the model hap wrapped, which get no "
                             "gradients: hap trains its own copies of them; build the optimizer over the wrapper's "
                             "(dmodel.parameters(), pipe.parameters())")
        comms = [_SHARDED[id(p)][2] for p in params if _watched(p)]
        if not comms:
            _CHECKED[opt] = {id(p) for p in params}  # no sharded parameter: nothing to watch
            return
        checked, comm = _CHECKED.setdefault(opt, set()), comms[0]
        refused = _refused_state(opt, checked) or _not_per_element(opt, next(p for p in params if _watched(p)))
    else:
        refused = _refused_state(opt, checked)
    if comm is not None:  # (None also without a process group: a unit test of the hook)
        gather_or_refuse(None, refused, comm)
    elif refused is not None:
        raise ValueError(refused)


SHARDS_STAMP = "hap_shards"
"""A parameter group's entry (in opt.state_dict() too) naming whose shards its optimizer state
holds: `rank 1 of 2, 4 sharded parameters of 312 elements (layout 5d1e0c2a)`, the layout a
digest of their shapes. Set at every step; not a hyper-parameter."""
_STAMPS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, list[str | None]]]" = weakref.WeakKeyDictionary()
_reshards = 0  # reshards so far in this process: a cached stamp of an earlier layout is stale


def group_settings(group: dict) -> dict:
    """A parameter group's hyper-parameters: its entries but the parameters and SHARDS_STAMP."""
    return {k: v for k, v in group.items() if k not in ("params", SHARDS_STAMP)}


def _own_stamps(opt: torch.optim.Optimizer) -> list[str | None]:
    """Per parameter group, SHARDS_STAMP as this rank holds its sharded parameters (None: none)."""
    epoch, stamps = _STAMPS.get(opt, (-1, []))
    if epoch != _reshards or len(stamps) != len(opt.param_groups):
        stamps = []
        for group in opt.param_groups:
            sharded = [p for p in group["params"] if _watched(p)]
            comm = _SHARDED[id(sharded[0])][2] if sharded else None
            layout = zlib.crc32(repr([tuple(p.shape) for p in sharded]).encode())
            stamps.append(None if comm is None else f"rank {comm.rank} of {comm.world}, {len(sharded)} sharded "
                          f"parameters of {sum(p.numel() for p in sharded)} elements (layout {layout:08x})")
        _STAMPS[opt] = (_reshards, stamps)
    return stamps


def whose_state(opt: torch.optim.Optimizer) -> str | None:
    """Why the state of the optimizer's sharded parameters is not this rank's at their present
    layout, or None (then it is stamped so): loaded from another rank's opt.state_dict() (rank
    0's, saved and loaded on every rank: at equal shard sizes the other ranks stepped with rank
    0's rows, silently), another layout's, or one device's. State without a stamp (a fresh
    optimizer's; hap's checkpoint, which loads each rank's own rows) is checked for its
    parameters' shapes."""
    for group, own in zip(opt.param_groups, _own_stamps(opt)):
        stamp = group.get(SHARDS_STAMP)
        if stamp == own or own is None:
            continue
        held = [(p, opt.state[p]) for p in group["params"] if _watched(p) and opt.state.get(p)]
        if stamp is not None and held:
            return (f"{type(opt).__name__}'s state was saved on {stamp}; this is {own}: the state of sharded "
                    "parameters is each rank's own rows at one layout (another rank's, say rank 0's loaded on every "
                    "rank, steps with the wrong rows); save and load each rank's own, or use hap.runtime.checkpoint")
        for p, state in held:
            bad = next((k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() > 1
                        and v.shape != p.shape), None)
            if bad is not None:
                return (f"{type(opt).__name__}'s state {bad!r} of {_watched(p)} is {tuple(state[bad].shape)}, this "
                        f"rank's shard {tuple(p.shape)}: state saved by one device, another rank or another layout; "
                        "load it with hap.runtime.checkpoint (any plan, any ranks)")
        group[SHARDS_STAMP] = own
    return None


def _check_whose_state(opt: torch.optim.Optimizer, args, kwargs) -> None:
    """Before every step: whose_state's refusal, on this rank."""
    refused = whose_state(opt)
    if refused is not None:
        raise ValueError(refused)


def stamp_state(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Mark the optimizers' state as this rank's at their parameters' present layout (after a
    reshard moved it there, one reshard counted; whose_state refused another's before)."""
    global _reshards
    _reshards += 1
    for opt in optimizers:
        for group, own in zip(opt.param_groups, _own_stamps(opt)):
            if own is not None:
                group[SHARDS_STAMP] = own


def _optimizer_left_behind(params, passed: Sequence[torch.optim.Optimizer]) -> str | None:
    """Why a reshard would leave an optimizer's state behind, or None: an optimizer that has
    stepped, is not among those `passed`, and keeps per-element state of a sharded parameter
    (its rows are about to move; the state would stay at the old ones)."""
    sharded = {id(p) for p in params if _watched(p)}
    for opt in list(_CHECKED.keys()):
        if any(opt is o for o in passed):
            continue
        for param, state in opt.state.items():
            if id(param) in sharded and any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in state.values()):
                return (f"reshard: {type(opt).__name__} keeps state of {_watched(param)}, whose rows move: pass it, "
                        "dmodel.reshard(ratios, optimizers=[opt]), so that its state moves with them")
    return None


def _refused_state(opt: torch.optim.Optimizer, checked: set[int]) -> str | None:
    """Why the optimizer's state of a parameter not in `checked` is not exact under hap (see
    _check_optimizer_state), or None; adds the parameters it looked at to `checked`."""
    for param, state in opt.state.items():
        if id(param) in checked:
            continue
        checked.add(id(param))
        label = _watched(param)
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if label is not None:
                try:
                    per_element(key, value.shape, param.shape, label, sharded=True)
                except ValueError as e:
                    return str(e)
            elif value.numel() > param.numel():
                return (f"optimizer state {key!r} is {tuple(value.shape)}, more than its parameter "
                        f"{tuple(param.shape)}: state over several parameters ({type(opt).__name__}'s "
                        "flat vectors, say) is not exact where hap shards some of them")
    return None


def held_by_original(model: nn.Module, graph, held: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """id of each of the model's parameters -> what this rank holds for it (held by graph name)."""
    state = model_state(model)
    return {id(state[graph.tensors[name].target]): p for name, p in held.items()}


def model_named_by_graph(params: dict[str, torch.Tensor], graph):
    """(graph tensor name, parameter) of parameters held by graph tensor name, in the model's order."""
    ordered = [name for name in graph.params if name in params]
    for name in ordered + [name for name in params if name not in set(ordered)]:
        yield name, params[name]


def check_trainable(params: dict[str, torch.Tensor], graph) -> None:
    """A ValueError where a parameter (by graph name) was frozen or unfrozen after the model was
    captured: the plan synchronizes the gradients of the parameters that required grad then, so
    one unfrozen later was silently left different on every rank, and one frozen later would
    leave its gradient bucket waiting."""
    for name, p in params.items():
        was = graph.tensors[name].requires_grad
        if p.requires_grad != was:
            raise ValueError(f"parameter {graph.tensors[name].target} {'required grad' if was else 'was frozen'} when "
                             f"hap captured the model and {'is frozen' if was else 'requires grad'} now: hap plans and "
                             "synchronizes the gradients of the parameters that required grad then; set requires_grad "
                             "before wrapping the model")


def _not_per_element(opt: torch.optim.Optimizer, sharded: torch.Tensor) -> str | None:
    """Why the optimizer's update is not exact on shards, or None: a fresh optimizer of its
    class and hyper-parameters steps twice on a probe parameter whole and on the same parameter
    split 4/2 in rows; an update that is per element (SGD, Adam, ...) moves both alike, one that
    reads the whole parameter (LAMB's and LARS's trust ratios, Muon's orthogonalization) does
    not, and under hap each rank would read its own rows alone. An optimizer the probe cannot
    build or step (LBFGS wants a closure; its flat state is refused by _refused_state) goes
    unprobed."""
    gen = torch.Generator().manual_seed(0)
    like = dict(dtype=sharded.dtype, device=sharded.device)
    start = torch.randn(6, 4, generator=gen).to(**like)
    grads = [torch.randn(6, 4, generator=gen).to(**like) for _ in range(2)]
    whole, parts = nn.Parameter(start.clone()), [nn.Parameter(start[:4].clone()), nn.Parameter(start[4:].clone())]
    group = next((g for g in opt.param_groups if any(p is sharded for p in g["params"])), opt.param_groups[0])
    hyper = {k: group[k] for k in opt.defaults if k in group}
    if "lr" in hyper and not float(hyper["lr"]):  # a warmup from 0 would move neither probe: probe at a rate that moves
        hyper["lr"] = opt.defaults["lr"] if float(opt.defaults.get("lr") or 0) else 1e-2
    try:
        one, split = type(opt)([whole], **hyper), type(opt)(parts, **hyper)
        for g in grads:
            whole.grad, parts[0].grad, parts[1].grad = g.clone(), g[:4].clone(), g[4:].clone()
            one.step()
            split.step()
    except Exception:  # noqa: BLE001 (any optimizer's failure: the probe is a check, not the training)
        return None
    if torch.allclose(whole.detach(), torch.cat([p.detach() for p in parts]), rtol=1e-4, atol=1e-6):
        return None
    label = _watched(sharded)
    return (f"{type(opt).__name__} updates a parameter's rows differently when they are split (it reads the whole "
            f"parameter: LAMB's and LARS's trust ratios, Muon's orthogonalization): not exact where hap shards "
            f"{label}; use an optimizer whose update is per element (SGD, Adam, ...) or a plan that keeps {label} whole")


def _watched(param: torch.Tensor) -> str | None:
    """The state-dict key of a live hap.HAP's sharded parameter, else None."""
    watched = _SHARDED.get(id(param))
    return watched[1] if watched is not None and watched[0]() is param else None


def _segments_like(planned, segment_of: Sequence[int], graph) -> list[int]:
    """Every node of `graph` (the model at another shape or in eval mode) in the segment of the
    planned graph's node of the same name; else (a node named otherwise: BatchNorm's eval op)
    of the first planned node that reads one of its parameters or buffers; else of the node
    before it (a node the other graph lacks, such as dropout, leaves the rest named alike);
    kept in order. A ValueError where a segment keeps no node."""
    by_name = {node.name: seg for node, seg in zip(planned.nodes, segment_of)}
    by_leaf: dict[str, int] = {}
    for node, seg in zip(planned.nodes, segment_of):
        for name in node.inputs:
            if planned.tensors[name].kind in ("param", "buffer"):
                by_leaf.setdefault(name, seg)
    out, seg = [], 0
    for node in graph.nodes:
        leaf = next((by_leaf[name] for name in node.inputs if name in by_leaf), seg)
        seg = max(seg, by_name.get(node.name, leaf))
        out.append(seg)
    if sorted(set(out)) != sorted(set(segment_of)):
        raise ValueError("its graph differs and a segment of the plan has none of its nodes")
    return out


def _runs(plan: Plan, graph) -> bool:
    """Whether the plan's program runs `graph` (the model at another input shape) as it is."""
    try:
        program = plan.steps(graph)
    except ValueError:
        return False
    for step in program:
        node, st = graph.nodes[step.node], step.strategy
        if (st.inputs, st.outputs) not in {(o.inputs, o.outputs) for o in strategies_for(node, graph, short_shards=True)}:
            return False
    return len(program) == len(graph.nodes)


FINGERPRINT_POINTS = 1024
"""Elements of each input given whole that its fingerprint reads (evenly spaced)."""

def _backward_begins(grad: torch.Tensor) -> None:
    """A hook on a returned loss: a backward through it begins (ledger.py: on one rank alone,
    its gradient sync pairs with another call's collectives)."""
    ledger.mark("a backward through dmodel's loss")


_GIVE_THE_SAME = ("the ranks were given different batches (each its own sample, as DistributedSampler gives DDP): "
                  "give every rank the same global batch")
DIFFERENT_BATCHES = (_GIVE_THE_SAME + ", or each rank its part of it (dmodel.local_batch(*batch), or the rows "
                     "dmodel.input_slices() names, with part=True)")
PIPELINE_DIFFERENT_BATCHES = (_GIVE_THE_SAME + " (hap.Pipeline's train_step takes the whole batch on every rank and "
                              "splits it into micro-batches itself)")


def fingerprints(inputs: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Three numbers per input, in float64: 1 (given whole) and two that two different batches
    all but never share, sums of up to FINGERPRINT_POINTS evenly spaced elements, plain and
    weighted by position; zeros for an input given as this rank's part (None). Every rank
    sends as many, whichever inputs it was given whole (a rank's part can be the whole)."""
    out = []
    for x in inputs:
        if x is None:
            out.append(torch.zeros(3, dtype=torch.float64, device=device))
            continue
        n = x.numel()
        if n > FINGERPRINT_POINTS:  # (integer positions: a float's rounding passed the end of 2^24 elements)
            at = torch.arange(FINGERPRINT_POINTS, device=x.device) * (n - 1) // (FINGERPRINT_POINTS - 1)
            v = torch.take(x.detach(), at).double()  # (in the logical order, with no copy of a strided input)
        else:
            v = x.detach().reshape(-1).double()
        weights = torch.arange(1, v.numel() + 1, device=v.device, dtype=torch.float64)
        out.append(torch.stack([torch.ones((), dtype=torch.float64, device=v.device), v.sum(),
                                (v * weights).sum()]).to(device))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64, device=device)


def inputs_differ(summed: torch.Tensor, squares: torch.Tensor, world: int) -> torch.Tensor:
    """Whether the ranks' fingerprints of an input every rank was given whole differ (a bool
    tensor, alike on every rank; held_apart)."""
    return (held_apart(summed, squares) & (summed[0::3] == world)).any()  # (inputs every rank was given whole)


def sum_step(value: torch.Tensor, given: torch.Tensor, inputs: Sequence[torch.Tensor | None], changed: str | None,
             comm: Comm, loaded: bool = False, alike: Sequence[tuple[str, torch.Tensor | None]] = ()
             ) -> tuple[torch.Tensor, torch.Tensor, "StepCheck"]:
    """A step's one sum over ranks, in float64: [value (the loss's parts), `given` (a
    piggyback), whether this rank's wrapped model was changed (`changed`: WrappedWatch's
    message), whether it loaded a state dict since its last step (`loaded`), the fingerprints
    of the inputs given whole (None: a rank's part), their squares, the fingerprints of
    `alike` (label, tensor), tensors that every rank holding them holds whole and alike (None:
    this rank holds none of it), their squares]. `alike` names the same tensors on every rank.
    Returns value's sum, given's sums and the step's check (StepCheck)."""
    device = value.device
    many = comm.world > 1
    prints = fingerprints(inputs, device) if many else torch.zeros(0, dtype=torch.float64, device=device)
    kept = fingerprints([t for _, t in alike], device) if many else torch.zeros(0, dtype=torch.float64, device=device)
    flags = torch.tensor([1.0 if changed else 0.0, 1.0 if loaded else 0.0], dtype=torch.float64, device=device)
    sums = all_reduce(torch.cat([value.detach().reshape(1).double(), given.double().to(device), flags, prints,
                                 prints ** 2, kept, kept ** 2]), comm)
    k, n, w = 1 + len(given), len(prints), len(kept)
    at = k + 2 + 2 * n  # where the fingerprints of `alike` start
    differ = inputs_differ(sums[k + 2:k + 2 + n], sums[k + 2 + n:at], comm.world) if n else \
        torch.zeros((), dtype=torch.bool, device=device)
    apart = held_apart(sums[at:at + w], sums[at + w:]) if w else torch.zeros(0, dtype=torch.bool, device=device)
    verdict = torch.cat([torch.stack([sums[k] > 0, differ]).double(), sums[k + 1:k + 2], apart.double()])
    return sums[0], sums[1:k], StepCheck(verdict, changed, [label for label, _ in alike], comm.world)


def held_apart(summed: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
    """Per tensor fingerprinted (three numbers each, the first 1 from each rank holding it:
    fingerprints), whether the ranks holding it hold it unlike: the variance of a
    fingerprint over those ranks is above rounding's."""
    held = summed[0::3].clamp(min=1).repeat_interleave(3)  # how many ranks hold each
    mean, mean_square = summed / held, squares / held
    spread = mean_square - mean * mean
    return ((spread > 1e-9 * mean_square.abs()) & spread.isfinite()).reshape(-1, 3).any(1)


DIVERGED = ("{label!r} differs between the ranks, which hold it whole and must hold it alike: it was written after "
            "wrapping with each rank's own values (an initialization through dmodel.modules(), each rank drawing "
            "its own numbers) or loaded differently on each rank: initialize the model before wrapping it, or load "
            "the same weights on every rank with dmodel.load_state_dict(...); or each rank's optimizer trained it apart "
            "(a learning rate or optimizer of each rank's own, a scheduler stepped on some ranks only, a gradient clip "
            "or more backward passes accumulated into a step on some ranks): set them alike on every rank")

OPTIMIZER_SETTINGS = "the settings of the optimizers stepping dmodel's parameters"
"""The label of the spot checks' fingerprint of optimizer_settings."""

SETTINGS_DIFFER = ("the optimizers stepping dmodel's parameters differ between the ranks in their settings (a "
                   "learning rate, momentum or weight decay of each rank's own, a scheduler stepped on some ranks "
                   "only, another optimizer on some rank): each rank would train its copies of the parameters every "
                   "rank holds whole apart from the others'; set them alike on every rank")


def spot_check_due(sums: int) -> bool:
    """Whether the `sums`-th loss sum (1, 2, ...) also compares the parameters the ranks hold
    whole and sum the gradients of: the 1st, 2nd, 4th, 8th, ... and every 1024th. Copies
    trained apart (each rank's optimizer set otherwise) are then found within twice the steps
    they had, at a fingerprint's cost on few steps; the ranks count alike, so they add the
    fingerprints to the sum alike."""
    return sums & (sums - 1) == 0 or sums % 1024 == 0


LOADED_ON_SOME = ("load_state_dict ran on {some} of the {world} ranks since the last step: each rank holds its own "
                  "part of the model (hap.HAP's shards, a pipeline's stages) and loads it itself, so every rank calls "
                  "dmodel.load_state_dict(state) with the whole state dict (DDP's habit, loading on rank 0 alone, left "
                  "the other ranks' parts as they were)")


class StepCheck:
    """What a step's sum told every rank (sum_step): a rank's wrapped model was changed, the
    ranks' inputs differ, how many ranks loaded a state dict since their last step, which
    tensors held whole differ. Read by `verify`: at once on the CPU; on a GPU at the next step
    (an event's wait), rather than the host waiting for the device every step."""

    def __init__(self, verdict: torch.Tensor, changed: str | None, alike: Sequence[str] = (), world: int = 1):
        self.changed, self.alike, self.world = changed, list(alike), world
        self.different_batches = DIFFERENT_BATCHES
        """What verify says where the ranks' inputs differ (hap.Pipeline's own: PIPELINE_DIFFERENT_BATCHES)."""
        self.loaded_everywhere = False
        """After verify: every rank loaded a state dict since its last step."""
        if verdict.device.type == "cuda":
            self.verdict = torch.empty(verdict.shape, dtype=verdict.dtype, pin_memory=True)
            self.verdict.copy_(verdict, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.verdict, self.event = verdict, None

    def now_or_later(self) -> "StepCheck | None":
        """Verified now (the CPU: None), or itself, for the next step to verify."""
        if self.event is not None:
            return self
        self.verify()
        return None

    def verify(self) -> None:
        """A ValueError, on every rank, where a rank's wrapped model was changed, the ranks were
        given different inputs, some ranks alone loaded a state dict, or a tensor every rank
        holds whole differs between them. Each rank given its own sample (DistributedSampler's
        habit, for DDP) trained each rank's rows of its own batch: no batch's gradient."""
        if self.event is not None:
            self.event.synchronize()
        changed, differ, loaded, *apart = self.verdict.tolist()
        if changed:
            raise ValueError(self.changed or "a parameter of the model hap wrapped was changed after wrapping on "
                                             "another rank, which hap, training copies of the parameters, would ignore")
        if differ:
            raise ValueError(self.different_batches)
        if 0 < loaded < self.world:
            raise ValueError(LOADED_ON_SOME.format(some=round(loaded), world=self.world))
        for label, off in zip(self.alike, apart):
            if off:
                raise ValueError(SETTINGS_DIFFER if label == OPTIMIZER_SETTINGS else DIVERGED.format(label=label))
        self.loaded_everywhere = loaded > 0

    def compare_next(self, due: bool) -> bool:
        """After verify: whether the next step compares the tensors the ranks hold alike (sum_step's
        `alike`), `due` saying whether it was due: where every rank loaded a state dict since its
        last step, or where it was due and this step did not compare them (none held whole, as
        under a plan that shards everything: it stays due, each step asking for none)."""
        return self.loaded_everywhere or (due and not self.alike)


class WrappedWatch:
    """The model a wrapper (hap.HAP, hap.Pipeline) trains copies of, watched for what is done to
    it after wrapping: model.train() and model.eval() (`switched`), one module's own mode, and
    in-place writes to its parameters (`changed_values`). `set` puts it in the wrapper's mode."""

    @classmethod
    def of(cls, model: nn.Module, graph, names, held: Callable) -> "WrappedWatch":
        """The watch of the parameters `names` (graph tensor names) a wrapper holds, held(name,
        whole) giving (the part of the whole this rank holds, the wrapper's copy of it). A model
        on the meta device holds no values: nothing to watch but its modes."""
        state = {} if any(p.is_meta for p in model.parameters()) else model_state(model)
        return cls(model, [(graph.tensors[name].target, state[graph.tensors[name].target],
                            functools.partial(held, name)) for name in names if state])

    def __init__(self, model: nn.Module, copies: list[tuple[str, torch.Tensor, Callable]]):
        """copies: per parameter the wrapper holds, (its name, the model's tensor, a function
        of that tensor giving (the part of it this rank holds, the wrapper's copy of that part))."""
        self.model, self.copies = model, copies
        # the modes the training graph was captured with: model.train()'s, as capture makes
        # them (an override of train() may keep a BatchNorm frozen)
        modes = module_modes(model)
        model.train(True)
        self.train_modes = module_modes(model)
        for m, mode in zip(model.modules(), modes):
            m.training = mode
        self.seen = modes
        self.versions = _looks(copies)
        self.trainable = {name: t.requires_grad for name, t, _ in copies}
        self.params = self.walk()[1]
        self.shapes = {name: t.shape for name, t, _ in copies}
        _WATCHES[model] = weakref.ref(self)  # (weakly: a watch holds the model, and the wrapper's shards)
        model.register_state_dict_post_hook(_stale_state_dict)

    def __deepcopy__(self, memo: dict) -> "WrappedWatch":
        """A copy of the wrapper (copy.deepcopy(dmodel): an EMA of it, AveragedModel) watches its
        copy of the model from the copy's own version counters, which start afresh."""
        new = copy.copy(self)
        new.model, new.copies = copy.deepcopy(self.model, memo), copy.deepcopy(self.copies, memo)
        new.versions, new.params = _looks(new.copies), new.walk()[1]
        _WATCHES[new.model] = weakref.ref(new)  # (its copy of the model keeps the state-dict hook)
        return new

    def set(self, training: bool) -> None:
        """The wrapper was put in this mode: so is the model (as DDP's wrapped module is), in the
        modes its training graph was captured with, or all in eval mode."""
        for m, mode in zip(self.model.modules(), self.train_modes if training else (False,) * len(self.train_modes)):
            m.training = mode
        self.seen = module_modes(self.model)

    def walk(self) -> tuple[tuple[bool, ...], tuple[int, ...]]:
        """The model's modules' modes and which tensors its parameters are, in one walk of it,
        for `switched` and `changed_values` (a step's look at the model)."""
        modes, params = [], []
        for m in self.model.modules():
            modes.append(m.training)
            params.extend(map(id, m._parameters.values()))
        return tuple(modes), tuple(params)

    def switched(self, modes: tuple[bool, ...]) -> bool | None:
        """The mode model.train() or model.eval() put the model in since the last look (None: no
        change), from the model's modes now (walk). A module's own mode changed is a ValueError:
        the training graph was captured with the modes at wrapping."""
        if modes == self.seen:
            return None
        if len(modes) != len(self.train_modes):
            raise ValueError("the model hap wrapped gained or lost modules after wrapping: hap trains the graph it "
                             "captured; change the model before wrapping it")
        if modes != self.train_modes and any(modes):
            name, m = next((n, m) for (n, m), was in zip(self.model.named_modules(), self.train_modes)
                           if m.training != was)
            raise ValueError(f"module {name or type(self.model).__name__!r} of the model hap wrapped was put in "
                             f"{'training' if m.training else 'eval'} mode after wrapping, unlike the training graph "
                             "hap captured: set modules' modes before wrapping (dmodel.train() and dmodel.eval() "
                             "switch the whole model)")
        self.seen = modes
        return any(modes)

    def changed_values(self, params: tuple[int, ...]) -> str | None:
        """Why the model was changed since the last look (None: it was not), from which tensors
        its parameters are now (walk): a parameter written in place (load_state_dict, an
        initialization), given new storage (`p.data = x`) or replaced (load_state_dict(
        assign=True)) with a value the wrapper's copy of this rank's part does not hold, which
        the wrapper, training its copies, would ignore. Loading the
        wrapper's own values back (full_state_dict, to evaluate the model) is no change. Said on
        every rank by the step's sum (sum_step): a rank may hold none of the rows written. (A
        write through `.data` in place, `p.data.copy_(x)`, leaves no trace to see.)"""
        if params != self.params:  # a parameter object replaced: watch the model's own now
            state = model_state(self.model)
            self.copies = [(name, state.get(name, original), held) for name, original, held in self.copies]
            self.params = params
        for name, original, _ in self.copies:  # (requires_grad_ bumps no version)
            if original.requires_grad != self.trainable[name]:
                return (f"{name} of the model hap wrapped was {'frozen' if self.trainable[name] else 'unfrozen'} "
                        "after wrapping (requires_grad_), which hap, training copies of the parameters, would "
                        "ignore: set requires_grad before wrapping the model")
        now = _looks(self.copies)
        if now == self.versions:
            return None
        found = None
        for (name, original, held), a, b in zip(self.copies, now, self.versions):
            if a != b and found is None and not self._agrees(name, original, held):
                found = (f"{name} of the model hap wrapped was changed after wrapping (load_state_dict, an "
                         "initialization, a write to it or its .data), which hap, training copies of the "
                         "parameters, would ignore: change the model before wrapping it, or load it into "
                         "hap's copies: dmodel.load_state_dict(model.state_dict())")
        self.versions = now
        return found

    def _agrees(self, name: str, original: torch.Tensor, held: Callable) -> bool | None:
        """Whether the model's tensor holds the wrapper's copy of this rank's part; None where
        its shape is no longer the one wrapped."""
        if original.shape != self.shapes[name]:
            return None
        part, mine = held(original.detach())
        return torch.equal(part.to(mine.device, mine.dtype), mine.detach())

    def trained_since(self) -> str | None:
        """The first parameter whose value on the model differs from the wrapper's copy of this
        rank's part (the wrapper trained it since wrapping), or None; "(meta)" for a model on
        the meta device, which holds no values at all."""
        if any(p.is_meta for p in self.model.parameters()):
            return "(meta)"
        # (a changed shape: refused at the next forward, changed_values)
        return next((name for name, original, held in self.copies if self._agrees(name, original, held) is False), None)


_WATCHES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
"""Each wrapped model's watch, while its wrapper lives."""


def wrapped_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() of a wrapped model, as hap reads it (no stale-state check)."""
    return {key: v.detach() for key, v in model.state_dict(keep_vars=True).items()}


def _stale_state_dict(model: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """model.state_dict() (keep_vars=False: to save it) of a model hap.HAP or hap.Pipeline
    wraps, once the wrapper has trained: a ValueError. DDP trains its module in place, so
    `torch.save(model.state_dict(), ...)` after training saved it; hap trains copies, and it
    saved the values from before training, silently."""
    watch = _WATCHES[model]() if model in _WATCHES else None
    if watch is None or any(isinstance(v, nn.Parameter) for v in state.values()):
        return  # (keep_vars=True: a walk of the model, torch.export's)
    name = watch.trained_since()
    if name is not None:
        what = "is on the meta device (hap materialized only its shards)" if name == "(meta)" else \
            f"holds its values from before training ({name} differs from hap's)"
        raise ValueError(f"model.state_dict() of the model hap wrapped {what}: hap trains copies of the parameters; "
                         "save dmodel.full_state_dict() (every rank calls it; pipe.full_state_dict() alike), or load "
                         "it into the model first: model.load_state_dict(dmodel.full_state_dict())")


def _looks(copies: list[tuple[str, torch.Tensor, Callable]]) -> tuple:
    """What changes when a watched tensor is written: its version counter (in place) and its
    storage (`p.data = x`), and which tensor it is."""
    tensors = [t for _, t, _ in copies]
    return tuple(zip(versions(tensors), (t.data_ptr() for t in tensors), map(id, tensors)))


def _held_part(ex: Executor, name: str, whole: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's part of parameter `name`'s whole value, the executor's copy of it)."""
    return ex.stored_part(name, whole), ex.params[name]


def input_shapes(graph) -> tuple:
    """The shapes of the graph's inputs, in order: the batch shape it was captured at."""
    return tuple(tuple(graph.tensors[name].shape) for name in graph.inputs)


def rank_comm(cluster: Cluster, comm: Comm | None, who: str) -> Comm:
    """This rank's Comm (the default process group if none), checked against the cluster."""
    if not dist.is_initialized():
        raise RuntimeError(f"{who} needs torch.distributed initialized first (or use hap.runtime.launch.spawn)")
    comm = comm or Comm.default()
    if cluster.size != comm.world:
        raise ValueError(f"cluster {cluster.name!r} has {cluster.size} devices but {comm.world} "
                         f"{'rank is' if comm.world == 1 else 'ranks are'} running")
    return comm


def state_keys(model: nn.Module, graph) -> dict[str, str | None]:
    """Each key of model.state_dict() -> the graph leaf holding its tensor (tied parameters:
    several keys, one leaf), or None for tensors the forward does not use."""
    state = model_state(model)
    leaf_of = {id(state[t.target]): name for name, t in graph.tensors.items() if t.kind in ("param", "buffer")}
    return {key: leaf_of.get(id(v)) for key, v in model.state_dict(keep_vars=True).items()}


def _materialized(model: nn.Module, graph, init: Callable[[nn.Module], None] | None):
    """For a meta-device model: each submodule's own parameters, made real and initialized, as
    {graph tensor: value}; then the submodule goes back to meta (only the shards stay). Buffers
    stay materialized: they are needed whole."""
    by_target = {t.target: name for name, t in graph.tensors.items() if t.kind in ("param", "buffer")}
    for prefix, sub in model.named_modules():
        own = list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False))
        if not any(t.is_meta for _, t in own):
            continue
        was_meta = {n for n, t in own if t.is_meta}
        sub.to_empty(device="cpu", recurse=False)
        own = list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False))  # now real
        with torch.no_grad():
            for n, t in own:
                if n in was_meta:
                    _mark_unset(t)
        if init is not None:
            init(sub)
        elif hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
        else:
            raise ValueError(f"module {prefix or '(root)'} ({type(sub).__name__}) is on the meta device and has no "
                             "reset_parameters(): pass hap.HAP(..., init=fn) to initialize it")
        own = list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False))  # (init may replace them)
        for n, t in own:
            if n in was_meta and _still_unset(t):
                raise ValueError(f"{f'{prefix}.{n}' if prefix else n} was on the meta device and "
                                 f"{'init' if init is not None else 'reset_parameters()'} left it unset: a value "
                                 "computed in __init__ (a buffer such as rotary inv_freq) is lost on the meta "
                                 "device; set it in init, or build it on a real device")
        with torch.no_grad():
            values = {by_target[f"{prefix}.{n}" if prefix else n]: t.detach() for n, t in own
                      if (f"{prefix}.{n}" if prefix else n) in by_target}
        yield values
        for n, p in sub.named_parameters(recurse=False):  # free the whole values; the shards were copied
            setattr(sub, n, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))


@contextlib.contextmanager
def _buffers_on_meta(model: nn.Module):
    """A meta model as it was captured first, for capturing it again (another shape, eval):
    its buffers, which stay materialized (_materialized), on the meta device as its parameters
    and inputs are; given back after."""
    swapped = []
    for sub in model.modules():
        for name, b in list(sub.named_buffers(recurse=False, remove_duplicate=False)):
            if not b.is_meta:
                swapped.append((sub, name, b))
                setattr(sub, name, torch.empty_like(b, device="meta"))  # (a buffer stays a buffer)
    try:
        yield
    finally:
        for sub, name, b in swapped:
            setattr(sub, name, b)


def _mark_unset(t: torch.Tensor) -> None:
    """Fill a materialized tensor with what no init writes: _unset, or for a bool tensor the
    byte 2 (neither False nor True: bools are bytes 0 and 1)."""
    if t.dtype == torch.bool:
        t.view(torch.uint8).fill_(2)
    else:
        t.fill_(_unset(t.dtype))


def _unset(dtype: torch.dtype):
    """What a materialized tensor (not bool) holds until its module's init writes it."""
    return float("nan") if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype).min


def _still_unset(t: torch.Tensor) -> bool:
    """Whether init left every element as _mark_unset filled it."""
    if t.numel() == 0:
        return False
    if t.dtype == torch.bool:
        return bool((t.view(torch.uint8) == 2).all())
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(t.isnan().all())
    return bool((t == _unset(t.dtype)).all())


def unlike_rank_0(values: Sequence) -> list[int]:
    """The ranks whose value differs from rank 0's."""
    return [r for r, v in enumerate(values) if v != values[0]]


def cluster_setting(cluster: Cluster) -> dict[str, tuple[str, str]]:
    """The cluster as a wrapper's setting (agree_plan): shown as it describes itself, compared
    as its whole spec. A rank given another (a slowdown of its own) emulated other speeds and
    links than the plan was made for, silently."""
    return {"cluster": (f"the cluster {cluster.describe()!r}", json.dumps(cluster.to_dict(), sort_keys=True))}


def agree_plan(plan: Plan | Exception | None, comm: Comm, graph: Graph,
               settings: dict[str, tuple[str, Any]] | None = None) -> Plan:
    """Rank 0's plan on every rank; a rank that was given a different plan is an error, and so
    is rank 0's failure to plan (`plan` an exception there), on every rank, and a rank whose
    model or example inputs (`graph`, its capture) differ from rank 0's (DDP's check: they
    trained, on rank 0's plan and values, or failed deep in the executor), or whose wrapper's
    `settings` do (name -> (as shown, as compared): hap.HAP's global_loss, the cluster)."""
    if plan is not None and not isinstance(plan, (Plan, Exception)):  # (rank 0's is told to every rank)
        plan = TypeError(f"plan must be a hap Plan (hap.Plan.from_json(path) reads a file), got {type(plan).__name__}")
    failed = isinstance(plan, Exception)
    box = [f"{type(plan).__name__}: {plan}" if failed else plan.to_json() if plan is not None else None]
    ledger.talking(comm.group)
    dist.broadcast_object_list(box, src=global_rank(comm, 0), group=comm.group)
    if failed:
        raise plan
    if not box[0].lstrip().startswith("{"):
        raise ValueError(f"rank 0 could not plan: {box[0]}")
    agreed = Plan.from_json(box[0])
    told = every_rank((plan.digest if plan is not None else agreed.digest, graph_leaves(graph),
                       [n.op for n in graph.nodes], settings or {}), comm)
    digests, leaves, ops, given = zip(*told)
    unlike = unlike_rank_0([{k: v[1] for k, v in g.items()} for g in given])
    if unlike:
        r = unlike[0]
        name = next(k for k in given[0] if given[r][k][1] != given[0][k][1])
        raise ValueError(f"rank {r} was given {given[r][name][0]}, rank 0 {given[0][name][0]}: every rank wraps the "
                         "model alike")
    unlike = unlike_rank_0(leaves)
    if unlike:
        raise ValueError(_leaves_differ(leaves[unlike[0]], leaves[0], unlike[0]))
    unlike = unlike_rank_0(ops)
    if unlike:  # the same parameters and inputs, another computation (an activation of its own, say)
        r = unlike[0]
        at = _first_unlike(ops[r], ops[0])
        said = [f"{o[at]}" if at < len(o) else "nothing" for o in (ops[r], ops[0])]
        raise ValueError(f"rank {r}'s model differs from rank 0's: its node {at} is {said[0]}, rank 0's {said[1]} "
                         "(every rank wraps the same model)")
    bad = unlike_rank_0(digests)
    if bad:
        raise ValueError(f"ranks {bad} were given a plan (digest {digests[bad[0]]}) other than rank 0's ({digests[0]})")
    if len(agreed.devices) != comm.world:
        raise ValueError(f"the plan is for {len(agreed.devices)} devices but {comm.world} "
                         f"{'rank is' if comm.world == 1 else 'ranks are'} running")
    # a plan of another model (a layer without its bias) failed at the first step with a bare
    # KeyError; every rank checks the same plan against the same graph, so every rank refuses it
    agreed.check_fits(graph)
    return agreed


def graph_leaves(graph: Graph) -> list[tuple]:
    """What every rank's capture must agree on: each parameter, buffer and input, by name, with
    its kind, shape and dtype, in graph order."""
    return [(t.target or name, t.kind, tuple(t.shape), t.dtype) for name, t in graph.tensors.items()
            if t.kind in ("param", "buffer", "input")]


def _first_unlike(theirs: Sequence, ours: Sequence) -> int:
    """The first index where two lists differ (the shorter one's length where one extends the other)."""
    return next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))


def _leaves_differ(theirs: list[tuple], ours: list[tuple], rank: int) -> str:
    """The first leaf where rank `rank`'s capture differs from rank 0's, in one line."""
    at = _first_unlike(theirs, ours)

    def said(leaves):
        return f"{leaves[at][0]} ({leaves[at][1]} {leaves[at][2]} {leaves[at][3]})" if at < len(leaves) else "nothing"

    return (f"rank {rank}'s model or example inputs differ from rank 0's: its leaf {at} is {said(theirs)}, rank 0's "
            f"{said(ours)} (every rank wraps the same model, with inputs of the same shapes)")


def _device_groups(plan: Plan, comm: Comm, more=(), made=None) -> dict[tuple[tuple[int, ...], int], object]:
    """A process group for every device group the plan names (lane 0) and `more` (the lanes
    its sync runs on: runtime/gradsync.Groups.needed), besides those already `made`, each
    made once (every rank takes part in making each, in one order, as torch.distributed
    requires). The whole world's lane 0 is comm's."""
    world = tuple(range(comm.world))
    groups: dict[tuple[tuple[int, ...], int], object] = {(world, 0): comm.group, **(made or {})}
    for devices, lane in sorted({(g, 0) for g in plan.device_groups()} | set(more)):
        if any(d < 0 or d >= comm.world for d in devices):
            raise ValueError(f"the plan names devices {list(devices)}, but ranks are 0..{comm.world - 1}")
        if (devices, lane) not in groups:
            groups[(devices, lane)] = dist.new_group(list(devices), timeout=collective_timeout())
    return groups
