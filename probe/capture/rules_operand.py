"""Rules for q and k on their way from their projection to the product (:class:`Operand` records).

A scale is attributed only along a path the rules fully model. A tensor with no record is
features (a projection's or a norm's output: factor 1). Then:

* ``t * s`` / ``t / c`` (any spelling, in place or not) by a Python number or a one-element tensor
  records the factor; ``t.mul_(s)`` keeps ``t / s`` as the unscaled base;
* ops linear in every tensor they take replay on the unscaled base, so the factor still holds:
  views, reshapes, transposes, permutations, parts (``unbind``, ``chunk``, slicing), ``cat`` /
  ``stack`` of tensors with one factor, ``neg``, casts, a sum of two tensors with one factor, a
  product with a tensor that varies along the features (a rotary ``cos`` / ``sin``);
* a projection or a norm starts new features (the factor is absorbed, no record);
* anything else on a scaled tensor (``+ 1``, a multiplier constant along the features that may
  be a norm of it, ``clamp``, an op outside the vocabulary, an in-place write) makes it *opaque*:
  a product with it has an unknown scale (reported at ``actual`` only, warned).

Layout facts ride along: ``(B, H, n, d) -> (B·H, n, d)`` reshapes (heads folded into the batch,
also ``(3, B, H, n, d) -> (3, B·H, n, d)`` before an ``unbind``) and Hugging Face's ``repeat_kv``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

import torch
from torch import Tensor

from probe.capture import ops as K
from probe.capture.eager_scores import number, prescale_factor, repeat_kv
from probe.capture.records import Derived, Exp, ExpSum, LogProbs, Moved, Operand, Probs, Scores, Shift, Slice, hide
from probe.capture.rules import Op, rule

__all__: List[str] = []

#: ops linear in every tensor they take: a factor on their input is a factor on their output
_STRUCTURAL = (K.VIEW, K.TRANSPOSE, K.PERMUTE, K.INDEX, K.JOIN, K.EXPAND, K.CAST, K.DETACH, K.NEG, K.SUM, K.MEAN)
_ALL = (Scores, Slice, Moved, Shift, LogProbs, Exp, ExpSum, Probs, Derived, Operand)


def _opaque(record: Operand, why: str) -> Optional[Operand]:
    return hide(record, why)


def _in_place(op: Op, x: Any) -> bool:
    return op.out is x


# -- factors -------------------------------------------------------------------------------------------
@rule((K.MUL, K.DIV), None, Operand)
def factor(tracer: Any, op: Op) -> None:
    """``t * s``, ``s * t``, ``t / c`` (in place or not): a scalar factor on a future q or k."""
    if len(op.args) < 2 or not isinstance(op.out, Tensor):
        return
    a, b = op.args[0], op.args[1]
    divide = op.kind == K.DIV
    if divide and op.kwargs.get("rounding_mode") is not None:
        return _touched(tracer, op)
    x, s = (b, a) if _weight(op, b) > _weight(op, a) else (a, b)
    if divide and x is not a:
        return _touched(tracer, op)  # c / t: not linear in t
    if not isinstance(x, Tensor) or x.dim() < 2:  # 2-d: queries without batch, or (B·T, D) rows
        return _touched(tracer, op)
    f, f_t = prescale_factor(s, divide)
    record = op.rec(x)
    record = record if isinstance(record, Operand) else None
    if f is None and f_t is None:
        return _times_tensor(tracer, op, x, s, record, divide)
    if record is not None and record.opaque:
        tracer.set(op.out, record)
        return
    shown = (f"{float(s.detach() if isinstance(s, Tensor) else s):.4g}"
             if number(s) or (isinstance(s, Tensor) and s.device.type == "cpu") else "a tensor")
    word = "divided by" if divide else "multiplied by"
    in_place = _in_place(op, x)
    if record is not None and record.base is not None:
        base, old, old_t, text = record.base, record.factor, record.factor_t, record.how + " and "
    elif f == 1.0 and f_t is None:
        return  # ``t * 1.0``: nothing to take into the scale
    else:
        if in_place:  # the unscaled values are gone: t / s is the base (exact up to one rounding)
            with torch.no_grad():
                base = op.out.detach() / (f if f is not None else f_t.reshape(()).to(op.out.dtype))
        else:
            base = x
        old, old_t, text = 1.0, None, ""
    if f_t is not None or old_t is not None:
        f_t = (old_t if old_t is not None else torch.ones(1, device=op.out.device)) * (f_t if f_t is not None else f)
        f = 1.0
    merged = record.merged if record is not None else None
    how = f"{text}{word} {shown}" + (" in place" if in_place else "")
    tracer.set(op.out, Operand(base=base, factor=old * f, factor_t=f_t, how=how, merged=merged,
                               loose=record.loose if record is not None else x.dim() == 2,
                               batch_at=record.batch_at if record is not None else None,
                               ops=(record.ops if record is not None else ()) + (op.name,)))


def _table(t: Tensor, out: Any) -> bool:
    """Whether ``t`` is broadcast over a leading dim of ``out`` (a position table, a grid): never a
    function of a batched q or k, so its record (a grid's ``2 * g - 1``) is not theirs."""
    return isinstance(out, Tensor) and (t.dim() < out.dim() or any(
        n == 1 and m > 1 for n, m in zip(t.shape[:-1], out.shape[out.dim() - t.dim():-1])))


def _weight(op: Op, t: Any) -> int:
    """Which operand of ``t * s`` is the one a factor applies to: a recorded q or k, then any tensor
    that is not a broadcast table, then a table, then a number."""
    if not isinstance(t, Tensor):
        return 0
    if _table(t, op.out):
        return 1
    return 3 if isinstance(op.rec(t), Operand) else 2


def _times_tensor(tracer: Any, op: Op, x: Tensor, m: Any, record: Optional[Operand], divide: bool) -> None:
    """``t * m`` / ``t / m`` with ``m`` a tensor of several values. On a scaled ``t``: when ``m``
    varies along the features (a rotary ``cos`` / ``sin``, a gain) the factor still holds
    (``(base * m) * f``); a multiplier constant along the features may be a norm of ``t`` itself,
    which removes the factor: opaque. On features (no factor): still features."""
    if record is None or not record.scaled:
        return
    if record.opaque or not isinstance(m, Tensor) or record.base is None:
        return tracer.set(op.out, _opaque(record, f"`{op.name}` of q or k after its factor"))
    other = op.rec(m)
    if isinstance(other, Operand) and other.base is None and _table(m, op.out):
        other = None  # a table whose own factor was lost (a grid's 2 * g - 1): a plain table
    if isinstance(other, Operand) and other.scaled and not other.loose:  # both scaled: the factors multiply
        if divide or other.base is None or record.factor_t is not None or other.factor_t is not None:
            return tracer.set(op.out, _opaque(record, f"`{op.name}` of q or k after its factor by a function of "
                                              "itself (a norm?)"))
        with torch.no_grad():
            base = record.base * other.base
        return tracer.set(op.out, Operand(base=base, factor=record.factor * other.factor,
                                          how=" and ".join(h for h in (record.how, other.how) if h),
                                          ops=record.ops + (op.name,)))
    varies = m.dim() > 0 and m.shape[-1] == x.shape[-1] and x.shape[-1] > 1 and (m.is_floating_point() or m.is_complex())
    if not varies or _in_place(op, x):
        return tracer.set(op.out, _opaque(record, f"`{op.name}` of q or k after its factor by a tensor constant "
                                          "along the features (a norm?)"))
    base = record.base * m if not divide else record.base / m
    tracer.set(op.out, dataclasses.replace(record, base=base, kv=None, ops=record.ops + (op.name,)))


def _touched(tracer: Any, op: Op) -> None:
    """An op on a scaled operand that the rules do not model: its outputs are opaque."""
    scaled = next((r for r in op.records.values() if isinstance(r, Operand) and r.scaled), None)
    if scaled is not None:
        for out in op.outs:
            tracer.set(out, _opaque(scaled, f"`{op.name}` on q or k after its factor ({scaled.how or 'opaque'})"))


@rule((K.ADD, K.SUB), Operand)
def linear_sum(tracer: Any, op: Op) -> None:
    """``a ± b`` of two tensors with the same factor (the two halves of a rotary embedding; a
    scaled bias: Funnel's ``q * s + r_w_bias * s``); anything else added to a scaled tensor is not
    linear in the factor: opaque."""
    a, b = (op.args + (None, None))[:2]
    ra, rb = op.rec(a), op.rec(b)
    alpha = op.kwargs.get("alpha", 1)
    if isinstance(ra, Operand) and isinstance(rb, Operand) and ra.base is not None and rb.base is not None \
            and not ra.opaque and not rb.opaque and ra.factor == rb.factor and ra.factor_t is None \
            and rb.factor_t is None and number(alpha):
        with torch.no_grad():
            base = ra.base + alpha * rb.base if op.kind == K.ADD else ra.base - alpha * rb.base
        tracer.set(op.out, dataclasses.replace(ra, base=base, kv=None, ops=ra.ops + (op.name,)))
        return
    if _adapter_sum(op, a, b, ra, rb):
        return  # new features (no record): the factor is part of the projection, not a scale on q
    _touched(tracer, op)


#: the spellings of an out-of-place factor (``t * s``, ``t / c``): an in-place one changed a tensor
#: something else may hold
_OUT_OF_PLACE_FACTOR = frozenset("mul __mul__ __rmul__ multiply div __truediv__ divide true_divide".split())


def _adapter_sum(op: Op, a: Any, b: Any, ra: Any, rb: Any) -> bool:
    """Whether ``a ± b`` adds a factor times one projection's output to another's, as an adapter
    does (peft's LoRA: ``base(x) + lora_B(lora_A(x)) * s``): the factor scales part of q, which
    is then ``(W + s·BA)·x``, a projection with another weight, not a scale on ``q·kᵀ``. Only
    that shape counts: two distinct tensors of the output's full shape (no broadcast bias, no
    parameter), one without a factor, the other exactly ``f·t`` (its one op the factor, no
    layout change since), ``t`` not the other addend (``q + q·s`` is the factor ``1 + s``)."""
    if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(op.out, Tensor)) or _in_place(op, a):
        return False
    if op.out.dim() < 2 or a.shape != op.out.shape or b.shape != op.out.shape or not number(op.kwargs.get("alpha", 1)):
        return False
    plain, scaled = (a, rb) if ra is None else (b, ra) if rb is None else (None, None)
    if plain is None or not isinstance(scaled, Operand) or isinstance(plain, torch.nn.Parameter):
        return False
    if scaled.base is None or scaled.opaque or scaled.factor_t is not None or len(scaled.ops) != 1 or \
            scaled.ops[0] not in _OUT_OF_PLACE_FACTOR or \
            scaled.merged is not None or scaled.kv is not None or scaled.batch_at is not None or scaled.lead is not None:
        return False
    return scaled.base.untyped_storage().data_ptr() != plain.untyped_storage().data_ptr()


