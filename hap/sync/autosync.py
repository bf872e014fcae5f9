"""AutoSync: search the synchronization strategy of a plan by simulators and trial runs.

    .venv/bin/hap sync --model vgg19 --scale small --cluster b9.yaml --trials 50 --out sync/

The loop (AutoSync, main paper Fig. 1): sample candidates under the knowledge constraints
(sampler.py) -> predict their times with the current simulator -> select K by Eq. 11
(select.py) -> run them on the cluster (trials.py) -> retrain the learned simulators -> again,
until the trial budget is spent. Before enough trials to learn from, hap's own overlap-aware
price of a strategy (price.overlapped) is the simulator. Beyond AutoSync, half of each round's
candidates are neighbours (one choice changed) of the best strategies measured so far,
baselines included, and no strategy is measured twice as a trial; at the end the best trial
and the best baseline are measured again, alternately, and the lower median wins. Every
measurement is one JSON line in DIR/trials.jsonl (model, cluster, strategy, measured seconds),
so a search resumes where it stopped and the data set grows across runs. Each search also writes
what it searched (model, knobs, cluster, plan) to DIR/domains/<key>.json, so that the trials of
other models, clusters and plans in the log train the learned simulators too (transfer: pairs
are ranked within a search only). The baselines (baselines.py) are measured in the same runs.

DIR/result.json holds the best strategy measured and its seconds, each baseline's seconds, the
simulators' pairwise ranking accuracy on held-out trials, and how the search went; DIR/plan.json
is the plan with the best strategy (`hap train --plan DIR/plan.json` trains with it); plots of
predicted against measured times and of the best time so far against trials are beside them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, get_args

import torch

from ..capture import capture
from ..config import check_fields, flag, instance, number, one_of, whole
from ..cost.cluster import Cluster, load_cluster
from ..models import build, capture_device, changing_knobs
from ..plan import Plan
from ..planner import baseline_plan, replayed
from . import baselines, price
from .sampler import SpaceConfig, bandwidths, neighbour, sample, similarity
from .select import select
from .simulators import KINDS, Domain, Sample, Simulator, features, ranking_accuracy
from .strategy import SyncStrategy, Variables, check_one_stage, with_strategy
from .trials import TrialCluster, Workload


SimulatorName = Literal["rnn", "gat", "linear"]
SimilarityName = Literal["choices", "embedding"]


@dataclass(kw_only=True, slots=True)
class AutoSyncConfig:
    trials: int = 50
    """Trial runs of the search (the baselines' runs not counted)."""
    per_round: int = 5
    """K: candidates run per round."""
    candidates: int = 200
    """M: candidates sampled and predicted per round."""
    alpha: float = 0.1
    """Eq. 11's weight of similarity against the predicted time (normalized to the best)."""
    simulator: SimulatorName = "rnn"
    """The learned simulator that ranks candidates once trained."""
    similarity: SimilarityName = "choices"
    """Eq. 11's similarity: shared choices, or the cosine of the simulator's hidden states."""
    learn_after: int = 10
    """Trials of this model and cluster before the learned simulator replaces hap's pricing."""
    epochs: int = 60
    space: SpaceConfig = field(default_factory=SpaceConfig)
    steps: int = 5
    """Timed training steps per trial (after 2 warm-up steps) ..."""
    min_timed_seconds: float = 0.5
    """... and as many more, in blocks of `steps`, until the timed steps took this long."""
    horovod_samples: int = 20
    baselines: bool = True
    local: float = 0.5
    """Share of each round's candidates drawn one choice away (sampler.neighbour) from the best
    strategies measured so far, baselines included (hap's addition; 0: AutoSync's sampler only)."""
    parents: int = 3
    """How many of the best measured strategies the local candidates are drawn around."""
    confirm: int = 3
    """At the end, the best trial and the best baseline are measured again this many times each,
    alternately, and `best` is the one of lower median (one fast step is often noise)."""
    seed: int = 0

    def __post_init__(self):
        # per_round 0 or candidates 0 would never finish the loop; the others make no sense
        check_fields(self, trials=whole(0), per_round=whole(1), candidates=whole(1), alpha=number(0),
                     simulator=one_of(*get_args(SimulatorName)), similarity=one_of(*get_args(SimilarityName)),
                     learn_after=whole(0), epochs=whole(1), steps=whole(1), min_timed_seconds=number(0),
                     horovod_samples=whole(1), local=number(0, 1), parents=whole(1), confirm=whole(0),
                     seed=whole(0, most=2**32 - 1),  # (Horovod's Bayesian optimization takes it as random_state)
                     baselines=flag(), space=instance(SpaceConfig))


def run(model: str, knobs: dict, cluster: Cluster | str, out: str | Path, config: AutoSyncConfig | None = None,
        plan: Plan | None = None, say: Callable[[str], None] = print) -> dict:
    """Search the synchronization strategy for `model` (hap.models) on `cluster` (local ranks),
    of `plan`'s gradients (default: data parallelism at compute-proportional batch shares).
    `cluster` may be given by name or cluster file, as hap sync's --cluster."""
    config = config or AutoSyncConfig()
    if isinstance(cluster, (str, Path)):
        cluster = load_cluster(str(cluster))
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a hap Cluster, a cluster name or a cluster file, got {type(cluster).__name__}")
    if not cluster.local:  # (as hap sync says: CPU timings would stand for the cluster's devices)
        raise ValueError(f"cluster {cluster.name!r} is not local: the search measures strategies on local processes "
                         "(a cluster file with local: true, emulating its devices and links)")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; the search writes into a directory there")
    out.mkdir(parents=True, exist_ok=True)
    for name, want_dir in (("trials.jsonl", False), ("domains", True), ("plan.json", False), ("result.json", False),
                           ("autosync.png", False)):  # what the search writes there: said before any work
        path = out / name
        if path.exists() and path.is_dir() != want_dir:
            raise ValueError(f"{path} is a {'directory' if path.is_dir() else 'file'}; the search writes a "
                             f"{'directory' if want_dir else 'file'} there")
    if cluster.size < 2:
        raise ValueError(f"cluster {cluster.name!r} has one device: there are no gradients to synchronize between devices")
    try:
        given, knobs = knobs, changing_knobs(model, cluster.size, **knobs)  # (--layers 2 where 2 is the default: one search)
    except TypeError as e:  # (an unknown knob: resolve() got an unexpected keyword argument)
        raise ValueError(f"{model}: {str(e).removeprefix('resolve() ')}") from None
    rng = random.Random(config.seed)
    made_for = plan.cluster.get("name") if plan is not None and isinstance(plan.cluster, dict) else cluster.name
    if made_for != cluster.name:  # (as hap train says it; the plan written names the cluster searched on)
        say(f"[autosync] the plan was made for cluster {made_for!r}: its sync is searched and priced on {cluster.name!r}")
    graph, plan, variables, cost, est = _setting(model, knobs, cluster, plan)
    if not variables.vars:
        raise ValueError(f"the plan of {model} keeps no parameter whole: there is no gradient to synchronize")
    own = baselines.plan_sync(variables, plan.sync)  # (its baseline, "hap")
    if not own.exact and not config.space.compress:
        raise ValueError("the plan's sync compresses gradients, which a search without compression never "
                         "returns: search with compression (--compress), or give a plan that synchronizes exactly")
    changes = baselines.bucket_changes(variables, plan.sync, own)
    # P's sync where no strategy runs it as it is (a server's bucket of several parameters, its
    # own launch order): baseline "hap" measures it so; its strategy form stands for it in the log
    as_is = list(plan.sync) if changes is not None else None
    if changes is not None:
        say(f"[autosync] baseline hap runs the plan's sync as it is; as a strategy (in the log) {changes}")

    def entries_of(kind: str, strategy: SyncStrategy) -> list:
        return as_is if as_is is not None and kind.endswith("baseline:hap") else variables.entries(strategy)
    domain = Domain(f"{model} {json.dumps(knobs, sort_keys=True)} on {cluster.name}", variables, cost, est)
    key = _domain_key(model, knobs, cluster, plan, config.space.compress)
    log = out / "trials.jsonl"
    # (rows logged before knobs at their defaults left the key are this search's too)
    history = _history(log, key, config.space.compress, say,
                       aliases=(_domain_key(model, given, cluster, plan, config.space.compress),))
    _save_domain(out, key, model, knobs, cluster, plan)
    others = _other_samples(history, key, out, say)
    for t in history:  # this search's rows must be of its parameters (a row of another search's, hand-edited)
        if t["domain"] == key:
            try:
                variables.entries(SyncStrategy.from_json(t["strategy"]))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{log}: a {t['kind']} row of this search holds a strategy of other parameters "
                                 f"({str(e).splitlines()[0]})") from None
    if config.trials == 0 and not config.baselines and not any(t["domain"] == key for t in history):
        raise ValueError("trials=0 with baselines=False measures nothing, and the log holds nothing of this search")
    mine = [t for t in history if t["domain"] == key and t["kind"] == "trial"]
    say(f"[autosync] {domain.name}: {len(variables.vars)} synchronized parameters, "
        f"{sum(v.nbytes for v in variables.vars) / 2**20:.1f} MiB; {len(mine)} trials already in {log}")

    bw = bandwidths(variables, cost)
    workload = Workload(model=model, knobs=knobs, cluster=cluster.to_dict(), plan=plan.to_dict(), steps=config.steps,
                        min_seconds=config.min_timed_seconds)
    t_start = time.perf_counter()
    # the trial ranks' model is the one captured here where it was built alike (on the CPU, not meta)
    with TrialCluster(workload, graph=graph if capture_device(knobs.get("scale")) is None else None) as trials:
        def measure(named: list[tuple[str, SyncStrategy]], tried: list[dict] | None = None) -> list[float]:
            seconds = trials.measure([entries_of(kind, s) for kind, s in named])
            with log.open("a") as f:
                for (kind, s), t, how in zip(named, seconds, tried or [{}] * len(named)):
                    row = {"domain": key, "model": model, "knobs": knobs, "cluster": cluster.name, "kind": kind,
                           "strategy": s.to_json(), "seconds": t, "knobs_tried": how,
                           "hap_estimate": price.overlapped(entries_of(kind, s), variables, cost, est)}
                    f.write(json.dumps(row) + "\n")
                    history.append(row)
            return seconds

        base = _baselines(variables, own, est, bw, measure, history, key, config, say,
                          as_is=as_is is not None) if config.baselines else {}
        simulator: Simulator | None = None
        while sum(1 for t in history if t["domain"] == key and t["kind"] == "trial") < config.trials:
            done = sum(1 for t in history if t["domain"] == key and t["kind"] == "trial")
            simulator = _trained(history, key, domain, others, config, simulator, done)
            pool = _candidates(history, key, variables, bw, rng, config)
            samples = [_sample(domain, s) for s in pool]
            if simulator is None:
                predicted = [price.overlapped(variables.entries(s), variables, cost, est) for s in pool]
            else:
                predicted = simulator.scores(samples)
                low = min(predicted)
                predicted = [p - low + 1.0 for p in predicted]  # scores to positive, best 1
            sim = _similarity(pool, samples, simulator, config)
            k = min(config.per_round, config.trials - done)
            picked = select(pool, predicted, k, config.alpha, sim)
            seconds = measure([("trial", pool[i]) for i in picked])
            best = min(t["seconds"] for t in history if t["domain"] == key and t["kind"] == "trial")
            say(f"[autosync] trials {done + len(picked)}/{config.trials}: {', '.join(f'{s * 1e3:.1f}' for s in seconds)} ms; "
                f"best so far {best * 1e3:.1f} ms")
        confirmed = _confirm(history, key, measure, config, say)
    result = _result(history, key, domain, base, config, time.perf_counter() - t_start, confirmed)
    best = SyncStrategy.from_json(result["best"]["strategy"])
    won_as_is = as_is is not None and result["best"]["kind"].endswith("baseline:hap")
    best_plan = plan if won_as_is else with_strategy(plan, variables, best)  # (P's sync as it ran)
    best_plan = price.with_estimate(best_plan, graph, cost, est, searched="autosync")
    best_plan.to_json(out / "plan.json")
    (out / "result.json").write_text(json.dumps(result, indent=1))
    _plots(history, key, out)
    measured = ", ".join(f"{n} {b['measured_seconds'] * 1e3:.1f} ms" for n, b in result["baselines"].items())
    say(f"[autosync] best {result['best']['measured_seconds'] * 1e3:.1f} ms ({result['best']['kind']}); "
        + (f"{measured}; " if measured else "") + f"wrote {out / 'result.json'}, {out / 'plan.json'}")
    return result


