"""Rules for scores between their product and the softmax (:class:`Scores`, :class:`Slice`, :class:`Moved`).

* ``* s`` / ``/ c`` by a Python number, a one-element tensor (GPT-2's ``torch.full([], ...)``)
  or a per-head tensor multiply the scale (and any bias already added);
* ``+ bias`` / ``+=`` / ``- bias`` add an additive bias (T5's position bias, Hugging Face's float
  masks, a bias made from q without the model's factor: DeBERTa's relative terms); a term that
  carries the model's factor (made from a scaled q, or from scaled scores) is never a fixed bias:
  the scale is then unknown; scores plus a mix of themselves over heads are a mix;
* ``masked_fill(m, -inf)`` and ``torch.where(m, scores, -inf)`` add a boolean mask (a fill above
  ``-100`` is not a mask: unknown), and so does ``torch.where(m, scores - 1e9, scores)`` (a shift
  at or below ``-100``: keras.layers.Attention); ``torch.max(scores, finfo.min)`` / ``clamp(min=...)`` at or
  below it only touch masked entries;
* ``c * tanh(z / c)`` records a soft cap ``c`` (Gemma 2);
* ``nan_to_num`` with its default fills (torchscale, before adding its mask) changes no finite
  score and keeps a ``-inf`` fill a mask: the record holds;
* casts and views keep the record (``(B·H, L, S) <-> (B, H, L, S)`` recovers the heads of a
  ``bmm`` layout; views regrouping the leading dims: Swin's windows); a permutation makes it
  :class:`Moved` until permuted back; ``scores[idx]`` is a :class:`Slice` that may be written back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from probe.capture import ops as K
from probe.capture.eager_scores import MASK_BIAS, MASK_FILL, factor, number, prescale_factor, reshaped, scaled
from probe.capture.records import Derived, Moved, Operand, Probs, Scores, Shift, Slice
from probe.capture.rules import Op, before, carries_scale, rule, unknown
from probe.capture.rules_products import mixed

__all__: List[str] = []


def _layout(node: Scores, scores: Any) -> Any:
    """How a bias or mask applied now lifts to (B, H, L, S): the layout's dims (3 or 4), or the
    scores' shape when they have extra leading dims."""
    return tuple(scores.shape) if node.ndim > 4 and isinstance(scores, Tensor) else node.ndim


# -- scale ---------------------------------------------------------------------------------------------
@rule(K.MUL, Scores)
def times(tracer: Any, op: Op) -> None:
    node = op.subject
    if len(op.args) < 2:
        return
    other = op.args[1] if op.rec(op.args[0]) is node else op.args[0]
    f = None if op.rec(other) is not None else factor(other, node)
    tracer.set(op.out, unknown(node, f"`{op.name}` of the scores by a tensor probe does not read") if f is None
               else scaled(node, f))


@rule(K.DIV, Scores)
def divided(tracer: Any, op: Op) -> None:
    node = op.subject
    if len(op.args) < 2 or op.rec(op.args[0]) is not node:
        return tracer.set(op.out, unknown(node, f"`{op.name}` by the scores"))
    f = None if op.kwargs.get("rounding_mode") is not None or node.tanh or op.rec(op.args[1]) is not None \
        else factor(op.args[1], node)
    if isinstance(f, float):
        f = 1.0 / f if f != 0 else None
    elif f is not None:
        f = f.reciprocal()
    tracer.set(op.out, unknown(node, f"`{op.name}` of the scores by a tensor probe does not read") if f is None
               else scaled(node, f))


# -- biases --------------------------------------------------------------------------------------------
def add_bias(tracer: Any, op: Op, node: Scores, other: Any, coeff: Any) -> None:
    record = op.rec(other)
    if isinstance(record, (Scores, Derived, Operand, Slice, Moved, Shift, Probs)) and carries_scale(record):
        tracer.set(op.out, unknown(node, "a term made from q, k or the scores with the model's factor added to "
                                   "the scores"))
        return
    if number(other) and number(coeff) and not (node.unknown or node.tanh):
        if other * coeff == 0:  # ``scores + 0`` (XLNet without segments)
            return tracer.set(op.out, node)
        other = torch.full((), float(other), dtype=op.out.dtype, device=op.out.device)  # a constant bias
    describable = isinstance(other, Tensor) and other.dtype != torch.bool and number(coeff)
    if node.unknown or node.tanh or not describable:
        why = f"`{op.name}` of the scores and a number or a tensor probe does not read"
        if describable and other.dim() > 0:  # (a term carrying the scale returned above)
            # the scale is unknown, but a tensor term still masks the keys where it is at most
            # MASK_BIAS (an additive -1e4 mask after a clamp): the softmax input's valid keys
            # (probe.capture.eager_scores.to_call)
            term = (other, float(coeff), _layout(node, op.out))
            return tracer.set(op.out, dataclasses.replace(unknown(node, why), biases=node.biases + (term,)))
        tracer.set(op.out, unknown(node, why))
        return
    tracer.set(op.out, dataclasses.replace(node, biases=node.biases + ((other, float(coeff), _layout(node, op.out)),)))


