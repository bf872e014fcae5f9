"""A training run under a straggler policy on local ranks: the small ViT on the bundled digits,
tensor parallel (every linear weight split, planner "megatron"), or with pipeline=True a
pipeline (pp-exact), one process per rank.

    from hap.straggler.run import RunSpec, run
    result = run(RunSpec(policy="zero-pri", schedule="round-robin:chi=8,every=22", epochs=10))
    result["test_accuracy"], result["seconds_per_iteration"]

The straggler-free reference is policy "none" with schedule "none".
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(kw_only=True, slots=True)
class RunSpec:
    policy: str = "none"
    """A policy of hap.straggler.POLICIES."""
    schedule: str = "none"
    """A schedule's text form (hap.straggler.schedule)."""
    method: str = "broadcast-reduce"
    world: int = 4
    epochs: int = 10
    batch: int = 64
    lr: float = 1e-3
    optimizer: str = "adam"
    """"adam", or "sgd" (momentum 0.9): Adam turns a gradient that is zero up to rounding (the
    attention keys' bias) into full-size steps, so it cannot show exactness over many steps."""
    hidden: int = 256
    layers: int = 2
    seed: int = 0
    steps: int | None = None
    """Stop after this many steps (None: all epochs)."""
    handover: tuple[float, ...] | None = None
    """Policy "migrate" with these fixed shares handed over per rank (Table I)."""
    pipeline: bool = False
    """Train the ViT as a pipeline of `world` stages (pp-exact's cut) instead of tensor parallel;
    policies none and rebalance (hap/pipeline/rebalance.py), a straggler slowed in all of its
    computing."""
    timeout_s: float = 300.0


def run(spec: RunSpec) -> dict:
    """Train; returns {policy, schedule, seconds_per_iteration (median over steps after the
    first), test_accuracy, final_loss, step_seconds, history (every rank's records),
    parameters (path of the final whole state, torch.save)}."""
    from ..runtime.launch import spawn

    out = tempfile.mkdtemp(prefix="hap-straggler-")
    spawn(_rank_main, spec.world, args=(asdict(spec), out), timeout_s=spec.timeout_s)
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    result["parameters"] = os.path.join(out, "state.pt")
    return result


def _rank_main(rank: int, spec: dict, out: str) -> None:
    from ..cost.cluster import local_cluster
    from ..models.digits import digits_split, epoch_batches, vit_for_digits
    from ..planner import baseline_plan
    from ..runtime.module import HAP
    from .mitigator import Mitigator, StragglerConfig
    from .schedule import parse_schedule

    torch.set_num_threads(1)
    world = spec["world"]
    train, test = digits_split(seed=spec["seed"])
    torch.manual_seed(spec["seed"])
    model = vit_for_digits(hidden=spec["hidden"], layers=spec["layers"], mlp=4 * spec["hidden"])
    example = epoch_batches(train, spec["batch"], 0, spec["seed"])[0]
    cluster = local_cluster((1.0,) * world, f"local-{world}")
    from ..capture import capture

    if spec.get("pipeline"):
        return _pipeline_rank(rank, spec, out, model, example, cluster, train, test)
    graph = capture(model, example)
    dmodel = HAP(model, cluster, example, plan=baseline_plan(graph, cluster, "megatron"), graph=graph)
    opt = _optimizer(spec, list(dmodel.parameters()))
    schedule = parse_schedule(spec["schedule"], world)
    steps_per_epoch = len(epoch_batches(train, spec["batch"], 0, spec["seed"]))
    mit = Mitigator(dmodel, StragglerConfig(policy=spec["policy"], schedule=schedule, method=spec["method"],
                                            epoch=steps_per_epoch, seed=spec["seed"],
                                            handover=tuple(spec["handover"]) if spec.get("handover") else None), opt)
    times, losses, it = [], [], 0
    for epoch in range(spec["epochs"]):
        for images, labels in epoch_batches(train, spec["batch"], epoch, spec["seed"]):
            if spec["steps"] is not None and it >= spec["steps"]:
                break
            mit.begin_step(it)
            loss = dmodel(images, labels, part=False)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            record = mit.end_step()
            times.append(record["wall"])
            losses.append(float(loss.detach()))
            it += 1
    _write_result(rank, spec, out, model, dmodel.full_state_dict(), test, times, losses, mit.history,
                  ratios=dmodel.plan.ratios)


