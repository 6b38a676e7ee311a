"""Front end for FlexAttention (``torch.nn.attention.flex_attention``).

``flex_attention`` is a plain Python function; what reaches the capture TorchFunctionMode is its
higher-order operator (``torch._higher_order_ops.flex_attention``), called from inside a
``torch.compile(fullgraph=True)`` region even in eager mode. Dynamo traces the mode's handler
there, so the handler only records the call (a list append, which Dynamo replays after the
compiled region with the real tensors); :meth:`FlexFrontEnd.drain`, run when the calling module's
forward returns, turns each record into an :class:`~probe.call.AttentionCall` of kind ``"flex"``:

* ``q``, ``k``, ``v`` as passed (``k``/``v`` may have fewer heads: grouped-query attention);
* ``scale`` as flex used it (its default is ``1/sqrt(E)``);
* ``mask``: the block mask made elementwise, ``(partial block & mask_mod) | full block``, at the
  block mask's own batch/head sizes (1 where it broadcasts);
* ``bias``: the effect of ``score_mod`` at the actual scale, ``score_mod(σR) - σR`` (``-inf``
  where it masks), evaluated with the same ``vmap`` over ``(b, h, q_idx, kv_idx)`` as PyTorch's
  ``create_mask``.

Pitfalls: ``actual`` is exact for any ``score_mod``; the counterfactual scales (``unscaled``,
``standard``, sweeps) treat ``score_mod`` as additive, which is exact for ALiBi, relative position
biases and masks, and an approximation for soft-capping or temperature. The mask and bias are
materialized at ``(B, H, L, S)`` (as flex's own unfused eager path materializes its scores), and
``q @ k.T`` is computed once more for the bias. Under a user's own ``torch.compile`` of the whole
model the recorded call is replayed only if Dynamo keeps the side effect; see docs/models.md.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from probe.call import AttentionCall
from probe.capture.frontend import Emit, FrontEnd
from probe.once import WarnOnce

__all__ = ["FlexFrontEnd", "flex_call"]

def _hop() -> Optional[Callable[..., Any]]:
    try:
        from torch._higher_order_ops.flex_attention import flex_attention
    except ImportError:  # a PyTorch without FlexAttention
        return None
    return flex_attention


def _is_identity(score_mod: Any) -> bool:
    return score_mod is None or getattr(score_mod, "__name__", "") == "_identity" and getattr(
        score_mod, "__module__", "").startswith("torch.nn.attention")


def _is_noop(mask_mod: Any) -> bool:
    return getattr(mask_mod, "__name__", "") == "noop_mask" and getattr(
        mask_mod, "__module__", "").startswith("torch.nn.attention")


def _vmapped(fn: Callable[..., Tensor], score: bool) -> Callable[..., Tensor]:
    """``fn`` over the (b, h, q_idx, kv_idx) grid, the way PyTorch's ``create_mask`` maps it."""
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv

    return _vmap_for_bhqkv(fn, prefix=(0,) if score else ())


def _grid(b: int, h: int, length: int, keys: int, device: torch.device) -> Tuple[Tensor, ...]:
    return tuple(torch.arange(n, device=device) for n in (b, h, length, keys))


def _blocks_dense(num: Tensor, indices: Tensor, n_blocks: int) -> Tensor:
    """``(..., q_blocks, n_blocks)`` bool: which kv blocks each query block visits."""
    keep = torch.arange(indices.shape[-1], device=indices.device) < num.unsqueeze(-1)
    slots = max(n_blocks, int(indices.shape[-1]))
    dense = torch.zeros(*indices.shape[:-1], slots + 1, dtype=torch.bool, device=indices.device)
    dense.scatter_(-1, torch.where(keep, indices.long(), slots), True)  # masked slots go to the spare
    return dense[..., :n_blocks]


