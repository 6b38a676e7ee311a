"""x-transformers (lucidrains) beyond the survey's option sets (coverage_survey.py's ``variants``,
survey_sweep.py's ``_XT`` / ``_XT_DEC``): options that change how scores are formed, masked or
normalized, with masks, cross-attention, grouped keys and KV-cache decoding, for
``coverage_survey.thirdparty_cases``:

    PYTHONPATH=. python benchmarks/coverage_survey.py --only thirdparty --match x-transformers

Tiny configs (dim 32, depth 2, 4 heads, dim_head 8, sequence 8, batch 2, random weights). Each case
carries the scale x-transformers' own code applies (``Attend``: ``sim * dim_head ** -0.5``, or for
flash ``q * (scale / q.shape[-1] ** -0.5)`` and SDPA's default):

- ``qk_norm``: ``l2norm`` then ``qk_norm_scale`` (10) as the attention scale;
- ``k_rmsnorm`` alone: ``F.normalize(k) * sqrt(d) * g`` (a norm starts new features, the constant
  after it counts) and ``d ** -0.5``: ``sqrt(8) * 8**-0.5 = 1``;
- ``custom_attn_fn`` ``softmax(2 s)``: the factor inside the softmax counts, ``2 * 8**-0.5``;
- ``l2_distance``: ``-|q - k|²`` scores (eager: cdist, named or not found) and flash's widened q
  and k (``[2q, |q|², -1]·[k, -1, |k|²]``) at ``8**-0.5``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

Case = Tuple[str, Callable[[], Tuple[nn.Module, tuple, dict]], Optional[Callable[[str, int], float]]]
B, L, VOCAB = 2, 8, 64
_KW = dict(dim=32, depth=2, heads=4, attn_dim_head=8)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _ids(n: int = L) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, n), generator=_gen())


def _mask(n: int = L) -> torch.Tensor:
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, -3:] = False
    return mask


def _head(site: str, d: int) -> float:
    return 8 ** -0.5


def _const(value: float) -> Callable[[str, int], float]:
    return lambda site, d: value


def _wrap(layers: nn.Module) -> nn.Module:
    from x_transformers import TransformerWrapper

    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=layers)


def _dec(kw: Dict[str, Any], mask: bool = False) -> Tuple[nn.Module, tuple, dict]:
    from x_transformers import Decoder

    torch.manual_seed(0)
    model = _wrap(Decoder(**dict(_KW, **kw)))
    return model.eval(), (_ids(),), ({"mask": _mask()} if mask else {})


def _enc(kw: Dict[str, Any], mask: bool = True, attn_mask: bool = False) -> Tuple[nn.Module, tuple, dict]:
    from x_transformers import Encoder

    torch.manual_seed(0)
    model = _wrap(Encoder(**dict(_KW, **kw)))
    kwargs: Dict[str, Any] = {"mask": _mask()} if mask else {}
    if attn_mask:  # a custom (i, j) pattern: a band of width 3
        i = torch.arange(L)
        kwargs["attn_mask"] = (i[:, None] - i[None, :]).abs() <= 2
    return model.eval(), (_ids(),), kwargs


class _Cross(nn.Module):
    """A decoder cross-attending to a given context (B, 10, 32) under a context mask."""

    def __init__(self, kw: Dict[str, Any]) -> None:
        super().__init__()
        from x_transformers import Decoder

        self.dec = _wrap(Decoder(**dict(_KW, depth=1, cross_attend=True, **kw)))

    def forward(self, ids: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor) -> torch.Tensor:
        return self.dec(ids, context=context, context_mask=context_mask)


def _cross(kw: Dict[str, Any]) -> Tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    model = _Cross(kw).eval()
    return model, (_ids(), torch.randn(B, 10, 32, generator=_gen()), _mask(10)), {}


class _Generate(nn.Module):
    """``AutoregressiveWrapper.generate``: a prompt of 6 tokens, then 3 steps through the KV cache
    (one query per step against the cached keys), greedy."""

    def __init__(self, kw: Dict[str, Any]) -> None:
        super().__init__()
        from x_transformers import AutoregressiveWrapper, Decoder

        self.ar = AutoregressiveWrapper(_wrap(Decoder(**dict(_KW, **kw))))

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        return self.ar.generate(prompt, 3, cache_kv=True, temperature=0.0)


def _generate(kw: Dict[str, Any]) -> Tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    return _Generate(kw).eval(), (_ids(6),), {}


def _seeded(built: Tuple[nn.Module, tuple, dict]) -> Tuple[nn.Module, tuple, dict]:
    """The same Gumbel draw on every forward (the check compares two)."""
    built[0].register_forward_pre_hook(lambda module, inputs: torch.manual_seed(0) and None)
    return built


def _xtransformer(flash: bool) -> Tuple[nn.Module, tuple, dict]:
    """``XTransformer``: encoder-decoder with a source mask (returns the loss on ``tgt``)."""
    from x_transformers import XTransformer

    torch.manual_seed(0)
    model = XTransformer(dim=32, enc_num_tokens=VOCAB, enc_depth=1, enc_heads=4, enc_max_seq_len=16,
                         enc_attn_dim_head=8, enc_attn_flash=flash, dec_num_tokens=VOCAB, dec_depth=1, dec_heads=4,
                         dec_max_seq_len=16, dec_attn_dim_head=8, dec_attn_flash=flash)
    return model.eval(), (_ids(), _ids(6)), {"mask": _mask()}


def _continuous() -> Tuple[nn.Module, tuple, dict]:
    """``ContinuousTransformerWrapper`` over vectors, an encoder with a padding mask."""
    from x_transformers import ContinuousTransformerWrapper, Encoder

    torch.manual_seed(0)
    model = ContinuousTransformerWrapper(dim_in=12, dim_out=5, max_seq_len=16, attn_layers=Encoder(**_KW))
    return model.eval(), (torch.randn(B, L, 12, generator=_gen()),), {"mask": _mask()}


def _twice(s: torch.Tensor) -> torch.Tensor:
    return F.softmax(2 * s, dim=-1)


_TEN = _const(10.0)
# (name, build, expected scale)
_CASES = [
    ("value_dim_head", lambda: _dec(dict(attn_value_dim_head=16)), _head),
    ("value_dim_head_flash", lambda: _dec(dict(attn_value_dim_head=16, attn_flash=True)), _head),
    ("dec_mask", lambda: _dec({}, mask=True), _head),
    ("dec_mask_flash", lambda: _dec(dict(attn_flash=True), mask=True), _head),
    ("enc_gqa_mask", lambda: _enc(dict(attn_kv_heads=2)), _head),
    ("enc_gqa_mask_flash", lambda: _enc(dict(attn_kv_heads=2, attn_flash=True)), _head),
    ("enc_mqa_mask_flash", lambda: _enc(dict(attn_one_kv_head=True, attn_flash=True)), _head),
    ("enc_attn_mask", lambda: _enc({}, attn_mask=True), _head),
    ("enc_attn_mask_flash", lambda: _enc(dict(attn_flash=True), attn_mask=True), _head),
    ("enc_mem_kv_mask", lambda: _enc(dict(attn_num_mem_kv=2)), _head),
    ("enc_mem_kv_mask_flash", lambda: _enc(dict(attn_num_mem_kv=2, attn_flash=True)), _head),
    ("enc_zero_kv_mask", lambda: _enc(dict(attn_add_zero_kv=True)), _head),
    ("enc_zero_kv_mask_flash", lambda: _enc(dict(attn_add_zero_kv=True, attn_flash=True)), _head),
    ("enc_sink_mask", lambda: _enc(dict(attn_head_learned_sink=True)), _head),
    ("enc_qk_norm_groups_mask", lambda: _enc(dict(attn_qk_norm=True, attn_qk_norm_groups=2)), _TEN),
    ("enc_qk_norm_mem_kv", lambda: _enc(dict(attn_qk_norm=True, attn_num_mem_kv=2)), _TEN),
    ("enc_qk_norm_gqa_flash", lambda: _enc(dict(attn_qk_norm=True, attn_kv_heads=2, attn_flash=True)), _TEN),
    ("dec_alibi_flash_mask", lambda: _dec(dict(alibi_pos_bias=True, attn_flash=True), mask=True), _head),
    ("enc_dynamic_pos_bias_mask", lambda: _enc(dict(dynamic_pos_bias=True)), _head),
    ("enc_cog_signed_mask", lambda: _enc(dict(attn_cog_signed=True)), _head),
    ("dec_rotary_xpos_flash", lambda: _dec(dict(rotary_xpos=True, attn_flash=True)), _head),
    ("dec_rotary_partial_heads", lambda: _dec(dict(rotary_pos_emb=True, rotate_num_heads=2)), _head),
    ("dec_softclamp_2", lambda: _dec(dict(attn_softclamp_logits=True, attn_logit_softclamp_value=2.0)), _head),
    ("dec_sigmoid", lambda: _dec(dict(attn_sigmoid=True)), _head),
    ("dec_hard", lambda: _dec(dict(attn_hard=True)), _head),
    ("dec_l2_distance", lambda: _dec(dict(attn_l2_distance=True)), _head),
    ("dec_l2_distance_flash", lambda: _dec(dict(attn_l2_distance=True, attn_flash=True)), _head),
    ("dec_k_rmsnorm", lambda: _dec(dict(attn_k_rmsnorm=True)), _const(1.0)),
    ("dec_custom_attn_fn", lambda: _dec(dict(attn_custom_attn_fn=_twice)), _const(2 * 8 ** -0.5)),
    ("dec_sparse_topk_st", lambda: _dec(dict(attn_sparse_topk=3, attn_sparse_topk_straight_through=True)), _head),
    ("dec_gate_value_heads", lambda: _dec(dict(attn_gate_value_heads=True)), _head),
    ("dec_hybrid_gru", lambda: _dec(dict(attn_hybrid_module=nn.GRU(32, 32, batch_first=True),
                                         attn_hybrid_fold_axial_dim=4, attn_hybrid_learned_mix=True)), _head),
    ("dec_gumbel_softmax", lambda: _seeded(_dec(dict(attn_gumbel_softmax=True, attn_gumbel_softmax_hard=False,
                                                     attn_gumbel_softmax_temp=0.5))), _head),
    ("dec_dd_alibi_per_row", lambda: _dec(dict(attn_data_dependent_alibi=True,
                                               attn_data_dependent_alibi_per_row=True)), _head),
    ("dec_mla_rope_subheads", lambda: _dec(dict(attn_use_latent_kv=True, attn_dim_latent_kv=16,
                                                attn_latent_rope_subheads=2, rotary_pos_emb=True)), _head),
    ("dec_residual_attn_cross", lambda: _cross(dict(residual_attn=True, cross_residual_attn=True)), _head),
    ("dec_shift_tokens", lambda: _dec(dict(shift_tokens=1)), _head),
    ("dec_sandwich_norm", lambda: _dec(dict(sandwich_norm=True)), _head),
    ("dec_scalenorm", lambda: _dec(dict(use_scalenorm=True)), _head),
    ("dec_post_norm", lambda: _dec(dict(pre_norm=False)), _head),
    ("cross_gqa_mask", lambda: _cross(dict(attn_kv_heads=2)), _head),
    ("cross_gqa_mask_flash", lambda: _cross(dict(attn_kv_heads=2, attn_flash=True)), _head),
    ("cross_mem_kv_mask", lambda: _cross(dict(attn_num_mem_kv=2)), _head),
    ("cross_zero_kv_mask_flash", lambda: _cross(dict(attn_add_zero_kv=True, attn_flash=True)), _head),
    ("cross_qk_norm_mask", lambda: _cross(dict(attn_qk_norm=True)), _TEN),
    ("dec_rel_pos_mask", lambda: _dec(dict(rel_pos_bias=True), mask=True), _head),
    ("enc_alibi_mem_kv_mask", lambda: _enc(dict(alibi_pos_bias=True, attn_num_mem_kv=2)), _head),
    ("dec_max_attend_past_flash", lambda: _dec(dict(attn_max_attend_past=3, attn_flash=True)), _head),
    ("xtransformer_mask", lambda: _xtransformer(False), _head),
    ("xtransformer_mask_flash", lambda: _xtransformer(True), _head),
    ("continuous_mask", _continuous, _head),
    ("generate_kv_cache", lambda: _generate({}), _head),
    ("generate_kv_cache_flash", lambda: _generate(dict(attn_flash=True)), _head),
    ("generate_kv_cache_gqa_rotary", lambda: _generate(dict(attn_kv_heads=2, rotary_pos_emb=True)), _head),
    ("generate_kv_cache_mem_kv", lambda: _generate(dict(attn_num_mem_kv=2)), _head),
    ("generate_kv_cache_alibi_flash", lambda: _generate(dict(alibi_pos_bias=True, attn_flash=True)), _head),
]


def xt_cases() -> Iterator[Case]:
    for name, build, expected in _CASES:
        yield f"x-transformers/xt_{name}", build, expected
