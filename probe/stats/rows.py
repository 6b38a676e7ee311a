"""What every path hands the reducer: per-row statistics of one call (:class:`Rows`), and the
per-row pieces the paths share.

A path (:mod:`probe.stats.paths`) turns a call into, for every query row, its count of valid
keys, the max, mean and ``M2`` of its logits ``R = q·kᵀ`` and a non-finite count, and, for the
rows whose exponential metrics are computed (all of them, or the ``rows=`` sample), their
normalized entropy and max probability at each distinct scale. :func:`probe.stats.reduce.reduce_rows`
turns those into per-head values; nothing downstream knows which path ran.

The shared pieces: the exact pass over a masked chunk (:func:`exact_pass`: row max, ``D = R − r``
in place, ``ΣD``, ``ΣD²``, the non-finite count), the exponential sums of the shifted logits
(:func:`exp_sums`: ``Σe``, ``Σe·D`` with ``e = exp(σD)``), entropy and max probability from them
(:func:`softmax_rows`), row means and ``M2`` from ``ΣD``, ``ΣD²`` (:func:`moment_rows`), and a
scale as something that multiplies a ``(B, H, l, S)`` chunk (:func:`scale_view`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from probe.call import Scale

__all__ = ["LOG2E", "Rows", "exact_pass", "exp_sums", "grad_sq", "moment_rows", "nonfinite_rows", "scale_view",
           "softmax_rows"]

#: ``log2(e)``: ``exp(x) = exp2(x·log2 e)``, and torch's ``exp2`` is about three times cheaper
#: than ``exp`` on CPUs (docs/performance.md).
LOG2E = 1.0 / math.log(2.0)


@dataclasses.dataclass
class Rows:
    """Per-row statistics of one call, ``(B, H, L)`` each (every query row) or ``(..., B, H, N)``
    (the rows whose exponential metrics were computed: ``N = L`` or the ``rows=`` sample).

    Attributes:
        n: valid keys per row (float32).
        top: max of ``R`` over the row's valid keys (0 where there is none).
        mean: mean of ``R`` over them, in the accumulation dtype.
        m2: their sum of squared deviations from ``mean`` (accumulation dtype).
        nonfinite: NaN and ``±inf`` among the row's valid logits, plus ``n`` where its softmax at
            the first scale (``actual``) is non-finite.
        low: min of ``R`` over the valid keys (``+inf`` where none), for negative or per-head
            scales; ``None`` when no scale needs it.
        soft_n: valid keys of each exponential row, ``(B, H, N)``.
        entropy: normalized entropy ``H(P)/log n`` per distinct scale, ``(G, B, H, N)``, 0 on rows
            with fewer than two valid keys.
        max_prob: ``max P`` likewise (0 on those rows).
    """

    n: Tensor
    top: Tensor
    mean: Tensor
    m2: Tensor
    nonfinite: Tensor
    low: Optional[Tensor]
    soft_n: Tensor
    entropy: Tensor
    max_prob: Tensor


def scale_view(scale: Scale, heads: int, like: Tensor, factor: float = 1.0) -> Scale:
    """``σ·factor`` as a float, or for a per-head tensor as ``(1, H, 1, 1)`` float32 on ``like``'s
    device, so that it multiplies a ``(B, H, l, S)`` chunk."""
    if isinstance(scale, Tensor):
        s = scale.to(device=like.device, dtype=torch.float32)
        return (s * factor if factor != 1.0 else s).reshape(1, -1, 1, 1).expand(1, heads, 1, 1)
    return float(scale) * factor


def exact_pass(R: Tensor, masked: bool, finite: bool, n_row: Tensor, work: Tensor
               ) -> Tuple[Tensor, Tensor, List[Tensor]]:
    """The pass every row of a chunk gets, on ``R`` already masked (masked entries ``−inf``).

    ``finite``: every entry of ``R`` before masking is known finite (then no count runs); ``work``:
    a buffer of ``R``'s size. Forms ``D = R − r`` in place (``r`` the row max over valid keys, 0
    for a fully masked row) and ``D0``, ``D`` with masked entries 0 (``D`` itself when nothing is
    masked; it lives in ``work``).

    Returns ``(D, D0, [r, ΣD, ΣD², #non-finite])``: ``#non-finite`` counts NaN and ``±inf``
    among the row's valid entries (``x·0`` is 0 for finite ``x`` and NaN otherwise; masked
    entries are ``−inf`` and are subtracted).
    """
    shape = R.shape[:-1]
    if finite:
        bad = torch.zeros(shape, device=R.device)
    else:
        bad = torch.nan_to_num(torch.mul(R, 0.0, out=work), nan=1.0, out=work).sum(-1)
        if masked:
            bad = bad - (R.shape[-1] - n_row)
    rmax = R.amax(-1, keepdim=True)
    rmax = torch.where(rmax == -math.inf, 0.0, rmax)
    D = R.sub_(rmax)
    D0 = D
    if masked:
        D0 = torch.nan_to_num(D, nan=math.nan, posinf=math.inf, neginf=0.0, out=work)
    return D, D0, [rmax.squeeze(-1), D0.sum(-1), torch.linalg.vector_norm(D0, dim=-1).square(), bad]


def exp_sums(D: Tensor, D0: Tensor, scales: Sequence[float], e: Tensor, keep: Optional[Tensor] = None
             ) -> List[Tensor]:
    """``[Σe_1, Σe·D_1, Σe_2, …]`` per row for ``e = exp(σD)`` at each positive scale, as
    ``exp2(σ·log2(e)·D)``; ``D ≤ 0`` shifted logits (masked entries ``−inf``, or a finite value far
    below every valid one), ``D0`` the same with masked entries 0 (may be ``D``), ``e`` a buffer of
    their size. ``keep``: ``(G, *D.shape)``, receives each scale's exponentials (``keep[i]``;
    ``e`` then holds ``e·D``)."""
    sums = []
    for i, sigma in enumerate(scales):
        ei = e if keep is None else keep[i]
        torch.mul(D, sigma * LOG2E, out=ei).exp2_()
        sums.append(ei.sum(-1))
        sums.append((ei.mul_(D0) if keep is None else torch.mul(ei, D0, out=e)).sum(-1))
    return sums


def grad_sq(e: Tensor, dP: Tensor, se: Tensor, t: Tensor) -> Tensor:
    """Per row ``Σ_j (P_j (dP_j − c))² = (‖e ⊙ (dP − c)‖ / Σe)²`` with ``c = Σ e·dP / Σe``, from
    the exponentials ``e``, their row sums ``se`` ``(..., 1)`` and ``dP``; ``t``: a buffer of
    ``e``'s shape (the shifted and general paths' backward). 0 on a row with ``Σe = 0`` (fully
    masked) and a finite ``dP``; a row with a NaN or infinite ``dP`` or ``e`` is NaN.

    A row with a valid key has ``Σe ≥ 1`` (its max is ``e = 1``, or within rounding of it), so
    ``Σe`` is taken at least float32's smallest normal number: a fully masked row (``e = 0``)
    then gives ``0 / tiny = 0`` with no ``where`` (three operations fewer per scale)."""
    u = torch.mul(e, dP, out=t)  # e ⊙ dP, then e ⊙ (dP − c) = u − c·e in place
    se = se.clamp(min=_TINY)  # (a NaN Σe stays NaN)
    c = u.sum(-1, keepdim=True).div_(se)
    norm = torch.linalg.vector_norm(u.addcmul_(e, c, value=-1), dim=-1)
    return norm.div_(se.squeeze(-1)).square_()


_TINY = torch.finfo(torch.float32).tiny


def softmax_rows(n: Tensor, sums: Union[Tensor, Sequence[Tensor]], scales: Sequence[float]) -> Tuple[Tensor, Tensor]:
    """Normalized entropy and max probability per row and scale, ``(G, B, H, N)`` each, from
    :func:`exp_sums` (a list, or those stacked on dim 0): ``H = log Σe − σ·Σe·D / Σe`` and
    ``max P = 1/Σe`` (the max of ``σD`` is 0); 0 on rows with fewer than two valid keys
    (``n``). Every scale at once: the same operations, the scales a ``(G, 1, …)`` tensor."""
    stacked = sums if isinstance(sums, Tensor) else torch.stack(list(sums))
    se, sed = stacked[0::2], stacked[1::2]
    ok = n >= 2
    log_n = torch.log(n.clamp(min=2))
    sigma = _sigmas(tuple(float(s) for s in scales), se.dim(), se.dtype, se.device)
    entropy = torch.where(ok, (torch.log(se) - sigma * sed / se).clamp(min=0) / log_n, 0.0)
    return entropy, torch.where(ok, 1.0 / se, 0.0)


@functools.lru_cache(maxsize=64)
def _sigmas(scales: Tuple[float, ...], dim: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The scales as a ``(G, 1, …, 1)`` tensor of ``dim`` dims (cached: callers must not change it)."""
    return torch.tensor(scales, dtype=dtype, device=device).reshape((-1,) + (1,) * (dim - 1))


