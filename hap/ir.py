"""The planner's graph IR: the single-device training program as captured from a model.

Leaf tensors (user inputs, parameters, buffers, constants) have no producer. Every compute
node reads tensors by name and writes one or more tensors; nodes are in topological order,
the order the single-device program runs them. The graph's output is the scalar loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

TensorKind = Literal["input", "param", "buffer", "constant", "activation"]

VIEW_OPS = frozenset({"aten.view.default", "aten._unsafe_view.default"})
"""The ops that read a tensor at another shape as a view (_unsafe_view: a view of a fresh copy)."""


def dtype_name(dtype) -> str:
    """A torch dtype as the IR names it (Tensor.dtype): 'float32' for torch.float32."""
    return str(dtype).removeprefix("torch.")


def memory_layout(x) -> str:
    """A tensor's memory order as the IR tells layouts apart: "contiguous", "channels_last"
    (4-D, or 5-D "channels_last_3d") or "strided"; `x` a torch tensor, or an IR Tensor (its
    stride None where it was captured contiguous)."""
    import torch

    if not isinstance(x, torch.Tensor):
        if x.stride is None:
            return "contiguous"
        x = torch.empty_strided(x.shape, x.stride, device="meta")
    if x.is_contiguous():
        return "contiguous"
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return "strided"


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Stands in a node's args where a tensor is passed."""

    name: str

    def __repr__(self) -> str:
        return f"%{self.name}"


@dataclass(slots=True, kw_only=True)
class Tensor:
    name: str
    """Unique name (the torch.export node name)."""
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name without the 'torch.' prefix, e.g. 'float32'."""
    itemsize: int
    """Bytes per element."""
    kind: TensorKind
    requires_grad: bool = False
    """True where the loss's gradient flows through this tensor (float and downstream of a parameter)."""
    producer: int = -1
    """Index of the producing node, -1 for leaves."""
    consumers: list[int] = field(default_factory=list)
    """Indices of consuming nodes, ascending, with repeats removed."""
    target: str | None = None
    """For parameters and buffers: the state_dict key (e.g. 'blocks.0.attn.qkv.weight')."""
    stride: tuple[int, ...] | None = None
    """Memory strides where one device's tensor is not contiguous (a transposed view), else None:
    random ops draw in memory order (eager's empty_like keeps strides), so hap draws alike."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_leaf(self) -> bool:
        return self.producer < 0


@dataclass(slots=True, kw_only=True)
class Node:
    index: int
    name: str
    op: str
    """Operator key, e.g. 'aten.linear.default'; rules are registered under it."""
    target: Any
    """The callable (a torch OpOverload) that computes the node on local tensors."""
    args: tuple
    kwargs: dict
    """Arguments as in the captured graph, tensors replaced by TensorRef."""
    inputs: tuple[str, ...]
    """Names of the tensor arguments, in the order they appear in args/kwargs (repeats kept)."""
    outputs: tuple[str, ...]
    """Names of the tensors the node produces (several for split, topk, ...)."""
    flops: float = 0.0
    """Forward FLOPs (torch.utils.flop_counter accounting)."""
    bwd_flops: float = 0.0
    """Backward FLOPs for the gradients this node must produce."""
    bytes_moved: int = 0
    """Bytes read and written by the forward (inputs + outputs), for memory-bound ops."""
    scope: str = ""
    """Module path of the innermost module that called the op ('' at the top)."""

    def __repr__(self) -> str:
        return f"{self.name} = {self.op}({', '.join(self.inputs)})"

    def __getstate__(self) -> dict:
        """Pickled with its op by name (a graph captured once, sent to every rank)."""
        from ._torch import op_reference
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        ref = op_reference(self.target)
        if ref is not None:
            state["target"] = _OpName(ref)
        return state

    def __setstate__(self, state: dict) -> None:
        from ._torch import op_of_reference
        target = state["target"]
        for name, value in state.items():
            setattr(self, name, value)
        if isinstance(target, _OpName):
            self.target = op_of_reference(target.ref)


@dataclass(frozen=True, slots=True)
class _OpName:
    """An op overload in a pickled Node."""
    ref: tuple[str, str, str, str | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeTiming:
    """Each node's measured forward and backward seconds on a device of `device_flops` FLOP/s,
    as t(share) = fixed + share * work. The cost model scales them to device j by
    `device_scale[j]` where the times were calibrated on the cluster, else by
    device_flops / flops_j."""

    fwd: tuple[float, ...]
    """Forward work of the whole node (share 1), beyond the fixed part."""
    bwd: tuple[float, ...]
    fwd_fixed: tuple[float, ...]
    """Forward seconds a node costs at any share (dispatch, small-batch inefficiency)."""
    bwd_fixed: tuple[float, ...]
    device_flops: float
    device_scale: tuple[tuple[float, float, float, float], ...] | None = None
    """Per device of the cluster: factors (forward work, forward fixed, backward work, backward
    fixed) that turn the times above into that device's, measured by running the model in hap's
    runtime on every device at once (cost.calibrate.calibrate_nodes). They include what timing nodes
    one by one misses: the executor's own cost per node, an emulated device's stretch, and the
    devices slowing each other down. None: not calibrated."""


@dataclass(slots=True, kw_only=True)
class Graph:
    nodes: list[Node]
    tensors: dict[str, Tensor]
    inputs: list[str]
    """User inputs in the order the model's forward takes them."""
    params: list[str]
    loss: str
    model_name: str = "model"
    timing: NodeTiming | None = None
    """Measured seconds per node (hap.cost.calibrate.measure_nodes); when set, the cost model
    prices computation from them instead of from FLOPs and bytes."""
    buffer_updates: dict[str, str] = field(default_factory=dict)
    """Buffers the forward mutates (BatchNorm's running statistics, counters): buffer tensor ->
    the tensor holding its new value. The runtime writes it back after every forward."""
    constants: dict[str, Any] = field(default_factory=dict)
    """Values of the constant leaves (tensors the model creates in forward, lifted by export)."""
    non_persistent: frozenset[str] = frozenset()
    """Targets of the buffers registered with persistent=False: out of state dicts and
    checkpoints, as torch leaves them (a load keeps the value the model was built with)."""
    experts: list[str] = field(default_factory=list)
    """Parameters stacked per expert on dim 0 ([E, ...]): those of modules that name them in a
    `hap_expert_params` attribute (hap.models.moe.MoEFFN does). The planner's expert-parallel
    baseline shards exactly these on dim 0."""
    captured_from: tuple = ()
    """The captured model's parameters and buffers under every name, with the modes its modules
    were captured in (capture.state_signature): what a graph given to hap.HAP or hap.Pipeline
    instead of capturing again is checked against."""
    returns: Any = None
    """The structure forward returns its loss in ((loss,), {"loss": loss}: a pytree TreeSpec of
    one leaf), which hap.HAP's forward returns it in too; None: the loss tensor itself."""

    def tensor(self, name: str) -> Tensor:
        return self.tensors[name]

    @property
    def param_bytes(self) -> int:
        return sum(self.tensors[p].nbytes for p in self.params)

    @property
    def total_flops(self) -> float:
        return sum(n.flops + n.bwd_flops for n in self.nodes)

    def summary(self) -> str:
        ops: dict[str, int] = {}
        for n in self.nodes:
            ops[n.op] = ops.get(n.op, 0) + 1
        return (
            f"{self.model_name}: {len(self.nodes)} nodes, {len(self.params)} parameters "
            f"({self.param_bytes / 2**20:.1f} MiB), {self.total_flops / 1e9:.1f} GFLOP per iteration, "
            f"{len(ops)} distinct ops"
        )


