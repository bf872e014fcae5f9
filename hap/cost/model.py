"""The cost model: time of computation and of collectives, in seconds, from FLOPs and bytes.

Units are uniform: FLOPs and FLOP/s, bytes and bytes/s, seconds. A tensor's size is always
its byte size (numel * itemsize), never its element count.

Computation (HAP section 3.2): a node that shards an iteration dim runs the fraction
share_j of its work on device j, otherwise all of it; time on device j is
    share_j * (flops / (gpus_j * flops_j) + activation bytes / (gpus_j * mem_bandwidth_j))
      + weight bytes / (gpus_j * mem_bandwidth_j) + op_overhead_j,
the weight bytes being those of the parameters it holds whole, which every device computing a
share reads whatever the share (`param_seconds`; a shard costs its fraction), and the last term
what a node costs whatever its size (dispatch, launch: `hap profile`).
The backward is costed with its own FLOPs from torch's flop counter (2x for matmuls) and twice
the memory traffic. A machine of several GPUs also all-reduces its local parameter gradients
over its internal links: 2(k-1)/k * bytes / intra_bandwidth, added to its backward time.

Collectives (volume V as in cluster.py, time = alpha + V / beta; s_j the share of device j):
    all_reduce            V = n
    all_gather_padded     V = m * max_j(s_j) * n        (shards padded to the largest)
    all_gather_grouped    sum over devices with s_j > 0 of  alpha_bc + s_j * n / beta_bc
    reduce_scatter        V = m * max_j(s_j) * n        (padded like NCCL's)
    all_to_all            V = m * max_j(max(s_j before, s_j after)) * n
On machines of several GPUs each collective also gathers to and broadcasts from one GPU
inside the machine: + 2 * (local bytes) / intra_bandwidth.
Every collective is thus const + slope * max_j(s_j), linear in the largest share, which is
what the load balancer's LP needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from ..ir import Graph, Node, chunk_of
from ..rules import Strategy
from ..rules.local import is_random, variant_collectives
from ..rules.nn import LOOKUPS, sparse_gradient_rows, starts_early
from ..rules.units import ShardClasses
from .cluster import Cluster

Optimizer = Literal["adam", "sgd", "momentum"]
OPTIMIZER_STATES = {"adam": 2, "momentum": 1, "sgd": 0}  # fp32 state tensors per parameter
RNG_STATE_BYTES = 5056  # torch.get_rng_state() on CPU: what hap.HAP broadcasts per step for random ops


@dataclass(frozen=True, slots=True)
class CommCost:
    const: float
    """Seconds that do not depend on the ratios."""
    slope: float
    """Seconds per unit of the largest share."""

    def at(self, max_share: float) -> float:
        return self.const + self.slope * max_share


class CostModel:
    def __init__(self, graph: Graph, cluster: Cluster, classes: ShardClasses, optimizer: Optimizer = "adam"):
        self.graph, self.cluster, self.classes = graph, cluster, classes
        self.m = cluster.size
        devs = cluster.devices
        self._comm: dict[tuple[str, float], CommCost] = {}  # the collectives' prices, asked for often
        self._base: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = {}  # base_times per node
        self._forward_floor: list[float] | None = None  # per node: the least forward time before it (early_count_seconds)
        self._param_seconds: dict[tuple, tuple[tuple[float, ...], tuple[float, ...]]] = {}  # per (node, parameter(s))
        self.inv_speed = tuple(1.0 / (d.flops * d.gpus) for d in devs)
        self.inv_mem_bw = tuple(1.0 / (d.mem_bandwidth * d.gpus) if d.mem_bandwidth > 0 else 0.0 for d in devs)
        self.overhead = tuple(d.op_overhead for d in devs)
        # A device with nothing of a node to compute only does the executor's bookkeeping, which
        # no device is slower at: an emulated slow device does not stretch it, a slow GPU has
        # the same host. What the fastest device pays per node stands for it.
        self.idle = min(self.overhead)
        self.timing = graph.timing  # measured node times, if any, and their scale to each device
        self.timing_scale: tuple[tuple[float, float, float, float], ...] = ()
        if graph.timing is not None and graph.timing.device_scale is not None:
            if len(graph.timing.device_scale) != self.m:
                raise ValueError(f"the graph's node times were calibrated on {len(graph.timing.device_scale)} devices, "
                                 f"the cluster has {self.m}")
            self.timing_scale = graph.timing.device_scale
            self.overhead = (0.0,) * self.m  # the calibration measured the executor's cost per node too
        elif graph.timing is not None:
            self.timing_scale = tuple((k, k, k, k) for k in (graph.timing.device_flops * s for s in self.inv_speed))
        self.intra_grad = tuple(2 * (d.gpus - 1) / d.gpus / d.intra_bandwidth if d.gpus > 1 else 0.0 for d in devs)
        machines = [d for d in devs if d.gpus > 1]
        self.intra_coll = 2 / min(d.intra_bandwidth for d in machines) if machines else 0.0
        self.state_factor = 2 + OPTIMIZER_STATES[optimizer]  # weights + gradients + optimizer states
        # hap.HAP gives every rank the global batch's loss: one scalar all-reduce per step; and
        # a model with random ops has rank 0's generator state broadcast first (rules/local.py)
        self.loss_sync = self.comm("all_reduce", 4.0).const if self.m > 1 else 0.0
        self.rng_sync = 0.0
        if self.m > 1 and any(is_random(node) for node in graph.nodes):
            self.rng_sync = self.grouped_gather(RNG_STATE_BYTES, 1)
        self.chunk_of = chunk_of(graph)  # the layer chunk of every node: a stage ends at each chunk's start
        # gradient sync: a bucket of b bytes all-reduces in sync_alpha + sync_slope * b seconds
        self.sync_slope = self.grad_sync(2.0) - self.grad_sync(1.0)
        self.sync_alpha = self.grad_sync(1.0) - self.sync_slope
        self.sparse_rows = sparse_gradient_rows(graph)  # parameters with sparse gradients: rows per step
        self.sparse_ids = {name: sum(graph.tensors[graph.nodes[k].inputs[1]].numel for k in graph.tensors[name].consumers)
                           for name in self.sparse_rows}  # ids looked up in each per step, all devices together
        self.first_use_bytes = [0.0] * len(graph.nodes)  # bytes of trainable parameters each node uses first
        for name, t in graph.tensors.items():
            if t.kind == "param" and t.requires_grad and t.consumers:
                self.first_use_bytes[t.consumers[0]] += self.sync_bytes(name)
        self.bucket_of = sync_groups(graph, self)  # the gradient bucket of every node's first-used parameters
        self._shares: dict[tuple, tuple[float, ...]] = {}  # (granules, ratios) -> shares: the search asks often
        self._granules: dict[str, tuple[int, ...]] = {}
        self._granule_counts: list[int] = []
        self._reduced_at: dict[int, frozenset[str]] = {}
        self._signatures: dict[tuple, tuple] = {}
        self._fixed: dict[tuple, tuple[tuple[float, ...], tuple[float, ...]]] = {}  # fixed_times per (node, shares)
        self._draws: dict[int, bool] = {}  # is_random per node
        self.node_class = self._node_classes()  # nodes alike in op, work and tensors cost alike under any ratios

    def reduced_at(self, k: int) -> frozenset[str]:
        """The trainable parameters node k uses first: a machine's GPUs all-reduce their gradients
        there (first_used_by), each once."""
        found = self._reduced_at.get(k)
        if found is None:
            graph = self.graph
            found = self._reduced_at[k] = frozenset(x for x in graph.nodes[k].inputs
                                                    if graph.tensors[x].requires_grad and self.first_used_by(x, k))
        return found

    def first_used_by(self, name: str, k: int) -> bool:
        """Whether node k is the first to use parameter `name` (where a machine's GPUs all-reduce
        its gradient: a tied parameter's uses add up first, then it is reduced once)."""
        t = self.graph.tensors[name]
        return t.kind == "param" and t.consumers[0] == k

    def state_bytes(self, name: str) -> float:
        """Bytes a device keeps for parameter `name` whole: its weights and, if it trains, its
        gradient and optimizer states (a frozen parameter has neither)."""
        t = self.graph.tensors[name]
        return t.nbytes * (self.state_factor if t.requires_grad else 1)

    def _node_classes(self) -> list[int]:
        """A class id per node: nodes alike in op, work (measured times included) and the
        bytes, gradients and split granules of their tensors, as every layer's are. Pricing
        walks and searches price one node per class."""
        graph, timing, ids, out = self.graph, self.graph.timing, {}, []
        for k, node in enumerate(graph.nodes):
            key = (node.op, node.flops, node.bwd_flops, node.bytes_moved,
                   tuple((graph.tensors[x].kind, graph.tensors[x].requires_grad, graph.tensors[x].nbytes,
                          self.granules(x), self.first_used_by(x, k), x in node.inputs[:i])
                         for i, x in enumerate(node.inputs)),
                   tuple(self.granules(x) for x in node.outputs),
                   None if timing is None else (timing.fwd[k], timing.bwd[k], timing.fwd_fixed[k], timing.bwd_fixed[k]))
            out.append(ids.setdefault(key, len(ids)))
        return out

    # -- shares --------------------------------------------------------------------------------

    def granules(self, tensor: str) -> tuple[int, ...]:
        """Split granules of every dim of a tensor (what its shares depend on)."""
        found = self._granules.get(tensor)
        if found is None:
            ndim = len(self.graph.tensors[tensor].shape)
            found = self._granules[tensor] = tuple(self.classes.granule_count(tensor, d) for d in range(ndim))
        return found

    def share_signature(self, ratios: Sequence[Sequence[float]]) -> tuple:
        """All that prices see of per-segment `ratios`: each segment's shares of every granule
        count the graph's dims have. Ratios with equal signatures price every program alike
        (only rounding told them apart), so a search under one is a search under the other."""
        key = tuple(map(tuple, ratios))
        found = self._signatures.get(key)
        if found is None:
            if not self._signatures:
                self._granule_counts = sorted({n for name in self.graph.tensors for n in self.granules(name)})
            found = self._signatures[key] = tuple(self.classes.granules_per_device(n, r) for r in key for n in self._granule_counts)
        return found

    def changed_shares(self, old: Sequence[Sequence[float]], new: Sequence[Sequence[float]]) -> set[tuple[int, int]]:
        """The (granule count, segment)s whose integer split differs between two per-segment ratios."""
        a, b = self.share_signature(old), self.share_signature(new)
        counts = self._granule_counts
        return {(counts[i % len(counts)], i // len(counts)) for i, (x, y) in enumerate(zip(a, b)) if x != y}

    def shares(self, tensor: str, dim: int, ratios: Sequence[float]) -> tuple[float, ...]:
        key = (self.granules(tensor)[dim], tuple(ratios))
        found = self._shares.get(key)
        if found is None:
            found = self._shares[key] = self.classes.shares(tensor, dim, ratios)
        return found

    def work_shard(self, node: Node, st: Strategy) -> tuple[str, int] | None:
        """The (tensor, dim) whose split decides how the node's work divides, or None."""
        for name, p in zip(node.inputs, st.inputs):
            if p.kind == "S":
                return name, p.dim
        for name, p in zip(node.outputs, st.outputs):
            if p.kind == "S":
                return name, p.dim
        return None

    # -- computation ---------------------------------------------------------------------------

    def base_times(self, node: Node) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Forward and backward seconds per device for the whole node (share 1): from the
        graph's measured node times where it has them, else from FLOPs and bytes."""
        found = self._base.get(node.index)
        if found is None:
            found = self._base[node.index] = self._base_times(node)
        return found

    def _base_times(self, node: Node) -> tuple[tuple[float, ...], tuple[float, ...]]:
        needs_bwd = any(self.graph.tensors[t].requires_grad for t in node.inputs)
        if self.timing is not None:
            fwd = tuple(self.timing.fwd[node.index] * k[0] for k in self.timing_scale)
            bwd = tuple(self.timing.bwd[node.index] * k[2] for k in self.timing_scale)
            return fwd, (bwd if needs_bwd else (0.0,) * self.m)
        moved = node.bytes_moved - sum(self.graph.tensors[t].nbytes for t in self.params_of(node))  # activations
        fwd = tuple(node.flops * s + moved * b for s, b in zip(self.inv_speed, self.inv_mem_bw))
        if not needs_bwd:
            return fwd, (0.0,) * self.m
        bwd = tuple(node.bwd_flops * s + 2 * moved * b for s, b in zip(self.inv_speed, self.inv_mem_bw))
        return fwd, bwd

    def params_of(self, node: Node) -> list[str]:
        """The node's parameter inputs, each once."""
        return list(dict.fromkeys(t for t in node.inputs if self.graph.tensors[t].kind == "param"))

    def param_seconds(self, node: Node, name: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Forward and backward seconds per device that parameter `name`, held whole, costs
        node `node` whatever the node's share of the batch (a shard of it costs its fraction): a
        matmul reads the whole weight in the forward, and in the backward reads it again and
        writes its whole gradient; an embedding (or a bag of them) reads only the rows it looks
        up (its output, priced with the work) but writes a dense gradient as large as the table,
        and none when its gradient is sparse. Zero where node times are measured: they include it."""
        found = self._param_seconds.get((node.index, name))
        if found is not None:
            return found
        t = self.graph.tensors[name]
        lookup = node.op in LOOKUPS
        passes_fwd = 0 if lookup or self.timing is not None else 1
        needs_bwd = any(self.graph.tensors[x].requires_grad for x in node.inputs) and self.timing is None
        writes_grad = t.requires_grad and name not in self.sparse_rows
        passes_bwd = (int(writes_grad) + (0 if lookup else 1)) if needs_bwd else 0
        found = self._param_seconds[(node.index, name)] = (tuple(passes_fwd * t.nbytes * b for b in self.inv_mem_bw),
                                                          tuple(passes_bwd * t.nbytes * b for b in self.inv_mem_bw))
        return found

    def whole_params_seconds(self, node: Node, names: tuple[str, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """param_seconds summed over parameters `names` (held whole) of `node` (none: zeros)."""
        found = self._param_seconds.get((node.index, names))
        if found is None:
            each = [self.param_seconds(node, name) for name in dict.fromkeys(names)]
            found = self._param_seconds[(node.index, names)] = (
                tuple(sum(f[j] for f, _ in each) for j in range(self.m)),
                tuple(sum(b[j] for _, b in each) for j in range(self.m)))
        return found

    def accumulate_seconds(self, nbytes: float) -> tuple[float, ...]:
        """Seconds per device to add a gradient of nbytes into one already held (reads two,
        writes one): a pipeline's micro-batches after the first pay it per parameter."""
        return tuple(3 * nbytes * b for b in self.inv_mem_bw)

    def fixed_times(self, node: Node, shares: Sequence[float] | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Forward and backward seconds per device that do not shrink with the node's share
        (one dispatch per pass, on every device, even for an empty shard; and the measured
        fixed part of the node's time where the graph has timings). With `shares` (the node's
        work share per device), a device whose share is 0 pays only `idle` per pass."""
        key = (node.index, None if shares is None else tuple(map(bool, shares)))
        found = self._fixed.get(key)
        if found is None:
            found = self._fixed[key] = self._fixed_times(node, shares)
        return found

    def _fixed_times(self, node: Node, shares: Sequence[float] | None) -> tuple[tuple[float, ...], tuple[float, ...]]:
        needs_bwd = any(self.graph.tensors[t].requires_grad for t in node.inputs)
        fwd = bwd = self.overhead
        if self.timing is not None:
            fwd = tuple(o + self.timing.fwd_fixed[node.index] * k[1] for o, k in zip(fwd, self.timing_scale))
            bwd = tuple(o + self.timing.bwd_fixed[node.index] * k[3] for o, k in zip(bwd, self.timing_scale))
        bwd = bwd if needs_bwd else (0.0,) * self.m
        if shares is not None and not all(shares):  # a device with no share of the node only keeps books
            fwd = tuple(c if s else self.idle for c, s in zip(fwd, shares))
            bwd = tuple(c if s else self.idle * (c > 0) for c, s in zip(bwd, shares))  # no backward: none
        return fwd, bwd

    def idle_draw(self, node: Node, shares: Sequence[float]) -> tuple[float, ...]:
        """Forward seconds per device of a random node's numbers drawn by a device with no share
        of it: every device draws the whole tensor's (rules/local.py), at its whole forward's price."""
        draws = self._draws.get(node.index)
        if draws is None:
            draws = self._draws[node.index] = is_random(node)
        if not draws or all(shares):
            return (0.0,) * self.m
        return tuple(0.0 if s else f for f, s in zip(self.base_times(node)[0], shares))

    @property
    def has_fixed(self) -> bool:
        return any(self.overhead) or self.timing is not None

    def grad_intra(self, nbytes: float) -> tuple[float, ...]:
        """Seconds each machine spends all-reducing nbytes of local gradient among its GPUs."""
        return tuple(c * nbytes for c in self.intra_grad)

    # -- communication -------------------------------------------------------------------------

    def comm(self, kind: str, nbytes: float) -> CommCost:
        """The collective `kind` on a tensor of nbytes, as const + slope * (largest share)."""
        found = self._comm.get((kind, nbytes))
        if found is None:
            if self.m == 1:
                return CommCost(0.0, 0.0)
            price = COLLECTIVE_PRICES.get(kind)
            if price is None:
                raise ValueError(f"unknown collective {kind!r}; priced: {', '.join(COLLECTIVE_PRICES)}")
            found = self._comm[(kind, nbytes)] = price(self, nbytes)
        return found

    def comm_time(self, kind: str, nbytes: float, shares: Sequence[float]) -> float:
        """Exact time under the given (rounded) shares; grouped broadcasts skip empty shards."""
        if kind == "all_gather_grouped":
            return self.grouped_gather(nbytes, sum(1 for s in shares if s > 0))
        return self.comm(kind, nbytes).at(max(shares) if shares else 1.0)

    def grouped_gather(self, nbytes: float, live: int) -> float:
        """An all-gather as one broadcast per device that holds rows (`live` of them): each
        pays the latency, the rows add up to the whole tensor once."""
        if self.m == 1:
            return 0.0
        f = self.cluster.fit("broadcast")
        return live * f.alpha + nbytes / f.beta + self.intra_coll * nbytes

    def variant_comm(self, node: Node, st: Strategy) -> float:
        """Seconds of the collectives that `st`'s local variant makes inside the node, forward
        and backward (on whole tensors: no share dependence)."""
        if st.local is None:
            return 0.0
        seconds = sum(self.comm(kind, nbytes).const for kind, nbytes in variant_collectives(node, st, self.graph))
        if st.local == "loss_mean" and starts_early(node, self.graph):
            seconds += self.early_count_seconds(node)
        return seconds

    def early_count_seconds(self, node: Node) -> float:
        """What the forward leaves to wait of a loss's count of its targets, all-reduced from
        the step's start beside the forward (rules.nn.starts_early): its time less the least
        the forward up to the loss can take, every node split in proportion to the devices'
        speeds (a constant of the node: every program waits alike). Tens of microseconds
        against milliseconds of forward on GPUs: nothing; on a slow emulated link, most of it."""
        if self._forward_floor is None:
            floor, self._forward_floor = 0.0, []
            for nd in self.graph.nodes:
                self._forward_floor.append(floor)
                fwd = self.base_times(nd)[0]
                floor += 0.0 if min(fwd) <= 0 else 1.0 / sum(1.0 / f for f in fwd)
        return max(0.0, self.comm("all_reduce", 8.0).const - self._forward_floor[node.index])

    def sync_bytes(self, param: str) -> float:
        """The bytes a bucket's all-reduce carries for a parameter kept whole: its size; for a
        sparse gradient (rules.nn.sparse_gradient_rows), what all-gathering every rank's rows
        with their int64 indices at even shares costs as an all-reduce (an all-gather of V
        bytes moves what an all-reduce of V / 2 does). The search and the buckets' forming
        price it so: every strategy of a sparse lookup keeps the table whole and syncs it
        alike. `walk` prices it at the program's shares (sparse_sync)."""
        t = self.graph.tensors[param]
        rows = self.sparse_rows.get(param)
        if rows is None:
            return float(t.nbytes)
        return sparse_gradient_bytes(t.nbytes, t.shape[0], rows) / 2

    def sparse_sync(self, param: str, most_looked_up, exact: bool = True) -> tuple:
        """(bytes all-gathered, seconds) of a sparse gradient's sync as runtime/gradsync._Sparse
        runs it: the ranks all-gather their row counts, then their (index, row) pairs, each
        rank's padded to the most any rank holds (sparse_sent_rows). `most_looked_up`: the
        most ids any device looks up in the table per step (a number, or the LP's expression);
        exact=False prices it as the LP must (linearly)."""
        t = self.graph.tensors[param]
        table = t.shape[0]
        pair = sparse_gradient_bytes(t.nbytes, table, 1)
        sent = sparse_sent_rows(table, self.sparse_ids[param], most_looked_up, self.m, exact)
        gathered = sent * (self.m * pair)  # V of the padded all-gather
        if self.m == 1:
            return gathered, 0.0
        counts = self.comm("all_gather_padded", 8.0 * self.m).at(1 / self.m)
        f = self.cluster.fit("all_gather")  # as _all_gather_padded prices V, the machines' GPUs gathering it too
        return gathered, counts + f.alpha + gathered * (1 / f.beta + self.intra_coll)

    def grad_sync(self, nbytes: float) -> float:
        """One bucket's all-reduce of gradients (nbytes of them)."""
        return self.comm("all_reduce", nbytes).const if nbytes > 0 else 0.0

    def group_collective(self, kind: str, nbytes: float, devices) -> float:
        """Seconds of collective `kind` (all_reduce, reduce, broadcast: nbytes the whole message)
        over a device group, priced on the cluster's topology by the group's slowest link; a
        cluster of measured fits only prices every group as all its devices."""
        devices = list(devices)
        if len(devices) <= 1:
            return 0.0
        topo = self.cluster.topology
        if topo is None or self.cluster.measured_fits:
            if kind == "all_reduce":
                return self.grad_sync(nbytes)
            return self.cluster.fit("broadcast" if kind == "reduce" else kind).time(nbytes)
        # a machine of several GPUs gathers to and broadcasts from one of them, as grad_sync adds
        # it: over the slowest internal link of the group's own machines
        inside = max((2 / self.cluster.devices[j].intra_bandwidth for j in devices if self.gpus(j) > 1),
                     default=0.0) * nbytes
        return topo.run_seconds(kind, nbytes, devices) + inside

    @property
    def grad_sync_least_slope(self) -> float:
        """The least seconds per byte a bucket's all-reduce ever adds: grad_sync(a + b) >=
        grad_sync(a) + this * b (all-reduce is the fastest of linear algorithms at each size)."""
        if self.m == 1:
            return 0.0
        return min(1 / f.beta for f in self.cluster.all_reduce_fits()) + self.intra_coll

    @property
    def step_overhead(self) -> float:
        """The collectives every step makes besides the program's and the gradients': the loss's
        all-reduce, and the random generator's broadcast for a model with random ops."""
        return self.loss_sync + self.rng_sync

    # -- memory --------------------------------------------------------------------------------

    def gpus(self, j: int) -> int:
        return self.cluster.devices[j].gpus

    def device_key(self, j: int) -> tuple:
        """Everything device j's computation, fixed costs, machine-internal gradient sync and
        memory are priced by. Collectives see only the largest share and the group, so devices
        with equal keys are interchangeable to every price: swapping their shares changes none."""
        scale = self.timing_scale[j] if self.timing_scale else None
        return (self.inv_speed[j], self.inv_mem_bw[j], self.overhead[j], scale, self.intra_grad[j], self.gpus(j))


# -- the collectives' prices: one small function per collective kind (the names moves use) ---------
# m devices, n bytes of the whole tensor, s the largest share; intra_coll prices machines of
# several GPUs gathering to and broadcasting from one GPU (see the module docstring).

def _all_reduce(cost: CostModel, n: float) -> CommCost:  # V = n
    return CommCost(cost.cluster.fit_at("all_reduce", n).time(n) + cost.intra_coll * n, 0.0)


def _all_gather_padded(cost: CostModel, n: float) -> CommCost:  # V = m * s * n
    f = cost.cluster.fit("all_gather")
    return CommCost(f.alpha + cost.intra_coll * n, cost.m * n / f.beta)


def _all_gather_grouped(cost: CostModel, n: float) -> CommCost:  # every device broadcasts its rows
    f = cost.cluster.fit("broadcast")
    return CommCost(cost.m * f.alpha + n / f.beta + cost.intra_coll * n, 0.0)


def _reduce_scatter(cost: CostModel, n: float) -> CommCost:  # V = m * s * n, padded like NCCL's
    f = cost.cluster.fit("reduce_scatter")
    return CommCost(f.alpha + cost.intra_coll * n, cost.m * n / f.beta)


def _all_to_all(cost: CostModel, n: float) -> CommCost:  # V = m * max(s before, s after) * n
    f = cost.cluster.fit("all_to_all")
    return CommCost(f.alpha, cost.m * n / f.beta + cost.intra_coll * n)


COLLECTIVE_PRICES = {"all_reduce": _all_reduce, "all_gather_padded": _all_gather_padded,
                     "all_gather_grouped": _all_gather_grouped, "reduce_scatter": _reduce_scatter,
                     "all_to_all": _all_to_all}


def sparse_gradient_bytes(nbytes: float, table_rows: int, rows: int) -> float:
    """What a sparse gradient of `rows` rows (of a table of `nbytes` in `table_rows` rows)
    sends: the rows, each with its int64 index."""
    return rows * (nbytes / table_rows + 8)


def sparse_sent_rows(table_rows: int, ids: int, most_looked_up, m: int, exact: bool = True):
    """The rows each rank sends in a sparse gradient's all-gather, padded to the most any rank
    holds (gloo and NCCL gather only equal sizes): a rank holds one row per distinct id it looks
    up, at most the table. So the most ids any rank looks up (`most_looked_up`), at most the
    table's rows; where a step's `ids` are at least m times the table's rows, the busiest rank
    looks up at least that many: the table, at any shares. exact=False (the LP, which takes no
    minimum) drops the cap: a linear bound, above the rows only where the busiest rank looks up
    more ids than the table has rows."""
    if ids >= m * table_rows:
        return table_rows
    return min(most_looked_up, table_rows) if exact else most_looked_up


BUCKET_LATENCY_SHARE = 0.25  # a bucket is large enough that its latency is at most this part of its time


def enough_bucket_bytes(seconds: Callable[[float], float]) -> float:
    """The fewest bytes from which on an all-reduce's latency is at most BUCKET_LATENCY_SHARE
    of its `seconds`. Where the cluster picks the algorithm per size (topology "auto", the
    best of ring, tree and hierarchical), the latency is that of the algorithm it runs at the
    size: the line of `seconds` there. (The chord at 1-2 bytes, the tree's, made buckets 7.5x
    too small for the ring that then ran them, latency 72% of its time.)"""
    def line(b: float) -> tuple[float, float]:  # (latency, seconds per byte) of the algorithm run at b bytes
        t = seconds(b)
        slope = (seconds(b * 1.001) - t) / (b * 0.001)
        return t - slope * b, slope

    def short(b: float) -> bool:
        return line(b)[0] <= BUCKET_LATENCY_SHARE * seconds(b) * (1 + 1e-9)

    if not short(2.0 ** 50):  # latency even at a petabyte: one bucket
        return math.inf
    enough = 2.0 ** 50
    for k in range(49, -1, -1):  # down, while large enough: the fewest bytes of 2^k
        if not short(2.0 ** k):
            break
        enough = 2.0 ** k
    latency, slope = line(enough)
    if latency <= 0 or slope <= 0:  # no latency (one device): any size
        return 0.0
    exact = latency * (1 - BUCKET_LATENCY_SHARE) / BUCKET_LATENCY_SHARE / slope  # on that algorithm's line
    return exact if enough / 2 < exact <= enough and short(exact) else enough


def sync_groups(graph: Graph, cost: CostModel) -> list[int]:
    """The gradient bucket of every node: consecutive layer chunks, from the last (whose
    gradients arrive first), joined until the parameters first used in them are large enough
    that the all-reduce's latency is at most BUCKET_LATENCY_SHARE of its time. Graph and
    cluster decide the buckets, not the program: the search can then price them step by step.
    The runtime syncs, in each bucket, the parameters the program keeps whole."""
    chunks = cost.chunk_of
    n = len(graph.nodes)
    if not n:
        return []
    chunk_bytes = [0.0] * (chunks[-1] + 1)
    for k, nbytes in enumerate(cost.first_use_bytes):
        chunk_bytes[chunks[k]] += nbytes
    enough = enough_bucket_bytes(cost.grad_sync)
    group_of_chunk = [0] * len(chunk_bytes)
    group, size = 0, 0.0
    for c in range(len(chunk_bytes) - 1, -1, -1):
        if size >= enough and chunk_bytes[c]:
            group, size = group + 1, 0.0
        group_of_chunk[c] = group
        size += chunk_bytes[c]
    for c in range(1, len(chunk_bytes)):  # a bucket starts where its parameters do: its readiness waits for no less
        if not chunk_bytes[c]:
            group_of_chunk[c] = group_of_chunk[c - 1]
    last = group_of_chunk[0]
    return [last - group_of_chunk[chunks[k]] for k in range(n)]  # numbered in forward order

