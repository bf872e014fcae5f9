"""The `hap` command line.

    hap plan --model vit --layers 24 --cluster paper-hetero-8 --json out.json
    hap train --model vit --scale small --cluster local --steps 20 [--planner dp-ev]
    hap train --model vit --steps 100 --checkpoint ckpt --checkpoint-every 10 [--resume]
    hap train --model vit --scale small --cluster local --planner megatron --straggler zero-pri --straggler-schedule round-robin:chi=8,every=5 --steps 20
    hap sync --model vgg19 --scale small --cluster C.yaml --trials 50 --out sync/  # AutoSync
    hap train --model vgg19 --scale small --cluster C.yaml --plan sync/plan.json   # train with it
    hap profile --cluster local -o local-profiled.yaml   # measure devices and collectives
    hap clusters                      # list the built-in clusters
    hap cluster paper-hetero-8        # show one (or a YAML file) as the planner reads it

Bad input gets one line on stderr naming the problem and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import time
from pathlib import Path

DEFAULT_LR = 0.05
"""hap train's SGD learning rate where --lr is not given (nor a checkpoint's, on --resume)."""
TRAIN_OPTIMIZER = "momentum"
"""What hap train trains with (SGD with momentum 0.9), whose state its plans' memory counts."""
TRAIN_OPTIMIZER_CLASS = "SGD"
"""Its class, as a checkpoint names it (torch.optim.SGD)."""


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="vgg19, vit, bert, bert-moe, ncf or ncf-sparse")
    p.add_argument("--layers", type=int, help="transformer layers (default: the paper's)")
    p.add_argument("--hidden", type=int, help="hidden width (default: the paper's)")
    p.add_argument("--batch", type=int, help="global batch (default at paper scale: 64 per GPU, 32 for bert-moe; "
                                             "--scale small: the small model's)")
    p.add_argument("--seq", type=int, help="sequence length (bert, bert-moe)")
    p.add_argument("--experts", type=int, help="experts per MoE layer (bert-moe; default 2 per GPU)")
    p.add_argument("--scale", choices=["paper", "small"], default="paper", help="paper size or a tiny CPU variant")
    p.add_argument("--dropout", type=float, help="dropout probability (default: the model's)")


MODEL_KNOBS = ("layers", "hidden", "batch", "seq", "experts", "scale", "dropout")
"""The model options of _add_model_args that hap.models.build takes."""


def _model_knobs(args) -> dict:
    """The model options given (args: the parsed command line, or its dict), for hap.models.build."""
    given = args if isinstance(args, dict) else vars(args)
    return {k: given[k] for k in MODEL_KNOBS if given.get(k) is not None}


