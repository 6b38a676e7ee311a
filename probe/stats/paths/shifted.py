"""The shifted path: one ``exp2`` per scale on ``D = R − rowmax(R)``, forward and backward.

For calls without bias or softcap and with positive float scales (SDPA defaults, BERT, Llama,
GPT) whose mask the centred path does not take (a row-dependent mask, inputs not proven finite,
a device other than the CPU): ``σ·rowmax(R)`` is the row max of ``σR`` for ``σ > 0``, so ``D`` is
formed once per chunk and each distinct scale costs one exponential (docs/performance.md). The
backward of the centred paths is this one too.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from probe.call import AttentionCall
from probe.stats.buffers import Scratch, give_back
from probe.stats.chunks import DPSource, all_finite, row_chunks
from probe.stats.plan import CallPlan, backward_step, chunk_picks
from probe.stats.rows import LOG2E, Rows, exact_pass, exp_sums, grad_sq, moment_rows, nonfinite_rows, softmax_rows

__all__ = ["causal_upper", "chunk_sums", "forward_rows", "grad_rows", "mask_"]


def causal_upper(step: int, device: torch.device) -> Tensor:
    """The diagonal block's causal mask for chunks of ``step`` rows, additive: ``−inf`` above the
    diagonal, 0 elsewhere (built once per call; see :func:`mask_`)."""
    upper = torch.ones(step, step, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(step, step, device=device).masked_fill_(upper, -math.inf)


def mask_(R: Tensor, valid: Optional[Tensor], causal: Optional[Tuple[int, Tensor]], finite: bool) -> None:
    """Set the masked entries of a chunk ``R`` to ``−inf`` in place: ``valid`` False, or with
    ``causal = (r0, upper)`` (:func:`causal_upper`) above the diagonal of the block at key ``r0``.

    When ``finite`` (:func:`~probe.stats.chunks.all_finite`) the mask is added as 0 / ``−inf``: on
    CPUs a broadcast ``masked_fill_`` costs four to five times an addition. Otherwise
    ``masked_fill_``, so that a NaN or ``+inf`` under the mask does not survive it.
    """
    keys = R.shape[-1]
    if causal is not None:
        r0, upper = causal
        if keys > r0:
            block = upper[: R.shape[2], : keys - r0]
            if finite:
                R[..., r0:].add_(block)
            else:
                R[..., r0:].masked_fill_(block.isinf(), -math.inf)
    elif valid is not None:
        if finite:
            R.add_(torch.where(valid, 0.0, -math.inf))
        else:
            R.masked_fill_(~valid, -math.inf)


def _row_counts(R: Tensor, valid: Optional[Tensor], causal: Optional[Tuple[int, Tensor]]) -> Tensor:
    batch, heads, length, keys = R.shape
    shape = (batch, heads, length)
    if causal is not None:
        r0 = causal[0]
        return (torch.arange(r0 + 1, r0 + length + 1, device=R.device, dtype=torch.float32)
                .clamp(max=keys).expand(shape))
    if valid is None:
        return torch.full(shape, float(keys), device=R.device)
    return valid.sum(-1, dtype=torch.float32).expand(shape)


def chunk_sums(R: Tensor, valid: Optional[Tensor], scales: List[float], work: Tensor,
               causal: Optional[Tuple[int, Tensor]] = None, pick: Optional[Tensor] = None
               ) -> Tuple[List[Tensor], List[Tensor]]:
    """Per-row sums of one chunk, each ``(B, H, l)`` float32: ``([n, r, ΣD, ΣD², #non-finite]``
    for every row, ``[Σe_1, Σe·D_1, …]`` for the rows ``pick`` (local, sorted; ``None``: every
    row)). ``work``: scratch of at least ``2·R.numel()`` floats. ``causal = (r0, upper)``: the
    chunk starts at query ``r0`` and is causal with no other mask; only its diagonal block is
    masked, with ``upper`` built once per call (masks that grow with the chunk's width fragment
    the CPU heap: +20 MiB of resident memory at L = 4096).

    Non-finite logits are counted only when the chunk may have some: on CPUs one sum of ``R``
    (a free host check there) proves most chunks clean and skips the count's three passes.

    Pitfall: ``R`` is overwritten. Masked entries of ``D`` are ``−inf`` for the exponential and 0
    in the sums (``0·(−inf)`` would be NaN); a fully masked row has ``r = −inf``, replaced by 0.
    """
    e = work[: R.numel()].view(R.shape)
    masked = valid is not None or causal is not None
    finite = all_finite(R)  # before masking: every entry of the chunk, valid or not
    mask_(R, valid, causal, finite)
    n_row = _row_counts(R, valid, causal)
    D, D0, exact = exact_pass(R, masked, finite, n_row, work[R.numel() : 2 * R.numel()].view(R.shape))
    if pick is not None:
        D, D0 = D.index_select(2, pick), (D0.index_select(2, pick) if masked else None)
        D0 = D if D0 is None else D0
        e = e.view(-1)[: D.numel()].view(D.shape)
    return [n_row] + exact, exp_sums(D, D0, scales, e)


def forward_rows(call: AttentionCall, plan: CallPlan, scratch: Scratch) -> Rows:
    """Every row's exact statistics and the sampled rows' exponential ones (:class:`Rows`), in
    chunks of ``plan.step`` rows: causal chunks stop at their last query, and without other
    masks only their diagonal block is masked, with one mask."""
    batch, heads = call.q.shape[:2]
    device = call.q.device
    step, floats = plan.step, plan.floats
    last, picks = chunk_picks(call, plan)
    block = call.causal and call.mask is None
    upper = causal_upper(step, device) if block else None
    work = scratch.get("work", (2 * batch * heads * step * plan.keys,))  # the widest chunk
    exact_parts: List[Tensor] = []
    soft_parts: List[Tensor] = []
    n_parts: List[Tensor] = []
    chunks = row_chunks(call, step, None, last=last, causal_mask=not block, scratch=scratch)
    for index, (R, valid, _) in enumerate(chunks):
        causal = None if upper is None else (index * step, upper)
        exact, soft = chunk_sums(R, valid, floats, work, causal, picks[index])
        # one (K, B, H, l) tensor per chunk: thousands of small tensors cost heap at long L
        exact_parts.append(torch.stack(exact))
        soft_parts.append(torch.stack(soft))
        n_parts.append(exact[0] if picks[index] is None else exact[0].index_select(2, picks[index]))
    exact_all = torch.cat(exact_parts, dim=-1) if len(exact_parts) > 1 else exact_parts[0]
    soft_all = torch.cat(soft_parts, dim=-1) if len(soft_parts) > 1 else soft_parts[0]
    soft_n = torch.cat(n_parts, dim=-1) if len(n_parts) > 1 else n_parts[0]
    n, r, sum_d, sum_d2, bad = exact_all.unbind(0)
    mean, m2 = moment_rows(n, r, sum_d, sum_d2, plan.acc)
    entropy, max_prob = softmax_rows(soft_n, soft_all, floats)  # the sums stacked, as softmax_rows takes them
    return Rows(n, r, mean, m2, nonfinite_rows(bad, n, r, floats[0]), None, soft_n, entropy, max_prob)


def grad_rows(call: AttentionCall, plan: CallPlan, dp: DPSource, scratch: Scratch) -> Tensor:
    """Per row ``Σ_j (∂L/∂Z^σ_j)²`` at each distinct positive scale, ``(G, B, H, N)`` float32, for
    the rows of ``plan.positions`` (``None``: every row): only those rows' ``q·kᵀ`` and ``dP`` are
    formed (the cost is proportional to their number).

    ``D = R − rowmax`` is formed once per chunk and ``e = exp(σD)`` once per scale; with
    ``c = Σ e·dP / Σe`` a row's ``Σ_j (P_j (dP_j − c))² = ‖e ⊙ (dP − c)‖² / (Σe)²``. Chunks are
    cache-sized and reuse four buffers (R, dP, e, one product); a causal chunk stops at its last
    query (later keys have ``P = 0``, no gradient) and, without other masks, masks only its
    diagonal block. The values are multiplied by ``dp.gs²``. ``scratch``: the call's buffers
    (:mod:`probe.stats.buffers`).

    Pitfall: a fully masked row has ``Σe = 0`` and contributes 0; a NaN row stays NaN.
    """
    batch, heads = call.q.shape[:2]
    positions = plan.positions
    total = plan.length if positions is None else positions.shape[0]
    step = backward_step(call, plan)
    starts = range(0, total, step)
    last = None
    if call.causal:  # the last query of each chunk, on the host
        ends = [min(total, r0 + step) - 1 for r0 in starts]
        last = ends if positions is None else [int(positions[i]) for i in ends]
    kept = plan.carry.pop("exps", None)  # taken: a second backward through the call recomputes
    if kept is not None and positions is not None:
        return _kept_rows(call, plan, dp, scratch, kept, step)
    # every row's max from the forward (proven-finite inputs): no amax, and the shift folds into
    # each scale's product, σ·log2(e)·R − σ·log2(e)·r
    rmax = plan.carry.pop("rmax", None) if positions is None else None
    block = call.causal and call.mask is None and positions is None
    upper = causal_upper(step, call.q.device) if block else None
    per_row: List[List[Tensor]] = [[] for _ in plan.values]
    picked = None if positions is None else positions.to(call.q.device, non_blocking=True)
    r0 = 0
    for R, valid, _ in row_chunks(call, step, picked, last=last, causal_mask=not block, scratch=scratch):
        rows, cols = R.shape[2], R.shape[3]
        dP, e, t = (scratch.get(name, R.shape) for name in ("dp", "e", "t"))
        dp.into(dP, r0, rows, cols, picked)
        # finite: the centred paths' inputs were proven so (plan.inputs_finite; autograd forbids
        # changing q and k in place before the backward), else a sum of R proves the chunk finite
        # on CPUs; then an added mask is cheaper (mask_)
        finite = valid is not None and (plan.proven or all_finite(R))
        mask_(R, valid, None if upper is None else (r0, upper), finite)
        if rmax is None:
            top = R.amax(-1, keepdim=True)
            D = R.sub_(torch.where(top == -math.inf, 0.0, top))
        else:
            D, top = R, rmax[:, :, r0 : r0 + rows].unsqueeze(-1)
        for i, sigma in enumerate(plan.floats):
            if rmax is None:
                torch.mul(D, sigma * LOG2E, out=e).exp2_()
            else:
                torch.add(top * (-sigma * LOG2E), D, alpha=sigma * LOG2E, out=e).exp2_()
            per_row[i].append(grad_sq(e, dP, e.sum(-1, keepdim=True), t))
        r0 += rows
    out = torch.stack([torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0] for parts in per_row])
    if rmax is not None and not math.isfinite(float(out.sum())):
        # the forward's row max as the shift: the float32 R formed here may exceed it by its
        # rounding, about 2⁻²⁴·d·max|q|·max|k|, and past logits of ~1e8 that exponential
        # overflows (inf − inf: NaN, where the model's own gradient is finite). Again, each chunk
        # shifted by its own max (e ≤ 1): the carried max is gone (popped), so no loop. CPUs
        # only (the centred paths carry it), where this read is free; a NaN upstream gradient
        # comes back NaN from either.
        return grad_rows(call, plan, dp, scratch)
    return out


def _kept_rows(call: AttentionCall, plan: CallPlan, dp: DPSource, scratch: Scratch,
               kept: Tuple[List[Tuple[int, Tensor]], Tensor], step: int) -> Tensor:
    """:func:`grad_rows` of the sampled rows from the exponentials their forward kept
    (``kept = (batches, Σe)``: ``(first row, (G, B, H, rows, keys))`` per batch of rows and
    ``(G, B, H, N)``, :func:`probe.stats.paths.centred.centred_rows`): per chunk of ``step`` rows
    of a batch only ``dP`` is formed over the batch's keys, then per scale
    ``‖e ⊙ (dP − c)‖² / (Σe)²``. No ``q·kᵀ``, mask, max or exponential: ``e`` is 0 on masked keys
    and on a causal row's later keys."""
    batches, sums = kept
    positions = plan.positions
    assert positions is not None
    picked = positions.to(call.q.device, non_blocking=True)
    batch, heads = call.q.shape[:2]
    per_row: List[List[Tensor]] = [[] for _ in plan.values]
    for first, exps in batches:
        rows_b, cols = exps.shape[3], exps.shape[4]
        for s0 in range(0, rows_b, step):
            rows = min(rows_b, s0 + step) - s0
            r0 = first + s0
            shape = (batch, heads, rows, cols)
            dP, t = scratch.get("dp", shape), scratch.get("t", shape)
            dp.into(dP, r0, rows, cols, picked)
            for i in range(len(plan.values)):
                se = sums[i, :, :, r0 : r0 + rows].unsqueeze(-1)
                per_row[i].append(grad_sq(exps[i, :, :, s0 : s0 + rows], dP, se, t))
    for _, exps in batches:  # read: their memory serves the next forward's (buffers.kept_buffer)
        give_back(exps)
    return torch.stack([torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0] for parts in per_row])