def _searched(history, key) -> list[dict]:
    """This domain's trials and baselines, without the confirmation's repeated measurements."""
    return [t for t in history if t["domain"] == key and not t["kind"].startswith("confirm")]


def _candidates(history, key, variables, bw, rng, config: AutoSyncConfig) -> list[SyncStrategy]:
    """A round's candidates: AutoSync's samples and neighbours of the best measured strategies,
    none measured before (a repeat would spend a trial on what is known)."""
    measured = sorted(_searched(history, key), key=lambda t: t["seconds"])
    parents = [SyncStrategy.from_json(t["strategy"]) for t in measured[:config.parents]]
    local = int(config.local * config.candidates) if parents else 0
    pool = [sample(variables, bw, rng, config.space) for _ in range(config.candidates - local)]
    pool += [neighbour(rng.choice(parents), variables, bw, rng, config.space) for _ in range(local)]
    # (by what the runtime runs: strategies whose groups are numbered otherwise were measured twice)
    seen = {variables.key(SyncStrategy.from_json(t["strategy"])) for t in measured}
    fresh = []
    for s in pool:
        key = variables.key(s)
        if key not in seen:
            seen.add(key)
            fresh.append(s)
    return fresh or pool


def _confirm(history, key, measure, config: AutoSyncConfig, say) -> dict | None:
    """The best trial and the best baseline measured again, alternately, config.confirm times each."""
    rows = [t for t in history if t["domain"] == key]
    trials = [t for t in rows if t["kind"] == "trial"]
    base = [t for t in rows if t["kind"].startswith("baseline:")]
    if config.confirm <= 0 or not trials or not base:
        return None
    trial, baseline = min(trials, key=lambda t: t["seconds"]), min(base, key=lambda t: t["seconds"])
    name = baseline["kind"].split(":", 1)[1]
    pair = [("confirm:trial", SyncStrategy.from_json(trial["strategy"])),
            (f"confirm:baseline:{name}", SyncStrategy.from_json(baseline["strategy"]))]
    seconds = measure(pair * config.confirm)
    t_s, b_s = seconds[0::2], seconds[1::2]
    out = {"trial": {"strategy": trial["strategy"], "seconds": t_s, "median": statistics.median(t_s)},
           "baseline": {"name": name, "strategy": baseline["strategy"], "seconds": b_s, "median": statistics.median(b_s)}}
    out["trial_over_baseline"] = out["baseline"]["median"] / out["trial"]["median"]
    say(f"[autosync] confirmed (median of {config.confirm}): best trial {out['trial']['median'] * 1e3:.1f} ms, "
        f"baseline {name} {out['baseline']['median'] * 1e3:.1f} ms ({out['trial_over_baseline']:.2f}x)")
    return out


