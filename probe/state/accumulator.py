"""Running per-site state: how each field combines across calls, steps and ranks.

A site's state is a dict of named tensors with one value per head, ``{field}@{scale}``. How a
field combines is declared once, by its metric in the catalogue
(:func:`probe.metrics.field_reduction`), so the device accumulator, the host totals and the
cross-rank reduction share one rule:

==================  ==========  ===============================================
field               reduction   content
==================  ==========  ===============================================
``logit@{s}``       moments     stack of (count, mean, M2) of σR over valid logits
``logit_max@{s}``   max         max of σR
``scale``           last        the actual scale per head (host side, for info)
anything else       sum         counts and sums (rows, entropy@s, grad_*_sq, ...)
==================  ==========  ===============================================
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Tuple

import torch
from torch import Tensor

from probe.metrics import field_reduction
from probe.stats.functional import combine_moments

__all__ = ["GRAD_STEPS", "Accumulator", "State", "combine", "merge_states", "rank_reduction", "reduction", "unpack"]

#: The count of probed steps whose backward reached a site (added once per site and step by the
#: recorder): summed over windows; across ranks the max, since ranks share step numbers. The
#: ``grad_*`` metrics are root mean squares over these steps (probe.state.finalize).
GRAD_STEPS = "grad_steps"

State = Dict[str, Tensor]
Layout = List[Tuple[Hashable, str, Tuple[int, ...]]]


def reduction(field: str) -> str:
    """The reduction of a field (:func:`probe.metrics.field_reduction`): ``moments``, ``max``,
    ``last`` or ``sum``."""
    return field_reduction(field)


def rank_reduction(field: str) -> str:
    """How a field combines across ranks: as across calls and steps, except :data:`GRAD_STEPS`
    (max: every rank counts the same shared steps)."""
    return "max" if field == GRAD_STEPS else reduction(field)


def combine(field: str, a: Tensor, b: Tensor) -> Tensor:
    """Combine two values of ``field`` (``a`` earlier, ``b`` later)."""
    kind = reduction(field)
    if kind == "moments":
        return combine_moments(a, b)
    if kind == "max":
        return torch.maximum(a, b)
    if kind == "last":
        return b
    return a + b


def merge_states(into: State, new: State) -> None:
    """Fold ``new`` into ``into`` in place (fields absent from ``into`` are adopted)."""
    for field, value in new.items():
        old = into.get(field)
        into[field] = value if old is None else combine(field, old, value.to(old.dtype))


class Accumulator:
    """Per-site running state on the tensors' device, packed into one tensor for a flush.

    Adding a call's fields is a handful of tiny per-head tensor ops: no host synchronization.
    """

    def __init__(self) -> None:
        self.states: Dict[Hashable, State] = {}

    def __bool__(self) -> bool:
        return bool(self.states)

    def add(self, key: Hashable, fields: State) -> None:
        merge_states(self.states.setdefault(key, {}), fields)

    def pack(self) -> Tuple[Tensor, Layout]:
        """Flatten every field of every site into one tensor (the one device→host transfer)."""
        parts: List[Tensor] = []
        layout: Layout = []
        dtype = None
        for key, state in self.states.items():
            for field, value in state.items():
                dtype = dtype or value.dtype
                parts.append(value.reshape(-1).to(dtype))
                layout.append((key, field, tuple(value.shape)))
        if not parts:
            return torch.zeros(0, dtype=torch.float64), layout
        return torch.cat(parts), layout

    def reset(self) -> None:
        self.states = {}


def unpack(flat: Tensor, layout: Layout) -> Dict[Hashable, State]:
    """Inverse of :meth:`Accumulator.pack` (on whatever device ``flat`` is)."""
    out: Dict[Hashable, State] = {}
    offset = 0
    for key, field, shape in layout:
        size = 1
        for dim in shape:
            size *= dim
        out.setdefault(key, {})[field] = flat[offset : offset + size].reshape(shape)
        offset += size
    return out
