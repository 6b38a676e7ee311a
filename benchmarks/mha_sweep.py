"""Option-matrix fidelity sweep of ``nn.MultiheadAttention`` and ``nn.Transformer*`` under probe.

    PYTHONPATH=. python benchmarks/mha_sweep.py [--json out.json] [--only NAME,...] [-v]

Each case is a tiny random-weight module run once without probe and once under
``probe.watch(model, every=1, rows=None)`` (the same seed: the same dropout draw): in ``train``
mode forward + backward, in ``eval`` mode under ``torch.no_grad()`` (where PyTorch's fast paths
apply: ``torch._native_multi_head_attention``, ``torch._transformer_encoder_layer_fwd``, the
nested-tensor conversion of ``nn.TransformerEncoder``), and once under ``probe.coverage``.

The reference is independent of probe. A recording pass (no probe) keeps the query, key, value
and arguments each attention module receives (a second one with PyTorch's fast path switched off
for the ``self_attn`` of fused encoder layers, which are then never called; an encoder that makes
a nested tensor of its padded batch never computes the padded query rows: they are left out); q and k are rebuilt from the module's own ``in_proj_weight`` /
``q_proj_weight`` / ``k_proj_weight`` and ``in_proj_bias`` in float64, with the ``bias_k`` key
and the ``add_zero_attn`` zero key appended; ``attn_mask`` (2-D or per-head 3-D) and
``key_padding_mask`` are applied as PyTorch documents them (a boolean ``True`` forbids, a float
is added) and merged; an entry is valid unless its bias is at most -100 (docs/metrics.md: its
weight e^-100 vanishes in float32), so ``-1e4`` masks like ``-inf``. Per head:
``logit_var`` / ``logit_max`` of ``R/sqrt(d)`` over valid entries, ``entropy`` (normalised by
log #valid keys) and ``max_prob`` of ``softmax(R/sqrt(d) + bias)`` over rows with at least two
valid keys. For ``nn.MultiheadAttention`` cases that allow it, the module's own per-head
probabilities (``need_weights=True, average_attn_weights=False``, a separate pass) give a second
entropy / max_prob reference. In train mode without dropout the gradient norms ``grad_q``,
``grad_k``, ``grad_v``, ``grad_logits`` are compared with a float64 copy of the model whose
attention is this reference written out (q, k, v, logits as autograd leaves); with dropout they
must be present or named.

Also checked: outputs (and, in train mode, every parameter's ``.grad``) with and without probe
are bitwise equal (NaN = NaN).

Classification of each case:

* ``exact``: every attention call measured, values within float32 rounding of the reference,
  gradient metrics present (train) and matching, outputs bitwise unchanged;
* ``named``: something is not measured and a warning or a coverage row names it, the rest exact;
* ``SILENTLY WRONG``: a measured value differs from the reference;
* ``SILENTLY MISSING``: an attention (or a gradient metric) has no value and nothing names it;
* ``OUTPUT CHANGED``: probe changed the model's outputs or gradients (the size of the change shown).
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import probe
from sweep_common import sweep_main  # noqa: E402  (benchmarks/, run as a script)

E, H, L, S, B = 16, 4, 5, 7, 2
MASK_BIAS = -100.0  # an additive bias at or below this masks its key (probe.call.AttentionCall, docs/metrics.md)
GRADS = ("grad_q", "grad_k", "grad_v", "grad_logits")
_MHA_SIG = inspect.signature(nn.MultiheadAttention.forward)


# -- the float64 reference --------------------------------------------------------------------------------
def _bool_to_float(m: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    if m is None:
        return None
    m = m.detach()
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=torch.float64).masked_fill(m, -math.inf)
    return m.to(torch.float64)


def attention_parts(mha: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
                    key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                    dtype: torch.dtype = torch.float64, raw: bool = False, **_: Any):
    """q (B,H,L,d), k, v (B,H,S',d), bias (B,H,L,S') with -inf where masked, the model dtype, the
    unbatched flag: built from the module's weights as PyTorch documents the options (``raw``: the
    bias the model adds, else with every entry at or below -100 made -inf, as probe masks)."""
    model_dtype = query.dtype
    unbatched = query.dim() == 2
    if unbatched:
        query, key, value = query[None], key[None], value[None]
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask[None]
    elif not mha.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    e, h = mha.embed_dim, mha.num_heads
    d = e // h
    if mha._qkv_same_embed_dim:
        wq, wk, wv = mha.in_proj_weight.chunk(3)
    else:
        wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    bq = bk = bv = None
    if mha.in_proj_bias is not None:
        bq, bk, bv = mha.in_proj_bias.chunk(3)

    def proj(x: Tensor, w: Tensor, bias: Optional[Tensor]) -> Tensor:
        y = x.to(dtype) @ w.to(dtype).T
        return y if bias is None else y + bias.to(dtype)

    q, k, v = proj(query, wq, bq), proj(key, wk, bk), proj(value, wv, bv)
    b, l_, s = q.shape[0], q.shape[1], k.shape[1]
    if mha.bias_k is not None:
        k = torch.cat([k, mha.bias_k.to(dtype).reshape(1, 1, e).expand(b, 1, e)], dim=1)
        v = torch.cat([v, mha.bias_v.to(dtype).reshape(1, 1, e).expand(b, 1, e)], dim=1)
    q, k, v = (t.reshape(b, t.shape[1], h, d).transpose(1, 2) for t in (q, k, v))
    if mha.add_zero_attn:
        k = torch.cat([k, k.new_zeros(b, h, 1, d)], dim=2)
        v = torch.cat([v, v.new_zeros(b, h, 1, d)], dim=2)
    bias = torch.zeros(b, h, l_, k.shape[2], dtype=torch.float64)
    am = _bool_to_float(attn_mask, model_dtype)
    if am is not None:
        bias[..., :s] += am if am.dim() == 2 else am.reshape(b, h, l_, s)
    kp = _bool_to_float(key_padding_mask, model_dtype)
    if kp is not None:
        bias[..., :s] += kp.reshape(b, 1, 1, s)
    if raw:
        return q, k, v, bias, model_dtype, unbatched
    bias = bias.masked_fill(~(bias > MASK_BIAS), -math.inf)
    return q, k, v, bias, model_dtype, unbatched


def stats(q: Tensor, k: Tensor, bias: Tensor) -> Dict[str, np.ndarray]:
    """Per-head reference metrics of one call, float64, plain numpy."""
    d = q.shape[-1]
    r = (q.detach().double() @ k.detach().double().transpose(-1, -2) / math.sqrt(d)).numpy()
    a = bias.numpy()
    valid = np.isfinite(a)
    out: Dict[str, List[float]] = {m: [] for m in ("logit_var", "logit_max", "entropy", "max_prob")}
    for i in range(r.shape[1]):
        ri, vi, ai = r[:, i], valid[:, i], a[:, i]
        vals = ri[vi]
        out["logit_var"].append(vals.var() if vals.size else np.nan)
        out["logit_max"].append(vals.max() if vals.size else np.nan)
        nv = vi.sum(-1)
        rows = nv >= 2
        z = np.where(vi, ri + np.where(vi, ai, 0.0), -np.inf)[rows]
        if not z.size:
            out["entropy"].append(np.nan)
            out["max_prob"].append(np.nan)
            continue
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            ent = -np.where(p > 0, p * np.log(p), 0.0).sum(-1) / np.log(nv[rows])
        out["entropy"].append(ent.mean())
        out["max_prob"].append(p.max(-1).mean())
    return {m: np.array(v) for m, v in out.items()}


def weights_stats(w: Tensor, bias: Tensor) -> Dict[str, np.ndarray]:
    """entropy / max_prob per head from the module's own per-head probabilities (B, H, L, S')."""
    w = w.detach().double().numpy()
    valid = np.isfinite(bias.numpy())
    ent, mp = [], []
    for i in range(w.shape[1]):
        e_, m_ = [], []
        for b in range(w.shape[0]):
            for r in range(w.shape[2]):
                keys = np.nonzero(valid[b, i, r])[0]
                if keys.size < 2:
                    continue
                p = w[b, i, r, keys]
                nz = p[p > 0]
                e_.append(-(nz * np.log(nz)).sum() / math.log(keys.size))
                m_.append(p.max())
        ent.append(np.mean(e_) if e_ else np.nan)
        mp.append(np.mean(m_) if m_ else np.nan)
    return dict(entropy=np.array(ent), max_prob=np.array(mp))


class RefMHA(nn.Module):
    """Stand-in forward for a float64 copy of an ``nn.MultiheadAttention``: the reference attention
    written out, with q, k, v and the logits kept for their gradients (dropout must be 0)."""

    def __init__(self, mha: nn.MultiheadAttention, store: Dict[str, List[Tensor]]) -> None:
        super().__init__()
        self.mha, self.store = mha, store

    def __call__(self, *args: Any, **kwargs: Any) -> Tuple[Tensor, Optional[Tensor]]:
        bound = _MHA_SIG.bind(self.mha, *args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        q, k, v, bias, _, unbatched = attention_parts(self.mha, a["query"], a["key"], a["value"],
                                                      a["key_padding_mask"], a["attn_mask"], raw=True)
        for t in (q, k, v):  # not leaves: the gradient must flow on into earlier layers
            if t.requires_grad:
                t.retain_grad()
        z = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        z.retain_grad()
        zb = z + bias
        if a["need_weights"]:
            p = torch.softmax(zb, dim=-1)  # a fully masked row is NaN, as in the model
        else:
            dead = torch.isinf(bias).all(-1, keepdim=True)  # a fully masked row: SDPA returns zeros
            p = torch.where(dead, 0.0, torch.softmax(torch.where(dead, 0.0, zb), dim=-1))
        o = p @ v
        o.retain_grad()
        y = o.transpose(1, 2)
        y = y.reshape(y.shape[0], y.shape[1], -1)
        y = F.linear(y, self.mha.out_proj.weight, self.mha.out_proj.bias)
        if unbatched:
            y = y[0]
        elif not self.mha.batch_first:
            y = y.transpose(0, 1)
        masked = bias.masked_fill(~(bias > MASK_BIAS), -math.inf)  # P over probe's valid keys (docs/gradients.md)
        self.store.setdefault(id(self.mha), []).append(dict(q=q, k=k, v=v, z=z, o=o, masked=masked))
        return y, None


# -- running a case ------------------------------------------------------------------------------------------
class Holder(nn.Module):
    def __init__(self, mha: nn.Module) -> None:
        super().__init__()
        self.attn = mha

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.attn(*args, **kwargs)


def _first(out: Any) -> Tensor:
    out = out[0] if isinstance(out, tuple) else out
    return out.to_padded_tensor(0.0) if out.is_nested else out


def _same(a: Tensor, b: Tensor) -> Tuple[bool, float]:
    if a.shape != b.shape:
        return False, float("inf")
    eq = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if bool(eq.all()):
        return True, 0.0
    diff = (a.double() - b.double()).abs().nan_to_num(nan=float("inf"))
    return False, float(diff.max())


def _loss(out: Tensor) -> Tensor:
    """A fixed random projection of the output (a normalized output's mean square has no gradient)."""
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    return (out.double() * w).sum() if out.dtype == torch.float64 else (out * w.to(out.dtype)).sum()


def _run(model: nn.Module, run: Callable[[nn.Module], Any], train: bool, probed: bool):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    p = probe.watch(model, every=1, rows=None) if probed else None
    try:
        if train:
            out = _first(run(model))
            _loss(out).backward()
        else:
            with torch.no_grad():
                out = _first(run(model))
    finally:
        summary = p.summary() if p else None
        if p:
            p.close()
    grads = [t.grad.clone() if t.grad is not None else None for t in model.parameters()]
    return out.detach(), grads, summary


def _record(model: nn.Module, run: Callable[[nn.Module], Any], train: bool) -> List[Tuple[str, nn.Module, dict]]:
    """The arguments every nn.MultiheadAttention of ``model`` receives (no grad): as the model runs,
    and, for those a fused encoder layer never calls, with PyTorch's fast path off."""
    real = _record_pass(model, run, fast=True)
    seen = {site for site, _, _ in real}
    return real + [c for c in _record_pass(model, run, fast=False) if c[0] not in seen]


def _record_pass(model: nn.Module, run: Callable[[nn.Module], Any], fast: bool) -> List[Tuple[str, nn.Module, dict]]:
    seen: List[Tuple[str, nn.Module, dict]] = []
    handles = []
    layer_attns = {id(m.self_attn) for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)}
    for name, m in model.named_modules():
        if isinstance(m, nn.MultiheadAttention) and not (fast and id(m) in layer_attns):  # (a hook blocks the layer's fast path)
            def pre(mod, args, kwargs, name=name):  # type: ignore[no-untyped-def]
                bound = _MHA_SIG.bind(mod, *args, **kwargs)
                bound.apply_defaults()
                a = {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in bound.arguments.items()
                     if k != "self"}
                for k in ("query", "key", "value"):
                    if a[k].is_nested:
                        a[k] = a[k].to_padded_tensor(0.0)
                seen.append((name, mod, a))
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
    fast_before = torch.backends.mha.get_fastpath_enabled()
    try:
        torch.backends.mha.set_fastpath_enabled(fast and fast_before)
        torch.manual_seed(7)
        with torch.no_grad():
            run(model)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_before)
        for h in handles:
            h.remove()
    return seen