def _domain_key(model: str, knobs: dict, cluster: Cluster, plan: Plan, compress: bool = False) -> str:
    """The search a logged row belongs to. A search with compression is another search: one
    without it must not return (or start from) an approximate strategy."""
    spec = {"model": model, "knobs": knobs, "cluster": cluster.to_dict(), "plan": plan.digest}
    if compress:
        spec["compress"] = True
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


_ROW_FIELDS = {"domain": str, "model": str, "knobs": dict, "cluster": str, "kind": str, "strategy": list,
               "seconds": (int, float), "hap_estimate": (int, float)}
"""The fields every logged row has, and their types."""


def _load(log: Path, say: Callable[[str], None] = print) -> list[dict]:
    """The rows of a trial log. An unfinished last line (a search stopped while writing it) is
    dropped from the file, and said so, so that the search resumes; any other line that is not
    a row is a ValueError naming it."""
    if not log.exists():
        return []
    text = log.read_text()
    lines = text.splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) and not text.endswith("\n"):
                log.write_text(text[: len(text) - len(line)])
                say(f"[autosync] {log}:{n}: dropped an unfinished last line (a search stopped while writing it)")
                break
            raise ValueError(f"{log}:{n}: not a JSON line (a trial log holds one trial per line)") from None
        bad = [f for f, kind in _ROW_FIELDS.items() if not isinstance(row, dict) or not isinstance(row.get(f), kind)]
        if bad:
            raise ValueError(f"{log}:{n}: not a trial row (no {', '.join(bad)}): a trial log holds one trial per line")
        rows.append(row)
    return rows


