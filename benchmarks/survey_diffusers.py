"""diffusers' transformer and attention models the survey had not covered, at tiny random configs
(no downloads, no hub). :func:`diffusers_cases` is meant to be yielded by
``survey_more.more_cases`` (``coverage_survey.py --only more --match diffusers2/``); each case is
``(name, builder -> (model, args, kwargs), expected_scale(site, head_dim))`` as in the other
survey modules.

Covered (diffusers 0.42):

- Sana (``SanaTransformer2DModel``): ReLU linear self-attention (``SanaLinearAttnProcessor2_0``:
  ``(pad(v) @ relu(k)ᵀ) @ relu(q)``, no softmax, no q·kᵀ) and SDPA cross-attention; with a padded
  caption and with ``qk_norm``;
- AuraFlow (joint MMDiT and single DiT blocks, SDPA);
- HunyuanDiT (layer-norm q/k, 2D RoPE on self-attention, cross-attention to CLIP+T5 text);
- Lumina-Next (``LuminaNextDiT2DModel``: GQA, q/k norm, RoPE; cross-attention to a masked caption
  with ``scale=None``; self-attention with ``attn.scale``; also with ``base_sequence_length``:
  proportional attention, the scale times ``sqrt(log(n, base))``) and Lumina 2 (refiners, joint
  stream, GQA, a padded caption);
- Wan 2.1 (self- and cross-attention, RoPE, ``rms_norm_across_heads``; an image-conditioned
  variant with added k/v: two SDPA calls in one processor) and SkyReels-V2 (its fork); Wan and
  Qwen-Image also on diffusers' ``flex`` attention backend (forward only on CPU: FlexAttention
  has no CPU backward);
- Sana-Video (the same linear attention, RoPE on relu(q) and relu(k)); Helios (Wan-style with
  history latents; also ``is_amplify_history``: the history tokens' keys times a learned per-head
  factor before SDPA, which is not the attention's scale);
- LTX-Video, Mochi (asymmetric joint attention, per-sample masked text), Allegro, CogView3-Plus,
  CogView4, HunyuanVideo (token refiner with masked self-attention, dual and single stream),
  EasyAnimate, ConsisID (its face extractor: ``(q·d**-0.25) @ (k·d**-0.25)ᵀ`` Perceiver
  attention), HiDream-I1 (MoE FFN: a gate softmax over experts that is not attention), OmniGen
  (Phi-3 style with a 3D mask), Qwen-Image, Chroma, Stable Audio DiT (GQA, partial RoPE),
  Latte; and Kandinsky 3's UNet (its attention pooling too), aMUSEd's UVit2DModel and the
  Kandinsky/unCLIP ``PriorTransformer`` (causal mask plus a padded caption), each with its
  default SDPA processor and with the eager ``AttnProcessor`` (``baddbmm`` with the scale).

Every model of the list asked for builds here; none is skipped.

Not in the survey's own verdict: a missed attention that the audit does not see either has no
row, so ``coverage_survey.check`` cannot count it. Sana's and Sana-Video's linear attention is
named NOT measured in the first block only (2026-12: later blocks have no row and no warning);
compare each run's rows with the model's ``attn1`` modules.

Scales: ``head_dim ** -0.5`` throughout, but for proportional attention (Lumina; the factor from
the sequence length and the base passed in) and ConsisID's face extractor (``d**-0.25`` on each
side: ``d**-0.5`` in all).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

Case = Tuple[str, Callable[[], Tuple[nn.Module, tuple, dict]], Optional[Callable[[str, int], float]]]


def _default(site: str, d: int) -> float:
    return d ** -0.5


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen())


class _NoGrad(nn.Module):
    """The model's forward under ``torch.no_grad``: FlexAttention has no CPU backward (torch 2.13),
    so the flex backend's cases are measured forward only."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.model(*args, **kwargs)


