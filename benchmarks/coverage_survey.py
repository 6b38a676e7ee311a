"""Survey: does probe find, name, scale, measure exactly and measure the gradients of every
attention in real third-party code? (issues 17 and 25; kept apart from README's test command.)

    PYTHONPATH=. python benchmarks/coverage_survey.py [--only hf,thirdparty,more,timm] [--quiet]
    /work/timm-venv/bin/python benchmarks/coverage_survey.py --only timm     # real timm
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/coverage_survey.py --only hfauto  # every other HF type

docs/models.md's support table is written from the JSON results of both environments:

    PYTHONPATH=. python benchmarks/coverage_survey.py --only hf,thirdparty,more --json /tmp/sys.json
    PYTHONPATH=. /work/timm-venv/bin/python benchmarks/coverage_survey.py --only thirdparty,timm --json /tmp/timm.json
    python benchmarks/coverage_survey.py --docs docs/models.md /tmp/sys.json /tmp/timm.json

Models: Hugging Face architectures from tiny random configs (eager and sdpa; ``hfauto``, not in the
default groups: every other transformers model type, built automatically by
benchmarks/hf_auto_sweep.py, about 10 minutes on one core), third-party
configurations (x-transformers, rotary-embedding-torch, nanoGPT / minGPT written from their
published code, vit-pytorch when importable), more libraries (benchmarks/survey_more.py:
diffusers, peft, fair-esm, perceiver-pytorch, flamingo-pytorch, reformer-pytorch) and real timm
models (fused and eager paths). A library that is not installed is skipped, and said so.

Oracle per attention site: found and named = :func:`probe.coverage`'s independent audit (every
softmax over scores derived from a product of two activations, and every SDPA / MHA call, at the
module that ran it); scale = the value the model's own code uses (its config: ``head_dim ** -0.5``
unless listed below), and for Hugging Face the eager and sdpa runs must agree; values = a second,
independent forward under a mode that records what the model computed (its own softmax outputs;
for SDPA its own arguments, at ``actual`` and, with the config's scale, at ``unscaled`` and
``standard``, in float64): probe's entropy, max_prob and saturation within 1e-4 relative
(:func:`survey_more.values`), and probe's own check of each record against the model
(``verified``); gradients = ``grad_q``, ``grad_k``, ``grad_v`` (and ``grad_logits``) present after
one backward. A run is *silently wrong* when a site fails a check and none of ``probe.watch``'s
warnings on one forward and backward names it.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from probe.session.coverage import coverage  # noqa: E402
from benchmarks.hf_auto_sweep import hfauto_cases, report as hf_auto_report  # noqa: E402
from benchmarks.survey_more import compare, more_cases, values  # noqa: E402

B, L, VOCAB = 2, 8, 64
Case = Tuple[str, Callable[[], Tuple[nn.Module, tuple, dict]], Optional[Callable[[str, int], float]]]


# -- Hugging Face ----------------------------------------------------------------------------------
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              initializer_range=0.3)
_GQA = dict(_SMALL, num_key_value_heads=2)

# (name, model class, config class, config kwargs, input kind, expected scale(site, d) or None: d ** -0.5)
_HF: List[Tuple[str, str, str, Dict[str, Any], str, Any]] = [
    ("bert", "BertModel", "BertConfig", _SMALL, "text", None),
    ("roberta", "RobertaModel", "RobertaConfig", dict(_SMALL, pad_token_id=0), "text", None),
    ("electra", "ElectraModel", "ElectraConfig", dict(_SMALL, embedding_size=32), "text", None),
    ("distilbert", "DistilBertModel", "DistilBertConfig", dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4,
                                                              hidden_dim=64), "text", None),
    ("albert", "AlbertModel", "AlbertConfig", dict(_SMALL, embedding_size=16), "text", None),
    ("gpt2", "GPT2LMHeadModel", "GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16),
     "text", None),
    ("gpt2_inverse", "GPT2LMHeadModel", "GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                           n_positions=16, scale_attn_by_inverse_layer_idx=True),
     "text", "inverse"),
    ("gpt2_reorder", "GPT2LMHeadModel", "GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                           n_positions=16, reorder_and_upcast_attn=True), "text", None),
    ("gpt_bigcode", "GPTBigCodeForCausalLM", "GPTBigCodeConfig", dict(vocab_size=VOCAB, n_embd=32, n_layer=2,
                                                                      n_head=4, n_positions=16, multi_query=True),
     "text", None),
    ("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", _SMALL, "text", None),
    ("gptj", "GPTJForCausalLM", "GPTJConfig", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                                   rotary_dim=4), "text", None),
    ("codegen", "CodeGenForCausalLM", "CodeGenConfig", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                            n_positions=16, rotary_dim=4), "text", None),
    ("bloom", "BloomForCausalLM", "BloomConfig", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4), "text",
     None),
    ("falcon", "FalconForCausalLM", "FalconConfig", dict(_SMALL, new_decoder_architecture=False), "text", None),
    ("opt", "OPTForCausalLM", "OPTConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32,
                                                max_position_embeddings=32), "text", None),
    ("xglm", "XGLMForCausalLM", "XGLMConfig", dict(vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4,
                                                   ffn_dim=64), "text", None),
    ("llama", "LlamaForCausalLM", "LlamaConfig", _GQA, "text", None),
    ("mistral", "MistralForCausalLM", "MistralConfig", dict(_GQA, sliding_window=4), "text", None),
    ("mixtral", "MixtralForCausalLM", "MixtralConfig", dict(_GQA, num_local_experts=2, num_experts_per_tok=1), "text",
     None),
    ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", _GQA, "text", None),
    ("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(_GQA, num_experts=2, num_experts_per_tok=1,
                                                                moe_intermediate_size=32,
                                                                shared_expert_intermediate_size=32), "text", None),
    ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(_GQA, head_dim=8), "text", None),
    ("phi", "PhiForCausalLM", "PhiConfig", _SMALL, "text", None),
    ("phi3", "Phi3ForCausalLM", "Phi3Config", dict(_GQA, pad_token_id=0), "text", None),
    ("gemma", "GemmaForCausalLM", "GemmaConfig", dict(_GQA, head_dim=8), "text", None),
    ("gemma2", "Gemma2ForCausalLM", "Gemma2Config", dict(_GQA, head_dim=8, query_pre_attn_scalar=8), "text", None),
    ("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", dict(_GQA, head_dim=8, query_pre_attn_scalar=8), "text", None),
    ("olmo", "OlmoForCausalLM", "OlmoConfig", _GQA, "text", None),
    ("olmo2", "Olmo2ForCausalLM", "Olmo2Config", _GQA, "text", None),
    ("stablelm", "StableLmForCausalLM", "StableLmConfig", _GQA, "text", None),
    ("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", _GQA, "text", None),
    ("granite", "GraniteForCausalLM", "GraniteConfig", dict(_GQA, attention_multiplier=0.125), "text", 0.125),
    ("cohere", "CohereForCausalLM", "CohereConfig", _GQA, "text", None),
    ("esm", "EsmModel", "EsmConfig", dict(_SMALL, position_embedding_type="rotary", pad_token_id=1,
                                          mask_token_id=2), "text", None),
    ("deberta", "DebertaModel", "DebertaConfig", dict(_SMALL, relative_attention=True, pos_att_type=["p2c", "c2p"],
                                                      max_relative_positions=8), "text", "deberta"),
    ("deberta_v2", "DebertaV2Model", "DebertaV2Config", dict(_SMALL, relative_attention=True,
                                                             pos_att_type=["p2c", "c2p"], position_buckets=4),
     "text", "deberta"),
    ("t5", "T5ForConditionalGeneration", "T5Config", dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                          num_heads=4, relative_attention_num_buckets=8,
                                                          decoder_start_token_id=0), "seq2seq", 1.0),
    ("bart", "BartModel", "BartConfig", dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                             encoder_attention_heads=4, decoder_attention_heads=4,
                                             encoder_ffn_dim=64, decoder_ffn_dim=64), "seq2seq", None),
    ("whisper", "WhisperModel", "WhisperConfig", dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                                      encoder_attention_heads=4, decoder_attention_heads=4,
                                                      encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                                                      max_source_positions=8, max_target_positions=16,
                                                      pad_token_id=1, bos_token_id=2, eos_token_id=2,
                                                      decoder_start_token_id=2), "whisper",
     None),
    ("vit", "ViTModel", "ViTConfig", dict(image_size=8, patch_size=4, num_channels=3, hidden_size=32,
                                          num_hidden_layers=2, num_attention_heads=4, intermediate_size=64), "image",
     None),
    ("swin", "SwinModel", "SwinConfig", dict(image_size=16, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 2],
                                             num_heads=[2, 4], window_size=4), "image16", None),
    ("longformer", "LongformerModel", "LongformerConfig", dict(_SMALL, attention_window=4, pad_token_id=1), "text16",
     None),
]


def _expected(rule: Any) -> Callable[[str, int], float]:
    def scale(site: str, d: int) -> float:
        if rule is None:
            return d ** -0.5
        if rule == "inverse":
            layer = int(site.split(".h.")[1].split(".")[0])
            return d ** -0.5 / (layer + 1)
        if rule == "deberta":
            return 1 / math.sqrt(3 * d)
        return float(rule)
    return scale


def padding_mask(n: int, padding: str) -> torch.Tensor:
    """A ``(B, n)`` attention mask whose last batch row has its first (``"left"``) or last
    (``"right"``) third padded."""
    mask = torch.ones(B, n, dtype=torch.long)
    if padding == "left":
        mask[-1, : n // 3] = 0
    else:
        mask[-1, n - n // 3 :] = 0
    return mask


def _hf_inputs(kind: str, config: Any, padding: Optional[str] = None) -> dict:
    """The model's inputs; ``padding`` ``"left"`` or ``"right"``: an ``attention_mask`` whose last
    batch row has its first or last third padded (text and seq2seq models; left padding gives a
    causal model query rows that see no key)."""
    g = torch.Generator().manual_seed(1)
    if kind in ("text", "text16", "seq2seq"):
        n = 16 if kind == "text16" else L
        out = {"input_ids": torch.randint(3, VOCAB, (B, n), generator=g)}
        if kind == "seq2seq":
            out["decoder_input_ids"] = torch.randint(3, VOCAB, (B, L), generator=g)
        if padding is not None:
            out["attention_mask"] = padding_mask(n, padding)
        return out
    if kind == "whisper":
        return {"input_features": torch.randn(B, 8, 16, generator=g),
                "decoder_input_ids": torch.randint(3, VOCAB, (B, L), generator=g)}
    size = 16 if kind == "image16" else 8
    return {"pixel_values": torch.randn(B, 3, size, size, generator=g)}


class _Generate(nn.Module):
    """``model.generate`` as one forward (a prompt and two decoding steps: KV cache, one query
    token per step; grouped-query models pack their heads then, transformers' ``pack_gqa``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=3,
                                   do_sample=False, pad_token_id=0)