def _history(log: Path, key: str, compress: bool, say: Callable[[str], None] = print,
             aliases: tuple[str, ...] = ()) -> list[dict]:
    """The log's rows (_load), those of `aliases` (keys the same search had before) as this
    search's; in a search without compression, none of this search's of a compressed strategy
    (logged by a search with compression before _domain_key told them apart): such a search
    neither starts from nor returns an approximate strategy."""
    rows = _load(log, say)
    for t in rows:
        if t["domain"] in aliases:
            t["domain"] = key
    if log.exists() and log.stat().st_size and not log.read_bytes().endswith(b"\n"):  # (a row appended would join it)
        with log.open("a") as f:
            f.write("\n")
    return rows if compress else [t for t in rows if t["domain"] != key or SyncStrategy.from_json(t["strategy"]).exact]


def _sample(domain: Domain, strategy: SyncStrategy, seconds: float = 0.0) -> Sample:
    x, edges = features(domain, strategy)
    return Sample(domain.name, x, edges, seconds, repr(domain.variables.key(strategy)))  # (by what runs: _candidates)


def _samples(history: list[dict], key: str, domain: Domain) -> list[Sample]:
    """This domain's measured trials as simulator samples (other domains' need their own
    variables: the caller trains on them only where it has them)."""
    return [_sample(domain, SyncStrategy.from_json(t["strategy"]), t["seconds"]) for t in history if t["domain"] == key]


