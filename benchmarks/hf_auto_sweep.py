"""Every Hugging Face architecture nobody here listed by hand, built automatically, for
``coverage_survey`` (group ``hfauto``):

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/coverage_survey.py --only hfauto [--match llama]

Types: transformers' ``MODEL_MAPPING_NAMES`` (the base model of each type) and the decoder-only
types of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that have no base model, less those
``coverage_survey._HF`` lists by hand (same config class). Each is built from
``AutoConfig.for_model(type, **tiny)`` where ``tiny`` sets every common size field the default
config has (width 32, 2 layers, 4 heads of 8, 2 key/value heads where the model groups them, FFN 64,
vocabulary 256, image 32 / patch 8, short audio), sub-configs shrunk alike, random weights, under
``attn_implementation`` ``"eager"`` and, where the class supports it, ``"sdpa"``. Inputs follow the
model's ``main_input_name`` (``input_ids``, ``pixel_values``, ``input_values``, ``input_features``;
``decoder_input_ids`` for encoder-decoders); text models also run with a left- and a right-padded
``attention_mask``. A composite model gets its main input only (its text tower, or its vision tower):
its other towers are surveyed where transformers lists them as types of their own.

A type that cannot be built or run so (its config refuses the tiny sizes, its forward needs
inputs built its own way, it takes longer than ``_BUILD_S`` to build and run once) is skipped and
counted, with its reason, in :func:`report` (printed at the end of the group): never silently.

Expected scale: ``head_dim ** -0.5`` (the ``d_k`` probe reads from q), except where ``_SCALE``
records what the model's own code applies (read in its ``modeling_*.py``).
"""

from __future__ import annotations

import inspect
import signal
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

Case = Tuple[str, Callable[[], Tuple[nn.Module, tuple, dict]], Optional[Callable[[str, int], float]]]
B, L, VOCAB = 2, 8, 256
_BUILD_S = 20  # seconds to build a type and run it once; slower ones are skipped, counted
_FORWARD_S = 3.0  # one no-grad forward slower than this: skipped (the survey runs five per case)

_WIDTH = ("hidden_size", "d_model", "n_embd", "embed_dim", "word_embed_proj_dim", "embedding_size",
          "encoder_hidden_size", "decoder_hidden_size", "output_hidden_size", "projection_dim", "text_embed_dim",
          "vision_embed_dim", "hidden_dim_model")
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
           "num_encoder_layers", "num_decoder_layers", "decoder_num_hidden_layers", "text_layers", "vision_layers",
           "num_single_text_layers")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads",
          "attention_heads", "decoder_num_attention_heads", "num_heads", "num_self_attention_heads",
          "num_cross_attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "encoder_kv_heads")
_HEAD_DIM = ("head_dim", "d_kv", "kv_channels", "attention_head_size", "v_head_dim")
_FFN = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner", "hidden_dim",
        "decoder_intermediate_size", "ffn_hidden_size", "intermediate_dim")
_MOE_FFN = ("moe_intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
            "expert_intermediate_size")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
_FIXED: Dict[str, Any] = dict(
    vocab_size=VOCAB, max_position_embeddings=64, n_positions=64, n_ctx=64, max_source_positions=32,
    max_target_positions=32, num_experts_per_tok=2, moe_topk=2, n_shared_experts=1, n_group=1, topk_group=1,
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, image_size=32, patch_size=8,
    num_mel_bins=16, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, ssm_state_size=8,
    mamba_d_state=8, state_size=8, mamba_num_heads=4, mamba_head_dim=16, mamba_n_heads=4, initializer_range=0.3,
    rotary_dim=4, first_k_dense_replace=1, num_nextn_predict_layers=0, attention_window=4,
    num_latents=8, d_latents=32, num_self_attends_per_block=2,  # Perceiver's latent array
    dropout=0.0, attention_dropout=0.0, hidden_dropout=0.0, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, layerdrop=0.0)


def _text(config: Any, site: str = "") -> Any:
    """The sub-config of the tower that ran ``site``: an encoder-decoder's own, a composite's text."""
    for part in ("encoder", "decoder"):
        if site.startswith(part) and getattr(config, part, None) is not None and \
                hasattr(getattr(config, part), "to_dict"):
            return getattr(config, part)
    return getattr(config, "text_config", None) or config


