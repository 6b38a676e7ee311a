"""From accumulated state to reported metrics (pure functions on host tensors).

Which metric a field belongs to and how it is reported is the catalogue's
(:mod:`probe.metrics`); this module does the arithmetic.
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from probe.metrics import METRIC_ORDER, METRICS, field_spec, head_reduce
from probe.stats.accumulator import GRAD_STEPS, State

__all__ = ["HEAD_REDUCTION", "METRIC_ORDER", "finalize", "head_reduce"]

#: How a metric's per-head values fold into one scalar, where not the mean (see probe.metrics).
HEAD_REDUCTION = {m.name: m.heads for m in METRICS if m.heads != "mean"}


def finalize(state: State) -> Dict[str, Dict[str, np.ndarray]]:
    """Metric → scale → per-head values (float64 numpy), from one site's state.

    ``logit_var = M2 / n``; ``entropy``, ``max_prob``, ``saturation`` are means over valid rows;
    a ``*_sq`` field (``grad_logits``, ``grad_q``, ...) is a sum of squares over the
    ``grad_steps`` probed steps whose backward reached the site (a state field), reported as the root mean square
    over those steps, ``sqrt(Σ / grad_steps)``: one step gives that step's norm, and the run
    value does not grow with the run's length (a threshold means the same on a short and a long
    run); ``grad_logits_se`` (sampled rows) is its standard error, to first order. A metric with nothing to average (no valid entry or row) is NaN, never 0.
    """
    out: Dict[str, Dict[str, np.ndarray]] = {}
    rows = state.get("rows")
    counted = state.get(GRAD_STEPS)
    grad_steps = float(counted.max()) if counted is not None else 1.0
    for field, value in state.items():
        name, _, scale = field.partition("@")
        scale = scale or "actual"
        metric = field_spec(field)
        v = value.detach().to("cpu", torch.float64)
        if metric is None:
            if name.endswith("_sq"):  # a norm outside the catalogue
                out.setdefault(name[: -len("_sq")], {})[scale] = (v.clamp(min=0) / max(grad_steps, 1)).sqrt().numpy()
            continue
        if metric.final == "var":
            n, _, m2 = v
            res = torch.where(n > 0, m2 / n.clamp(min=1), torch.nan)
        elif metric.final == "max":
            n = state[f"logit@{scale}"][0].detach().to("cpu", torch.float64)
            res = torch.where(n > 0, v, torch.nan)
        elif metric.final == "per_row":
            if rows is None:
                continue
            r = rows.detach().to("cpu", torch.float64)
            res = torch.where(r > 0, v / r.clamp(min=1), torch.nan)
        elif metric.final == "se":
            if rows is None:
                continue
            r = rows.detach().to("cpu", torch.float64)
            res = torch.where(r > 0, v.clamp(min=0).sqrt() / r.clamp(min=1), torch.nan)
        elif metric.final == "root":
            res = (v.clamp(min=0) / max(grad_steps, 1)).sqrt()
        elif metric.final == "root_se":
            # ``g = sqrt(T / s)`` from an estimated total ``T`` with variance ``V``: to first
            # order ``se(g) = sqrt(V) / s / (2g) = sqrt(V) / (2 sqrt(T·s))``
            total = state[f"{name[: -len('_var')]}_sq@{scale}"].detach().to("cpu", torch.float64).clamp(min=0)
            res = torch.where(total > 0, v.clamp(min=0).sqrt() / (2 * (total * max(grad_steps, 1)).sqrt()), 0.0)
        else:
            res = v
        out.setdefault(metric.name, {})[scale] = res.numpy()
    order = {m: i for i, m in enumerate(METRIC_ORDER)}
    return {m: out[m] for m in sorted(out, key=lambda m: (order.get(m, len(order)), m))}