# -- ops linear in every tensor they take: replayed on the unscaled bases -----------------------------
@rule(_STRUCTURAL, Operand)
def replay(tracer: Any, op: Op) -> None:
    """A view, a part, a permutation, a join, ``neg``, a cast, a sum or mean (Nyströmformer's
    landmarks: means of segments of the scaled q and k): replayed on the unscaled bases (every tensor
    input must carry the same factor), layout facts kept where the op keeps them."""
    x = op.args[0] if op.args else None
    data = op.args[:1] if op.kind in K.FIRST else (*op.args, *op.kwargs.values())  # not type_as's `other`
    inputs = [t for a in data for t in K.tensors(a)]
    if op.kind == K.JOIN:  # an empty part adds nothing (a KV cache's first update: cat([empty, k]))
        inputs = [t for t in inputs if t.numel() > 0] or inputs
    records = [op.rec(t) for t in inputs]
    operands = [r for r in records if isinstance(r, Operand)]
    first = operands[0]
    if any(r.scaled for r in operands):
        if any(not (isinstance(r, Operand) and r.base is not None and not r.opaque) for r in records) or \
                len({(r.factor, id(r.factor_t)) for r in operands}) != 1:
            return _touched(tracer, op)

        def sub(a: Any) -> Any:
            if isinstance(a, Tensor):
                return op.rec(a).base if any(a is t for t in inputs) else a
            if isinstance(a, (list, tuple)) and any(isinstance(t, Tensor) for t in a):
                return type(a)(sub(t) for t in a)
            return a

        with torch.no_grad():
            bases = op.func(*(sub(a) for a in op.args), **{k: sub(v) for k, v in op.kwargs.items()})
        outs, bases = (op.outs, list(bases) if isinstance(bases, (list, tuple)) else [bases])
        for o, b in zip(outs, bases):
            if isinstance(b, Tensor) and tuple(b.shape) == tuple(o.shape):
                _note_fold(tracer, op, x, o, first)
                tracer.set(o, dataclasses.replace(first, base=b, kv=_kv(op, x, o, first),
                                                  merged=_merged(op, x, o, first), batch_at=_batch_at(op, x, o, first),
                                                  lead=_lead(op, x, o, first), ops=first.ops + (op.name,)))
            else:
                tracer.set(o, _opaque(first, f"`{op.name}` on q or k after its factor"))
        return
    # no factor: only layout facts, where the op keeps them
    for o in op.outs:
        kv = _kv(op, x, o, first)
        merged, batch_at, lead = _merged(op, x, o, first), _batch_at(op, x, o, first), _lead(op, x, o, first)
        _note_fold(tracer, op, x, o, first)
        if kv is not None or merged is not None or batch_at is not None or lead is not None:
            tracer.set(o, Operand(kv=kv, merged=merged, batch_at=batch_at, lead=lead))


