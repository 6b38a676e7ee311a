"""QK-Clip on real model families: after one clip, on the batch that measured it, every clipped
head's max logit is τ (to float rounding) and every other head is untouched, bit for bit.

Each model runs one training step under ``probe.watch(model, qk_clip=τ, every=None)`` with a
learning rate of 0 (so the only change to the weights is the clip). The reference measures each
attention module alone on the inputs it had in that step, before and after, through the SDPA
call it issues (tests/qk_clip_util.py: float64, nothing of probe's); eager variants are measured
through SDPA after the clip, on the same weights.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
from torch import nn

import probe
from tests.capture.timm_style import TinyViT
from tests.qk_clip_util import ModuleInputs, NanoGPT

transformers = pytest.importorskip("transformers")


def _hf(name: str, attn: str) -> Tuple[nn.Module, Dict[str, Any], Callable[[nn.Module, str], None]]:
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                             attn_implementation=attn))
        inputs = {"input_ids": torch.randint(0, 64, (2, 9)), "use_cache": False}
    elif name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                           bos_token_id=0, eos_token_id=0, attn_implementation=attn))
        inputs = {"input_ids": torch.randint(0, 64, (2, 9)), "use_cache": False}
    elif name == "bert":
        from transformers import BertConfig, BertModel
        model = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, attn_implementation=attn))
        inputs = {"input_ids": torch.randint(0, 64, (2, 9)),
                  "attention_mask": torch.tensor([[1] * 9, [1] * 6 + [0] * 3])}
    elif name == "olmo2":  # QK-norm over all heads' features: a gain entry per head and feature
        from transformers import Olmo2Config, Olmo2ForCausalLM
        model = Olmo2ForCausalLM(Olmo2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                             bos_token_id=1, eos_token_id=2, attn_implementation=attn))
        with torch.no_grad():  # the gains (initialised at 1) spread, as after training
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.copy_(torch.rand(norm.weight.shape) * 6)
        inputs = {"input_ids": torch.randint(0, 64, (2, 9)), "use_cache": False}
    else:
        from transformers import ViTConfig, ViTModel
        model = ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                   image_size=8, patch_size=4, attn_implementation=attn))
        inputs = {"pixel_values": torch.randn(2, 3, 8, 8)}
    return model, inputs, lambda m, how: m.set_attn_implementation(how)


def _timm(attn: str):
    torch.manual_seed(0)
    model = TinyViT()
    model.set_fused_attn(attn == "sdpa")
    return model, {"x": torch.randn(2, 5, 32)}, lambda m, how: m.set_fused_attn(how == "sdpa")


def _nano(attn: str):
    torch.manual_seed(0)
    model = NanoGPT(flash=attn == "sdpa")
    return model, {"idx": torch.randint(0, 64, (2, 9))}, lambda m, how: m.set_flash(how == "sdpa")


def _attention_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """The modules that issue the attention call (HF: *Attention with q/k projections)."""
    keep = {}
    for name, m in model.named_modules():
        cls = type(m).__name__
        if cls in ("LlamaAttention", "GPT2Attention", "BertSelfAttention", "ViTAttention", "Attention",
                   "NanoAttention", "Olmo2Attention"):
            keep[name] = m
    return keep


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out[0]


def _tau(tops: Dict[str, torch.Tensor]) -> float:
    """A τ between two heads' max logits, at the widest gap around the middle (no head near τ)."""
    values = torch.cat(list(tops.values())).sort().values
    n = values.numel()
    gaps = [(float(values[i + 1] - values[i]), i) for i in range(n // 4, 3 * n // 4)]
    _, i = max(gaps)
    return float(values[i] + values[i + 1]) / 2


CASES = [("llama", a) for a in ("sdpa", "eager")] + [("olmo2", a) for a in ("sdpa", "eager")] \
    + [("gpt2", a) for a in ("sdpa", "eager")] \
    + [("bert", a) for a in ("sdpa", "eager")] + [("vit", a) for a in ("sdpa", "eager")] \
    + [("timm", a) for a in ("sdpa", "eager")] + [("nanogpt", a) for a in ("sdpa", "eager")]


@pytest.mark.parametrize("family,attn", CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_clipped_heads_land_on_tau_others_untouched(family, attn):
    build = {"timm": _timm, "nanogpt": _nano}.get(family, lambda a: _hf(family, a))
    model, inputs, switch = build(attn)
    model.eval()  # no dropout: the probe's forward and the reference see the same numbers
    with torch.no_grad():  # sharpen the attention so that max logits spread over a wide range
        for name, p in model.named_parameters():
            if p.dim() == 2 and any(s in name for s in ("q_proj", "k_proj", "c_attn", "query", "key", "qkv")):
                p.mul_(6.0)
    modules = _attention_modules(model)
    assert modules, family
    kept = ModuleInputs(modules)
    model(**inputs)
    kept.remove()
    switch(model, "sdpa")
    before = kept.measure()
    switch(model, attn)
    tau = _tau({n: t for n, (t, _) in before.items()})
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no site refused, nothing skipped
        with probe.watch(model, qk_clip=tau, every=None) as p:
            _first_tensor(model(**inputs)).float().pow(2).mean().backward()
            opt.step()
    switch(model, "sdpa")
    after = kept.measure()
    clipped = 0
    for name, (top, out) in before.items():
        top_after, out_after = after[name]
        over = top > tau
        clipped += int(over.sum())
        torch.testing.assert_close(top_after[over], torch.full_like(top_after[over], tau), rtol=2e-6, atol=0)
        assert torch.equal(top_after[~over], top[~over]), name  # q and k of those heads bit for bit
        assert torch.equal(out_after[:, ~over], out[:, ~over]), name  # their attention outputs too
    assert 0 < clipped < sum(t.numel() for t, _ in before.values())
    # only the traced q and k entries changed
    for n, w in weights.items():
        changed = not torch.equal(dict(model.named_parameters())[n], w)
        if changed:
            assert any(s in n for s in ("q_proj", "k_proj", "c_attn", "query", "key", "qkv", "q_norm", "k_norm")), n
    summary = p.summary()
    sites = summary.sites
    assert len(sites) == len(modules)
    for site in sites:
        assert summary.info(site)["qk_clip"].startswith("q: ")
        factor = summary.value(site, "qk_clip_factor")
        top = summary.value(site, "qk_clip_logit")
        assert ((factor < 1) == (top > tau)).all()
