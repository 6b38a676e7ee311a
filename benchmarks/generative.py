"""The generative check at scale (issue 25): thousands of attention implementations drawn from the
grammar of ``tests/capture/grammar.py``, each run bare and under ``probe.watch`` (outputs and
gradients must be bitwise the same) and judged against float64 from its own probabilities and
its unscaled q, k: ``exact`` (every value within 1e-4), ``named`` (a warning names the site:
scale unknown, not measured, unverified) or ``silent`` (wrong or missing, nothing said).

Prints the counts, split by whether the program applies an op probe does not model
(``Spec.hazardous``: those must be named, the others exact), and every silent or unexpected
program with what was wrong. The suite runs a few hundred of the same programs
(``tests/capture/test_generative.py``).

    PYTHONPATH=. python benchmarks/generative.py [--programs 3000] [--start 0]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.capture.grammar import CHOICES, draw  # noqa: E402
from tests.capture.test_generative import run_program  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=3000)
    parser.add_argument("--start", type=int, default=0, help="first seed")
    args = parser.parse_args()
    counts: collections.Counter = collections.Counter()
    odd = []
    t0 = time.perf_counter()
    for seed in range(args.start, args.start + args.programs):
        spec = draw(seed)
        try:
            outcome, detail = run_program(spec)
        except AssertionError as err:  # outputs or gradients changed
            outcome, detail = "changed", str(err)[:300]
        counts[(outcome, spec.hazardous)] += 1
        if outcome in ("silent", "changed") or (outcome != "exact" and not spec.hazardous):
            odd.append((outcome, spec, detail))
    seconds = time.perf_counter() - t0
    total = sum(counts.values())
    print(f"{total} programs ({args.start}..{args.start + total - 1}) from a grammar of {len(CHOICES)} choices, "
          f"{seconds:.0f} s")
    for outcome in ("exact", "named", "silent", "changed"):
        plain, hazard = counts[(outcome, False)], counts[(outcome, True)]
        print(f"  {outcome:8s} {plain + hazard:6d}   (no hazard {plain}, with an op probe does not model {hazard})")
    for outcome, spec, detail in odd:
        print(f"\n{outcome}: {spec}\n    {detail}")
    return 1 if counts[("silent", False)] + counts[("silent", True)] + counts[("changed", False)] + \
        counts[("changed", True)] else 0


if __name__ == "__main__":
    sys.exit(main())
