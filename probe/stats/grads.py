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
(:func:`probe.stats.chunks._iter`), so the extra memory is bounded by a byte budget
whatever the sequence length.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from probe.call import AttentionCall, Scale
from probe.stats.chunks import _as_4d, _iter, cache_chunk_rows, grouped_product, kv_view, minmax
from probe.stats.masks import simplify
from probe.stats.functional import _proven_finite, accumulation_dtype, grad_logits_shifted, shiftable
from probe.stats.general import Scratch, chunk_masks, release, take_scratch
from probe.stats.sampling import row_design
from probe.stats.shifted import total_variance

_LOG2E = 1.0 / math.log(2.0)

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
    lo, hi = minmax(grad.detach())
    exponent = torch.floor(torch.log2(torch.maximum(hi, -lo).float()))
    ok = torch.isfinite(exponent)
    return torch.where(ok, torch.exp2(-torch.where(ok, exponent, 0.0)), 1.0)


def _scale_view(scale: Scale, heads: int, like: Tensor) -> Scale:
    if isinstance(scale, Tensor):
        return scale.to(device=like.device, dtype=torch.float32).reshape(1, -1, 1, 1).expand(1, heads, 1, 1)
    return float(scale)


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


@torch.no_grad()  # as forward_stats: also under a backward with create_graph=True
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
            the forward statistics used), or ``None`` for every row. Sampled, only those rows'
            logits and ``dP`` are formed, and the sums are Horvitz-Thompson estimates with
            their variances in ``grad_logits_var@{scale}``: on the shifted path
            (:func:`~probe.stats.shifted.grad_logits_shifted`) and on the general one alike
            (bias, softcap, per-head or non-positive scales, ``grad_probs``, own logits).

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
    elif grad_output is not None and call.v is not None:
        # (B, Hk, dv, S) over a contiguous float32 v: one copy at most (a half-precision
        # transposed v was copied twice, to float32 and then to contiguous), none for a large
        # transposed float32 v (read in place, chunks.kv_product)
        vt = kv_view(call.v)[0]
        dout = grad_output.reshape(batch, heads, length, grad_output.shape[-1])
        gs = grad_scale(dout)  # as above, applied to each chunk of dout rows
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
        eager = grad_probs is not None
        parts, variances = grad_logits_shifted(call, None if eager else dout, None if eager else vt, floats,
                                               budget_bytes, acc, grad_scale=gs, positions=rows,
                                               dprobs=dprobs if eager else None)
        unscale = gs.to(acc).square()
        fields = {f"grad_logits_sq@{name}": part / unscale for names, part in zip(groups.values(), parts) for name in names}
        if variances is not None:
            fields.update({f"grad_logits_var@{name}": var / unscale.square()
                           for names, var in zip(groups.values(), variances) for name in names})
        return fields

    return _general_grads(call, groups, own_logits, scales, budget_bytes, acc, gs, rows,
                          dprobs if grad_probs is not None else None,
                          None if grad_probs is not None else (dout, vt))


