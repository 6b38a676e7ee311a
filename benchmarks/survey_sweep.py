"""More survey cases (the sweep after issue 25): diffusers' SD3, Flux, AutoencoderKL, PixArt,
CogVideoX and UNet variants, torchtune's Llama 3 / Qwen 2 builders, open_clip towers and
x-transformers encoders / cross-attention. Tiny configs from constructors, random weights, no hub
downloads; each library skipped when not installed. :func:`sweep_cases` is yielded by
``survey_more.more_cases`` (``coverage_survey.py --only more``)."""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

Case = Tuple[str, Callable[[], Tuple[nn.Module, tuple, dict]], Optional[Callable[[str, int], float]]]
B, L, VOCAB = 2, 8, 64


def _default(site: str, d: int) -> float:
    return d ** -0.5


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


# -- diffusers -------------------------------------------------------------------------------------
def _sd3(qk_norm: Optional[str], dual: tuple = ()) -> Tuple[nn.Module, tuple, dict]:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                  num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8,
                                  dual_attention_layers=dual, qk_norm=qk_norm).eval()
    g = _gen()
    return model, (), {"hidden_states": torch.randn(1, 4, 8, 8, generator=g),
                       "encoder_hidden_states": torch.randn(1, 5, 32, generator=g),
                       "pooled_projections": torch.randn(1, 16, generator=g), "timestep": torch.tensor([3])}


def _flux() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=16, axes_dims_rope=(4, 4, 8)).eval()
    g = _gen()
    n, t = 16, 5
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"),
                          -1).reshape(-1, 3)
    return model, (), {"hidden_states": torch.randn(1, n, 8, generator=g),
                       "encoder_hidden_states": torch.randn(1, t, 32, generator=g),
                       "pooled_projections": torch.randn(1, 16, generator=g), "timestep": torch.tensor([0.5]),
                       "img_ids": img_ids, "txt_ids": torch.zeros(t, 3)}


def _vae() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    model = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4,
                          norm_num_groups=8, layers_per_block=1).eval()
    return model, (torch.randn(1, 3, 16, 16, generator=_gen()),), {"sample_posterior": False}


def _pixart() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    model = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                     num_layers=2, cross_attention_dim=32, sample_size=8, patch_size=2,
                                     caption_channels=32, norm_num_groups=8).eval()
    g = _gen()
    mask = torch.ones(1, 5)
    mask[:, -2:] = 0  # padded caption tokens
    return model, (), {"hidden_states": torch.randn(1, 4, 8, 8, generator=g),
                       "encoder_hidden_states": torch.randn(1, 5, 32, generator=g), "timestep": torch.tensor([3]),
                       "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
                       "encoder_attention_mask": mask}


def _cogvideox(rotary: bool) -> Tuple[nn.Module, tuple, dict]:
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                        time_embed_dim=8, text_embed_dim=32, num_layers=1, sample_width=8,
                                        sample_height=8, sample_frames=9, patch_size=2, max_text_seq_length=4,
                                        use_rotary_positional_embeddings=rotary).eval()
    g = _gen()
    kwargs: Dict[str, Any] = {"hidden_states": torch.randn(1, 3, 4, 8, 8, generator=g),
                              "encoder_hidden_states": torch.randn(1, 4, 32, generator=g), "timestep": torch.tensor([3])}
    if rotary:
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        kwargs["image_rotary_emb"] = get_3d_rotary_pos_embed(16, ((0, 0), (4, 4)), (4, 4), 3)
    return model, (), kwargs


def _unet_heads(head_dim: Any, eager: bool) -> Tuple[nn.Module, tuple, dict]:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                 block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                 attention_head_dim=head_dim, norm_num_groups=8, upcast_attention=eager).eval()
    if eager:
        from diffusers.models.attention_processor import AttnProcessor

        model.set_attn_processor(AttnProcessor())
    g = _gen()
    return model, (torch.randn(1, 4, 8, 8, generator=g), 3), {"encoder_hidden_states": torch.randn(1, 5, 32, generator=g)}


