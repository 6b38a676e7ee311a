"""The one reducer: per-row statistics (:class:`~probe.stats.rows.Rows`, gradient rows) to per-head values.

Every path's rows come here, forward and backward alike:

- **Moments**, exact, in the accumulation dtype: rows combine by Chan's formula,
  ``mean = Σ nμ / Σ n``, ``M2 = Σ M2_row + Σ n(μ − mean)²``, a sum of non-negative terms; the max
  (and min) over rows with a valid key; ``nonfinite`` the sum of the rows' counts.
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
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from probe.stats.rows import Rows
from probe.stats.sampling import row_design, stratified_variance

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


def reduce_rows(rows: Rows, length: int, saturation: float, acc: torch.dtype) -> Heads:
    """Per-head values (module docstring) from every row of a call (``length`` rows in all).

    With ``rows.positions`` (sorted CPU positions drawn by :func:`~probe.stats.sampling.sample_rows`;
    other subsets count as one uniform sample) the exponential rows are a sample: the valid-row
    count, moments, max and ``nonfinite`` stay exact, the exponential totals are ratio estimates
    with their variances.
    """
    n = rows.n
    n64 = n.to(acc)
    count = n64.sum(_DIMS)
    mean_row = rows.mean.to(acc)
    mean = (n64 * mean_row).sum(_DIMS) / count.clamp(min=1)
    spread = (n64 * (mean_row - mean.view(1, -1, 1)).square()).sum(_DIMS)
    m2 = torch.where(n > 0, rows.m2.to(acc), 0.0).sum(_DIMS) + spread
    top = torch.where(n > 0, rows.top, -math.inf).amax(_DIMS).to(acc)
    low = None if rows.low is None else rows.low.amin(_DIMS).to(acc)
    nonfinite = rows.nonfinite.sum(_DIMS, dtype=acc)

    sampled = rows.positions is not None
    ok = rows.soft_n >= 2
    # exact, also when the exponential rows are sampled
    n_ok = ((n if sampled else rows.soft_n) >= 2).sum(_DIMS, dtype=acc)
    design = row_design(rows.positions, length) if sampled else None  # type: ignore[arg-type]
    weight = None if design is None else design[0].to(n.device, acc, non_blocking=True)
    soft, residuals = [], []
    for entropy, max_prob in zip(rows.entropy.unbind(0), rows.max_prob.unbind(0)):
        per_row = (entropy, max_prob, (ok & (max_prob >= saturation)).to(entropy.dtype))
        if weight is None:
            soft.append(torch.stack([n_ok] + [v.sum(_DIMS, dtype=acc) for v in per_row]))
        else:
            totals, parts = ratio_totals(per_row, ok, weight, n_ok, acc)
            soft.append(torch.stack([n_ok] + totals))
            residuals.append(parts)
    var = None
    if design is not None:  # every scale's three variances in one pass: (G, 3, B, H, N) -> (G, 3, H)
        var = total_variance(torch.stack([r for r, _ in residuals]), design).to(acc) * residuals[0][1]
    return Heads(count, mean, m2, top, low, nonfinite, torch.stack(soft), var)


def ratio_totals(per_row: Sequence[Tensor], ok: Tensor, weight: Tensor, n_ok: Tensor, acc: torch.dtype
                 ) -> Tuple[List[Tensor], Tuple[Tensor, Tensor]]:
    """Totals over the valid rows of per-row values sampled at positions with weights ``weight``,
    by the ratio estimator: ``T̂ = n · Σ w·y / Σ w·x`` with ``x`` the row's validity and ``n`` the
    exact number of valid rows (``n_ok``), so that ``T̂ / n`` is the mean over the sampled valid
    rows, weighted. Where the number of valid rows differs between positions (left padding under
    causal masking: a padded query sees no key) the Horvitz-Thompson total ``Σ w·y`` divided by
    the exact ``n`` mixes the sample's share of valid rows into the mean (measured: a normalized
    entropy of 1.16 on a 12-token batch, with a standard error of 5e-6); the ratio is exact for
    values that are equal in every valid row and equals the Horvitz-Thompson total where every
    position has the same number of valid rows.

    Returns the totals (``(H,)`` per value) and ``(residuals, factor)``: the variance of each
    total is :func:`total_variance` of the residuals ``y − R̂·x`` (``(3, B, H, N)``) times
    ``factor = (n / Σ w·x)²`` (linearization). A head with no valid row drawn keeps the
    Horvitz-Thompson total (0) and its variance."""
    x = ok.to(acc)
    x_hat = (x * weight).sum(_DIMS)
    drawn = x_hat > 0
    factor = torch.where(drawn, n_ok / torch.where(drawn, x_hat, 1.0), 1.0)
    totals, residuals = [], []
    for v in per_row:
        v = v.to(acc)
        y_hat = (v * weight).sum(_DIMS)
        ratio = torch.where(drawn, y_hat / torch.where(drawn, x_hat, 1.0), 0.0)
        totals.append(torch.where(drawn, ratio * n_ok, y_hat))
        residuals.append(v - ratio.view(1, -1, 1) * x)
    return totals, (torch.stack(residuals), factor.square())


def grad_totals(per_row: Tensor, positions: Optional[Tensor], length: int, acc: torch.dtype
                ) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-head totals of gradient rows ``(G, B, H, N)``: ``(G, H)`` sums over every row, or with
    ``positions`` (the sampled rows, sorted CPU positions) their Horvitz–Thompson totals (weights
    of the stratified design, :func:`~probe.stats.sampling.row_design`) and, second, each total's
    estimated variance (:func:`total_variance`; ``None`` for every row)."""
    if positions is None:
        return per_row.sum((1, 3), dtype=acc), None
    design = row_design(positions, length)
    weight = design[0].to(per_row.device, acc, non_blocking=True)
    return (per_row.to(acc) * weight).sum((1, 3)), total_variance(per_row, design).to(acc)


def total_variance(per_row: Tensor, design: Tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
    """Estimated variance, per head, of the stratified Horvitz-Thompson total of ``per_row``
    ``(..., B, H, N)`` (:func:`~probe.stats.sampling.stratified_variance` of ``y``, the
    per-position sums over the batch: the batch shares the positions), ``(..., H)``. ``design``
    from :func:`~probe.stats.sampling.row_design`. NaN when a stratum has one row (``rows=1``)."""
    y = per_row.sum(-3, dtype=torch.float64 if per_row.device.type != "mps" else torch.float32)  # (..., H, N)
    return stratified_variance(y.reshape(-1, y.shape[-1]), *design[1:]).reshape(y.shape[:-1])