#: Causal LMs also surveyed through ``generate`` on a left-padded batch.
_GENERATE = ("gpt2", "llama", "mistral", "qwen2", "gemma", "phi3", "falcon", "opt")


def hf_cases() -> Iterator[Case]:
    import transformers as tr

    for name, model_cls, config_cls, kwargs, kind, rule in _HF:
        if name not in _GENERATE:
            continue
        for impl in ("eager", "sdpa"):
            def build_generate(model_cls=model_cls, config_cls=config_cls, kwargs=kwargs, kind=kind, impl=impl):
                config = getattr(tr, config_cls)(**kwargs, attn_implementation=impl)
                torch.manual_seed(0)
                return _Generate(getattr(tr, model_cls)(config).eval()), (), _hf_inputs(kind, config, "left")
            yield f"hf/{name}/{impl}/generate", build_generate, _expected(rule)

    for name, model_cls, config_cls, kwargs, kind, rule in _HF:
        paddings = (None, "left", "right") if kind in ("text", "text16", "seq2seq") else (None,)
        for impl, padding in itertools.product(("eager", "sdpa"), paddings):
            def build(model_cls=model_cls, config_cls=config_cls, kwargs=kwargs, kind=kind, impl=impl,
                      padding=padding):
                config = getattr(tr, config_cls)(**kwargs, attn_implementation=impl)
                torch.manual_seed(0)
                model = getattr(tr, model_cls)(config).eval()
                return model, (), _hf_inputs(kind, config, padding)
            yield f"hf/{name}/{impl}" + ("" if padding is None else f"/{padding}-padded"), build, _expected(rule)


