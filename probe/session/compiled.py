"""torch.compile support: sampled steps run eagerly, unsampled steps run the compiled code.

probe measures attention through a ``TorchFunctionMode`` and Python hooks, which a compiled graph
does not run: inside Dynamo the mode would be traced into the graph (a recompile on every sampled
step, because the mode stack and the global module hooks are guarded), or skipped altogether by a
backend that never calls Python. So on a sampled step probe sets the compiler stance
``torch.compiler.set_stance("force_eager")`` for the duration of the root forward: compiled
functions and modules run their original Python code, the capture sees every attention call,
and the statistics are those of eager mode *exactly* (they are eager mode). Unsampled steps run
the compiled code untouched: no recompile, no extra guard.

Where the stance can be set depends on who compiled what:

- ``probe.watch(torch.compile(model))`` or compiled sub-modules: probe's root hooks run before
  the compiled code, the stance applies to the same step. No graph break.
- ``model.compile(...)`` after ``probe.watch(model)``: the watched root's ``compile`` compiles its
  ``forward`` instead of its whole call (:func:`_compile`): as the first case, from step 0,
  and ``fullgraph=True`` works.
- ``torch.compile`` applied after ``probe.watch(model)``, or a compiled training step calling the
  model: Dynamo traces the root module's hooks. probe's hooks then
  run outside the graph (``torch._dynamo.disable``: one graph break at the start and one at
  the end of the root forward, no break inside the model) and the stance, which only applies
  when a compiled function is entered, is armed at the end of the step before each sampled step.
  The first sampled step seen this way ran compiled before probe could intervene: probe skips it
  with a warning, and probes the following sampled steps. A root compiled in place *before*
  ``probe.watch`` (``model.compile(); probe.watch(model)``) is recognized at watch time and
  probed from step 0.

Pitfalls: ``fullgraph=True`` around the root hooks is an error (the hooks are a graph break): a
compiled training step calling the model, ``model.compile(fullgraph=True)`` before the watch;
compile the model and watch the compiled module instead. On a sampled step the model runs at
eager speed and with eager numerics (differences of float rounding from the fused kernels).
A sampled step of a compiled or scripted model that yields no attention call at all (a graph
that never runs Python, e.g. TorchScript or an AOT-compiled artifact) is reported by a warning,
never by silent empty statistics.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, Callable, List, Optional

import torch
from torch import nn

from probe.errors import ProbeError

__all__ = ["EagerSteps", "check_model", "is_compiled", "outside_graph", "skipped_compiled"]


def _dynamo() -> Optional[Any]:
    # Only touch Dynamo when the user already loaded it: importing it costs seconds.
    return sys.modules.get("torch._dynamo")


def outside_graph(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn(*args)`` eagerly even while Dynamo traces the caller (a graph break).

    Used by probe's root hooks when ``torch.compiler.is_compiling()``: hooks that step counters,
    enter modes and register global hooks must not become part of a graph.
    """
    import torch._dynamo

    return torch._dynamo.disable(fn, recursive=True)(*args)


def _set_stance(stance: str) -> Any:
    import torch._dynamo

    # set_stance refuses to run inside a compiled region; a disabled function is never one.
    return torch._dynamo.disable(lambda: torch._dynamo.set_stance(stance))()


def _restore(ctx: Any) -> None:
    import torch._dynamo

    torch._dynamo.disable(lambda: ctx.__exit__(None, None, None))()


class _ForceEager:
    """One ``force_eager`` stance shared by every probe in the process, reference counted.

    Nested probes enter and leave in hook order, not in stack order (the outer probe's forward
    hook runs first): restoring each probe's own saved stance would leave ``force_eager`` set
    for good. The first holder sets it, the last one restores what was there before.
    """

    def __init__(self) -> None:
        self._holders = 0
        self._ctx: Optional[Any] = None

    def acquire(self) -> bool:
        if self._holders == 0:
            self._ctx = _set_stance("force_eager")
        self._holders += 1
        return True

    def release(self) -> None:
        self._holders = max(0, self._holders - 1)
        if self._holders == 0 and self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            _restore(ctx)


