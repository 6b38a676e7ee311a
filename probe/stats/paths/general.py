"""The general path: any bias, mask, softcap or scale, forward and backward.

Used for calls the shifted paths cannot take: an additive float bias, soft-capping, a per-head
scale tensor or a non-positive scale (:func:`probe.stats.plan.shiftable`).

Per chunk of query rows (:func:`chunk_rows`), as the shifted path: the exact pass over every
row (``R`` masked in place, its row max ``r``, ``D = R − r``, ``ΣD``, ``ΣD²``, the non-finite
count; :func:`probe.stats.rows.exact_pass`), the row min for negative or per-head scales, and
the softmax of ``Z = σR + A`` (``c·tanh(σR/c) + A``) per scale on the sampled rows only (all rows
without sampling), in reused buffers, with ``exp2`` when the call's logits are proven finite.
The backward (:func:`grad_rows`) forms the same ``Z`` per chunk of the sampled rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from probe.call import AttentionCall, Scale
from probe.stats.buffers import Scratch
from probe.stats.chunks import MASK_BIAS, DPSource, all_finite, as_4d, row_chunks
from probe.stats.plan import CallPlan, backward_step, chunk_picks
from probe.stats.rows import LOG2E, Rows, exact_pass, grad_sq, moment_rows, scale_view

__all__ = ["chunk_masks", "chunk_rows", "forward_rows", "grad_chunk", "grad_rows"]


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


def _rows_of(t: Optional[Tensor], pick: Optional[Tensor]) -> Optional[Tensor]:
    """Rows ``pick`` of a ``(..., l, S)`` tensor that may broadcast over rows (a causal mask is ``(l, S)``)."""
    if t is None or pick is None or t.shape[-2] == 1:
        return t
    return t.index_select(-2, pick)


def _row_counts(valid: Optional[Tensor], neg: Optional[Tensor], shape: Tuple[int, int, int], keys: int,
                scratch: Scratch) -> Tensor:
    """Valid keys per row, ``(B, H, l)`` float32: ``keys`` minus the masked ones, counted from the
    float mask (a float sum; a bool sum is ten times slower on CPUs)."""
    if valid is None or neg is None:
        return torch.full(shape, float(keys), device=scratch.device)
    masked = torch.clamp(neg, min=-1.0, out=scratch.get("z", neg.shape)).sum(-1)  # −(masked keys)
    return masked.add_(keys).expand(shape)


def _logits(X: Tensor, scale: Scale, softcap: Optional[float], unit: float, out: Tensor) -> Tensor:
    """``σX·unit`` or ``c·tanh(σX/c)·unit`` into ``out``."""
    heads = X.shape[1]
    if softcap is None:
        return torch.mul(X, scale_view(scale, heads, X, unit), out=out)
    return torch.mul(X, scale_view(scale, heads, X, 1.0 / softcap), out=out).tanh_().mul_(softcap * unit)


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
    ``−inf`` logit gives a NaN entropy, as the plain formula (:mod:`probe.stats.reference`).

    Returns ``[lse_1, H_1, maxP_1, lse_2, ...]``: per row, the natural log-sum-exp of ``Z``
    (non-finite where the row's softmax is), the normalized entropy and the max probability,
    both 0 on rows with fewer than two valid keys.
    """
    z, e = scratch.get("z", X.shape), scratch.get("e", X.shape)
    # base 2 when proven (|Z| ≤ 2¹⁰⁰: Z·log2(e) cannot overflow); otherwise natural units, so that
    # a row's log-sum-exp is non-finite exactly where the model's is (the nonfinite count)
    unit, log, expo = (LOG2E, torch.log2, torch.exp2) if proven else (1.0, torch.log, torch.exp)
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
        _logits(X, sigma, softcap, unit, z)
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
    z = _logits(R, scale, None, 1.0, scratch.get("z", R.shape))
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    if bias is not None:
        z.add_(bias)
    if valid is not None:
        torch.where(valid, z, _full(-math.inf, z), out=z)
    top = z.amax(-1)
    return torch.isnan(top) | (top == math.inf)


