"""The shifted path: one ``exp2`` per scale on ``D = R − rowmax(R)``, forward and backward.

For calls without bias or softcap and with positive float scales (SDPA defaults, BERT, Llama,
GPT): ``σ·rowmax(R)`` is the row max of ``σR`` for ``σ > 0``, so ``D`` is formed once per chunk
and each distinct scale costs one exponential (docs/performance.md).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from probe.call import AttentionCall
from probe.stats.chunks import _iter, all_finite, cache_chunk_rows, grouped_product, kv_view
from probe.stats.sampling import row_design, stratified_variance

__all__ = ["causal_upper", "grad_logits_shifted", "head_moments", "mask_", "shifted_reduce", "shifted_rows", "total_variance"]

_LOG2E = 1.0 / math.log(2.0)


def causal_upper(step: int, device: torch.device) -> Tensor:
    """The diagonal block's causal mask for chunks of ``step`` rows, additive: ``−inf`` above the
    diagonal, 0 elsewhere (built once per call; see :func:`mask_`)."""
    upper = torch.ones(step, step, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(step, step, device=device).masked_fill_(upper, -math.inf)


def mask_(R: Tensor, valid: Optional[Tensor], causal: Optional[Tuple[int, Tensor]], finite: bool) -> None:
    """Set the masked entries of a chunk ``R`` to ``−inf`` in place: ``valid`` False, or with
    ``causal = (r0, upper)`` (:func:`causal_upper`) above the diagonal of the block at key ``r0``.

    When ``finite`` (:func:`all_finite`) the mask is added as 0 / ``−inf``: on CPUs a broadcast
    ``masked_fill_`` costs four to five times an addition. Otherwise ``masked_fill_``, so that a
    NaN or ``+inf`` under the mask does not survive it.
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


def shifted_rows(R: Tensor, valid: Optional[Tensor], scales: Sequence[float],
                 work: Optional[Tensor] = None, causal: Optional[Tuple[int, Tensor]] = None,
                 pick: Optional[Tensor] = None) -> Tuple[List[Tensor], List[Tensor]]:
    """Per-row sums of one chunk for the shifted path, each ``(B, H, l)`` float32.

    With ``r`` the row max of ``R`` over valid keys and ``D = R − r`` (``≤ 0``), every positive
    scale has row max ``σr``, so ``e = exp(σD)`` (computed as ``exp2(σ·log2(e)·D)``, three times
    cheaper than ``exp`` on CPUs), ``Σe`` and ``Σ e·D`` give the row's entropy and max
    probability (:func:`shifted_reduce`): one exponential and two row sums per scale.

    Returns ``(exact, soft)``: ``exact = [n, r, ΣD, ΣD², #non-finite]`` for every row of
    the chunk, where ``n`` is the number of valid keys and ``#non-finite`` counts NaN/±inf among
    the row's valid logits; ``soft = [n, r, Σe_1, Σe·D_1, Σe_2, ...]`` for the rows ``pick``
    (local indices, sorted) or every row when ``pick`` is ``None``. The exponentials, the
    expensive part, run on the picked rows only (``rows=`` budget of :func:`forward_stats`).

    ``work`` is scratch space of at least ``2·R.numel()`` floats, reused across chunks.
    ``causal = (r0, upper)``: the chunk starts at query ``r0`` and is causal with no other mask;
    only its diagonal block is masked, with ``upper`` (:func:`causal_upper`, built once per
    call). Masks that grow with the chunk's width fragment the CPU heap (measured: +20 MiB
    of resident memory at L = 4096).

    Non-finite logits are counted only when the chunk may have some: on CPUs one sum of ``R``
    (:func:`all_finite`, a free host check there) proves most chunks clean and skips the count's
    three passes; elsewhere the count always runs (no host synchronization).

    Pitfall: ``R`` is overwritten. Masked entries of ``D`` are ``-inf`` for the exponential and 0
    in the sums (``0·(−inf)`` would be NaN); a fully masked row has ``r = −inf``, replaced by 0.
    """
    batch, heads, length, keys = R.shape
    shape = (batch, heads, length)
    if work is None or work.numel() < 2 * R.numel():
        work = torch.empty(2 * R.numel(), device=R.device)
    e = work[: R.numel()].view(R.shape)
    masked = valid is not None or causal is not None
    finite = all_finite(R)  # before masking: every entry of the chunk, valid or not
    mask_(R, valid, causal, finite)
    if causal is not None:
        r0 = causal[0]
        n_row = (torch.arange(r0 + 1, r0 + length + 1, device=R.device, dtype=torch.float32)
                 .clamp(max=keys).expand(shape))
    elif valid is None:
        n_row = torch.full(shape, float(keys), device=R.device)
    else:
        n_row = valid.sum(-1, dtype=torch.float32).expand(shape)
    if finite:
        bad = torch.zeros(shape, device=R.device)
    else:  # x·0 is 0 for finite x and NaN for NaN and ±inf (masked entries are −inf: subtract them)
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
    r = rmax.squeeze(-1)
    exact = [n_row, r, D0.sum(-1), torch.linalg.vector_norm(D0, dim=-1).square(), bad]
    if pick is not None:
        D, D0 = D.index_select(2, pick), D0.index_select(2, pick) if masked else None
        D0 = D if D0 is None else D0
        e = e.view(-1)[: D.numel()].view(D.shape)
        n_row, r = n_row.index_select(2, pick), r.index_select(2, pick)
    soft = [n_row, r]
    for sigma in scales:
        torch.mul(D, sigma * _LOG2E, out=e).exp2_()
        soft.append(e.sum(-1))
        soft.append(e.mul_(D0).sum(-1))
    return exact, soft