def _kv(op: Op, x: Any, out: Tensor, record: Operand) -> Optional[Tensor]:
    """The kv heads ``out`` repeats, scaled or not: kept through a cast and a swap of the last two
    dims, found at ``repeat_kv``'s reshape of a tensor that already carries a factor (MiMo-V2's
    ``v * v_scale``, a k scaled before it is repeated); without them a grouped-query call's k or v
    would be recorded per query head, and its ``grad_k`` / ``grad_v`` could not join the site's."""
    if op.kind == K.VIEW and isinstance(x, Tensor) and x.dim() == 5 and out.dim() == 4 and x.stride(2) == 0:
        repeated = repeat_kv(x, out)
        return None if repeated is None else repeated.kv
    if record.kv is None:
        return None
    if op.kind in (K.CAST, K.DETACH):
        return record.kv
    return record.kv.transpose(-1, -2) if _swaps_last_two(op, x) else None


def _batch_at(op: Op, x: Any, out: Tensor, record: Optional[Operand]) -> Optional[int]:
    """Where the batch dim is in ``out`` (from the end), when a permutation moved it."""
    if not isinstance(x, Tensor):
        return None
    n = x.dim()
    at = None if record is None else record.batch_at
    if op.kind in (K.TRANSPOSE, K.PERMUTE):
        perm = _permutation(op, n)
        if perm is None:
            return None
        where = (at % n) if at is not None else 0
        moved = perm.index(where) - n
        return None if moved == -n and at is None else moved
    if at is None or out.dim() < -at or x.dim() < -at:
        return None
    keeps = op.kind in (K.CAST, K.DETACH, K.NEG, K.INDEX, K.VIEW) and tuple(out.shape[at:]) == tuple(x.shape[at:])
    return at if keeps else None


