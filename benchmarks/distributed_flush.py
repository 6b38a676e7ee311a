"""Cost of one distributed flush: probe's cross-rank reduction, per flush, on CPU with gloo.

Each rank holds the accumulator state of a model with ``--sites`` attention sites of ``--heads``
heads (the fields ``forward_stats`` and the gradient hooks produce at the three built-in scales),
then calls :meth:`probe.state.distributed.Reducer.reduce` ``--flushes`` times: the first flush agrees on
the layout (3 collectives), every later one is a single ``all_gather``. Printed: the bytes each
rank sends, the first flush, the median steady flush, and the ratio to a local flush (pack + host
copy, what one process pays without torch.distributed). Ranks are processes on this machine, so
the numbers are latency of the loopback transport plus the host-side combine, not network time.

Usage::

    python benchmarks/distributed_flush.py                      # 2 ranks, 24 sites x 16 heads
    python benchmarks/distributed_flush.py --world 4 --sites 48 --heads 32
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FIELDS_PER_SCALE = ("logit@{s}", "logit_max@{s}", "entropy@{s}", "max_prob@{s}", "saturated@{s}", "grad_logits_sq@{s}")
OTHER_FIELDS = ("rows", "nonfinite", "grad_q_sq", "grad_k_sq", "grad_v_sq")


def fake_state(rank: int, sites: int, heads: int):
    g = torch.Generator().manual_seed(rank)
    states, infos = {}, {}
    for i in range(sites):
        state = {}
        for scale in ("actual", "unscaled", "standard"):
            for f in FIELDS_PER_SCALE:
                name = f.format(s=scale)
                shape = (3, heads) if name.startswith("logit@") else (heads,)
                state[name] = torch.rand(shape, generator=g, dtype=torch.float64) + 1
        for f in OTHER_FIELDS:
            state[f] = torch.rand(heads, generator=g, dtype=torch.float64)
        states[(f"layers.{i}.attn", 0)] = state
        infos[(f"layers.{i}.attn", 0)] = {"kind": "sdpa", "heads": heads, "kv_heads": heads, "d_k": 64,
                                          "scale": 0.125, "calls": 1}
    return states, infos


def run(rank: int, world: int, port: int, sites: int, heads: int, flushes: int) -> None:
    from probe.state.distributed import Reducer
    from probe.state.accumulator import Accumulator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        states, infos = fake_state(rank, sites, heads)
        reducer = Reducer(dist.group.WORLD)
        times = []
        for step in range(flushes):
            dist.barrier()
            start = time.perf_counter()
            flat, layout, _ = reducer.reduce(states, infos, step)
            times.append(time.perf_counter() - start)
        acc = Accumulator()
        acc.states = states
        local = []
        for _ in range(flushes):
            start = time.perf_counter()
            packed, _ = acc.pack()
            packed.to("cpu", copy=True)
            local.append(time.perf_counter() - start)
        if rank == 0:
            steady = statistics.median(times[1:])
            sent = reducer._pack(states, infos, 0).numel() * 8
            print(f"world={world} sites={sites} heads={heads} fields/site={len(layout) // sites}")
            print(f"bytes per rank per flush: {sent}  (gathered on every rank: {sent * world})")
            print(f"first flush: {times[0] * 1e3:.2f} ms, {3} collectives")
            print(f"steady flush: median {steady * 1e3:.2f} ms over {flushes - 1}, 1 collective, "
                  f"collectives so far {reducer.collectives}")
            print(f"local flush (no torch.distributed): median {statistics.median(local) * 1e3:.3f} ms; "
                  f"ratio steady/local = {steady / statistics.median(local):.1f}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sites", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--flushes", type=int, default=30)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args.world, port, args.sites, args.heads, args.flushes), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
