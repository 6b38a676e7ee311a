"""Checking a reconstruction against the model's own computation, on a few query rows.

probe measures an attention call from its record (:class:`~probe.call.AttentionCall`: ``q``,
``k``, scale, bias, mask, causal, softcap), not from what the model computed. These functions
rebuild the probabilities of a few rows from the record, plainly and in float64
(``P = softmax(Z)`` over valid keys, ``Z = σ·q·kᵀ`` soft-capped, plus the bias; a key is invalid
where ``mask`` is False, above the causal diagonal, or where the bias is at or below
:data:`~probe.stats.chunks.MASK_BIAS`), and compare them with the model's own result:

* :func:`probs_distance`: the softmax output the model produced (eager attention), by the L1
  distance ``Σ_j |P_rec − P_model|`` of each checked row (it bounds the error of ``max_prob``
  and, by continuity, of the entropy);
* :func:`output_distance`: the call's output (SDPA, ``nn.MultiheadAttention``, FlexAttention),
  by ``max |P_rec·v − out| / max|v|`` per row (a lower bound of the L1 distance).

Both return ``(distance, tolerance)`` as 0-d float64 tensors on the call's device (no host
synchronization): the tolerance is ``max(1e-4, 4·u·(1 + max|Z|))``, ``u`` the unit roundoff of the
least precise of the tensors involved (a bfloat16 model's own logits carry errors of
``u·|Z|``). Rows whose reconstruction has no valid key are skipped; a row the model made
non-finite where the reconstruction is finite counts as an infinite distance.

:func:`probs_fields` gives the forward fields at ``actual`` from the model's own probabilities,
for a site whose reconstruction did not match.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from probe.call import AttentionCall
from probe.stats.chunks import MASK_BIAS, accumulation_dtype

__all__ = ["TOLERANCE", "check_positions", "check_shape", "masked_in_effect", "output_distance", "probs_distance",
           "probs_fields", "reconstruct"]

#: The smallest tolerance of a check (the promise: measured values within 1e-4 of the model's own).
TOLERANCE = 1e-4


def check_positions(length: int, n: int, device: torch.device) -> Tensor:
    """``min(n, length)`` query positions spread evenly over ``0 .. length-1`` (first and last
    included): deterministic, so a run checks the same rows every time."""
    n = max(1, min(n, length))
    if n == 1:
        return torch.zeros(1, dtype=torch.long, device=device)
    return torch.linspace(0, length - 1, n, device=device).round().long().unique()


def check_shape(call: AttentionCall, rows: int, budget_bytes: int) -> Tuple[int, int]:
    """``(batch entries, rows)`` of a check within ``budget_bytes`` (at least one of each): a few
    float64 buffers of ``(b, H, r, S)`` per row, and per batch entry the float32 copies of its
    k and v that a half-precision or non-contiguous layout needs."""
    batch, heads, length, dim = call.q.shape
    keys = call.k.shape[2]
    dv = call.v.shape[-1] if call.v is not None else 0
    per_row = heads * keys * 8 * 4
    per_entry = call.k.shape[1] * keys * (dim + dv) * 4
    rows = max(1, min(rows, length, budget_bytes // max(1, per_row + per_entry)))
    entries = max(1, min(batch, budget_bytes // max(1, rows * per_row + per_entry)))
    return entries, rows


def _rows_of(t: Tensor, entries: int, pos: Tensor, shape: Tuple[int, int, int, int]) -> Tensor:
    """Batch entries ``0 .. entries-1`` and rows ``pos`` of a tensor broadcastable to (B, H, L, S)."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    if t.dim() > 4:
        t = t.reshape(-1, *t.shape[-3:])
    if t.shape[0] > 1:
        t = t[:entries]
    if t.shape[-2] > 1:
        t = t.index_select(-2, pos)
    return t.expand(shape)


