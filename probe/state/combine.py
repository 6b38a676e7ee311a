"""How state combines: one declaration, one combine, for calls, windows and ranks.

A site's state is a dict of fields (``{field}@{scale}``, one value per head). How each field
combines is declared once, by its metric in the catalogue (:func:`probe.metrics.field_reduction`),
as one of four kinds:

==========  ====================================  ============================  ==========
kind        two parts (earlier ``a``, later ``b``)  k parts (ranks)               identity
==========  ====================================  ============================  ==========
``sum``     ``a + b``                              ``Σ``                         0
``max``     ``maximum(a, b)`` (NaN wins)           ``max``                       −inf
``min``     ``minimum(a, b)`` (NaN wins)           ``min``                       +inf
``moments`` Chan's pair (:func:`chan_pair`)        Chan's k-way (:func:`chan_pool`)  n = 0
``last``    ``b``                                  the highest rank present      (absent)
==========  ====================================  ============================  ==========

Across ranks, :data:`GRAD_STEPS` takes the max instead of the sum (every rank counts the same
shared steps). Everything that combines state goes through this module:

- :func:`combine` / :func:`merge_states`: two states field by field, on tensors (the device
  accumulator, pending state added to the totals);
- :class:`Layout`: many fields packed into one flat vector, grouped by kind, so a window folds into
  the run totals (:meth:`Layout.fold`, numpy or torch) and the ranks' states reduce
  (:meth:`Layout.reduce`) in a dozen vector operations, not a few per field.

``tests/state/test_combine.py`` checks on random states that the three routes agree.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Hashable, List, Literal, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from probe.metrics import field_reduction
from probe.stats.pool import chan_pair, chan_pool

__all__ = ["GRAD_STEPS", "Entry", "Layout", "State", "combine", "kind", "merge_states"]

#: The count of probed steps whose backward reached a site (added once per site and step by the
#: recorder): summed over windows; across ranks the max, since ranks share step numbers. The
#: ``grad_*`` metrics are root mean squares over these steps (probe.state.finalize).
GRAD_STEPS = "grad_steps"

State = Dict[str, Tensor]
Entry = Tuple[Hashable, str, Tuple[int, ...]]  # (site key, field, shape)
Across = Literal["steps", "ranks"]


def kind(field: str, across: Across = "steps") -> str:
    """How ``field`` combines: ``sum``, ``max``, ``min``, ``moments`` or ``last``, over calls and steps
    (``across="steps"``) or over ranks (``"ranks"``: :data:`GRAD_STEPS` takes the max)."""
    if across == "ranks" and field == GRAD_STEPS:
        return "max"
    return field_reduction(field)


def _maximum(a: Any, b: Any) -> Any:
    return np.maximum(a, b) if isinstance(a, np.ndarray) else torch.maximum(a, b)


def _minimum(a: Any, b: Any) -> Any:
    return np.minimum(a, b) if isinstance(a, np.ndarray) else torch.minimum(a, b)


def combine(field: str, a: Tensor, b: Tensor) -> Tensor:
    """Combine two values of ``field`` (``a`` earlier, ``b`` later); moments are ``(3, ...)``
    stacks of (count, mean, M2)."""
    k = kind(field)
    if k == "moments":
        return torch.stack(chan_pair(a[0], a[1], a[2], b[0], b[1], b[2]))
    if k == "max":
        return torch.maximum(a, b)
    if k == "min":
        return torch.minimum(a, b)
    if k == "last":
        return b
    return a + b


def merge_states(into: State, new: State) -> None:
    """Fold ``new`` into ``into`` in place (fields absent from ``into`` are adopted)."""
    for field, value in new.items():
        old = into.get(field)
        into[field] = value if old is None else combine(field, old, value.to(old.dtype))


def _numel(shape: Tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


class Layout:
    """Where each field of an ordered list of entries sits in a flat vector, grouped by kind.

    Args:
        entries: ``(key, field, shape)`` in packing order; a moments field is a ``(3, ...)``
            stack whose rows (count, mean, M2) are consecutive thirds of its slice.
        across: ``"steps"`` (windows into run totals) or ``"ranks"`` (the cross-rank kinds).
    """

    def __init__(self, entries: Sequence[Entry], across: Across = "steps") -> None:
        self.entries: List[Entry] = list(entries)
        positions: Dict[str, List[int]] = {"sum": [], "max": [], "min": [], "last": []}
        moments: List[List[int]] = [[], [], []]
        owner: List[int] = []
        offset = 0
        for i, (_, field, shape) in enumerate(self.entries):
            size = _numel(shape)
            owner += [i] * size
            k = kind(field, across)
            if k == "moments":
                third = size // 3
                for row in range(3):
                    moments[row] += range(offset + row * third, offset + (row + 1) * third)
            else:
                positions[k] += range(offset, offset + size)
            offset += size
        self.size = offset
        as_index = lambda rows: np.asarray(rows, dtype=np.intp)  # noqa: E731
        self.sum, self.max, self.min, self.last = (as_index(positions[k]) for k in ("sum", "max", "min", "last"))
        self.moments = tuple(as_index(rows) for rows in moments)
        self.owner = as_index(owner)  # the entry of each position
        self._torch: Dict[Any, Any] = {}
        self._into: Any = None
        self._into_index: Dict[str, Any] = {}

    def _index(self, name: str, like: Any) -> Any:
        """An index array as ``like`` takes it (numpy, or a cached long tensor on its device)."""
        value = getattr(self, name) if name != "moments" else self.moments
        if isinstance(like, np.ndarray):
            return value
        key = (name, like.device)
        if key not in self._torch:
            convert = lambda a: torch.from_numpy(a).to(torch.long).to(like.device)  # noqa: E731
            self._torch[key] = tuple(convert(a) for a in value) if name == "moments" else convert(value)
        return self._torch[key]

    def identity(self) -> np.ndarray:
        """The packed identity (float64): 0 for sums and moments, −inf for maxima, +inf for minima;
        ``last`` entries are 0 and must be marked absent."""
        out = np.zeros(self.size)
        out[self.max] = -math.inf
        out[self.min] = math.inf
        return out

    def fold(self, totals: Any, window: Any, into: Any = None) -> None:
        """``totals`` (earlier) combined with ``window`` (later), in place, element for element
        the arithmetic of :func:`combine`. ``window`` is a 1-D numpy array or tensor of this
        layout; ``totals`` the same, or a larger vector where ``into`` (a numpy index array, the
        same object on every call) says which position of ``totals`` each window position folds
        into."""
        src = lambda name: self._index(name, window)  # noqa: E731
        if into is None:
            dst = lambda name: self._index(name, totals)  # noqa: E731
        else:
            if self._into is not into:  # compose once: window position -> totals position
                self._into = into
                self._into_index = {k: into[getattr(self, k)] for k in ("sum", "max", "min", "last")}
                self._into_index["moments"] = tuple(into[a] for a in self.moments)
            dst = self._into_index.__getitem__
        with np.errstate(all="ignore"):  # inf - inf, 0 * inf: NaN, as torch gives silently
            to, at = dst("sum"), src("sum")
            totals[to] = totals[to] + window[at]
            to, at = dst("max"), src("max")
            totals[to] = _maximum(totals[to], window[at])
            to, at = dst("min"), src("min")
            totals[to] = _minimum(totals[to], window[at])
            totals[dst("last")] = window[src("last")]
            (n, mean, m2), (wn, wmean, wm2) = dst("moments"), src("moments")
            totals[n], totals[mean], totals[m2] = chan_pair(
                totals[n], totals[mean], totals[m2], window[wn], window[wmean], window[wm2])

    def reduce(self, parts: Tensor, present: Tensor) -> Tensor:
        """Combine ``k`` parts of this layout (``(k, size)``, one per rank) into one ``(size,)``:
        sums add, maxima take the max, minima the min, moments pool by Chan's k-way form, ``last`` takes the
        highest part where its entry is ``present`` (``(k, entries)`` booleans). Absent parts
        must hold the :meth:`identity`."""
        idx = lambda name: self._index(name, parts)  # noqa: E731
        out = parts.new_empty(self.size)
        at = idx("sum")
        out[at] = parts[:, at].sum(0)
        at = idx("max")
        out[at] = parts[:, at].amax(0)
        at = idx("min")
        out[at] = parts[:, at].amin(0)
        at = idx("last")
        if at.numel():
            here = present[:, idx("owner")[at]]
            ranks = torch.arange(parts.shape[0], device=parts.device).unsqueeze(1).expand_as(here)
            last = torch.where(here, ranks, 0).amax(0)
            out[at] = parts[:, at].gather(0, last.unsqueeze(0)).squeeze(0)
        n, mean, m2 = idx("moments")
        out[n], out[mean], out[m2] = chan_pool(parts[:, n], parts[:, mean], parts[:, m2])
        return out
