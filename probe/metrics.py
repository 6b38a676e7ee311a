"""The metric catalogue: one :class:`MetricSpec` per metric probe reports.

Everything that depends on *which* metric it is reads it here: how the running state of the
metric combines across calls, steps and ranks (:mod:`probe.state.accumulator`,
:mod:`probe.state.distributed`), how the state becomes the reported value (:mod:`probe.state.finalize`),
how per-head values fold into one number (sinks, reports), how per-step values fold over a run
(event files), whether NaN means "no data" (thresholds), the heatmap colour range (images),
and how compare's table folds heads. A new metric is one entry in :data:`METRICS` plus the pure
function that computes its state (see docs/architecture.md, "Add a metric").

This module imports nothing from probe (a leaf).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Literal, Optional, Tuple

import numpy as np

__all__ = [
    "METRICS",
    "METRIC_ORDER",
    "NAN_MEANS_NO_DATA",
    "Colour",
    "MetricSpec",
    "field_reduction",
    "head_reduce",
    "spec",
    "step_reduce",
]

#: How a state field combines (across calls, steps and ranks): added, maximum, minimum, the
#: pooled (count, mean, M2) moments of Chan's formula, or the later value.
Reduction = Literal["sum", "max", "min", "moments", "last"]
#: How the reported value is made from the state: ``var`` = M2 / n of the moments (NaN when n
#: is 0); ``max`` = the max (NaN when the moments' count is 0); ``per_row`` = sum / ``rows``
#: (NaN when no row); ``root`` = sqrt of a sum of squares over the probed steps whose backward
#: reached the site, divided by their number (the RMS over steps of the per-step norm: a run value
#: independent of the run's length); ``count`` = the sum itself; ``se`` =
#: sqrt(summed variance estimates) / ``rows``, the standard error of a ``per_row`` mean
#: estimated from sampled rows (``rows=``).
Final = Literal["var", "max", "per_row", "root", "count", "se", "root_se"]
#: How values fold: mean, max, min, sum, root of the sum of squares (a norm), or root mean square;
#: NaN values ignored.
Fold = Literal["mean", "max", "min", "sum", "rss", "rms"]


@dataclasses.dataclass(frozen=True)
class Colour:
    """A fixed heatmap colour range: ``lo``/``hi`` in metric units, the transform applied
    (``linear``, ``log10``, ``symlog``, ``log1p``) and the tick values of the legend."""

    lo: float
    hi: float
    transform: str
    ticks: Tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """What a metric is.

    Attributes:
        name: the reported name (``summary.value(site, name, scale)``).
        backward: a gradient metric (present only after a backward pass).
        field: the state field prefix (``{field}@{scale}``) it is computed from.
        reduction: how that field combines across calls, steps and ranks.
        final: how the reported value is made from the state.
        heads: how per-head values fold into one number (TensorBoard, JSONL, reports).
        steps: how per-step values of one head fold over a run (reading event files).
        nan_no_data: NaN means "nothing to measure" (no valid entry or row), not a failure.
        colour: the heatmap colour range.
        compare_heads: how compare's table folds heads (``rss``: a norm over heads).
        optional: produced only on request (``qk_clip=``): where absent it is not "not measured".
    """

    name: str
    backward: bool
    field: str
    reduction: Reduction
    final: Final
    heads: Fold
    steps: Fold
    nan_no_data: bool
    colour: Colour
    compare_heads: Fold = "mean"
    optional: bool = False


_UNIT = Colour(0.0, 1.0, "linear", (0.0, 0.25, 0.5, 0.75, 1.0))
_GRAD = Colour(1e-8, 1e2, "log10", (1e-8, 1e-6, 1e-4, 1e-2, 1.0, 1e2))
_LOGIT_MAX = Colour(-10.0, 1e3, "symlog", (-10.0, 0.0, 10.0, 100.0, 1e3))


def _grad(name: str) -> MetricSpec:
    # A norm: sums of squares add across calls, steps and ranks; a step reports its norm, a run
    # the root mean square over its steps (finalize's grad_steps).
    return MetricSpec(name, True, f"{name}_sq", "sum", "root", "mean", "rms", False, _GRAD, "rss")


#: Every metric, in report order.
METRICS: Tuple[MetricSpec, ...] = (
    MetricSpec("logit_var", False, "logit", "moments", "var", "mean", "mean", True,
               Colour(1e-2, 1e4, "log10", (1e-2, 1e-1, 1.0, 10.0, 1e2, 1e3, 1e4))),
    # 100 is the QK-Clip threshold of the default `logit_max < 100` check.
    MetricSpec("logit_max", False, "logit_max", "max", "max", "max", "max", True, _LOGIT_MAX),
    MetricSpec("entropy", False, "entropy", "sum", "per_row", "mean", "mean", True, _UNIT),
    MetricSpec("max_prob", False, "max_prob", "sum", "per_row", "mean", "mean", True, _UNIT),
    MetricSpec("saturation", False, "saturated", "sum", "per_row", "mean", "mean", True, _UNIT),
    MetricSpec("nonfinite", False, "nonfinite", "sum", "count", "sum", "sum", False,
               Colour(0.0, 1e6, "log1p", (0.0, 10.0, 1e3, 1e6))),
    _grad("grad_logits"),
    _grad("grad_q"),
    _grad("grad_k"),
    _grad("grad_v"),
    # standard errors of the sampled means (`rows=`, probe.stats.forward.forward_stats);
    # present only when rows were sampled
    MetricSpec("entropy_se", False, "entropy_var", "sum", "se", "mean", "mean", True, _UNIT),
    MetricSpec("max_prob_se", False, "max_prob_var", "sum", "se", "mean", "mean", True, _UNIT),
    MetricSpec("saturation_se", False, "saturated_var", "sum", "se", "mean", "mean", True, _UNIT),
    # of the sampled grad_logits (probe.stats.backward.grad_logits_stats), to first order
    MetricSpec("grad_logits_se", True, "grad_logits_var", "sum", "root_se", "mean", "rms", False, _GRAD, "rss"),
    # QK-Clip (qk_clip=, probe.session.clipping), per optimizer step and head: the max logit S it
    # measured (every training step, not only sampled ones), the factor γ = min(1, τ/S) it applied
    # to the head's logits, and whether it clipped (summed: the number of steps clipped)
    MetricSpec("qk_clip_logit", False, "qk_clip_logit", "max", "count", "max", "max", True, _LOGIT_MAX, "max", True),
    MetricSpec("qk_clip_factor", False, "qk_clip_factor", "min", "count", "min", "min", False, _UNIT, "min", True),
    MetricSpec("qk_clip_steps", False, "qk_clip_steps", "sum", "count", "sum", "sum", False,
               Colour(0.0, 1e4, "log1p", (0.0, 10.0, 100.0, 1e3, 1e4)), "sum", True),
)

METRIC_ORDER: Tuple[str, ...] = tuple(m.name for m in METRICS)
NAN_MEANS_NO_DATA = frozenset(m.name for m in METRICS if m.nan_no_data)
_BY_NAME: Dict[str, MetricSpec] = {m.name: m for m in METRICS}
_BY_FIELD: Dict[str, MetricSpec] = {m.field: m for m in METRICS}
#: Colour range of a metric outside the catalogue.
OTHER_COLOUR = Colour(1e-6, 1e6, "log10", (1e-6, 1e-3, 1.0, 1e3, 1e6))


def spec(name: str) -> Optional[MetricSpec]:
    """The spec of a reported metric, ``None`` for a name outside the catalogue."""
    return _BY_NAME.get(name)


def field_spec(field: str) -> Optional[MetricSpec]:
    """The metric a state field (``{field}@{scale}``) belongs to."""
    return _BY_FIELD.get(field.partition("@")[0])


def field_reduction(field: str) -> Reduction:
    """How a state field combines: its metric's reduction; ``scale`` (the actual per-head scale,
    for info) keeps the later value; anything else (``rows``, counts) adds."""
    if field == "scale":
        return "last"
    metric = field_spec(field)
    return metric.reduction if metric is not None else "sum"


def fold(kind: Fold, values: np.ndarray) -> float:
    """Fold ``values`` (NaN ignored; NaN when every value is)."""
    finite = values[~np.isnan(values)]
    if finite.size == 0:
        return math.nan
    if kind == "max":
        return float(finite.max())
    if kind == "min":
        return float(finite.min())
    if kind == "sum":
        return float(finite.sum())
    if kind == "rss":
        return float(np.sqrt(np.square(finite).sum()))
    # means as numpy's mean computes them (its sum, divided by the count), without the wrapper
    # that cost more than the arithmetic: a flush folds a hundred of these
    if kind == "rms":
        return float(np.sqrt(float(np.add.reduce(np.square(finite))) / finite.size))
    return float(np.add.reduce(finite)) / finite.size


def head_reduce(metric: str, values: np.ndarray) -> float:
    """One number for all heads: the max for ``logit_max``, the sum for ``nonfinite``, else the
    mean; NaN heads are ignored (NaN only when every head is)."""
    m = spec(metric)
    return fold(m.heads if m is not None else "mean", values)


def step_reduce(metric: str, values: np.ndarray) -> float:
    """One number for a run from per-step values of one head (NaN steps ignored)."""
    m = spec(metric)
    return fold(m.steps if m is not None else "mean", values)


def colour(metric: str) -> Colour:
    """The heatmap colour range of ``metric``."""
    m = spec(metric)
    if m is not None:
        return m.colour
    return _GRAD if metric.startswith("grad_") else OTHER_COLOUR
