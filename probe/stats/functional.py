"""Pure, on-device reductions of an :class:`~probe.call.AttentionCall` into per-head sums.

Everything here is a function of tensors: no state, no host synchronization (no ``.item()``,
no data-dependent shapes), so it runs unchanged on ``meta`` tensors. Running state and its
combination across calls, steps and ranks live in :mod:`probe.stats.accumulator`.

Notation (DESIGN.md): ``R = q @ k.T`` (raw dot products), ``A`` the additive bias with masked
entries removed, ``σ`` a scale, ``Z = σR + A`` (``c·tanh(σR/c) + A`` with softcap ``c``),
``P = softmax(Z)`` over valid keys.
"""

from __future__ import annotations

import math
from typing import Dict, Iterator, Mapping, Optional, Tuple

import torch
from torch import Tensor

from probe.call import AttentionCall, Scale

__all__ = [
    "FORWARD_METRICS",
    "accumulation_dtype",
    "chunk_rows",
    "combine_moments",
    "forward_stats",
    "iter_chunks",
    "logit_moments",
    "softmax_stats",
]

#: Metrics computed in the forward pass, in the order they are reported.
FORWARD_METRICS = ("logit_var", "logit_max", "entropy", "max_prob", "saturation", "nonfinite")

# How many (B, H, rows, S) float32 buffers one chunk keeps alive at once: R, Z, exp(Z - max),
# the entropy product, and masks/temporaries. Used to turn a byte budget into query rows.
_LIVE_BUFFERS = 6


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 for running sums wherever the device has it (MPS has not)."""
    return torch.float32 if device.type == "mps" else torch.float64


def chunk_rows(batch: int, heads: int, keys: int, budget_bytes: int) -> int:
    """Query rows per chunk so that the chunk's live buffers stay within ``budget_bytes``."""
    per_row = max(1, batch * heads * keys * 4 * _LIVE_BUFFERS)
    return max(1, budget_bytes // per_row)


def _as_4d(t: Tensor) -> Tensor:
    while t.dim() < 4:
        t = t.unsqueeze(0)
    if t.dim() > 4:
        t = t.reshape(-1, *t.shape[-3:])
    return t


def _rows(t: Optional[Tensor], r0: int, r1: int) -> Optional[Tensor]:
    """Rows ``r0:r1`` of a tensor broadcastable to ``(B, H, L, S)`` (broadcast rows kept)."""
    if t is None:
        return None
    t = _as_4d(t)
    return t if t.shape[-2] == 1 else t[..., r0:r1, :]


def _bias_valid(bias: Tensor) -> Tensor:
    # Hugging Face masks use finfo.min instead of -inf; anything at most half of it is masked.
    return bias > torch.finfo(bias.dtype).min / 2


def iter_chunks(
    call: AttentionCall, budget_bytes: int
) -> Iterator[Tuple[Tensor, Optional[Tensor], Optional[Tensor]]]:
    """Yield ``(R, valid, bias)`` for consecutive chunks of query rows.

    ``R`` is ``q[:, :, rows] @ k.T`` in float32, shape ``(B, H, l, S)``, computed once per chunk
    for every scale (grouped-query attention without repeating k). ``valid`` (bool) and
    ``bias`` (float32, masked entries zeroed) broadcast to ``R``; either may be ``None``.
    """
    q, k = call.q, call.k
    batch, heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    kt = k.float().transpose(-1, -2)  # (B, Hk, d, S); a copy only for half-precision inputs
    if groups > 1:
        kt = kt.expand(batch, -1, -1, -1).unsqueeze(2)  # (B, Hk, 1, d, S)
    step = chunk_rows(batch, heads, keys, budget_bytes)
    for r0 in range(0, length, step):
        r1 = min(length, r0 + step)
        qc = q[:, :, r0:r1].float()
        if groups > 1:
            R = (qc.reshape(batch, kv_heads, groups, r1 - r0, dim) @ kt).reshape(batch, heads, r1 - r0, keys)
        else:
            R = qc @ kt
        valid = _rows(call.mask, r0, r1)
        bias = _rows(call.bias, r0, r1)
        if bias is not None:
            bias_ok = _bias_valid(bias)
            valid = bias_ok if valid is None else valid & bias_ok
            bias = torch.where(bias_ok, bias.float(), 0.0)
        if call.causal:
            rows = torch.arange(r0, r1, device=q.device).unsqueeze(-1)
            causal = rows >= torch.arange(keys, device=q.device)  # top-left aligned, as SDPA
            valid = causal if valid is None else valid & causal
        yield R, valid, bias


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
    """Softmax statistics at one scale, summed over valid rows, per head.

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


def _scaled_moments(moments: Tensor, scale: Scale, heads: int) -> Tuple[Tensor, Tensor]:
    """(count, mean, M2) and max of ``σR`` from the moments of ``R`` (scale-linear)."""
    n, mean, m2, rmax, rmin = moments
    if isinstance(scale, Tensor):
        s = scale.to(device=moments.device, dtype=moments.dtype).reshape(-1).expand(heads)
        top = torch.where(s >= 0, s * rmax, s * rmin)
    else:
        s = float(scale)
        top = s * rmax if s >= 0 else s * rmin
    return torch.stack([n, s * mean, s * s * m2]), top


def forward_stats(
    call: AttentionCall,
    scales: Mapping[str, Scale],
    saturation: float = 0.99,
    budget_bytes: int = 64 * 2**20,
) -> Dict[str, Tensor]:
    """All forward metrics of one call, as accumulator fields (see :mod:`probe.stats.accumulator`).

    One ``q @ k.T`` per chunk of query rows serves every scale; ``logit_var`` and ``logit_max``
    are derived from the moments of ``R``; scales with the same value share one softmax pass.

    Args:
        call: the attention computation.
        scales: scale name → value (``"actual"`` must be present; it also gives ``nonfinite``).
        saturation: τ, a row is saturated when its max probability is at least τ.
        budget_bytes: extra memory allowed for one chunk's buffers.

    Returns:
        Field name → per-head tensor: ``logit@{s}`` (count/mean/M2 stack), ``logit_max@{s}``,
        ``rows``, ``entropy@{s}``, ``max_prob@{s}``, ``saturated@{s}`` and ``nonfinite``.
    """
    heads = call.heads
    acc = accumulation_dtype(call.q.device)
    groups: Dict[object, list] = {}
    for name, value in scales.items():
        key = id(value) if isinstance(value, Tensor) else float(value)
        groups.setdefault(key, []).append(name)
    representative = {names[0]: scales[names[0]] for names in groups.values()}
    actual_rep = next(names[0] for names in groups.values() if "actual" in names)

    moments: Optional[Tensor] = None
    soft: Dict[str, Tensor] = {}
    nonfinite = torch.zeros(heads, dtype=acc, device=call.q.device)
    for R, valid, bias in iter_chunks(call, budget_bytes):
        part = logit_moments(R, valid).to(acc)
        if moments is None:
            moments = part
        else:
            mv = combine_moments(moments[:3], part[:3])
            moments = torch.cat([mv, torch.maximum(moments[3:4], part[3:4]), torch.minimum(moments[4:5], part[4:5])])
        for name, value in representative.items():
            sums, lse = softmax_stats(R, valid, bias, value, call.softcap, saturation)
            soft[name] = sums.to(acc) if name not in soft else soft[name] + sums.to(acc)
            if name == actual_rep:
                nonfinite = nonfinite + _nonfinite(R, valid, lse).to(acc)
    if moments is None:  # no query rows: nothing to report
        return {}

    out: Dict[str, Tensor] = {"nonfinite": nonfinite}
    for names in groups.values():
        sums = soft[names[0]]
        for name in names:
            out[f"logit@{name}"], out[f"logit_max@{name}"] = _scaled_moments(moments, scales[name], heads)
            out[f"entropy@{name}"] = sums[1]
            out[f"max_prob@{name}"] = sums[2]
            out[f"saturated@{name}"] = sums[3]
    out["rows"] = soft[actual_rep][0]
    return out
