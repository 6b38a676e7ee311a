"""The records of the eager front end (:mod:`probe.capture.eager`) and pure functions on them.

A :class:`Scores` record says where a score tensor came from (q, k, scale, biases, masks, soft
cap); a :class:`Meta` record what is known about an activation that may become q or kᵀ; a
:class:`Pending` softmax waits for its product with v. The functions here fold an op into a
record (:func:`scaled`, :func:`reshaped`), make the :class:`~probe.call.AttentionCall` of a
softmax (:func:`to_call`) and rewrite a softmax input under an override (:func:`rescaled`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.call import AttentionCall

__all__ = ["MASK_FILL", "Meta", "Moved", "Pending", "Slice", "Scores", "factor", "handler_names", "heads_of", "lift", "number", "permuted",
           "repeat_kv", "rescaled", "reshaped", "scaled", "to_call", "grad_map"]

#: A fill value at or below this masks an entry (``exp`` of it underflows to 0 in float32).
#: A fill value at or below this masks an entry (``exp`` of it underflows to 0 in float32).
MASK_FILL = -1e4


@dataclasses.dataclass(frozen=True)
class Scores:
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
    grad_of: Tuple[Tuple[str, Tensor, Callable[[Tensor], Tensor]], ...] = ()  # see AttentionCall.grad_of
    scale_from: Optional[str] = None
    head_dim: Optional[int] = None  # d of the heads mixed into q, k (talking heads)
    mix: Optional[Tuple["Scores", Tensor, int]] = None  # (scores before the mix, M (H, G), biases it made)


@dataclasses.dataclass(frozen=True)
class Meta:
    """What is known about an activation that may become q or kᵀ."""

    base: Optional[Tensor] = None  # the tensor before ``* factor``
    factor: float = 1.0
    merged: Optional[Tuple[int, int]] = None  # (B, H) when this (B*H, L, d) came from (B, H, L, d)
    src: Optional[Tensor] = None  # this tensor is ``src.transpose(-1, -2)`` (the model's own k)
    whole: Optional[Tensor] = None  # the (B, H, n, d) tensor this (B*H, n, d) one was reshaped from
    kv: Optional[Tensor] = None  # the (B, Hk, n, d) tensor this one repeats per group (repeat_kv)
    factor_t: Optional[Tensor] = None  # a one-element tensor factor (kept on its device: no sync)
    how: str = ""  # how the factor was applied, in words (info["scale_from"])


@dataclasses.dataclass(frozen=True)
class Slice:
    """``scores[idx]``, viewed, cast and with tensors added: written back in place (``scores[idx]
    = slice + bias``, timm MViTv2's relative positions) it changes the scores ``of`` by a bias
    that does not scale with σ."""

    of: "Scores"


@dataclasses.dataclass(frozen=True)
class Moved:
    """Probabilities on their way to ``P @ v`` with their dims permuted (``perm`` of the
    :class:`Pending` layout): DeepViT normalises them over the heads as ``(b, i, j, h)``. Only a
    permutation back to the original layout makes them probabilities again."""

    pending: "Pending"
    perm: Tuple[int, ...]


@dataclasses.dataclass
class Pending:
    """A softmax over scores, waiting for its product with v (then the call gets v and output).
    ``key``: the site reserved when the softmax ran (the call is named after that module)."""

    call: AttentionCall
    merged: Optional[Tuple[int, int]]
    emit: Callable[..., None]
    key: Any = None
    done: bool = False

    def fire(self, v: Optional[Tensor] = None, output: Optional[Tensor] = None,
             v_grad: Optional[Tuple[Tensor, Callable[[Tensor], Tensor]]] = None) -> None:
        if not self.done:
            self.done = True
            grad_of = self.call.grad_of if v_grad is None else {**(self.call.grad_of or {}), "v": v_grad}
            call = dataclasses.replace(self.call, v=v, output=output, grad_of=grad_of)
            if self.key is None:
                self.emit(call)
            else:
                self.emit(call, self.key)


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


def handler_names() -> Dict[Callable[..., Any], str]:
    """Intercepted function → name of the :class:`~probe.capture.eager.EagerFrontEnd` method that
    handles it (``torch`` functions, ``F`` functions and tensor methods)."""
    table: Dict[Callable[..., Any], str] = {}
    for names, extra, handler in (
        ("matmul __matmul__ bmm", (torch.matmul, torch.bmm), "_on_matmul"),
        ("baddbmm", (torch.baddbmm,), "_on_baddbmm"),
        ("", (torch.einsum,), "_on_einsum"),
        ("mul mul_ __mul__ __rmul__ __imul__", (torch.mul,), "_on_mul"),
        ("div div_ __truediv__ __itruediv__", (torch.div, torch.true_divide), "_on_div"),
        ("add add_ __iadd__", (torch.add,), "_on_add"),
        ("sub sub_ __isub__", (torch.sub,), "_on_sub"),
        ("masked_fill masked_fill_", (torch.masked_fill,), "_on_masked_fill"),
        ("", (torch.where,), "_on_where"),
        ("tanh", (torch.tanh,), "_on_tanh"),
        ("float to type type_as contiguous half bfloat16 double", (F.dropout, torch.dropout), "_on_cast"),
        ("view reshape transpose", (torch.reshape, torch.transpose), "_on_view"),
        ("__getitem__ neg __neg__ permute unsqueeze squeeze flatten unflatten unbind chunk split",
         (torch.neg, torch.cat, torch.stack, torch.permute, torch.unbind, torch.chunk, torch.split,
          torch.view_as_complex, torch.view_as_real), "_on_linear"),
        ("clamp clamp_ clamp_min maximum", (torch.clamp, torch.clamp_min, torch.max, torch.maximum), "_on_floor"),
        ("__rsub__ __rdiv__", (F.conv1d, F.linear, torch.conv1d), "_on_other"),
        ("", (F.conv2d, torch.conv2d), "_on_conv"),
        ("", (F.layer_norm, torch.layer_norm), "_on_norm"),
        ("__setitem__", (), "_on_setitem"),
        ("softmax", (torch.softmax, F.softmax), "_on_softmax"),
    ):
        methods = [getattr(cls, n) for n in names.split() for cls in (torch._C.TensorBase, Tensor) if hasattr(cls, n)]
        for func in (*methods, *extra):
            table[func] = handler
    return table


def permuted(t: Tensor, dims: List[int]) -> Tensor:
    # The tensor itself when nothing moves, so that hooks on it see the model's gradient.
    return t if dims == list(range(t.dim())) else t.permute(dims)


def repeat_kv(x: Tensor, out: Tensor) -> Optional[Meta]:
    """``x[:, :, None].expand(B, Hk, n, S, d).reshape(B, Hk * n, S, d)`` (Hugging Face's
    ``repeat_kv``): the kv tensor it repeats, the model's own when ``x`` is a view of it."""
    b, hk, n, length, d = x.shape
    if n < 2 or tuple(out.shape) != (b, hk * n, length, d):
        return None
    base = x._base
    if (base is not None and tuple(base.shape) == (b, hk, length, d) and base.data_ptr() == x.data_ptr()
            and base.unsqueeze(2).expand(x.shape).stride() == x.stride()):
        return Meta(kv=base)
    return Meta(kv=x.select(2, 0))


def einsum_pair(args: Tuple[Any, ...]) -> Optional[Tuple[Tuple[Any, Any], Tuple[str, str, str]]]:
    """((x, y), (x letters, y letters, output letters)) of a two-operand einsum without ``...``."""
    if not args or not isinstance(args[0], str):
        return None
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    eq = args[0].replace(" ", "")
    if len(ops) != 2 or "->" not in eq or "." in eq or eq.count(",") != 1:
        return None
    ins, res = eq.split("->")
    sx, sy = ins.split(",")
    return (ops[0], ops[1]), (sx, sy, res)


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
    return isinstance(x, (int, float)) and not isinstance(x, bool)




def factor(x: Any, node: Scores) -> Optional[Any]:
    """A Python float, a 1-D factor tensor (one value or one per head), or None."""
    if number(x):
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


def scaled(node: Scores, f: Any) -> Scores:
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
    # (N, L, S) -> (B, H, L, S): learn the heads of a bmm layout
    b, h = out.shape[0], out.shape[1]
    if b * h != x.shape[0]:
        return None
    if node.merged is None and node.q.shape[1] == 1 and node.q.shape[0] == b * h and h > 1:
        q = node.q.reshape(b, h, *node.q.shape[2:])
        k = node.k.reshape(b, h, *node.k.shape[2:]) if node.k.shape[0] == b * h else node.k
        return dataclasses.replace(node, q=q, k=k, ndim=4, merged=(b, h))
    return dataclasses.replace(node, ndim=4)


def heads_of(t: Tensor, merged: Optional[Tuple[int, int]]) -> Tensor:
    """(B, H, n, d) from a 4-D tensor or a (B*H, n, d) one."""
    if t.dim() == 4:
        return t
    if t.dim() > 4:  # extra leading dims (windows, blocks): flattened into the batch
        return t.reshape(-1, *t.shape[-3:])
    if merged is not None and t.shape[0] == merged[0] * merged[1]:
        return t.reshape(merged[0], merged[1], *t.shape[1:])
    return t.unsqueeze(1)


def lift(t: Tensor, layout: int, node: Scores) -> Tensor:
    """A bias or mask applied to a ``layout``-dim score tensor, broadcastable to (B, H, L, S).
    ``layout`` is the shape of the scores when it has more than 4 dims (extra leading dims)."""
    if isinstance(layout, tuple):  # applied to (..., H, L, S) scores: flatten the leading dims
        return t.expand(layout).reshape(-1, *layout[-3:])
    if layout > 4 and t.dim() == layout:
        return t.reshape(-1, *t.shape[-3:])
    if layout == 4 or t.dim() < 3:
        return t
    if node.merged is not None and t.shape[0] == node.merged[0] * node.merged[1] and node.merged[1] > 1:
        return t.reshape(node.merged[0], node.merged[1], *t.shape[1:])
    return t.unsqueeze(-3)


def to_call(node: Scores, logits: Tensor) -> AttentionCall:
    if node.unknown or node.tanh:
        return AttentionCall(q=node.q, k=node.k, v=None, scale=None, logits=lift(logits, logits.dim(), node),
                             kind="eager", grad_of={n: (t, f) for n, t, f in node.grad_of} or None)
    bias: Optional[Tensor] = None
    for t, coeff, layout in node.biases:
        term = lift(t, layout, node)
        term = term if coeff == 1.0 else term * coeff
        bias = term if bias is None else bias + term
    valid: Optional[Tensor] = None
    for m, invert, layout, fill in node.masks:
        keep = ~m if invert else m
        if fill is not None:  # a tensor fill value masks only when it is very negative
            keep = keep | (fill > MASK_FILL)
        keep = lift(keep, layout, node)
        valid = keep if valid is None else valid & keep
    scale: Any = node.scale
    if node.scale_t is not None:
        scale = node.scale_t * node.scale
    return AttentionCall(q=node.q, k=node.k, v=None, scale=scale, bias=bias, mask=valid,
                         softcap=node.softcap, kind="eager", grad_of={n: (t, f) for n, t, f in node.grad_of} or None,
                         scale_from=node.scale_from, head_dim=node.head_dim)


def head_mix(root: Scores, m: Tensor) -> Optional[Scores]:
    """The record of ``Σ_h M_hg · Z_h`` (heads mixed before the softmax: talking heads), ``Z`` the
    4-D scores ``root`` describes: ``q'_g = [M_1g·q_1, ..., M_Hg·q_H]``, ``k'_g = [k_1, ..., k_H]``
    (so ``q'_g·k'_g = Σ_h M_hg·q_h·k_h``: the mix scales with σ like the scores), the bias mixed
    alike. ``None`` when the record cannot be mixed (masked, capped, a per-head scale, an
    unknown op), then the scale is unknown."""
    if root.unknown or root.tanh or root.softcap is not None or root.masks or root.scale_t is not None:
        return None
    if root.ndim != 4 or root.mix is not None or m.dim() != 2 or m.shape[0] != root.q.shape[1]:
        return None
    b, h, length, d = root.q.shape
    with torch.no_grad():  # q', k' are not the model's tensors: their gradients come from q, k
        m = m.detach().to(root.q.dtype)
        k = root.k if root.k.shape[1] == h else root.k.repeat_interleave(h // root.k.shape[1], dim=1)
        q2 = torch.einsum("hg,bhld->bglhd", m, root.q.detach()).reshape(b, m.shape[1], length, h * d)
        k2 = k.detach().transpose(1, 2).reshape(k.shape[0], 1, k.shape[2], h * d)
        k2 = k2.expand(k2.shape[0], m.shape[1], *k2.shape[2:])
        biases: Tuple[Tuple[Tensor, float, int], ...] = ()
        if root.biases:
            call = to_call(root, root.q)  # the summed, lifted bias
            if call.bias is not None:
                bias = call.bias.expand(b, h, *call.bias.shape[-2:])
                biases = ((torch.einsum("bhls,hg->bgls", bias, m.to(bias.dtype)), 1.0, 4),)
    # grad_q / grad_k: those of the model's own q and k, per head before the mix (when the mix keeps H heads)
    own = {n: (t, f) for n, t, f in root.grad_of}
    grad_of = tuple((n, *own.get(n, (t, None))) for n, t in (("q", root.q), ("k", root.k))
                    if t.shape[1] == m.shape[1] == h)
    return dataclasses.replace(root, q=q2, k=k2, biases=biases, grad_of=grad_of, merged=None, head_dim=d, mix=(root, m, len(biases)),
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