_SHARED_STANCE = _ForceEager()


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or a sub-module is compiled (``torch.compile``, ``Module.compile``) or
    scripted (TorchScript): the cases where a sampled step may run code probe cannot see."""
    script = torch.jit.ScriptModule
    for module in model.modules():
        # read from the instance's dict and its sub-modules (an OptimizedModule's ``_orig_mod``),
        # not by hasattr: a missing attribute goes through Module.__getattr__ and an
        # AttributeError (336 against 150 us for the whole walk on a 4-layer BERT)
        state = module.__dict__
        if (isinstance(module, script) or state.get("_compiled_call_impl") is not None
                or "_orig_mod" in state or "_orig_mod" in state.get("_modules", ())
                or hasattr(state.get("forward"), "_torchdynamo_orig_callable")):  # (_compile)
            return True
    return False


def check_model(model: nn.Module) -> None:
    """Refuse a TorchScript root (no Python runs inside it, so nothing could ever be captured)
    and warn about TorchScript sub-modules, whose attention calls probe cannot see.

    Raises:
        ProbeError: for a ``torch.jit.ScriptModule`` root.
    """
    if isinstance(model, torch.jit.ScriptModule):
        raise ProbeError(
            "expected `model` to be an eager or torch.compile'd nn.Module, got a TorchScript "
            f"{type(model).__name__}: its attention runs in TorchScript's interpreter, which probe cannot see"
        )
    hidden: List[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(outer + ".") for outer in hidden)
        if isinstance(module, torch.jit.ScriptModule) and not inside:
            hidden.append(name)
    if hidden:
        warnings.warn(
            f"probe: attention inside the TorchScript sub-modules {', '.join(hidden[:5])} is invisible to probe",
            UserWarning,
            stacklevel=3,
        )


def skipped_compiled(step: int) -> str:
    """The warning for a sampled step whose root forward already ran compiled."""
    return (f"probe: step {step} was sampled but the model's root forward already runs compiled (torch.compile "
            "applied after probe.watch, model.compile() or a compiled training step); probe skipped it and runs "
            "later sampled steps eagerly. To probe from the first step, watch the compiled module: "
            "probe.watch(torch.compile(model)).")


class EagerSteps:
    """Holds ``force_eager`` while a sampled step runs; re-arms it before the next one when the
    root hooks are traced (see the module doc).

    Attributes:
        hooks_traced: Dynamo was seen tracing the root hooks (the root forward is compiled).
        in_graph: the current hook call came from a traced (compiled) root forward.
    """

    def __init__(self) -> None:
        self._ctx: Optional[Any] = None
        self.hooks_traced = False
        self.in_graph = False

    @property
    def active(self) -> bool:
        """Whether this object currently holds the ``force_eager`` stance."""
        return self._ctx is not None

    def enter(self) -> None:
        """Set ``force_eager`` (no-op when Dynamo is not loaded: nothing can be compiled)."""
        if self._ctx is None and _dynamo() is not None:
            self._ctx = _SHARED_STANCE.acquire()

    def exit(self) -> None:
        """Restore the stance that was in effect before :meth:`enter`. Safe to call twice."""
        if self._ctx is not None:
            self._ctx = None
            _SHARED_STANCE.release()

    def attach(self, model: nn.Module) -> None:
        """At watch time: a root compiled in place (``model.compile()``) runs its hooks inside its
        compiled ``_call_impl``, so they will be traced; arm for step 0 (always sampled) now.
        A later ``model.compile(...)`` compiles the root's ``forward`` instead (:func:`_compile`)."""
        if getattr(model, "_compiled_call_impl", None) is not None:
            self.hooks_traced = True
            self.arm(True)
        _watched_compile(model)

    @staticmethod
    def detach(model: Optional[nn.Module]) -> None:
        """At close: ``model.compile`` is ``nn.Module.compile`` again (the last probe puts it back)."""
        _unwatched_compile(model)

    def arm(self, next_sampled: bool) -> None:
        """Before the next root forward: eager if it is sampled and the root hooks are traced."""
        if self.hooks_traced and next_sampled:
            self.enter()
        else:
            self.exit()


#: Watched roots whose ``model.compile(...)`` compiles ``forward`` (:func:`_compile`).
_ROOTS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_MODULE_COMPILE: List[Callable[..., Any]] = []  # nn.Module's own compile while it is replaced


def _compile(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``nn.Module.compile`` while a probe is open. On a watched root: ``torch.compile`` of its
    ``forward`` (``model.forward`` becomes the compiled one), where ``nn.Module.compile`` compiles
    its whole call, hooks included. probe's root hooks then stay out of the graph, as with
    ``probe.watch(torch.compile(model))``: sampled steps are probed from step 0, unsampled steps run
    the compiled forward without a graph break, and ``fullgraph=True`` works (the hooks inside the
    compiled call were a graph break, which fullgraph makes an error: the first forward died). The
    same results; other hooks on the root itself run eagerly too. Any other module: its own."""
    if self in _ROOTS:
        self.forward = torch.compile(self.forward, *args, **kwargs)
        return None
    return _MODULE_COMPILE[0](self, *args, **kwargs)


def _watched_compile(model: nn.Module) -> None:
    if not _MODULE_COMPILE:
        _MODULE_COMPILE.append(nn.Module.compile)
        nn.Module.compile = _compile  # type: ignore[method-assign]
    _ROOTS.add(model)


def _unwatched_compile(model: Optional[nn.Module]) -> None:
    if model is not None:
        _ROOTS.discard(model)
    if not _ROOTS and _MODULE_COMPILE:
        nn.Module.compile = _MODULE_COMPILE.pop()  # type: ignore[method-assign]
