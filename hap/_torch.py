"""Private torch API, in this one place: each use is a small function here, with why no public
API does it, so that a torch upgrade that moves one breaks one file. (Checked with torch 2.13.)
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_unflatten  # noqa: F401 (the model's return structure: no public pytree module)

FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
SYMBOLIC_SHAPES_LOGGER = "torch.fx.experimental.symbolic_shapes"
"""The logger torch's fake tensors write a failing op's whole traceback to, before export raises."""


# -- profiler ------------------------------------------------------------------------------------

def cpu_profiler() -> torch.profiler.profile:
    """A CPU torch.profiler whose start and stop print nothing. kineto writes "USDT: ...
    profiler_start" and "profiler_stop" lines to stderr at each, at every log level but the one
    above all (KINETO_LOG_LEVEL=6, read when a profiler first starts); torch has no public
    switch. A level the user set is kept."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


# -- autograd ------------------------------------------------------------------------------------

def at_backward_end(fn: Callable[[], None]) -> None:
    """Run `fn` once the current backward's graph task is done. No public hook runs when a
    backward ends; DDP and FSDP queue their end-of-backward work with the autograd engine's
    queue_callback too."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def safe_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax, but 0 (not NaN) along a row whose entries are all -inf: what torch's math
    attention path applies to the scores (a query whose keys are all masked, left padding
    under a causal mask, attends to nothing). torch exposes it only as aten._safe_softmax."""
    return torch.ops.aten._safe_softmax.default(x, dim)