def _flex(build: Callable[[], Tuple[nn.Module, tuple, dict]]) -> Tuple[nn.Module, tuple, dict]:
    """``build`` sets the model's processors to the flex backend; ``set_attention_backend`` also
    sets diffusers' process-wide active backend, which later models' processors (backend None)
    would then use: put back here, the model keeps flex through its own processors."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    try:
        model, args, kwargs = build()
    finally:
        _AttentionBackendRegistry.set_active_backend(active)
    return (_NoGrad(model) if not torch.cuda.is_available() else model), args, kwargs


# -- image transformers ----------------------------------------------------------------------------
def _sana(variant: str) -> Tuple[nn.Module, tuple, dict]:
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(0)
    model = SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                   num_layers=3, num_cross_attention_heads=2, cross_attention_head_dim=8,
                                   cross_attention_dim=16, caption_channels=16, sample_size=8, patch_size=1,
                                   qk_norm="rms_norm_across_heads" if variant == "qk_norm" else None).eval()
    g = _gen()
    kwargs: Dict[str, Any] = {"hidden_states": torch.randn(1, 4, 8, 8, generator=g),
                              "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
                              "timestep": torch.tensor([3])}
    if variant == "mask":
        mask = torch.ones(1, 5)
        mask[:, -2:] = 0
        kwargs["encoder_attention_mask"] = mask
    return model, (), kwargs


def _auraflow() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import AuraFlowTransformer2DModel

    torch.manual_seed(0)
    model = AuraFlowTransformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1,
                                       num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=2,
                                       joint_attention_dim=32, caption_projection_dim=16, out_channels=4,
                                       pos_embed_max_size=64).eval()
    g = _gen()
    return model, (), {"hidden_states": torch.randn(1, 4, 8, 8, generator=g),
                       "encoder_hidden_states": torch.randn(1, 5, 32, generator=g), "timestep": torch.tensor([3])}


def _hunyuan_dit() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import HunyuanDiT2DModel
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    torch.manual_seed(0)
    model = HunyuanDiT2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                              num_attention_heads=2, cross_attention_dim=8, cross_attention_dim_t5=8,
                              pooled_projection_dim=4, hidden_size=16, text_len=4, text_len_t5=4).eval()
    g = _gen()
    mask = torch.ones(1, 4)
    mask[:, -1] = 0
    return model, (), {"hidden_states": torch.randn(1, 4, 8, 8, generator=g), "timestep": torch.tensor([3.0]),
                       "encoder_hidden_states": torch.randn(1, 4, 8, generator=g), "text_embedding_mask": mask,
                       "encoder_hidden_states_t5": torch.randn(1, 4, 8, generator=g),
                       "text_embedding_mask_t5": torch.ones(1, 4),
                       "image_meta_size": torch.tensor([[1024.0, 1024, 16, 16, 0, 0]]),
                       "style": torch.zeros(1, dtype=torch.long),
                       "image_rotary_emb": get_2d_rotary_pos_embed(8, ((0, 0), (4, 4)), (4, 4))}


def _proportional(n: int, base: int) -> Callable[[str, int], float]:
    def scale(site: str, d: int) -> float:
        return math.sqrt(math.log(n, base)) * d ** -0.5
    return scale


def _lumina_next(base: Optional[int]) -> Tuple[nn.Module, tuple, dict]:
    from diffusers import LuminaNextDiT2DModel
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    torch.manual_seed(0)
    model = LuminaNextDiT2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
                                 num_attention_heads=3, num_kv_heads=1, multiple_of=16, learn_sigma=False,
                                 qk_norm=True, cross_attention_dim=32).eval()
    g = _gen()
    mask = torch.ones(1, 6)
    mask[:, -2:] = 0
    kwargs: Dict[str, Any] = {"hidden_states": torch.randn(1, 4, 8, 8, generator=g), "timestep": torch.tensor([0.5]),
                              "encoder_hidden_states": torch.randn(1, 6, 32, generator=g), "encoder_mask": mask,
                              "image_rotary_emb": get_2d_rotary_pos_embed_lumina(8, 16, 16),
                              "cross_attention_kwargs": {}}
    if base is not None:
        kwargs["cross_attention_kwargs"] = {"base_sequence_length": base}
    return model, (), kwargs


def _lumina_next_scale(base: Optional[int]) -> Callable[[str, int], float]:
    """The cross-attention (``attn2``, no key RoPE) passes ``scale=None``: ``d**-0.5``; the
    self-attention ``attn.scale``, times the proportional factor when a base is given (16
    image tokens)."""
    prop = _proportional(16, base) if base is not None else _default

    def scale(site: str, d: int) -> float:
        return prop(site, d) if site.endswith("attn1") else d ** -0.5
    return scale


def _lumina2() -> Tuple[nn.Module, tuple, dict]:
    """Lumina 2's forward takes ``attention_kwargs`` for LoRA only: its processor's
    ``base_sequence_length`` (proportional attention) is never passed, so every scale is ``d**-0.5``."""
    from diffusers import Lumina2Transformer2DModel

    torch.manual_seed(0)
    model = Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=24, num_layers=1,
                                      num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=16,
                                      axes_dim_rope=(4, 2, 2), axes_lens=(32, 32, 32), cap_feat_dim=16).eval()
    g = _gen()
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[:, -2:] = False
    return model, (), {"hidden_states": torch.randn(1, 4, 8, 8, generator=g), "timestep": torch.tensor([0.5]),
                       "encoder_hidden_states": torch.randn(1, 6, 16, generator=g), "encoder_attention_mask": mask}


def _cogview3plus() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import CogView3PlusTransformer2DModel

    torch.manual_seed(0)
    model = CogView3PlusTransformer2DModel(patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                                           num_attention_heads=2, out_channels=4, text_embed_dim=8, time_embed_dim=8,
                                           condition_dim=2, pos_embed_max_size=8, sample_size=8).eval()
    g = _gen()
    return model, (), {"hidden_states": torch.randn(1, 4, 8, 8, generator=g),
                       "encoder_hidden_states": torch.randn(1, 5, 8, generator=g), "timestep": torch.tensor([3]),
                       "original_size": torch.tensor([[8.0, 8.0]]), "target_size": torch.tensor([[8.0, 8.0]]),
                       "crop_coords": torch.tensor([[0.0, 0.0]])}


def _cogview4() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import CogView4Transformer2DModel

    torch.manual_seed(0)
    model = CogView4Transformer2DModel(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                       num_attention_heads=2, out_channels=4, text_embed_dim=8, time_embed_dim=8,
                                       condition_dim=4, rope_axes_dim=(4, 4)).eval()
    g = _gen()
    return model, (), {"hidden_states": torch.randn(1, 4, 8, 8, generator=g),
                       "encoder_hidden_states": torch.randn(1, 5, 8, generator=g), "timestep": torch.tensor([3]),
                       "original_size": torch.tensor([[8.0, 8.0]]), "target_size": torch.tensor([[8.0, 8.0]]),
                       "crop_coords": torch.tensor([[0.0, 0.0]])}


def _hidream() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import HiDreamImageTransformer2DModel

    torch.manual_seed(0)
    model = HiDreamImageTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                           num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
                                           caption_channels=[8, 4], text_emb_dim=8, num_routed_experts=2,
                                           num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(16, 16),
                                           llama_layers=(0, 1), force_inference_output=True).eval()
    g = _gen()
    return model, (), {"hidden_states": torch.randn(1, 4, 8, 8, generator=g), "timesteps": torch.tensor([3]),
                       "encoder_hidden_states_t5": torch.randn(1, 4, 8, generator=g),
                       "encoder_hidden_states_llama3": torch.randn(2, 1, 4, 4, generator=g),
                       "pooled_embeds": torch.randn(1, 8, generator=g)}


def _omnigen() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import OmniGenTransformer2DModel

    torch.manual_seed(0)
    model = OmniGenTransformer2DModel(hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                                      intermediate_size=32, num_layers=2, pad_token_id=0, vocab_size=100,
                                      in_channels=4, time_step_dim=4,
                                      rope_scaling={"long_factor": [1, 2, 3, 4], "short_factor": [1, 2, 3, 4]}).eval()
    g = _gen()
    n_text, n_img = 6, 16
    n = n_text + 1 + n_img
    mask = torch.ones(1, n, n).tril()
    mask[:, n_text + 1:, n_text + 1:] = 1  # the image tokens see one another (OmniGen's pipeline mask)
    return model, (), {"hidden_states": torch.randn(1, 4, 8, 8, generator=g), "timestep": torch.tensor([0.5]),
                       "input_ids": torch.randint(1, 100, (1, n_text), generator=g),
                       "input_img_latents": [], "input_image_sizes": {}, "attention_mask": mask,
                       "position_ids": torch.arange(n)[None]}


def _qwenimage(backend: Optional[str] = None) -> Tuple[nn.Module, tuple, dict]:
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                        axes_dims_rope=(8, 4, 4)).eval()
    if backend is not None:
        model.set_attention_backend(backend)
    g = _gen()
    mask = torch.ones(1, 5, dtype=torch.long)
    mask[:, -2:] = 0
    return model, (), {"hidden_states": torch.randn(1, 16, 16, generator=g),
                       "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
                       "encoder_hidden_states_mask": mask, "timestep": torch.tensor([0.5]),
                       "img_shapes": [(1, 4, 4)]}


def _chroma() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(0)
    model = ChromaTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                     axes_dims_rope=(4, 4, 8), approximator_num_channels=8,
                                     approximator_hidden_dim=16, approximator_layers=1).eval()
    g = _gen()
    n, t = 16, 5
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"),
                          -1).reshape(-1, 3)
    return model, (), {"hidden_states": torch.randn(1, n, 8, generator=g),
                       "encoder_hidden_states": torch.randn(1, t, 32, generator=g), "timestep": torch.tensor([0.5]),
                       "img_ids": img_ids, "txt_ids": torch.zeros(t, 3)}


# -- video transformers ----------------------------------------------------------------------------
def _wan(kind: str, backend: Optional[str] = None) -> Tuple[nn.Module, tuple, dict]:
    """Wan's text is padded to 512 tokens: its processor takes the first ``len - 512`` context
    tokens as the image's (added k/v projections) and the last 512 as the text's."""
    import diffusers

    torch.manual_seed(0)
    cls = diffusers.SkyReelsV2Transformer3DModel if kind == "skyreels" else diffusers.WanTransformer3DModel
    image = kind == "i2v"
    model = cls(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
                image_dim=8 if image else None, added_kv_proj_dim=16 if image else None).eval()
    g = _gen()
    kwargs: Dict[str, Any] = {"hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g), "timestep": torch.tensor([3]),
                              "encoder_hidden_states": torch.randn(1, 512, 16, generator=g)}
    if backend is not None:
        model.set_attention_backend(backend)
    if image:
        kwargs["encoder_hidden_states_image"] = torch.randn(1, 3, 8, generator=g)
    return model, (), kwargs


def _sana_video() -> Tuple[nn.Module, tuple, dict]:
    """Sana-Video: ReLU linear self-attention with RoPE on relu(q), relu(k)
    (``SanaLinearAttnProcessor3_0``: ``(v @ rope(k)ᵀ) @ rope(q) / (Σk · q)``), SDPA cross-attention."""
    from diffusers import SanaVideoTransformer3DModel

    torch.manual_seed(0)
    model = SanaVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                        num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=8,
                                        cross_attention_dim=16, caption_channels=16, sample_size=8,
                                        rope_max_seq_len=32).eval()
    g = _gen()
    return model, (), {"hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g),
                       "encoder_hidden_states": torch.randn(1, 5, 16, generator=g), "timestep": torch.tensor([3])}


def _helios(amplify: bool) -> Tuple[nn.Module, tuple, dict]:
    """Helios (Wan-style, with short / mid / long history latents in the self-attention);
    ``amplify``: ``is_amplify_history``, the history tokens' keys multiplied per head by a learned
    ``1 + sigmoid(s)·(max_scale - 1)`` before SDPA (the current tokens' keys are not): a factor on
    some keys only, not the attention's scale, which stays ``d**-0.5``."""
    from diffusers import HeliosTransformer3DModel

    torch.manual_seed(0)
    model = HeliosTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                     in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                     num_layers=2, rope_dim=(4, 4, 4), is_amplify_history=amplify).eval()
    with torch.no_grad():  # trained history scales, away from their init and unequal over heads
        for name, p in model.named_parameters():
            if "history_key_scale" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    g = _gen()
    f, h, w = 2, 8, 8
    return model, (), {"hidden_states": torch.randn(1, 4, f, h, w, generator=g), "timestep": torch.tensor([3]),
                       "encoder_hidden_states": torch.randn(1, 6, 16, generator=g),
                       "indices_hidden_states": torch.arange(f)[None].float() + 6,
                       "indices_latents_history_short": torch.tensor([[5.0]]),
                       "indices_latents_history_mid": torch.tensor([[4.0]]),
                       "indices_latents_history_long": torch.arange(4)[None].float(),
                       "latents_history_short": torch.randn(1, 4, 1, h, w, generator=g),
                       "latents_history_mid": torch.randn(1, 4, 1, h, w, generator=g),
                       "latents_history_long": torch.randn(1, 4, 4, h, w, generator=g)}