def _trained(history, key, domain, others: list[Sample], config: AutoSyncConfig, current, done) -> Simulator | None:
    """The learned simulator, retrained every round once this search has `learn_after` trials:
    on its own trials and `others` (other searches' in the log)."""
    if done < config.learn_after:
        return None
    if current is not None and done % config.per_round:
        return current
    sim = Simulator(config.simulator, seed=config.seed)
    sim.train(_samples(history, key, domain) + others, epochs=config.epochs)
    return sim


class PlanMismatch(ValueError):
    """The plan given cannot be this search's (another model, batch or cluster size; a pipeline)."""


def _setting(model: str, knobs: dict, cluster: Cluster, plan: Plan | None):
    """(graph, plan, variables, cost, estimate) of a search: the model captured as the trial
    ranks capture it (models.capture_device), its plan (default: data parallel at compute-proportional batch shares, AutoSync's
    setting), the gradients it synchronizes, the cost model and the plan's estimate."""
    built, inputs = build(model, devices=cluster.size, device=capture_device(knobs.get("scale")), **knobs)
    graph = capture(built, inputs, name=model)
    if plan is None:
        plan = baseline_plan(graph, cluster, "dp-cp")
    elif len(plan.devices) == cluster.size:  # (made for another cluster of this size: searched and priced on this one)
        plan = dataclasses.replace(plan, cluster=cluster.to_dict(), devices=[d.name for d in cluster.devices])
    try:
        check_one_stage(plan)
        plan.check_fits(graph)
        cost, est = replayed(graph, cluster, plan)
    except ValueError as e:
        raise PlanMismatch(str(e)) from None
    variables = Variables.of(plan, graph, cluster.machines, cost)
    return graph, plan, variables, cost, est


