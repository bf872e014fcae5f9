"""Sharded checkpoints that load under any plan, ratios or number of ranks (hap.HAP's, or
hap.Pipeline's, whose stages each write their own parameters whole).

    from hap.runtime import checkpoint
    path = checkpoint.save(dmodel, opt, "ckpt", step)      # every rank: ckpt/step-00000012, then ckpt/latest
    step, extra = checkpoint.load(dmodel, opt, "ckpt")     # every rank: the latest complete checkpoint

Each rank writes only its own part of every parameter, buffer and optimizer state tensor, and
the part is recorded as a row range of the whole tensor under the model's own state-dict key
(torch.distributed.checkpoint, DCP). A checkpoint knows nothing of the plan: a run under
another plan, other ratios or another number of ranks reads the rows its own layout needs. A
checkpoint also holds the step, rank 0's CPU random generator state (which every rank then
shares, as hap.HAP does: dropout draws what one device would) and any `extra` object.

A save writes into a hidden sibling directory; once every rank has written its part, the ranks
hash its files (a share each), and rank 0 records their SHA-256, renames it into place and then
points `latest` at it (a file replaced atomically): a save that dies midway leaves the previous
checkpoint the latest, `load` never sees a partial one, and a file changed since (a flipped
bit) is refused before it is read.
PowerSGD's error feedback (summed over the ranks) and Q are saved per part it compresses and
restored where the loading run compresses that part alike (_compressor_items says why a sum is enough).
Optimizer state is saved with its parameter's rows where it holds one value per element of
the parameter (momentum, Adam's moments); an optimizer whose state spans a sharded parameter
(Adafactor's factored moments) is refused, as it would not be one device's.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from .._torch import ShardedTensor, quiet_sharded_tensors, sharded_tensor
from . import ledger, wire
from .collectives import _with_length, from_rank_0, gather_or_refuse, global_rank
from .executor import per_element
from .module import group_settings, unlike_rank_0, wrapped_state

log = logging.getLogger("hap")

POINTER = "latest"
CHECKSUMS = "checksums.json"
"""In a checkpoint: the SHA-256 of every file DCP wrote, checked before a load reads them."""
COMMITS = ".commits"
"""Beside the checkpoints: their names in the order they were committed, one a line (keep=
keeps the newest committed; a copy of the directory keeps that order, where file times do not)."""
_CHECKSUMMED = "checksummed"
"""In a checkpoint's .metadata: the save wrote checksums.json (older checkpoints have none)."""
_STATE = "optim/state/"  # + <parameter's key>/<state name>
_POWERSGD = "sync/powersgd/"  # + <parameter's key>/<rows>/error, .../q
_NAME = re.compile(r"step-(\d+)(\.\d+)?$")
_RESUMED: dict[str, str] = {}
"""Directory -> the checkpoint this process last loaded from it, until its next save there: the
save logs it as committed again first (COMMITS), so that keep= keeps the run's own lineage (the
checkpoint it resumed from), not a later step of the run it replaces."""


def state_dict(dmodel) -> dict[str, torch.Tensor]:
    """This rank's part of every parameter and buffer by the model's state-dict key, as DCP
    saves it: a tensor kept whole on every rank is a plain tensor, a sharded one a tensor that
    knows its rows in the whole (_like). Where this rank holds no part of some entries
    (a pipeline stage holds its own), a RankStateDict."""
    ex, out = dmodel.executor, {}
    for name in _persistent(dmodel):
        out[dmodel.graph.tensors[name].target] = _like(dmodel, name, ex.value_of(name).detach().contiguous())
    out.update(idle_state(dmodel))
    lacks = next((key for key in model_shapes(dmodel.graph) if key not in out), None)
    return out if lacks is None else RankStateDict(out, lacks)


class RankStateDict(dict):
    """A rank's state dict that lacks the entries other ranks hold (a pipeline stage's, whole):
    pickling it, as torch.save does, is a ValueError naming one it lacks. DDP's habit,
    `torch.save(model.state_dict())` on rank 0, saved stage 0's entries alone and the other
    stages' were lost. DCP saves it (each rank its entries); copy.copy and copy.deepcopy keep it one."""

    def __init__(self, entries: dict[str, torch.Tensor], lacks: str):
        super().__init__(entries)
        self.lacks = lacks
        """A state-dict key another rank holds."""

    def __reduce_ex__(self, protocol):
        raise ValueError(f"cannot pickle this rank's state dict: it lacks {self.lacks!r}, which another rank holds "
                         "(each pipeline stage holds its own entries): save dmodel.full_state_dict() (every rank "
                         "calls it) or use hap.runtime.checkpoint.save")

    def __copy__(self) -> "RankStateDict":
        return RankStateDict(self, self.lacks)

    def __deepcopy__(self, memo: dict) -> "RankStateDict":
        return RankStateDict({key: copy.deepcopy(value, memo) for key, value in self.items()}, self.lacks)


def idle_state(dmodel) -> dict[str, torch.Tensor]:
    """The parameters the forward never reads (a head the loss does not use), by key: trained by
    nothing, kept whole in the model hap wrapped (rank 0's values on every rank: sync_idle), and
    saved and loaded with the rest, so a resume keeps what load_state_dict put there. Not on
    the meta device (a model too large for one device: never materialized)."""
    original = wrapped_state(dmodel.model)
    return {key: original[key] for key in idle_shapes(dmodel.graph) if key in original and not original[key].is_meta}


def idle_shapes(graph) -> dict[str, tuple[int, ...]]:
    """State-dict key -> whole shape of every parameter no node uses (idle_state)."""
    return {t.target: t.shape for t in graph.tensors.values() if t.kind == "param" and not t.consumers}


def sync_idle(dmodel) -> None:
    """Rank 0's values of the idle parameters on every rank, as DDP starts (a collective)."""
    if dmodel.comm.world > 1:
        with torch.no_grad():
            for value in idle_state(dmodel).values():
                value.copy_(from_rank_0(value, dmodel.comm))


def _persistent(dmodel) -> list[str]:
    """The leaves the model's state dict and a checkpoint hold, in stored order: not a buffer
    registered with persistent=False (torch leaves those out; a load keeps their built value)."""
    graph = dmodel.graph
    return [name for name in dmodel.executor.stored if graph.tensors[name].target not in graph.non_persistent]


def model_shapes(graph) -> dict[str, tuple[int, ...]]:
    """What a checkpoint of this model holds, whatever the plan: state-dict key -> whole shape
    of every parameter a node uses and every buffer but the non-persistent ones."""
    used = {name for node in graph.nodes for name in node.inputs}
    return {t.target: t.shape for name, t in graph.tensors.items()
            if (t.kind == "param" and name in used) or (t.kind == "buffer" and t.target not in graph.non_persistent)}