def _ltx() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                       cross_attention_dim=16, num_layers=2, caption_channels=16).eval()
    g = _gen()
    mask = torch.ones(1, 5)
    mask[:, -2:] = 0
    return model, (), {"hidden_states": torch.randn(1, 2 * 4 * 4, 4, generator=g),
                       "encoder_hidden_states": torch.randn(1, 5, 16, generator=g), "timestep": torch.tensor([3]),
                       "encoder_attention_mask": mask, "num_frames": 2, "height": 4, "width": 4}


def _mochi() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import MochiTransformer3DModel

    torch.manual_seed(0)
    model = MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                                    pooled_projection_dim=16, in_channels=4, out_channels=4, text_embed_dim=16,
                                    time_embed_dim=4, max_sequence_length=8).eval()
    g = _gen()
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, -2:] = False  # the second sample's caption is padded: Mochi's per-sample loop
    return model, (), {"hidden_states": torch.randn(2, 4, 2, 8, 8, generator=g),
                       "encoder_hidden_states": torch.randn(2, 5, 16, generator=g), "timestep": torch.tensor([3, 5]),
                       "encoder_attention_mask": mask}


def _allegro() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import AllegroTransformer3DModel

    torch.manual_seed(0)
    model = AllegroTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                      num_layers=1, cross_attention_dim=16, sample_height=8, sample_width=8,
                                      sample_frames=2, caption_channels=16).eval()
    g = _gen()
    return model, (), {"hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g),
                       "encoder_hidden_states": torch.randn(1, 5, 16, generator=g), "timestep": torch.tensor([3])}


