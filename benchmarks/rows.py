"""Choosing the default `rows` budget: forward statistics cost against standard error.

For each workload (``benchmarks/workloads.py``) one probed forward + backward per budget gives
the reported ``entropy`` / ``max_prob`` and their standard errors (``*_se``), and the CPU time of
``forward_stats`` alone on the captured q, k of the first layer is timed per budget,
interleaved, medians. Usage: ``python benchmarks/rows.py [--rounds 5] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe  # noqa: E402
from probe.call import AttentionCall  # noqa: E402
from probe.stats.forward import forward_stats  # noqa: E402
from workloads import build  # noqa: E402

BUDGETS = (None, 512, 256, 128, 64)


def capture_first_call(w) -> AttentionCall:
    calls = []
    p = probe.watch(w.model, every=1)
    p._emit_orig, p._emit = p._emit, lambda call: (calls.append(call), p._emit_orig(call))[1]  # noqa: SLF001
    w.step(w.model)
    p.close()
    return calls[0]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in ("bert-padded", "llama-gqa"):
        w = build(name)
        print(f"\n{w.description}")
        print(f"{'rows':>6} {'fwd stats ms':>13} {'entropy (mean of heads)':>24} {'max SE/value':>13}")
        call = None
        try:
            call = capture_first_call(w)
        except Exception as err:  # noqa: BLE001
            print("could not capture a call:", err)
        times = {b: [] for b in BUDGETS}
        if call is not None:
            scales = {"actual": call.scale, "unscaled": 1.0, "standard": call.standard_scale}
            for r in range(args.rounds + 1):
                for b in BUDGETS:
                    t = time.process_time()
                    with torch.no_grad():
                        forward_stats(call, scales, rows=b, generator=torch.Generator().manual_seed(r))
                    if r:
                        times[b].append(time.process_time() - t)
        for b in BUDGETS:
            with probe.watch(w.model, every=1, rows=b) as p:
                w.step(w.model)
                w.step(w.model)
                s = p.summary()
            ent = [s.value(site, "entropy").mean() for site in s.sites]
            rel = 0.0
            if b is not None and any("entropy_se" in s.metrics(site) for site in s.sites):
                rel = max(float((s.value(site, f"{m}_se") / s.value(site, m)).max())
                          for site in s.sites for m in ("entropy", "max_prob")
                          if f"{m}_se" in s.metrics(site))
            ms = 1e3 * statistics.median(times[b]) if times[b] else float("nan")
            print(f"{str(b):>6} {ms:>13.1f} {sum(ent) / len(ent):>24.4f} {rel:>13.4f}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