class LoadedKeys(NamedTuple):
    """What `load_state_dict` left out, as torch's Module.load_state_dict reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_state_dict(dmodel, state: dict[str, Any], strict: bool = True) -> LoadedKeys:
    """Load a model state dict into this rank's parts: each value either whole (the original
    model's `state_dict()`, a checkpoint loaded whole) or as `state_dict` gives it (this rank's
    rows, as after dcp.load into it). A tied parameter may come under any of its names.
    strict: every parameter and buffer the model trains must be there and nothing else (else a
    ValueError naming it, and nothing is loaded)."""
    ex, graph = dmodel.executor, dmodel.graph
    leaf_of = {key: name for key, name in dmodel._state_keys.items() if name in ex.stored}
    unknown = sorted(set(state) - set(dmodel._state_keys))
    if unknown and strict:
        raise ValueError(f"the state dict holds {unknown[0]!r}, which the model lacks")
    parts = {}
    for key, value in state.items():
        name = leaf_of.get(key)
        if name is not None:  # a tied parameter under two keys of two values: the last, as torch copies them in turn
            parts[name] = _local_part(dmodel, name, key, value)
    missing = sorted(graph.tensors[name].target for name in set(_persistent(dmodel)) - set(parts))
    if missing and strict:
        raise ValueError(f"the state dict has no {missing[0]!r}, which the model needs")
    # what the forward never reads (a head the loss does not use) stays in the model hap wrapped,
    # whole, where full_state_dict reads it
    original = wrapped_state(dmodel.model)
    idle = {key: value for key, value in state.items()
            if key in original and key not in leaf_of and dmodel._state_keys.get(key) not in parts}
    for key, value in idle.items():
        if not isinstance(value, torch.Tensor) or value.shape != original[key].shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{key!r} is {shape} in the state dict but {tuple(original[key].shape)} in the model")
    with torch.no_grad():
        for name, part in parts.items():
            if name in ex.params:
                ex.params[name].copy_(part)
            else:
                ex.buffers[name] = part.clone()  # replaced, as a forward does
        for key, value in idle.items():
            original[key].copy_(value)
    return LoadedKeys(missing, unknown)


def _local_part(dmodel, name: str, key: str, value) -> torch.Tensor:
    """This rank's part of graph tensor `name` from a state-dict value (whole, or this rank's rows)."""
    ex, t = dmodel.executor, dmodel.graph.tensors[name]
    p, seg = ex.stored[name]
    mine = ex.value_of(name)
    if isinstance(value, ShardedTensor):
        if tuple(value.size()) != tuple(t.shape):
            raise ValueError(f"{key!r} is {tuple(value.size())} in the state dict but {tuple(t.shape)} in the model")
        shards = value.local_shards()
        local = shards[0].tensor if shards else mine.new_empty(_with_length(t.shape, p.dim, 0) if p.is_shard else t.shape)
    elif isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(t.shape):
        local = ex.stored_part(name, value)
    else:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{key!r} is {shape} in the state dict but {tuple(t.shape)} in the model")
    if local.shape != mine.shape:
        raise ValueError(f"{key!r}: this rank's part is {tuple(local.shape)} in the state dict but "
                         f"{tuple(mine.shape)} under this plan (load a sharded checkpoint with checkpoint.load)")
    return local.to(mine.dtype)


def optimizer_state_dict(dmodel, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state in torch's layout, keyed by the parameters' state-dict keys:
    {"state": {key: {name: value}}, "param_groups": [{..., "params": [key, ...]}]}. A state
    tensor of its parameter's local shape (momentum, Adam's moments) is sharded like the
    parameter; others (Adam's step) and the groups' hyper-parameters are the same on every rank.
    A ValueError where a state tensor spans a sharded parameter (executor.per_element)."""
    groups, state = [], {}
    for group, params in zip(opt.param_groups, _opt_params(dmodel, opt)):
        for name, key, p in params:
            if p in opt.state:
                sharded = dmodel.executor.stored[name][0].is_shard
                # (SGD's momentum of a sparse gradient is sparse: saved dense, it steps on as one device's)
                state[key] = {k: _like(dmodel, name, (v.to_dense() if v.layout != torch.strided else v).detach().contiguous())
                              if isinstance(v, torch.Tensor) and per_element(k, v.shape, p.shape, key, sharded) else v
                              for k, v in opt.state[p].items()}
        groups.append({**group_settings(group), "params": [key for _, key, _ in params]})
    return {"state": state, "param_groups": groups}


