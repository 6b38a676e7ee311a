"""PyTorch's fused MHA paths under probe: run them unchanged, measure them beside.

In eval without gradients ``nn.MultiheadAttention`` may run ``torch._native_multi_head_attention``,
``nn.TransformerEncoderLayer`` ``torch._transformer_encoder_layer_fwd``, and
``nn.TransformerEncoder`` converts a padded batch with ``src_key_padding_mask`` to a nested tensor
(its outputs at padded positions are then zeros). An active TorchFunctionMode forbids all three
(``has_torch_function``), so under the capture mode they would run the unfused path: outputs
different in the last bits, different at padded positions, and different at valid positions of
whatever reads them (``nn.Transformer``'s decoder attending to a padded memory without
``memory_key_padding_mask``), and a NaN for a fully masked row where the fused kernel gives a
number. So such a module (:func:`may_run_fast`: eval, fast path enabled, no gradient needed, its
stock ``forward``) runs outside the capture mode (:class:`probe.capture.mode.ModuleStack`), bitwise
as without probe, and :func:`measure` records its attention by running probe's MHA mirror
(:func:`probe.capture.mha.mha_forward`) once more on the same arguments under ``no_grad``, with the
capture mode pushed back for that call: the q, k, masks and scale are those of PyTorch's unfused
path (the fused kernel's own q, k agree with them to float rounding). A nested input (only the
fused kernel accepts it) is measured from the module's weights (:func:`nested_self_attention_call`).
An encoder's layers are measured as they run; an encoder layer's ``self_attn`` with it.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.transformer import _detect_is_causal_mask, _get_seq_len

from probe.call import AttentionCall
from probe.experiment import overrides

__all__ = ["FUSED_MODULES", "claims", "encoder_layer_kwargs", "is_nested", "kwargs_hooked", "may_run_fast", "measure",
           "nested_self_attention_call"]

FUSED_MODULES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)
_STOCK = {cls: cls.forward for cls in FUSED_MODULES}
_LAYER_SIG = inspect.signature(nn.TransformerEncoderLayer.forward)
_ENCODER_SIG = inspect.signature(nn.TransformerEncoder.forward)


def is_nested(t: Any) -> bool:
    return isinstance(t, Tensor) and t.is_nested and t.layout == torch.strided


def _stock(module: nn.Module) -> bool:
    """A PyTorch module whose ``forward`` is PyTorch's own (a subclass may add attention of its own)."""
    return any(isinstance(module, cls) and type(module).forward is fwd for cls, fwd in _STOCK.items())


def may_run_fast(module: nn.Module, args: Tuple[Any, ...]) -> bool:
    """Whether PyTorch may take a fused path for this call (necessary conditions only: a module
    claimed in vain runs its unfused path outside the capture mode, bitwise as without probe)."""
    if not _stock(module) or module.training or not torch.backends.mha.get_fastpath_enabled():
        return False
    if overrides.rules_active() or torch.is_autocast_enabled() or torch.compiler.is_compiling():
        return False  # probe.scaling rewrites the call through the mirror; autocast blocks the fast path
    if torch.is_grad_enabled() and (any(isinstance(a, Tensor) and a.requires_grad for a in args)
                                    or any(p.requires_grad for p in module.parameters())):
        return False
    return True


def _layer_attn(module: nn.Module, parent: Optional[nn.Module]) -> bool:
    return isinstance(parent, nn.TransformerEncoderLayer) and parent.self_attn is module


def kwargs_hooked(root: nn.Module) -> List[nn.Module]:
    """The modules claimed by their call's keyword arguments (masks), hooked for them: every
    ``nn.TransformerEncoder`` and ``nn.MultiheadAttention`` but an encoder layer's ``self_attn``. An
    ``nn.TransformerEncoderLayer`` takes its fast path only without hooks on it or its children,
    so its calls are seen without their keyword arguments (claimed for a nested input, or measured
    inside a claimed encoder, whose call gives the layers' masks)."""
    found, layer_attns = [], set()
    for m in root.modules():  # one walk (every sampled step activates the capture)
        if isinstance(m, nn.TransformerEncoderLayer):
            layer_attns.add(id(m.self_attn))
        if isinstance(m, (nn.TransformerEncoder, nn.MultiheadAttention)):
            found.append(m)
    return [m for m in found if not (isinstance(m, nn.MultiheadAttention) and id(m) in layer_attns)]


