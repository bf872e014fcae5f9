"""AutoSync's transfer, measured: simulators trained only on other searches' measured strategies
(another batch, another model, another cluster) rank this search's.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/autosync_transfer.py --out out/bench-autosync-transfer

Four searches share one log (DIR/trials.jsonl), `--trials` each (about 1-3 minutes each at 12):
VGG19 (small) on the local cluster at its own batch (8) and at batch 16, BERT (2 layers, 128
wide) on the local cluster, and VGG19 (small) on AutoSync's B9 cluster scaled to 3 local ranks
(benchmarks/clusters/autosync-b9.yaml). For each search and each training set that exists for
it -- every other search, the searches of other models, the searches of this model at the same
knobs on other clusters -- every simulator is trained on that set alone (baselines included, the
confirmations left out) and its pairwise ranking accuracy is taken on all of this search's
strategies; hap's own price ranks the same strategies for comparison. --report-only: no
searches, the report of those already in DIR (a search whose description no longer builds is
left out, and said so). Writes DIR/transfer.json and prints a line per (search, training set).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BERT = {"scale": "small", "layers": 2, "hidden": 128, "seq": 32, "batch": 16}
B9 = str(Path(__file__).parent / "clusters" / "autosync-b9.yaml")
SEARCHES = [("vgg19", {"scale": "small"}, "local"), ("vgg19", {"scale": "small", "batch": 16}, "local"),
            ("bert", BERT, "local"), ("vgg19", {"scale": "small"}, B9)]
"""(model, knobs, cluster) of each search."""


def training_sets(spec: dict, others: dict[str, dict]) -> dict[str, list[str]]:
    """The searches (keys of `others`) each kind of transfer trains on, for the search `spec`."""
    return {"all others": list(others),
            "other models": [k for k, o in others.items() if o["model"] != spec["model"]],
            "other clusters": [k for k, o in others.items() if (o["model"], o["knobs"]) == (spec["model"], spec["knobs"])
                               and o["cluster"] != spec["cluster"]]}


def main() -> int:
    from hap.cost.cluster import load_cluster
    from hap.sync import AutoSyncConfig, autosync
    from hap.sync.simulators import KINDS, Simulator, ranking_accuracy

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/bench-autosync-transfer")
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--report-only", action="store_true", help="report the searches already in --out, run none")
    args = ap.parse_args()
    out = Path(args.out)
    if not args.report_only:
        for model, knobs, cluster in SEARCHES:
            autosync.run(model, knobs, load_cluster(cluster), out, AutoSyncConfig(trials=args.trials, candidates=20),
                         say=lambda m: print(m, flush=True))
    history = autosync._load(out / "trials.jsonl")
    specs, measured, samples = {}, {}, {}
    for key in sorted({t["domain"] for t in history}):
        rows = [t for t in history if t["domain"] == key and not t["kind"].startswith("confirm")]
        try:
            specs[key] = json.loads((out / "domains" / f"{key}.json").read_text())
            samples[key] = autosync.logged_samples(out, key, rows)
        except (OSError, ValueError, KeyError, TypeError) as e:  # as autosync's own transfer leaves it out
            print(f"search {key} left out: {type(e).__name__}: {e}"[:300], flush=True)
            specs.pop(key, None)
            continue
        measured[key] = rows
    keys = sorted(samples)
    rows = []
    for key in keys:
        spec, mine = specs[key], samples[key]
        name = f"{spec['model']} {json.dumps(spec['knobs'], sort_keys=True)} on {spec['cluster']['name']}"
        hap_price = ranking_accuracy([t["hap_estimate"] for t in measured[key]], mine)
        for kind, trained_on in training_sets(spec, {k: specs[k] for k in keys if k != key}).items():
            if not trained_on:
                continue
            train = [s for k in trained_on for s in samples[k]]
            row = {"search": name, "transfer": kind, "strategies": len(mine), "trained_on": len(train),
                   "searches_trained_on": len(trained_on), "hap": hap_price}
            for sim_kind in KINDS:
                sim = Simulator(sim_kind, seed=0)
                sim.train(train, epochs=60)
                row[sim_kind] = ranking_accuracy(sim.scores(mine), mine)
            rows.append(row)
            print(f"{name}: {row['strategies']} strategies ranked by simulators trained on {kind} "
                  f"({len(trained_on)} searches, {len(train)} strategies): "
                  + ", ".join(f"{k} {row[k]:.2f}" for k in KINDS) + f"; hap's own price {hap_price:.2f}", flush=True)
    (out / "transfer.json").write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
