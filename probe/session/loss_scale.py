"""Gradient metrics in the loss's own units under a loss scaler (mixed-precision training).

``torch.amp.GradScaler`` (also ``torch.cuda.amp``'s, and FSDP's ``ShardedGradScaler``) multiplies
the loss by a scale ``s`` (65536 at first, halved on every overflow, doubled every 2000 clean
steps) before ``backward()``: every gradient the backward hooks see is ``s`` times the model's, so
``grad_logits``, ``grad_q``, ``grad_k`` and ``grad_v`` would read ``s`` times too large and jump
whenever the scaler changes ``s``. And a backward that overflows (the scaler then skips that
optimizer step: routine in the first steps of fp16 training) would put inf or NaN into the run's
sums for good.

While a probe with gradient metrics is open, ``GradScaler.scale`` is wrapped (:func:`acquire`;
restored when the last such probe closes): the tensors it returns get a hook that, when a backward
starts from them, makes their scale the *current* one until that backward ends
(:func:`current`). :class:`ScaledFields` then holds the gradient fields of that backward and, at
its end, adds them divided by ``s²`` (sums of squares; ``s⁴`` for their variances), all of them
or, if any is not finite, none: the step counts no gradient step then (``grad_steps``), as the
scaler counts no optimizer step. Everything stays on the device: no host synchronization.

Keras 3 (torch backend) scales the loss itself under ``mixed_float16``
(``LossScaleOptimizer.scale_loss``, 32768 at first): wrapped the same way when Keras is loaded
when a probe opens.

Not seen: a loss scaled by other means (DeepSpeed's fp16 loss scaler, a hand-written
``loss * 1024``); its gradient metrics are in the scaled units.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["ScaledFields", "acquire", "current", "release"]

_lock = threading.Lock()
_users = 0
_originals: Dict[Tuple[type, str], Callable[..., Any]] = {}  # (class, method) -> its own
#: autograd's graph task id -> ``(scale, token)`` of that running backward (set when it starts from
#: a scaled tensor, removed at its end; the token tells one backward from the next). By task, not
#: globally: a backward in another thread finds its own.
_current: Dict[int, Tuple[Tensor, object]] = {}


def _running() -> Optional[Tuple[Tensor, object]]:
    """The scaled backward the running hook belongs to: its graph task's, or, in a task of its
    own (the nested backward of reentrant activation checkpointing), the one scaled backward
    running (``None`` when several are: which one nests it is not known)."""
    if not _current:
        return None
    running = _current.get(torch._C._current_graph_task_id())
    if running is None and len(_current) == 1:
        running = next(iter(_current.values()))
    return running


def current() -> Optional[Tensor]:
    """The loss scale of the backward running now, or ``None`` (not started from a scaled loss)."""
    running = _running()
    return None if running is None else running[0]


def acquire() -> bool:
    """A probe with gradient metrics opens: wrap ``scale`` of torch's grad scalers (the first
    one) and Keras's ``LossScaleOptimizer.scale_loss`` (the first with Keras loaded). True: the
    caller must :func:`release` once."""
    global _users
    with _lock:
        _users += 1
        if _users == 1:
            from torch.amp.grad_scaler import GradScaler

            for cls in _scaler_classes(GradScaler):
                _wrap_class(cls)
            # a scaler class defined later (FSDP's, whose module costs 0.5 s to import) is wrapped as
            # it is defined
            GradScaler.__init_subclass__ = classmethod(_defined)  # type: ignore[assignment]
        keras = sys.modules.get("keras.src.optimizers.loss_scale_optimizer")  # (imported by now, if used)
        if keras is not None and (keras.LossScaleOptimizer, "scale_loss") not in _originals:
            cls = keras.LossScaleOptimizer
            _originals[(cls, "scale_loss")] = cls.__dict__["scale_loss"]
            cls.scale_loss = _wrap_keras(cls.__dict__["scale_loss"])  # type: ignore[attr-defined]
    return True


def release() -> None:
    """That probe closes: the last one puts the scalers' own ``scale`` back."""
    global _users
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users == 0:
            from torch.amp.grad_scaler import GradScaler

            del GradScaler.__init_subclass__
            for (cls, name), original in _originals.items():
                setattr(cls, name, original)
            _originals.clear()


def _defined(cls: type, **kwargs: Any) -> None:
    """``GradScaler.__init_subclass__`` while a probe is open: a new scaler class is wrapped too."""
    with _lock:
        if _users and "scale" in cls.__dict__:
            _wrap_class(cls)


