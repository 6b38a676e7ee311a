"""Running per-site state on the tensors' device, packed into one tensor for a flush.

A site's state is a dict of named tensors with one value per head, ``{field}@{scale}``; fields
combine as :mod:`probe.state.combine` declares (from the metric catalogue), so the device
accumulator, the host totals and the cross-rank reduction share one rule:

==================  ==========  ===============================================
field               kind        content
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

from probe.state.combine import GRAD_STEPS, Entry, State, merge_states

__all__ = ["GRAD_STEPS", "Accumulator", "Entries", "State", "unpack"]

#: What :meth:`Accumulator.pack` packed, in order: ``(site key, field, shape)``.
Entries = List[Entry]


class Accumulator:
    """Per-site running state on the tensors' device, packed into one tensor for a flush.

    Adding a call's fields is a handful of tiny per-head tensor ops: no host synchronization.
    """

    def __init__(self) -> None:
        self.states: Dict[Hashable, State] = {}

    def __bool__(self) -> bool:
        return bool(self.states)

    def add(self, key: Hashable, fields: State) -> None:
        """Fold ``fields`` into ``key``'s state, all or nothing: a field that cannot be combined
        (another shape) raises and leaves the state as it was."""
        merged = dict(self.states.get(key, {}))
        merge_states(merged, fields)
        self.states[key] = merged

    def pack(self) -> Tuple[Tensor, Entries]:
        """Flatten every field of every site into one tensor (the one device→host transfer)."""
        # comprehensions, not a loop of appends: a flush packs every field of every site
        layout: Entries = [(key, field, tuple(value.shape)) for key, state in self.states.items()
                           for field, value in state.items()]
        if not layout:
            return torch.zeros(0, dtype=torch.float64), layout
        parts: List[Tensor] = [value if value.dim() == 1 else value.reshape(-1)
                               for state in self.states.values() for value in state.values()]
        dtype = parts[0].dtype  # the first field's: any other is converted to it
        if any(part.dtype != dtype for part in parts):
            parts = [part.to(dtype) for part in parts]
        return torch.cat(parts), layout

    def reset(self) -> None:
        self.states = {}


def unpack(flat: Tensor, layout: Entries) -> Dict[Hashable, State]:
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
