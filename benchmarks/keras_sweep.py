"""Fidelity sweep of Keras 3 attention (torch backend) under probe.

    KERAS_BACKEND=torch PYTHONPATH=. python benchmarks/keras_sweep.py [--json out.json] [--only NAME,...]

Each case is a tiny random-weight Keras model, run forward + backward under
``probe.watch(model, every=1, rows=None)`` and once under ``probe.coverage``. The reference is
independent of probe: a reference forward (no probe) records the projected q, k, the boolean
mask and the causal flag each attention layer passes to its own ``_compute_attention`` (Keras'
``MultiHeadAttention`` / ``GroupQueryAttention``, keras_hub's Llama attention) or the q, k of
``Attention._calculate_scores``; the logits are rebuilt in float64 with the layer's own einsum
equation and scale, its own mask and causal mask, and reduced per head as docs/metrics.md says
(logit_var, logit_max at ``actual``, entropy normalised by log(#valid keys), max_prob; rows with
fewer than two valid keys excluded). Calls pooled on one probe site (a Functional model's
layers all report at ``root``) are pooled in the reference the same way.

Classification of each case:

* ``exact``: every attention call measured, and each measured site agrees with the reference
  within float32 rounding;
* ``named``: some call is not measured (or is unverified), and a warning or a coverage row names
  it; the measured ones are exact;
* ``SILENTLY WRONG``: a site is measured and verified but its values differ from the reference;
* ``SILENTLY MISSING``: a call has no site and nothing names it;
* ``no attention``: the layer is not a q·kᵀ softmax (no reference), and what probe did is shown.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import probe  # noqa: E402
from sweep_common import agree, sweep_main  # noqa: E402  (benchmarks/, run as a script)

try:  # optional: tiny keras_hub backbones (random weights, built from constructor arguments)
    import keras_hub  # noqa: E402
except Exception:  # pragma: no cover - keras_hub absent or broken
    keras_hub = None

L = keras.layers
RECORD: Optional[List[Dict[str, Any]]] = None  # calls recorded by the reference forward


# -- recording the layers' own q, k, mask -----------------------------------------------------------------
def _np(t: Any) -> Optional[np.ndarray]:
    if t is None:
        return None
    return t.detach().cpu().double().numpy() if t.dtype != torch.bool else t.detach().cpu().numpy()


def _patch(cls: type, method: str, grab: Callable[..., Dict[str, Any]]) -> None:
    orig = getattr(cls, method)

    def wrapper(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if RECORD is not None:
            RECORD.append(dict(grab(self, *args, **kwargs), layer=self))
        return orig(self, *args, **kwargs)

    setattr(cls, method, wrapper)


def _mha_grab(self, query, key, value, attention_mask=None, training=None, return_attention_scores=False,
              use_causal_mask=False, **_):  # type: ignore[no-untyped-def]
    causal = _np(self._compute_causal_mask(query, value)) if use_causal_mask else None
    return dict(kind="mha", q=_np(query), k=_np(key), mask=_np(attention_mask), causal=causal,
                eq=self._dot_product_equation, order="kq", scale=float(self._inverse_sqrt_key_dim),
                axes=len(self._attention_axes))


def _gqa_grab(self, query, key, value, attention_mask=None, training=None, use_causal_mask=False, **_):  # type: ignore[no-untyped-def]
    causal = _np(self._compute_causal_mask(query, value)) if use_causal_mask else None
    return dict(kind="gqa", q=_np(query), k=_np(key), mask=_np(attention_mask), causal=causal,
                eq=self._dot_product_equation, order="qk", scale=float(self._inverse_sqrt_head_dim), axes=1)


def _llama_grab(self, query, key, value, attention_mask=None, **_):  # type: ignore[no-untyped-def]
    return dict(kind="llama", q=_np(query), k=_np(key), mask=_np(attention_mask), causal=None,
                eq=self._dot_product_equation, order="qk", scale=float(self._inv_norm_factor), axes=1)


def _dot_grab(self, query, key):  # type: ignore[no-untyped-def]
    if self.score_mode != "dot":
        return dict(kind="not-qk")
    scale = 1.0 if self.scale is None else float(keras.ops.convert_to_numpy(self.scale))
    return dict(kind="dot", q=_np(query)[:, None], k=_np(key)[:, None], mask=None, causal=None,
                eq="bhqd,bhkd->bhqk", order="qk", scale=scale, axes=1)


def _patch_scores_mask() -> None:
    """``Attention._apply_scores`` gets the boolean mask (causal, value mask) of the scores just recorded."""
    orig = L.Attention._apply_scores

    def wrapper(self, scores, value, scores_mask=None, training=False):  # type: ignore[no-untyped-def]
        if RECORD and RECORD[-1]["layer"] is self and scores_mask is not None:
            m = _np(keras.ops.convert_to_tensor(scores_mask))
            RECORD[-1]["mask"] = m.reshape(m.shape[:-2] + (1,) + m.shape[-2:]) if m.ndim == 3 else m[:, None, None]
        return orig(self, scores, value, scores_mask=scores_mask, training=training)

    L.Attention._apply_scores = wrapper


_patch_scores_mask()
_patch(L.MultiHeadAttention, "_compute_attention", _mha_grab)
_patch(L.GroupQueryAttention, "_compute_attention", _gqa_grab)
_patch(L.Attention, "_calculate_scores", _dot_grab)
if keras_hub is not None:
    from keras_hub.src.models.llama.llama_attention import LlamaAttention

    _patch(LlamaAttention, "_compute_attention", _llama_grab)


# -- the float64 reference ---------------------------------------------------------------------------------
def reference(call: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """Per-head sufficient statistics of one recorded call, in float64."""
    ops = (call["k"], call["q"]) if call["order"] == "kq" else (call["q"], call["k"])
    s = np.einsum(call["eq"], *ops) * call["scale"]
    n = call["axes"]
    head = s.ndim - 2 * n - 1
    valid = np.ones(s.shape, dtype=bool)
    for m in (call["mask"], call["causal"]):
        if m is None:
            continue
        m = m.astype(bool)
        while m.ndim < s.ndim:
            m = np.expand_dims(m, axis=-2 * n - 1)
        valid = valid & np.broadcast_to(m, s.shape)
    s = np.moveaxis(s, head, 0)
    valid = np.moveaxis(valid, head, 0)
    h = s.shape[0]
    keys = int(np.prod(s.shape[s.ndim - n:]))
    s = s.reshape(h, -1, keys)
    valid = valid.reshape(h, -1, keys)
    out: Dict[str, np.ndarray] = {k: np.zeros(h) for k in ("count", "mean", "m2", "max", "ent", "mp", "rows")}
    for i in range(h):
        v = s[i][valid[i]]
        out["count"][i], out["mean"][i] = v.size, v.mean()
        out["m2"][i], out["max"][i] = ((v - v.mean()) ** 2).sum(), v.max()
        nv = valid[i].sum(-1)
        rows = nv >= 2
        z = np.where(valid[i], s[i], -np.inf)[rows]
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            ent = -np.where(p > 0, p * np.log(p), 0.0).sum(-1) / np.log(nv[rows])
        out["ent"][i], out["mp"][i], out["rows"][i] = ent.sum(), p.max(-1).sum(), rows.sum()
    return out


def pooled(refs: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """Calls on one site, combined as probe combines them (Chan's moments; row-weighted means)."""
    acc = dict(refs[0])
    for r in refs[1:]:
        n = acc["count"] + r["count"]
        d = r["mean"] - acc["mean"]
        acc = dict(count=n, mean=acc["mean"] + d * r["count"] / n,
                   m2=acc["m2"] + r["m2"] + d * d * acc["count"] * r["count"] / n,
                   max=np.maximum(acc["max"], r["max"]), ent=acc["ent"] + r["ent"], mp=acc["mp"] + r["mp"],
                   rows=acc["rows"] + r["rows"])
    with np.errstate(invalid="ignore", divide="ignore"):
        return dict(logit_var=acc["m2"] / acc["count"], logit_max=acc["max"], entropy=acc["ent"] / acc["rows"],
                    max_prob=acc["mp"] / acc["rows"])


# -- running a case ---------------------------------------------------------------------------------------
def site_of(model: torch.nn.Module, layer: Any) -> str:
    for name, mod in model.named_modules():
        if mod is layer:
            return name or "root"
    return "root"  # a Functional model's layers are not torch submodules: probe names the root


def _loss(out: Any) -> torch.Tensor:
    leaves = [t for t in keras.tree.flatten(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().square().mean() for t in leaves)


def run_case(name: str, build: Callable[[], Tuple[Any, tuple, dict]]) -> Dict[str, Any]:
    global RECORD
    keras.utils.set_random_seed(0)
    model, args, kwargs = build()
    model(*args, **kwargs)  # build the weights
    RECORD = []
    with torch.no_grad():
        model(*args, **kwargs)
    calls, RECORD = RECORD, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1, rows=None) as p:
            _loss(model(*args, **kwargs)).backward()
        summary = p.summary()
    msgs = [str(w.message) for w in caught if "probe" in str(w.message)]
    cov = probe.coverage(model, *args, **kwargs)
    missed = [r.site for r in cov.rows if not r.captured or r.verified is False]
    row: Dict[str, Any] = dict(case=name, calls=len([c for c in calls if c["kind"] != "not-qk"]),
                               sites=summary.sites, warnings=msgs, coverage_missed=missed,
                               coverage=str(cov).splitlines()[-1] if cov.rows else "no rows")
    by_site: Dict[str, List[Dict[str, np.ndarray]]] = {}
    for c in calls:
        if c["kind"] != "not-qk":
            by_site.setdefault(site_of(model, c["layer"]), []).append(reference(c))
    named_text = " ".join(msgs)
    verdicts, worst = [], 0.0
    for site, refs in by_site.items():
        # one site per call (``root#1``, ``root#2``: a Functional model's layers), or the calls pooled
        # on one site; an eager softmax may report at a sublayer (``attn._softmax``)
        mine = [s for s in summary.sites if s == site or s.startswith(site + "#") or s.startswith(site + ".")]
        named = any(f"'{s}" in named_text for s in (site + "'", site + "#", site + ".")) and (
            "NOT measured" in named_text or "UNVERIFIED" in named_text) or any(
            m == site or m.startswith((site + "#", site + ".")) for m in missed)
        if not mine:
            verdicts.append("named" if named else "SILENTLY MISSING")
            continue
        if len(mine) == len(refs) and len(mine) > 1:
            groups = [([s], [r]) for s, r in zip(mine, refs)]
        else:
            groups = [(mine, refs)]
        for sites_, refs_ in groups:
            s0 = sites_[0]
            info = summary.info(s0)
            n = sum(int(summary.info(s).get("calls", 1)) for s in sites_)
            if info.get("verified") is False:
                verdicts.append("named" if named else "UNVERIFIED-unnamed")
                continue
            got = {m: summary.value(s0, m, "actual") for m in ("logit_var", "logit_max", "entropy", "max_prob")}
            best = None
            for subset in itertools.combinations(range(len(refs_)), min(n, len(refs_))):
                ok, err = agree(got, pooled([refs_[i] for i in subset]))
                best = (ok, err) if best is None or (ok and not best[0]) or (ok == best[0] and err < best[1]) else best
                if ok:
                    break
            ok, err = best
            worst = max(worst, err)
            if not ok:
                verdicts.append("SILENTLY WRONG")
            elif n < len(refs_):
                verdicts.append("named" if named else "SILENTLY MISSING")
            else:
                verdicts.append("exact")
            row.setdefault("detail", {})[s0] = dict(
                calls=f"{n}/{len(refs_)}", scale=info.get("scale"), d_k=info.get("d_k"), heads=info.get("heads"),
                kind=info.get("kind"), verified=info.get("verified"), got={m: np.round(v, 6).tolist() for m, v in got.items()},
                ref={m: np.round(v, 6).tolist() for m, v in pooled(refs_).items()})
    if not by_site:
        verdicts.append("no attention")
    order = ["SILENTLY WRONG", "SILENTLY MISSING", "UNVERIFIED-unnamed", "named", "exact", "no attention"]
    row["verdict"] = next(v for v in order if v in verdicts)
    row["worst_err"] = worst
    return row


# -- the cases --------------------------------------------------------------------------------------------
def X(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def functional(inputs: Any, outputs: Any) -> keras.Model:
    return keras.Model(inputs, outputs)


def one_mha(mha_kwargs: dict, call_kwargs: Optional[dict] = None, q_shape=(5, 16), kv_shape=None, train=False,
            sub: bool = False) -> Callable[[], Tuple[Any, tuple, dict]]:
    call_kwargs = call_kwargs or {}

    def build():  # type: ignore[no-untyped-def]
        mha = L.MultiHeadAttention(**mha_kwargs)
        xq = X(2, *q_shape)
        xk = X(2, *kv_shape, seed=1) if kv_shape else xq
        extra = {k: v for k, v in call_kwargs.items() if k != "attention_mask"}
        mask = call_kwargs.get("attention_mask")
        kw = dict(training=True) if train else {}

        class Sub(keras.Model):
            def __init__(self) -> None:
                super().__init__()
                self.attn = mha

            def call(self, q, k, training=False):  # type: ignore[no-untyped-def]
                return self.attn(q, k, attention_mask=mask, training=training, **extra)

        if sub:
            return Sub(), (xq, xk), kw
        iq = keras.Input(q_shape)
        ik = keras.Input(kv_shape or q_shape)
        return functional([iq, ik], mha(iq, ik, attention_mask=mask, **extra)), ([xq, xk],), kw
    return build


def pad_mask(t: int, s: int) -> torch.Tensor:
    valid = torch.tensor([[True] * s, [True] * (s - 2) + [False] * 2])  # second sequence padded
    return valid[:, None, :].expand(2, t, s).clone()


def random_mask(t: int, s: int) -> torch.Tensor:
    m = torch.rand(2, t, s, generator=torch.Generator().manual_seed(3)) > 0.4
    m[0, 0] = False  # a fully masked row
    m[0, 1] = False
    m[0, 1, 2] = True  # a row with one valid key
    return m


def two_mha_functional():  # type: ignore[no-untyped-def]
    i = keras.Input((5, 16))
    h = L.MultiHeadAttention(2, 8)(i, i)
    h = L.MultiHeadAttention(4, 4, value_dim=6)(h, h, use_causal_mask=True)
    return functional(i, h), (X(2, 5, 16),), {}


class Mixed(keras.Model):
    """A 1-D MHA and a 2-D (attention_axes) MHA in one subclassed model."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = L.MultiHeadAttention(2, 8)
        self.img = L.MultiHeadAttention(2, 8, attention_axes=(1, 2))

    def call(self, x):  # type: ignore[no-untyped-def]
        b = x.shape[0]
        y = self.seq(x, x)
        y = keras.ops.reshape(y, (b, 3, 3, 16))
        return self.img(y, y)


def gqa(kw: dict, call_kw: Optional[dict] = None, train: bool = False, mask=None):  # type: ignore[no-untyped-def]
    def build():  # type: ignore[no-untyped-def]
        layer = L.GroupQueryAttention(**kw)
        i = keras.Input((5, 16))
        return functional(i, layer(i, i, attention_mask=mask, **(call_kw or {}))), (X(2, 5, 16),), \
            (dict(training=True) if train else {})
    return build


def dot_attention(kw: dict, call_kw: Optional[dict] = None, scale: Optional[float] = None,
                  additive: bool = False):  # type: ignore[no-untyped-def]
    def build():  # type: ignore[no-untyped-def]
        qd, kd = L.Dense(8), L.Dense(8)
        layer = (L.AdditiveAttention if additive else L.Attention)(**kw)
        i = keras.Input((5, 16))
        m = functional(i, layer([qd(i), kd(i)], **(call_kw or {})))
        m(X(2, 5, 16))
        if scale is not None:
            layer.scale.assign(scale)
        return m, (X(2, 5, 16),), {}
    return build


def hub(make: Callable[[], Any], inputs: Callable[[], dict]):  # type: ignore[no-untyped-def]
    def build():  # type: ignore[no-untyped-def]
        return make(), (inputs(),), {}
    return build


def _tokens(with_segments: bool = False) -> Callable[[], dict]:
    def f() -> dict:
        ids = torch.randint(1, 50, (2, 6), generator=torch.Generator().manual_seed(0))
        pad = torch.ones(2, 6, dtype=torch.int32)
        pad[1, 4:] = 0
        d = {"token_ids": ids, "padding_mask": pad}
        if with_segments:
            d["segment_ids"] = torch.zeros(2, 6, dtype=torch.int32)
        return d
    return f


def cases() -> Dict[str, Callable[[], Tuple[Any, tuple, dict]]]:
    c = {
        "mha subclassed h2 k8": one_mha(dict(num_heads=2, key_dim=8), sub=True),
        "mha functional h3 k4 v6": one_mha(dict(num_heads=3, key_dim=4, value_dim=6)),
        "mha cross L5 S7": one_mha(dict(num_heads=2, key_dim=8), kv_shape=(7, 12)),
        "mha causal": one_mha(dict(num_heads=2, key_dim=8), dict(use_causal_mask=True)),
        "mha causal cross L5 S7": one_mha(dict(num_heads=2, key_dim=8), dict(use_causal_mask=True), kv_shape=(7, 16)),
        "mha padding mask": one_mha(dict(num_heads=2, key_dim=8), dict(attention_mask=pad_mask(5, 5))),
        "mha random bool mask": one_mha(dict(num_heads=2, key_dim=8), dict(attention_mask=random_mask(5, 5)),
                                        sub=True),
        "mha mask + causal": one_mha(dict(num_heads=2, key_dim=8),
                                     dict(attention_mask=pad_mask(5, 5), use_causal_mask=True), sub=True),
        "mha sliding_window=2 causal": one_mha(dict(num_heads=2, key_dim=8, sliding_window=2),
                                               dict(use_causal_mask=True), sub=True),
        "mha use_gate": one_mha(dict(num_heads=2, key_dim=8, use_gate=True), sub=True),
        "mha dropout=0.3 training": one_mha(dict(num_heads=2, key_dim=8, dropout=0.3), train=True, sub=True),
        "mha dropout=0.3 inference": one_mha(dict(num_heads=2, key_dim=8, dropout=0.3), sub=True),
        "mha dropout + padding mask": one_mha(dict(num_heads=2, key_dim=8, dropout=0.3),
                                              dict(attention_mask=pad_mask(5, 5)), train=True, sub=True),
        "mha dropout + causal": one_mha(dict(num_heads=2, key_dim=8, dropout=0.3), dict(use_causal_mask=True),
                                        train=True, sub=True),
        "mha return_attention_scores": one_mha(dict(num_heads=2, key_dim=8),
                                               dict(return_attention_scores=True), sub=True),
        "mha attention_axes=(2,) on 4-D": one_mha(dict(num_heads=2, key_dim=8, attention_axes=(2,)),
                                                  q_shape=(3, 5, 16), sub=True),
        "mha attention_axes=(1,2) image": one_mha(dict(num_heads=2, key_dim=8, attention_axes=(1, 2)),
                                                  q_shape=(3, 4, 16), sub=True),
        "two mha in one Functional": two_mha_functional,
        "subclassed 1-D + 2-D mha": lambda: (Mixed(), (X(2, 9, 16),), {}),
        "gqa q4 kv2": gqa(dict(head_dim=8, num_query_heads=4, num_key_value_heads=2)),
        "gqa q4 kv1 causal": gqa(dict(head_dim=8, num_query_heads=4, num_key_value_heads=1),
                                 dict(use_causal_mask=True)),
        "gqa padding mask": gqa(dict(head_dim=8, num_query_heads=4, num_key_value_heads=2), mask=pad_mask(5, 5)),
        "gqa dropout training": gqa(dict(head_dim=8, num_query_heads=4, num_key_value_heads=2, dropout=0.3),
                                    train=True),
        "keras Attention (dot)": dot_attention({}),
        "keras Attention use_scale=0.5": dot_attention(dict(use_scale=True), scale=0.5),
        "keras Attention causal": dot_attention({}, dict(use_causal_mask=True)),
        "keras Attention concat": dot_attention(dict(score_mode="concat")),
        "keras AdditiveAttention": dot_attention({}, additive=True),
    }
    if keras_hub is not None:
        c.update({
            "keras_hub BERT tiny": hub(lambda: keras_hub.models.BertBackbone(
                vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
                max_sequence_length=8, dropout=0.0), _tokens(True)),
            "keras_hub GPT-2 tiny": hub(lambda: keras_hub.models.GPT2Backbone(
                vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
                max_sequence_length=8, dropout=0.0), _tokens()),
            "keras_hub Llama tiny (GQA)": hub(lambda: keras_hub.models.LlamaBackbone(
                vocabulary_size=50, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16,
                intermediate_dim=32, dropout=0.0), _tokens()),
            "keras_hub ViT tiny": hub(lambda: keras_hub.models.ViTBackbone(
                image_shape=(8, 8, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                dropout_rate=0.0, attention_dropout=0.0), lambda: X(2, 8, 8, 3)),
        })
    return c


def main() -> None:
    def line(name: str, row: Dict[str, Any]) -> str:
        note = "; ".join(w[:150] for w in row["warnings"] if "NOT measured" in w or "UNVERIFIED" in w
                         or "no attention call" in w)
        return (f"{name:34s} {row['verdict']:18s} calls={row['calls']} sites={','.join(row['sites']) or '-':22s} "
                f"err={row['worst_err']:.1e}  {note[:220]}")

    sweep_main(cases(), run_case, line,
               lambda name, case, err: dict(case=name, verdict=f"ERROR {type(err).__name__}: {str(err)[:120]}",
                                            calls=0, sites=[], warnings=[], worst_err=0.0),
               lambda row: f"{json.dumps(row.get('detail', {}), indent=1)} {row.get('coverage')} {row['warnings']}")

if __name__ == "__main__":
    sys.exit(main())
