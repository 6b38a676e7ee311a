"""Pure, on-device reductions of an :class:`~probe.call.AttentionCall` into per-head sums.

Everything here is a function of tensors: no state, no host synchronization (no ``.item()``,
no data-dependent shapes), so it runs unchanged on ``meta`` tensors. Running state and its
combination across calls, steps and ranks live in :mod:`probe.state.accumulator`.

Notation (DESIGN.md): ``R = q @ k.T`` (raw dot products), ``A`` the additive bias with masked
entries removed, ``σ`` a scale, ``Z = σR + A`` (``c·tanh(σR/c) + A`` with softcap ``c``),
``P = softmax(Z)`` over valid keys.

Cost model (docs/performance.md): per chunk of query rows, one ``q·kᵀ`` serves every scale.
Without bias or softcap and with positive float scales (SDPA defaults, BERT, Llama, GPT) the
*shifted* path runs: ``D = R − rowmax(R)`` is formed once in place, the logit moments come from
per-row sums of ``D``, and each distinct scale costs one ``exp(σD)`` with two row reductions
(``σ·rowmax`` is the row max of ``σR`` for ``σ > 0``, so no second max pass). Other calls take
the general path (:mod:`probe.stats.general`): the same exact pass over every row, and per scale
``Z = σR + A`` (soft-capped) and one exponential on the sampled rows only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from probe.call import AttentionCall, Scale
from probe.stats.chunks import (
    MASK_BIAS,
    _as_4d,
    _iter,
    accumulation_dtype,
    cache_chunk_rows,
    chunk_rows,
    iter_chunks,
    minmax,
    sample_rows,
)
from probe.stats.general import (
    combine_moments,
    general_reduce,
    general_rows,
    logit_moments,
    release,
    softmax_stats,
    take_scratch,
)
from probe.stats.masks import simplify
from probe.stats.sampling import row_design
from probe.stats.key_blocks import blocked_keys, centred_stats_blocked
from probe.stats.moments import absmax, centred_stats, inputs_finite, key_validity, row_moments
from probe.stats.shifted import causal_upper, grad_logits_shifted, shifted_reduce, shifted_rows

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


def _scaled_moments(moments: Tensor, scale: Scale, heads: int) -> Tuple[Tensor, Tensor]:
    """(count, mean, M2) and max of ``σR`` from the moments of ``R`` (scale-linear); the min of
    ``R`` (a fifth row) is needed only for negative scales, which the shifted path never has."""
    n, mean, m2, rmax = moments[:4]
    rmin = moments[4] if moments.shape[0] > 4 else None
    if isinstance(scale, Tensor):
        s = scale.to(device=moments.device, dtype=moments.dtype).reshape(-1).expand(heads)
        assert rmin is not None  # tensor scales take the general path
        top = torch.where(s >= 0, s * rmax, s * rmin)
    else:
        s = float(scale)
        assert s >= 0 or rmin is not None  # negative scales take the general path
        top = s * rmax if s >= 0 else s * rmin
    return torch.stack([n, s * mean, s * s * m2]), top


def shiftable(call: AttentionCall, values: Sequence[Scale]) -> bool:
    """Whether the shifted path applies: no bias, no softcap, finite positive float scales."""
    return call.bias is None and call.softcap is None and all(
        not isinstance(v, Tensor) and 0.0 < float(v) < 1e30 for v in values
    )


@torch.no_grad()  # statistics never need autograd (and out= products refuse tensors that require grad)
def forward_stats(
    call: AttentionCall,
    scales: Mapping[str, Scale],
    saturation: float = 0.99,
    budget_bytes: int = 64 * 2**20,
    *,
    rows: Union[None, int, Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> Dict[str, Tensor]:
    """All forward metrics of one call, as accumulator fields (see :mod:`probe.state.accumulator`).

    One ``q @ k.T`` per chunk of query rows serves every scale; ``logit_var`` and ``logit_max``
    are derived from the moments of ``R``; scales with the same value share one softmax pass.

    Args:
        call: the attention computation.
        scales: scale name → value (``"actual"`` must be present; it also gives ``nonfinite``).
        saturation: τ, a row is saturated when its max probability is at least τ.
        budget_bytes: extra memory allowed for one chunk's buffers.
        rows: a budget of query rows for the exponential metrics. ``None`` (or ``N >= L``):
            every row, all statistics exact. An int ``N < L`` draws ``N`` distinct positions
            by the stratified design (:func:`sample_rows`, with ``generator``); a 1-D tensor gives the
            sorted positions (drawn by that design). Only ``entropy``, ``max_prob`` and
            ``saturated`` are then computed on those rows, as totals estimated by the ratio of
            their Horvitz–Thompson sums (weights ``L_h/n_h``) to that of the valid rows, times the
            exact valid-row count ``rows`` (:func:`~probe.stats.shifted.shifted_reduce`), with
            ``{field}_var@{s}`` fields holding each total's estimated variance; ``logit_var``,
            ``logit_max``, the row count and ``nonfinite`` stay exact, on the shifted and on the
            general path (bias, softcap, per-head or non-positive scale) alike.
        generator: the CPU generator for ``rows=N`` (``None``: torch's global generator).

    Returns:
        Field name → per-head tensor: ``logit@{s}`` (count/mean/M2 stack), ``logit_max@{s}``,
        ``rows``, ``entropy@{s}``, ``max_prob@{s}``, ``saturated@{s}`` and ``nonfinite``; with
        sampled rows also ``entropy_var@{s}``, ``max_prob_var@{s}``, ``saturated_var@{s}``.
    """
    batch, heads, length, _ = call.q.shape
    keys = call.k.shape[2]
    if batch * heads * length * keys == 0:
        return {}  # batch 0, no heads, no queries or no keys: nothing to measure
    call = simplify(call, budget_bytes)  # a float mask as a boolean one, HF's causal + padding mask as causal
    acc = accumulation_dtype(call.q.device)
    groups: Dict[object, List[str]] = {}
    for name, value in scales.items():
        key = id(value) if isinstance(value, Tensor) else float(value)
        groups.setdefault(key, []).append(name)
    # the group holding `actual` goes first: it also gives `nonfinite`
    order = sorted(groups.values(), key=lambda names: "actual" not in names)
    values = [scales[names[0]] for names in order]
    # Within the budget, also keep a chunk near the cache size (never below 16 rows), and never
    # above the rows there are: buffers (the causal block mask is step × step) are sized from it.
    step = min(chunk_rows(batch, heads, keys, budget_bytes), cache_chunk_rows(batch, heads, keys), length)

    if shiftable(call, values):
        floats = [float(v) for v in values]
        positions = _sampled_positions(rows, length, generator)
        supported, valid, causal = key_validity(call) if inputs_finite(call) else (False, None, False)
        if supported:  # the centred path (its mask: `valid` and `causal`)
            centred = dataclasses.replace(call, causal=causal)
            moments, soft, nonfinite, var = _centred_stats(centred, floats, saturation, step, acc, positions, valid,
                                                           budget_bytes)
        else:
            moments, soft, nonfinite, var = _shifted_stats(call, floats, saturation, step, acc, positions)
    else:
        positions = _sampled_positions(rows, length, generator)
        moments, soft, nonfinite, var = _general_stats(call, values, saturation, step, acc, positions)

    out: Dict[str, Tensor] = {"nonfinite": nonfinite}
    for i, names in enumerate(order):
        sums = soft[i]
        for name in names:
            out[f"logit@{name}"], out[f"logit_max@{name}"] = _scaled_moments(moments, scales[name], heads)
            out[f"entropy@{name}"] = sums[1]
            out[f"max_prob@{name}"] = sums[2]
            out[f"saturated@{name}"] = sums[3]
            if var is not None:
                out[f"entropy_var@{name}"] = var[i, 0]
                out[f"max_prob_var@{name}"] = var[i, 1]
                out[f"saturated_var@{name}"] = var[i, 2]
    out["rows"] = soft[0, 0]
    return out


def _sampled_positions(rows: Union[None, int, Tensor], length: int,
                       generator: Optional[torch.Generator]) -> Optional[Tensor]:
    """Sorted CPU positions of the rows whose exponential metrics are computed (None: all)."""
    if isinstance(rows, Tensor):
        positions = rows.cpu()  # given by the caller; on the host to split it into chunks
        return None if positions.shape[0] >= length else positions
    if rows is None or rows >= length:
        return None
    return sample_rows(length, rows, generator)


def _picks(positions: Optional[Tensor], starts: range, step: int, device: torch.device) -> List[Optional[Tensor]]:
    """The local indices of the sampled rows in each chunk (all ``None``: every row)."""
    if positions is None:
        return [None] * len(starts)
    chunk_of = positions // step
    return [(positions[chunk_of == c] - r0).to(device, non_blocking=True) for c, r0 in enumerate(starts)]


def _chunk_plan(call: AttentionCall, step: int, positions: Optional[Tensor]
                ) -> Tuple[Optional[List[int]], List[Optional[Tensor]]]:
    """For chunks of ``step`` query rows: the last query position of each (causal calls, on the
    host; ``None``: do not trim, also on meta tensors) and each chunk's sampled local rows."""
    length, device = call.q.shape[2], call.q.device
    starts = range(0, length, step)
    last = [min(length, r0 + step) - 1 for r0 in starts] if call.causal and device.type != "meta" else None
    return last, _picks(positions, starts, step, device)


def _centred_stats(call: AttentionCall, floats: List[float], saturation: float, step: int,
                   acc: torch.dtype, positions: Optional[Tensor], valid: Optional[Tensor], budget_bytes: int
                   ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """The shifted path for inputs proven finite with no mask, key padding, causal or both
    (:mod:`probe.stats.moments`): per chunk one product with rows centred on their exact mean,
    ``‖C‖²`` and ``amax``; exponentials on ``positions`` only (all when None). Long calls,
    whose centred k and chunk buffers would outgrow a quarter of the budget, run over blocks
    of keys instead (:func:`~probe.stats.key_blocks.centred_stats_blocked`)."""
    length = call.q.shape[2]
    if blocked_keys(call, valid, step, None if positions is None else positions.shape[0], budget_bytes):
        exact, soft_rows = centred_stats_blocked(call, valid, floats, positions, budget_bytes)
    else:
        starts = range(0, length, step)
        exact, soft_rows = centred_stats(call, valid, floats, step, _picks(positions, starts, step, call.q.device))
    moments, soft, nonfinite, var = shifted_reduce(exact, soft_rows, floats, saturation, acc,
                                                   None if positions is None else length)
    # count, mean and M2 from the rows' means and M2 (shifted_reduce's assume ΣD, ΣD²)
    exact_moments = row_moments(exact[0], exact[2], exact[3], acc)
    return torch.cat([exact_moments, moments[3:]]), soft, nonfinite, var


def _shifted_stats(call: AttentionCall, floats: List[float], saturation: float, step: int,
                   acc: torch.dtype, positions: Optional[Tensor]
                   ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """The shifted path over every row; exponentials on ``positions`` only (all when None)."""
    batch, heads, length, _ = call.q.shape
    keys = call.k.shape[2]
    device = call.q.device
    last, picks = _chunk_plan(call, step, positions)
    # a causal call without other masks: mask only each chunk's diagonal block, with one mask
    block = call.causal and call.mask is None
    upper = causal_upper(step, device) if block else None
    work = torch.empty(2 * batch * heads * step * keys, device=device)  # the widest chunk
    exact_parts: List[Tensor] = []
    soft_parts: List[Tensor] = []
    chunks = _iter(call, step, None, reuse=True, last=last, causal_mask=not block)
    for index, (R, valid, _) in enumerate(chunks):
        causal = None if upper is None else (index * step, upper)
        exact, soft = shifted_rows(R, valid, floats, work, causal, picks[index])
        # one (K, B, H, l) tensor per chunk: thousands of small tensors cost heap at long L
        exact_parts.append(torch.stack(exact))
        soft_parts.append(torch.stack(soft))
    exact_all = torch.cat(exact_parts, dim=-1) if len(exact_parts) > 1 else exact_parts[0]
    soft_all = torch.cat(soft_parts, dim=-1) if len(soft_parts) > 1 else soft_parts[0]
    return shifted_reduce(list(exact_all.unbind(0)), list(soft_all.unbind(0)), floats, saturation, acc,
                          None if positions is None else length, positions)


def _proven_finite(call: AttentionCall, values: Sequence[Scale]) -> Tuple[bool, bool]:
    """``(proven, bias_masks)``: whether every logit ``Z = σR + A`` (``c·tanh(σR/c) + A``) of the
    call is certainly finite at every scale, from ``|R| ≤ max|q|·max|k|·d``, ``|σ|`` and the bias's
    max (valid bias entries are above -100): then no non-finite count and no non-finite softmax
    row can occur; and whether the bias may mask a key (its min is at or below
    :data:`~probe.stats.chunks.MASK_BIAS`, or unknown). On CPUs only, where reading the bounds costs
    no synchronization (``O(L·d)`` and one pass over the bias); elsewhere ``(False, True)`` and the
    general path counts and masks (no host synchronization)."""
    q, k, bias = call.q, call.k, call.bias
    if q.device.type != "cpu" or k.device.type != "cpu" or (bias is not None and bias.device.type != "cpu"):
        return False, True
    raw = absmax(q) * absmax(k) * q.shape[-1]  # no |q|, |k| copies
    sigma = 0.0
    for v in values:
        s = float(v.abs().amax()) if isinstance(v, Tensor) else abs(float(v))
        if not s <= 2.0**100:  # NaN or huge (max() would drop a NaN)
            return False, True
        sigma = max(sigma, s)
    bound = raw * sigma  # |σR|, finite under tanh too
    top = abs(float(call.softcap)) if call.softcap is not None else bound
    masks = True
    if bias is not None:
        low, high = (float(x) for x in minmax(bias))
        if not high <= 2.0**100:  # NaN (max() would drop it) or huge
            return False, True
        masks = not low > MASK_BIAS
        top += max(-MASK_BIAS, high)
    return raw <= 2.0**100 and bound <= 2.0**100 and top <= 2.0**100, masks  # False for NaN


def _general_stats(call: AttentionCall, values: Sequence[Scale], saturation: float, step: int,
                   acc: torch.dtype, positions: Optional[Tensor]
                   ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """The general path (bias, softcap, per-head or non-positive scales): the exact statistics
    over every row, the exponential ones on ``positions`` only (all when None), as the shifted
    path: causal chunks stop at their last query, one product buffer and two scratch buffers
    serve every chunk (:func:`probe.stats.general.general_rows`)."""
    batch, heads, length, _ = call.q.shape
    keys = call.k.shape[2]
    device = call.q.device
    last, picks = _chunk_plan(call, step, positions)
    need_min = any(isinstance(v, Tensor) or float(v) < 0 for v in values)
    proven, bias_masks = _proven_finite(call, values)
    buffers = take_scratch(batch * heads * step * keys, device)  # the widest chunk
    # the bias is read per chunk here, raw (general_rows masks with it): not through _iter
    plain = dataclasses.replace(call, bias=None)
    bias = None if call.bias is None else _as_4d(call.bias)
    exact_parts: List[Tensor] = []
    soft_parts: List[Tensor] = []
    for index, (R, valid, _) in enumerate(_iter(plain, step, None, reuse=True, last=last)):
        r0, cols = index * step, R.shape[-1]
        b = None
        if bias is not None:
            b = bias if bias.shape[-2] == 1 else bias[..., r0 : r0 + R.shape[2], :]
            b = b[..., :cols] if b.shape[-1] > cols else b
        exact, soft = general_rows(R, valid, b, values, call.softcap, buffers, picks[index], need_min, proven,
                                   bias_masks)
        exact_parts.append(torch.stack(exact))
        soft_parts.append(torch.stack(soft))
    release(buffers)
    exact_all = torch.cat(exact_parts, dim=-1) if len(exact_parts) > 1 else exact_parts[0]
    soft_all = torch.cat(soft_parts, dim=-1) if len(soft_parts) > 1 else soft_parts[0]
    design = None if positions is None else row_design(positions, length)
    return general_reduce(exact_all, soft_all, len(values), saturation, acc, design)
