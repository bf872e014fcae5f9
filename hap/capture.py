"""Capture: a plain nn.Module whose forward returns the loss -> the planner's Graph.

We use torch.export: it traces through Python control flow on shapes (which
torch.fx.symbolic_trace cannot) and lifts parameters, buffers and constants to graph inputs
with their state_dict keys. Its training graph is then made functional
(`run_decompositions({})`, no op decomposed): higher-order wrapper regions (autocast, grad
mode) are inlined, in-place ops become out-of-place ones, and every buffer the model mutates
(BatchNorm's running statistics, counters) becomes an output: Graph.buffer_updates. High-level
ops such as linear, conv2d, layer_norm and scaled_dot_product_attention stay whole. Inlining
drops a no-grad region's grad mode, so its tensor inputs are detached first.

A view that merges leading dims into rows only to run linear layers on them and split the rows
back (nn.MultiheadAttention's output projection: (T, B, H, hd) -> (T*B, d) -> linear ->
(T, B, d)) keeps the dims instead ((T, B, d) -> linear -> (T, B, d): the same numbers). Merged
with the sequence outside, the batch's rows are not one block of each device's rows, so every
split of the batch would have had to gather there.

FLOPs come from torch.utils.flop_counter: every node is run once on meta tensors under
FlopCounterMode for the forward, and once more through autograd for the backward of exactly
the inputs that need a gradient. Nodes with equal signatures (identical layers) share that
work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import operator
import os
import random
import re
import sys
import threading
import traceback
import warnings
from typing import Any, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils.flop_counter import FlopCounterMode

from ._torch import backward_hooks, is_higher_order_op, quiet_fake_tensors, without_partial_graph
from .ir import VIEW_OPS, Graph, Node, Tensor, TensorRef, dtype_name, node_signature

# Nodes that produce nothing the program needs.
_SKIPPED_OPS = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default"}
_KIND_OF_INPUT = {
    InputKind.USER_INPUT: "input",
    InputKind.PARAMETER: "param",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
}


class CaptureError(ValueError):
    """The model cannot be captured; the message says why."""


@contextlib.contextmanager
def _without_autocast():
    """Capture the model's own arithmetic: export under an enclosing torch.autocast would bake
    its casts into the graph (a batch shape first met under autocast then computed in bfloat16
    without it). At run time autocast applies to the graph's ops as they dispatch, as it does
    to one device's; autocast inside the model's forward is captured as written."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def capture(model: torch.nn.Module, example_inputs: Sequence[Any], name: str | None = None,
            training: bool = True) -> Graph:
    """Capture `model` (forward returns the scalar training loss) on `example_inputs`, in
    training mode (or with training=False in eval mode: no dropout, BatchNorm's running
    statistics read, not updated); the model's own mode is left as it was. A model in the mode
    asked for is captured with its modules' modes as they are (a BatchNorm kept in eval mode
    in a training model reads its running statistics, as on one device)."""
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"capture needs an nn.Module, got {type(model).__name__}")
    example_inputs = example_tuple(example_inputs)
    for k, x in enumerate(example_inputs):
        if isinstance(x, (dict, list, tuple)):  # export would flatten it; hap's runtime passes tensors positionally
            raise CaptureError(f"input {k} is a {type(x).__name__}: hap runs a forward that takes tensors, one "
                               "argument each; wrap the model so that it does (as hap.models.zoo.LibraryModel does)")
    _refuse_backward_hooks(model)
    modes = [(m, m.training) for m in model.modules()]
    if training != model.training:  # (the modes as they are otherwise: a BatchNorm frozen in eval mode stays so)
        model.train(training)
    lost: list[str] = []
    try:
        with warnings.catch_warnings(), _unsupported_calls(lost), _HostDraws() as draws, quiet_fake_tensors(), \
                _without_autocast(), without_partial_graph():
            warnings.simplefilter("ignore", FutureWarning)
            ep = torch.export.export(model, example_inputs)
            if lost:
                raise CaptureError(lost[0])
            draws.check_alike(ep, lambda: torch.export.export(model, example_inputs))
            ep = _functional(ep)
    except CaptureError:
        raise
    except Exception as e:  # torch raises many types; the user needs the first line
        if lost:  # what failed it, said plainly (a packed sequence)
            raise CaptureError(lost[0]) from e
        raise CaptureError(f"torch.export could not capture {type(model).__name__}: {_first_line(e)}") from e
    finally:
        signature = state_signature(model)  # (in the modes captured)
        for m, mode in modes:  # each module's own mode back, not the model's spread over all
            m.training = mode
    frozen = frozenset(n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)
    graph = graph_from_exported(ep, name or type(model).__name__, _aliases(model, ep), frozen)
    if any(graph.tensors[p].requires_grad for p in graph.params) and not graph.tensors[graph.loss].requires_grad:
        raise CaptureError("the loss does not require grad: no trainable parameter reaches it with a gradient (is "
                           "the forward computed under torch.no_grad()?)")
    # counting FLOPs runs random ops (torch.rand) for real: the generators are left as they were,
    # so that training after capture draws what one device draws
    with torch.random.fork_rng(devices=_cuda_devices(model, example_inputs)):
        _count_flops(graph)
    graph.experts = _expert_params(model, graph)
    graph.captured_from = signature
    returned = ep.call_spec.out_spec
    graph.returns = None if returned is None or returned.is_leaf() else returned  # (one leaf: the loss, checked)
    return graph