@ledger.called("checkpoint.save(dmodel, ...)")
def save(dmodel, opt: torch.optim.Optimizer | None, directory: str, step: int, extra: Any = None,
         keep: int | None = None) -> str:
    """Write a checkpoint of the model (and optimizer) at `step` to directory/step-<step> and
    make it the latest; returns its path. A collective: every rank calls it. `extra`: any
    picklable object (rank 0's is kept: another on some rank is a warning). keep: how many checkpoints to keep (the newest; None: all)."""
    comm = dmodel.comm  # (agreed first: a rank refusing alone left the others waiting)
    pickled = _pickled(extra)  # (once: a large extra, a data loader's state, is pickled once a save)
    _same_on_every_rank("checkpoint save", {"directories": os.path.abspath(directory), "steps": step, "keeps": keep}, comm,
                        noted={"extra=": hashlib.sha256(pickled).hexdigest() if isinstance(pickled, bytes) else str(pickled)})
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    staging = os.path.join(directory, f".tmp-step-{step:08d}")
    items = {f"model/{k}": v for k, v in state_dict(dmodel).items()}
    kind, groups = _model_groups(dmodel, opt)
    refused = None
    try:
        if opt is not None:
            items.update(_flat_optimizer({**optimizer_state_dict(dmodel, opt), "param_groups": groups}))
            items["optim/kind"] = kind
        if comm.rank == 0:  # written once; every rank loads rank 0's (extra as bytes: DCP would take a tensor for its own)
            if isinstance(pickled, ValueError):
                raise pickled
            items.update({"step": step, "extra_pickle": pickled, "rng": torch.get_rng_state(),
                          _CHECKSUMMED: True})  # (a load then requires the checksums: verify)
            os.makedirs(directory, exist_ok=True)
            _remove(staging)  # a save of this step that died before (or a stray file of that name)
            os.makedirs(staging)
    except (ValueError, OSError) as e:
        refused = f"checkpoint save: {e}"
    gather_or_refuse(None, refused, comm)  # (and the staging directory is there)
    items.update(_compressor_items(dmodel))
    try:
        with quiet_sharded_tensors():
            dcp.save(items, storage_writer=dcp.FileSystemWriter(staging), process_group=comm.group,
                     planner=dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    except CheckpointException as e:  # every rank gets every rank's failure (a full disk): one line instead
        if comm.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # the latest checkpoint is the one before
        raise ValueError(f"checkpoint save: writing {staging} failed ({_first_failure(e)})") from None
    dist.barrier(group=comm.group)  # every rank's part is written
    sums = _checksums(staging, comm)
    resumed = _RESUMED.pop(os.path.realpath(directory), None)
    box: list = [None]
    if comm.rank == 0:
        try:
            box = [_commit(staging, directory, step, keep, sums, resumed)]
        except OSError as e:  # told to every rank, not left waiting
            box = [ValueError(f"checkpoint save: committing {staging} failed: {e}")]
    dist.broadcast_object_list(box, src=global_rank(comm, 0), group=comm.group)  # no rank returns before it is the latest
    if isinstance(box[0], ValueError):
        raise box[0]
    return box[0]


def _same_on_every_rank(what: str, args: dict[str, Any], comm, noted: dict[str, Any] | None = None) -> None:
    """A ValueError on every rank where the ranks were given different `args` (a directory of
    each rank's own: rank 0 alone commits a save, and every rank loads what rank 0 resolved);
    a warning, on rank 0, where they were given different `noted` (an extra= of each rank's
    own, say its sampler's state: the checkpoint keeps rank 0's)."""
    every = gather_or_refuse((args, noted or {}), None, comm)
    for key in every[0][1]:
        unlike = unlike_rank_0([n[key] for _, n in every])
        if unlike and comm.rank == 0:
            log.warning("%s: ranks %s were given another %s than rank 0's: the checkpoint keeps rank 0's alone, which "
                        "every rank's load returns (gather each rank's state into one extra first)", what, unlike, key)
    every = [a for a, _ in every]
    for key, mine in every[0].items():
        unlike = unlike_rank_0([a[key] for a in every])
        if unlike:
            shared = "; a checkpoint is one directory on a filesystem every rank shares" if key == "directories" else ""
            raise ValueError(f"{what}: the ranks were given different {key} (rank 0: {mine}, rank {unlike[0]}: "
                             f"{every[unlike[0]][key]}){shared}")


def _pickled(extra: Any) -> bytes | ValueError:
    """`extra`'s pickle, or the ValueError that says why it does not pickle (raised by rank 0's
    save after the ranks agreed; the others note its words, to tell extras apart)."""
    try:
        return pickle.dumps(extra)
    except Exception as e:  # pickle raises about anything (a lambda: PicklingError, AttributeError)
        return ValueError(f"extra does not pickle ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")


@ledger.called("checkpoint.load(dmodel, ...)")
def load(dmodel, opt: torch.optim.Optimizer | None, directory: str, verified: bool = False) -> tuple[int, Any]:
    """Load the latest checkpoint under `directory` (or the checkpoint `directory` itself) into
    the model's parameters and buffers, the optimizer (if given: its state and hyper-parameters)
    and the CPU random generator; returns (step, extra). A collective: every rank calls it.
    A checkpoint that lacks a tensor the model needs, holds one it lacks, holds one of another
    shape, or whose optimizer holds other parameters, is a ValueError naming it, and nothing is
    loaded. verified=True: the caller has run `verify` on this very checkpoint already (hap
    train, before its ranks start; `directory` then names it, not its parent, whose latest
    could be another), so its files are not hashed again; every rank passes the same value
    (verify is a collective)."""
    comm, ex, graph = dmodel.comm, dmodel.executor, dmodel.graph
    _same_on_every_rank("checkpoint load", {"directories": os.path.abspath(directory), "verified flags": verified}, comm)
    box: list = [None]
    if comm.rank == 0:
        try:
            box = [_resolve(directory)]
        except ValueError as e:  # told to every rank, not left waiting
            box = [e]
        except OSError as e:
            box = [ValueError(f"checkpoint load: {directory}: {e.strerror or type(e).__name__}")]
    dist.broadcast_object_list(box, src=global_rank(comm, 0), group=comm.group)
    if isinstance(box[0], ValueError):
        raise box[0]
    path = box[0]
    if path is None:
        raise ValueError(f"no checkpoint in {directory}")
    if not verified:
        verify(path, comm)
    meta = metadata(path)
    check(path, model_shapes(graph), meta, optional=idle_shapes(graph))
    held = {f"model/{graph.tensors[name].target}": (name, _empty_local(ex, name)) for name in _persistent(dmodel)}
    # in place, into the model's own (a checkpoint from before they were saved keeps the model's)
    held.update({f"model/{key}": (None, value) for key, value in idle_state(dmodel).items()
                 if f"model/{key}" in meta.state_dict_metadata})
    extra = "extra_pickle" if "extra_pickle" in meta.state_dict_metadata else "extra"  # (older checkpoints: the object)
    objects = {"step": None, extra: None}
    kind, groups = _model_groups(dmodel, opt)  # kind: None where no rank has an optimizer
    refused = None
    try:
        if kind is not None:  # every rank checks the groups (a pipeline stage may have no optimizer)
            if "optim/param_groups" not in meta.state_dict_metadata:
                raise ValueError(f"checkpoint {path} holds no optimizer state")
            objects.update({item: None for item in ("optim/param_groups", "optim/kind") if item in meta.state_dict_metadata})
        if opt is not None:
            state = _optimizer_items(dmodel, opt, _kept(meta))
            held.update({item: v for item, v in state.items() if v is not None})
            objects.update({item: None for item, v in state.items() if v is None})
    except ValueError as e:
        refused = f"checkpoint {path}: {e}" if not str(e).startswith("checkpoint ") else str(e)
    gather_or_refuse(None, refused, comm)
    _load(objects, path, comm)  # first the small objects: the optimizer's groups must match
    if kind is not None:
        saved_kind = objects.get("optim/kind", kind)  # (older checkpoints did not say)
        if saved_kind != kind:
            raise ValueError(f"checkpoint {path} holds the state of optimizer class {saved_kind}, not {kind} "
                             f"(to start {kind} afresh, load the model alone: load(dmodel, None, ...))")
        _check_groups(groups, objects["optim/param_groups"], f"checkpoint {path}")
    hyper, refused = None, None
    try:
        hyper = _loaded_hyper(dmodel, opt, objects["optim/param_groups"]) if opt is not None else None
    except ValueError as e:  # told to every rank before anything loads
        refused = f"checkpoint {path}: {e}"
    gather_or_refuse(None, refused, comm)
    if extra == "extra_pickle":
        objects["extra"] = pickle.loads(objects.pop(extra))
    rng = torch.empty_like(torch.get_rng_state())
    _load({"rng": rng, **{item: _like(dmodel, name, local) if name else local for item, (name, local) in held.items()}},
          path, comm)  # in place: parameters in their own storage
    _put_loaded(dmodel, opt, held, objects, hyper)
    torch.set_rng_state(rng)
    _load_compressor(dmodel, path, meta, comm)
    _RESUMED[os.path.dirname(os.path.realpath(path))] = os.path.basename(os.path.realpath(path))
    return objects["step"], objects["extra"]


@ledger.called("checkpoint.hand_over(old, old_opt, new, new_opt)")
def hand_over(old, old_opt: torch.optim.Optimizer | None, new, new_opt: torch.optim.Optimizer | None) -> int:
    """What `save` of `old` (and its optimizer) and `load` into `new` would do, through messages
    between the ranks instead of a directory: the parameters, buffers, optimizer state and
    hyper-parameters of `old` go to `new`, the same model wrapped under another plan on the same
    ranks (the pipeline rebalancer's move: the cuts, device groups and shares may all differ).
    Each tensor goes from a rank that holds it to each rank that needs it and lacks it, once, and
    is cast to the new model's dtype where the two differ (as a load casts); the parameters no
    node uses go too, into the model `new` wrapped; the random generators stay as they are
    (alike on every rank already). Both sides must hold their tensors whole on each rank, as a
    pipeline stage does (a ValueError for a sharded one: hap.HAP's state moves with
    dmodel.reshard). The same refusals as `load` (a tensor one model holds and the other lacks
    or holds in another shape, another optimizer class, parameters in one side's groups alone),
    on every rank, before anything moves. Returns the bytes this rank received. A collective."""
    comm = new.comm
    kind, groups = _model_groups(old, old_opt)
    new_kind, new_groups = _model_groups(new, new_opt)
    items: dict[str, Any] = {}
    refused = None
    try:
        items = {f"model/{key}": value for key, value in state_dict(old).items()}
        if old_opt is not None:
            items.update(_flat_optimizer({**optimizer_state_dict(old, old_opt), "param_groups": groups}))
        items.pop("optim/param_groups", None)  # (the same on every rank: _model_groups)
        sharded = next((item for item, value in items.items() if isinstance(value, ShardedTensor)), None)
        if sharded is not None:
            raise ValueError(f"{sharded.removeprefix('model/')!r} is sharded under the old plan, and a hand-over moves "
                             "whole tensors (a pipeline stage's): move hap.HAP's state with dmodel.reshard, or through "
                             "checkpoint.save and checkpoint.load")
        if new_kind is not None and kind != new_kind:
            raise ValueError(f"the old plan's optimizer is of class {kind}, the new one's {new_kind}" if kind else
                             "the old plan had no optimizer, and its state is what a hand-over moves")
        if new_kind is not None:
            _check_groups(new_groups, groups, "the old plan's optimizer")
    except ValueError as e:
        refused = f"checkpoint.hand_over: {e}"
    held = gather_or_refuse({item: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("object", v)
                             for item, v in items.items()}, refused, comm)
    wanted, objects, hyper, refused = {}, {}, None, None
    try:
        wanted = _handed_model_items(new, held)
        if new_opt is not None:
            kept = {item: None if entry[0] == "object" else entry for rank in held for item, entry in rank.items()}
            for item, slot in _optimizer_items(new, new_opt, kept).items():
                if slot is None:
                    objects[item] = next(rank[item][1] for rank in held if item in rank)
                else:
                    wanted[item] = slot
            hyper = _loaded_hyper(new, new_opt, groups)
    except ValueError as e:
        refused = f"checkpoint.hand_over: {e}"
    wants = gather_or_refuse(sorted(wanted), refused, comm)
    received = _exchange(items, {item: local for item, (_, local) in wanted.items()}, held, wants, comm)
    _put_loaded(new, new_opt, wanted, objects, hyper)
    return received


def _put_loaded(dmodel, opt: torch.optim.Optimizer | None, loaded: dict[str, tuple], objects: dict[str, Any],
                hyper: list[dict] | None) -> None:
    """What load and hand_over end with, the parameters filled in place already: the loaded
    buffers into the model (replaced, as a forward does), and into `opt` the loaded state
    (`loaded`: item -> (graph tensor or None, its local tensor); `objects`: the items that are
    no tensor) with the hyper-parameters each group was saved with."""
    ex, graph = dmodel.executor, dmodel.graph
    for name in _persistent(dmodel):
        if name in ex.buffers:
            ex.buffers[name] = loaded[f"model/{graph.tensors[name].target}"][1]
    if opt is not None:
        values = {**{item: local for item, (_, local) in loaded.items()}, **objects}
        opt.load_state_dict(_torch_optimizer_state(dmodel, opt, values, hyper))


def groups_like(old, old_opt: torch.optim.Optimizer | None, new) -> list[dict]:
    """This rank's parameters of `new` in parameter groups as the optimizers of `old` (over all
    ranks) held them, each group with the hyper-parameters they were trained with, in the old
    groups' order (none empty): what to build `new`'s optimizer from, `make(groups_like(...))`,
    so that hand_over finds each parameter in a group of its own settings (AdamW without
    weight decay for biases and norms, as transformers' Trainer groups them; one group of the
    optimizer's defaults was refused). Parameters no old optimizer held are left out, as they
    were. A collective."""
    _, groups = _model_groups(old, old_opt)
    mine = {new.graph.tensors[name].target: p for name, p in new.executor.params.items()}
    out: list[dict] = []
    for group in groups:
        # (group i of two stages' optimizers may be set apart: `hyper_of`, a group each)
        made: list[dict] = []
        for key in group["params"]:
            if key not in mine:
                continue
            hyper = _hyper(group, key)
            found = next((g for g in made if _same_hyper(hyper, _hyper(g))), None)
            if found is None:
                found = {**hyper, "params": []}
                made.append(found)
            found["params"].append(mine[key])
        out += made
    return out


def _handed_model_items(new, held: list[dict[str, tuple]]) -> dict[str, tuple[str | None, torch.Tensor]]:
    """The model's items `new` needs on this rank (item -> (graph tensor or None for a parameter
    no node uses, the local tensor to fill in place: a parameter's own storage, or the wrapped
    model's)), each held by some rank in the shape it needs; a ValueError where one model holds
    a tensor the other lacks."""
    graph = new.graph
    shapes = {**model_shapes(graph), **idle_shapes(graph)}
    lacked = next((item for rank in held for item in rank
                   if item.startswith("model/") and item.removeprefix("model/") not in shapes), None)
    if lacked is not None:
        raise ValueError(f"the old plan holds {lacked.removeprefix('model/')!r}, which the new model lacks (another model?)")
    places = {graph.tensors[name].target: (name, _empty_local(new.executor, name)) for name in _persistent(new)}
    places.update({key: (None, value.detach()) for key, value in idle_state(new).items()})
    out = {}
    for key, place in places.items():
        found = next((rank[f"model/{key}"] for rank in held if f"model/{key}" in rank), None)
        if found is None and place[0] is None:  # (optional, as load has them: older checkpoints lack them)
            continue
        if found is None:
            raise ValueError(f"no rank holds {key!r} under the old plan (another model?)")
        if found[0] != tuple(shapes[key]):
            raise ValueError(f"{key!r} is {found[0]} under the old plan but {tuple(shapes[key])} under the new one")
        out[f"model/{key}"] = place
    return out


def _exchange(items: dict[str, Any], wanted: dict[str, torch.Tensor], held: list[dict], wants: list[list[str]],
              comm) -> int:
    """Fill each of this rank's `wanted` tensors with its value among some rank's `items`: its
    own where it holds one, else the first holder's, sent point to point (as bytes: any dtype;
    received in the sender's dtype and cast). Every rank lists the same transfers in one order
    and tags each by its place in the list, so all are in flight at once and none waits on
    another. Returns the bytes received."""
    works, casts, received = [], [], 0
    transfers = sorted((item, r) for r, items_wanted in enumerate(wants) for item in items_wanted)
    for tag, (item, dst) in enumerate(transfers):
        src = dst if item in held[dst] else next(r for r, rank in enumerate(held) if item in rank)
        if comm.rank == dst == src:
            wanted[item].copy_(items[item])
        elif comm.rank == src and items[item].numel():
            works.append(wire.isend(items[item].detach().contiguous().reshape(-1).view(torch.uint8),
                                    global_rank(comm, dst), tag=tag))
        elif comm.rank == dst and wanted[item].numel():
            buf = wanted[item]
            if buf.dtype != held[src][item][1]:  # (a model cast to another dtype between the two)
                buf = torch.empty(buf.shape, dtype=held[src][item][1], device=buf.device)
                casts.append((wanted[item], buf))
            works.append(wire.irecv(buf.view(-1).view(torch.uint8), global_rank(comm, src), tag=tag))
            received += buf.numel() * buf.element_size()
    for work in works:
        work.wait()
    for out, buf in casts:
        out.copy_(buf)
    return received


def _compressor_key(dmodel, name: str, rows: tuple[int, int] | None) -> str:
    """Where a checkpoint keeps PowerSGD's state of parameter `name`'s part `rows` (ending in /)."""
    where = "whole" if rows is None else f"rows{rows[0]}+{rows[1]}"
    return f"{_POWERSGD}{dmodel.graph.tensors[name].target}/{where}/"


def _compressor_items(dmodel) -> dict[str, torch.Tensor]:
    """PowerSGD's state for a checkpoint (a collective): per part it compresses, the ranks'
    error feedback summed, and Q (the same on every rank). The sum is all a later step needs:
    the ranks all-reduce P = sum(M) Q and Q = sum(M)^T P^, and leave errors summing to
    sum(M) - P^ P^T sum(M), with M = gradient + error; so a load gives the whole sum to one
    rank, under any number of ranks, and trains on as the saved run would (up to rounding)."""
    sync = getattr(dmodel, "grad_sync", None)  # (a pipeline has none)
    state = sync.compressor_state() if sync is not None else {}
    if not state:
        return {}
    errors = [err for err, _ in state.values()]
    summed = torch.cat([e.detach().reshape(-1).double() for e in errors])
    dist.all_reduce(summed, group=dmodel.comm.group)
    out = {}
    for ((name, rows), (err, q)), total in zip(state.items(), summed.split([e.numel() for e in errors])):
        key = _compressor_key(dmodel, name, rows)
        out[key + "error"] = total.view(err.shape).to(err.dtype)
        out[key + "q"] = q.detach().clone()
    return out


def _load_compressor(dmodel, path: str, meta: Metadata, comm) -> None:
    """Give PowerSGD its saved state where this run compresses a part as the saved run did
    (the error sum to rank 0, zero elsewhere: see _compressor_items); a warning names what
    this run cannot take (a part it does not compress, or of another shape), which starts
    afresh as it would without a checkpoint. A collective."""
    sync = getattr(dmodel, "grad_sync", None)
    mine = sync.compressor_state() if sync is not None else {}
    saved = {k[:k.rindex("/") + 1] for k in meta.state_dict_metadata if k.startswith(_POWERSGD)}
    keys = {part: _compressor_key(dmodel, *part) for part in mine}  # (the same on every rank: the plan's)
    items = {}
    for part, (err, q) in mine.items():
        for what, t in (("error", err), ("q", q)):
            size = getattr(meta.state_dict_metadata.get(keys[part] + what), "size", None)
            if size is not None and tuple(size) == tuple(t.shape):
                items[keys[part] + what] = torch.empty_like(t)
    if items:
        _load(items, path, comm)
    state = {part: (items[keys[part] + "error"] if comm.rank == 0 else torch.zeros_like(err), items.get(keys[part] + "q"))
             for part, (err, _) in mine.items() if keys[part] + "error" in items}
    if state:
        sync.restore_compressor_state(state)
    dropped = sorted(saved - {keys[part] for part in state})
    if dropped and comm.rank == 0:
        warnings.warn(f"checkpoint {path}: PowerSGD's error feedback of {len(dropped)} part(s) "
                      f"({dropped[0][len(_POWERSGD):-1]}{', ...' if len(dropped) > 1 else ''}) is dropped: "
                      "this run does not compress them as the saved run did", stacklevel=2)


def latest(directory: str) -> tuple[str, int] | None:
    """The latest complete checkpoint under `directory` and its step, or None; a ValueError
    where `latest` names no checkpoint there (a damaged directory)."""
    if os.path.isfile(directory):
        raise ValueError(f"{directory} is a file, not a directory of checkpoints")
    try:
        with open(os.path.join(directory, POINTER), errors="replace") as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    except OSError as e:  # a directory named latest, no permission: said on every rank (load), not raised on one
        raise ValueError(f"{directory}/{POINTER} does not read ({e.strerror or type(e).__name__}): the directory is damaged") from None
    found = _NAME.fullmatch(name)
    if not found:
        raise ValueError(f"{directory}/{POINTER} names {name[:40]!r}, not a checkpoint: the directory is damaged")
    if not os.path.isdir(os.path.join(directory, name)):
        raise ValueError(f"{directory}/{POINTER} names {name}, which is not there: the directory is damaged")
    return os.path.join(directory, name), int(found.group(1))


def checkpoints(directory: str) -> list[tuple[str, int]]:
    """The checkpoints under `directory` (path, step), newest step first (of a step saved again,
    the last save first): what a resume may name where the latest is damaged (none of them
    verified here)."""
    try:
        names = [n for n in os.listdir(directory) if _NAME.fullmatch(n) and os.path.isdir(os.path.join(directory, n))]
    except OSError:
        return []
    found = [(os.path.join(directory, n), int(_NAME.fullmatch(n).group(1))) for n in names]
    return sorted(found, key=lambda f: tuple(-x for x in _order(os.path.basename(f[0]))))  # a step saved again: its last first


def metadata(path: str) -> Metadata:
    """The checkpoint's metadata, having checked that every file it lists is there, whole; a
    ValueError naming what is damaged."""
    try:
        meta = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise ValueError(f"{path} is not a checkpoint (no .metadata)") from None
    except Exception as e:  # a truncated or garbled pickle raises about anything
        raise ValueError(f"checkpoint {path} is damaged: its .metadata does not load ({type(e).__name__})") from None
    if not isinstance(meta, Metadata):
        raise ValueError(f"checkpoint {path} is damaged: its .metadata holds a {type(meta).__name__}")
    for info in (meta.storage_data or {}).values():
        file = os.path.join(path, info.relative_path)
        if not os.path.isfile(file) or os.path.getsize(file) < info.offset + info.length:
            raise ValueError(f"checkpoint {path} is damaged: {info.relative_path} is "
                             f"{'missing' if not os.path.isfile(file) else 'cut short'}")
    return meta


def saved_optimizer(path: str, meta: Metadata | None = None) -> str | None:
    """The class name of the optimizer whose state the checkpoint at `path` holds ("SGD"), ""
    where it does not say (an older hap's), None where it holds none; read in this process
    alone (hap train asks before its ranks start)."""
    meta = meta or metadata(path)
    if "optim/param_groups" not in meta.state_dict_metadata:
        return None
    if "optim/kind" not in meta.state_dict_metadata:
        return ""
    items: dict[str, Any] = {"optim/kind": None}
    _load(items, path, None)
    return items["optim/kind"]


def check(path: str, shapes: dict[str, tuple[int, ...]], meta: Metadata | None = None,
          optional: dict[str, tuple[int, ...]] | None = None) -> None:
    """A ValueError unless the checkpoint at `path` holds exactly the model tensors `shapes`
    names (state-dict key -> whole shape), each whole, and any of the `optional` ones (the idle
    parameters: checkpoints of older hap versions lack them) in their shapes."""
    optional = optional or {}
    meta = meta or metadata(path)
    if "step" not in meta.state_dict_metadata:
        raise ValueError(f"{path} is not a hap checkpoint")
    held = {k.removeprefix("model/"): md for k, md in meta.state_dict_metadata.items() if k.startswith("model/")}
    for key, shape in shapes.items():
        if key not in held:
            raise ValueError(f"checkpoint {path} has no {key!r}, which the model needs "
                             "(a checkpoint of another model?)")
        if tuple(held[key].size) != tuple(shape):
            raise ValueError(f"{key!r} is {tuple(held[key].size)} in checkpoint {path} but {tuple(shape)} in the model")
        if sum(_volume(c.sizes) for c in held[key].chunks) != _volume(shape):
            raise ValueError(f"checkpoint {path} holds only part of {key!r}")
    for key in set(held) & set(optional):
        if tuple(held[key].size) != tuple(optional[key]):
            raise ValueError(f"{key!r} is {tuple(held[key].size)} in checkpoint {path} but {tuple(optional[key])} in the model")
    extra = sorted(set(held) - set(shapes) - set(optional))
    if extra:
        raise ValueError(f"checkpoint {path} holds {extra[0]!r}, which the model lacks "
                         "(a checkpoint of another model?)")


def _commit(staging: str, directory: str, step: int, keep: int | None, sums: dict[str, str],
            resumed: str | None = None) -> str:
    """Rank 0, once every rank has written: record the files' checksums, rename the staging
    directory into place, log it (after `resumed`, the checkpoint this run resumed from, logged
    again) in COMMITS, point `latest` at it (the commit), and drop what is no longer needed. The
    log comes before the pointer: a crash between the two leaves the new checkpoint logged and
    the pointer at the one before (the other order left the latest unlogged: the oldest to keep=)."""
    with open(os.path.join(staging, CHECKSUMS), "w") as f:
        json.dump(sums, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    # this step saved before: the next repeat (step-00000012.1, .2, ...), so that (step, repeat)
    # orders the saves in time and none is replaced before the commit
    repeats = [repeat for at, repeat in (_order(e) for e in os.listdir(directory) if _NAME.fullmatch(e)) if at == step]
    name = f"step-{step:08d}" + (f".{max(repeats) + 1}" if repeats else "")
    final = os.path.join(directory, name)
    os.rename(staging, final)
    _fsync_dir(directory)
    lineage = [resumed] if resumed is not None and resumed != name and os.path.isdir(os.path.join(directory, resumed)) else []
    with open(os.path.join(directory, COMMITS), "a") as f:
        f.write("".join(f"{entry}\n" for entry in (*lineage, name)))
        f.flush()
        os.fsync(f.fileno())
    pointer = os.path.join(directory, f".{POINTER}.tmp")
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(directory, POINTER))
    _fsync_dir(directory)
    for entry in os.listdir(directory):  # staging directories of saves that died
        if entry.startswith(".tmp-step-"):
            _remove(os.path.join(directory, entry))
    if keep is not None:  # the newest committed: a run resumed from an older step keeps its own, not a later step's
        committed = _commit_order(directory)
        done = sorted((e for e in os.listdir(directory) if _NAME.fullmatch(e) and e != name),
                      key=lambda e: (committed.get(e, -1), _order(e)))  # (saves before the log: by step, first)
        for entry in done[: max(0, len(done) - (keep - 1))]:
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
    return final


def _remove(path: str) -> None:
    """Remove a directory's tree, or a file, at `path`; nothing where there is none."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _commit_order(directory: str) -> dict[str, int]:
    """Checkpoint name -> its place in the order of commits (COMMITS; a name committed again, its
    last place)."""
    try:
        with open(os.path.join(directory, COMMITS), errors="replace") as f:
            return {line.strip(): i for i, line in enumerate(f)}
    except OSError:
        return {}


def _order(name: str) -> tuple[int, int]:
    """A checkpoint directory's place in time: its step, then its repeat (step-00000012.1)."""
    found = _NAME.fullmatch(name)
    return int(found.group(1)), int(found.group(2)[1:]) if found.group(2) else 0


def _checksums(staging: str, comm) -> dict[str, str]:
    """The SHA-256 of every file written into `staging` (a directory every rank reads), each
    rank hashing an equal share of the files. A collective."""
    files = sorted(os.listdir(staging))
    mine, refused = {}, None
    try:
        mine = {entry: _sha256(os.path.join(staging, entry)) for entry in files[comm.rank::comm.world]}
    except OSError as e:
        refused = f"checkpoint save: {staging} does not read back: {e}"
    return {entry: digest for share in gather_or_refuse(mine, refused, comm) for entry, digest in share.items()}


def verify(path: str, comm=None) -> None:
    """A ValueError naming a file of the checkpoint at `path` whose bytes are not those written
    (a flipped bit loads silently otherwise), or that is missing or does not read; checkpoints
    without checksums pass. With `comm`, a collective: each rank checks an equal share of the
    files, and every rank raises."""
    if comm is None:
        return _verify_share(path, 0, 1)
    refused = None
    try:
        _verify_share(path, comm.rank, comm.world)
    except ValueError as e:
        refused = str(e)
    gather_or_refuse(None, refused, comm)


def _verify_share(path: str, share: int, shares: int) -> None:
    try:
        with open(os.path.join(path, CHECKSUMS)) as f:
            sums = json.load(f)
    except FileNotFoundError:  # a checkpoint from before checksums passes; one whose save wrote them, not
        if _CHECKSUMMED in metadata(path).state_dict_metadata:
            raise ValueError(f"checkpoint {path} is damaged: its {CHECKSUMS} is missing") from None
        return
    except (ValueError, OSError):
        raise ValueError(f"checkpoint {path} is damaged: its {CHECKSUMS} does not load") from None
    if not isinstance(sums, dict):
        raise ValueError(f"checkpoint {path} is damaged: its {CHECKSUMS} holds no checksums")
    # the save hashed every file DCP wrote: one it lists not (an emptied list) would load unchecked
    unlisted = sorted(e for e in os.listdir(path) if (e == ".metadata" or e.endswith(".distcp")) and e not in sums)
    if unlisted:
        raise ValueError(f"checkpoint {path} is damaged: its {CHECKSUMS} does not list {unlisted[0]}")
    for entry, want in sorted(sums.items())[share::shares]:
        file = os.path.join(path, entry)
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint {path} is damaged: {entry} is missing")
        try:
            got = _sha256(file)
        except OSError as e:
            raise ValueError(f"checkpoint {path} is damaged: {entry} does not read ({e.strerror or e})") from None
        if got != want:
            raise ValueError(f"checkpoint {path} is damaged: {entry} does not match its checksum")


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _resolve(directory: str) -> str | None:
    """The checkpoint `load` reads: the latest under `directory`, or `directory` itself."""
    found = latest(directory)
    if found is not None:
        return found[0]
    return directory if os.path.exists(os.path.join(directory, ".metadata")) else None


def _load(items: dict[str, Any], path: str, comm) -> None:
    """DCP fills the tensors among `items` in place and replaces the other values. Items are
    keys as given, not flattened (as saved): `extra` and the optimizer's groups are one object
    each. comm None: read in this process alone (no process group)."""
    try:
        with quiet_sharded_tensors(), warnings.catch_warnings():
            if comm is None:  # (DCP then says it reads in one process, as meant)
                warnings.simplefilter("ignore", UserWarning)
            dcp.load(items, storage_reader=dcp.FileSystemReader(path), no_dist=comm is None,
                     process_group=None if comm is None else comm.group,
                     planner=dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    except CheckpointException as e:  # a BaseException of every rank's tracebacks: one line instead
        raise ValueError(f"checkpoint {path} does not load ({_first_failure(e)})") from None


def _first_failure(e: CheckpointException) -> str:
    """The first failing rank's exception of DCP's collective one, in one line."""
    exc = next((exc for exc, _ in e.failures.values()), None)
    why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}" if exc is not None else "unknown"
    return why[:200]


def _fsync_dir(path: str) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _opt_params(dmodel, opt: torch.optim.Optimizer) -> list[list[tuple[str, str, torch.Tensor]]]:
    """Per optimizer parameter group, its parameters as (graph tensor, state-dict key, parameter)."""
    name_of = {id(p): name for name, p in dmodel.executor.params.items()}
    out = []
    for group in opt.param_groups:
        if any(id(p) not in name_of for p in group["params"]):
            raise ValueError("the optimizer holds a tensor that is not one of dmodel.parameters()")
        out.append([(name_of[id(p)], dmodel.graph.tensors[name_of[id(p)]].target, p) for p in group["params"]])
    return out


def _flat_optimizer(osd: dict[str, Any]) -> dict[str, Any]:
    """optimizer_state_dict as DCP items: optim/state/<key>/<name>, optim/param_groups."""
    items = {f"{_STATE}{key}/{name}": v for key, state in osd["state"].items() for name, v in state.items()}
    items["optim/param_groups"] = osd["param_groups"]
    return items


def _optimizer_items(dmodel, opt: torch.optim.Optimizer,
                     kept: dict[str, tuple[tuple[int, ...], torch.dtype] | None]) -> dict[str, tuple | None]:
    """The state items for the optimizer's parameters among those `kept` (item -> its whole
    shape and dtype, or None for a value that is no tensor): item -> (the graph tensor it is
    sharded like or None, the local tensor to fill), or None for a value that is no tensor.
    A tensor of its parameter's whole shape is loaded as this rank's part, others whole (a
    ValueError where such a tensor spans a sharded parameter: see executor.per_element)."""
    params = {key: (name, p) for group in _opt_params(dmodel, opt) for name, key, p in group}
    out = {}
    for item, m in kept.items():
        key = item.removeprefix(_STATE).rpartition("/")[0]
        if not item.startswith(_STATE) or key not in params:  # other parameters: _check_groups says so
            continue
        name, p = params[key]
        if m is None:
            out[item] = None
        elif per_element(item.rpartition("/")[2], m[0], dmodel.graph.tensors[name].shape, key,
                         dmodel.executor.stored[name][0].is_shard):  # (else a ValueError where sharded)
            out[item] = (name, torch.empty(p.shape, dtype=m[1]))
        else:
            out[item] = (None, torch.empty(m[0], dtype=m[1]))
    return out


def _kept(meta: Metadata) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
    """What a checkpoint holds, as _optimizer_items reads it: item -> (whole shape, dtype), or
    None for an object."""
    return {item: None if isinstance(m, BytesStorageMetadata) else (tuple(m.size), m.properties.dtype)
            for item, m in meta.state_dict_metadata.items()}


def _model_groups(dmodel, opt: torch.optim.Optimizer | None) -> tuple[str | None, list[dict]]:
    """The optimizers' class name and parameter groups as a checkpoint records them:
    hyper-parameters and the state-dict keys of the group's parameters on every rank, in rank
    order (a pipeline stage's optimizer holds its own stage's; a rank with no parameters may
    have none). A collective; a ValueError on every rank where one rank's optimizer is wrong."""
    kind, mine, refused = None if opt is None else type(opt).__qualname__, [], None
    try:
        if opt is not None:
            mine = [(group_settings(g), [key for _, key, _ in params])
                    for g, params in zip(opt.param_groups, _opt_params(dmodel, opt))]
    except ValueError as e:
        refused = str(e)
    every = gather_or_refuse((kind, mine), refused, dmodel.comm)
    kinds = sorted({k for k, _ in every if k is not None})
    if len(kinds) > 1:
        raise ValueError(f"the ranks' optimizers are of different kinds: {', '.join(kinds)}")
    groups: list[dict] = []
    for _, ranks_groups in every:
        for i, (hyper, keys) in enumerate(ranks_groups):
            if i == len(groups):
                groups.append({**hyper, "params": [], "hyper_of": {}})
            new = [key for key in keys if key not in groups[i]["params"]]
            groups[i]["params"] += new
            if not _same_hyper(hyper, _hyper(groups[i])):  # group i of another stage, set otherwise
                groups[i]["hyper_of"].update({key: hyper for key in new})
    return (kinds[0] if kinds else None), groups


def _hyper(group: dict, key: str | None = None) -> dict:
    """A recorded group's hyper-parameters, or those its parameter `key` was trained with (a
    pipeline stage's group i may be set otherwise than another's: `hyper_of`)."""
    own = group.get("hyper_of", {})
    if key is not None and key in own:
        return own[key]
    return {k: v for k, v in group.items() if k not in ("params", "hyper_of")}


def _same_hyper(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else
        (not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor) and x == y)
        for x, y in ((a[k], b[k]) for k in a))


