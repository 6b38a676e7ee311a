"""What checking the reconstruction against the model costs (issue 25; probe/session/verify.py).

    PYTHONPATH=. python benchmarks/verify_cost.py [--workloads bert-padded,llama-gqa,bert-padded-eager]
                                                  [--rounds 9] [--steps 4] [--seq 0] [--batch 0]

For each workload (benchmarks/workloads.py, Hugging Face models from configs) it reports, in one
run, ratios of times measured side by side:

- ``first step``: the first sampled step (where every site is checked on 8 rows) with the check
  over the same step with the check switched off (each in a fresh probe; the first-forward audit
  runs in both);
- ``every=1``: the median of each round's ratio of a probed training step with the check (every
  site's 32nd call is checked on 2 rows) to the same step without it, rounds alternating the two
  arms, and the probed step with the check over the bare step (docs/performance.md's goals: 1.3x
  BERT padded, 1.5x Llama GQA);
- ``one check``: the time of one first check (8 rows) of the workload's first site, and of the
  statistics of that call, to compare.

"Without the check" replaces ``Verifier.verify`` by a function that returns nothing (the site is
then neither checked nor unverified); everything else is the same code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import probe  # noqa: E402
from benchmarks.workloads import build  # noqa: E402
from probe.session import verify as verify_mod  # noqa: E402

_REAL = verify_mod.Verifier.verify


def _off(self: Any, key: Any, call: Any, step: int) -> None:
    return None


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _probed_steps(workload: Any, steps: int, check: bool) -> List[float]:
    verify_mod.Verifier.verify = _REAL if check else _off  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with probe.watch(workload.model, every=1) as p:
                times = [_timed(lambda: workload.step(workload.model)) for _ in range(steps)]
                p.summary()
        return times
    finally:
        verify_mod.Verifier.verify = _REAL  # type: ignore[method-assign]


def one_check(workload: Any) -> Dict[str, float]:
    """Time the first check of the first site's call, and its forward statistics."""
    from probe.stats.forward import forward_stats

    calls: List[Any] = []
    original = verify_mod.Verifier.verify

    def spy(self: Any, key: Any, call: Any, step: int) -> Any:
        if not calls:
            calls.append(call)
        return original(self, key, call, step)

    verify_mod.Verifier.verify = spy  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with probe.watch(workload.model):
                workload.step(workload.model)
    finally:
        verify_mod.Verifier.verify = original  # type: ignore[method-assign]
    call = calls[0]
    verifier = verify_mod.Verifier(64 * 2**20, lambda site, message: None)
    with torch.no_grad():
        check = min(_timed(lambda: verifier._check(call, verify_mod.CHECK_ROWS)) for _ in range(5))
        later = min(_timed(lambda: verifier._check(call, verify_mod.LATER_ROWS)) for _ in range(5))
        stats = min(_timed(lambda: forward_stats(call, {"actual": call.scale, "unscaled": 1.0,
                                                        "standard": call.standard_scale})) for _ in range(3))
    return {"check_ms": 1e3 * check, "later_ms": 1e3 * later, "stats_ms": 1e3 * stats}


def run(name: str, rounds: int, steps: int, seq: int, batch: int) -> Dict[str, Any]:
    workload = build(name, seq, batch)
    for _ in range(2):
        workload.step(workload.model)  # warm up
    first_on, first_off, ratios, bare_ratios = [], [], [], []
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got: Dict[bool, List[float]] = {}
        for check in order:
            got[check] = _probed_steps(workload, steps, check)
        bare = [_timed(lambda: workload.step(workload.model)) for _ in range(steps)]
        first_on.append(got[True][0])
        first_off.append(got[False][0])
        on, off = statistics.median(got[True][1:]), statistics.median(got[False][1:])
        ratios.append(on / off)
        bare_ratios.append(on / statistics.median(bare))
    return {"name": name, "description": workload.description,
            "first": statistics.median(a / b for a, b in zip(first_on, first_off)),
            "first_ms": 1e3 * (statistics.median(first_on) - statistics.median(first_off)),
            "every1": statistics.median(ratios), "every1_range": (min(ratios), max(ratios)),
            "vs_bare": statistics.median(bare_ratios), **one_check(workload)}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="bert-padded,llama-gqa,bert-padded-eager")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=4, help="probed steps per arm and round (the first is the "
                        "first sampled step)")
    parser.add_argument("--seq", type=int, default=0, help="sequence length (0: the workload's own)")
    parser.add_argument("--batch", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")
    print("| workload | first sampled step: with / without check | (ms) | every=1: with / without (min..max) | "
          "every=1 with check × bare | one first check (8 rows) | one later check (2 rows) | that call's statistics |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.workloads.split(","):
        r = run(name, args.rounds, args.steps, args.seq, args.batch)
        lo, hi = r["every1_range"]
        print(f"| {r['name']} | {r['first']:.3f} | {r['first_ms']:+.1f} | {r['every1']:.3f} ({lo:.3f}..{hi:.3f}) | "
              f"{r['vs_bare']:.2f} | {r['check_ms']:.2f} ms | {r['later_ms']:.2f} ms | {r['stats_ms']:.1f} ms |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