def _grad_reference(model: nn.Module, run: Callable[[nn.Module], Any]) -> Dict[str, Dict[str, np.ndarray]]:
    """Per-site gradient norms from a float64 copy whose attention modules are :class:`RefMHA`."""
    twin = copy.deepcopy(model).double()
    store: Dict[int, List[Dict[str, Tensor]]] = {}
    names = {}
    for name, m in list(twin.named_modules()):
        if isinstance(m, nn.MultiheadAttention):
            names[id(m)] = name
            ref = RefMHA(m, store)
            m.forward = ref.__call__  # type: ignore[method-assign]
    out = _first(run(_Double(twin)))
    _loss(out).backward()
    res: Dict[str, Dict[str, np.ndarray]] = {}
    for mid, calls in store.items():
        c = calls[0]
        zb = (c["z"] + c["masked"]).detach()
        dead = torch.isinf(c["masked"]).all(-1, keepdim=True)
        pv = torch.where(dead, 0.0, torch.softmax(torch.where(dead, 0.0, zb), dim=-1))
        dp = c["o"].grad @ c["v"].detach().transpose(-1, -2)
        dz = pv * (dp - (pv * dp).sum(-1, keepdim=True))  # grad_logits as docs/gradients.md defines it
        res[names[mid]] = {"grad_q": c["q"].grad, "grad_k": c["k"].grad, "grad_v": c["v"].grad, "grad_logits": dz}
        res[names[mid]] = {m: g.square().sum((0, 2, 3)).sqrt().numpy() for m, g in res[names[mid]].items()}
    return res


