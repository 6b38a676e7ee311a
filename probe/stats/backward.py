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
(:func:`probe.stats.chunks.row_chunks`), so the extra memory is bounded by a byte budget
whatever the sequence length. ``grad_logits`` follows the forward's plan
(:mod:`probe.stats.plan`): the path's gradient rows, then the one reducer
(:func:`probe.stats.reduce.grad_totals`).
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional

import torch
from torch import Tensor

from probe.call import AttentionCall, Scale
from probe.stats.buffers import call_scratch, release, take_scratch
from probe.stats.chunks import DPSource, accumulation_dtype, kv_view, minmax
from probe.stats.paths import general, logits, shifted
from probe.stats.plan import CallPlan, backward_step, plan_call
from probe.stats.reduce import grad_totals

__all__ = ["BACKWARD_METRICS", "BACKWARD_PATH", "grad_logits_stats", "grad_scale", "head_sq"]

#: Metrics computed from the backward pass, in the order they are reported.
BACKWARD_METRICS = ("grad_logits", "grad_q", "grad_k", "grad_v")

#: The gradient rows of each forward path: the centred paths' backward is the shifted one.
BACKWARD_PATH = {"centred": "shifted", "key_blocks": "shifted", "shifted": "shifted", "general": "general",
                 "logits": "logits"}

#: The module computing each backward path's rows (looked up per call: a test may wrap one).
PATH_MODULES = {"shifted": shifted, "general": general, "logits": logits}

# Bytes of the upcast copy of one chunk of gradient rows in head_sq: near a core's L2 cache.
_HEAD_SQ_BYTES = 2 * 2**20