def node_signature(n: Node, graph: Graph) -> tuple:
    """What a node's strategies and cost depend on: its op, its arguments (tensors by shape,
    dtype and whether they carry a gradient), which outputs carry one, and which inputs are
    one tensor given twice (w @ w takes one placement for both: rules._canonical). Nodes with
    equal signatures (the layers of a deep model) share that work."""
    def sig(a):
        if isinstance(a, TensorRef):
            t = graph.tensors[a.name]
            return ("T", t.shape, t.dtype, t.requires_grad)
        if isinstance(a, (list, tuple)):
            return tuple(sig(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, sig(v)) for k, v in a.items()))
        return repr(a)

    outs = tuple(graph.tensors[o].requires_grad for o in n.outputs)
    repeats = tuple(n.inputs.index(name) for name in n.inputs)  # each input's first position
    return (n.op, sig(n.args), sig(n.kwargs), outs, repeats)


def chunk_cuts(graph: Graph, max_live: int = 1, max_chunk: int = 16) -> list[int]:
    """Where to cut the graph for the layer-wise search: before every node where at most
    `max_live` activations other than scalars are live (layer boundaries: a scalar such as an
    auxiliary loss may ride along to the end), and inside longer stretches, at the points with
    the fewest live activations, so that no chunk exceeds `max_chunk` nodes."""
    live = live_counts(graph, scalars=False)
    n = len(graph.nodes)
    base = [0] + [k for k in range(1, n) if live[k] <= max_live] + [n]
    cuts = []
    for lo, hi in zip(base, base[1:]):
        while hi - lo > max_chunk:
            # the least-live point in the second half of the next max_chunk nodes
            lo = min(range(lo + max_chunk // 2, lo + max_chunk + 1), key=lambda k: (live[k], -k))
            cuts.append(lo)
        cuts.append(hi)
    return [c for c in cuts if 0 < c < n]


def live_counts(graph: Graph, scalars: bool = True) -> list[int]:
    """Activations live before each node index (produced earlier, used there or later)."""
    delta = [0] * (len(graph.nodes) + 2)
    for t in graph.tensors.values():
        if t.producer >= 0 and t.consumers and max(t.consumers) > t.producer and (scalars or len(t.shape) > 0):
            delta[t.producer + 1] += 1
            delta[max(t.consumers) + 1] -= 1
    out, acc = [], 0
    for k in range(len(graph.nodes) + 1):
        acc += delta[k]
        out.append(acc)
    return out


def chunk_of(graph: Graph) -> list[int]:
    """The layer chunk (between consecutive `chunk_cuts`) of every node: gradient buckets are
    formed per chunk, so the buckets and the layer-cut search share one notion of a layer."""
    out, c, cuts = [], 0, set(chunk_cuts(graph))
    for k in range(len(graph.nodes)):
        c += k in cuts
        out.append(c)
    return out


def size_text(nbytes: float) -> str:
    """Bytes in the unit that fits: 812 KiB, 3.4 MiB, 15.2 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"