def state_signature(model: torch.nn.Module) -> tuple:
    """Every parameter and buffer of `model` under every name: (name, kind, shape, dtype,
    requires_grad, the first name of the same tensor: how parameters are tied), then each
    module's training mode, in model.modules() order."""
    first: dict[int, str] = {}
    state = [(name, kind, tuple(t.shape), dtype_name(t.dtype), t.requires_grad, first.setdefault(id(t), name))
             for kind, named in (("parameter", model.named_parameters(remove_duplicate=False)),
                                 ("buffer", model.named_buffers(remove_duplicate=False)))
             for name, t in named]
    return tuple(state), tuple(m.training for m in model.modules())


def check_captured_from(graph: Graph, model: torch.nn.Module, example_inputs: Sequence[Any]) -> None:
    """A one-line ValueError where `graph` is not what capturing `model` on `example_inputs` in
    training mode (as hap.HAP does) gives: other inputs' shapes or dtypes, other parameters or
    buffers (names, shapes, dtypes, which are trainable, which are tied), other modules' modes."""
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a hap Graph (hap.capture(model, example_inputs)), got {type(graph).__name__}")
    if not graph.captured_from:
        raise ValueError("graph= was not made by hap.capture (it says nothing of the model it was captured from)")
    _refuse_backward_hooks(model)  # (capture refuses them: added since, they were dropped silently)
    inputs = example_tuple(example_inputs)
    if len(inputs) != len(graph.inputs):
        raise ValueError(f"graph= was captured with {len(graph.inputs)} inputs, the example inputs are {len(inputs)}")
    for k, (name, x) in enumerate(zip(graph.inputs, inputs)):
        t = graph.tensors[name]
        got = (tuple(x.shape), dtype_name(x.dtype)) if isinstance(x, torch.Tensor) else (type(x).__name__,)
        if got != (t.shape, t.dtype):
            raise ValueError(f"graph= was captured with input {k} ({name}) of shape {t.shape} and dtype {t.dtype}; the "
                             f"example inputs' is {' and '.join(map(str, got))}: capture the model on these inputs")
    held = next((t for t in (*model.parameters(), *model.buffers())), None)
    made = next((t for t in graph.constants.values() if isinstance(t, torch.Tensor)), None)
    if held is not None and made is not None and made.device != held.device:  # (the graph's constants are used as captured)
        raise ValueError(f"graph= was captured with the model on {made.device}, the model is on {held.device} now: "
                         "capture it where it runs")
    state, modes = state_signature(model)
    want_state, want_modes = graph.captured_from
    if state != want_state:
        have, want = {e[0]: e for e in state}, {e[0]: e for e in want_state}
        name = next((n for n in [*want, *have] if have.get(n) != want.get(n)), None)
        if name is None or name not in have or name not in want:
            where = "the graph's model" if name in want else "this model"
            raise ValueError(f"graph= was captured from another model: only {where} has {name!r}" if name else
                             "graph= was captured from another model: its parameters and buffers are in another order")
        k = next(i for i in range(1, 6) if have[name][i] != want[name][i])
        if k == 5:  # tied to another name in one model only
            tie = lambda first: "a tensor of its own" if first == name else f"the same tensor as {first!r}"  # noqa: E731
            raise ValueError(f"graph= was captured from another model: {name!r} is {tie(have[name][5])} here and "
                             f"{tie(want[name][5])} in the graph's model")
        field = ("kind", "shape", "dtype", "requires_grad")[k - 1]
        raise ValueError(f"graph= was captured from another model: {name!r} has {field} {have[name][k]} "
                         f"here and {want[name][k]} in the graph's model")
    if want_modes and not want_modes[0]:  # (the root's mode is capture's `training`)
        raise ValueError("graph= was captured for evaluation (hap.capture(..., training=False)); hap.HAP and "
                         "hap.Pipeline take a training graph: capture with training=True (the default)")
    if (modes if model.training else tuple(True for _ in modes)) != want_modes:  # (capture's modes for training)
        raise ValueError("graph= was captured with the model's modules in other training modes (model.train() / "
                         ".eval() of some modules since): capture it again")


def adopt(graph: Graph, model: torch.nn.Module, example_inputs: Sequence[Any]) -> Graph:
    """`graph`, given to hap.HAP or hap.Pipeline instead of capturing `model` on
    `example_inputs` again, as capturing it would give it: checked against the model
    (check_captured_from; a one-line error), and holding the model's own values of the tensor
    attributes export lifted as constants (`self.scale = torch.randn(8)`: the captured
    model's values, or a value changed since, had trained silently)."""
    check_captured_from(graph, model, example_inputs)
    constants = dict(graph.constants)
    for name, value in graph.constants.items():
        target = graph.tensors[name].target
        own = _tensor_attribute(model, target) if target else None
        if own is None or not isinstance(value, torch.Tensor):  # (a tensor the forward makes: the graph's)
            continue
        if (tuple(own.shape), own.dtype) != (tuple(value.shape), value.dtype):
            raise ValueError(f"graph= was captured from another model: tensor attribute {target!r} is "
                             f"{tuple(own.shape)} {dtype_name(own.dtype)} here and {tuple(value.shape)} "
                             f"{dtype_name(value.dtype)} in the graph's model")
        constants[name] = own.detach().clone()
    same = all(constants[k] is v for k, v in graph.constants.items())  # (nothing lifted from the model: itself)
    return graph if same else dataclasses.replace(graph, constants=constants)