def _unet_proc(kind: str) -> Tuple[nn.Module, tuple, dict]:
    """UNet2DConditionModel with other processors: sliced eager attention, fused qkv, a padded
    caption (``encoder_attention_mask``), added-KV attention (``SimpleCrossAttn`` blocks)."""
    from diffusers import UNet2DConditionModel
    from diffusers.models import attention_processor as ap

    torch.manual_seed(0)
    simple = kind == "added_kv"
    down = ("SimpleCrossAttnDownBlock2D" if simple else "CrossAttnDownBlock2D", "DownBlock2D")
    up = ("UpBlock2D", "SimpleCrossAttnUpBlock2D" if simple else "CrossAttnUpBlock2D")
    model = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                 block_out_channels=(32, 64), down_block_types=down, up_block_types=up,
                                 mid_block_type="UNetMidBlock2DSimpleCrossAttn" if simple else "UNetMidBlock2DCrossAttn",
                                 cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8).eval()
    if kind == "sliced":
        model.set_attn_processor(ap.SlicedAttnProcessor(slice_size=3))
    elif kind == "fused":
        model.fuse_qkv_projections()
    elif kind == "added_kv_eager":
        model.set_attn_processor(ap.AttnAddedKVProcessor())
    g = _gen()
    kwargs: Dict[str, Any] = {"encoder_hidden_states": torch.randn(2, 5, 32, generator=g)}
    if kind in ("mask", "mask_eager"):
        mask = torch.ones(2, 5)
        mask[1, -2:] = 0
        kwargs["encoder_attention_mask"] = mask
        if kind == "mask_eager":
            model.set_attn_processor(ap.AttnProcessor())
    return model, (torch.randn(2, 4, 8, 8, generator=g), 3), kwargs


# -- torchtune -------------------------------------------------------------------------------------
def _torchtune(arch: str, mask: bool = False) -> Tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    if arch in ("lora_llama3", "dora_llama3"):  # torchtune's own adapters: out + lora_b(lora_a(x)) * (alpha / r)
        from torchtune.models.llama3 import lora_llama3

        model = lora_llama3(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], vocab_size=VOCAB,
                            num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=32,
                            lora_rank=4, lora_alpha=8.0, use_dora=arch == "dora_llama3")
        with torch.no_grad():  # trained adapters: lora_b (zero at init) moved off it
            for name, p in model.named_parameters():
                if "lora_b" in name:
                    p.add_(torch.randn(p.shape, generator=_gen()) * 0.2)
        for module in model.modules():  # DoRA's magnitude is torch.empty until this (torchtune's recipes call it
            if hasattr(module, "initialize_dora_magnitude"):  # after loading weights): garbage, up to 1e27, otherwise
                module.initialize_dora_magnitude()
    elif arch == "llama3":
        from torchtune.models.llama3 import llama3

        model = llama3(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=32)
    else:
        from torchtune.models.qwen2 import qwen2

        model = qwen2(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                      intermediate_dim=64, max_seq_len=32)
    kwargs: Dict[str, Any] = {}
    if mask:  # two documents packed in entry 0 (a block-causal boolean mask), positions restarting
        keep = torch.ones(L, L, dtype=torch.bool).tril().expand(B, L, L).clone()
        keep[0, 5:, :5] = False
        kwargs = {"mask": keep, "input_pos": torch.cat([torch.arange(5), torch.arange(3)]).expand(B, L)}
    return model.eval(), (torch.randint(0, VOCAB, (B, L), generator=_gen()),), kwargs


# -- open_clip -------------------------------------------------------------------------------------
def _open_clip_model() -> types.ModuleType:
    """``open_clip.model`` without the package's ``__init__`` (which needs torchvision's C ops;
    only ``FrozenBatchNorm2d``'s name is imported by the modules used here, stubbed if absent)."""
    if importlib.util.find_spec("transformers") is not None:
        import transformers  # noqa: F401  (imported by open_clip; it looks for torchvision itself, unstubbed)
    stub = "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None
    if stub:  # only while open_clip is imported: other libraries probe for torchvision
        tv = types.ModuleType("torchvision")
        ops, misc = types.ModuleType("torchvision.ops"), types.ModuleType("torchvision.ops.misc")
        misc.FrozenBatchNorm2d = nn.BatchNorm2d  # type: ignore[attr-defined]
        tv.ops, ops.misc = ops, misc  # type: ignore[attr-defined]
        sys.modules.update({"torchvision": tv, "torchvision.ops": ops, "torchvision.ops.misc": misc})
    if "open_clip" not in sys.modules:
        spec = importlib.util.find_spec("open_clip")
        package = types.ModuleType("open_clip")
        package.__path__ = list(spec.submodule_search_locations)  # type: ignore[union-attr]
        sys.modules["open_clip"] = package
    try:
        import open_clip.model as oc_model  # noqa: WPS433
    finally:
        if stub:
            for name in ("torchvision", "torchvision.ops", "torchvision.ops.misc"):
                sys.modules.pop(name, None)
    return oc_model


