"""From accumulated state to reported metrics (pure functions on host tensors)."""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from probe.stats.accumulator import State

__all__ = ["HEAD_REDUCTION", "METRIC_ORDER", "finalize", "head_reduce"]

#: Every metric probe reports, in report order (grad metrics only after a backward pass).
METRIC_ORDER = (
    "logit_var", "logit_max", "entropy", "max_prob", "saturation", "nonfinite",
    "grad_logits", "grad_q", "grad_k", "grad_v",
)

# Rows-normalized sums: field prefix → metric name.
_PER_ROW = {"entropy": "entropy", "max_prob": "max_prob", "saturated": "saturation"}

#: How a metric's per-head values fold into one scalar (TensorBoard head summaries, reports).
HEAD_REDUCTION = {"logit_max": "max", "nonfinite": "sum"}


def finalize(state: State) -> Dict[str, Dict[str, np.ndarray]]:
    """Metric → scale → per-head values (float64 numpy), from one site's state.

    ``logit_var = M2 / n``; ``entropy``, ``max_prob``, ``saturation`` are means over valid rows;
    ``*_sq`` fields are reported as their square root (``grad_logits``, ``grad_q``, ...). A
    metric with nothing to average (no valid entry or row) is NaN, never 0.
    """
    out: Dict[str, Dict[str, np.ndarray]] = {}
    rows = state.get("rows")
    for field, value in state.items():
        name, _, scale = field.partition("@")
        scale = scale or "actual"
        v = value.detach().to("cpu", torch.float64)
        if name == "logit":
            n, _, m2 = v
            res = torch.where(n > 0, m2 / n.clamp(min=1), torch.nan)
            out.setdefault("logit_var", {})[scale] = res.numpy()
        elif name == "logit_max":
            n = state[f"logit@{scale}"][0].detach().to("cpu", torch.float64)
            out.setdefault("logit_max", {})[scale] = torch.where(n > 0, v, torch.nan).numpy()
        elif name in _PER_ROW and rows is not None:
            r = rows.detach().to("cpu", torch.float64)
            out.setdefault(_PER_ROW[name], {})[scale] = torch.where(r > 0, v / r.clamp(min=1), torch.nan).numpy()
        elif name.endswith("_sq"):
            out.setdefault(name[: -len("_sq")], {})[scale] = v.clamp(min=0).sqrt().numpy()
        elif name == "nonfinite":
            out.setdefault("nonfinite", {})[scale] = v.numpy()
    order = {m: i for i, m in enumerate(METRIC_ORDER)}
    return {m: out[m] for m in sorted(out, key=lambda m: (order.get(m, len(order)), m))}


def head_reduce(metric: str, values: np.ndarray) -> float:
    """One number for all heads: the max for ``logit_max``, the sum for ``nonfinite``, else the
    mean; NaN heads are ignored (NaN only when every head is)."""
    kind = HEAD_REDUCTION.get(metric, "mean")
    finite = values[~np.isnan(values)]
    if finite.size == 0:
        return float("nan")
    if kind == "max":
        return float(finite.max())
    if kind == "sum":
        return float(finite.sum())
    return float(finite.mean())
