"""The demo's numbers over torch thread counts (and seeds): the ranges README and docs/ quote.

Training is deterministic for one thread count, but the number of threads changes the order of
float reductions, and the run without the divisor is chaotic: its late numbers differ from one
thread count to the next. This script runs ``probe demo`` in a fresh process per thread count
(``OMP_NUM_THREADS``) and seed and prints, per run and number, the range over all of them, and
whether each verdict and reading word held everywhere::

    python benchmarks/demo_ranges.py                     # threads 1 and 2, seed 0 (what a user runs)
    python benchmarks/demo_ranges.py --threads 1 2 4 --seeds 0 1 2 3
    python benchmarks/demo_ranges.py --json ranges.json  # also write every run's numbers

Each demo takes 20-60 s on 2 cores, so the default takes one to two minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

_ONE = """
import json, sys
from probe.cli.demo import facts, run_demo
results = run_demo(steps={steps}, logdir=sys.argv[1], seed={seed}, out=open('/dev/null', 'w'))
print(json.dumps(facts(results)))
"""

#: (key, label, format) of the numbers to show.
ROWS = (
    ("saturation_first", "saturation, first probed step", "{:.2f}"),
    ("saturation_last", "saturation, last probed step", "{:.2f}"),
    ("entropy_first", "entropy, first probed step", "{:.3f}"),
    ("entropy_last", "entropy, last probed step", "{:.3f}"),
    ("logit_max_first", "max logit, first probed step", "{:.1f}"),
    ("logit_max_last", "max logit, last probed step", "{:.1f}"),
    ("run_logit_max", "max logit over the run (probe check)", "{:.1f}"),
    ("grad_ratio_first", "grad ratio, first probed step", "{:.2f}"),
    ("grad_ratio_last", "grad ratio, last probed step", "{:.3f}"),
    ("loss_first", "loss, step 0", "{:.2f}"),
    ("loss_middle", "loss, middle 10 steps", "{:.2f}"),
    ("loss_last", "loss, last 10 steps", "{:.2f}"),
    ("counting", "counting bound, last 10 batches", "{:.2f}"),
    ("one_token", "one-token bound, last 10 batches", "{:.2f}"),
)


def run_one(threads: int, seed: int, steps: int) -> Dict[str, Dict[str, Any]]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as logdir:
        out = subprocess.run([sys.executable, "-c", _ONE.format(steps=steps, seed=seed), logdir],
                             capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"demo failed at {threads} threads, seed {seed}:\n{out.stderr}")
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    for row in facts.values():
        row["run_logit_max"] = row["verdict"]["logit_max"]
    return facts


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    runs = []
    for seed in args.seeds:
        for threads in args.threads:
            facts = run_one(threads, seed, args.steps)
            runs.append({"threads": threads, "seed": seed, "facts": facts})
            brief = "  ".join(f"{name}: {'PASS' if row['verdict']['ok'] else 'FAIL'} max logit "
                              f"{row['run_logit_max']:.1f} loss {row['loss_last']:.2f}" for name, row in facts.items())
            print(f"threads {threads} seed {seed}: {brief}", flush=True)
    names = list(runs[0]["facts"])
    print(f"\nranges over threads {args.threads}, seeds {args.seeds}, {args.steps} steps:")
    print(f"{'':<40}" + "".join(f"{name:>22}" for name in names))
    for key, label, fmt in ROWS:
        cells = []
        for name in names:
            values = [r["facts"][name][key] for r in runs if not math.isnan(r["facts"][name][key])]
            lo, hi = (min(values), max(values)) if values else (math.nan, math.nan)
            cells.append(fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}")
        print(f"{label:<40}" + "".join(f"{c:>22}" for c in cells))
    verdicts = {name: sorted({r["facts"][name]["verdict"]["ok"] for r in runs}) for name in names}
    print("verdicts: " + ", ".join(f"{name} {'PASS' if v == [True] else 'FAIL' if v == [False] else 'MIXED'}"
                                   for name, v in verdicts.items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
