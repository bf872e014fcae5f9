"""The wrapped model's module tree over the parameters hap holds.

hap.HAP and hap.Pipeline register, as their own children, a shell of every module of the model
they wrap: an instance of the module's class, with its settings (in_features, eps, config),
holding this rank's parameters (a shard, a stage's) in place of the model's. So walks of the
module by torch and by libraries see the model's modules and names: named_parameters() gives
the model's names, and Hugging Face's weight-decay groups, which walk named_children() and skip
LayerNorm instances and biases, pick the parameters they pick on the model (over hap's own
containers they gave names that no parameter has: no decay anywhere, silently). A shell runs
nothing; the wrapper runs the model. The wrapper's state_dict() and load_state_dict() are by the
model's keys too (hap.runtime.checkpoint)."""

import copy
from typing import Callable

import torch
from torch import nn


class MirrorsModel(nn.Module):
    """An nn.Module whose children mirror the model it wraps (mirror_model)."""

    def mirror_model(self, model: nn.Module, held: dict[int, torch.Tensor], sharded: frozenset[int] = frozenset()) -> None:
        """Register shells of model's children, and model's own parameters, holding held[id(p)]
        in place of each parameter p of the model (None where hap holds none of it); `sharded`:
        the ids of the model's parameters hap shards over the ranks (the same on every rank)."""
        memo: dict[int, nn.Module] = {}
        self._parameters.update(_held_parameters(model, held))
        for name, child in model._modules.items():
            if child is not None:
                self._modules[name] = _shell(child, held, sharded, memo)
        self.mirror_modes(model)

    def mirror_modes(self, model: nn.Module) -> None:
        """Every shell in the mode of its module of `model` (after hap set the model's modes)."""
        for shell, module in zip(list(self.modules())[1:], list(model.modules())[1:]):
            shell.training = module.training
        self._shell_modes = module_modes(self)

    def train(self, mode: bool = True):
        """This wrapper's mode; its shells keep the modes of the model's modules (after
        _follow_mode, where the wrapper sets those too)."""
        nn.Module.train(self, mode)
        self._follow_mode(mode)
        self.mirror_modes(self.model)
        return self

    def _follow_mode(self, mode: bool) -> None:
        """What else the wrapper's train(mode) sets: nothing here."""

    def refuse_shell_mode_change(self) -> None:
        """A ValueError where a shell's mode was set since mirror_modes (a BatchNorm frozen
        through dmodel.modules(), say: its statistics moved on, silently)."""
        now = module_modes(self)
        if now == self.__dict__.get("_shell_modes", now):
            return
        name, m = next((n, m) for (n, m), was in zip(self.named_modules(), self._shell_modes) if m.training != was)
        raise ValueError(f"module {name or type(self).__name__!r} inside {type(self).__name__} was put in "
                         f"{'training' if m.training else 'eval'} mode, unlike the training graph hap captured: set "
                         "modules' modes on the model before wrapping it (dmodel.train() and dmodel.eval() switch "
                         "the whole model)")

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """This rank's part of the model's state, under the keys of `model.state_dict()` (a tied
        parameter once), sharing storage with the parameters and buffers: a tensor kept whole is
        itself, a sharded one (hap.HAP's) a tensor that knows its rows in the whole; a pipeline
        stage's holds that stage's parameters and buffers. torch.distributed.checkpoint saves it
        and loads into it under any plan, ratios or number of ranks (hap.runtime.checkpoint does
        that, with the optimizer's state and atomic commits). Pickling a rank's part (torch.save,
        DDP's habit on rank 0: the other ranks' parts were lost) is a one-line ValueError."""
        if args or kwargs:
            raise TypeError(f"{type(self).__name__}.state_dict() takes no arguments (it is not a submodule's)")
        from .checkpoint import state_dict

        return state_dict(self)

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Load a state dict whole (the original model's `state_dict()`, pretrained weights) or
        as `state_dict()` gives it (after dcp.load into it): each rank its part (a pipeline
        stage's entries; the other stages' are their ranks' to load). A missing, unknown or
        misshapen entry is a ValueError naming it (strict), and nothing is loaded. Returns
        (missing_keys, unexpected_keys), as torch does."""
        from .checkpoint import load_state_dict

        loaded = load_state_dict(self, state_dict, strict)
        self._loaded = True  # (every rank must load: the next step's sum says how many did)
        return loaded

    def _apply(self, fn, recurse: bool = True):
        """Refused where it would change a parameter's dtype or device (.half(), .to(device)):
        the model was captured and planned as it was, and its buffers live in hap's executor
        (a BatchNorm's statistics stayed float32 beside half parameters: an error deep inside
        the step). Otherwise (.float() of a float model, share_memory()) torch's. A rank that holds
        no parameters (a pipeline stage of the loss alone) asks the model's: it let .half()
        through while the other ranks refused, then waited for them."""
        for p in list(self.parameters()) or list(self.model.parameters())[:1]:
            probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
            if probe.dtype != p.dtype or probe.device != p.device:
                raise ValueError(f"{type(self).__name__} of a model captured in {p.dtype} on {p.device} cannot move to "
                                 f"{probe.dtype} on {probe.device}: convert the model before wrapping it "
                                 "(model.half(), model.to(device)), or use torch.autocast")
        return super()._apply(fn, recurse)

    def __reduce_ex__(self, protocol):
        raise TypeError(f"pickling (torch.save) or copy.copy of a {type(self).__name__} would take its process groups "
                        "along: save dmodel.full_state_dict() (every rank calls it), hap.runtime.checkpoint.save(dmodel, "
                        "opt, dir), or the model itself; copy.deepcopy(dmodel) makes a copy")

    def __deepcopy__(self, memo: dict):
        # as copy.deepcopy does by default (through pickle's __reduce_ex__, refused above):
        # torch's __getstate__ leaves out what ties a module to itself (torch.compile's call)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def __setattr__(self, name: str, value) -> None:
        # hap's own attribute (plan, graph) named as one of the model's modules or parameters
        # (a model's child `model`, as in Hugging Face's): it stays hap's; the shell is a child
        own = self.__dict__
        if not isinstance(value, (nn.Module, nn.Parameter)) and (
                name in own.get("_modules", ()) or name in own.get("_parameters", ())):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


def module_modes(module: nn.Module) -> tuple[bool, ...]:
    """Each module's training flag, in modules() order."""
    return tuple(m.training for m in module.modules())


def _held_parameters(module: nn.Module, held: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    # None where the model has None (Linear(bias=False)) or hap holds none (another stage's)
    return {name: None if p is None else held.get(id(p)) for name, p in module._parameters.items()}


class _Shell:
    """Mixed into a shell's class (a subclass of its module's, made once per class)."""

    def forward(self, *args, **kwargs):
        raise ValueError(f"this {type(self).__name__} inside hap's wrapper only holds this rank's parameters (a shard, "
                         "a stage's) under the model's names: call the wrapper (dmodel(*batch)), which runs the model")

    def extra_repr(self) -> str:
        return self._hap_repr  # the module's own, taken whole (its own may read what a shell lacks)

    def __getattr__(self, name: str):
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            if name in self.__dict__.get("_hap_buffers", ()):
                raise AttributeError(f"{type(self).__name__} inside hap's wrapper holds no buffer {name!r}: hap keeps "
                                     "the model's buffers (BatchNorm's running statistics) itself; "
                                     "dmodel.full_state_dict() has them") from None
            raise


_SHELL_CLASSES: dict[type, type] = {}


def _shell_class(cls: type) -> type:
    """cls with _Shell's methods first: isinstance(shell, cls) holds, its name is cls's; and its
    own initialization, where it has one, refused on a shell holding a shard (_guarded_reset)."""
    if cls not in _SHELL_CLASSES:
        members = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        members.update({name: _guarded_reset(getattr(cls, name), name) for name in _RESETS
                        if callable(getattr(cls, name, None))})
        _SHELL_CLASSES[cls] = type(cls.__name__, (_Shell, cls), members)
    return _SHELL_CLASSES[cls]


_RESETS = ("reset_parameters", "_reset_parameters")
"""The methods by which a module initializes its own parameters (torch's layers, MultiheadAttention)."""


def _guarded_reset(reset: Callable, name: str) -> Callable:
    """The module's own `reset` (its parameters' initialization), refused on a shell holding a
    shard: it drew the shard alone, its fan-in taken from the shard's shape. Whole parameters it
    initializes as on the model (each rank its own draws: the next step compares them)."""
    def guarded(self, *args, **kwargs):
        if self.__dict__.get("_hap_sharded"):
            raise ValueError(f"{type(self).__name__}.{name}() inside hap's wrapper would initialize this rank's shard "
                             "of a parameter alone (its fan-in from the shard's shape): initialize the model before "
                             "wrapping it, or load weights with dmodel.load_state_dict(...)")
        return reset(self, *args, **kwargs)

    return guarded


def _shell(module: nn.Module, held: dict[int, torch.Tensor], sharded: frozenset[int], memo: dict[int, nn.Module]) -> nn.Module:
    """An instance of module's class with its settings, held parameters and children's shells
    (a module met twice, one shell), but no buffers, no hooks, and a forward that refuses. A
    class that cannot be made so (torch.compile's wrapper, whose attributes are its module's) is
    a plain module's."""
    if id(module) in memo:
        return memo[id(module)]
    try:
        shell = _bare(_shell_class(type(module)))
        for key, value in vars(module).items():
            shell.__dict__.setdefault(key, value)  # settings: isinstance checks and libraries read them
    except Exception:  # (RecursionError: an attribute lookup that needs what __init__ sets)
        shell = _bare(_shell_class(nn.Module))
    try:
        shell.__dict__["_hap_repr"] = module.extra_repr()
    except Exception:
        shell.__dict__["_hap_repr"] = ""
    shell.__dict__["_hap_buffers"] = frozenset(module._buffers)
    memo[id(module)] = shell
    shell._parameters.update(_held_parameters(module, held))
    shell.__dict__["_hap_sharded"] = any(p is not None and id(p) in sharded for p in module._parameters.values())
    for name, child in module._modules.items():
        shell._modules[name] = None if child is None else _shell(child, held, sharded, memo)
    return shell


def _bare(cls: type) -> nn.Module:
    shell = cls.__new__(cls)
    nn.Module.__init__(shell)  # its own parameter, buffer, child and hook tables
    return shell