def _grad_rows(X: Tensor, valid: Optional[Tensor], neg: Optional[Tensor], bias: Optional[Tensor], dP: Tensor,
               scale: Scale, softcap: Optional[float], proven: bool, scratch: Scratch) -> Tensor:
    """Per row ``Σ_j (∂L/∂Z_j)²`` of a chunk, ``(B, H, l)`` float32 (:func:`grad_logits_chunk`'s
    quantity before the sum over rows), in scratch buffers: ``X`` raw logit rows (not written),
    ``valid`` / ``neg`` their masks and ``bias`` their raw bias rows
    (:func:`probe.stats.general.chunk_masks`), ``dP`` their ``∂L/∂P``.

    As the shifted path: ``e = exp(Z − m)``, ``c = Σ e·dP / Σe`` and
    ``Σ_j (P_j (dP_j − c))² = ‖e ⊙ (dP − c)‖² / (Σe)²``, with ``u = e ⊙ dP`` turned into
    ``e ⊙ (dP − c)`` in place; base 2 when ``proven`` (every ``Z`` finite, :func:`_proven_finite`),
    the mask then added, else natural units and the mask selected. A fully masked row has
    ``Σe = 0`` and contributes 0; a NaN row stays NaN."""
    heads = X.shape[1]
    z, e = scratch.get("z", X.shape), scratch.get("e", X.shape)
    unit, expo = (_LOG2E, torch.exp2) if proven else (1.0, torch.exp)
    if softcap is None:
        torch.mul(X, _scale_times(scale, heads, X, unit), out=z)
    else:
        torch.mul(X, _scale_times(scale, heads, X, 1.0 / softcap), out=z).tanh_().mul_(softcap * unit)
    if bias is not None:
        if proven:
            z.add_(bias, alpha=unit)
        else:  # a NaN or -inf bias under the mask: selected away below
            z.add_(torch.where(valid, bias.float(), 0.0) if valid is not None else bias, alpha=unit)
    if valid is not None:
        if proven:
            z.add_(neg)  # type: ignore[arg-type]
        else:
            torch.where(valid, z, torch.full((), -math.inf, device=z.device), out=z)
    m = z.amax(-1, keepdim=True)
    z.sub_(torch.where(m == -math.inf, 0.0, m))
    expo(z, out=e)
    se = e.sum(-1, keepdim=True)
    u = torch.mul(e, dP, out=z)
    c = u.sum(-1, keepdim=True) / se
    se = se.squeeze(-1)
    g2 = torch.linalg.vector_norm(u.addcmul_(e, c, value=-1), dim=-1).square() / se.square()
    return torch.where(se == 0, 0.0, g2)


def _scale_times(scale: Scale, heads: int, like: Tensor, factor: float) -> Scale:
    if isinstance(scale, Tensor):
        return (scale.to(device=like.device, dtype=torch.float32) * factor).reshape(1, -1, 1, 1).expand(1, heads, 1, 1)
    return float(scale) * factor


