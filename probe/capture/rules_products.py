"""Rules for products: ``q @ kᵀ`` starts scores, ``P @ v`` completes a call, mixes over heads.

A product of two batched activations (``matmul``, ``@``, ``bmm``, ``baddbmm``, a two-operand
``einsum`` by any binding of its letters, any number of leading dims) starts a
:class:`~probe.capture.records.Scores` record: ``q = a``, ``k = b.transpose(-1, -2)`` (or the
einsum's operands permuted into ``(..., L, d)`` / ``(..., S, d)``). The operands' own records
give their factors, whichever side carries them and whatever permutes them on the way (the same
map is applied to the record's unscaled ``base`` as to the operand); an *opaque* operand gives
scores whose scale cannot be attributed. A product with a weight (a parameter or a view of one) is a
projection: its output starts new features (no record), except on the left of a batched activation,
*learned queries* (vit-pytorch's ``PatchMerger``: ``softmax(self.queries @ xᵀ · s) @ x``, attention
pooling): a weight ``(..., N, d)``, or queries shared by every batch row (:func:`shared_rows`:
``(self.queries * s)``, ``self.to_q(self.latents)``), times an activation ``(B, ..., d, T)`` over the features starts
``Scores.learned``, ``q`` the weight broadcast to the batch (``(B, 1, N, d)``; ``(B, H, N, d)``, heads
split), ``k`` the tokens: a call only at a softmax over the tokens (the last dim); any op that is not on
the way to it forgets the record (:meth:`~probe.capture.eager.EagerFrontEnd.handle`). A weight on the
right (``x @ Wᵀ``, ``F.linear``: a classifier, a router) or a softmax over the weight's rows stays a
projection. grad_q is measured when the model expanded the weight to the batch itself, else named.

Extra leading dims join the batch, dim -3 the heads (named if the module declares another count). The
model's own operands carry the gradient hooks (:func:`~probe.capture.eager_scores.grad_map`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from probe.capture import ops as K
from probe.capture.eager_scores import (broadcasts, grad_map, head_mix, heads_of, kv_heads, number, permuted,
                                        shared_rows, unfold, weight, windowed)
from probe.capture.records import Derived, Moved, Operand, Probs, Scores, hide
from probe.capture.rules import Op, default, rule, unknown

__all__ = ["einsum_pair", "pv_roles", "qk_roles", "start"]

Map = Callable[[Tensor], Tensor]


def _same(t: Tensor) -> Tensor:
    return t


def _transposed(t: Tensor) -> Tensor:
    return t.transpose(-1, -2)


def start(tracer: Any, op: Op, own_a: Any, own_b: Any, q_of: Map = _same, k_of: Map = _transposed,
          scale: float = 1.0) -> Optional[Scores]:
    """A score record for a product of ``own_a`` and ``own_b`` (the model's own operands) when
    both are batched activations: ``q = q_of(a)`` (``(..., L, d)``), ``k = k_of(b)``
    (``(..., S, d)``), with the factors their records carry taken out into the scale."""
    if not (isinstance(own_a, Tensor) and isinstance(own_b, Tensor) and isinstance(op.out, Tensor)):
        return None
    # learned queries (see the module docstring): a weight, or queries shared by every batch row
    learned = (weight(own_a) and own_a.dim() >= 2) or shared_rows(own_a, own_b)
    if own_a.dim() < (2 if learned else 3) or own_b.dim() < 3 or (weight(own_a) and not learned) or weight(own_b):
        return None
    ra, rb = op.rec(own_a), op.rec(own_b)
    ra = ra if isinstance(ra, Operand) else None
    rb = rb if isinstance(rb, Operand) else None
    q = q_of(ra.base if ra is not None and ra.base is not None else own_a)
    k = k_of(rb.base if rb is not None and rb.base is not None else own_b)
    per_row = not learned
    if learned and q.dim() <= k.dim() and q.shape[-1] == k.shape[-1] and broadcasts(q.shape[:-2], k.shape[:-2]):
        per_row = tuple(q.shape[:-2]) == tuple(k.shape[:-2])  # the model's own q holds every batch row
        q = q if per_row else q.expand(*k.shape[:-2], *q.shape[-2:])
    if q.dim() != k.dim():
        return None
    scale_t: Optional[Tensor] = None
    factors = []
    how = []
    for name, r in (("q", ra), ("k", rb)):
        f: Any = 1.0
        if r is not None and r.base is not None:
            f = r.factor if r.factor_t is None else r.factor_t * r.factor
            how.append(f"{name} {r.how}".rstrip())
        factors.append(f)
        if isinstance(f, Tensor):
            scale_t = f.reshape(1) if scale_t is None else scale_t * f.reshape(1)
        else:
            scale = scale * f
    if rb is not None and rb.kv is not None:  # grouped-query attention: the kv heads, not their repeated copies
        k = k_of(rb.kv) if rb.base is None else kv_heads(k, rb.kv.shape[1])
    heads_from = merged = None
    lead = next((r.lead for r in (ra, rb) if r is not None and r.lead is not None), None) if q.dim() >= 4 else None
    fold = lead or (tracer.fold_of(q.shape[0]) if q.dim() >= 4 else None)
    if lead is not None and q.dim() == 4 and q.shape[0] == lead[0] * lead[1] and k.shape[0] % lead[0] == 0:
        # the leading dim holds heads folded into the batch in this module, dim 1 windows
        # (local-attention: (B·H, W, n, d)): read as (B·W, H, n, d)
        merged = (lead[0], lead[1], "win", q.shape[1])
        q, k = unfold(q, merged), unfold(k, merged)
        q_of = (lambda t, f=q_of, m=merged: unfold(f(t), m))
        k_of = (lambda t, f=k_of, m=merged: unfold(f(t), m))
    elif fold is not None:
        heads_from = (f"its product's leading dim holds the {fold[0]}·{fold[1]} rows of heads folded into the batch "
                      f"in this module, and its dim 1 ({q.shape[1]}: windows?) is reported as heads")
    if q.dim() > 4:  # extra leading dims (windows, blocks: (B, T, H, N, d)): flattened into the batch
        heads_from, q, k = heads_from or _grouped(tracer, q), q.reshape(-1, *q.shape[-3:]), k.reshape(-1, *k.shape[-3:])
    if q.dim() == 3:
        merged, heads_from = _heads(tracer, q, ra, rb)
        if merged is not None and q.shape[0] == merged[0] * merged[1] and k.shape[0] % merged[0] == 0:
            q, k = unfold(q, merged), unfold(k, merged)
            q_of = (lambda t, f=q_of, m=merged: unfold(f(t), m))
            k_of = (lambda t, f=k_of, m=merged: unfold(f(t), m))
        else:
            heads_from = heads_from if merged is None else None
            merged = None
            q, k = q.unsqueeze(1), k.unsqueeze(1)
    if k.shape[0] not in (1, q.shape[0]) or q.shape[1] % k.shape[1] or q.shape[-1] != k.shape[-1]:
        return None
    grads = [("q", grad_map(own_a, q, factors[0], pre=None if q_of is _same else q_of) if per_row else (None, _SHARED)),
             ("k", grad_map(own_b, k, factors[1], pre=k_of))]
    opaque = next((r.opaque for r in (ra, rb) if r is not None and r.opaque), None)
    return Scores(q=q, k=k, ndim=op.out.dim(), merged=merged, scale=scale, scale_t=scale_t,
                  grad_of=tuple((n, *g) for n, g in grads if g is not None),
                  scale_from=("; ".join(how) + " before q·kᵀ") if how else None,
                  unattributed=opaque, operands=(ra, rb), heads_from=heads_from, learned=learned)


_SHARED = ("q is a parameter shared by every batch row (learned queries broadcast in the product): autograd "
           "gives only its gradient summed over the batch, not each row's")


def _grouped(tracer: Any, q: Tensor) -> Optional[str]:
    """Why dim -3 of ``(B, ..., L, d)`` is not all the heads the module declares (grouped query heads
    ``(B, H_kv, G, L, d)``: native-sparse-attention's ``attend``); ``None`` for ``(B, windows, H, N, d)``."""
    declared = tracer.declared_heads()
    if declared is None or q.shape[-3] == declared[0] or math.prod(q.shape[1:-2]) % declared[0]:
        return None
    return (f"its product has dims {tuple(q.shape[:-2])} before (L, d), dim -3 ({q.shape[-3]}) reported as heads, but "
            f"the module declares `{declared[1]}` = {declared[0]} (query heads grouped per kv head?)")


def _heads(tracer: Any, q: Tensor, ra: Optional[Operand], rb: Optional[Operand]) -> Tuple[Optional[tuple],
                                                                                          Optional[str]]:
    """How the ``(N, L, d)`` rows of a product are ``(B, H)``: from the fold probe saw (batch-major
    ``(B, H, n, d) -> (B·H, n, d)``, or head-major ``(H, B, n, d) -> (H·B, n, d)`` after a
    permutation that moved the batch dim), else from the module's declared head count (rows taken
    batch-major, said in ``heads_from``), else ``None``."""
    merged = ra.merged if ra is not None and ra.merged is not None else (rb.merged if rb is not None else None)
    if merged is None:
        merged = tracer.fold_of(q.shape[0])  # folded in this module, the fact lost on the way (a rotary)
    if merged is not None:
        return merged, None
    declared = tracer.declared_heads()
    if declared is None:
        return None, None
    heads, attr = declared
    if q.shape[0] % heads:  # a slice of the B·H rows (diffusers' SlicedAttnProcessor), or not heads at all
        return None, (f"heads folded into the batch where probe did not see it, and the module declares `{attr}` = "
                      f"{heads} but the product has {q.shape[0]} rows, not a multiple: reported as one head per row")
    return (q.shape[0] // heads, heads), (f"heads folded into the batch where probe did not see it: taken from the "
                                          f"module's `{attr}` = {heads} ((B·H) rows read batch-major)")


def _fire_pv(tracer: Any, probs: Probs, b: Tensor, out: Tensor, v_rec: Any) -> None:
    v = heads_of(b, probs.merged)
    if b.dim() == 4 and isinstance(v_rec, Operand) and v_rec.kv is not None:
        v = v_rec.kv  # the kv heads behind a repeat_kv copy
    pre = ((lambda g, m=probs.merged: heads_of(g, m))
           if probs.merged is not None and (b.dim() == 3 or windowed(probs.merged)) else None)
    probs.fire(v, heads_of(out, probs.merged), grad_map(b, v, pre=pre))


# -- matmul, @, bmm ------------------------------------------------------------------------------------
@rule(K.PRODUCT, Probs)
def pv_product(tracer: Any, op: Op) -> None:
    """``P @ v``: the call is complete."""
    a, b = op.arg(0, "input"), op.arg(1, "other", op.kwargs.get("mat2"))
    probs = op.rec(a)
    if isinstance(probs, Probs) and isinstance(b, Tensor) and isinstance(op.out, Tensor) \
            and a.dim() == b.dim() == op.out.dim() >= 3:
        _fire_pv(tracer, probs, b, op.out, op.rec(b))


@rule(K.PRODUCT, Moved)
def pv_transposed(tracer: Any, op: Op) -> None:
    """``v @ P.transpose(-2, -1)`` (channels-first v, ``(..., d, S)``: timm's ``Attention2d`` in
    CoAtNet / MaxViT, SHViT): ``(P @ vᵀ)ᵀ``, the call complete with ``v = vᵀ``, output transposed.
    Any other product of permuted scores or probabilities: the default (``Derived``)."""
    a, b = op.arg(0, "input"), op.arg(1, "other", op.kwargs.get("mat2"))
    if getattr(op.func, "__name__", "") == "__rmatmul__":
        a, b = b, a
    moved = op.rec(b)
    n = op.out.dim() if isinstance(op.out, Tensor) else 0
    if (isinstance(moved, Moved) and isinstance(moved.of, Probs) and isinstance(a, Tensor) and n >= 3
            and a.dim() == b.dim() == n and moved.perm == (*range(n - 2), n - 1, n - 2)):
        probs, t = moved.of, (lambda g: g.transpose(-1, -2))
        v = heads_of(t(a), probs.merged)
        pre = (lambda g, m=probs.merged: heads_of(t(g), m)) if probs.merged is not None else t
        probs.fire(v, heads_of(t(op.out), probs.merged), grad_map(a, v, pre=pre))
        return
    default(tracer, op)


@rule(K.PRODUCT, None, Operand)
def qk_product(tracer: Any, op: Op) -> None:
    """``a @ b`` of two batched activations starts scores; a product with a weight is a projection."""
    a, b = op.arg(0, "input"), op.arg(1, "other", op.kwargs.get("mat2"))
    if getattr(op.func, "__name__", "") == "__rmatmul__":
        a, b = b, a
    node = start(tracer, op, a, b)
    if node is not None:
        tracer.set(op.out, node)
    elif isinstance(a, Tensor) and isinstance(b, Tensor) and a.dim() >= 3 and b.dim() >= 3 \
            and not weight(a) and not weight(b):
        _opaque(tracer, op)  # two activations, but not q·kᵀ: a factor on either is no longer read


@rule(K.PRODUCT, Scores)
def scores_product(tracer: Any, op: Op) -> None:
    """Scores times a matrix (keys or heads mixed by a product): the scale is unknown."""
    tracer.set(op.out, unknown(op.subject, f"`{op.name}` of the scores with a matrix"))


@rule(K.BADDBMM, None, Operand)
def baddbmm(tracer: Any, op: Op) -> None:
    """``baddbmm(bias, q, kᵀ, beta=, alpha=)`` by any binding (Bloom's alibi, GPT-2's reorder)."""
    bound = {**dict(zip(("input", "batch1", "batch2"), op.args)), **op.kwargs}
    bias, beta, alpha = bound.get("input"), bound.get("beta", 1), bound.get("alpha", 1)
    if not (number(beta) and number(alpha)):
        return _opaque(tracer, op)
    node = start(tracer, op, bound.get("batch1"), bound.get("batch2"), scale=float(alpha))
    if node is not None and beta != 0 and isinstance(bias, Tensor):
        node = dataclasses.replace(node, biases=((bias, float(beta), 3),))
    tracer.set(op.out, node)


def _opaque(tracer: Any, op: Op) -> None:
    scaled = [r for r in op.records.values() if isinstance(r, Operand) and r.scaled]
    if scaled and isinstance(op.out, Tensor):
        tracer.set(op.out, hide(scaled[0], f"`{op.name}` of q or k after its factor"))


# -- einsum --------------------------------------------------------------------------------------------
def einsum_pair(args: Tuple[Any, ...]) -> Optional[Tuple[Tuple[Any, Any], Tuple[str, str, str]]]:
    """((x, y), (x letters, y letters, output letters)) of a two-operand einsum; ``...`` is spelled
    out in capital letters, right-aligned as einsum broadcasts it."""
    if not args or not isinstance(args[0], str):
        return None
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    eq = args[0].replace(" ", "")
    if len(operands) != 2 or "->" not in eq or eq.count(",") != 1:
        return None
    ins, res = eq.split("->")
    specs = ins.split(",")
    if "." in eq:
        if not all(isinstance(t, Tensor) for t in operands) or any(sp.count("...") > 1 or sp.replace("...", "").count(".")
                                                                   for sp in (*specs, res)):
            return None
        spans = [t.dim() - len(sp.replace("...", "")) if "..." in sp else 0 for sp, t in zip(specs, operands)]
        if min(spans) < 0:
            return None
        letters = "ABCDEFGHIJKLMNOP"[:max(spans)]
        specs = [sp.replace("...", letters[len(letters) - n:]) for sp, n in zip(specs, spans)]
        res = res.replace("...", letters)
    return (operands[0], operands[1]), (specs[0], specs[1], res)


def qk_roles(sa: str, sb: str, res: str) -> Optional[Tuple[str, str]]:
    """For ``einsum(sa, sb -> res)`` as q·kᵀ: the letter orders (batch + query + d, batch + key +
    d) to permute q and k into; ``None`` when it is not a q·kᵀ product."""
    if len(sa) != len(sb) or len(sa) < 3 or len(res) != len(sa):
        return None
    batch, qi, ki = res[:-2], res[-2], res[-1]
    d = set(sa) & set(sb) - set(res)
    if len(d) != 1 or qi not in sa or qi in sb or ki not in sb or ki in sa:
        return None
    if not all(c in sa and c in sb for c in batch):
        return None
    di = next(iter(d))
    return batch + qi + di, batch + ki + di


def pv_roles(sp: str, sv: str, res: str) -> Optional[Tuple[str, str, str]]:
    """For ``einsum`` of probabilities ``sp`` (``..., query, key``) with v ``sv``: (batch + key,
    batch + query + feature, feature) letter orders for v and the output; ``None`` when the key
    letter is not the one contracted (not P·v)."""
    if len(sp) < 3:
        return None
    qi, ki = sp[-2], sp[-1]
    batch = sp[:-2]
    feats = [c for c in sv if c not in sp]
    if ki in res or ki not in sv or qi in sv or qi not in res or len(feats) != 1 or feats[0] not in res:
        return None
    if not all(c in sv and c in res for c in batch) or len(res) != len(sp) or len(sv) != len(sp):
        return None
    return batch + ki, batch + qi + feats[0], feats[0]


def _lifted(letters: str, batch: str) -> Tuple[str, Optional[Callable[[Tensor], Tensor]]]:
    """An einsum operand without some of the batch letters (one k or v head for all query heads:
    ``"bjd"`` beside ``"bhid"``): its letters with them as leading size-1 dims, and the view."""
    missing = "".join(c for c in batch if c not in letters)
    if not missing:
        return letters, None
    return missing + letters, lambda t, n=len(missing): t.reshape((1,) * n + tuple(t.shape))


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


@rule(K.EINSUM, Probs)
def pv_einsum(tracer: Any, op: Op) -> None:
    """P·v by any letters and operand order; P mixed over heads after the softmax stays P."""
    parsed = einsum_pair(op.args)
    if parsed is None or not isinstance(op.out, Tensor):
        return
    (x, y), (sx, sy, res) = parsed
    for sp, sv, p, t in ((sx, sy, x, y), (sy, sx, y, x)):
        probs = op.rec(p)
        if not isinstance(probs, Probs) or not isinstance(t, Tensor):
            continue
        sv2, lift = _lifted(sv, sp[:-2]) if len(sv) < len(sp) else (sv, None)
        roles = pv_roles(sp, sv2, res)
        if roles is not None:
            to_v, to_out = [sv2.index(c) for c in roles[0] + roles[2]], [res.index(c) for c in roles[1]]
            pre = (lambda g, d=to_v: g.permute(d)) if lift is None else (lambda g, d=to_v, f=lift: f(g).permute(d))
            v = heads_of(pre(t), probs.merged)
            if windowed(probs.merged):
                pre = (lambda g, p=pre, m=probs.merged: heads_of(p(g), m))
            probs.fire(v, heads_of(permuted(op.out, to_out), probs.merged), grad_map(t, v, pre=pre))
        elif sp[-2:] == res[-2:]:  # P mixed over heads after the softmax (re-attention)
            tracer.set(op.out, probs)
        return


@rule(K.EINSUM, None, Operand)
def qk_einsum(tracer: Any, op: Op) -> None:
    """A two-operand einsum that is q·kᵀ (one k head for all query heads: ``"bhid,bjd->bhij"``)."""
    parsed = einsum_pair(op.args)
    if parsed is None or not isinstance(op.out, Tensor):
        return _opaque(tracer, op)
    (x, y), (sx, sy, res) = parsed
    sx2, lx = _lifted(sx, res[:-2]) if len(sx) < len(sy) else (sx, None)
    sy2, ly = _lifted(sy, res[:-2]) if len(sy) < len(sx) else (sy, None)
    roles = qk_roles(sx2, sy2, res)
    if roles is None and qk_roles(sy2, sx2, res) is not None:  # k first (Keras: ``"aecd,abcd->acbe"``, k, q)
        (x, y), (sx2, lx, sy2, ly) = (y, x), (sy2, ly, sx2, lx)
        roles = qk_roles(sx2, sy2, res)
    if roles is None:
        return _opaque(tracer, op) if isinstance(x, Tensor) and isinstance(y, Tensor) and not any(
            weight(t) or t.dim() < 3 for t in (x, y)) else None
    to_q, to_k = [sx2.index(c) for c in roles[0]], [sy2.index(c) for c in roles[1]]

    def q_of(t: Tensor, d: list = to_q, f: Any = lx) -> Tensor:
        return permuted(t if f is None else f(t), d)

    def k_of(t: Tensor, d: list = to_k, f: Any = ly) -> Tensor:
        return permuted(t if f is None else f(t), d)

    tracer.set(op.out, start(tracer, op, x, y, q_of, k_of))


@rule(K.EINSUM, Scores)
def mix_einsum(tracer: Any, op: Op) -> None:
    """Scores mixed by a weight over heads (talking heads: ``"bhij,hg->bgij"``), else unknown."""
    parsed = einsum_pair(op.args)
    node = op.subject
    m = None
    if parsed is not None:
        (x, y), (sx, sy, res) = parsed
        m = _einsum_head_mix(sx, sy, res, y) if op.rec(x) is node else _einsum_head_mix(sy, sx, res, x)
    tracer.set(op.out, mixed(node, m, f"`einsum` of the scores ({op.args[0] if op.args else ''})"))


def mixed(node: Scores, m: Optional[Tensor], why: str) -> Scores:
    """``node``'s scores mixed over heads by ``m`` (H, G) (:func:`head_mix`); unknown (reported at
    `actual` only, with a warning) when it cannot be described."""
    out = head_mix(node, m) if m is not None else None
    return unknown(node, why) if out is None else out


# -- convolutions and linear layers over the heads (talking heads) ------------------------------------
@rule(K.CONV, Scores)
def mix_conv(tracer: Any, op: Op) -> None:
    """``conv2d(scores, W)`` with a 1x1 kernel, no bias, stride 1 (x-transformers' talking heads)."""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    bound = {**dict(zip(names, op.args)), **op.kwargs}
    w = bound.get("weight")

    def pair(x: Any) -> Tuple[Any, ...]:
        return tuple(x) if isinstance(x, (list, tuple)) else (x,)

    plain = (bound.get("bias") is None and bound.get("groups", 1) == 1 and all(
        set(pair(bound.get(n, default))) == {default} for n, default in (("stride", 1), ("padding", 0), ("dilation", 1))))
    ok = op.func in (torch.conv2d, torch.nn.functional.conv2d) and isinstance(w, Tensor) and w.dim() == 4
    m = w[:, :, 0, 0].t() if ok and plain and tuple(w.shape[2:]) == (1, 1) else None
    tracer.set(op.out, mixed(op.subject, m, f"`{op.name}` of the scores"))


@rule(K.CONV, Probs)
def conv_probs(tracer: Any, op: Op) -> None:
    """Heads mixed after the softmax (post talking heads): still on the way to ``P @ v``."""
    x = op.arg(0, "input")
    if isinstance(op.out, Tensor) and isinstance(x, Tensor) and op.out.shape[-2:] == x.shape[-2:]:
        tracer.set(op.out, op.subject)


@rule(K.LINEAR, Moved)
def linear_over_heads(tracer: Any, op: Op) -> None:
    """``F.linear`` over the heads of permuted scores (heads last: an ``nn.Linear(H, G)``): a mix
    of the scores over heads (its bias a bias of the mixed heads); over permuted probabilities it
    keeps them on the way to ``P @ v``. Over any other dim: not scores any more."""
    moved, x = op.subject, op.arg(0, "input")
    w, b = op.arg(1, "weight"), op.arg(2, "bias")
    if not (isinstance(x, Tensor) and isinstance(op.out, Tensor) and isinstance(w, Tensor) and w.dim() == 2):
        return
    heads_last = len(moved.perm) == 4 and moved.perm[-1] == 1
    if not heads_last:
        return
    if isinstance(moved.of, Probs):
        tracer.set(op.out, moved)
        return
    node = mixed(moved.of, w.t(), "`linear` over the heads of the scores")
    if isinstance(b, Tensor) and not node.unknown:
        node = dataclasses.replace(node, biases=node.biases + ((b.detach().reshape(1, -1, 1, 1), 1.0, 4),),
                                   mix=(node.mix[0], node.mix[1], node.mix[2] + 1) if node.mix else None)
    tracer.set(op.out, Moved(node, moved.perm))


@rule((K.LINEAR, K.CONV, K.NORM), Operand)
def projection(tracer: Any, op: Op) -> None:
    """A projection or a norm of an operand starts new features: its factor is absorbed (no record)."""


@rule(K.LINEAR, Scores, Derived)
def key_contraction(tracer: Any, op: Op) -> None:
    """``F.linear`` over the keys of the scores (an output layer): not scores any more (no record)."""


@rule(K.CONV, Derived)
def conv_of_derived(tracer: Any, op: Op) -> None:
    """A convolution of a tensor derived from scores (a 1x1 ``Conv2d`` output projection after a
    ``P·v`` the rules did not describe: timm's CoAtNet, SHViT): new features, as ``F.linear``
    (:func:`key_contraction`), so the next block's q·kᵀ starts scores again (no record)."""
