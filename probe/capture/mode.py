"""Scoping of capture: the TorchFunctionMode over a sampled root forward, and site naming.

The mode is entered only on sampled steps (by :class:`probe.Probe`'s root hooks), so an
unsampled step pays nothing but two Python hook calls. While it is active, global module
forward hooks keep a stack of the running modules of the watched model: the site of a call is
the qualified name of the innermost one.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from probe.call import AttentionCall
from probe.overrides import is_applying

__all__ = ["CaptureMode", "FrontEnd", "ModuleStack", "SitesFilter", "WRAPPER_ATTRS", "site_filter", "site_names"]

#: True while a front end handles an intercepted call. Interventions (``probe.intervene``) are then
#: the front end's to apply or not: an intervention mode never rewrites the calls a front end makes
#: internally (the MHA mirror's SDPA call), or probe would record one scale and run another.
_IN_FRONT_END: contextvars.ContextVar[bool] = contextvars.ContextVar("probe_in_front_end", default=False)


def in_front_end() -> bool:
    """Whether the current code runs inside a capture front end's ``handle``."""
    return _IN_FRONT_END.get()


FrontEnd = Any  # an object with ``funcs`` (a tuple of callables) and ``handle(func, args, kwargs, emit)``


#: Which sites to keep: a glob, a list of names or globs, or a predicate on the site name.
SitesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]


def site_filter(sites: SitesFilter) -> Optional[Callable[[str], bool]]:
    """A predicate on site names from a ``sites=`` argument (``None`` keeps every site).

    Raises:
        ProbeError: for anything but a glob, a list of names/globs or a callable.
    """
    import fnmatch

    from probe.errors import ProbeError

    if sites is None:
        return None
    if isinstance(sites, str):
        return lambda name: fnmatch.fnmatchcase(name, sites)
    if isinstance(sites, (list, tuple, set, frozenset)) and all(isinstance(s, str) for s in sites):
        patterns = list(sites)
        return lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)
    if callable(sites):
        return sites
    raise ProbeError(f"expected `sites` to be a glob, a list of names/globs or a predicate, got {sites!r}")


