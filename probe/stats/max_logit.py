"""The max-logit-only path: per head, the largest logit ``max σ·q·kᵀ`` of one call, and nothing else.

QK-Clip (:mod:`probe.experiment.qk_clip`) needs every optimizer step's max logit per head, not
the full statistics of a sampled step. This path is their physical floor: one ``q·kᵀ`` per chunk
of query rows (in float32, grouped-query attention without repeating k), the invalid entries
set to ``-inf`` in place, one ``amax`` per chunk; no exponential, no moment, no row sum.

The value is :mod:`probe.stats.forward`'s ``logit_max`` at the call's own scale: the max of
``σR`` over the valid entries (``mask`` False, ``causal`` above the top-left diagonal and a
``bias`` at or below :data:`~probe.stats.chunks.MASK_BIAS` are invalid), *before* any soft cap
and without the bias (QK-Clip caps ``σ·q·kᵀ``, the part the q and k weights produce). A NaN
among the valid entries makes its head's value NaN; a head without any valid entry is ``-inf``.

Pitfall: for a negative or per-head scale the max of ``σR`` is ``σ·min R`` where ``σ < 0``, so
such calls take a second reduction (``min R``); positive float scales (every model probe knows)
need only the max.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from probe.call import AttentionCall
from probe.stats.chunks import cache_chunk_rows, chunk_rows, row_chunks
from probe.stats.masks import simplify

__all__ = ["max_logit"]


@torch.no_grad()
def max_logit(call: AttentionCall, budget_bytes: int = 64 * 2**20, scale: Optional[object] = None) -> Tensor:
    """Per head, the max over valid entries of ``σ·q·kᵀ`` (float32, shape ``(H,)``).

    Args:
        call: the attention computation (its ``scale`` is used unless ``scale`` is given).
        budget_bytes: extra memory one chunk's logit buffer may use.
        scale: a float or a per-head 1-D tensor overriding ``call.scale``.

    Returns:
        ``(H,)`` float32 on the call's device: ``-inf`` for a head with no valid entry, NaN for a
        head with a NaN among its valid entries. No host synchronization.

    Raises:
        ValueError: when the call has no scale (an eager call whose scale probe could not recover).
    """
    sigma = call.scale if scale is None else scale
    if sigma is None:
        raise ValueError("the call's scale is unknown: its max logit is not a multiple of q·kᵀ")
    batch, heads, length, _ = call.q.shape
    keys = call.k.shape[2]
    device = call.q.device
    top = torch.full((heads,), float("-inf"), device=device)
    if batch * heads * length * keys == 0:
        return top
    call = simplify(call, budget_bytes)  # a float mask as a boolean one, HF's causal + padding mask as causal
    need_min = isinstance(sigma, Tensor) or float(sigma) < 0  # type: ignore[arg-type]
    bottom = torch.full((heads,), float("inf"), device=device) if need_min else None
    # one float32 buffer per chunk (no other live buffer), kept near the cache size
    step = min(chunk_rows(batch, heads, keys, budget_bytes * 6), cache_chunk_rows(batch, heads, keys), length)
    trim = call.causal and device.type != "meta"
    last = [min(length, r0 + step) - 1 for r0 in range(0, length, step)] if trim else None
    # causal and nothing else: keys before a chunk's first row are valid for all its rows, so
    # only the chunk's diagonal block is masked (not a pass over the whole chunk)
    block = call.causal and call.mask is None and bottom is None and last is not None
    for index, (R, valid, _) in enumerate(row_chunks(call, step, reuse=True, last=last, causal_mask=not block)):
        if block:
            r0 = index * step
            diagonal = R[..., r0:]
            rows = torch.arange(r0, r0 + R.shape[2], device=device).unsqueeze(-1)
            diagonal.masked_fill_(rows < torch.arange(r0, R.shape[3], device=device), float("-inf"))
            top = torch.maximum(top, diagonal.amax(dim=(0, 2, 3)))
            if r0 > 0:
                top = torch.maximum(top, R[..., :r0].amax(dim=(0, 2, 3)))
            continue
        if bottom is not None:
            low = R if valid is None else torch.where(valid, R, float("inf"))
            bottom = torch.minimum(bottom, low.amin(dim=(0, 2, 3)))
        if valid is not None:
            R.masked_fill_(~valid, float("-inf"))  # R is the chunk's own buffer
        top = torch.maximum(top, R.amax(dim=(0, 2, 3)))  # NaN propagates
    if not need_min:  # σ ≥ 0: σ·max R (a head without valid entry stays -inf, also for σ = 0)
        return torch.where(top == float("-inf"), top, top * float(sigma))  # type: ignore[arg-type]
    s = sigma.detach().to(device=device, dtype=torch.float32).reshape(-1).expand(heads) if isinstance(sigma, Tensor) \
        else torch.full((heads,), float(sigma), device=device)  # type: ignore[arg-type]
    assert bottom is not None
    return torch.where(s >= 0, s * top, s * bottom)