def _multiplier(config: Any, site: str, d: int) -> float:
    """Granite: ``self.scaling = config.attention_multiplier`` (a speech model's language model)."""
    if "language_model" not in site and getattr(config, "text_config", None) is not None:
        return d ** -0.5
    return float(_text(config).attention_multiplier)


def _mistral4(config: Any, site: str, d: int) -> float:
    from transformers.modeling_rope_utils import yarn_apply_mscale

    return float(yarn_apply_mscale(_text(config).rope_parameters, d ** -0.5))


#: expected scale per type where the model's code applies another than ``head_dim ** -0.5``:
#: a number, or ``rule(config, site, d)`` (``d`` the head dim probe reads from q); each read in
#: the type's ``modeling_*.py``
_SCALE: Dict[str, Any] = {
    # T5's relative attention: ``self.scaling = 1.0`` (the scale folded into the initialisation)
    **{t: 1.0 for t in ("mt5", "umt5", "longt5", "switch_transformers")},
    "gpt_neo": 1.0,  # GPTNeoSelfAttention._attn: ``matmul(query, key.T)``, no scale
    # q and k RMS-normed per head, ``self.scaling = 1.0``
    **{t: 1.0 for t in ("embedding_gemma2_text", "gemma4", "gemma4_text", "gemma4_unified",
                        "gemma4_unified_text")},
    **{t: _multiplier for t in ("granitemoe", "granitemoeshared", "granite_swa", "granitemoe_swa",
                                "granite_docling_text", "granite_speech", "granite_speech_plus")},
    # ``self.scaling = config.query_pre_attn_scalar ** -0.5``
    **{t: (lambda c, site, d: _text(c, site).query_pre_attn_scalar ** -0.5) for t in ("gemma3", "t5gemma",
                                                                                       "vaultgemma")},
    # "q/k are RMS-normalized per head, hence 1/d rather than 1/sqrt(d)"
    **{t: (lambda c, site, d: 1.0 / d) for t in ("inkling_text", "inkling_mm_model")},
    # ``q = qk_norm(q) * qk_scale_factor``, then ``head_dim ** -0.5``: a factor after a norm counts
    **{t: (lambda c, site, d: _text(c).qk_scale_factor * d ** -0.5) for t in ("muse_glimmer", "muse_glimmer_text",
                                                                           "muse_spark_text")},
    "mistral4": _mistral4,  # ``yarn_apply_mscale(rope_parameters, qk_head_dim ** -0.5)``
    # MLA, and ``q_pass * mla_scale_q_lora``, ``q_rot * mla_scale_q_lora`` after q's projection
    "longcat_flash": lambda c, site, d: _mistral4(c, site, d) * (c.hidden_size / c.q_lora_rank) ** 0.5,
    # ``self.scale = embed_dim ** -0.5``: the stage's width, not the head dim
    "cvt": lambda c, site, d: c.embed_dim[int(site.split("stages.")[1].split(".")[0])] ** -0.5,
    # DeBERTa's disentangled attention: ``sqrt(d * (1 + len(pos_att_type)))``
    "sew-d": lambda c, site, d: (d * (1 + len(c.pos_att_type))) ** -0.5,
    "zamba2": lambda c, site, d: (d / 2) ** -0.5,  # ``self.scaling = (self.head_dim / 2) ** -0.5``
}
CONFIGS: Dict[str, Any] = {}
#: inputs a type needs besides its main one
_EXTRA: Dict[str, Dict[str, Any]] = {
    "rwkv": {"use_cache": False},  # its own backward raises with its state cache (updated in place), probe or not
}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _layer_list(values: list) -> list:
    """A per-layer list cut to 2 layers, keeping two distinct kinds where it has them, an attention
    kind first (a hybrid's ``["linear_attention", "moe", "full_attention", ...]``)."""
    kinds = list(dict.fromkeys(values))
    kinds.sort(key=lambda k: not ("att" in k and "linear" not in k))
    return (kinds[:2] if len(kinds) > 1 else values[:1] * 2)