def _hunyuan_video() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                           num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2,
                                           patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
                                           pooled_projection_dim=8, rope_axes_dim=(2, 4, 2)).eval()
    g = _gen()
    mask = torch.ones(1, 5, dtype=torch.long)
    mask[:, -2:] = 0
    return model, (), {"hidden_states": torch.randn(1, 4, 1, 8, 8, generator=g), "timestep": torch.tensor([3]),
                       "encoder_hidden_states": torch.randn(1, 5, 16, generator=g), "encoder_attention_mask": mask,
                       "pooled_projections": torch.randn(1, 8, generator=g), "guidance": torch.tensor([3000.0])}


def _easyanimate() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import EasyAnimateTransformer3DModel

    torch.manual_seed(0)
    model = EasyAnimateTransformer3DModel(attention_head_dim=16, num_attention_heads=2, in_channels=4, mmdit_layers=2,
                                          num_layers=2, out_channels=4, patch_size=2, sample_height=8,
                                          sample_width=8, text_embed_dim=16, time_embed_dim=8,
                                          time_position_encoding_type="3d_rope").eval()
    g = _gen()
    return model, (), {"hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g), "timestep": torch.tensor([3]),
                       "encoder_hidden_states": torch.randn(1, 5, 16, generator=g)}


def _consisid() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import ConsisIDTransformer3DModel

    torch.manual_seed(0)
    model = ConsisIDTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                       time_embed_dim=2, text_embed_dim=8, num_layers=1, sample_width=8,
                                       sample_height=8, sample_frames=8, patch_size=2, temporal_compression_ratio=4,
                                       max_text_seq_length=8, cross_attn_interval=1, is_kps=False,
                                       is_train_face=True, cross_attn_dim_head=8, cross_attn_num_heads=2,
                                       LFE_id_dim=2, LFE_vit_dim=2, LFE_depth=2, LFE_dim_head=8, LFE_num_heads=2,
                                       LFE_num_id_token=1, LFE_num_querie=2, LFE_output_dim=10, LFE_ff_mult=1,
                                       LFE_num_scale=1).eval()
    g = _gen()
    return model, (), {"hidden_states": torch.randn(1, 1, 4, 8, 8, generator=g),
                       "encoder_hidden_states": torch.randn(1, 8, 8, generator=g), "timestep": torch.tensor([3]),
                       "id_vit_hidden": [torch.randn(1, 3, 2, generator=g)], "id_cond": torch.randn(1, 2, generator=g)}


