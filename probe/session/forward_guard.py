"""Noticing a root forward that ended without its forward hook: KeyboardInterrupt, SystemExit,
GeneratorExit.

``nn.Module`` runs ``always_call`` forward hooks when the forward raises an ``Exception``, not a
``BaseException``: a Ctrl-C inside a sampled forward (caught by the caller, as a notebook does)
skips probe's end-of-forward hook, leaving its capture mode on the TorchFunctionMode stack and
its global module hooks installed. probe owns no frame around the model's forward (it does not
wrap or modify the model), so it cannot run a ``finally`` there; instead it remembers the frame
of the ``Module.__call__`` that started the step and, at the next point where it matters (the
next attention call anyone makes, the next forward of the watched model, any call on the
probe), checks whether that frame is still on the current thread's stack. If it is not, the
forward is over and the state is restored (:class:`ForwardFrame`).

The check walks ``f_back`` pointers comparing identities: no ``f_locals``, no allocation.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any, Callable, Dict, Optional, Tuple

from torch import nn

__all__ = ["ForwardFrame", "InertHook", "RootHook"]

_CALL_IMPL = nn.Module._call_impl.__code__


class ForwardFrame:
    """The ``Module._call_impl`` frame of the root forward in progress (if any)."""

    def __init__(self) -> None:
        self._frame: Optional[FrameType] = None
        self._thread: Optional[int] = None

    def enter(self) -> None:
        """Record the innermost ``Module._call_impl`` frame above the caller (the root's call).

        Nothing is recorded when there is none (a hook called from a compiled graph): staleness
        is then never claimed.
        """
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not _CALL_IMPL:
            frame = frame.f_back
        self._frame = frame
        self._thread = threading.get_ident()

    def exit(self) -> None:
        """The forward ended normally: forget its frame (and the locals it holds)."""
        self._frame = None
        self._thread = None

    def stale(self) -> bool:
        """True when a forward was entered, never exited, and its frame is no longer running on
        this thread: it ended with a BaseException that skipped the forward hook. Asked from
        another thread, the answer is False (that thread's stack says nothing about it)."""
        target = self._frame
        if target is None or self._thread != threading.get_ident():
            return False
        frame: Optional[FrameType] = sys._getframe(1)
        while frame is not None:
            if frame is target:
                return False
            frame = frame.f_back
        return True


class RootHook:
    """A hook on the watched root module that copies of the model do not carry along.

    ``copy.deepcopy(model)``, ``pickle.dumps(model)`` and ``torch.save(model)`` copy a module's
    hook dicts. Probe's hooks are bound to the probe (threads, locks), which cannot be copied; this
    wrapper copies as an :class:`InertHook` instead, so a copy of a watched model (an EMA copy, a
    whole-model checkpoint) is made without error and is *not* watched. Unpickling such a copy
    needs probe importable, as any pickle of a hooked module needs its hooks' module.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "InertHook":
        return InertHook()

    def __reduce__(self) -> Tuple[Any, Tuple[()]]:
        return (InertHook, ())


class InertHook:
    """What a copied :class:`RootHook` becomes: on its first call it removes itself from the
    module's hook dicts and does nothing."""

    def __call__(self, module: nn.Module, *args: Any) -> None:
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, hook in hooks.items() if hook is self]:
                del hooks[key]
                for flags in (module._forward_hooks_always_called, module._forward_pre_hooks_with_kwargs,
                              module._forward_hooks_with_kwargs):
                    flags.pop(key, None)
        return None
