"""Run by test_keras.py in a subprocess: Keras reads KERAS_BACKEND once, at its first import."""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import probe  # noqa: E402


class Block(keras.Model):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.attn = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=dropout)
        self.out = keras.layers.Dense(4)

    def call(self, x, scores=False, training=False):
        return self.attn(x, x, return_attention_scores=scores) if scores else \
            self.out(self.attn(x, x, training=training))


def entropy_reference(model: Block, x: torch.Tensor) -> list:
    """Per-head mean row entropy / log(#keys) of the layer's own probabilities, in float64."""
    _, p = model(x, scores=True)  # (batch, heads, query, key)
    p = p.detach().double().numpy()
    return (-(p * np.log(p)).sum(-1) / np.log(p.shape[-1])).mean(axis=(0, 2)).tolist()


def masked_dot_attention(x: torch.Tensor) -> dict:
    """keras.layers.Attention with a causal mask: Keras masks by ``where(mask, scores - 1e9, scores)``.
    Probe's values against the float64 reference from the layer's own q and k and its mask."""
    inp = keras.Input((6, 16))
    q, k = keras.layers.Dense(8), keras.layers.Dense(8)
    model = keras.Model(inp, keras.layers.Attention()([q(inp), k(inp)], use_causal_mask=True))
    model(x)
    with probe.watch(model, every=1, rows=None) as p:
        model(x).square().mean().backward()
    s = p.summary()
    with torch.no_grad():
        z = (q(x) @ k(x).transpose(-1, -2)).double()
    valid = torch.ones(6, 6, dtype=torch.bool).tril().expand_as(z)
    prob = torch.where(valid, z, -torch.inf).softmax(-1)
    n = valid.sum(-1).double()
    rows = n >= 2
    ent = -(torch.where(prob > 0, prob * prob.log(), 0.0)).sum(-1) / n.log()
    return {"sites": s.sites, "scale": s.info(s.sites[0])["scale"],
            "logit_var": s.value(s.sites[0], "logit_var", "actual").tolist(),
            "logit_var_ref": [z[valid].var(unbiased=False).item()],
            "entropy": s.value(s.sites[0], "entropy", "actual").tolist(), "entropy_ref": [ent[rows].mean().item()]}


class Mixed(keras.Model):
    """A 1-D MultiHeadAttention (SDPA) and a 2-D one (attention_axes=(1, 2): einsum, then a
    softmax over two key axes, exp(s - logsumexp(s, (4, 5))))."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
        self.img = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, attention_axes=(1, 2))

    def call(self, x):
        y = keras.ops.reshape(self.seq(x, x), (x.shape[0], 3, 3, 16))
        return self.img(y, y)


def two_d_attention() -> dict:
    model = Mixed()
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1, rows=None) as p:
            model(x).square().mean().backward()
    return {"sites": p.summary().sites, "warnings": [str(w.message) for w in caught if "NOT measured" in str(w.message)]}


def eager_path(x: torch.Tensor) -> dict:
    """MultiHeadAttention with dropout > 0 takes Keras' eager path (einsum(k, q), a Softmax layer,
    a Dropout layer): measured, and named after the layer as on the SDPA path."""
    block = Block(dropout=0.3)
    block(x)
    with probe.watch(block, every=1, rows=None) as p:
        block(x, training=True).square().mean().backward()
    s = p.summary()
    return {"sites": s.sites, "info": s.info(s.sites[0]), "entropy": s.value(s.sites[0], "entropy", "actual").tolist(),
            "entropy_ref": entropy_reference(block, x)}


def mixed_fit() -> dict:
    """``fit`` under ``mixed_float16``: Keras scales the loss (LossScaleOptimizer, 32768 at first)
    and, its meta-device shape inference failing under the policy, calls the model on ones: the
    gradient metrics are those of a scale of 1 and the statistics those of the real batch."""
    x = np.random.default_rng(0).standard_normal((4, 6, 16)).astype("float32")
    y = np.random.default_rng(1).standard_normal((4, 6, 4)).astype("float32")
    out = {}
    try:
        for name, scale in (("mixed", None), ("mixed_scale1", 1.0)):
            keras.mixed_precision.set_global_policy("mixed_float16")
            keras.utils.set_random_seed(0)
            block = Block()
            block(x[:1])
            opt = keras.optimizers.SGD(0.0)
            block.compile(optimizer=opt if scale is None else keras.optimizers.LossScaleOptimizer(opt, initial_scale=scale),
                          loss="mse")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with probe.watch(block, rows=None) as p:
                    block.fit(x, y, epochs=1, batch_size=4, verbose=0)
            s = p.summary()
            out[name] = {"optimizer": type(block.optimizer).__name__, "calls": s.info("attn")["calls"],
                         "entropy": s.value("attn", "entropy").tolist(), "grad_q": s.value("attn", "grad_q").tolist(),
                         "entropy_ref": entropy_reference(block, torch.tensor(x)),
                         "warnings": [str(w.message) for w in caught if "probe" in str(w.message)]}
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return out


def main() -> None:
    keras.utils.set_random_seed(0)
    x = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(0))
    sub = Block()
    sub(x)
    with probe.watch(sub) as p:
        sub(x).square().mean().backward()
    s = p.summary()
    inp = keras.Input((6, 16))
    functional = keras.Model(inp, keras.layers.Dense(4)(keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(inp, inp)))
    with probe.watch(functional) as q:
        functional(x)
    f = q.summary()
    json.dump({
        "backend": keras.backend.backend(),
        "is_module": isinstance(sub, torch.nn.Module),
        "sites": s.sites, "info": s.info(s.sites[0]),
        "entropy": s.value(s.sites[0], "entropy", "actual").tolist(),
        "entropy_ref": entropy_reference(sub, x),
        "grad_logits": s.value(s.sites[0], "grad_logits", "actual").tolist(),
        "functional_sites": f.sites, "functional_kind": f.info(f.sites[0])["kind"],
        "masked_dot": masked_dot_attention(x),
        "two_d": two_d_attention(),
        "eager": eager_path(x),
        "mixed_fit": mixed_fit(),
    }, sys.stdout)


if __name__ == "__main__":
    main()
