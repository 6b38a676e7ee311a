"""The front-end contract: what :class:`~probe.capture.mode.CaptureMode` may ask of a front end.

A front end turns one style of attention (SDPA, eager ops, ``nn.MultiheadAttention``,
FlexAttention) into :class:`~probe.call.AttentionCall` records. It subclasses :class:`FrontEnd`,
sets :attr:`~FrontEnd.funcs` and implements :meth:`~FrontEnd.handle`; every other capability has a
no-op default, so a front end overrides only what it needs. The front ends every probe uses are
listed in :data:`probe.capture.registry.FRONT_ENDS` (a new front end is one file there plus one
case in ``tests/capture/test_conformance.py``; see docs/architecture.md).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

from torch import nn

from probe.experiment import overrides
from probe.call import AttentionCall

__all__ = ["Emit", "FrontEnd", "NamedSite", "FUSED_TYPES", "HELD", "settled"]

#: Receives each record; ``None`` when the mode only applies overrides (records nothing).
Emit = Callable[[AttentionCall], None]
#: ``named_site(name)``: calls emitted inside the context are attributed to ``name``.
NamedSite = Callable[[str], ContextManager[None]]


class FrontEnd:
    """Base class of the capture front ends (no-op defaults).

    Attributes:
        funcs: the functions the capture mode routes to :meth:`handle` (torch functions, tensor
            methods, higher-order operators).
        applies_overrides: :meth:`handle` looks up and applies :mod:`probe.experiment.overrides` itself, so
            an intervention mode above a recording mode leaves these calls to it.
        traceable: :meth:`handle` may run while Dynamo traces (inside a compiled region); it must
            then keep to what Dynamo can replay (FlexAttention: one list append).
        catch_all: while :meth:`watching` says so, the mode routes every function outside any
            front end's ``funcs`` here too (the eager tracer's default rule for ops it does not
            name: one front end per mode may set it).
        fused_types: for a front end overriding :meth:`runs_fused`, the module types it may claim;
            a module boundary asks it only for those (empty: every module is asked).

    A front end overriding :meth:`has_pending` calls :meth:`held` when it records a call for
    :meth:`drain`: module boundaries ask whether calls are held only after that (once per step
    per boundary otherwise: some 2,000 Python lines of a 4-layer BERT step).
    """

    funcs: Tuple[Callable[..., Any], ...] = ()
    applies_overrides: bool = False
    traceable: bool = False
    catch_all: bool = False
    fused_types: Tuple[type, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.runs_fused is not FrontEnd.runs_fused:  # may claim a module: boundaries ask it for these types
            FUSED_TYPES[0] = tuple(dict.fromkeys(FUSED_TYPES[0] + (cls.fused_types or (nn.Module,))))

    @staticmethod
    def held() -> None:
        """This front end now holds a recorded call that :meth:`drain` must measure."""
        HELD[0] = True

    def passes(self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        """Whether the mode may run this routed call untouched, without :meth:`handle` (a cheap
        check: the eager tracer rejects ops that cannot start a record on inputs that carry none)."""
        return False

    def watching(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], func: Any = None) -> bool:
        """For a ``catch_all`` front end: whether an unnamed function with these arguments must go to
        :meth:`handle` (cheap: called for every such function while the mode is active)."""
        return False

    def handle(self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
               emit: Optional[Emit]) -> Any:
        """Run ``func(*args, **kwargs)`` (or the call an override rewrites it into) and return
        its result unchanged; pass the records it makes to ``emit`` (when not ``None``).

        Pitfall: never raise because of bookkeeping, never change the model's outputs.
        """
        raise NotImplementedError

    def overrides_active(self) -> bool:
        """Whether an override this front end applies is registered now (cheap: an intervention
        mode asks it for every routed call before anything else)."""
        return self.applies_overrides and overrides.active()

    def has_pending(self) -> bool:
        """Whether calls were recorded that :meth:`drain` must still measure."""
        return False

    def drain(self, emit: Emit, site: str) -> None:
        """Measure recorded calls now (at a module boundary, outside any compiled region and with
        the capture mode paused); ``site`` is the module that issued them."""

    def reset(self) -> None:
        """Forget per-forward state (the capture mode exits)."""

    def runs_fused(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                   parent: Optional[nn.Module] = None, inside: bool = False) -> bool:
        """Whether ``module`` must (or should) run PyTorch's fused kernel outside the capture mode
        (a nested-tensor input, a fast path in eval); :meth:`measure_fused` then measures it.
        ``inside``: an ancestor already runs outside, ``module`` is only to be measured (``parent``
        the module that called it)."""
        return False

    def measure_fused(self, module: nn.Module, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                      mode: Any, named_site: NamedSite, parent: Optional[nn.Module] = None) -> None:
        """Record the attention of a module claimed by :meth:`runs_fused`, to ``mode.emit``."""


# The module types some front end may claim for PyTorch's fused kernel (FrontEnd.fused_types of the
# classes overriding runs_fused), as a tuple for isinstance (ModuleStack reads it directly).
FUSED_TYPES: List[Tuple[type, ...]] = [()]

# Functions of a watched root giving the modules whose calls' keyword arguments a front end needs
# for FrontEnd.runs_fused (ModuleStack hooks them with kwargs; a global hook sees positional ones only).
KWARGS_HOOKED: List[Callable[[nn.Module], List[nn.Module]]] = []

# Whether a front end may hold recorded calls (FrontEnd.held): set when one records, cleared by a
# module boundary that asked every recording mode and found none (ModuleStack reads it directly).
HELD = [False]


def settled() -> None:
    """Every recording mode was asked and no front end holds a call (a module boundary drained)."""
    HELD[0] = False