#: Size fields (the groups are disjoint) and the tiny value each takes.
_SIZES = ((_WIDTH, 32), (_LAYERS, 2), (_HEADS, 4), (_HEAD_DIM, 8), (_FFN, 64), (_MOE_FFN, 32), (_EXPERTS, 4))


def tiny(defaults: Dict[str, Any], sub: Dict[str, Any], mrope: bool = False) -> Dict[str, Any]:
    """The keyword arguments that shrink one config: every size field ``defaults`` (its default
    ``to_dict()``) has, set to a tiny value; ``sub`` maps sub-config names to their defaults and
    classes; ``mrope``: the config takes 3-D rotary sections (Qwen2-VL's ``mrope_section``)."""
    out: Dict[str, Any] = {}
    for key, value in defaults.items():
        size = next((n for fields, n in _SIZES if key in fields), None)
        if key in sub:
            out[key] = tiny(sub[key][0], {}, _mrope(sub[key][1]))
        elif size is not None and _int(value):
            out[key] = size
        elif key in _HEADS and isinstance(value, list) and value and all(_int(v) for v in value):
            out[key] = [2] * len(value)
        elif key in _KV_HEADS and _int(value):
            heads = next((defaults[h] for h in _HEADS if _int(defaults.get(h))), None)
            out[key] = 1 if value == 1 else (4 if value == heads else 2)
        elif key in _FIXED and (_int(value) or isinstance(value, float)) and value != 0 or key in _FIXED and \
                key.endswith(("dropout", "_prob")):
            out[key] = _FIXED[key]
        elif key == "depths" and isinstance(value, list):
            out[key] = [1] * len(value)
        elif key in ("hidden_sizes", "embed_dims", "embed_dim") and isinstance(value, list):
            out[key] = [16 * 2 ** i for i in range(len(value))]
        elif key == "conv_dim" and isinstance(value, (list, tuple)):
            out[key] = [32] * len(value)
        elif key in ("layer_types", "layers_block_type", "block_types", "attention_layers") and \
                isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            out[key] = _layer_list(value)
        elif key.endswith(("_token_id", "_token_index")) and _int(value) and value >= VOCAB - 8:
            out[key] = VOCAB - 8 + (hash(key) % 8)
    if "max_position_embeddings" in out and out.get("max_source_positions"):
        out["max_position_embeddings"] = 64
    # fields whose default is None or that follow others (each seen to fail the build otherwise)
    if "head_dim" in defaults and defaults["head_dim"] is None and any(h in out for h in _HEADS):
        out["head_dim"] = 8
    if _int(defaults.get("qk_rope_head_dim")) and "head_dim" in defaults:
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA: the rotary part's dim (DeepSeek-V3's rope)
    for key, value in (("moe_k", 2), ("num_experts_per_token", 2), ("attn_layer_period", 2), ("attn_layer_offset", 1),
                       ("expert_layer_period", 2), ("expert_layer_offset", 1)):
        if _int(defaults.get(key)):
            out[key] = value
    if "num_experts_per_tok" in defaults and defaults["num_experts_per_tok"] is None and \
            any(_int(defaults.get(e)) for e in _EXPERTS):
        out["num_experts_per_tok"] = 2  # DeepSeek-V2's default None
    if "attn_layer_indices" in defaults:
        out["attn_layer_indices"] = [1]
    if isinstance(defaults.get("mlp_layer_types"), list):
        out["mlp_layer_types"] = _layer_list(defaults["mlp_layer_types"])
    rope = defaults.get("rope_parameters")
    if isinstance(rope, dict) and (isinstance(rope.get("mrope_section"), list) or mrope):
        out["rope_parameters"] = dict(rope, mrope_section=[2, 1, 1])  # 3-D rotary sections: sum head_dim / 2
    return out


def _mrope(cls: Any) -> bool:
    return "mrope_section" in (getattr(cls, "ignore_keys_at_rope_validation", None) or ())