def _tensor_attribute(model: torch.nn.Module, target: str) -> torch.Tensor | None:
    """The plain tensor attribute (not a parameter or buffer) at `target` ("sub.scale"), or None."""
    path, _, attr = target.rpartition(".")
    try:
        owner = model.get_submodule(path) if path else model
    except AttributeError:
        return None
    value = owner.__dict__.get(attr)
    return value if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) else None


def example_tuple(example_inputs: Sequence[Any]) -> tuple:
    """The example inputs as a tuple, one per forward argument; a CaptureError for a bare tensor
    (tuple() would split its rows into arguments)."""
    if isinstance(example_inputs, torch.Tensor):
        raise CaptureError(f"example inputs must be a tuple of tensors, one per forward argument, not a tensor of shape "
                           f"{tuple(example_inputs.shape)}: for a forward of one argument give (x,)")
    if not isinstance(example_inputs, (tuple, list)):
        raise CaptureError(f"example inputs must be a tuple of tensors, one per forward argument, not "
                           f"{type(example_inputs).__name__}")
    return tuple(example_inputs)


def _refuse_backward_hooks(model: torch.nn.Module) -> None:
    """A module's backward hooks change its gradients; the captured graph does not keep them."""
    registered, hooked = backward_hooks(model)
    if registered:
        raise CaptureError("a global module backward hook is registered (register_module_full_backward_hook): "
                           "hap computes gradients from the captured graph, which does not keep hooks")
    if hooked:
        path, sub = hooked[0]
        raise CaptureError(f"module {path or '(root)'} ({type(sub).__name__}) has a backward hook "
                           "(register_full_backward_hook): hap computes gradients from the captured graph, "
                           "which does not keep hooks; change the gradients after backward instead")


@contextlib.contextmanager
def _unsupported_calls(lost: list[str]):
    """While torch.export traces the forward, record in `lost` what changes the backward that the
    captured graph cannot keep: a custom torch.autograd.Function (export keeps its forward
    alone: a gradient reversal's backward would be the identity; torch's own, a torch.library
    custom op's or a higher-order op's, stay in the graph as that op) and a gradient hook
    registered on a tensor (Tensor.register_hook); and pack_padded_sequence, whose failure
    inside export names neither it nor packing. The three (public attributes) are patched for
    the trace only, and call through."""
    from torch.autograd import function

    apply, register_hook = function.Function.apply.__func__, torch.Tensor.register_hook

    def watched_apply(cls, *args, **kwargs):
        where = _user_frame()
        if cls.__name__ == "CheckpointFunction":
            lost.append(f"torch.utils.checkpoint with use_reentrant=True at {where}: its recomputation is an "
                        "autograd.Function, which torch.export cannot capture; pass use_reentrant=False")
        elif not cls.__module__.startswith("torch."):  # torch's own: a custom op's or a higher-order op's, kept
            lost.append(f"forward applies the custom autograd.Function {cls.__qualname__} at {where}: torch.export "
                        "keeps its forward alone, so its backward would be lost; write it with differentiable ops")
        return apply(cls, *args, **kwargs)

    def watched_hook(tensor, hook):
        lost.append(f"forward registers a gradient hook (Tensor.register_hook) at {_user_frame()}: hap computes "
                    "gradients from the captured graph, which does not keep hooks; change the gradients after backward")
        return register_hook(tensor, hook)

    def watched_pack(*args, **kwargs):
        lost.append(f"pack_padded_sequence at {_user_frame()}: a packed sequence's layout depends on the lengths' "
                    "values, which torch.export cannot trace; pad the batch and mask instead")
        return pack(*args, **kwargs)

    rnn, pack = torch.nn.utils.rnn, torch.nn.utils.rnn.pack_padded_sequence
    function.Function.apply, torch.Tensor.register_hook = classmethod(watched_apply), watched_hook
    rnn.pack_padded_sequence = watched_pack
    try:
        yield
    finally:
        function.Function.apply, torch.Tensor.register_hook = classmethod(apply), register_hook
        rnn.pack_padded_sequence = pack


