"""Query-row chunks of one attention call: ``R = q·kᵀ`` rows and their masks, sized to a budget.

A chunk's logit block ``(B, H, rows, S)`` is rebuilt from q and k (never the full ``L × S``
matrix), in float32, with grouped-query attention handled without repeating k. Chunk lengths
come from a byte budget (:func:`chunk_rows`) and, below it, from the cache size
(:func:`cache_chunk_rows`); callers also cap them at the number of rows there are.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor

from probe.call import AttentionCall
from probe.stats.buffers import Scratch

__all__ = ["MASK_BIAS", "accumulation_dtype", "all_finite", "as_4d", "cache_chunk_rows", "chunk_rows", "grouped_product",
           "kv_product", "kv_view", "minmax", "row_chunks", "rows_of", "storage_order", "DPSource"]

# How many (B, H, rows, S) float32 buffers one chunk keeps alive at once. The shifted path holds
# R (shifted in place), its masked copy, exp(σD) and one product; the general path R, Z,
# exp(Z − m) and the entropy product. Masks are bool (a quarter each); 6 covers both.
_LIVE_BUFFERS = 6

# Below the budget, chunks are also kept near cache size: large enough that the per-chunk
# operations (about 25 each) and the products' short row blocks do not dominate, small enough that
# a block and its temporaries stay in the last-level cache. 2 MiB, measured inside the real steps
# against 1 MiB (statistics time per step, arms alternating in one process): faster on every
# workload, most on the widest calls (Gemma-2 eager forward 168 → 120 ms, Llama rows=None 95 →
# 86 ms); 4 MiB no better; 0.5 MiB slower (docs/performance.md, "Chunk size, again").
_CACHE_CHUNK_BYTES = 2**21


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 for running sums wherever the device has it (MPS has not)."""
    return torch.float32 if device.type == "mps" else torch.float64


def all_finite(x: Tensor) -> bool:
    """Whether every entry of ``x`` is certainly finite, proven by one sum: NaN and ±inf
    propagate into it. On CPUs only, where reading the result costs no synchronization; elsewhere
    (and when a sum of finite values overflows) ``False``, and callers take their exact path."""
    return x.device.type == "cpu" and bool(torch.isfinite(x.sum()))


