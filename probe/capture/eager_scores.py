"""Pure functions on the eager tracer's records (:mod:`probe.capture.records`).

They fold an op into a :class:`~probe.capture.records.Scores` record (:func:`scaled`,
:func:`reshaped`, :func:`head_mix`), make the :class:`~probe.call.AttentionCall` of a softmax
(:func:`to_call`), rewrite a softmax input under an override (:func:`rescaled`), and map the
gradient of the model's own tensors onto a record's (:func:`grad_map`).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

from probe.call import AttentionCall
from probe.capture.records import Operand, Scores

__all__ = ["MASK_BIAS", "MASK_FILL", "broadcasts", "factor", "grad_map", "head_mix", "heads_of", "kv_heads", "lift",
           "number", "permuted", "prescale_factor", "repeat_kv", "rescaled", "reshaped", "scaled", "shared_rows", "to_call",
           "unfold", "weight", "windowed"]

#: A floor at or below this only touches masked entries (``torch.max(scores, finfo.min)``).
MASK_FILL = -1e4
#: An additive bias, or a fill value, at or below this masks its key (``AttentionCall``'s rule,
#: ``probe.stats.chunks.MASK_BIAS``: its weight ``e^-100`` vanishes).
MASK_BIAS = -100.0


def grad_map(own: Tensor, record: Tensor, factor: Any = 1.0,
             pre: Optional[Callable[[Tensor], Tensor]] = None) -> Optional[Tuple[Tensor, Callable[[Tensor], Tensor]]]:
    """How to get the gradient of a record tensor (``(B, H, n, d)``, made from the model's own
    ``own`` by a transpose / permutation ``pre``, a reshape, dropping repeated kv heads, and a
    factor taken out) from the gradient of ``own``; ``None`` when ``record`` is ``own`` itself."""
    if record is own and pre is None and not isinstance(factor, Tensor) and factor == 1.0:
        return None
    shape = tuple(record.shape)

    def fn(g: Tensor) -> Tensor:
        if pre is not None:
            g = pre(g)
        if g.numel() != record.numel() and len(shape) == 4 and g.numel() % record.numel() == 0:
            # repeat_kv: (B, Hk·n, S, d) holds n copies of each kv head; their gradients add up
            g = g.reshape(shape[0], shape[1], -1, *shape[2:]).sum(2)
        g = g.reshape(shape)
        return g if not isinstance(factor, Tensor) and factor == 1.0 else g * factor

    return own, fn


def permuted(t: Tensor, dims: List[int]) -> Tensor:
    # The tensor itself when nothing moves, so that hooks on it see the model's gradient.
    return t if dims == list(range(t.dim())) else t.permute(dims)


def repeat_kv(x: Tensor, out: Tensor) -> Optional[Operand]:
    """``x[:, :, None].expand(B, Hk, n, S, d).reshape(B, Hk * n, S, d)`` (Hugging Face's
    ``repeat_kv``): the kv tensor it repeats, the model's own when ``x`` is a view of it."""
    b, hk, n, length, d = x.shape
    if n < 2 or tuple(out.shape) != (b, hk * n, length, d):
        return None
    base = x._base
    if (base is not None and tuple(base.shape) == (b, hk, length, d) and base.data_ptr() == x.data_ptr()
            and base.unsqueeze(2).expand(x.shape).stride() == x.stride()):
        return Operand(kv=base)
    return Operand(kv=x.select(2, 0))