class _HostDraws:
    """Python's and numpy's global random generators while torch.export traces the forward
    (a context manager). The trace runs the forward once: a draw the graph uses is kept as a
    constant (SpecAugment's masks, drawn with np.random in transformers' wav2vec2) or as the
    branch it chose (a layer drop on random.random()), so every step would reuse it where one
    device draws anew, silently. A draw the graph never uses (MusicGen's layer drop at
    probability 0: random.uniform every layer) or draws alike every step (BigBird's random
    attention blocks, seeded in the forward) is harmless. So where the model's code drew
    (`sites`: their module-level functions are patched for the trace, the call's place
    noted) or a generator's state moved otherwise (a function imported by name, or another
    thread), `check_alike` traces twice more, the uniform draws at the bottom of their range
    and then at its top (so a branch on `draw < p` goes both ways) and the others from moved
    states; a graph that differs is refused. (A generator object of the forward's own,
    np.random.default_rng()'s, is not watched.)"""

    def __init__(self):
        self.generators = [(random, random._inst, ())]  # (module, its global generator, its functions that are no methods of it)
        numpy = sys.modules.get("numpy")  # (a model that draws with numpy imported it)
        if numpy is not None:
            self.generators.append((numpy.random, numpy.random.mtrand._rand, ("seed", "ranf", "sample", "default_rng")))
        self.sites: list[str] = []
        self.extreme: str | None = None  # "low" or "high": where check_alike's traces put uniform draws
        self._reseeded: set[str] = set()  # the generators the forward seeded in this trace (their draws follow)
        self._patched: list[tuple] = []

    def __enter__(self) -> "_HostDraws":
        self.before = self._states()
        thread = threading.get_ident()
        for module, gen, functions in self.generators:
            for name in dir(module):
                fn = getattr(module, name)
                if (getattr(fn, "__self__", None) is gen or name in functions) and "state" not in name:
                    self._patched.append((module, name, fn))
                    setattr(module, name, self._watched(module.__name__, name, fn, thread))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, fn in self._patched:
            setattr(module, name, fn)

    def _watched(self, module: str, name: str, fn, thread: int):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            # (the model's code on the capturing thread: not torch's own use, nor another thread's)
            if threading.get_ident() != thread or _is_library(sys._getframe(1).f_code.co_filename):
                return out
            if name == "seed":  # (the generator's state moved: checked, but no draw to name)
                if (args[0] if args else kwargs.get("seed", kwargs.get("a"))) is not None:
                    self._reseeded.add(module)
                return out
            self.sites.append(f"{module}.{name} at {_user_frame()}")
            if self.extreme and module not in self._reseeded and (module, name) in _UNIFORM:
                lo, hi = _UNIFORM[(module, name)](*args, **kwargs)
                return out * 0 + (lo if self.extreme == "low" else hi - (hi - lo) * 1e-12)  # (a float, or an array of its shape)
            return out

        return call

    def _states(self) -> list:
        return [gen.getstate() if module is random else gen.get_state(legacy=False) for module, gen, _ in self.generators]

    def check_alike(self, ep: ExportedProgram, trace_again) -> None:
        """A CaptureError where the model's code drew (or a generator moved) and another trace,
        its uniform draws at an end of their range and the others from moved states, gives
        another graph."""
        after = self._states()
        if not self.sites and all(_frozen(a) == _frozen(b) for a, b in zip(after, self.before)):
            return
        first = self.sites[0] if self.sites else None
        try:
            for extreme in ("low", "high"):
                for _, gen, _ in self.generators:
                    for _ in range(7):
                        gen.random()
                self.extreme, self._reseeded = extreme, set()
                try:
                    other = trace_again()
                except Exception:  # (the first trace ran: the draws' values, computed with, failed this one)
                    other = None
                if other is None or not _same_graph(ep, other):
                    where = (f"with {first}" if first else
                             "outside torch (a generator moved by no call hap saw: a function imported by name)")
                    raise CaptureError(f"forward draws random numbers {where}, and the graph depends on them: "
                                       f"{_HOST_DRAW}")
        finally:
            self.extreme = None
            for (module, gen, _), state in zip(self.generators, after):
                if module is random:
                    gen.setstate(state)
                else:
                    gen.set_state(state)


_UNIFORM = {  # (module, function) -> the range its draw is uniform over, from its arguments
    ("random", "random"): lambda: (0.0, 1.0),
    ("random", "uniform"): lambda a, b: (a, b),
    **{("numpy.random", name): lambda *args, **kwargs: (0.0, 1.0)
       for name in ("rand", "random", "random_sample", "ranf", "sample")},
    ("numpy.random", "uniform"): lambda low=0.0, high=1.0, size=None: (low, high),
}


_HOST_DRAW = ("torch.export keeps the one draw made as it traces, so every step would reuse it where one device "
              "draws anew; draw with torch (torch.rand, torch.bernoulli: hap draws those as one device does), or "
              "turn that randomness off")


def _frozen(state) -> object:
    """A generator's state comparable with == (numpy's holds arrays: their bytes)."""
    if isinstance(state, dict):
        return tuple((k, _frozen(v)) for k, v in sorted(state.items()))
    return state.tobytes() if hasattr(state, "tobytes") else state


def _same_graph(a: ExportedProgram, b: ExportedProgram) -> bool:
    """Two traces of one model captured alike: the same code and constants."""
    if a.graph_module.code != b.graph_module.code or a.constants.keys() != b.constants.keys():
        return False
    return all(torch.equal(x, b.constants[k]) if isinstance(x, torch.Tensor) else x is b.constants[k]
               for k, x in a.constants.items())


def _user_frame() -> str:
    """file:line of the innermost caller outside torch and hap (the model's code)."""
    frame = sys._getframe(1)
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame = frame.f_back
    return "an unknown place" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep, "<")
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _is_library(path: str) -> bool:
    """Whether a frame's file is torch's, hap's, generated code's or the standard library's:
    not the model's code."""
    return path.startswith(_LIBRARY_DIRS) or (path.startswith(_STDLIB) and "-packages" + os.sep not in path)


def _cuda_devices(model: torch.nn.Module, example_inputs: tuple) -> list[int]:
    tensors = [*model.parameters(), *model.buffers(), *(x for x in example_inputs if isinstance(x, torch.Tensor))]
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def _aliases(model: torch.nn.Module, ep: ExportedProgram) -> dict[str, str]:
    """Placeholders that export gave a tensor already lifted under another name (a tied
    embedding: one parameter, two state_dict keys) -> the first one's name."""
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    first: dict[int, str] = {}
    out = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.target in state:
            key = id(state[spec.target])
            if key in first:
                out[spec.arg.name] = first[key]
            else:
                first[key] = spec.arg.name
    return out


