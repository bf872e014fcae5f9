"""Pipeline training: each stage of a plan runs its range of the program on its device group,
micro-batch by micro-batch, in the plan's schedule (GPipe or 1F1B), sending activations
forward and their gradients back point to point. Exact: loss, gradients and parameters after
a step are one device's (pipeline/stages.py says why).

    dist.init_process_group("gloo")                    # or hap.runtime.launch.spawn(...)
    pipe = hap.Pipeline(model, cluster, example_inputs, plan)   # a plan of K stages
    params = list(pipe.parameters())                    # this stage's parameters, whole (named as
                                                        # the model's: pipe.named_parameters())
    opt = torch.optim.Adam(params) if params else None  # a stage may have none (the loss alone)
    loss = pipe.train_step(*batch)                     # forward and backward, gradients summed
    if opt: opt.step(); opt.zero_grad()

Inside a stage the devices split every micro-batch by the stage's ratios (data parallelism,
uneven shares allowed); a parameter's gradient is summed over every device of every stage
that uses it (a tied embedding's first and last stage) after the last backward, as the plan's
sync entries say. Every rank is given the global batch and reads the rows of its pieces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Literal, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..capture import adopt, capture, example_tuple
from ..cost.cluster import Cluster
from ..ir import Graph
from ..placement import P, R, Placement
from ..plan import Plan
from ..rules import strategy_table
from ..rules.local import LocalContext, is_random, run_node, substitute, whole_noise
from ..rules.nn import counts_early, label_count
from ..rules.units import ShardClasses
from ..runtime.checkpoint import sync_idle
from ..runtime.collectives import Comm, broadcast, every_rank, from_rank_0, global_rank, run_move
from ..runtime.emulate import Emulation
from ..runtime.executor import check_inputs, leaf_values
from ..runtime import ledger, wire
from ..runtime.mirror import MirrorsModel
from ..runtime.module import (PIPELINE_DIFFERENT_BATCHES, SHAPES_KEPT, StepCheck, WrappedWatch, agree_plan,
                              check_trainable, clip_spread_, cluster_setting, held_by_original, input_shapes,
                              rank_comm, spot_check_due, spread_gradients, state_keys, sum_step, watch_wrapped,
                              wrapped_state)
from .price import card_loads, card_seconds
from .schedule import stage_order
from .stages import check_aligned, check_pipelinable, crossings, overlaps, row_ranges, stage_of_nodes, stage_pieces


@dataclasses.dataclass(slots=True)
class _Transfer:
    """One part of a crossing that this rank sends or receives for a micro-batch: rows
    [start, start + length) of its dim (local to this rank's piece), or the whole tensor."""
    crossing: int
    peer: int
    """The other device (its rank in the pipeline's comm)."""
    tag: int
    start: int = 0
    length: int = -1
    """-1: the whole tensor (a replicated crossing)."""


class Pipeline(MirrorsModel):
    @ledger.called("hap.Pipeline(model, ...) (wrapping the model)")
    def __init__(self, model: nn.Module, cluster: Cluster, example_inputs: Sequence[torch.Tensor], plan: Plan,
                 comm: Comm | None = None, graph: Graph | None = None, *,
                 initial: Literal["rank 0", "handed over"] = "rank 0"):
        """graph: the model already captured on these inputs, not captured again (as hap.HAP's).

        initial: where the parameters and buffers start. "rank 0": rank 0's model's values, on
        every rank (as DDP starts). "handed over": the caller fills every parameter and persistent
        buffer at once (checkpoint.hand_over, as the pipeline rebalancer's move does), so they
        are not broadcast first; only the non-persistent buffers, which no hand-over moves, are."""
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"hap.Pipeline wraps a torch.nn.Module whose forward returns the loss, got {type(model).__name__}")
        if initial not in ("rank 0", "handed over"):
            raise ValueError(f"initial={initial!r}: 'rank 0' or 'handed over'")
        comm = rank_comm(cluster, comm, "hap.Pipeline")
        if comm.emulation is None:  # the cluster's emulated slow devices and links (local cluster), as hap.HAP
            comm = dataclasses.replace(comm, emulation=Emulation.for_rank(cluster, comm.rank))
        if not model.training:  # (every rank's model alike: refused on all of them)
            raise ValueError("hap.Pipeline trains in training mode and the model is in eval mode: call model.train() "
                             "first (a model trained in eval mode, say with frozen BatchNorm statistics, trains with hap.HAP)")
        self.comm, self.cluster = comm, cluster
        self.emulation = comm.emulation
        object.__setattr__(self, "model", model)  # not a submodule: parameters() are this stage's only
        # where this rank computes: the model's device (received activations, draws and sums go there)
        self.device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
        if plan is None and comm.rank == 0:  # (other ranks may leave it to rank 0's: told to them too)
            plan = TypeError("hap.Pipeline needs a pipeline Plan (hap.planners.make_plan('pp-exact', graph, cluster, "
                             "config), or hap.Plan.from_json of one), got None")
        if graph is None:
            graph = capture(model, example_tuple(example_inputs))
        else:
            graph = adopt(graph, model, example_inputs)
        self.graph = graph
        self.plan = plan = agree_plan(plan, comm, graph, cluster_setting(cluster))
        if len(plan.stages) < 2 or plan.schedule is None:
            raise ValueError("hap.Pipeline runs a plan of several stages with a schedule; run a one-stage plan with hap.HAP")
        self._state_keys = state_keys(model, graph)
        K, M = len(plan.stages), plan.schedule.micro_batches
        self.K, self.M, self.schedule = K, M, plan.schedule.name
        if sorted(d for st in plan.stages for d in st.devices) != list(range(comm.world)):
            raise ValueError(f"the stages' device groups {[st.devices for st in plan.stages]} must cover the "
                             f"{comm.world} ranks once each")
        self.s = s = next(k for k, st in enumerate(plan.stages) if comm.rank in st.devices)
        self.devices = plan.stages[s].devices
        self.d = self.devices.index(comm.rank)
        self._planned = self._lay_out(graph)
        plan.check_shards(graph, self._planned.classes, self._planned.pieces)
        self._use(self._planned)
        self._by_shape: dict[tuple, _Layout] = {}  # other batch shapes' layouts, the most recently used last
        programs = self._planned.programs
        values = leaf_values(graph, model, example_inputs)
        loaded = {ld.tensor for step in self.steps for ld in step.loads}
        # rank 0's values, as DDP starts (ranks may have built the model under other seeds): every
        # rank takes part in each broadcast, in one order, and keeps the parameters its stage
        # loads and every buffer (a checkpoint holds them all, as hap.HAP keeps them)
        mine = {}
        for name, t in graph.tensors.items():  # (parameters no node uses: sync_idle, below)
            if t.kind in ("param", "buffer") and name in values and (t.kind == "buffer" or t.consumers):
                handed = initial == "handed over" and (t.kind == "param" or t.target not in graph.non_persistent)
                x = values[name].detach().clone() if handed else from_rank_0(values[name], comm)
                if t.kind == "buffer" or name in loaded:
                    mine[name] = x
        self.params: dict[str, nn.Parameter] = {}  # by graph tensor name (torch.export's p_fc1_bias), as hap.HAP's shards
        for name in sorted(loaded):
            t = graph.tensors[name]
            if t.kind == "param":
                self.params[name] = nn.Parameter(mine[name], requires_grad=t.requires_grad)
        self.mirror_model(model, held_by_original(model, graph, self.params))  # children: the model's modules, as hap.HAP's
        self._constants: dict[str, torch.Tensor] = {name: x for name, x in mine.items() if graph.tensors[name].kind == "buffer"}
        loads = [{ld.tensor for step in prog for ld in step.loads} for prog in programs]  # per stage
        whole = set().union(*loads)
        # the buffers this stage keeps current (and a checkpoint takes from it): those it loads
        # (the forward of the stage that reads BatchNorm's running statistics updates them),
        # and those no stage loads, alike everywhere
        self._kept_buffers = [name for name in self._constants if name in loads[s] or name not in whole]
        # the parameters whose gradients this rank counts in a global norm: each by the first
        # device of the first stage that holds it (a tied embedding's two stages hold one)
        self._norm_counted = [name for name in self.params
                              if self.d == 0 and min(k for k, held in enumerate(loads) if name in held) == s]
        self._groups = {g: dist.new_group(list(g)) for g in plan.device_groups() if len(g) > 1}
        self._buckets: dict[int, tuple[tuple[int, ...], list[str]]] = {}
        for e in plan.sync:
            if comm.rank in e.devices and e.param in self.params and len(e.devices) > 1:
                self._buckets.setdefault(e.bucket, (e.devices, []))[1].append(e.param)
        sync_idle(self)  # the parameters no node uses: rank 0's, as the others
        # Random numbers, as one device draws them: every step, from rank 0's generator, each
        # random node's whole draw in graph order (_Layout.draws); every micro-batch takes its
        # rows. After the step the last stage's generator, which drew them all, is everyone's.
        self._random = any(is_random(node) for node in graph.nodes)
        self._noise: dict[int, object] = {}
        self._rng_after = plan.stages[-1].devices[0]
        self.last_step: dict[str, float] = {}
        """Seconds of the last train_step: total, compute (forward and backward), waiting; and
        whether its batch was of the planned shape (a smaller one is quicker: not a faster device)."""
        self.tracing = False
        """Label nodes, received transfers and the gradient sync in a recorded Chrome trace
        (torch.profiler), as hap.HAP's executor does."""
        self._stage_state = _StageState(self)
        watch_wrapped(model)
        if len(plan.stages) > 1:  # each rank holds its stage's gradients alone
            spread_gradients(self)
        self._wrapped = WrappedWatch.of(model, graph, self.params, functools.partial(_held_whole, self.params))
        self._step_check: StepCheck | None = None  # the last step's, where a GPU's verdict is read later
        self._loaded = False  # load_state_dict since the last step (on every rank, or a ValueError)
        self._compare_alike = True  # at the next step: each parameter on the ranks holding it (an initialization)
        self._sums = 0  # the loss's sums over ranks so far (spot_check_due)
        self._every_param = sorted(n for n in whole if graph.tensors[n].kind == "param")  # every stage's

    # -- layouts: what runs at a batch shape ---------------------------------------------------

    def _lay_out(self, graph: Graph) -> "_Layout":
        """The plan laid over `graph` (the model captured at one batch shape): a ValueError where
        it cannot run it."""
        plan, K, M, s = self.plan, self.K, self.M, self.s
        cuts = [st.nodes[0] for st in plan.stages[1:]]
        stage_of = stage_of_nodes(cuts, len(graph.nodes))
        if [st.nodes for st in plan.stages] != [[stage_of.index(k), len(stage_of) - 1 - stage_of[::-1].index(k)]
                                                 for k in range(K)]:
            raise ValueError("the plan's stages do not cover the model's nodes in order")
        programs = [plan.steps(graph, k) for k in range(K)]
        whole_program = [step for prog in programs for step in prog]
        check_pipelinable(graph, whole_program, M)
        plan.check_sync_fits(graph, programs)  # (a hand-edited entry trained silently wrong, or hung)
        classes = ShardClasses(graph, enumerate(strategy_table(graph)))
        crossed = crossings(graph, whole_program, stage_of)
        pieces = stage_pieces(graph, classes, whole_program, [st.ratios[0] for st in plan.stages], M)
        check_aligned(classes, crossed, pieces, M)
        sends, recvs, cards = self._routes(graph, crossed, classes, pieces)
        loads = {ld.tensor for step in programs[s] for ld in step.loads}
        last = plan.stages[s].nodes[1]  # (the earlier stages' draws only advance the generator)
        return _Layout(graph=graph, programs=programs, classes=classes, crossings=crossed, pieces=pieces,
                       sends=sends, recvs=recvs, cards=cards,
                       draws=[node for node in graph.nodes if node.index <= last and is_random(node)],
                       incoming=[ci for ci, c in enumerate(crossed) if s in c.dsts],
                       updates=[(buf, new) for buf, new in graph.buffer_updates.items() if buf in loads])

    def _use(self, layout: "_Layout") -> None:
        """Run steps of `layout`'s batch shape (the planned one's is the pipeline's between steps)."""
        self.graph, self.classes, self.crossings, self.pieces = layout.graph, layout.classes, layout.crossings, layout.pieces
        self.steps = layout.programs[self.s]
        self._sends, self._recvs, self._cards = layout.sends, layout.recvs, layout.cards
        self._draws, self._incoming, self._updates = layout.draws, layout.incoming, layout.updates

    def _layout_of(self, batch: Sequence[torch.Tensor]) -> "_Layout":
        """The layout of this batch's shape: the planned one, or another global batch's (a last,
        smaller batch of an epoch; another sequence length), captured at it once. Every rank is
        given the whole batch, so every rank meets the same shapes and keeps the same layouts."""
        key = tuple(tuple(x.shape) for x in batch)
        planned = input_shapes(self._planned.graph)
        if key == planned:
            return self._planned
        seen = every_rank(key, self.comm)
        if len(set(seen)) > 1:
            raise ValueError(f"ranks were given inputs of different shapes {sorted(set(seen))}: give every rank of "
                             "a pipeline the whole batch")
        layout = self._by_shape.pop(key, None)
        if layout is None:
            try:
                graph = capture(self.model, example_tuple(batch))
                if [(n.name, n.op) for n in graph.nodes] != [(n.name, n.op) for n in self._planned.graph.nodes]:
                    raise ValueError("the model's graph at this shape is not the planned one's (plan the pipeline "
                                     "at this shape)")
                layout = self._lay_out(graph)
            except ValueError as e:
                raise ValueError(f"inputs of shape {key}: the pipeline planned for {planned} cannot run them: "
                                 f"{e}; drop such a batch (DataLoader(drop_last=True)) or plan at its shape") from None
        self._by_shape[key] = layout
        for old in list(self._by_shape)[: max(0, len(self._by_shape) - SHAPES_KEPT)]:
            del self._by_shape[old]
        return layout

    # -- routes --------------------------------------------------------------------------------

    def _tag(self, m: int, crossing: int, crossed: int, dst_stage: int, backward: bool) -> int:
        return ((m * crossed + crossing) * self.K + dst_stage) * 2 + backward

    def _routes(self, graph: Graph, crossed: list, classes: ShardClasses, pieces: list) -> tuple[list, list, list]:
        """Per micro-batch, what this rank sends and receives in the forward (the backward
        sends the same parts the other way); and, where links are emulated, the bytes of rows
        every machine's network card carries per micro-batch (card_loads)."""
        plan, rank = self.plan, self.comm.rank
        sends: list[list[_Transfer]] = [[] for _ in range(self.M)]
        recvs: list[list[_Transfer]] = [[] for _ in range(self.M)]
        rows: list[list[tuple]] = [[] for _ in range(self.M)]  # every rank's: (cut, from, to, bytes, needs a gradient)
        for ci, c in enumerate(crossed):
            src_devs = plan.stages[c.src].devices
            t = graph.tensors[c.tensor]
            for dst in c.dsts:
                dst_devs = plan.stages[dst].devices
                for m in range(self.M):
                    tag = self._tag(m, ci, len(crossed), dst, False)
                    if not c.placement.is_shard:  # replicated: the micro-batch's first device sends it whole
                        if rank == src_devs[0]:
                            sends[m] += [_Transfer(ci, d, tag) for d in dst_devs]
                        elif self.s == dst:
                            recvs[m].append(_Transfer(ci, src_devs[0], tag))
                        continue
                    dim = c.placement.dim
                    src_rows = row_ranges(classes.split_sizes(c.tensor, dim, pieces[c.src]), self.M, m)
                    dst_rows = row_ranges(classes.split_sizes(c.tensor, dim, pieces[dst]), self.M, m)
                    for i, j, start, length in overlaps(src_rows, dst_rows):
                        if rank == src_devs[i]:
                            sends[m].append(_Transfer(ci, dst_devs[j], tag, start - src_rows[i][0], length))
                        if rank == dst_devs[j]:
                            recvs[m].append(_Transfer(ci, src_devs[i], tag, start - dst_rows[j][0], length))
                        row_bytes = t.nbytes / t.shape[dim] if t.shape[dim] else 0.0
                        rows[m].append(((c.src, dst), src_devs[i], dst_devs[j], row_bytes * length, c.requires_grad))
        return sends, recvs, self._card_loads(rows)

    def _card_loads(self, rows: list) -> list:
        """Per micro-batch, {(cut, backward): (bytes out, bytes in) per machine's network card}
        of the rows every rank sends over each cut (source stage, destination stage) at once, as
        the price counts each cut's (price.shared_cards_seconds: a card carries its machine's
        flows to the others); [] where links are not emulated."""
        links = self.emulation.links
        if links is None:
            return []
        out = []
        for flows in rows:
            by_way: dict[tuple, list] = {}  # (cut, backward) -> (from, to, bytes)
            for cut, a, b, nbytes, needs_grad in flows:
                by_way.setdefault((cut, False), []).append((a, b, nbytes))
                if needs_grad:
                    by_way.setdefault((cut, True), []).append((b, a, nbytes))
            out.append({way: card_loads(links, moved) for way, moved in by_way.items()})
        return out

    # -- one iteration -------------------------------------------------------------------------

    def forward(self, *batch):
        raise TypeError("a pipeline runs forward and backward together, micro-batch by micro-batch: "
                        "call pipe.train_step(*batch)")

    def train_step(self, *batch: torch.Tensor) -> torch.Tensor:
        """One iteration on the global batch (given whole on every rank): every micro-batch's
        forward and backward in the schedule's order, then the gradients summed over the
        devices that share each parameter. Returns the global batch's loss on every rank
        (detached); the gradients are in this stage's parameters' .grad."""
        if not self.training:
            raise ValueError("hap.Pipeline runs training steps (pipe.train()); evaluate the model with hap.HAP "
                             "in eval mode, say on a checkpoint")
        if torch.is_autocast_enabled(self.device.type):  # (a stage's sends are sized by the captured dtypes: gloo aborted)
            raise ValueError("hap.Pipeline.train_step under torch.autocast: the stages send activations of the dtypes "
                             "the model was captured in; put the autocast inside the model's forward, where capture "
                             "sees it")
        if not torch.is_grad_enabled():  # (it drew dropout and moved statistics, and no gradient came)
            raise ValueError("hap.Pipeline.train_step under torch.no_grad() would train nothing: a pipeline runs "
                             "training steps; evaluate the model with hap.HAP in eval mode, say on a checkpoint")
        check_inputs(batch, self.graph)
        check, self._step_check = self._step_check, None
        if check is not None:
            check.verify()
            self._compare_alike = check.compare_next(self._compare_alike)
        self.refuse_shell_mode_change()  # (one of pipe.modules() put in another mode)
        modes, params = self._wrapped.walk()
        self._wrapped.switched(modes)  # (a module's own mode changed: a ValueError)
        if not self.model.training:
            raise ValueError("model.eval() was called on the model hap.Pipeline wrapped: a pipeline runs training "
                             "steps; evaluate the model with hap.HAP in eval mode, say on a checkpoint")
        changed = self._wrapped.changed_values(params)  # (told every rank by the step's sum)
        check_trainable(self.params, self.graph)
        # (counted at once: its first messages are a stage's peers'. A step of another shape goes by
        # another name, so that ranks given the planned batch and others not have parted at once:
        # the others wait in their agreement on the shape, which the first never join.)
        planned = input_shapes(self._planned.graph) == tuple(tuple(x.shape) for x in batch)
        with ledger.call("a training step, pipe.train_step(...)" + ("" if planned else ", of a batch not of the "
                         "planned shape"), now=True):
            self._use(self._layout_of(batch))
            try:
                return self._train_step(batch, changed)
            finally:
                self._use(self._planned)

    def _train_step(self, batch: tuple[torch.Tensor, ...], changed: str | None) -> torch.Tensor:
        t0 = time.perf_counter()
        self._computed = 0.0
        # gradients of an earlier train_step (accumulation) are summed already: set aside, added back after this sum
        earlier = {key: p.grad for key, p in self.params.items() if p.grad is not None}
        for key in earlier:
            self.params[key].grad = None
        if self._random:
            self._draw()
        inputs = self._inputs_now = dict(zip(self.graph.inputs, batch))
        saved: dict[int, tuple] = {}
        pending: list[dist.Work] = []
        loss = torch.zeros((), dtype=getattr(torch, self.graph.tensors[self.graph.loss].dtype), device=self.device)
        for kind, m in stage_order(self.schedule, self.K, self.M, self.s):
            if kind == "F":
                saved[m] = self._forward(m, inputs, pending)
                if saved[m][0] is not None:
                    loss = loss + saved[m][0].detach()
            else:
                self._backward(m, saved.pop(m), pending)
        for work in pending:
            work.wait()
        with self._span("hap move gradient sync (all_reduce)"):
            self._sync_gradients()
        for key, g in earlier.items():  # as one device accumulates: earlier + this step's
            p = self.params[key]
            p.grad = g if p.grad is None else g.add_(p.grad)
        if self._random:
            self._noise = {}
            self._share_rng(self._rng_after)
        # the loss's sum over ranks, with the step's checks (hap.HAP's forward)
        loaded, self._loaded = self._loaded, False
        self._sums += 1
        due = self._compare_alike or spot_check_due(self._sums)
        alike = [(self.graph.tensors[n].target, self.params.get(n)) for n in self._every_param] if due else ()
        total, _, check = sum_step(loss, torch.zeros(0, dtype=torch.float64), batch, changed, self.comm, loaded, alike)
        total = total.to(loss.dtype)
        check.different_batches = PIPELINE_DIFFERENT_BATCHES
        self._step_check = check.now_or_later()
        if self._step_check is None:
            self._compare_alike = check.compare_next(self._compare_alike)
        wall = time.perf_counter() - t0
        self.last_step = {"seconds": wall, "compute": self._computed, "waiting": wall - self._computed,
                          "planned_shape": self.graph is self._planned.graph}
        return total

    def _draw(self) -> None:
        """This step's random numbers: rank 0's generator, then every random node's whole draw
        up to this stage's end, in graph order; this stage's own are kept for its micro-batches."""
        self._share_rng(0)
        mine = range(self.plan.stages[self.s].nodes[0], self.plan.stages[self.s].nodes[1] + 1)
        with self._span("hap random draws"):
            for node in self._draws:
                drawn = whole_noise(node, self.graph, self.device)
                if node.index in mine:
                    self._noise[node.index] = drawn

    def _share_rng(self, src: int) -> None:
        """Every rank's CPU generator set to rank src's (a collective)."""
        torch.set_rng_state(broadcast(torch.get_rng_state(), src, self.comm))

    def _forward(self, m: int, inputs: dict[str, torch.Tensor], pending: list) -> tuple:
        """Micro-batch m's forward on this rank's piece: (its partial loss on the last stage,
        the sent tensors that need gradients, the received leaves that need gradients)."""
        received = self._receive(m)
        t0 = time.perf_counter()
        j, J = m * len(self.devices) + self.d, self.M * len(self.devices)
        split = self.pieces[self.s]
        ctx = LocalContext(device=j, world=J, split=lambda t, dim: self.classes.split_sizes(t, dim, split),
                           all_reduce=self._stage_sum, noise=lambda node, device: self._noise[node.index])
        piece = Comm(rank=j, world=J)
        held: dict[tuple[str, Placement], torch.Tensor] = {}
        for ci, value in received.items():
            c = self.crossings[ci]
            held[(c.tensor, c.placement)] = value[0]
        for step in self.steps:
            node = self.graph.nodes[step.node]
            for ms in step.moves:  # local moves only (check_pipelinable): slices, zero partials
                held[(ms.tensor, ms.move.dst)] = run_move(held[(ms.tensor, ms.move.src)], ms.move, piece,
                                                          self._sizes(ms.tensor, ms.move.src), self._sizes(ms.tensor, ms.move.dst))
            for ld in step.loads:
                held[(ld.tensor, ld.placement)] = self._load(ld.tensor, ld.placement, inputs, piece)
            node_ctx = ctx
            if counts_early(node, step.strategy, self.graph):
                node_ctx = dataclasses.replace(ctx, all_reduce=functools.partial(self._label_count, node))
            local = {name: held[(name, p)] for name, p in zip(node.inputs, step.strategy.inputs)}
            with self._span(f"hap node {node.name} {node.op.removeprefix('aten.')} [{step.strategy.name}]"):
                outs = run_node(node, step.strategy, local, self.graph, node_ctx)
            for name, p, out in zip(node.outputs, step.strategy.outputs, outs):
                held[(name, p)] = out
        self._charge(time.perf_counter() - t0)
        for buf, new in self._updates:  # one micro-batch (check_pipelinable): the step's statistics
            self._constants[buf] = next(v for (name, p), v in held.items() if name == new and not p.is_shard).detach()
        part = None
        if self.s == self.K - 1:
            loss_p = next(p for (name, p) in held if name == self.graph.loss)
            part = held[(self.graph.loss, loss_p)]
            if loss_p != P and j != 0:  # a whole loss counts once over the pieces
                part = part * 0
        outputs = []
        self._settle()
        for tr in self._sends[m]:
            c = self.crossings[tr.crossing]
            x = held[(c.tensor, c.placement)]
            if tr.length >= 0:
                x = x.narrow(c.placement.dim, tr.start, tr.length)
            pending.append(wire.isend(x.detach().contiguous(), self._rank_of(tr), tag=tr.tag))
            if c.requires_grad:  # its gradient comes back (zeros where this piece has no path)
                outputs.append((tr, x))
        sent = {tr.crossing for tr in self._sends[m]}
        for ci, c in enumerate(self.crossings):  # this piece has no rows of it: its gradient is empty,
            if c.src == self.s and c.requires_grad and ci not in sent:  # yet the backward must run the
                x = held[(c.tensor, c.placement)]  # group's collectives (synchronized BatchNorm's)
                if x.numel() == 0:
                    outputs.append((None, x))
        leaves = [(tr, leaf) for ci, (_, parts) in received.items() for tr, leaf in parts if self.crossings[ci].requires_grad]
        return part, outputs, leaves

    def _backward(self, m: int, saved: tuple, pending: list) -> None:
        part, outputs, leaves = saved
        grads = []
        works = []
        for tr, x in outputs:
            g = torch.empty_like(x, memory_format=torch.contiguous_format)
            if tr is not None:
                works.append(wire.irecv(g, self._rank_of(tr), tag=tr.tag + 1))
            grads.append(g)
        for w in works:
            w.wait()
        self._arrived([(tr, g) for (tr, _), g in zip(outputs, grads) if tr is not None], m, backward=True)
        t0 = time.perf_counter()
        if part is not None and part.requires_grad:
            torch.autograd.backward([part])
        elif any(x.requires_grad for _, x in outputs):
            pairs = [(x, g) for (_, x), g in zip(outputs, grads) if x.requires_grad]
            torch.autograd.backward([x for x, _ in pairs], [g for _, g in pairs])
        self._charge(time.perf_counter() - t0)
        self._settle()
        for tr, leaf in leaves:
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            pending.append(wire.isend(g.contiguous(), self._rank_of(tr), tag=tr.tag + 1))

    def _receive(self, m: int) -> dict[int, tuple[torch.Tensor, list]]:
        """Micro-batch m's crossings into this rank: crossing -> (its local value, [(transfer,
        leaf)]) where the leaves are the received parts, concatenated in row order."""
        works, parts = [], {}
        for tr in self._recvs[m]:
            c = self.crossings[tr.crossing]
            t = self.graph.tensors[c.tensor]
            shape = list(t.shape)
            if tr.length >= 0:
                shape[c.placement.dim] = tr.length
            buf = torch.empty(shape, dtype=getattr(torch, t.dtype), device=self.device)
            works.append(wire.irecv(buf, self._rank_of(tr), tag=tr.tag))
            parts.setdefault(tr.crossing, []).append((tr, buf))
        with self._span(f"hap move receive micro-batch {m} (gloo)"):
            for w in works:
                w.wait()
        self._arrived([tr_buf for got in parts.values() for tr_buf in got], m)
        out = {}
        for ci, got in parts.items():
            c = self.crossings[ci]
            got = [(tr, buf.requires_grad_(c.requires_grad)) for tr, buf in sorted(got, key=lambda x: x[0].start)]
            value = got[0][1] if len(got) == 1 else torch.cat([b for _, b in got], c.placement.dim)
            out[ci] = (value, got)
        for ci in self._empty_crossings(out):  # this rank's rows of the micro-batch are none
            c = self.crossings[ci]
            t = self.graph.tensors[c.tensor]
            shape = list(t.shape)
            shape[c.placement.dim] = 0
            # needing a gradient as the received parts do: a group's collectives in the backward
            # (synchronized BatchNorm's) run on every device of the stage, rows or none
            empty = torch.empty(shape, dtype=getattr(torch, t.dtype), device=self.device)
            out[ci] = (empty.requires_grad_(c.requires_grad), [])
        return out

    def _rank_of(self, tr: _Transfer) -> int:
        return global_rank(self.comm, tr.peer)

    def _arrived(self, received: list[tuple[_Transfer, torch.Tensor]], m: int, backward: bool = False) -> None:
        """Micro-batch m's messages just received: an emulated link (emulate: true) takes their
        time as the pipeline's price has it (price.PipelinePricer._send_seconds): rows from each
        sender at once, one message per tensor after another, and no faster than the network
        cards they go through (this machine's in, each sender's machine's out: every rank's rows
        over the same cut counted, _card_loads); then whole tensors, which their sender sends to the stage's
        devices in turn, so a device waits for those to the devices before it (backward: their
        gradients, all into the one device that sent them)."""
        links = self.emulation.links
        if links is None or not received:
            return
        me = self.comm.rank
        rows: dict[tuple, dict[int, list]] = {}  # cut -> peer -> [seconds on the link, messages]
        whole = 0.0
        for tr, buf in received:
            nbytes = buf.numel() * buf.element_size()
            if tr.length >= 0:
                c = self.crossings[tr.crossing]
                cut = (self.s, self._stage_of_tag(tr.tag)) if backward else (c.src, self.s)
                peer = rows.setdefault(cut, {}).setdefault(tr.peer, [0.0, 0])
                peer[0] += links.send(tr.peer, me, nbytes)
                peer[1] += 1
            elif backward:
                whole += links.send(tr.peer, me, nbytes)
            else:
                whole += sum(links.send(tr.peer, d, nbytes) for d in self.devices[: self.d + 1])
        rows_seconds = 0.0
        mine = links.machine_of(me)
        for cut, peers in rows.items():
            rows_seconds = max(rows_seconds, max(seconds for seconds, _ in peers.values()))
            sent, got = self._cards[m].get((cut, backward), ({}, {})) if self._cards else ({}, {})
            count = max(n for _, n in peers.values())
            for peer in peers:  # the cards a message from another machine goes through: its out, this one's in
                theirs = links.machine_of(peer)
                if theirs == mine or links.overridden(peer, me):
                    continue
                for k, load in ((mine, got), (theirs, sent)):
                    rows_seconds = max(rows_seconds, card_seconds(links, k, load.get(k, 0.0), count))
        self.emulation.off_wire(self.emulation.occupy(rows_seconds + whole))

    def _stage_of_tag(self, tag: int) -> int:
        """The destination stage a transfer's tag names (_tag)."""
        return (tag // 2) % self.K

    def _group_all_reduce(self, x: torch.Tensor, devices: tuple[int, ...]) -> None:
        """Sum x over a group of devices in place, taking an emulated link's time as well."""
        ready = self.comm.on_wire("all_reduce", x.numel() * x.element_size(), list(devices))
        wire.all_reduce(x, group=self._groups[devices])
        self.comm.off_wire(ready)

    def _empty_crossings(self, got: dict) -> list[int]:
        return [ci for ci in self._incoming if ci not in got]

    def _sizes(self, tensor: str, p: Placement) -> list[int] | None:
        return self.classes.split_sizes(tensor, p.dim, self.pieces[self.s]) if p.is_shard else None

    def _load(self, tensor: str, p: Placement, inputs: dict[str, torch.Tensor], piece: Comm) -> torch.Tensor:
        t = self.graph.tensors[tensor]
        if t.kind == "param":
            value = self.params[tensor]
        elif t.kind == "buffer":
            value = self._constants[tensor]
        elif tensor in inputs:
            value = inputs[tensor]
        else:
            value = self.graph.constants[tensor]
        if p == R or p.kind == "D":
            return value
        if p.is_shard:
            sizes = self._sizes(tensor, p)
            return value.narrow(p.dim, sum(sizes[: piece.rank]), sizes[piece.rank])
        if t.kind == "param":
            raise ValueError(f"a pipeline stage loads parameter {tensor} as {p}; its program must keep parameters whole")
        return value if piece.rank == 0 else torch.zeros_like(value)  # P: one piece holds it

    def _stage_sum(self, x: torch.Tensor) -> torch.Tensor:
        """A local variant's sum over every piece of the batch (BatchNorm's statistics, forward
        and backward): over the stage's devices, whose pieces are the whole batch where such a
        node runs (one micro-batch: check_pipelinable)."""
        assert self.M == 1, "check_pipelinable lets a sum over the batch run with 1 micro-batch only"
        out = x.detach().clone()
        if len(self.devices) > 1:
            self._group_all_reduce(out, tuple(self.devices))
        return out

    def _label_count(self, node, x: torch.Tensor) -> torch.Tensor:
        """A mean's count of its labels over every piece of the batch: from the whole labels,
        which every rank computes from the whole batch it holds (no collective)."""
        whole = _Missing({name: self._whole(name) for name in node.inputs[1:]})
        return label_count(substitute(node.args, whole), substitute(node.kwargs, whole)).to(x.dtype)

    def _whole(self, name: str) -> torch.Tensor:
        """The whole-batch value of a tensor computed from the data alone (labels reshaped, say),
        as one device computes it."""
        t = self.graph.tensors[name]
        if t.is_leaf:
            return self._load(name, R, self._inputs_now, Comm(rank=0, world=1))
        if t.requires_grad:
            raise ValueError(f"{name}: a loss's mean denominator that depends on parameters cannot be counted per "
                             "micro-batch")
        node = self.graph.nodes[t.producer]
        values = {x: self._whole(x) for x in node.inputs}
        out = node.target(*substitute(node.args, values), **substitute(node.kwargs, values))
        outs = tuple(out) if isinstance(out, (list, tuple)) else (out,)
        return outs[node.outputs.index(name)]

    def _span(self, label: str):
        """A named span in the Chrome trace while one is recorded, else nothing."""
        return torch.profiler.record_function(label) if self.tracing else contextlib.nullcontext()

    def _charge(self, seconds: float) -> None:
        """An emulated slow device owes (slowdown - 1) times what it just computed."""
        self._computed += seconds
        self.emulation.computed(seconds)

    def _settle(self) -> None:
        """An emulated slow device sleeps off its debt: that is its computing (last_step counts it)."""
        if self.emulation.debt > 0:
            t0 = time.perf_counter()
            self.emulation.settle()
            self._computed += time.perf_counter() - t0

    def _sync_gradients(self) -> None:
        """Sum every parameter's gradient over the devices of the stages that use it."""
        for bucket in sorted(self._buckets):
            devices, names = self._buckets[bucket]
            params = [self.params[n] for n in names if self.params[n].requires_grad]
            if not params:
                continue
            # which ranks' backward reached each parameter, summed beside the gradients: one that
            # none reached (used only on a detached branch) keeps no gradient, as on one device
            had = [p.grad is not None for p in params]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in params] + [torch.tensor(had, dtype=params[0].grad.dtype, device=params[0].grad.device)])
            self._group_all_reduce(flat, devices)
            parts = flat.split([p.numel() for p in params] + [len(params)])
            for p, part, reached in zip(params, parts, parts[-1].tolist()):
                if reached:
                    p.grad.copy_(part.view_as(p.grad))
                else:
                    p.grad = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model, as hap.HAP's: the norm of every
        stage's gradients, each parameter counted once (by the first device of the first stage
        that holds it: a tied embedding's two stages hold one parameter), the same on every rank;
        every gradient is scaled by min(1, max_norm / (norm + 1e-6)). A collective: every rank
        calls it, after train_step. Returns the total norm."""
        return clip_spread_(self, max_norm, norm_type)

    def spread_grads(self) -> tuple[list[tuple[torch.Tensor, bool]], torch.dtype | None]:
        """This stage's gradients, each with whether this rank counts it in the global norm
        (clip_grad_norm_); and the norm's dtype: the model's gradients', on every rank, a stage
        without parameters too (it was float32)."""
        counted = set(self._norm_counted)
        dtype = next((p.dtype for p in self.model.parameters() if p.requires_grad and p.is_floating_point()), None)
        return [(p.grad, name in counted) for name, p in self.params.items() if p.grad is not None], dtype

    # -- state ---------------------------------------------------------------------------------

    @property
    def executor(self) -> "_StageState":
        """This stage's parameters and buffers as hap.runtime.checkpoint reads and writes them
        (checkpoint.save(pipe, opt, ...) and checkpoint.load work as for hap.HAP; a checkpoint of
        either loads under the other, any plan)."""
        return self._stage_state

    @ledger.called("pipe.full_state_dict()")
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model's state dict, whole, under the keys of `model.state_dict()` (each
        stage's first device contributes its parameters). A collective: every rank gets it."""
        mine = {}
        if self.d == 0:
            mine = {n: p.detach().clone() for n, p in self.params.items()}
            mine.update({n: self._constants[n].clone() for n in self._kept_buffers})
        whole = {n: v for part in every_rank(mine, self.comm) for n, v in part.items()}
        original = wrapped_state(self.model)
        return {key: whole[name] if name in whole else original[key].detach().clone()
                for key, name in self._state_keys.items()}


