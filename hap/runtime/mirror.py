"""The wrapped model's module tree over the parameters hap holds.

hap.HAP and hap.Pipeline register, as their own children, a shell of every module of the model
they wrap: an instance of the module's class, with its settings (in_features, eps, config),
holding this rank's parameters (a shard, a stage's) in place of the model's. So walks of the
module by torch and by libraries see the model's modules and names: named_parameters() gives
the model's names, and Hugging Face's weight-decay groups, which walk named_children() and skip
LayerNorm instances and biases, pick the parameters they pick on the model (over hap's own
containers they gave names that no parameter has: no decay anywhere, silently). A shell runs
nothing; the wrapper runs the model."""

import copy

import torch
from torch import nn


class MirrorsModel(nn.Module):
    """An nn.Module whose children mirror the model it wraps (mirror_model)."""

    def mirror_model(self, model: nn.Module, held: dict[int, torch.Tensor]) -> None:
        """Register shells of model's children, and model's own parameters, holding held[id(p)]
        in place of each parameter p of the model (None where hap holds none of it)."""
        memo: dict[int, nn.Module] = {}
        self._parameters.update(_held_parameters(model, held))
        for name, child in model._modules.items():
            if child is not None:
                self._modules[name] = _shell(child, held, memo)

    def _apply(self, fn, recurse: bool = True):
        """Refused where it would change a parameter's dtype or device (.half(), .to(device)):
        the model was captured and planned as it was, and its buffers live in hap's executor
        (a BatchNorm's statistics stayed float32 beside half parameters: an error deep inside
        the step). Otherwise (.float() of a float model, share_memory()) torch's."""
        for p in self.parameters():
            probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
            if probe.dtype != p.dtype or probe.device != p.device:
                raise ValueError(f"{type(self).__name__} of a model captured in {p.dtype} on {p.device} cannot move to "
                                 f"{probe.dtype} on {probe.device}: convert the model before wrapping it "
                                 "(model.half(), model.to(device)), or use torch.autocast")
        return super()._apply(fn, recurse)

    def __reduce_ex__(self, protocol):
        raise TypeError(f"torch.save (pickle) of a {type(self).__name__} would take its process groups along: save "
                        "dmodel.full_state_dict() (every rank calls it), hap.runtime.checkpoint.save(dmodel, opt, dir), "
                        "or the model itself")

    def __deepcopy__(self, memo: dict):
        # as copy.deepcopy does by default (pickle's __reduce_ex__, refused above, made it)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
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


def _held_parameters(module: nn.Module, held: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    # None where the model has None (Linear(bias=False)) or hap holds none (another stage's)
    return {name: None if p is None else held.get(id(p)) for name, p in module._parameters.items()}


def _shell(module: nn.Module, held: dict[int, torch.Tensor], memo: dict[int, nn.Module]) -> nn.Module:
    """An instance of module's class with its settings, held parameters and children's shells
    (a module met twice, one shell), but no buffers, no hooks, and a forward that refuses."""
    if id(module) in memo:
        return memo[id(module)]
    cls = type(module)
    shell = cls.__new__(cls)
    nn.Module.__init__(shell)  # its own parameter, buffer, child and hook tables
    for key, value in vars(module).items():
        shell.__dict__.setdefault(key, value)  # settings: repr() and isinstance checks read them
    shell.training = module.training
    memo[id(module)] = shell
    shell._parameters.update(_held_parameters(module, held))
    for name, child in module._modules.items():
        shell._modules[name] = None if child is None else _shell(child, held, memo)
    shell.register_forward_pre_hook(_runs_nothing)
    return shell


def _runs_nothing(module: nn.Module, args) -> None:
    raise ValueError(f"this {type(module).__name__} inside hap's wrapper only holds this rank's parameters (a shard, "
                     "a stage's) under the model's names: call the wrapper (dmodel(*batch)), which runs the model")
