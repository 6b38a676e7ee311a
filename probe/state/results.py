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

from probe.state.accumulator import unpack
from probe.state.combine import Layout, State, merge_states
from probe.state.finalize import finalize
from probe.summary import Summary

__all__ = ["Results", "pending_states", "step_ends"]

Info = Dict[str, Any]


Field = Tuple[str, str, Tuple[int, ...]]  # (site name, state field, shape)
_Index = Dict[Tuple[str, str], Tuple[int, Tuple[int, ...]]]  # (site name, field) -> (offset, shape)


def _window_plan(fields: Sequence[Field], index: _Index) -> Tuple[Layout, np.ndarray]:
    """The window's layout and, for each of its positions, the position in the totals it folds into."""
    into: List[np.ndarray] = []
    for name, field, shape in fields:
        at, have = index[(name, field)]
        if have != shape:
            raise ValueError(f"site {name!r} field {field!r}: shape {shape} in this window, {have} in the totals")
        into.append(np.arange(at, at + math.prod(shape), dtype=np.intp))
    return Layout(fields), (np.concatenate(into) if into else np.zeros(0, dtype=np.intp))


class Results:
    """Run totals per site name, safe to update from the worker while the training thread reads.

    The totals live in one float64 array (``_flat``, each site's fields at ``_index``); a window
    folds in through its :class:`~probe.state.combine.Layout`, cached per window layout.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flat = np.zeros(0)
        self._index: _Index = {}
        self._infos: Dict[str, Info] = {}
        self._plans: Dict[Tuple[Field, ...], Tuple[Layout, np.ndarray]] = {}

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
                    plan = _window_plan(old, self._index)
                    window = _select(flat, fields, old)
                else:
                    plan = self._plans[key] = _window_plan(fields, self._index)
                    window = flat
            else:
                window = flat
            layout, into = plan
            layout.fold(self._flat, window, into=into)
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
