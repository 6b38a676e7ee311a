"""Hugging Face families, eager and SDPA: the float64 reference, parity, scales, names, outputs.

Models are built from tiny configs with random weights (no downloads). The reference for the
eager implementation comes from what the model itself passed to its ``eager_attention_forward``
(recorded by wrapping that module-level function for the test), independently of probe's capture.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Dict, List

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import probe
from probe.stats.paths import key_blocks
from tests.helpers import reference_metrics

pytest.importorskip("transformers")

B, L, VOCAB = 2, 8, 64
METRICS = ("logit_var", "logit_max", "entropy", "max_prob", "saturation")
SCALES = ("actual", "unscaled", "standard")


def _config(name: str, attn: str, softcap: Any = None):
    import transformers as tr

    common = dict(vocab_size=VOCAB, attn_implementation=attn)
    if name == "bert":
        return tr.BertModel, tr.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=64, initializer_range=0.3, **common)
    if name in ("gpt2", "gpt2_inverse", "gpt2_reorder"):
        return tr.GPT2LMHeadModel, tr.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16, initializer_range=0.3,
                                                 scale_attn_by_inverse_layer_idx=name != "gpt2",
                                                 reorder_and_upcast_attn=name == "gpt2_reorder", **common)
    if name == "llama":
        return tr.LlamaForCausalLM, tr.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2,
                                                   initializer_range=0.3, **common)
    if name == "mistral":
        return tr.MistralForCausalLM, tr.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                       num_attention_heads=4, num_key_value_heads=2, sliding_window=3,
                                                       initializer_range=0.3, **common)
    if name == "t5":
        return tr.T5ForConditionalGeneration, tr.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                          relative_attention_num_buckets=8, dropout_rate=0.0,
                                                          decoder_start_token_id=0, **common)
    if name == "vit":
        return tr.ViTModel, tr.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                         initializer_range=0.3, attn_implementation=attn)
    if name == "gemma2":
        return tr.Gemma2ForCausalLM, tr.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                     query_pre_attn_scalar=16, sliding_window=4,
                                                     layer_types=["sliding_attention", "full_attention"],
                                                     attn_logit_softcapping=softcap, final_logit_softcapping=None,
                                                     initializer_range=0.3, **common)
    raise ValueError(name)


def build(name: str, attn: str, softcap: Any = None) -> nn.Module:
    cls, config = _config(name, attn, softcap)
    torch.manual_seed(0)
    return cls(config).eval()


def inputs(name: str) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(B, 3, 8, 8, generator=g)}
    ids = torch.randint(1, VOCAB, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, -3:] = 0  # right padding: every query row keeps a valid key
    batch = {"input_ids": ids, "attention_mask": mask}
    if name == "t5":
        batch["decoder_input_ids"] = torch.randint(1, VOCAB, (B, 5), generator=g)
    return batch


def sites(name: str) -> List[str]:
    layers = range(2)
    return {
        "bert": [f"encoder.layer.{i}.attention.self" for i in layers],
        "gpt2": [f"transformer.h.{i}.attn" for i in layers],
        "gpt2_inverse": [f"transformer.h.{i}.attn" for i in layers],
        "gpt2_reorder": [f"transformer.h.{i}.attn" for i in layers],
        "llama": [f"model.layers.{i}.self_attn" for i in layers],
        "mistral": [f"model.layers.{i}.self_attn" for i in layers],
        "gemma2": [f"model.layers.{i}.self_attn" for i in layers],
        "vit": [f"layers.{i}.attention" for i in layers],
        "t5": [f"encoder.block.{i}.layer.0.SelfAttention" for i in layers]
        + [f"decoder.block.{i}.layer.0.SelfAttention" for i in layers]
        + [f"decoder.block.{i}.layer.1.EncDecAttention" for i in layers],
    }[name]


def expected_scale(name: str, site_index: int) -> float:
    if name == "t5":
        return 1.0
    if name == "gemma2":
        return 16 ** -0.5
    if name in ("gpt2_inverse", "gpt2_reorder"):
        return 8 ** -0.5 / (site_index + 1)
    return 8 ** -0.5


def _main(out: Any) -> torch.Tensor:
    for attr in ("logits", "last_hidden_state"):
        if getattr(out, attr, None) is not None:
            return getattr(out, attr)
    return out[0]


def _hooks(model: nn.Module) -> set:
    """Every module hook (Hugging Face installs its own for output_attentions)."""
    found = set()
    for name, m in model.named_modules():
        for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            found.update((name, kind, id(fn)) for fn in getattr(m, kind).values())
    return found


def _assert_clean(model: nn.Module, before: set = frozenset()) -> None:
    """No hook probe added is left on the model or globally, and no mode on the stack."""
    assert _hooks(model) == set(before)
    assert not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks
    assert not _get_current_function_mode_stack()


def run(model: nn.Module, batch: Dict[str, torch.Tensor], **kw: Any):
    """(main output without probe, main output with probe, the probe's summary)."""
    with torch.no_grad():
        ref = _main(model(**batch, **kw))
        with probe.watch(model) as p:
            out = model(**batch, **kw)
    _assert_clean(model)
    return ref, out, p.summary()


FAMILIES = ["bert", "gpt2", "gpt2_inverse", "llama", "mistral", "t5", "vit", "gemma2"]
# Gemma 2 has a test of its own below (transformers 5.24 refuses sdpa for it); GPT-2's
# reorder_and_upcast_attn is an eager-only path (baddbmm over (B*H, L, d), alpha=scale) whose
# heads probe recovers from the reshapes
SDPA_FAMILIES = [n for n in FAMILIES if n != "gemma2"] + ["gpt2_reorder"]


def test_gemma2_sdpa_is_refused_or_equals_eager():
    # transformers 5.24 refuses sdpa for Gemma 2; older releases (5.20.2, which pip picks on
    # Python 3.10) run it, and then it must match eager like every other family
    try:
        build("gemma2", "sdpa")
    except ValueError as e:
        assert "does not support an attention implementation" in str(e)
        return
    test_eager_and_sdpa_same_sites_scales_and_metrics("gemma2")


@pytest.mark.parametrize("name", SDPA_FAMILIES)
def test_eager_and_sdpa_same_sites_scales_and_metrics(name):
    batch = inputs(name)
    summaries = {}
    for attn in ("eager", "sdpa"):
        ref, out, summaries[attn] = run(build(name, attn), batch)
        assert torch.equal(_main(out), ref), f"{attn}: outputs changed"
    eager, sdpa = summaries["eager"], summaries["sdpa"]
    assert eager.sites == sdpa.sites and sorted(eager.sites) == sorted(sites(name))
    for i, site in enumerate(sites(name)):
        assert eager.info(site)["kind"] == "eager" and sdpa.info(site)["kind"] == "sdpa"
        for field in ("heads", "d_k"):
            assert eager.info(site)[field] == sdpa.info(site)[field], (site, field)
        # GQA: eager sees through repeat_kv; with a padding mask Hugging Face repeats k before
        # SDPA too (no enable_gqa), and SDPA is then handed the repeated heads
        kv = {"llama": 2, "mistral": 2, "gemma2": 2}.get(name, 4)
        assert eager.info(site)["kv_heads"] == kv and sdpa.info(site)["kv_heads"] in (kv, 4)
        for s in (eager, sdpa):
            assert s.info(site)["scale"] == pytest.approx(expected_scale(name, i % 2), rel=1e-7), site
            assert s.info(site)["verified"] is True, (site, s.info(site))  # against the model (issue 25)
        for metric in METRICS:
            for scale in SCALES:
                np.testing.assert_allclose(eager.value(site, metric, scale), sdpa.value(site, metric, scale),
                                           rtol=1e-4, atol=1e-4, err_msg=f"{site} {metric}@{scale}")


class Recorder:
    """Wraps a modeling module's ``eager_attention_forward`` and keeps what each call received."""

    def __init__(self, module_name: str, names: Dict[int, str]) -> None:
        self.mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        self.original: Callable[..., Any] = self.mod.eager_attention_forward
        self.signature = inspect.signature(self.original)
        self.names = names
        self.calls: Dict[str, Dict[str, Any]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        a.update(a.pop("kwargs", {}))
        self.calls[self.names[id(a["module"])]] = a
        return self.original(*args, **kwargs)


def _valid_and_bias(call: Dict[str, Any]):
    """The (B, H, L, S) valid mask and additive bias the model's eager call used."""
    q, k, mask = call["query"], call["key"], call["attention_mask"]
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    bias = torch.zeros(shape, dtype=torch.float64)
    valid = torch.ones(shape, dtype=torch.bool)
    if mask is not None:
        if mask.dtype == torch.bool:
            valid = valid & mask
        else:
            ok = mask > torch.finfo(mask.dtype).min / 2
            valid = valid & ok
            bias = bias + torch.where(ok, mask.double(), 0.0)
    if call.get("position_bias") is not None:
        bias = bias + call["position_bias"].double()
    return valid, bias


def _reference(call: Dict[str, Any]) -> Dict[str, np.ndarray]:
    scale = call.get("scaling")
    scale = call["query"].shape[-1] ** -0.5 if scale is None else scale
    valid, bias = _valid_and_bias(call)
    return reference_metrics(call["query"], call["key"], scale, valid, bias, softcap=call.get("softcap"))


def _from_probabilities(p: torch.Tensor, valid: torch.Tensor) -> Dict[str, np.ndarray]:
    """Entropy and max_prob per head from returned attention probabilities over valid keys
    (a fully masked padding row, which eager attention spreads uniformly, has none)."""
    p = p.double()
    n = valid.sum(-1)
    rows = n >= 2
    ent = -(torch.where(valid & (p > 0), p * p.clamp_min(1e-300).log(), 0.0)).sum(-1) / n.clamp(min=2).double().log()
    maxp = torch.where(valid, p, 0.0).amax(-1)
    count = rows.sum((0, 2)).double()
    return {"entropy": (torch.where(rows, ent, 0.0).sum((0, 2)) / count).numpy(),
            "max_prob": (torch.where(rows, maxp, 0.0).sum((0, 2)) / count).numpy()}


@pytest.mark.parametrize("budget", [64 * 2**20, 2**12], ids=["default-budget", "key-blocks"])
@pytest.mark.parametrize("name,softcap", [(n, None) for n in FAMILIES] + [("gemma2", 2.0)])
def test_eager_matches_float64_reference_and_returned_probabilities(name, softcap, budget, monkeypatch):
    """Every family against float64 and its own returned probabilities; with a 4 KiB
    ``memory_budget`` too, under which every call of these tiny models that takes the centred path
    runs over blocks of keys (probe.stats.paths.key_blocks) and every other path in one-row chunks."""
    model = build(name, "eager", softcap)
    module = {"gpt2_inverse": "gpt2"}.get(name, name)
    recorder = Recorder(module, {id(m): n for n, m in model.named_modules()})
    monkeypatch.setattr(recorder.mod, "eager_attention_forward", recorder)
    blocked = []
    real_blocked = key_blocks.forward_rows
    monkeypatch.setattr(key_blocks, "forward_rows", lambda *a, **k: blocked.append(1) or real_blocked(*a, **k))
    with torch.no_grad():
        plain = _main(model(**inputs(name), output_attentions=True))
        before = _hooks(model)
        with probe.watch(model, memory_budget=budget) as p:
            out = model(**inputs(name), output_attentions=True)
    assert torch.equal(_main(out), plain)
    _assert_clean(model, before)
    # Mistral's sliding-window mask depends on the row, and soft-capping takes the general path
    assert bool(blocked) == (budget < 2**20 and name != "mistral" and softcap is None)
    s = p.summary()
    assert sorted(recorder.calls) == sorted(s.sites) == sorted(sites(name))
    for site in s.sites:
        ref = _reference(recorder.calls[site])
        for metric in METRICS:
            np.testing.assert_allclose(s.value(site, metric), ref[metric], rtol=2e-4, atol=1e-6,
                                       err_msg=f"{site} {metric}")
        if softcap is not None:
            assert s.info(site)["softcap"] == softcap
    # the probabilities the model returns give the same entropy and max_prob
    if name == "t5":
        returned = list(out.encoder_attentions) + list(out.decoder_attentions) + list(out.cross_attentions)
    else:
        returned = list(out.attentions)
    for site, probs in zip(sites(name), returned):
        mine = _from_probabilities(probs, _valid_and_bias(recorder.calls[site])[0])
        for metric in ("entropy", "max_prob"):
            np.testing.assert_allclose(s.value(site, metric), mine[metric], rtol=1e-4, atol=1e-6, err_msg=site)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_kv_cache_generate_eager_and_sdpa(name):
    ids = inputs(name)["input_ids"][:1, :5]
    summaries, tokens = {}, {}
    for attn in ("eager", "sdpa"):
        model = build(name, attn)
        kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
        ref = model.generate(ids, **kw)
        with probe.watch(model) as p:
            got = model.generate(ids, **kw)
        _assert_clean(model)
        assert torch.equal(got, ref)
        tokens[attn], summaries[attn] = got, p.summary()
    assert torch.equal(tokens["eager"], tokens["sdpa"])
    eager, sdpa = summaries["eager"], summaries["sdpa"]
    assert eager.sites == sdpa.sites == sites(name)
    assert eager.steps == sdpa.steps == 3  # the prefill and two single-token decoding steps
    for site in eager.sites:
        assert eager.info(site)["calls"] == sdpa.info(site)["calls"] == 3
        for metric in METRICS:
            np.testing.assert_allclose(eager.value(site, metric), sdpa.value(site, metric), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["bert", "gpt2_inverse", "t5", "llama"])
def test_backward_metrics_eager_and_sdpa_agree(name):
    # Eager calls carry v and the output once P @ v is seen: grad_logits at every scale and
    # grad_q / grad_k / grad_v from autograd, the same as the SDPA implementation's.
    summaries = {}
    for attn in ("eager", "sdpa"):
        model = build(name, attn)
        batch = inputs(name)
        if name == "llama":  # no padding mask: SDPA then takes k per kv head (enable_gqa) as eager
            del batch["attention_mask"]
        with probe.watch(model) as p:
            out = _main(model(**batch))
            # a fixed random projection: the mean square of a LayerNorm output has ~no gradient
            (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        _assert_clean(model)
        summaries[attn] = p.summary()
    eager, sdpa = summaries["eager"], summaries["sdpa"]
    for site in sites(name):
        assert eager.info(site)["kv_heads"] == sdpa.info(site)["kv_heads"]
        for metric in ("grad_q", "grad_k", "grad_v"):
            np.testing.assert_allclose(eager.value(site, metric), sdpa.value(site, metric), rtol=1e-4, atol=1e-9,
                                       err_msg=f"{site} {metric}")
        for scale in SCALES:
            np.testing.assert_allclose(eager.value(site, "grad_logits", scale), sdpa.value(site, "grad_logits", scale),
                                       rtol=1e-4, atol=1e-9, err_msg=f"{site} grad_logits@{scale}")