def _save_domain(out: Path, key: str, model: str, knobs: dict, cluster: Cluster, plan: Plan) -> None:
    """DIR/domains/<key>.json: what a later search needs to learn from this one's trials."""
    path = out / "domains" / f"{key}.json"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        spec = {"model": model, "knobs": knobs, "cluster": cluster.to_dict(), "plan": plan.to_dict()}
        path.write_text(json.dumps(spec))


def logged_samples(out: Path, key: str, rows: list[dict]) -> list[Sample]:
    """Logged rows of the search `key` as simulator samples of its domain, rebuilt from
    DIR/domains/<key>.json (an OSError, or a ValueError where it no longer builds)."""
    from ..cost.cluster import cluster_from_dict

    spec = json.loads((out / "domains" / f"{key}.json").read_text())
    cluster = cluster_from_dict(spec["cluster"])
    _, _, variables, cost, est = _setting(spec["model"], spec["knobs"], cluster, Plan.from_dict(spec["plan"]))
    domain = Domain(f"{spec['model']} {json.dumps(spec['knobs'], sort_keys=True)} on {cluster.name} [{key}]",
                    variables, cost, est)
    return [_sample(domain, SyncStrategy.from_json(t["strategy"]), t["seconds"]) for t in rows]


def _other_samples(history: list[dict], key: str, out: Path, say: Callable[[str], None] = print) -> list[Sample]:
    """The measured strategies of the other searches in the log, as samples of their own
    domains (rebuilt from DIR/domains/<key>.json), for transfer. A search whose description is
    missing (logged before they were written) or no longer builds is left out, and said so."""
    rows: dict[str, list[dict]] = {}
    for t in history:
        if t["domain"] != key and not t["kind"].startswith("confirm"):
            rows.setdefault(t["domain"], []).append(t)
    samples: list[Sample] = []
    for other, measured in rows.items():
        try:
            samples += logged_samples(out, other, measured)
        except (OSError, ValueError, KeyError, TypeError) as e:
            say(f"[autosync] {len(measured)} measured strategies of another search ({other}) left out of training: "
                f"{type(e).__name__}: {e}"[:300])
    if samples:
        searches = len({s.domain for s in samples})
        say(f"[autosync] {len(samples)} measured strategies of {searches} other search{'es' if searches > 1 else ''} "
            "train the simulators too")
    return samples


def _similarity(pool, samples, simulator, config: AutoSyncConfig):
    if config.similarity == "embedding" and simulator is not None:
        emb = simulator.embeddings(samples)
        cos = torch.nn.functional.cosine_similarity
        return lambda i, j: (cos(emb[i], emb[j], dim=0).item() + 1) / 2
    return lambda i, j: similarity(pool[i], pool[j])