@dataclasses.dataclass(slots=True, kw_only=True)
class _Layout:
    """What a pipeline runs at one shape of the batch, from the plan and the model's graph
    captured at that shape (Pipeline._lay_out)."""
    graph: Graph
    programs: list[list]
    """Every stage's program, as Steps over `graph`."""
    classes: ShardClasses
    crossings: list
    """The tensors a stage computes and a later stage reads (stages.crossings)."""
    pieces: list[list[float]]
    """Per stage, the shares of its micro-batches' pieces (stages.stage_pieces)."""
    sends: list[list[_Transfer]]
    recvs: list[list[_Transfer]]
    """Per micro-batch, what this rank sends and receives in the forward."""
    cards: list
    """Per micro-batch, each cut's bytes (out, in) of each machine's network card, forward and
    backward (Pipeline._card_loads; [] where links are not emulated)."""
    draws: list
    """The random nodes up to this stage's last, drawn whole every step in graph order."""
    incoming: list[int]
    """The crossings into this rank's stage."""
    updates: list[tuple[str, str]]
    """(buffer, its new value) of the buffers this stage's forward updates."""


class _StageState:
    """A pipeline stage's state with the executor's interface that checkpoint.py uses: every
    parameter this stage loads and the buffers it keeps current (Pipeline._kept_buffers), each
    whole (R) on each of its devices."""

    def __init__(self, pipe: Pipeline):
        self.params = dict(pipe.params)
        self.buffers = pipe._constants  # the pipeline's own: a load replaces its values
        self.stored = {name: (R, 0) for name in [*self.params, *pipe._kept_buffers]}

    def value_of(self, name: str) -> torch.Tensor:
        return self.params[name] if name in self.params else self.buffers[name]

    def stored_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full

    def sizes(self, tensor: str, p: Placement, seg: int) -> None:
        return None


class _Missing(dict):
    def __missing__(self, key):
        return None


def _held_whole(params: dict[str, nn.Parameter], name: str, whole: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(parameter `name`'s whole value, this stage's copy of it: a stage holds its parameters whole)."""
    return whole, params[name]
