"""Results that outlive the profiler: run totals per site and the :class:`~probe.summary.Summary`.

A flush hands one window of packed per-site state to :meth:`Results.add_window` (on the
background worker); it folds the window into the run totals and returns the window's own
summary for the sinks. :meth:`Results.summary` builds the run summary from the totals plus any
state not flushed yet.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Hashable, Iterable, Mapping, Optional

import torch
from torch import Tensor

from probe.stats.accumulator import State, merge_states, unpack
from probe.stats.finalize import finalize
from probe.summary import Summary

__all__ = ["Results", "pending_states", "step_ends"]

Info = Dict[str, Any]


class Results:
    """Run totals per site name, safe to update from the worker while the training thread reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: Dict[str, State] = {}
        self._infos: Dict[str, Info] = {}

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._totals)

    def add_window(self, host: Tensor, layout: Any, names: Mapping[Hashable, str],
                   infos: Mapping[Hashable, Info], steps: int) -> Summary:
        """Fold one flushed window (packed ``host`` tensor and its layout) into the totals;
        returns the window's summary."""
        states = unpack(host.to(torch.float64), layout)
        window: Dict[str, Dict[str, Any]] = {}
        with self._lock:
            for key, state in states.items():
                name = names[key]
                info = dict(infos[key])
                if "scale" in state:
                    info["scale"] = state["scale"].tolist()
                merge_states(self._totals.setdefault(name, {}), {f: v.clone() for f, v in state.items()})
                self._infos[name] = info
                window[name] = {"info": info, "metrics": finalize(state)}
        return Summary(window, steps=steps)

    def add_states(self, states: Mapping[str, State], infos: Mapping[str, Info]) -> None:
        """Fold already unpacked per-site host states (by site name) into the totals
        (:class:`probe.sinks.writer.Window`)."""
        with self._lock:
            for name, state in states.items():
                merge_states(self._totals.setdefault(name, {}), {f: v.clone() for f, v in state.items()})
                self._infos[name] = dict(infos[name])

    def summary(self, pending: Mapping[str, State], pending_infos: Mapping[str, Info], steps: int,
                meta: Optional[Dict[str, Any]] = None) -> Summary:
        """The totals plus ``pending`` (state not flushed yet, by site name) as one summary.

        ``pending_infos`` (by site name) replace the flushed infos of sites that have totals.
        """
        with self._lock:
            totals = {name: dict(state) for name, state in self._totals.items()}
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
