"""Pure, on-device reductions of an :class:`~probe.call.AttentionCall` into per-head sums.

Everything here is a function of tensors: no state, no host synchronization (no ``.item()``,
no data-dependent shapes), so it runs unchanged on ``meta`` tensors. Running state and its
combination across calls, steps and ranks live in :mod:`probe.stats.accumulator`.

Notation (DESIGN.md): ``R = q @ k.T`` (raw dot products), ``A`` the additive bias with masked
entries removed, ``σ`` a scale, ``Z = σR + A`` (``c·tanh(σR/c) + A`` with softcap ``c``),
``P = softmax(Z)`` over valid keys.

Cost model (docs/performance.md): per chunk of query rows, one ``q·kᵀ`` serves every scale.
Without bias or softcap and with positive float scales (SDPA defaults, BERT, Llama, GPT) the
*shifted* path runs: ``D = R − rowmax(R)`` is formed once in place, the logit moments come from
per-row sums of ``D``, and each distinct scale costs one ``exp(σD)`` with two row reductions
(``σ·rowmax`` is the row max of ``σR`` for ``σ > 0``, so no second max pass). Other calls take
the general path (:func:`softmax_stats`, :func:`logit_moments`), a few more passes per scale.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from probe.call import AttentionCall, Scale

__all__ = [
    "FORWARD_METRICS",
    "accumulation_dtype",
    "cache_chunk_rows",
    "chunk_rows",
    "combine_moments",
    "forward_stats",
    "grad_logits_shifted",
    "iter_chunks",
    "logit_moments",
    "sample_rows",
    "shiftable",
    "softmax_stats",
]

#: Metrics computed in the forward pass, in the order they are reported.
FORWARD_METRICS = ("logit_var", "logit_max", "entropy", "max_prob", "saturation", "nonfinite")

# How many (B, H, rows, S) float32 buffers one chunk keeps alive at once. The shifted path holds
# R (shifted in place), its masked copy, exp(σD) and one product; the general path R, Z,
# exp(Z − m) and the entropy product. Masks are bool (a quarter each); 6 covers both.
_LIVE_BUFFERS = 6

# Below the budget, chunks are also kept near the size of a core's L2 cache so that the few
# elementwise passes of a chunk read it from cache rather than from memory (docs/performance.md).
_CACHE_CHUNK_BYTES = 2 * 2**20


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 for running sums wherever the device has it (MPS has not)."""
    return torch.float32 if device.type == "mps" else torch.float64