class _Clip(nn.Module):
    def __init__(self, clip: nn.Module) -> None:
        super().__init__()
        self.clip = clip

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        out = self.clip(image, text)
        return out["image_features"] @ out["text_features"].T if isinstance(out, dict) else out[0] @ out[1].T


def _open_clip(variant: str) -> Tuple[nn.Module, tuple, dict]:
    oc = _open_clip_model()
    torch.manual_seed(0)
    extra: Dict[str, Any] = {"custom": dict(block_type="custom"), "qk_norm": dict(qk_norm=True),
                             "scale_heads": dict(scale_heads=True), "attn_pool": dict(attentional_pool=True,
                                                                                      attn_pooler_queries=4,
                                                                                      attn_pooler_heads=2),
                             "default": {}}[variant]
    vision = dict(layers=2, width=32, head_width=8, patch_size=8, image_size=16, **extra)
    text_extra = {k: v for k, v in extra.items() if k not in ("attentional_pool", "attn_pooler_queries",
                                                              "attn_pooler_heads")}
    text = dict(context_length=L, vocab_size=VOCAB, width=32, heads=4, layers=2, **text_extra)
    clip = oc.CLIP(embed_dim=16, vision_cfg=vision, text_cfg=text)
    g = _gen()
    return _Clip(clip).eval(), (torch.randn(B, 3, 16, 16, generator=g),
                                torch.randint(1, VOCAB, (B, L), generator=g)), {}


# -- x-transformers --------------------------------------------------------------------------------
class _XtCross(nn.Module):
    """An x-transformers decoder attending to an encoder (cross-attention with a context mask)."""

    def __init__(self, kw: Dict[str, Any]) -> None:
        super().__init__()
        from x_transformers import Decoder, Encoder, TransformerWrapper

        self.enc = TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, return_only_embed=True,
                                      attn_layers=Encoder(dim=32, depth=1, heads=4, attn_dim_head=8, **kw))
        self.dec = TransformerWrapper(num_tokens=VOCAB, max_seq_len=16,
                                      attn_layers=Decoder(dim=32, depth=1, heads=4, attn_dim_head=8,
                                                          cross_attend=True, **kw))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(src, dtype=torch.bool)
        mask[0, -3:] = False
        ctx = self.enc(src, mask=mask)
        return self.dec(tgt, context=ctx, context_mask=mask)


def _xt(kind: str, kw: Dict[str, Any]) -> Tuple[nn.Module, tuple, dict]:
    from x_transformers import Encoder, TransformerWrapper

    torch.manual_seed(0)
    g = _gen()
    ids = torch.randint(0, VOCAB, (B, L), generator=g)
    if kind == "cross":
        return _XtCross(kw).eval(), (ids, torch.randint(0, VOCAB, (B, 6), generator=g)), {}
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, -2:] = False
    model = TransformerWrapper(num_tokens=VOCAB, max_seq_len=16,
                               attn_layers=Encoder(dim=32, depth=2, heads=4, attn_dim_head=8, **kw))
    return model.eval(), (ids,), {"mask": mask}


_XT = {"encoder": {}, "encoder_flash": dict(attn_flash=True), "encoder_alibi": dict(alibi_pos_bias=True),
       "encoder_alibi_flash": dict(alibi_pos_bias=True, attn_flash=True),
       "encoder_rotary_flash": dict(rotary_pos_emb=True, attn_flash=True),
       "encoder_qk_norm": dict(attn_qk_norm=True), "encoder_talking_heads": dict(attn_pre_talking_heads=True),
       "cross": {}, "cross_flash": dict(attn_flash=True), "cross_rotary": dict(rotary_pos_emb=True),
       "cross_inverted": dict(cross_attn_inverted_attention=True)}


