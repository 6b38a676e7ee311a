"""Forward statistics of one call: plan → path → the one reducer → accumulator fields.

Everything here is a function of tensors: no state, no host synchronization (no ``.item()``,
no data-dependent shapes) beyond the facts the plan reads on CPUs, so it runs unchanged on
``meta`` tensors. Running state and its combination across calls, steps and ranks live in
:mod:`probe.state.accumulator`.

Notation (DESIGN.md): ``R = q @ k.T`` (raw dot products), ``A`` the additive bias with masked
entries removed, ``σ`` a scale, ``Z = σR + A`` (``c·tanh(σR/c) + A`` with softcap ``c``),
``P = softmax(Z)`` over valid keys.

Cost model (docs/performance.md): per chunk of query rows, one ``q·kᵀ`` serves every scale; the
logit moments are scale-linear (``Var(σR) = σ²Var(R)``, ``max σR = σ max R``, the min for negative
scales), so they come from one pass over ``R``; each distinct scale costs one exponential on the
sampled rows. Which path computes the rows is the plan's choice (:mod:`probe.stats.plan`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from probe.call import AttentionCall, Scale
from probe.stats.buffers import call_scratch, release
from probe.stats.paths import centred, general, key_blocks, logits, shifted
from probe.stats.plan import CallPlan, absmax, plan_call
from probe.stats.reduce import Heads, reduce_rows
from probe.stats.rows import Rows

__all__ = ["FORWARD_METRICS", "finish_fields", "forward_fields", "forward_rows", "forward_stats", "logits_stats"]

#: Metrics computed in the forward pass, in the order they are reported.
FORWARD_METRICS = ("logit_var", "logit_max", "entropy", "max_prob", "saturation", "nonfinite")

#: The module computing each path's rows (looked up per call: a test may wrap one).
PATH_MODULES = {"centred": centred, "key_blocks": key_blocks, "shifted": shifted, "general": general,
                "logits": logits}


@torch.no_grad()  # statistics never need autograd (and out= products refuse tensors that require grad)
def forward_stats(
    call: AttentionCall,
    scales: Mapping[str, Scale],
    saturation: float = 0.99,
    budget_bytes: int = 64 * 2**20,
    *,
    rows: Union[None, int, Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> Dict[str, Tensor]:
    """All forward metrics of one call, as accumulator fields (see :mod:`probe.state.accumulator`).

    One ``q @ k.T`` per chunk of query rows serves every scale; ``logit_var`` and ``logit_max``
    are derived from the moments of ``R``; scales with the same value share one softmax pass.

    Args:
        call: the attention computation (with ``logits`` and no scale: the unknown-scale path,
            at ``actual`` only).
        scales: scale name → value (``"actual"`` must be present; it also gives ``nonfinite``).
        saturation: τ, a row is saturated when its max probability is at least τ.
        budget_bytes: extra memory allowed for one call's buffers.
        rows: a budget of query rows for the exponential metrics. ``None`` (or ``N >= L``):
            every row, all statistics exact. An int ``N < L`` draws ``N`` distinct positions
            by the stratified design (:func:`~probe.stats.sampling.sample_rows`, with
            ``generator``); a 1-D tensor gives the sorted positions (drawn by that design). Only
            ``entropy``, ``max_prob`` and ``saturated`` are then computed on those rows, as
            totals estimated by the ratio of their Horvitz–Thompson sums (weights ``L_h/n_h``) to
            that of the valid rows, times the exact valid-row count ``rows``
            (:func:`~probe.stats.reduce.reduce_rows`), with ``{field}_var@{s}`` fields holding
            each total's estimated variance; ``logit_var``, ``logit_max``, the row count and
            ``nonfinite`` stay exact, on every path.
        generator: the CPU generator for ``rows=N`` (``None``: torch's global generator).

    Returns:
        Field name → per-head tensor: ``logit@{s}`` (count/mean/M2 stack), ``logit_max@{s}``,
        ``rows``, ``entropy@{s}``, ``max_prob@{s}``, ``saturated@{s}`` and ``nonfinite``; with
        sampled rows also ``entropy_var@{s}``, ``max_prob_var@{s}``, ``saturated_var@{s}``.
    """
    if _empty(call):
        return {}  # batch 0, no heads, no queries or no keys: nothing to measure
    call, plan = plan_call(call, scales, budget_bytes, rows, generator)
    return forward_fields(call, plan, saturation)


def logits_stats(logits: Tensor, saturation: float = 0.99, budget_bytes: int = 64 * 2**20) -> Dict[str, Tensor]:
    """:func:`forward_stats` of a call known only by its softmax input ``Z`` ``(B, H, L, S)``
    (any float dtype, computed in float32): the fields at ``actual``."""
    batch, heads, length, keys = logits.shape
    dummy = torch.empty(batch, heads, length, 0, device=logits.device)
    call = AttentionCall(q=dummy, k=torch.empty(batch, heads, keys, 0, device=logits.device), v=None,
                         scale=None, logits=logits)
    if logits.numel() == 0:
        return {}
    return forward_fields(*plan_call(call, {"actual": None}, budget_bytes), saturation)


@torch.no_grad()
def forward_fields(call: AttentionCall, plan: CallPlan, saturation: float = 0.99) -> Dict[str, Tensor]:
    """The accumulator fields of a planned call (:func:`~probe.stats.plan.plan_call`)."""
    rows = forward_rows(call, plan)
    return {} if rows is None else finish_fields([(rows, plan)], saturation)[0]


@torch.no_grad()
def forward_rows(call: AttentionCall, plan: CallPlan) -> Optional[Rows]:
    """The per-row statistics of a planned call (``None`` when it has nothing to measure): the
    part of :func:`forward_fields` that reads the call's tensors; :func:`finish_fields` turns
    rows into fields, also later and for several calls at once."""
    if _empty(call):
        return None
    # the chunks' buffers (probe.stats.buffers: on some paths the thread's previous call's),
    # sized for the widest chunk (blocks of keys ask for what each block needs)
    batch, heads = call.q.shape[:2]
    widest = 0 if plan.path == "key_blocks" else batch * heads * plan.step * plan.keys
    scratch = call_scratch(plan.path, widest, call.q.device)
    try:
        rows: Rows = PATH_MODULES[plan.path].forward_rows(call, plan, scratch)
        if _may_rescale(call, plan) and not math.isfinite(float(rows.m2.sum())) and _retry_finite(call, plan):
            rows = _rescaled_rows(call, plan, scratch)
    finally:
        release(scratch)
    if plan.keep and plan.positions is None:  # every row's max, for the backward (plan.kept_bytes)
        plan.carry["rmax"] = rows.top
    return rows


# The centred paths (CPUs; every logit proven at most LOGIT_BOUND = 2⁹⁰ in size) sum each row's
# squares in float32: beyond logits of ~1e19/sqrt(S) that sum overflows (an inf M2 there can only
# be that). Their call is then measured again with q and k scaled by 2⁻³² (exact: powers of two),
# so logits 2⁶⁴ times smaller, the scales 2⁶⁴ times larger (σR unchanged: the same softmax), and the
# rows scaled back in float64. A read of one sum per call, free on CPUs. The shifted and general
# paths' CPU calls likewise, when the retry is sure to be finite: q and k with
# max|q|·max|k|·d·sqrt(S) at most 2¹²⁶ (read only after an M2 came out non-finite): then |R| fits
# float32 and 2⁶⁴ times smaller its squares sum finitely.
# R's moments see neither the mask nor the bias, and a bias, a soft cap and the scales' signs see
# the same σR, so only the moments and extremes of R scale back. Larger logits keep their inf (an
# R past float32's range has no float32 max). Not on accelerators: the read would synchronize.
_PROVEN_PATHS = ("centred", "key_blocks")
_SHRINK = 2.0**-32


def _may_rescale(call: AttentionCall, plan: CallPlan) -> bool:
    """Whether this plan's call is measured again when a row M2 comes out non-finite (read on
    the host, so CPUs only: the proven paths are), given :func:`_retry_finite`."""
    return plan.path in _PROVEN_PATHS or (plan.path in ("shifted", "general") and call.q.device.type == "cpu")


def _retry_finite(call: AttentionCall, plan: CallPlan) -> bool:
    """Whether the rescaled measurement's R fits float32 and its squares sum finitely: known on
    the centred paths (every logit at most 2⁹⁰), else from ``max|q|·max|k|·d·sqrt(S) ≤ 2¹²⁶``
    (False for inf and NaN; a general call proven finite bounds σR, not R)."""
    if plan.path in _PROVEN_PATHS:
        return True
    return absmax(call.q) * absmax(call.k) * call.q.shape[-1] * math.sqrt(call.k.shape[2]) <= 2.0**126


def _rescaled_rows(call: AttentionCall, plan: CallPlan, scratch: Any) -> Rows:
    """The call's rows measured on ``q·2⁻³²``, ``k·2⁻³²`` at scales ``σ·2⁶⁴``, moments scaled back."""
    grow = _SHRINK**-2
    small = dataclasses.replace(call, q=call.q * _SHRINK, k=call.k * _SHRINK)
    again = dataclasses.replace(plan, values=tuple(v * grow if isinstance(v, Tensor) else float(v) * grow  # type: ignore[arg-type]
                                                   for v in plan.values))
    rows: Rows = PATH_MODULES[plan.path].forward_rows(small, again, scratch)
    plan.carry.update(again.carry)  # the kept exponentials are of σR itself: the backward's as they are
    return dataclasses.replace(rows, top=rows.top * grow, mean=rows.mean * grow, m2=rows.m2 * grow**2,
                               low=None if rows.low is None else rows.low * grow)


