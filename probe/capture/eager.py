"""Front end for eager attention: ``softmax(q @ k.T * s + bias)`` written out op by op.

While the capture mode is active (sampled forwards only), every intercepted op that can lead
into a softmax records where its result came from, in a table keyed by ``id(tensor)`` with a
weak reference (an entry disappears with its tensor; the table is cleared when the mode exits):

* a product ``a @ b`` of two batched activations (``torch.matmul``, ``@``, ``torch.bmm``,
  ``torch.baddbmm``, ``torch.einsum("bhqd,bhkd->bhqk")``) starts a *score* record with
  ``q = a``, ``k = b.transpose(-1, -2)`` (so ``q @ k.T`` is exactly the product: no transpose has
  to be tracked) and scale 1;
* ``* s`` / ``/ c`` by a Python number, a one-element tensor (GPT-2's ``torch.full([], ...)``) or
  a per-head tensor multiply the scale (and any bias already added); ``q * s`` *before* the
  product (timm) is remembered on ``q`` and folded into the scale;
* ``+ bias`` / ``+=`` add an additive bias (T5's position bias, Hugging Face's float masks);
  ``masked_fill(m, -inf)`` and ``torch.where(m, scores, -inf)`` add a boolean mask;
* ``c * tanh(z / c)`` records a soft cap ``c`` (Gemma 2);
* casts and ``contiguous`` keep the record; ``view`` / ``reshape`` between ``(B*H, L, S)`` and
  ``(B, H, L, S)`` keep it (and recover the heads of a ``bmm`` layout).

A softmax over the last dim of a tensor with a score record makes an :class:`AttentionCall`
(kind ``"eager"``); it is emitted when its probabilities meet ``P @ v`` (``matmul``, ``bmm``,
``einsum``, through casts, dropout and views), which gives the call ``v`` and ``output`` for the
backward metrics, or else at the next softmax / when the forward ends, without ``v``. A softmax
over anything else (an output layer) is not attention and emits nothing. When an op the record
cannot describe touched the scores on the way (a ``clamp``, a constant shift, a finite
``masked_fill`` value, ...) the call is emitted at once with ``scale=None`` and ``logits`` set to
the softmax input: probe reports it at ``actual`` only and warns once.

Pitfalls: every op runs exactly as the model called it and its own result is returned, so
outputs are bitwise unchanged; reading a tensor factor never syncs (it stays a tensor); a
``bmm`` over ``(B*H, L, d)`` whose merge from ``(B, H, L, d)`` was not seen is reported with one
head per batch row; products of 2-D matrices (no batch dim) are never taken as attention.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.experiment import overrides
from probe.capture.frontend import Emit, FrontEnd
from probe.capture.eager_products import Products
from probe.capture.mode import reserve_site
from probe.once import WarnOnce
from probe.capture.eager_scores import (
    MASK_FILL,
    Meta,
    Pending,
    Scores,
    Slice,
    handler_names,
    prescale_factor,
    number,
    repeat_kv,
    rescaled,
    reshaped,
    to_call,
)

__all__ = ["EagerFrontEnd"]

_TB = torch._C.TensorBase  # tensor methods are intercepted as TensorBase methods


_HANDLERS = handler_names()


_CLAMPS = frozenset(f for f in (torch.clamp, torch.clamp_min, getattr(_TB, "clamp", None), getattr(_TB, "clamp_",
                                                                                             None),
                                 getattr(_TB, "clamp_min", None)) if f is not None)


def _version(t: Tensor) -> int:
    """Bumped by every in-place op on ``t`` or a view of it; -1 for inference tensors."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _layout(node: Scores, scores: Any) -> Any:
    """How a bias or mask applied now lifts to (B, H, L, S): the layout's dims (3 or 4), or the
    scores' shape when they have extra leading dims."""
    return tuple(scores.shape) if node.ndim > 4 and isinstance(scores, Tensor) else node.ndim


