"""Chan's formula for pooled (count, mean, M2): written once, for torch tensors and numpy arrays.

Every place that pools moments calls one of these two: the rows of a call into heads
(:mod:`probe.stats`), calls and windows into a site's running state and run totals, and ranks
into one state (:mod:`probe.state.combine`). They use only arithmetic and ``where``, so the same
code runs on tensors (any device) and on numpy arrays (the host's totals), element for element.

Both forms add only non-negative terms to ``M2`` (no ``Σx² − n·mean²`` cancellation), and a part
with count 0 contributes nothing, whatever its mean and M2 hold.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

__all__ = ["chan_pair", "chan_pool"]


def _where(cond: Any, a: Any, b: Any) -> Any:
    if isinstance(cond, np.ndarray):
        return np.where(cond, a, b)
    import torch

    return torch.where(cond, a, b)


def _at_least_one(x: Any) -> Any:
    return np.maximum(x, 1.0) if isinstance(x, np.ndarray) else x.clamp(min=1)


def chan_pair(na: Any, ma: Any, m2a: Any, nb: Any, mb: Any, m2b: Any) -> Tuple[Any, Any, Any]:
    """Pool two parts ``a`` (earlier) and ``b`` (later), elementwise.

    ``n = na + nb``, ``mean = ma + δ·nb/n``, ``M2 = M2a + M2b + δ²·na·nb/n`` with ``δ = mb − ma``
    (``n`` clamped to 1 in the divisions: two empty parts stay empty, mean 0). With ``nb = 0``
    the result is ``a`` exactly; with ``na = 0`` and ``ma = 0`` it is ``b`` exactly.
    """
    n = na + nb
    safe = _at_least_one(n)
    delta = mb - ma
    return n, ma + delta * (nb / safe), m2a + m2b + delta * delta * (na * nb / safe)


def chan_pool(n: Any, mean: Any, m2: Any, dims: Any = 0) -> Tuple[Any, Any, Any]:
    """Pool the parts along ``dims`` (an int or a tuple; dim 0: ``k`` parts stacked, the k-way
    form): ``n = Σ nᵢ``, ``mean = Σ nᵢ·meanᵢ / n``, ``M2 = Σ M2ᵢ + Σ nᵢ·(meanᵢ − mean)²``; parts
    with ``nᵢ = 0`` are ignored. The pooled values have ``dims`` removed."""
    total = n.sum(dims)
    some = n > 0
    safe = _at_least_one(total)
    pooled = _where(some, n * mean, 0.0).sum(dims) / safe
    kept = (dims,) if isinstance(dims, int) else tuple(dims)
    back = pooled.reshape(tuple(1 if i in kept or i - len(n.shape) in kept else size for i, size in enumerate(n.shape)))
    spread = _where(some, n * (mean - back) ** 2, 0.0).sum(dims)
    return total, pooled, _where(some, m2, 0.0).sum(dims) + spread