@torch.no_grad()
def finish_fields(items: Sequence[Tuple[Rows, CallPlan]], saturation: float = 0.99) -> List[Dict[str, Tensor]]:
    """The accumulator fields of each ``(rows, plan)`` (:func:`forward_rows`), in order.

    Calls whose rows reduce alike (the same batch, rows, scale groups, sampling design and
    accumulation dtype: every layer of a model, typically) are reduced together, their rows
    stacked on the head dimension: the reducer is per head, so each call's values are the ones
    it gets alone (bitwise: the reductions run over batch and rows, per head), for one pass of
    the reducer's few dozen small operations instead of one per call."""
    out: List[Optional[Dict[str, Tensor]]] = [None] * len(items)
    groups: Dict[tuple, List[int]] = {}
    for i, (rows, plan) in enumerate(items):
        groups.setdefault(_reduces_alike(rows, plan), []).append(i)
    for members in groups.values():
        first_plan = items[members[0]][1]
        # the logits path's forward takes every row (no design: its totals are sums)
        design = None if first_plan.path == "logits" else first_plan.design
        together = reduce_rows(_stack_rows([items[i][0] for i in members]), saturation, first_plan.acc, design)
        start = 0
        for i in members:
            rows, plan = items[i]
            count = rows.n.shape[1]
            heads = together if len(members) == 1 else _head_slice(together, start, start + count)
            out[i] = _fields(heads, plan, count)
            start += count
    return out  # type: ignore[return-value]


