"""TransformerLens 4's ``TransformerBridge`` under probe (skipped without transformer-lens >= 4).

TransformerLens 4 replaced ``HookedTransformer`` with a bridge that wraps each component
(``_original_component``) and hooks it; ``boot_native`` builds a small random TL-native model with
no download. Reference: the model's own attention pattern from ``run_with_cache``, in float64.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import probe

tl = pytest.importorskip("transformer_lens")
try:
    from transformer_lens.model_bridge import TransformerBridge
except ImportError:
    pytest.skip("transformer_lens without TransformerBridge (before 4.0)", allow_module_level=True)

LENGTH = 12


def _bridge():
    cfg = dict(n_layers=2, d_model=32, n_ctx=16, d_head=8, n_heads=4, d_vocab=50, act_fn="gelu", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerBridge.boot_native(cfg)


def test_native_bridge_measured_exactly_with_gradients():
    model = _bridge()
    ids = torch.randint(0, 50, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, rows=None) as p:
            model(ids).float().square().mean().backward()
    assert not [w for w in caught if "probe" in str(w.message)]
    s = p.summary()
    assert len(s.sites) == 2
    _, cache = model.run_with_cache(ids)
    keys = torch.arange(1, LENGTH + 1, dtype=torch.float64)  # causal: the keys each row sees
    for layer, site in enumerate(s.sites):
        assert s.info(site)["scale"] == pytest.approx(8 ** -0.5)
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"].double()  # (B, H, L, S)
        entropy = -(pattern * pattern.clamp_min(1e-300).log()).sum(-1) / keys.log().clamp_min(1e-300)
        rows = keys >= 2  # a row with one key has no softmax to measure (docs/metrics.md)
        want = entropy[..., rows].mean((0, 2)).numpy()
        np.testing.assert_allclose(s.value(site, "entropy"), want, rtol=1e-5)
        np.testing.assert_allclose(s.value(site, "max_prob"), pattern.amax(-1)[..., rows].mean((0, 2)).numpy(), rtol=1e-5)
        assert {"grad_logits", "grad_q", "grad_k", "grad_v"} <= set(s.metrics(site))
