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
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from probe.call import AttentionCall
from probe.intervene import _APPLYING, eager_scale

__all__ = ["EagerFrontEnd"]

_TB = torch._C.TensorBase
#: A fill value at or below this masks an entry (``exp`` of it underflows to 0 in float32).
MASK_FILL = -1e4


@dataclasses.dataclass(frozen=True)
class _Scores:
    """Where a score tensor came from. Biases and masks keep the layout (3 or 4 dims) the
    scores had when they were applied; they are lifted to ``(B, H, L, S)`` at emit time."""

    q: Tensor  # (B, H, L, d)
    k: Tensor  # (B, Hk, S, d)
    ndim: int  # dims of the score tensor this record describes (3 or 4)
    merged: Optional[Tuple[int, int]] = None  # (B, H) of a (B*H, L, S) layout, when known
    scale: float = 1.0
    scale_t: Optional[Tensor] = None  # tensor factor: 1 value or one per head
    biases: Tuple[Tuple[Tensor, float, int], ...] = ()  # (tensor, coefficient, layout)
    masks: Tuple[Tuple[Tensor, bool, int, Optional[Tensor]], ...] = ()  # (mask, invert, layout, fill)
    softcap: Optional[float] = None
    tanh: bool = False  # tanh applied, waiting for its ``* c``
    unknown: bool = False  # an op the record cannot describe touched the scores


@dataclasses.dataclass(frozen=True)
class _Meta:
    """What is known about an activation that may become q or kᵀ."""

    base: Optional[Tensor] = None  # the tensor before ``* factor``
    factor: float = 1.0
    merged: Optional[Tuple[int, int]] = None  # (B, H) when this (B*H, L, d) came from (B, H, L, d)
    src: Optional[Tensor] = None  # this tensor is ``src.transpose(-1, -2)`` (the model's own k)
    whole: Optional[Tensor] = None  # the (B, H, n, d) tensor this (B*H, n, d) one was reshaped from
    kv: Optional[Tensor] = None  # the (B, Hk, n, d) tensor this one repeats per group (repeat_kv)


@dataclasses.dataclass
class _Pending:
    """A softmax over scores, waiting for its product with v (then the call gets v and output)."""

    call: AttentionCall
    merged: Optional[Tuple[int, int]]
    emit: Callable[[AttentionCall], None]
    done: bool = False

    def fire(self, v: Optional[Tensor] = None, output: Optional[Tensor] = None) -> None:
        if not self.done:
            self.done = True
            self.call.v, self.call.output = v, output
            self.emit(self.call)


def _permuted(t: Tensor, dims: List[int]) -> Tensor:
    # The tensor itself when nothing moves, so that hooks on it see the model's gradient.
    return t if dims == list(range(t.dim())) else t.permute(dims)


