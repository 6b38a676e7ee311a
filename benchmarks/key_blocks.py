"""The centred path over blocks of keys against the chunked one, per call: time ratios in one run.

``probe.stats.paths.key_blocks`` takes a call when the chunked variant's centred copy of k and buffers
over every key would outgrow a quarter of ``memory_budget`` (about S = 2048 at 8 heads of 64).
Here both variants run on the same calls, interleaved, and the ratio of their median times is
printed (below 1: the blocks are faster), at the default ``rows=128`` and at ``rows=None``
(every row exact: the blocks multiply every row twice). Shapes: the benchmark workloads' (which
keep the chunked variant by default) and longer causal calls, in the contiguous SDPA layout and
in Hugging Face's (transposed views, grouped-query attention).

Usage::

    python benchmarks/key_blocks.py               # 5 interleaved rounds, 2 threads
    python benchmarks/key_blocks.py --rounds 3 --lengths 2048 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import List, Optional

import torch

from probe.call import AttentionCall
from probe.stats import chunks, plan
from probe.stats.forward import forward_stats
from probe.stats.sampling import sample_rows

SCALES = {"actual": 0.125, "unscaled": 1.0, "standard": 0.125}


def _call(batch: int, heads: int, kv: int, length: int, causal: bool, hf: bool) -> AttentionCall:
    g = torch.Generator().manual_seed(0)
    if hf:  # transposed views of (B, L, H, d) projections
        q = torch.randn(batch, length, heads, 64, generator=g).transpose(1, 2)
        k = torch.randn(batch, length, kv, 64, generator=g).transpose(1, 2)
    else:
        q = torch.randn(batch, heads, length, 64, generator=g)
        k = torch.randn(batch, kv, length, 64, generator=g)
    return AttentionCall(q=q, k=k, v=None, scale=0.125, causal=causal)


def _time(call: AttentionCall, rows: Optional[int], blocked: bool) -> float:
    plan.blocked_keys = lambda *args: blocked  # type: ignore[assignment]
    positions = None if rows is None else sample_rows(call.q.shape[2], rows, torch.Generator().manual_seed(1))
    start = time.perf_counter()
    forward_stats(call, SCALES, rows=positions)
    return time.perf_counter() - start


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192],
                        help="causal (1, 8, L, 64) calls, both layouts, besides the workloads' shapes")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    real = plan.blocked_keys
    cases = [("bert-padded shape (2, 4, 512), full", (2, 4, 4, 512, False, True)),
             ("llama-gqa shape (1, 8/2, 1024), causal", (1, 8, 2, 1024, True, True))]
    for length in args.lengths:
        cases.append((f"(1, 8, {length}), causal, SDPA layout", (1, 8, 8, length, True, False)))
        cases.append((f"(1, 8/2, {length}), causal, HF layout", (1, 8, 2, length, True, True)))
    print(f"forward_stats per call, median of {args.rounds} interleaved rounds, {args.threads} threads; "
          "ratio = key blocks / chunks")
    print(f"{'call':<42}{'rows':>6}{'chunks ms':>11}{'blocks ms':>11}{'ratio':>7}{'default':>10}")
    try:
        for name, shape in cases:
            call = _call(*shape)
            batch, heads, _, length = shape[:4]
            budget = 64 * 2**20  # forward_stats' step, as it plans it
            step = min(chunks.chunk_rows(batch, heads, length, budget),
                       chunks.cache_chunk_rows(batch, heads, length), length)
            for rows in (128, None):
                default = "blocks" if real(call, None, step, rows, budget) else "chunks"
                _time(call, rows, False), _time(call, rows, True)  # warm-up
                times = {False: [], True: []}
                for _ in range(args.rounds):
                    for blocked in (False, True):
                        times[blocked].append(_time(call, rows, blocked))
                chunked, blocked = (statistics.median(times[b]) * 1e3 for b in (False, True))
                print(f"{name:<42}{str(rows):>6}{chunked:>11.1f}{blocked:>11.1f}{blocked / chunked:>7.2f}{default:>10}")
                sys.stdout.flush()
    finally:
        plan.blocked_keys = real  # type: ignore[assignment]
    return 0


if __name__ == "__main__":
    sys.exit(main())