@rule(K.ADD, Scores)
def plus(tracer: Any, op: Op) -> None:
    node = op.subject
    if len(op.args) < 2:
        return
    i = 0 if op.rec(op.args[0]) is node else 1
    alpha = op.kwargs.get("alpha", 1)
    other = op.args[1 - i]
    rother = op.rec(other)
    if isinstance(rother, Scores) and _same(node, rother):  # plus a mix of themselves (talking heads: s + conv1x1(s))
        a, b = (node, rother) if i == 0 else (rother, node)
        tracer.set(op.out, mix_sum(a, b, alpha))
        return
    if i == 1 and alpha != 1:  # a + alpha * scores
        tracer.set(op.out, unknown(node, "`add` with a factor on the scores"))
        return
    add_bias(tracer, op, node, other, alpha if i == 0 else 1)


@rule(K.SUB, Scores)
def minus(tracer: Any, op: Op) -> None:
    from probe.capture.rules_softmax import centred

    node = op.subject
    if len(op.args) < 2 or op.rec(op.args[0]) is not node:
        return tracer.set(op.out, unknown(node, "the scores subtracted from a tensor"))
    other = op.args[1]
    rother = op.rec(other)
    alpha = op.kwargs.get("alpha", 1)
    if isinstance(rother, Scores) and _same(node, rother):
        tracer.set(op.out, mix_sum(node, rother, -alpha if number(alpha) else None))
        return
    if isinstance(rother, Shift) and rother.of is node and alpha == 1:
        centred(tracer, op, node, rother)
        return
    add_bias(tracer, op, node, other, -alpha if number(alpha) else None)


def _same(a: Scores, b: Scores) -> bool:
    """Whether two records describe the same product (one of them maybe mixed over heads). Scores
    of another product added (DeBERTa's content-to-position terms, XLNet's positional scores) are
    a bias when they carry no factor of the model's scale, else they make the scale unknown."""
    return (a.mix[0] if a.mix else a) is (b.mix[0] if b.mix else b) or (a.q is b.q and a.k is b.k)


def mix_sum(a: Scores, b: Scores, coeff: Any) -> Scores:
    """``a + coeff·b`` of two records of the same scores, each the scores themselves or a mix
    of them over heads with nothing applied after it (``s + conv1x1(s)``): the mix
    ``M_a + coeff·M_b``; anything else is unknown."""
    why = "scores added to other scores"
    mixes = []
    for node in (a, b):
        if node.mix is None:
            mixes.append((node, None))
            continue
        root, m, n_biases = node.mix
        if (node.unknown or node.masks or len(node.biases) != n_biases or node.softcap is not None
                or node.scale_t is not None or not root.scale):
            return unknown(a, why)
        mixes.append((root, m * (node.scale / root.scale)))  # ``0.5 * conv1x1(s)``: the factor is the mix's
    (ra, ma), (rb, mb) = mixes
    if ra is not rb or (ma is None and mb is None) or not number(coeff):
        return unknown(a, why)
    eye = torch.eye(ra.q.shape[1], dtype=ra.q.dtype, device=ra.q.device)
    ma, mb = (eye if ma is None else ma), (eye if mb is None else mb)
    if ma.shape != mb.shape:
        return unknown(a, why)
    return mixed(ra, ma + coeff * mb, why)


