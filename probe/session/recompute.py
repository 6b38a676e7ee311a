"""Reentrant activation checkpointing: hook the calls a module recomputes inside backward.

``checkpoint(..., use_reentrant=True)`` runs a block's forward under ``no_grad`` (no tensor of
the probed forward takes part in autograd, so no backward hook can be registered) and runs it
again inside backward, outside the probed forward. :class:`Recompute` watches the issuing
modules: while one runs again with grad enabled it enters a capture mode of its own, and hands
each recomputed call, under its original site key and step, to ``register`` (the recorder's
backward hooks). The recomputation adds no forward statistics. A no-grad block that is never
recomputed (a frozen sub-model) leaves module hooks that never fire, removed with the others.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.hooks import RemovableHandle

from probe.call import AttentionCall
from probe.capture.frontend import FrontEnd
from probe.capture.mode import CaptureMode

__all__ = ["Recompute"]

#: ``register(call, key, step, payload)``: hook one recomputed call.
Register = Callable[[AttentionCall, Hashable, int, Any], int]


@dataclasses.dataclass
class _Deferred:
    """A module whose calls ran under ``no_grad`` inside a probed forward (reentrant checkpoint)."""

    name: str
    step: int
    keys: List[Tuple[str, int]]
    payload_for: Callable[[AttentionCall], Any]
    frontends: Sequence[FrontEnd]
    seen: int = 0  # calls issued by the module in the running recomputation


class Recompute:
    """Owns the module hooks and the capture mode of recomputed forwards (see the module docstring).

    Args:
        register: hooks one recomputed call (``BackwardHooks.register``).
    """

    def __init__(self, register: Register) -> None:
        self._register = register
        self._handles: List[RemovableHandle] = []
        self._deferred: Dict[int, _Deferred] = {}
        self._running: List[_Deferred] = []  # deferred modules in the running recomputation
        self._mode: Optional[CaptureMode] = None

    def defer(
        self,
        module: nn.Module,
        key: Tuple[str, int],
        step: int,
        frontends: Sequence[FrontEnd],
        payload_for: Callable[[AttentionCall], Any],
    ) -> None:
        """Measure the gradients of a call that ran under ``no_grad`` in a grad-enabled forward.

        Reentrant checkpointing (``checkpoint(..., use_reentrant=True)``) runs the forward under
        ``no_grad`` and runs it again inside backward, outside the probed forward. Hooks on the
        issuing ``module`` (key ``(module name, call index)``) enter a capture mode while the
        module runs again with grad enabled, and hook the recomputed call's tensors under the
        original key and step (``payload_for(call)`` gives each its payload); the recomputation
        adds no forward statistics. A no-grad block that
        is never recomputed (a frozen sub-model) leaves hooks that never fire, removed with the
        others.
        """
        entry = self._deferred.get(id(module))
        if entry is None:  # remove() clears these at every step change
            entry = self._deferred[id(module)] = _Deferred(key[0], step, [], payload_for, frontends)
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._rerun_start, entry)))
            self._handles.append(module.register_forward_hook(functools.partial(self._rerun_end, entry), always_call=True))
        if key not in entry.keys:
            entry.keys.append(key)

    def _rerun_start(self, entry: _Deferred, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return  # the no-grad forward itself, or inference
        if self._mode is None:
            if any(isinstance(m, CaptureMode) and m.recording for m in _get_current_function_mode_stack()):
                return  # inside a probed forward: its own capture sees these calls
            self._mode = CaptureMode(entry.frontends, self._rerun_emit)
            self._mode.__enter__()
        entry.seen = 0
        self._running.append(entry)

    def _rerun_end(self, entry: _Deferred, module: nn.Module, args: Any, output: Any) -> None:
        if self._running and self._running[-1] is entry:
            self._running.pop()
            if not self._running and self._mode is not None:
                mode, self._mode = self._mode, None
                mode.__exit__(None, None, None)

    def _rerun_emit(self, call: AttentionCall) -> None:
        entry = self._running[-1]  # the innermost deferred module issued this call
        key = (entry.name, entry.seen)
        entry.seen += 1
        if key not in entry.keys:
            return  # filtered out or skipped in the forward
        call = dataclasses.replace(call, site=entry.name)
        try:
            call.validate()
        except ValueError:
            return
        self._register(call, key, entry.step, entry.payload_for(call))

    def remove(self) -> None:
        """Remove the module hooks and leave a running recomputation's mode (harmless twice)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self._deferred = {}
        self._running = []
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
