"""Pure, on-device reductions of the backward pass of attention into per-head sums of squares.

Two kinds of gradient are measured (docs/gradients.md):

* ``grad_q``, ``grad_k``, ``grad_v``: the norms of what autograd computed for the tensors the
  model passed to attention, per head (per kv head for k and v under grouped-query attention).
  :func:`head_sq` reduces one such gradient.
* ``grad_logits`` at every scale σ: the gradient the softmax passes back to its logits,

  ``∂L/∂Z^σ = P^σ ⊙ (dP − rowsum(P^σ ⊙ dP))``  with  ``dP = (∂L/∂out) · vᵀ``,

  where ``P^σ = softmax(Z^σ)`` over valid keys. ``dP`` is the gradient with respect to the
  probabilities; it depends on the output gradient and on ``v`` only, so it is *held fixed*
  across scales: the counterfactual scales answer "what would the softmax pass back, at this
  scale, for the same upstream gradient". At ``actual`` it is exactly the gradient of the
  model's logits (without attention dropout). :func:`grad_logits_stats` computes it.

Everything here is a function of tensors: no state, no host synchronization, so it runs on
``meta`` tensors. Logits are rebuilt in chunks of query rows
(:func:`probe.stats.functional.iter_chunks`), so the extra memory is bounded by a byte budget
whatever the sequence length.
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from probe.call import AttentionCall, Scale
from probe.stats.masks import simplify
from probe.stats.functional import accumulation_dtype, chunk_rows, grad_logits_shifted, iter_chunks, shiftable

__all__ = ["BACKWARD_METRICS", "grad_logits_chunk", "grad_logits_stats", "grad_scale", "head_sq"]

#: Metrics computed from the backward pass, in the order they are reported.
BACKWARD_METRICS = ("grad_logits", "grad_q", "grad_k", "grad_v")

# (B, H, rows, S) float32 buffers one backward chunk keeps alive at once: R (the next chunk's R
# is built while this one's is still referenced), valid/bias, and three reused workspaces (dP,
# P in place of Z, the gradient). Measured at L = 8192: about 6 buffers' worth of extra peak; 8
# leaves a margin.
_BACKWARD_BUFFERS = 8

# Bytes of the upcast copy of one chunk of gradient rows in head_sq: near a core's L2 cache.
_HEAD_SQ_BYTES = 2 * 2**20


def head_sq(grad: Tensor, budget_bytes: int = _HEAD_SQ_BYTES) -> Tensor:
    """Per-head sum of squares of a ``(B, H, L, d)`` gradient, shape ``(H,)``.

    ``‖g_h‖² = Σ_{b, i} ‖g[b, h, i, :]‖²``: the norm kernel reduces each row's contiguous last
    dimension in the accumulation dtype (no squared copy of ``g`` is materialized), then the
    ``(B, H, L)`` row norms are squared and summed. Rows go in chunks whose upcast copy stays
    within ``budget_bytes`` (at most ``_HEAD_SQ_BYTES``, cache-sized).

    Reducing dims ``(0, 2, 3)`` in one call was 2.5 to 4 times slower on one thread (and up to
    15 times on two) on Hugging Face's layout, a transposed view of ``(B, L, H, d)``, whose
    ``(B, L)`` dims cannot be merged (docs/performance.md, "Backward").

    Pitfall: a half-precision gradient squared in its own dtype overflows at 256, and a float32
    sum of squares overflows once entries pass ~1.8e19 (a loss scaled by 1e30 whose gradients are
    still finite) and underflows below ~1e-19: the norm's ``dtype=`` upcasts, to float64 where
    the device has it. It does so by copying its whole input first (measured: 258 MiB of peak
    memory for a 128 MiB float32 gradient in one call), hence the chunks.
    """
    acc = accumulation_dtype(grad.device)
    dtype = torch.float64 if acc == torch.float64 or grad.dtype == torch.float64 else torch.float32
    batch, heads, length, dim = grad.shape
    row_bytes = batch * heads * dim * (torch.finfo(dtype).bits // 8)
    step = max(1, min(budget_bytes, _HEAD_SQ_BYTES) // max(1, row_bytes))
    total: Optional[Tensor] = None
    for r0 in range(0, length, step):
        part = torch.linalg.vector_norm(grad[:, :, r0 : r0 + step], dim=-1, dtype=dtype).square_().sum((0, 2))
        total = part if total is None else total.add_(part)
    return (torch.zeros(heads, dtype=dtype, device=grad.device) if total is None else total).to(acc)


def _storage_order(t: Tensor) -> Tensor:
    """``t`` with its dims permuted by decreasing stride: a contiguous view when ``t`` is a
    permuted contiguous tensor (Hugging Face's transposed ``(B, L, H, d)``), so that a full
    reduction reads memory in order instead of copying ``t`` first (``aminmax`` does)."""
    order = sorted(range(t.dim()), key=lambda i: t.stride(i), reverse=True)
    return t.permute(order)


def grad_scale(grad: Tensor) -> Tensor:
    """A power of two ``2**-e`` (0-dim float32, on the device, no host sync) that brings the
    largest entry of ``grad`` into ``[1, 2)``; 1 for a zero, empty or non-finite ``grad``.

    ``∂L/∂Z`` is linear in the upstream gradient, so sums of squares computed from
    ``grad * grad_scale(grad)`` and divided by its square in float64 are the same numbers without
    the float32 overflow of a huge but finite gradient (a loss scaled by 1e30). Powers of two
    scale exactly. The largest magnitude comes from ``aminmax`` (one pass; NaN propagates):
    ``vector_norm(ord=inf)`` took 17 times as long on a CPU.
    """
    if grad.numel() == 0:
        return torch.ones((), device=grad.device)
    lo, hi = torch.aminmax(_storage_order(grad.detach()))
    exponent = torch.floor(torch.log2(torch.maximum(hi, -lo).float()))
    ok = torch.isfinite(exponent)
    return torch.where(ok, torch.exp2(-torch.where(ok, exponent, 0.0)), 1.0)


def _scale_view(scale: Scale, heads: int, like: Tensor) -> Scale:
    if isinstance(scale, Tensor):
        return scale.to(device=like.device, dtype=torch.float32).reshape(1, -1, 1, 1).expand(1, heads, 1, 1)
    return float(scale)


def _rows_times_kv(x: Tensor, kv_t: Tensor, kv_heads: int, out: Optional[Tensor] = None) -> Tensor:
    """``x @ kv_t`` with query heads grouped onto kv heads: ``(B, H, l, d) @ (B, Hk, d, S)``,
    written into ``out`` (a contiguous ``(B, H, l, S)`` buffer) when given."""
    batch, heads, rows, dim = x.shape
    groups = heads // kv_heads
    cols = kv_t.shape[-1]
    if groups == 1:
        return torch.matmul(x, kv_t, out=out)
    # (B, Hk, g·rows, d) @ (B, Hk, d, S) is (B, H, rows, S) in memory, without repeating kv
    grouped = None if out is None else out.view(batch, kv_heads, groups * rows, cols)
    res = torch.matmul(x.reshape(batch, kv_heads, groups * rows, dim), kv_t, out=grouped)
    return res.view(batch, heads, rows, cols)


def _first_cols(t: Optional[Tensor], cols: int) -> Optional[Tensor]:
    return t if t is None or t.shape[-1] == 1 else t[..., :cols]


def _workspace(buffer: Optional[Tensor], shape: Tuple[int, ...], like: Tensor) -> Tensor:
    """A ``shape`` view of the front of ``buffer`` (reused across chunks and scales: a fresh large
    tensor per op costs page faults on CPUs), or a new tensor when there is none."""
    if buffer is None:
        return torch.empty(shape, dtype=torch.float32, device=like.device)
    return buffer[: math.prod(shape)].view(shape)


def grad_logits_chunk(
    R: Tensor,
    valid: Optional[Tensor],
    bias: Optional[Tensor],
    dP: Tensor,
    scale: Scale,
    softcap: Optional[float] = None,
    work: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tensor:
    """Per-head ``Σ (∂L/∂Z^σ)²`` over one chunk of query rows, shape ``(H,)``.

    ``Z^σ = σR + A`` (``c·tanh(σR/c) + A`` with softcap ``c``), ``P = softmax(Z^σ)`` over valid
    keys and ``∂L/∂Z^σ = P ⊙ (dP − rowsum(P ⊙ dP))``. Masked entries have ``P = 0`` and so no
    gradient; a row with a single valid key has ``P = 1`` there and gradient 0.

    Args:
        R: raw dot products ``q·kᵀ`` in float32, ``(B, H, l, S)``.
        valid: boolean, broadcastable to ``R``, or ``None`` (all valid).
        bias: additive float32 bias with masked entries zeroed, broadcastable to ``R``, or ``None``.
        dP: ``(∂L/∂out)·vᵀ`` for the same rows, ``(B, H, l, S)``, float32.
        scale: σ, a float or a per-head 1-D tensor.
        softcap: the logit soft-capping constant ``c`` or ``None``.
        work: two flat float32 buffers of at least ``R.numel()`` elements to compute in (``R`` and
            ``dP`` are never written); fresh tensors when ``None``.

    Pitfall: masked entries are set to ``-inf`` before the exponential, never multiplied by 0
    (which turns a fully masked row's ``-inf`` into NaN), and a fully masked row divides by 1
    instead of 0.
    """
    shape = tuple(R.shape)
    p = _workspace(None if work is None else work[0], shape, R)
    g = _workspace(None if work is None else work[1], shape, R)
    torch.mul(R, _scale_view(scale, shape[1], R), out=p)
    if softcap is not None:
        p.div_(softcap).tanh_().mul_(softcap)
    if bias is not None:
        p.add_(bias)
    if valid is not None:
        p.masked_fill_(valid.logical_not(), -math.inf)
    m = p.amax(-1, keepdim=True)
    m = torch.where(m == -math.inf, 0.0, m)
    p.sub_(m).exp_()
    se = p.sum(-1, keepdim=True)
    p.div_(torch.where(se > 0, se, 1.0))  # P
    row = torch.mul(p, dP, out=g).sum(-1, keepdim=True)  # rowsum(P ⊙ dP)
    torch.sub(dP, row, out=g).mul_(p)  # ∂L/∂Z
    return g.mul_(g).sum((0, 2, 3))


def grad_logits_stats(
    call: AttentionCall,
    grad_output: Optional[Tensor],
    scales: Mapping[str, Optional[Scale]],
    budget_bytes: int = 64 * 2**20,
    *,
    grad_probs: Optional[Tensor] = None,
    rows: Optional[Tensor] = None,
) -> Dict[str, Tensor]:
    """``grad_logits_sq@{scale}`` for every scale: per-head sums of squares of ``∂L/∂Z^σ``.

    ``dP`` is ``grad_output · vᵀ`` or, for an eager call whose softmax output was hooked, the
    hooked gradient ``grad_probs = ∂L/∂P`` itself. One ``q·kᵀ`` and one ``dP`` per chunk of query
    rows serve every scale; scales with the same value share one pass.

    Args:
        call: the attention computation (``q``, ``k``, ``v``, bias/mask, causal, softcap).
        grad_output: ``∂L/∂out``, ``(B, H, L, dv)`` (what a hook on ``call.output`` receives), or
            ``None`` when ``grad_probs`` is given.
        scales: scale name → value. ``None`` stands for the call's own logits (``call.logits``,
            an eager call whose scale could not be recovered): ``P = softmax(call.logits)``.
        budget_bytes: extra memory one chunk may use.
        grad_probs: ``∂L/∂P`` in any layout with ``B·H·L·S`` elements (an eager softmax output
            may be ``(B·H, L, S)``).
        rows: sorted CPU positions of sampled query rows (the ``rows=`` budget, the positions
            the forward statistics used), or ``None`` for every row. Sampled, the common case
            (:func:`~probe.stats.shifted.grad_logits_shifted`) forms only those rows and reports
            Horvitz-Thompson estimates of the sums, with their variances in
            ``grad_logits_var@{scale}``, ``dP`` from ``grad_output`` or ``grad_probs`` alike;
            other calls (bias, softcap, own logits) stay exact.

    Returns:
        ``{"grad_logits_sq@{name}": (H,) tensor}`` in the accumulation dtype; empty when the call
        has no query rows or no source for ``dP``.

    Pitfall: with attention dropout *after* the softmax, ``grad_output · vᵀ`` misses the dropout
    mask and its ``1/(1-p)`` rescaling (SDPA's ``dropout_p``): the actual scale is then an
    approximation. ``grad_probs`` (eager) already contains them and is exact.
    """
    q, k = call.q, call.k
    batch, heads, length, _ = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    acc = accumulation_dtype(q.device)
    if batch * heads * length * keys > 0:
        call = simplify(call, budget_bytes)  # as the forward: a float mask as a boolean one, HF's as causal
    if grad_probs is not None:
        dprobs = grad_probs.reshape(batch, heads, length, keys)
        gs = grad_scale(dprobs)  # dP scaled to at most 2: no float32 overflow in the squares

        def dp_rows(r0: int, r1: int, cols: int, buffer: Optional[Tensor]) -> Tensor:
            return dprobs[:, :, r0:r1, :cols].float() * gs

    elif grad_output is not None and call.v is not None:
        # (B, Hk, dv, S) over a contiguous float32 v: one copy at most (a half-precision
        # transposed v was copied twice, to float32 and then to contiguous)
        vt = call.v.to(torch.float32, memory_format=torch.contiguous_format).transpose(-1, -2)
        dout = grad_output.reshape(batch, heads, length, grad_output.shape[-1])
        gs = grad_scale(dout)  # as above, applied to each chunk of dout rows

        def dp_rows(r0: int, r1: int, cols: int, buffer: Optional[Tensor]) -> Tensor:
            out = _workspace(buffer, (batch, heads, r1 - r0, cols), vt)
            return _rows_times_kv(dout[:, :, r0:r1].float() * gs, vt[..., :cols], kv_heads, out)

    else:
        return {}

    groups: Dict[object, List[str]] = {}
    own_logits: List[str] = []
    for name, value in scales.items():
        if value is None:
            own_logits.append(name)
            continue
        key = id(value) if isinstance(value, Tensor) else float(value)
        groups.setdefault(key, []).append(name)

    values = [scales[names[0]] for names in groups.values()]
    if groups and not own_logits and shiftable(call, values):  # type: ignore[arg-type]
        # the common case (no bias, no softcap, positive float scales): shared shifted logits,
        # one exp2 per scale, cache-sized chunks (probe.stats.functional.grad_logits_shifted);
        # dP from dout·vᵀ or, for an eager call, the hooked ∂L/∂P
        floats = [float(v) for v in values]  # type: ignore[arg-type]
        if grad_probs is not None:
            parts, variances = grad_logits_shifted(call, None, None, floats, budget_bytes, acc, grad_scale=gs,
                                                   positions=rows, dprobs=dprobs)
        else:
            parts, variances = grad_logits_shifted(call, dout, vt, floats, budget_bytes, acc, grad_scale=gs,
                                                   positions=rows)
        unscale = gs.to(acc).square()
        fields = {f"grad_logits_sq@{name}": part / unscale for names, part in zip(groups.values(), parts) for name in names}
        if variances is not None:
            fields.update({f"grad_logits_var@{name}": var / unscale.square()
                           for names, var in zip(groups.values(), variances) for name in names})
        return fields

    # iter_chunks sizes its chunks for the forward's live buffers; ask it for the row count that
    # keeps the backward's larger set of buffers within the budget.
    rows = max(1, budget_bytes // max(1, batch * heads * keys * 4 * _BACKWARD_BUFFERS))
    size = batch * heads * min(rows, length) * keys
    work = (torch.empty(size, dtype=torch.float32, device=q.device),
            torch.empty(size, dtype=torch.float32, device=q.device))
    dp_buffer = torch.empty(size, dtype=torch.float32, device=q.device) if grad_probs is None else None
    sums: Dict[str, Tensor] = {}
    if groups:
        forward_row_bytes = max(1, 2**40 // chunk_rows(batch, heads, keys, 2**40))
        r0 = 0
        for R, valid, bias in iter_chunks(call, rows * forward_row_bytes):
            r1 = r0 + R.shape[2]
            # Under causal masking keys after the chunk's last row are masked for all its rows:
            # P = 0 there, so they carry no gradient and are skipped (half the work).
            cols = min(keys, r1) if call.causal else keys
            if cols < keys:
                R, valid, bias = R[..., :cols], _first_cols(valid, cols), _first_cols(bias, cols)
            dP = dp_rows(r0, r1, cols, dp_buffer)
            for names in groups.values():
                part = grad_logits_chunk(R, valid, bias, dP, scales[names[0]], call.softcap, work).to(acc)
                sums[names[0]] = part if names[0] not in sums else sums[names[0]] + part
            r0 = r1
    if own_logits and call.logits is not None:
        logits = call.logits.reshape(batch, heads, length, keys)
        part_sum: Optional[Tensor] = None
        for r0 in range(0, length, rows):
            z = logits[:, :, r0 : r0 + rows].float()
            # masked entries are -inf or finfo.min in the model's own logits: exp gives 0
            dP = dp_rows(r0, min(length, r0 + rows), keys, dp_buffer)
            part = grad_logits_chunk(z, None, None, dP, 1.0, None, work).to(acc)
            part_sum = part if part_sum is None else part_sum + part
        if part_sum is not None:
            groups[None] = own_logits
            sums[own_logits[0]] = part_sum
    out: Dict[str, Tensor] = {}
    unscale = gs.to(acc).square()
    for names in groups.values():
        if names[0] in sums:
            for name in names:
                out[f"grad_logits_sq@{name}"] = sums[names[0]] / unscale
    return out