def _latte() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import LatteTransformer3DModel

    torch.manual_seed(0)
    model = LatteTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                    num_layers=1, cross_attention_dim=16, sample_size=8, patch_size=2,
                                    num_embeds_ada_norm=1000, norm_type="ada_norm_single", caption_channels=16,
                                    video_length=2).eval()
    g = _gen()
    return model, (), {"hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g),
                       "encoder_hidden_states": torch.randn(1, 5, 16, generator=g), "timestep": torch.tensor([3]),
                       "enable_temporal_attentions": True}


# -- audio, UNets, prior -----------------------------------------------------------------------------
def _stable_audio() -> Tuple[nn.Module, tuple, dict]:
    from diffusers import StableAudioDiTModel
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    torch.manual_seed(0)
    model = StableAudioDiTModel(sample_size=8, in_channels=4, num_layers=2, attention_head_dim=8,
                                num_attention_heads=4, num_key_value_attention_heads=2, out_channels=4,
                                cross_attention_dim=16, time_proj_dim=8, global_states_input_dim=16,
                                cross_attention_input_dim=16).eval()
    g = _gen()
    # the pipeline's rotary table: half the head dim rotated, over the global token and the samples
    rotary = get_1d_rotary_pos_embed(4, 8 + 1, use_real=True, repeat_interleave_real=False)
    return model, (), {"hidden_states": torch.randn(1, 4, 8, generator=g), "timestep": torch.tensor([3]),
                       "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
                       "global_hidden_states": torch.randn(1, 1, 16, generator=g), "rotary_embedding": rotary}


