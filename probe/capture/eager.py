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
from torch import Tensor, nn

from probe import overrides
from probe.capture.frontend import Emit, FrontEnd
from probe.once import WarnOnce
from probe.capture.eager_scores import (
    MASK_FILL,
    Meta,
    Pending,
    Scores,
    factor,
    handler_names,
    heads_of,
    number,
    permuted,
    repeat_kv,
    rescaled,
    reshaped,
    scaled,
    to_call,
)

__all__ = ["EagerFrontEnd"]

_TB = torch._C.TensorBase  # tensor methods are intercepted as TensorBase methods


_HANDLERS = handler_names()


class EagerFrontEnd(FrontEnd):
    """Recovers q, k, scale, bias, mask and softcap from the ops leading into a softmax."""

    funcs: Tuple[Callable[..., Any], ...] = tuple(_HANDLERS)
    applies_overrides = True  # probe.scaling: the softmax runs at the overridden scale (_rewrite)

    def __init__(self) -> None:
        self._table: Dict[int, Tuple[weakref.ref, Any]] = {}
        self._pending: List[Pending] = []
        self._warn_once = WarnOnce(RuntimeWarning)

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
        out = func(*args, **kwargs)
        try:
            handler(func, args, kwargs, out, emit)
        except Exception as err:  # noqa: BLE001 - bookkeeping must never break the model
            self._warn(err)
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
            p.fire()

    # -- the provenance table --------------------------------------------------------------------
    def _get(self, t: Any) -> Any:
        if not isinstance(t, Tensor):
            return None
        entry = self._table.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _set(self, t: Any, value: Any) -> None:
        if not isinstance(t, Tensor) or value is None:
            return
        key, table = id(t), self._table

        def drop(ref: weakref.ref, key: int = key, table: Dict[int, Any] = table) -> None:
            entry = table.get(key)
            if entry is not None and entry[0] is ref:
                del table[key]

        table[key] = (weakref.ref(t, drop), value)

    def _scores(self, *ts: Any) -> Tuple[Optional[Scores], int]:
        for i, t in enumerate(ts):
            node = self._get(t)
            if isinstance(node, Scores):
                return node, i
        return None, -1

    # -- products ----------------------------------------------------------------------------------
    def _start(self, a: Any, b: Any, out: Any, scale: float = 1.0, k: Optional[Tensor] = None) -> Optional[Scores]:
        """A score record for ``out = a @ b`` when both are batched activations (``k``: the
        model's own ``b.transpose(-1, -2)`` when the caller knows it)."""
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(out, Tensor)):
            return None
        if a.dim() != b.dim() or a.dim() not in (3, 4) or isinstance(a, nn.Parameter) or isinstance(b, nn.Parameter):
            return None
        ma, mb = self._get(a), self._get(b)
        if isinstance(ma, Meta) and ma.base is not None:
            a, scale = ma.base, scale * ma.factor
        if isinstance(mb, Meta) and mb.base is not None:
            b, scale = mb.base, scale * mb.factor
        q = a
        # k is the model's own tensor when kᵀ was made by a transpose we saw (grad hooks need it)
        if k is None:
            k = mb.src if isinstance(mb, Meta) and mb.src is not None else b.transpose(-1, -2)
        merged = None
        if a.dim() == 3:
            merged = ma.merged if isinstance(ma, Meta) else None
            if merged is not None and q.shape[0] == k.shape[0] == merged[0] * merged[1]:
                # the model's own 4-D q and k where seen (their gradients reach the grad hooks)
                q = self._whole(q, merged)
                k = self._whole(k, merged)
            else:
                merged = None
                q, k = q.unsqueeze(1), k.unsqueeze(1)
        k = self._unrepeated(k)
        if k.shape[0] not in (1, q.shape[0]) or q.shape[1] % k.shape[1]:
            return None
        return Scores(q=q, k=k, ndim=out.dim(), merged=merged, scale=scale)

    def _unrepeated(self, t: Tensor) -> Tensor:
        """The kv-head tensor behind a ``repeat_kv`` copy (grouped-query attention), else ``t``."""
        meta = self._get(t)
        return meta.kv if isinstance(meta, Meta) and meta.kv is not None else t

    def _whole(self, t: Tensor, merged: Tuple[int, int]) -> Tensor:
        meta = self._get(t)
        if isinstance(meta, Meta) and meta.whole is not None and meta.base is None:
            return meta.whole
        return t.reshape(merged[0], merged[1], *t.shape[1:])

    def _on_matmul(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        a = args[0] if args else kwargs.get("input")
        b = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
        probs = self._get(a)
        if isinstance(probs, Pending):  # P @ v: the call is complete
            if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(out, Tensor)):
                return
            if a.dim() == b.dim() == out.dim() in (3, 4):
                probs.fire(self._unrepeated(heads_of(b, probs.merged)), heads_of(out, probs.merged))
            return
        self._set(out, self._start(a, b, out))

    def _on_baddbmm(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        if len(args) < 3:
            return
        bias, beta, alpha = args[0], kwargs.get("beta", 1), kwargs.get("alpha", 1)
        if not (number(beta) and number(alpha)):
            return
        node = self._start(args[1], args[2], out, float(alpha))
        if node is not None and beta != 0 and isinstance(bias, Tensor):
            node = dataclasses.replace(node, biases=((bias, float(beta), 3),))
        self._set(out, node)

    def _on_einsum(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        if not args or not isinstance(args[0], str):
            return
        ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        eq = args[0].replace(" ", "")
        if len(ops) != 2 or "->" not in eq or "." in eq:
            return
        ins, res = eq.split("->")
        sa, sb = ins.split(",") if ins.count(",") == 1 else ("", "")
        if len(sa) != len(sb) or len(sa) not in (3, 4) or len(res) != len(sa):
            return
        batch, qi, ki = res[:-2], res[-2], res[-1]
        d = set(sa) & set(sb) - set(res)
        if len(d) != 1 or qi not in sa or qi in sb or ki not in sb or ki in sa or any(c not in sa + sb for c in batch):
            return
        if not all(c in sa and c in sb for c in batch):
            return
        di = next(iter(d))
        probs = self._get(ops[0])
        if isinstance(probs, Pending):  # einsum("bhqk,bhkd->bhqd", P, v), any letters
            # here di is the key letter (contracted) and ki the value feature letter
            v = permuted(ops[1], [sb.index(c) for c in batch + di + ki])
            if isinstance(out, Tensor) and v.dim() == out.dim():
                probs.fire(heads_of(v, probs.merged), heads_of(out, probs.merged))
            return
        a = permuted(ops[0], [sa.index(c) for c in batch + qi + di])
        k = permuted(ops[1], [sb.index(c) for c in batch + ki + di])
        self._set(out, self._start(a, k.transpose(-1, -2), out, k=k))

    # -- scale -------------------------------------------------------------------------------------
    def _on_mul(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        if len(args) < 2:
            return
        node, i = self._scores(args[0], args[1])
        if node is None:
            self._prescale(args[0], args[1], out)
            return
        f = factor(args[1 - i], node)
        self._set(out, dataclasses.replace(node, unknown=True) if f is None else scaled(node, f))

    def _prescale(self, a: Any, b: Any, out: Any) -> None:
        # q * s before the product (timm): remember s on the result.
        x, s = (a, b) if isinstance(a, Tensor) else (b, a)
        if isinstance(x, Tensor) and number(s) and x.dim() in (3, 4) and isinstance(out, Tensor):
            meta = self._get(x)
            base, factor = (meta.base, meta.factor) if isinstance(meta, Meta) and meta.base is not None else (x, 1.0)
            merged = meta.merged if isinstance(meta, Meta) else None
            self._set(out, Meta(base=base, factor=factor * float(s), merged=merged))

    def _on_div(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        node = self._get(args[0]) if args else None
        if not isinstance(node, Scores) or len(args) < 2:
            return
        f = None if kwargs.get("rounding_mode") is not None or node.tanh else factor(args[1], node)
        if isinstance(f, float):
            f = 1.0 / f if f != 0 else None
        elif f is not None:
            f = f.reciprocal()
        self._set(out, dataclasses.replace(node, unknown=True) if f is None else scaled(node, f))

    # -- bias and masks ----------------------------------------------------------------------------
    def _add_bias(self, out: Any, node: Scores, other: Any, coeff: Any) -> None:
        describable = isinstance(other, Tensor) and other.dtype != torch.bool and number(coeff)
        if node.unknown or node.tanh or not describable:
            self._set(out, dataclasses.replace(node, unknown=True))
            return
        self._set(out, dataclasses.replace(node, biases=node.biases + ((other, float(coeff), node.ndim),)))

    def _on_add(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        if len(args) < 2:
            return
        node, i = self._scores(args[0], args[1])
        if node is None:
            return
        alpha = kwargs.get("alpha", 1)
        if i == 1 and alpha != 1:  # a + alpha * scores
            self._set(out, dataclasses.replace(node, unknown=True))
            return
        self._add_bias(out, node, args[1 - i], alpha if i == 0 else 1)

    def _on_sub(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        node = self._get(args[0]) if args else None
        if isinstance(node, Scores) and len(args) > 1:
            self._add_bias(out, node, args[1], -kwargs.get("alpha", 1) if number(kwargs.get("alpha", 1)) else None)

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
        self._set(out, dataclasses.replace(node, masks=node.masks + ((mask, invert, node.ndim, fill_t),)))

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

    def _on_other(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        node = self._get(args[0]) if args else None
        if isinstance(node, Scores):
            self._set(out, dataclasses.replace(node, unknown=True))

    # -- layout ------------------------------------------------------------------------------------
    def _on_cast(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        if isinstance(out, Tensor) and args:
            record = self._get(args[0])
            # dropout changes values: only the probabilities on their way to P @ v keep theirs
            kinds = (Pending,) if func in (F.dropout, torch.dropout) else (Scores, Pending, Meta)
            if isinstance(record, kinds):
                self._set(out, record)

    def _on_view(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        x = args[0] if args else None
        if not isinstance(x, Tensor) or not isinstance(out, Tensor):
            return
        record = self._get(x)
        transpose = func in (_TB.transpose, torch.transpose)
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
                self._set(out, Meta(base=func(record.base, *args[1:], **kwargs), factor=record.factor))
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
            self._set(out, Meta(base=base, factor=record.factor, merged=merged or record.merged))
        elif merged is not None:
            self._set(out, Meta(merged=merged, whole=x))

    # -- the softmax -------------------------------------------------------------------------------
    def _rewrite(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any], Optional[Scores]]]:
        """``probe.scaling`` on a softmax over recognised scores (:func:`probe.overrides.lookup`):
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
        change = overrides.lookup(node.q.shape[1], node.q.shape[-1], x, variants=False, describable=describable)
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
        pending = Pending(call, node.merged, emit)
        self._pending.append(pending)
        self._set(out, pending)