# -- masks ---------------------------------------------------------------------------------------------
def add_mask(tracer: Any, op: Op, node: Scores, mask: Any, invert: bool, fill: Any) -> None:
    # (also on scores whose scale is unknown: their softmax input is measured, and the mask says
    # which of its entries are fill values, not logits)
    ok = isinstance(mask, Tensor) and mask.dtype == torch.bool
    fill_t = None
    if ok and isinstance(fill, Tensor) and fill.is_floating_point() and op.rec(fill) is None:
        fill_t = fill.detach()  # compared with MASK_BIAS on device at emit time, no sync
    elif not (ok and number(fill) and fill <= MASK_BIAS):
        ok = False
    if not ok:
        tracer.set(op.out, unknown(node, f"`{op.name}` with a fill value above {MASK_BIAS:g} or a mask that is "
                                   "not boolean"))
        return
    tracer.set(op.out, dataclasses.replace(node, masks=node.masks + ((mask, invert, _layout(node, op.out), fill_t),)))


@rule(K.MASKED_FILL, Scores)
def masked_fill(tracer: Any, op: Op) -> None:
    node = op.subject
    if op.rec(op.args[0] if op.args else None) is not node:
        return tracer.set(op.out, unknown(node, "`masked_fill` with the scores as its value"))
    add_mask(tracer, op, node, op.arg(1, "mask"), True, op.arg(2, "value"))  # fills where the mask is True


@rule(K.WHERE, Scores)
def where(tracer: Any, op: Op) -> None:
    node = op.subject
    if len(op.args) != 3:
        return tracer.set(op.out, unknown(node, "`where` of the scores"))
    a, b = op.rec(op.args[1]), op.rec(op.args[2])
    for i, base, shifted in ((1, a, b), (2, b, a)):  # ``where(m, scores - 1e9, scores)``: keras.layers.Attention
        shift = _shift(base, shifted) if isinstance(base, Scores) else None
        if shift is not None:
            return add_mask(tracer, op, base, op.args[0], i == 2, shift)
    i = 1 if a is node else 2
    fill = op.args[2] if i == 1 else op.args[1]
    if op.rec(fill) is not None:
        return tracer.set(op.out, unknown(node, "`where` between the scores and another function of them"))
    add_mask(tracer, op, node, op.args[0], i == 2, fill)


def _shift(node: Scores, other: Any) -> Optional[Tensor]:
    """The term ``b`` when ``other`` is the record of ``node + b``: the same scores with one more
    additive bias (a number or a tensor). ``where(m, scores + b, scores)`` is then a mask of the
    entries it shifts, as a fill of ``b`` is: a mask where ``b`` is at most ``MASK_BIAS``; above,
    the record differs from the model there and the check against the model finds it."""
    if not isinstance(other, Scores) or len(other.biases) != len(node.biases) + 1:
        return None
    for f in dataclasses.fields(Scores):
        a, b = getattr(node, f.name), getattr(other, f.name)
        if f.name == "biases":
            b = b[:-1]
        if a is b:
            continue
        if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(x is y for x, y in zip(a, b)):
            continue
        if isinstance(a, Tensor) or isinstance(b, Tensor) or a != b:
            return None
    t, coeff, _ = other.biases[-1]
    return (t if coeff == 1.0 else t * coeff).detach()


# -- soft cap, floors ----------------------------------------------------------------------------------
@rule(K.TANH, Scores)
def tanh(tracer: Any, op: Op) -> None:
    node = op.subject
    plain = not (node.unknown or node.tanh or node.biases or node.masks or node.softcap is not None)
    tracer.set(op.out, dataclasses.replace(node, tanh=True) if plain else unknown(node, "`tanh` after a bias or mask"))


def _floor(tracer: Any, op: Op, node: Scores, floor: Any, cap: Any) -> None:
    """A floor at or below the mask fill only touches masked entries (XGLM, OPT): the record
    holds; any other floor or a cap makes the scale unknown."""
    value, _ = prescale_factor(floor, False) if floor is not None else (MASK_FILL, None)
    keeps = cap is None and value is not None and value <= MASK_FILL
    tracer.set(op.out, node if keeps else unknown(node, f"`{op.name}` of the scores"))


@rule(K.FLOOR, Scores)
def floor(tracer: Any, op: Op) -> None:
    node = op.subject
    if op.name in ("maximum",):
        other = op.args[1] if op.rec(op.args[0]) is node else op.args[0]
        return _floor(tracer, op, node, other if op.rec(other) is None else "no", None)
    lo, hi = (tuple(op.args[1:]) + (None, None))[:2]
    lo, hi = op.kwargs.get("min", lo), op.kwargs.get("max", hi)
    _floor(tracer, op, node, lo, hi)


