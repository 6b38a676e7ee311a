"""Forward metrics straight from a softmax input, for eager attention whose scale is unknown.

When the eager front end sees a softmax over ``q·kᵀ`` but cannot describe every op between the
product and the softmax (a ``- max`` for stability, a constant shift, a finite fill value...), it
passes the softmax input ``Z`` itself (:attr:`probe.call.AttentionCall.logits`). Without the scale
there are no counterfactual scales: everything is reported at ``actual`` only, from ``Z``:

* ``logit_var`` / ``logit_max``: variance and max of ``Z`` over valid entries. Pitfall: unlike the
  other paths this includes any additive bias the model folded in (``Z``, not ``σR``);
* ``entropy``, ``max_prob``, ``saturation`` of ``softmax(Z)`` over valid keys, as usual;
* valid entries: those above half the dtype's most negative finite value (so ``-inf`` and
  Hugging Face's ``finfo.min`` masks are excluded); ``nonfinite`` counts NaN / +inf logits.

Query rows are processed in chunks within ``budget_bytes``; no host synchronization.
"""

from __future__ import annotations

import math
from typing import Dict

import torch
from torch import Tensor

from probe.stats.functional import accumulation_dtype, chunk_rows, combine_moments, logit_moments, softmax_stats

__all__ = ["logits_stats"]


def logits_stats(logits: Tensor, saturation: float = 0.99, budget_bytes: int = 64 * 2**20) -> Dict[str, Tensor]:
    """Accumulator fields at scale ``actual`` from softmax inputs ``Z`` of shape ``(B, H, L, S)``.

    Args:
        logits: the softmax input, any float dtype (computed in float32).
        saturation: τ, a row is saturated when its max probability is at least τ.
        budget_bytes: extra memory allowed for one chunk's buffers.

    Returns:
        ``logit@actual`` (count/mean/M2), ``logit_max@actual``, ``entropy@actual``,
        ``max_prob@actual``, ``saturated@actual``, ``rows`` and ``nonfinite``, one value per head;
        empty when there are no query rows.
    """
    batch, heads, length, keys = logits.shape
    if logits.numel() == 0:
        return {}  # nothing to measure
    acc = accumulation_dtype(logits.device)
    floor = torch.finfo(logits.dtype).min / 2
    step = min(chunk_rows(batch, heads, keys, budget_bytes), length)
    moments = soft = None
    nonfinite = torch.zeros(heads, dtype=acc, device=logits.device)
    for r0 in range(0, length, step):
        z = logits[:, :, r0 : r0 + step].float()
        valid = z > floor  # excludes -inf, finfo.min masks and NaN
        part = logit_moments(torch.where(valid, z, 0.0), valid).to(acc)
        if moments is None:
            moments = part
        else:
            mv = combine_moments(moments[:3], part[:3])
            moments = torch.cat([mv, torch.maximum(moments[3:4], part[3:4]), torch.minimum(moments[4:5], part[4:5])])
        finite = valid & (z < math.inf)
        sums, _ = softmax_stats(torch.where(finite, z, 0.0), finite, None, 1.0, None, saturation)
        soft = sums.to(acc) if soft is None else soft + sums.to(acc)
        nonfinite = nonfinite + (torch.isnan(z) | (z == math.inf)).sum((0, 2, 3)).to(acc)
    if moments is None or soft is None:
        return {}
    n, mean, m2, zmax, _ = moments
    return {
        "nonfinite": nonfinite,
        "logit@actual": torch.stack([n, mean, m2]),
        "logit_max@actual": zmax,
        "entropy@actual": soft[1],
        "max_prob@actual": soft[2],
        "saturated@actual": soft[3],
        "rows": soft[0],
    }

