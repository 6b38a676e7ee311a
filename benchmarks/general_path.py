"""Per-call cost of the general path (bias, softcap, per-head scale): ``forward_stats`` and
``grad_logits_stats`` at workload shapes, one thread, medians of interleaved runs.

Calls (random inputs, scales ``actual`` / ``unscaled`` / ``standard`` as the recorder asks):

- ``t5``: ``(1, 4, 512, 64)``, a relative position bias ``(1, 4, 512, 512)``, scale 1 (T5).
- ``gemma2``: ``(1, 8, 1024, 32)`` with 2 kv heads, causal, softcap 50, scale 1/16 (Gemma 2);
  backward from ``grad_output`` and from ``grad_probs`` (eager).
- ``tensor-scale``: ``(2, 4, 512, 64)``, key padding, a per-head scale tensor (probe.variants).

Usage::

    python benchmarks/general_path.py [--rows 128|none] [--before probe_before] [--runs 15]
    benchmarks/before.sh COMMIT DIR && PYTHONPATH=$PWD:DIR python benchmarks/general_path.py --before probe_before
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch


def _cases(seed: int = 0) -> Dict[str, dict]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    q, k, v = (torch.randn(1, 4, 512, 64, generator=g) * 0.3 for _ in range(3))
    bias = torch.randn(1, 4, 512, 512, generator=g)
    out["t5"] = dict(q=q, k=k, v=v, scale=1.0, bias=bias, scales={"actual": 1.0, "unscaled": 1.0, "standard": 0.125})
    q = torch.randn(1, 8, 1024, 32, generator=g)
    k, v = (torch.randn(1, 2, 1024, 32, generator=g) for _ in range(2))
    out["gemma2"] = dict(q=q, k=k, v=v, scale=1 / 16, causal=True, softcap=50.0,
                         scales={"actual": 1 / 16, "unscaled": 1.0, "standard": 32**-0.5}, probs=True)
    q, k, v = (torch.randn(2, 4, 512, 64, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 1, 512, dtype=torch.bool)
    mask[1, ..., 384:] = False
    sigma = torch.tensor([0.1, 0.125, 0.15, 0.2])
    out["tensor-scale"] = dict(q=q, k=k, v=v, scale=sigma, mask=mask,
                               scales={"actual": sigma, "unscaled": 1.0, "standard": 0.125})
    return out


def _arms(module: str, case: dict, rows: Optional[int]) -> Dict[str, Callable[[], object]]:
    call_mod = importlib.import_module(f"{module}.call")
    try:  # the plan → paths → reducer layout (issue 24), or the layout before it
        functional = importlib.import_module(f"{module}.stats.forward")
        grads = importlib.import_module(f"{module}.stats.backward")
    except ImportError:
        functional = importlib.import_module(f"{module}.stats.functional")
        grads = importlib.import_module(f"{module}.stats.grads")
    sampling = importlib.import_module(f"{module}.stats.sampling")
    spec = {k: v for k, v in case.items() if k not in ("scales", "probs")}
    call = call_mod.AttentionCall(**spec)
    scales = case["scales"]
    b, h, length, _ = call.q.shape
    positions = None if rows is None else sampling.sample_rows(length, rows, torch.Generator().manual_seed(1))
    dout = torch.randn(b, h, length, call.v.shape[-1], generator=torch.Generator().manual_seed(2))
    arms = {
        "forward": lambda: functional.forward_stats(call, scales, rows=positions),
        "backward": lambda: grads.grad_logits_stats(call, dout, scales, rows=positions),
    }
    if case.get("probs"):
        dprobs = torch.randn(b, h, length, call.k.shape[2], generator=torch.Generator().manual_seed(3))
        arms["backward(grad_probs)"] = lambda: grads.grad_logits_stats(call, None, scales, grad_probs=dprobs,
                                                                       rows=positions)
    return arms


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=lambda t: None if t == "none" else int(t), default=128)
    parser.add_argument("--before", default=None, help="module name of another probe version, run interleaved")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--cases", nargs="+", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    modules = ["probe"] + ([args.before] if args.before else [])
    for name, case in _cases().items():
        if args.cases and name not in args.cases:
            continue
        arms = {m: _arms(m, case, args.rows) for m in modules}
        for what in arms["probe"]:
            times: Dict[str, List[float]] = {m: [] for m in modules}
            for i in range(args.runs + 1):
                for m in (modules if i % 2 == 0 else modules[::-1]):
                    fn = arms[m].get(what)
                    if fn is None:
                        continue
                    t = time.perf_counter()
                    fn()
                    if i:  # the first run warms up
                        times[m].append(time.perf_counter() - t)
            med = {m: statistics.median(ts) * 1e3 for m, ts in times.items() if ts}
            line = f"{name:13s} {what:21s} rows={args.rows}: " + "  ".join(f"{m} {v:7.2f} ms" for m, v in med.items())
            if args.before and args.before in med:
                line += f"  ratio {med['probe'] / med[args.before]:.2f}x"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
