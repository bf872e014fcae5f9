"""The cost model's price of a pipeline: the one formula the exact partition minimizes, the
DQN is rewarded by and a pipeline plan's estimate states.

Stage k (nodes [a, b] on device group G_k, which splits each micro-batch by ratios r) takes
per micro-batch, forward plus backward,

    t_k = max over i in G_k of ( r_i / M * work_i[a..b] + fixed_i[a..b] + (M - 1) / M * acc_i[a..b] )
          + inner_k + send_k

where r_i is device i's share of the batch as the runtime splits it, whole rows per micro-batch
(stages.device_pieces, summed: the ratio itself where the rows divide evenly), work_i is the
batch-proportional time of the nodes on device i (the cost model's node times at the whole
batch), fixed_i what does not shrink with the share (per-node overheads, nodes on replicated
tensors, reading the whole weights and writing their gradients: every micro-batch pays it),
acc_i adding a micro-batch's gradients into those held, inner_k the collectives nodes make
inside themselves over G_k (a synchronized batch norm's sums), and send_k the transfer of
what crosses the cut after stage k, forward and (what needs a gradient) back:
split rows between the pairs of devices whose rows overlap, at once (the slowest of their
links and of the network cards they share decides: a machine's card carries all its devices'
rows to other machines), replicated tensors whole, every micro-batch, from one device to each
device of the next group. An iteration of M micro-batches (GPipe or 1F1B: the same bubble)
then takes

    L = sum_k t_k + (M - 1) * max_k t_k + max_k sync_k + step_collectives

sync_k being stage k's gradient sync after the flush: the all-reduce over G_k of the gradients
it alone holds, and one over the union of the groups for each set of stages that share
parameters (a tied embedding), as the plan's sync buckets run them; and step_collectives the
loss's all-reduce and, for a model with random ops, the two broadcasts of the generator's state
(before the step's draws and after it). A stage holds every parameter its nodes load (a shared
one on each of its stages: weights, gradient, optimizer state, and their accumulation). The
schedule's event simulation (schedule.simulate: a transfer overlaps the next computation but
waits for its link, each stage syncs once its own passes and sends are done) agrees with the
first two terms exactly where the stages are alike and transfers are free, and is reported
beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..cost.model import CostModel
from ..rules.local import variant_collectives
from ..rules.nn import counts_early
from ..search.program import Step
from .schedule import ScheduleName, in_flight, simulate
from .stages import batch_granules, device_pieces, stage_of_nodes


@dataclass(frozen=True, slots=True)
class PipelineEstimate:
    seconds: float
    """L above."""
    stage_seconds: tuple[float, ...]
    """t_k: per micro-batch, forward + backward + the transfer after it."""
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    send: tuple[float, ...]
    """Seconds of one micro-batch's crossings over each cut, forward."""
    send_back: tuple[float, ...]
    """Seconds of their gradients' way back."""
    sync: tuple[float, ...]
    memory: tuple[float, ...]
    """Peak bytes per device."""
    simulated: float
    """The schedule's event simulation of the same stage times, plus sync."""


def iteration_seconds(t: Sequence[float], sync: Sequence[float], M: int, tail: float = 0.0) -> float:
    """The pipeline formula: sum of the stage times t_k, (M - 1) more of the slowest, the
    largest stage's gradient sync, and `tail` (the loss's sync). A stage that cannot run
    (infinite time) makes it infinite, with one micro-batch too (not 0 * inf: NaN)."""
    slowest = max(t)
    if math.isinf(slowest):
        return math.inf
    return float(sum(t) + (M - 1) * slowest + max(sync) + tail)