def _kandinsky3(eager: bool = False) -> Tuple[nn.Module, tuple, dict]:
    from diffusers import Kandinsky3UNet

    torch.manual_seed(0)
    model = Kandinsky3UNet(in_channels=4, time_embedding_dim=16, groups=4, attention_head_dim=8, layers_per_block=3,
                           block_out_channels=(32, 64), cross_attention_dim=16, encoder_hid_dim=16).eval()
    if eager:
        model.set_default_attn_processor()  # AttnProcessor: baddbmm with the scale, softmax, bmm
    g = _gen()
    mask = torch.ones(1, 5)
    mask[:, -2:] = 0
    return model, (), {"sample": torch.randn(1, 4, 16, 16, generator=g), "timestep": torch.tensor([3]),
                       "encoder_hidden_states": torch.randn(1, 5, 16, generator=g), "encoder_attention_mask": mask}


def _uvit(eager: bool = False) -> Tuple[nn.Module, tuple, dict]:
    from diffusers import UVit2DModel

    torch.manual_seed(0)
    model = UVit2DModel(hidden_size=32, cond_embed_dim=16, micro_cond_encode_dim=2, micro_cond_embed_dim=10,
                        encoder_hidden_size=16, vocab_size=33, codebook_size=32, in_channels=16,
                        block_out_channels=32, num_res_blocks=1, block_num_heads=2, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=32, sample_size=4).eval()
    if eager:
        model.set_default_attn_processor()
    g = _gen()
    return model, (), {"input_ids": torch.randint(0, 32, (1, 4, 4), generator=g),
                       "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
                       "pooled_text_emb": torch.randn(1, 16, generator=g),
                       "micro_conds": torch.tensor([[8.0, 8, 0, 0, 6]])}


