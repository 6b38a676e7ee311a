"""The measurements behind the default ``rows=128`` (docs/performance.md, "Sampled rows").

- ``se WORKLOAD [--budgets 64,128,256]``: one probed step (forward + backward) of a workload
  (``benchmarks/workloads.py``) with ``rows=N`` and with ``rows=None``: per metric and scale, the
  median and largest standard error relative to the exact value, and ``|error| / SE``.
- ``sharp [--length 1024]``: a causal GQA call with 8 heads from near uniform to peaked, 20
  seeded draws per budget: the largest per-head standard error of one call and how often
  ``±1.96 SE`` covers the exact mean.
- ``cost WORKLOAD [--budgets none,64,128,256] [--threads 2]``: the step's CPU time with a probe
  at ``every=1`` (no logdir) per budget, relative to the bare step, interleaved rounds, medians.
  Hold the bench lock: ``flock /work/coord/bench.lock python benchmarks/rows_default.py cost ...``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe  # noqa: E402
from probe.call import AttentionCall  # noqa: E402
from probe.stats.forward import forward_stats  # noqa: E402
from workloads import build  # noqa: E402

ESTIMATED = ("entropy", "max_prob", "saturation", "grad_logits")


def _budgets(text: str):
    return [None if x == "none" else int(x) for x in text.split(",")]


def se(workload: str, budgets) -> None:
    warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN ratios where nothing saturates
    w = build(workload)

    def run(rows):
        with probe.watch(w.model, rows=rows) as p:
            w.step(w.model)
        return p.summary()

    exact = run(None)
    for rows in budgets:
        s = run(rows)
        print(f"== {w.name} rows={rows}")
        for m in ESTIMATED:
            for scale in ("actual", "unscaled"):
                sites = s.sites
                v = np.concatenate([s.value(site, m, scale) for site in sites])
                err = np.concatenate([s.standard_error(site, m, scale) for site in sites])
                ex = np.concatenate([exact.value(site, m, scale) for site in sites])
                with np.errstate(divide="ignore", invalid="ignore"):
                    rel, z = err / np.abs(ex), np.abs(v - ex) / err
                print(f"  {m:11s}@{scale:8s} exact mean {np.mean(ex):.4g}  SE/value median {np.nanmedian(rel):.2%} "
                      f"max {np.nanmax(rel) if np.isfinite(rel).any() else float('nan'):.2%}  "
                      f"|err|/SE median {np.nanmedian(z) if np.isfinite(z).any() else float('nan'):.2f}")


def sharp(length: int, budgets) -> None:
    g = torch.Generator().manual_seed(0)
    heads, d = 8, 32
    k = torch.randn(1, 2, length, d, generator=g)
    temps = torch.tensor([0.5, 1, 2, 4, 0.5, 1, 2, 4.0]).view(1, heads, 1, 1)
    self_weight = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1.0]).view(1, heads, 1, 1)  # attend to itself
    q = temps * (self_weight * k.repeat_interleave(4, 1) + torch.randn(1, heads, length, d, generator=g))
    call = AttentionCall(q=q, k=k, v=None, scale=d**-0.5, causal=True)
    scales = {"actual": d**-0.5}
    ex = forward_stats(call, scales, saturation=0.9)
    for field in ("entropy", "max_prob"):
        print(f"exact {field}: {(ex[f'{field}@actual'] / ex['rows']).numpy().round(3)}")
    for rows in budgets:
        for field in ("entropy", "max_prob"):
            ses, inside = [], []
            for seed in range(20):
                f = forward_stats(call, scales, saturation=0.9, rows=rows, generator=torch.Generator().manual_seed(seed))
                est, x = f[f"{field}@actual"] / f["rows"], ex[f"{field}@actual"] / ex["rows"]
                err = f[f"{field}_var@actual"].clamp(min=0).sqrt() / f["rows"]
                ses.append(err.numpy())
                inside.append(((est - x).abs() <= 1.96 * err).numpy())
            print(f"rows={rows} {field:9s} largest SE of one call {np.max(np.median(ses, 0)):.3f}  "
                  f"covered by ±1.96 SE {np.mean(inside):.0%}")


def cost(workload: str, budgets, rounds: int) -> None:
    w = build(workload)
    arms = {"bare": (copy.deepcopy(w.model), None)}
    for rows in budgets:
        model = copy.deepcopy(w.model)
        arms[f"rows={rows}"] = (model, probe.watch(model, every=1, rows=rows))
    times = {name: [] for name in arms}
    for r in range(2 + rounds):  # two warm-up rounds
        names = list(arms)
        for name in names[r % len(names):] + names[: r % len(names)]:
            model, p = arms[name]
            t0 = time.process_time()
            w.step(model)
            if p is not None:
                p.summary()
            if r >= 2:
                times[name].append(time.process_time() - t0)
    bare = statistics.median(times["bare"])
    print(f"{w.name}: {torch.get_num_threads()} threads, bare {bare * 1e3:.0f} ms CPU, × bare: " + "  ".join(
        f"{name} {statistics.median(t) / bare:.3f}" for name, t in times.items() if name != "bare"))
    for _, p in arms.values():
        if p is not None:
            p.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["se", "sharp", "cost"])
    parser.add_argument("workload", nargs="?", default="llama-gqa")
    parser.add_argument("--budgets", default=None)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.what == "se":
        se(args.workload, _budgets(args.budgets or "64,128,256"))
    elif args.what == "sharp":
        sharp(args.length, _budgets(args.budgets or "64,128,256"))
    else:
        cost(args.workload, _budgets(args.budgets or "none,64,128,256"), args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