def _baselines(variables, own: SyncStrategy, est, bw, measure, history, key, config: AutoSyncConfig, say,
               as_is: bool = False) -> dict[str, dict]:
    """Each baseline's best measured run. A run this search logged before (the same baseline and
    knobs) is taken from the log, not measured again: a search stopped among its baselines
    resumes where it stopped, Horovod's tuning too (it proposes the same points, given the same
    seed and times)."""
    logged = {}
    for t in history:
        if t["domain"] == key and t["kind"].startswith("baseline:"):
            logged.setdefault((t["kind"], json.dumps(t.get("knobs_tried", {}), sort_keys=True)), t["seconds"])
    reused = [0]
    # Seconds of each strategy run, by what runs (Variables.key): a baseline whose knobs give a
    # strategy measured already (most of Horovod's thresholds give hap's buckets) takes its time,
    # not a measurement more (the least of 20 runs of one strategy beat its one run by noise).
    # A baseline's first run of a strategy is logged, so a resumed search meets the same.
    ran: dict[tuple, float] = {}

    def logged_or_measured(named, tried):
        # (the plan's sync run as it is is no strategy's run: as_is)
        keys = [("the plan's sync as it is",) if as_is and kind == "baseline:hap" else variables.key(s)
                for kind, s in named]
        for k, (kind, _), how in zip(keys, named, tried):  # (resumed: a run this search logged before)
            past = logged.get((kind, json.dumps(how, sort_keys=True)))
            if k not in ran and past is not None:
                ran[k] = past
                reused[0] += 1
        first: dict[tuple, int] = {}  # each strategy not run yet, at its first place (twice among these: once)
        for i, k in enumerate(keys):
            if k not in ran:
                first.setdefault(k, i)
        todo = list(first.values())
        for i, t in zip(todo, measure([named[i] for i in todo], [tried[i] for i in todo]) if todo else []):
            ran[keys[i]] = t
        return [ran[k] for k in keys]

    out = {}
    largest = max(v.nbytes for v in variables.vars)
    sizes = sorted({max(2**16, largest // d) for d in (1, 2, 4, 8)}, reverse=True)  # partition sizes tried
    named = [("hap", own), ("ddp", baselines.ddp(variables))]  # (own: the plan's sync, baselines.plan_sync)
    named += [("tuned-ps", baselines.tuned_ps(variables, bw, s)) for s in sizes]
    seconds = logged_or_measured([(f"baseline:{n}", s) for n, s in named], [{"partition_bytes": None}] * 2 +
                      [{"partition_bytes": s} for s in sizes])
    for (n, s), t, size in zip(named, seconds, [None, None] + sizes):
        if n not in out or t < out[n]["measured_seconds"]:
            out[n] = {"measured_seconds": t, "strategy": s.to_json(), **({"partition_bytes": size} if size else {})}
    total = sum(v.nbytes for v in variables.vars)

    def horovod(x):  # log2 threshold bytes, cycle ms
        s = baselines.horovod_fusion(variables, est, 2 ** x[0], x[1] * 1e-3)
        return logged_or_measured([("baseline:horovod", s)], [{"fusion_threshold_bytes": int(2 ** x[0]), "cycle_ms": x[1]}])[0]

    lo = max(10.0, float(int(max(1, min(v.nbytes for v in variables.vars))).bit_length()))
    hi = max(lo + 1, float(int(total).bit_length()) + 1)
    x, t, _ = baselines.bayesian_optimization(horovod, [(lo, hi), (0.1, 20.0)], samples=config.horovod_samples,
                                              seed=config.seed)
    out["horovod"] = {"measured_seconds": t, "fusion_threshold_bytes": int(2 ** x[0]), "cycle_ms": x[1],
                      "strategy": baselines.horovod_fusion(variables, est, 2 ** x[0], x[1] * 1e-3).to_json()}
    say("[autosync] baselines" + (f" ({reused[0]} runs from the log)" if reused[0] else "") + ": "
        + ", ".join(f"{n} {b['measured_seconds'] * 1e3:.1f} ms" for n, b in out.items()))
    return out


def _result(history, key, domain: Domain, base, config: AutoSyncConfig, seconds: float,
            confirmed: dict | None) -> dict:
    mine = _searched(history, key)
    trials = [t for t in mine if t["kind"] == "trial"]
    best = min(mine, key=lambda t: t["seconds"])
    if confirmed is not None:  # the confirmed winner, at its median
        won = "trial" if confirmed["trial"]["median"] <= confirmed["baseline"]["median"] else "baseline"
        kind = "trial" if won == "trial" else f"baseline:{confirmed['baseline']['name']}"
        best = {"seconds": confirmed[won]["median"], "kind": kind, "strategy": confirmed[won]["strategy"]}
    best_trial = min(trials, key=lambda t: t["seconds"]) if trials else None
    return {
        "model": mine[0]["model"], "knobs": mine[0]["knobs"], "cluster": mine[0]["cluster"],
        "trials": len(trials),
        "best": {"measured_seconds": best["seconds"], "kind": best["kind"], "strategy": best["strategy"],
                 "text": str(SyncStrategy.from_json(best["strategy"]))},
        "best_trial": None if best_trial is None else {"measured_seconds": best_trial["seconds"],
                                                       "strategy": best_trial["strategy"]},
        "baselines": {n: {k: v for k, v in b.items() if k != "strategy"} for n, b in base.items()},
        "ranking_accuracy": _held_out(mine, domain, config),
        "best_so_far": _best_so_far(trials),
        "confirmed": confirmed,
        "search_seconds": seconds,
    }


def _held_out(rows: list[dict], domain: Domain, config: AutoSyncConfig) -> dict:
    """Pairwise ranking accuracy on held-out measured strategies: a seeded random 30% of this
    domain's, each simulator trained on the other 70% (hap's price and the analytic model need
    no training); and, as `forecast`, the learned simulators trained on the first 70% in the
    order measured and tested on the last 30%, which the search itself picked as promising
    (harder: they are alike, and chosen where the simulator was most optimistic). An accuracy
    is None (JSON null) where there is no pair to rank: NaN is not JSON."""
    samples = [_sample(domain, SyncStrategy.from_json(t["strategy"]), t["seconds"]) for t in rows]
    order = list(range(len(samples)))
    random.Random(config.seed).shuffle(order)
    cut = int(0.7 * len(samples))
    vs, cost = domain.variables, domain.cost
    test = [samples[i] for i in order[cut:]]
    out: dict = {}
    analytic = [price.analytic(vs.entries(SyncStrategy.from_json(rows[i]["strategy"])), vs, cost, domain.compute)
                for i in order[cut:]]
    out["hap"] = _accuracy_or_none(ranking_accuracy([rows[i]["hap_estimate"] for i in order[cut:]], test))
    out["analytic"] = _accuracy_or_none(ranking_accuracy(analytic, test))
    for kind in KINDS:
        out[kind] = _trained_accuracy(kind, [samples[i] for i in order[:cut]], test, config)
    out["held_out"] = len(test)
    out["forecast"] = {kind: _trained_accuracy(kind, samples[:cut], samples[cut:], config) for kind in KINDS}
    return out


def _accuracy_or_none(x: float) -> float | None:
    return None if x != x else x  # NaN: no pair ranked


def _trained_accuracy(kind: str, train: list[Sample], test: list[Sample], config: AutoSyncConfig) -> float | None:
    sim = Simulator(kind, seed=config.seed)
    sim.train(train, epochs=config.epochs)
    return _accuracy_or_none(ranking_accuracy(sim.scores(test), test))


def _best_so_far(trials: list[dict]) -> list[float]:
    best, out = float("inf"), []
    for t in trials:
        best = min(best, t["seconds"])
        out.append(best)
    return out


def _plots(history: list[dict], key: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [t for t in history if t["domain"] == key]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.scatter([t["hap_estimate"] * 1e3 for t in mine], [t["seconds"] * 1e3 for t in mine], s=10)
    a.set_xlabel("hap's estimate (ms)")
    a.set_ylabel("measured (ms)")
    a.set_title("strategies: predicted vs measured")
    trials = [t for t in mine if t["kind"] == "trial"]
    b.plot(range(1, len(trials) + 1), [s * 1e3 for s in _best_so_far(trials)], label="AutoSync best so far")
    names = {}
    for t in mine:
        if t["kind"].startswith("baseline:"):
            n = t["kind"].split(":", 1)[1]
            names[n] = min(names.get(n, float("inf")), t["seconds"])
    for n, s in names.items():
        b.axhline(s * 1e3, linestyle="--", linewidth=0.8, label=n)
    b.set_xlabel("trials")
    b.set_ylabel("ms per step")
    b.legend(fontsize=7)
    b.set_title("best strategy found")
    fig.tight_layout()
    fig.savefig(out / "autosync.png", dpi=120)
    plt.close(fig)
