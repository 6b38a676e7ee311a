"""The general path: per-chunk softmax statistics for any bias, mask, softcap or scale.

Used for calls the shifted path (:mod:`probe.stats.shifted`) cannot take: an additive float
bias, soft-capping, a per-head scale tensor or a non-positive scale.

Per chunk of query rows (:func:`general_rows`), as the shifted path: one pass set over every row
that needs no exponential (``R`` masked in place, its row max ``r``, ``D = R − r``, ``ΣD``,
``ΣD²``, the row min for negative or per-head scales, the non-finite count), and the softmax of
``Z = σR + A`` (``c·tanh(σR/c) + A``) per scale on the sampled rows only (all rows without
sampling), in reused buffers, with ``exp2``. :func:`general_reduce` combines the rows per head:
exact moments, maximum, minimum and ``nonfinite``; Horvitz-Thompson totals and their variances
for the exponential metrics of sampled rows (:mod:`probe.stats.sampling`).

:func:`softmax_stats` and :func:`logit_moments` are the plain per-chunk formulas (kept as the
reference the tests and the unknown-scale path use).
"""

from __future__ import annotations

import math
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from probe.call import Scale
from probe.stats.pool import chan_pair
from probe.stats.chunks import MASK_BIAS, all_finite

__all__ = ["KEEP_BYTES", "Scratch", "chunk_masks", "combine_moments", "general_reduce", "general_rows",
           "logit_moments", "release", "softmax_stats", "take_scratch"]

_LOG2E = 1.0 / math.log(2.0)

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
    """Exactly combine two ``(3, ...)`` stacks of (count, mean, M2) (:func:`probe.stats.pool.chan_pair`)."""
    return torch.stack(chan_pair(a[0], a[1], a[2], b[0], b[1], b[2]))


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


def _scale2(scale: Scale, heads: int, device: torch.device, factor: float) -> Scale:
    """``σ·factor`` as a float or a ``(1, H, 1, 1)`` float32 tensor."""
    if isinstance(scale, Tensor):
        return (scale.to(device=device, dtype=torch.float32) * factor).reshape(1, -1, 1, 1).expand(1, heads, 1, 1)
    return float(scale) * factor


def _rows_of(t: Optional[Tensor], pick: Optional[Tensor]) -> Optional[Tensor]:
    """Rows ``pick`` of a ``(..., l, S)`` tensor that may broadcast over rows (a causal mask is ``(l, S)``)."""
    if t is None or pick is None or t.shape[-2] == 1:
        return t
    return t.index_select(-2, pick)


class Scratch:
    """Flat buffers of one call's general path, reused by every chunk (a fresh chunk-sized tensor
    per op costs page faults on CPUs: measured 7 of 17 ms of a T5-shaped call). ``size`` is the
    widest chunk's ``B·H·rows·S``. :func:`take_scratch` keeps them for the thread's next call."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self._buffers: Dict[str, Tensor] = {}

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> Tensor:
        """A ``shape`` view of the buffer ``name`` (contents undefined)."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(max(n, self.size), dtype=dtype, device=self.device)
        return buf[:n].view(tuple(shape))


#: Bytes of general-path buffers a thread keeps between calls on CPUs (:func:`take_scratch`).
KEEP_BYTES = 16 * 2**20

_KEPT = threading.local()


def take_scratch(size: int, device: torch.device) -> Scratch:
    """The buffers of one call: on CPUs the calling thread's, kept from its previous call while
    they total at most :data:`KEEP_BYTES` (the same chunk shapes come back every layer and step:
    fresh ones cost their page faults every call, measured 2.5 of 6.8 ms forward and 2.4 of 5.0
    ms backward on a T5-shaped call); elsewhere (the caching allocators of accelerators) new ones.
    Call :func:`release` when done."""
    if device.type != "cpu":
        return Scratch(size, device)
    kept = getattr(_KEPT, "scratch", None)
    _KEPT.scratch = None  # taken: a nested call (none is expected) would get its own
    if kept is None:
        return Scratch(size, device)
    kept.size = size
    return kept


def release(buffers: Scratch) -> None:
    """Hand a call's buffers back to its thread (CPUs, within :data:`KEEP_BYTES`)."""
    if buffers.device.type == "cpu" and buffers.nbytes() <= KEEP_BYTES:
        _KEPT.scratch = buffers


