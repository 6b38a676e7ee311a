"""The plan of one call's statistics, built once and carried from the forward to its backward.

:func:`plan_call` decides, once per call, everything the statistics depend on besides the
tensors themselves: the mask in the form the fast paths take (:func:`probe.stats.masks.simplify`),
the distinct scales (:func:`group_scales`: scales with the same value share every pass), the
sampled query rows of the exponential metrics (``rows=``), the chunk lengths forward and
backward, the facts proven on the host (finite logits, a bias that cannot mask), and the path:

==============  ===============================================================================
``centred``     no bias or softcap, positive float scales, a mask that is none, key padding,
                causal or both, inputs proven finite (CPUs): :mod:`probe.stats.paths.centred`
``key_blocks``  the same over blocks of keys, when its per-call buffers would outgrow a quarter
                of the budget (:func:`blocked_keys`): :mod:`probe.stats.paths.key_blocks`
``shifted``     no bias or softcap, positive float scales, any other mask or device:
                :mod:`probe.stats.paths.shifted`
``general``     a bias, softcap, per-head or non-positive scales: :mod:`probe.stats.paths.general`
``logits``      an eager call whose scale is unknown, from its own softmax input:
                :mod:`probe.stats.paths.logits`
==============  ===============================================================================

The backward follows the forward's plan: the ``centred``, ``key_blocks`` and ``shifted`` calls
take the shifted gradient rows, the others their own path's. A plan holds no q, k or v (the
backward's record holds them weakly once its hook ran: :mod:`probe.capture.grads`), only
positions, a key mask and numbers.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import struct
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from probe.call import AttentionCall, Scale
from probe.stats.chunks import MASK_BIAS, accumulation_dtype, cache_chunk_rows, chunk_rows, minmax
from probe.stats.masks import key_validity, simplify
from probe.stats.sampling import Design, row_design, sample_rows

__all__ = ["CENTRED_MIN_SCALE", "LOGIT_BOUND", "PATHS", "KEEP_EXPS_BYTES", "SAMPLED_BYTES", "SHIFTED_MIN_SCALE",
           "CallPlan", "absmax", "backward_step", "blocked_keys", "chunk_picks", "group_scales", "inputs_finite", "plan_call", "proven_finite", "shiftable"]

PATHS = ("centred", "key_blocks", "shifted", "general", "logits")

#: Logits proven at most this large in size (:func:`inputs_finite`) let the centred path mask with
#: a finite value below every one of them.
LOGIT_BOUND = 2.0**90

#: The smallest scale the centred paths take: they mask with the finite ``-2¹⁰⁰``
#: (:data:`probe.stats.paths.centred.NEG`), whose exponential ``exp(σ·(-2¹⁰⁰ - r))`` is 0 only while
#: ``σ·2¹⁰⁰`` is far above float32's exponent range; at ``σ = 1e-41`` masked keys counted
#: (normalized entropy 1.56). Smaller scales go to the shifted path (``-inf`` masks).
CENTRED_MIN_SCALE = 2.0**-80

#: The smallest scale the shifted paths take: float32's smallest normal number (``σ·log₂e`` is a
#: float32 factor there, and one that rounds to 0 makes a masked key's ``0·(−inf)`` NaN). Smaller
#: scales go to the general path, which scales the logits before it masks them.
SHIFTED_MIN_SCALE = 2.0**-125

#: Bytes of the centred path's buffer of gathered sampled rows (and of their exponentials').
SAMPLED_BYTES = 8 * 2**20

#: Bytes of the sampled rows' exponentials one call's forward may keep for its backward
#: (:attr:`CallPlan.carry`; all scales together). The callers bound the total over a step
#: (:mod:`probe.session.recorder`: half of ``memory_budget``).
KEEP_EXPS_BYTES = 8 * 2**20

#: Query rows per backward chunk at least (within the budget): wide calls' cache-sized chunks
#: are a few rows each, and every chunk costs about 25 operations.
BACKWARD_MIN_ROWS = 64

# (B, H, rows, S) float32 buffers a backward chunk keeps alive (R, dP, e, a product, masks, the
# next chunk's rows); 8 leaves a margin (measured at L = 8192: about 6 buffers' worth of peak).
_BACKWARD_BUFFERS = 8


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """What :func:`plan_call` decided for one call (module docstring).

    Attributes:
        path: one of :data:`PATHS`.
        names: the scale names of each distinct value, the group holding ``actual`` first (it also
            gives ``nonfinite``).
        values: one value per group; ``None`` for the ``logits`` path (the call's own logits).
        length, keys: query rows ``L`` and keys ``S``.
        positions: sorted CPU positions of the rows whose exponential metrics and ``grad_logits``
            are computed (``None``: every row). The ``logits`` path's forward uses every row.
        design: their stratified design (:func:`~probe.stats.sampling.row_design`: weights,
            strata), for the estimates forward and backward; ``None`` with every row.
        step: query rows per forward chunk.
        acc: the accumulation dtype.
        budget_bytes: ``memory_budget``.
        valid, causal: the centred paths' valid keys ``(b, h, S)`` (``None``: all) and causality.
        proven, bias_masks: every logit is proven finite (the general path: at every scale,
            with the bias, :func:`proven_finite`; the centred paths: :func:`inputs_finite`), and
            whether the bias may mask a key (the general path's).
        keep: whether the forward keeps what spares the backward work (:meth:`kept_bytes`; set
            by the caller that will hook the backward, within its budget).
        carry: what the forward left for the backward (``"exps"``: each scale's sampled rows'
            exponentials and their sums, :mod:`probe.stats.paths.centred`; ``"rmax"``: every
            row's max logit, ``(B, H, L)``); the backward takes it out, so a plan holds it from
            the call's forward to its backward at most.
    """

    path: str
    names: Tuple[Tuple[str, ...], ...]
    values: Tuple[Optional[Scale], ...]
    length: int
    keys: int
    positions: Optional[Tensor]
    step: int
    acc: torch.dtype
    budget_bytes: int
    valid: Optional[Tensor] = None
    causal: bool = False
    proven: bool = False
    bias_masks: bool = True
    design: Optional[Design] = None
    keep: bool = False
    carry: Dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def kept_bytes(self, batch: int, heads: int) -> int:
        """Bytes the forward would keep for the backward (``carry``): on the centred path with
        sampled rows each distinct scale's exponentials of those rows over every key
        (``"exps"``); on the centred paths with every row each row's max (``"rmax"``, which
        spares the backward its ``amax`` and shift); 0 elsewhere."""
        if self.path not in ("centred", "key_blocks"):
            return 0
        if self.positions is None:
            return batch * heads * self.length * 4
        if self.path != "centred":
            return 0
        return len(self.values) * batch * heads * int(self.positions.shape[0]) * self.keys * 4

    @property
    def floats(self) -> List[float]:
        """The values as floats (the shifted paths' scales are positive floats)."""
        return [float(v) for v in self.values]  # type: ignore[arg-type]

    @property
    def sampled(self) -> Optional[int]:
        """How many rows are sampled (``None``: every row)."""
        return None if self.positions is None else int(self.positions.shape[0])


def _float32(value: float) -> float:
    """``value`` rounded to float32; unchanged where float32 cannot hold it (past its range,
    NaN, ±inf)."""
    rounded = struct.unpack("f", struct.pack("f", value))[0]
    return rounded if math.isfinite(rounded) else value


def group_scales(scales: Mapping[str, Optional[Scale]]) -> Tuple[Tuple[Tuple[str, ...], ...], Tuple[Optional[Scale], ...]]:
    """``(names, values)``: the scale names grouped by value (a tensor by identity), the group
    holding ``actual`` first, and one value per group.

    Floats group by their float32 value, the precision the chunks are computed in: Hugging Face
    writes the scale as ``head_dim ** -0.5``, one ulp away from ``1 / sqrt(head_dim)`` at
    ``head_dim = 32`` (``standard``), and two groups would pay a second exponential pass for
    the same float32 numbers."""
    groups: Dict[object, List[str]] = {}
    for name, value in scales.items():
        key = id(value) if isinstance(value, Tensor) or value is None else _float32(float(value))
        groups.setdefault(key, []).append(name)
    order = sorted(groups.values(), key=lambda names: "actual" not in names)
    return tuple(tuple(n) for n in order), tuple(scales[n[0]] for n in order)


def shiftable(call: AttentionCall, values: Sequence[Optional[Scale]]) -> bool:
    """Whether the shifted paths apply: no bias, no softcap, finite float scales from
    :data:`SHIFTED_MIN_SCALE` up."""
    return call.bias is None and call.softcap is None and all(
        v is not None and not isinstance(v, Tensor) and SHIFTED_MIN_SCALE <= float(v) < 1e30 for v in values
    )


def plan_call(call: AttentionCall, scales: Mapping[str, Optional[Scale]], budget_bytes: int = 64 * 2**20,
              rows: Union[None, int, Tensor] = None, generator: Optional[torch.Generator] = None,
              keep_bytes: int = 0) -> Tuple[AttentionCall, CallPlan]:
    """The call with its mask simplified (:func:`~probe.stats.masks.simplify`) and its plan.

    Args:
        call: the attention computation.
        scales: scale name → value (``None``: the call's own logits, for a call whose scale is
            unknown: then every name is measured from ``call.logits``).
        budget_bytes: ``memory_budget``, the extra memory one call may use.
        rows: ``None``, a budget ``N`` of sampled rows (drawn with ``generator`` by
            :func:`~probe.stats.sampling.sample_rows` when ``N < L``) or sorted positions.
        generator: the CPU generator for ``rows=N``.
        keep_bytes: how much the forward may keep for the call's backward (0: nothing, the
            backward recomputes): the plan keeps what :meth:`CallPlan.kept_bytes` names when it
            fits in it and in :data:`KEEP_EXPS_BYTES` (``plan.keep``).
    """
    batch, heads, length, _ = call.q.shape
    names, values = group_scales(scales)
    own_logits = (call.logits is not None and call.scale is None) or any(v is None for v in values)
    # from its own logits, the softmax's width: scores joined with logits of their own along the
    # keys (an attention sink) have more columns than k has keys
    keys = call.logits.shape[-1] if own_logits and call.logits is not None else call.k.shape[2]
    positions = _positions(rows, length, generator)
    common = dict(names=names, values=values, length=length, keys=keys, positions=positions,
                  acc=accumulation_dtype(call.q.device), budget_bytes=budget_bytes,
                  design=None if positions is None else row_design(  # drawn here: the design of (L, N)
                      positions.shape[0] if isinstance(rows, int) else positions, length))
    if own_logits:
        step = max(1, min(chunk_rows(batch, heads, keys, budget_bytes), length))
        return call, CallPlan("logits", names=(("actual",),), values=(None,), step=step,  # type: ignore[arg-type]
                              **{k: v for k, v in common.items() if k not in ("names", "values")})
    if batch * heads * length * keys > 0:
        call = simplify(call, budget_bytes)  # a float mask as a boolean one, HF's causal + padding mask as causal
    # Within the budget, also keep a chunk near the cache size (never below 16 rows), and never
    # above the rows there are: buffers (the causal block mask is step × step) are sized from it.
    step = max(1, min(chunk_rows(batch, heads, keys, budget_bytes), cache_chunk_rows(batch, heads, keys), length))
    if not shiftable(call, values):
        proven, bias_masks = proven_finite(call, values)
        return call, CallPlan("general", step=step, proven=proven, bias_masks=bias_masks, **common)  # type: ignore[arg-type]
    supported, valid, causal = key_validity(call) if inputs_finite(call) and \
        min(float(v) for v in values) >= CENTRED_MIN_SCALE else (False, None, False)  # type: ignore[arg-type]
    if not supported:
        return call, CallPlan("shifted", step=step, **common)  # type: ignore[arg-type]
    blocked = blocked_keys(call, valid, step, None if positions is None else positions.shape[0], budget_bytes)
    plan = CallPlan("key_blocks" if blocked else "centred", step=step, valid=valid, causal=causal,  # type: ignore[arg-type]
                    proven=True, **common)
    kept = plan.kept_bytes(batch, heads)
    if 0 < kept <= min(keep_bytes, KEEP_EXPS_BYTES):
        plan = dataclasses.replace(plan, keep=True)
    return call, plan


def _positions(rows: Union[None, int, Tensor], length: int, generator: Optional[torch.Generator]) -> Optional[Tensor]:
    """Sorted CPU positions of the rows whose exponential metrics are computed (None: all)."""
    if isinstance(rows, Tensor):
        positions = rows.cpu()  # given by the caller; on the host to split it into chunks
        return None if positions.shape[0] >= length else positions
    if rows is None or rows >= length:
        return None
    return sample_rows(length, rows, generator)


def chunk_picks(call: AttentionCall, plan: CallPlan) -> Tuple[Optional[List[int]], List[Optional[Tensor]]]:
    """For the forward's chunks of ``plan.step`` query rows: the last query position of each
    (causal calls, on the host; ``None``: do not trim, also on meta tensors) and each chunk's
    sampled local rows (all ``None``: every row), on the call's device."""
    length, step, device = plan.length, plan.step, call.q.device
    starts = range(0, length, step)
    last = [min(length, r0 + step) - 1 for r0 in starts] if call.causal and device.type != "meta" else None
    if plan.positions is None:
        return last, [None] * len(starts)
    # sorted positions: each chunk's are one slice (bounds found on the host, where they are),
    # made local by one subtraction per chunk
    positions = plan.positions.tolist()
    picks: List[Optional[Tensor]] = []
    lo = 0
    for r0 in starts:
        hi = bisect.bisect_left(positions, r0 + step, lo)
        local = torch.tensor([p - r0 for p in positions[lo:hi]], dtype=torch.long)
        picks.append(local if device.type == "cpu" else local.to(device, non_blocking=True))
        lo = hi
    return last, picks


def backward_step(call: AttentionCall, plan: CallPlan) -> int:
    """Query rows per backward chunk: within the budget (sampled rows on the shifted paths: a
    quarter of it, so that long rows go a few at a time and the process's extra memory, which
    also holds code and the allocator's slack, stays within the budget), near the cache size,
    never above the rows formed."""
    batch, heads = call.q.shape[:2]
    total = plan.length if plan.positions is None else plan.positions.shape[0]
    share = plan.budget_bytes
    if plan.positions is not None and plan.path in ("centred", "key_blocks", "shifted"):
        share //= 4
    per_row = max(1, batch * heads * plan.keys * 4 * _BACKWARD_BUFFERS)
    near_cache = max(BACKWARD_MIN_ROWS, cache_chunk_rows(batch, heads, plan.keys))
    return max(1, min(max(1, share // per_row), near_cache, total))


def blocked_keys(call: AttentionCall, valid: Optional[Tensor], step: int, picks: Optional[int],
                 budget_bytes: int) -> bool:
    """Whether the centred path runs over blocks of keys (:mod:`probe.stats.paths.key_blocks`):
    when the chunked variant's centred copy of k and buffers (a chunk of ``step`` query rows
    over every key; the exponentials' buffer of the same size, or with ``picks`` sampled rows
    the two buffers of gathered rows) would take more than a quarter of ``budget_bytes``. They
    grow with the number of keys, the blocks do not."""
    batch, heads, _, dim = call.q.shape
    kv, keys = call.k.shape[1], call.k.shape[2]
    if valid is not None and valid.shape[1] > 1:
        kv = heads  # a per-head mask: k per query head
    copy = batch * kv * dim * (keys + 1) * 4
    chunk = batch * heads * step * (keys + 1) * 4
    exps = chunk if picks is None else 2 * min(SAMPLED_BYTES, picks * batch * heads * keys * 4)
    return copy + chunk + exps > budget_bytes // 4


def absmax(t: Tensor) -> float:
    """``max|t|`` on the host (NaN if ``t`` has one), from its min and max: no ``|t|`` copy and
    no copy of a transposed ``t`` (:func:`~probe.stats.chunks.minmax`)."""
    low, high = (float(x) for x in minmax(t))
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def inputs_finite(call: AttentionCall) -> bool:
    """Whether every logit ``q_i·k_j`` is certainly finite and at most :data:`LOGIT_BOUND` in
    size, proven from ``max|q|·max|k|·d`` (``O(L·d)``, no pass over the logits). On CPUs only,
    where reading the result costs no synchronization; elsewhere ``False``."""
    q, k = call.q, call.k
    if q.device.type != "cpu" or q.numel() == 0 or k.numel() == 0:
        return False
    return absmax(q) * absmax(k) * q.shape[-1] <= LOGIT_BOUND  # False for NaN


def proven_finite(call: AttentionCall, values: Sequence[Optional[Scale]]) -> Tuple[bool, bool]:
    """``(proven, bias_masks)``: whether every logit ``Z = σR + A`` (``c·tanh(σR/c) + A``) of the
    call is certainly finite at every scale, from ``|R| ≤ max|q|·max|k|·d``, ``|σ|`` and the bias's
    max (valid bias entries are above -100): then no non-finite count and no non-finite softmax
    row can occur; and whether the bias may mask a key (its min is at or below
    :data:`~probe.stats.chunks.MASK_BIAS`, or unknown). On CPUs only, where reading the bounds costs
    no synchronization (``O(L·d)`` and one pass over the bias); elsewhere ``(False, True)`` and the
    general path counts and masks (no host synchronization)."""
    q, k, bias = call.q, call.k, call.bias
    if q.device.type != "cpu" or k.device.type != "cpu" or (bias is not None and bias.device.type != "cpu"):
        return False, True
    raw = absmax(q) * absmax(k) * q.shape[-1]  # no |q|, |k| copies
    sigma = 0.0
    for v in values:
        s = float(v.abs().amax()) if isinstance(v, Tensor) else abs(float(v))  # type: ignore[arg-type]
        if not s <= 2.0**100:  # NaN or huge (max() would drop a NaN)
            return False, True
        sigma = max(sigma, s)
    bound = raw * sigma  # |σR|, finite under tanh too
    top = abs(float(call.softcap)) if call.softcap is not None else bound
    masks = True
    if bias is not None:
        low, high = (float(x) for x in minmax(bias))
        if not high <= 2.0**100:  # NaN (max() would drop it) or huge
            return False, True
        masks = not low > MASK_BIAS
        top += max(-MASK_BIAS, high)
    return raw <= 2.0**100 and bound <= 2.0**100 and top <= 2.0**100, masks  # False for NaN