# -- third party -------------------------------------------------------------------------------------
class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention (model.py), flash and manual paths."""

    def __init__(self, n_embd: int = 32, n_head: int = 4, block_size: int = 16, flash: bool = True) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.flash = n_head, n_embd, flash
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Bn, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(Bn, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(Bn, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(Bn, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = torch.nn.functional.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(Bn, T, C)
        return self.c_proj(y)


class Blocks(nn.Module):
    def __init__(self, layers: List[nn.Module], d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class RotaryAttention(nn.Module):
    """rotary-embedding-torch's README usage: rotate q and k, then attention (sdpa or eager)."""

    def __init__(self, d: int = 32, heads: int = 4, fused: bool = True, prescale: bool = False) -> None:
        super().__init__()
        from rotary_embedding_torch import RotaryEmbedding

        self.rotary = RotaryEmbedding(dim=d // heads // 2)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.heads, self.fused, self.prescale = heads, fused, prescale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        s = (d // self.heads) ** -0.5
        if self.prescale:
            q = q * s
        q, k = self.rotary.rotate_queries_or_keys(q), self.rotary.rotate_queries_or_keys(k)
        if self.fused:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0 if self.prescale else None)
        else:
            attn = q @ k.transpose(-1, -2) * (1.0 if self.prescale else s)
            o = attn.softmax(-1) @ v
        return self.out(o.transpose(1, 2).reshape(b, n, d))