class _Double(nn.Module):
    """Calls ``inner`` with float tensor arguments cast to float64 (the float64 twin's inputs)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cast = lambda t: t.double() if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731
        return self.inner(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


TOL = dict(logit_var=(1e-4, 1e-6), logit_max=(1e-4, 1e-5), entropy=(0, 2e-5), max_prob=(0, 2e-5),
           grad_q=(2e-3, 1e-8), grad_k=(2e-3, 1e-8), grad_v=(2e-3, 1e-8), grad_logits=(2e-3, 1e-8))


def _agree(got: np.ndarray, ref: np.ndarray, metric: str) -> Tuple[bool, float]:
    rel, ab = TOL[metric]
    got, ref = np.asarray(got, float), np.asarray(ref, float)
    if got.shape != ref.shape:
        return False, float("inf")
    both = np.isnan(got) & np.isnan(ref)
    err = np.where(both, 0.0, np.abs(got - ref))
    err = np.nan_to_num(err, nan=np.inf)
    ok = bool(np.all(err <= ab + rel * np.abs(np.nan_to_num(ref))))
    scale = np.maximum(np.abs(np.nan_to_num(ref)), 1e-12) if rel else 1.0
    return ok, float(np.max(err / scale)) if err.size else 0.0


def run_case(name: str, spec: Dict[str, Any]) -> Dict[str, Any]:
    torch.manual_seed(0)
    model, args, kwargs = spec["build"]()
    run = lambda m: m(*args, **kwargs)  # noqa: E731
    train = spec["mode"] == "train"
    model.train(train)
    calls = _record(model, run, train)
    ref_out, ref_grads, _ = _run(model, run, train, probed=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, grads, summary = _run(model, run, train, probed=True)
    msgs = [str(w.message) for w in caught if "probe" in str(w.message)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cov = probe.coverage(model, *args, backward=train, **kwargs)
    missed = [r.site for r in cov.rows if not r.captured or r.verified is False]
    problems, notes, named_only = [], [], []
    same, diff = _same(out, ref_out)
    if not same:
        problems.append(("OUTPUT CHANGED", f"out max|diff| {diff:.1e}"))
    if train:
        bad = [i for i, (a, b) in enumerate(zip(grads, ref_grads)) if (a is None) != (b is None)
               or (a is not None and not _same(a, b)[0])]
        if bad:
            problems.append(("OUTPUT CHANGED", f"{len(bad)} param grads differ"))
    text = " ".join(msgs)
    worst = worst_g = 0.0
    by_site: Dict[str, List[Dict[str, Any]]] = {}
    for site, mha, a in calls:
        by_site.setdefault(site, []).append((mha, a))
    grad_ref = _grad_reference(model, run) if train and spec.get("grad_ref", True) else {}
    for site, entries in by_site.items():
        named = f"'{site}'" in text and "NOT measured" in text or site in missed
        if site not in summary.sites:
            (named_only if named else problems).append(("named" if named else "SILENTLY MISSING", f"{site}: no site"))
            continue
        mha, a = entries[0]
        q, k, _, bias, _, _ = attention_parts(mha, **a)
        if not train and spec.get("nested") is not None and site.startswith(spec["nested"][0]):
            # nn.TransformerEncoder's fast path makes a nested tensor: padded query rows are never computed
            bias[spec["nested"][1][:, None, :, None].expand_as(bias)] = -math.inf
        ref = stats(q, k, bias)
        for m, r in ref.items():
            ok, err = _agree(summary.value(site, m, "actual"), r, m)
            worst = max(worst, err if np.isfinite(err) else 0.0)
            if not ok:
                problems.append(("SILENTLY WRONG", f"{site} {m}: got {np.round(summary.value(site, m), 5).tolist()} "
                                 f"ref {np.round(r, 5).tolist()}"))
        if spec.get("weights_check") and not train:
            kw = {k_: a[k_] for k_ in ("key_padding_mask", "attn_mask")}
            with torch.no_grad():
                w = mha(a["query"], a["key"], a["value"], need_weights=True, average_attn_weights=False, **kw)[1]
            w = w if w.dim() == 4 else w[None]
            for m, r in weights_stats(w, bias).items():
                ok, err = _agree(ref[m], r, m)
                if not ok:
                    notes.append(f"weights-ref {m} disagrees with float64 ref ({err:.1e})")
        if train:
            have = set(summary.metrics(site))
            nm = summary.not_measured(site)
            gone = [g for g in GRADS if g not in have]
            for g in gone:
                if any(g in v for v in nm.values()) or (f"'{site}'" in text and g in text):
                    named_only.append(("named", f"{site} {g} named"))
                else:
                    problems.append(("SILENTLY MISSING", f"{site} {g}"))
            for g, r in grad_ref.get(site, {}).items():
                if g in have:
                    ok, err = _agree(summary.value(site, g), r, g)
                    worst_g = max(worst_g, err)
                    if not ok:
                        problems.append(("SILENTLY WRONG", f"{site} {g}: got {summary.value(site, g)} ref {r}"))
    extra = [s for s in summary.sites if s not in by_site]
    if extra:
        notes.append(f"extra sites {extra}")
    order = ["OUTPUT CHANGED", "SILENTLY WRONG", "SILENTLY MISSING", "named"]
    kinds = [p[0] for p in problems + named_only]
    verdict = next((v for v in order if v in kinds), "exact")
    return dict(case=name, mode=spec["mode"], verdict=verdict, sites=summary.sites, calls=len(calls),
                worst_err=worst, worst_grad=worst_g, problems=[p[1] for p in problems], named=[p[1] for p in named_only],
                notes=notes, warnings=msgs, out_diff=diff)


# -- the cases ---------------------------------------------------------------------------------------------
def X(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def kpm(kind: str, s: int = L, b: int = B) -> Tensor:
    m = torch.zeros(b, s, dtype=torch.bool)
    m[-1, s - 2:] = True
    if kind == "bool":
        return m
    return torch.where(m, -math.inf if kind == "-inf" else -1e4, 0.0)


def amask(kind: str, l_: int = L, s: int = L, b: int = B, h: int = H, full_row: bool = False) -> Tensor:
    shape = (l_, s) if kind.startswith("2d") else (b * h, l_, s)
    bad = torch.rand(shape, generator=torch.Generator().manual_seed(3)) < 0.3
    bad[..., 0] = False
    if full_row:
        bad[..., 1, :] = True
    if kind.endswith("bool"):
        return bad
    fill = -1e4 if "finite" in kind else -math.inf
    return torch.where(bad, fill, torch.randn(shape, generator=torch.Generator().manual_seed(4)))


def mha_case(mha_kw: Optional[dict] = None, call_kw: Optional[dict] = None, cross: bool = False,
             unbatched: bool = False, dtype: torch.dtype = torch.float32, mode: str = "train",
             weights_check: bool = True) -> Dict[str, Any]:
    mha_kw = dict(mha_kw or {})
    call_kw = dict(call_kw or {})
    bf = mha_kw.setdefault("batch_first", True)

    def build():  # type: ignore[no-untyped-def]
        mha = nn.MultiheadAttention(E, H, dtype=dtype, **mha_kw)
        s = S if cross else L
        if unbatched:
            q = X(L, E, dtype=dtype)
            k = v = q
        else:
            q = X(B, L, E, dtype=dtype)
            k = X(B, s, mha_kw.get("kdim") or E, seed=1, dtype=dtype) if cross else q
            v = X(B, s, mha_kw.get("vdim") or E, seed=2, dtype=dtype) if cross else q
            if not bf:
                q, k, v = (t.transpose(0, 1) for t in (q, k, v))
                if not cross:
                    k = v = q
        return Holder(mha), (q, k, v), call_kw

    return dict(build=build, mode=mode, weights_check=weights_check and not mha_kw.get("dropout"),
                grad_ref=not mha_kw.get("dropout"))


def mha_cases() -> Dict[str, Dict[str, Any]]:
    kb, kf, k4 = kpm("bool"), kpm("-inf"), kpm("-1e4")
    kb_s = kpm("bool", S)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    c = {
        "batch_first": mha_case(),
        "seq_first": mha_case(dict(batch_first=False)),
        "kdim12 vdim10 cross L5 S7": mha_case(dict(kdim=12, vdim=10), cross=True),
        "packed cross L5 S7 + kpm": mha_case(cross=True, call_kw=dict(key_padding_mask=kb_s)),
        "bias=False": mha_case(dict(bias=False)),
        "add_bias_kv": mha_case(dict(add_bias_kv=True)),
        "add_zero_attn": mha_case(dict(add_zero_attn=True)),
        "bias_kv+zero_attn+kpm": mha_case(dict(add_bias_kv=True, add_zero_attn=True), dict(key_padding_mask=kb)),
        "kpm bool": mha_case(call_kw=dict(key_padding_mask=kb)),
        "kpm float -inf": mha_case(call_kw=dict(key_padding_mask=kf)),
        "kpm float -1e4": mha_case(call_kw=dict(key_padding_mask=k4)),
        "mask 2d bool": mha_case(call_kw=dict(attn_mask=amask("2d_bool"))),
        "mask 2d float": mha_case(call_kw=dict(attn_mask=amask("2d_float"))),
        "mask 2d float -1e4": mha_case(call_kw=dict(attn_mask=amask("2d_float_finite"))),
        "mask 3d bool": mha_case(call_kw=dict(attn_mask=amask("3d_bool"))),
        "mask 3d float": mha_case(call_kw=dict(attn_mask=amask("3d_float"))),
        "mask 3d float + kpm float": mha_case(call_kw=dict(attn_mask=amask("3d_float"), key_padding_mask=kf)),
        "mask 2d bool + kpm bool": mha_case(call_kw=dict(attn_mask=amask("2d_bool"), key_padding_mask=kb)),
        "mask 3d bool cross+kdim": mha_case(dict(kdim=12, vdim=10), dict(attn_mask=amask("3d_bool", s=S)), cross=True),
        "is_causal + causal mask": mha_case(call_kw=dict(attn_mask=causal, is_causal=True, need_weights=False)),
        "is_causal + mask, weights": mha_case(call_kw=dict(attn_mask=causal, is_causal=True)),
        "is_causal + mask + kpm": mha_case(call_kw=dict(attn_mask=causal, is_causal=True, key_padding_mask=kb,
                                                        need_weights=False)),
        "need_weights=False": mha_case(call_kw=dict(need_weights=False)),
        "need_weights avg=False": mha_case(call_kw=dict(need_weights=True, average_attn_weights=False)),
        "dropout=0.3": mha_case(dict(dropout=0.3)),
        "dropout=0.3 sdpa": mha_case(dict(dropout=0.3), dict(need_weights=False)),
        "unbatched 2-D + kpm": mha_case(call_kw=dict(key_padding_mask=kb[-1]), unbatched=True),
        "fully masked row bool": mha_case(call_kw=dict(attn_mask=amask("2d_bool", full_row=True))),
        "fully masked row sdpa": mha_case(call_kw=dict(attn_mask=amask("3d_float", full_row=True),
                                                       need_weights=False)),
        "fully masked kpm row -1e4": mha_case(call_kw=dict(key_padding_mask=torch.tensor([[0.0] * L, [-1e4] * L]))),
        "float64 module + kpm": mha_case(call_kw=dict(key_padding_mask=kb), dtype=torch.float64),
    }
    out = {}
    for name, spec in c.items():
        out[f"mha {name}"] = spec
        out[f"mha {name} [eval]"] = dict(spec, mode="eval")
    return out


def layer_case(make: Callable[[], nn.Module], args: Callable[[], tuple], kwargs: Optional[dict] = None,
               mode: str = "train", grad_ref: bool = True, nested: Optional[Tuple[str, Tensor]] = None) -> Dict[str, Any]:
    """``nested``: (site prefix, padding mask) of an encoder that converts its batch to a nested tensor in eval."""
    kwargs = kwargs or {}

    def build():  # type: ignore[no-untyped-def]
        return make(), args(), kwargs

    return dict(build=build, mode=mode, grad_ref=grad_ref, nested=nested)


def transformer_cases() -> Dict[str, Dict[str, Any]]:
    kw = dict(dim_feedforward=32, dropout=0.0, batch_first=True)
    enc = lambda **o: nn.TransformerEncoderLayer(E, H, **{**kw, **o})  # noqa: E731
    dec = lambda **o: nn.TransformerDecoderLayer(E, H, **{**kw, **o})  # noqa: E731
    src, tgt = (lambda: X(B, L, E)), (lambda: X(B, S, E, seed=1))
    pad = kpm("bool")
    tpad = kpm("bool", S)
    cm_t = nn.Transformer.generate_square_subsequent_mask(S)
    cm_s = nn.Transformer.generate_square_subsequent_mask(L)
    mem_mask = amask("2d_bool", l_=S, s=L)
    c: Dict[str, Dict[str, Any]] = {}
    for mode in ("train", "eval"):
        t = f" [{mode}]" if mode == "eval" else ""
        c.update({
            f"TEL{t}": layer_case(lambda: nn.Sequential(enc()), lambda: (src(),), mode=mode),
            f"TEL norm_first{t}": layer_case(lambda: nn.Sequential(enc(norm_first=True)), lambda: (src(),), mode=mode),
            f"TEL src_key_padding_mask{t}": layer_case(lambda: enc(), lambda: (src(),),
                                                       dict(src_key_padding_mask=pad), mode=mode),
            f"TEL src_mask causal is_causal{t}": layer_case(lambda: enc(), lambda: (src(),),
                                                            dict(src_mask=cm_s, is_causal=True), mode=mode),
            f"TE 2 layers kpm (nested){t}": layer_case(
                lambda: nn.TransformerEncoder(enc(), 2, enable_nested_tensor=True), lambda: (src(),),
                dict(src_key_padding_mask=pad), mode=mode, nested=("layers.", pad)),
            f"TE 2 layers kpm, no nested{t}": layer_case(
                lambda: nn.TransformerEncoder(enc(), 2, enable_nested_tensor=False), lambda: (src(),),
                dict(src_key_padding_mask=pad), mode=mode),
            f"TE norm_first kpm + mask{t}": layer_case(
                lambda: nn.TransformerEncoder(enc(norm_first=True), 2, enable_nested_tensor=False),
                lambda: (src(),), dict(mask=amask("2d_bool"), src_key_padding_mask=pad), mode=mode),
            f"TDL tgt_mask causal tgt_is_causal{t}": layer_case(
                lambda: nn.TransformerDecoder(dec(), 1), lambda: (tgt(), src()),
                dict(tgt_mask=cm_t, tgt_is_causal=True), mode=mode),
            f"TDL memory_mask + memory kpm + tgt kpm{t}": layer_case(
                lambda: nn.TransformerDecoder(dec(norm_first=True), 1), lambda: (tgt(), src()),
                dict(tgt_mask=cm_t, memory_mask=mem_mask, memory_key_padding_mask=pad, tgt_key_padding_mask=tpad),
                mode=mode),
            f"Transformer all masks{t}": layer_case(
                lambda: nn.Transformer(E, H, 1, 1, **kw), lambda: (src(), tgt()),
                dict(tgt_mask=cm_t, memory_mask=mem_mask, src_key_padding_mask=pad, tgt_key_padding_mask=tpad,
                     memory_key_padding_mask=pad, tgt_is_causal=True), mode=mode, nested=("encoder.", pad)),
            f"Transformer dropout 0.1{t}": layer_case(
                lambda: nn.Transformer(E, H, 1, 1, **{**kw, "dropout": 0.1}), lambda: (src(), tgt()),
                dict(tgt_mask=cm_t, src_key_padding_mask=pad), mode=mode, grad_ref=False, nested=("encoder.", pad)),
        })
    # (a nested-tensor input runs only on the fused kernels, which the recording pass turns off:
    # tests/capture/test_mha.py::test_nested_input_runs_fused_path_bitwise_and_is_measured covers it)
    return c


def cases() -> Dict[str, Dict[str, Any]]:
    return {**mha_cases(), **transformer_cases()}


def main() -> None:
    warnings.filterwarnings("ignore", message=".*nested tensors is in prototype.*")
    warnings.filterwarnings("ignore", message="enable_nested_tensor is True")

    def line(name: str, row: Dict[str, Any]) -> str:
        detail = "; ".join(row["problems"] + row["named"] + row["notes"])
        return (f"{name:48s} {row['verdict']:16s} calls={row['calls']} sites={len(row['sites'])} "
                f"err={row['worst_err']:.1e} grad={row['worst_grad']:.0e}  {detail[:300]}")

    sweep_main(cases(), run_case, line,
               lambda name, spec, err: dict(case=name, mode=spec["mode"], verdict=f"ERROR {type(err).__name__}: "
                                            f"{str(err)[:150]}", sites=[], calls=0, worst_err=0.0, worst_grad=0.0,
                                            problems=[], named=[], notes=[], warnings=[], out_diff=0.0))

if __name__ == "__main__":
    sys.exit(main())