def _permutation(op: Op, n: int) -> Optional[List[int]]:
    if op.kind == K.TRANSPOSE:
        if op.name == "mT":
            dims = [n - 2, n - 1]
        else:
            dims = [d % n for d in op.args[1:3] if isinstance(d, int)] if op.name != "t" else [0, 1]
        if len(dims) != 2:
            return None
        perm = list(range(n))
        perm[dims[0]], perm[dims[1]] = perm[dims[1]], perm[dims[0]]
        return perm
    if op.name == "movedim":
        return None
    given = op.args[1:] if len(op.args) > 2 or not isinstance(op.args[1] if len(op.args) > 1 else None,
                                                               (list, tuple)) else op.args[1]
    given = list(op.kwargs.get("dims", given))
    return [d % n for d in given] if len(given) == n and all(isinstance(d, int) for d in given) else None


@rule((K.TRANSPOSE, K.PERMUTE), None)
def batch_moved(tracer: Any, op: Op) -> None:
    """A permutation that moves the batch dim (``q.permute(2, 0, 1, 3)``: heads first, folded
    head-major next) is remembered (:attr:`Operand.batch_at`)."""
    x = op.args[0] if op.args else None
    if isinstance(op.out, Tensor) and isinstance(x, Tensor) and x.is_floating_point() and x.dim() >= 4:
        at = _batch_at(op, x, op.out, None)
        if at is not None:
            tracer.set(op.out, Operand(batch_at=at))


