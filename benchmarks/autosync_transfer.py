"""AutoSync's transfer, measured: simulators trained only on another search's measured strategies
rank this search's.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/autosync_transfer.py --out out/bench-autosync-transfer

Two searches share one log (DIR/trials.jsonl): VGG19 (small) on the local cluster at its own
batch (8) and at batch 16, `--trials` each (about a minute each at 12). For each search, every
simulator is trained on the other search's measured strategies alone (baselines included, the
confirmations left out) and its pairwise ranking accuracy is taken on all of this search's; hap's
own price ranks the same strategies for comparison. Searches already in DIR are not run again.
Writes DIR/transfer.json and prints a line per search.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SEARCHES = [{"scale": "small"}, {"scale": "small", "batch": 16}]


def main() -> int:
    from hap.cost.cluster import load_cluster
    from hap.sync import AutoSyncConfig, autosync
    from hap.sync.simulators import KINDS, Simulator, ranking_accuracy

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/bench-autosync-transfer")
    ap.add_argument("--trials", type=int, default=12)
    args = ap.parse_args()
    out = Path(args.out)
    cluster = load_cluster("local")
    for knobs in SEARCHES:
        autosync.run("vgg19", knobs, cluster, out, AutoSyncConfig(trials=args.trials, candidates=20),
                     say=lambda m: print(m, flush=True))
    history = autosync._load(out / "trials.jsonl")
    rows = []
    for key in sorted({t["domain"] for t in history}):
        measured = [t for t in history if t["domain"] == key and not t["kind"].startswith("confirm")]
        mine = autosync.logged_samples(out, key, measured)
        others = autosync._other_samples(history, key, out, say=lambda m: None)
        row = {"search": json.loads((out / "domains" / f"{key}.json").read_text())["knobs"], "strategies": len(mine),
               "trained_on": len(others), "hap": ranking_accuracy([t["hap_estimate"] for t in measured], mine)}
        for kind in KINDS:
            sim = Simulator(kind, seed=0)
            sim.train(others, epochs=60)
            row[kind] = ranking_accuracy(sim.scores(mine), mine)
        rows.append(row)
        print(f"vgg19 {row['search']}: {row['strategies']} strategies ranked by simulators trained on the other "
              f"search's {row['trained_on']} alone: " + ", ".join(f"{k} {row[k]:.2f}" for k in KINDS)
              + f"; hap's own price {row['hap']:.2f}", flush=True)
    (out / "transfer.json").write_text(json.dumps({"searches": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
