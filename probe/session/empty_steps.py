"""A sampled step that measured nothing is said, never an empty summary without a word.

probe measures the attention that runs inside the forward of the module passed to
``probe.watch``. Two ways a sampled step ends with nothing recorded:

* the watched module's forward ran, but no attention call was captured inside it (a model
  without attention, or one whose attention runs where probe cannot see it: the first-forward
  audit names those it finds);
* with explicit steps (``p.step(n)``), the watched module's forward never ran during the step:
  its parts were called directly (a ``LightningModule`` whose ``training_step`` calls its
  submodules, a wrapper whose ``forward`` is not the training path). Then :class:`EmptySteps`
  watches, on that step only, which of the watched module's submodules run instead (one global
  forward pre-hook, removed when the root's forward starts or the step ends), and names them.

A step recorded whole (``p.step(n, window=True)``, the Lightning callback's training batches:
every attention call is captured, whatever module runs it) that captured nothing is the third
case, said with the submodules that ran.

Each case is one ``UserWarning`` per probe, naming the watched module. Steps that are not sampled
cost nothing; after the warning the watcher is no longer armed.

With automatic steps (one root forward is one step) there is no step to judge when the watched
module's forward never runs: ``model.forward(x)`` called directly skips ``nn.Module.__call__``
and with it the root's hooks (TransformerLens' ``run_with_hooks`` and ``generate`` do so), and
nothing at all would be measured, without a word. So the modules the root's forward calls
directly (its children, looking through ``ModuleList`` / ``ModuleDict``; not ``torch.nn`` leaves,
which run no attention) carry a forward
pre-hook while the probe is open: one that runs outside the root's forward, between two root
forwards and not paused, is said once, naming it. It does nothing inside the root's forward, in
a backward (activation checkpointing reruns them) or traced by Dynamo; it is per module, not
global (a global module hook makes every ``torch.compile``'d module warn), and a copy of the
model carries it inert.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from probe.capture.sites import site_names
from probe.session.forward_guard import RootHook

__all__ = ["EmptySteps"]


def _builtin_leaf(module: nn.Module) -> bool:
    """A ``torch.nn`` module without children (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``...):
    it runs no attention, so calling it outside the watched forward (a user's own logging of
    ``model.q(x)``, a tied ``lm_head``) is not worth a warning."""
    return type(module).__module__.startswith("torch.nn.") and next(module.children(), None) is None

#: How many submodules that ran instead a warning names.
_SHOWN = 6


def _describe(model: nn.Module) -> str:
    return f"{type(model).__name__}"


class EmptySteps:
    """Warns once when a sampled step of ``model`` measured no attention (module docstring).

    The profiler calls :meth:`begin` when an explicit step starts, :meth:`forward_end` when a
    captured root forward ends (with the number of attention calls it captured) and :meth:`end`
    when a step is over (the next ``p.step``, ``close``).
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)  # weakly: a forgotten probe is collected with its model
        self._step: Optional[int] = None
        self._sampled = False
        self._forwards = 0  # root forwards captured in the current step
        self._calls = 0  # attention calls they captured
        self._ran: List[str] = []  # watched submodules that ran while the root's forward did not
        self._names: Dict[int, str] = {}
        self._handle: Optional[RemovableHandle] = None
        self._root_ran = False
        self._windows = 0  # recording windows of the current step that closed
        self.warned = False
        self._outside: List[RemovableHandle] = []  # on the modules the root calls (automatic steps)
        self._outside_armed = False  # between two root forwards, not paused
        self._outside_names: Optional[Dict[int, str]] = None  # read at the first module seen outside
        self.warned_outside = False

    def begin(self, step: int, sampled: bool) -> None:
        """An explicit step begins (``p.step(step)``); watch what runs if it is sampled. The same
        step again (its next micro-batch) goes on counting."""
        self.outside(False)  # counting is explicit from now on
        if step == self._step and sampled == self._sampled:
            return
        self.end()
        self._step, self._sampled = step, sampled
        self._forwards = self._calls = 0
        self._ran = []
        self._root_ran = False
        if sampled and not self.warned:
            model = self._model()
            self._names = {} if model is None else site_names(model)
            self._handle = nn.modules.module.register_module_forward_pre_hook(self._seen)

    def _seen(self, module: nn.Module, args: Any) -> None:
        if module is self._model():
            self._root_ran = True  # its own forward runs (captured, or paused for an evaluation)
            self._disarm()
            return
        name = self._names.get(id(module))
        if name is not None and len(self._ran) < 64 and not any(name.startswith(r + ".") or name == r for r in self._ran):
            self._ran.append(name)

    def _disarm(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def outside(self, armed: bool) -> None:
        """Automatic steps: watch (``armed``), until the next root forward, for a module the root
        calls that runs outside its forward (module docstring); ``False`` stops watching."""
        self._outside_armed = armed and not self.warned_outside
        model = self._model()
        if self._outside_armed and not self._outside and model is not None:
            # an nn.TransformerEncoderLayer takes its fast path only without a hook on it or any
            # module inside it: none is put there (a hook must never change what the model computes)
            todo = [] if isinstance(model, nn.TransformerEncoderLayer) else list(model.children())
            while todo:
                m = todo.pop(0)
                if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
                    todo.extend(m.children())  # containers are not called: their children are
                elif m is not model and not _builtin_leaf(m) and not isinstance(m, nn.TransformerEncoderLayer):
                    self._outside.append(m.register_forward_pre_hook(RootHook(self._seen_outside)))

    def _unhook_outside(self) -> None:
        self._outside_armed = False
        for handle in self._outside:
            handle.remove()
        self._outside = []

    def _seen_outside(self, module: nn.Module, args: Any) -> None:
        if not self._outside_armed or torch.compiler.is_compiling() or torch._C._current_graph_task_id() != -1:
            return  # inside the root's forward, traced by Dynamo, or rerun by a backward
        model = self._model()
        if model is None:
            return
        if self._outside_names is None:
            self._outside_names = site_names(model)
        name = self._outside_names.get(id(module), type(module).__name__)
        self.warned_outside = True
        self._unhook_outside()
        warnings.warn(
            f"probe: {name!r} ({type(module).__name__}), a submodule of the watched module {_describe(model)}, ran "
            "outside the watched module's forward, so probe measures nothing it runs: any attention in it is NOT "
            "measured. probe measures the attention that runs inside the forward of the module passed to "
            "probe.watch, called as a module (model(x)): model.forward(x) called directly skips nn.Module.__call__ "
            "and its hooks (TransformerLens' run_with_hooks and generate do so). Call the watched module itself, "
            "watch the module whose forward runs, or record the whole step with p.step(n, window=True).",
            UserWarning, stacklevel=3)

    def forward_end(self, step: int, calls: int, auto: bool, compiled: bool = False) -> None:
        """A captured root forward of ``step`` ended having captured ``calls`` attention calls.
        With automatic steps (one forward is one step) the step is judged now. ``compiled``: the
        root runs compiled or scripted code (no call at all then has its own warning)."""
        self._disarm()
        if compiled and not calls and not self.warned:
            self.warned = True
            warnings.warn(f"probe: step {step} was sampled but no attention call was captured in this compiled or "
                          "scripted model: its graph does not run probe's capture (TorchScript, an exported or "
                          "AOT-compiled artifact?). Watch the nn.Module, or the torch.compile'd module, instead.",
                          UserWarning, stacklevel=4)
        if self._step != step:
            self._step, self._forwards, self._calls, self._ran = step, 0, 0, []
        self._sampled = True
        self._forwards += 1
        self._calls += calls
        if auto:
            self.end()

    def window_end(self, step: int, calls: int) -> None:
        """A recording window of ``step`` closed having captured ``calls`` attention calls."""
        if step == self._step:
            self._windows += 1
            self._calls += calls

    def end(self, closing: bool = False) -> None:
        """The current step is over: warn (once) when it was sampled and measured nothing.
        ``closing``: the probe closes, possibly because the step raised before any forward (a
        failed training step): a step whose forward never ran is then warned only when some of
        the watched module's submodules ran in it."""
        self._disarm()
        if closing:
            self._unhook_outside()
        step, sampled, forwards, calls, ran = self._step, self._sampled, self._forwards, self._calls, self._ran
        windows, self._windows = self._windows, 0
        self._step, self._sampled, self._forwards, self._calls, self._ran = None, False, 0, 0, []
        if step is None or not sampled or calls or self.warned:
            return
        if not windows and not forwards and (self._root_ran or closing and not ran):
            return
        if windows and closing and not ran and not self._root_ran:
            return  # the step raised before any part of the module ran
        model = self._model()
        watched = "the watched module" if model is None else _describe(model)
        shown = ", ".join(ran[:_SHOWN]) + (f" and {len(ran) - _SHOWN} more" if len(ran) > _SHOWN else "")
        if windows:
            what = "its own forward" if self._root_ran else (f"its submodules {shown}" if ran else "none of its parts")
            message = (f"probe: step {step} was sampled and everything it ran was recorded (the whole training step, "
                       f"not only the forward of the watched module {watched}), but no attention call was captured: "
                       f"{what} ran, and no F.scaled_dot_product_attention, nn.MultiheadAttention, FlexAttention or "
                       "softmax over q·kᵀ that probe measures. The summary has no site for this step.")
        elif forwards:
            message = (f"probe: step {step} was sampled but no attention call was captured inside the watched module "
                       f"({watched}): its forward ran {forwards} time(s) and no F.scaled_dot_product_attention, "
                       "nn.MultiheadAttention, FlexAttention or softmax over q·kᵀ that probe measures ran inside it. "
                       "The summary has no site for this step.")
        else:
            instead = f"; these of its submodules ran directly instead: {shown}" if ran else ""
            message = (f"probe: step {step} was sampled but the forward of the watched module ({watched}) never ran "
                       f"during it, so nothing was measured{instead}. probe measures the attention that runs inside "
                       "the forward of the module passed to probe.watch: watch the module whose forward runs (e.g. "
                       "probe.watch(model.backbone)), call the watched module itself, or record the whole step "
                       "with p.step(n, window=True).")
        self.warned = True
        warnings.warn(message, UserWarning, stacklevel=4)

    def remove(self) -> None:
        """Remove the watcher's hooks (harmless twice)."""
        self._disarm()
        self._unhook_outside()
