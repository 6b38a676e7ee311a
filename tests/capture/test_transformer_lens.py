"""TransformerLens' ``HookedTransformer`` under probe (skipped without transformer-lens < 4).

Its attention wraps the scores and the pattern in ``HookPoint`` modules (identity modules that
user hooks replace or edit): the site is the attention module ``blocks.N.attn``, at scale
``1/attn_scale``, also with a user hook on the scores; ``run_with_hooks`` calls ``forward``
directly, which probe names (automatic steps) or measures (a recording window).
The full sweep: ``benchmarks/tlens_sweep.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import probe

tl = pytest.importorskip("transformer_lens")
try:  # TransformerLens 4 removed HookedTransformer (its module raises ImportError on the name)
    tl.HookedTransformerConfig
except (AttributeError, ImportError):
    pytest.skip("transformer_lens without HookedTransformer (4.0 and later)", allow_module_level=True)


def _model(**cfg):
    base = dict(n_layers=2, d_model=32, n_ctx=16, d_head=8, n_heads=4, d_vocab=50, act_fn="gelu", seed=0)
    base.update(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return tl.HookedTransformer(tl.HookedTransformerConfig(**base))


def _scale_hook(t, hook):
    return t * 0.5


@pytest.mark.parametrize("cfg", [{}, dict(positional_embedding_type="rotary", n_key_value_heads=2),
                                 dict(attn_scale=2.0, attn_scores_soft_cap=5.0)])
def test_sites_are_the_attention_modules_at_the_models_scale(cfg):
    model = _model(**cfg)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1, rows=None) as p:
            model(tokens).sum().backward()
            p.step(1, window=True)  # run_with_hooks calls forward directly: a window records it
            model.run_with_hooks(tokens, fwd_hooks=[(lambda n: n.endswith("hook_attn_scores"), _scale_hook)])
    assert not [w for w in caught if str(w.message).startswith("probe:")]
    s = p.summary()
    assert s.sites == ["blocks.0.attn", "blocks.1.attn"]
    for n, site in enumerate(s.sites):
        assert s.info(site)["verified"] is True
        expected = 1.0 / float(model.blocks[n].attn.attn_scale)
        assert s.info(site)["scale"] in (pytest.approx(expected), pytest.approx(expected * 0.5))


def test_run_with_hooks_under_automatic_steps_is_named():
    model = _model()
    tokens = torch.randint(0, 50, (2, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1) as p:
            model.run_with_hooks(tokens, fwd_hooks=[])
    messages = [str(w.message) for w in caught if str(w.message).startswith("probe:")]
    assert p.summary().sites == []
    assert len(messages) == 1 and "ran outside the watched module's forward" in messages[0], messages
