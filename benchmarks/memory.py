"""Extra peak memory of probe on long sequences: bounded by the chunk budget, flat in L.

One fresh process per (arm, L): a module calling ``F.scaled_dot_product_attention`` on q, k, v of
shape (1, 8, L, 64), causal, float32, runs forward (``fwd``) or forward + backward (``fwd+bwd``)
twice. ``--layout hf``: as Hugging Face lays them out instead, q, k and v are transposed views of
projections of shape (1, L, heads, 64) with 2 kv heads (grouped-query attention), k and v slices
of one fused projection. Arms: ``bare`` (no probe), ``probe`` (``probe.watch(every=1)``, all metrics, three scales;
with ``grads=True`` on ``fwd+bwd``). The extra peak is the peak resident set size of the probe
process minus that of the bare process with the same L and pass.

Why RSS and not an allocator counter: torch has no CPU allocator statistics (only CUDA's
``max_memory_allocated``) and ``tracemalloc`` does not see torch's allocations. Each process is
fresh, so ``ru_maxrss`` is the peak of that one workload; glibc returns large blocks (> 128 KiB,
every tensor that matters here) to the OS on free, so RSS follows live tensors closely.
Resolution is about 1 MiB (library pages, allocator caches); both arms share all of it.

For scale: a full float32 logit matrix at L = 4096 and 8 heads is 512 MiB; at 8192 it is 2 GiB.

Usage::

    python benchmarks/memory.py                  # L = 1k, 2k, 4k, 8k
    python benchmarks/memory.py --lengths 1024 4096
    benchmarks/before.sh COMMIT DIR && PYTHONPATH=$PWD:DIR python benchmarks/memory.py --before probe_before
                                                 # another version's extra peak beside this one's
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from typing import Dict, List, Optional

HEADS, DIM = 8, 64


def _child(arm: str, length: int, backward: bool, budget: int, layout: str = "sdpa") -> None:
    import importlib

    import torch
    import torch.nn.functional as F

    probe = importlib.import_module(arm.split(":", 1)[1] if arm.startswith("before:") else "probe")

    torch.manual_seed(0)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=layout == "hf")

    model = Attention()
    if layout == "hf":  # transposed views of (1, L, heads, d) projections, 2 kv heads in one k/v projection
        q = torch.randn(1, length, HEADS, DIM, requires_grad=backward).transpose(1, 2)
        kv = torch.randn(1, length, 4, DIM, requires_grad=backward).transpose(1, 2)
        k, v = kv.chunk(2, dim=1)
    else:
        shape = (1, HEADS, length, DIM)
        q, k, v = (torch.randn(shape, requires_grad=backward) for _ in range(3))
    p = probe.watch(model, grads=backward, memory_budget=budget) if arm != "bare" else None
    for _ in range(2):
        out = model(q, k, v)
        if backward:
            out.sum().backward()
        del out
    if p is not None:
        p.summary()  # the statistics really were computed
        p.close()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mib": peak_kib / 1024}))


def measure(arm: str, length: int, backward: bool, budget: int, layout: str = "sdpa") -> float:
    cmd = [sys.executable, __file__, "--child", arm, str(length), str(int(backward)), str(budget), layout]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mib"]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--budget", type=int, default=64 * 2**20, help="probe's memory_budget in bytes")
    parser.add_argument("--json", default=None)
    parser.add_argument("--layout", choices=["sdpa", "hf"], default="sdpa",
                        help="hf: transposed (1, L, H, d) views, 2 kv heads (grouped-query attention)")
    parser.add_argument("--before", default=None, help="module name of another probe version to measure beside this one")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        arm, length, backward, budget, layout = args.child
        _child(arm, int(length), bool(int(backward)), int(budget), layout)
        return 0
    kv = ", 2 kv heads, Hugging Face layout" if args.layout == "hf" else ""
    print(f"extra peak RSS of probe, (1, {HEADS}, L, {DIM}) causal float32{kv}, memory_budget "
          f"{args.budget / 2**20:.0f} MiB, one process per cell")
    before = f"before:{args.before}" if args.before else None
    extra_before = f"{'before extra':>14}" if before else ""
    print(f"{'L':>6}{'pass':>9}{'bare MiB':>11}{'probe MiB':>11}{'extra MiB':>11}{extra_before}{'full logits MiB':>17}")
    rows: List[Dict[str, float]] = []
    for length in args.lengths:
        for backward in (False, True):
            bare = measure("bare", length, backward, args.budget, args.layout)
            probed = measure("probe", length, backward, args.budget, args.layout)
            old = measure(before, length, backward, args.budget, args.layout) if before else None
            full = HEADS * length * length * 4 / 2**20
            name = "fwd+bwd" if backward else "fwd"
            col = f"{old - bare:>14.1f}" if old is not None else ""
            print(f"{length:>6}{name:>9}{bare:>11.1f}{probed:>11.1f}{probed - bare:>11.1f}{col}{full:>17.0f}")
            sys.stdout.flush()
            rows.append({"L": length, "pass": name, "bare_mib": bare, "probe_mib": probed,
                         "extra_mib": probed - bare, "full_logits_mib": full,
                         **({"before_extra_mib": old - bare} if old is not None else {})})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
