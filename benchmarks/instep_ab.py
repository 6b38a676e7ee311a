"""Two variants of probe's internals inside one real training step: arms alternating step by step in
one process, on one watched model.

Step ratios move more between runs on a shared machine than most changes inside ``probe.stats``
do (the same arm read 1.20-1.41x within an hour here), so a change there is measured where it
acts: each step runs one arm's setup (Python, executed before the step), then the step, timed by
the process's CPU clock, with the time spent inside the forward statistics
(``recorder.forward_rows`` and the fields' finishing, ``finish_fields``, at the call or the
forward's end), the backward's ``grad_logits`` (``grad_hooks.grad_logits_stats``)
and the gradient norms of q, k, v (``grad_hooks.head_sq``) counted apart. The medians of each arm
and the median of the paired step differences (B − A, each B step against the A step before it)
are printed. Arms alternate, so drift (another process, the machine's clock) falls on both.

An arm's setup usually sets a module constant, e.g. the chunk size::

    python benchmarks/instep_ab.py --workload llama-gqa --steps 20 \\
        --a "import probe.stats.chunks as c; c._CACHE_CHUNK_BYTES = 2**20" \\
        --b "import probe.stats.chunks as c; c._CACHE_CHUNK_BYTES = 2**21"

or swaps a function for another version's (load the other file with ``importlib``). State a setup
leaves behind carries over to the other arm's next step unless that arm's setup undoes it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import probe  # noqa: E402
import probe.session.deferred as deferred  # noqa: E402
import probe.session.grad_hooks as grad_hooks  # noqa: E402
import probe.session.recorder as recorder  # noqa: E402
from workloads import WORKLOADS, build  # noqa: E402

PARTS = ("forward", "backward", "grad_qkv")


class _Timed:
    """Times calls of ``owner.name`` (re-wrapped after an arm's setup replaced it)."""

    def __init__(self, owner: Any, name: str, spent: Dict[str, float], part: str) -> None:
        self.owner, self.name, self.spent, self.part = owner, name, spent, part
        self.target: Optional[Callable[..., Any]] = None
        self.wrapper = self._wrap()

    def _wrap(self) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return self.target(*args, **kwargs)  # type: ignore[misc]
            finally:
                self.spent[self.part] += time.process_time() - start

        return timed

    def install(self) -> None:
        current = getattr(self.owner, self.name)
        if current is not self.wrapper:
            self.target = current
            setattr(self.owner, self.name, self.wrapper)


def run(workload: str, rows: Optional[int], steps: int, setups: Dict[str, str], warmup: int = 2,
        seq: int = 0, batch: int = 0) -> Dict[str, List[List[float]]]:
    """Per arm, per measured step: ``[step ms, forward ms, backward ms, grad_qkv ms]``."""
    spent = {part: 0.0 for part in PARTS}
    timers = [_Timed(recorder, "forward_rows", spent, "forward"), _Timed(recorder, "finish_fields", spent, "forward"),
              _Timed(deferred, "finish_fields", spent, "forward"),
              _Timed(grad_hooks, "grad_logits_stats", spent, "backward"),
              _Timed(grad_hooks, "head_sq", spent, "grad_qkv")]
    w = build(workload, seq, batch)
    namespace: Dict[str, Any] = {}
    results: Dict[str, List[List[float]]] = {arm: [] for arm in setups}
    arms = list(setups)
    with probe.watch(w.model, every=1, rows=rows):
        for i in range(len(arms) * (steps + warmup)):
            arm = arms[i % len(arms)]
            exec(setups[arm], namespace)  # noqa: S102 - the user's own benchmark setup
            for timer in timers:
                timer.install()
            for part in PARTS:
                spent[part] = 0.0
            start = time.process_time()
            w.step(w.model)
            took = time.process_time() - start
            if i >= len(arms) * warmup:
                results[arm].append([took * 1e3] + [spent[part] * 1e3 for part in PARTS])
    return results


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="bert-padded")
    parser.add_argument("--rows", default="128", help="rows= of the watched model ('none': every row)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per arm")
    parser.add_argument("--seq", type=int, default=0)
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--a", default="pass", help="arm A's setup (Python, run before each of its steps)")
    parser.add_argument("--b", default="pass", help="arm B's setup")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = None if args.rows.lower() == "none" else int(args.rows)
    res = run(args.workload, rows, args.steps, {"A": args.a, "B": args.b}, seq=args.seq, batch=args.batch)
    print(f"{args.workload}, rows={rows}, {args.steps} steps per arm, alternating, torch threads {args.threads}, CPU ms")
    print(f"{'arm':4s} {'step':>8s} {'forward':>9s} {'backward':>9s} {'grad_qkv':>9s}")
    for arm, rows_ in res.items():
        med = [statistics.median(col) for col in zip(*rows_)]
        print(f"{arm:4s} {med[0]:8.1f} {med[1]:9.2f} {med[2]:9.2f} {med[3]:9.2f}")
    paired = [b[0] - a[0] for a, b in zip(res["A"], res["B"])]
    print(f"B - A, paired step difference: median {statistics.median(paired):+.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