def _copy_as_clone(graph: torch.fx.Graph, fx: torch.fx.Node) -> None:
    """aten.copy(dst, src), which a slice assignment (h[:, :2] = ...) leaves in the functional
    graph, has no autograd formula; its value is src broadcast to dst's shape in dst's dtype,
    which expand, _to_copy and clone compute, with gradients."""
    dst, src = fx.args[0].meta["val"], fx.args[1].meta["val"]
    want = fx.meta["val"]
    y = fx.args[1]
    with graph.inserting_before(fx), want.fake_mode:
        if tuple(src.shape) != tuple(want.shape):
            y = _call(graph, torch.ops.aten.expand.default, (y, list(want.shape)), {}, src.expand(want.shape), fx)
        if src.dtype != want.dtype:
            y = _call(graph, torch.ops.aten._to_copy.default, (y,), {"dtype": want.dtype}, want, fx)
        y = _call(graph, torch.ops.aten.clone.default, (y,), {}, want, fx)
    assert tuple(dst.shape) == tuple(want.shape)
    fx.replace_all_uses_with(y)
    graph.erase_node(fx)


def _is_view(fx: torch.fx.Node) -> bool:
    return fx.op == "call_function" and str(fx.target) in VIEW_OPS


def _unmerge_rows(fx: torch.fx.Node) -> bool:
    """Where `fx` views x (a0, ..., ak-1, rest) as (a0 * ... * ak-1, c) only for linear layers
    on those rows, whose result a view splits back to (a0, ..., ak-1, c'), keep the leading dims
    throughout (the module docstring): linear runs on any leading dims alike. Returns whether
    it rewrote."""
    if not _is_view(fx):
        return False
    x, out = fx.args[0].meta.get("val"), fx.meta.get("val")
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or out.dim() != 2:
        return False
    k, rows = 0, 1
    while k < x.dim() and rows < out.shape[0]:
        rows, k = rows * x.shape[k], k + 1
    if k < 2 or rows != out.shape[0]:
        return False  # not a merge of leading dims (one dim: nothing merged)
    lead, chain, cur = tuple(x.shape[:k]), [], fx
    while len(cur.users) == 1:
        (user,) = cur.users
        if not (user.op == "call_function" and user.target is torch.ops.aten.linear.default
                and user.args[0] is cur and cur not in user.args[1:]):
            break
        chain.append(user)
        cur = user
    end = next(iter(cur.users)) if len(cur.users) == 1 else None
    if (not chain or end is None or not _is_view(end)
            or end.args[0] is not cur or tuple(end.meta["val"].shape) != lead + (cur.meta["val"].shape[1],)):
        return False
    with out.fake_mode:
        fx.args = (fx.args[0], [*lead, out.shape[1]])
        fx.meta["val"] = x.view(*lead, out.shape[1])
        for node in chain:  # (T*B, c) -> (T, B, c): contiguous rows, one reshape away
            node.meta["val"] = node.meta["val"].view(*lead, node.meta["val"].shape[1])
    return True


def _call(graph: torch.fx.Graph, op, args: tuple, kwargs: dict, val, like: torch.fx.Node) -> torch.fx.Node:
    node = graph.call_function(op, args, kwargs)
    node.meta.update(like.meta)
    node.meta["val"] = val
    return node


