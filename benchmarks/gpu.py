"""probe on a CUDA GPU: no host synchronization in probed steps, and CUDA-event timings.

The model is the BERT encoder of ``benchmarks/overhead.py`` (4 layers, hidden 256, 4 heads,
d_k 64) in bfloat16, batch 8, sequence 512 and 2048, forward + backward. Two checks:

1. ``torch.cuda.set_sync_debug_mode("error")`` is on across every probed step (forward,
   backward and the flush that starts the next step): any ``.item()``, ``.tolist()``,
   ``bool(tensor)``, ``nonzero`` or blocking copy inside probe raises. The script fails loudly if
   one does.
2. The arms of ``overhead.py`` (bare, unsampled, every=1, every=10, plain reference), interleaved
   round by round, timed with CUDA events (``elapsed_time`` between events recorded on the stream,
   read after one synchronize per round, outside the probed steps).

Without CUDA it prints why and exits 0, so it can sit in a CPU-only CI job.

Usage::

    python benchmarks/gpu.py            # 20 rounds per sequence length
    python benchmarks/gpu.py --quick
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import probe  # noqa: E402
from overhead import PlainMode, PlainStats, build_bert  # noqa: E402


def run_length(seq: int, batch: int, rounds: int, warmup: int) -> Dict[str, float]:
    device = torch.device("cuda")
    base = build_bert(seq).to(device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (batch, seq), device=device)
    models = {name: copy.deepcopy(base) for name in ("bare", "unsampled", "every=1", "every=10", "plain")}
    probes = {
        "unsampled": probe.watch(models["unsampled"], every=10**9),
        "every=1": probe.watch(models["every=1"], every=1),
        "every=10": probe.watch(models["every=10"], every=10),
    }
    plain = PlainStats()

    def step(model: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids).last_hidden_state
        out.float().square().mean().backward()

    step(models["unsampled"])  # its step 0 is sampled; later steps are not
    torch.cuda.synchronize()
    steps = {"every=10": 10}
    times: Dict[str, List[float]] = {name: [] for name in models}
    for r in range(warmup + rounds):
        events = {}
        for name, model in models.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            n = steps.get(name, 1)
            start.record()
            if name == "plain":  # .item() per head and metric: synchronizes by design
                for _ in range(n):
                    with PlainMode(plain):
                        step(model)
            else:
                torch.cuda.set_sync_debug_mode("error")  # any host sync inside probe raises
                try:
                    for _ in range(n):
                        step(model)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            end.record()
            events[name] = (start, end, n)
        torch.cuda.synchronize()
        if r >= warmup:
            for name, (start, end, n) in events.items():
                times[name].append(start.elapsed_time(end) / n)
    torch.cuda.set_sync_debug_mode("error")
    try:
        probes["every=1"].summary()  # the flush path too: one packed, non-blocking copy
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for p in probes.values():
        p.close()
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device visible to torch "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); nothing to measure.")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 model")
    rounds = 5 if args.quick else 20
    for seq in args.seq:
        med = run_length(seq, args.batch, rounds, warmup=2)
        bare = med["bare"]
        print(f"\nBERT 4x256, 4 heads, batch {args.batch}, seq {seq}, fwd+bwd, {rounds} rounds, "
              "sync debug mode 'error' over probed steps: no host sync raised")
        print(f"{'arm':<12}{'median ms':>12}{'x bare':>10}")
        for name, ms in med.items():
            print(f"{name:<12}{ms:>12.2f}{ms / bare:>10.3f}")
        over = med["plain"] - bare
        print(f"probe overhead / plain overhead (every=1): {(med['every=1'] - bare) / over:.3f}" if over > 0 else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
