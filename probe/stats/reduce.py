"""The one reducer: per-row statistics (:class:`~probe.stats.rows.Rows`, gradient rows) to per-head values.

Every path's rows come here, forward and backward alike:

- **Moments**, exact, in the accumulation dtype: rows combine by Chan's formula
  (:func:`probe.stats.pool.chan_pool`: ``mean = Σ nμ / Σ n``, ``M2 = Σ M2_row + Σ n(μ − mean)²``,
  a sum of non-negative terms); the max (and min) over rows with a valid key; ``nonfinite`` the
  sum of the rows' counts.
- **Exponential metrics** (entropy, max probability, saturation): sums over the rows; with sampled
  rows (``rows=``) the ratio estimator over the sampled valid rows with the stratified design's
  Horvitz–Thompson weights (:mod:`probe.stats.sampling`) times the exact number of valid rows,
  and each total's linearized variance (:func:`ratio_totals`).
- **Gradient rows** (``Σ_j (∂L/∂Z_j)²`` per row): their sum, or sampled the Horvitz–Thompson
  total and its variance (:func:`grad_totals`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from probe.stats.pool import chan_pool
from probe.stats.rows import Rows
from probe.stats.sampling import Design, stratified_variance

__all__ = ["Heads", "grad_totals", "ratio_totals", "reduce_rows", "total_variance"]

_DIMS = (0, 2)  # batch and rows


@dataclasses.dataclass
class Heads:
    """Per-head values of one call, ``(H,)`` each unless noted.

    Attributes:
        count, mean, m2, top: the moments and max of ``R`` over valid entries.
        low: the min of ``R`` (``None`` when the rows did not carry it).
        nonfinite: non-finite logits and probabilities.
        soft: ``(G, 4, H)`` per distinct scale: valid rows (two or more valid keys), and the
            totals of normalized entropy, max probability and saturated rows (estimated when
            sampled).
        var: ``(G, 3, H)`` the estimated variance of each of those three totals when sampled,
            else ``None``.
    """

    count: Tensor
    mean: Tensor
    m2: Tensor
    top: Tensor
    low: Optional[Tensor]
    nonfinite: Tensor
    soft: Tensor
    var: Optional[Tensor]


def reduce_rows(rows: Rows, saturation: float, acc: torch.dtype, design: Optional[Design] = None) -> Heads:
    """Per-head values (module docstring) from every row of a call.

    With ``design`` (:func:`~probe.stats.sampling.row_design` of the sampled positions) the
    exponential rows are a sample: the valid-row count, moments, max and ``nonfinite`` stay
    exact, the exponential totals are ratio estimates with their variances.
    """
    n = rows.n
    heads = n.shape[1]
    # the rows (batch and positions) as parts of each head
    count, mean, m2 = chan_pool(n.to(acc), rows.mean.to(acc), rows.m2.to(acc), _DIMS)
    top = torch.where(n > 0, rows.top, -math.inf).amax(_DIMS).to(acc)
    low = None if rows.low is None else rows.low.amin(_DIMS).to(acc)
    nonfinite = rows.nonfinite.sum(_DIMS, dtype=acc)

    ok = rows.soft_n >= 2
    # exact, also when the exponential rows are sampled
    n_ok = ((n if design is not None else rows.soft_n) >= 2).sum(_DIMS, dtype=acc)
    # every scale's three per-row values at once: (G, 3, B, H, N)
    per_row = torch.stack([rows.entropy, rows.max_prob, (ok & (rows.max_prob >= saturation)).to(rows.entropy.dtype)], 1)
    if design is None:
        totals, var = per_row.sum((2, 4), dtype=acc), None
    else:
        totals, var = ratio_totals(per_row, ok, n_ok, design, acc)
    soft = torch.cat([n_ok.expand(totals.shape[0], 1, heads), totals], 1)
    return Heads(count, mean, m2, top, low, nonfinite, soft, var)


def ratio_totals(per_row: Tensor, ok: Tensor, n_ok: Tensor, design: Design, acc: torch.dtype
                 ) -> Tuple[Tensor, Tensor]:
    """Totals over the valid rows of per-row values ``(..., B, H, N)`` sampled at positions with
    the design's weights ``w``, by the ratio estimator: ``T̂ = n · Σ w·y / Σ w·x`` with ``x`` the
    row's validity (``ok``) and ``n`` the exact number of valid rows (``n_ok``), so that ``T̂ / n``
    is the mean over the sampled valid rows, weighted. Where the number of valid rows differs
    between positions (left padding under causal masking: a padded query sees no key) the
    Horvitz-Thompson total ``Σ w·y`` divided by the exact ``n`` mixes the sample's share of valid
    rows into the mean (measured: a normalized entropy of 1.16 on a 12-token batch, with a
    standard error of 5e-6); the ratio is exact for values that are equal in every valid row and
    equals the Horvitz-Thompson total where every position has the same number of valid rows.

    Returns the totals ``(..., H)`` and their variances: :func:`total_variance` of the residuals
    ``y − R̂·x`` times ``(n / Σ w·x)²`` (linearization). A head with no valid row drawn keeps the
    Horvitz-Thompson total (0) and its variance."""
    weight = design[0].to(ok.device, acc, non_blocking=True)
    # over the batch first: the batch shares the positions, and the variance is that of the
    # per-position sums (total_variance)
    x_b = ok.sum(0, dtype=acc)  # (H, N) valid rows at each position
    y_b = per_row.sum(-3, dtype=acc)  # (..., H, N)
    # weighted sums per row of (…, H, N), each over its own row (not a matrix-vector product: its
    # blocking over rows would round a head differently when calls are reduced stacked on the
    # head dimension, probe.stats.forward.finish_fields)
    x_hat, y_hat = (x_b * weight).sum(-1), (y_b * weight).sum(-1)
    drawn = x_hat > 0
    safe = torch.where(drawn, x_hat, 1.0)
    ratio = torch.where(drawn, y_hat / safe, 0.0)
    totals = torch.where(drawn, ratio * n_ok, y_hat)
    factor = torch.where(drawn, n_ok / safe, 1.0)
    residuals = y_b - ratio.unsqueeze(-1) * x_b  # the batch's sums of y − R̂·x per position
    return totals, _position_variance(residuals, design) * factor.square()


def grad_totals(per_row: Tensor, acc: torch.dtype, design: Optional[Design] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-head totals of gradient rows ``(G, B, H, N)``: ``(G, H)`` sums over every row, or with
    ``design`` (of the sampled rows) their Horvitz–Thompson totals and, second, each total's
    estimated variance (:func:`total_variance`; ``None`` for every row)."""
    if design is None:
        return per_row.sum((1, 3), dtype=acc), None
    weight = design[0].to(per_row.device, acc, non_blocking=True)
    y_b = per_row.sum(1, dtype=acc)  # (G, H, N): the batch shares the positions
    return y_b @ weight, _position_variance(y_b, design)


def total_variance(per_row: Tensor, design: Design) -> Tensor:
    """Estimated variance, per head, of the stratified Horvitz-Thompson total of ``per_row``
    ``(..., B, H, N)`` (:func:`~probe.stats.sampling.stratified_variance` of ``y``, the
    per-position sums over the batch: the batch shares the positions), ``(..., H)``. ``design``
    from :func:`~probe.stats.sampling.row_design`. NaN when a stratum has one row (``rows=1``)."""
    y = per_row.sum(-3, dtype=torch.float64 if per_row.device.type != "mps" else torch.float32)  # (..., H, N)
    return _position_variance(y, design)


def _position_variance(y: Tensor, design: Design) -> Tensor:
    """:func:`~probe.stats.sampling.stratified_variance` of per-position sums ``y`` ``(..., H, N)``."""
    return stratified_variance(y.reshape(-1, y.shape[-1]), *design[1:]).reshape(y.shape[:-1])