def thirdparty_cases() -> Iterator[Case]:
    default = _expected(None)
    for flash in (True, False):
        yield (f"nanogpt/{'flash' if flash else 'manual'}",
               lambda flash=flash: (Blocks([NanoGPTAttention(flash=flash) for _ in range(2)]), (_ids(),), {}), default)
    for fused, prescale in ((True, False), (False, False), (True, True), (False, True)):
        yield (f"rotary/{'sdpa' if fused else 'eager'}{'/prescaled' if prescale else ''}",
               lambda f=fused, p=prescale: (Blocks([RotaryAttention(fused=f, prescale=p) for _ in range(2)]),
                                            (_ids(),), {}), default)
    try:
        import x_transformers  # noqa: F401
    except ImportError:
        print("x-transformers not installed: skipped")
    else:
        variants = {
            "default": {}, "flash": dict(attn_flash=True), "qk_norm": dict(attn_qk_norm=True),
            "qk_norm_flash": dict(attn_qk_norm=True, attn_flash=True), "rotary": dict(rotary_pos_emb=True),
            "alibi": dict(alibi_pos_bias=True), "talking_heads": dict(attn_pre_talking_heads=True),
            "softclamp": dict(attn_softclamp_logits=True), "gate_values": dict(attn_gate_values=True),
            "rel_pos": dict(rel_pos_bias=True), "gqa": dict(attn_kv_heads=2), "mqa": dict(attn_one_kv_head=True),
            "mem_kv": dict(attn_num_mem_kv=2), "residual_attn": dict(residual_attn=True),
            "head_scale": dict(attn_head_scale=True), "post_talking_heads": dict(attn_post_talking_heads=True),
            "sparse_topk": dict(attn_sparse_topk=4), "qk_norm_dim_scale": dict(attn_qk_norm=True,
                                                                             attn_qk_norm_dim_scale=True),
        }
        for name, kw in variants.items():
            yield f"x-transformers/{name}", lambda kw=kw: _xt(kw), (
                _expected(10.0) if "qk_norm" in name and "dim_scale" not in name else default)  # qk_norm_scale
        from benchmarks.xt_sweep import xt_cases

        yield from xt_cases()  # further options, masks, cross-attention, KV cache (each with its own scale)


    try:
        import vit_pytorch  # noqa: F401  (needs torchvision: the timm venv has it)
    except ImportError:
        print("vit-pytorch not importable: skipped")
    else:
        for name in ("vit", "simple_vit", "deepvit", "cait", "cross_vit", "local_vit", "nest", "cvt", "twins_svt",
                     "levit"):
            yield f"vit-pytorch/{name}", lambda name=name: _vit_pytorch(name), default
        from benchmarks.vit_sweep import vit_cases

        yield from vit_cases()  # the further modules, each with the scale its own code applies


def _vit_pytorch(name: str) -> Tuple[nn.Module, tuple, dict]:
    import importlib

    mod = importlib.import_module(f"vit_pytorch.{name}")
    common = dict(image_size=32, num_classes=10)
    torch.manual_seed(0)
    if name in ("vit", "deepvit"):
        model = getattr(mod, "ViT" if name == "vit" else "DeepViT")(patch_size=8, dim=32, depth=2, heads=4, mlp_dim=64,
                                                                   dim_head=8, **common)
    elif name == "simple_vit":
        model = mod.SimpleViT(patch_size=8, dim=32, depth=2, heads=4, mlp_dim=64, dim_head=8, **common)
    elif name == "cait":
        model = mod.CaiT(patch_size=8, dim=32, depth=2, cls_depth=1, heads=4, mlp_dim=64, dim_head=8, **common)
    elif name == "cross_vit":
        model = mod.CrossViT(sm_dim=32, lg_dim=32, sm_patch_size=8, lg_patch_size=16, depth=1, sm_enc_depth=1,
                             lg_enc_depth=1, cross_attn_depth=1, cross_attn_heads=4, cross_attn_dim_head=8, **common)
    elif name == "local_vit":
        model = mod.LocalViT(patch_size=8, dim=32, depth=2, heads=4, mlp_dim=64, dim_head=8, **common)
    elif name == "nest":
        model = mod.NesT(patch_size=4, dim=32, heads=4, num_hierarchies=2, block_repeats=(1, 1), **common)
    elif name == "cvt":
        model = mod.CvT(num_classes=10, s1_emb_dim=16, s2_emb_dim=32, s3_emb_dim=32, s1_heads=1, s2_heads=2,
                        s3_heads=2, s1_depth=1, s2_depth=1, s3_depth=1)
    elif name == "twins_svt":
        model = mod.TwinsSVT(num_classes=10, s1_emb_dim=16, s2_emb_dim=32, s3_emb_dim=32, s4_emb_dim=32,
                             s1_local_patch_size=4, s2_local_patch_size=2, s3_local_patch_size=2, s4_local_patch_size=1,
                             s1_global_k=4, s2_global_k=2, s3_global_k=1, s4_global_k=1)
    else:
        model = mod.LeViT(image_size=64, num_classes=10, stages=2, dim=(32, 64), depth=1, heads=(2, 2),
                          mlp_mult=2, dropout=0.0)
        return model.eval(), (torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1)),), {}
    return model.eval(), (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)),), {}


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(1))


