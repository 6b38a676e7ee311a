"""Provenance of ``nn.MultiheadAttention``: its projections run inside one torch function.

``F.multi_head_attention_forward`` computes q and k from the module's packed ``in_proj_weight``
(and ``in_proj_bias``) inside one call, where the op-by-op trace of
:mod:`probe.capture.provenance` cannot follow them; but the layout is torch's own: q is
``x·W[0:E]ᵀ + b[0:E]``, k is ``x·W[E:2E]ᵀ + b[E:2E]``, query head ``h`` the rows
``h·d … h·d+d-1`` of each block. :func:`mha_site` gives those rows for a site whose module is an
``nn.MultiheadAttention`` in that layout; separate projections (``kdim`` / ``vdim`` other than
``embed_dim``) and a learned key bias (``add_bias_kv``, an extra key the rows do not make) are
refused. The trace still counts the weight's uses: a module called twice per forward, or a weight
also used by another op, is refused when the site is confirmed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from probe.call import AttentionCall

__all__ = ["mha_site"]


def mha_site(module: Optional[nn.Module], call: AttentionCall, new_source: Callable[..., Any],
             pending: Callable[..., Any], refusal: Callable[[str], Any]) -> Union[Any, None]:
    """The pending site of an ``nn.MultiheadAttention`` call, a refusal, or ``None`` when ``call``
    is not one (``new_source(owner, bias, layout, features)``, ``pending(...)`` and ``refusal(why)``
    are the trace's constructors)."""
    if call.kind != "mha" or not isinstance(module, nn.MultiheadAttention):
        return None
    if not module._qkv_same_embed_dim or module.in_proj_weight is None:
        return refusal("nn.MultiheadAttention with separate q, k, v projections (kdim or vdim other than "
                       "embed_dim) is not modelled")
    if module.bias_k is not None:
        return refusal("nn.MultiheadAttention with add_bias_kv: its learned key is not made by the rows")
    e, heads = module.embed_dim, module.num_heads
    if call.q.shape[1] != heads or call.k.shape[1] != heads:
        return refusal(f"nn.MultiheadAttention recorded with {call.q.shape[1]} heads, the module has {heads}")
    source = new_source((module, "in_proj_weight"), module.in_proj_bias, "rows", 3 * e)
    if source is None:
        return refusal("nn.MultiheadAttention's in_proj_bias is not its own parameter")
    head = torch.arange(e) // (e // heads)
    q_of = torch.full((3 * e,), -1, dtype=torch.long)
    k_of = torch.full((3 * e,), -1, dtype=torch.long)
    q_of[:e], k_of[e:2 * e] = head, head
    return pending(source, source, q_of, k_of, "nn.MultiheadAttention: in_proj_weight rows [0, E) (q), "
                   "[E, 2E) (k)", torch.arange(heads))