def chunk_rows(R: Tensor, valid: Optional[Tensor], bias: Optional[Tensor], scales: Sequence[Scale],
               softcap: Optional[float], scratch: Scratch, pick: Optional[Tensor], need_min: bool,
               proven: bool, bias_masks: bool = True) -> Tuple[List[Tensor], List[Tensor]]:
    """Per-row sums of one chunk, each ``(B, H, l)`` float32.

    ``valid``: the call's mask and causal masking for the chunk (``None``: every key), ``bias`` its
    raw bias rows (an entry at or below :data:`~probe.stats.chunks.MASK_BIAS` masks its key;
    ``bias_masks`` False: none does, proven by the caller).

    Returns ``(exact, soft)``: ``exact = [n, r, ΣD, ΣD², #non-finite, (r_min)]`` for every row,
    ``n`` its valid keys, ``r`` the max of ``R`` over them (0 when none), ``D = R − r``,
    ``#non-finite`` the NaN/±inf among its valid logits plus ``n`` where the row's softmax at
    ``scales[0]`` (``actual``) is non-finite, ``r_min`` the min of ``R`` (``need_min``; ``+inf``
    when no key is valid); ``soft = [n, H_1, maxP_1, H_2, ...]`` on the rows ``pick`` (local
    indices) or every row when ``None``.

    ``proven``: the call's logits ``Z`` are finite at every scale
    (:func:`probe.stats.plan.proven_finite`, CPUs): no non-finite count, no non-finite
    softmax row, masks added. Otherwise a chunk whose sum is finite
    (:func:`~probe.stats.chunks.all_finite`) still skips the count and is masked by addition;
    the non-finite softmax rows of unsampled rows come from a row max of ``Z`` at ``actual``
    (no exponential).

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
        bad_n = None
    elif pick is None:
        lse = soft[0]
        bad_n = torch.where(torch.isnan(lse) | (lse == math.inf), n_row, 0.0)
    else:
        bad_n = torch.where(_top_bad(R, valid, bias, scales[0], softcap, scratch), n_row, 0.0)
    if neg is not None:  # the exact part, in place
        if finite:
            R.add_(neg)
        else:
            torch.where(valid, R, _full(-math.inf, R), out=R)  # type: ignore[arg-type]
    _, D0, (r, sum_d, sum_d2, bad) = exact_pass(R, valid is not None, finite, n_row, scratch.get("z", R.shape))
    exact = [n_row, r, sum_d, sum_d2, bad if bad_n is None else bad + bad_n]
    if need_min:  # valid D ≤ 0 and masked ones 0 in D0: its row min is the valid min
        exact.append(torch.where(n_row > 0, r + D0.amin(-1), math.inf))
    return exact, [n_s] + [x for i, x in enumerate(soft) if i % 3]


def _bias_rows(bias: Optional[Tensor], r0: int, rows: int, cols: int, picked: Optional[Tensor]) -> Optional[Tensor]:
    """The raw bias of a chunk's rows (``picked``: positions ``r0 .. r0 + rows`` of them) and keys ``:cols``."""
    if bias is None:
        return None
    if bias.shape[-2] != 1:
        bias = bias[..., r0 : r0 + rows, :] if picked is None else bias.index_select(-2, picked[r0 : r0 + rows])
    return bias[..., :cols] if bias.shape[-1] > cols else bias


def forward_rows(call: AttentionCall, plan: CallPlan, scratch: Scratch) -> Rows:
    """Every row's exact statistics and the sampled rows' exponential ones (:class:`Rows`):
    causal chunks stop at their last query, one product buffer and the scratch buffers serve
    every chunk (:func:`chunk_rows`)."""
    batch, heads = call.q.shape[:2]
    values = plan.values
    last, picks = chunk_picks(call, plan)
    need_min = any(isinstance(v, Tensor) or float(v) < 0 for v in values)  # type: ignore[arg-type]
    buffers = scratch
    # the bias is read per chunk here, raw (chunk_rows masks with it): not through row_chunks
    plain = dataclasses.replace(call, bias=None)
    bias = None if call.bias is None else as_4d(call.bias)
    exact_parts: List[Tensor] = []
    soft_parts: List[Tensor] = []
    for index, (R, valid, _) in enumerate(row_chunks(plain, plan.step, None, last=last, scratch=buffers)):
        b = _bias_rows(bias, index * plan.step, R.shape[2], R.shape[-1], None)
        exact, soft = chunk_rows(R, valid, b, values, call.softcap, buffers, picks[index],  # type: ignore[arg-type]
                                 need_min, plan.proven, plan.bias_masks)
        exact_parts.append(torch.stack(exact))
        soft_parts.append(torch.stack(soft))
    exact_all = torch.cat(exact_parts, dim=-1) if len(exact_parts) > 1 else exact_parts[0]
    soft_all = torch.cat(soft_parts, dim=-1) if len(soft_parts) > 1 else soft_parts[0]
    n, r, sum_d, sum_d2, bad = exact_all[:5].unbind(0)
    mean, m2 = moment_rows(n, r, sum_d, sum_d2, plan.acc)
    low = exact_all[5] if need_min else None
    return Rows(n, r, mean, m2, bad, low, soft_all[0], soft_all[1::2], soft_all[2::2])