def nonfinite_rows(bad: Tensor, n: Tensor, top: Tensor, sigma: float) -> Tensor:
    """``bad`` plus ``n`` on rows whose softmax at ``σ > 0`` is non-finite: with finite logits
    ``Σe ∈ [1, n]``, so a row's log-sum-exp ``σr + log Σe`` is NaN or ``+inf`` exactly when ``σr``
    is (a NaN logit makes the row max ``r`` NaN, ``+inf`` makes it ``+inf``)."""
    z = sigma * top
    return bad + torch.where(torch.isnan(z) | (z == math.inf), n, 0.0)


def moment_rows(n: Tensor, top: Tensor, sum_d: Tensor, sum_d2: Tensor, acc: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Row means and ``M2`` in ``acc`` from the valid count ``n``, the max ``r``, ``ΣD`` and
    ``ΣD²`` (``D = R − r``): ``μ = r + ΣD/n``, ``M2 = ΣD² − (ΣD)²/n``. The subtraction cancels
    only as much as ``mean(D)²/var(D)`` in a row, small because ``D`` is measured from the row
    max, not from zero."""
    a = sum_d.to(acc)
    safe = n.to(acc).clamp(min=1)
    return top.to(acc) + a / safe, (sum_d2.to(acc) - a * a / safe).clamp(min=0)