def _xt(kw: Dict[str, Any]) -> Tuple[nn.Module, tuple, dict]:
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    model = TransformerWrapper(num_tokens=VOCAB, max_seq_len=16,
                               attn_layers=Decoder(dim=32, depth=2, heads=4, attn_dim_head=8, **kw))
    return model.eval(), (_ids(),), {}


# -- timm ----------------------------------------------------------------------------------------------
#: real timm models (name, create_model kwargs): small inputs where the model takes ``img_size``
_T: Dict[str, Any] = dict(img_size=64, depth=2, embed_dim=64, num_heads=2)
_TIMM: List[Tuple[str, Dict[str, Any]]] = [
    ("vit_tiny_patch16_224", dict(img_size=64)), ("swin_tiny_patch4_window7_224", {}), ("convit_tiny", dict(img_size=64)),
    ("cait_xxs24_224", dict(img_size=64, depth=4)), ("levit_128s", dict(img_size=64)), ("twins_svt_small", {}),
    ("pvt_v2_b0", {}), ("xcit_nano_12_p16_224", dict(img_size=64)), ("beit_base_patch16_224",
    dict(img_size=64, depth=2)), ("eva02_tiny_patch14_224", dict(img_size=56)), ("nest_tiny", dict(img_size=64)),
    ("gcvit_xxtiny", {}), ("volo_d1_224", dict(img_size=64)), ("mvitv2_tiny", {}), ("coat_tiny", dict(img_size=64)),
    ("crossvit_tiny_240", {}), ("efficientformer_l1", {}), ("tnt_s_patch16_224", dict(img_size=64)),
    # the real-timm sweep: tiny where the constructor allows (_T: a 2-block ViT of width 64, 2 heads)
    ("deit3_small_patch16_224", _T), ("vit_small_patch16_224", dict(_T, qk_norm=True)),
    ("vit_little_patch16_reg4_gap_256", _T), ("vit_tiny_patch16_224", dict(_T, dynamic_img_size=True)),
    ("vit_base_patch16_siglip_224", _T), ("vit_base_patch16_rope_224", _T), ("vit_relpos_small_patch16_224", _T),
    ("vit_srelpos_small_patch16_224", _T), ("vit_small_patch16_dinov3_qkvb", dict(img_size=64, depth=2)),
    ("flexivit_small", _T), ("beitv2_base_patch16_224", _T), ("eva02_small_patch14_224", dict(img_size=56, depth=2)),
    ("aimv2_large_patch14_224", dict(_T, img_size=56)), ("vit_pe_core_tiny_patch16_384", dict(img_size=64, depth=2)),
    ("naflexvit_base_patch16_gap", dict(depth=2, embed_dim=64, num_heads=2)),
    ("swinv2_tiny_window8_256", dict(img_size=64)), ("swinv2_cr_tiny_ns_224", dict(img_size=64)),
    ("maxvit_nano_rw_256", dict(img_size=64)), ("maxvit_rmlp_nano_rw_256", dict(img_size=64)),
    ("maxvit_tiny_tf_224", dict(img_size=64)), ("coatnet_nano_rw_224", dict(img_size=64)),
    ("coatnet_0_224", dict(img_size=64)), ("pit_ti_224", dict(img_size=64)), ("twins_pcpvt_small", dict(img_size=64)),
    ("pvt_v2_b2_li", {}), ("efficientformerv2_s0", dict(img_size=64)), ("fastvit_sa12", {}), ("fastvit_mci0", {}),
    ("hiera_tiny_224", dict(img_size=(64, 64))), ("vitamin_small_224", dict(img_size=64)), ("tiny_vit_5m_224", {}),
    ("davit_tiny", {}), ("mobilevit_xxs", {}), ("mobilevitv2_050", {}), ("edgenext_xx_small", {}), ("halonet26t", {}),
    ("botnet26t_256", dict(img_size=64)), ("lambda_resnet26t", {}), ("shvit_s1", {}), ("nextvit_small", {}),
    ("visformer_tiny", {}), ("swiftformer_xs", {}), ("csatv2", {}),
]


