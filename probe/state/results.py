"""Results that outlive the profiler: run totals per site and the :class:`~probe.summary.Summary`.

The writer folds each flushed window of per-site state into the run totals
(:meth:`Results.add_states`, on a background thread); :meth:`Results.summary` builds the run
summary from the totals plus any state not flushed yet.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from torch import Tensor

from probe.state.accumulator import State, merge_states, reduction, unpack
from probe.state.finalize import finalize
from probe.summary import Summary

__all__ = ["Results", "pending_states", "step_ends"]

Info = Dict[str, Any]


Field = Tuple[str, str, Tuple[int, ...]]  # (site name, state field, shape)
_Index = Dict[Tuple[str, str], Tuple[int, Tuple[int, ...]]]  # (site name, field) -> (offset, shape)


class _Plan:
    """Where the values of one window layout go in the flat totals, grouped by how each combines
    (:func:`probe.state.accumulator.reduction`): a window folds in a dozen array operations
    instead of a few tensor operations per field."""

    def __init__(self, fields: Sequence[Field], index: _Index) -> None:
        flat: Dict[str, Tuple[List[int], List[int]]] = {k: ([], []) for k in ("sum", "max", "last")}
        moments: List[Tuple[List[int], List[int]]] = [([], []) for _ in range(3)]  # count, mean, M2
        offset = 0
        for name, field, shape in fields:
            size = math.prod(shape)
            at, have = index[(name, field)]
            if have != shape:
                raise ValueError(f"site {name!r} field {field!r}: shape {shape} in this window, {have} in the totals")
            kind = reduction(field)
            if kind == "moments":  # a (3, ...) stack: the rows are consecutive thirds
                third = size // 3
                for row, (to, frm) in enumerate(moments):
                    to.extend(range(at + row * third, at + (row + 1) * third))
                    frm.extend(range(offset + row * third, offset + (row + 1) * third))
            else:
                to, frm = flat[kind]
                to.extend(range(at, at + size))
                frm.extend(range(offset, offset + size))
            offset += size
        self.size = offset
        self.flat = {k: (np.asarray(to, dtype=np.intp), np.asarray(frm, dtype=np.intp)) for k, (to, frm) in flat.items()}
        self.moments = [(np.asarray(to, dtype=np.intp), np.asarray(frm, dtype=np.intp)) for to, frm in moments]

    def fold(self, totals: np.ndarray, window: np.ndarray) -> None:
        """``totals`` (earlier) combined with ``window`` (later) in place: element for element the
        arithmetic of :func:`probe.state.accumulator.combine`, Chan's formula for the moments."""
        with np.errstate(all="ignore"):  # inf - inf, 0 * inf: NaN, as torch gives silently
            to, frm = self.flat["sum"]
            totals[to] += window[frm]
            to, frm = self.flat["max"]
            a, b = totals[to], window[frm]
            totals[to] = np.where((b > a) | np.isnan(b), b, a)  # torch.maximum: NaN wins
            to, frm = self.flat["last"]
            totals[to] = window[frm]
            (n_to, n_frm), (mean_to, mean_frm), (m2_to, m2_frm) = self.moments
            na, ma, m2a = totals[n_to], totals[mean_to], totals[m2_to]
            nb, mb, m2b = window[n_frm], window[mean_frm], window[m2_frm]
            n = na + nb
            safe = np.maximum(n, 1)
            delta = mb - ma
            totals[n_to] = n
            totals[mean_to] = ma + delta * (nb / safe)
            totals[m2_to] = m2a + m2b + np.square(delta) * (na * nb / safe)