def _add_pipeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline-stages", type=int, metavar="K",
                   help="pipeline planners: stages (default: the best of 2, 4, 8 and, on up to 8 devices, one per device)")
    p.add_argument("--micro-batches", type=int, metavar="M",
                   help="pipeline planners: micro-batches per iteration (default: the best of K, 2K, 4K)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], help="pipeline planners: the schedule (default: 1f1b)")


def _planner_config(args, planner: str):
    """The PlannerConfig of the command line; `planner` names what plans (a pipeline flag for
    anything but a pipeline planner would be ignored: a UserError)."""
    from .planner import PlannerConfig
    from .planners import reading

    for flag in ("pipeline_stages", "micro_batches"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    given = [f"--{flag.replace('_', '-')}" for flag in ("pipeline_stages", "micro_batches", "schedule")
             if getattr(args, flag) is not None]
    if given and planner not in reading("pipeline"):
        raise UserError(f"{given[0]} is for the pipeline planners ({', '.join(reading('pipeline'))}), not {planner}")
    if getattr(args, "segments", 1) > 1 and planner not in reading("segments"):
        raise UserError(f"--segments is for the planners {', '.join(reading('segments'))}, not {planner}")
    return PlannerConfig(segments=getattr(args, "segments", 1), pipeline_stages=args.pipeline_stages or 0,
                         micro_batches=args.micro_batches or 0, schedule=args.schedule)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hap", description="SPMD training on heterogeneous clusters by program synthesis")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="synthesize a plan and print its summary")
    _add_model_args(p)
    p.add_argument("--cluster", default="paper-hetero-8", help="built-in cluster name or YAML file")
    p.add_argument("--planner", default="astar", metavar="NAME",
                   help="which planner: astar (hap's synthesis), a pipeline (pp-exact, dqn), operator partitioning "
                        "by the DQN (dqn-opp), auto (the fastest estimate of astar and pp-exact), or a baseline: "
                        "dp-ev, dp-cp, tp, ep, megatron")
    _add_pipeline_args(p)
    p.add_argument("--segments", type=int, default=1, help="model segments with their own ratios")
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    p.add_argument("--listing", action="store_true", help="print the program, one instruction per line")
    p.add_argument("--quiet", action="store_true", help="no progress lines")

    t = sub.add_parser("train", help="train on the local cluster: one process per device, gloo")
    _add_model_args(t)
    t.set_defaults(scale="small")
    t.add_argument("--cluster", default="local", help="built-in cluster name or YAML file (local processes)")
    t.add_argument("--steps", type=int, default=10, help="training iterations")
    t.add_argument("--planner", metavar="NAME",
                   help="which planner: astar (hap's synthesis, the default), a pipeline (pp-exact, dqn), dqn-opp, "
                        "auto, or a baseline: dp-ev, dp-cp, tp, ep, megatron")
    _add_pipeline_args(t)
    t.add_argument("--strategy", choices=["hap", "dp-ev", "dp-cp"],
                   help="the same as --planner (hap: astar), kept for old command lines")
    t.add_argument("--plan", metavar="FILE", help="train with this plan (hap plan --json, hap sync's DIR/plan.json) "
                   "instead of planning")
    t.add_argument("--lr", type=float, help=f"SGD learning rate (momentum 0.9; default {DEFAULT_LR}, or with "
                   "--resume the checkpoint's, which a given --lr replaces)")
    t.add_argument("--clip", type=float, metavar="NORM", help="clip gradients to this global norm")
    t.add_argument("--trace", metavar="DIR", help="write a Chrome trace of the last steps per rank, DIR/rank<r>.json, "
                   "and the plan they ran, DIR/plan.json")
    t.add_argument("--calibrate", action="store_true",
                   help="price the plan (a --plan's too) from the model's own node times measured on this cluster "
                   "(cached in .hap-cache/)")
    t.add_argument("--emulate", action="store_true",
                   help="run a cluster of devices not on this machine as local processes at this machine's speed")
    t.add_argument("--checkpoint", metavar="DIR",
                   help="write sharded checkpoints to DIR (at the last step, and every --checkpoint-every steps)")
    t.add_argument("--checkpoint-every", type=int, metavar="N", help="write a checkpoint every N steps")
    t.add_argument("--resume", nargs="?", const="latest", metavar="STEP",
                   help="continue from the latest checkpoint in --checkpoint DIR, or the one of step STEP there "
                        "(any plan, ratios or cluster size) up to --steps in all, with its learning rate unless "
                        "--lr is given")
    t.add_argument("--straggler", metavar="POLICY", choices=_straggler_policies(), default="none",
                   help="react to slow ranks in the tensor-parallel linear layers (a plan that splits linear weights: "
                        "--planner megatron): " + ", ".join(_straggler_policies()) + " (default none: no mitigator); "
                        "with a pipeline plan, rebalance re-plans the pipeline for the measured speeds (exact)")
    t.add_argument("--straggler-schedule", metavar="TEXT", default="none",
                   help="emulated stragglers: round-robin:chi=8,every=5, multi:chi=8/6/4/2, persistent:chi=8,rank=1 "
                        "(also start=N), or none (the default)")
    t.add_argument("--migration", choices=["broadcast-reduce", "scatter-gather"],
                   help="how migrated columns travel (--straggler migrate, semi, rebalance; default broadcast-reduce)")

    y = sub.add_parser("sync", help="search the gradient synchronization strategy by simulators and trial runs (AutoSync)")
    _add_model_args(y)
    y.add_argument("--cluster", required=True, help="built-in cluster name or YAML file (local processes)")
    y.add_argument("--trials", type=int, default=50, help="trial runs of the search (the baselines' not counted)")
    y.add_argument("--out", required=True, metavar="DIR", help="writes DIR/trials.jsonl (appended: a search "
                   "resumes), DIR/result.json, DIR/plan.json and DIR/autosync.png")
    y.add_argument("--per-round", type=int, default=5, metavar="K", help="strategies run per round")
    y.add_argument("--candidates", type=int, default=200, metavar="M", help="strategies sampled and predicted per round")
    y.add_argument("--simulator", choices=["rnn", "gat", "linear"], default="rnn", help="the learned simulator that ranks")
    y.add_argument("--compress", action="store_true", help="also try fp16 and PowerSGD (approximate: they change training)")
    y.add_argument("--plan", metavar="FILE", help="the plan whose gradients to synchronize (default: data parallel, "
                   "compute-proportional shares)")
    y.add_argument("--seed", type=int, default=0)

    f = sub.add_parser("profile", help="measure a cluster's devices and collectives; write a cluster file")
    f.add_argument("--cluster", default="local", help="built-in cluster name or YAML file (local processes)")
    f.add_argument("-o", "--output", required=True, metavar="FILE", help="the profiled cluster file (YAML)")
    f.add_argument("--quick", action="store_true", help="fewer sizes and repeats")

    x = sub.add_parser("explain", help="draw a plan's iteration per device, its layouts and where the time goes")
    x.add_argument("plan", help="a plan file (hap plan --json, or hap train --trace DIR writes DIR/plan.json)")
    x.add_argument("-o", "--output", default="explain", metavar="DIR", help="where to write (default: explain/)")
    x.add_argument("--trace", metavar="DIR", help="the traces of `hap train --trace DIR`: measured beside the estimate")

    sub.add_parser("clusters", help="list the built-in clusters")
    c = sub.add_parser("cluster", help="show a cluster as the planner reads it")
    c.add_argument("name", help="built-in cluster name or YAML file")
    return ap


def _straggler_policies() -> tuple[str, ...]:
    from .straggler import POLICIES

    return POLICIES


def _build_graph(args, devices: int, say):
    """The graph of the model the command line names, captured as the ranks will capture it
    (models.capture_device)."""
    from .capture import capture
    from .models import build, capture_device, resolve

    try:
        resolve(args.model, devices=devices, **_model_knobs(args))  # (knobs refused before anything is said)
        say(f"building {args.model} ...")  # (a model of 100,000 layers took minutes to build, and said nothing)
        model, inputs = build(args.model, devices=devices, device=capture_device(args.scale), **_model_knobs(args))
    except ValueError as e:  # a knob's own words ("layers must be ..."): named as the flag given
        said = str(e)
        knob = next((k for k in MODEL_KNOBS if said.startswith(f"{k} ") and getattr(args, k, None) is not None), None)
        raise UserError(f"--{said}" if knob else said) from None
    except RuntimeError as e:  # (a --batch or --hidden too large to build on this machine: torch's allocator)
        if "allocate" not in str(e):
            raise
        raise UserError(f"--model {args.model} at scale {args.scale} with these sizes does not fit this machine's "
                        f"memory ({str(e).splitlines()[0][:160]})") from None
    say(f"capturing {args.model} ...")
    return capture(model, inputs, name=args.model)


def cmd_plan(args) -> int:
    from .cost.cluster import load_cluster
    from .planners import make_plan

    cluster = load_cluster(args.cluster)
    _check_planner(args.planner)
    if args.segments < 1:
        raise UserError(f"--segments must be at least 1, got {args.segments}")
    config = _planner_config(args, args.planner)
    say = (lambda msg: None) if args.quiet else (lambda msg: print(f"[hap] {msg}", file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    graph = _build_graph(args, cluster.gpus, say)
    say(f"{graph.summary()} (captured in {time.perf_counter() - t0:.1f} s)")
    say(cluster.describe())
    try:
        result = make_plan(args.planner, graph, cluster, config, progress=say)
    except ValueError as e:  # a baseline this graph has not (ep without experts)
        raise UserError(f"--planner {args.planner}: {str(e).removeprefix(args.planner + ': ')}") from None
    print(result.summary())
    if args.listing:
        print(result.listing())
    if args.json:
        try:
            result.to_json(args.json)
        except OSError as e:  # (a full disk: after all the planning)
            raise UserError(f"--json {args.json}: cannot write it: {e.strerror or e}") from None
        say(f"wrote {args.json}")
    return 0


def cmd_train(args) -> int:
    import json
    import statistics
    import tempfile

    from .cost.cluster import load_cluster
    from .models import capture_device
    from .planners import make_plan
    from .runtime.launch import RankFailed, spawn

    cluster = load_cluster(args.cluster)
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    if args.clip is not None and not args.clip > 0:
        raise UserError(f"--clip must be a positive norm, got {args.clip}")
    if args.lr is not None and not 0 < args.lr < math.inf:  # (inf: NaN from the second step)
        raise UserError(f"--lr must be positive and finite, got {args.lr}")
    resume = _resume_from(args)
    if args.planner is not None and args.strategy is not None:
        raise UserError("give --planner or --strategy, not both")
    if args.plan is not None and (args.planner or args.strategy):  # (--calibrate prices it: kept)
        flag = "--planner" if args.planner else "--strategy"
        raise UserError(f"--plan trains the plan in {args.plan} as it is: {flag} would be ignored")
    if args.calibrate and cluster.size < 2:  # said before any node is timed
        raise UserError(f"--calibrate: calibration needs two devices at least; cluster {cluster.name!r} has {cluster.size}")
    if args.calibrate and os.path.exists(".hap-cache") and not os.path.isdir(".hap-cache"):  # (said after calibrating)
        raise UserError("--calibrate: .hap-cache is a file here; the node times are cached in a directory of that name")
    planner = _check_planner(args.planner or {"hap": "astar", None: "astar"}.get(args.strategy, args.strategy))
    config = _planner_config(args, planner if args.plan is None else f"the plan in {args.plan}")
    config = dataclasses.replace(config, optimizer=TRAIN_OPTIMIZER)  # (its state counts in the memory priced)
    straggling = _check_straggler(args, cluster.size)
    say = lambda msg: print(f"[hap] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if not cluster.local and not args.emulate:
        raise UserError(f"cluster {cluster.name!r} describes {cluster.gpus} GPUs that are not on this machine; hap train "
                        "runs one local process per device: use a local cluster (local, local-homo, local-4, a file "
                        "`hap profile` wrote) or pass --emulate to run its devices here at this machine's speed")
    if not cluster.local:
        say(f"emulating {cluster.name}'s {cluster.size} devices as local processes at this machine's speed (--emulate)")
    elif args.emulate:
        say(f"--emulate does nothing here: cluster {cluster.name!r} is local (its slowdowns and emulated links run as "
            "the file says)")
    graph = _build_graph(args, cluster.gpus, say)
    if resume is not None:
        _check_checkpoint(resume[0], graph, args, cluster.gpus)
        args.resume_path = resume[0]  # the ranks load the checkpoint checked here, not hashing it again
        say(f"resuming from {resume[0]} (step {resume[1]}), learning rate "
            + ("the checkpoint's" if args.lr is None else f"{args.lr} (replacing the checkpoint's)"))
    say(cluster.describe())
    given = _plan_file(args.plan, cluster) if args.plan is not None else None  # (read before calibrating)
    if given is not None:
        _check_plan_fits(args.plan, given, graph)
    if args.calibrate:
        graph.timing = _calibrated(args, graph, cluster, say)
    if given is not None:
        result = _priced_here(args.plan, given, graph, cluster, config, say)
        planner = f"the plan in {args.plan}"
    else:
        try:
            result = make_plan(planner, graph, cluster, config, progress=say)
        except ValueError as e:  # a baseline this graph has not (ep without experts)
            raise UserError(f"--planner {planner}: {str(e).removeprefix(planner + ': ')}") from None
    # whether its estimate is of calibrated node times: a later --plan of it is priced alike or says so
    result = dataclasses.replace(result, search={**result.search, "calibrated": graph.timing is not None})
    print(result.summary())
    if len(result.stages) > 1:
        _check_pipeline(args, graph, result)
    elif straggling is not None:
        _check_straggler_sites(args, graph, result)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        result.to_json(path)
        whose = planner if args.plan is not None else f"{planner}'s plan"
        steps = (f"{args.steps} step{'s' if args.steps != 1 else ''}" if resume is None
                 else f"steps {resume[1] + 1}-{args.steps}")
        say(f"training {steps} with {whose} on {cluster.size} local processes")
        if straggling is not None:
            say(straggling)
        try:
            # the ranks' model is the one captured here where it was built alike (on the CPU, not meta)
            captured = dataclasses.replace(graph, timing=None) if capture_device(args.scale) is None else None
            spawn(_train_rank, cluster.size, args=(vars(args), path, os.path.join(tmp, "times.json"), captured))
        except RankFailed:
            refused = os.path.join(tmp, _REFUSED)
            if os.path.exists(refused):  # the mitigator refused this plan: bad input, said once
                raise UserError(open(refused).read().strip()) from None
            raise
        ran = json.loads(open(os.path.join(tmp, "times.json")).read())
    times, estimates = ran["seconds"], ran["estimates"]
    warm = 2 if len(times) > 3 else 0  # the first iterations warm up allocators and caches
    measured, est = statistics.median(times[warm:]), statistics.median(estimates[warm:])
    changed = "" if len(set(estimates[warm:])) == 1 else ", the median of the plans those steps ran"
    print(f"per-iteration time: measured {measured * 1e3:.1f} ms (median of {len(times) - warm}), "
          f"estimated {est * 1e3:.1f} ms{changed} ({measured / est:.2f}x the estimate)")
    if args.trace:
        where = os.path.normpath(args.trace)  # (traces/ gave traces//rank<r>.json)
        print(f"Chrome traces (chrome://tracing or ui.perfetto.dev): {os.path.join(where, 'rank<r>.json')}; the plan: "
              f"{os.path.join(where, 'plan.json')} (hap explain {os.path.join(where, 'plan.json')} --trace {where})")
    return 0


def _check_pipeline(args, graph, plan) -> None:
    """What hap train cannot do with a pipeline plan, said before any rank starts."""
    from .pipeline.stages import check_pipelinable

    if args.straggler not in ("none", "rebalance"):
        raise UserError(f"--straggler {args.straggler} prunes or migrates the columns of tensor-parallel layers; a "
                        f"pipeline plan's stages are data parallel: use --straggler rebalance (or none)")
    if args.migration is not None:
        raise UserError("--migration: a pipeline's rebalance re-cuts its stages and migrates no columns")
    try:
        check_pipelinable(graph, [st for k in range(len(plan.stages)) for st in plan.steps(graph, k)],
                          plan.schedule.micro_batches)
    except ValueError as e:
        raise UserError(str(e)) from None


def _check_plan_fits(path: str, plan, graph) -> None:
    """The plan must be of this model at this batch (Plan.check_fits), said here once rather
    than by every rank."""
    if plan.model != graph.model_name:  # (its graph may fit another model's: the run said it trained that one)
        raise UserError(f"--plan {path} is a plan of model {plan.model!r}, not of --model {graph.model_name}")
    try:
        plan.check_fits(graph)
    except ValueError as e:
        raise UserError(f"--plan {path}: {e}") from None


def _read_plan(path: str, named: str):
    """The plan in file `path`, or a UserError starting with `named` (the path, or the flag and
    the path), once: from_json names the file where it cannot read it."""
    from .plan import Plan

    try:
        return Plan.from_json(Path(path))
    except (OSError, ValueError) as e:
        said = str(e).removeprefix(f"plan file {path}: ")
        raise UserError(f"{named}: {said}") from None


def _plan_file(path: str, cluster):
    plan = _read_plan(path, f"--plan {path}")
    if len(plan.devices) != cluster.size:
        raise UserError(f"--plan {path} is for {len(plan.devices)} devices, cluster {cluster.name!r} has {cluster.size}")
    return plan


def _priced_here(path: str, plan, graph, cluster, config, say):
    """The plan priced on the cluster it is about to run on (it may have been made for another
    of the same size, or its shares or groups edited since): the summary and the measured
    over estimated ratio then speak of this run. A plan that does not fit a device's memory
    there is refused, as the planners refuse one."""
    from .ir import size_text
    from .planner import baselines_on, priced
    from .search.astar import SearchError

    try:
        here = priced(graph, cluster, dataclasses.replace(plan, cluster=cluster.to_dict(),
                                                          devices=[d.name for d in cluster.devices]), config)
    except ValueError as e:
        raise UserError(f"--plan {path}: {e}") from None
    for j, (need, device) in enumerate(zip(here.memory_bytes, cluster.devices)):  # as a planner would refuse it
        if need > device.memory:
            raise UserError(f"--plan {path}: out of memory: the plan needs {size_text(need)} on device {j} "
                            f"({device.name}), which has {size_text(device.memory)}")
    made_for = plan.cluster.get("name") if isinstance(plan.cluster, dict) else None
    old, new = plan.estimated_iteration_seconds, here.estimated_iteration_seconds
    repriced = made_for != cluster.name or not math.isclose(old, new, rel_tol=1e-6)
    if made_for != cluster.name:
        say(f"--plan {path} was made for cluster {made_for!r}; priced on {cluster.name!r}: "
            f"{new * 1e3:.2f} ms per iteration (it said {old * 1e3:.2f} ms)")
    elif repriced:
        said, again = _distinct_ms(old, new)
        calibrated = plan.search.get("calibrated")
        why = ("its estimate is of calibrated node times, this price not: add --calibrate" if calibrated and graph.timing is None
               else "its estimate is not of calibrated node times, this price is" if not calibrated and graph.timing
               else "planned for other model knobs, batch or input shape, for a cluster file of this name since changed, "
                    "or edited since?")
        say(f"--plan {path} says {said} ms per iteration, priced again {again} ms ({why}): training with "
            "the price of it as it is")
    if here.baselines and repriced:
        # priced where the plan was made: the summary's "hap is Nx" would be of that model and cluster
        try:
            here = dataclasses.replace(here, baselines=baselines_on(graph, cluster, list(here.baselines), config))
        except (ValueError, SearchError) as e:
            say(f"  its baselines are left out: they could not be planned on {cluster.name!r} ({e})")
            here = dataclasses.replace(here, baselines={})
    return here


def _distinct_ms(a: float, b: float) -> tuple[str, str]:
    """Seconds a and b in milliseconds, with two decimals or as many more (up to six) as it
    takes to tell them apart."""
    for decimals in range(2, 7):
        shown = f"{a * 1e3:.{decimals}f}", f"{b * 1e3:.{decimals}f}"
        if shown[0] != shown[1]:
            break
    return shown


def cmd_sync(args) -> int:
    from .cost.cluster import load_cluster
    from .sync import AutoSyncConfig, SpaceConfig, run
    from .sync.autosync import PlanMismatch
    from .sync.strategy import check_one_stage

    cluster = load_cluster(args.cluster)
    if not cluster.local:
        raise UserError(f"cluster {cluster.name!r} is not local: hap sync measures strategies on local processes "
                        "(a cluster file with local: true, emulating its devices and links)")
    for name in ("trials", "per_round", "candidates"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    knobs = _model_knobs(args)
    plan = _plan_file(args.plan, cluster) if args.plan else None
    if plan is not None:
        try:
            check_one_stage(plan)  # (before run captures the model)
        except ValueError as e:
            raise UserError(f"--plan {args.plan}: {e}") from None
    try:
        config = AutoSyncConfig(trials=args.trials, per_round=args.per_round, candidates=args.candidates,
                                simulator=args.simulator, space=SpaceConfig(compress=args.compress), seed=args.seed)
    except ValueError as e:  # named by its flag: "AutoSyncConfig.seed must be ..." -> "--seed must be ..."
        raise UserError(re.sub(r"AutoSyncConfig\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), str(e))) from None
    try:
        result = run(args.model, knobs, cluster, args.out, config, plan=plan,
                     say=lambda msg: print(msg, file=sys.stderr, flush=True))
    except PlanMismatch as e:  # (named by its file, as hap train names it)
        raise UserError(f"--plan {args.plan}: {e}") from None
    except ValueError as e:
        raise UserError(str(e)) from None
    _print_sync_result(result)
    result_file, plan_file = os.path.join(args.out, "result.json"), os.path.join(args.out, "plan.json")
    print(f"wrote {result_file}, {plan_file} (hap train --plan {plan_file})")
    return 0


def _print_sync_result(result: dict) -> None:
    """hap sync's summary: the best strategy, then each baseline's fastest step against the best
    trial's fastest (like with like: the confirmation's medians are said on a line of their own)."""
    best, fastest = result["best"], result["best_trial"]
    print(f"best: {best['measured_seconds'] * 1e3:.1f} ms per step ({best['kind']}, {result['trials']} trials"
          + (", median of the confirmation)" if result["confirmed"] else ")"))
    if fastest is not None:
        print(f"fastest step of each, against the best trial's ({fastest['measured_seconds'] * 1e3:.1f} ms):")
        for name, b in result["baselines"].items():
            print(f"  {name:9s} {b['measured_seconds'] * 1e3:8.1f} ms   "
                  f"{b['measured_seconds'] / fastest['measured_seconds']:.2f}x the best trial's")
    if result["confirmed"]:
        c = result["confirmed"]
        print(f"confirmed, alternately, median of {len(c['trial']['seconds'])}: best trial {c['trial']['median'] * 1e3:.1f} ms, "
              f"{c['baseline']['name']} {c['baseline']['median'] * 1e3:.1f} ms ({c['trial_over_baseline']:.2f}x)")
    acc = result["ranking_accuracy"]

    def text(x):
        return "-" if x is None else f"{x:.2f}"  # (None: no pair to rank)
    print("ranking accuracy on a random held-out 30%: " + ", ".join(f"{k} {text(acc[k])}" for k in
                                                                   ("hap", "analytic", "linear", "rnn", "gat"))
          + f" ({acc['held_out']} strategies); on the last 30% measured: "
          + ", ".join(f"{k} {text(v)}" for k, v in acc["forecast"].items()))


def cmd_explain(args) -> int:
    from .explain import explain

    plan = _read_plan(args.plan, args.plan)
    try:
        report = explain(plan, args.output, args.trace)
    except ValueError as e:
        raise UserError(str(e)) from None
    print("\n".join(report))
    print(f"wrote {os.path.join(args.output, 'timeline.png')}, timeline.json (chrome://tracing), layouts.txt")
    return 0


def _check_planner(name: str) -> str:
    """`name`, if a planner has it (said before capturing the model), else a UserError."""
    from .planners import planner_named

    try:
        planner_named(name)
    except ValueError as e:
        raise UserError(str(e)) from None
    return name


def _check_straggler(args, world: int) -> str | None:
    """The --straggler options checked before any rank starts (the schedule's parsed kind left
    in args.schedule_kind): what the run will do (a line), or None when it runs no mitigator."""
    from .straggler import EXACT, MIGRATING, parse_schedule

    try:
        schedule = parse_schedule(args.straggler_schedule, world)
    except ValueError as e:
        raise UserError(f"--straggler-schedule: {e}") from None
    args.schedule_kind = schedule.kind
    if args.migration is not None and args.straggler not in MIGRATING:
        raise UserError(f"--migration is for --straggler {', '.join(MIGRATING)}, not {args.straggler}")
    if args.straggler == "none" and schedule.kind == "none":
        return None
    what = "the cluster's own speeds only" if schedule.kind == "none" else schedule.describe()
    if args.straggler == "none":
        how = "not mitigated (measured only)"
    else:
        how = f"mitigated by {args.straggler} ({'exact' if args.straggler in EXACT else 'approximate: prunes columns'})"
    return f"stragglers: {what}; {how}"


def _check_straggler_sites(args, graph, plan) -> None:
    """A one-stage plan without the tensor-parallel linear layers that --straggler (or its
    emulated schedule) works on, refused before any rank starts (the ranks' mitigator would)."""
    from .straggler.mitigator import no_layers_refusal, tp_linear_layers

    refused = no_layers_refusal(args.straggler, args.schedule_kind)
    if refused and not tp_linear_layers(graph, plan.steps(graph)):
        raise UserError(refused)


def _resume_from(args) -> tuple[str, int] | None:
    """The checkpoint --resume continues from and its step (None: train from the start)."""
    from .runtime.checkpoint import latest

    if args.checkpoint is None:
        if args.resume or args.checkpoint_every is not None:
            raise UserError(f"{'--resume' if args.resume else '--checkpoint-every'} needs --checkpoint DIR")
        return None
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise UserError(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    if not args.resume:
        return None
    if args.resume != "latest":
        return _resume_named(args)
    try:
        found = latest(args.checkpoint)
    except ValueError as e:
        raise UserError(f"--resume: {e}{_earlier_hint(args.checkpoint, None)}") from None
    if found is None and os.path.exists(os.path.join(args.checkpoint, ".metadata")):  # (saves would go inside it)
        raise UserError(f"--resume: {args.checkpoint} is a checkpoint itself: give --checkpoint the directory that "
                        f"holds it, {os.path.dirname(os.path.normpath(args.checkpoint)) or '.'}")
    if found is None:  # (checkpoints there, their `latest` pointer gone: named)
        raise UserError(f"--resume: no checkpoint in {args.checkpoint}{_earlier_hint(args.checkpoint, None)}")
    if found[1] >= args.steps:
        raise UserError(f"--resume: the latest checkpoint in {args.checkpoint} is at step {found[1]}, "
                        f"so --steps {args.steps} leaves nothing to train")
    return found


def _resume_named(args) -> tuple[str, int]:
    """The checkpoint `--resume STEP` names in --checkpoint DIR (a step, or a checkpoint's name)."""
    from .runtime.checkpoint import checkpoints

    found = [(path, step) for path, step in checkpoints(args.checkpoint)
             if args.resume in (str(step), os.path.basename(path))]
    if not found:
        raise UserError(f"--resume {args.resume}: no such checkpoint in {args.checkpoint}"
                        + _earlier_hint(args.checkpoint, None))
    if found[0][1] >= args.steps:
        raise UserError(f"--resume: the checkpoint {found[0][0]} is at step {found[0][1]}, so --steps {args.steps} "
                        "leaves nothing to train")
    return found[0]


def _earlier_hint(directory: str, damaged: str | None) -> str:
    """What a resume may name instead of a damaged checkpoint (or where the latest is unknown)."""
    from .runtime.checkpoint import checkpoints

    others = [os.path.basename(path) for path, _ in checkpoints(directory) if path != damaged]
    more = f" and {len(others) - 3} earlier" if len(others) > 3 else ""
    return f" (checkpoints there: {', '.join(others[:3])}{more}; --resume STEP resumes from one)" if others else ""


def _check_checkpoint(path: str, graph, args, devices: int) -> None:
    """The checkpoint's files must be as written (their checksums, .metadata's too) and it must be
    of this model (its every parameter and buffer, by key and shape), said here once rather
    than by every rank (which then load it without hashing it again)."""
    from .runtime.checkpoint import check, idle_shapes, model_shapes, saved_optimizer, verify

    try:
        verify(path)
        check(path, model_shapes(graph), optional=idle_shapes(graph))
        kind = saved_optimizer(path)
    except ValueError as e:
        hint = _earlier_hint(os.path.dirname(path), path) if "damaged" in str(e) or "checksum" in str(e) else ""
        if args.model == "bert-moe" and args.experts is None and "is (" in str(e):  # (a shape differs)
            hint = (f" (bert-moe's experts are 2 per device unless --experts says: {2 * devices} on these "
                    f"{devices}; give --experts as the checkpoint's run had them)")
        raise UserError(f"--resume: {e}{hint}") from None
    if kind != TRAIN_OPTIMIZER_CLASS and kind != "":  # (a checkpoint the Python API saved; "": an older hap's)
        held = "no optimizer state" if kind is None else f"the state of optimizer class {kind}"
        raise UserError(f"--resume: checkpoint {path} holds {held}, and hap train trains on with "
                        f"{TRAIN_OPTIMIZER_CLASS} (momentum 0.9) and its state: resume it with the Python API "
                        "(hap.runtime.checkpoint.load, your optimizer)")


def _calibrated(args, graph, cluster, say):
    """The graph's node times measured on this cluster (cost.calibrate.calibrated_timing), cached."""
    import torch

    from .models import build
    from .cost.calibrate import calibrated_timing

    torch.manual_seed(0)
    model, inputs = build(args.model, devices=cluster.gpus, **_model_knobs(args))  # (the graph's model: --dropout too)
    t0 = time.perf_counter()
    try:
        timing, cached = calibrated_timing(graph, model, inputs, cluster, cache_dir=".hap-cache")
    except ValueError as e:  # a batch too small to tell the devices' rows apart
        raise UserError(f"--calibrate: {e}") from None
    say("node times calibrated on this cluster: " + ("from .hap-cache/" if cached else
                                                        f"measured in {time.perf_counter() - t0:.0f} s, cached in .hap-cache/"))
    return timing


_REFUSED = "straggler-refused.txt"
"""Beside times.json: why the straggler mitigator refused the plan (every rank writes it before it raises)."""


def _mitigator(args: dict, dmodel, opt, out_dir: str):
    """The straggler mitigator --straggler and --straggler-schedule ask for (None: neither)."""
    from .straggler import Mitigator, StragglerConfig, parse_schedule

    if args["straggler"] == "none" and args["straggler_schedule"] == "none":
        return None
    config = StragglerConfig(policy=args["straggler"], schedule=parse_schedule(args["straggler_schedule"], dmodel.comm.world),
                             method=args["migration"] or "broadcast-reduce")
    try:
        return Mitigator(dmodel, config, opt)
    except ValueError as e:  # the same on every rank: whichever raises first has said it for cmd_train
        path = os.path.join(out_dir, _REFUSED)
        with open(f"{path}.{dmodel.comm.rank}", "w") as f:
            f.write(str(e))
        os.replace(f"{path}.{dmodel.comm.rank}", path)
        raise


def _train_rank(rank: int, args: dict, plan_path: str, times_path: str, graph=None) -> None:
    """graph: the model's graph the command captured (None: each rank captures it)."""
    import torch

    from .cost.cluster import load_cluster
    from .models import build
    from .plan import Plan
    from .runtime.module import HAP

    torch.manual_seed(0)  # the same model on every rank
    model, batch = build(args["model"], devices=load_cluster(args["cluster"]).gpus, **_model_knobs(args))
    plan = Plan.from_json(plan_path)
    if len(plan.stages) > 1:
        return _train_pipeline(rank, args, model, batch, plan, times_path, graph)
    dmodel = HAP(model, load_cluster(args["cluster"]), batch, plan=plan, graph=graph)
    mine = dmodel.local_batch(*batch)  # each rank keeps only its part of the (fixed, synthetic) batch
    opt = torch.optim.SGD(dmodel.parameters(), lr=args["lr"] or DEFAULT_LR, momentum=0.9)
    mit = _mitigator(args, dmodel, opt, os.path.dirname(times_path))
    straggling = _Straggling(args["straggler"]) if mit is not None and rank == 0 else None
    start = _resumed(dmodel, opt, args)
    run = _TrainLoop(rank, args, start, dmodel, opt, lambda: setattr(dmodel.executor, "tracing", True))
    for step in range(start, args["steps"]):
        t0 = time.perf_counter()
        with run.step(step):
            if mit is not None:
                mit.begin_step(step)
            loss = dmodel(*mine, part=True)  # the loss must fall
            loss.backward()
            norm = dmodel.clip_grad_norm_(args["clip"]) if args["clip"] else None
            opt.step()
            opt.zero_grad(set_to_none=True)  # the mitigator's layers need it (torch's default too)
            record = mit.end_step() if mit is not None else None
        seconds = time.perf_counter() - t0
        if record is not None and record["resharded"]:  # new shares: this rank's part of the batch moved
            mine = dmodel.local_batch(*batch)
        note = straggling.step(record) if straggling is not None else ""
        run.done(step, seconds, loss, norm, note)
    run.finish(times_path, straggling.summary() if straggling is not None else None)


def _resumed(dmodel, opt, args: dict) -> int:
    """The step to start from: 0, or with --resume the checkpoint's, its state loaded (and a
    given --lr in place of the checkpoint's learning rate)."""
    from .runtime import checkpoint

    if not args["resume"]:
        return 0
    step = checkpoint.load(dmodel, opt, args["resume_path"], verified=True)[0]
    if opt is not None and args["lr"] is not None:
        for group in opt.param_groups:
            group["lr"] = args["lr"]
    return step


def _train_pipeline(rank: int, args: dict, model, batch, plan, times_path: str, graph) -> None:
    """hap train's loop for a plan of several stages (hap.Pipeline)."""
    import torch

    from .cost.cluster import load_cluster
    from .pipeline.runtime import Pipeline

    def make_optimizer(params):  # a stage may have no parameters (the loss alone, say)
        return torch.optim.SGD(params, lr=args["lr"] or DEFAULT_LR, momentum=0.9) if params else None

    pipe = Pipeline(model, load_cluster(args["cluster"]), batch, plan, graph=graph)
    opt = make_optimizer(list(pipe.parameters()))
    start = _resumed(pipe, opt, args)
    reb = _rebalancer(args, pipe, opt, batch, make_optimizer)
    run = _TrainLoop(rank, args, start, pipe, opt, lambda: setattr(run.dmodel, "tracing", True))
    moves = []
    for step in range(start, args["steps"]):
        t0 = time.perf_counter()
        with run.step(step):
            if reb is not None:
                reb.begin_step(step)
            loss = pipe.train_step(*batch)
            norm = pipe.clip_grad_norm_(args["clip"]) if args["clip"] else None
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            moved = reb.end_step()["moved"] if reb is not None else None
        seconds = time.perf_counter() - t0
        if moved is not None:  # a new pipeline holds the state now
            pipe, opt = run.dmodel, run.opt = reb.pipe, reb.opt
            moves.append(step + 1)
            if run.progress is not None:
                run.progress.note(f"after step {step + 1}: re-planned for the measured speeds and moved in "
                                  f"{moved['seconds']:.2f} s to {moved['to']} "
                                  f"(estimated {moved['estimate'] * 1e3:.1f} ms)")
        run.done(step, seconds, loss, norm)
    summary = None
    if reb is not None and rank == 0:
        speeds = ", ".join(f"{s:.2f}" for s in reb.speeds)
        summary = (f"pipeline straggler {reb.config.policy}: measured relative speeds {speeds}; re-planned and "
                   f"moved {len(moves)} time{'s' if len(moves) != 1 else ''}"
                   + (f" (after step{'s' if len(moves) > 1 else ''} {', '.join(map(str, moves))})" if moves else "")
                   + ("; a speed present from the start could not be told (the plan gives one rank alone work enough "
                      "to time, the other stages the loss alone): only a slowdown that begins later is found"
                      if reb.start_untold else ""))
    run.finish(times_path, summary)


def _rebalancer(args: dict, pipe, opt, batch, make_optimizer):
    """A pipeline's straggler controller, as --straggler (none or rebalance) and
    --straggler-schedule ask (None: neither)."""
    from .pipeline.rebalance import RebalanceConfig, Rebalancer
    from .straggler import parse_schedule

    if args["straggler"] == "none" and args["straggler_schedule"] == "none":
        return None
    config = RebalanceConfig(policy=args["straggler"], schedule=parse_schedule(args["straggler_schedule"], pipe.comm.world))
    return Rebalancer(pipe, opt, batch, config, make_optimizer)


class _TrainLoop:
    """What hap train's loops (hap.HAP's and hap.Pipeline's) do around each step: the progress
    line (rank 0), the step times, checkpoints every --checkpoint-every steps and at the end,
    and with --trace a Chrome trace of the last 3 steps and the plan they ran."""

    def __init__(self, rank: int, args: dict, start: int, dmodel, opt, start_tracing):
        from ._torch import cpu_profiler

        self.rank, self.args, self.dmodel, self.opt, self.start_tracing = rank, args, dmodel, opt, start_tracing
        self.every = args["checkpoint_every"] or args["steps"]
        self.traced = min(3, args["steps"] - start) if args["trace"] else 0
        self.profiler = cpu_profiler() if self.traced else None
        self.progress = _Progress(args["steps"], start) if rank == 0 else None
        self.times: list[float] = []
        self.estimates: list[float] = []
        """Per step, the estimate of the plan it ran (a reshard or a pipeline's move changes it)."""

    def step(self, step: int):
        """The step's span (a trace's "hap step N"), starting the trace at the first traced step."""
        import contextlib

        import torch

        self.estimates.append(self.dmodel.plan.estimated_iteration_seconds)
        if self.profiler is None:
            return contextlib.nullcontext()
        if step == self.args["steps"] - self.traced:
            self.start_tracing()
            self.profiler.start()
        return torch.profiler.record_function(f"hap step {step}")

    def done(self, step: int, seconds: float, loss, norm, note: str = "") -> None:
        from .runtime import checkpoint

        self.times.append(seconds)
        if self.progress is not None:
            self.progress.step(loss.item(), seconds, norm, note)
        if self.args["checkpoint"] and ((step + 1) % self.every == 0 or step + 1 == self.args["steps"]):
            path = checkpoint.save(self.dmodel, self.opt, self.args["checkpoint"], step + 1)
            if self.progress is not None:
                self.progress.note(f"checkpoint at step {step + 1}: {path}")

    def finish(self, times_path: str, summary: str | None = None) -> None:
        import json

        if self.progress is not None:
            self.progress.close()
        if summary is not None:
            print(summary, flush=True)
        if self.profiler is not None:
            self.profiler.stop()
            os.makedirs(self.args["trace"], exist_ok=True)
            self.profiler.export_chrome_trace(os.path.join(self.args["trace"], f"rank{self.rank}.json"))
            if self.rank == 0:  # the plan the traced steps ran (a reshard or re-plan changes it during the run)
                self.dmodel.plan.to_json(os.path.join(self.args["trace"], "plan.json"))
        if self.rank == 0:
            with open(times_path, "w") as f:
                json.dump({"seconds": self.times, "estimates": self.estimates}, f)


class _Straggling:
    """What the straggler mitigator did, step by step, as rank 0 sees it: its record of a step
    holds every rank's pruned share (summed with the loss) and handed-over share (decisions
    are the same on every rank)."""

    def __init__(self, policy: str):
        self.policy = policy
        self.steps = self.pruning = self.migrating = self.reshards = 0
        self.most = (0.0, 0)  # the largest share of a rank's columns pruned, and that rank

    def step(self, record: dict) -> str:
        """Count the step; the note for its progress line ("" when nothing was pruned or moved)."""
        pruned, moved = record["pruned_by_rank"], record["migrated_by_rank"]
        self.steps += 1
        self.pruning += any(p > 0 for p in pruned)
        self.migrating += any(m > 0 for m in moved)
        self.reshards += bool(record["resharded"])
        for r, p in enumerate(pruned):
            if p > self.most[0]:
                self.most = (p, r)
        parts = [f"rank {r} pruned {p:.0%}" for r, p in enumerate(pruned) if p > 0]
        parts += [f"rank {r} migrated {m:.0%}" for r, m in enumerate(moved) if m > 0]
        if record["resharded"]:
            parts.append("resharded")
        return "  " + ", ".join(parts) if parts else ""

    def summary(self) -> str:
        most = f" (at most {self.most[0]:.0%} of rank {self.most[1]}'s columns)" if self.pruning else ""
        return (f"straggler {self.policy}: pruning on {self.pruning} of {self.steps} steps{most}, migration on "
                f"{self.migrating}, resharded {self.reshards} time{'s' if self.reshards != 1 else ''}")


class _Progress:
    """Training progress: one updating line on a terminal (tqdm), else a line every tenth of
    the steps this run trains (and the last: a resumed run's tenth is of its own steps)."""

    def __init__(self, steps: int, done: int = 0):
        from tqdm import tqdm

        self.steps, self.done, self.start = steps, done, done
        # (tqdm draws on stderr: the bar where that is a terminal too)
        shown = sys.stdout.isatty() and sys.stderr.isatty()
        self.bar = tqdm(total=steps, initial=done, unit="step", dynamic_ncols=True) if shown else None

    def step(self, loss: float, seconds: float, norm, note: str = "") -> None:
        self.done += 1
        extra = (f"  grad norm {norm:.3f}" if norm is not None else "") + note
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}  {seconds * 1e3:.1f} ms{extra}", refresh=False)
            self.bar.update()
        elif (self.done - self.start) % max(1, (self.steps - self.start) // 10) == 0 or self.done == self.steps:
            print(f"step {self.done:4d}/{self.steps}  loss {loss:.4f}  {seconds * 1e3:7.1f} ms{extra}", flush=True)

    def note(self, line: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def cmd_profile(args) -> int:
    import json
    import tempfile

    import yaml

    from .cost.cluster import cluster_from_dict, load_cluster
    from .runtime.launch import spawn

    if "TORCHELASTIC_RUN_ID" in os.environ:
        raise UserError("hap profile starts its own local processes: run it directly, not under torchrun")
    cluster = load_cluster(args.cluster)
    if not cluster.local:
        raise UserError(f"cluster {cluster.name!r} is not local (local: true): hap profile measures processes on this "
                        "machine, not its devices")
    print(f"[hap] profiling {cluster.describe()} on {cluster.size} local processes", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "spec.json")
        spawn(_profile_rank, cluster.size, args=(args.cluster, args.quick, out))
        spec = json.loads(open(out).read())
    report = spec.pop("report")
    cluster_from_dict(spec)  # what we write must load
    with open(args.output, "w") as f:
        f.write(f"# written by: hap profile --cluster {args.cluster}\n")
        yaml.safe_dump(spec, f, sort_keys=False)
    for j, (dev, rep) in enumerate(zip(spec["devices"], report["devices"])):
        rates = ", ".join(f"{k} {rep[k]['rate'] / 1e9:.1f} G/s" for k in ("matmul", "conv", "attention"))
        print(f"device {j} ({dev['name']}): {dev['flops'] / 1e9:.1f} GFLOP/s ({rates}), memory "
              f"{dev['mem_bandwidth'] / 1e9:.1f} GB/s, {dev['op_overhead'] * 1e6:.1f} us per node per pass")
    for kind, fit in report["collectives"].items():
        print(f"{kind:15s} alpha {fit['alpha'] * 1e6:8.1f} us  beta {fit['beta'] / 1e9:6.2f} GB/s  "
              f"worst residual {fit['worst_residual'] * 100:.0f}%")
    print(f"wrote {args.output}")
    return 0


def _profile_rank(rank: int, cluster_name: str, quick: bool, out: str) -> None:
    import json

    from .cost.cluster import load_cluster
    from .runtime.collectives import Comm
    from .runtime.profile import profile_cluster

    spec = profile_cluster(load_cluster(cluster_name), Comm.default(), quick)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(spec, f)


def cmd_clusters(args) -> int:
    from .cost.cluster import BUILTIN

    for name in BUILTIN:
        print(BUILTIN[name]().describe())
    return 0


def cmd_cluster(args) -> int:
    import yaml

    from .cost.cluster import load_cluster

    cluster = load_cluster(args.name)
    # the description as YAML comments: the output is a cluster file (hap cluster X > x.yaml)
    print(f"# {cluster.describe()}")
    if cluster.topology is not None:
        print(f"# topology: {cluster.topology.describe()}")
    print(yaml.safe_dump(cluster.to_dict(), sort_keys=False), end="")
    return 0


# where each command writes: (command, argument, "file" or "dir"); checked before any work
_FILES_IN = {("explain", "output"): (r"timeline\.png", r"timeline\.json", r"layouts\.txt"),
             ("train", "trace"): (r"plan\.json", r"rank\d+\.json(\.tmp)?"),
             ("train", "checkpoint"): (r"latest", r"\.latest\.tmp", r"\.commits")}
"""Files a command writes into an output folder, by name (a regular expression; hap sync checks its own)."""
_OUTPUTS = [("plan", "json", "file"), ("train", "trace", "dir"), ("train", "checkpoint", "dir"),
            ("sync", "out", "dir"), ("explain", "output", "dir"), ("profile", "output", "file")]


def _check_outputs(args, made: list[str]) -> None:
    """Every output path the command will write can be written (its folder made now, and each
    folder made appended to `made`), so that a run does not end in a traceback after all its work."""
    for command, name, kind in _OUTPUTS:
        path = getattr(args, name, None) if args.command == command else None
        if path is None:
            continue
        flag = "-o" if name == "output" else f"--{name}"
        folder = path if kind == "dir" else (os.path.dirname(path) or ".")
        if kind == "file" and os.path.isdir(path):
            raise UserError(f"{flag} {path} is a directory; give a file name")
        if kind == "file" and path.endswith(os.sep):
            raise UserError(f"{flag} {path} ends in {os.sep}; give a file name")
        if kind == "dir" and os.path.exists(path) and not os.path.isdir(path):
            raise UserError(f"{flag} {path} is a file; give a directory")
        inside = _FILES_IN.get((command, name), ())  # (explain wrote timeline.json, then PIL raised; a trace
        for entry in (os.listdir(path) if inside and os.path.isdir(path) else ()):  # and a checkpoint after training)
            if any(re.fullmatch(f, entry) for f in inside) and os.path.isdir(os.path.join(path, entry)):
                raise UserError(f"{flag} {path}: {entry} there is a directory; the command writes a file of that name")
        try:
            _make_folders(folder, made)
        except OSError as e:
            raise UserError(f"{flag} {path}: cannot make the folder {folder}: {e.strerror or e}") from None
        if kind == "file":  # opened for appending, as the end of the run will write it (through a link)
            real = os.path.realpath(path)
            existed = os.path.exists(real)
            try:
                with open(real, "a"):
                    pass
            except OSError as e:
                raise UserError(f"{flag} {path}: cannot write it: {e.strerror or e}") from None
            if not existed:
                os.remove(real)
        elif not os.access(folder, os.W_OK):
            raise UserError(f"{flag} {path}: cannot write into it")


def _make_folders(folder: str, made: list[str]) -> None:
    """os.makedirs(folder), appending the folders it made, outermost first, to `made`."""
    missing, at = [], os.path.abspath(folder)
    while not os.path.exists(at):
        missing.append(at)
        at = os.path.dirname(at)
    os.makedirs(folder, exist_ok=True)
    made.extend(reversed(missing))


def _remove_empty(made: list[str]) -> None:
    """Remove the folders of `made` (outermost first) that are still empty, innermost first: a
    command that failed leaves no output folder behind."""
    for folder in reversed(made):
        try:
            os.rmdir(folder)
        except OSError:  # (not empty: something was written there)
            pass


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # (also while the modules below load)
        from hap_command import interrupted
        return interrupted()


def _main(argv: list[str] | None) -> int:
    from .balance.lp import BalanceError
    from .capture import CaptureError
    from .cost.cluster import ClusterError
    from .runtime.launch import RankFailed
    from .sync.trials import TrialsFailed

    args = _parser().parse_args(argv)
    handlers = {"plan": cmd_plan, "train": cmd_train, "profile": cmd_profile, "clusters": cmd_clusters,
                "cluster": cmd_cluster, "explain": cmd_explain, "sync": cmd_sync}
    made: list[str] = []  # output folders this command made: removed again where it fails before writing in them
    code = 1
    try:
        _check_outputs(args, made)
        code = handlers[args.command](args)
        return code
    except (UserError, ClusterError, CaptureError, BalanceError) as e:
        print(f"hap: error: {e}", file=sys.stderr)
        return 2
    except (RankFailed, TrialsFailed) as e:  # a training or profiling rank failed: its line, then its traceback
        print(f"hap: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (hap plan --listing | head): stop quietly, as a pipe does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush would raise again
        return 141
    except OSError as e:  # a file it reads or writes (a full disk, a cache path that is a file): one line
        where = f"{e.filename}: " if e.filename else ""
        print(f"hap: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    finally:
        if code != 0:
            _remove_empty(made)


if __name__ == "__main__":
    sys.exit(main())