def timm_cases() -> Iterator[Case]:
    import timm

    for name, kw in _TIMM:
        for fused in (True, False):
            def build(name=name, kw=kw, fused=fused):
                torch.manual_seed(0)
                model = timm.create_model(name, pretrained=False, num_classes=10, **kw).eval()
                for m in model.modules():
                    if hasattr(m, "fused_attn"):
                        m.fused_attn = fused
                size = model.default_cfg["input_size"]
                if "img_size" in kw:
                    s = kw["img_size"]
                    size = (3, *s) if isinstance(s, tuple) else (3, s, s)
                x = torch.randn(1, *size, generator=torch.Generator().manual_seed(1))
                return model, (x,), {}
            yield f"timm/{name}/{'fused' if fused else 'eager'}", build, None


# -- running -------------------------------------------------------------------------------------------
def check(name: str, build: Callable[[], Tuple[nn.Module, tuple, dict]], expected: Optional[Callable[[str, int], float]],
          quiet: bool) -> Optional[Dict[str, Any]]:
    try:
        model, args, kwargs = build()
    except Exception as err:  # noqa: BLE001 - a config this library version does not take
        print(f"{name}: skipped (could not build: {type(err).__name__}: {str(err)[:100]})")
        return None
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the model itself fails with this library version
        print(f"{name}: skipped (its own forward raised {type(err).__name__}: {str(err)[:100]})")
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            report = coverage(model, *args, **kwargs)
        except Exception as err:  # noqa: BLE001
            print(f"{name}: FAILED ({type(err).__name__}: {str(err)[:200]})")
            return {"name": name, "sites": 0, "bad": 1, "silent": 1, "problems": ["coverage failed"], "scales": {}}
    warned, summary = _watch_warnings(model, args, kwargs)
    try:
        oracle = values(model, args, kwargs, expected)
    except Exception as err:  # noqa: BLE001 - the value check never hides the rest of the survey
        print(f"{name}: value check failed ({type(err).__name__}: {str(err)[:100]})")
        oracle = {}
    differs = compare(summary, oracle) if summary is not None else {}
    problems, silent, scales = [], 0, {}
    checked = 0
    for row in report.rows:
        issue = []
        if row.captured and row.site in oracle and summary is not None and row.site in summary.sites:
            checked += 1
        if row.captured and getattr(row, "verified", None) is False:
            why = getattr(row, "verification", "")
            issue.append("unverified: keys masked in effect (a -100 mask on a positive bias) counted as valid"
                         if "masked in effect" in why else f"unverified ({why.split(', ')[0]})")
        if row.site in differs:
            issue.append("values: " + "; ".join(differs[row.site][:3]))
        if not row.captured:
            issue.append(("missed" if "reported under" not in row.why else "misnamed")
                         + (f" ({row.why.split(' (')[0]})" if row.why else ""))
        else:
            if row.scale is None:
                issue.append("scale unknown")
            elif expected is not None and row.front_end != "mha":
                d = row.d_k
                want = expected(row.site, d) if d else None
                got = row.scale if not isinstance(row.scale, list) else row.scale[0]
                if want is not None and abs(got - want) > 1e-5 * want:
                    issue.append(f"scale {got:.4g} != {want:.4g}")
            scales[row.site] = row.scale
            missing = [g for g in ("grad_q", "grad_k", "grad_v") if g not in row.grads]
            if missing and report.backward:
                issue.append("no " + "/".join(missing))
        if issue:
            loud = f"'{row.site}'" in warned
            silent += not loud
            problems.append(f"{row.site}: {', '.join(issue)}{'' if loud else ' (silent)'}")
    result = {"name": name, "sites": len(report.rows), "bad": len(problems), "silent": silent, "problems": problems,
              "scales": scales, "captured": sum(r.captured for r in report.rows),
              "front_ends": sorted({r.front_end for r in report.rows if r.front_end}),
              "grads": sorted({g[5:] for r in report.rows for g in r.grads}, key=("logits", "q", "k", "v").index),
              "verified": sum(r.captured and getattr(r, "verified", None) is True for r in report.rows),
              "values_checked": checked}
    status = "ok" if not problems else f"{len(problems)} problem(s), {silent} silent"
    print(f"{name}: {len(report.rows)} sites, {status}")
    if not quiet:
        for p in problems:
            print(f"    {p}")
    return result