def _config(model_type: str, impl: str) -> Any:
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    subs = {name: (getattr(base, name).to_dict() if getattr(base, name, None) is not None else cls().to_dict(), cls)
            for name, cls in (getattr(base, "sub_configs", None) or {}).items()}
    kwargs = tiny(base.to_dict(), subs, _mrope(type(base)))
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = impl
    for name in subs:
        sc = getattr(config, name, None)
        if sc is not None and hasattr(sc, "_attn_implementation"):
            sc._attn_implementation = impl
    return config


def _inputs(model: nn.Module, config: Any, padding: Optional[str]) -> List[Dict[str, Any]]:
    """Candidate inputs, the first the model runs with is used."""
    g = torch.Generator().manual_seed(1)
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    vision = getattr(config, "vision_config", None) or config
    audio = getattr(config, "audio_config", None) or getattr(config, "encoder_config", None) or config
    size = getattr(vision, "image_size", 32)
    size = size if _int(size) else 32
    channels = getattr(vision, "num_channels", 3) if _int(getattr(vision, "num_channels", 3)) else 3
    mels = getattr(audio, "num_mel_bins", None) or getattr(audio, "input_feat_per_channel", None) or 16
    from benchmarks.coverage_survey import padding_mask  # (it imports this module)

    ids = torch.randint(4, VOCAB - 64, (B, L), generator=g)
    cands: List[Dict[str, Any]] = []
    if main == "input_ids":
        base = {"input_ids": ids}
        if padding is not None:
            base["attention_mask"] = padding_mask(L, padding)
        cands.append(base)
    elif main == "pixel_values":
        cands += [{"pixel_values": torch.randn(B, channels, size, size, generator=g)},
                  {"pixel_values": torch.randn(B, 4, channels, size, size, generator=g)}]
    elif main == "input_values":
        cands += [{"input_values": torch.randn(B, 1600, generator=g)},
                  {"input_values": torch.randn(B, 1, 1600, generator=g)},
                  {"input_values": torch.randn(B, 32, channels, generator=g)}]
    elif main == "input_features":
        frames = 2 * (getattr(audio, "max_source_positions", 16) or 16)
        cands += [{"input_features": torch.randn(B, mels, frames, generator=g)},
                  {"input_features": torch.randn(B, frames, mels, generator=g)},
                  {"input_features": torch.randn(B, 64, mels, generator=g)}]
    elif main in params:
        cands.append({main: torch.randn(B, L, 32, generator=g)})
    if "grid_thw" in params and "hidden_states" in params:  # Qwen2-VL's vision tower: flattened patches
        t = getattr(config, "temporal_patch_size", 1) or 1
        p = getattr(config, "patch_size", 8)
        c = getattr(config, "in_channels", None) or getattr(config, "num_channels", 3)
        cands = [{"hidden_states": torch.randn(16 * B, c * t * p * p, generator=g),
                  "grid_thw": torch.tensor([[1, 4, 4]] * B)}]
    if "noise" in params and main == "pixel_values":  # ViT-MAE's random masking, fixed for every forward
        patches = (size // getattr(vision, "patch_size", 8)) ** 2
        cands = [dict(c, noise=torch.rand(B, patches, generator=g)) for c in cands]
    cands = [dict(c, **_EXTRA.get(config.model_type, {})) for c in cands]
    out = []
    for c in cands:
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            c = dict(c, decoder_input_ids=torch.randint(4, VOCAB - 64, (B, L), generator=g))
        out.append(c)
        if "pixel_values" in params and "pixel_values" not in c and main == "input_ids":
            out.append(dict(c, pixel_values=torch.randn(B, channels, size, size, generator=g)))
    return out


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout()


#: type -> why it was skipped; type -> the inputs it ran with; run -> why that one run was skipped
SKIPPED: Dict[str, str] = {}
BUILT: Dict[str, str] = {}
RUN_SKIPPED: Dict[str, str] = {}


def _build(model_type: str, cls_name: str, impl: str, padding: Optional[str]) -> Tuple[nn.Module, tuple, dict]:
    import transformers as tr

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(_BUILD_S)
    stage = "config"
    try:
        config = _config(model_type, impl)
        stage = "build"
        torch.manual_seed(0)
        model = getattr(tr, cls_name)(config).eval()
        CONFIGS[model_type] = config
        stage = "forward"
        err: Optional[BaseException] = None
        for inputs in _inputs(model, config, padding):
            try:
                start = time.perf_counter()
                with torch.no_grad():
                    model(**inputs)
                if time.perf_counter() - start > _FORWARD_S:
                    raise RuntimeError(f"one forward took {time.perf_counter() - start:.1f} s")
                BUILT.setdefault(model_type, "+".join(inputs))
                return model, (), inputs
            except _Timeout:
                raise
            except Exception as e:  # noqa: BLE001 - the next candidate
                err = e
        raise err if err is not None else RuntimeError(f"no input for main_input_name {model.main_input_name!r}")
    except Exception as e:
        why = (f"timeout: over {_BUILD_S} s to build and run once" if isinstance(e, _Timeout) else
               f"{stage}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        if model_type in BUILT:
            RUN_SKIPPED[f"{model_type}/{impl}/{padding}"] = why
        else:
            SKIPPED.setdefault(model_type, why)
        raise
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _types() -> List[Tuple[str, str]]:
    """(model type, model class name) of every type to survey, less those ``_HF`` lists."""
    from transformers.models.auto import modeling_auto as ma
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from benchmarks.coverage_survey import _HF

    listed = {cfg for _, _, cfg, _, _, _ in _HF}
    out = []
    names = dict(ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    names.update(ma.MODEL_MAPPING_NAMES)
    for t, cls in sorted(names.items()):
        if isinstance(cls, (tuple, list)):
            cls = cls[0]
        if CONFIG_MAPPING_NAMES.get(t) in listed:
            continue
        out.append((t, cls))
    return out


def _expected(model_type: str) -> Callable[[str, int], float]:
    rule = _SCALE.get(model_type)

    def scale(site: str, d: int) -> float:
        if rule is None:
            return d ** -0.5
        if not callable(rule):
            return float(rule)
        try:
            return float(rule(CONFIGS[model_type], site, d))
        except Exception as err:  # noqa: BLE001 - a rule that does not fit this config: said, never passed
            print(f"hfauto/{model_type}: its expected-scale rule failed at {site} ({type(err).__name__}: {err})")
            return -1.0
    return scale


def hfauto_cases() -> Iterator[Case]:
    import transformers as tr

    for model_type, cls_name in _types():
        try:
            cls = getattr(tr, cls_name)
            impls = ("eager", "sdpa") if getattr(cls, "_supports_sdpa", False) else ("eager",)
            main = getattr(cls, "main_input_name", "input_ids")
            paddings = (None, "left", "right") if main == "input_ids" and \
                "attention_mask" in inspect.signature(cls.forward).parameters else (None,)
        except Exception as e:  # noqa: BLE001 - a missing optional dependency
            SKIPPED[model_type] = f"import: {type(e).__name__}: {' '.join(str(e).split())[:120]}"
            continue
        for impl in impls:
            for padding in paddings:
                suffix = "" if padding is None else f"/{padding}-padded"

                def build(t=model_type, c=cls_name, impl=impl, padding=padding):
                    if t in SKIPPED:
                        raise RuntimeError(f"skipped: {SKIPPED[t]}")
                    return _build(t, c, impl, padding)
                yield f"hfauto/{model_type}/{impl}{suffix}", build, _expected(model_type)


def report() -> None:
    """How many types were tried, built and skipped, and why (grouped)."""
    tried = len(_types())
    print(f"\nhfauto: {tried} types tried, {len(BUILT)} built and run, {len(SKIPPED)} skipped")
    by: Dict[str, List[str]] = {}
    for t, why in sorted(SKIPPED.items()):
        by.setdefault(why.split(":")[0], []).append(t)
    for stage, ts in sorted(by.items(), key=lambda kv: -len(kv[1])):
        print(f"  {stage} ({len(ts)}): {', '.join(ts)}")
    for t, why in sorted(SKIPPED.items()):
        print(f"    {t}: {why}")
    if RUN_SKIPPED:
        print(f"  runs skipped of types that built ({len(RUN_SKIPPED)}):")
        for run, why in sorted(RUN_SKIPPED.items()):
            print(f"    {run}: {why}")
