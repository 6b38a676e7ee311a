"""One flush on its way from the device to the run totals and the sinks: :class:`Window`."""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from probe.state.accumulator import unpack
from probe.state.combine import State, merge_states
from probe.state.finalize import finalize
from probe.summary import Summary

__all__ = ["Window", "to_host"]


class Window:
    """The statistics of one flush on their way from the device to the totals and the sinks.

    Args:
        step: the last step of the window (the step sinks write it at).
        steps: the probed steps it covers.
        flat: the packed state (:meth:`probe.state.accumulator.Accumulator.pack`), on the host or
            being copied there.
        event: a CUDA event to wait on before reading ``flat`` (None when it is ready).
        layout: the pack layout.
        names: site key -> site name.
        infos: site key -> info dict.
    """

    def __init__(self, step: int, steps: Sequence[int], flat: Optional[Tensor], event: Any, layout: Any,
                 names: Mapping[Hashable, str], infos: Mapping[Hashable, Mapping[str, Any]]) -> None:
        self.step = step
        self.steps: List[int] = list(steps)
        self._flat, self._event, self._layout = flat, event, layout
        self._names, self._infos = names, infos
        self.states: Optional[Dict[str, State]] = None  # site name -> host float64 state
        self.infos: Dict[str, Dict[str, Any]] = {}
        # the same values packed, as the totals fold them (None for a merged window)
        self.host: Optional[np.ndarray] = None
        self.fields: Optional[List[Tuple[str, str, Tuple[int, ...]]]] = None
        self._summary: Optional[Summary] = None

    @property
    def ready(self) -> bool:
        return self.states is not None

    def materialize(self) -> Dict[str, State]:
        """Wait for the copy, unpack into per-site float64 host states (once)."""
        if self.states is None:
            if self._event is not None:
                self._event.synchronize()
            assert self._flat is not None
            host = self._flat.detach().to("cpu", torch.float64)
            states = unpack(host, self._layout)
            self.host = host.numpy()
            self.fields = [(self._names[key], field, tuple(shape)) for key, field, shape in self._layout]
            out: Dict[str, State] = {}
            for key, state in states.items():
                name = self._names[key]
                info = dict(self._infos[key])
                if "scale" in state:
                    info["scale"] = state["scale"].tolist()
                out[name] = state
                self.infos[name] = info
            self.states = out
            self._flat = self._event = None
        return self.states

    def summary(self) -> Summary:
        """This window alone as a :class:`Summary` (what a sink receives); after :meth:`materialize`."""
        if self._summary is None:
            assert self.states is not None
            sites = {name: {"info": self.infos[name], "metrics": finalize(state)} for name, state in self.states.items()}
            self._summary = Summary(sites, steps=len(set(self.steps)))
        return self._summary

    @staticmethod
    def merged(a: "Window", b: "Window") -> "Window":
        """One window covering ``a`` then ``b`` (both materialized), as if flushed together."""
        out = Window(b.step, a.steps + b.steps, None, None, None, {}, {})
        states: Dict[str, State] = {name: {f: v.clone() for f, v in s.items()} for name, s in (a.states or {}).items()}
        for name, state in (b.states or {}).items():
            merge_states(states.setdefault(name, {}), {f: v.clone() for f, v in state.items()})
        out.states = states
        out.infos = {**a.infos, **b.infos}
        return out


def to_host(flat: Tensor) -> Tuple[Tensor, Any]:
    """Start the one device→host copy of a flush; returns (host tensor, event to wait on)."""
    flat = flat.detach()
    if flat.device.type == "cuda":
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event
    return flat.to("cpu"), None