class ModuleStack:
    """The running modules of one model, maintained by global forward hooks while active.

    Each entry counts the attention calls its module issued in the current invocation, so a
    module that issues several gets call indices 0, 1, ... (reported as ``#1``, ``#2``).
    """

    def __init__(self, root: nn.Module) -> None:
        self._root = root
        self._names: Dict[int, str] = {}
        self._stack: List[List[Any]] = []  # [module id, name, calls issued]
        self._handles: List[RemovableHandle] = []
        self._suspended: Optional[Tuple[int, "CaptureMode"]] = None  # (module id, popped mode)

    def activate(self) -> None:
        # Re-read the module tree each sampled step: modules may have been added since.
        self._names = site_names(self._root)
        self._stack = [[id(self._root), "root", 0]]
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._push),
            nn.modules.module.register_module_forward_hook(self._pop, always_call=True),
        ]

    def deactivate(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack = []
        self._suspended = None

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def _push(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is not None and module is not self._root:  # the root is the stack's bottom
            if self._stack:
                self._drain()  # calls recorded so far belong to the running module, not this child
            self._stack.append([id(module), name, 0])
            if self._suspended is None:
                self._maybe_run_fused(module, name, args)

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._suspended is not None and self._suspended[0] == id(module):
            torch._C._push_on_torch_function_stack(self._suspended[1])
            self._suspended = None
        if self._stack and self._stack[-1][0] == id(module):
            self._drain()
        if len(self._stack) > 1 and self._stack[-1][0] == id(module):
            self._stack.pop()

    def _drain(self) -> None:
        """Let front ends measure calls they could only record (FlexAttention, whose operator
        runs inside a compiled region): at every module boundary, attributed to the module on top
        of the stack (the one that issued them), measured with the capture mode paused so the
        statistics' ops are not captured."""
        for i in range(torch._C._len_torch_function_stack()):
            mode = torch._C._get_function_stack_at(i)
            if isinstance(mode, CaptureMode) and mode.recording and mode.pending():
                mode.drain(self._stack[-1][1])

    def _maybe_run_fused(self, module: nn.Module, name: str, args: Any) -> None:
        """Let a module run PyTorch's fused kernel when only that path can run it.

        A module whose input is a nested tensor (``nn.MultiheadAttention``,
        ``nn.TransformerEncoderLayer``) must take its fast path, which an active TorchFunctionMode
        forbids (``has_torch_function``). A front end with ``runs_fused(module, args)`` claims such a
        module: the capture mode leaves the function-mode stack until the module returns, and the
        front end's ``measure_fused(module, name, args, emit, site)`` measures it from its weights.
        """
        n = torch._C._len_torch_function_stack()
        mode = torch._C._get_function_stack_at(n - 1) if n else None
        if not isinstance(mode, CaptureMode) or not mode.recording:
            return
        claims = (f for f in dict.fromkeys(mode._routes.values()) if hasattr(f, "runs_fused"))
        frontend = next((f for f in claims if f.runs_fused(module, args)), None)
        if frontend is None:
            return
        torch._C._pop_torch_function_stack()
        self._suspended = (id(module), mode)
        frontend.measure_fused(module, name, args, mode._emit, self.named_site)

    @contextlib.contextmanager
    def named_site(self, name: str) -> Iterator[None]:
        """Calls emitted inside are attributed to ``name`` (a child the fused kernel runs for)."""
        self._stack.append([None, name, 0])
        try:
            yield
        finally:
            self._stack.pop()

    def next_site(self) -> Tuple[str, int]:
        """(qualified name, index of this call within the module's current invocation)."""
        top = self._stack[-1] if self._stack else [id(self._root), "root", 0]
        index = top[2]
        top[2] += 1
        return top[1], index


#: Attributes through which wrappers hold the module they wrap: torch.compile's OptimizedModule,
#: FSDP1, activation checkpointing. Sites are named as for the bare model.
WRAPPER_ATTRS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def site_names(root: nn.Module) -> Dict[int, str]:
    """id(module) → site name: its qualified name in ``root`` without wrapper segments.

    ``DistributedDataParallel`` / ``DataParallel`` hold the model as ``module``, so
    ``probe.watch(ddp_model)`` (or ``probe.watch(torch.compile(ddp_model))``) names sites
    ``layers.0``, not ``module.layers.0``; the :data:`WRAPPER_ATTRS` are dropped anywhere in the tree. The wrapped module itself is named like its
    wrapper (a call issued directly by the wrapped root is ``root``).
    """
    modules = dict(root.named_modules())
    names: Dict[int, str] = {}
    for name, module in modules.items():
        parts: List[str] = []
        path = ""
        for part in name.split(".") if name else []:
            parallel = isinstance(modules.get(path), (nn.parallel.DistributedDataParallel, nn.DataParallel))
            if part not in WRAPPER_ATTRS and not (parallel and part == "module"):
                parts.append(part)
            path = f"{path}.{part}" if path else part
        names[id(module)] = ".".join(parts) or "root"
    return names


class CaptureMode(TorchFunctionMode):
    """Routes the functions that front ends intercept to them; everything else runs untouched.

    Inside ``__torch_function__`` this mode is disabled, so the statistics computed from an
    emitted call are not themselves intercepted.

    With ``emit=None`` the mode records nothing and only has its front ends apply overrides
    (:mod:`probe.overrides`; this is :class:`probe.intervene.InterventionMode`). Such a mode
    leaves a call alone when it is already being applied, when a front end issues it internally
    (its recorded scale must stay true), or when a recording mode below it routes the call to a
    front end that applies overrides itself (probe then records the overridden scale).
    """

    def __init__(self, frontends: Sequence[FrontEnd], emit: Optional[Callable[[AttentionCall], None]]) -> None:
        super().__init__()
        self._routes: Dict[Callable[..., Any], FrontEnd] = {}
        for frontend in frontends:
            for func in frontend.funcs:
                self._routes[func] = frontend
        self._frontends = list(frontends)
        self._emit = emit
        self.recording = emit is not None
        self._traceable = [(f, fe) for fe in frontends if getattr(fe, "traceable", False) for f in fe.funcs]
        self._recording = [fe for fe in frontends if hasattr(fe, "pending") and hasattr(fe, "drain")]
        self._paused = False

    def __exit__(self, *exc: Any) -> None:
        # Front ends that track tensors during the forward (eager) forget them here.
        try:
            super().__exit__(*exc)
        finally:
            for frontend in self._frontends:
                reset = getattr(frontend, "reset", None)
                if reset is not None:
                    reset()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        if self.recording and torch.compiler.is_compiling():
            # Dynamo traces this mode inside a compiled region (FlexAttention compiles its
            # operator even in eager mode): only front ends marked ``traceable`` may act there.
            for traced, frontend in self._traceable:
                if func is traced:
                    return frontend.handle(func, args, kwargs, self._emit)
            return func(*args, **kwargs)
        frontend = self._routes.get(func)
        if frontend is None:
            return func(*args, **kwargs)
        if not self.recording and (is_applying() or in_front_end() or _recorder_below(func)):
            return func(*args, **kwargs)
        token = _IN_FRONT_END.set(True)
        try:
            return frontend.handle(func, args, kwargs, self._emit)
        finally:
            _IN_FRONT_END.reset(token)

    def pending(self) -> bool:
        """Whether a front end holds calls recorded but not yet measured (``pending`` list)."""
        return any(f.pending for f in self._recording)

    def drain(self, site: str) -> None:
        """Have front ends with ``drain(emit, site)`` measure their recorded calls now, with this
        mode passing every function through (it may sit below another mode: it is paused, not
        popped)."""
        self._paused = True
        try:
            for frontend in self._recording:
                if frontend.pending:
                    frontend.drain(self._emit, site)
        finally:
            self._paused = False

    def consults_overrides(self, func: Callable[..., Any]) -> bool:
        """Whether this mode records and its front end for ``func`` applies overrides itself
        (its class sets ``applies_overrides = True``), so an intervention mode above this one
        must leave the call to it: probe then records the overridden scale as ``actual``."""
        return self.recording and bool(getattr(self._routes.get(func), "applies_overrides", False))


def _recorder_below(func: Callable[..., Any]) -> bool:
    # Inside __torch_function__ the running mode is popped: the stack holds only the modes below it.
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, CaptureMode) and m.consults_overrides(func) for m in _get_current_function_mode_stack())


def default_frontends() -> List[FrontEnd]:
    """The front ends every probe uses."""
    from probe.capture.eager import EagerFrontEnd
    from probe.capture.flex import FlexFrontEnd
    from probe.capture.mha import MHAFrontEnd
    from probe.capture.sdpa import SDPAFrontEnd

    return [SDPAFrontEnd(), EagerFrontEnd(), MHAFrontEnd(), FlexFrontEnd()]


def is_mode_active(mode: Optional[TorchFunctionMode]) -> bool:
    """Whether ``mode`` is on the current TorchFunctionMode stack (for tests and cleanup)."""
    from torch.overrides import _get_current_function_mode_stack

    return mode is not None and any(m is mode for m in _get_current_function_mode_stack())