def _first_line(e: Exception) -> str:
    """torch's first line, and where in the model's code the error arose (a data-dependent
    branch: `if labels.max() >= vocab`): where torch's message says, in either of its two
    forms, else the innermost frame of the model's code in the traceback."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    if type(e).__name__ == "DynamicOutputShapeException":  # its message is the op alone
        first = f"the shape of {first}'s output depends on its inputs' values, which torch.export cannot trace"
    elif "Could not guard on data-dependent expression" in first and re.search(r"Size-like symbols: u\d", first):
        # a size torch only knows from the data (x[mask]), which torch's own code then branches on
        first = ("a tensor's shape depends on its values (boolean-mask indexing x[mask], nonzero, masked_select, "
                 "unique), which torch.export cannot trace: keep shapes fixed (multiply by the mask and divide by "
                 "its sum, or cross_entropy's ignore_index, instead of selecting rows)")
    elif "Could not guard on data-dependent expression" in first:  # (torch's words for the symbolic value)
        first = ("it branches in Python on a tensor's value (data-dependent), which torch.export cannot follow (it "
                 "traces one path): "
                 "write the branch with tensor ops (torch.where), or turn it off (a random draw that skips a layer, "
                 "transformers' LayerDrop, is off at config.layerdrop=0.0)")
    elif "Could not extract specialized integer from data-dependent expression" in first:
        first = ("a Python number is taken from a tensor's value (.item(), int(t), or a count kept in a tensor: "
                 "BatchNorm with momentum=None averages by its num_batches_tracked), which torch.export cannot "
                 "trace: compute with tensors (BatchNorm: a numeric momentum, 0.1 by default)")
    where = re.search(r'The following call raised this error:\s*File "([^"]+)", line (\d+), in (\S+)(?:\n[ \t]+(\S[^\n]*))?', text)
    if where is None:  # (the model's line, where torch names the library's as the cause)
        where = re.search(r'Original traceback:\s*File "([^"]+)", line (\d+), in (\S+)(?:\n[ \t]+(\S[^\n]*))?', text)
    caused = re.search(r"Caused by: \((\S+?):(\d+) in (\S+)\)", text)
    if where:
        path, line, fn, code = where.groups()
    elif caused:
        path, line, fn = caused.groups()
        code = linecache.getline(_loaded_file(path), int(line))
    else:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not _is_library(f.filename)]
        if not frames:
            return first
        path, line, fn, code = frames[-1].filename, frames[-1].lineno, frames[-1].name, frames[-1].line
    code = (code or "").strip()
    return first + f" (at {os.path.basename(path)}:{line} in {fn}" + (f": {code}" if code else "") + ")"


def _loaded_file(tail: str) -> str:
    """The file of a loaded module whose path ends with `tail` (torch names one so), or tail."""
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None) or ""
        if path.endswith(os.sep + tail):
            return path
    return tail


def _functional(ep: ExportedProgram) -> ExportedProgram:
    """The functional ATen graph of `ep` (see the module docstring), with no-grad regions kept
    gradient-free and no higher-order op or submodule left."""
    graph = ep.graph
    for fx in list(graph.nodes):
        if fx.op == "call_function" and fx.target is torch.ops.higher_order.wrap_with_set_grad_enabled and not fx.args[0]:
            # torch.no_grad(): nothing computed inside may pass a gradient to its inputs
            args = list(fx.args)
            with graph.inserting_before(fx):
                for i in range(2, len(args)):
                    if isinstance(args[i], torch.fx.Node) and isinstance(args[i].meta.get("val"), torch.Tensor):
                        cut = graph.call_function(torch.ops.aten.detach.default, (args[i],))
                        cut.meta.update(args[i].meta)
                        cut.meta["val"] = args[i].meta["val"].detach()
                        args[i] = cut
            fx.args = tuple(args)
    ep.graph_module.recompile()
    dead, live = _dead_draws(ep.graph)
    with warnings.catch_warnings():  # torch's own pytree deprecation notices, not the user's business
        warnings.simplefilter("ignore", FutureWarning)
        ep = ep.run_decompositions({})
    if dead:
        _draw_again(ep.graph, dead, live)
        ep.graph_module.recompile()
    copies = [fx for fx in ep.graph.nodes if fx.op == "call_function" and fx.target is torch.ops.aten.copy.default]
    for fx in copies:
        _copy_as_clone(ep.graph, fx)
    merges = [fx for fx in list(ep.graph.nodes) if _unmerge_rows(fx)]
    if copies or merges:
        ep.graph_module.recompile()
    left = [fx for fx in ep.graph.nodes if fx.op == "call_function" and is_higher_order_op(fx.target)]
    left += [fx for fx in ep.graph.nodes if fx.op == "get_attr"]  # a submodule no op of ours calls
    if left:
        fx = left[0]
        op = fx.target.name() if fx.op == "call_function" else f"submodule {fx.target}"
        raise CaptureError(f"unsupported higher-order op {op} at {_scope(fx) or 'the top module'} "
                           f"(node {fx.name}): hap captures plain ATen ops only")
    return ep


def _draws(fx: torch.fx.Node) -> bool:
    """Whether an FX node may draw from torch's generator (an op torch tags nondeterministic_seeded,
    or attention, which may have dropout)."""
    return fx.op == "call_function" and (torch.Tag.nondeterministic_seeded in getattr(fx.target, "tags", ())
                                         or fx.target is torch.ops.aten.scaled_dot_product_attention.default)


def _dead_draws(graph: torch.fx.Graph) -> tuple[list[tuple[int, torch.fx.Node]], int]:
    """The random nodes whose outputs reach nothing (a dropout on a branch the loss never uses),
    each with the number of live random nodes before it, and the number of live ones.
    run_decompositions drops them, but one device draws their numbers all the same, so every
    later mask would be another (a Canine classifier's losses 1.5e-3 off one device's)."""
    live: set[torch.fx.Node] = set()
    todo = [fx for fx in graph.nodes if fx.op == "output"]
    while todo:
        fx = todo.pop()
        if fx not in live:
            live.add(fx)
            todo += fx.all_input_nodes
    found, before = [], 0
    for fx in graph.nodes:
        if _draws(fx):
            if fx in live:
                before += 1
            else:
                found.append((before, fx))
    return found, before


def _draw_again(graph: torch.fx.Graph, dead: list[tuple[int, torch.fx.Node]], live: int) -> None:
    """Put each dead random node back where one device draws it (before the live random node
    that followed it), on tensors of ones of its inputs' shapes: its draws depend on those alone,
    and its output stays unused."""
    anchors = [fx for fx in graph.nodes if _draws(fx)]
    if len(anchors) != live:  # (the decomposition made other random nodes of them: no place to tell)
        raise CaptureError("a random op whose output the loss never uses could not be kept in place: "
                           "one device draws its numbers, so hap's later random numbers would differ")
    output = next(fx for fx in graph.nodes if fx.op == "output")
    for before, node in dead:
        with graph.inserting_before(anchors[before] if before < len(anchors) else output):
            again = graph.call_function(node.target, tuple(_ones_for(graph, a) for a in node.args),
                                        {name: _ones_for(graph, a) for name, a in node.kwargs.items()})
        again.meta.update({key: node.meta[key] for key in ("val", "stack_trace", "nn_module_stack") if key in node.meta})


def _ones_for(graph: torch.fx.Graph, arg):
    """A constant argument as it is; a tensor's, a new node of ones of its shape and dtype."""
    if not isinstance(arg, torch.fx.Node):
        return arg
    val = arg.meta["val"]
    made = graph.call_function(torch.ops.aten.ones.default, (list(val.shape),), {"dtype": val.dtype, "device": val.device})
    made.meta["val"] = val
    return made


