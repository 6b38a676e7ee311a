"""Fidelity sweep of TransformerLens' ``HookedTransformer`` under probe.

    PYTHONPATH=. python benchmarks/tlens_sweep.py [--json out.json] [--only NAME,...] [-v]

Each case is a tiny random-weight ``HookedTransformer`` (``n_layers=2``, built from a
``HookedTransformerConfig``: no weights are downloaded), run forward + backward of a loss under
``probe.watch(model, every=1, rows=None)`` and once under ``probe.coverage``. The reference is
independent of probe: the same input run through ``model.run_with_cache`` (no probe), with the
same user hooks where the case has some; per layer, in float64:

* ``σR`` from the model's own q and k as they enter the product (the arguments of each attention
  module's ``calculate_attention_scores``: after rotary embeddings, QK-norm and ``clip_qkv``; a
  GQA model's kv heads repeated as TransformerLens repeats them) times the layer's
  ``1 / attn_scale`` (times a factor a user hook puts on the scores);
* the valid entries: those of ``hook_attn_scores`` (pre-softmax, after the model's masks and user
  hooks) that are finite (TransformerLens masks with ``-inf``);
* ``P`` = softmax of ``hook_attn_scores`` in float64 over the valid keys (checked against
  ``hook_pattern`` where no hook changes the pattern).

Reduced per head as docs/metrics.md says: ``logit_var`` / ``logit_max`` of σR over valid
entries, ``entropy`` normalised by log(#valid keys), ``max_prob``, rows with fewer than two
valid keys excluded. The site must be the attention module ``blocks.N.attn`` (not one of the
``HookPoint`` modules TransformerLens wraps every intermediate in), at scale ``1/attn_scale``.

Classification of each case (the worst over its layers):

* ``exact``: every layer measured at ``blocks.N.attn``, verified, at the model's scale, and its
  values agree with the reference within float32 rounding;
* ``named``: a layer is not measured, unverified or at an unknown scale, and a warning and the
  coverage report name it; the measured values are exact;
* ``SILENTLY WRONG``: a layer is measured (verified, scale claimed) but its values or scale
  differ from the reference, or it is reported under another name than ``blocks.N.attn``;
* ``SILENTLY MISSING``: a layer has no site and nothing names it.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

import probe
from sweep_common import agree, sweep_main  # noqa: E402  (benchmarks/, run as a script)

warnings.filterwarnings("ignore", category=DeprecationWarning)  # HookedTransformer's own deprecation note
from transformer_lens import HookedTransformer, HookedTransformerConfig  # noqa: E402

V = 50  # vocabulary


# -- the float64 reference ---------------------------------------------------------------------------------
QK: Dict[Any, Any] = {"on": False}  # id(attention module) -> its q, k in the reference pass


def _record_qk() -> None:
    """The q and k each attention module passes to its own ``calculate_attention_scores`` (after
    rotary embeddings, QK-norm, ``clip_qkv``, ...), recorded in the reference pass only."""
    from transformer_lens.components.abstract_attention import AbstractAttention

    for cls in [AbstractAttention, *AbstractAttention.__subclasses__()]:
        if "calculate_attention_scores" not in vars(cls):
            continue
        orig = vars(cls)["calculate_attention_scores"]

        def wrapper(self, q, k, *a, __orig=orig, **kw):  # type: ignore[no-untyped-def]
            if QK["on"]:
                QK[id(self)] = (q.detach().clone(), k.detach().clone())
            return __orig(self, q, k, *a, **kw)

        setattr(cls, "calculate_attention_scores", wrapper)


_record_qk()


def _ref_layer(cache: Any, model: Any, n: int, factor: float = 1.0) -> Dict[str, np.ndarray]:
    attn = model.blocks[n].attn
    pre = f"blocks.{n}.attn."
    q, k = (t.double() for t in QK[id(attn)])
    if k.shape[2] != q.shape[2]:  # GQA: TransformerLens repeat_interleaves the kv heads
        k = torch.repeat_interleave(k, q.shape[2] // k.shape[2], dim=2)
    scale = factor / float(attn.attn_scale)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    z = cache[pre + "hook_attn_scores"].double()
    valid = torch.isfinite(z)
    p = torch.softmax(torch.where(valid, z, torch.tensor(-torch.inf, dtype=z.dtype)), -1)
    h = s.shape[1]
    out: Dict[str, Any] = {k_: np.zeros(h) for k_ in ("count", "mean", "m2", "max", "ent", "mp", "rows")}
    for i in range(h):
        v = s[:, i][valid[:, i]]
        out["count"][i], out["mean"][i] = v.numel(), float(v.mean())
        out["m2"][i], out["max"][i] = float(((v - v.mean()) ** 2).sum()), float(v.max())
        nv = valid[:, i].sum(-1)
        rows = nv >= 2
        pi = p[:, i][rows]
        ent = -torch.where(pi > 0, pi * pi.clamp_min(1e-300).log(), torch.zeros_like(pi)).sum(-1) / nv[rows].double().log()
        out["ent"][i], out["mp"][i], out["rows"][i] = float(ent.sum()), float(pi.max(-1).values.sum()), int(rows.sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        ref = dict(logit_var=out["m2"] / out["count"], logit_max=out["max"], entropy=out["ent"] / out["rows"],
                   max_prob=out["mp"] / out["rows"])
    ref["scale"] = scale
    pat = cache[pre + "hook_pattern"].double()
    ref["pattern_err"] = float((pat - torch.nan_to_num(p, nan=0.0)).abs().max())
    return ref


# -- running a case ---------------------------------------------------------------------------------------
Hooks = List[Tuple[str, Callable[..., Any]]]


class Case:
    def __init__(self, cfg: Dict[str, Any], pad: Optional[str] = None, hooks: Optional[Callable[[], Hooks]] = None,
                 factor: float = 1.0, fwd: Optional[Dict[str, Any]] = None, train: bool = False,
                 window: bool = False, direct: bool = False) -> None:
        self.cfg, self.pad, self.hooks, self.factor, self.fwd, self.train = cfg, pad, hooks, factor, fwd or {}, train
        self.window = window  # the watched step recorded whole: p.step(0, window=True)
        self.direct = direct  # model.forward(tokens), not model(tokens)


def build(case: Case) -> Tuple[Any, torch.Tensor, Dict[str, Any]]:
    base = dict(n_layers=2, d_model=32, n_ctx=24, d_head=8, n_heads=4, d_vocab=V, act_fn="gelu",
                normalization_type="LN", seed=0)
    base.update(case.cfg)
    torch.manual_seed(0)
    model = HookedTransformer(HookedTransformerConfig(**base))
    model.train(case.train)
    tokens = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(1))
    kw: Dict[str, Any] = dict(case.fwd)
    if case.pad:
        mask = torch.ones(2, 12, dtype=torch.long)
        if case.pad == "left":
            mask[1, :4] = 0
        else:
            mask[1, -4:] = 0
        tokens = tokens.masked_fill(mask == 0, 0)
        kw["attention_mask"] = mask
    return model, tokens, kw


def _loss(logits: torch.Tensor) -> torch.Tensor:
    target = torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=torch.Generator().manual_seed(2))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def run_case(name: str, case: Case) -> Dict[str, Any]:
    model, tokens, kw = build(case)
    hooks = case.hooks() if case.hooks else []
    QK.clear()
    QK["on"] = True
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):  # the reference: no probe, the same user hooks
        _, cache = model.run_with_cache(tokens, **kw)
    QK["on"] = False
    refs = {f"blocks.{n}.attn": _ref_layer(cache, model, n, case.factor) for n in range(model.cfg.n_layers)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1, rows=None) as p:
            if case.window:
                p.step(0, window=True)
            if case.hooks is not None or case.window:
                logits = model.run_with_hooks(tokens, fwd_hooks=hooks, **kw)
            elif case.direct:
                logits = model.forward(tokens, **kw)
            else:
                logits = model(tokens, **kw)
            _loss(logits).backward()
        summary = p.summary()
    msgs = [str(w.message) for w in caught if "probe" in str(w.message)]
    with model.hooks(fwd_hooks=hooks):
        cov = probe.coverage(model, tokens, **kw)
    rows = {r.site: r for r in cov.rows}
    text = " ".join(msgs)
    outside = any("ran outside the watched module's forward" in m for m in msgs)
    verdicts, worst, detail = [], 0.0, {}
    for site, ref in refs.items():
        named_warn = f"'{site}'" in text and any(s in text for s in ("NOT measured", "UNVERIFIED", "scale"))
        row = rows.get(site)
        named_cov = row is not None and (not row.captured or row.verified is False or row.scale is None)
        if site not in summary.sites:
            verdicts.append("named" if (named_warn or outside) else "SILENTLY MISSING")
            detail[site] = dict(missing=True, coverage=row.why if row else None)
            continue
        info = summary.info(site)
        got = {m: summary.value(site, m, "actual") for m in ("logit_var", "logit_max", "entropy", "max_prob")}
        ok, err = agree(got, ref)
        grads = [g for g in ("grad_logits", "grad_q", "grad_k", "grad_v")
                 if g in summary.metrics(site)] if hasattr(summary, "metrics") else None
        scale = info.get("scale")
        scale_ok = scale is not None and np.allclose(np.asarray(scale, float), ref["scale"], rtol=1e-6)
        detail[site] = dict(scale=scale, ref_scale=ref["scale"], verified=info.get("verified"), kind=info.get("kind"),
                            heads=info.get("heads"), err=err, ok=ok, grads=grads,
                            pattern_err=ref["pattern_err"],
                            got={m: np.round(v, 5).tolist() for m, v in got.items()},
                            ref={m: np.round(ref[m], 5).tolist() for m in got})
        if info.get("verified") is False or scale is None:
            verdicts.append("named" if (named_warn or named_cov) else "SILENTLY WRONG")
            if scale is None and ok:
                worst = max(worst, err)
            continue
        worst = max(worst, err)
        verdicts.append("exact" if ok and scale_ok else "SILENTLY WRONG")
    extra = [s for s in summary.sites if s not in refs]
    if extra:
        verdicts.append("SILENTLY WRONG")  # a site under another name than blocks.N.attn
    order = ["SILENTLY WRONG", "SILENTLY MISSING", "named", "exact"]
    return dict(case=name, verdict=next(v for v in order if v in verdicts), sites=summary.sites, extra_sites=extra,
                worst_err=worst, warnings=msgs, detail=detail, coverage=str(cov).splitlines()[-1],
                scales=sorted({str(np.round(np.asarray(d["scale"], float), 4).tolist()) if d.get("scale") is not None
                               else "unknown" for d in detail.values() if "scale" in d}))


# -- user hooks active during the watched forward ------------------------------------------------------------
def h_record() -> Hooks:
    store: List[torch.Tensor] = []
    return [(lambda n: n.endswith("hook_pattern"), lambda t, hook: store.append(t.detach()))]


def h_ablate_pattern() -> Hooks:  # zero head 0's pattern in layer 0 (a head ablation)
    def f(t: torch.Tensor, hook: Any) -> torch.Tensor:
        t = t.clone()
        t[:, 0] = 0
        return t
    return [("blocks.0.attn.hook_pattern", f)]


def h_ablate_pattern_inplace() -> Hooks:
    def f(t: torch.Tensor, hook: Any) -> None:
        t[:, 1] = 0.0
    return [("blocks.1.attn.hook_pattern", f)]


def h_scale_scores() -> Hooks:  # temperature on the scores of every layer
    return [(lambda n: n.endswith("hook_attn_scores"), lambda t, hook: t * 0.5)]


def h_mask_scores() -> Hooks:  # knock out key 0 for every query but the first (a BOS ablation)
    def f(t: torch.Tensor, hook: Any) -> torch.Tensor:
        m = torch.zeros(t.shape[-2:], dtype=torch.bool)
        m[1:, 0] = True
        return t.masked_fill(m, float("-inf"))
    return [(lambda n: n.endswith("hook_attn_scores"), f)]


def h_mask_scores_inplace() -> Hooks:
    def f(t: torch.Tensor, hook: Any) -> None:
        t[:, :, 1:, 0] = float("-inf")
    return [(lambda n: n.endswith("hook_attn_scores"), f)]


def h_record_scores() -> Hooks:
    store: List[torch.Tensor] = []
    return [(lambda n: n.endswith("hook_attn_scores"), lambda t, hook: store.append(t.detach().clone()))]


def cases() -> Dict[str, Case]:
    c: Dict[str, Case] = {
        "default (causal, standard pos)": Case({}),
        "d_model 64, 8 heads, n_ctx 32": Case(dict(d_model=64, n_heads=8, n_ctx=32)),
        "attn_only": Case(dict(attn_only=True)),
        "training mode": Case({}, train=True),
        "rotary": Case(dict(positional_embedding_type="rotary")),
        "rotary rotary_dim=4": Case(dict(positional_embedding_type="rotary", rotary_dim=4)),
        "rotary adjacent pairs": Case(dict(positional_embedding_type="rotary", rotary_adjacent_pairs=True)),
        "shortformer": Case(dict(positional_embedding_type="shortformer")),
        "alibi": Case(dict(positional_embedding_type="alibi")),
        "GQA n_kv_heads=2 rotary": Case(dict(n_key_value_heads=2, positional_embedding_type="rotary")),
        "GQA n_kv_heads=1 (MQA)": Case(dict(n_key_value_heads=1)),
        "GQA ungrouped": Case(dict(n_key_value_heads=2, ungroup_grouped_query_attention=True)),
        "use_attn_scale=False": Case(dict(use_attn_scale=False)),
        "attn_scale=2.0": Case(dict(attn_scale=2.0)),
        "scale_attn_by_inverse_layer_idx": Case(dict(scale_attn_by_inverse_layer_idx=True)),
        "attn_scores_soft_cap=5": Case(dict(attn_scores_soft_cap=5.0)),
        "soft cap + use_attn_scale=False": Case(dict(attn_scores_soft_cap=3.0, use_attn_scale=False)),
        "local attn window 3": Case(dict(use_local_attn=True, attn_types=["local", "global"], window_size=3)),
        "use_split_qkv_input": Case(dict(use_split_qkv_input=True)),
        "use_attn_result": Case(dict(use_attn_result=True)),
        "use_attn_in": Case(dict(use_attn_in=True)),
        "split_qkv + attn_result": Case(dict(use_split_qkv_input=True, use_attn_result=True)),
        "qk_norm (RMS)": Case(dict(use_qk_norm=True, normalization_type="RMS")),
        "clip_qkv=0.5": Case(dict(clip_qkv=0.5)),
        "RMS, gated mlp, rotary (llama-like)": Case(dict(normalization_type="RMS", gated_mlp=True, act_fn="silu",
                                                         positional_embedding_type="rotary",
                                                         original_architecture="LlamaForCausalLM")),
        "parallel_attn_mlp (GPT-J-like)": Case(dict(parallel_attn_mlp=True, positional_embedding_type="rotary",
                                                    original_architecture="GPTJForCausalLM")),
        "attention sinks": Case(dict(use_attention_sinks=True)),
        "bidirectional": Case(dict(attention_dir="bidirectional")),
        "padding right (attention_mask)": Case({}, pad="right"),
        "padding left (attention_mask)": Case({}, pad="left"),
        "padding left, rotary": Case(dict(positional_embedding_type="rotary"), pad="left"),
        "bidirectional, padding right": Case(dict(attention_dir="bidirectional"), pad="right"),
        "padding_side=left kwarg": Case({}, fwd=dict(padding_side="left")),
        "model.forward(tokens) called directly": Case({}, direct=True),
        "run_with_hooks, no hooks": Case({}, hooks=lambda: []),
        "run_with_hooks in p.step(0, window=True)": Case({}, window=True),
        "hook: record hook_pattern": Case({}, hooks=h_record),
        "hook: record hook_attn_scores": Case({}, hooks=h_record_scores),
        "hook: ablate head (pattern, new)": Case({}, hooks=h_ablate_pattern),
        "hook: ablate head (pattern, in place)": Case({}, hooks=h_ablate_pattern_inplace),
        "hook: scores * 0.5": Case({}, hooks=h_scale_scores, factor=0.5),
        "hook: mask key 0 (masked_fill)": Case({}, hooks=h_mask_scores),
        "hook: mask key 0 (in place)": Case({}, hooks=h_mask_scores_inplace),
    }
    for name in [n for n in c if n.startswith("hook: ")]:  # the same hooks in a recording window
        c[name + " [window]"] = Case(c[name].cfg, hooks=c[name].hooks, factor=c[name].factor, window=True)
    return c


def main() -> None:
    def line(name: str, row: Dict[str, Any]) -> str:
        note = "; ".join(w[:160] for w in row["warnings"] if "NOT measured" in w or "UNVERIFIED" in w
                         or "scale" in w or "no attention" in w)
        return (f"{name:38s} {row['verdict']:16s} sites={','.join(row['sites']) or '-':28s} "
                f"scale={'/'.join(row['scales']):16s} err={row['worst_err']:.1e}  {note[:300]}")

    sweep_main(cases(), run_case, line,
               lambda name, case, err: dict(case=name, verdict=f"ERROR {type(err).__name__}: {str(err)[:150]}",
                                            sites=[], warnings=[], worst_err=0.0, scales=[]),
               lambda row: f"{json.dumps(row.get('detail', {}), default=str)} {row.get('coverage')} {row['warnings']}")

if __name__ == "__main__":
    sys.exit(main())