def shifted_reduce(exact: List[Tensor], soft_rows: List[Tensor], scales: Sequence[float], saturation: float,
                   acc: torch.dtype, length: Optional[int] = None, positions: Optional[Tensor] = None
                   ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Per-head (moments (4, H): count, mean, M2, max; softmax sums (len(scales), 4, H), nonfinite (H,), variances)
    from the per-row sums of :func:`shifted_rows` (every chunk's, concatenated along rows).

    Moments: a row has mean ``μ = r + ΣD/n`` and ``M2 = ΣD² − (ΣD)²/n``; rows combine exactly
    per head, in ``acc``: ``mean = Σ nμ / Σ n``, ``M2 = Σ M2_row + Σ n(μ − mean)²`` (Chan).
    ``ΣD² − (ΣD)²/n`` cancels only as much as ``mean(D)²/var(D)`` in a row, which is small
    because ``D`` is measured from the row max, not from zero.
    Softmax at ``σ``: ``H = log Σe − σ·Σ e·D / Σe``, ``max P = 1/Σe``; nonfinite probabilities:
    every valid entry of a row whose log-sum-exp ``σr + log Σe`` is NaN or ``+inf``.

    ``nonfinite`` is exact, from every row's max: with finite logits ``Σe ∈ [1, n]``, so a row's
    log-sum-exp is NaN or ``+inf`` exactly when ``σr`` is (a NaN logit makes ``r`` NaN, ``+inf``
    makes it ``+inf``).

    Sampled rows (``length`` = L given, ``N`` soft rows at sorted ``positions``, by default the
    stratified design's :func:`~probe.stats.sampling.sample_rows`): the softmax sums are
    Horvitz-Thompson totals (weight ``L_h/n_h`` per position, :func:`~probe.stats.sampling.row_design`);
    the row count, the moments, the maximum and ``nonfinite`` stay exact. ``variances`` is then
    ``(len(scales), 3, H)``: the estimated variance of each total (entropy, max_prob, saturated),
    :func:`total_variance` of the per-position sums over the batch; else ``None``.
    """
    n, r, a, b, bad = exact
    dims = (0, 2)
    count, mean, m2, top = head_moments(n, r, a, b, acc)
    moments = torch.stack([count, mean, m2, top])  # no min: every scale here is positive
    n_ok = (n >= 2).sum(dims, dtype=acc)  # exact, also when the softmax rows are sampled

    n_s = soft_rows[0]
    design = None
    if length is not None:
        design = row_design(soft_rows[0].shape[-1] if positions is None else positions, length)
    weight = None if design is None else design[0].to(n.device, acc, non_blocking=True)
    ok = n_s >= 2
    log_n = torch.log(n_s.clamp(min=2))
    soft, variances, nonfinite = [], [], None
    for i, sigma in enumerate(scales):
        se, sed = soft_rows[2 + 2 * i], soft_rows[3 + 2 * i]
        lse = torch.log(se)
        entropy = torch.where(ok, (lse - sigma * sed / se).clamp(min=0) / log_n, 0.0)
        max_prob = torch.where(ok, 1.0 / se, 0.0)
        saturated = (ok & (max_prob >= saturation)).to(entropy.dtype)
        per_row = (entropy, max_prob, saturated)
        if design is None:
            soft.append(torch.stack([n_ok] + [v.sum(dims, dtype=acc) for v in per_row]))
        else:
            totals, residuals = _ratio_totals(per_row, ok, weight, n_ok, dims, acc)
            soft.append(torch.stack([n_ok] + totals))
            variances.append(residuals)
        if i == 0:  # every row of the probabilities at `actual` is non-finite where σr is (docstring)
            top_z = sigma * r
            bad_rows = torch.isnan(top_z) | (top_z == math.inf)
            nonfinite = bad.sum(dims, dtype=acc) + torch.where(bad_rows, n, 0.0).sum(dims, dtype=acc)
    var = None
    if design is not None:
        # every scale's three variances in one pass: (len(scales), 3, B, H, N) -> (len(scales), 3, H)
        var = total_variance(torch.stack([r for r, _ in variances]), design).to(acc) * variances[0][1]
    return moments, torch.stack(soft), nonfinite, var  # type: ignore[return-value]


def _ratio_totals(per_row: Sequence[Tensor], ok: Tensor, weight: Tensor, n_ok: Tensor, dims: Tuple[int, int],
                  acc: torch.dtype) -> Tuple[List[Tensor], Tuple[Tensor, Tensor]]:
    """Totals over the valid rows of per-row values sampled at positions with weights ``weight``,
    by the ratio estimator: ``T̂ = n · Σ w·y / Σ w·x`` with ``x`` the row's validity and ``n`` the
    exact number of valid rows (``n_ok``), so that ``T̂ / n`` is the mean over the sampled valid
    rows, weighted. Where the number of valid rows differs between positions (left padding under
    causal masking: a padded query sees no key) the Horvitz-Thompson total ``Σ w·y`` divided by
    the exact ``n`` mixes the sample's share of valid rows into the mean (measured: a normalized
    entropy of 1.16 on a 12-token batch, with a standard error of 5e-6); the ratio is exact for
    values that are equal in every valid row and equals the Horvitz-Thompson total where every
    position has the same number of valid rows.

    Returns the totals (``(H,)`` per value) and ``(residuals, factor)``: the variance of each
    total is :func:`total_variance` of the residuals ``y − R̂·x`` (``(3, B, H, N)``) times
    ``factor = (n / Σ w·x)²`` (linearization). A head with no valid row drawn keeps the
    Horvitz-Thompson total (0) and its variance."""
    x = ok.to(acc)
    x_hat = (x * weight).sum(dims)
    drawn = x_hat > 0
    factor = torch.where(drawn, n_ok / torch.where(drawn, x_hat, 1.0), 1.0)
    totals, residuals = [], []
    for v in per_row:
        v = v.to(acc)
        y_hat = (v * weight).sum(dims)
        ratio = torch.where(drawn, y_hat / torch.where(drawn, x_hat, 1.0), 0.0)
        totals.append(torch.where(drawn, ratio * n_ok, y_hat))
        residuals.append(v - ratio.view(1, -1, 1) * x)
    return totals, (torch.stack(residuals), factor.square())


def head_moments(n: Tensor, r: Tensor, a: Tensor, b: Tensor, acc: torch.dtype) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per head ``(count, mean, M2, max)`` of the logits from each row's valid count ``n``, max
    ``r``, ``ΣD`` and ``ΣD²`` (``D = R − r``), ``(B, H, L)`` each: a row has mean ``μ = r + ΣD/n``
    and ``M2 = ΣD² − (ΣD)²/n``; rows combine exactly in ``acc`` (Chan)."""
    dims = (0, 2)
    n64, r64, a64 = n.to(acc), r.to(acc), a.to(acc)
    safe_n = n64.clamp(min=1)
    mu = r64 + a64 / safe_n
    m2_row = (b.to(acc) - a64 * a64 / safe_n).clamp(min=0)
    count = n64.sum(dims)
    mean = (n64 * mu).sum(dims) / count.clamp(min=1)
    m2 = m2_row.sum(dims) + (n64 * (mu - mean.view(1, -1, 1)).square()).sum(dims)
    top = torch.where(n > 0, r, -math.inf).amax(dims).to(acc)
    return count, mean, m2, top


def total_variance(per_row: Tensor, design: Tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
    """Estimated variance, per head, of the stratified Horvitz-Thompson total of ``per_row``
    ``(..., B, H, N)`` (:func:`~probe.stats.sampling.stratified_variance` of ``y``, the
    per-position sums over the batch: the batch shares the positions), ``(..., H)``. ``design``
    from :func:`~probe.stats.sampling.row_design`. NaN when a stratum has one row (``rows=1``)."""
    y = per_row.sum(-3, dtype=torch.float64 if per_row.device.type != "mps" else torch.float32)  # (..., H, N)
    return stratified_variance(y.reshape(-1, y.shape[-1]), *design[1:]).reshape(y.shape[:-1])


# (B, H, rows, S) float32 buffers the backward's shifted path keeps alive: R, dP, e, a product,
# masks and the next chunk's q rows; 8 leaves a margin (as probe.stats.grads).
_BACKWARD_LIVE_BUFFERS = 8


def grad_logits_shifted(call: AttentionCall, dout: Optional[Tensor], vt: Optional[Tensor], values: Sequence[float],
                         budget_bytes: int, acc: torch.dtype, grad_scale: Optional[Tensor] = None,
                         positions: Optional[Tensor] = None, dprobs: Optional[Tensor] = None
                         ) -> Tuple[List[Tensor], Optional[List[Tensor]]]:
    """Per-head ``Σ (∂L/∂Z^σ)²`` for positive float scales without bias or softcap (the common
    case), one tensor per scale in ``values``.

    As in the forward's shifted path (:mod:`probe.stats.functional`), ``D = R − rowmax`` is
    formed once per chunk and ``e = exp(σD)`` once per scale; with ``c = Σ e·dP / Σe`` a row's
    ``Σ_j (P_j (dP_j − c))² = ‖e ⊙ (dP − c)‖² / (Σe)²``. Chunks are cache-sized and reuse four
    buffers (R, dP, e, one product); a causal chunk stops at its last query (later keys have
    ``P = 0``, no gradient) and, without other masks, masks only its diagonal block.

    Args:
        call: the attention computation (no bias, no softcap).
        dout: ``∂L/∂out`` as ``(B, H, L, dv)`` (``None`` with ``dprobs``).
        vt: ``vᵀ`` in float32, ``(B, Hk, dv, S)`` (``None`` with ``dprobs``).
        values: the distinct scales, all ``> 0`` (see :func:`shiftable`).
        budget_bytes: extra memory one chunk may use.
        acc: the accumulation dtype.
        grad_scale: a factor applied to each chunk of ``dout`` (the sums come out multiplied by
            its square; :func:`probe.stats.grads.grad_scale` keeps a huge gradient from overflowing).
        positions: sorted CPU positions of sampled query rows (the ``rows=`` budget), or ``None``
            for every row. Only those rows' ``q·kᵀ`` and ``dP`` are formed: the cost is
            proportional to their number.
        dprobs: ``dP = ∂L/∂P`` itself as ``(B, H, L, S)`` (an eager call's hooked softmax
            output, attention dropout included), instead of ``dout · vᵀ``: each chunk copies its
            rows of it (scaled by ``grad_scale``), no product.

    Returns:
        ``(sums, variances)``: per scale, the per-head sum over every row, or with
        ``positions`` its Horvitz-Thompson estimate (weights of the stratified design,
        :func:`~probe.stats.sampling.row_design`) and, in ``variances``, the
        estimate's variance (:func:`total_variance`); ``variances`` is ``None`` for every row.

    Pitfall: a fully masked row has ``Σe = 0`` and contributes 0; a NaN row stays NaN.
    """
    batch, heads, length, _ = call.q.shape
    keys, kv_heads = call.k.shape[2], call.kv_heads
    strided = False
    if vt is not None:  # once, not per chunk (as k in _iter); a large transposed v is read in place
        vt, strided = kv_view(vt.transpose(-1, -2))
    if positions is not None and positions.shape[0] >= length:
        positions = None
    if batch * heads * length * keys == 0:
        return [torch.zeros(heads, dtype=acc, device=call.q.device) for _ in values], None
    total = length if positions is None else positions.shape[0]
    # Sampled rows (few: the `rows=` budget) take a quarter of the budget: long rows then go a
    # few at a time (each chunk rereads k and v, a small cost for ~128 rows), and the process's
    # extra memory, which also holds code and the allocator's slack, stays within the budget.
    share = budget_bytes if positions is None else budget_bytes // 4
    step = min(max(1, share // max(1, batch * heads * keys * 4 * _BACKWARD_LIVE_BUFFERS)),
               cache_chunk_rows(batch, heads, keys), total)  # never above the rows there are
    starts = range(0, total, step)
    last = None
    if call.causal:  # the last query of each chunk, on the host
        ends = [min(total, r0 + step) - 1 for r0 in starts]
        last = ends if positions is None else [int(positions[i]) for i in ends]
    block = call.causal and call.mask is None and positions is None
    upper = causal_upper(step, call.q.device) if block else None
    sums = [torch.zeros(heads, dtype=acc, device=call.q.device) for _ in values]
    per_row: List[List[Tensor]] = [[] for _ in values]  # sampled: (H, rows) batch sums per chunk
    work = torch.empty(3 * batch * heads * step * keys, device=call.q.device)
    picked = None if positions is None else positions.to(call.q.device, non_blocking=True)
    r0 = 0
    for R, valid, _ in _iter(call, step, picked, reuse=True, last=last, causal_mask=not block):
        rows, cols = R.shape[2], R.shape[3]
        n = R.numel()
        dP, e, t = (work[i * n : (i + 1) * n].view(R.shape) for i in range(3))
        if dprobs is not None:  # dP given: this chunk's rows of it, scaled
            src = dprobs[..., :cols]
            src = src[:, :, r0 : r0 + rows] if picked is None else src.index_select(2, picked[r0 : r0 + rows])
            if grad_scale is not None:
                torch.mul(src, grad_scale, out=dP)
            else:
                dP.copy_(src)
        else:
            assert dout is not None and vt is not None
            dc = dout[:, :, r0 : r0 + rows] if picked is None else dout.index_select(2, picked[r0 : r0 + rows])
            dc, vc = dc.float(), vt[..., :cols]
            if grad_scale is not None:
                dc = dc * grad_scale
            grouped_product(dc, vc, dP, strided)
        # a sum of R proves the chunk finite on CPUs, where an added mask is cheaper (mask_)
        mask_(R, valid, None if upper is None else (r0, upper), valid is not None and all_finite(R))
        rmax = R.amax(-1, keepdim=True)
        D = R.sub_(torch.where(rmax == -math.inf, 0.0, rmax))
        for i, sigma in enumerate(values):
            torch.mul(D, sigma * _LOG2E, out=e).exp2_()
            se = e.sum(-1, keepdim=True)
            u = torch.mul(e, dP, out=t)  # e ⊙ dP, then e ⊙ (dP − c) = u − c·e in place
            c = u.sum(-1, keepdim=True) / se
            se = se.squeeze(-1)
            g2 = torch.linalg.vector_norm(u.addcmul_(e, c, value=-1), dim=-1).square() / se.square()
            g2 = torch.where(se == 0, 0.0, g2)
            if positions is None:
                sums[i] = sums[i] + g2.sum((0, 2), dtype=acc)
            else:
                per_row[i].append(g2)
        r0 += rows
    if positions is None:
        return sums, None
    # Horvitz-Thompson totals over the sampled rows, and each total's estimated variance (the
    # forward's stratified design, rebuilt from the same positions: probe.stats.sampling)
    rows_all = [torch.cat(parts, dim=-1) for parts in per_row]
    design = row_design(positions, length)
    weight = design[0].to(call.q.device, acc, non_blocking=True)
    return ([(r.to(acc) * weight).sum((0, 2)) for r in rows_all],
            list(total_variance(torch.stack(rows_all), design).to(acc).unbind(0)))
