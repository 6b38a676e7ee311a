"""Site naming: which module of the watched model issued an attention call.

A site is the qualified name of the innermost running module of the model (``root`` for the
model itself), without wrapper segments; a module that issues several calls in one invocation
gets call indices 0, 1, ... (reported as ``name#1``, ``name#2``). :class:`SiteStack` keeps the
running modules with global forward hooks while active; the capture mode's
:class:`~probe.capture.mode.ModuleStack` and the interventions (``probe.scaling``, variants)
both name sites with it.
"""

from __future__ import annotations

import fnmatch
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from torch import nn
from torch.utils.hooks import RemovableHandle

from probe.errors import ProbeError

__all__ = ["SiteStack", "SitesFilter", "WRAPPER_ATTRS", "function_module", "live_modules", "live_stacks", "site_filter",
           "site_names"]

#: Which sites to keep: a glob, a list of names or globs, or a predicate on the site name.
SitesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]

#: Attributes through which wrappers hold the module they wrap: torch.compile's OptimizedModule,
#: FSDP1, activation checkpointing. Sites are named as for the bare model.
WRAPPER_ATTRS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def site_filter(sites: SitesFilter) -> Optional[Callable[[str], bool]]:
    """A predicate on site names from a ``sites=`` argument (``None`` keeps every site).

    Raises:
        ProbeError: for anything but a glob, a list of names/globs or a callable.
    """
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


def site_names(root: nn.Module) -> Dict[int, str]:
    """id(module) → site name: its qualified name in ``root`` without wrapper segments.

    ``DistributedDataParallel`` / ``DataParallel`` hold the model as ``module``, so
    ``probe.watch(ddp_model)`` (or ``probe.watch(torch.compile(ddp_model))``) names sites
    ``layers.0``, not ``module.layers.0``; the :data:`WRAPPER_ATTRS` are dropped anywhere in the
    tree. The wrapped module itself is named like its wrapper (a call issued directly by the
    wrapped root is ``root``).
    """
    modules = dict(root.named_modules())
    # the same tree as last time (every sampled step asks): its names again, a copy
    tree = tuple((name, id(module), type(module)) for name, module in modules.items())
    try:
        cached = _NAMES.get(root)
    except TypeError:  # a root whose class made it unhashable (a dataclass with eq=True): no cache
        cached = None
    if cached is not None and cached[0] == tree:
        return dict(cached[1])
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
    try:
        _NAMES[root] = (tree, dict(names))
    except TypeError:
        pass
    return names


# root -> (its tree as (name, id, type) per module, its names) from the last site_names(root): the
# tree holds ids of live modules only while they are in it, and a changed tree recomputes
_NAMES: "weakref.WeakKeyDictionary[nn.Module, Tuple[tuple, Dict[int, str]]]" = weakref.WeakKeyDictionary()


#: Parameterless ``torch.nn`` leaves that only wrap a function: a call they issue belongs to the
#: module that called them (``self.softmax = nn.Softmax(-1)`` runs its parent's softmax).
FUNCTION_MODULES = (nn.Softmax, nn.LogSoftmax, nn.Dropout, nn.Identity)
#: The same leaves of Keras 3 on the torch backend (``keras.layers.MultiHeadAttention`` runs its
#: softmax in a ``Softmax`` layer), by class name: probe never imports keras.
KERAS_FUNCTION_LAYERS = frozenset({"Softmax", "Dropout", "Activation", "Identity"})


def function_module(module: nn.Module) -> bool:
    """A parameterless leaf that only wraps a function: its calls belong to the module that called it."""
    cls = type(module)
    return isinstance(module, FUNCTION_MODULES) or (
        cls.__module__.startswith("keras.") and cls.__name__ in KERAS_FUNCTION_LAYERS)


#: Every active :class:`SiteStack` (a probe's capture, a ``probe.scaling`` rule), latest last.
_LIVE: List["SiteStack"] = []


def live_stacks() -> List["SiteStack"]:
    """Every active site stack, latest last (a copy): probe's captures and ``probe.scaling``'s."""
    return list(_LIVE)


def live_modules() -> List[nn.Module]:
    """The running modules, innermost first, of the latest active stack whose root runs (a front
    end reads a module's attributes there, also under ``probe.scaling`` alone)."""
    for stack in reversed(_LIVE):
        if stack.root_running:
            return stack.modules()
    return []


class SiteStack:
    """The running modules of one model, kept by global forward hooks while active.

    Each entry counts the attention calls its module issued in the current invocation. The
    root's counter restarts at each root forward, and modules running while the root does not
    (another model) belong to no site. Subclasses act at module boundaries through
    :meth:`_entering`, :meth:`_entered` and :meth:`_leaving`.
    """

    def __init__(self, root: nn.Module) -> None:
        # weakly: the root's own hooks hold whoever holds this stack (a probe), and a probe
        # forgotten by its user must be collected with its model (probe.session.profiler)
        self._root = weakref.ref(root)
        self._root_id = id(root)
        self._names: Dict[int, str] = {}
        self._stack: List[List[Any]] = []  # [module id, name, calls issued, module]
        self._handles: List[RemovableHandle] = []
        self.root_running = 0

    def activate(self, inside_root: bool = False) -> None:
        """Start tracking (``inside_root``: called from within the root's own forward)."""
        # Re-read the module tree at each activation: modules may have been added since.
        root = self._root()
        self._names = {} if root is None else site_names(root)
        self._stack = [[self._root_id, "root", 0, root]] if inside_root else []
        self.root_running = int(inside_root)
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._push),
            nn.modules.module.register_module_forward_hook(self._pop, always_call=True),
        ]
        _LIVE.append(self)

    def deactivate(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._stack, self.root_running = [], [], 0
        for i in range(len(_LIVE) - 1, -1, -1):
            if _LIVE[i] is self:
                del _LIVE[i]
                break

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def _push(self, module: nn.Module, args: Any) -> None:
        if module is self._root():
            if self.root_running == 0:
                self._stack = [[id(module), "root", 0, module]]
            self.root_running += 1
            return
        name = self._names.get(id(module))
        if name is not None and self.root_running and not function_module(module):
            self._entering()
            self._stack.append([id(module), name, 0, module])
            self._entered(module, name, args)

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        self._leaving(module)
        if module is self._root():
            self.root_running = max(0, self.root_running - 1)
        elif len(self._stack) > 1 and self._stack[-1][0] == id(module):
            self._stack.pop()

    def _entering(self) -> None:
        """A child of the running module is about to run."""

    def _entered(self, module: nn.Module, name: str, args: Any) -> None:
        """``module`` (site ``name``) was pushed and is about to run on ``args``."""

    def _leaving(self, module: nn.Module) -> None:
        """``module`` returned (before it is popped)."""

    def modules(self) -> List[nn.Module]:
        """The running modules of the watched model, innermost first."""
        return [entry[3] for entry in reversed(self._stack) if len(entry) > 3 and entry[3] is not None]

    def running(self) -> Optional[str]:
        """The site name of the innermost running module (``None`` outside the root's forward)."""
        return str(self._stack[-1][1]) if self._stack else None

    def next_site(self) -> Tuple[str, int]:
        """(qualified name, index of this call within the module's current invocation)."""
        top: List[Any] = self._stack[-1] if self._stack else [self._root_id, "root", 0]
        index = int(top[2])
        top[2] += 1
        return str(top[1]), index