def _expert_params(model: torch.nn.Module, graph: Graph) -> list[str]:
    """Graph names of the parameters that modules declare stacked per expert on dim 0
    (`hap_expert_params`, a tuple of attribute names); tied ones once, in graph order."""
    targets = {f"{path}.{attr}" if path else attr
               for path, mod in model.named_modules() for attr in getattr(mod, "hap_expert_params", ())}
    return [p for p in graph.params if graph.tensors[p].target in targets]


def graph_from_exported(ep: ExportedProgram, name: str, aliases: dict[str, str] | None = None,
                        frozen: frozenset[str] = frozenset()) -> Graph:
    """The Graph of an exported program; `aliases` names placeholders that hold the same tensor
    as an earlier one (see _aliases): their uses read that one, which is a single leaf.
    `frozen`: the targets (state-dict names) of parameters that do not train (requires_grad
    False in the model), which hap keeps so: no gradient, no sync, no optimizer step."""
    aliases = aliases or {}
    kinds, targets = {}, {}
    mutated: dict[str, str] = {}  # output position -> buffer target, for the buffers forward mutates
    for k, spec in enumerate(ep.graph_signature.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutated[k] = spec.target
        elif spec.kind != OutputKind.USER_OUTPUT:
            what = {OutputKind.USER_INPUT_MUTATION: "mutates its input", OutputKind.PARAMETER_MUTATION: "mutates the parameter"}
            raise CaptureError(f"forward {what.get(spec.kind, spec.kind.name.lower())} {spec.target or spec.arg.name} in "
                               "place; hap trains parameters by their gradients only")
    for spec in ep.graph_signature.input_specs:
        kind = _KIND_OF_INPUT.get(spec.kind)
        if kind is None and getattr(spec.arg, "class_fqn", "").endswith("Generator"):
            placeholder = next(fx for fx in ep.graph.nodes if fx.op == "placeholder" and fx.name == spec.arg.name)
            user = next(iter(placeholder.users), None)
            where = f"{user.target} at {_scope(user) or 'the top module'}" if user is not None else spec.arg.name
            raise CaptureError(f"forward draws with a torch.Generator of its own ({where}): hap draws random numbers "
                               "from torch's default generator, as one device does, and cannot carry another's state; "
                               "draw from the default (torch.manual_seed seeds it)")
        if kind is None:
            raise CaptureError(f"unsupported graph input kind {spec.kind} for {spec.arg}")
        kinds[spec.arg.name] = kind
        targets[spec.arg.name] = spec.target

    tensors: dict[str, Tensor] = {}
    nodes: list[Node] = []
    inputs: list[str] = []
    params: list[str] = []
    getitem_names: dict[tuple[str, int], str] = {}  # (multi-output node, index) -> getitem name
    loss, buffer_updates = None, {}

    for fx in ep.graph.nodes:
        if fx.op == "call_function" and fx.target is operator.getitem:
            src, i = fx.args
            getitem_names[(src.name, i)] = fx.name
    for fx in ep.graph.nodes:
        if fx.op == "placeholder":
            if fx.name in aliases:
                continue
            val = fx.meta["val"]
            if not isinstance(val, torch.Tensor):
                raise CaptureError(f"input {fx.name} is not a tensor ({type(val).__name__}); pass tensors only")
            kind = kinds[fx.name]
            tensors[fx.name] = _tensor(fx.name, val, kind, targets[fx.name])
            (params if kind == "param" else inputs if kind == "input" else []).append(fx.name)
        elif fx.op == "call_function":
            if fx.target is operator.getitem:
                continue
            op = str(fx.target)
            val = fx.meta.get("val")
            if op in _SKIPPED_OPS or val is None:
                continue
            if isinstance(val, (list, tuple)):
                outs = [getitem_names.get((fx.name, i), f"{fx.name}#{i}") for i in range(len(val))]
                vals = list(val)
            else:
                outs, vals = [fx.name], [val]
            index = len(nodes)
            args, kwargs, ins = _tensorize_args(fx, tensors, aliases)
            for t in ins:
                if index not in tensors[t].consumers:
                    tensors[t].consumers.append(index)
            node = Node(index=index, name=fx.name, op=op, target=fx.target, args=args, kwargs=kwargs,
                        inputs=tuple(ins), outputs=(), scope=_scope(fx))
            nodes.append(node)
            out_names = []
            for out, v in zip(outs, vals):
                if not isinstance(v, torch.Tensor):
                    raise CaptureError(f"{op} at {fx.name} returns {type(v).__name__}; only tensor outputs are supported")
                out_names.append(out)
                tensors[out] = _tensor(out, v, "activation", None, producer=index)
            node.outputs = tuple(out_names)
        elif fx.op == "output":
            outs = [o for k, o in enumerate(fx.args[0]) if k not in mutated]
            if len(outs) != 1:
                raise CaptureError(f"forward must return only the scalar loss, it returns {len(outs)} values")
            loss = outs[0].name if hasattr(outs[0], "name") else None
            by_target = {targets[name]: name for name, kind in kinds.items() if kind == "buffer"}
            buffer_updates = {by_target[target]: fx.args[0][k].name for k, target in mutated.items()}
    if loss is None or loss not in tensors:
        raise CaptureError("forward must return the scalar loss tensor")
    lt = tensors[loss]
    if lt.shape != () or not lt.dtype.startswith(("float", "bfloat")):
        raise CaptureError(f"forward must return a scalar float loss, it returns shape {lt.shape} {lt.dtype}")
    constants = {n: ep.constants[targets[n]].detach().clone() for n, kind in kinds.items() if kind == "constant"}
    graph = Graph(nodes=nodes, tensors=tensors, inputs=inputs, params=params, loss=loss, model_name=name,
                  buffer_updates=buffer_updates, constants=constants,
                  non_persistent=frozenset(ep.graph_signature.non_persistent_buffers))
    _mark_requires_grad(graph, frozen)
    return graph


def _tensor(name, val: torch.Tensor, kind, target, producer=-1) -> Tensor:
    if any(isinstance(s, torch.SymInt) for s in val.shape):  # known only when it runs
        raise CaptureError(f"{name} has a shape that depends on the data ({tuple(val.shape)}), as boolean-mask "
                           "indexing, nonzero or unique give: hap needs shapes known before the data (torch.where, "
                           "a mask multiplied in)")
    stride = None if val.is_contiguous() else tuple(int(s) for s in val.stride())
    return Tensor(name=name, shape=tuple(int(s) for s in val.shape), dtype=dtype_name(val.dtype),
                  itemsize=val.element_size(), kind=kind, target=target, producer=producer, stride=stride)


def _tensorize_args(fx, tensors, aliases):
    ins: list[str] = []

    def conv(a):
        if isinstance(a, torch.fx.Node):
            name = aliases.get(a.name, a.name)
            if name not in tensors:
                raise CaptureError(f"{fx.target} at {_scope(fx) or 'the top module'} (node {fx.name}) takes {a.name}, "
                                   "which is not a tensor hap tracks")
            ins.append(name)
            return TensorRef(name)
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        if isinstance(a, dict):
            return {k: conv(v) for k, v in a.items()}
        return a

    return conv(tuple(fx.args)), conv(dict(fx.kwargs)), ins


def _scope(fx) -> str:
    stack = fx.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


def _mark_requires_grad(graph: Graph, frozen: frozenset[str]) -> None:
    for p in graph.params:
        t = graph.tensors[p]
        t.requires_grad = _is_float(t.dtype) and t.target not in frozen
    for n in graph.nodes:
        flows = any(graph.tensors[i].requires_grad for i in n.inputs)
        for k, o in enumerate(n.outputs):
            t = graph.tensors[o]
            if n.op in _OUTPUT_K_FROM_INPUT_K:  # broadcast_tensors: each output is a view of its own input
                flows = graph.tensors[n.inputs[k]].requires_grad
            t.requires_grad = flows and _is_float(t.dtype) and n.op not in _NON_DIFFERENTIABLE


_OUTPUT_K_FROM_INPUT_K = {"aten.broadcast_tensors.default"}
_NON_DIFFERENTIABLE = {"aten.detach.default", "aten.zeros_like.default", "aten.ones_like.default",
                       "aten.empty_like.default", "aten.full_like.default"}


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


# ---------------------------------------------------------------------------------------------
# FLOPs


def _count_flops(graph: Graph) -> None:
    seen: dict[tuple, tuple[float, float]] = {}
    for n in graph.nodes:
        key = node_signature(n, graph)
        if key not in seen:
            seen[key] = _node_flops(n, graph)
        n.flops, n.bwd_flops = seen[key]
        n.bytes_moved = sum(graph.tensors[t].nbytes for t in (*n.inputs, *n.outputs))


def meta_args(n: Node, graph: Graph, with_grad: bool):
    """Node args with TensorRefs replaced by meta tensors of the right shape and dtype."""

    def conv(a):
        if isinstance(a, TensorRef):
            t = graph.tensors[a.name]
            m = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="meta")
            return m.requires_grad_(with_grad and t.requires_grad)
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        if isinstance(a, dict):
            return {k: conv(v) for k, v in a.items()}
        return a

    return conv(n.args), conv(n.kwargs)


def _node_flops(n: Node, graph: Graph) -> tuple[float, float]:
    needs_bwd = any(graph.tensors[o].requires_grad for o in n.outputs)
    try:
        args, kwargs = meta_args(n, graph, with_grad=needs_bwd)
        with FlopCounterMode(display=False) as fwd:
            out = n.target(*args, **kwargs)
        fwd_flops = float(fwd.get_total_flops())
        bwd_flops = 0.0
        if needs_bwd:
            outs = [o for o in (out if isinstance(out, (list, tuple)) else [out])
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs:
                with FlopCounterMode(display=False) as bwd:
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                bwd_flops = float(bwd.get_total_flops())
        return fwd_flops, bwd_flops
    except Exception:
        # No meta kernel: the op is counted as doing no matmul-class FLOPs, like torch's own
        # accounting does for every op outside its table. Its memory traffic is still costed.
        return 0.0, 0.0
