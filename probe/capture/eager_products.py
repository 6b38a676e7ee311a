"""The product rules of the eager front end (:class:`probe.capture.eager.EagerFrontEnd`).

``a @ b`` of two batched activations starts a score record (q = a, kᵀ = b, any number of leading
dims, ``baddbmm`` and two-operand ``einsum`` by any binding of their arguments); a product of
recorded probabilities with v completes a call (``matmul`` or any ``einsum`` contracting the key
letter); a scalar factor applied to q or k before the product (``q * s``, ``k / c``, a Python
number or a one-element tensor) is remembered and taken into the scale, and SDPA asks for it too
(:meth:`Products.prescaled`). The model's own operands carry the gradient hooks: a record made
from them (a transpose, a reshape, an un-repeated kv head, a factor taken out) says how their
gradient becomes its own (:func:`~probe.capture.eager_scores.grad_map`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor, nn


from probe.capture.eager_scores import (
    Meta,
    Moved,
    Pending,
    Scores,
    Slice,
    einsum_pair,
    factor,
    grad_map,
    head_mix,
    heads_of,
    number,
    permuted,
    prescale_factor,
    pv_roles,
    qk_roles,
    scaled,
)

__all__ = ["Products"]


_GETITEM = frozenset(getattr(cls, "__getitem__") for cls in (torch._C.TensorBase, Tensor))


def _pair(x: Any) -> Tuple[Any, ...]:
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


def _lift(t: Any, letters: str, batch: str) -> Tuple[Any, str, Optional[Tuple[int, ...]]]:
    """An einsum operand without some of the batch letters (one k or v head for all query heads:
    ``"bjd"`` beside ``"bhid"``): a view with them as leading size-1 dims, its letters, and the
    view's shape (how the operand's gradient maps onto it); the operand itself when none is missing."""
    missing = "".join(c for c in batch if c not in letters)
    if not missing or not isinstance(t, Tensor):
        return t, letters, None
    shape = (1,) * len(missing) + tuple(t.shape)
    return t.reshape(shape), missing + letters, shape


def _einsum_head_mix(ss: str, sw: str, res: str, w: Any) -> Optional[Tensor]:
    """M (H, G) of ``einsum(ss, sw -> res)`` when it mixes the heads of 4-D scores ``ss`` (batch,
    head, query, key) by a 2-D weight ``sw`` (head, new head): ``"bhij,hg->bgij"``."""
    if len(ss) != 4 or len(sw) != 2 or len(res) != 4 or not isinstance(w, Tensor) or w.dim() != 2:
        return None
    h = ss[1]
    g = next((c for c in sw if c != h), None)
    if h not in sw or g is None or g in ss or res != ss[0] + g + ss[2:]:
        return None
    return w if sw == h + g else w.t()


def _transposed(g: Tensor) -> Tensor:
    return g.transpose(-1, -2)


class Products:
    """Mixin: the product and scale handlers; the provenance table is the front end's."""

    def _get(self, t: Any) -> Any:  # pragma: no cover - EagerFrontEnd's
        raise NotImplementedError

    def _set(self, t: Any, value: Any) -> None:  # pragma: no cover - EagerFrontEnd's
        raise NotImplementedError

    def _scores(self, *ts: Any) -> Tuple[Optional[Scores], int]:  # pragma: no cover - EagerFrontEnd's
        raise NotImplementedError

    # -- products ----------------------------------------------------------------------------------
    def _start(self, a: Any, b: Any, out: Any, scale: float = 1.0, k: Optional[Tensor] = None) -> Optional[Scores]:
        """A score record for ``out = a @ b`` when both are batched activations (``k``: the
        model's own ``b.transpose(-1, -2)`` when the caller knows it)."""
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(out, Tensor)):
            return None
        if a.dim() != b.dim() or a.dim() < 3 or isinstance(a, nn.Parameter) or isinstance(b, nn.Parameter):
            return None
        own_a, own_b = a, b
        ma, mb = self._get(a), self._get(b)
        scale_t: Optional[Tensor] = None
        fa: Any = 1.0
        fb: Any = 1.0
        how = []
        if isinstance(ma, Meta) and ma.base is not None:
            a, fa = ma.base, (ma.factor_t if ma.factor_t is not None else ma.factor)
            how.append(f"q {ma.how}".rstrip())
        if isinstance(mb, Meta) and mb.base is not None:
            b, fb = mb.base, (mb.factor_t if mb.factor_t is not None else mb.factor)
            how.append(f"k {mb.how}".rstrip())
        for f in (fa, fb):
            if isinstance(f, Tensor):
                scale_t = f.reshape(1) if scale_t is None else scale_t * f.reshape(1)
            else:
                scale = scale * f
        mb = self._get(b)
        q = a
        # k is the model's own tensor when kᵀ was made by a transpose we saw (grad hooks need it)
        if k is None:
            src = mb.src if isinstance(mb, Meta) else None
            if src is None and isinstance(mb, Meta) and mb.whole is not None:  # (B·H, d, S) from (B, H, d, S)
                whole = self._get(mb.whole)
                if isinstance(whole, Meta) and whole.src is not None:
                    src = whole.src.reshape(-1, *whole.src.shape[2:])
            k = src if src is not None else b.transpose(-1, -2)
        if a.dim() > 4:  # extra leading dims (windows, blocks: (B, T, H, N, d)): flattened into the batch
            q, k = q.reshape(-1, *q.shape[-3:]), k.reshape(-1, *k.shape[-3:])
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
        grads = [("q", grad_map(own_a, q, fa)), ("k", grad_map(own_b, k, fb, _transposed))]
        return Scores(q=q, k=k, ndim=out.dim(), merged=merged, scale=scale, scale_t=scale_t,
                      grad_of=tuple((n, *g) for n, g in grads if g is not None),
                      scale_from=("; ".join(how) + " before q·kᵀ") if how else None)

    def prescaled(self, t: Any) -> Optional[Tuple[Tensor, float, Optional[Tensor], str]]:
        """``(base, factor, tensor factor, how)`` when ``t`` is ``base`` times a scalar (for SDPA)."""
        meta = self._get(t)
        if isinstance(meta, Meta) and meta.base is not None:
            return meta.base, meta.factor, meta.factor_t, meta.how
        return None

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
            if a.dim() == b.dim() == out.dim() >= 3:
                v = self._unrepeated(heads_of(b, probs.merged))
                probs.fire(v, heads_of(out, probs.merged), grad_map(b, v))
            return
        node = self._start(a, b, out)
        mixed = next((r for r in map(self._get, (a, b)) if isinstance(r, Scores)), None)
        if node is None and mixed is not None:  # scores times a matrix (heads or keys mixed)
            node = dataclasses.replace(mixed, unknown=True)
        self._set(out, node)

    def _on_baddbmm(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        bound = {**dict(zip(("input", "batch1", "batch2"), args)), **kwargs}  # any binding of the arguments
        bias, beta, alpha = bound.get("input"), bound.get("beta", 1), bound.get("alpha", 1)
        if not (number(beta) and number(alpha)):
            return
        node = self._start(bound.get("batch1"), bound.get("batch2"), out, float(alpha))
        if node is not None and beta != 0 and isinstance(bias, Tensor):
            node = dataclasses.replace(node, biases=((bias, float(beta), 3),))
        self._set(out, node)

    def _on_einsum(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        parsed = einsum_pair(args)
        if parsed is None or not isinstance(out, Tensor):
            return
        (x, y), (sx, sy, res) = parsed
        for i, (sp, sv, t) in enumerate(((sx, sy, y), (sy, sx, x))):
            probs = self._get((x, y)[i])
            if not isinstance(probs, Pending):
                continue
            t2, sv2, shape = _lift(t, sv, sp[:-2]) if len(sv) < len(sp) else (t, sv, None)  # one v head: "bjd"
            roles = pv_roles(sp, sv2, res)
            if roles is not None and isinstance(t, Tensor):  # P·v, any letters and operand order
                to_v, to_out = [sv2.index(c) for c in roles[0] + roles[2]], [res.index(c) for c in roles[1]]
                v = heads_of(permuted(t2, to_v), probs.merged)
                probs.fire(v, heads_of(permuted(out, to_out), probs.merged),
                           grad_map(t, v, pre=lambda g, d=to_v, sh=shape: (g if sh is None else g.reshape(sh)).permute(d)))
            elif sp[-2:] == res[-2:]:  # P mixed over heads after the softmax (re-attention)
                self._set(out, probs)
            return
        # one k head for all query heads (multi-query: "bhid,bjd->bhij"): k lifted to "hbjd", h of size 1
        x2, sx2, shx = _lift(x, sx, res[:-2]) if len(sx) < len(sy) else (x, sx, None)
        y2, sy2, shy = _lift(y, sy, res[:-2]) if len(sy) < len(sx) else (y, sy, None)
        roles = qk_roles(sx2, sy2, res)
        if roles is None:
            mixed = next((r for r in map(self._get, (x, y)) if isinstance(r, Scores)), None)
            if mixed is not None:  # scores mixed by a weight: talking heads ("bhij,hg->bgij"), else unknown
                m = _einsum_head_mix(sx, sy, res, y) if mixed is self._get(x) else _einsum_head_mix(sy, sx, res, x)
                self._set(out, self._mixed(mixed, m))
            return
        to_q, to_k = [sx2.index(c) for c in roles[0]], [sy2.index(c) for c in roles[1]]
        q, k = permuted(x2, to_q), permuted(y2, to_k)
        node = self._start(q, k.transpose(-1, -2), out, k=k)
        if node is not None:  # the model's own operands carry the gradients
            grads = (("q", *grad_map(x, node.q, 1.0, pre=lambda g: (g if shx is None else g.reshape(shx)).permute(to_q))),
                     ("k", *grad_map(y, node.k, pre=lambda g: (g if shy is None else g.reshape(shy)).permute(to_k))))
            node = dataclasses.replace(node, grad_of=grads)
        self._set(out, node)

    # -- heads mixed before the softmax (talking heads) ---------------------------------------------
    def _mixed(self, node: Scores, m: Optional[Tensor]) -> Scores:
        """The record of ``node``'s scores mixed over heads by ``m`` (H, G): see :func:`head_mix`;
        unknown (reported at `actual` only, with a warning) when it cannot be described."""
        mixed = head_mix(node, m) if m is not None else None
        return dataclasses.replace(node, unknown=True) if mixed is None else mixed

    def _on_conv(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        """``conv2d(scores, W)`` with a 1x1 kernel, no bias, stride 1 (x-transformers' talking heads)."""
        node = self._get(args[0]) if args else None
        if isinstance(node, Pending) and isinstance(out, Tensor) and out.shape[-2:] == args[0].shape[-2:]:
            self._set(out, node)  # heads mixed after the softmax (post talking heads): still on the way to P @ v
            return
        if not isinstance(node, Scores):
            return
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        bound = {**dict(zip(names, args)), **kwargs}
        w = bound.get("weight")
        plain = (bound.get("bias") is None and bound.get("groups", 1) == 1 and all(
            set(_pair(bound.get(n, default))) == {default} for n, default in (("stride", 1), ("padding", 0),
                                                                            ("dilation", 1))))
        ok = func in (torch.conv2d, torch.nn.functional.conv2d) and isinstance(w, Tensor) and w.dim() == 4
        m = w[:, :, 0, 0].t() if ok and plain and tuple(w.shape[2:]) == (1, 1) else None
        self._set(out, self._mixed(node, m))

    def _mix_sum(self, a: Scores, b: Scores, coeff: Any) -> Scores:
        """``a + coeff·b`` of two records of the same scores, each the scores themselves or a mix
        of them over heads with nothing applied after it (``s + conv1x1(s)``): the mix
        ``M_a + coeff·M_b``; anything else is unknown."""
        eye = None
        mixes = []
        for node, other in ((a, b), (b, a)):
            if node.mix is None:
                mixes.append((node, None))
                continue
            root, m, n_biases = node.mix
            if (node.unknown or node.masks or len(node.biases) != n_biases or node.softcap is not None
                    or node.scale_t is not None or not root.scale):
                return dataclasses.replace(a, unknown=True)
            mixes.append((root, m * (node.scale / root.scale)))  # ``0.5 * conv1x1(s)``: the factor is the mix's
        (ra, ma), (rb, mb) = mixes
        if ra is not rb or (ma is None and mb is None) or not isinstance(coeff, (int, float)):
            return dataclasses.replace(a, unknown=True)
        eye = torch.eye(ra.q.shape[1], dtype=ra.q.dtype, device=ra.q.device)
        ma, mb = (eye if ma is None else ma), (eye if mb is None else mb)
        if ma.shape != mb.shape:
            return dataclasses.replace(a, unknown=True)
        return self._mixed(ra, ma + coeff * mb)

    # -- scale -------------------------------------------------------------------------------------
    def _on_mul(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        if len(args) < 2:
            return
        node, i = self._scores(args[0], args[1])
        if node is None:
            if not self._keep_probs(args, out):
                self._prescale(args[0], args[1], out, "multiplied by")
            return
        f = factor(args[1 - i], node)
        self._set(out, dataclasses.replace(node, unknown=True) if f is None else scaled(node, f))

    def _keep_probs(self, args: Tuple[Any, ...], out: Any) -> bool:
        """P changed after the softmax (a gated mix, a renormalisation): still on its way to P·v."""
        pending = next((r for r in map(self._get, args[:2]) if isinstance(r, Pending)), None)
        if pending is not None and isinstance(out, Tensor) and out.dim() >= 3:
            self._set(out, pending)
        return pending is not None

    def _prescale(self, a: Any, b: Any, out: Any, how: str) -> None:
        # q * s (or k / c) before the product (timm, OPT, DeBERTa): remember s on the result.
        x, s = (a, b) if isinstance(a, Tensor) else (b, a)
        if not (isinstance(x, Tensor) and x.dim() >= 3 and isinstance(out, Tensor)):
            return
        f, f_t = prescale_factor(s, how == "divided by")
        if f is None and f_t is None:
            self._linear_in(a, b, out, how)
            if how == "multiplied by" and self._get(out) is None:
                self._linear_in(b, a, out, how)
            return
        meta = self._get(x)
        if f == 1.0 and f_t is None and not isinstance(meta, Meta):
            return  # ``t * 1.0``: nothing to take into the scale
        base, old, old_t, text = x, 1.0, None, ""
        if isinstance(meta, Meta) and meta.base is not None:
            base, old, old_t, text = meta.base, meta.factor, meta.factor_t, meta.how + " and "
        elif out is x:
            return  # ``q.mul_(s)``: x already holds q * s, the unscaled q is gone (measured as it is)
        if f_t is not None or old_t is not None:
            f_t = (old_t if old_t is not None else torch.ones(1, device=out.device)) * (f_t if f_t is not None else f)
            f = 1.0
        shown = f"{float(s.detach() if isinstance(s, Tensor) else s):.4g}" if number(s) or (isinstance(s, Tensor) and s.device.type == "cpu") else "a tensor"
        merged = meta.merged if isinstance(meta, Meta) else None
        self._set(out, Meta(base=base, factor=old * (f if f is not None else 1.0), factor_t=f_t, merged=merged,
                            how=f"{text}{how} {shown}"))

    # -- ops linear in a prescaled q or k: the factor still applies (rotary after ``q * s``) ----------
    def _linear_in(self, x: Tensor, m: Any, out: Tensor, how: str) -> None:
        """``x * m`` or ``x / m`` with ``x = base * f`` and ``m`` a tensor that varies along the
        features (a rotary ``cos`` / ``sin``, a gain): ``out = (base * m) * f``. A multiplier
        constant along the features (``x * rsqrt(mean(x²))``, ``x / x.norm(dim=-1,
        keepdim=True)``) may be a norm of ``x`` itself, which removes the factor: not followed."""
        meta = self._get(x)
        if not (isinstance(meta, Meta) and meta.base is not None and isinstance(m, Tensor)
                and isinstance(x, Tensor)):
            return
        if m.dim() == 0 or m.shape[-1] != x.shape[-1] or x.shape[-1] < 2 or not (m.is_floating_point() or m.is_complex()):
            return
        other = self._get(m)
        if isinstance(other, Meta) and other.base is not None:  # both prescaled: the factors multiply
            if how != "multiplied by" or meta.factor_t is not None or other.factor_t is not None:
                return
            self._set(out, Meta(base=meta.base * other.base, factor=meta.factor * other.factor,
                                how=" and ".join(h for h in (meta.how, other.how) if h)))
            return
        base = meta.base * m if how == "multiplied by" else meta.base / m
        self._set(out, dataclasses.replace(meta, base=base, src=None, whole=None, kv=None))

    def _move_probs(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], record: Any, out: Tensor) -> None:
        """Probabilities permuted on their way to ``P @ v`` (and permuted back): followed as
        :class:`Moved` until their layout is the original one again."""
        x = args[0]
        if func not in (torch.permute, torch.Tensor.permute, torch._C.TensorBase.permute) or out.dim() != x.dim():
            return
        dims = args[1:] if len(args) > 2 or not isinstance(args[1] if len(args) > 1 else None, (list, tuple)) else args[1]
        dims = tuple(kwargs.get("dims", dims))
        if len(dims) != x.dim() or not all(isinstance(d, int) for d in dims):
            return
        dims = tuple(d % x.dim() for d in dims)
        perm = record.perm if isinstance(record, Moved) else tuple(range(x.dim()))
        pending = record.pending if isinstance(record, Moved) else record
        new = tuple(perm[d] for d in dims)
        self._set(out, pending if new == tuple(range(x.dim())) else Moved(pending, new))

    def _on_norm(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        """A norm of the probabilities on their way to ``P @ v`` (DeepViT's re-attention norm over
        the heads) keeps them there: v, and so ``grad_v``, are still found."""
        record = self._get(args[0]) if args else None
        if isinstance(record, (Pending, Moved)) and isinstance(out, Tensor) and out.shape == args[0].shape:
            self._set(out, record)

    def _linear_sum(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        """``a + b`` / ``a - b`` of two prescaled tensors with one factor (the two halves of a
        rotary embedding); a number or an unscaled tensor added is not linear in the factor."""
        if len(args) == 2 and all(isinstance(a, Tensor) for a in args):
            self._on_linear(func, args, kwargs, out, None)

    def _on_linear(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        """An op linear in every tensor it takes (slicing, a permutation, ``neg``, ``cat`` /
        ``stack`` of tensors sharing one factor, ``unbind`` / ``chunk`` / ``split``): when each is
        a prescaled ``base * f`` with the same ``f``, the op is replayed on the bases, so a factor
        applied to q or k before a rotary embedding is still taken into the scale (ESM,
        rotary-embedding-torch)."""
        metas = []

        def sub(a: Any) -> Any:
            if isinstance(a, Tensor):
                meta = self._get(a)
                if not (isinstance(meta, Meta) and meta.base is not None):
                    raise LookupError
                metas.append(meta)
                return meta.base
            if isinstance(a, (list, tuple)) and any(isinstance(t, Tensor) for t in a):
                return type(a)(sub(t) for t in a)
            return a

        first = self._get(args[0]) if args else None
        if isinstance(first, Scores) and func in _GETITEM and isinstance(out, Tensor):
            if not (first.unknown or first.tanh or first.softcap is not None):
                self._set(out, Slice(first))  # a part of the scores, maybe written back (_on_setitem)
            return
        if isinstance(first, (Pending, Moved)) and isinstance(out, Tensor):
            self._move_probs(func, args, kwargs, first, out)
            return
        if not (isinstance(first, Meta) and first.base is not None) and not (
                args and isinstance(args[0], (list, tuple)) and args[0] and isinstance(self._get(args[0][0]), Meta)):
            return  # the common case, without building anything
        try:
            bases = func(*(sub(a) for a in args), **kwargs)
        except LookupError:
            return  # a tensor without the factor: not linear in the factor
        if len({(m.factor, id(m.factor_t)) for m in metas}) != 1:
            return
        meta = dataclasses.replace(metas[0], src=None, whole=None, kv=None)
        outs, bases = (out, bases) if isinstance(out, (list, tuple)) else ((out,), (bases,))
        for o, b in zip(outs, bases):
            if isinstance(o, Tensor) and isinstance(b, Tensor):
                self._set(o, dataclasses.replace(meta, base=b))

    def _on_div(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, emit: Any) -> None:
        node = self._get(args[0]) if args else None
        if len(args) < 2:
            return
        if not isinstance(node, Scores):
            if not self._keep_probs(args[:1], out) and kwargs.get("rounding_mode") is None:
                self._prescale(args[0], args[1], out, "divided by")
            return
        f = None if kwargs.get("rounding_mode") is not None or node.tanh else factor(args[1], node)
        if isinstance(f, float):
            f = 1.0 / f if f != 0 else None
        elif f is not None:
            f = f.reciprocal()
        self._set(out, dataclasses.replace(node, unknown=True) if f is None else scaled(node, f))