def _swaps_last_two(op: Op, x: Any) -> bool:
    if not isinstance(x, Tensor):
        return False
    if op.kind == K.TRANSPOSE:
        dims = [d for d in op.args[1:3] if isinstance(d, int)]
        return op.name == "mT" or (len(dims) == 2 and {d % x.dim() for d in dims} == {x.dim() - 2, x.dim() - 1})
    return False


def _folded(x: Any, out: Any, record: Optional[Operand] = None) -> Optional[tuple]:
    """``(B, H)`` when ``out`` is ``x`` with its heads folded into the batch: ``(B, H, n, d) ->
    (B·H, n, d)``, also with leading dims kept (``(3, B, H, n, d) -> (3, B·H, n, d)``);
    ``(B, H, "hb")`` when the batch dim was moved second (``(H, B, n, d)``: head-major rows)."""
    if isinstance(x, Tensor) and isinstance(out, Tensor) and x.dim() >= 4 and out.dim() == x.dim() - 1 \
            and tuple(out.shape[-2:]) == tuple(x.shape[-2:]) and tuple(out.shape[:-3]) == tuple(x.shape[:-4]) \
            and out.shape[-3] == x.shape[-4] * x.shape[-3] and x.shape[-3] > 1 \
            and x.stride(-4) != 0 and x.stride(-3) != 0:  # an expanded dim repeats kv heads (repeat_kv): no fold
        if record is not None and record.batch_at == -3:
            return (x.shape[-3], x.shape[-4], "hb")
        return (x.shape[-4], x.shape[-3])
    return None


def _split_fold(x: Any, out: Any) -> Optional[tuple]:
    """``(B, H)`` when a sequence-first ``(T, B, H·d)`` is viewed ``(T, B·H, d)`` (fairseq, PyTorch's
    own multi-head function): its rows ``B·H`` become the batch of a product after a transpose."""
    if isinstance(x, Tensor) and isinstance(out, Tensor) and x.dim() == out.dim() == 3 \
            and out.shape[0] == x.shape[0] and out.shape[-1] < x.shape[-1] and x.shape[-1] % out.shape[-1] == 0:
        heads = x.shape[-1] // out.shape[-1]
        if heads > 1 and out.shape[1] == x.shape[1] * heads:
            return (x.shape[1], heads)
    return None


def _lead(op: Op, x: Any, out: Tensor, record: Optional[Operand]) -> Optional[tuple]:
    """``(B, H)`` when dim 0 of ``out`` holds the ``B·H`` rows of a fold: a fold into a 3-D tensor
    now, or ``x``'s kept by an op that leaves dim 0 alone (views of the rest, parts, casts)."""
    if not isinstance(x, Tensor) or out.dim() < 3:
        return None
    if op.kind == K.VIEW and out.dim() == 3:
        folded = _folded(x, out, record)
        if folded is not None and len(folded) == 2:
            return folded
    lead = None if record is None else (record.lead or (record.merged if x.dim() == 3 and record.merged
                                                        and len(record.merged) == 2 else None))
    if lead is None or out.shape[0] != x.shape[0]:
        return None
    if op.kind in (K.VIEW, K.INDEX, K.CAST, K.DETACH, K.NEG, K.JOIN):
        return lead
    if op.kind in (K.TRANSPOSE, K.PERMUTE):
        perm = _permutation(op, x.dim())
        return lead if perm is not None and perm[0] == 0 else None
    return None


def _note_fold(tracer: Any, op: Op, x: Any, out: Tensor, record: Optional[Operand]) -> None:
    """Tell the tracer about a fold of heads into the batch rows seen in the running module
    (``EagerFrontEnd.fold_seen``): a later product there whose records lost it reads it back."""
    if op.kind != K.VIEW:
        return
    folded = _folded(x, out, record)
    if folded is not None:
        tracer.fold_seen(folded, out.shape[-3])
    elif _split_fold(x, out) is not None:
        tracer.fold_seen(_split_fold(x, out), out.shape[1])