def chunk_rows(batch: int, heads: int, keys: int, budget_bytes: int) -> int:
    """Query rows per chunk so that the chunk's live buffers stay within ``budget_bytes``."""
    per_row = max(1, batch * heads * keys * 4 * _LIVE_BUFFERS)
    return max(1, budget_bytes // per_row)


def cache_chunk_rows(batch: int, heads: int, keys: int) -> int:
    """Query rows per chunk that keep one ``(B, H, rows, S)`` float32 buffer near the size of a
    core's L2 cache (at least 16 rows, so the per-chunk Python overhead stays small)."""
    return max(16, _CACHE_CHUNK_BYTES // max(1, batch * heads * keys * 4))


def storage_order(t: Tensor) -> Tensor:
    """``t`` with its dims permuted by decreasing stride: a contiguous view when ``t`` is a
    permuted contiguous tensor (Hugging Face's transposed ``(B, L, H, d)``), so that a full
    reduction reads memory in order instead of copying ``t`` first (``aminmax`` does: 32 MiB
    for q of shape (1, 8, 16384, 64) transposed, unseen by tensor counters)."""
    order = sorted(range(t.dim()), key=lambda i: t.stride(i), reverse=True)
    return t.permute(order)


def minmax(t: Tensor) -> Tuple[Tensor, Tensor]:
    """``(min, max)`` of every entry of ``t`` (NaN propagates) without a copy of ``t``: one
    ``aminmax`` pass over a contiguous (or permuted contiguous) tensor, else ``amin`` and
    ``amax`` (a slice such as k in a fused k/v projection is neither)."""
    dense = storage_order(t)
    if dense.is_contiguous():
        return torch.aminmax(dense)  # type: ignore[return-value]
    return t.amin(), t.amax()


# A transposed float32 k or v (Hugging Face's layouts) larger than this is not copied once per
# call for the products (its (B, H) dims do not flatten, so a batched product would copy it each
# time): the products then go one ``mm`` per batch and kv head, which reads it in place.
_KV_COPY_BYTES = 16 * 2**20


def kv_view(t: Tensor, scratch: Optional[Scratch] = None, name: str = "kt") -> Tuple[Tensor, bool]:
    """``(tᵀ, strided)``: ``t`` (k or v, ``(B, H_kv, S, d)``) transposed to ``(B, H_kv, d, S)``
    float32 for products, and whether it was left a strided view (see :func:`kv_product`).
    Contiguous float32: a view. A transposed float32 view larger than ``_KV_COPY_BYTES``: a view,
    strided. Otherwise one contiguous float32 copy (a half-precision tensor is converted anyway),
    into ``scratch``'s buffer ``name`` when given (a fresh copy per call costs its page faults)."""
    if t.dtype == torch.float32 and t.stride(-1) == 1 and not t.is_contiguous() \
            and t.numel() * 4 > _KV_COPY_BYTES:
        return t.transpose(-1, -2), True
    if t.dtype == torch.float32 and t.is_contiguous():
        return t.transpose(-1, -2), False
    if scratch is None:
        return t.float().contiguous().transpose(-1, -2), False
    return scratch.get(name, t.shape).copy_(t).transpose(-1, -2), False


def kv_product(x: Tensor, kv_t: Tensor, strided: bool, out: Optional[Tensor] = None) -> Tensor:
    """``x @ kv_t``, ``(B, H_kv, M, d) @ (B, H_kv, d, N)``, into ``out`` (contiguous) when given.
    ``strided`` (:func:`kv_view`): one ``bmm`` per batch element over the kv heads, reading
    ``kv_t`` in place (a batch element's heads are one stride apart and each head's matrix is
    transposed with a leading dimension of ``H·d``, which ``bmm`` takes as it is; a product over
    ``(B, H)`` at once would copy the whole of it, since the two dims do not flatten)."""
    if not strided:
        return torch.matmul(x, kv_t, out=out)
    batch, heads, rows, _ = x.shape
    if out is None:
        out = torch.empty(batch, heads, rows, kv_t.shape[-1], device=x.device, dtype=torch.float32)
    for b in range(batch):
        torch.bmm(x[b], kv_t[b if kv_t.shape[0] > 1 else 0], out=out[b])
    return out


def grouped_product(x: Tensor, kv_t: Tensor, out: Optional[Tensor] = None, strided: bool = False) -> Tensor:
    """``x @ kv_t`` with query heads grouped onto kv heads: ``(B, H, l, d) @ (B, H_kv, d, S)``
    gives ``(B, H, l, S)``, into ``out`` (contiguous) when given. The rows are laid out as
    ``(B, H_kv, g·l, d)``, so that one batched product per kv head gives ``(B, H, l, S)`` in memory
    (broadcasting k over a group dim instead makes matmul copy the repeated k in every call).
    ``strided``: ``kv_t`` left in place by :func:`kv_view` (:func:`kv_product`)."""
    batch, heads, rows, dim = x.shape
    kv_heads, cols = kv_t.shape[1], kv_t.shape[-1]
    if heads == kv_heads:
        return kv_product(x, kv_t, strided, out)
    groups = heads // kv_heads
    grouped = None if out is None else out.view(batch, kv_heads, groups * rows, cols)
    res = kv_product(x.reshape(batch, kv_heads, groups * rows, dim), kv_t, strided, grouped)
    return res.view(batch, heads, rows, cols)


def as_4d(t: Tensor) -> Tensor:
    """``t`` as 4-D: leading dims of 1 added, or extra leading dims merged into the batch."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    if t.dim() > 4:
        t = t.reshape(-1, *t.shape[-3:])
    return t


def rows_of(t: Optional[Tensor], r0: int, r1: int, pos: Optional[Tensor] = None) -> Optional[Tensor]:
    """Rows ``r0:r1`` (or positions ``pos``) of a tensor broadcastable to ``(B, H, L, S)``."""
    if t is None:
        return None
    t = as_4d(t)
    if t.shape[-2] == 1:
        return t  # broadcast over rows
    return t[..., r0:r1, :] if pos is None else t.index_select(-2, pos)


#: An additive bias at or below this masks its key (``AttentionCall``): its weight e^-100 ≈ 4e-44
#: is below float32's smallest normal number, so the key's probability vanishes unless the logits
#: themselves span more than 100. -inf, Hugging Face's finfo.min and Swin's -100 are all masks.
MASK_BIAS = -100.0


def _bias_valid(bias: Tensor) -> Tensor:
    return ~(bias <= MASK_BIAS)  # a NaN bias masks nothing: it makes its logit NaN, as in the model


def _chunk_mask(call: AttentionCall, r0: int, r1: int, pos: Optional[Tensor],
                keys: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(valid, bias) for rows ``r0:r1`` (or positions ``pos``) and keys ``0:keys``."""
    device = call.q.device
    valid = rows_of(call.mask, r0, r1, pos)
    bias = rows_of(call.bias, r0, r1, pos)
    if keys < call.k.shape[2]:
        valid = None if valid is None else valid[..., :keys]
        bias = None if bias is None else bias[..., :keys]
    if bias is not None:
        bias_ok = _bias_valid(bias)
        valid = bias_ok if valid is None else valid & bias_ok
        bias = torch.where(bias_ok, bias.float(), 0.0)
    if call.causal:
        rows = (torch.arange(r0, r1, device=device) if pos is None else pos).unsqueeze(-1)
        causal = rows >= torch.arange(keys, device=device)  # top-left aligned, as SDPA
        valid = causal if valid is None else valid & causal
    return valid, bias


def row_chunks(call: AttentionCall, step: int, positions: Optional[Tensor] = None, reuse: bool = False,
          last: Optional[Sequence[int]] = None, causal_mask: bool = True, scratch: Optional[Scratch] = None
          ) -> Iterator[Tuple[Tensor, Optional[Tensor], Optional[Tensor]]]:
    """Chunks of ``(R, valid, bias)``; with ``reuse`` every ``R`` is a view of one buffer, valid
    until the next chunk (a fresh large tensor per chunk costs page faults on CPUs). ``scratch``
    (:mod:`probe.stats.buffers`): that buffer (``"R"``) and k's copy (``"kt"``) come from it, kept
    from the thread's previous call on CPUs.

    ``last``: the last query position of each chunk, from the host (``None``: do not trim). Under
    causal masking the keys after it are masked for every row of the chunk, so ``R`` only spans
    keys ``0 .. last`` (about half the work for a causal call); callers that need all ``S``
    columns (the backward's ``dP``) leave it ``None``. ``causal_mask=False`` leaves causal
    masking to the caller (``valid`` then omits it: the shifted paths mask only the diagonal block).
    """
    q, k = call.q, call.k
    batch, heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    # (B, Hk, d, S). Copied once when k's (B, H) dims cannot be flattened into one batch dim
    # (Hugging Face's q/k/v are transposed views of (B, L, H, d)): otherwise every chunk's
    # matmul would copy it again (measured: 8 ms of a 66 ms probed BERT step).
    # Grouped-query attention: a chunk's q rows are laid out as (B, Hk, g·rows, d), so that one
    # batched product per kv head gives (B, Hk, g·rows, S), which is (B, H, rows, S) in memory;
    # broadcasting k over a group dim instead makes matmul copy the repeated k in every chunk.
    kt, strided = kv_view(k, scratch)  # a large transposed k is read in place (kv_product)
    if groups > 1 and not strided:
        kt = kt.expand(batch, -1, -1, -1)
    total = length if positions is None else positions.shape[0]
    buffer = None
    if scratch is not None and total > 0:
        buffer = scratch.get("R", (batch * heads * min(step, total) * keys,))
    elif reuse and total > 0:
        buffer = torch.empty(batch * heads * min(step, total) * keys, device=q.device)
    for r0 in range(0, total, step):
        r1 = min(total, r0 + step)
        rows = r1 - r0
        pos = None if positions is None else positions[r0:r1]
        qc = (q[:, :, r0:r1] if pos is None else q.index_select(2, pos)).float()
        cols = keys if last is None or not call.causal else max(1, min(keys, last[r0 // step] + 1))
        kc = kt if cols == keys else kt[..., :cols]
        R = None if buffer is None else buffer[: batch * heads * rows * cols].view(batch, heads, rows, cols)
        R = grouped_product(qc, kc, R, strided)
        if causal_mask:
            valid, bias = _chunk_mask(call, r0, r1, pos, cols)
        else:
            valid, bias = _chunk_mask(dataclasses.replace(call, causal=False), r0, r1, pos, cols)
        yield R, valid, bias


class DPSource:
    """``dP = ∂L/∂P`` of chunks of query rows, multiplied by ``gs`` (a power of two that keeps
    the backward's squares from overflowing): from ``dprobs`` itself (an eager call's hooked
    softmax output, ``(B, H, L, S)``, attention dropout included: each chunk copies its rows) or
    as ``dout · vᵀ`` (``vt`` from :func:`kv_view` of v, ``strided`` as it said)."""

    def __init__(self, gs: Tensor, dprobs: Optional[Tensor] = None, dout: Optional[Tensor] = None,
                 vt: Optional[Tensor] = None, strided: bool = False, taken: bool = False) -> None:
        if dprobs is None and (dout is None or vt is None):
            raise ValueError("DPSource needs dprobs, or dout and vt")
        self.gs, self.dprobs, self.dout, self.vt, self.strided = gs, dprobs, dout, vt, strided
        # taken: ``dout`` holds only the rows formed (the sampled ones, in their order), already
        # float32 and multiplied by ``gs``
        self.taken = taken

    def into(self, out: Tensor, r0: int, rows: int, cols: int, picked: Optional[Tensor]) -> Tensor:
        """Rows ``r0 .. r0 + rows`` of those formed (all rows, or the positions ``picked``) over
        keys ``:cols``, into ``out`` (``(B, H, rows, cols)`` float32)."""
        if self.dprobs is not None:
            src = self.dprobs[..., :cols]
            src = src[:, :, r0 : r0 + rows] if picked is None else src.index_select(2, picked[r0 : r0 + rows])
            return torch.mul(src, self.gs, out=out)
        assert self.dout is not None and self.vt is not None
        if self.taken:
            return grouped_product(self.dout[:, :, r0 : r0 + rows], self.vt[..., :cols], out, self.strided)
        dc = self.dout[:, :, r0 : r0 + rows] if picked is None else self.dout.index_select(2, picked[r0 : r0 + rows])
        return grouped_product(dc.float() * self.gs, self.vt[..., :cols], out, self.strided)