def claims(module: nn.Module, args: Tuple[Any, ...], parent: Optional[nn.Module], inside: bool) -> bool:
    """Whether ``module`` runs outside the capture mode (``inside``: an ancestor already does, and
    ``module`` is only to be measured)."""
    if not args:
        return False
    if inside:  # a claimed encoder's layers; an encoder layer's self_attn is measured with its layer
        if isinstance(module, nn.TransformerEncoderLayer):
            return _stock(module) and isinstance(parent, nn.TransformerEncoder)
        return _stock(module) and not _layer_attn(module, parent)
    if is_nested(args[0]):
        if isinstance(module, nn.TransformerEncoderLayer):
            return isinstance(module.self_attn, nn.MultiheadAttention)
        return isinstance(module, nn.MultiheadAttention)
    if isinstance(module, nn.TransformerEncoderLayer) or _layer_attn(module, parent):
        return False  # seen without its keyword arguments: the unfused path, under the capture mode
    return may_run_fast(module, args)


def encoder_layer_kwargs(encoder: nn.TransformerEncoder, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The masks ``nn.TransformerEncoder.forward`` passes its layers (a nested input ignores them)."""
    bound = _ENCODER_SIG.bind(encoder, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    src, mask, kpm = a["src"], a["mask"], a["src_key_padding_mask"]
    kpm = F._canonical_mask(mask=kpm, mask_name="src_key_padding_mask", other_type=F._none_or_dtype(mask),
                            other_name="mask", target_type=src.dtype)
    mask = F._canonical_mask(mask=mask, mask_name="mask", other_type=None, other_name="", target_type=src.dtype,
                             check_other=False)
    batch_first = encoder.layers[0].self_attn.batch_first
    is_causal = _detect_is_causal_mask(mask, a["is_causal"], _get_seq_len(src, batch_first))
    return dict(src_mask=mask, src_key_padding_mask=kpm, is_causal=is_causal)


def nested_self_attention_call(mha: nn.MultiheadAttention, x: Tensor) -> AttentionCall:
    """The self-attention PyTorch's fused kernel computes for a nested (ragged) batch ``x``.

    The fused kernels run without autograd and are opaque, so ``q`` and ``k`` are recomputed from
    ``mha``'s packed projection on the zero-padded batch; entries of a sequence beyond its own
    length (padding rows and keys) are masked out. The sequence lengths are nested-tensor
    metadata kept on the host: reading them does not synchronize.

    Args:
        mha: the attention module (packed projection, ``batch_first``: what the fast path requires).
        x: the nested input ``(B, L_i, E)`` the kernel attends over (after ``norm1`` when
            ``norm_first``).
    """
    with torch.no_grad():
        padded = x.to_padded_tensor(0.0)
        bsz, length, _ = padded.shape
        heads, head_dim = mha.num_heads, mha.head_dim
        q, k, v = F.linear(padded, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.reshape(bsz, length, heads, head_dim).transpose(1, 2) for t in (q, k, v))
        lengths = x._nested_tensor_size()[:, 0].to(padded.device, non_blocking=True)
        inside = torch.arange(length, device=padded.device) < lengths.view(-1, 1)  # (B, L)
        mask = (inside.unsqueeze(-1) & inside.unsqueeze(-2)).unsqueeze(1)  # (B, 1, L, L)
    return AttentionCall(q=q, k=k, v=v, scale=1.0 / math.sqrt(head_dim), mask=mask, kind="mha")


@contextlib.contextmanager
def _pushed(mode: Any) -> Any:
    torch._C._push_on_torch_function_stack(mode)
    try:
        with torch.no_grad():
            yield
    finally:
        torch._C._pop_torch_function_stack()


def measure(module: nn.Module, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], mode: Any,
            named_site: Callable[[str], ContextManager[None]]) -> None:
    """Record the attention of a module that runs outside the capture mode (``mode``, whose
    ``emit`` receives the calls). Raises what the mirror raises (the caller warns)."""
    if isinstance(module, nn.TransformerEncoder):
        return  # its layers are measured as they run (with encoder_layer_kwargs)
    x = args[0]
    layer = module if isinstance(module, nn.TransformerEncoderLayer) else None
    mha = module.self_attn if layer is not None else module
    if layer is not None:
        bound = _LAYER_SIG.bind(layer, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if layer.norm_first:
            n = layer.norm1
            x = F.layer_norm(x, n.normalized_shape, n.weight, n.bias, n.eps) if not is_nested(x) else n(x)
        call_args: Tuple[Any, ...] = (x, x, x)
        call_kwargs = dict(attn_mask=a["src_mask"], key_padding_mask=a["src_key_padding_mask"],
                           need_weights=False, is_causal=a["is_causal"])
        site: ContextManager[None] = named_site("self_attn" if name == "root" else f"{name}.self_attn")
    else:
        call_args, call_kwargs, site = args, kwargs, contextlib.nullcontext()
    with site:
        if is_nested(x):  # only the fused kernel runs it: from the weights
            if mha._qkv_same_embed_dim and mha.in_proj_bias is not None and (layer is not None or len(args) > 1 and args[1] is x):
                mode.emit(nested_self_attention_call(mha, x))
            return
        with _pushed(mode):
            nn.MultiheadAttention.forward(mha, *call_args, **call_kwargs)  # the mirror records it
