"""FlexAttention: score_mod / block_mask applied to the recomputed logits, against the float64 reference.

FlexAttention runs on CPU in this PyTorch (its eager path compiles the operator with Dynamo's
eager backend), so every case runs here; the first call pays Dynamo's start-up (seconds).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import probe
from tests.helpers import reference_metrics

flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, L, D = 2, 4, 12, 8
METRICS = ("logit_var", "logit_max", "entropy", "max_prob", "saturation")

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


class Flex(nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v):
        out = flex.flex_attention(q, k, v, **self.kwargs)
        return out * 1.0  # an op after the call, inside the same module


class Model(nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.attn = Flex(**kwargs)

    def forward(self, q, k, v):
        return self.attn(q, k, v)


def rel_bias(score, b, h, q_idx, kv_idx):
    return score + 0.1 * (q_idx - kv_idx) * (h + 1)


def softcap(score, b, h, q_idx, kv_idx):
    return 3.0 * torch.tanh(score / 3.0)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window_per_batch(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 2 + 3 * b  # batch-dependent: the block mask keeps B


PLAIN = {  # the same rules written plainly, on Python ints
    "causal": lambda b, h, i, j: i >= j,
    "window_per_batch": lambda b, h, i, j: abs(i - j) <= 2 + 3 * b,
}


def _valid(rule, hk=H):
    valid = torch.ones(B, H, L, L, dtype=torch.bool)
    if rule is not None:
        for b in range(B):
            for h in range(H):
                for i in range(L):
                    for j in range(L):
                        valid[b, h, i, j] = PLAIN[rule](b, h, i, j)
    return valid


def _rel_bias_plain():
    bias = torch.zeros(B, H, L, L, dtype=torch.float64)
    for h in range(H):
        for i in range(L):
            for j in range(L):
                bias[:, h, i, j] = 0.1 * (i - j) * (h + 1)
    return bias


def _run(model, q, k, v):
    ref = model(q, k, v)
    with probe.watch(model) as p:
        out = model(q, k, v)
    assert torch.equal(out, ref)
    return p.summary()


def _check(s, q, k, valid, bias, scales, softcap_c=None):
    assert s.sites == ["attn"]
    assert s.info("attn")["kind"] == "flex"
    for name, sigma in scales.items():
        ref = reference_metrics(q, k, sigma, valid, bias, softcap=softcap_c)
        for metric in METRICS:
            np.testing.assert_allclose(s.value("attn", metric, name), ref[metric], rtol=2e-4, atol=2e-5,
                                       err_msg=f"{metric}@{name}")


CASES = {
    "plain": (dict(), None, False),
    "rel_bias": (dict(score_mod=rel_bias), None, True),
    "causal_blocks": (dict(block_mask="causal"), "causal", False),
    "window_blocks_and_bias": (dict(block_mask="window_per_batch", score_mod=rel_bias), "window_per_batch", True),
    "explicit_scale": (dict(scale=0.2, block_mask="causal"), "causal", False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_flex_metrics_match_reference_at_every_scale(name):
    kwargs, rule, has_bias = CASES[name]
    kwargs = dict(kwargs)
    if rule is not None:  # blocks of 4 rows/keys: full, partial and skipped blocks all occur
        fn = {"causal": causal, "window_per_batch": window_per_batch}[rule]
        kwargs["block_mask"] = flex.create_block_mask(fn, B if rule == "window_per_batch" else None, None, L, L,
                                                      device="cpu", BLOCK_SIZE=4)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    s = _run(Model(**kwargs), q, k, v)
    actual = kwargs.get("scale", 1 / math.sqrt(D))
    assert s.info("attn")["scale"] == pytest.approx(actual)
    assert s.info("attn")["verified"] is True  # its output matched P·v (issue 25's check)
    bias = _rel_bias_plain() if has_bias else None
    _check(s, q, k, _valid(rule), bias, {"actual": actual, "unscaled": 1.0, "standard": D ** -0.5})


def test_non_additive_score_mod_is_exact_at_actual_scale():
    q, k, v = (torch.randn(B, H, L, D) * 2 for _ in range(3))
    s = _run(Model(score_mod=softcap), q, k, v)
    _check(s, q, k, _valid(None), None, {"actual": 1 / math.sqrt(D)}, softcap_c=3.0)


def test_gqa_with_block_mask():
    # FlexAttention has no backward on CPU in this PyTorch, so gradients are not exercised here.
    q = torch.randn(B, H, L, D)
    k, v = (torch.randn(B, 2, L, D) for _ in range(2))
    block_mask = flex.create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=4)
    s = _run(Model(enable_gqa=True, block_mask=block_mask), q, k, v)
    assert s.info("attn")["kv_heads"] == 2
    _check(s, q, k.repeat_interleave(2, dim=1), _valid("causal"), None,
           {"actual": 1 / math.sqrt(D), "unscaled": 1.0})


def test_unmeasurable_score_mod_warns_naming_the_site_and_leaves_output():
    model = Model(score_mod=rel_bias)
    q, k, v = (torch.randn(1, 2, L, D) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a measurable call does not warn
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        with probe.watch(model):
            model(q, k, v)
    from probe.capture.flex import FlexFrontEnd

    fe = FlexFrontEnd()
    fe.pending.append(((q, k, v, "not a score_mod", None, 0.3), {}, q))
    seen = []
    with pytest.warns(UserWarning, match=r"site 'attn' was NOT measured"):
        fe.drain(seen.append, "attn")
    assert seen == []


def test_only_sampled_steps_are_measured_and_outputs_unchanged():
    # Unsampled steps run flex's cached compiled code; each sampled step records through the mode.
    model = Model(score_mod=rel_bias)
    q, k, v = (torch.randn(1, H, L, D) for _ in range(3))
    ref = model(q, k, v)
    with probe.watch(model, every=2) as p:
        outs = [model(q, k, v) for _ in range(4)]
    assert all(torch.equal(o, ref) for o in outs)
    s = p.summary()
    assert s.steps == 2 and s.info("attn")["calls"] == 2


def test_hugging_face_flex_implementation_matches_eager_per_head():
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    flex_model = LlamaForCausalLM(LlamaConfig(**kw, attn_implementation="flex_attention")).eval()
    eager_model = LlamaForCausalLM(LlamaConfig(**kw, attn_implementation="eager")).eval()
    eager_model.load_state_dict(flex_model.state_dict())
    ids = torch.randint(0, 64, (2, 9))
    summaries = []
    for model in (flex_model, eager_model):
        with torch.no_grad(), probe.watch(model) as p:
            model(input_ids=ids)
        summaries.append(p.summary())
    flex_s, eager_s = summaries
    assert flex_s.sites == eager_s.sites == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for site in flex_s.sites:
        assert flex_s.info(site)["kind"] == "flex"
        for metric in METRICS:
            for scale in ("actual", "unscaled", "standard"):
                np.testing.assert_allclose(flex_s.value(site, metric, scale), eager_s.value(site, metric, scale),
                                           rtol=1e-4, atol=1e-5, err_msg=f"{site} {metric}@{scale}")


def test_a_mode_above_the_capture_does_not_change_the_site_or_metrics():
    """A TorchFunctionMode entered in the attention module's own hooks (as probe's variants do)
    sits above the capture mode while flex runs: the call is still measured at its own site."""
    from torch.overrides import TorchFunctionMode

    class PassThrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    model = Model(score_mod=rel_bias)
    above = PassThrough()
    def enter(module, args):
        above.__enter__()  # returns None: the args are unchanged

    def leave(module, args, output):
        above.__exit__(None, None, None)

    handles = [model.attn.register_forward_pre_hook(enter), model.attn.register_forward_hook(leave, always_call=True)]
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    try:
        s = _run(model, q, k, v)
    finally:
        for h in handles:
            h.remove()
    _check(s, q, k, _valid(None), _rel_bias_plain(), {"actual": 1 / math.sqrt(D), "unscaled": 1.0})
