"""The centred path over blocks of keys: :mod:`probe.stats.paths.centred` in bounded memory at any length.

The chunked centred path (:func:`probe.stats.paths.centred.centred_rows`) keeps one centred
float32 copy of k per call and buffers that span every key: 70 MiB of tensors at
(1, 8, 16384, 64), growing with S. :func:`probe.stats.plan.blocked_keys` says when a call would
outgrow a quarter of ``memory_budget`` that way; :func:`blocked_rows` then computes the same
per-row sums from blocks of keys (docs/performance.md, "Long calls: blocks of keys").
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from probe.call import AttentionCall
from probe.stats.buffers import Scratch
from probe.stats.chunks import grouped_product
from probe.stats.paths.centred import NEG, PREP_BYTES, CentredPrep, exact_rows, to_rows
from probe.stats.plan import CallPlan
from probe.stats.rows import Rows, exp_sums

__all__ = ["blocked_rows", "forward_rows"]

# Bytes of one block of centred keys and of one block of C.
_BLOCK_BYTES = 2 * 2**20


def _block_shape(batch: int, heads: int, kv: int, dim: int, length: int, keys: int,
                 budget_bytes: int) -> Tuple[int, int]:
    """(keys per block, query rows per block) of :func:`blocked_rows`: a block of
    centred keys and a block of ``C`` near ``_BLOCK_BYTES`` each (a sixteenth of a smaller
    budget), and at least 16 keys and rows (the per-block Python overhead)."""
    size = min(_BLOCK_BYTES, budget_bytes // 16)
    # C blocks of 64 rows where the key block allows it (a causal chunk's keys stop at its last row)
    width = min(keys, max(16, min(size // max(1, batch * kv * dim * 4), size // max(1, batch * heads * 64 * 4))))
    rows = min(length, max(16, size // max(1, batch * heads * width * 4)))
    return max(1, width), max(1, rows)


def blocked_rows(call: AttentionCall, valid: Optional[Tensor], scales: Sequence[float],
                          positions: Optional[Tensor], budget_bytes: int,
                          scratch: Optional[Scratch] = None) -> Tuple[List[Tensor], List[Tensor]]:
    """:func:`~probe.stats.paths.centred.centred_rows` in bounded memory at any length: no centred copy of k and no
    buffer over every key. Keys are centred a block at a time (:meth:`CentredPrep.block`);

    1. per block of keys and block of query rows, ``C = q·k̃ᵀ`` (causal entries after the row
       zeroed) adds its row sums, sums of squares and max to per-row float64 / float32 totals;
    2. with every row's max known, the rows at ``positions`` (sorted CPU indices; ``None``:
       every row) are multiplied again per block of keys, and their ``Σe``, ``Σe·D`` per scale
       add up over the blocks, with ``D = C − max C``. A recomputed ``C`` may round differently
       from step 1's (another product shape); each row's largest ``D`` is kept and the sums are
       moved onto it exactly (``Σe·e^{−σδ}``, ``(Σe·D − δΣe)·e^{−σδ}``), so that ``max P = 1/Σe``
       holds.

    Returns what :func:`~probe.stats.paths.centred.centred_rows` returns. Memory: one block of keys and two of ``C``
    (:func:`_block_shape`) and ``O(B·H·L)`` per-row floats (about a fifth of q's size at d = 64).
    """
    q = call.q
    batch, heads, length, dim = q.shape
    keys = call.k.shape[2]
    device = q.device
    scratch = scratch or Scratch(0, device)  # the blocks' buffers (probe.stats.buffers)
    prep = CentredPrep(call, valid, blocked=True, block_bytes=min(PREP_BYTES, budget_bytes // 16), scratch=scratch)
    kv, causal = prep.kv, call.causal
    width, rows = _block_shape(batch, heads, kv, dim, length, keys, budget_bytes)
    kbuf = scratch.get("kt", (batch * kv * dim * width,))
    cbuf = scratch.get("R", (batch * heads * rows * width,))
    csum = torch.zeros(batch, heads, length, dtype=torch.float64, device=device)
    sumsq = torch.zeros(batch, heads, length, dtype=torch.float64, device=device)
    cmax = torch.full((batch, heads, length), NEG, device=device)

    def product(qc: Tensor, kblk: Tensor, count: int, cols: int) -> Tensor:
        return grouped_product(qc, kblk, cbuf[: batch * heads * count * cols].view(batch, heads, count, cols))

    for k0 in range(0, keys, width):
        k1 = min(keys, k0 + width)
        first = k0 if causal else 0  # causal: row i sees keys 0 … i
        if first >= length:
            break
        kblk = prep.block(k0, k1, kbuf[: batch * kv * dim * (k1 - k0)].view(batch, kv, dim, k1 - k0))
        cols_k = torch.arange(k0, k1, device=device)
        for r0 in range(first, length, rows):
            r1 = min(length, r0 + rows)
            end = min(k1, r1) if causal else k1  # a causal chunk's keys stop at its last row
            C = product(q[:, :, r0:r1].float(), kblk[..., : end - k0], r1 - r0, end - k0)
            cut = None
            if causal and end - 1 > r0:  # some key of the block after some row
                cut = torch.arange(r0, r1, device=device).unsqueeze(-1) < cols_k[: end - k0]
                C.masked_fill_(cut, 0.0)  # masked keys are 0 in C (k̃ zeroed): only causal entries
            csum[..., r0:r1] += C.sum(-1)
            sumsq[..., r0:r1] += torch.linalg.vector_norm(C, dim=-1).double().square()
            if cut is not None:
                C.masked_fill_(cut, NEG)
            if prep.keybias is not None:
                C.add_(prep.keybias[..., k0:end])
            torch.maximum(cmax[..., r0:r1], C.amax(-1), out=cmax[..., r0:r1])
    exact = exact_rows(prep, csum, sumsq, cmax)
    cmax = torch.where(cmax <= NEG / 2, 0.0, cmax)  # a fully masked row: its exponentials from 0
    del csum, sumsq

    n, r = exact[0], exact[1]
    if positions is None:
        qsel, top, where = q, cmax, torch.arange(length)
    else:
        index = positions.to(device, non_blocking=True)
        qsel, top, where = q.index_select(2, index), cmax.index_select(2, index), positions
        n, r = n.index_select(2, index), r.index_select(2, index)
    count = qsel.shape[2]
    sums = torch.zeros(2 * len(scales), batch, heads, count, device=device)
    dmax = torch.full((batch, heads, count), NEG, device=device)
    ebuf = scratch.get("e", (batch * heads * rows * width,))
    for k0 in range(0, keys, width):
        k1 = min(keys, k0 + width)
        if causal and count and k0 > int(where[-1]):
            break
        kblk = prep.block(k0, k1, kbuf[: batch * kv * dim * (k1 - k0)].view(batch, kv, dim, k1 - k0))
        cols_k = torch.arange(k0, k1, device=device)
        for b0 in range(0, count, rows):
            b1 = min(count, b0 + rows)
            if causal and k0 > int(where[b1 - 1]):
                continue  # these rows (sorted) see none of the block's keys; later rows may
            end = min(k1, int(where[b1 - 1]) + 1) if causal else k1
            C = product(qsel[:, :, b0:b1].float(), kblk[..., : end - k0], b1 - b0, end - k0)
            if causal and end - 1 > int(where[b0]):
                at = where[b0:b1].to(device, non_blocking=True)
                C.masked_fill_(at.unsqueeze(-1) < cols_k[: end - k0], NEG)
            if prep.keybias is not None:
                C.add_(prep.keybias[..., k0:end])
            D = C.sub_(top[..., b0:b1].unsqueeze(-1))
            torch.maximum(dmax[..., b0:b1], D.amax(-1), out=dmax[..., b0:b1])
            part = exp_sums(D, D, scales, ebuf[: D.numel()].view(D.shape))
            sums[:, :, :, b0:b1] += torch.stack(part)
    delta = torch.where(dmax <= NEG / 2, 0.0, dmax)  # the recomputed rows' largest D (≈ 0)
    soft = []
    for i, sigma in enumerate(scales):
        moved = torch.exp(-sigma * delta)
        se, sed = sums[2 * i], sums[2 * i + 1]
        soft += [se * moved, (sed - delta * se) * moved]
    return exact, [n, r] + soft


def forward_rows(call: AttentionCall, plan: CallPlan, scratch: Scratch) -> Rows:
    """The centred path's :class:`Rows` over blocks of keys (the call causal also when its mask
    held the causal pattern: ``plan.causal``)."""
    call = dataclasses.replace(call, causal=plan.causal)
    exact, soft = blocked_rows(call, plan.valid, plan.floats, plan.positions, plan.budget_bytes, scratch)
    return to_rows(exact, soft, plan.floats)