def grad_chunk(X: Tensor, valid: Optional[Tensor], neg: Optional[Tensor], bias: Optional[Tensor], dP: Tensor,
               scale: Scale, softcap: Optional[float], proven: bool, scratch: Scratch) -> Tensor:
    """Per row ``Σ_j (∂L/∂Z_j)²`` of a chunk, ``(B, H, l)`` float32
    (:func:`probe.stats.reference.grad_logits_chunk`'s quantity before the sum over rows), in
    scratch buffers: ``X`` raw logit rows (not written), ``valid`` / ``neg`` their masks and
    ``bias`` their raw bias rows (:func:`chunk_masks`), ``dP`` their ``∂L/∂P``.

    As the shifted path: ``e = exp(Z − m)``, ``c = Σ e·dP / Σe`` and
    ``Σ_j (P_j (dP_j − c))² = ‖e ⊙ (dP − c)‖² / (Σe)²``, with ``u = e ⊙ dP`` turned into
    ``e ⊙ (dP − c)`` in place; base 2 when ``proven`` (every ``Z`` finite), the mask then added,
    else natural units and the mask selected. A fully masked row has ``Σe = 0`` and contributes
    0; a NaN row stays NaN."""
    z, e = scratch.get("z", X.shape), scratch.get("e", X.shape)
    unit, expo = (LOG2E, torch.exp2) if proven else (1.0, torch.exp)
    _logits(X, scale, softcap, unit, z)
    if bias is not None:
        if proven:
            z.add_(bias, alpha=unit)
        else:  # a NaN or -inf bias under the mask: selected away below
            z.add_(torch.where(valid, bias.float(), 0.0) if valid is not None else bias, alpha=unit)
    if valid is not None:
        if proven:
            z.add_(neg)  # type: ignore[arg-type]
        else:
            torch.where(valid, z, torch.full((), -math.inf, device=z.device), out=z)
    m = z.amax(-1, keepdim=True)
    z.sub_(torch.where(m == -math.inf, 0.0, m))
    expo(z, out=e)
    return grad_sq(e, dP, e.sum(-1, keepdim=True), z)


def grad_rows(call: AttentionCall, plan: CallPlan, dp: DPSource, scratch: Scratch) -> Tensor:
    """Per row ``Σ_j (∂L/∂Z^σ_j)²`` at each distinct scale, ``(G, B, H, N)`` float32, for the rows
    of ``plan.positions`` (``None``: every row): only those rows form their logits and ``dP``, in
    cache-sized chunks that stop at their last query under causal masking, with buffers reused
    across chunks (``scratch``, :mod:`probe.stats.buffers`). The values are multiplied by
    ``dp.gs²``."""
    batch, heads = call.q.shape[:2]
    positions = plan.positions
    total = plan.length if positions is None else positions.shape[0]
    step = backward_step(call, plan)
    picked = None if positions is None else positions.to(call.q.device, non_blocking=True)
    buffers = scratch
    last = None
    if call.causal and call.q.device.type != "meta":  # the last query of each chunk, on the host
        ends = [min(total, r0 + step) - 1 for r0 in range(0, total, step)]
        last = ends if positions is None else [int(positions[i]) for i in ends]
    plain = dataclasses.replace(call, bias=None)  # the raw bias is masked with here
    bias = None if call.bias is None else as_4d(call.bias)
    per_row: List[List[Tensor]] = [[] for _ in plan.values]
    r0 = 0
    for R, valid, _ in row_chunks(plain, step, picked, last=last, scratch=buffers):
        n, cols = R.shape[2], R.shape[3]
        b = _bias_rows(bias, r0, n, cols, picked)
        valid, neg = chunk_masks(valid, b, buffers, plan.bias_masks)
        dP = dp.into(buffers.get("dp", (batch, heads, n, cols)), r0, n, cols, picked)
        for i, sigma in enumerate(plan.values):
            per_row[i].append(grad_chunk(R, valid, neg, b, dP, sigma, call.softcap,  # type: ignore[arg-type]
                                         plan.proven, buffers))
        r0 += n
    return torch.stack([torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0] for parts in per_row])