def versions(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """Each tensor's version counter, which every in-place write bumps (load_state_dict's copy_,
    torch.nn.init's fills; not a write through `.data`). No public accessor: autograd's check of
    tensors saved for backward reads it."""
    return tuple(t._version for t in tensors)


def is_view(t: torch.Tensor) -> bool:
    """Whether `t` is a view of another tensor (a view cannot be detached in place)."""
    return t._is_view()


def route_clip_grad_norm(spread_norm: Callable[[list, float, bool], torch.Tensor | None]) -> None:
    """Have torch.nn.utils.clip_grad_norm_ take its total norm from `spread_norm(grads,
    norm_type, error_if_nonfinite)` where that returns one (gradients spread over ranks), else
    from torch. clip_grad_norm_ looks up the module-private _get_total_norm at every call, so
    this reaches it however it was imported, before hap too; the public alias
    torch.nn.utils.get_total_norm stays torch's. No public hook exists: FSDP2 gets a global
    norm from DTensor gradients, which hap's plain shards are not. Idempotent."""
    from torch.nn.utils import clip_grad
    own = clip_grad._get_total_norm
    if getattr(own, "hap_routed", False):
        return

    def total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        found = spread_norm(listed, float(norm_type), error_if_nonfinite)
        return own(listed, norm_type, error_if_nonfinite, foreach) if found is None else found

    total_norm.hap_routed = True
    clip_grad._get_total_norm = total_norm


def route_grad_scaler(agree: Callable[[torch.optim.Optimizer, list], None]) -> None:
    """Have torch.amp.GradScaler, once it has checked `optimizer`'s gradients for infs, call
    `agree(optimizer, found_infs)`, which may sum its per-device inf flags (float tensors) over
    other ranks in place: then every rank skips a step that one rank's gradients overflow.
    The check is unscale_'s (a plain GradScaler; torch's ShardedGradScaler overrides it and
    agrees over its own group) or, for a fused optimizer, which unscales itself,
    _check_inf_per_device's (both scalers: torch's ShardedGradScaler agrees in unscale_ alone).
    Both read per-optimizer state that has no public accessor. Idempotent."""
    cls = torch.amp.GradScaler
    own_unscale, own_check = cls.unscale_, cls._check_inf_per_device
    if getattr(own_unscale, "hap_routed", False):
        return

    def unscale_(self, optimizer):
        own_unscale(self, optimizer)
        if self._enabled:  # (a rank whose optimizer holds no gradient has no flag, and agrees too)
            agree(optimizer, list(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()))

    def _check_inf_per_device(self, optimizer):
        found = own_check(self, optimizer)
        agree(optimizer, list(found.values()))
        return found

    unscale_.hap_routed = True
    unscale_.__doc__ = own_unscale.__doc__
    cls.unscale_, cls._check_inf_per_device = unscale_, _check_inf_per_device


# -- ops and modules -----------------------------------------------------------------------------

def schema_arg(target, args: Sequence[Any], kwargs: dict, name: str) -> Any:
    """An ATen op's argument by its schema name: positional, keyword, or the schema's default
    (None where the op has no such argument). OpOverload has no public schema accessor."""
    for i, a in enumerate(target._schema.arguments):
        if a.name == name:
            if i < len(args) and not a.kwarg_only:
                return args[i]
            return kwargs.get(name, a.default_value if a.has_default_value() else None)
    return None


def schema_names(target) -> list[str]:
    """An ATen op's argument names, in schema order."""
    return [a.name for a in target._schema.arguments]


def op_reference(target) -> tuple[str, str, str, str | None] | None:
    """An op overload's (namespace, name, overload, the Python module that defines it where it
    is a torch.library custom op), by which it is found again in another process (a captured
    graph sent to the ranks: OpOverload does not pickle, and has no public name of its op
    without the namespace); None for any other callable."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    qualified = target._schema.name
    from torch._library.custom_ops import OPDEFS  # (a custom op's definition: no public registry)
    defined = OPDEFS.get(qualified)
    module = getattr(getattr(defined, "_init_fn", None), "__module__", None)
    return target.namespace, qualified.split("::", 1)[1], target._overloadname, module


def op_of_reference(ref: tuple[str, str, str, str | None]):
    """The op overload `op_reference` named; a custom op's module is imported first where its
    op is not registered yet in this process (a rank that has not imported the model's library)."""
    namespace, name, overload, module = ref
    if module is not None and not hasattr(getattr(torch.ops, namespace), name):
        import importlib
        importlib.import_module(module)
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except AttributeError:
        raise ValueError(f"the graph's op {namespace}::{name}.{overload} is not registered in this process "
                         "(load the library defining it before the graph)") from None


def is_higher_order_op(target) -> bool:
    """Whether an FX node's target is a higher-order op (cond, while_loop, wrap_with_...)."""
    return isinstance(target, torch._ops.HigherOrderOperator)


def backward_hooks(model: torch.nn.Module) -> tuple[bool, list[tuple[str, torch.nn.Module]]]:
    """Whether a global module backward hook is registered, and the submodules (path, module)
    with backward hooks of their own. nn.Module keeps both in private fields only."""
    from torch.nn.modules import module as torch_module

    registered = bool(torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks)
    return registered, [(path, sub) for path, sub in model.named_modules()
                        if sub._backward_hooks or sub._backward_pre_hooks]


# -- distributed checkpoints ---------------------------------------------------------------------
# DCP reshards a tensor only when it knows the tensor's global layout. A DTensor's Shard placement
# assumes torch.chunk's even sizes, which hap's shards (sizes like [7, 3] or [10, 0]) are not; a
# ShardedTensor built from explicit ShardMetadata (each rank's row offset and size) is the layout
# DCP takes for uneven shards, on any backend, with ranks holding no rows simply holding no shard.
# torch marks ShardedTensor deprecated in favour of DTensor (FutureWarning on every call), so the
# warning is silenced around the calls that touch it; the checkpoint files are DCP's and do not
# record which class wrote them.

from torch.distributed._shard.metadata import ShardMetadata  # noqa: E402
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata  # noqa: E402
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties  # noqa: E402


class RankRows(ShardedTensor):
    """hap's ShardedTensor: one that pickles is refused. torch.save of a rank's state dict (DDP's
    habit, `torch.save(model.state_dict())` on rank 0) wrote that rank's rows alone, in a file
    that loads nowhere outside a process group, and the other ranks' rows were lost."""

    key = "a sharded tensor"
    """What it is, for messages: set to the state-dict key it is made for."""

    def __reduce_ex__(self, protocol):
        whole = tuple(self.size())
        held = [(s.metadata.shard_offsets, s.metadata.shard_sizes) for s in self.local_shards()]
        dim = next((d for d, n in enumerate(held[0][1]) if n != whole[d]), 0) if held else 0
        mine = f"rows {held[0][0][dim]}:{held[0][0][dim] + held[0][1][dim]} of dim {dim}" if held else "none"
        raise ValueError(f"cannot pickle this rank's part of {self.key} of shape {whole} (it holds {mine}): "
                         "dmodel.state_dict() is each rank's part, for torch.distributed.checkpoint; save "
                         "dmodel.full_state_dict() (every rank calls it) or use hap.runtime.checkpoint.save")

    def __deepcopy__(self, memo):
        copied = super().__deepcopy__(memo)  # (a plain ShardedTensor)
        copied.__class__, copied.key = type(self), self.key
        return copied

    def __copy__(self):  # (copy.copy went through __reduce_ex__: refused as pickling)
        return _rank_rows(self.local_shards(), self.metadata(), self._process_group, self.key)


def _rank_rows(shards: list, meta: ShardedTensorMetadata, group, key: str) -> RankRows:
    """torch's ShardedTensor of these local shards, made a RankRows (torch builds a ShardedTensor
    whatever class it is called on)."""
    with quiet_sharded_tensors():
        made = ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta, process_group=group)
    made.__class__, made.key = RankRows, key
    return made


def sharded_tensor(local: torch.Tensor, shape: tuple[int, ...], dim: int, sizes: Sequence[int], rank: int,
                   placements: Sequence[str], group, key: str) -> ShardedTensor:
    """A ShardedTensor (RankRows) of whole shape `shape` whose rank r holds rows [sum(sizes[:r]),
    +sizes[r]) of dim `dim`, placed at placements[r] ("rank:<global rank>/<device>"); this rank's
    rows are `local` (shared, not copied). `key`: what it is, for messages."""
    def shard(r):
        offsets, part = [0] * len(shape), list(shape)
        offsets[dim], part[dim] = sum(sizes[:r]), sizes[r]
        return ShardMetadata(offsets, part, placements[r])

    props = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata([shard(r) for r in range(len(sizes)) if sizes[r]], torch.Size(shape), props)
    mine = [Shard(local, shard(rank))] if sizes[rank] else []
    return _rank_rows(mine, meta, group, key)


@contextlib.contextmanager
def quiet_sharded_tensors():
    """ShardedTensor's deprecation warnings silenced (see above)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


@contextlib.contextmanager
def without_partial_graph():
    """torch.export prints the partial graph of a trace that failed to stderr as it raises
    (torch/export/_trace.py: dozens of lines; the capture error names the line in one): what
    else the block writes to stderr is passed on, after it."""
    written = io.StringIO()
    try:
        with contextlib.redirect_stderr(written):
            yield
    except Exception as e:
        partial = getattr(e, "partial_fx_graph", None)
        text = written.getvalue()
        sys.stderr.write(text.replace(f"{partial}\n", "") if partial is not None else text)  # (once per wrapper level)
        raise
    sys.stderr.write(written.getvalue())


@contextlib.contextmanager
def quiet_fake_tensors():
    """torch's logs of a failing trace silenced: fake tensors' traceback of a failing op, and
    symbolic shapes' graph dump where a branch on a tensor's value stops export (the capture
    error says it in one line)."""
    loggers = [logging.getLogger(name) for name in (FAKE_TENSOR_LOGGER, SYMBOLIC_SHAPES_LOGGER)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# -- distributed ---------------------------------------------------------------------------------

def default_store():
    """The default process group's store (None: none found), where ranks that torchrun started
    keep their ledger (runtime/ledger.py). No public accessor: torch's own collectives' setup
    reads it the same way."""
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:
        return None


_BACKWARD_CONTEXT = "context"
"""The thread-local slot torch's backward keeps a copy of the caller's contextvars in while it
runs (torch/autograd/graph.py, _engine_run_backward)."""


def launch_collective(collective: Callable, *args, **kwargs):
    """collective(*args, **kwargs) with the backward's context out of the thread-local state it
    captures. A gloo collective keeps a copy of that state, and the backend's worker thread drops
    the last reference after the work is done: a Python object in it needs the GIL to be freed.
    When that comes at interpreter exit the worker cannot take the GIL and the process aborts
    ("terminate called without an active exception"; seen in 1 of about 6 torchrun runs of
    tests/torchrun_ranks.py). The collective itself runs no Python."""
    if not torch._C._is_key_in_tls(_BACKWARD_CONTEXT):
        return collective(*args, **kwargs)
    context = torch._C._get_obj_in_tls(_BACKWARD_CONTEXT)
    torch._C._remove_obj_from_tls(_BACKWARD_CONTEXT)
    try:
        return collective(*args, **kwargs)
    finally:
        torch._C._stash_obj_in_tls(_BACKWARD_CONTEXT, context)
