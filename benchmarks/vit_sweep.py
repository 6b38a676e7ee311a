"""vit-pytorch (lucidrains) beyond the survey's first ten modules: one case per module that builds
from a tiny config (image 32 or 64, dim 32, depth 1-2, 2-4 heads, random weights, batch 2), for
``coverage_survey.thirdparty_cases`` (run in the timm venv, which has torchvision):

    PYTHONPATH=. /work/timm-venv/bin/python benchmarks/coverage_survey.py --only thirdparty --match vit-pytorch

Each case carries the scale the module's own Attention code applies (read from its source, per
site where they differ), so a wrong scale reported as known shows as a problem:

- ``q * d**-0.5`` or ``(q @ kᵀ) * d**-0.5`` (most modules): ``d ** -0.5`` of the head dim;
- ``F.normalize(t) * sqrt(d) * gamma`` on q and k (na_vit's and simple_vit_with_qk_norm's RMSNorm,
  no scale after): a norm starts new features and the constant after it counts, ``sqrt(d)²·1``;
  nViT: ``l2norm`` then a learned per-feature gain, SDPA ``scale=1``: ``1``;
- XCiT's cross-covariance attention: ``l2norm`` q and k, scores ``* temperature.exp()`` (a learned
  per-head tensor, here moved off its init of ones so heads differ): ``exp(temperature[0])``; its
  "d_k" is the number of tokens (attention over channels);
- vit_for_small_dataset's LSA: ``* temperature.exp()`` (one learned value, moved off its init
  ``log(d**-0.5)``) and a diagonal mask;
- the patch merger's learned queries: ``dim ** -0.5`` of the model dim.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

Case = Tuple[str, Callable[[], Tuple[nn.Module, tuple, dict]], Optional[Callable[[str, int], float]]]
_D = 8  # dim_head wherever the constructor takes one


def _img(size: int = 32, b: int = 2, *lead: int) -> torch.Tensor:
    return torch.randn(b, 3, *lead, size, size, generator=torch.Generator().manual_seed(1))


def _head(site: str, d: int) -> float:
    return d ** -0.5


def _const(value: float) -> Callable[[str, int], float]:
    return lambda site, d: value


def _set(model: nn.Module, suffix: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Move every parameter named ``*suffix`` off its init (a trained model's value)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(suffix):
                p.copy_(fn(p))


_V = dict(image_size=32, patch_size=8, num_classes=10, dim=32, depth=2, heads=4, mlp_dim=64, dim_head=_D)
_TEMP = torch.tensor([0.3, -0.2, 0.5, 0.1])  # XCiT per-head temperatures (log scale) after "training"


def _build(name: str) -> Tuple[nn.Module, tuple, dict]:
    m = importlib.import_module(f"vit_pytorch.{name}")
    torch.manual_seed(0)
    x: Any = _img()
    if name == "pit":
        model = m.PiT(image_size=32, patch_size=4, num_classes=10, dim=32, depth=(1, 1), heads=2, mlp_dim=64,
                      dim_head=_D)
    elif name == "regionvit":
        model = m.RegionViT(dim=(16, 32, 32, 32), depth=(1, 1, 1, 1), window_size=2, num_classes=10,
                            local_patch_size=4)
        x = _img(64)
    elif name == "crossformer":
        model = m.CrossFormer(dim=(32, 64, 64, 64), depth=(1, 1, 1, 1), global_window_size=(2, 2, 1, 1),
                              local_window_size=2, num_classes=10)
        x = _img(64)
    elif name == "scalable_vit":
        model = m.ScalableViT(num_classes=10, dim=16, depth=(1, 1, 1, 1), heads=(1, 2, 2, 2),
                              reduction_factor=(4, 2, 2, 1), window_size=(2, 2, None, None), iwsa_dim_key=8,
                              iwsa_dim_value=8, ssa_dim_key=8, ssa_dim_value=8)
        x = _img(64)
    elif name == "sep_vit":
        # its Transformer never passes window_size / dim_head on (1.26.14): windows of 7, heads of 32
        model = m.SepViT(num_classes=10, dim=16, depth=(1, 1, 1, 1), heads=(1, 2, 2, 2))
        x = _img(224, 1)
    elif name in ("max_vit", "max_vit_with_registers"):
        model = m.MaxViT(num_classes=10, dim=16, depth=(1, 1), dim_head=_D, dim_conv_stem=16, window_size=2,
                         dropout=0.0)
    elif name == "mobile_vit":
        model = m.MobileViT(image_size=(32, 32), dims=[16, 16, 16], channels=[8, 8, 8, 8, 16, 16, 16, 16, 16, 16, 32],
                            num_classes=10, depths=(1, 1, 1))
        x = _img(64)
    elif name == "xcit":
        model = m.XCiT(image_size=32, patch_size=8, num_classes=10, dim=32, depth=2, cls_depth=1, heads=4, mlp_dim=64,
                       dim_head=_D)
        _set(model, "temperature", lambda p: _TEMP.view(4, 1, 1).to(p))
    elif name == "parallel_vit":
        model = m.ViT(**_V, num_parallel_branches=2)
    elif name == "na_vit":
        model = m.NaViT(**dict(_V, patch_size=8))
        g = torch.Generator().manual_seed(1)
        x = [[torch.randn(3, 32, 32, generator=g), torch.randn(3, 16, 24, generator=g)],
             [torch.randn(3, 24, 32, generator=g)]]  # variable sizes: packed, masked per image
    elif name == "t2t":
        model = m.T2TViT(image_size=32, num_classes=10, dim=32, depth=1, heads=4, mlp_dim=64, dim_head=_D,
                         t2t_layers=((7, 4), (3, 2)))
    elif name == "cct":
        model = m.CCT(img_size=32, embedding_dim=32, n_conv_layers=1, kernel_size=3, stride=1, padding=1,
                      pooling_kernel_size=3, pooling_stride=2, pooling_padding=1, num_layers=2, num_heads=4,
                      mlp_ratio=2.0, num_classes=10, positional_embedding="learnable")
    elif name == "rvt":
        model = m.RvT(**_V)
    elif name == "ats_vit":
        model = m.ViT(**dict(_V, patch_size=4), max_tokens_per_depth=(32, 16))
        # its token sampling draws Gumbel noise: the same draw on every forward (the check compares two)
        model.register_forward_pre_hook(lambda module, inputs: torch.manual_seed(0) and None)
    elif name == "look_vit":
        model = m.LookViT(dim=32, image_size=32, num_classes=10, depth=1, patch_size=8, heads=4, dim_head=_D,
                          highres_patch_size=4, cross_attn_heads=2, cross_attn_dim_head=16, dropout=0.0)
    elif name == "vit_for_small_dataset":
        model = m.ViT(**_V)
        _set(model, "temperature", lambda p: p + 0.4)
    elif name == "vit_with_patch_merger":
        model = m.ViT(**dict(_V, patch_size=4), patch_merge_layer=1, patch_merge_num_tokens=8)
    elif name == "learnable_memory_vit":
        vit = m.ViT(**_V)
        model = m.Adapter(vit=vit, num_memories_per_layer=3, num_classes=5)
    elif name == "vivit":
        model = m.ViViT(image_size=32, image_patch_size=8, frames=4, frame_patch_size=2, num_classes=10, dim=32,
                        spatial_depth=1, temporal_depth=1, heads=4, mlp_dim=64, dim_head=_D)
        x = _img(32, 2, 4)
    elif name in ("simple_vit_1d", "vit_1d"):
        model = m.SimpleViT(seq_len=64, patch_size=8, num_classes=10, dim=32, depth=2, heads=4, mlp_dim=64,
                            dim_head=_D) if name == "simple_vit_1d" else m.ViT(
            seq_len=64, patch_size=8, num_classes=10, dim=32, depth=2, heads=4, mlp_dim=64, dim_head=_D)
        x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    elif name in ("vit_3d", "simple_vit_3d"):
        model = getattr(m, "ViT" if name == "vit_3d" else "SimpleViT")(
            image_size=32, image_patch_size=8, frames=4, frame_patch_size=2, num_classes=10, dim=32, depth=2, heads=4,
            mlp_dim=64, dim_head=_D)
        x = _img(32, 2, 4)
    elif name == "simple_uvit":
        model = m.SimpleUViT(**dict(_V, depth=3), num_register_tokens=2)
    elif name in ("vit_nd", "vit_nd_rotary"):
        kw = dict(ndim=3, input_shape=(4, 16, 16), patch_size=(2, 8, 8), num_classes=10, dim=32, depth=2, heads=4,
                  mlp_dim=64, dim_head=_D)
        kw["causal_dims"] = (0,)  # causal over time: the dense mask of its manual path
        # the manual path (q·kᵀ, finfo.min fill, softmax): flex_attention has no backward on CPU
        importlib.import_module("vit_pytorch.vit_nd_masking").flex_attention_supported = lambda device: False
        model = m.ViTND(**kw)
        x = torch.randn(2, 3, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    elif name == "cct_3d":
        model = m.CCT(img_size=32, num_frames=4, embedding_dim=32, n_conv_layers=1, kernel_size=3, stride=1, padding=1,
                      pooling_kernel_size=3, pooling_stride=2, pooling_padding=1, num_layers=2, num_heads=4,
                      mlp_ratio=2.0, num_classes=10, positional_embedding="learnable")
        x = _img(32, 2, 4)
    elif name == "simple_flash_attn_vit_3d":
        model = m.SimpleViT(image_size=32, image_patch_size=8, frames=4, frame_patch_size=2, num_classes=10, dim=32,
                            depth=2, heads=4, mlp_dim=64, dim_head=_D)
        x = _img(32, 2, 4)
    elif name == "vit_detpool":
        model = m.ViTDetPool(**_V)
    elif name == "simple_flash_attn_vit":
        model = m.SimpleViT(**_V, use_flash=True)
    elif name == "normalized_vit":
        model = m.nViT(**{k: v for k, v in _V.items()})
    elif name == "jumbo_vit":
        model = m.JumboViT(**_V, jumbo_cls_k=2)
    else:  # the plain ViT / SimpleViT variants
        cls = getattr(m, "ViT", None) or getattr(m, "SimpleViT")
        model = cls(**_V)
    return model.eval(), (x,), {}


#: name -> expected scale(site, d); None: the head dim's ``d ** -0.5``
_EXPECTED: Dict[str, Callable[[str, int], float]] = {
    "na_vit": _const(float(_D)), "simple_vit_with_qk_norm": _const(float(_D)), "normalized_vit": _const(1.0),
    "xcit": lambda site, d: math.exp(float(_TEMP[0])) if "xcit_transformer" in site else d ** -0.5,
    "vit_for_small_dataset": _const(math.exp(math.log(_D ** -0.5) + 0.4)),
    "vit_5": _const(_D ** 0.5),  # RMSNorm on q and k (sqrt(d) each), then * d**-0.5
}

NAMES = ("pit", "regionvit", "crossformer", "scalable_vit", "sep_vit", "max_vit", "max_vit_with_registers",
         "mobile_vit", "xcit", "parallel_vit", "na_vit", "t2t", "cct", "rvt", "ats_vit", "look_vit",
         "vit_for_small_dataset", "simple_vit_with_qk_norm", "simple_vit_with_register_tokens",
         "simple_vit_with_relative_proj_pos_bias", "simple_vit_with_value_residual", "simple_flash_attn_vit",
         "normalized_vit", "vit_with_patch_merger", "learnable_memory_vit", "vivit", "simple_vit_1d", "vit_1d",
         "vit_3d", "simple_vit_3d", "vit_nd", "vit_nd_rotary", "vit_5", "jumbo_vit", "simple_uvit",
         "simple_vit_with_patch_dropout", "vit_with_patch_dropout", "vit_with_keel_post_ln",
         "simple_vit_with_specialized_cls", "vit_with_decorr", "simple_vit_orthog_residual_update", "cct_3d",
         "simple_flash_attn_vit_3d", "vit_detpool")


def vit_cases() -> Iterator[Case]:
    for name in NAMES:
        yield f"vit-pytorch/{name}", (lambda name=name: _build(name)), _EXPECTED.get(name, _head)
