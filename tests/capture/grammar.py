"""A grammar of the ways real code spells eager attention, for the generative test (issue 25).

:func:`draw` picks a :class:`Spec` at random (seeded): where the scale's factor sits (on q, on k,
on both, on the scores, none) and how it is spelled (``x * c``, ``c * x``, ``x / c``, ``x.mul``,
``torch.mul``, ``x.mul_``, ``x *= c``, ``x /= c``, a one-element tensor), the head layout
(``(B, H, L, d)``, ``(B, L, H, d)`` through an einsum, heads folded into the batch for ``bmm``,
windows as a fifth dim), grouped or multi-query kv heads, the product (``@``, ``matmul`` with
``mT``, ``einsum``, ``bmm``, ``baddbmm``), a bias, a mask (causal, padding, a sliding window)
built inside the function or passed in, as a boolean ``masked_fill`` with ``-inf`` or
``finfo.min``, ``where``, or an additive ``-100`` / ``finfo.min`` / ``-inf``, before or after the
bias, the softmax spelling, and sometimes an op probe does not model (a *hazard*).
:class:`Program` runs it and keeps the truth: the unscaled q and k in ``(N, H, L, d)`` (k repeated
per query head), the scale, the additive bias that is not a mask, the valid keys, and its own
probabilities. :func:`judge` compares a probe summary with it: ``exact``, ``named`` (a warning
names the site) or ``silent``.

Other tests reuse the grammar (QK-Clip's ``tests/capture/test_provenance_generative.py``): a new
choice goes at the END of :data:`CHOICES`, so that every seed keeps drawing what it drew before.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

B, L, D = 2, 6, 4
hidden = torch._C.DisableTorchFunction  # the truth is computed where capture does not see it

CHOICES: Dict[str, Tuple[str, ...]] = {
    "heads": ("2", "4"),
    "kv": ("mha", "mha", "gqa", "mqa"),
    "layout": ("bhld", "bhld", "blhd", "merged", "windows"),
    "factor_on": ("q", "k", "qk", "scores", "scores_div", "none"),
    "spelling": ("mul", "rmul", "div", "method", "torch", "inplace", "imul", "idiv", "tensor"),
    "product": ("at", "matmul_mT", "einsum", "bmm", "baddbmm"),
    "bias": ("none", "none", "rel", "alibi"),
    "mask": ("none", "causal", "padding", "window"),
    "mask_kind": ("fill_inf", "fill_min", "where", "add_100", "add_min", "add_inf"),
    "mask_place": ("inside", "passed"),
    "order": ("bias_first", "mask_first"),
    "softmax": ("softmax", "F_softmax_dtype", "exp_lse", "exp_sum", "exp_max_sum", "log_softmax_exp"),
    "expand": ("repeat_kv", "repeat_interleave", "broadcast"),
    "pv": ("matmul", "einsum"),
    "hazard": ("none",) * 8 + ("q_clamp", "k_add", "scores_clamp", "scores_nan_to_num"),
    "when": ("late", "late", "early"),  # the factor on q / k before the heads are split (OPT) or after
    "rotary": ("none", "none", "half", "complex"),
    "norm": ("none", "none", "normalize", "rms"),  # a norm of q and k before their factor (QK-norm)
    "softcap": ("none", "none", "none", "tanh"),
    "per_head": ("no", "no", "no", "yes"),  # a per-head tensor factor on the scores
    "dropout": ("no", "no", "yes"),
    "fold": ("bh4", "bh3", "hb3"),  # heads in the batch: viewed back to 4-D, or 3-D throughout (head-major too)
    "mix": ("none",) * 5 + ("linear", "conv", "einsum"),  # talking heads before the softmax
    "kform": ("k", "k", "kT"),  # k transposed before its factor
    # choices added later come last, so that a seed keeps drawing what it drew before (other tests
    # reuse the grammar: tests/capture/test_provenance_generative.py)
    "mask_view": ("direct", "direct", "swin"),  # Swin: scores viewed (B, nW, H, n, n) for the mask, then back
    "fill": ("inf", "inf", "inf", "100"),  # fill_inf as masked_fill(m, -100.0)
}


@dataclasses.dataclass(frozen=True)
class Spec:
    seed: int
    heads: int
    kv: str
    layout: str
    factor_on: str
    spelling: str
    product: str
    bias: str
    mask: str
    mask_kind: str
    mask_place: str
    order: str
    softmax: str
    expand: str
    pv: str
    hazard: str
    when: str
    rotary: str
    norm: str
    softcap: str
    per_head: str
    dropout: str
    fold: str
    mix: str
    kform: str
    mask_view: str
    fill: str

    @property
    def hazardous(self) -> bool:
        """Whether the program applies an op probe does not model to q, k or the scores (a
        multiplier constant along the features after the factor counts: a norm written out)."""
        applies = {"q_clamp": self.factor_on in ("q", "qk"), "k_add": self.factor_on in ("k", "qk"),
                   "scores_clamp": True, "scores_nan_to_num": True, "none": False}[self.hazard]
        return applies or (self.when == "early" and self.norm == "rms")

    @property
    def flat(self) -> bool:
        """Scores stay ``(B·H, L, S)`` until P·v (heads in the batch, not viewed back)."""
        return self.layout == "merged" and self.fold != "bh4"

    @property
    def kv_heads(self) -> int:
        return {"mha": self.heads, "gqa": self.heads // 2, "mqa": 1}[self.kv]


def draw(seed: int) -> Spec:
    """A random program (the same for the same seed), with choices that do not fit together fixed."""
    rng = random.Random(seed)
    c = {name: rng.choice(options) for name, options in CHOICES.items()}
    c["heads"] = int(c["heads"])
    if c["layout"] in ("blhd", "windows"):
        c["kv"] = "mha"  # keep the expansion of kv heads to the (B, H, L, d) layouts
    if c["product"] in ("bmm", "baddbmm"):
        c["layout"] = "merged"
    elif c["layout"] == "merged":
        c["product"] = rng.choice(("bmm", "baddbmm"))
    if c["layout"] in ("blhd",):
        c["product"] = "einsum"
    if c["kv"] != "mha" and c["layout"] == "merged":
        c["expand"] = rng.choice(("repeat_kv", "repeat_interleave"))
    if c["expand"] == "broadcast" and (c["kv"] != "mqa" or c["product"] not in ("at", "matmul_mT", "einsum")):
        c["expand"] = "repeat_kv"
    if c["layout"] == "windows" and c["mask"] == "window":
        c["mask"] = "causal"
    if c["softcap"] == "tanh" or c["per_head"] == "yes":
        c["hazard"] = "none" if c["hazard"].startswith("scores") else c["hazard"]
    if c["softcap"] == "tanh" and (c["bias"] != "none" or c["mask"] != "none") and c["order"] == "bias_first":
        c["order"] = "mask_first"  # the cap applies to q·kᵀ·s only (Gemma 2): bias and mask after it
    if c["when"] == "early" and c["factor_on"] not in ("q", "k", "qk"):
        c["when"] = "late"
    flat = c["layout"] == "merged" and c["fold"] != "bh4"
    if flat or c["layout"] == "windows":
        c["per_head"], c["mix"] = "no", "none"
    if c["mix"] != "none":
        c["per_head"], c["softcap"] = "no", "none"
    if not (c["layout"] == "bhld" and c["product"] in ("at", "matmul_mT") and c["kv"] == "mha"
            and c["rotary"] == "none"):
        c["kform"] = "k"
    return Spec(seed=seed, **c)


def _factor(x: Tensor, c: float, spelling: str) -> Tensor:
    if spelling == "mul":
        return x * c
    if spelling == "rmul":
        return c * x
    if spelling == "div":
        return x / (1.0 / c)
    if spelling == "method":
        return x.mul(c)
    if spelling == "torch":
        return torch.mul(x, c)
    if spelling == "tensor":
        return x * torch.tensor(c, dtype=x.dtype)
    x = x.clone()
    if spelling == "inplace":
        x.mul_(c)
    elif spelling == "imul":
        x *= c
    else:  # idiv
        x /= 1.0 / c
    return x


def _rotary(t: Tensor, kind: str, layout: str) -> Tensor:
    """A rotary embedding of ``t`` (``(B, H, L, d)``, or ``(B, L, H, d)`` for the blhd layout):
    Hugging Face's ``rotate_half`` form, or Meta's complex form; linear in ``t``."""
    if kind == "none":
        return t
    n = t.shape[-2] if layout != "blhd" else t.shape[1]
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    theta = pos / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))  # (n, d/2)
    if layout == "blhd":
        theta = theta[:, None]
    if kind == "half":
        emb = torch.cat((theta, theta), -1)
        x1, x2 = t[..., : D // 2], t[..., D // 2:]
        return t * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()
    z = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
    return torch.view_as_real(z * torch.polar(torch.ones_like(theta), theta)).flatten(-2).type_as(t)


def _mask(spec: Spec, n: int) -> Optional[Tensor]:
    """The keys each query may not see, (B, 1, n, n) boolean (True = masked), never a whole row."""
    if spec.mask == "none":
        return None
    i = torch.arange(n)
    if spec.mask == "causal":
        m = (i[None, :] > i[:, None]).expand(B, 1, n, n)
    elif spec.mask == "window":
        m = ((i[:, None] - i[None, :]).abs() > 1).expand(B, 1, n, n)
    else:  # padding: the last key of the second sequence
        m = torch.zeros(B, 1, n, n, dtype=torch.bool)
        m[1, :, :, -1] = True
    return m.clone()


class Program(nn.Module):
    """One attention implementation spelled as ``spec`` says (see the module docstring)."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        h, hk = spec.heads, spec.kv_heads
        self.num_heads = h
        self.proj = nn.Linear(h * D, (h + 2 * hk) * D)
        g = torch.Generator().manual_seed(spec.seed)
        self.c = D ** -0.5 * [0.5, 1.0, 2.0][spec.seed % 3]
        self.register_buffer("rel", torch.randn(h, L, L, generator=g) * 2.0)
        self.register_buffer("slopes", torch.linspace(0.3, 1.2, h).view(h, 1, 1))
        self.truth: Dict[str, Tensor] = {}

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        spec, h, hk = self.spec, self.spec.heads, self.spec.kv_heads
        q, k, v = self.proj(x).split([h * D, hk * D, hk * D], -1)
        c, scale = self.c, 1.0
        fq = c if spec.factor_on == "q" else math.sqrt(c) if spec.factor_on == "qk" else None
        fk = c if spec.factor_on == "k" else math.sqrt(c) if spec.factor_on == "qk" else None
        if spec.when == "early":  # on the projections, before the heads are split (OPT, Whisper)
            q, k = (t if f is None else _factor(t, f, spec.spelling) for t, f in ((q, fq), (k, fk)))
            fq_late, fk_late = None, None
        else:
            fq_late, fk_late = fq, fk
        q, k, v = (t.view(B, L, -1, D) for t in (q, k, v))  # (B, L, heads, d)
        v = v.transpose(1, 2)
        if spec.layout != "blhd":
            q, k = (t.transpose(1, 2) for t in (q, k))  # (B, heads, L, d)
        if spec.norm == "normalize":
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        elif spec.norm == "rms":  # written out: features (no factor before it)
            q, k = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) for t in (q, k))
        with hidden():  # the truth is computed where capture does not see it
            raw_q, raw_k = _rotary(q, spec.rotary, spec.layout), _rotary(k, spec.rotary, spec.layout)
            if spec.when == "early" and spec.norm == "none":
                raw_q, raw_k = (t if f is None else t / f for t, f in ((raw_q, fq), (raw_k, fk)))
        if spec.when == "early" and spec.norm != "none":  # a norm after the factor absorbs it
            fq, fk = None, None
        if spec.kform == "kT":
            k = k.transpose(-2, -1)
        if fq_late is not None:
            q = _factor(q, fq_late, spec.spelling)
        if fk_late is not None:
            k = _factor(k, fk_late, spec.spelling)
        scale *= (fq or 1.0) * (fk or 1.0)
        q, k = _rotary(q, spec.rotary, spec.layout), _rotary(k, spec.rotary, spec.layout)
        if spec.hazard == "q_clamp" and spec.factor_on in ("q", "qk"):
            q = q.clamp(-1e3, 1e3)
        if spec.hazard == "k_add" and spec.factor_on in ("k", "qk"):
            k = k + 0.0
        with hidden():
            if spec.layout == "blhd":
                raw_q, raw_k = raw_q.transpose(1, 2), raw_k.transpose(1, 2)
            if hk < h:
                raw_k = raw_k.repeat_interleave(h // hk, 1)
        if hk < h:
            k, v = self._expand(k), self._expand(v)
        n = L
        if spec.layout == "windows":  # two windows of L / 2 positions: (B, T, H, n, d)
            n = L // 2
            q, k, v = (t.reshape(B, h, 2, n, D).transpose(1, 2) for t in (q, k, v))
            with hidden():
                raw_q, raw_k = (t.reshape(B, h, 2, n, D).transpose(1, 2).reshape(B * 2, h, n, D) for t in (raw_q, raw_k))
        scores = self._product(q, k, scale_in_baddbmm=spec.factor_on in ("scores", "scores_div"))
        if spec.factor_on in ("scores", "scores_div") and spec.product != "baddbmm":
            scores = scores * c if spec.factor_on == "scores" else scores / (1.0 / c)
        if spec.factor_on in ("scores", "scores_div"):
            scale *= c
        scale_t = torch.tensor(scale)
        if spec.per_head == "yes":
            gain = torch.linspace(0.5, 1.5, h)
            scores = scores * gain.view(1, h, 1, 1) if scores.dim() == 4 else scores * gain.view(1, 1, h, 1, 1)
            scale_t = scale * gain
        if spec.softcap == "tanh":
            scores = torch.tanh(scores / 5.0) * 5.0
        masked = _mask(spec, n) if mask is None else mask
        with hidden():
            raw = (raw_q @ raw_k.transpose(-1, -2)).double()
        scores, bias, raw = self._bias_and_mask(scores, masked, n, raw)
        if bias is not None and self._bias_in_product and spec.per_head == "yes":
            bias = bias * torch.linspace(0.5, 1.5, h).view(h, 1, 1)  # the gain multiplied baddbmm's bias too
        if spec.hazard == "scores_clamp":
            scores = scores.clamp(max=1e4)
        elif spec.hazard == "scores_nan_to_num":
            scores = torch.nan_to_num(scores)
        p = self._softmax(scores)
        nb = raw_q.shape[0]
        if spec.flat:
            p = self._unflat(p)
        with hidden():
            self.truth = self._truth(p, raw, bias, masked, scale_t, nb, n)
        if spec.flat:
            p, v = self._flat_p, self._fold(v)
        if spec.dropout == "yes":
            p = F.dropout(p, 0.25, training=True)
        out = torch.einsum("...ij,...jd->...id", p, v) if spec.pv == "einsum" else p @ v
        return out.reshape(B, -1).sum(-1, keepdim=True) * x[:, :1, 0]

    def _truth(self, p: Tensor, raw: Tensor, bias: Optional[Tensor], masked: Optional[Tensor], scale_t: Tensor,
               nb: int, n: int) -> Dict[str, Tensor]:
        h = self.spec.heads
        valid = (~masked.unsqueeze(1).expand(B, nb // B, 1, n, n).reshape(nb, 1, n, n).expand(nb, h, n, n)
                 if masked is not None else torch.ones(nb, h, n, n, dtype=torch.bool))
        return {"raw": raw.detach().double(), "d": torch.tensor(D), "scale": scale_t,
                "softcap": torch.tensor(5.0 if self.spec.softcap == "tanh" else 0.0),
                "bias": bias.detach().double().expand(nb, h, n, n) if bias is not None else torch.zeros(1),
                "valid": valid, "probs": p.detach().double().reshape(nb, h, n, n)}

    def _fold(self, t: Tensor) -> Tensor:
        """(B, H, L, d) -> (B·H, L, d) rows, batch-major or head-major (``fold``)."""
        if self.spec.fold == "hb3":  # heads first, then folded: rows h·B + b
            return t.permute(1, 0, 2, 3).reshape(-1, *t.shape[2:])
        return t.reshape(-1, *t.shape[2:])

    def _rows(self, t: Tensor) -> Tensor:
        """A per-head (H, L, S) or per-batch (B, 1, L, S) term as (B·H, L, S) rows of the fold."""
        h = self.spec.heads
        full = t.expand(B, h, *t.shape[-2:]) if t.dim() == 4 else t.unsqueeze(0).expand(B, h, *t.shape[-2:])
        return self._fold(full)

    def _unflat(self, p: Tensor) -> Tensor:
        self._flat_p = p
        h = self.spec.heads
        return p.view(h, B, *p.shape[1:]).transpose(0, 1) if self.spec.fold == "hb3" else p.view(B, h, *p.shape[1:])

    def _expand(self, t: Tensor) -> Tensor:
        spec, h, hk = self.spec, self.spec.heads, self.spec.kv_heads
        if spec.expand == "repeat_interleave":
            return t.repeat_interleave(h // hk, 1)
        if spec.expand == "broadcast":
            return t  # (B, 1, L, d) broadcast by the product itself
        return t[:, :, None].expand(B, hk, h // hk, L, D).reshape(B, h, L, D)

    def _product(self, q: Tensor, k: Tensor, scale_in_baddbmm: bool) -> Tensor:
        spec = self.spec
        if spec.product == "einsum":
            if spec.layout == "blhd":
                return torch.einsum("bqhd,bkhd->bhqk", q, k)
            if spec.expand == "broadcast":  # one k head for all query heads, without a head letter
                return torch.einsum("bhqd,bkd->bhqk", q, k[:, 0])
            return torch.einsum("...qd,...kd->...qk".replace("...", "bthx"[:q.dim() - 2]), q, k)
        if spec.kform == "kT":  # k was transposed before its factor
            return q @ k if spec.product == "at" else torch.matmul(q, k)
        if spec.product == "at":
            return q @ k.transpose(-2, -1)
        if spec.product == "matmul_mT":
            return torch.matmul(q, k.mT)
        h = spec.heads
        q3, k3 = self._fold(q), self._fold(k)
        if spec.product == "bmm":
            s = torch.bmm(q3, k3.transpose(1, 2))
        else:
            alpha = self.c if scale_in_baddbmm and spec.factor_on == "scores" else (
                1.0 / (1.0 / self.c) if scale_in_baddbmm else 1.0)
            bias = self._bias(L)
            if self._bias_in_product:  # Bloom: baddbmm(alibi, q, kᵀ, beta=1, alpha=s)
                s = torch.baddbmm(self._rows(bias), q3, k3.transpose(1, 2), beta=1.0, alpha=alpha)
            else:
                empty = torch.empty(B * h, L, L)  # beta=0: ignored (GPT-2's reorder_and_upcast_attn)
                s = torch.baddbmm(empty, q3, k3.transpose(1, 2), beta=0.0, alpha=alpha)
        return s if spec.flat else s.view(B, h, L, L)

    def _bias_and_mask(self, scores: Tensor, masked: Optional[Tensor], n: int,
                       raw: Tensor) -> Tuple[Tensor, Optional[Tensor], Tensor]:
        """Bias, talking heads and mask in the spec's order; the truth's bias and unscaled logits
        (mixed alike when heads are mixed)."""
        spec = self.spec
        bias = self._bias(n)
        steps = ["bias", "mix", "mask"] if spec.order == "bias_first" else ["mask", "bias", "mix"]
        for step in steps:
            if step == "bias" and bias is not None and not self._bias_in_product:
                scores = scores + (self._rows(bias) if spec.flat else bias)
            elif step == "mask" and masked is not None:
                scores = self._apply_mask(scores, masked, n)
            elif step == "mix" and spec.mix != "none":
                scores, m, b = self._mix(scores)
                with hidden():
                    raw, bias = self._mixed_truth(raw, bias, m, b, n)
        return scores, bias, raw

    @staticmethod
    def _mixed_truth(raw: Tensor, bias: Optional[Tensor], m: Tensor, b: Optional[Tensor], n: int
                     ) -> Tuple[Tensor, Tensor]:
        """The unscaled logits and the bias after a mix of the heads by ``m`` (and its own bias ``b``)."""
        m = m.detach().double()
        full = torch.zeros(1, 1, n, n, dtype=torch.float64) if bias is None else bias.detach().double()
        mixed = torch.einsum("bhij,hg->bgij", full.expand(raw.shape[0], m.shape[0], n, n), m)
        return (torch.einsum("bhij,hg->bgij", raw, m),
                mixed if b is None else mixed + b.detach().double().view(1, -1, 1, 1))

    @property
    def _bias_in_product(self) -> bool:
        spec = self.spec
        return spec.product == "baddbmm" and spec.bias != "none" and spec.order == "bias_first"

    def _bias(self, n: int) -> Optional[Tensor]:
        if self.spec.bias == "rel":
            return self.rel[:, :n, :n]
        if self.spec.bias == "alibi":
            i = torch.arange(n, dtype=torch.float32)
            return -self.slopes * (i[None, :] - i[:, None]).abs()
        return None

    def _mix(self, s: Tensor) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """Heads mixed before the softmax; (scores, M (H, G), the mix's own bias)."""
        h = self.spec.heads
        g = torch.Generator().manual_seed(self.spec.seed + 7)
        w = torch.eye(h) + 0.3 * torch.rand(h, h, generator=g)  # positive: masked logits stay masked
        if self.spec.mix == "linear":  # an nn.Linear(H, H) over the heads, made last by a permutation
            lb = 0.1 * torch.randn(h, generator=g)
            return F.linear(s.permute(0, 2, 3, 1), w, lb).permute(0, 3, 1, 2), w.t(), lb
        if self.spec.mix == "conv":
            return F.conv2d(s, w.view(h, h, 1, 1)), w.t(), None
        return torch.einsum("bhij,hg->bgij", s, w), w, None

    def _apply_mask(self, scores: Tensor, masked: Tensor, n: int) -> Tensor:
        spec = self.spec
        m = masked if scores.dim() == 4 else masked.reshape(B, 1, 1, n, n)
        if spec.flat:
            m = self._rows(masked)
        if spec.mask_place == "inside" and spec.mask_kind.startswith("add"):  # built in place, Swin-style
            add = scores.new_zeros(m.shape)
            fill = {"add_100": -100.0, "add_min": torch.finfo(scores.dtype).min, "add_inf": float("-inf")}[spec.mask_kind]
            add[m] = fill
            return scores + add
        if spec.mask_view == "swin" and scores.dim() == 4 and not spec.flat:  # the batch as windows of one image
            h = scores.shape[1]
            fill = -100.0 if spec.mask_kind != "fill_min" else torch.finfo(scores.dtype).min
            windows = torch.zeros(B, 1, n, n).masked_fill(m.expand(B, 1, n, n), fill)
            return (scores.view(1, B, h, n, n) + windows.unsqueeze(0)).view(-1, h, n, n)
        if spec.mask_kind == "fill_inf":
            return scores.masked_fill(m, float("-inf") if spec.fill == "inf" else -100.0)
        if spec.mask_kind == "fill_min":
            return scores.masked_fill(m, torch.finfo(scores.dtype).min)
        if spec.mask_kind == "where":
            return torch.where(~m, scores, torch.tensor(float("-inf")))
        fill = {"add_100": -100.0, "add_min": torch.finfo(scores.dtype).min, "add_inf": float("-inf")}[spec.mask_kind]
        return scores + torch.zeros(m.shape).masked_fill(m, fill)

    def _softmax(self, s: Tensor) -> Tensor:
        kind = self.spec.softmax
        if kind == "softmax":
            return s.softmax(-1)
        if kind == "F_softmax_dtype":
            return F.softmax(s, dim=-1, dtype=torch.float32)
        if kind == "exp_lse":
            return torch.exp(s - torch.logsumexp(s, -1, keepdim=True))
        if kind == "exp_sum":
            e = s.exp()
            return e / e.sum(-1, keepdim=True)
        if kind == "exp_max_sum":
            e = torch.exp(s - s.amax(-1, keepdim=True).detach())
            return e / e.sum(dim=-1, keepdim=True)
        return F.log_softmax(s, dim=-1).exp()


def inputs(spec: Spec) -> Tuple[Tensor, Optional[Tensor]]:
    g = torch.Generator().manual_seed(spec.seed + 1)
    x = torch.randn(B, L, spec.heads * D, generator=g)
    n = L // 2 if spec.layout == "windows" else L
    passed = _mask(spec, n) if spec.mask_place == "passed" and spec.mask != "none" else None
    return x, passed


# -- judging a summary against the program's truth ---------------------------------------------------------
def _entropy(p: Tensor, valid: Tensor) -> np.ndarray:
    """Per-head mean normalised entropy over rows with at least two valid keys (probe's rule)."""
    p = torch.where(valid, p, torch.zeros_like(p))
    n = valid.sum(-1)
    ent = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1) / n.clamp(min=2).double().log()
    rows = n >= 2
    return ((ent * rows).sum((0, 2)) / rows.sum((0, 2))).numpy()


def _max_prob(p: Tensor, valid: Tensor) -> np.ndarray:
    rows = valid.sum(-1) >= 2
    return ((torch.where(valid, p, torch.zeros_like(p)).amax(-1) * rows).sum((0, 2)) / rows.sum((0, 2))).numpy()


def references(truth: Dict[str, Tensor]) -> Dict[str, np.ndarray]:
    """Float64 references: at `actual` from the program's own probabilities; unscaled and standard
    from its unscaled q, k, its bias and its valid keys."""
    raw, valid, bias = truth["raw"], truth["valid"], truth["bias"]
    std = int(truth["d"]) ** -0.5
    ref = {"entropy": _entropy(truth["probs"], valid), "max_prob": _max_prob(truth["probs"], valid)}
    cap = float(truth["softcap"])
    logits = std * raw if not cap else cap * torch.tanh(std * raw / cap)
    z = torch.where(valid, logits + bias, torch.tensor(float("-inf"), dtype=torch.float64))
    p_std = torch.softmax(z, -1)
    ref["entropy@standard"] = _entropy(p_std, valid)
    heads = raw.shape[1]
    ref["logit_var@unscaled"] = np.array([float(raw[:, h][valid[:, h]].var(unbiased=False)) for h in range(heads)])
    return ref


def _close(a: np.ndarray, b: np.ndarray, rtol: float = 1e-4, atol: float = 1e-6) -> bool:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return a.shape == b.shape and bool(np.all(np.abs(a - b) <= atol + rtol * np.abs(b)))


def judge(summary, truth: Dict[str, Tensor], warned: List[str]) -> Tuple[str, str]:
    """``(outcome, detail)``: ``exact`` (one site, the program's scale, every value within 1e-4 of
    its float64 reference), ``named`` (a warning names the site) or ``silent`` (wrong or missing,
    and nothing said)."""
    said = ("NOT measured:", "`actual` only", "UNVERIFIED", "folded into the batch")  # about forward values
    named = [w for w in warned if "'root'" in w and any(x in w for x in said)]
    if summary.sites != ["root"]:
        return ("named", named[0]) if named else ("silent", f"sites {summary.sites}")
    info = summary.info("root")
    ref = references(truth)
    problems = []
    scale = truth["scale"].reshape(-1).tolist()
    got = info.get("scale")
    got = [got] if isinstance(got, (int, float)) else got
    if got is None:
        problems.append(f"scale unknown ({info.get('scale_unknown')})")
    elif len(got) != len(scale) and len(scale) != 1 or not all(
            math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, scale * (len(got) if len(scale) == 1 else 1))):
        problems.append(f"scale {got} != {scale}")
    if info["heads"] != truth["raw"].shape[1]:
        problems.append(f"heads {info['heads']} != {truth['raw'].shape[1]}")
    else:
        checks = [("entropy", "actual", ref["entropy"]), ("max_prob", "actual", ref["max_prob"]),
                  ("logit_var", "unscaled", ref["logit_var@unscaled"]), ("entropy", "standard", ref["entropy@standard"])]
        for metric, at, want in checks:
            try:
                got = summary.value("root", metric, at)
            except Exception:  # noqa: BLE001 - a value not reported
                problems.append(f"{metric}@{at} not reported")
                continue
            if not _close(got, want):
                problems.append(f"{metric}@{at} {np.round(got, 5)} != {np.round(want, 5)}")
    if not problems:
        return ("named", named[0]) if named else ("exact", "")
    return ("named", named[0]) if named else ("silent", "; ".join(problems))