def _prior(eager: bool = False) -> Tuple[nn.Module, tuple, dict]:
    from diffusers import PriorTransformer

    torch.manual_seed(0)
    model = PriorTransformer(num_attention_heads=2, attention_head_dim=8, num_layers=2, embedding_dim=16,
                             num_embeddings=5, additional_embeddings=4).eval()
    if eager:
        model.set_default_attn_processor()
    g = _gen()
    mask = torch.ones(1, 5, dtype=torch.bool)
    mask[:, -2:] = False
    return model, (), {"hidden_states": torch.randn(1, 16, generator=g), "timestep": 3,
                       "proj_embedding": torch.randn(1, 16, generator=g),
                       "encoder_hidden_states": torch.randn(1, 5, 16, generator=g), "attention_mask": mask}


def diffusers_cases(have: Callable[[str], bool]) -> Iterator[Case]:
    """The cases above (``diffusers2/...``), when diffusers is installed."""
    if not have("diffusers"):
        return
    for variant in ("plain", "mask", "qk_norm"):
        yield f"diffusers2/sana/{variant}", lambda v=variant: _sana(v), _default
    yield "diffusers2/auraflow", _auraflow, _default
    yield "diffusers2/hunyuan_dit", _hunyuan_dit, _default
    yield "diffusers2/lumina_next", lambda: _lumina_next(None), _lumina_next_scale(None)
    yield "diffusers2/lumina_next/proportional", lambda: _lumina_next(4), _lumina_next_scale(4)
    yield "diffusers2/lumina2", _lumina2, _default
    yield "diffusers2/cogview3plus", _cogview3plus, _default
    yield "diffusers2/cogview4", _cogview4, _default
    yield "diffusers2/hidream", _hidream, _default
    yield "diffusers2/omnigen", _omnigen, _default
    yield "diffusers2/qwenimage", _qwenimage, _default
    yield "diffusers2/chroma", _chroma, _default
    for kind in ("t2v", "i2v", "skyreels"):
        yield f"diffusers2/wan/{kind}", lambda k=kind: _wan(k), _default
    yield "diffusers2/wan/t2v/flex", lambda: _flex(lambda: _wan("t2v", "flex")), _default
    yield "diffusers2/qwenimage/flex", lambda: _flex(lambda: _qwenimage("flex")), _default
    yield "diffusers2/sana_video", _sana_video, _default
    yield "diffusers2/helios", lambda: _helios(False), _default
    yield "diffusers2/helios/amplify_history", lambda: _helios(True), _default
    yield "diffusers2/ltx_video", _ltx, _default
    yield "diffusers2/mochi", _mochi, _default
    yield "diffusers2/allegro", _allegro, _default
    yield "diffusers2/hunyuan_video", _hunyuan_video, _default
    yield "diffusers2/easyanimate", _easyanimate, _default
    yield "diffusers2/consisid", _consisid, _default
    yield "diffusers2/latte", _latte, _default
    yield "diffusers2/stable_audio", _stable_audio, _default
    for name, fn in (("kandinsky3", _kandinsky3), ("uvit", _uvit), ("prior", _prior)):
        yield f"diffusers2/{name}", fn, _default
        yield f"diffusers2/{name}/eager", lambda fn=fn: fn(True), _default