class PipelinePricer:
    """Prices any cut of one data-parallel program into stages; prefix sums make a stage's
    time O(devices)."""

    def __init__(self, cost: CostModel, program: Sequence[Step]):
        graph = self.graph = cost.graph
        self.cost = cost
        self.step_collectives = cost.loss_sync + 2 * cost.rng_sync
        """The loss's all-reduce and the generator's two broadcasts a pipeline step makes (runtime.py)."""
        n, m = len(graph.nodes), cost.m
        work_f, work_b = np.zeros((n, m)), np.zeros((n, m))
        fixed_f, fixed_b = np.zeros((n, m)), np.zeros((n, m))
        for step in program:
            node = graph.nodes[step.node]
            f, b = cost.base_times(node)
            xf, xb = cost.fixed_times(node)
            split = cost.work_shard(node, step.strategy) is not None
            (work_f if split else fixed_f)[node.index] += f
            (work_b if split else fixed_b)[node.index] += b
            fixed_f[node.index] += xf
            fixed_b[node.index] += xb
            # its parameters, whole in a stage, read (and their gradients written) per micro-batch
            pf, pb = cost.whole_params_seconds(node, tuple(cost.params_of(node)))
            fixed_f[node.index] += pf
            fixed_b[node.index] += pb
        cum = lambda a: np.vstack([np.zeros((1, m)), np.cumsum(a, axis=0)])  # noqa: E731
        self.work_f, self.work_b, self.fixed_f, self.fixed_b = cum(work_f), cum(work_b), cum(fixed_f), cum(fixed_b)
        acts = np.zeros(n)
        for node in graph.nodes:
            acts[node.index] = sum(graph.tensors[o].nbytes for o in node.outputs)
        self.acts = np.concatenate([[0], np.cumsum(acts)])
        self._held_params(cost)
        # collectives inside nodes (a synchronized batch norm's sums), over a stage's group
        # (a loss's count of its targets is none: a stage counts them from the whole batch's labels)
        self._inner = [(step.node, variant_collectives(graph.nodes[step.node], step.strategy, graph)) for step in program
                       if not counts_early(graph.nodes[step.node], step.strategy, graph)]
        self._inner = [(k, found) for k, found in self._inner if found]
        self._inner_cum: dict[tuple[int, ...], np.ndarray] = {}
        self.crossing_bytes, self.crossing_counts = _crossing_bytes(graph, program)
        """[split or whole, forward or backward, c]: the bytes that cross the cut before node c
        split on a dim (whole batch) or replicated, and those of them whose gradient comes back;
        and the same counting the tensors (each a message of its own: a latency each)."""
        self.cut_bytes = self.crossing_bytes[:, 0].sum(0)  # [c]: all bytes crossing the cut before node c
        self.add_per_byte = np.asarray(cost.accumulate_seconds(1.0))  # per device: seconds per gradient byte added
        self.granules = batch_granules(graph, cost.classes, program)
        """Granules (rows, or groups of them) of the batch, which micro-batches and devices split whole."""
        self._pieces: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def _device_pieces(self, ratios: Sequence[float], M: int) -> tuple[np.ndarray, np.ndarray]:
        key = (tuple(float(x) for x in ratios), M)
        found = self._pieces.get(key)
        if found is None:
            pieces = device_pieces(self.granules, M, key[0])
            found = self._pieces[key] = (np.asarray([sum(p) for p in pieces]) / M, np.asarray([max(p) for p in pieces]))
        return found

    def shares(self, ratios: Sequence[float], M: int) -> np.ndarray:
        """Each device's share of the batch as the runtime splits it (stages.device_pieces), per
        micro-batch on average: what it computes per micro-batch."""
        return self._device_pieces(ratios, M)[0]

    def peak_shares(self, ratios: Sequence[float], M: int) -> np.ndarray:
        """Each device's largest share of the batch in one micro-batch: what it holds at most."""
        return self._device_pieces(ratios, M)[1]

    def _held_params(self, cost: CostModel) -> None:
        """Per parameter: [weights, state (weights, gradient, optimizer states), gradient] bytes.
        `params`: the prefix sums of weights at each parameter's first consumer (what comes
        before a node: the DQN's W feature); `_single` those of the three amounts of the
        parameters one node uses; `spread` lists the parameters several nodes use (a tied
        embedding), held by every stage that runs one."""
        graph, n = self.graph, len(self.graph.nodes)
        names = [x for x, t in graph.tensors.items() if t.kind == "param" and t.consumers]
        amounts = np.asarray([[graph.tensors[x].nbytes, cost.state_bytes(x),
                               graph.tensors[x].nbytes * graph.tensors[x].requires_grad] for x in names],
                             dtype=float).reshape(-1, 3)
        users = [np.unique(graph.tensors[x].consumers) for x in names]
        first, single = np.zeros(n), np.zeros((n, 3))
        self.spread: list[tuple[np.ndarray, np.ndarray]] = []
        """(the nodes that use it, its [weights, state, gradient] bytes) per parameter several nodes use."""
        for nodes, amount in zip(users, amounts):
            first[nodes[0]] += amount[0]
            if len(nodes) == 1:
                single[nodes[0]] += amount
            else:
                self.spread.append((nodes, amount))
        self.params = np.concatenate([[0.0], np.cumsum(first)])
        self.buffer_bytes = float(sum(t.nbytes for t in graph.tensors.values() if t.kind == "buffer"))
        """Every stage's device keeps every buffer whole (runtime.Pipeline: a checkpoint takes any from it)."""
        self._single = np.vstack([np.zeros((1, 3)), np.cumsum(single, axis=0)])

    # -- pieces of the formula -----------------------------------------------------------------

    def held(self, a, b, whole: bool = False) -> np.ndarray:
        """[weights, state, gradient] bytes of the parameters that nodes a..b (inclusive) load,
        each once; one that several stages use counts in each (every one keeps its weights,
        gradient and optimizer state). whole: only those no node outside a..b loads. a and b
        may be index arrays (broadcast): then [..., 3]."""
        a, b = np.asarray(a), np.asarray(b)
        total = self._single[b + 1] - self._single[a]
        for nodes, amount in self.spread:
            inside = (nodes >= a[..., None]) & (nodes <= b[..., None])
            total = total + (inside.all(-1) if whole else inside.any(-1))[..., None] * amount
        return total

    def stage_times(self, a, b, group: Sequence[int], ratios: Sequence[float], M: int):
        """(forward, backward) seconds of nodes a..b (inclusive) per micro-batch on the group:
        the one price of a stage's time, which the estimate and StageTable (every stage at once:
        a and b index arrays, broadcast, give arrays) both take."""
        g = np.asarray(group)
        ai, bi = np.asarray(a)[..., None], np.asarray(b)[..., None]
        r = self.shares(ratios, M)
        f = r * (self.work_f[bi + 1, g] - self.work_f[ai, g]) + (self.fixed_f[bi + 1, g] - self.fixed_f[ai, g])
        bw = r * (self.work_b[bi + 1, g] - self.work_b[ai, g]) + (self.fixed_b[bi + 1, g] - self.fixed_b[ai, g])
        # micro-batches after the first add their gradients into the held ones: (M - 1) / M per micro-batch
        bw = bw + (M - 1) / M * self.held(a, b)[..., 2:] * self.add_per_byte[g]
        f, bw = f.max(-1), bw.max(-1) + self.inner_seconds(a, b, group)
        return (float(f), float(bw)) if f.ndim == 0 else (f, bw)

    def inner_seconds(self, a, b, group: Sequence[int]):
        """Seconds of the collectives that nodes a..b make inside themselves over the group
        (forward and backward, per micro-batch; the walk's variant_comm, on a stage's devices);
        a and b may be index arrays."""
        if not self._inner or len(group) < 2:
            return 0.0
        key = tuple(group)
        cum = self._inner_cum.get(key)
        if cum is None:
            per = np.zeros(len(self.graph.nodes))
            for k, found in self._inner:
                per[k] += sum(self.cost.group_collective(kind, nbytes, key) for kind, nbytes in found)
            cum = self._inner_cum[key] = np.concatenate([[0.0], np.cumsum(per)])
        found = cum[np.asarray(b) + 1] - cum[np.asarray(a)]
        return float(found) if np.ndim(found) == 0 else found

    def transfer(self, cut: int, src: Sequence[int], dst: Sequence[int], M: int,
                 src_ratios: Sequence[float] | None = None,
                 dst_ratios: Sequence[float] | None = None) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch's crossings over the cut before node
        `cut`, as the runtime routes them: split rows move between the pairs of devices whose
        rows overlap (each group's shares: its ratios, even where not given) at once, and a
        replicated tensor goes whole, every micro-batch, from the source group's first device
        to each destination device (its gradient comes back from each), after its rows. A tensor
        read several stages on is priced at every cut it crosses, each on its own link (the
        runtime sends it once, straight to each reader)."""
        split, whole = self.crossing_bytes[0, :, cut] / M, self.crossing_bytes[1, :, cut]
        n_split, n_whole = self.crossing_counts[0, :, cut], self.crossing_counts[1, :, cut]
        flows = row_flows(self.shares([1.0] * len(src) if src_ratios is None else src_ratios, M) * M,
                          self.shares([1.0] * len(dst) if dst_ratios is None else dst_ratios, M) * M)
        there = self._send_seconds(float(split[0]), float(whole[0]), int(n_split[0]), int(n_whole[0]),
                                   [(src[i], dst[j], f) for i, j, f in flows], src[0], dst)
        back = self._send_seconds(float(split[1]), float(whole[1]), int(n_split[1]), int(n_whole[1]),
                                  [(dst[j], src[i], f) for i, j, f in flows], None, dst, src[0])
        return there, back

    def _send_seconds(self, split: float, whole: float, n_split: int, n_whole: int,
                      flows: Sequence[tuple[int, int, float]], whole_from: int | None, whole_to: Sequence[int],
                      whole_back_to: int | None = None) -> float:
        """Seconds of moving a micro-batch's rows of n_split tensors (split bytes of them) as
        `flows` say ((from, to, fraction of the rows): all at once), then n_whole whole tensors
        (whole bytes) between whole_from and each of whole_to (back: from each to whole_back_to),
        one after another: each tensor its own message, with its own latency, as the runtime
        sends them. On a topology the rows take the slowest of their links and of the network
        cards they share: a card carries every flow between its machine and the others at
        once (four devices sending to four on another machine share one card each way)."""
        topo = self.cost.cluster.topology
        if topo is None or self.cost.cluster.measured_fits:
            fit = self.cost.cluster.fit("broadcast")
            most = max((f for _, _, f in flows), default=0.0)
            return ((n_split * fit.alpha + split * most / fit.beta if split > 0 else 0.0)
                    + (len(whole_to) * (n_whole * fit.alpha + whole / fit.beta) if whole > 0 else 0.0))

        def message(a: int, b: int, count: int, nbytes: float) -> float:
            link = topo.link(a, b)
            return count * link.latency + nbytes / link.bandwidth

        rows = 0.0
        if split > 0:
            rows = max(message(a, b, n_split, split * f) for a, b, f in flows)
            rows = max(rows, shared_cards_seconds(topo, [(a, b, split * f) for a, b, f in flows], n_split))
        if whole <= 0:
            return rows
        if whole_back_to is None:
            return rows + sum(message(whole_from, j, n_whole, whole) for j in whole_to)
        return rows + sum(message(j, whole_back_to, n_whole, whole) for j in whole_to)

    def sync(self, a: int, b: int, group: Sequence[int]) -> float:
        """The part of stage a..b's gradient sync that depends on it alone: the all-reduce over
        its group of the gradients no other stage holds (the plan's bucket of this group), and
        each machine's GPUs summing every gradient the stage holds (shared_sync adds the rest)."""
        held, own = (float(x[2]) for x in (self.held(a, b), self.held(a, b, whole=True)))
        seconds = self.cost.group_collective("all_reduce", own, group) if len(group) > 1 and own else 0.0
        machines = max(self.cost.grad_intra(held)[i] for i in group)  # GPUs inside a machine sum first
        return seconds + machines

    def shared_sync(self, stage_of: Sequence[int], groups: Sequence[Sequence[int]]) -> list[float]:
        """Per stage, seconds of the all-reduces of the gradients that several stages hold
        (stage_of: every node's stage): one per set of stages over the union of their groups,
        as the plan's sync buckets (plan.assemble) and the runtime run them, paid by each of
        those stages after its own bucket (as sync prices it)."""
        buckets: dict[tuple[int, ...], float] = {}
        for nodes, amount in self.spread:
            stages = tuple(sorted({int(stage_of[c]) for c in nodes}))
            if len(stages) > 1 and amount[2]:
                buckets[stages] = buckets.get(stages, 0.0) + float(amount[2])
        out = [0.0] * len(groups)
        for stages, nbytes in buckets.items():
            seconds = self.cost.group_collective("all_reduce", nbytes, sorted(d for k in stages for d in groups[k]))
            for k in stages:
                out[k] += seconds
        return out

    def memory(self, a: int, b: int, group: Sequence[int], ratios: Sequence[float], M: int, live: int) -> list[float]:
        """Bytes per GPU of stage a..b's devices holding `live` micro-batches at once: the stage's
        parameter state, the model's buffers, and per micro-batch its share of the activations
        it makes and of those it receives over the cut before it (kept for its backward, as a
        one-stage plan keeps what a move brings); a replicated crossing whole."""
        params = float(self.held(a, b)[1]) + self.buffer_bytes
        acts = float(self.acts[b + 1] - self.acts[a])
        split, whole = (float(self.crossing_bytes[k, 0, a]) if a > 0 else 0.0 for k in (0, 1))
        # per GPU: a machine's GPUs split its share of the micro-batch's activations and each
        # keeps the stage's whole parameter state (data parallel), as search.program.memory_terms
        return [params + ((acts + split) * r + whole) * live / self.cost.gpus(i)
                for i, r in zip(group, self.peak_shares(ratios, M))]

    # -- the whole -----------------------------------------------------------------------------

    def estimate(self, cuts: Sequence[int], groups: Sequence[Sequence[int]], ratios: Sequence[Sequence[float]],
                 M: int, schedule: ScheduleName = "1f1b") -> PipelineEstimate:
        n = len(self.graph.nodes)
        bounds = [0, *cuts, n]
        K = len(groups)
        if len(bounds) != K + 1:
            raise ValueError(f"{len(cuts)} cuts make {len(bounds) - 1} stages, not {K}")
        fwd, bwd, send, back, sync, mem = [], [], [], [], [], [0.0] * self.cost.m
        shared = self.shared_sync(stage_of_nodes(cuts, n), groups)
        for k in range(K):
            a, b = bounds[k], bounds[k + 1] - 1
            f, bw = self.stage_times(a, b, groups[k], ratios[k], M)
            fwd.append(f)
            bwd.append(bw)
            sync.append(self.sync(a, b, groups[k]) + shared[k])
            for i, x in zip(groups[k], self.memory(a, b, groups[k], ratios[k], M, in_flight(schedule, K, M, k))):
                mem[i] = x
            if k < K - 1:
                there, returned = self.transfer(bounds[k + 1], groups[k], groups[k + 1], M, ratios[k], ratios[k + 1])
                send.append(there)
                back.append(returned)
        t = [f + bw + (send[k] + back[k] if k < K - 1 else 0.0) for k, (f, bw) in enumerate(zip(fwd, bwd))]
        seconds = iteration_seconds(t, sync, M, self.step_collectives)
        simulated = simulate(schedule, M, fwd, bwd, send, back, sync).end + self.step_collectives
        return PipelineEstimate(seconds, tuple(t), tuple(fwd), tuple(bwd), tuple(send), tuple(back), tuple(sync),
                                tuple(mem), simulated)


def row_flows(src: Sequence[float], dst: Sequence[float]) -> list[tuple[int, int, float]]:
    """(source device index, destination device index, fraction of the rows) of every pair
    whose rows overlap, where the source group holds the rows by shares `src` in order and the
    destination group by `dst` (as stages.overlaps routes them, in fractions)."""
    out, a0 = [], 0.0
    for i, a in enumerate(src):
        b0 = 0.0
        for j, b in enumerate(dst):
            lo, hi = max(a0, b0), min(a0 + a, b0 + b)
            if hi - lo > 1e-12:
                out.append((i, j, hi - lo))
            b0 += b
        a0 += a
    return out


def card_loads(topo, flows: Sequence[tuple[int, int, float]]) -> tuple[dict[int, float], dict[int, float]]:
    """Bytes (out, in) per machine's network card of `flows` ((from, to, bytes) at once): each
    machine's card carries its flows to other machines out and theirs to it in (a pair with a
    link of its own, an override, uses neither card)."""
    out: dict[int, float] = {}
    into: dict[int, float] = {}
    for a, b, nbytes in flows:
        ma, mb = topo.machine_of(a), topo.machine_of(b)
        if ma != mb and not topo.overridden(a, b):
            out[ma] = out.get(ma, 0.0) + nbytes
            into[mb] = into.get(mb, 0.0) + nbytes
    return out, into


def card_seconds(topo, machine: int, nbytes: float, messages: int) -> float:
    """Seconds machine `machine`'s network card takes for nbytes in `messages` messages."""
    nic = topo.machines[machine].nic
    return messages * nic.latency + nbytes / nic.bandwidth


def shared_cards_seconds(topo, flows: Sequence[tuple[int, int, float]], messages: int) -> float:
    """Seconds the busiest network card takes for `flows` (card_loads), out or in."""
    out, into = card_loads(topo, flows)
    return max((card_seconds(topo, k, max(out.get(k, 0.0), into.get(k, 0.0)), messages) for k in {*out, *into}),
               default=0.0)


def _crossing_bytes(graph, program: Sequence[Step]) -> tuple[np.ndarray, np.ndarray]:
    """[split or whole, forward or backward, c]: bytes crossing the cut before node c, by the
    placement the program gives them (split on a dim: the whole batch's; replicated: one
    copy), forward, and backward for those whose gradient comes back (stages.crossings); and
    the number of those tensors."""
    placed = {}
    for step in program:
        placed.update(zip(graph.nodes[step.node].outputs, step.strategy.outputs))
    delta = np.zeros((2, 2, 2, len(graph.nodes) + 2))  # [bytes or count, kind, way, c]
    for t in graph.tensors.values():
        if t.producer >= 0 and t.consumers and max(t.consumers) > t.producer:
            kind = 0 if placed[t.name].is_shard else 1
            for way in (0, 1) if t.requires_grad else (0,):
                delta[:, kind, way, t.producer + 1] += (t.nbytes, 1)
                delta[:, kind, way, max(t.consumers) + 1] -= (t.nbytes, 1)
    nbytes, counts = np.cumsum(delta, axis=-1)[..., : len(graph.nodes) + 1]
    return nbytes, counts