def chunk_rows(batch: int, heads: int, keys: int, budget_bytes: int) -> int:
    """Query rows per chunk so that the chunk's live buffers stay within ``budget_bytes``."""
    per_row = max(1, batch * heads * keys * 4 * _LIVE_BUFFERS)
    return max(1, budget_bytes // per_row)


def cache_chunk_rows(batch: int, heads: int, keys: int) -> int:
    """Query rows per chunk that keep one ``(B, H, rows, S)`` float32 buffer near the size of a
    core's L2 cache (at least 16 rows, so the per-chunk Python overhead stays small)."""
    return max(16, _CACHE_CHUNK_BYTES // max(1, batch * heads * keys * 4))


def sample_rows(length: int, rows: int, generator: Optional[torch.Generator] = None,
                device: Optional[torch.device] = None) -> Tensor:
    """``rows`` distinct query positions drawn uniformly from ``range(length)``, sorted.

    Each position is included with probability ``π = rows / length``; the same positions serve
    every batch element and head. Drawn on the CPU (``generator`` is a CPU generator) and moved
    to ``device`` without waiting.
    """
    idx = torch.randperm(length, generator=generator)[: min(rows, length)].sort().values
    return idx.to(device, non_blocking=True) if device is not None else idx


def _as_4d(t: Tensor) -> Tensor:
    while t.dim() < 4:
        t = t.unsqueeze(0)
    if t.dim() > 4:
        t = t.reshape(-1, *t.shape[-3:])
    return t


def _rows(t: Optional[Tensor], r0: int, r1: int, pos: Optional[Tensor] = None) -> Optional[Tensor]:
    """Rows ``r0:r1`` (or positions ``pos``) of a tensor broadcastable to ``(B, H, L, S)``."""
    if t is None:
        return None
    t = _as_4d(t)
    if t.shape[-2] == 1:
        return t  # broadcast over rows
    return t[..., r0:r1, :] if pos is None else t.index_select(-2, pos)


def _bias_valid(bias: Tensor) -> Tensor:
    # Hugging Face masks use finfo.min instead of -inf; anything at most half of it is masked.
    return bias > torch.finfo(bias.dtype).min / 2


def _chunk_mask(call: AttentionCall, r0: int, r1: int, pos: Optional[Tensor],
                keys: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(valid, bias) for rows ``r0:r1`` (or positions ``pos``) and keys ``0:keys``."""
    device = call.q.device
    valid = _rows(call.mask, r0, r1, pos)
    bias = _rows(call.bias, r0, r1, pos)
    if keys < call.k.shape[2]:
        valid = None if valid is None else valid[..., :keys]
        bias = None if bias is None else bias[..., :keys]
    if bias is not None:
        bias_ok = _bias_valid(bias)
        valid = bias_ok if valid is None else valid & bias_ok
        bias = torch.where(bias_ok, bias.float(), 0.0)
    if call.causal:
        rows = (torch.arange(r0, r1, device=device) if pos is None else pos).unsqueeze(-1)
        causal = rows >= torch.arange(keys, device=device)  # top-left aligned, as SDPA
        valid = causal if valid is None else valid & causal
    return valid, bias


def _iter(call: AttentionCall, step: int, positions: Optional[Tensor] = None, reuse: bool = False,
          last: Optional[Sequence[int]] = None, causal_mask: bool = True
          ) -> Iterator[Tuple[Tensor, Optional[Tensor], Optional[Tensor]]]:
    """Chunks of ``(R, valid, bias)``; with ``reuse`` every ``R`` is a view of one buffer, valid
    until the next chunk (a fresh large tensor per chunk costs page faults on CPUs).

    ``last``: the last query position of each chunk, from the host (``None``: do not trim). Under
    causal masking the keys after it are masked for every row of the chunk, so ``R`` only spans
    keys ``0 .. last`` (about half the work for a causal call); callers that need all ``S``
    columns (the backward's ``dP``) leave it ``None``. ``causal_mask=False`` leaves causal
    masking to the caller (``valid`` then omits it; see :func:`_causal_block`).
    """
    q, k = call.q, call.k
    batch, heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    # (B, Hk, d, S). Copied once when k's (B, H) dims cannot be flattened into one batch dim
    # (Hugging Face's q/k/v are transposed views of (B, L, H, d)): otherwise every chunk's
    # matmul would copy it again (measured: 8 ms of a 66 ms probed BERT step).
    kt = k.float().contiguous().transpose(-1, -2)
    if groups > 1:
        kt = kt.expand(batch, -1, -1, -1).unsqueeze(2)  # (B, Hk, 1, d, S)
    total = length if positions is None else positions.shape[0]
    buffer = None
    if reuse and total > 0:
        buffer = torch.empty(batch * heads * min(step, total) * keys, device=q.device)
    for r0 in range(0, total, step):
        r1 = min(total, r0 + step)
        rows = r1 - r0
        pos = None if positions is None else positions[r0:r1]
        qc = (q[:, :, r0:r1] if pos is None else q.index_select(2, pos)).float()
        cols = keys if last is None or not call.causal else max(1, min(keys, last[r0 // step] + 1))
        kc = kt if cols == keys else kt[..., :cols]
        R = None if buffer is None else buffer[: batch * heads * rows * cols].view(batch, heads, rows, cols)
        if groups > 1:
            qc = qc.reshape(batch, kv_heads, groups, rows, dim)
            out = None if R is None else R.view(batch, kv_heads, groups, rows, cols)
            R = torch.matmul(qc, kc, out=out).view(batch, heads, rows, cols)
        else:
            R = torch.matmul(qc, kc, out=R)
        if causal_mask:
            valid, bias = _chunk_mask(call, r0, r1, pos, cols)
        else:
            valid, bias = _chunk_mask(dataclasses.replace(call, causal=False), r0, r1, pos, cols)
        yield R, valid, bias


def iter_chunks(
    call: AttentionCall, budget_bytes: int
) -> Iterator[Tuple[Tensor, Optional[Tensor], Optional[Tensor]]]:
    """Yield ``(R, valid, bias)`` for consecutive chunks of query rows.

    ``R`` is ``q[:, :, rows] @ k.T`` in float32, shape ``(B, H, l, S)``, computed once per chunk
    for every scale (grouped-query attention without repeating k). ``valid`` (bool) and
    ``bias`` (float32, masked entries zeroed) broadcast to ``R``; either may be ``None``.
    ``R`` is a fresh buffer the caller may overwrite.
    """
    batch, heads = call.q.shape[:2]
    yield from _iter(call, chunk_rows(batch, heads, call.k.shape[2], budget_bytes))


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


def _general_chunk(R: Tensor, valid: Optional[Tensor], bias: Optional[Tensor], scales: Sequence[Scale],
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


_LOG2E = 1.0 / math.log(2.0)


def _shifted_rows(R: Tensor, valid: Optional[Tensor], scales: Sequence[float],
                  work: Optional[Tensor] = None, causal: Optional[Tuple[int, Tensor]] = None) -> List[Tensor]:
    """Per-row sums of one chunk for the shifted path, each ``(B, H, l)`` float32.

    With ``r`` the row max of ``R`` over valid keys and ``D = R − r`` (``≤ 0``), every positive
    scale has row max ``σr``, so ``e = exp(σD)`` (computed as ``exp2(σ·log2(e)·D)``, three times
    cheaper than ``exp`` on CPUs), ``Σe`` and ``Σ e·D`` give the row's entropy and max
    probability (:func:`_shifted_reduce`): one exponential and two row sums per scale.

    Returns ``[n, r, ΣD, ΣD², min D, #non-finite, Σe_1, Σe·D_1, Σe_2, ...]`` where ``n`` is the
    number of valid keys and ``#non-finite`` counts NaN/±inf among the row's valid logits.

    ``work`` is scratch space of at least ``2·R.numel()`` floats, reused across chunks.
    ``causal = (r0, upper)``: the chunk starts at query ``r0`` and is causal with no other mask;
    only its diagonal block is masked, with ``upper`` (``triu(ones(step, step), 1)``, built once
    per call). Masks that grow with the chunk's width fragment the CPU heap (measured: +20 MiB
    of resident memory at L = 4096).

    Pitfall: ``R`` is overwritten. Masked entries of ``D`` are ``-inf`` for the exponential and 0
    in the sums (``0·(−inf)`` would be NaN); a fully masked row has ``r = −inf``, replaced by 0.
    """
    batch, heads, length, keys = R.shape
    shape = (batch, heads, length)
    if work is None or work.numel() < 2 * R.numel():
        work = torch.empty(2 * R.numel(), device=R.device)
    e = work[: R.numel()].view(R.shape)
    masked = valid is not None or causal is not None
    if causal is not None:
        r0, upper = causal
        if keys > r0:
            R[..., r0:].masked_fill_(upper[:length, : keys - r0], -math.inf)
        n_row = (torch.arange(r0 + 1, r0 + length + 1, device=R.device, dtype=torch.float32)
                 .clamp(max=keys).expand(shape))
    elif valid is None:
        n_row = torch.full(shape, float(keys), device=R.device)
    else:
        R.masked_fill_(~valid, -math.inf)
        n_row = valid.sum(-1, dtype=torch.float32).expand(shape)
    # x·0 is 0 for finite x and NaN for NaN and ±inf (masked entries are −inf: subtract them)
    bad = torch.nan_to_num(torch.mul(R, 0.0, out=e), nan=1.0, out=e).sum(-1)
    if masked:
        bad = bad - (keys - n_row)
    rmax = R.amax(-1, keepdim=True)
    rmax = torch.where(rmax == -math.inf, 0.0, rmax)
    D = R.sub_(rmax)
    D0 = D
    if masked:
        D0 = torch.nan_to_num(D, nan=math.nan, posinf=math.inf, neginf=0.0,
                              out=work[R.numel() : 2 * R.numel()].view(R.shape))
    out = [n_row, rmax.squeeze(-1), D0.sum(-1), torch.linalg.vector_norm(D0, dim=-1).square(),
           D0.amin(-1), bad]  # masked entries of D0 are 0 >= every valid D: amin is the valid min
    for sigma in scales:
        torch.mul(D, sigma * _LOG2E, out=e).exp2_()
        out.append(e.sum(-1))
        out.append(e.mul_(D0).sum(-1))
    return out


def _shifted_reduce(rows: List[Tensor], scales: Sequence[float], saturation: float,
                    acc: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-head (moments (5, H), softmax sums (len(scales), 4, H), nonfinite (H,)) from the
    per-row sums of :func:`_shifted_rows` (all rows of a call, concatenated).

    Moments: a row has mean ``μ = r + ΣD/n`` and ``M2 = ΣD² − (ΣD)²/n``; rows combine exactly
    per head, in ``acc``: ``mean = Σ nμ / Σ n``, ``M2 = Σ M2_row + Σ n(μ − mean)²`` (Chan).
    ``ΣD² − (ΣD)²/n`` cancels only as much as ``mean(D)²/var(D)`` in a row, which is small
    because ``D`` is measured from the row max, not from zero.
    Softmax at ``σ``: ``H = log Σe − σ·Σ e·D / Σe``, ``max P = 1/Σe``; nonfinite probabilities:
    every valid entry of a row whose log-sum-exp ``σr + log Σe`` is NaN or ``+inf``.
    """
    n, r, a, b, lo, bad = rows[:6]
    dims = (0, 2)
    n64, r64, a64 = n.to(acc), r.to(acc), a.to(acc)
    seen = n > 0
    safe_n = n64.clamp(min=1)
    mu = r64 + a64 / safe_n
    m2_row = (b.to(acc) - a64 * a64 / safe_n).clamp(min=0)
    count = n64.sum(dims)
    mean = (n64 * mu).sum(dims) / count.clamp(min=1)
    m2 = m2_row.sum(dims) + (n64 * (mu - mean.view(1, -1, 1)).square()).sum(dims)
    top = torch.where(seen, r, -math.inf).amax(dims).to(acc)
    low = torch.where(seen, r + lo, math.inf).amin(dims).to(acc)
    moments = torch.stack([count, mean, m2, top, low])

    ok = n >= 2
    log_n = torch.log(n.clamp(min=2))
    n_ok = ok.sum(dims, dtype=acc)
    soft, nonfinite = [], None
    for i, sigma in enumerate(scales):
        se, sed = rows[6 + 2 * i], rows[7 + 2 * i]
        lse = torch.log(se)
        entropy = (lse - sigma * sed / se).clamp(min=0) / log_n
        max_prob = 1.0 / se
        soft.append(torch.stack([
            n_ok,
            torch.where(ok, entropy, 0.0).sum(dims, dtype=acc),
            torch.where(ok, max_prob, 0.0).sum(dims, dtype=acc),
            (ok & (max_prob >= saturation)).sum(dims, dtype=acc),
        ]))
        if i == 0:
            row_lse = lse + sigma * r
            bad_rows = torch.isnan(row_lse) | (row_lse == math.inf)
            nonfinite = bad.sum(dims, dtype=acc) + torch.where(bad_rows, n, 0.0).sum(dims, dtype=acc)
    return moments, torch.stack(soft), nonfinite  # type: ignore[arg-type]


# (B, H, rows, S) float32 buffers the backward's shifted path keeps alive: R, dP, e, a product,
# masks and the next chunk's q rows; 8 leaves a margin (as probe.stats.grads).
_BACKWARD_LIVE_BUFFERS = 8


def grad_logits_shifted(call: AttentionCall, dout: Tensor, vt: Tensor, values: Sequence[float],
                         budget_bytes: int, acc: torch.dtype, grad_scale: Optional[Tensor] = None) -> List[Tensor]:
    """Per-head ``Σ (∂L/∂Z^σ)²`` for positive float scales without bias or softcap (the common
    case), one tensor per scale in ``values``.

    As in the forward's shifted path (:mod:`probe.stats.functional`), ``D = R − rowmax`` is
    formed once per chunk and ``e = exp(σD)`` once per scale; with ``c = Σ e·dP / Σe`` a row's
    ``Σ_j (P_j (dP_j − c))² = ‖e ⊙ (dP − c)‖² / (Σe)²``. Chunks are cache-sized and reuse four
    buffers (R, dP, e, one product); a causal chunk stops at its last query (later keys have
    ``P = 0``, no gradient) and, without other masks, masks only its diagonal block.

    Args:
        call: the attention computation (no bias, no softcap).
        dout: ``∂L/∂out`` as ``(B, H, L, dv)``.
        vt: ``vᵀ`` in float32, ``(B, Hk, dv, S)``.
        values: the distinct scales, all ``> 0`` (see :func:`shiftable`).
        budget_bytes: extra memory one chunk may use.
        acc: the accumulation dtype.
        grad_scale: a factor applied to each chunk of ``dout`` (the sums come out multiplied by
            its square; :func:`probe.stats.grads.grad_scale` keeps a huge gradient from overflowing).

    Pitfall: a fully masked row has ``Σe = 0`` and contributes 0; a NaN row stays NaN.
    """
    batch, heads, length, _ = call.q.shape
    keys, kv_heads = call.k.shape[2], call.kv_heads
    vt = vt.transpose(-1, -2).contiguous().transpose(-1, -2)  # once, not per chunk (as k in _iter)
    if batch * heads * length * keys == 0:
        return [torch.zeros(heads, dtype=acc, device=call.q.device) for _ in values]
    step = min(max(1, budget_bytes // max(1, batch * heads * keys * 4 * _BACKWARD_LIVE_BUFFERS)),
               cache_chunk_rows(batch, heads, keys), length)  # never above the rows there are
    last = [min(length, r0 + step) - 1 for r0 in range(0, length, step)] if call.causal else None
    block = call.causal and call.mask is None
    upper = torch.ones(step, step, dtype=torch.bool, device=call.q.device).triu(1) if block else None
    sums = [torch.zeros(heads, dtype=acc, device=call.q.device) for _ in values]
    work = torch.empty(3 * batch * heads * min(step, length) * keys, device=call.q.device)
    r0 = 0
    for R, valid, _ in _iter(call, step, reuse=True, last=last, causal_mask=not block):
        rows, cols = R.shape[2], R.shape[3]
        n = R.numel()
        dP, e, t = (work[i * n : (i + 1) * n].view(R.shape) for i in range(3))
        dc, vc = dout[:, :, r0 : r0 + rows].float(), vt[..., :cols]
        if grad_scale is not None:
            dc = dc * grad_scale
        if kv_heads != heads:
            g = heads // kv_heads
            torch.matmul(dc.reshape(batch, kv_heads, g, rows, -1), vc.unsqueeze(2),
                         out=dP.view(batch, kv_heads, g, rows, cols))
        else:
            torch.matmul(dc, vc, out=dP)
        if upper is not None and cols > r0:
            R[..., r0:].masked_fill_(upper[:rows, : cols - r0], -math.inf)
        elif valid is not None:
            R.masked_fill_(~valid, -math.inf)
        rmax = R.amax(-1, keepdim=True)
        D = R.sub_(torch.where(rmax == -math.inf, 0.0, rmax))
        for i, sigma in enumerate(values):
            torch.mul(D, sigma * _LOG2E, out=e).exp2_()
            se = e.sum(-1)
            c = torch.mul(e, dP, out=t).sum(-1, keepdim=True) / se.unsqueeze(-1)
            g2 = torch.linalg.vector_norm(torch.sub(dP, c, out=t).mul_(e), dim=-1).square() / se.square()
            sums[i] = sums[i] + torch.where(se == 0, 0.0, g2).sum((0, 2), dtype=acc)
        r0 += rows
    return sums


def _valid_rows(call: AttentionCall, step: int) -> Tensor:
    """Per head, the number of query rows with at least two valid keys (mask and bias only)."""
    batch, heads, length, _ = call.q.shape
    keys = call.k.shape[2]
    total = torch.zeros(heads, device=call.q.device)
    for r0 in range(0, length, step):
        r1 = min(length, r0 + step)
        valid, _ = _chunk_mask(call, r0, r1, None, keys)
        if valid is None:
            n_row = torch.full((1, 1, 1), keys, device=call.q.device)
        else:
            n_row = valid.sum(-1)
        total = total + (n_row >= 2).expand(batch, heads, r1 - r0).sum((0, 2))
    return total


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


def shiftable(call: AttentionCall, values: Sequence[Scale]) -> bool:
    """Whether the shifted path applies: no bias, no softcap, finite positive float scales."""
    return call.bias is None and call.softcap is None and all(
        not isinstance(v, Tensor) and 0.0 < float(v) < 1e30 for v in values
    )


def forward_stats(
    call: AttentionCall,
    scales: Mapping[str, Scale],
    saturation: float = 0.99,
    budget_bytes: int = 64 * 2**20,
    *,
    rows: Union[None, int, Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> Dict[str, Tensor]:
    """All forward metrics of one call, as accumulator fields (see :mod:`probe.stats.accumulator`).

    One ``q @ k.T`` per chunk of query rows serves every scale; ``logit_var`` and ``logit_max``
    are derived from the moments of ``R``; scales with the same value share one softmax pass.

    Args:
        call: the attention computation.
        scales: scale name → value (``"actual"`` must be present; it also gives ``nonfinite``).
        saturation: τ, a row is saturated when its max probability is at least τ.
        budget_bytes: extra memory allowed for one chunk's buffers.
        rows: query-row sampling. ``None`` uses every row; an int ``N < L`` draws ``N`` distinct
            positions uniformly (:func:`sample_rows`, with ``generator``); a 1-D tensor gives the
            sorted positions. With ``π = N / L``, the row sums (entropy, max_prob, saturated,
            nonfinite) are weighted by ``1/π`` (Horvitz–Thompson) and ``rows`` is the exact
            number of valid rows, so the mean metrics are unbiased; ``logit_var`` is the variance
            of the sampled logits (consistent, not unbiased) and ``logit_max`` a lower bound.
        generator: the CPU generator for ``rows=N`` (``None``: torch's global generator).

    Returns:
        Field name → per-head tensor: ``logit@{s}`` (count/mean/M2 stack), ``logit_max@{s}``,
        ``rows``, ``entropy@{s}``, ``max_prob@{s}``, ``saturated@{s}`` and ``nonfinite``.
    """
    batch, heads, length, _ = call.q.shape
    keys = call.k.shape[2]
    if batch * heads * length * keys == 0:
        return {}  # batch 0, no heads, no queries or no keys: nothing to measure
    acc = accumulation_dtype(call.q.device)
    groups: Dict[object, List[str]] = {}
    for name, value in scales.items():
        key = id(value) if isinstance(value, Tensor) else float(value)
        groups.setdefault(key, []).append(name)
    # the group holding `actual` goes first: it also gives `nonfinite`
    order = sorted(groups.values(), key=lambda names: "actual" not in names)
    values = [scales[names[0]] for names in order]

    positions: Optional[Tensor] = None
    cpu_positions: Optional[Tensor] = None
    if isinstance(rows, Tensor):
        positions = rows.to(call.q.device)
    elif rows is not None and rows < length:
        cpu_positions = sample_rows(length, rows, generator)
        positions = cpu_positions.to(call.q.device, non_blocking=True)
    total = length if positions is None else positions.shape[0]
    # Within the budget, also keep a chunk near the cache size (never below 16 rows), and never
    # above the rows there are: buffers (the causal block mask is step × step) are sized from it.
    step = min(chunk_rows(batch, heads, keys, budget_bytes), cache_chunk_rows(batch, heads, keys),
               max(1, total))

    shifted = shiftable(call, values)
    floats = [float(v) for v in values] if shifted else []
    moments: Optional[Tensor] = None
    soft: Optional[Tensor] = None
    nonfinite = torch.zeros(heads, dtype=acc, device=call.q.device)
    row_parts: List[List[Tensor]] = []
    work: Optional[Tensor] = None
    # last query position of each chunk (host side: the positions are drawn on the CPU)
    host_pos = None if positions is None else positions.cpu() if isinstance(rows, Tensor) else cpu_positions
    last = [(min(total, r0 + step) - 1) if host_pos is None else int(host_pos[min(total, r0 + step) - 1])
            for r0 in range(0, total, step)] if call.causal and call.q.device.type != "meta" else None
    # a causal call without other masks: mask only each chunk's diagonal block, with one mask
    block = shifted and call.causal and positions is None and call.mask is None
    upper = torch.ones(step, step, dtype=torch.bool, device=call.q.device).triu(1) if block else None
    for index, (R, valid, bias) in enumerate(_iter(call, step, positions, reuse=shifted, last=last,
                                                   causal_mask=not block)):
        if shifted:  # per-row sums now, one per-head reduction at the end (fewer small ops)
            if work is None:  # sized for the widest chunk (causal chunks grow)
                work = torch.empty(2 * batch * heads * min(step, total) * keys, device=R.device)
            causal = None if upper is None else (index * step, upper)
            # one (K, B, H, l) tensor per chunk: thousands of small tensors cost heap at long L
            row_parts.append(torch.stack(_shifted_rows(R, valid, floats, work, causal)))
            continue
        part, sums, bad = _general_chunk(R, valid, bias, values, call.softcap, saturation, acc)
        if moments is None:
            moments, soft = part, sums
        else:
            mv = combine_moments(moments[:3], part[:3])
            moments = torch.cat([mv, torch.maximum(moments[3:4], part[3:4]), torch.minimum(moments[4:5], part[4:5])])
            soft = soft + sums
        nonfinite = nonfinite + bad
    if row_parts:
        rows_all = torch.cat(row_parts, dim=-1) if len(row_parts) > 1 else row_parts[0]
        row_parts.clear()
        moments, soft, nonfinite = _shifted_reduce(list(rows_all.unbind(0)), floats, saturation, acc)
    if moments is None or soft is None:  # no query rows: nothing to report
        return {}
    row_count = soft[0, 0]
    if positions is not None:
        weight = length / max(1, positions.shape[0])  # 1/π, Horvitz–Thompson
        soft = soft * weight
        nonfinite = nonfinite * weight
        moments = torch.cat([moments[:1] * weight, moments[1:]])
        row_count = _valid_rows(call, step).to(acc)

    out: Dict[str, Tensor] = {"nonfinite": nonfinite}
    for i, names in enumerate(order):
        sums = soft[i]
        for name in names:
            out[f"logit@{name}"], out[f"logit_max@{name}"] = _scaled_moments(moments, scales[name], heads)
            out[f"entropy@{name}"] = sums[1]
            out[f"max_prob@{name}"] = sums[2]
            out[f"saturated@{name}"] = sums[3]
    out["rows"] = row_count
    return out
