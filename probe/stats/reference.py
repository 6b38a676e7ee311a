"""The plain formulas, written as directly as possible: the reference the fast paths are tested
against, and what the unknown-scale path (:mod:`probe.stats.paths.logits`) computes.

No buffers, no shortcuts, masked entries excluded with ``where`` (never by multiplying with 0,
which turns the ``−inf`` of a fully masked row into NaN). Everything is per row, so the one
reducer (:mod:`probe.stats.reduce`) folds these rows exactly as it folds the fast paths'.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from probe.call import Scale
from probe.stats.rows import scale_view

__all__ = ["grad_logits_chunk", "logit_rows", "softmax_rows"]


def logit_rows(z: Tensor, valid: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(n, mean, M2, max)`` of each row of ``z`` ``(B, H, l, S)`` over its valid entries, each
    ``(B, H, l)``: the count, the mean, the sum of squared deviations from it, and the max
    (``−inf`` for a row without a valid entry)."""
    n = valid.sum(-1).to(z.dtype)
    mean = torch.where(valid, z, 0.0).sum(-1) / n.clamp(min=1)
    m2 = torch.where(valid, z - mean.unsqueeze(-1), 0.0).square().sum(-1)
    top = torch.where(valid, z, -math.inf).amax(-1)
    return n, mean, m2, top


def softmax_rows(R: Tensor, valid: Optional[Tensor], scale: Scale = 1.0, bias: Optional[Tensor] = None,
                 softcap: Optional[float] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(n, entropy, max_prob, lse)`` per row of ``P = softmax(Z)`` over valid keys, ``Z = σR + A``
    (``c·tanh(σR/c) + A`` with softcap ``c``): the number of valid keys, the normalized entropy
    ``H(P)/log n`` and ``max P`` (both 0 on rows with fewer than two valid keys) and the
    log-sum-exp of ``Z`` (non-finite where a row's logits are).

    ``H = log Σe − Σ e·(Z − m) / Σe`` with ``e = exp(Z − m)``, ``m`` the row max, and
    ``max P = 1 / Σe``: one exponential, no second softmax.
    """
    z = R * scale_view(scale, R.shape[1], R)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if bias is not None:
        z = z + bias
    shape = z.shape[:-1]
    if valid is not None:
        z = torch.where(valid, z, -math.inf)
        n = valid.sum(-1).float().expand(shape)
    else:
        n = torch.full(shape, float(z.shape[-1]), device=z.device)
    m = z.amax(-1, keepdim=True)
    m = torch.where(m == -math.inf, 0.0, m)  # fully masked rows: keep exp(-inf) = 0, no NaN
    zc = z - m
    e = torch.exp(zc)
    se = e.sum(-1)
    if valid is not None:
        zc = torch.where(valid, zc, 0.0)
    lse = torch.log(se)
    ok = n >= 2
    entropy = torch.where(ok, (lse - (e * zc).sum(-1) / se).clamp(min=0) / torch.log(n.clamp(min=2)), 0.0)
    max_prob = torch.where(ok, 1.0 / se, 0.0)
    return n, entropy, max_prob, lse + m.squeeze(-1)


def grad_logits_chunk(
    R: Tensor,
    valid: Optional[Tensor],
    bias: Optional[Tensor],
    dP: Tensor,
    scale: Scale,
    softcap: Optional[float] = None,
) -> Tensor:
    """Per-head ``Σ (∂L/∂Z^σ)²`` over one chunk of query rows, shape ``(H,)``.

    ``Z^σ = σR + A`` (``c·tanh(σR/c) + A`` with softcap ``c``), ``P = softmax(Z^σ)`` over valid
    keys and ``∂L/∂Z^σ = P ⊙ (dP − rowsum(P ⊙ dP))``. Masked entries have ``P = 0`` and so no
    gradient; a row with a single valid key has ``P = 1`` there and gradient 0.

    Args:
        R: raw dot products ``q·kᵀ`` in float32, ``(B, H, l, S)``.
        valid: boolean, broadcastable to ``R``, or ``None`` (all valid).
        bias: additive float32 bias with masked entries zeroed, broadcastable to ``R``, or ``None``.
        dP: ``(∂L/∂out)·vᵀ`` for the same rows, ``(B, H, l, S)``, float32.
        scale: σ, a float or a per-head 1-D tensor.
        softcap: the logit soft-capping constant ``c`` or ``None``.

    Pitfall: masked entries are set to ``-inf`` before the exponential, never multiplied by 0
    (which turns a fully masked row's ``-inf`` into NaN), and a fully masked row divides by 1
    instead of 0.
    """
    z = R * scale_view(scale, R.shape[1], R)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if bias is not None:
        z = z + bias
    if valid is not None:
        z = z.masked_fill(valid.logical_not(), -math.inf)
    m = z.amax(-1, keepdim=True)
    p = torch.exp(z - torch.where(m == -math.inf, 0.0, m))
    se = p.sum(-1, keepdim=True)
    p = p / torch.where(se > 0, se, 1.0)
    g = p * (dP - (p * dP).sum(-1, keepdim=True))  # ∂L/∂Z
    return g.square().sum((0, 2, 3))
