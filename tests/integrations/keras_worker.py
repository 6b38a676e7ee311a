"""Run by test_keras.py in a subprocess: Keras reads KERAS_BACKEND once, at its first import."""

from __future__ import annotations

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import probe  # noqa: E402


class Block(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.attn = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
        self.out = keras.layers.Dense(4)

    def call(self, x, scores=False):
        return self.attn(x, x, return_attention_scores=scores)if scores else self.out(self.attn(x, x))


def entropy_reference(model: Block, x: torch.Tensor) -> list:
    """Per-head mean row entropy / log(#keys) of the layer's own probabilities, in float64."""
    _, p = model(x, scores=True)  # (batch, heads, query, key)
    p = p.detach().double().numpy()
    return (-(p * np.log(p)).sum(-1) / np.log(p.shape[-1])).mean(axis=(0, 2)).tolist()


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
    }, sys.stdout)


if __name__ == "__main__":
    main()
