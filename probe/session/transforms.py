"""PyTorch's transforms probe steps aside for: a forward of the watched model it cannot measure.

probe measures a forward by running statistics on the real tensors of its attention calls and
by hooking their gradients. Under a transform those tensors are not real, or the forward is
not a training step:

* ``torch.jit.trace`` (and TensorBoard's ``SummaryWriter.add_graph``, which traces): every op
  probe ran would be recorded into the graph, and the trace check would see two graphs differ;
* ``torch.export.export``: the forward runs under Dynamo or on fake tensors, for a graph;
* ``torch.func`` transforms (``grad``, ``vmap``, ``jacrev``, ...; per-sample gradients with
  ``vmap(grad(functional_call(...)))``): tensors are functorch wrappers, whose values probe's
  statistics cannot read (``.item()``, storage access);
* ``FakeTensorMode``, ``make_fx`` and functionalization, and meta-device tensors: no values at all;
* Keras's shape inference (``SymbolicScope``, torch backend): ``fit`` calls the model on
  placeholder tensors, on the meta device or, where that fails (``mixed_float16``), on ones on
  the CPU: not a forward of the user's, so stepped aside for without a warning (the ones were
  measured as a second call of each step: entropy 0.91 where the model's own was 0.82).

For such a forward probe changes nothing: the model runs as without probe, the step counter,
the statistics and the flush state are untouched, and one warning per kind of transform says
what was skipped. ``torch.compile``'s own tracing is not one of them: probe runs its hooks
outside the graph (:mod:`probe.session.compiled`).

The checks cost a few C calls per root forward (the thread's tracing state, the functorch
level, three dispatch-mode slots, the first tensor argument).
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor

from probe.once import WarnOnce

__all__ = ["StepAside", "transform_running"]

_MODES = (("FAKE", "FakeTensorMode (fake tensors)"), ("PROXY", "make_fx / proxy tracing"),
          ("FUNCTIONAL", "functionalization"))


def _first_tensor(args: Sequence[Any], kwargs: Optional[Mapping[str, Any]]) -> Optional[Tensor]:
    values = list(args) + (list(kwargs.values()) if kwargs else [])
    for value in values:
        if isinstance(value, Tensor):
            return value
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, Tensor):
                    return item
        elif isinstance(value, Mapping):
            for item in value.values():
                if isinstance(item, Tensor):
                    return item
    return None


#: Keras's shape inference (the step aside is not warned: Keras runs it, not the user)
KERAS_SYMBOLIC = "Keras's shape inference (SymbolicScope)"


def transform_running(args: Sequence[Any] = (), kwargs: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """What probe cannot measure under, if a forward called with ``args`` / ``kwargs`` runs
    under it now: a short name for the warning, or ``None`` (see the module docstring)."""
    keras_scope = sys.modules.get("keras.src.backend.common.symbolic_scope")
    if keras_scope is not None and keras_scope.in_symbolic_scope():
        return KERAS_SYMBOLIC
    jit_trace = sys.modules.get("torch.jit._trace")
    # the module map is set for the whole of torch.jit.trace(module): also while its check runs
    # the module eagerly to compare (the tracing state is off then)
    if torch.jit.is_tracing() or getattr(jit_trace, "_trace_module_map", None) is not None:
        return "torch.jit.trace (SummaryWriter.add_graph traces too)"
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    if is_exporting is not None and is_exporting():
        return "torch.export"
    functorch = getattr(torch._C, "_functorch", None)
    if functorch is not None and functorch.maybe_current_level() is not None:
        return "a torch.func transform (grad, vmap, jacrev, ...)"
    keys = getattr(torch._C, "_TorchDispatchModeKey", None)
    if keys is not None:
        for key, name in _MODES:
            if hasattr(keys, key) and torch._C._get_dispatch_mode(getattr(keys, key)) is not None:
                return name
    tensor = _first_tensor(args, kwargs)
    if tensor is not None:
        if tensor.is_meta:
            return "meta-device tensors"
        fake = sys.modules.get("torch._subclasses.fake_tensor")
        if fake is not None and isinstance(tensor, fake.FakeTensor):
            return "FakeTensorMode (fake tensors)"
        if functorch is not None and functorch.is_functorch_wrapped_tensor(tensor):
            return "a torch.func transform (grad, vmap, jacrev, ...)"
    return None


class StepAside:
    """The profiler's use of :func:`transform_running`: whether a root forward is one probe steps
    aside for, with one warning per kind of transform."""

    def __init__(self) -> None:
        self._warned = WarnOnce()
        #: root calls stepped aside for while a root forward was running (their ends are not its end)
        self.nested = 0

    def __call__(self, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]], what: Optional[str] = None) -> bool:
        """Whether to step aside for this forward (``what``: already known, e.g. ``torch.export``)."""
        what = what or transform_running(args, kwargs)
        return what is not None and self._say(what, f"probe: a forward of the watched model ran under {what}; probe "
                                              "stepped aside for it (not measured, not counted as a step; the model ran "
                                              "as without probe)")

    def call(self, q: Tensor) -> bool:
        """Whether an attention call with query ``q``, captured inside a recorded step, runs under
        a transform: it is not measured (one warning per kind)."""
        what = transform_running((q,))
        return what is not None and self._say(what, f"probe: an attention call ran under {what} inside a recorded "
                                              "step; probe did not measure it (the model ran as without probe)")

    def _say(self, what: str, message: str) -> bool:
        """Warn once per kind of transform (Keras's shape inference: never, Keras runs it, not the
        user); True: the caller steps aside."""
        if what != KERAS_SYMBOLIC:
            self._warned(what, message, stacklevel=5)
        return True
