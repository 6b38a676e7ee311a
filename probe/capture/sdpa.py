"""Front end for ``F.scaled_dot_product_attention``, and how it applies overrides.

Overrides (:mod:`probe.experiment.overrides`: ``probe.scaling``, the variants) are applied here: a float
scale is passed as SDPA's ``scale``; a per-head scale ``s_h`` by scaling ``q`` per head,
``q * (s_h / s_ref)``, and calling SDPA with ``scale=s_ref`` (``s_ref`` the call's own scale or a
variant's reference), so the factor is exactly 1.0 when ``s_h == s_ref`` (bitwise-identical
outputs; otherwise results match a per-head SDPA call to rounding); a variant's bias is folded
into one float ``attn_mask`` with the model's mask and ``is_causal`` (SDPA forbids a mask with
``is_causal``). The call is recorded with the original ``q`` and the effective scale.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.experiment import overrides
from probe.call import AttentionCall
from probe.capture.frontend import Emit, FrontEnd
from probe.capture.sites import live_modules

__all__ = ["SDPAFrontEnd", "bind_sdpa", "sdpa_call"]

_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def bind_sdpa(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """SDPA's arguments by name (positional ones bound as SDPA binds them)."""
    bound = dict(zip(_PARAMS, args))
    bound.update(kwargs)
    return bound


def _to_4d(t: Tensor) -> Tensor:
    # SDPA takes (N, ..., H, L, E); a 3-D input has no head dim: one head.
    if t.dim() == 3:
        return t.unsqueeze(1)
    if t.dim() > 4:
        return t.reshape(-1, *t.shape[-3:])
    return t


def _rows(t: Tensor, entries: int, pos: Tensor) -> Tensor:
    """Batch entries ``0 .. entries-1`` and query rows ``pos`` of a mask broadcastable to (B, H, L, S)."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    t = t.reshape(-1, *t.shape[-3:]) if t.dim() > 4 else t
    t = t[:entries] if t.shape[0] > 1 else t
    return t.index_select(-2, pos) if t.shape[-2] > 1 else t


def rerun_rows(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool, scale: Any,
               ) -> Callable[[int, Tensor], Tensor]:
    """``AttentionCall.rerun``: SDPA on rows ``pos`` of batch entries ``0 .. entries-1`` of 4-D
    ``q``, ``k``, ``v``, with the call's mask (boolean or additive) and causality, without
    dropout: what the call computed before its dropout, for the check of the reconstruction."""

    def rerun(entries: int, pos: Tensor) -> Tensor:
        rows = _rows(mask, entries, pos) if mask is not None else None
        if causal:  # top-left aligned, as SDPA's is_causal, at the rows' own positions
            keep = pos.unsqueeze(-1) >= torch.arange(k.shape[-2], device=pos.device)
            rows = keep if rows is None else (rows & keep if rows.dtype == torch.bool
                                              else rows.masked_fill(~keep, float("-inf")))
        q_rows, own = q[:entries].index_select(2, pos), scale
        if isinstance(scale, Tensor):  # a per-head scale (probe.scaling): on q, as the override runs it
            q_rows, own = q_rows * scale.to(q_rows.dtype).reshape(-1, 1, 1), 1.0
        return F.scaled_dot_product_attention(q_rows, k[:entries], v[:entries], rows, scale=own,
                                              enable_gqa=q.shape[1] != k.shape[1])

    return rerun


def _packed_groups(q: Tensor, k: Tensor, mask: Any, causal: bool) -> int:
    """``g`` when the call is Hugging Face's ``pack_gqa`` (transformers' SDPA attention, one query
    token under grouped-query attention with a mask): ``q`` ``(B, H, 1, d)`` reshaped to
    ``(B, H/g, g, d)``, so that SDPA runs on the kv heads without repeating k and v. Its "heads"
    are then the kv heads and its rows the query heads; recorded as is, a site's decoding steps
    would have ``H/g`` heads where its prompt had ``H``. Known from the running module's
    ``num_key_value_groups`` (``g``) and its config's ``num_attention_heads``; 0 otherwise."""
    modules = live_modules()
    groups = getattr(modules[0], "num_key_value_groups", None) if modules else None
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 2 or causal:
        return 0
    if q.shape[1] != k.shape[1] or q.shape[2] != groups:
        return 0
    heads = getattr(getattr(modules[0], "config", None), "num_attention_heads", None)
    if not isinstance(heads, int) or heads != q.shape[1] * groups:  # (g rows of a call that is not packed: as they are)
        return 0
    rows_of_its_own = isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[2] != 1
    if rows_of_its_own and (mask.shape[1], mask.shape[2]) != (q.shape[1], groups):
        return 0  # a mask with rows of its own that are not the packed heads
    return groups


