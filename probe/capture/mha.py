"""Front end for ``nn.MultiheadAttention`` (``F.multi_head_attention_forward``) and its fused paths.

``nn.MultiheadAttention.forward`` and the ``nn.Transformer*`` layers call
``F.multi_head_attention_forward``, which dispatches through the capture TorchFunctionMode. The
mode is popped while a handler runs, and the function's own body starts with a
``has_torch_function`` check that would hand the call to any mode again, so the SDPA or
``bmm``/``softmax`` calls inside it cannot be intercepted one level down. This front end therefore
runs :func:`mha_forward`, a line-by-line mirror of PyTorch's function built from the same
operations (and its private helpers), which records the exact ``q``, ``k``, ``v`` of the
autograd graph as an :class:`~probe.call.AttentionCall` of kind ``"mha"``. The outputs are
bitwise those of ``F.multi_head_attention_forward`` (tested for every path); a call it does not
understand (an unknown keyword from a newer PyTorch) runs PyTorch's own function and is
reported once by a warning.

What is recorded (``E`` the head dim, ``H`` heads, ``L`` target and ``S`` source length):

* ``q``, ``k``, ``v`` as ``(B, H, L|S, E)`` views of the projected tensors, after ``bias_k`` /
  ``bias_v`` and ``add_zero_attn`` appended their extra key (so ``S`` counts them, as the
  softmax does);
* the scale: ``1/sqrt(E)`` as SDPA computes it (``need_weights=False``) or ``sqrt(1/E)`` as the
  ``need_weights=True`` path multiplies ``q`` by (they may differ in the last bit);
* ``bias``: the float mask PyTorch builds from ``attn_mask`` and ``key_padding_mask`` (boolean
  masks become ``-inf``); ``causal`` when ``is_causal`` reaches SDPA without a mask.

Fast paths: in eval without gradients, ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``
and ``nn.TransformerEncoder`` run outside the capture mode, on PyTorch's fused paths as without
probe, and are measured beside them (:mod:`probe.capture.mha_fused`). Fused kernels called
directly are run unchanged and named in one warning per site: their attention is not measured.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from probe.experiment import overrides
from probe.call import AttentionCall
from probe.capture import mha_fused
from probe.capture.frontend import KWARGS_HOOKED, Emit, FrontEnd, NamedSite
from probe.capture.sdpa import rerun_rows
from probe.once import WarnOnce

__all__ = ["MHAFrontEnd", "lookup_mha", "mha_forward", "mirrors"]

def _heads_view(t: Tensor, bsz: int, heads: int) -> Tensor:
    """``(B*H, N, E)`` → ``(B, H, N, E)`` (a view, as PyTorch's SDPA branch takes it)."""
    return t.view(bsz, heads, t.shape[-2], t.shape[-1])


def mha_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Optional[Tensor],
    in_proj_bias: Optional[Tensor],
    bias_k: Optional[Tensor],
    bias_v: Optional[Tensor],
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Tensor,
    out_proj_bias: Optional[Tensor],
    training: bool = True,
    key_padding_mask: Optional[Tensor] = None,
    need_weights: bool = True,
    attn_mask: Optional[Tensor] = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Optional[Tensor] = None,
    k_proj_weight: Optional[Tensor] = None,
    v_proj_weight: Optional[Tensor] = None,
    static_k: Optional[Tensor] = None,
    static_v: Optional[Tensor] = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
    *,
    emit: Optional[Emit] = None,
    scale_override: Union[None, float, Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """``F.multi_head_attention_forward`` with the same operations, emitting its attention.

    Same arguments and results as PyTorch's function (see its documentation); ``emit`` receives
    one :class:`AttentionCall` of kind ``"mha"`` whose logits are
    ``scale * q @ k.T + bias`` with ``q``, ``k``, ``v`` the tensors of the autograd graph.
    ``scale_override`` (``probe.scaling``) replaces the scale: a float, or a ``(H,)`` tensor on
    ``q``'s device and dtype (one per head, applied by multiplying ``q`` per head); the call is
    recorded with it.

    Pitfall: keep this in step with ``torch.nn.functional.multi_head_attention_forward``;
    ``tests/capture/test_mha.py`` checks bitwise agreement on every path.
    """
    is_batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
    if not is_batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    src_len, _, _ = key.shape
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask", other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask", target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # SDPA builds the causal mask itself
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
            target_type=query.dtype, check_other=False,
        )
        if key_padding_mask is not None:
            is_causal = False  # the mask is used instead
    if embed_dim != embed_dim_to_check:
        raise AssertionError(f"was expecting embedding dimension of {embed_dim_to_check}, but got {embed_dim}")
    if isinstance(embed_dim, Tensor):
        head_dim = embed_dim.div(num_heads, rounding_mode="trunc")
    else:
        head_dim = embed_dim // num_heads
    if head_dim * num_heads != embed_dim:
        raise AssertionError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")
    if use_separate_proj_weight:
        if key.shape[:2] != value.shape[:2]:
            raise AssertionError(f"key's sequence and batch dims {key.shape[:2]} do not match value's {value.shape[:2]}")
        if q_proj_weight is None or k_proj_weight is None or v_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is True but q/k/v_proj_weight is None")
        b_q = b_k = b_v = None
        if in_proj_bias is not None:
            b_q, b_k, b_v = in_proj_bias.chunk(3)
        q, k, v = F._in_projection(query, key, value, q_proj_weight, k_proj_weight, v_proj_weight, b_q, b_k, b_v)
    else:
        if key.shape != value.shape:
            raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
        if in_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is False but in_proj_weight is None")
        q, k, v = F._in_projection_packed(query, key, value, in_proj_weight, in_proj_bias)

    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {(tgt_len, src_len)}."
                )
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            if attn_mask.shape != (bsz * num_heads, tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                    f"{(bsz * num_heads, tgt_len, src_len)}."
                )
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")

    if bias_k is not None and bias_v is not None:
        if static_k is not None or static_v is not None:
            raise AssertionError("bias cannot be added to static key or value.")
        k = torch.cat([k, bias_k.repeat(1, bsz, 1)])
        v = torch.cat([v, bias_v.repeat(1, bsz, 1)])
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
    elif bias_k is not None or bias_v is not None:
        raise AssertionError("bias_k and bias_v must be set together")

    q = q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    if static_k is None:
        k = k.view(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    else:
        if static_k.size(0) != bsz * num_heads or static_k.size(2) != head_dim:
            raise AssertionError(f"expecting static_k of shape ({bsz * num_heads}, S, {head_dim}), got {tuple(static_k.shape)}")
        k = static_k
    if static_v is None:
        v = v.view(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    else:
        if static_v.size(0) != bsz * num_heads or static_v.size(2) != head_dim:
            raise AssertionError(f"expecting static_v of shape ({bsz * num_heads}, S, {head_dim}), got {tuple(static_v.shape)}")
        v = static_v

    if add_zero_attn:
        zero_attn_shape = (bsz * num_heads, 1, head_dim)
        k = torch.cat([k, torch.zeros(zero_attn_shape, dtype=k.dtype, device=k.device)], dim=1)
        v = torch.cat([v, torch.zeros(zero_attn_shape, dtype=v.dtype, device=v.device)], dim=1)
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))

    src_len = k.size(1)
    if key_padding_mask is not None:
        if not torch.jit.is_scripting() and not torch.jit.is_tracing():
            F._check_key_padding_mask(key_padding_mask, src_len, bsz)
        key_padding_mask = (
            key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1).reshape(bsz * num_heads, 1, src_len)
        )
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask

    if not training:
        dropout_p = 0.0

    if need_weights:
        _, _, head_e = q.shape
        scale: Any = math.sqrt(1.0 / float(head_e))
        if scale_override is not None:
            scale = scale_override if isinstance(scale_override, Tensor) else float(scale_override)
        # The recorded (B, H, N, E) views are the tensors the computation continues from (views
        # do not change values), so gradient hooks on them see the real gradients.
        q4, k4, v4 = (_heads_view(t, bsz, num_heads) for t in (q, k, v))
        q, k, v = (t.flatten(0, 1) for t in (q4, k4, v4))
        if isinstance(scale, Tensor):
            q_scaled = (q4 * scale.reshape(-1, 1, 1)).flatten(0, 1)  # per head of (B, H, L, E)
        else:
            q_scaled = q * scale
        if is_causal and attn_mask is None:
            raise AssertionError("FIXME: is_causal not implemented for need_weights")
        if attn_mask is not None:
            attn_output_weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            attn_output_weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        del q_scaled
        attn_output_weights = F.softmax(attn_output_weights, dim=-1)
        if dropout_p > 0.0:
            attn_output_weights = F.dropout(attn_output_weights, p=dropout_p)
        out4 = _heads_view(torch.bmm(attn_output_weights, v), bsz, num_heads)
        if emit is not None:
            bias = None
            if attn_mask is not None:
                bias = attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else _heads_view(attn_mask, bsz, num_heads)
            recorded = scale.detach() if isinstance(scale, Tensor) else scale
            rerun = rerun_rows(q4, k4, v4, bias, False, recorded) if dropout_p > 0.0 else None
            emit(AttentionCall(q=q4, k=k4, v=v4, scale=recorded, bias=bias, output=out4, kind="mha", rerun=rerun))
        attn_output = out4.flatten(0, 1).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        attn_output = F.linear(attn_output, out_proj_weight, out_proj_bias)
        attn_output = attn_output.view(tgt_len, bsz, attn_output.size(1))
        attn_output_weights = attn_output_weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            attn_output_weights = attn_output_weights.mean(dim=1)
        if not is_batched:
            attn_output = attn_output.squeeze(1)
            attn_output_weights = attn_output_weights.squeeze(0)
        return attn_output, attn_output_weights

    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
    q = q.view(bsz, num_heads, tgt_len, head_dim)
    k = k.view(bsz, num_heads, src_len, head_dim)
    v = v.view(bsz, num_heads, src_len, head_dim)
    own_scale = 1.0 / math.sqrt(head_dim)
    recorded: Any = own_scale
    if scale_override is None:
        attn_output = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
    elif isinstance(scale_override, Tensor):
        # SDPA takes one float: scale q per head by s_h / s_own and keep SDPA's own scale.
        q_run = q * (scale_override.reshape(-1, 1, 1) / own_scale)
        attn_output = F.scaled_dot_product_attention(q_run, k, v, attn_mask, dropout_p, is_causal)
        recorded = scale_override.detach()
    else:
        recorded = float(scale_override)
        attn_output = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=recorded)
    if emit is not None:
        rerun = rerun_rows(q, k, v, attn_mask, bool(is_causal), recorded) if dropout_p > 0.0 else None
        emit(AttentionCall(
            q=q, k=k, v=v, scale=recorded, bias=attn_mask, causal=bool(is_causal),
            output=attn_output, kind="mha", rerun=rerun,
        ))
    attn_output = attn_output.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    attn_output = F.linear(attn_output, out_proj_weight, out_proj_bias)
    attn_output = attn_output.view(tgt_len, bsz, attn_output.size(1))
    if not is_batched:
        attn_output = attn_output.squeeze(1)
    return attn_output, None


