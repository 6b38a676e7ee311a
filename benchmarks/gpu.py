"""probe on a CUDA GPU: no host synchronization in probed steps, and CUDA-event timings.

The model is the BERT encoder of ``benchmarks/overhead.py`` (4 layers, hidden 256, 4 heads,
d_k 64) in bfloat16, batch 8, sequence 512 and 4096 (4k and 32k tokens), forward + backward.
Two checks:

1. ``torch.cuda.set_sync_debug_mode("error")`` is on across every probed step (forward,
   backward and the flush that starts the next step): any ``.item()``, ``.tolist()``,
   ``bool(tensor)``, ``nonzero`` or blocking copy inside probe raises. The script fails loudly if
   one does.
2. The arms of ``overhead.py`` (bare, unsampled, every=1, every=10, plain reference), interleaved
   round by round, timed with CUDA events (``elapsed_time`` between events recorded on the stream,
   read after one synchronize per round, outside the probed steps).

Without CUDA it prints why and exits 0, so it can sit in a CPU-only CI job. ``--dry-run`` runs
the same arms on the CPU instead (bfloat16, batch 2, sequence 64, one round, ``perf_counter``
timing, no sync check: those two are CUDA's), so that the script itself is known to work before
a device is lent (``tests/test_gpu_benchmark.py`` runs it).

Usage::

    python benchmarks/gpu.py            # 20 rounds per sequence length
    python benchmarks/gpu.py --quick
    python benchmarks/gpu.py --dry-run  # no GPU: the script's own check, on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from typing import Dict, Iterator, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import probe  # noqa: E402
from overhead import PlainMode, PlainStats, build_bert  # noqa: E402


class _CudaTimer:
    """Elapsed time between two points on the CUDA stream (read after a synchronize)."""

    def __init__(self) -> None:
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.start.record()

    def stop(self) -> None:
        self.end.record()

    def ms(self) -> float:
        return self.start.elapsed_time(self.end)


class _HostTimer:
    """``--dry-run``'s stand-in for :class:`_CudaTimer`: ``perf_counter`` on the host."""

    def __init__(self) -> None:
        self.start, self.end = time.perf_counter(), 0.0

    def stop(self) -> None:
        self.end = time.perf_counter()

    def ms(self) -> float:
        return (self.end - self.start) * 1e3


@contextlib.contextmanager
def _no_host_sync(device: torch.device) -> Iterator[None]:
    """On CUDA, any host synchronization inside raises (``set_sync_debug_mode("error")``)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_length(seq: int, batch: int, rounds: int, warmup: int,
               device: torch.device = torch.device("cuda")) -> Dict[str, float]:
    timer = _CudaTimer if device.type == "cuda" else _HostTimer
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
    _synchronize(device)
    steps = {"every=10": 10}
    times: Dict[str, List[float]] = {name: [] for name in models}
    for r in range(warmup + rounds):
        events = {}
        for name, model in models.items():
            n = steps.get(name, 1)
            clock = timer()
            if name == "plain":  # .item() per head and metric: synchronizes by design
                for _ in range(n):
                    with PlainMode(plain):
                        step(model)
            else:
                with _no_host_sync(device):  # any host sync inside probe raises
                    for _ in range(n):
                        step(model)
            clock.stop()
            events[name] = (clock, n)
        _synchronize(device)
        if r >= warmup:
            for name, (clock, n) in events.items():
                times[name].append(clock.ms() / n)
    with _no_host_sync(device):
        probes["every=1"].summary()  # the flush path too: one packed, non-blocking copy
    for p in probes.values():
        p.close()
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: run the arms on the CPU (batch 2, seq 64, one round) to check the script")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, rounds, warmup, seqs, batch = torch.device("cpu"), 1, 0, [64], 2
        print(f"dry run on the CPU (torch {torch.__version__}, bf16 model): timings are the host's, "
              "no sync check (CUDA's)")
    elif not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device visible to torch "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); nothing to measure.")
        return 0
    else:
        device, rounds, warmup, seqs, batch = torch.device("cuda"), 5 if args.quick else 20, 2, args.seq, args.batch
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 model")
    for seq in seqs:
        med = run_length(seq, batch, rounds, warmup, device)
        bare = med["bare"]
        checked = "sync debug mode 'error' over probed steps: no host sync raised" if device.type == "cuda" else "no sync check"
        print(f"\nBERT 4x256, 4 heads, batch {batch}, seq {seq} ({batch * seq} tokens), fwd+bwd, {rounds} rounds, "
              f"{checked}")
        print(f"{'arm':<12}{'median ms':>12}{'x bare':>10}")
        for name, ms in med.items():
            print(f"{name:<12}{ms:>12.2f}{ms / bare:>10.3f}")
        over = med["plain"] - bare
        print(f"probe overhead / plain overhead (every=1): {(med['every=1'] - bare) / over:.3f}" if over > 0 else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