#: Decoder options the survey's x-transformers set (coverage_survey.py) does not try
_XT_DEC = {"add_zero_kv": dict(attn_add_zero_kv=True), "head_learned_sink": dict(attn_head_learned_sink=True),
           "cope": dict(attn_use_cope=True), "selective": dict(attn_selective=True),
           "cog_signed": dict(attn_cog_signed=True), "laser": dict(attn_laser=True),
           "data_dependent_alibi": dict(attn_data_dependent_alibi=True),
           "rel_proj_pos_bias": dict(attn_use_rel_proj_pos_bias=True), "dynamic_pos_bias": dict(dynamic_pos_bias=True),
           "rotary_xpos": dict(rotary_xpos=True), "polar_pos_emb": dict(polar_pos_emb=True),
           "qk_norm_groups": dict(attn_qk_norm=True, attn_qk_norm_groups=2), "qk_rmsnorm": dict(attn_qk_rmsnorm=True),
           "value_rmsnorm": dict(attn_value_rmsnorm=True), "max_attend_past": dict(attn_max_attend_past=3),
           "latent_q_kv": dict(attn_use_latent_q=True, attn_dim_latent_q=16, attn_use_latent_kv=True,
                               attn_dim_latent_kv=16),
           "pre_scale_post_talking_heads": dict(attn_pre_scale_post_talking_heads=True),
           "onnxable": dict(attn_onnxable=True), "inverted": dict(attn_inverted_attention=True),
           "mqa_flash": dict(attn_one_kv_head=True, attn_flash=True), "gqa_flash": dict(attn_kv_heads=2, attn_flash=True),
           "alibi_flash": dict(alibi_pos_bias=True, attn_flash=True), "macaron": dict(macaron=True),
           "hyper_connections": dict(num_residual_streams=2), "value_residual": dict(add_value_residual=True),
           "softclamp_flash": dict(attn_softclamp_logits=True, attn_flash=True)}


#: the scales these options use: qk_norm's qk_norm_scale (10); polar's features are twice the head
#: dim (cos and sin halves) at the head dim's scale; qk_rmsnorm's ``F.normalize(x) * sqrt(d) * g``
#: on q and k (a norm starts new features, the constant after it counts: sqrt(8)² · 8^-0.5)
_XT_SCALE: Dict[str, Callable[[str, int], float]] = {"qk_norm_groups": lambda s, d: 10.0,
                                                     "polar_pos_emb": lambda s, d: 8 ** -0.5,
                                                     "qk_rmsnorm": lambda s, d: 8 * 8 ** -0.5}


def _xt_dec(kw: Dict[str, Any]) -> Tuple[nn.Module, tuple, dict]:
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    model = TransformerWrapper(num_tokens=VOCAB, max_seq_len=16,
                               attn_layers=Decoder(dim=32, depth=2, heads=4, attn_dim_head=8, **kw))
    return model.eval(), (torch.randint(0, VOCAB, (B, L), generator=_gen()),), {}


def sweep_cases(have: Callable[[str], bool]) -> Iterator[Case]:
    if have("diffusers"):
        for name, qk in (("sd3", None), ("sd3_qk_norm", "rms_norm")):
            yield f"diffusers/{name}", lambda qk=qk: _sd3(qk), _default
        yield "diffusers/sd3_dual", lambda: _sd3("rms_norm", (0,)), _default
        yield "diffusers/flux", _flux, _default
        yield "diffusers/vae", _vae, _default
        yield "diffusers/pixart", _pixart, _default
        yield "diffusers/cogvideox", lambda: _cogvideox(False), _default
        yield "diffusers/cogvideox_rotary", lambda: _cogvideox(True), _default
        yield "diffusers/unet_heads/sdpa", lambda: _unet_heads((2, 4), False), _default
        yield "diffusers/unet_heads/eager_upcast", lambda: _unet_heads((2, 4), True), _default
        for kind in ("sliced", "fused", "mask", "mask_eager", "added_kv", "added_kv_eager"):
            yield f"diffusers/unet_{kind}", lambda k=kind: _unet_proc(k), _default
    if have("torchtune"):
        for arch in ("llama3", "qwen2"):
            yield f"torchtune/{arch}", lambda a=arch: _torchtune(a), _default
        yield "torchtune/llama3_packed_mask", lambda: _torchtune("llama3", True), _default
        for arch in ("lora_llama3", "dora_llama3"):
            yield f"torchtune/{arch}", lambda a=arch: _torchtune(a), _default
    if have("open_clip"):
        for v in ("default", "custom", "qk_norm", "scale_heads", "attn_pool"):
            yield f"open_clip/{v}", lambda v=v: _open_clip(v), _default
    if have("x_transformers"):
        for name, kw in _XT.items():
            scale = (lambda s, d: 10.0) if "qk_norm" in name else _default
            yield f"x-transformers/{name}", lambda n=name, kw=kw: _xt("cross" if n.startswith("cross") else "enc", kw), scale
        for name, kw in _XT_DEC.items():
            yield f"x-transformers/dec_{name}", lambda kw=kw: _xt_dec(kw), _XT_SCALE.get(name, _default)
