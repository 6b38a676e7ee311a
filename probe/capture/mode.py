"""Scoping of capture: the TorchFunctionMode over a sampled root forward, and its site stack.

The mode is entered only on sampled steps (by :class:`probe.Probe`'s root hooks), so an
unsampled step pays nothing but two Python hook calls. While it is active, global module
forward hooks keep a stack of the running modules of the watched model (:class:`ModuleStack`, a
:class:`~probe.capture.sites.SiteStack`): the site of a call is the qualified name of the
innermost one. The mode routes the functions front ends intercept to them
(:class:`~probe.capture.frontend.FrontEnd`); with ``emit=None`` it only applies overrides.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from probe.capture.frontend import FUSED_TYPES, HELD, KWARGS_HOOKED, Emit, FrontEnd, settled
from probe.capture.sites import SiteStack, SitesFilter, WRAPPER_ATTRS, live_stacks, site_filter, site_names
from probe.experiment.overrides import is_applying

__all__ = [  # the site names are re-exported from probe.capture.sites
    "CaptureMode", "ModuleStack", "SitesFilter", "WRAPPER_ATTRS", "in_front_end", "is_mode_active", "running_modules",
    "running_site", "site_filter", "site_names",
]

#: True while a front end handles an intercepted call. Interventions (``probe.experiment.scaling``) are then
#: the front end's to apply or not: an intervention mode never rewrites the calls a front end makes
#: internally (the MHA mirror's SDPA call), or probe would record one scale and run another.
_IN_FRONT_END: contextvars.ContextVar[bool] = contextvars.ContextVar("probe_in_front_end", default=False)


#: The recording mode's ``reserve`` while a front end handles a call (see :func:`reserve_site`).
_RESERVE: contextvars.ContextVar[Optional[Callable[[], Any]]] = contextvars.ContextVar("probe_reserve", default=None)


def reserve_site() -> Optional[Any]:
    """The site key of the module running now, for a call a front end emits later (an eager
    softmax waiting for its ``P @ v``): ``emit(call, key)`` then names the call after the module
    that ran the softmax. ``None`` when the mode has no ``reserve``."""
    reserve = _RESERVE.get()
    return None if reserve is None else reserve()


def _capture_stack() -> Optional["ModuleStack"]:
    """The innermost active capture's module stack: the latest :class:`ModuleStack` among the
    active site stacks (:func:`probe.capture.sites.live_stacks`, the one registry of running
    stacks; ``probe.scaling``'s stacks are plain :class:`SiteStack` s)."""
    for stack in reversed(live_stacks()):
        if isinstance(stack, ModuleStack):
            return stack
    return None


def running_modules() -> List[nn.Module]:
    """The running modules of the innermost active capture's model, innermost first (a front end
    reads a module's declared head count there)."""
    stack = _capture_stack()
    return stack.modules() if stack is not None else []


def running_site() -> Optional[str]:
    """The site name of the innermost running module of the innermost active capture."""
    stack = _capture_stack()
    return stack.running() if stack is not None else None


def in_front_end() -> bool:
    """Whether the current code runs inside a capture front end's ``handle``."""
    return _IN_FRONT_END.get()


class ModuleStack(SiteStack):
    """The site stack of a probe's capture: activated inside the root's forward on a sampled
    step; at module boundaries it lets front ends measure what they could only record, and lets
    modules that need PyTorch's fused kernel run it."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__(root)
        self._suspended: Optional[Tuple[int, "CaptureMode", List[Any]]] = None  # (module id, popped modes)
        self._kw_ids: set = set()  # modules claimed with their kwargs (hooked): _claim, not _entered

    def activate(self, inside_root: bool = True) -> None:  # a capture activates inside its root's forward
        super().activate(inside_root)
        root = self._root()
        self._kw_ids = set()
        for hooked in KWARGS_HOOKED if root is not None else ():  # modules a front end claims by their kwargs
            for m in hooked(root):
                if m is not root and id(m) not in self._kw_ids:
                    self._kw_ids.add(id(m))
                    self._handles.append(m.register_forward_pre_hook(self._claim, with_kwargs=True))

    def claim_root(self, args: Any, kwargs: Any) -> None:
        """The root's forward starts (the capture mode just entered): a root some front end may
        claim is offered as any other module (its own pre-hooks ran before the capture began)."""
        root = self._root()
        if root is not None and isinstance(root, FUSED_TYPES[0]) and self._stack and self._stack[-1][0] == id(root):
            self._maybe_run_fused(root, "root", args, kwargs)

    def deactivate(self) -> None:
        super().deactivate()
        self._suspended = None

    def _entering(self) -> None:
        if self._stack and HELD[0]:  # (a front end may hold calls: FrontEnd.held)
            self._drain()  # calls recorded so far belong to the running module, not this child

    def _entered(self, module: nn.Module, name: str, args: Any) -> None:
        if isinstance(module, FUSED_TYPES[0]) and id(module) not in self._kw_ids:  # (else: _claim, with kwargs)
            self._maybe_run_fused(module, name, args, {})

    def _claim(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A module some front end may claim was pushed (after the global hooks) with these arguments."""
        if self._stack and self._stack[-1][0] == id(module):
            self._maybe_run_fused(module, self._stack[-1][1], args, kwargs)

    def _leaving(self, module: nn.Module) -> None:
        if self._suspended is not None and self._suspended[0] == id(module):
            torch._C._push_on_torch_function_stack(self._suspended[1])
            for rider in reversed(self._suspended[2]):
                torch._C._push_on_torch_function_stack(rider)
            self._suspended = None
        if HELD[0] and self._stack and self._stack[-1][0] == id(module):
            self._drain()

    def _drain(self) -> None:
        """Let front ends measure calls they could only record (FlexAttention, whose operator
        runs inside a compiled region): at every module boundary, attributed to the module on top
        of the stack (the one that issued them), measured with the capture mode paused so the
        statistics' ops are not captured. Called only after a front end said it holds a call
        (:meth:`FrontEnd.held`); when no recording mode holds one, the next boundaries skip."""
        held = False
        for i in range(torch._C._len_torch_function_stack()):
            mode = torch._C._get_function_stack_at(i)
            if isinstance(mode, CaptureMode) and mode.recording and mode.pending():
                mode.drain(self._stack[-1][1])
                held = held or mode.pending()  # (a drain that measured nothing keeps its calls)
        if not held and self._suspended is None:  # (a suspended mode is off the stack: ask again later)
            settled()

    def _maybe_run_fused(self, module: nn.Module, name: str, args: Any, kwargs: Any) -> None:
        """Let a module run PyTorch's fused kernel when only that path can run it, or when
        PyTorch would pick it without probe.

        A module whose input is a nested tensor (``nn.MultiheadAttention``,
        ``nn.TransformerEncoderLayer``) must take its fast path, and in eval without gradients
        these and ``nn.TransformerEncoder`` may: an active TorchFunctionMode forbids both
        (``has_torch_function``). A front end with ``runs_fused(module, args, kwargs)`` claims such a
        module: the capture mode leaves the function-mode stack until the module returns, and the
        front end's ``measure_fused(module, name, args, kwargs, mode, site)`` measures it. Modules
        entered meanwhile are offered to the same front end with ``inside=True``, to measure only.
        """
        parent = self._stack[-2][3] if len(self._stack) > 1 and len(self._stack[-2]) > 3 else None
        if self._suspended is not None:  # an ancestor runs outside the mode: measure only
            mode = self._suspended[1]
            for candidate in mode._fusers:
                if isinstance(module, candidate.fused_types or nn.Module) and candidate.runs_fused(
                        module, args, kwargs, parent=parent, inside=True):
                    candidate.measure_fused(module, name, args, kwargs, mode, self.named_site, parent=parent)
                    break
            return
        n = torch._C._len_torch_function_stack()
        riders = []  # modes that ride on the capture mode (probe.capture.audit): they leave with it
        while n > len(riders) and getattr(torch._C._get_function_stack_at(n - 1 - len(riders)), "rides_capture", False):
            riders.append(torch._C._get_function_stack_at(n - 1 - len(riders)))
        mode = torch._C._get_function_stack_at(n - 1 - len(riders)) if n > len(riders) else None
        if not isinstance(mode, CaptureMode) or not mode.recording:
            return
        frontend = None
        for candidate in mode._fusers:  # only front ends overriding FrontEnd.runs_fused, for their types
            if isinstance(module, candidate.fused_types or nn.Module) and candidate.runs_fused(
                    module, args, kwargs, parent=parent):
                frontend = candidate
                break
        if frontend is None:
            return
        for _ in range(len(riders) + 1):
            torch._C._pop_torch_function_stack()
        self._suspended = (id(module), mode, riders)
        assert mode.emit is not None  # a recording mode
        frontend.measure_fused(module, name, args, kwargs, mode, self.named_site, parent=parent)

    @contextlib.contextmanager
    def named_site(self, name: str) -> Iterator[None]:
        """Calls emitted inside are attributed to ``name`` (a child the fused kernel runs for)."""
        self._stack.append([None, name, 0])
        try:
            yield
        finally:
            self._stack.pop()


class CaptureMode(TorchFunctionMode):
    """Routes the functions that front ends intercept to them; everything else runs untouched.

    Inside ``__torch_function__`` this mode is disabled, so the statistics computed from an
    emitted call are not themselves intercepted.

    With ``emit=None`` the mode records nothing and only has its front ends apply overrides
    (:mod:`probe.experiment.overrides`; this is :class:`probe.experiment.scaling.InterventionMode`). Such a mode
    leaves a call alone when it is already being applied, when a front end issues it internally
    (its recorded scale must stay true), or when a recording mode below it routes the call to a
    front end that applies overrides itself (probe then records the overridden scale).
    """

    def __init__(self, frontends: Sequence[FrontEnd], emit: Optional[Emit],
                 reserve: Optional[Callable[[], Any]] = None) -> None:
        super().__init__()
        self._reserve = reserve
        self.frontends: List[FrontEnd] = list(frontends)
        # function -> index of its front end in self.frontends (the last one naming it), built
        # once per set of front ends: a probe makes a mode at every sampled step
        self._routes = _routes(self.frontends)
        self.emit = emit
        self.recording = emit is not None
        self._traceable = [(f, fe) for fe in frontends if fe.traceable for f in fe.funcs]
        self._paused = False
        #: the front end that sees every other op while it follows tensors (the eager tracer)
        self._catch_all = next((fe for fe in frontends if fe.catch_all), None)
        # the front ends that can hold recorded calls (asked at every module boundary): those
        # overriding FrontEnd.has_pending, which is always False
        self._holders = [fe for fe in frontends if type(fe).has_pending is not FrontEnd.has_pending]
        # the front ends that may claim a module for PyTorch's fused kernel (asked at every module
        # entry): those overriding FrontEnd.runs_fused, which is always False
        self._fusers = [fe for fe in frontends if type(fe).runs_fused is not FrontEnd.runs_fused]

    def __exit__(self, *exc: Any) -> None:
        # Front ends that track tensors during the forward (eager) forget them here.
        try:
            super().__exit__(*exc)
        finally:
            for frontend in self.frontends:
                frontend.reset()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        if self.recording and torch.compiler.is_compiling():
            # Dynamo traces this mode inside a compiled region (FlexAttention compiles its
            # operator even in eager mode): only front ends marked ``traceable`` may act there.
            for traced, frontend in self._traceable:
                if func is traced:
                    return frontend.handle(func, args, kwargs, self.emit)
            return func(*args, **kwargs)
        route = self._routes.get(func)
        frontend = None if route is None else self.frontends[route]
        if frontend is None:
            catch_all = self._catch_all
            if catch_all is None or not catch_all.watching(args, kwargs, func):
                return func(*args, **kwargs)
            frontend = catch_all
        elif frontend.passes(func, args, kwargs):  # cheap rejection: nothing for the front end to do
            return func(*args, **kwargs)
        if not self.recording and (not frontend.overrides_active() or is_applying() or in_front_end()
                                   or _recorder_below(func)):
            return func(*args, **kwargs)
        token = _IN_FRONT_END.set(True)
        reserving = _RESERVE.set(self._reserve)
        try:
            return frontend.handle(func, args, kwargs, self.emit)
        finally:
            _RESERVE.reset(reserving)
            _IN_FRONT_END.reset(token)

    def pass_through(self) -> None:
        """Pass every function through untouched from now on. For the mode's owner when the mode
        cannot be popped yet (from inside its own handler): the owner pops it later."""
        self._paused = True

    def pending(self) -> bool:
        """Whether a front end holds calls recorded but not yet measured."""
        for frontend in self._holders:  # a loop, not any() over a generator: every module boundary
            if frontend.has_pending():
                return True
        return False

    def drain(self, site: str) -> None:
        """Have front ends measure their recorded calls now (:meth:`FrontEnd.drain`), with this
        mode passing every function through (it may sit below another mode: it is paused, not
        popped)."""
        if self.emit is None:
            return
        self._paused = True
        try:
            for frontend in self.frontends:
                if frontend.has_pending():
                    frontend.drain(self.emit, site)
        finally:
            self._paused = False

    def consults_overrides(self, func: Callable[..., Any]) -> bool:
        """Whether this mode records and its front end for ``func`` applies overrides itself
        (its class sets ``applies_overrides = True``), so an intervention mode above this one
        must leave the call to it: probe then records the overridden scale as ``actual``."""
        route = self._routes.get(func)
        return self.recording and route is not None and self.frontends[route].applies_overrides


# The routes of recent sets of front ends, by their ids: (the front ends, weakly; their funcs; the routes).
_ROUTES: "OrderedDict[Tuple[int, ...], Tuple[Tuple[weakref.ref, ...], Tuple[Any, ...], Dict[Callable[..., Any], int]]]" = OrderedDict()


def _routes(frontends: Sequence[FrontEnd]) -> Dict[Callable[..., Any], int]:
    """Function -> index of the front end that intercepts it (the last one naming it), cached for
    the same front ends (callers must not change the dict)."""
    key = tuple(id(f) for f in frontends)
    hit = _ROUTES.get(key)
    if (hit is not None and all(r() is f for r, f in zip(hit[0], frontends))
            and all(funcs is f.funcs for funcs, f in zip(hit[1], frontends))):
        return hit[2]
    routes: Dict[Callable[..., Any], int] = {}
    for index, frontend in enumerate(frontends):
        for func in frontend.funcs:
            routes[func] = index
    _ROUTES[key] = (tuple(weakref.ref(f) for f in frontends), tuple(f.funcs for f in frontends), routes)
    while len(_ROUTES) > 16:
        _ROUTES.popitem(last=False)
    return routes


def _recorder_below(func: Callable[..., Any]) -> bool:
    # Inside __torch_function__ the running mode is popped: the stack holds only the modes below it.
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, CaptureMode) and m.consults_overrides(func) for m in _get_current_function_mode_stack())


def is_mode_active(mode: Optional[TorchFunctionMode]) -> bool:
    """Whether ``mode`` is on the current TorchFunctionMode stack (for tests and cleanup)."""
    from torch.overrides import _get_current_function_mode_stack

    return mode is not None and any(m is mode for m in _get_current_function_mode_stack())
