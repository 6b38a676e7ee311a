"""Cost of probe on the unsampled steps of a torch.compile'd model, and of a sampled (eager) step.

A 2-layer SDPA model (d_model 64, 4 heads, batch 2, 16 tokens), forward only, compiled with the
``eager`` backend (``--backend inductor`` for inductor). Arms, each timed over ``--steps``
forwards after warm-up, the best of ``--repeats`` rounds (a shared machine is noisy):

- ``bare``: the compiled model, no probe;
- ``watch(compiled)``: ``probe.watch(torch.compile(model), every=10**9)``: probe's hooks sit on
  the OptimizedModule, outside the graph;
- ``compile after watch``: ``probe.watch(model, every=10**9)`` then ``torch.compile(model)``:
  Dynamo traces the root hooks, which leave the graph (two graph breaks per forward);
- ``sampled``: ``probe.watch(torch.compile(model), every=1)``: every step runs eagerly under
  ``force_eager`` and is measured.

Printed: microseconds per forward and the ratio to ``bare``.

Usage::

    python benchmarks/compile_overhead.py
    python benchmarks/compile_overhead.py --backend inductor --steps 200
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import probe  # noqa: E402
from tests.helpers import SDPAModel  # noqa: E402


def timed(run, x, steps: int, repeats: int) -> float:
    for _ in range(5):
        run(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            run(x)
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)
    results = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SDPAModel()
        torch._dynamo.reset()
        results["bare"] = timed(torch.compile(model, backend=args.backend), x, args.steps, args.repeats)

        torch._dynamo.reset()
        compiled = torch.compile(SDPAModel(), backend=args.backend)
        with probe.watch(compiled, every=10**9):
            results["watch(compiled)"] = timed(compiled, x, args.steps, args.repeats)

        torch._dynamo.reset()
        model = SDPAModel()
        with probe.watch(model, every=10**9):
            results["compile after watch"] = timed(torch.compile(model, backend=args.backend), x, args.steps, args.repeats)

        torch._dynamo.reset()
        compiled = torch.compile(SDPAModel(), backend=args.backend)
        with probe.watch(compiled, every=1):
            results["sampled (eager + stats)"] = timed(compiled, x, max(1, args.steps // 10), args.repeats)

    bare = results["bare"]
    print(f"backend={args.backend} torch={torch.__version__} steps={args.steps} best of {args.repeats}")
    for name, seconds in results.items():
        print(f"{name:26s} {seconds * 1e6:10.1f} us/forward   x{seconds / bare:.2f}")


if __name__ == "__main__":
    main()