def _element_mask(block: Tuple[Any, ...], length: int, keys: int, device: torch.device) -> Optional[Tensor]:
    """``(Bm, Hm, L, S)`` validity from a flattened ``BlockMask.as_tuple()``; ``None``: all valid."""
    kv_num, kv_idx, full_num, full_idx = block[2], block[3], block[4], block[5]
    q_block, kv_block, mask_mod = int(block[-3]), int(block[-2]), block[-1]
    n_kv = math.ceil(keys / kv_block)
    rows = torch.arange(length, device=device) // q_block
    cols = torch.arange(keys, device=device) // kv_block

    def expand(dense: Tensor) -> Tensor:
        return dense.index_select(-2, rows.clamp(max=dense.shape[-2] - 1)).index_select(-1, cols)

    partial = expand(_blocks_dense(kv_num, kv_idx, n_kv))
    if not _is_noop(mask_mod):
        bm, hm = partial.shape[0], partial.shape[1]
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

        with TransformGetItemToIndex():  # as create_mask: tensor[idx] inside the mask_mod
            partial = partial & _vmapped(mask_mod, score=False)(*_grid(bm, hm, length, keys, device))
    if full_num is not None and full_idx is not None:
        partial = partial | expand(_blocks_dense(full_num, full_idx, n_kv))
    return partial


def flex_call(args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> Optional[AttentionCall]:
    """Normalize one call of flex's operator ``(q, k, v, score_mod, block_mask, scale, ...)``."""
    names = ("query", "key", "value", "score_mod", "block_mask", "scale")
    bound = dict(zip(names, args))
    bound.update({n: kwargs[n] for n in names if n in kwargs})
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    if not all(isinstance(t, Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None
    batch, heads, length, _ = q.shape
    keys = k.shape[2]
    scale = float(bound["scale"]) if bound.get("scale") is not None else 1.0 / math.sqrt(q.shape[-1])
    out = output[0] if isinstance(output, (tuple, list)) else output
    with torch.no_grad():
        mask = None
        block = bound.get("block_mask")
        if isinstance(block, tuple) and len(block) >= 9:
            mask = _element_mask(block, length, keys, q.device)
        bias = None
        score_mod = bound.get("score_mod")
        if not _is_identity(score_mod):
            groups = heads // k.shape[1]
            kk = k.repeat_interleave(groups, dim=1) if groups > 1 else k
            scores = (q.float() @ kk.float().transpose(-1, -2)) * scale
            from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

            with TransformGetItemToIndex():
                modded = _vmapped(score_mod, score=True)(scores, *_grid(batch, heads, length, keys, q.device))
            bias = modded.float() - scores
    return AttentionCall(q=q, k=k, v=v, scale=scale, bias=bias, mask=mask, output=out, kind="flex")


class FlexFrontEnd(FrontEnd):
    """Intercepts FlexAttention's operator; measures each call when its module returns."""

    funcs: Tuple[Callable[..., Any], ...] = tuple(f for f in (_hop(),) if f is not None)
    traceable = True  # handle() runs while Dynamo traces flex's compiled region

    def __init__(self) -> None:
        self.pending: List[Tuple[Tuple[Any, ...], Dict[str, Any], Any]] = []
        self._warn_once = WarnOnce()

    def handle(self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
               emit: Optional[Emit]) -> Any:
        # Traced by Dynamo inside flex's compiled region: keep to one call and one list append.
        output = func(*args, **kwargs)
        self.pending.append((args, kwargs, output))
        self.held()
        return output

    def has_pending(self) -> bool:
        return bool(self.pending)

    def drain(self, emit: Emit, site: str) -> None:
        """Measure the recorded calls (outside any compiled region and outside the capture mode).

        ``site`` is the module whose forward just returned: the one that issued the calls.
        """
        pending, self.pending = self.pending, []
        for args, kwargs, output in pending:
            try:
                call = flex_call(args, kwargs, output)
            except Exception as err:  # noqa: BLE001 - an unusual score_mod never breaks the model
                call = None
                reason = f"{type(err).__name__}: {err}"
            else:
                reason = "its arguments were not understood"
            if call is None:
                self._warn_once(f"{site}:{reason}", f"probe: the FlexAttention call at site {site!r} was NOT measured: {reason}")
                continue
            emit(call)

    def reset(self) -> None:
        """Forget records of a forward that ended without its module returning (an exception)."""
        self.pending = []
