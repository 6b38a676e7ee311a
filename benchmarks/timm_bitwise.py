"""Real timm under probe, bitwise: the model's outputs and gradients (parameters and input) must be
identical with and without ``probe.watch``, in training mode (dropout and drop-path on where the
constructor takes them, the same RNG seed before each forward) and in eval, on the fused and the
eager attention path. Also counts the sites probe recorded and the warnings it gave.

    PYTHONPATH=. /work/timm-venv/bin/python benchmarks/timm_bitwise.py [--match NAME] [--json PATH]

The cases are the survey's (``coverage_survey._TIMM``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.coverage_survey import _TIMM  # noqa: E402


def _build(name: str, kw: Dict[str, Any], train: bool) -> Tuple[nn.Module, torch.Tensor]:
    import timm

    torch.manual_seed(0)
    extra = dict(drop_rate=0.1, drop_path_rate=0.1) if train else {}
    try:
        model = timm.create_model(name, pretrained=False, num_classes=10, **kw, **extra)
    except TypeError:
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=10, **kw)
    size = model.default_cfg["input_size"]
    if "img_size" in kw:
        s = kw["img_size"]
        size = (3, *s) if isinstance(s, tuple) else (3, s, s)
    x = torch.randn(2, *size, generator=torch.Generator().manual_seed(1))
    return model.train(train), x


def _run(model: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]]]:
    x = x.clone().requires_grad_(True)
    torch.manual_seed(5)
    out = model(x)
    if isinstance(out, (tuple, list)):
        out = out[0]
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out.float() * w).sum(), params + [x], allow_unused=True)
    return out.detach(), list(grads)


def _same(a: List[Optional[torch.Tensor]], b: List[Optional[torch.Tensor]]) -> int:
    """How many of the tensors differ (bitwise; None only equals None)."""
    bad = 0
    for s, t in zip(a, b):
        if (s is None) != (t is None):
            bad += 1
        elif s is not None and not torch.equal(s, t):
            bad += 1
    return bad


def check(name: str, kw: Dict[str, Any], fused: bool, train: bool) -> Dict[str, Any]:
    import probe

    model, x = _build(name, kw, train)
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused
    twin = copy.deepcopy(model)
    out0, g0 = _run(model, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(twin, every=1, rows=None) as p:
            out1, g1 = _run(twin, x)
        summary = p.summary()
    said = [str(w.message) for w in caught if "probe" in str(w.message)]
    return {"name": f"{name}/{'fused' if fused else 'eager'}/{'train' if train else 'eval'}",
            "sites": len(summary.sites), "out_differs": not torch.equal(out0, out1),
            "grads_differ": _same(g0, g1), "grads": len(g0), "warnings": said}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--match", default="")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    results = []
    for name, kw in _TIMM:
        if args.match and args.match not in name:
            continue
        for fused in (True, False):
            for train in (True, False):
                try:
                    r = check(name, kw, fused, train)
                except Exception as err:  # noqa: BLE001 - report and go on
                    r = {"name": f"{name}/{'fused' if fused else 'eager'}/{'train' if train else 'eval'}",
                         "error": f"{type(err).__name__}: {str(err)[:200]}"}
                results.append(r)
                bad = r.get("error") or (r["out_differs"] or r["grads_differ"])
                print(f"{r['name']}: " + (r["error"] if "error" in r else
                      f"{r['sites']} sites, output {'DIFFERS' if r['out_differs'] else 'identical'}, "
                      f"{r['grads_differ']} of {r['grads']} gradients differ, {len(r['warnings'])} warnings")
                      + ("  <-- " if bad else ""), flush=True)
                for w in r.get("warnings", [])[:3]:
                    print(f"    {w[:300]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    broken = [r["name"] for r in results if r.get("error") or r["out_differs"] or r["grads_differ"]]
    print(f"\n{len(results)} runs, {len(broken)} not identical or failed: {broken}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
