"""Every benchmark, one Markdown report: the paper's experiments and this machine's measurements.

    .venv/bin/python benchmarks/all.py --out out/bench [--quick]      # or: make bench-all / bench-quick

Runs, each as its own process (so one's memory and threads never touch the next's timings):
  1. benchmarks/paper.py     the paper's simulated experiments (Figs. 13, 14, 17, 19): estimates
  2. benchmarks/fidelity.py  estimated vs measured iteration time over model variants (Fig. 18)
  3. benchmarks/runtime_speed.py --node-timing   hap vs DP-EV vs DP-CP measured, hap vs DDP
and writes OUT/report.md (with the PNG plots beside it, in one folder per part). --quick runs
smaller sweeps of each (under 10 minutes on a 2-core machine); the full run takes about 20.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PARTS = {  # folder: (script, extra arguments, the Markdown it writes)
    "paper": ("paper.py", [], "paper.md"),
    "fidelity": ("fidelity.py", [], "fidelity.md"),
    "runtime": ("runtime_speed.py", ["--node-timing"], "runtime.md"),
}


def run_part(folder: str, out_dir: str, quick: bool) -> tuple[str, float]:
    """Run one benchmark into out_dir/folder; its Markdown with image links made relative to
    out_dir, and the seconds it took."""
    script, extra, md = PARTS[folder]
    part_dir = os.path.join(out_dir, folder)
    os.makedirs(part_dir, exist_ok=True)
    cmd = [sys.executable, os.path.join(HERE, script), "--out", part_dir, *extra] + (["--quick"] if quick else [])
    print(f"[bench] {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(os.path.join(part_dir, "log.txt"), "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        tail = open(os.path.join(part_dir, "log.txt")).read().splitlines()[-15:]
        return (f"## {folder}: FAILED (exit code {done.returncode})\n\n```\n" + "\n".join(tail) + "\n```\n"), seconds
    text = open(os.path.join(part_dir, md)).read()
    return re.sub(r"\]\((?!https?:|/)([^)]+\.png)\)", rf"]({folder}/\1)", text), seconds


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/bench", help="folder for the report, plots and raw results")
    ap.add_argument("--quick", action="store_true", help="smaller sweeps: under 10 minutes on 2 cores")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS))
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    sections, timings, failed = [], [], False
    for folder in parts:
        text, seconds = run_part(folder, args.out, args.quick)
        failed |= "FAILED (exit code" in text.splitlines()[0]
        sections.append(text)
        timings.append(f"{folder} {seconds:.0f} s")
        print(f"[bench] {folder}: {seconds:.0f} s", file=sys.stderr, flush=True)
    total = time.perf_counter() - t0
    head = ["# hap benchmark report", "",
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {_commit()}, "
            f"{'quick' if args.quick else 'full'} run: `python benchmarks/all.py{' --quick' if args.quick else ''}`; "
            f"{os.cpu_count()} CPU cores, Python {platform.python_version()}; took {total / 60:.1f} min "
            f"({', '.join(timings)}).", "",
            "Simulated figures are the cost model's estimates for the paper's testbed; the local-cluster figures "
            "are measured on this machine.", ""]
    path = os.path.join(args.out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(head) + "\n" + "\n".join(sections))
    print(f"[bench] wrote {path} in {total / 60:.1f} min", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
