"""Backward capture: tensor hooks on an attention call's output and on its q, k, v.

On a sampled step, for every captured call that takes part in autograd, :class:`BackwardHooks`
registers (during the forward):

* a hook on the attention output: it receives ``∂L/∂out``; when an eager record carries the
  softmax output (``call.probs``), the hook sits there instead and receives ``dP = ∂L/∂P``
  directly (dropout after the softmax included). The gradient goes to ``on_logits`` with a slim,
  detached copy of the record (the recorder turns it into ``grad_logits`` at every scale);
* a hook on each of q, k, v that requires grad: its gradient goes to ``on_input``.

Each hook only reads its gradient and returns ``None``, so gradients are unchanged. Every
backward pass through a hooked call contributes (gradient accumulation over micro-batches,
several ``backward(retain_graph=True)`` calls). What is computed from the gradients is the
recorder's business (:mod:`probe.recorder`): this module computes no statistic.

Ownership: :class:`BackwardHooks` keeps every handle and removes them in
:meth:`BackwardHooks.remove` (the profiler calls it when the next step's forward begins and on
``close``); removing twice is harmless, and a probe removes only its own hooks. Until then the
hooks keep the call's q, k, v (and mask) alive, which the autograd graph keeps anyway, except
under activation checkpointing.

Reentrant activation checkpointing runs the forward under ``no_grad`` and again inside backward:
:meth:`BackwardHooks.defer` watches the issuing modules and hooks the recomputed calls.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.hooks import RemovableHandle

from probe.call import AttentionCall
from probe.capture.mode import CaptureMode

__all__ = ["BackwardHooks", "OnInput", "OnLogits"]

#: ``on_logits(record, key, step, payload, grad, from_probs)``: ``grad`` is ``dP`` when
#: ``from_probs``, else ``∂L/∂out``; ``payload`` is what :meth:`BackwardHooks.register` got.
OnLogits = Callable[[AttentionCall, Hashable, int, Any, Tensor, bool], None]
#: ``on_input(name, key, step, grad)``: the gradient of q, k or v (``name``).
OnInput = Callable[[str, Hashable, int, Tensor], None]


def _detached(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach()


@dataclasses.dataclass
class _Deferred:
    """A module whose calls ran under ``no_grad`` inside a probed forward (reentrant checkpoint)."""

    name: str
    step: int
    keys: List[Tuple[str, int]]
    payload_for: Callable[[AttentionCall], Any]
    frontends: Sequence[Any]
    seen: int = 0  # calls issued by the module in the running recomputation


class BackwardHooks:
    """Registers and owns the backward hooks of one probe.

    Args:
        on_logits: receives the gradient at the attention output (or softmax output).
        on_input: receives the gradients of q, k, v.
        warn: receives a message when a callback fails (training is never broken by a
            diagnostic).
    """

    def __init__(self, on_logits: OnLogits, on_input: OnInput, warn: Callable[[str], None]) -> None:
        self._on_logits = on_logits
        self._on_input = on_input
        self._warn = warn
        self._handles: List[RemovableHandle] = []
        self.step: Optional[int] = None
        #: Whether the current root forward began with grad enabled (set by the profiler).
        self.root_grad = False
        self._deferred: Dict[int, _Deferred] = {}
        self._running: List[_Deferred] = []  # deferred modules in the running recomputation
        self._mode: Any = None

    def __len__(self) -> int:
        return len(self._handles)

    def register(self, call: AttentionCall, key: Hashable, step: int, payload: Any = None) -> int:
        """Hook ``call``'s output (an eager call's softmax output) and q, k, v; returns how many
        hooks were registered. ``payload`` is handed back to ``on_logits``.

        Nothing is registered when grad mode is off or no tensor requires grad (inference), so
        grad metrics are then absent, not zero. Tensors passed as more than one of q, k, v (the
        same object) are skipped for grad_q/k/v: autograd gives only their summed gradient. A
        call whose scale is unknown and that carries no logits gets no output hook (its logits
        cannot be rebuilt).
        """
        if not torch.is_grad_enabled():
            return 0
        before = len(self._handles)
        self.step = step
        out, probs = call.output, call.probs
        source = None
        if isinstance(probs, Tensor) and probs.requires_grad:
            source = probs  # an eager softmax output: its gradient is dP itself, dropout included
        elif isinstance(out, Tensor) and out.requires_grad and call.v is not None:
            source = out  # its gradient ∂L/∂out gives dP = ∂L/∂out · vᵀ
        if source is not None and (call.scale is not None or call.logits is not None):
            # A slim copy of the record: detached tensors, no reference to the hooked tensor
            # itself (it holds the hook; a reference back would make a cycle only GC can free).
            record = AttentionCall(
                q=call.q.detach(), k=call.k.detach(), v=_detached(call.v), scale=call.scale,
                bias=_detached(call.bias), mask=_detached(call.mask), causal=call.causal,
                softcap=call.softcap, site=call.site, kind=call.kind, logits=_detached(call.logits),
            )
            hook = self._dp_hook(record, key, step, payload, from_probs=source is probs)
            self._handles.append(source.register_hook(hook))
        tensors = {"q": call.q, "k": call.k, "v": call.v}
        for name, t in tensors.items():
            if not isinstance(t, Tensor) or not t.requires_grad:
                continue
            if any(other is t for other_name, other in tensors.items() if other_name != name):
                continue
            self._handles.append(t.register_hook(self._input_hook(name, key, step)))
        return len(self._handles) - before

    def _dp_hook(self, record: AttentionCall, key: Hashable, step: int, payload: Any,
                 from_probs: bool) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            try:
                with torch.no_grad():
                    self._on_logits(record, key, step, payload, grad, from_probs)
            except Exception as err:  # noqa: BLE001 - a diagnostic never breaks training
                self._warn(f"probe: grad_logits failed at {record.site!r}: {type(err).__name__}: {err}")

        return hook

    def _input_hook(self, name: str, key: Hashable, step: int) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            try:
                with torch.no_grad():
                    self._on_input(name, key, step, grad)
            except Exception as err:  # noqa: BLE001
                self._warn(f"probe: grad_{name} failed at {key!r}: {type(err).__name__}: {err}")

        return hook

    # -- reentrant activation checkpointing -----------------------------------------------------
    def defer(
        self,
        module: nn.Module,
        key: Tuple[str, int],
        step: int,
        frontends: Sequence[Any],
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
        self.step = step
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
        self.register(call, key, entry.step, entry.payload_for(call))

    def remove(self) -> None:
        """Remove every hook this object registered (harmless twice, and for freed tensors)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self.step = None
        self._deferred = {}
        self._running = []
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