def kv_heads(k: Tensor, kv_heads: int) -> Tensor:
    """The first copy of each kv head in ``k`` (``(B, Hk·n, S, d)``, ``repeat_kv``'s layout: head
    ``g·n + j`` is copy ``j`` of kv head ``g``): a scaled k's unscaled kv heads, read from its base."""
    if k.dim() != 4 or kv_heads < 1 or k.shape[1] % kv_heads:
        return k
    return k.unflatten(1, (kv_heads, k.shape[1] // kv_heads)).select(2, 0)


def prescale_factor(s: Any, invert: bool) -> Tuple[Optional[float], Optional[Tensor]]:
    """A scalar factor applied to q or k before the product: (float, None) for a number or a
    one-element CPU tensor (read without a device sync), (None, tensor) for a one-element tensor
    on a device (kept there), (None, None) otherwise."""
    if number(s):
        f = float(s)
        return (None, None) if f == 0 and invert else ((1.0 / f if invert else f), None)
    if isinstance(s, Tensor) and s.is_floating_point() and s.numel() == 1:
        if s.device.type == "cpu":
            f = float(s.detach().reshape(()))
            return (None, None) if f == 0 and invert else ((1.0 / f if invert else f), None)
        t = s.detach().float().reshape(1)
        return None, (t.reciprocal() if invert else t)
    return None, None


def number(x: Any) -> bool:
    """A real number: Python's, or NumPy's scalars (``np.float32(s)``: a factor on q in it was read
    as none, scale 1.0, silently); not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def factor(x: Any, node: Scores) -> Optional[Any]:
    """A Python float, a 1-D factor tensor (one value or one per head), or None."""
    if number(x):
        return float(x)
    if not isinstance(x, Tensor) or not x.is_floating_point():
        return None
    if x.numel() == 1:
        return x.detach().float().reshape(1)
    heads = node.q.shape[1]
    n = node.ndim
    shape = (1,) * (n - x.dim()) + tuple(x.shape) if x.dim() <= n else ()
    # one value per head: (..., H, 1, 1) against (B, H, L, S) scores, or (B, nW, H, L, S) windows
    if n >= 4 and len(shape) == n and shape[-3] == heads and x.numel() == heads:
        return x.detach().float().reshape(heads)
    return None


def scaled(node: Scores, f: Any) -> Scores:
    """``node`` times ``f`` (a float, or a tensor of one value or one per head)."""
    if node.unknown:
        return node
    if node.tanh:  # c * tanh(z / c): the multiplier is the cap
        if not isinstance(f, float):
            return dataclasses.replace(node, unknown="a tensor factor after `tanh`")
        return dataclasses.replace(node, tanh=False, softcap=f, scale=node.scale * f)
    if isinstance(f, float):
        if node.softcap is not None and f <= 0:
            return dataclasses.replace(node, unknown="a negative factor after a soft cap")
        # f·(c·tanh(σR/c) + A) = (fc)·tanh(fσR/(fc)) + fA
        biases = tuple((t, c * f, n) for t, c, n in node.biases)
        softcap = None if node.softcap is None else node.softcap * f
        return dataclasses.replace(node, scale=node.scale * f, biases=biases, softcap=softcap)
    if node.softcap is not None or (node.biases and node.ndim < 4):
        return dataclasses.replace(node, unknown="a tensor factor after a soft cap, or after a bias on scores with "
                                   "their heads folded into the batch")
    # a per-head factor after a bias scales the bias per head: f_h · (σR + A) = (f_h σ)R + f_h A (the bias
    # lifted to (B, H, L, S) first: one added to a (B·H, L, S) layout before a view to 4-D)
    per_head = f.reshape(-1, 1, 1)
    biases = tuple((lift(t, n, node) * per_head.to(t.dtype), c, 4) for t, c, n in node.biases)
    scale_t = f if node.scale_t is None else node.scale_t * f
    return dataclasses.replace(node, scale_t=scale_t, biases=biases)


def reshaped(node: Scores, x: Tensor, out: Tensor) -> Optional[Scores]:
    """The record of a view of the scores: (B*H, L, S) <-> (B, H, L, S), and any view that keeps
    (H, L, S) and regroups the leading dims (windows: (B·nW, H, L, S) <-> (B, nW, H, L, S))."""
    if x.shape[-2:] != out.shape[-2:] or out.dim() < 3:
        return None
    if out.shape == x.shape:
        return node
    heads = node.q.shape[1]
    if x.dim() >= 4 and out.dim() >= 4 and x.shape[-3] == out.shape[-3] == heads and node.ndim == x.dim():
        return dataclasses.replace(node, ndim=out.dim())
    if out.dim() not in (3, 4) or x.dim() not in (3, 4) or out.dim() == x.dim():
        return None
    if out.dim() == 3:  # (B, H, L, S) -> (B*H, L, S)
        return dataclasses.replace(node, ndim=3) if out.shape[0] == x.shape[0] * x.shape[1] else None
    if node.merged is not None and len(node.merged) > 2:
        return None  # head-major or windowed rows viewed otherwise: not the record's (B, H) layout
    # (N, L, S) -> (B, H, L, S): learn the heads of a bmm layout
    b, h = out.shape[0], out.shape[1]
    if b * h != x.shape[0]:
        return None
    if node.merged is None and node.q.shape[1] == 1 and node.q.shape[0] == b * h and h > 1:
        q = node.q.reshape(b, h, *node.q.shape[2:])
        k = node.k.reshape(b, h, *node.k.shape[2:]) if node.k.shape[0] == b * h else node.k
        return dataclasses.replace(node, q=q, k=k, ndim=4, merged=(b, h))
    return dataclasses.replace(node, ndim=4)


def unfold(t: Tensor, merged: Tuple[Any, ...]) -> Tensor:
    """``(B, H', ...)`` from ``(B·H', ...)`` rows (``H'`` = the heads of ``t``: H, or fewer kv heads):
    batch-major rows (``merged = (B, H)``), or head-major ones (``(B, H, "hb")``: row ``h·B + b``,
    from ``(H, B, n, d)`` folded: ``q.permute(2, 0, 1, 3).reshape(-1, n, d)``). With windows after
    the rows (``(B, H, "win")``: ``(B·H', W, n, x)``, local-attention): ``(B·W, H', n, x)``."""
    if len(merged) > 2 and merged[2] == "win":
        t5 = t.reshape(merged[0], -1, *t.shape[1:])  # (B, H', W, n, x)
        return t5.transpose(1, 2).reshape(-1, t5.shape[1], *t.shape[2:])
    if len(merged) > 2:
        return t.reshape(-1, merged[0], *t.shape[1:]).transpose(0, 1)
    return t.reshape(merged[0], -1, *t.shape[1:])


def windowed(merged: Optional[Tuple[Any, ...]]) -> bool:
    """Whether ``merged`` describes ``(B·H, W, n, x)``: heads folded into the batch, then windows."""
    return merged is not None and len(merged) > 2 and merged[2] == "win"


def heads_of(t: Tensor, merged: Optional[Tuple[Any, ...]]) -> Tensor:
    """(B, H, n, d) from a 4-D tensor or a (B*H, n, d) one."""
    if windowed(merged) and t.dim() == 4 and t.shape[0] % merged[0] == 0:
        return unfold(t, merged)
    if t.dim() == 4:
        return t
    if t.dim() > 4:  # extra leading dims (windows, blocks): flattened into the batch
        return t.reshape(-1, *t.shape[-3:])
    if merged is not None and t.shape[0] == merged[0] * merged[1]:
        return unfold(t, merged)
    return t.unsqueeze(1)


def lift(t: Tensor, layout: int, node: Scores) -> Tensor:
    """A bias or mask applied to a ``layout``-dim score tensor, broadcastable to (B, H, L, S).
    ``layout`` is the shape of the scores when it has more than 4 dims (extra leading dims)."""
    if windowed(node.merged) and layout == 4:  # (B·H, W, L, S) scores: the bias over every row, then unfolded
        b, h = node.merged[:2]
        return unfold(t.expand(b * h, node.merged[3], *t.shape[-2:]) if t.dim() >= 2 else t, node.merged)
    if isinstance(layout, tuple):  # applied to (..., H, L, S) scores: flatten the leading dims
        return t.expand(layout).reshape(-1, *layout[-3:])
    if layout > 4 and t.dim() == layout:
        return t.reshape(-1, *t.shape[-3:])
    if layout == 4 or t.dim() < 3:
        return t
    if node.merged is not None and t.shape[0] == node.merged[0] * node.merged[1] and node.merged[1] > 1:
        return unfold(t, node.merged)
    return t.unsqueeze(-3)


def to_call(node: Scores, logits: Tensor) -> AttentionCall:
    """The call a softmax over ``logits`` (the scores ``node`` describes) records.

    Several additive terms (a bias and a mask built apart: Swin's relative position bias, then
    its window mask of -100) each mask their own keys: a key is valid only where every term is
    above :data:`MASK_BIAS`, not only where their sum is (a positive bias would unmask it)."""
    grad_of = {n: (t, f) for n, t, f in node.grad_of} or None
    unknown = bool(node.unknown or node.tanh)
    bias: Optional[Tensor] = None
    valid: Optional[Tensor] = None
    terms = [(lift(t, layout, node), coeff) for t, coeff, layout in node.biases]
    for term, coeff in terms:
        term = term if coeff == 1.0 else term * coeff
        bias = term if bias is None else bias + term
        if len(terms) > 1 or unknown:  # (one term is the known path's bias, which masks its own keys)
            keep = term > MASK_BIAS
            valid = keep if valid is None else valid & keep
    for m, invert, layout, fill in node.masks:
        keep = ~m if invert else m
        if fill is not None:  # a tensor fill value masks only when it is very negative
            keep = keep | (fill > MASK_BIAS)
        keep = lift(keep, layout, node)
        valid = keep if valid is None else valid & keep
    if unknown:
        # measured from the softmax input itself: the masks seen on the way (a -1e9 fill, an
        # additive -1e4) still say which keys are masked: a finite fill is a logit of the
        # softmax input, and counted as one it made a causal call's logit_var 2.5e17
        z = lift(logits, logits.dim(), node)
        if valid is not None and not broadcasts(valid.shape, z.shape):
            valid = None  # (keys joined after the mask: an attention sink) fill values then count
        return AttentionCall(q=node.q, k=node.k, v=None, scale=None, logits=z, mask=valid, kind="eager",
                             grad_of=grad_of, scale_unknown=node.unknown or "`tanh` without its factor")
    scale: Any = node.scale
    if node.scale_t is not None:
        scale = node.scale_t * node.scale
    return AttentionCall(q=node.q, k=node.k, v=None, scale=scale, bias=bias, mask=valid,
                         softcap=node.softcap, kind="eager", grad_of=grad_of, scale_from=node.scale_from,
                         head_dim=node.head_dim, scale_unknown=node.unattributed)


def broadcasts(shape: Tuple[int, ...], to: Tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``to`` (the softmax input's shape)."""
    return len(shape) <= len(to) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(to)))


def head_mix(root: Scores, m: Tensor) -> Optional[Scores]:
    """The record of ``Σ_h M_hg · Z_h`` (heads mixed before the softmax: talking heads), ``Z`` the
    4-D scores ``root`` describes: ``q'_g = [M_1g·q_1, ..., M_Hg·q_H]``, ``k'_g = [k_1, ..., k_H]``
    (so ``q'_g·k'_g = Σ_h M_hg·q_h·k_h``: the mix scales with σ like the scores), the bias mixed
    alike. A mask shared by every head (a boolean one, or an additive term with one value for all
    heads: padding, causal, Swin's windows) masks the same keys after the mix and is kept as a
    boolean mask; the mixed values there are never read. ``None`` when the record cannot be mixed
    (a mask that differs between heads, a soft cap, a per-head scale, an unknown op): then the
    scale is unknown."""
    if root.unknown or root.tanh or root.softcap is not None or root.scale_t is not None:
        return None
    if root.ndim != 4 or root.mix is not None or m.dim() != 2 or m.shape[0] != root.q.shape[1] or windowed(root.merged):
        return None
    b, h, length, d = root.q.shape

    def shared(t: Tensor) -> bool:  # one value for every head of a (B, H, L, S)-broadcastable tensor
        return t.dim() < 3 or t.shape[-3] == 1

    valid: Optional[Tensor] = None
    for mask, invert, layout, fill in root.masks:
        keep = lift(~mask if invert else mask, layout, root)
        if fill is not None:
            keep = keep | (fill > MASK_BIAS)
        if not shared(keep):
            return None
        valid = keep if valid is None else valid & keep
    with torch.no_grad():  # q', k' are not the model's tensors: their gradients come from q, k
        m = m.detach().to(root.q.dtype)
        k = root.k if root.k.shape[1] == h else root.k.repeat_interleave(h // root.k.shape[1], dim=1)
        q2 = torch.einsum("hg,bhld->bglhd", m, root.q.detach()).reshape(b, m.shape[1], length, h * d)
        k2 = k.detach().transpose(1, 2).reshape(k.shape[0], 1, k.shape[2], h * d)
        k2 = k2.expand(k2.shape[0], m.shape[1], *k2.shape[2:])
        biases: Tuple[Tuple[Tensor, float, Any], ...] = ()
        total: Optional[Tensor] = None
        for t, coeff, layout in root.biases:
            term = lift(t, layout, root)
            term = term if coeff == 1.0 else term * coeff
            if shared(term):
                valid = (term > MASK_BIAS) if valid is None else valid & (term > MASK_BIAS)
            total = term if total is None else total + term
        if total is not None:
            total = total.expand(b, h, *total.shape[-2:]) if total.dim() == 4 else total.expand(b, h, length, -1)
            biases = ((torch.einsum("bhls,hg->bgls", total, m.to(total.dtype)), 1.0, 4),)
    masks = () if valid is None else ((valid, False, 4, None),)
    # grad_q / grad_k: those of the model's own q and k, per head before the mix (when the mix keeps H
    # heads); under grouped kv heads each query head gets the gradient of the kv head it reads
    own = {n: (t, f) for n, t, f in root.grad_of}
    grad_of = tuple((n, *own.get(n, (t, None))) for n, t in (("q", root.q), ("k", root.k))
                    if t.shape[1] == m.shape[1] == h)
    if m.shape[1] == h and root.k.shape[1] < h:
        t, f = own.get("k", (root.k, None))
        groups = h // root.k.shape[1]
        grad_of += (("k", t, lambda g, f=f, n=groups: (g if f is None else f(g)).repeat_interleave(n, dim=1)),)
    return dataclasses.replace(root, q=q2, k=k2, biases=biases, masks=masks, grad_of=grad_of, merged=None, head_dim=d,
                               mix=(root, m, len(biases)),
                               scale_from=(root.scale_from + "; " if root.scale_from else "") + "heads mixed before "
                               "the softmax")


def rescaled(node: Scores, x: Tensor, new: Union[float, Tensor]) -> Tuple[Tensor, Scores]:
    """``probe.scaling`` on a softmax over ``x`` (recognised scores ``node``): the input to run,
    ``Z + (s' - s)·q·kᵀ`` (q unscaled: a pre-scaling is part of ``s``), and the record at ``s'``."""
    heads = node.q.shape[1]
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
    if x.dim() != 4:
        change = change.reshape(x.shape)
    z = x + change.to(x.dtype)
    if isinstance(new, Tensor):
        return z, dataclasses.replace(node, scale=1.0, scale_t=new.detach())
    return z, dataclasses.replace(node, scale=float(new), scale_t=None)


def weight(t: Tensor) -> bool:
    """A parameter, or a view of one (``rearrange(self.to_kv.weight, ...)``: CoLT5): a product with it
    is a projection, not scores."""
    while t is not None:
        if isinstance(t, nn.Parameter):
            return True
        t = t._base
    return False


def shared_rows(a: Tensor, b: Tensor) -> bool:
    """``a @ b`` with ``a`` not a weight and the same for every batch row of an activation ``b``
    (``(..., d, T)``, batch rows): ``a``'s leading dims fewer than ``b``'s (``(N, d)``, heads split
    ``(H, N, d)``), or broadcast to more rows (``(1, N, d)`` against several): queries computed
    from weights (``(self.queries * s) @ xᵀ``, ``self.to_q(self.latents) @ xᵀ``), read as learned
    queries."""
    if weight(a) or weight(b) or b.dim() < 3 or a.dim() < 2 or a.dim() > b.dim():
        return False
    lead_a, lead_b = a.shape[:-2], b.shape[len(b.shape) - a.dim():-2]
    if not all(x == 1 or x == y for x, y in zip(lead_a, lead_b)):
        return False
    rows_a = rows_b = 1
    for x in lead_a:
        rows_a *= x
    for y in b.shape[:-2]:
        rows_b *= y
    return a.dim() < b.dim() or rows_a < rows_b