def _watch_warnings(model: nn.Module, args: tuple, kwargs: dict) -> Tuple[str, Any]:
    """What ``probe.watch`` itself says on one forward and one backward (its first-forward audit
    warns about every attention it misses or misnames, its check about every record that does
    not match the model, its ledger about every gradient metric the backward did not give), and
    its summary (``rows=None``: exact): a problem a warning names is loud, any other is silent."""
    import probe
    from probe.session.coverage import _backward

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.enable_grad(), probe.watch(model, rows=None) as p:
                out = model(*args, **kwargs)
                _backward(out, model)
            summary = p.summary()
        except Exception as err:  # noqa: BLE001
            return f"watch failed: {type(err).__name__}: {err}", None
    return " ".join(str(w.message) for w in caught if "probe" in str(w.message)), summary


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="hf,thirdparty,more,timm")
    parser.add_argument("--match", default="", help="only cases whose name contains this")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="also print one table row per run")
    parser.add_argument("--json", metavar="PATH", help="also write the results (and library versions) as JSON")
    parser.add_argument("--docs", nargs="+", metavar=("MODELS_MD", "RESULTS_JSON"),
                        help="write the support table of MODELS_MD (docs/models.md) from results JSON files, run nothing")
    args = parser.parse_args(argv)
    if args.docs:
        write_docs(args.docs[0], args.docs[1:])
        return 0
    groups = args.only.split(",")
    sources: List[Tuple[str, Callable[[], Iterator[Case]]]] = [("hf", hf_cases), ("thirdparty", thirdparty_cases),
                                                               ("more", more_cases), ("timm", timm_cases),
                                                               ("hfauto", hfauto_cases)]
    results: Dict[str, List[Dict[str, Any]]] = {}
    for group, cases in sources:
        if group not in groups:
            continue
        try:
            items = list(cases())
        except ImportError as err:
            print(f"{group}: skipped ({err})")
            continue
        for name, build, expected in items:
            if args.match and args.match not in name:
                continue
            r = check(name, build, expected, args.quiet)
            if r is not None:
                results.setdefault(group, []).append(r)
    _hf_parity(results.get("hf", []) + results.get("hfauto", []))
    if "hfauto" in groups:
        hf_auto_report()
    if args.markdown:
        print("\n| model / configuration | sites captured | front end | gradient metrics | problems |")
        print("| --- | --- | --- | --- | --- |")
        for rs in results.values():
            for r in rs:
                problems = "; ".join(p.replace(" (silent)", "") for p in r["problems"]) or "-"
                print(f"| {r['name']} | {r.get('captured', 0)} of {r['sites']} | {', '.join(r.get('front_ends', []))} | "
                      f"{', '.join(r.get('grads', [])) or '-'} | {problems} |")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"versions": versions(), "results": results}, f, indent=1, default=str)
    print("\n| group | runs | runs with a problem | runs silently wrong | sites | sites with a problem | silent |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for group, rs in results.items():
        print(f"| {group} | {len(rs)} | {sum(r['bad'] > 0 for r in rs)} | {sum(r['silent'] > 0 for r in rs)} | "
              f"{sum(r['sites'] for r in rs)} | {sum(r['bad'] for r in rs)} | {sum(r['silent'] for r in rs)} |")
    return 0


def versions() -> Dict[str, str]:
    """The versions of the libraries the survey ran against (those importable here)."""
    import importlib
    import platform

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "timm", "x_transformers", "vit_pytorch", "rotary_embedding_torch", "diffusers",
                 "peft", "esm", "perceiver_pytorch", "flamingo_pytorch", "reformer_pytorch"):
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not installed here
            continue
        version = getattr(mod, "__version__", None)
        if version is None:
            from importlib.metadata import PackageNotFoundError, version as dist_version

            try:
                version = dist_version(name.replace("_", "-"))
            except PackageNotFoundError:
                version = "?"
        out[name] = str(version)
    from benchmarks.survey_libs import DISTRIBUTIONS
    from importlib.metadata import PackageNotFoundError, version as dist_version

    for dist in DISTRIBUTIONS:  # read from the metadata: some import only with stand-ins (survey_libs)
        try:
            out[dist] = dist_version(dist)
        except PackageNotFoundError:
            continue
    return out


_START, _END = "<!-- support table: start -->", "<!-- support table: end -->"
_LIBRARY = {"hf": "Hugging Face transformers", "timm": "timm", "nanogpt": "nanoGPT / minGPT style (written here)",
            "rotary": "rotary-embedding-torch", "x-transformers": "x-transformers", "vit-pytorch": "vit-pytorch",
            "diffusers": "diffusers", "peft": "peft (LoRA, DoRA, IA3; base frozen)", "fair-esm": "fair-esm",
            "perceiver-pytorch": "perceiver-pytorch", "flamingo-pytorch": "flamingo-pytorch",
            "reformer-pytorch": "reformer-pytorch", "libs": "library survey (benchmarks/survey_libs.py)"}