def _wrap_class(cls: type) -> None:
    original = cls.__dict__["scale"]
    _originals[(cls, "scale")] = original
    cls.scale = _wrap(original)  # type: ignore[attr-defined]


def _scaler_classes(base: type) -> List[type]:
    """``base`` and its subclasses defined so far that define their own ``scale``."""
    found, todo = [], [base]
    while todo:
        cls = todo.pop()
        if "scale" in cls.__dict__:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        scaled = original(self, outputs)
        if _users and getattr(self, "_enabled", False) and isinstance(getattr(self, "_scale", None), Tensor):
            _bind(scaled, self._scale)
        return scaled

    scale.__probe_wrapped__ = True  # type: ignore[attr-defined]
    return scale


def _wrap_keras(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras 3's ``LossScaleOptimizer.scale_loss`` (``mixed_float16``; its torch backend's
    ``train_step`` calls ``backward()`` on what it returns), whose scale is ``dynamic_scale``."""
    @functools.wraps(original)
    def scale_loss(self: Any, loss: Any) -> Any:
        scaled = original(self, loss)
        if _users and isinstance(scaled, Tensor):
            value = self.dynamic_scale if getattr(self, "built", False) else self.initial_scale
            value = getattr(value, "value", value)  # a Keras variable's torch tensor
            _bind(scaled, value.detach() if isinstance(value, Tensor) else torch.tensor(float(value)))
        return scaled

    scale_loss.__probe_wrapped__ = True  # type: ignore[attr-defined]
    return scale_loss


def _bind(out: Any, factor: Tensor, depth: int = 0) -> None:
    """Hook the scaled tensors in ``out`` (a tensor, or lists and tuples of them; a lazy iterable
    is left alone: reading it would use it up)."""
    if isinstance(out, Tensor):
        if out.requires_grad:
            out.register_hook(functools.partial(_enter, factor))
    elif isinstance(out, (list, tuple)) and depth < 3:
        for item in out:
            _bind(item, factor, depth + 1)


def _enter(factor: Tensor, grad: Tensor) -> None:
    """A backward starts from a scaled tensor: its scale is current until that backward ends."""
    task = torch._C._current_graph_task_id()
    _current[task] = (factor, object())
    torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_current.pop, task, None))


AddFields = Callable[..., None]


class ScaledFields:
    """``add(key, step, fields)`` for the backward hooks: fields of an unscaled backward go to
    ``add`` at once; those of a scaled one are held until it ends, then added in the loss's units
    (module docstring) with ``counted``, the step's ``grad_steps`` (1, or 0 when they were not
    finite)."""

    def __init__(self, add: AddFields, warn: Callable[[str], None]) -> None:
        self._add = add
        self._warn = warn
        self._held: List[Tuple[Hashable, int, Dict[str, Tensor]]] = []
        self._backward: Optional[Tuple[Tensor, object]] = None  # the scaled backward they are of
        self._lock = threading.Lock()

    def __call__(self, key: Hashable, step: int, fields: Dict[str, Tensor]) -> None:
        running = _running()
        if running is None:
            self._add(key, step, fields)
            return
        with self._lock:
            if self._backward is not running:  # the first of this backward: add them all when it ends
                self._held = []  # (any of an earlier one that raised before its end: never added)
                self._backward = running
                torch.autograd.Variable._execution_engine.queue_callback(self.settle)
            self._held.append((key, step, fields))

    def settle(self) -> None:
        """Add the held fields of the backward that just ended."""
        with self._lock:
            held, self._held = self._held, []
            running, self._backward = self._backward, None
        if not held or running is None:
            return
        try:
            self._settle(held, running[0])
        except Exception as err:  # noqa: BLE001 - a training loop never dies because of probe
            self._warn(f"probe: the gradient metrics of a loss-scaled backward were not recorded ({type(err).__name__}: "
                       f"{err}); training is unaffected")

    def _settle(self, held: List[Tuple[Hashable, int, Dict[str, Tensor]]], factor: Tensor) -> None:
        values = [value.reshape(-1) for _, _, fields in held for value in fields.values()]
        ref = values[0]
        finite = torch.isfinite(torch.cat([v.to(ref.device, ref.dtype) for v in values])).all()
        square = factor.detach().to(device=ref.device, dtype=ref.dtype).square()
        fourth = square.square()  # the variances'
        counted = finite.to(ref.dtype).reshape(1)
        for key, step, fields in held:
            out = {name: torch.where(finite.to(value.device), value / (fourth if "_var" in name else square).to(
                value.device), 0.0) for name, value in fields.items()}
            self._add(key, step, out, counted=counted)
