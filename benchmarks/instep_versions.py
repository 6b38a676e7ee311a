"""Two versions of probe inside one process, each watching its own copy of one model, steps
alternating: per step, the CPU time inside each version's statistics and the whole step.

``overhead.py --before`` compares whole steps, whose ratio moves by ±0.04 between fresh processes
on a shared 2-core machine (the same code; docs/performance.md, "Ninth round"): a change of a few
milliseconds needs dozens of processes there. The time probe spends inside its own statistics
moves much less, so this measures that, per step, for both versions side by side:

- ``forward``: ``recorder.forward_rows`` and the finishing (``deferred.finish_fields``),
- ``backward``: ``grad_hooks.grad_logits_stats``,
- ``grad_qkv``: ``grad_hooks.head_sq``,
- ``parts``: their sum, and ``step``: the whole training step,

each the median over the steps, then the median of the paired differences (now − before, each
step against the other version's step next to it; the order alternates every round) and a
distribution-free 95 % interval of that median (``overhead.median_interval``). Setup::

    sh benchmarks/before.sh COMMIT /tmp/before
    PYTHONPATH=$PWD:/tmp/before python benchmarks/instep_versions.py --workload bert-padded --steps 40

Run it with the copies swapped too (``--swap``: the older version watches the original model):
which copy a version watches can move its numbers by a millisecond.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from instep_ab import PARTS, _Timed  # noqa: E402
from overhead import median_interval  # noqa: E402
from workloads import WORKLOADS, build  # noqa: E402


# (module under the package, attribute, part) timed in each version: instep_ab.py's parts
_TIMED = (("session.recorder", "forward_rows", "forward"), ("session.recorder", "finish_fields", "forward"),
          ("session.deferred", "finish_fields", "forward"), ("session.grad_hooks", "grad_logits_stats", "backward"),
          ("session.grad_hooks", "head_sq", "grad_qkv"))


def _instrument(package: str) -> Dict[str, float]:
    """Wrap the timed functions of ``package`` (``probe`` or the other version's name) with
    instep_ab.py's timers; returns the dict their CPU time accumulates in."""
    spent = {part: 0.0 for part in PARTS}
    for module_name, attr, part in _TIMED:
        _Timed(importlib.import_module(f"{package}.{module_name}"), attr, spent, part).install()
    return spent


def run(workload: str, before: str, steps: int, swap: bool, warmup: int = 3) -> Dict[str, Dict[str, List[float]]]:
    versions = {"now": "probe", "before": before}
    spent = {label: _instrument(package) for label, package in versions.items()}
    w = build(workload)
    other = copy.deepcopy(w.model)
    models = {"now": other, "before": w.model} if swap else {"now": w.model, "before": other}
    probes = {label: importlib.import_module(package).watch(models[label], every=1)
              for label, package in versions.items()}
    results: Dict[str, Dict[str, List[float]]] = {label: {k: [] for k in PARTS + ("parts", "step")} for label in versions}
    try:
        for r in range(warmup + steps):
            order = ["now", "before"] if r % 2 == 0 else ["before", "now"]
            for label in order:
                parts = spent[label]
                for k in parts:
                    parts[k] = 0.0
                start = time.process_time()
                w.step(models[label])
                took = time.process_time() - start
                if r >= warmup:
                    row = results[label]
                    row["step"].append(took)
                    for k in PARTS:
                        row[k].append(parts[k])
                    row["parts"].append(sum(parts.values()))
    finally:
        for p in probes.values():
            p.close()
    return results


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="bert-padded", choices=list(WORKLOADS))
    parser.add_argument("--before", default="probe_before", help="the other version's module name (benchmarks/before.sh)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--swap", action="store_true", help="the other version watches the original model, this one the copy")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = run(args.workload, args.before, args.steps, args.swap)
    cols = PARTS + ("parts", "step")
    print(f"{args.workload}, {args.steps} steps per version, alternating, torch threads {args.threads}, CPU ms (medians)")
    print(f"{'version':10s}" + "".join(f"{c:>11s}" for c in cols))
    for label, row in res.items():
        print(f"{label:10s}" + "".join(f"{1e3 * statistics.median(row[c]):11.2f}" for c in cols))
    paired = {c: [a - b for a, b in zip(res["now"][c], res["before"][c])] for c in cols}
    print(f"{'now-before':10s}" + "".join(f"{1e3 * statistics.median(paired[c]):+11.2f}" for c in cols)
          + "   (median of paired differences)")
    bounds = {c: median_interval(paired[c]) for c in cols}
    print("95 % interval of each median (distribution-free): " + ", ".join(
        f"{c} [{1e3 * bounds[c][0]:+.2f}, {1e3 * bounds[c][1]:+.2f}]" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
