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

from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from probe.call import AttentionCall, Scale
from probe.stats.chunks import (
    _chunk_mask,
    _iter,
    accumulation_dtype,
    cache_chunk_rows,
    chunk_rows,
    iter_chunks,
    sample_rows,
)
from probe.stats.general import combine_moments, general_chunk, logit_moments, softmax_stats
from probe.stats.shifted import grad_logits_shifted, shifted_reduce, shifted_rows

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
            row_parts.append(torch.stack(shifted_rows(R, valid, floats, work, causal)))
            continue
        part, sums, bad = general_chunk(R, valid, bias, values, call.softcap, saturation, acc)
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
        moments, soft, nonfinite = shifted_reduce(list(rows_all.unbind(0)), floats, saturation, acc)
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