class Results:
    """Run totals per site name, safe to update from the worker while the training thread reads.

    The totals live in one float64 array (``_flat``, each site's fields at ``_index``); a window
    with a layout seen before folds in by a cached :class:`_Plan`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flat = np.zeros(0)
        self._index: _Index = {}
        self._infos: Dict[str, Info] = {}
        self._plans: Dict[Tuple[Field, ...], _Plan] = {}

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._index)

    def add_states(self, states: Mapping[str, State], infos: Mapping[str, Info],
                   flat: Optional[np.ndarray] = None, fields: Optional[Sequence[Field]] = None) -> None:
        """Fold per-site host states (by site name) into the totals (:class:`probe.state.writer.Window`).

        ``flat`` and ``fields``: the same values packed (float64, in ``fields`` order), when the
        caller has them; otherwise they are gathered from ``states``.
        """
        if flat is None or fields is None or len(set((n, f) for n, f, _ in fields)) != len(fields):
            fields = [(name, field, tuple(v.shape)) for name, state in states.items() for field, v in state.items()]
            parts = [v.detach().to("cpu", torch.float64).reshape(-1) for state in states.values() for v in state.values()]
            flat = torch.cat(parts).numpy() if parts else np.zeros(0)
        key = tuple(fields)
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                new = [(name, field, shape) for name, field, shape in fields if (name, field) not in self._index]
                if new:  # fields seen for the first time are adopted as they are
                    self._grow(new)
                    adopted = set((name, field) for name, field, _ in new)
                    old = [f for f in fields if (f[0], f[1]) not in adopted]
                    self._adopt(flat, fields, adopted)
                    plan = _Plan(old, self._index)
                    window = _select(flat, fields, old)
                else:
                    plan = self._plans[key] = _Plan(fields, self._index)
                    window = flat
            else:
                window = flat
            plan.fold(self._flat, window)
            for name in states:
                self._infos[name] = dict(infos[name])

    def _grow(self, new: Sequence[Field]) -> None:
        offset = self._flat.size
        for name, field, shape in new:
            self._index[(name, field)] = (offset, shape)
            offset += math.prod(shape)
        self._flat = np.concatenate([self._flat, np.zeros(offset - self._flat.size)])
        self._plans.clear()

    def _adopt(self, flat: np.ndarray, fields: Sequence[Field], adopted: Set[Tuple[str, str]]) -> None:
        offset = 0
        for name, field, shape in fields:
            size = math.prod(shape)
            if (name, field) in adopted:
                at, _ = self._index[(name, field)]
                self._flat[at:at + size] = flat[offset:offset + size]
            offset += size

    def _states(self) -> Dict[str, State]:
        """A copy of the totals as per-site states (under the lock)."""
        values = torch.from_numpy(self._flat.copy())
        out: Dict[str, State] = {}
        for (name, field), (at, shape) in self._index.items():
            out.setdefault(name, {})[field] = values[at:at + math.prod(shape)].reshape(shape)
        return out

    def summary(self, pending: Mapping[str, State], pending_infos: Mapping[str, Info], steps: int,
                meta: Optional[Dict[str, Any]] = None) -> Summary:
        """The totals plus ``pending`` (state not flushed yet, by site name) as one summary.

        ``pending_infos`` (by site name) replace the flushed infos of sites that have totals.
        """
        with self._lock:
            totals = self._states()
            infos = {name: dict(info) for name, info in self._infos.items()}
        for name, state in pending.items():
            merge_states(totals.setdefault(name, {}), state)
        for name, info in pending_infos.items():
            if name in totals:
                merged = dict(info)
                if "scale" in totals[name]:
                    merged["scale"] = totals[name]["scale"].tolist()
                infos[name] = merged
        sites = {name: {"info": infos.get(name, {}), "metrics": finalize(totals[name])} for name in totals}
        return Summary(sites, steps=steps, meta=meta)


def _select(flat: np.ndarray, fields: Sequence[Field], keep: Sequence[Field]) -> np.ndarray:
    """The values of the ``keep`` fields of a window packed by ``fields``, in ``keep`` order."""
    offsets: Dict[Tuple[str, str], Tuple[int, int]] = {}
    offset = 0
    for name, field, shape in fields:
        size = math.prod(shape)
        offsets[(name, field)] = (offset, size)
        offset += size
    parts = [flat[o:o + n] for o, n in (offsets[(name, field)] for name, field, _ in keep)]
    return np.concatenate(parts) if parts else np.zeros(0)


def pending_states(flat: Tensor, layout: Any, names: Mapping[Hashable, str]) -> Dict[str, State]:
    """Unflushed accumulator state by site name, on the host in float64."""
    out: Dict[str, State] = {}
    for key, state in unpack(flat.detach().to("cpu", torch.float64), layout).items():
        out[names[key]] = state
    return out


def step_ends(probed: Iterable[int]) -> Dict[str, int]:
    """``first_step`` / ``last_step`` of the probed steps, for ``Summary.meta`` (the CLI says which
    steps a value comes from); empty when nothing was probed."""
    steps = sorted(probed)
    return {"first_step": steps[0], "last_step": steps[-1]} if steps else {}