def _bound_groups(bound: Dict[str, Any]) -> int:
    """:func:`_packed_groups` of a bound SDPA call (0 unless q and k are 4-D tensors)."""
    q, k = bound.get("query"), bound.get("key")
    if not isinstance(q, Tensor) or not isinstance(k, Tensor) or q.dim() != 4 or k.dim() != 4:
        return 0
    return _packed_groups(q, k, bound.get("attn_mask"), bool(bound.get("is_causal", False)))


def _unpacker(groups: int) -> Callable[[Tensor], Tensor]:
    """``(B, H/g, g, n)`` → ``(B, H, 1, n)``: the inverse of ``pack_gqa``'s reshape (head
    ``h = j·g + r`` is row ``r`` of kv head ``j``)."""
    return lambda t: t.reshape(t.shape[0], t.shape[1] * groups, 1, t.shape[-1])


def sdpa_call(args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Optional[Tensor],
              groups: Optional[int] = None) -> Optional[AttentionCall]:
    """Normalize one SDPA call's arguments; ``None`` when it is not a tensor call we understand.
    ``groups``: :func:`_packed_groups` of the call when the caller knows it (``None``: found here)."""
    b = bind_sdpa(args, kwargs)
    q, k, v = b.get("query"), b.get("key"), b.get("value")
    if not all(isinstance(t, Tensor) for t in (q, k, v)) or q.dim() < 3:
        return None
    q4, k4, v4 = _to_4d(q), _to_4d(k), _to_4d(v)
    if q4.shape[1] % k4.shape[1]:
        return None  # SDPA itself has rejected this call already
    mask = b.get("attn_mask")
    bias = None
    if isinstance(mask, Tensor) and mask.dtype != torch.bool:
        bias, mask = mask, None
    elif not isinstance(mask, Tensor):
        mask = None
    scale = b.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])  # SDPA's default, 1/sqrt(E)
    out = _to_4d(output) if isinstance(output, Tensor) and output.dim() >= 3 else output
    # a 3-D or 5-D layout is recorded as a 4-D view: hooks go on the model's own tensors
    own = {"q": q, "k": k, "v": v, "output": output}
    grad_of = {n: (t, _to_4d) for n, t in own.items() if isinstance(t, Tensor) and t.dim() not in (4,) and t.dim() >= 3}
    if groups is None:
        groups = _packed_groups(q4, k4, b.get("attn_mask"), bool(b.get("is_causal", False)))
    if groups:  # one query token per head, the heads of each kv head packed into its rows: unpacked
        unpack = _unpacker(groups)
        q4, out = unpack(q4), unpack(out) if isinstance(out, Tensor) else out
        mask, bias = (None if m is None else unpack(m) if m.dim() == 4 and m.shape[1] > 1 else m for m in (mask, bias))
        grad_of.update({n: (t, lambda g, f=grad_of.get(n, (None, _to_4d))[1]: unpack(f(g)))
                        for n, t in (("q", q), ("output", output)) if isinstance(t, Tensor)})
    causal = bool(b.get("is_causal", False))
    rerun = None
    if float(b.get("dropout_p") or 0.0) > 0.0:  # the output carries dropout: check against a rerun without it
        raw = b.get("attn_mask") if isinstance(b.get("attn_mask"), Tensor) else None
        rerun = rerun_rows(q4, k4, v4, raw, causal, b.get("scale"))
    return AttentionCall(
        q=q4, k=k4, v=v4, scale=scale, bias=bias, mask=mask, causal=causal,
        output=out, kind="sdpa", grad_of=grad_of or None, rerun=rerun,
    )


def traced(call: AttentionCall, bound: Dict[str, Any], prescaled: Callable[[Tensor], Any]) -> AttentionCall:
    """``call`` with scalar factors applied to q or k before SDPA (``q = q_proj(h) * s`` then
    ``scale=1``: OPT, Whisper) taken out of q / k and into the scale, as the eager front end
    does; ``prescaled(t)`` gives ``(base, factor, tensor factor, how)`` for such a tensor, or
    ``(None, 1.0, None, why)`` when an op probe does not model touched it after a factor: the
    call's scale is then unknown (``AttentionCall.scale_unknown``, `actual` only)."""
    how = []
    grad_of = dict(call.grad_of or {})
    fields: Dict[str, Any] = {"scale": call.scale}
    for name, arg in (("q", "query"), ("k", "key")):
        found = prescaled(bound.get(arg))
        if found is None:
            continue
        base, f, f_t, text = found
        if base is None:
            fields["scale_unknown"] = text
            continue
        if tuple(base.shape) != tuple(bound[arg].shape):
            continue
        own = bound[arg]
        factor: Any = f_t if f_t is not None else f
        fields[name] = _to_4d(base)
        fields["scale"] = factor * fields["scale"]
        grad_of[name] = (own, lambda g, factor=factor: _to_4d(g) * factor)
        how.append(f"{name} {text}")
    if not how and "scale_unknown" not in fields:
        return call
    return dataclasses.replace(call, grad_of=grad_of, scale_from=("; ".join(how) + " before SDPA") if how else None,
                               **fields)