def _repeat_kv(x: Tensor, out: Tensor) -> Optional[_Meta]:
    """``x[:, :, None].expand(B, Hk, n, S, d).reshape(B, Hk * n, S, d)`` (Hugging Face's
    ``repeat_kv``): the kv tensor it repeats, the model's own when ``x`` is a view of it."""
    b, hk, n, length, d = x.shape
    if n < 2 or tuple(out.shape) != (b, hk * n, length, d):
        return None
    base = x._base
    if (base is not None and tuple(base.shape) == (b, hk, length, d) and base.data_ptr() == x.data_ptr()
            and base.unsqueeze(2).expand(x.shape).stride() == x.stride()):
        return _Meta(kv=base)
    return _Meta(kv=x.select(2, 0))


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class EagerFrontEnd:
    """Recovers q, k, scale, bias, mask and softcap from the ops leading into a softmax."""

    applies_overrides = True  # probe.scaling: the softmax runs at the overridden scale (_rewrite)

    def __init__(self) -> None:
        self._table: Dict[int, Tuple[weakref.ref, Any]] = {}
        self._pending: List[_Pending] = []
        self._warned = False
        self._handlers: Dict[Callable[..., Any], Callable[..., None]] = {}
        for names, extra, handler in (
            ("matmul __matmul__ bmm", (torch.matmul, torch.bmm), self._on_matmul),
            ("baddbmm", (torch.baddbmm,), self._on_baddbmm),
            ("", (torch.einsum,), self._on_einsum),
            ("mul mul_ __mul__ __rmul__ __imul__", (torch.mul,), self._on_mul),
            ("div div_ __truediv__ __itruediv__", (torch.div, torch.true_divide), self._on_div),
            ("add add_ __iadd__", (torch.add,), self._on_add),
            ("sub sub_ __isub__", (torch.sub,), self._on_sub),
            ("masked_fill masked_fill_", (torch.masked_fill,), self._on_masked_fill),
            ("", (torch.where,), self._on_where),
            ("tanh", (torch.tanh,), self._on_tanh),
            ("float to type type_as contiguous half bfloat16 double", (F.dropout, torch.dropout), self._on_cast),
            ("view reshape transpose", (torch.reshape, torch.transpose), self._on_view),
            ("clamp clamp_ __rsub__ __rdiv__", (torch.clamp,), self._on_other),
            ("softmax", (torch.softmax, F.softmax), self._on_softmax),
        ):
            methods = [getattr(cls, n) for n in names.split() for cls in (_TB, Tensor) if hasattr(cls, n)]
            for func in (*methods, *extra):
                self._handlers[func] = handler
        self.funcs = tuple(self._handlers)

    # -- protocol --------------------------------------------------------------------------------
    def handle(
        self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
        emit: Callable[[AttentionCall], None],
    ) -> Any:
        if self._handlers[func] == self._on_softmax:
            rewrite = self._rewrite(args, kwargs)
            if rewrite is not None:  # probe.scaling consulted: run flagged (never applied twice)
                run_args, run_kwargs, node = rewrite
                token = _APPLYING.set(True)
                try:
                    out = func(*run_args, **run_kwargs)
                finally:
                    _APPLYING.reset(token)
                try:
                    self._on_softmax(func, args, kwargs, out, emit, node)
                except Exception as err:  # noqa: BLE001 - bookkeeping must never break the model
                    self._warn(err)
                return out
        out = func(*args, **kwargs)
        try:
            self._handlers[func](func, args, kwargs, out, emit)
        except Exception as err:  # noqa: BLE001 - bookkeeping must never break the model
            self._warn(err)
        return out

    def _warn(self, err: Exception) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"probe: eager attention capture skipped an op ({type(err).__name__}: {err})",
                          RuntimeWarning, stacklevel=3)

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

    def _scores(self, *ts: Any) -> Tuple[Optional[_Scores], int]:
        for i, t in enumerate(ts):
            node = self._get(t)
            if isinstance(node, _Scores):
                return node, i
        return None, -1

    # -- products ----------------------------------------------------------------------------------
    def _start(self, a: Any, b: Any, out: Any, scale: float = 1.0, k: Optional[Tensor] = None) -> Optional[_Scores]:
        """A score record for ``out = a @ b`` when both are batched activations (``k``: the
        model's own ``b.transpose(-1, -2)`` when the caller knows it)."""
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(out, Tensor)):
            return None
        if a.dim() != b.dim() or a.dim() not in (3, 4) or isinstance(a, nn.Parameter) or isinstance(b, nn.Parameter):
            return None
        ma, mb = self._get(a), self._get(b)
        if isinstance(ma, _Meta) and ma.base is not None:
            a, scale = ma.base, scale * ma.factor
        if isinstance(mb, _Meta) and mb.base is not None:
            b, scale = mb.base, scale * mb.factor
        q = a
        # k is the model's own tensor when kᵀ was made by a transpose we saw (grad hooks need it)
        if k is None:
            k = mb.src if isinstance(mb, _Meta) and mb.src is not None else b.transpose(-1, -2)
        merged = None
        if a.dim() == 3:
            merged = ma.merged if isinstance(ma, _Meta) else None
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
        return _Scores(q=q, k=k, ndim=out.dim(), merged=merged, scale=scale)

    def _unrepeated(self, t: Tensor) -> Tensor:
        """The kv-head tensor behind a ``repeat_kv`` copy (grouped-query attention), else ``t``."""
        meta = self._get(t)
        return meta.kv if isinstance(meta, _Meta) and meta.kv is not None else t

    def _whole(self, t: Tensor, merged: Tuple[int, int]) -> Tensor:
        meta = self._get(t)
        if isinstance(meta, _Meta) and meta.whole is not None and meta.base is None:
            return meta.whole
        return t.reshape(merged[0], merged[1], *t.shape[1:])

    def _on_matmul(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        a = args[0] if args else kwargs.get("input")
        b = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
        probs = self._get(a)
        if isinstance(probs, _Pending):  # P @ v: the call is complete
            if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(out, Tensor)):
                return
            if a.dim() == b.dim() == out.dim() in (3, 4):
                probs.fire(self._unrepeated(self._heads(b, probs.merged)), self._heads(out, probs.merged))
            return
        self._set(out, self._start(a, b, out))

    @staticmethod
    def _heads(t: Tensor, merged: Optional[Tuple[int, int]]) -> Tensor:
        """(B, H, n, d) from a 4-D tensor or a (B*H, n, d) one."""
        if t.dim() == 4:
            return t
        if merged is not None and t.shape[0] == merged[0] * merged[1]:
            return t.reshape(merged[0], merged[1], *t.shape[1:])
        return t.unsqueeze(1)

    def _on_baddbmm(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        if len(args) < 3:
            return
        bias, beta, alpha = args[0], kwargs.get("beta", 1), kwargs.get("alpha", 1)
        if not (_number(beta) and _number(alpha)):
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
        if isinstance(probs, _Pending):  # einsum("bhqk,bhkd->bhqd", P, v), any letters
            # here di is the key letter (contracted) and ki the value feature letter
            v = _permuted(ops[1], [sb.index(c) for c in batch + di + ki])
            if isinstance(out, Tensor) and v.dim() == out.dim():
                probs.fire(self._heads(v, probs.merged), self._heads(out, probs.merged))
            return
        a = _permuted(ops[0], [sa.index(c) for c in batch + qi + di])
        k = _permuted(ops[1], [sb.index(c) for c in batch + ki + di])
        self._set(out, self._start(a, k.transpose(-1, -2), out, k=k))

    # -- scale -------------------------------------------------------------------------------------
    @staticmethod
    def _factor(x: Any, node: _Scores) -> Optional[Any]:
        """A Python float, a 1-D factor tensor (one value or one per head), or None."""
        if _number(x):
            return float(x)
        if not isinstance(x, Tensor) or not x.is_floating_point():
            return None
        if x.numel() == 1:
            return x.detach().float().reshape(1)
        heads = node.q.shape[1]
        shape = (1,) * (4 - x.dim()) + tuple(x.shape) if x.dim() <= 4 else ()
        if node.ndim == 4 and len(shape) == 4 and shape[1] == heads and x.numel() == heads:
            return x.detach().float().reshape(heads)
        return None

    @staticmethod
    def _scaled(node: _Scores, f: Any) -> _Scores:
        if node.unknown:
            return node
        if node.tanh:  # c * tanh(z / c): the multiplier is the cap
            if not isinstance(f, float):
                return dataclasses.replace(node, unknown=True)
            return dataclasses.replace(node, tanh=False, softcap=f, scale=node.scale * f)
        if isinstance(f, float):
            if node.softcap is not None and f <= 0:
                return dataclasses.replace(node, unknown=True)
            # f·(c·tanh(σR/c) + A) = (fc)·tanh(fσR/(fc)) + fA
            biases = tuple((t, c * f, n) for t, c, n in node.biases)
            softcap = None if node.softcap is None else node.softcap * f
            return dataclasses.replace(node, scale=node.scale * f, biases=biases, softcap=softcap)
        if node.biases or node.softcap is not None:
            return dataclasses.replace(node, unknown=True)
        scale_t = f if node.scale_t is None else node.scale_t * f
        return dataclasses.replace(node, scale_t=scale_t)

    def _on_mul(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        if len(args) < 2:
            return
        node, i = self._scores(args[0], args[1])
        if node is None:
            self._prescale(args[0], args[1], out)
            return
        f = self._factor(args[1 - i], node)
        self._set(out, dataclasses.replace(node, unknown=True) if f is None else self._scaled(node, f))

    def _prescale(self, a: Any, b: Any, out: Any) -> None:
        # q * s before the product (timm): remember s on the result.
        x, s = (a, b) if isinstance(a, Tensor) else (b, a)
        if isinstance(x, Tensor) and _number(s) and x.dim() in (3, 4) and isinstance(out, Tensor):
            meta = self._get(x)
            base, factor = (meta.base, meta.factor) if isinstance(meta, _Meta) and meta.base is not None else (x, 1.0)
            merged = meta.merged if isinstance(meta, _Meta) else None
            self._set(out, _Meta(base=base, factor=factor * float(s), merged=merged))

    def _on_div(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        node = self._get(args[0]) if args else None
        if not isinstance(node, _Scores) or len(args) < 2:
            return
        f = None if kwargs.get("rounding_mode") is not None or node.tanh else self._factor(args[1], node)
        if isinstance(f, float):
            f = 1.0 / f if f != 0 else None
        elif f is not None:
            f = f.reciprocal()
        self._set(out, dataclasses.replace(node, unknown=True) if f is None else self._scaled(node, f))

    # -- bias and masks ----------------------------------------------------------------------------
    def _add_bias(self, out: Any, node: _Scores, other: Any, coeff: Any) -> None:
        describable = isinstance(other, Tensor) and other.dtype != torch.bool and _number(coeff)
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
        if isinstance(node, _Scores) and len(args) > 1:
            self._add_bias(out, node, args[1], -kwargs.get("alpha", 1) if _number(kwargs.get("alpha", 1)) else None)

    def _mask(self, out: Any, node: _Scores, mask: Any, invert: bool, fill: Any) -> None:
        ok = isinstance(mask, Tensor) and mask.dtype == torch.bool and not node.unknown
        fill_t = None
        if ok and isinstance(fill, Tensor) and fill.is_floating_point():
            fill_t = fill.detach()  # compared with MASK_FILL on device at emit time, no sync
        elif not (ok and _number(fill) and fill <= MASK_FILL):
            ok = False
        if not ok:
            self._set(out, dataclasses.replace(node, unknown=True))
            return
        self._set(out, dataclasses.replace(node, masks=node.masks + ((mask, invert, node.ndim, fill_t),)))

    def _on_masked_fill(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        node = self._get(args[0]) if args else None
        if isinstance(node, _Scores):
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
        if isinstance(node, _Scores):
            plain = not (node.unknown or node.tanh or node.biases or node.masks or node.softcap is not None)
            self._set(out, dataclasses.replace(node, tanh=True) if plain else dataclasses.replace(node, unknown=True))

    def _on_other(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        node = self._get(args[0]) if args else None
        if isinstance(node, _Scores):
            self._set(out, dataclasses.replace(node, unknown=True))

    # -- layout ------------------------------------------------------------------------------------
    def _on_cast(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        if isinstance(out, Tensor) and args:
            record = self._get(args[0])
            # dropout changes values: only the probabilities on their way to P @ v keep theirs
            kinds = (_Pending,) if func in (F.dropout, torch.dropout) else (_Scores, _Pending, _Meta)
            if isinstance(record, kinds):
                self._set(out, record)

    def _on_view(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        x = args[0] if args else None
        if not isinstance(x, Tensor) or not isinstance(out, Tensor):
            return
        record = self._get(x)
        transpose = func in (_TB.transpose, torch.transpose)
        if isinstance(record, (_Scores, _Pending)):
            if transpose:  # moves values (even when the shape stays, L == S)
                if isinstance(record, _Scores) and x.dim() == out.dim():
                    self._set(out, dataclasses.replace(record, unknown=True))
                return
            if isinstance(record, _Scores):
                self._set(out, self._reshaped(record, x, out))
            elif x.shape[-2:] == out.shape[-2:]:  # probabilities viewed between layouts
                self._set(out, record)
            return
        if transpose:
            if isinstance(record, _Meta) and record.base is not None:
                self._set(out, _Meta(base=func(record.base, *args[1:], **kwargs), factor=record.factor))
            elif x.dim() in (3, 4) and len(args) == 3 and all(isinstance(a, int) for a in args[1:]):
                if {args[1] % x.dim(), args[2] % x.dim()} == {x.dim() - 2, x.dim() - 1}:
                    self._set(out, _Meta(src=x))
            return
        if record is None and x.dim() == 5 and out.dim() == 4 and x.stride(2) == 0:
            self._set(out, _repeat_kv(x, out))
            return
        merged = None
        if x.dim() == 4 and out.dim() == 3 and out.shape[0] == x.shape[0] * x.shape[1] and out.shape[1:] == x.shape[2:]:
            merged = (x.shape[0], x.shape[1])
        if isinstance(record, _Meta) and record.base is not None:
            base = record.base.reshape(out.shape) if out.shape != x.shape else record.base
            self._set(out, _Meta(base=base, factor=record.factor, merged=merged or record.merged))
        elif merged is not None:
            self._set(out, _Meta(merged=merged, whole=x))

    @staticmethod
    def _reshaped(node: _Scores, x: Tensor, out: Tensor) -> Optional[_Scores]:
        """The record of a view of the scores: only (B*H, L, S) <-> (B, H, L, S) keeps it."""
        if x.shape[-2:] != out.shape[-2:] or out.dim() not in (3, 4):
            return None
        if out.dim() == x.dim():
            return node if out.shape == x.shape else None
        if out.dim() == 3:  # (B, H, L, S) -> (B*H, L, S)
            return dataclasses.replace(node, ndim=3) if out.shape[0] == x.shape[0] * x.shape[1] else None
        # (N, L, S) -> (B, H, L, S): learn the heads of a bmm layout
        b, h = out.shape[0], out.shape[1]
        if b * h != x.shape[0]:
            return None
        if node.merged is None and node.q.shape[1] == 1 and node.q.shape[0] == b * h and h > 1:
            q = node.q.reshape(b, h, *node.q.shape[2:])
            k = node.k.reshape(b, h, *node.k.shape[2:]) if node.k.shape[0] == b * h else node.k
            return dataclasses.replace(node, q=q, k=k, ndim=4, merged=(b, h))
        return dataclasses.replace(node, ndim=4)

    # -- the softmax -------------------------------------------------------------------------------
    def _rewrite(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any], Optional[_Scores]]]:
        """``probe.scaling`` on a softmax over recognised scores: ``None`` when not consulted;
        else (args, kwargs, record) to run and record, the softmax input ``Z`` replaced by
        ``Z + (s' - s)·q·kᵀ`` (q unscaled: a pre-scaling is part of ``s``) when the scale changes."""
        x = args[0] if args else kwargs.get("input")
        node = self._get(x)
        if not isinstance(node, _Scores) or not isinstance(x, Tensor):
            return None
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(dim, int) or dim not in (-1, x.dim() - 1):
            return None
        heads = node.q.shape[1]
        describable = not (node.unknown or node.tanh or node.softcap is not None)
        consulted, new = eager_scale(heads, node.q.shape[-1], x, describable)
        if not consulted:
            return None
        if new is None:
            return args, kwargs, None
        k = node.k
        if k.shape[1] != heads:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
        raw = torch.matmul(node.q, k.transpose(-1, -2))  # (B, H, L, S)
        old: Any = node.scale if node.scale_t is None else node.scale_t * node.scale
        if isinstance(new, Tensor) or isinstance(old, Tensor):
            delta = (torch.as_tensor(new, device=raw.device, dtype=torch.float32)
                     - torch.as_tensor(old, device=raw.device, dtype=torch.float32))
            delta = delta.reshape(-1, 1, 1) if delta.numel() > 1 else delta.reshape(())
            change = raw * delta.to(raw.dtype)
        else:
            change = raw * (float(new) - float(old))
        if x.dim() == 3:
            change = change.reshape(-1, *change.shape[-2:])
        z = x + change.to(x.dtype)
        if args:
            run_args, run_kwargs = (z, *args[1:]), kwargs
        else:
            run_args, run_kwargs = args, {**kwargs, "input": z}
        if isinstance(new, Tensor):
            record = dataclasses.replace(node, scale=1.0, scale_t=new.detach())
        else:
            record = dataclasses.replace(node, scale=float(new), scale_t=None)
        return run_args, run_kwargs, record

    def _on_softmax(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any,
                    record: Optional[_Scores] = None) -> None:
        x = args[0] if args else kwargs.get("input")
        node = record if record is not None else self._get(x)
        if not isinstance(node, _Scores) or not isinstance(x, Tensor):
            return  # not over q·kᵀ: an output layer, a router, ...
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(dim, int) or dim not in (-1, x.dim() - 1):
            return
        self._fire_pending()
        call = self._call(node, x)
        if call.scale is None or not isinstance(out, Tensor):
            emit(call)  # unknown scale: no counterfactual gradients either, so no need for v
            return
        call.probs = out  # its gradient is dP itself: exact also under attention dropout
        pending = _Pending(call, node.merged, emit)
        self._pending.append(pending)
        self._set(out, pending)

    def _lift(self, t: Tensor, layout: int, node: _Scores) -> Tensor:
        """A bias or mask applied to a ``layout``-dim score tensor, broadcastable to (B, H, L, S)."""
        if layout == 4 or t.dim() < 3:
            return t
        if node.merged is not None and t.shape[0] == node.merged[0] * node.merged[1] and node.merged[1] > 1:
            return t.reshape(node.merged[0], node.merged[1], *t.shape[1:])
        return t.unsqueeze(-3)

    def _call(self, node: _Scores, logits: Tensor) -> AttentionCall:
        if node.unknown or node.tanh:
            return AttentionCall(q=node.q, k=node.k, v=None, scale=None, logits=self._lift(logits, logits.dim(), node),
                                 kind="eager")
        bias: Optional[Tensor] = None
        for t, coeff, layout in node.biases:
            term = self._lift(t, layout, node)
            term = term if coeff == 1.0 else term * coeff
            bias = term if bias is None else bias + term
        valid: Optional[Tensor] = None
        for m, invert, layout, fill in node.masks:
            keep = ~m if invert else m
            if fill is not None:  # a tensor fill value masks only when it is very negative
                keep = keep | (fill > MASK_FILL)
            keep = self._lift(keep, layout, node)
            valid = keep if valid is None else valid & keep
        scale: Any = node.scale
        if node.scale_t is not None:
            scale = node.scale_t * node.scale
        return AttentionCall(q=node.q, k=node.k, v=None, scale=scale, bias=bias, mask=valid,
                             softcap=node.softcap, kind="eager")

