"""The QK-Clip rule (Kimi K2's MuonClip) and its application to the weights a site's q and k come from.

For a head ``h`` whose max logit ``S_h = max σ·q·kᵀ`` exceeded ``τ``, the published rule scales the
head's query and key projections each by ``√γ_h``, ``γ_h = τ / S_h``, so that its logits are
multiplied by ``γ_h`` and the max becomes ``τ``; heads at or below ``τ`` are untouched.

**Grouped kv heads (GQA, MQA).** A kv head ``g`` is shared by the query heads ``h`` of its group;
scaling it changes every one of their logits. probe scales the kv head by
``b_g = √(max_{h∈g} γ_h)`` (the factor of the group's *least* clipped head: ``1`` as soon as one
head of the group is at or below τ) and each query head by ``a_h = γ_h / b_g``, so that
``a_h·b_g = γ_h`` for every head of the group: each clipped head lands on τ, each other head is
unchanged, and nothing is ever scaled up. With one query head per kv head this is the published
``a_h = b_h = √γ_h``; with a key shared by every head (MQA) it is Kimi K2's treatment of MLA's
shared rotary key (the key is left alone, the query takes the whole factor) unless every head
needs clipping.

**What is scaled.** The rows (``nn.Linear``), columns (GPT-2's ``Conv1D``) or gain entries (a
per-head QK-norm gain) that :mod:`probe.capture.provenance` traced, and the bias entries of the
same features. Entries outside the site's heads are multiplied by exactly ``1.0`` (bitwise
unchanged). A parameter sharded by FSDP2 (a ``DTensor``) is scaled in place on each rank's
shard, at the shard's global offset.

Pitfall: a non-finite ``S`` (NaN, inf) is never a reason to scale: ``τ / inf = 0`` would erase
the head. Such heads keep their weights and are reported.
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple, Union

import torch
from torch import Tensor, nn

from probe.capture.provenance import Rows, SiteProvenance

__all__ = ["factors", "gamma", "scale_site"]


def gamma(top: Tensor, tau: float) -> Tensor:
    """``γ = τ / S`` where ``S > τ`` and finite, else ``1`` (float32, ``S``'s shape)."""
    top = top.float()
    clip = torch.isfinite(top) & (top > tau)
    return torch.where(clip, tau / torch.where(clip, top, 1.0), 1.0)


def factors(top: Tensor, tau: float, kv_of: Union[int, Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """``(γ, a, b)``: the logit factor per query head, the query factor ``a`` per query head and the
    key factor ``b`` per kv head, with ``a_h·b_g = γ_h`` (see the module docstring). ``kv_of``: the
    kv head each query head reads (a tensor), or the number of kv heads (query head ``h`` then
    reads ``h // (H // kv_heads)``). Exactly ``1.0`` where nothing is clipped."""
    g = gamma(top, tau)
    heads = g.shape[0]
    if isinstance(kv_of, int):
        kv_of = torch.arange(heads, device=g.device) // (heads // kv_of)
    kv_of = kv_of.to(g.device)
    groups = int(kv_of.max()) + 1 if heads else 0
    # exactly 1 where a head of the group is not clipped (sqrt(1) = 1)
    b = torch.zeros(groups, device=g.device).scatter_reduce(0, kv_of, g, "amax", include_self=False).sqrt()
    a = torch.where(g == 1.0, 1.0, g / b[kv_of])
    return g, a, b


def _per_feature(rows: Rows, per_head: Tensor, device: torch.device) -> Tensor:
    head_of = rows.head_of.to(device)
    return torch.where(head_of >= 0, per_head.to(device)[head_of.clamp(min=0)], 1.0)


def _shaped(rows: Rows, f: Tensor, param: Tensor, is_bias: bool) -> Tensor:
    """The factor of each entry of ``param`` (broadcastable to its global shape)."""
    if is_bias or rows.layout == "gain":
        return f.view(param.shape)
    return f.view(-1, 1) if rows.layout == "rows" else f.view(1, -1)


def _apply(param: nn.Parameter, factor: Tensor) -> None:
    """``param *= factor`` in place; on a DTensor (FSDP2) on the local shard, at its global offset."""
    placements = getattr(param, "placements", None)
    if placements is None:
        param.data.mul_(factor)  # in the parameter's dtype; a factor of 1.0 leaves an entry bit for bit
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, placements)
    local = param._local_tensor if hasattr(param, "_local_tensor") else param.to_local()
    for dim, (size, start) in enumerate(zip(local_shape, offset)):
        if factor.shape[dim] > 1:
            factor = factor.narrow(dim, start, size)
    if local.numel():
        local.mul_(factor)


@torch.no_grad()
def scale_site(site: SiteProvenance, a: Tensor, b: Tensor) -> None:
    """Scale the traced entries of ``site``: query head ``h`` by ``a[h]``, kv head ``g`` by ``b[g]``
    (and their bias entries alike). Entries of other heads and features: times exactly 1.0."""
    per_param: Dict[Tuple[int, str], Tuple[nn.Module, str, Rows, List[Tensor]]] = {}
    for rows, per_head in ((site.q, a), (site.k, b)):
        module = rows.module()
        if module is None:
            continue
        for attr in (rows.weight, rows.bias):
            if attr is None:
                continue
            param = module._parameters[attr]
            f = _per_feature(rows, per_head, param.device)
            key = (id(module), attr)
            if key in per_param:
                per_param[key][3].append(f)
            else:
                per_param[key] = (module, attr, rows, [f])
    for module, attr, rows, parts in per_param.values():
        param = module._parameters[attr]
        f = parts[0] if len(parts) == 1 else math.prod(parts[1:], start=parts[0])  # q and k of one fused weight
        _apply(param, _shaped(rows, f, param, attr == rows.bias))