def _reduces_alike(rows: Rows, plan: CallPlan) -> tuple:
    """What must agree for calls' rows to be reduced stacked on the head dimension."""
    design = None if plan.path == "logits" or plan.design is None else id(plan.design[0])
    return (plan.path == "logits", design, plan.acc, rows.n.shape[0], rows.n.shape[2], tuple(rows.entropy.shape[:-3]),
            rows.entropy.shape[-1], rows.low is None, rows.n.device, rows.n.dtype, rows.mean.dtype, rows.top.dtype,
            rows.entropy.dtype)


def _stack_rows(parts: Sequence[Rows]) -> Rows:
    """The calls' rows stacked on the head dimension (one call: its own rows, no copy)."""
    if len(parts) == 1:
        return parts[0]

    def cat(values: Sequence[Optional[Tensor]]) -> Optional[Tensor]:
        return None if values[0] is None else torch.cat(values, dim=-2)  # type: ignore[arg-type]

    return Rows(**{f.name: cat([getattr(r, f.name) for r in parts]) for f in dataclasses.fields(Rows)})


def _head_slice(h: Heads, start: int, stop: int) -> Heads:
    return Heads(h.count[start:stop], h.mean[start:stop], h.m2[start:stop], h.top[start:stop],
                 None if h.low is None else h.low[start:stop], h.nonfinite[start:stop], h.soft[..., start:stop],
                 None if h.var is None else h.var[..., start:stop])


def _empty(call: AttentionCall) -> bool:
    batch, heads, length, _ = call.q.shape
    return batch * heads * length * call.k.shape[2] == 0


def _fields(h: Heads, plan: CallPlan, heads: int) -> Dict[str, Tensor]:
    out: Dict[str, Tensor] = {"nonfinite": h.nonfinite}
    for i, (names, value) in enumerate(zip(plan.names, plan.values)):
        moments, top = _scaled(h, 1.0 if value is None else value, heads)
        for name in names:
            out[f"logit@{name}"], out[f"logit_max@{name}"] = moments, top
            out[f"entropy@{name}"], out[f"max_prob@{name}"], out[f"saturated@{name}"] = h.soft[i, 1:].unbind(0)
            if h.var is not None:
                out[f"entropy_var@{name}"], out[f"max_prob_var@{name}"], out[f"saturated_var@{name}"] = (
                    h.var[i].unbind(0))
    out["rows"] = h.soft[0, 0]
    return out


def _scaled(h: Heads, scale: Scale, heads: int) -> Tuple[Tensor, Tensor]:
    """(count, mean, M2) and max of ``σR`` from the moments of ``R`` (scale-linear); the max of
    ``σR`` is ``σ·min R`` for ``σ < 0``: the general path keeps the min for negative and per-head
    scales (+inf stands in for it elsewhere: a NaN scale gives a NaN max)."""
    def low() -> Tensor:
        return h.low if h.low is not None else torch.full_like(h.top, math.inf)

    if isinstance(scale, Tensor):
        s = scale.to(device=h.mean.device, dtype=h.mean.dtype).reshape(-1).expand(heads)
        top = torch.where(s >= 0, s * h.top, s * low())
    else:
        s = float(scale)
        top = s * h.top if s >= 0 else s * low()
    return torch.stack([h.count, s * h.mean, s * s * h.m2]), top