def reconstruct(call: AttentionCall, entries: int, pos: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(P, valid, zmax)``: the probabilities (float64, ``(entries, H, r, S)``, 0 where invalid)
    of rows ``pos`` of the first ``entries`` batch entries as the record describes them, the
    validity of each entry, and ``max|Z|`` over the valid ones (0-d)."""
    q, k = call.q[:entries].index_select(2, pos), call.k[:entries]
    b, heads, r, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    g = heads // kv_heads
    # float32 products (the model's own are at best float32), float64 from there on
    raw = q.float().reshape(b, kv_heads, g * r, dim) @ k.float().transpose(-1, -2)
    z = raw.reshape(b, heads, r, keys).double()
    scale = call.scale if call.scale is not None else 1.0
    if isinstance(scale, Tensor):
        z = z * scale.detach().to(z.device, torch.float64).reshape(-1).expand(heads).reshape(1, heads, 1, 1)
    else:
        z = z * float(scale)
    if call.softcap is not None:
        z = torch.tanh(z / call.softcap) * call.softcap
    shape = (b, heads, r, keys)
    valid = torch.ones(shape, dtype=torch.bool, device=z.device)
    if call.bias is not None:
        bias = _rows_of(call.bias.detach(), entries, pos, shape).double()
        valid = valid & ~(bias <= MASK_BIAS)  # NaN masks nothing: it makes the logit NaN, as in the model
        z = z + torch.where(valid, bias, 0.0)
    if call.mask is not None:
        valid = valid & _rows_of(call.mask, entries, pos, shape)
    if call.causal:
        valid = valid & (pos.unsqueeze(-1) >= torch.arange(keys, device=z.device))
    z = torch.where(valid, z, -math.inf)
    top = z.amax(-1, keepdim=True)
    e = torch.exp(z - torch.where(top == -math.inf, 0.0, top))
    p = e / e.sum(-1, keepdim=True).clamp(min=1e-300)
    zmax = torch.where(valid, z.abs(), 0.0).amax() if z.numel() else z.new_zeros(())
    return p, valid, zmax


def masked_in_effect(call: AttentionCall, entries: int, pos: Tensor) -> Tensor:
    """How many keys of the checked rows the record counts as valid although their bias lies at
    least 100 below the row's largest valid bias (0-d): a mask of -100 added to a positive bias
    (shifted-window attention: ``rel_bias + mask``) masks those keys in the model, but escapes
    the ``bias <= -100`` rule, so the normalized entropy would count them. Never synchronizes."""
    if call.bias is None:
        return torch.zeros((), dtype=torch.long, device=call.q.device)
    b, heads, keys = min(entries, call.q.shape[0]), call.q.shape[1], call.k.shape[2]
    shape = (b, heads, pos.numel(), keys)
    bias = _rows_of(call.bias.detach(), entries, pos, shape).double()
    valid = ~(bias <= MASK_BIAS)
    if call.mask is not None:
        valid = valid & _rows_of(call.mask, entries, pos, shape)
    top = torch.where(valid, bias, -math.inf).amax(-1, keepdim=True)
    return (valid & (bias <= top + MASK_BIAS)).sum()


def _roundoff(*tensors: Optional[Tensor]) -> float:
    return max(torch.finfo(t.dtype).eps / 2 for t in tensors if t is not None and t.is_floating_point())


def _tolerance(zmax: Tensor, roundoff: float) -> Tensor:
    return torch.clamp(4 * roundoff * (1 + zmax.nan_to_num(0.0, posinf=0.0)), min=TOLERANCE)


def _worst(valid: Tensor, dist: Tensor, rec: Tensor, model: Tensor) -> Tensor:
    """The largest per-row distance over rows with a valid key and a finite reconstruction (a
    kernel may return NaN or zeros for NaN inputs: both are the model's own business); a row
    the model made non-finite where the reconstruction is finite (an overflow in the model's
    precision) is infinitely far."""
    rec_ok, model_ok = torch.isfinite(rec).all(-1), torch.isfinite(model).all(-1)
    dist = torch.where(rec_ok, torch.where(model_ok, dist, math.inf), 0.0)
    rows = valid.any(-1)
    return torch.where(rows, dist, 0.0).amax() if rows.numel() else dist.new_zeros(())


def probs_distance(call: AttentionCall, probs: Tensor, entries: int, pos: Tensor) -> Tuple[Tensor, Tensor]:
    """Max over checked rows of ``Σ_j |P_rec − P_model|``, and its tolerance (module docstring).

    Args:
        call: the record.
        probs: the model's softmax output as ``(B, H, L, S)`` (a view of its own tensor).
        entries, pos: the batch entries ``0 .. entries-1`` and query positions to check.
    """
    p, valid, zmax = reconstruct(call, entries, pos)
    model = probs[:entries].index_select(2, pos).double()
    dist = _worst(valid, (p - model).abs().sum(-1), p, model)
    return dist, _tolerance(zmax, _roundoff(call.q, call.k, probs))


def output_distance(call: AttentionCall, output: Tensor, entries: int, pos: Tensor,
                    rows_only: bool = False) -> Tuple[Tensor, Tensor]:
    """Max over checked rows of ``max_c |(P_rec·v)_c − out_c| / max|v|``, and its tolerance.

    Args:
        call: the record (with ``v``).
        output: the call's own output as ``(B, H, L, dv)``; with ``rows_only`` the checked rows
            only, ``(entries, H, len(pos), dv)`` (computed by the model's own function).
        entries, pos: the batch entries ``0 .. entries-1`` and query positions to check.
    """
    assert call.v is not None
    p, valid, zmax = reconstruct(call, entries, pos)
    v = call.v[:entries].float()  # no copy of a float32 v; float32 products are far inside the tolerance
    b, heads, r, keys = p.shape
    kv_heads = v.shape[1]
    got = (p.float().reshape(b, kv_heads, (heads // kv_heads) * r, keys) @ v).reshape(b, heads, r, -1).double()
    model = output if rows_only else output[:entries].index_select(2, pos)
    vmax = v.abs().amax((-2, -1)).repeat_interleave(heads // kv_heads, dim=1).reshape(b, heads, 1)
    model = model.double()
    dist = _worst(valid, (got - model).abs().amax(-1) / vmax.clamp(min=1e-30), got, model)
    return dist, _tolerance(zmax, _roundoff(call.q, call.k, call.v, output))


def probs_fields(probs: Tensor, saturation: float, budget_bytes: int) -> Dict[str, Tensor]:
    """Forward fields at ``actual`` from the model's own probabilities ``(B, H, L, S)``.

    Valid keys are those with a probability above 1e-30 (about e^-69: an exact zero, or the
    e^-100 weight of a -100 mask, is a masked key); a row counts when it has at least two and
    finite probabilities. Gives ``entropy@actual`` (the
    entropy normalized by the log of the valid count, as everywhere), ``max_prob@actual``,
    ``saturated@actual`` and ``rows``: sums over rows per head. Nothing logit-based (the logits
    are not known) and no counterfactual scale.
    """
    batch, heads, length, keys = probs.shape
    acc = accumulation_dtype(probs.device)
    step = max(1, min(length, budget_bytes // max(1, batch * heads * keys * 4 * 4)))
    sums = torch.zeros(4, heads, dtype=acc, device=probs.device)
    for r0 in range(0, length, step):
        p = probs[:, :, r0:r0 + step].float()
        valid = p > 1e-30
        n = valid.sum(-1)
        ok = (n >= 2) & torch.isfinite(p).all(-1)
        plogp = torch.where(valid, p * torch.log(torch.where(valid, p, 1.0)), 0.0).sum(-1)
        entropy = (-plogp).clamp(min=0) / torch.log(n.clamp(min=2).float())
        top = p.amax(-1)
        zero = torch.zeros((), device=p.device)
        sums += torch.stack([
            ok.sum((0, 2)).float(),
            torch.where(ok, entropy, zero).sum((0, 2)),
            torch.where(ok, top, zero).sum((0, 2)),
            (ok & (top >= saturation)).sum((0, 2)).float(),
        ]).to(acc)
    return {"rows": sums[0], "entropy@actual": sums[1], "max_prob@actual": sums[2], "saturated@actual": sums[3]}