class EagerFrontEnd(Products, FrontEnd):
    """Recovers q, k, scale, bias, mask and softcap from the ops leading into a softmax."""

    funcs: Tuple[Callable[..., Any], ...] = tuple(_HANDLERS)
    applies_overrides = True  # probe.scaling: the softmax runs at the overridden scale (_rewrite)

    def __init__(self) -> None:
        self._table: Dict[int, Tuple[weakref.ref, Any]] = {}
        self._pending: List[Pending] = []
        self._warn_once = WarnOnce(RuntimeWarning)
        self._before: Optional[Tensor] = None  # the scores a ``scores[idx] = value`` overwrites

    # -- protocol --------------------------------------------------------------------------------
    def overrides_active(self) -> bool:
        return overrides.rules_active()  # variants do not reach eager attention

    def handle(
        self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
        emit: Optional[Emit],
    ) -> Any:
        if emit is None and not overrides.rules_active():
            return func(*args, **kwargs)  # only applying overrides, and none reaches eager attention
        handler = getattr(self, _HANDLERS[func])
        if handler == self._on_softmax:
            rewrite = self._rewrite(args, kwargs)
            if rewrite is not None:  # probe.scaling consulted: run flagged (never applied twice)
                run_args, run_kwargs, node = rewrite
                with overrides.applying():
                    out = func(*run_args, **run_kwargs)
                try:
                    self._on_softmax(func, args, kwargs, out, emit, node)
                except Exception as err:  # noqa: BLE001 - bookkeeping must never break the model
                    self._warn(err)
                return out
        if handler == self._on_setitem:
            self._before = self._overwritten(args)
        seen = self._seen(args)
        out = func(*args, **kwargs)
        changed = [(t, r) for t, v, r in seen if _version(t) != v]  # in place: the handler judges it
        for t, r in changed:
            self._table[id(t)] = (self._table[id(t)][0], r, _version(t))
        try:
            handler(func, args, kwargs, out, emit)
        except Exception as err:  # noqa: BLE001 - bookkeeping must never break the model
            self._warn(err)
        for t, r in changed:  # a record the handler left as it was describes t before the change
            if self._table[id(t)][1] is r:
                self._set(t, dataclasses.replace(r, unknown=True) if isinstance(r, Scores) else Meta())
        return out

    def _warn(self, err: Exception) -> None:
        self._warn_once("op", f"probe: eager attention capture skipped an op ({type(err).__name__}: {err})",
                        stacklevel=3)

    def reset(self) -> None:
        """Emit what still waits for its ``P @ v``, forget every record (the capture mode exits)."""
        try:
            self._fire_pending()
        except Exception as err:  # noqa: BLE001 - runs from the root's forward hook
            self._warn(err)
        finally:
            self._table.clear()
            self._pending = []

    def _fire_pending(self) -> None:
        # A softmax whose probabilities never met a product with v is emitted without v.
        pending, self._pending = self._pending, []
        for p in pending:
            if not p.done and isinstance(p.key, tuple) and p.key:
                self._warn_once(f"no v:{p.key[0]}", f"probe: the attention probabilities at site {p.key[0]!r} never "
                                "met their product with v (an op probe does not follow changed them after the "
                                "softmax): grad_v is not measured there", stacklevel=2)
            p.fire()

    # -- the provenance table --------------------------------------------------------------------
    def _get(self, t: Any) -> Any:
        if not isinstance(t, Tensor):
            return None
        entry = self._table.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        if entry[2] != _version(t) and isinstance(entry[1], (Meta, Scores)):
            # changed in place by an op no handler saw (``exp_``, ``copy_``, an op on a view):
            # no longer ``base * factor``; scores of unknown scale, reported at `actual`
            return dataclasses.replace(entry[1], unknown=True) if isinstance(entry[1], Scores) else None
        return entry[1]

    def _set(self, t: Any, value: Any) -> None:
        if not isinstance(t, Tensor) or value is None:
            return
        key, table = id(t), self._table

        def drop(ref: weakref.ref, key: int = key, table: Dict[int, Any] = table) -> None:
            entry = table.get(key)
            if entry is not None and entry[0] is ref:
                del table[key]

        table[key] = (weakref.ref(t, drop), value, _version(t))

    def _seen(self, args: Tuple[Any, ...]) -> List[Tuple[Tensor, int, Any]]:
        """``(tensor, version, record)`` of the args whose records (Meta, Scores) are current."""
        return [(a, _version(a), self._table[id(a)][1]) for a in args if isinstance(a, Tensor) and id(a) in self._table
                and self._table[id(a)][0]() is a and self._table[id(a)][2] == _version(a)
                and isinstance(self._table[id(a)][1], (Meta, Scores))]

    def _scores(self, *ts: Any) -> Tuple[Optional[Scores], int]:
        for i, t in enumerate(ts):
            node = self._get(t)
            if isinstance(node, Scores):
                return node, i
        return None, -1

    # -- bias and masks ----------------------------------------------------------------------------
    def _add_bias(self, out: Any, node: Scores, other: Any, coeff: Any) -> None:
        describable = isinstance(other, Tensor) and other.dtype != torch.bool and number(coeff)
        if node.unknown or node.tanh or not describable:
            self._set(out, dataclasses.replace(node, unknown=True))
            return
        self._set(out, dataclasses.replace(node, biases=node.biases + ((other, float(coeff), _layout(node, out)),)))

    def _on_add(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        if len(args) < 2:
            return
        node, i = self._scores(args[0], args[1])
        if node is None:
            if not (self._slice_plus(args, kwargs, out) or self._keep_probs(args, out)):
                self._linear_sum(func, args, kwargs, out)
            return
        alpha = kwargs.get("alpha", 1)
        other = self._get(args[1 - i])
        if isinstance(other, Scores):
            # scores plus a function of themselves (talking heads: ``s + conv1x1(s)``) scale with σ
            # too, so they are never a fixed bias
            a, b = (node, other) if i == 0 else (other, node)
            self._set(out, self._mix_sum(a, b, alpha))
            return
        if i == 1 and alpha != 1:  # a + alpha * scores
            self._set(out, dataclasses.replace(node, unknown=True))
            return
        self._add_bias(out, node, args[1 - i], alpha if i == 0 else 1)

    def _on_sub(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        node = self._get(args[0]) if args else None
        if isinstance(node, Scores) and len(args) > 1 and isinstance(self._get(args[1]), Scores):
            alpha = kwargs.get("alpha", 1)
            self._set(out, self._mix_sum(node, self._get(args[1]), -alpha if number(alpha) else None))
        elif isinstance(node, Scores) and len(args) > 1:
            self._add_bias(out, node, args[1], -kwargs.get("alpha", 1) if number(kwargs.get("alpha", 1)) else None)
        elif node is None:
            first = self._get(args[0]) if args else None
            if isinstance(first, Slice):  # a part of the scores minus a tensor (not a record): still a part
                if len(args) > 1 and self._get(args[1]) is None and isinstance(out, Tensor):
                    self._set(out, first)
                return
            self._linear_sum(func, args, kwargs, out)

    def _slice_plus(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> bool:
        """A part of the scores plus a tensor that is not a record: still a :class:`Slice`."""
        records = [self._get(a) for a in args[:2]]
        if not any(isinstance(r, Slice) for r in records):
            return False
        a, b = records
        scaled = isinstance(b, Slice) and kwargs.get("alpha", 1) != 1  # a + alpha * slice
        if isinstance(out, Tensor) and not scaled and (a is None or b is None):
            self._set(out, a if isinstance(a, Slice) else b)
        return True

    def _mask(self, out: Any, node: Scores, mask: Any, invert: bool, fill: Any) -> None:
        ok = isinstance(mask, Tensor) and mask.dtype == torch.bool and not node.unknown
        fill_t = None
        if ok and isinstance(fill, Tensor) and fill.is_floating_point():
            fill_t = fill.detach()  # compared with MASK_FILL on device at emit time, no sync
        elif not (ok and number(fill) and fill <= MASK_FILL):
            ok = False
        if not ok:
            self._set(out, dataclasses.replace(node, unknown=True))
            return
        self._set(out, dataclasses.replace(node, masks=node.masks + ((mask, invert, _layout(node, out), fill_t),)))

    def _on_masked_fill(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        node = self._get(args[0]) if args else None
        if isinstance(node, Scores):
            mask = args[1] if len(args) > 1 else kwargs.get("mask")
            value = args[2] if len(args) > 2 else kwargs.get("value")
            self._mask(out, node, mask, True, value)  # masked_fill fills where the mask is True

    def _on_where(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        if len(args) != 3:
            return
        node, i = self._scores(args[1], args[2])
        if node is not None:
            self._mask(out, node, args[0], i == 1, args[2] if i == 0 else args[1])

    def _on_tanh(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        node = self._get(args[0]) if args else None
        if isinstance(node, Scores):
            plain = not (node.unknown or node.tanh or node.biases or node.masks or node.softcap is not None)
            self._set(out, dataclasses.replace(node, tanh=True) if plain else dataclasses.replace(node, unknown=True))

    def _on_floor(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        """``torch.max(scores, finfo.min)``, ``clamp(min=...)`` (XGLM, OPT): a floor at or below
        the mask fill only touches masked entries, so the record holds; any other floor or cap
        makes the scale unknown."""
        node, i = self._scores(*args[:2])
        if node is None:
            return
        if func in _CLAMPS:
            floor, cap = (args[1:] + (None, None))[:2] if len(args) > 1 else (None, None)
            floor, cap = kwargs.get("min", floor), kwargs.get("max", cap)
        else:
            floor, cap = (args[1 - i] if len(args) == 2 and isinstance(args[1 - i], Tensor) else "no"), None
            if isinstance(floor, str):
                return  # torch.max(scores, dim): a reduction, not a floor
        value, _ = prescale_factor(floor, False) if floor is not None else (MASK_FILL, None)
        keeps = cap is None and value is not None and value <= MASK_FILL
        self._set(out, node if keeps else dataclasses.replace(node, unknown=True))

    def _on_other(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        node = self._get(args[0]) if args else None
        if isinstance(node, Scores):
            self._set(out, dataclasses.replace(node, unknown=True))

    # -- layout ------------------------------------------------------------------------------------
    # -- scores written in place ---------------------------------------------------------------------
    def _overwritten(self, args: Tuple[Any, ...]) -> Optional[Tensor]:
        record = self._get(args[0]) if args else None
        if len(args) < 3 or not isinstance(record, Scores) or record.unknown:
            return None
        with torch.no_grad():
            return args[0][args[1]].clone()

    def _on_setitem(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        """``t[idx] = value`` changed ``t`` in place. Scores written back as a part of themselves
        plus tensors (timm MViTv2: ``attn[:, :, 1:, 1:] = attn[...].view(...) + rel_h + rel_w``) or
        with a mask fill ``<= -1e4`` keep their record, the change a bias; any other write makes
        the scale unknown. A prescaled q or k is no longer ``base * factor``: its factor is dropped."""
        target = args[0] if args else None
        record, before, self._before = self._get(target), self._before, None
        if isinstance(record, Meta):
            self._set(target, Meta())
        if not isinstance(record, Scores):
            return
        value = args[2] if len(args) > 2 else None
        written = self._get(value)
        ok = before is not None and ((isinstance(written, Slice) and written.of is record)
                                     or (number(value) and value <= MASK_FILL))
        if not ok:
            self._set(target, dataclasses.replace(record, unknown=True))
            return
        with torch.no_grad():
            after = target[args[1]]
            delta = torch.zeros(target.shape, dtype=torch.float32, device=target.device)
            delta[args[1]] = torch.where(after == before, 0.0, after.float() - before.float())
        self._set(target, dataclasses.replace(record, biases=record.biases + ((delta, 1.0, _layout(record, target)),)))

    def _on_cast(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        if isinstance(out, Tensor) and args:
            record = self._get(args[0])
            # dropout changes values: only the probabilities on their way to P @ v keep theirs
            kinds = (Pending,) if func in (F.dropout, torch.dropout) else (Scores, Pending, Meta, Slice)
            if isinstance(record, Meta) and record.base is not None and out is not args[0]:
                # a prescaled q or k cast: its base is cast alike (the factor then meets tensors of out's dtype)
                record = dataclasses.replace(record, base=func(record.base, *args[1:], **kwargs))
            if isinstance(record, kinds):
                self._set(out, record)

    def _on_view(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        x = args[0] if args else None
        if not isinstance(x, Tensor) or not isinstance(out, Tensor):
            return
        record = self._get(x)
        transpose = func in (_TB.transpose, torch.transpose)
        if isinstance(record, Slice):
            self._set(out, record)
            return
        if isinstance(record, (Scores, Pending)):
            if transpose:  # moves values (even when the shape stays, L == S)
                if isinstance(record, Scores) and x.dim() == out.dim():
                    self._set(out, dataclasses.replace(record, unknown=True))
                return
            if isinstance(record, Scores):
                self._set(out, reshaped(record, x, out))
            elif x.shape[-2:] == out.shape[-2:]:  # probabilities viewed between layouts
                self._set(out, record)
            return
        if transpose:
            if isinstance(record, Meta) and record.base is not None:
                self._set(out, dataclasses.replace(record, base=func(record.base, *args[1:], **kwargs),
                                                   merged=None, src=None, whole=None, kv=None))
            elif x.dim() in (3, 4) and len(args) == 3 and all(isinstance(a, int) for a in args[1:]):
                if {args[1] % x.dim(), args[2] % x.dim()} == {x.dim() - 2, x.dim() - 1}:
                    self._set(out, Meta(src=x))
            return
        if record is None and x.dim() == 5 and out.dim() == 4 and x.stride(2) == 0:
            self._set(out, repeat_kv(x, out))
            return
        merged = None
        if x.dim() == 4 and out.dim() == 3 and out.shape[0] == x.shape[0] * x.shape[1] and out.shape[1:] == x.shape[2:]:
            merged = (x.shape[0], x.shape[1])
        if isinstance(record, Meta) and record.base is not None:
            base = record.base.reshape(out.shape) if out.shape != x.shape else record.base
            self._set(out, dataclasses.replace(record, base=base, merged=merged or record.merged,
                                               src=None, whole=None, kv=None))
        elif merged is not None:
            self._set(out, Meta(merged=merged, whole=x))

    # -- the softmax -------------------------------------------------------------------------------
    def _rewrite(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any], Optional[Scores]]]:
        """``probe.scaling`` on a softmax over recognised scores (:func:`probe.experiment.overrides.lookup`):
        ``None`` when not consulted; else (args, kwargs, record) to run and record, the softmax
        input rewritten by :func:`~probe.capture.eager_scores.rescaled` when the scale changes; a
        site the records cannot describe (soft cap, unknown op) is left unchanged."""
        x = args[0] if args else kwargs.get("input")
        node = self._get(x)
        if not isinstance(node, Scores) or not isinstance(x, Tensor):
            return None
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(dim, int) or dim not in (-1, x.dim() - 1):
            return None
        describable = not (node.unknown or node.tanh or node.softcap is not None)
        change = overrides.lookup(node.q.shape[1], node.head_dim or node.q.shape[-1], x, variants=False, describable=describable)
        if change is None:
            return None
        if change.scale is None:
            return args, kwargs, None
        z, record = rescaled(node, x, change.scale)
        if args:
            return (z, *args[1:]), kwargs, record
        return args, {**kwargs, "input": z}, record

    def _on_softmax(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any,
                    record: Optional[Scores] = None) -> None:
        x = args[0] if args else kwargs.get("input")
        node = record if record is not None else self._get(x)
        if not isinstance(node, Scores) or not isinstance(x, Tensor):
            return  # not over q·kᵀ: an output layer, a router, ...
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(dim, int) or dim not in (-1, x.dim() - 1):
            return
        self._fire_pending()
        if emit is None:
            return  # applying overrides only: nothing is recorded
        call = to_call(node, x)
        if call.scale is None or not isinstance(out, Tensor):
            emit(call)  # unknown scale: no counterfactual gradients either, so no need for v
            return
        call = dataclasses.replace(call, probs=out)  # its gradient is dP itself: exact under dropout too
        # named after the module running now, which ran the softmax, whenever P·v comes
        pending = Pending(call, node.merged, emit, reserve_site())
        self._pending.append(pending)
        self._set(out, pending)