def _fold_masks(mask: Any, bias: Tensor, causal: bool, q: Tensor, k: Tensor) -> Tensor:
    """One float mask: the model's mask (bool or additive), causal, plus the variant's bias."""
    if causal:
        # SDPA forbids attn_mask with is_causal: fold top-left causal (tril) into the float mask.
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = keep if mask is None else mask
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, float("-inf"))  # a Python scalar: no host-to-device copy
    return mask + bias


def apply_override(bound: Dict[str, Any], change: overrides.Override, groups: int = 0
                   ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(kwargs to run, kwargs to record) of an SDPA call under ``change``: the run rescales q per
    head or passes the new float ``scale``; the record keeps the original q and the effective
    scale (a float or a per-head tensor), with the combined mask. ``groups``: the call packs
    ``groups`` query heads into each kv head's rows (:func:`_packed_groups`): per-head values go
    to those rows."""
    q, k = bound["query"], bound["key"]
    own = bound.get("scale")
    own_scale = 1.0 / math.sqrt(q.shape[-1]) if own is None else float(own)
    run, record = dict(bound), dict(bound)
    new = change.scale
    if isinstance(new, Tensor):
        reference = change.reference if change.reference is not None else own_scale
        reference = reference if reference != 0 else 1.0
        run["query"] = q * (new.to(device=q.device, dtype=q.dtype).reshape(-1, max(1, groups), 1) / reference)
        if reference != own_scale:  # else keep the call's own `scale` (None stays None: same kernel path)
            run["scale"] = reference
        record["scale"] = new.detach()
    elif new is not None:
        run["scale"] = record["scale"] = float(new)
    if change.bias is not None:
        bias = change.bias if not groups else change.bias.reshape(1, q.shape[1], groups, change.bias.shape[-1])
        mask = _fold_masks(bound.get("attn_mask"), bias, bool(bound.get("is_causal", False)), q, k)
        run["attn_mask"], run["is_causal"] = mask, False
        record["attn_mask"], record["is_causal"] = mask.detach(), False
    return run, record


def lookup_sdpa(bound: Dict[str, Any], groups: int = 0) -> Optional[overrides.Override]:
    """:func:`probe.experiment.overrides.lookup` for one bound SDPA call (``None``: not consulted);
    ``groups``: its query heads packed into rows (:func:`_packed_groups`)."""
    q, k = bound.get("query"), bound.get("key")
    if not isinstance(q, Tensor) or not isinstance(k, Tensor) or q.dim() < 3:
        return None
    heads = (q.shape[-3] if q.dim() >= 4 else 1) * max(1, groups)
    return overrides.lookup(heads, q.shape[-1], q, keys=k.shape[-2])


class SDPAFrontEnd(FrontEnd):
    """Intercepts ``F.scaled_dot_product_attention``: the model's own call runs unchanged,
    unless an override (``probe.scaling``, a variant) applies; then the rewritten call runs and
    is recorded with its effective scale. ``emit=None``: apply overrides, record nothing."""

    funcs = (F.scaled_dot_product_attention,)
    applies_overrides = True
    #: ``prescaled(tensor)``: the eager front end's record of a scalar factor on q or k, if any
    prescaled: Optional[Callable[[Tensor], Any]] = None

    def handle(
        self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
        emit: Optional[Emit],
    ) -> Any:
        bound = bind_sdpa(args, kwargs)
        groups = _bound_groups(bound)
        change = lookup_sdpa(bound, groups)
        if change is None:
            output = func(*args, **kwargs)
        else:
            run, record = apply_override(bound, change, groups) if change.changes else (kwargs, kwargs)
            with overrides.applying():  # consulted: never applied (or counted) again below
                output = func(**run) if change.changes else func(*args, **kwargs)
            if change.changes:
                args, kwargs = (), record
        if emit is not None:
            call = sdpa_call(args, kwargs, output, groups)  # (an override's record packs as the call did)
            if call is not None and self.prescaled is not None and change is None:
                call = traced(call, bound, self.prescaled)
            if call is not None:
                emit(call)
        return output