@rule(K.MAX, Scores)
def maximum(tracer: Any, op: Op) -> None:
    """``torch.max(scores, other)``: a floor; ``scores.amax(-1, keepdim=True)`` /
    ``scores.max(-1, keepdim=True)``: a row statistic (:class:`Shift`), e.g. for a softmax spelled out."""
    node, x = op.subject, op.args[0] if op.args else None
    second = op.arg(1, "dim")
    if isinstance(second, Tensor):
        return _floor(tracer, op, node, second if op.rec(second) is None else "no", None)
    keepdim = op.arg(2, "keepdim", False)
    values = op.out[0] if isinstance(op.out, tuple) else op.out
    if isinstance(values, Tensor) and isinstance(x, Tensor) and keepdim and second in (-1, x.dim() - 1):
        tracer.set(values, Shift(node, "max"))


# -- casts and views -----------------------------------------------------------------------------------
@rule((K.CAST, K.DETACH), Scores, Slice, Shift)
def keep(tracer: Any, op: Op) -> None:
    if isinstance(op.out, Tensor):
        tracer.set(op.out, op.subject)


@rule(K.NAN_TO_NUM, Scores)
def finite(tracer: Any, op: Op) -> None:
    """``nan_to_num(scores)`` (torchscale's decoder, before its causal mask): finite scores are left
    as they are and ``-inf`` becomes the dtype's most negative value, still a mask fill, so the
    record holds. A fill of its own for ``-inf`` above the mask fill, or for ``+inf``, changes what
    the softmax sees of such entries: unknown."""
    neginf = op.arg(3, "neginf")
    keeps = op.arg(2, "posinf") is None and (neginf is None or number(neginf) and neginf <= MASK_FILL)
    tracer.set(op.out, op.subject if keeps else unknown(op.subject, f"`{op.name}` of the scores with its own fills"))


@rule(K.VIEW, Scores)
def view(tracer: Any, op: Op) -> None:
    x, out, node = op.args[0], op.out, op.subject
    if not isinstance(out, Tensor):
        return
    if op.func in (torch.view_as_complex, torch.view_as_real):
        return tracer.set(out, Derived(carries_scale(node), "the scores viewed as complex numbers"))
    record = reshaped(node, x, out)
    tracer.set(out, record if record is not None else Derived(carries_scale(node), f"`{op.name}` of the scores"))


@rule((K.VIEW, K.ADD, K.SUB), Slice)
def slice_kept(tracer: Any, op: Op) -> None:
    """A part of the scores viewed, or plus a tensor that is not a record: still a part."""
    if op.kind == K.VIEW:
        return tracer.set(op.out, op.subject)
    a, b = (op.args + (None, None))[:2]
    ra, rb = op.rec(a), op.rec(b)
    scaled_slice = isinstance(rb, Slice) and op.kwargs.get("alpha", 1) != 1
    other = rb if isinstance(ra, Slice) else ra  # a bias made without the model's factor is still a bias
    if isinstance(op.out, Tensor) and not scaled_slice and not isinstance(other, Slice) \
            and not carries_scale(other) and (op.kind == K.ADD or isinstance(ra, Slice)):
        tracer.set(op.out, op.subject)
    else:
        tracer.set(op.out, Derived(carries_scale(op.subject), "a part of the scores"))


def _perm(op: Op, x: Tensor) -> Optional[Tuple[int, ...]]:
    n = x.dim()
    if op.kind == K.TRANSPOSE:
        if op.name in ("mT",):
            dims = [n - 2, n - 1]
        elif op.name == "t":
            dims = [0, 1] if n == 2 else []
        else:
            dims = [d % n for d in op.args[1:3] if isinstance(d, int)]
        if len(dims) != 2:
            return None
        perm = list(range(n))
        perm[dims[0]], perm[dims[1]] = perm[dims[1]], perm[dims[0]]
        return tuple(perm)
    if op.name == "movedim":
        return None
    dims = op.args[1:] if len(op.args) > 2 or not isinstance(op.args[1] if len(op.args) > 1 else None, (list, tuple)) \
        else op.args[1]
    dims = tuple(op.kwargs.get("dims", dims))
    if len(dims) != n or not all(isinstance(d, int) for d in dims):
        return None
    return tuple(d % n for d in dims)


