"""Front end for ``F.scaled_dot_product_attention``."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.call import AttentionCall
from probe.intervene import sdpa_change

__all__ = ["SDPAFrontEnd", "sdpa_call"]

_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _bind(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    bound = dict(zip(_PARAMS, args))
    bound.update(kwargs)
    return bound


def _to_4d(t: Tensor) -> Tensor:
    # SDPA takes (N, ..., H, L, E); a 3-D input has no head dim: one head.
    if t.dim() == 3:
        return t.unsqueeze(1)
    if t.dim() > 4:
        return t.reshape(-1, *t.shape[-3:])
    return t


def sdpa_call(args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Optional[Tensor]) -> Optional[AttentionCall]:
    """Normalize one SDPA call's arguments; ``None`` when it is not a tensor call we understand."""
    b = _bind(args, kwargs)
    q, k, v = b.get("query"), b.get("key"), b.get("value")
    if not all(isinstance(t, Tensor) for t in (q, k, v)) or q.dim() < 3:
        return None
    q4, k4, v4 = _to_4d(q), _to_4d(k), _to_4d(v)
    if q4.shape[1] % k4.shape[1]:
        return None  # SDPA itself has rejected this call already
    mask = b.get("attn_mask")
    bias = None
    if isinstance(mask, Tensor) and mask.dtype != torch.bool:
        bias, mask = mask, None
    elif not isinstance(mask, Tensor):
        mask = None
    scale = b.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])  # SDPA's default, 1/sqrt(E)
    out = _to_4d(output) if isinstance(output, Tensor) and output.dim() >= 3 else output
    return AttentionCall(
        q=q4, k=k4, v=v4, scale=scale, bias=bias, mask=mask, causal=bool(b.get("is_causal", False)),
        output=out, kind="sdpa",
    )


class SDPAFrontEnd:
    """Intercepts ``F.scaled_dot_product_attention``: the model's own call runs unchanged,
    unless an intervention (``probe.scaling``, a variant) rewrites it; then the rewritten call
    runs and is recorded with its effective scale."""

    funcs = (F.scaled_dot_product_attention,)
    applies_overrides = True  # see CaptureMode.consults_overrides

    def handle(
        self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
        emit: Callable[[AttentionCall], None],
    ) -> Any:
        change = sdpa_change(args, kwargs)  # None unless probe.scaling / a variant applies here
        if change is not None:
            output = change.run(func)
            args, kwargs = change.record_args, change.record_kwargs
        else:
            output = func(*args, **kwargs)
        call = sdpa_call(args, kwargs, output)
        if call is not None:
            emit(call)
        return output