def _optimizer(spec: dict, params: list) -> torch.optim.Optimizer:
    """The run's optimizer: Adam, or "sgd" (momentum 0.9)."""
    if spec.get("optimizer", "adam") == "sgd":
        return torch.optim.SGD(params, lr=spec["lr"], momentum=0.9)
    return torch.optim.Adam(params, lr=spec["lr"])


def _write_result(rank: int, spec: dict, out: str, model, state: dict, test, times: list[float], losses: list[float],
                  history: list[dict], **extra) -> None:
    """Every rank's history gathered; on rank 0 the final whole state (state.pt) and
    result.json: run()'s fields and `extra`. A collective."""
    import torch.distributed as dist

    from ..models.digits import accuracy

    histories = [None] * spec["world"]
    dist.all_gather_object(histories, history)
    if rank == 0:
        model.load_state_dict(state)
        torch.save(state, os.path.join(out, "state.pt"))
        result = {"policy": spec["policy"], "schedule": spec["schedule"], "method": spec["method"],
                  "seconds_per_iteration": statistics.median(times[1:] or times), "step_seconds": times,
                  "mean_seconds_per_iteration": sum(times[1:]) / max(1, len(times) - 1),
                  "test_accuracy": accuracy(model, test), "final_loss": losses[-1], "losses": losses,
                  "history": histories, **extra}
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


def _pipeline_rank(rank: int, spec: dict, out: str, model, example, cluster, train, test) -> None:
    """_rank_main for RunSpec(pipeline=True): pp-exact's pipeline of `world` stages, trained under
    the pipeline rebalancer; its records in the mitigator's form (nothing pruned or migrated; a
    move counts as a reshard)."""
    from ..capture import capture
    from ..models.digits import epoch_batches
    from ..pipeline.plan import exact_plan
    from ..pipeline.rebalance import RebalanceConfig, Rebalancer
    from ..pipeline.runtime import Pipeline
    from ..planner import PlannerConfig
    from .schedule import parse_schedule

    world = spec["world"]
    graph = capture(model, example)
    plan = exact_plan(graph, cluster, PlannerConfig(pipeline_stages=world))

    def make(params):  # a stage may hold no parameters (the loss alone)
        return _optimizer(spec, params) if params else None

    pipe = Pipeline(model, cluster, example, plan, graph=graph)
    reb = Rebalancer(pipe, make(list(pipe.parameters())), example,
                     RebalanceConfig(policy=spec["policy"], schedule=parse_schedule(spec["schedule"], world)), make)
    times, losses, records, it = [], [], [], 0
    for epoch in range(spec["epochs"]):
        for images, labels in epoch_batches(train, spec["batch"], epoch, spec["seed"]):
            if spec["steps"] is not None and it >= spec["steps"]:
                break
            t0 = time.perf_counter()
            reb.begin_step(it)
            loss = reb.pipe.train_step(images, labels)
            if reb.opt is not None:
                reb.opt.step()
                reb.opt.zero_grad(set_to_none=True)
            moved = reb.end_step()["moved"]
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
            records.append({"iteration": it, "rank": rank, "wall": times[-1], "pruned": 0.0, "migrated": 0.0,
                            "resharded": int(moved is not None), "beta": None, "moved": moved})
            it += 1
    _write_result(rank, spec, out, model, reb.pipe.full_state_dict(), test, times, losses, records, speeds=reb.speeds,
                  stages=[[st.nodes, st.devices] for st in reb.pipe.plan.stages])
