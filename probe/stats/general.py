"""The general path: per-chunk softmax statistics for any bias, mask, softcap or scale.

Used for calls the shifted path (:mod:`probe.stats.shifted`) cannot take: an additive float
bias, soft-capping, a per-head scale tensor or a non-positive scale.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from probe.call import Scale

__all__ = ["combine_moments", "general_chunk", "logit_moments", "softmax_stats"]

def logit_moments(R: Tensor, valid: Optional[Tensor]) -> Tensor:
    """Per-head moments of ``R`` over valid entries, shape ``(5, H)``.

    Rows: count ``n``, mean, ``M2`` (sum of squared deviations from the mean), max, min.
    Maximum and minimum are ``-inf`` / ``+inf`` for a head with no valid entry.
    """
    heads = R.shape[1]
    dims = (0, 2, 3)
    if valid is None:
        n = torch.full((heads,), R.numel() / heads, dtype=torch.float32, device=R.device)
        mean = R.mean(dims)
        centered = R - mean.view(1, -1, 1, 1)
        m2 = centered.square().sum(dims)
        return torch.stack([n, mean, m2, R.amax(dims), R.amin(dims)])
    valid = valid.expand_as(R)
    n = valid.sum(dims).float()
    mean = torch.where(valid, R, 0.0).sum(dims) / n.clamp(min=1)
    centered = torch.where(valid, R - mean.view(1, -1, 1, 1), 0.0)
    m2 = centered.square().sum(dims)
    rmax = torch.where(valid, R, -math.inf).amax(dims)
    rmin = torch.where(valid, R, math.inf).amin(dims)
    return torch.stack([n, mean, m2, rmax, rmin])


def combine_moments(a: Tensor, b: Tensor) -> Tensor:
    """Exactly combine two ``(3, ...)`` stacks of (count, mean, M2) (Chan et al.)."""
    na, ma, m2a = a[0], a[1], a[2]
    nb, mb, m2b = b[0], b[1], b[2]
    n = na + nb
    safe = n.clamp(min=1)
    delta = mb - ma
    mean = ma + delta * (nb / safe)
    m2 = m2a + m2b + delta.square() * (na * nb / safe)
    return torch.stack([n, mean, m2])


def _scale_view(scale: Scale, heads: int, like: Tensor) -> Scale:
    if isinstance(scale, Tensor):
        return scale.to(device=like.device, dtype=torch.float32).reshape(1, -1, 1, 1).expand(1, heads, 1, 1)
    return float(scale)


def softmax_stats(
    R: Tensor,
    valid: Optional[Tensor],
    bias: Optional[Tensor],
    scale: Scale,
    softcap: Optional[float],
    saturation: float,
) -> Tuple[Tensor, Tensor]:
    """Softmax statistics at one scale, summed over valid rows, per head (the general path).

    Returns ``(sums, row_logsumexp)``: ``sums`` is ``(4, H)`` with the number of valid rows
    (at least two valid keys), the sum of normalized entropies ``H(P)/log(n_valid)``, the sum of
    max probabilities and the number of rows with max probability ``>= saturation``;
    ``row_logsumexp`` is ``(B, H, l)`` (non-finite where a row's logits are).

    The entropy uses ``H = log Σe - Σ e·(Z - m) / Σe`` with ``e = exp(Z - m)``, ``m`` the row
    max, and the max probability is ``1 / Σe``: one exp pass, no second softmax.
    Masked entries are excluded with ``where`` (never by multiplying with 0, which turns the
    ``-inf`` of a fully masked row into NaN).
    """
    heads = R.shape[1]
    s = _scale_view(scale, heads, R)
    z = R * s
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if bias is not None:
        z = z + bias
    if valid is not None:
        z = torch.where(valid, z, -math.inf)
        n_row = valid.sum(-1)
    else:
        n_row = torch.full((1, 1, 1), R.shape[-1], device=R.device)
    m = z.amax(-1, keepdim=True)
    m = torch.where(m == -math.inf, 0.0, m)  # fully masked rows: keep exp(-inf) = 0, no NaN
    zc = z - m
    e = torch.exp(zc)
    se = e.sum(-1)
    if valid is not None:
        zc = torch.where(valid, zc, 0.0)
    ez = (e * zc).sum(-1)
    lse = torch.log(se)
    ok = (n_row >= 2).expand(R.shape[0], heads, R.shape[2])
    entropy = ((lse - ez / se).clamp(min=0) / torch.log(n_row.clamp(min=2).float())).expand_as(ok)
    max_prob = (1.0 / se).expand_as(ok)
    zero = torch.zeros((), device=R.device)
    sums = torch.stack(
        [
            ok.sum((0, 2)).float(),
            torch.where(ok, entropy, zero).sum((0, 2)),
            torch.where(ok, max_prob, zero).sum((0, 2)),
            (ok & (max_prob >= saturation)).sum((0, 2)).float(),
        ]
    )
    return sums, lse + m.squeeze(-1)


def _nonfinite(R: Tensor, valid: Optional[Tensor], row_lse: Tensor) -> Tensor:
    """Count non-finite valid logits plus the probabilities of rows whose softmax is non-finite."""
    bad = ~torch.isfinite(R)
    if valid is not None:
        bad = bad & valid
        n_row = valid.sum(-1).expand_as(row_lse)
    else:
        n_row = torch.full_like(row_lse, R.shape[-1])
    bad_rows = torch.isnan(row_lse) | (row_lse == math.inf)
    return bad.sum((0, 2, 3)).float() + torch.where(bad_rows, n_row, 0).sum((0, 2)).float()


def general_chunk(R: Tensor, valid: Optional[Tensor], bias: Optional[Tensor], scales: Sequence[Scale],
                   softcap: Optional[float], saturation: float, acc: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """(moments (5, H), softmax sums (len(scales), 4, H), nonfinite (H,)); scales[0] is `actual`."""
    moments = logit_moments(R, valid).to(acc)
    soft, nonfinite = [], None
    for i, value in enumerate(scales):
        sums, lse = softmax_stats(R, valid, bias, value, softcap, saturation)
        soft.append(sums.to(acc))
        if i == 0:
            nonfinite = _nonfinite(R, valid, lse).to(acc)
    return moments, torch.stack(soft), nonfinite  # type: ignore[arg-type]