@rule((K.TRANSPOSE, K.PERMUTE), Scores, Moved, Probs)
def moved(tracer: Any, op: Op) -> None:
    """Scores (or probabilities) permuted: :class:`Moved` until permuted back to their layout."""
    x, record = op.args[0], op.subject
    perm = _perm(op, x) if isinstance(x, Tensor) and isinstance(op.out, Tensor) else None
    if perm is None:
        inner = record.of if isinstance(record, Moved) else record
        if isinstance(inner, Scores):
            tracer.set(op.out, Derived(carries_scale(inner), f"`{op.name}` of the scores"))
        return
    base = record.perm if isinstance(record, Moved) else tuple(range(x.dim()))
    inner = record.of if isinstance(record, Moved) else record
    new = tuple(base[d] for d in perm)
    tracer.set(op.out, inner if new == tuple(range(len(new))) else Moved(inner, new))


@rule(K.INDEX, Scores)
def part(tracer: Any, op: Op) -> None:
    """``scores[idx]``: a part of the scores, maybe written back (``SETITEM``); other parts: derived."""
    node = op.subject
    if op.name == "__getitem__" and isinstance(op.out, Tensor) and not (node.unknown or node.tanh
                                                                        or node.softcap is not None):
        return tracer.set(op.out, Slice(node))
    for out in op.outs:
        tracer.set(out, Derived(carries_scale(node), f"`{op.name}` of the scores"))


@rule(K.JOIN, Scores)
def joined(tracer: Any, op: Op) -> None:
    """Scores joined along the keys with logits that are not scores (x-transformers' learned
    attention sink: ``cat((sink, sim), dim=-1)``): a softmax over them is reported from its
    input, scale unknown; joined any other way they are no longer these scores."""
    parts = op.args[0] if op.args and isinstance(op.args[0], (list, tuple)) else ()
    dim = op.arg(1, "dim", 0)
    node = op.subject
    x = next((t for t in parts if op.rec(t) is node), None)
    keys = isinstance(x, Tensor) and isinstance(dim, int) and dim in (-1, x.dim() - 1)
    if keys and isinstance(op.out, Tensor) and all(op.rec(t) is None for t in parts if t is not x):
        tracer.set(op.out, unknown(node, "the scores joined with other logits along the keys (an attention sink)"))
        return
    tracer.set(op.out, Derived(carries_scale(node), "the scores joined with other tensors"))


# -- scores written in place ---------------------------------------------------------------------------
def _overwritten(tracer: Any, op: Op) -> None:
    node = op.rec(op.args[0]) if op.args else None
    tracer.saved = None
    if len(op.args) < 3 or not isinstance(node, Scores) or node.unknown:
        return
    with torch.no_grad():
        tracer.saved = op.args[0][op.args[1]].clone()


before(K.SETITEM, Scores)(_overwritten)


@rule(K.SETITEM, Scores, Slice)
def written(tracer: Any, op: Op) -> None:
    """``t[idx] = value`` changed ``t`` in place. Scores written back as a part of themselves plus
    tensors (timm MViTv2: ``attn[:, :, 1:, 1:] = attn[...].view(...) + rel_h + rel_w``) or with a
    mask fill ``<= -100`` keep their record, the change a bias; any other write makes the scale
    unknown. Scores written into another tensor make it :class:`Derived` (never a fixed bias)."""
    target = op.args[0] if op.args else None
    record, before_values, tracer.saved = op.rec(target), tracer.saved, None
    value = op.args[2] if len(op.args) > 2 else None
    written_rec = op.rec(value)
    if not isinstance(record, Scores):
        if isinstance(target, Tensor) and written_rec is not None:
            tracer.set(target, Derived(carries_scale(written_rec), "scores written into a tensor"))
        return
    ok = before_values is not None and ((isinstance(written_rec, Slice) and written_rec.of is record)
                                        or (written_rec is None and number(value) and value <= MASK_BIAS))
    if not ok:
        tracer.set(target, unknown(record, "the scores written in place"))
        return
    with torch.no_grad():
        after = target[op.args[1]]
        delta = torch.zeros(target.shape, dtype=torch.float32, device=target.device)
        delta[op.args[1]] = torch.where(after == before_values, 0.0, after.float() - before_values.float())
    tracer.set(target, dataclasses.replace(record, biases=record.biases + ((delta, 1.0, _layout(record, target)),)))