def _general_grads(call: AttentionCall, groups: Dict[object, List[str]], own_logits: List[str],
                   scales: Mapping[str, Optional[Scale]], budget_bytes: int, acc: torch.dtype, gs: Tensor,
                   rows: Optional[Tensor], dprobs: Optional[Tensor], dout_vt: Optional[Tuple[Tensor, Tensor]]
                   ) -> Dict[str, Tensor]:
    """The general loop of :func:`grad_logits_stats` (bias, softcap, per-head or non-positive
    scales, ``grad_probs``, the call's own logits): only the rows ``rows`` (sorted CPU positions;
    ``None``: every row) form their logits and ``dP``, in cache-sized chunks that stop at their
    last query under causal masking, with buffers reused across chunks; sampled, the sums are
    Horvitz-Thompson estimates with their variances (the forward's design,
    :mod:`probe.stats.sampling`). ``dP`` comes from ``dprobs`` (``∂L/∂P``, ``(B, H, L, S)``) or
    from ``dout · vᵀ``; both are multiplied by ``gs`` (:func:`grad_scale`)."""
    q = call.q
    batch, heads, length, _ = q.shape
    keys = call.k.shape[2]
    device = q.device
    positions = None if rows is None or rows.shape[0] >= length else rows.cpu()
    total = length if positions is None else positions.shape[0]
    if batch * heads * total * keys == 0:
        return {}
    step = min(max(1, budget_bytes // max(1, batch * heads * keys * 4 * _BACKWARD_BUFFERS)),
               cache_chunk_rows(batch, heads, keys), total)
    starts = range(0, total, step)
    picked = None if positions is None else positions.to(device, non_blocking=True)
    buffers = take_scratch(batch * heads * step * keys, device)
    # whether grad_logits_stats left vᵀ in place (kv_view again: a view of its own result)
    v_strided = dout_vt is not None and kv_view(dout_vt[1].transpose(-1, -2))[1]

    def dp_into(r0: int, n: int, cols: int) -> Tensor:
        """``dP`` of the chunk's rows (local ``r0 .. r0 + n`` of the rows formed), keys ``:cols``."""
        out = buffers.get("dp", (batch, heads, n, cols))
        pos = None if picked is None else picked[r0 : r0 + n]
        if dprobs is not None:
            src = dprobs[:, :, r0 : r0 + n] if pos is None else dprobs.index_select(2, pos)
            return out.copy_(src[..., :cols]).mul_(gs)
        assert dout_vt is not None
        dout, vt = dout_vt
        dc = (dout[:, :, r0 : r0 + n] if pos is None else dout.index_select(2, pos)).float() * gs
        return grouped_product(dc, vt[..., :cols], out, v_strided)

    def finish(per_row: List[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        y = torch.cat(per_row, dim=-1) if len(per_row) > 1 else per_row[0]
        if positions is None:
            return y.sum((0, 2), dtype=acc), None
        design = row_design(positions, length)
        weight = design[0].to(device, acc, non_blocking=True)
        return (y.to(acc) * weight).sum((0, 2)), total_variance(y.unsqueeze(0), design).to(acc)[0]

    results: Dict[str, Tuple[Tensor, Optional[Tensor]]] = {}
    if groups:
        values = [scales[names[0]] for names in groups.values()]
        proven, bias_masks = _proven_finite(call, values)  # type: ignore[arg-type]
        last = None
        if call.causal and device.type != "meta":  # the last query of each chunk, on the host
            ends = [min(total, r0 + step) - 1 for r0 in starts]
            last = ends if positions is None else [int(positions[i]) for i in ends]
        plain = dataclasses.replace(call, bias=None)  # the raw bias is masked with here
        bias = None if call.bias is None else _as_4d(call.bias)
        per_row: List[List[Tensor]] = [[] for _ in values]
        r0 = 0
        for R, valid, _ in _iter(plain, step, picked, reuse=True, last=last):
            n, cols = R.shape[2], R.shape[3]
            b = None
            if bias is not None:
                b = bias if bias.shape[-2] == 1 else (
                    bias[..., r0 : r0 + n, :] if picked is None else bias.index_select(-2, picked[r0 : r0 + n]))
                b = b[..., :cols] if b.shape[-1] > cols else b
            valid, neg = chunk_masks(valid, b, buffers, bias_masks)
            dP = dp_into(r0, n, cols)
            for i, sigma in enumerate(values):
                per_row[i].append(_grad_rows(R, valid, neg, b, dP, sigma,  # type: ignore[arg-type]
                                             call.softcap, proven, buffers))
            r0 += n
        for names, part in zip(groups.values(), per_row):
            results[names[0]] = finish(part)
    if own_logits and call.logits is not None:
        logits = call.logits.reshape(batch, heads, length, keys)
        part_rows: List[Tensor] = []
        for r0 in starts:
            n = min(total, r0 + step) - r0
            # masked entries are -inf or finfo.min in the model's own logits: exp gives 0
            z = (logits[:, :, r0 : r0 + n] if picked is None else logits.index_select(2, picked[r0 : r0 + n])).float()
            part_rows.append(_grad_rows(z, None, None, None, dp_into(r0, n, keys), 1.0, None, False, buffers))
        groups[None] = own_logits
        results[own_logits[0]] = finish(part_rows)
    release(buffers)
    out: Dict[str, Tensor] = {}
    unscale = gs.to(acc).square()
    for names in groups.values():
        if names[0] in results:
            part, var = results[names[0]]
            for name in names:
                out[f"grad_logits_sq@{name}"] = part / unscale
                if var is not None:
                    out[f"grad_logits_var@{name}"] = var / unscale.square()
    return out
