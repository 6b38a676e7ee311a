"""From accumulated state to reported metrics (pure functions on host tensors).

Which metric a field belongs to and how it is reported is the catalogue's
(:mod:`probe.metrics`); this module does the arithmetic.
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from probe.metrics import METRIC_ORDER, field_spec
from probe.state.combine import GRAD_STEPS, State

__all__ = ["finalize"]


def _nonneg(v: np.ndarray) -> np.ndarray:
    """``v`` with negative values made 0 (NaN and -0.0 kept), as torch's ``clamp(min=0)``."""
    return np.where(v < 0, 0.0, v)


def _sqrt(v: np.ndarray) -> np.ndarray:
    """``torch.sqrt``, as before: torch's float64 sqrt is not always correctly rounded (numpy's is),
    and reported values stay bit for bit what they were."""
    return torch.from_numpy(np.ascontiguousarray(v)).sqrt().numpy()


def finalize(state: State) -> Dict[str, Dict[str, np.ndarray]]:
    """Metric → scale → per-head values (float64 numpy), from one site's state.

    ``logit_var = M2 / n``; ``entropy``, ``max_prob``, ``saturation`` are means over valid rows;
    a ``*_sq`` field (``grad_logits``, ``grad_q``, ...) is a sum of squares over the
    ``grad_steps`` probed steps whose backward reached the site (a state field), reported as the root mean square
    over those steps, ``sqrt(Σ / grad_steps)``: one step gives that step's norm, and the run
    value does not grow with the run's length (a threshold means the same on a short and a long
    run); ``grad_logits_se`` (sampled rows) is its standard error, to first order. A metric with nothing to average (no valid entry or row) is NaN, never 0.
    """
    # numpy on the host float64 values (a view when they are host float64 already): the same
    # IEEE operations as torch's, without its per-operation overhead on these few-element arrays
    host = {field: value.detach().to("cpu", torch.float64).numpy() for field, value in state.items()}
    out: Dict[str, Dict[str, np.ndarray]] = {}
    rows = host.get("rows")
    counted = host.get(GRAD_STEPS)
    grad_steps = float(counted.max()) if counted is not None else 1.0
    # no step counted (every backward that reached the site overflowed under a loss scaler and
    # was left out, probe.session.loss_scale): the gradient metrics have nothing to average
    steps = max(grad_steps, 1) if grad_steps > 0 else np.nan
    with np.errstate(all="ignore"):  # where() discards the divisions it guards, as torch's did silently
        for field, v in host.items():
            name, _, scale = field.partition("@")
            scale = scale or "actual"
            metric = field_spec(field)
            if metric is None:
                if name.endswith("_sq"):  # a norm outside the catalogue
                    out.setdefault(name[: -len("_sq")], {})[scale] = _sqrt(_nonneg(v) / steps)
                continue
            if metric.final == "var":
                n, _, m2 = v
                res = np.where(n > 0, m2 / np.maximum(n, 1), np.nan)
            elif metric.final == "max":
                res = np.where(host[f"logit@{scale}"][0] > 0, v, np.nan)
            elif metric.final == "per_row":
                if rows is None:
                    continue
                res = np.where(rows > 0, v / np.maximum(rows, 1), np.nan)
            elif metric.final == "se":
                if rows is None:
                    continue
                res = np.where(rows > 0, _sqrt(_nonneg(v)) / np.maximum(rows, 1), np.nan)
            elif metric.final == "root":
                res = _sqrt(_nonneg(v) / steps)
            elif metric.final == "root_se":
                # ``g = sqrt(T / s)`` from an estimated total ``T`` with variance ``V``: to first
                # order ``se(g) = sqrt(V) / s / (2g) = sqrt(V) / (2 sqrt(T·s))``
                total = _nonneg(host[f"{name[: -len('_var')]}_sq@{scale}"])
                res = np.where(total > 0, _sqrt(_nonneg(v)) / (2 * _sqrt(total * steps)), 0.0 * steps)
            else:
                res = v
            out.setdefault(metric.name, {})[scale] = res
    order = {m: i for i, m in enumerate(METRIC_ORDER)}
    return {m: out[m] for m in sorted(out, key=lambda m: (order.get(m, len(order)), m))}