def _loaded_hyper(dmodel, opt: torch.optim.Optimizer, saved: list[dict]) -> list[dict]:
    """Per group of this rank's optimizer, the hyper-parameters its parameters were saved
    with; a ValueError where one group holds parameters saved with different ones."""
    group_of = {key: group for group in saved for key in group["params"]}
    out = []
    for i, params in enumerate(_opt_params(dmodel, opt)):
        found: list[tuple[str, dict]] = []
        for _, key, _ in params:
            hyper = _hyper(group_of[key], key)
            if not any(_same_hyper(hyper, h) for _, h in found):
                found.append((key, hyper))
        if len(found) > 1:
            (a, ha), (b, hb) = found[:2]
            differ = next(k for k in sorted(ha.keys() | hb.keys()) if not _same_hyper({k: ha.get(k)}, {k: hb.get(k)}))
            raise ValueError(f"parameter group {i} holds {a!r} and {b!r}, saved with {differ} {ha.get(differ)!r} and "
                             f"{hb.get(differ)!r}: give them groups of their own, as they were")
        out.append(found[0][1] if found else group_settings(opt.param_groups[i]))
    return out


def _check_groups(groups: list[dict], saved: list[dict], source: str) -> None:
    """The optimizers (over all ranks) must hold the parameters the `source`'s (a checkpoint's,
    the old plan's) do; their groups may differ where each holds parameters saved alike
    (_loaded_hyper)."""
    mine = {key for group in groups for key in group["params"]}
    theirs = {key for group in saved for key in group["params"]}
    differ = sorted(mine ^ theirs)
    if differ:
        where = "the optimizer" if differ[0] in mine else source
        raise ValueError(f"{differ[0]!r} is in {where}'s parameter groups alone")