_SIGNATURE = inspect.signature(mha_forward)
_KNOWN = frozenset(name for name in _SIGNATURE.parameters if name not in ("emit", "scale_override"))


def mirrors(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether :func:`mha_forward` understands this call's arguments (else PyTorch's own runs)."""
    return len(args) <= len(_KNOWN) and _KNOWN.issuperset(kwargs)


def _fused_funcs() -> Tuple[Callable[..., Any], ...]:
    names = ("_native_multi_head_attention", "_transformer_encoder_layer_fwd")
    return tuple(getattr(torch, n) for n in names if hasattr(torch, n))


_FUSED = _fused_funcs()


_MHA_PARAMS = ("query", "key", "value", "embed_dim_to_check", "num_heads")  # the leading ones we read


def lookup_mha(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[overrides.Override]:
    """:func:`probe.experiment.overrides.lookup` for one ``F.multi_head_attention_forward`` call (``None``:
    not consulted). Variants (module overrides) do not reach ``nn.MultiheadAttention``."""
    if not overrides.rules_active():
        return None
    bound = dict(zip(_MHA_PARAMS, args))
    bound.update(kwargs)
    q, embed_dim, heads = bound.get("query"), bound.get("embed_dim_to_check"), bound.get("num_heads")
    if not isinstance(q, Tensor) or not isinstance(embed_dim, int) or not isinstance(heads, int) or heads <= 0:
        return None
    return overrides.lookup(heads, embed_dim // heads, q, variants=False)


class MHAFrontEnd(FrontEnd):
    """Intercepts ``F.multi_head_attention_forward`` (every ``nn.MultiheadAttention`` call).

    The site is the innermost module running, i.e. the ``nn.MultiheadAttention`` itself
    (``layers.0.self_attn``), or the custom module calling the function directly. Overrides
    (``probe.scaling``) run as :func:`mha_forward` with ``scale_override``; the SDPA call inside
    it is never rewritten again. ``emit=None``: apply overrides, record nothing.
    """

    funcs: Tuple[Callable[..., Any], ...] = (F.multi_head_attention_forward,) + _FUSED
    fused_types = mha_fused.FUSED_MODULES  # runs_fused claims only these
    applies_overrides = True

    def __init__(self) -> None:
        self._warn_once = WarnOnce()
        self.pending: List[str] = []  # fused kernels called directly, named at the next module boundary
        self._layer_kwargs: Dict[int, Dict[str, Any]] = {}  # a claimed encoder's masks for its layers

    def handle(self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
               emit: Optional[Emit]) -> Any:
        if func in _FUSED:
            if emit is not None:
                self.pending.append(getattr(func, "__name__", repr(func)))  # warned by drain, naming the site
                self.held()
            return func(*args, **kwargs)
        change = lookup_mha(args, kwargs)
        if not mirrors(args, kwargs):
            if emit is not None:
                self._warn_once(f"signature:{sorted(kwargs)}", (
                    "probe: F.multi_head_attention_forward was called with arguments this version of probe "
                    f"does not know ({sorted(set(kwargs) - _KNOWN)}); it runs unchanged (probe.scaling "
                    "does not reach it) and is NOT measured."
                ))
            if change is None:
                return func(*args, **kwargs)
            with overrides.applying():
                return func(*args, **kwargs)
        if change is None:
            return func(*args, **kwargs) if emit is None else mha_forward(*args, **kwargs, emit=emit)
        with overrides.applying():  # consulted (even when unchanged): never applied again below
            if change.scale is None and emit is None:
                return func(*args, **kwargs)
            return mha_forward(*args, **kwargs, emit=emit, scale_override=change.scale)

    def overrides_active(self) -> bool:
        return overrides.rules_active()  # variants do not reach nn.MultiheadAttention

    def has_pending(self) -> bool:
        return bool(self.pending)

    def runs_fused(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                   parent: Optional[nn.Module] = None, inside: bool = False) -> bool:
        """Whether ``module`` runs outside the capture mode: a nested-tensor input (only PyTorch's
        fused path accepts it), or a call PyTorch may run on a fused path (eval, no gradient);
        :func:`probe.capture.mha_fused.claims`. :meth:`measure_fused` then measures it."""
        return mha_fused.claims(module, args, parent, inside)

    def measure_fused(self, module: nn.Module, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                      mode: Any, named_site: NamedSite, parent: Optional[nn.Module] = None) -> None:
        """Record the attention of a module claimed by :meth:`runs_fused` (an encoder layer at its
        ``self_attn`` child's name, as on the unfused path); a failure is warned, never raised."""
        try:
            if isinstance(module, nn.TransformerEncoder):
                self._layer_kwargs[id(module)] = mha_fused.encoder_layer_kwargs(module, args, kwargs)
            elif isinstance(module, nn.TransformerEncoderLayer) and not kwargs:
                kwargs = self._layer_kwargs.get(id(parent), {})
            mha_fused.measure(module, name, args, kwargs, mode, named_site)
        except (RuntimeError, ValueError, TypeError, AssertionError) as err:  # PyTorch's own run raises it
            self._warn_once(f"fused:{name}", f"probe: could not measure the fused attention of {name!r}: {err}")

    def drain(self, emit: Emit, site: str) -> None:
        """Warn once per site and kernel about fused kernels called directly (not measured)."""
        kernels, self.pending = self.pending, []
        for kernel in dict.fromkeys(kernels):
            self._warn_once(f"{site}:{kernel}", (
                f"probe: torch.{kernel} (a fused attention kernel) was called directly at site {site!r}; "
                "it runs unchanged and its attention is NOT measured. Call the nn.MultiheadAttention / "
                "nn.TransformerEncoderLayer module instead."
            ))

    def reset(self) -> None:
        self.pending, self._layer_kwargs = [], {}


KWARGS_HOOKED.append(mha_fused.kwargs_hooked)  # the modules MHAFrontEnd.runs_fused reads the keyword arguments of