def chunk_masks(valid: Optional[Tensor], bias: Optional[Tensor], scratch: Scratch, bias_masks: bool = True
                ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(valid, neg)`` of a chunk: the keys each row may attend to (the call's mask and causal
    masking ``valid``, and a bias not at or below :data:`~probe.stats.chunks.MASK_BIAS`) as bool, and the
    same as an additive float mask (0 / ``−inf``), both broadcastable to the chunk, in buffers.
    ``bias``: the chunk's raw bias rows (any float dtype, masked entries anything); ``bias_masks``
    False: it is known to mask nothing (its min is above the threshold)."""
    if bias is not None and bias_masks:  # a NaN bias masks nothing: it makes its logit NaN, as in the model
        ok = torch.le(bias, MASK_BIAS, out=scratch.get("ok", bias.shape, torch.bool)).logical_not_()
        if valid is None:
            valid = ok
        else:
            shape = torch.broadcast_shapes(ok.shape, valid.shape)
            valid = torch.logical_and(ok, valid, out=scratch.get("valid", shape, torch.bool))
    if valid is None:
        return None, None
    neg = torch.where(valid, _full(0.0, valid), _full(-math.inf, valid), out=scratch.get("neg", valid.shape))
    return valid, neg


def _full(value: float, like: Tensor) -> Tensor:
    """A 0-dim float32 tensor on ``like``'s device (``where(..., out=)`` takes no Python numbers)."""
    return torch.full((), value, device=like.device)


def _row_counts(valid: Optional[Tensor], neg: Optional[Tensor], shape: Tuple[int, int, int], keys: int,
                scratch: Scratch) -> Tensor:
    """Valid keys per row, ``(B, H, l)`` float32: ``keys`` minus the masked ones, counted from the
    float mask (a float sum; a bool sum is ten times slower on CPUs)."""
    if valid is None or neg is None:
        return torch.full(shape, float(keys), device=scratch.device)
    masked = torch.clamp(neg, min=-1.0, out=scratch.get("z", neg.shape)).sum(-1)  # −(masked keys)
    return masked.add_(keys).expand(shape)


def _softmax_rows(X: Tensor, valid: Optional[Tensor], neg: Optional[Tensor], bias: Optional[Tensor],
                  n_row: Tensor, scales: Sequence[Scale], softcap: Optional[float], proven: bool,
                  scratch: Scratch) -> List[Tensor]:
    """Per-row softmax sums of ``Z = σX + A`` (``c·tanh(σX/c) + A``) for each scale, ``X`` raw
    (unmasked) logit rows, ``bias`` their raw bias rows, ``valid`` / ``neg`` their masks
    (:func:`chunk_masks`), ``n_row`` their valid keys.

    ``proven`` (every ``Z`` finite, bounded by 2¹⁰⁰): in base-2 units, ``Z₂ = Z·log2(e)`` formed
    directly (the factor folded into σ, the softcap's ``c`` and the bias, the latter once for every
    scale), so that ``e = exp2(Z₂ − m₂)``, a third of ``exp``'s cost on CPUs, and the mask added
    (with the bias, one addition). Otherwise natural units (``Z·log2(e)`` could overflow where
    ``Z`` does not), the mask selected (a NaN or ``+inf`` under it must not leak), and a valid
    ``−inf`` logit gives a NaN entropy, as the plain formula (:func:`softmax_stats`).

    Returns ``[lse_1, H_1, maxP_1, lse_2, ...]``: per row, the natural log-sum-exp of ``Z``
    (non-finite where the row's softmax is), the normalized entropy and the max probability,
    both 0 on rows with fewer than two valid keys.
    """
    heads = X.shape[1]
    z, e = scratch.get("z", X.shape), scratch.get("e", X.shape)
    # base 2 when proven (|Z| ≤ 2¹⁰⁰: Z·log2(e) cannot overflow); otherwise natural units, so that
    # a row's log-sum-exp is non-finite exactly where the model's is (the nonfinite count)
    unit, log, expo = (_LOG2E, torch.log2, torch.exp2) if proven else (1.0, torch.log, torch.exp)
    add = None  # what is added to σX: the bias (log2 units) and, when proven, the mask
    if bias is not None:
        shape = bias.shape if valid is None else torch.broadcast_shapes(bias.shape, valid.shape)
        buf = scratch.get("bias", shape)
        if valid is None:
            add = torch.mul(bias, unit, out=buf)
        elif proven:  # a finite bias (its max is finite): masked entries become −inf
            add = torch.add(neg, bias, alpha=unit, out=buf)  # type: ignore[arg-type]
        else:  # masked entries 0 (selected away below), whatever the bias holds there
            add = torch.where(valid, bias.float(), _full(0.0, bias), out=buf)
    elif proven:
        add = neg
    select = valid if not proven else None
    zero = _full(0.0, X)
    ok = n_row >= 2
    log_n = torch.log(n_row.clamp(min=2))
    out: List[Tensor] = []
    for sigma in scales:
        if softcap is None:
            torch.mul(X, _scale2(sigma, heads, X.device, unit), out=z)
        else:  # c·tanh(σX/c)·log2(e)
            torch.mul(X, _scale2(sigma, heads, X.device, 1.0 / softcap), out=z).tanh_().mul_(softcap * unit)
        if add is not None:
            z.add_(add)
        if select is not None:
            torch.where(select, z, _full(-math.inf, z), out=z)
        m = z.amax(-1, keepdim=True)
        m = torch.where(m == -math.inf, 0.0, m)  # fully masked rows: exp(-inf) = 0, no NaN
        z.sub_(m)
        expo(z, out=e)
        se = e.sum(-1)
        if select is not None:  # masked entries: -inf in z, and 0·(−inf) would be NaN
            torch.where(select, z, zero, out=z)
        elif neg is not None:  # proven: only masked entries are −inf
            z.nan_to_num_(nan=math.nan, posinf=math.inf, neginf=0.0)
        ez = e.mul_(z).sum(-1)
        lse = log(se)  # in units of log(2) when proven
        entropy = torch.where(ok, (lse - ez / se).clamp(min=0) / (unit * log_n), 0.0)
        max_prob = torch.where(ok, 1.0 / se, 0.0)
        out += [(lse + m.squeeze(-1)) / unit, entropy, max_prob]
    return out


def _top_bad(R: Tensor, valid: Optional[Tensor], bias: Optional[Tensor], scale: Scale,
             softcap: Optional[float], scratch: Scratch) -> Tensor:
    """Per row, whether the softmax of ``Z`` at ``scale`` is non-finite: its row max over valid
    keys is NaN or ``+inf`` (with finite logits ``Σe ∈ [1, n]``, so the log-sum-exp is finite).
    No exponential; for unsampled rows of calls not proven finite."""
    z = scratch.get("z", R.shape)
    torch.mul(R, _scale_view(scale, R.shape[1], R), out=z)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    if bias is not None:
        z.add_(bias)
    if valid is not None:
        torch.where(valid, z, _full(-math.inf, z), out=z)
    top = z.amax(-1)
    return torch.isnan(top) | (top == math.inf)


def general_rows(R: Tensor, valid: Optional[Tensor], bias: Optional[Tensor], scales: Sequence[Scale],
                 softcap: Optional[float], scratch: Scratch, pick: Optional[Tensor], need_min: bool,
                 proven: bool, bias_masks: bool = True) -> Tuple[List[Tensor], List[Tensor]]:
    """Per-row sums of one chunk for the general path, each ``(B, H, l)`` float32.

    ``valid``: the call's mask and causal masking for the chunk (``None``: every key), ``bias`` its
    raw bias rows (an entry at or below :data:`~probe.stats.chunks.MASK_BIAS` masks its key;
    ``bias_masks`` False: none does, proven by the caller).

    Returns ``(exact, soft)``: ``exact = [n, r, ΣD, ΣD², #non-finite, bad_n, (r_min)]`` for every
    row, ``n`` its valid keys, ``r`` the max of ``R`` over them (0 when none), ``D = R − r``,
    ``#non-finite`` the NaN/±inf among its valid logits, ``bad_n`` ``n`` where the row's softmax at
    ``scales[0]`` (``actual``) is non-finite (else 0), ``r_min`` the min of ``R`` (``need_min``;
    ``+inf`` when no key is valid); ``soft = [n, lse_1, H_1, maxP_1, ...]`` (:func:`_softmax_rows`)
    on the rows ``pick`` (local indices) or every row when ``None``.

    ``proven``: the call's logits ``Z`` are finite at every scale
    (:func:`probe.stats.functional._proven_finite`, CPUs): no non-finite count, no non-finite
    softmax row, masks added. Otherwise a chunk whose sum is finite (:func:`all_finite`) still
    skips the count and is masked by addition; the non-finite softmax rows of unsampled rows come
    from a row max of ``Z`` at ``actual`` (no exponential).

    Pitfall: ``R`` is overwritten (after the sampled rows are copied out).
    """
    batch, heads, length, keys = R.shape
    shape = (batch, heads, length)
    valid, neg = chunk_masks(valid, bias, scratch, bias_masks)
    n_row = _row_counts(valid, neg, shape, keys, scratch)
    finite = proven or all_finite(R)  # before masking: every entry of the chunk, valid or not
    if pick is None:
        soft = _softmax_rows(R, valid, neg, bias, n_row, scales, softcap, proven, scratch)
        n_s = n_row
    else:  # the sampled rows, copied out before R changes
        X = torch.index_select(R, 2, pick, out=scratch.get("rows", (batch, heads, pick.shape[0], keys)))
        n_s = n_row.index_select(2, pick)
        soft = _softmax_rows(X, _rows_of(valid, pick), _rows_of(neg, pick), _rows_of(bias, pick), n_s,
                             scales, softcap, proven, scratch)
    if proven:
        bad_n = torch.zeros(shape, device=R.device)
    elif pick is None:
        lse = soft[0]
        bad_n = torch.where(torch.isnan(lse) | (lse == math.inf), n_row, 0.0)
    else:
        bad_n = torch.where(_top_bad(R, valid, bias, scales[0], softcap, scratch), n_row, 0.0)
    # the exact part, in place: mask, row max, D = R − r, ΣD, ΣD² (as probe.stats.shifted.shifted_rows)
    if neg is not None:
        if finite:
            R.add_(neg)
        else:
            torch.where(valid, R, _full(-math.inf, R), out=R)  # type: ignore[arg-type]
    z = scratch.get("z", R.shape)
    if finite:
        bad = torch.zeros(shape, device=R.device)
    else:  # x·0 is 0 for finite x and NaN for NaN and ±inf (masked entries are −inf: subtract them)
        bad = torch.nan_to_num(torch.mul(R, 0.0, out=z), nan=1.0, out=z).sum(-1)
        if valid is not None:
            bad = bad - (keys - n_row)
    rmax = R.amax(-1, keepdim=True)
    rmax = torch.where(rmax == -math.inf, 0.0, rmax)
    D = R.sub_(rmax)
    D0 = D
    if valid is not None:
        D0 = torch.nan_to_num(D, nan=math.nan, posinf=math.inf, neginf=0.0, out=z)
    r = rmax.squeeze(-1)
    exact = [n_row, r, D0.sum(-1), torch.linalg.vector_norm(D0, dim=-1).square(), bad, bad_n]
    if need_min:  # valid D ≤ 0 and masked ones 0 in D0: its row min is the valid min
        exact.append(torch.where(n_row > 0, r + D0.amin(-1), math.inf))
    return exact, [n_s] + soft


def general_reduce(exact: Tensor, soft: Tensor, count: int, saturation: float, acc: torch.dtype,
                   design: Optional[Tuple[Tensor, Tensor, Tensor, Tensor]] = None
                   ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Per head ``(moments (5, H): count, mean, M2, max, min; softmax sums (count, 4, H); nonfinite (H,);
    variances (count, 3, H) or None)`` from the rows of :func:`general_rows` (chunks concatenated
    along rows: ``exact`` ``(6 or 7, B, H, L)``, ``soft`` ``(1 + 3·count, B, H, N)``).

    Moments as :func:`probe.stats.shifted.shifted_reduce` (row means ``r + ΣD/n`` and
    ``M2 = ΣD² − (ΣD)²/n`` combined by Chan's formula, in ``acc``). With ``design``
    (:func:`~probe.stats.sampling.row_design` of the sampled positions) the softmax sums are
    estimated as on the shifted path: the ratio estimator over the sampled valid rows times the
    exact valid-row count (:func:`probe.stats.shifted._ratio_totals`, Horvitz-Thompson weights),
    ``variances`` their linearized variances (:func:`~probe.stats.shifted.total_variance`).
    """
    from probe.stats.shifted import _ratio_totals, head_moments, total_variance

    n, r, a, b, bad, bad_n = exact[:6]
    dims = (0, 2)
    total, mean, m2, top = head_moments(n, r, a, b, acc)
    low = exact[6].amin(dims).to(acc) if exact.shape[0] > 6 else torch.full_like(top, math.inf)
    moments = torch.stack([total, mean, m2, top, low])
    n_ok = (n >= 2).sum(dims, dtype=acc)
    nonfinite = bad.sum(dims, dtype=acc) + bad_n.sum(dims, dtype=acc)
    weight = None if design is None else design[0].to(n.device, acc, non_blocking=True)
    ok = soft[0] >= 2
    sums, residuals = [], []
    for i in range(count):
        entropy, max_prob = soft[2 + 3 * i], soft[3 + 3 * i]
        saturated = (ok & (max_prob >= saturation)).to(entropy.dtype)
        rows = (entropy, max_prob, saturated)
        if weight is None:
            sums.append(torch.stack([n_ok] + [v.sum(dims, dtype=acc) for v in rows]))
        else:  # the ratio estimator of the shifted path (valid rows may differ between positions)
            totals, parts = _ratio_totals(rows, ok, weight, n_ok, dims, acc)
            sums.append(torch.stack([n_ok] + totals))
            residuals.append(parts)
    var = None
    if design is not None:  # every scale's three variances in one pass, as shifted_reduce
        var = total_variance(torch.stack([r for r, _ in residuals]), design).to(acc) * residuals[0][1]
    return moments, torch.stack(sums), nonfinite, var
