"""Keras 3 on the torch backend: a keras.layers.MultiHeadAttention is a torch module and captured."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

# Keras picks its backend at its first import (tensorflow by default), so it is never imported
# here: the check runs in a subprocess with KERAS_BACKEND=torch.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="keras is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_keras_multi_head_attention_is_one_sdpa_site_with_per_head_values() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-m", "tests.integrations.keras_worker"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["backend"] == "torch" and out["is_module"]
    assert out["sites"] == ["attn"]
    info = out["info"]
    assert (info["kind"], info["heads"], info["d_k"]) == ("sdpa", 2, 8)
    assert math.isclose(info["scale"], 8 ** -0.5, rel_tol=1e-6)
    # per-head entropy equals the one of the layer's own attention probabilities (float64 reference)
    assert len(out["entropy"]) == 2
    for got, ref in zip(out["entropy"], out["entropy_ref"]):
        assert math.isclose(got, ref, rel_tol=1e-4, abs_tol=1e-5), (out["entropy"], out["entropy_ref"])
    assert len(out["grad_logits"]) == 2 and all(g > 0 for g in out["grad_logits"])
    # a Functional model's layers are not torch submodules: the site is named after the root
    assert out["functional_sites"] == ["root"] and out["functional_kind"] == "sdpa"
    # keras.layers.Attention masks by `where(mask, scores - 1e9, scores)`: a mask, not scores of
    # unknown scale measured with every key valid (logit_var was 2.4e17, the entropy normalised by
    # log(all keys)); at scale 1 (q·kᵀ, no divisor)
    dot = out["masked_dot"]
    assert dot["sites"] == ["root"] and dot["scale"] == 1.0
    for key in ("logit_var", "entropy"):
        for got, ref in zip(dot[key], dot[key + "_ref"]):
            assert math.isclose(got, ref, rel_tol=1e-4, abs_tol=1e-5), (key, dot)
    # attention_axes=(1, 2) (softmax over two key axes) is not measured: it must be named, not
    # silently absent beside a measured layer
    two_d = out["two_d"]
    assert two_d["sites"] == ["seq"]
    assert any("'img" in w for w in two_d["warnings"]), two_d
    # dropout > 0: Keras' eager path, einsum(k, q) (was "not taken as q·kᵀ": NOT measured) then a
    # Softmax layer (the site was named `attn._softmax`): measured, at `attn` as on the SDPA path
    eager = out["eager"]
    assert eager["sites"] == ["attn"]
    assert (eager["info"]["kind"], eager["info"]["heads"], eager["info"]["d_k"]) == ("eager", 2, 8)
    assert math.isclose(eager["info"]["scale"], 8 ** -0.5, rel_tol=1e-6) and eager["info"]["verified"] is True
    for got, ref in zip(eager["entropy"], eager["entropy_ref"]):
        assert math.isclose(got, ref, rel_tol=1e-4, abs_tol=1e-5), eager
    # fit under mixed_float16: Keras's shape inference on ones is not a call of the step (it was
    # measured: entropy 0.91 for the model's 0.82), and the gradient metrics are in the loss's units
    # (they read 32768 times too large: the LossScaleOptimizer's scale)
    mixed, one = out["mixed_fit"]["mixed"], out["mixed_fit"]["mixed_scale1"]
    assert mixed["optimizer"] == "LossScaleOptimizer" and mixed["calls"] == 1 and not mixed["warnings"], mixed
    for got, ref in zip(mixed["entropy"], mixed["entropy_ref"]):  # (the model's own, in float16)
        assert math.isclose(got, ref, rel_tol=1e-3), mixed
    for got, ref in zip(mixed["grad_q"], one["grad_q"]):
        assert math.isclose(got, ref, rel_tol=1e-3), (mixed, one)