def _merged(op: Op, x: Any, out: Tensor, record: Operand) -> Optional[tuple]:
    """``(B, H)`` of ``out``'s dim -3 when it still holds the ``B·H`` rows of ``x``'s (or folds them now)."""
    if op.kind == K.VIEW and _folded(x, out, record) is not None:
        return _folded(x, out, record)
    if record.merged is None or not isinstance(x, Tensor) or out.dim() < 3 or x.dim() < 3:
        return None
    if op.kind in (K.CAST, K.DETACH, K.NEG) or (_swaps_last_two(op, x) and out.shape[-3] == x.shape[-3]):
        return record.merged
    if op.kind in (K.INDEX, K.VIEW) and tuple(out.shape[-3:]) == tuple(x.shape[-3:]):
        return record.merged
    if op.kind in (K.INDEX, K.JOIN) and out.dim() == x.dim() and out.shape[-3] == x.shape[-3]:
        # a part or a join along the tokens or features (RvT: the class token split off, rotated, joined back)
        others = [op.rec(t) for a in op.args for t in K.tensors(a)] if op.kind == K.JOIN else [record]
        if all(isinstance(r, Operand) and r.merged == record.merged for r in others):
            return record.merged
    return None


@rule(K.VIEW, None)
def layout(tracer: Any, op: Op) -> None:
    """A reshape that folds heads into the batch (``(B, H, n, d) -> (B·H, n, d)``, also with
    leading dims kept: ``(3, B, H, n, d) -> (3, B·H, n, d)``), or Hugging Face's ``repeat_kv``
    (``k[:, :, None].expand(B, Hk, n, S, d).reshape(B, Hk·n, S, d)``)."""
    x, out = op.args[0] if op.args else None, op.out
    if not isinstance(x, Tensor) or not isinstance(out, Tensor) or not x.is_floating_point():
        return
    if x.dim() == 5 and out.dim() == 4 and x.stride(2) == 0:
        tracer.set(out, repeat_kv(x, out))
        return
    folded = _folded(x, out)
    if folded is not None:
        tracer.set(out, Operand(merged=folded, lead=folded if out.dim() == 3 and len(folded) == 2 else None))
    _note_fold(tracer, op, x, out, None)


@rule(K.LINEAR_IN, None, Operand)
def hidden_coefficient(tracer: Any, op: Op) -> None:
    """``addcmul``, ``addcdiv``, ``lerp``: linear with a coefficient the rules do not read."""
    for out in op.outs:
        if out.dim() >= 3 and out.is_floating_point():
            tracer.set(out, Operand(opaque=f"`{op.name}` on q or k (a coefficient probe does not read)"))


@rule(K.SETITEM, Operand)
def written_into(tracer: Any, op: Op) -> None:
    """``t[idx] = value``: a scaled value written into ``t`` makes ``t`` opaque (a KV cache filled with
    a scaled k); a write into a scaled ``t`` makes it opaque (the in-place check of the tracer)."""
    target, value = op.args[0] if op.args else None, op.args[2] if len(op.args) > 2 else None
    rv = op.rec(value)
    if isinstance(rv, Operand) and rv.scaled and isinstance(target, Tensor):
        tracer.set(target, _opaque(rv, "a scaled q or k written into a tensor"))


@rule(K.COPY, *_ALL, None)
def copied(tracer: Any, op: Op) -> None:
    """``t.copy_(src)``: ``t`` takes ``src``'s values, and its record."""
    target, src = (op.args + (None, None))[:2]
    record = op.rec(src)
    if isinstance(target, Tensor) and isinstance(src, Tensor) and target.shape == src.shape:
        tracer.set(target, record if isinstance(record, (Operand, Derived)) else None)
    elif isinstance(target, Tensor):
        tracer.set(target, Derived(True, "a copy") if record is not None else None)


@rule(K.FACTORY, *_ALL)
def factory(tracer: Any, op: Op) -> None:
    """``zeros_like``, ``new_full``, ...: values unrelated to the input's (no record)."""