def _torch_optimizer_state(dmodel, opt: torch.optim.Optimizer, values: dict[str, Any], hyper: list[dict]) -> dict:
    """The loaded optimizer state as torch's Optimizer.load_state_dict takes it: parameters
    numbered in this optimizer's order, hyper-parameters per group as saved (_loaded_hyper)."""
    by_key: dict[str, dict[str, Any]] = {}
    for item, v in values.items():
        if item.startswith(_STATE):
            key, _, name = item.removeprefix(_STATE).rpartition("/")
            by_key.setdefault(key, {})[name] = v
    groups, state, index = [], {}, 0
    for params, old in zip(_opt_params(dmodel, opt), hyper):
        groups.append({**old, "params": list(range(index, index + len(params)))})
        for _, key, _ in params:
            if key in by_key:
                state[index] = by_key[key]
            index += 1
    return {"state": state, "param_groups": groups}


def _empty_local(ex, name: str) -> torch.Tensor:
    """Where DCP loads a parameter (in place: its own storage) or a buffer (a new tensor of
    its local shape, replacing it)."""
    if name in ex.params:
        return ex.params[name].detach()
    return torch.empty_like(ex.buffers[name], memory_format=torch.contiguous_format)


def _like(dmodel, name: str, local: torch.Tensor):
    """`local`, this rank's part of a tensor laid out like graph tensor `name`, as DCP takes it:
    itself where every rank holds it whole, else a sharded tensor that knows its rows."""
    ex = dmodel.executor
    p, seg = ex.stored[name]
    assert p.kind != "P", f"{name} kept as a partial sum"
    shape = tuple(dmodel.graph.tensors[name].shape)
    if not p.is_shard or _volume(shape) == 0:
        return local
    sizes = ex.sizes(name, p, seg)
    assert local.shape[p.dim] == sizes[dmodel.comm.rank], f"{name}: {tuple(local.shape)}, not this rank's of {sizes}"
    comm = dmodel.comm
    return sharded_tensor(local, shape, p.dim, sizes, comm.rank,
                          [f"rank:{global_rank(comm, r)}/{local.device}" for r in range(comm.world)], comm.group,
                          repr(dmodel.graph.tensors[name].target))


def _volume(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

