"""The unknown-scale path: statistics straight from an eager call's softmax input.

When the eager front end sees a softmax over ``q·kᵀ`` but cannot describe every op between the
product and the softmax (a ``- max`` for stability, a constant shift, a finite fill value...), it
passes the softmax input ``Z`` itself (:attr:`probe.call.AttentionCall.logits`). Without the scale
there are no counterfactual scales: everything is reported at ``actual`` only, from ``Z``, with
the plain formulas (:mod:`probe.stats.reference`):

* ``logit_var`` / ``logit_max``: variance and max of ``Z`` over valid entries. Pitfall: unlike the
  other paths this includes any additive bias the model folded in (``Z``, not ``σR``);
* ``entropy``, ``max_prob``, ``saturation`` of ``softmax(Z)`` over valid keys, as usual, on every
  row (the forward does not sample; the backward does);
* valid entries: those above half the dtype's most negative finite value (so ``-inf`` and
  Hugging Face's ``finfo.min`` masks are excluded) and not masked by a mask the front end saw on
  the way to the softmax (``call.mask``: a ``masked_fill`` or ``where`` of a fill value at or below
  ``MASK_BIAS``, or such an additive term, e.g. a ``-1e9`` causal fill); ``nonfinite`` counts
  NaN / +inf logits.

Query rows are processed in chunks within the budget; no host synchronization.
"""

from __future__ import annotations

import math
from typing import List

import torch
from torch import Tensor

from probe.call import AttentionCall
from probe.stats.buffers import Scratch
from probe.stats.chunks import DPSource, rows_of
from probe.stats.paths.general import grad_chunk
from probe.stats.plan import CallPlan, backward_step
from probe.stats.reference import logit_rows, softmax_rows
from probe.stats.rows import Rows

__all__ = ["forward_rows", "grad_rows"]


def forward_rows(call: AttentionCall, plan: CallPlan, scratch: Scratch) -> Rows:
    """:class:`Rows` of ``softmax(call.logits)`` over every row, at ``actual`` only."""
    logits = call.logits
    assert logits is not None
    batch, heads, length, keys = call.q.shape[0], call.q.shape[1], plan.length, plan.keys
    logits = logits.reshape(batch, heads, length, keys)
    floor = torch.finfo(logits.dtype).min / 2
    parts: List[Tensor] = []
    for r0 in range(0, length, plan.step):
        z = logits[:, :, r0 : r0 + plan.step].float()
        valid = z > floor  # excludes -inf, finfo.min masks and NaN
        seen = rows_of(call.mask, r0, r0 + z.shape[2])
        if seen is not None:  # keys masked by a finite fill on the way (module docstring)
            valid = valid & seen
        n, mean, m2, top = logit_rows(z, valid)
        finite = valid & (z < math.inf)
        n_s, entropy, max_prob, _ = softmax_rows(torch.where(finite, z, 0.0), finite)
        bad = (torch.isnan(z) | (z == math.inf)).sum(-1, dtype=torch.float32)
        parts.append(torch.stack([n, torch.where(n > 0, top, 0.0), mean, m2, bad, n_s, entropy, max_prob]))
    rows = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    n, top, mean, m2, bad, n_s, entropy, max_prob = rows.unbind(0)
    return Rows(n, top, mean.to(plan.acc), m2.to(plan.acc), bad, None, n_s, entropy[None], max_prob[None])


def grad_rows(call: AttentionCall, plan: CallPlan, dp: DPSource, scratch: Scratch) -> Tensor:
    """Per row ``Σ_j (∂L/∂Z_j)²`` with ``P = softmax(call.logits)`` (masked entries are ``−inf``
    or ``finfo.min`` there: ``exp`` gives 0), ``(1, B, H, N)`` for the rows of ``plan.positions``
    (``None``: every row), multiplied by ``dp.gs²``."""
    assert call.logits is not None
    batch, heads = call.q.shape[:2]
    logits = call.logits.reshape(batch, heads, plan.length, plan.keys)
    positions = plan.positions
    total = plan.length if positions is None else positions.shape[0]
    step = backward_step(call, plan)
    picked = None if positions is None else positions.to(call.q.device, non_blocking=True)
    buffers = scratch
    parts: List[Tensor] = []
    for r0 in range(0, total, step):
        n = min(total, r0 + step) - r0
        rows = logits[:, :, r0 : r0 + n] if picked is None else logits.index_select(2, picked[r0 : r0 + n])
        dP = dp.into(buffers.get("dp", (batch, heads, n, plan.keys)), r0, n, plan.keys, picked)
        parts.append(grad_chunk(rows.float(), None, None, None, dP, 1.0, None, False, buffers))
    return (torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]).unsqueeze(0)
