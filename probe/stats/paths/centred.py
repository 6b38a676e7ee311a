"""Exact logit moments and maximum at the cost of one product, ``‖C‖²`` and ``amax`` per chunk.

The centred path (:mod:`probe.stats.plan`), for calls without bias or softcap whose mask is
``None``, key padding (validity depends only on batch, head and key), causal, or both
(:func:`probe.stats.masks.key_validity`, which also recognizes Hugging Face's combined causal +
padding mask), with inputs proven to give finite logits (:func:`probe.stats.plan.inputs_finite`,
CPUs):

- Keys are centred once per call on the mean ``k̄`` of each (batch, kv head)'s valid keys, masked
  keys zeroed: ``k̃_j = w_j·(k_j − k̄)``. Each chunk's product is ``C = q·k̃ᵀ`` (float32, as
  :mod:`probe.stats.chunks`, grouped-query attention without repeating k); masked keys give 0.
- Row ``i``: ``Σ_j C_ij = q_i·Σ_j k̃_j`` over its valid keys, with no pass over ``C``
  (:func:`row_sums`: the sum over every valid key, ``≈ 0`` (the centring's rounding), or, causal,
  an inclusive prefix sum of ``k̃``), ``Σ_j C_ij² = ‖C_i‖²`` (one fused pass, a causal chunk's
  diagonal block zeroed above the diagonal first), ``M2_i = ‖C_i‖² − (Σ_j C_ij)²/n_i`` and the
  mean ``μ_i = q_i·k̄ + Σ_j C_ij / n_i`` with ``q_i·k̄ = q̄·k̄ + (q_i − q̄)·k̄`` (the large part in
  float64: a float32 ``q_i·k̄`` would round away the spread of mean-dominated logits). Rows
  combine in float64 (Chan, :func:`probe.stats.reduce.reduce_rows`):
  ``M2 = Σ M2_i + Σ n_i (μ_i − μ)²``, a sum of non-negative terms.
- The mask is added as the finite :data:`NEG` (below every valid logit, so ``e·D`` is 0 there,
  not NaN; no masked copy, no non-finite count): to the causal block, and, for padded keys, to
  every chunk under causal masking or ``rows=None``, else only to the sampled rows (the row max
  of ``C`` with a padded key's 0 is ``max(valid max, 0)``, and the valid max is at least the
  row's mean over every valid key, ``≈ 0``). The row max is ``max C + q_i·k̄``, and only the
  sampled rows form ``D = C − max C`` and their exponentials: without causal masking the rows
  of q go sampled ones first (one ``index_select`` per chunk, which the product's copy of
  Hugging Face's strided rows costs anyway), so that they lead the first chunks and run on
  ``C`` in place; causal calls, whose chunks are trimmed at their last row, copy them out of
  each chunk and run them in batches.
- Long calls (the centred copy of k and the buffers over every key would outgrow a quarter of
  ``memory_budget``) run over blocks of keys instead (:mod:`probe.stats.paths.key_blocks`): keys are
  centred a block at a time, per-row sums, sums of squares and maxima add up over the blocks,
  and the sampled rows' exponentials run in a second pass once every row's max is known. Extra
  memory is then a few 2 MiB blocks and ``O(B·H·L)`` per-row floats at any length (measured:
  docs/performance.md, "Memory at long sequences").

Precision (tests/stats/test_moments.py, float64 references): ``C`` rounds by about
``d·2⁻²⁴·|q_i|·|k̃_j|`` (centred keys: less than the logits ``R = q·k`` themselves), the cancellation
in ``M2_i`` is ``(mean_j C_ij)² / var_j C_ij`` — about 0 without causal masking, the drift of a
prefix mean of the keys from ``k̄`` with it — and the means are float64: logit variances to ~1e-8
where float32 logits lose 3e-3 (mean 1e6 × spread). Measured alternative: float64 Gram matrices
(``ΣR² = <QᵀQ, KᵀK>``, no pass over the logits) cost more than the passes they replace on CPUs at
d = 32/64 (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from probe.call import AttentionCall
from probe.stats.buffers import Scratch, kept_buffer
from probe.stats.masks import mask_terms
from probe.stats.plan import LOGIT_BOUND, SAMPLED_BYTES, CallPlan, chunk_picks
from probe.stats.rows import Rows, exp_sums, nonfinite_rows, softmax_rows

__all__ = ["NEG", "PREP_BYTES", "CentredPrep", "centred_rows", "exact_rows", "forward_rows", "to_rows"]

#: The finite mask value of the proven-finite path: every logit is at most
#: :data:`~probe.stats.plan.LOGIT_BOUND` (2⁹⁰) in size there, so a masked entry stays below every
#: valid one, and ``e·D`` is ``0`` (not ``0·(−inf)`` = NaN) where ``exp`` underflows.
NEG = -(2.0**100)
assert NEG < -4 * LOGIT_BOUND

#: Bytes of one block of the per-call preparation's temporaries (q − q̄ rows, float64 key slabs).
PREP_BYTES = 2 * 2**20

# Sampled rows gathered before their exponentials run (causal calls: each batch spans the keys
# of its last row only).
_FLUSH_ROWS = 32


class CentredPrep:
    """Per-call tensors of the centred path (module docstring): ``O(S·d)`` work, none over q.

    ``blocked``: no centred copy of k (``kt`` is ``None``): :meth:`block` centres one block of
    keys at a time into a caller's buffer (:mod:`probe.stats.paths.key_blocks`), and ``k̄`` comes
    from float64 sums over slabs of keys."""

    def __init__(self, call: AttentionCall, valid: Optional[Tensor], blocked: bool = False,
                 block_bytes: int = 0, scratch: Optional[Scratch] = None):
        q, k = call.q, call.k
        scratch = scratch or Scratch(0, q.device)  # its temporaries' buffers (probe.stats.buffers)
        batch, heads, length, dim = q.shape
        kv, keys = k.shape[1], k.shape[2]
        g = heads // kv
        self.repeat = 1
        block_bytes = block_bytes or PREP_BYTES  # temporaries: blocks of rows or keys of this size
        if valid is not None and valid.shape[1] > 1 and g > 1:  # a per-head mask: k per query head
            if blocked:
                self.repeat = g  # each block is repeated, not k
            else:
                k = k.repeat_interleave(g, 1)
            kv, g = heads, 1
        self.g, self.kv, self.causal, self.k = g, kv, call.causal, k
        terms = mask_terms(valid, (batch, kv, keys, length, heads, g, call.causal), q.device, NEG)
        w = terms.w
        self.w = w
        self.kt: Optional[Tensor] = None
        if blocked:
            kbar = _key_mean(k, w, self.repeat, block_bytes)
        else:
            # k̃ as (B, Hk, S, d) float32 in memory, read as its transpose (B, Hk, d, S): the
            # copy of Hugging Face's transposed k keeps its order (7 times faster than writing
            # it transposed), and products take a transposed operand as it is
            shape = (batch, kv, keys, dim)
            rows_k = scratch.get("kt", shape)
            if w is None:  # k is copied first and centred there: no other k-sized temporary
                rows_k.copy_(k)
                mean = rows_k.mean(-2, keepdim=True)
                rows_k.sub_(mean)
            else:  # masked keys zeroed as k is copied (one pass), then w·(k − k̄) = w·k − w·k̄ (a
                wk = w.unsqueeze(-1)  # sum over keys: 30 us per BERT call less than w as a (1 × S) product)
                torch.mul(k, wk, out=rows_k)
                mean = rows_k.sum(-2, keepdim=True) / terms.count
                rows_k.addcmul_(wk, mean, value=-1)
            kbar = mean.transpose(-1, -2)
            self.kt = rows_k.transpose(-1, -2)
        self.kbar = kbar  # (B, Hk, d, 1) float32
        # q_i·k̄ = q̄·k̄ + (q_i − q̄)·k̄: the large part in float64, the rest from centred q (in
        # float32 q_i·k̄ would round by 2⁻²⁴·|q_i|·|k̄|, the whole spread of mean-dominated logits);
        # q̄ is any fixed point near the rows (a float32 mean: q − q̄ rounds by 2⁻²⁴·|q_i| whatever
        # q̄'s own rounding), and the rows go in blocks, so that q − q̄ is never a q-sized temporary
        qbar = q.sum((0, 2), keepdim=True, dtype=torch.float32) / max(1, batch * length)  # (1, H, 1, d)
        # one product per block of centred rows serves both per-row sums a call without causal
        # masking needs: q_i·k̄ (the shift) and q_i·Σ_j k̃_j (row_sums; ≈ 0, the centring's
        # rounding), as (q_i − q̄)·[k̄, Σk̃] plus q̄·[k̄, Σk̃] in float64; causal rows sum prefixes
        sums = self.kt is not None and not call.causal
        cols = kbar if not sums else torch.cat([kbar, self.kt.sum(-1, keepdim=True)], -1)  # (B, Hk, d, 1|2)
        kq = cols.transpose(-1, -2).unsqueeze(2).expand(batch, kv, g, cols.shape[-1], dim).reshape(
            batch, heads, cols.shape[-1], dim)
        base = (qbar.double() * kq.double()).sum(-1).unsqueeze(-1)  # (B, H, 1|2, 1) float64
        out = torch.empty(batch, heads, cols.shape[-1], length, dtype=torch.float64, device=q.device)
        block = max(1, block_bytes // max(1, batch * heads * dim * 4))
        for r0 in range(0, length, block):
            rows_q = q[:, :, r0 : r0 + block]
            shape = (batch, heads, rows_q.shape[2], dim)
            diff = torch.sub(rows_q, qbar, out=scratch.get("qd", shape))  # the one temporary
            # [k̄, Σk̃]ᵀ·(q_i − q̄)ᵀ: one or two rows as wide as the block (the product as
            # (q_i − q̄)·[k̄, Σk̃], one or two columns, took 1.8 times as long)
            torch.add(base, torch.matmul(kq, diff.transpose(-1, -2)), out=out[..., r0 : r0 + block])
        self.shift = out[:, :, 0]
        #: ``Σ_j C_ij`` per row, ``(B, H, L)`` float64 (:func:`row_sums`), without causal masking
        self.csum: Optional[Tensor] = out[:, :, 1] if sums else None
        self.n = terms.rows
        self.keybias = terms.keybias

    def block(self, k0: int, k1: int, out: Tensor) -> Tensor:
        """Centred keys ``k̃_{k0} … k̃_{k1−1}`` into ``out``, ``(B, Hk, d, k1 − k0)`` float32."""
        src = self.k[:, :, k0:k1].transpose(-1, -2)
        if self.repeat > 1:  # per-head mask: kv head j serves query heads j·g … j·g + g − 1
            batch, kv, dim, width = src.shape
            out.view(batch, kv, self.repeat, dim, width).copy_(src.unsqueeze(2).expand(batch, kv, self.repeat, dim, width))
        else:
            out.copy_(src)
        out.sub_(self.kbar)
        if self.w is not None:
            out.mul_(self.w[..., k0:k1].unsqueeze(-2))
        return out


def _key_mean(k: Tensor, w: Optional[Tensor], repeat: int, block_bytes: int) -> Tensor:
    """``k̄`` per (batch, kv head) over the valid keys (weights ``w``, ``(B, Hk', S)`` with
    ``Hk' = repeat·Hk``), ``(B, Hk', d, 1)`` float32, from float64 sums over slabs of keys: no
    k-sized copy."""
    batch, kv, keys, dim = k.shape
    total = torch.zeros(batch, kv * repeat, dim, dtype=torch.float64, device=k.device)
    slab = max(1, block_bytes // max(1, batch * kv * repeat * dim * 8))
    for k0 in range(0, keys, slab):
        part = k[:, :, k0 : k0 + slab].double()
        if repeat > 1:
            part = part.repeat_interleave(repeat, 1)
        if w is not None:
            part = part.mul_(w[..., k0 : k0 + slab].unsqueeze(-1))
        total += part.sum(2)
    count = torch.full((1, 1), float(keys), dtype=torch.float64, device=k.device) if w is None else w.sum(-1).double().clamp(min=1)
    return (total / count.unsqueeze(-1)).float().unsqueeze(-1)


def _prefix_sums(keys: Tensor, out: Tensor) -> Tensor:
    """``Σ_{j ≤ i} k̃_j`` for every key ``i`` of ``keys`` (``(B, Hk, S, d)``) into ``out`` (the same
    shape, float32) from float64 sums: a float64 prefix sum over slabs of keys with a carry, so
    that no ``(B, Hk, S, d)`` float64 copy is made (two of them, 64 MiB at S = 8192)."""
    batch, kv, count, dim = keys.shape
    slab = max(1, PREP_BYTES // max(1, batch * kv * dim * 8))
    carry: Optional[Tensor] = None
    for k0 in range(0, count, slab):
        part = keys[:, :, k0 : k0 + slab].cumsum(-2, dtype=torch.float64)
        if carry is not None:
            part.add_(carry)
        out[:, :, k0 : k0 + slab].copy_(part)
        carry = part[:, :, -1:]
    return out


def row_sums(prep: CentredPrep, q: Tensor, scratch: Scratch) -> Tensor:
    """``Σ_j C_ij`` over each row's valid keys, ``(B, H, L)`` float64, without a pass over ``C``:
    ``q_i·Σ_j k̃_j``. Without causal masking the sum is over every valid key (≈ 0, the centring's
    rounding) and the prep's product already holds it (``prep.csum``, :class:`CentredPrep`);
    causal, over the keys up to ``i``: an inclusive prefix sum of ``k̃`` (float64 then float32)
    times each row."""
    assert prep.kt is not None
    if prep.csum is not None:  # without causal masking: the prep's product (CentredPrep)
        return prep.csum
    batch, heads, length, dim = q.shape
    qg = q.unflatten(1, (prep.kv, prep.g)).float()  # (B, Hk, g, L, d): a kv head per group
    keys_rows = prep.kt.transpose(-1, -2)  # (B, Hk, S, d)
    keys = keys_rows.shape[2]
    prefix = _prefix_sums(keys_rows, scratch.get("prefix", keys_rows.shape))
    if length > keys:  # rows after the last key see every key
        prefix = prefix.index_select(2, torch.arange(length, device=q.device).clamp(max=keys - 1))
    return torch.linalg.vecdot(qg, prefix[:, :, :length].unsqueeze(2)).reshape(batch, heads, length).double()


def centred_rows(call: AttentionCall, valid: Optional[Tensor], scales: Sequence[float], step: int,
                  picks: Sequence[Optional[Tensor]], scratch: Optional[Scratch] = None,
                  keep: Optional[List[Tuple[int, Tensor]]] = None,
                  positions: Optional[Tensor] = None) -> Tuple[List[Tensor], List[Tensor]]:
    """Per-row sums of the centred path (module docstring): ``exact = [n, r, μ, M2, 0]`` for every
    row (:func:`exact_rows`) and ``soft = [n, r, Σe_1, Σe·D_1, …]`` for the rows ``picks`` (as
    :func:`~probe.stats.paths.shifted.chunk_sums` returns them; :func:`to_rows` takes both).

    Per chunk: one product, ``‖C‖²`` and ``amax`` (causal: the diagonal block zeroed, then masked;
    padded keys masked where the module docstring says). The sampled rows (``picks``, local indices per chunk) run
    first without causal masking (their exponentials on the leading rows of ``C``), or, causal,
    are copied out and their exponentials computed in batches; with ``picks`` all ``None`` (every row)
    each chunk's exponentials run while it is in cache. ``scratch``: the call's buffers
    (:mod:`probe.stats.buffers`). ``keep``: a list that receives, for the backward
    (:func:`probe.stats.paths.shifted.grad_rows`), each batch of sampled rows' exponentials as
    ``(first row, (G, B, H, rows, keys seen) tensor)``, every scale's, in the rows' order: a causal
    batch spans the keys of its last chunk only (beyond a row's own chunk its entries are 0).
    ``positions``: the sampled rows' sorted positions, on the call's device, which a call without
    causal masking takes instead of ``picks`` (then ``[None]``: not split into chunks).
    """
    q = call.q
    batch, heads, length, dim = q.shape
    keys = call.k.shape[2]
    device = q.device
    scratch = scratch or Scratch(0, device)
    prep = CentredPrep(call, valid, scratch=scratch)
    assert prep.kt is not None
    lower = upper = torch.empty(0, device=device)
    if call.causal:  # the diagonal block's mask: 1 / 0 (zeroes C above the diagonal), 0 / NEG
        above = torch.ones(step, step, dtype=torch.bool, device=device).triu(1)
        lower = (~above).float()
        upper = torch.zeros(step, step, device=device).masked_fill_(above, NEG)
    if positions is not None and call.causal:
        raise ValueError("centred_rows: `positions` replace `picks` only without causal masking")
    every = positions is None and all(p is None for p in picks)
    if positions is not None:
        rows_all: Optional[Tensor] = positions
    else:
        rows_all = None if every else torch.cat([p + r0 for p, r0 in zip(picks, range(0, length, step)) if p is not None])
    # without causal masking the rows go in any order: the sampled ones first, so that they are
    # the leading rows of the first chunks, and their exponentials run on C in place (no gather)
    order = inverse = None
    if rows_all is not None and not call.causal:
        order, inverse = _sampled_first(rows_all, length)
    full_buf = scratch.get("R", (batch * heads * step * keys,))
    kt3 = prep.kt.flatten(0, 1)  # (B·Hk, d, S): k̃ rows read transposed, a view
    work = scratch.get("e", (batch * heads * step * keys,)) if every or order is not None else None
    sampled = e_buf = None
    if not every and order is None:  # the sampled rows' C, masked (NEG) beyond each chunk's keys, a bounded batch
        total = sum(int(p.shape[0]) for p in picks if p is not None)  # of them at a time
        cap = max(1, min(total, SAMPLED_BYTES // max(1, batch * heads * keys * 4)))
        sampled = scratch.get("rows", (batch, heads, cap, keys))
        if call.causal:  # rows of later chunks span more keys: the rest is masked
            sampled.fill_(NEG)
        e_buf = scratch.get("e", (batch * heads * cap * keys,))
    parts: List[Tensor] = []
    soft_parts: List[Tensor] = []
    used = 0  # sampled rows gathered in the buffer
    done = 0  # sampled rows whose exponentials ran
    cmax_parts: List[Tensor] = []  # their amax, until their exponentials run

    def exps(D: Tensor, top: Tensor, cols: int, buf: Tensor) -> None:
        """The exponentials of sampled rows from their ``C`` (``D``, changed in place) and row max
        ``top``, over keys ``:cols``; ``buf``: a buffer of at least ``D``'s size."""
        nonlocal done
        if prep.keybias is not None and not call.causal:  # masked keys: 0 in C, NEG here
            D.add_(prep.keybias[..., :cols])
        D.sub_(torch.where(top <= NEG / 2, 0.0, top).unsqueeze(-1))
        # kept: the exponentials go where the backward finds them, one tensor per batch of rows
        kept = None if keep is None else kept_buffer((len(scales),) + tuple(D.shape), device)
        soft_parts.append(torch.stack(exp_sums(D, D, scales, buf[: D.numel()].view(D.shape), kept)))
        if keep is not None and kept is not None:  # (kept is None exactly when keep is)
            keep.append((done, kept))
        done += D.shape[2]

    def flush(cols: int) -> None:  # the gathered rows' exponentials, over the keys seen so far
        nonlocal used, cmax_parts
        assert sampled is not None and e_buf is not None
        D = sampled[:, :, :used, :cols]
        exps(D, torch.cat(cmax_parts, dim=-1) if len(cmax_parts) > 1 else cmax_parts[0], cols, e_buf)
        if call.causal:  # the buffer is reused: keys beyond a later row's chunk stay masked
            D.fill_(NEG)
        used, cmax_parts = 0, []
    for index, r0 in enumerate(range(0, length, step)):
        r1 = min(length, r0 + step)
        rows = r1 - r0
        cols = min(keys, r1) if call.causal else keys  # a causal chunk stops at its last query
        qc = q[:, :, r0:r1].float() if order is None else q.index_select(2, order[r0:r1]).float()
        # q rows as (B·Hk, g·rows, d): one product per kv head (chunks.row_chunks), whose output
        # is (B, H, rows, cols) in memory; bmm on 3-d views (matmul's own reshaping of 4-d
        # operands cost seven more tensor operations per chunk)
        C3 = full_buf[: batch * heads * rows * cols].view(batch * prep.kv, prep.g * rows, cols)
        torch.bmm(qc.reshape(batch * prep.kv, prep.g * rows, dim), kt3 if cols == keys else kt3[..., :cols], out=C3)
        C = C3.view(batch, heads, rows, cols)
        diag = C[..., r0:] if call.causal and cols > r0 else None
        if diag is not None:  # only the causal block is masked: zeroed for ‖C‖², NEG for the max
            diag.mul_(lower[:rows, : cols - r0])
        sq = torch.linalg.vector_norm(C, dim=-1)
        if diag is not None:
            diag.add_(upper[:rows, : cols - r0])
        if prep.keybias is not None and (every or call.causal):
            C.add_(prep.keybias[..., :cols])
        # else masked keys are 0 in C (k̃ zeroed): without their NEG the max is max(valid max, 0),
        # and the valid max is at least the row's mean, q_i·Σk̃/n over every valid key ≈ 0 (the
        # centring's rounding); the sampled rows get their NEG in flush()
        cmax = C.amax(-1)
        parts.append(torch.stack([sq, cmax]))
        pick = picks[index] if order is None else None
        if every:
            top = torch.where(cmax <= NEG / 2, 0.0, cmax).unsqueeze(-1)
            assert work is not None
            soft_parts.append(torch.stack(exp_sums(C.sub_(top), C, scales, work[: C.numel()].view(C.shape))))
        elif order is not None:
            assert rows_all is not None and work is not None
            m = max(0, min(rows, rows_all.shape[0] - r0))  # this chunk's sampled rows: its first m
            if m > 0:
                exps(C[:, :, :m], cmax[:, :, :m], cols, work)
        else:
            taken = 0
            while pick is not None and taken < pick.shape[0]:
                part = pick[taken : taken + cap - used]
                # into the buffer's view directly (the assignment took a temporary and a copy)
                torch.index_select(C, 2, part, out=sampled[:, :, used : used + part.shape[0], :cols])
                cmax_parts.append(cmax.index_select(2, part))
                used += part.shape[0]
                taken += part.shape[0]
                if used == cap:
                    flush(cols)
            # the rest: at the end, or (causal) once there are enough of them
            if used > 0 and (r1 == length or (call.causal and used >= _FLUSH_ROWS)):
                flush(cols)
    per_row = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]  # (2, B, H, L)
    if inverse is not None:  # back in the rows' order
        per_row = per_row.index_select(-1, inverse)
    sq, cmax = per_row.unbind(0)
    exact = exact_rows(prep, row_sums(prep, q, scratch), sq.double().square(), cmax)
    n = prep.n
    r = exact[1]
    if every:
        soft_all = torch.cat(soft_parts, dim=-1) if len(soft_parts) > 1 else soft_parts[0]
        return exact, [n, r] + list(soft_all.unbind(0))
    assert rows_all is not None
    n_s, r_s = n.index_select(2, rows_all), r.index_select(2, rows_all)
    if not soft_parts:  # no sampled row
        return exact, [n_s, r_s] + [torch.zeros_like(n_s) for _ in range(2 * len(scales))]
    soft_all = torch.cat(soft_parts, dim=-1) if len(soft_parts) > 1 else soft_parts[0]
    return exact, [n_s, r_s] + list(soft_all.unbind(0))


def _sampled_first(rows: Tensor, length: int) -> Tuple[Tensor, Tensor]:
    """A permutation of ``range(length)`` that lists ``rows`` (distinct, host positions: the
    centred paths run on CPUs) first, in their order, then the other rows, and its inverse, built
    by NumPy (a torch operation's dispatch costs more than this arithmetic: eight of them per call)."""
    picked = rows.numpy()
    others = np.ones(length, dtype=bool)
    others[picked] = False
    order = np.concatenate([picked, np.flatnonzero(others)])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(length)
    return torch.from_numpy(order), torch.from_numpy(inverse)


def exact_rows(prep: CentredPrep, csum: Tensor, sumsq: Tensor, cmax: Tensor) -> List[Tensor]:
    """``[n, r, μ, M2, 0]`` per row (float64 mean and M2) from each row's ``Σ_j C_ij`` and
    ``Σ_j C_ij²`` (float64) and ``max_j C_ij`` (any value where every key is masked: ``r`` is 0
    there)."""
    n = prep.n
    safe = n.double().clamp(min=1)
    per_key = csum / safe
    m2 = torch.addcmul(sumsq, csum, per_key, value=-1).clamp_(min=0)  # ΣC² − (ΣC)²/n
    if prep.causal:  # a row of one key (every causal call's first) has M2 = 0, not ΣC²'s rounding
        m2 = m2.masked_fill_(n <= 1, 0.0)  # (≈ 2⁻²⁴·C², C of the logits' size: its key is not centred for it)
    mean = prep.shift + per_key
    r = torch.where(n > 0, (cmax + prep.shift).float(), 0.0)
    zero = torch.zeros((), device=n.device).expand(n.shape)
    return [n, r, mean, m2, zero]


def to_rows(exact: List[Tensor], soft: List[Tensor], scales: Sequence[float]) -> Rows:
    """:class:`Rows` from :func:`centred_rows`' (or the key blocks') per-row sums."""
    n, r, mean, m2, zero = exact
    entropy, max_prob = softmax_rows(soft[0], soft[2:], scales)
    # every logit is proven at most LOGIT_BOUND in size, so σ·r is finite for any σ below 2³⁶,
    # and with finite logits Σe ∈ [1, n]: no row's softmax is non-finite (nonfinite_rows' test)
    finite = abs(scales[0]) * LOGIT_BOUND < 2.0**126
    return Rows(n, r, mean, m2, zero if finite else nonfinite_rows(zero, n, r, scales[0]), None, soft[0],
                entropy, max_prob)


def forward_rows(call: AttentionCall, plan: CallPlan, scratch: Scratch) -> Rows:
    """The centred path's :class:`Rows` in chunks of ``plan.step`` query rows (the call causal
    also when its mask held the causal pattern: ``plan.causal``)."""
    call = dataclasses.replace(call, causal=plan.causal)
    keep: Optional[List[Tuple[int, Tensor]]] = [] if plan.keep else None
    if plan.positions is not None and not call.causal:  # the sampled rows go first: not split into chunks
        exact, soft = centred_rows(call, plan.valid, plan.floats, plan.step, [None], scratch, keep,
                                   positions=plan.positions.to(call.q.device, non_blocking=True))
    else:
        exact, soft = centred_rows(call, plan.valid, plan.floats, plan.step, chunk_picks(call, plan)[1], scratch, keep)
    if keep:  # the sampled rows' exponentials and each row's Σe, (G, B, H, N), for the backward
        plan.carry["exps"] = (keep, torch.stack(soft[2::2]))
    return to_rows(exact, soft, plan.floats)