# The largest copy of the sampled rows of ∂L/∂out taken at once (else each chunk takes its own).
_TAKEN_BYTES = 8 * 2**20


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
    memory for a 128 MiB float32 gradient in one call), hence the chunks. A float32 gradient on a
    CPU skips the copy when its heads allow it (:func:`_float32_rows`: float32 row norms, within
    ``(d + 1)·2⁻²⁴`` per row, summed in float64); a head that leaves float32's range comes here.
    """
    acc = accumulation_dtype(grad.device)
    dtype = torch.float64 if acc == torch.float64 or grad.dtype == torch.float64 else torch.float32
    if grad.device.type == "cpu" and grad.dtype == torch.float32 and dtype == torch.float64:
        fast = _float32_rows(grad)
        if fast is not None:
            return fast
    batch, heads, length, dim = grad.shape
    row_bytes = batch * heads * dim * (torch.finfo(dtype).bits // 8)
    step = max(1, min(budget_bytes, _HEAD_SQ_BYTES) // max(1, row_bytes))
    total: Optional[Tensor] = None
    # on CPUs the upcast goes into the thread's kept buffer (a fresh one costs its page faults)
    scratch = take_scratch(0, grad.device) if grad.device.type == "cpu" and grad.dtype != dtype else None
    for r0 in range(0, length, step):
        rows = grad[:, :, r0 : r0 + step]
        # in the order the rows lie in memory (Hugging Face's (B, L, H, d) under the (B, H, L, d)
        # view): the upcast is then a sequential copy, not a transposing one (measured in the BERT
        # step: 0.45 against 0.36 ms per gradient)
        order = _memory_order(rows)
        rows = rows.permute(order)
        if scratch is not None:
            rows = scratch.get("upcast", rows.shape, dtype).copy_(rows)
        part = torch.linalg.vector_norm(rows, dim=-1, dtype=dtype).square_().sum([i for i in range(3) if order[i] != 1])
        total = part if total is None else total.add_(part)
    if scratch is not None:
        release(scratch)
    return (torch.zeros(heads, dtype=dtype, device=grad.device) if total is None else total).to(acc)


def _memory_order(t: Tensor) -> List[int]:
    """The permutation of ``t``'s first three dims that reads them in the order they lie in memory
    (the last dim stays last), or the identity when the last dim is not contiguous."""
    return sorted(range(3), key=lambda i: t.stride(i), reverse=True) + [3] if t.stride(3) == 1 else [0, 1, 2, 3]


def _float32_rows(grad: Tensor) -> Optional[Tensor]:
    """:func:`head_sq` of a float32 CPU gradient from its float32 row norms, squared and summed
    in float64; ``None`` when a head's sum is not accurate that way (the float64 path must run).

    One pass over ``g``, no copy (the float64 copy of each chunk took 3.2 of the 5.9 ms per
    BERT-512 step). A row's float32 ``Σ_j g_j²`` is within ``(d + 1)·2⁻²⁴`` of its exact value
    (positive terms) plus what rounds away below float32's normal range, at most ``2⁻¹⁴⁹`` per
    square. A head is taken as it is when that absolute part, ``n·d·2⁻¹⁴⁹`` over its ``n`` rows,
    is at most ``2⁻⁴⁰`` of its sum, and the sum is finite: a head of ordinary gradients,
    zero rows (padded keys) among them. Otherwise (a head of entries below ~1e-19, a square
    above float32's range, NaN or inf) the whole gradient goes to the float64 path, which
    gives every magnitude its float64 sum and NaN and inf to their heads. On CPUs only, where
    reading that check costs no synchronization."""
    order = _memory_order(grad)
    dims = [i for i in range(3) if order[i] != 1]
    total = torch.linalg.vector_norm(grad.permute(order), dim=-1).double().square_().sum(dims)  # (H,)
    heads, dim = grad.shape[1], grad.shape[3]
    floor = (grad.numel() // max(1, heads * dim)) * dim * 2.0**-109  # n·d·2⁻¹⁴⁹ = 2⁻⁴⁰ of the sum
    # read on the host (H numbers, one read; NaN fails the comparison): four tensor operations
    # fewer per gradient than the same check as tensors, each about 10 us inside a training step
    return total if all(floor <= value < math.inf for value in total.tolist()) else None


def grad_scale(grad: Tensor) -> Tensor:
    """A power of two ``2**-e`` (0-dim float32, on the device, no host sync) that brings the
    largest entry of ``grad`` into ``[1, 2)`` (below it when that entry is subnormal: the scale is
    at most ``2¹²⁶``); 1 for a zero, empty or non-finite ``grad``.

    ``∂L/∂Z`` is linear in the upstream gradient, so sums of squares computed from
    ``grad * grad_scale(grad)`` and divided by its square in float64 are the same numbers without
    the float32 overflow of a huge but finite gradient (a loss scaled by 1e30). Powers of two
    scale exactly. The largest magnitude comes from ``aminmax`` (one pass; NaN propagates):
    ``vector_norm(ord=inf)`` took 17 times as long on a CPU.
    """
    if grad.numel() == 0:
        return torch.ones((), device=grad.device)
    lo, hi = minmax(grad.detach())
    if grad.device.type == "cpu":  # read on the host: no synchronization there, ten operations fewer
        return torch.tensor(_cpu_grad_scale(max(-lo.item(), hi.item())), dtype=torch.float32)
    exponent = torch.floor(torch.log2(torch.maximum(hi, -lo).float()))
    ok = torch.isfinite(exponent)
    # at most 2¹²⁶: a gradient of subnormal entries (below 2⁻¹²⁶, a vanishing gradient) would
    # otherwise get an infinite scale and NaN sums; its largest entry then lands below 1
    return torch.where(ok, torch.exp2(-torch.where(ok, exponent, 0.0).clamp_(min=-126)), 1.0)


def _cpu_grad_scale(largest: float) -> float:
    """:func:`grad_scale` of a gradient whose largest magnitude is ``largest`` (a float32 range
    taken as the device path's float32 takes it: past it, or NaN or 0, the scale is 1)."""
    if not 2.0**-150 < largest <= _FLOAT32_MAX:  # 0 or inf in float32, or NaN (False for NaN)
        return 1.0
    exponent = math.frexp(largest)[1] - 1  # floor(log2(largest)), exactly
    return math.ldexp(1.0, -max(exponent, -126))


_FLOAT32_MAX = torch.finfo(torch.float32).max


@torch.no_grad()  # as forward_stats: also under a backward with create_graph=True
def grad_logits_stats(
    call: AttentionCall,
    grad_output: Optional[Tensor],
    scales: Mapping[str, Optional[Scale]],
    budget_bytes: int = 64 * 2**20,
    *,
    grad_probs: Optional[Tensor] = None,
    rows: Optional[Tensor] = None,
    plan: Optional[CallPlan] = None,
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
            (:func:`~probe.stats.paths.shifted.grad_rows`) and on the general one alike
            (bias, softcap, per-head or non-positive scales, ``grad_probs``, own logits).
        plan: the forward's plan of this call (:func:`~probe.stats.plan.plan_call`, the call
            already simplified): its path, scale groups and sampled rows are used, and ``scales``
            and ``rows`` ignored. ``None``: planned here.

    Returns:
        ``{"grad_logits_sq@{name}": (H,) tensor}`` in the accumulation dtype; empty when the call
        has no query rows or no source for ``dP``.

    Pitfall: with attention dropout *after* the softmax, ``grad_output · vᵀ`` misses the dropout
    mask and its ``1/(1-p)`` rescaling (SDPA's ``dropout_p``): the actual scale is then an
    approximation. ``grad_probs`` (eager) already contains them and is exact.
    """
    if _empty(call):
        return {}
    if plan is None:
        call, plan = plan_call(call, scales, budget_bytes, rows)
    if not plan.names:
        return {}
    batch, heads, length, keys = call.q.shape[0], call.q.shape[1], plan.length, plan.keys
    if plan.path == "logits" and call.logits is None:
        return {}  # the call's own logits were asked for but it has none
    if grad_probs is None and (grad_output is None or call.v is None or call.v.shape[2] != keys):
        return {}  # no dP, or one of v's keys that is not the softmax's width (logits joined with a sink's)
    # the chunks' buffers and v's copy (probe.stats.buffers: on some paths the thread's previous call's)
    scratch = call_scratch(BACKWARD_PATH[plan.path], batch * heads * backward_step(call, plan) * keys, call.q.device)
    try:
        if grad_probs is not None:
            dprobs = grad_probs.reshape(batch, heads, length, keys)
            gs = grad_scale(dprobs)  # dP scaled to at most 2: no float32 overflow in the squares
            dp = DPSource(gs, dprobs=dprobs)
        else:
            assert grad_output is not None and call.v is not None
            # (B, Hk, dv, S) over a contiguous float32 v: one copy at most (a half-precision
            # transposed v was copied twice, to float32 and then to contiguous), none for a large
            # transposed float32 v (read in place, chunks.kv_product)
            vt, strided = kv_view(call.v, scratch, "vt")
            dout = grad_output.reshape(batch, heads, length, grad_output.shape[-1])
            positions = plan.positions
            if positions is not None and batch * heads * positions.shape[0] * dout.shape[-1] * 4 <= _TAKEN_BYTES:
                # sampled: only their rows of dout are read, so take them once (float32), scale
                # them from their own largest entry and multiply them by it in place
                taken = dout.index_select(2, positions.to(dout.device, non_blocking=True)).float()
                gs = grad_scale(taken)
                dp = DPSource(gs, dout=taken.mul_(gs), vt=vt, strided=strided, taken=True)
            else:
                gs = grad_scale(dout)  # as above, applied to each chunk of dout rows
                dp = DPSource(gs, dout=dout, vt=vt, strided=strided)
        per_row = PATH_MODULES[BACKWARD_PATH[plan.path]].grad_rows(call, plan, dp, scratch)
    finally:
        release(scratch)
    sums, variances = grad_totals(per_row, plan.acc, plan.design)
    unscale = gs.to(plan.acc).square()
    sums = sums / unscale  # every scale group at once, (G, H)
    variances = None if variances is None else variances / unscale.square()
    out: Dict[str, Tensor] = {}
    for i, names in enumerate(plan.names):
        for name in names:  # the names of one group share its values
            out[f"grad_logits_sq@{name}"] = sums[i]
            if variances is not None:
                out[f"grad_logits_var@{name}"] = variances[i]
    return out


def _empty(call: AttentionCall) -> bool:
    batch, heads, length, _ = call.q.shape
    return batch * heads * length * call.k.shape[2] == 0