def write_docs(path: str, json_paths: List[str]) -> None:
    """Replace the support table of ``path`` (between its two marker lines) with one row per model
    from the survey's JSON results: variants run, sites captured, front ends, scales, gradient
    metrics, and what is not measured (each with probe's warning)."""
    import json

    runs: Dict[str, Dict[str, Any]] = {}
    used: List[Dict[str, str]] = []
    for jp in json_paths:
        with open(jp) as f:
            data = json.load(f)
        if data["versions"] not in used:
            used.append(data["versions"])
        for rs in data["results"].values():
            for r in rs:
                runs[r["name"]] = r  # a case run under two environments: the later file wins
    models: Dict[str, List[Dict[str, Any]]] = {}
    for name, r in runs.items():
        parts = name.split("/")
        key = "/".join(parts[:2]) if parts[0] in ("hf", "timm", "rotary", "nanogpt", "diffusers", "peft",
                                                  "reformer-pytorch", "libs") else name
        models.setdefault(key, []).append(r)
    lines = [_START, "",
             "| library | model / configuration | variants | sites captured | verified, checked by values | front end | "
             "scale reported | gradient metrics | not measured (each warned) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, rs in models.items():
        group, _, model = key.partition("/")
        variants = ", ".join(r["name"][len(key) + 1:] or "-" for r in rs) if any(
            r["name"] != key for r in rs) else "-"
        captured = ", ".join(f"{r.get('captured', 0)} of {r['sites']}" for r in rs)
        checked = ", ".join(f"{r['verified']}, {r['values_checked']}" if "verified" in r else "(not run)" for r in rs)
        fronts = ", ".join(sorted({f for r in rs for f in r.get("front_ends", [])})) or "-"
        scales = sorted({_fmt(v) for r in rs for v in r.get("scales", {}).values()})
        grads = sorted({g for r in rs for g in r.get("grads", [])}, key=("logits", "q", "k", "v").index)
        problems = sorted({p.split(": ", 1)[1].replace(" (silent)", " (SILENT)") for r in rs for p in r["problems"]})
        lines.append(f"| {_LIBRARY.get(group, group)} | {model or key} | {variants} | {captured} | {checked} | {fronts} | "
                     f"{', '.join(scales) or '-'} | {', '.join(grads) or '-'} | {'; '.join(problems) or '-'} |")
    versions_text = "; ".join(", ".join(f"{k} {v}" for k, v in u.items()) for u in used)
    lines += ["", f"Generated by `benchmarks/coverage_survey.py --docs` from {len(runs)} runs "
              f"({sum(r['sites'] for r in runs.values())} attention sites) with: {versions_text}.", "", _END]
    with open(path) as f:
        text = f.read()
    if _START not in text or _END not in text:
        raise SystemExit(f"{path} has no support table markers ({_START} ... {_END})")
    head, rest = text.split(_START, 1)
    _, tail = rest.split(_END, 1)
    with open(path, "w") as f:
        f.write(head + "\n".join(lines) + tail)
    print(f"wrote {len(models)} rows to {path}")


def _fmt(scale: Any) -> str:
    if scale is None:
        return "unknown"
    if isinstance(scale, list):
        values = sorted({round(float(v), 4) for v in scale})
        return f"{values[0]:.4g}" if len(values) == 1 else f"per head {values[0]:.4g}..{values[-1]:.4g}"
    return f"{float(scale):.4g}"


def _hf_parity(rs: List[Dict[str, Any]]) -> None:
    """Eager and sdpa runs of one Hugging Face model must report the same scale at each site."""
    by = {r["name"]: r for r in rs}
    for name, r in by.items():
        if not name.endswith("/sdpa"):
            continue
        eager = by.get(name[:-5] + "/eager")
        if eager is None:
            continue
        for site, scale in r["scales"].items():
            other = eager["scales"].get(site)
            if isinstance(scale, float) and isinstance(other, float) and abs(scale - other) > 1e-6 * abs(other):
                r["bad"] += 1
                r["silent"] += 1
                r["problems"].append(f"{site}: sdpa scale {scale:.4g} != eager {other:.4g} (silent)")
                print(f"{name}: {site}: sdpa scale {scale:.4g} != eager {other:.4g} (silent)")


if __name__ == "__main__":
    sys.exit(main())
