"""Probe's lifecycle: one explicit state machine, in the manner of ``torch.profiler``'s action table.

A :class:`~probe.session.profiler.Probe` is always in exactly one :class:`Phase`; every change
goes through :meth:`Lifecycle.move`, which checks it against :data:`TRANSITIONS`. The profiler
does the work of each transition (enter or leave the capture mode, flush a window, remove
hooks); this module only says where the probe is and where it may go next.

========  =========================================================================================
phase     meaning
========  =========================================================================================
READY     watching; no step has begun (the next root forward is step 0)
STEP      a step is current; no root forward is running
CAPTURE   the outermost root forward of a recorded step runs under the capture mode
BYPASS    a root forward runs untouched: its step is not recorded, the probe is paused, the
          compiled root was seen too late, or probe steps aside for a transform it cannot
          measure under (``torch.jit.trace``, ``torch.export``, ``torch.func``, fake or meta
          tensors: :mod:`probe.session.transforms`)
PAUSED    :meth:`Probe.pause`: root forwards run untouched until :meth:`Probe.step`
WINDOW    ``p.step(n, window=True)`` on a sampled step: every attention call runs under the capture
          mode, whatever module issues it, until :meth:`Probe.pause`, the next ``step`` or ``close``
          (a trainer's training step that calls the model's parts; root forwards inside it are no
          transition)
CLOSED    :meth:`Probe.close`: hooks removed; nothing is recorded again
========  =========================================================================================

==============  ==============================  ============================================
event           from                            to
==============  ==============================  ============================================
FORWARD_START   READY, STEP, PAUSED             CAPTURE or BYPASS (the outermost root call)
FORWARD_END     CAPTURE, BYPASS                 :attr:`Lifecycle.resume` (STEP or PAUSED)
STEP            READY, STEP, PAUSED, WINDOW     STEP, or WINDOW (``p.step(n)``; counting turns explicit)
STEP            CAPTURE, BYPASS                 unchanged (calls from now on belong to ``n``)
PAUSE           READY, STEP, PAUSED, WINDOW     PAUSED
PAUSE           CAPTURE, BYPASS                 unchanged; PAUSED once the forward ends
INTERRUPTED     CAPTURE, BYPASS                 :attr:`Lifecycle.resume` (a BaseException
                                                skipped the forward hook: probe.session.forward_guard)
CLOSE           any                             CLOSED
==============  ==============================  ============================================

A root module called again from inside its own forward is not a transition: it only deepens
:attr:`Lifecycle.depth`, and the outermost call's end is the FORWARD_END.

Steps are counted one of two ways (:class:`Counting`): each outermost root forward begins the
next step (AUTO, the default), until the first ``p.step(n)``, from which on only ``step`` sets
them (EXPLICIT, for good). A forward probe steps aside for does not count as a step.

Extending it: a new phase or event is a member here, its rows in :data:`TRANSITIONS`, and the
profiler method that performs it calling :meth:`Lifecycle.move` (tests/test_lifecycle.py walks
the table).
"""

from __future__ import annotations

import enum
import warnings
from typing import Dict, FrozenSet, Optional, Tuple

__all__ = ["Counting", "Event", "Lifecycle", "Phase", "TRANSITIONS"]


class Phase(enum.Enum):
    """Where a probe is (see the module docstring)."""

    READY = "ready"
    STEP = "step"
    CAPTURE = "capture"
    BYPASS = "bypass"
    PAUSED = "paused"
    WINDOW = "window"
    CLOSED = "closed"


class Event(enum.Enum):
    """What moves a probe from one phase to another."""

    FORWARD_START = "forward_start"
    FORWARD_END = "forward_end"
    STEP = "step"
    PAUSE = "pause"
    INTERRUPTED = "interrupted"
    CLOSE = "close"


class Counting(enum.Enum):
    """Who numbers the steps."""

    AUTO = "auto"  #: each outermost root forward begins the next step
    EXPLICIT = "explicit"  #: ``p.step(n)`` alone (from its first call on)


_OPEN = frozenset({Phase.READY, Phase.STEP, Phase.PAUSED})  # no root forward running
_FORWARD = frozenset({Phase.CAPTURE, Phase.BYPASS})
_BETWEEN = _OPEN | {Phase.WINDOW}  # where p.step and p.pause act at once

#: (event, phase it happens in) -> the phases it may lead to. Anything else is a bug in probe.
TRANSITIONS: Dict[Tuple[Event, Phase], FrozenSet[Phase]] = {
    **{(Event.FORWARD_START, p): _FORWARD for p in _OPEN},
    **{(Event.FORWARD_END, p): frozenset({Phase.STEP, Phase.PAUSED}) for p in _FORWARD},
    **{(Event.STEP, p): frozenset({Phase.STEP, Phase.WINDOW}) for p in _BETWEEN},
    **{(Event.STEP, p): frozenset({p}) for p in _FORWARD},
    **{(Event.PAUSE, p): frozenset({Phase.PAUSED}) for p in _BETWEEN},
    **{(Event.PAUSE, p): frozenset({p}) for p in _FORWARD},
    **{(Event.INTERRUPTED, p): frozenset({Phase.STEP, Phase.PAUSED}) for p in _FORWARD},
    **{(Event.CLOSE, p): frozenset({Phase.CLOSED}) for p in Phase},
}


class Lifecycle:
    """The phase of one probe, and the little it must remember across phases.

    Attributes:
        phase: the current :class:`Phase`.
        counting: how steps are numbered (:class:`Counting`).
        step: the current step number (``None`` before the first step).
        depth: how many calls of the root module are running (0 outside a forward; above 1 when
            the root calls itself).
        resume: the phase the running forward returns to when it ends (STEP, or PAUSED once
            :meth:`Probe.pause` was called).
    """

    def __init__(self) -> None:
        self.phase = Phase.READY
        self.counting = Counting.AUTO
        self.step: Optional[int] = None
        self.depth = 0
        self.resume = Phase.STEP
        self._warned = False

    # -- reading -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    @property
    def in_forward(self) -> bool:
        """A root forward is running (captured or not)."""
        return self.phase in _FORWARD

    @property
    def paused(self) -> bool:
        """Paused now, or from the end of the running forward on."""
        return self.phase is Phase.PAUSED or (self.in_forward and self.resume is Phase.PAUSED)

    def next_step(self) -> int:
        """The step the next counted forward begins: 0 first, then one more each time."""
        return 0 if self.step is None else self.step + 1

    def following_step(self) -> int:
        """The step the next root forward will belong to (for arming ``torch.compile``'s stance)."""
        if self.counting is Counting.AUTO:
            return self.next_step()
        return 0 if self.step is None else self.step

    # -- moving --------------------------------------------------------------------------------
    def move(self, event: Event, to: Phase) -> None:
        """Take ``event`` into phase ``to``. A move the table does not allow is a bug in probe:
        it warns once (never raises: the user's forward is running) and is taken anyway."""
        allowed = TRANSITIONS.get((event, self.phase), frozenset())
        if to not in allowed and not self._warned:
            self._warned = True
            warnings.warn(f"probe: internal error: {event.name} in phase {self.phase.name} cannot lead to "
                          f"{to.name} (please report it); continuing", RuntimeWarning, stacklevel=3)
        self.phase = to

    def start_forward(self, capture: bool, step: Optional[int]) -> None:
        """The outermost root forward starts: CAPTURE (``capture``) or BYPASS; ``step``: the
        step it begins (AUTO counting), ``None`` when the step does not change."""
        self.resume = Phase.PAUSED if self.phase is Phase.PAUSED else Phase.STEP
        self.move(Event.FORWARD_START, Phase.CAPTURE if capture else Phase.BYPASS)
        if step is not None:
            self.step = step
        self.depth = 1

    def end_forward(self, event: Event = Event.FORWARD_END) -> None:
        """The outermost root forward ended (``Event.INTERRUPTED``: it ended without its hook)."""
        self.depth = 0
        self.move(event, self.resume)

    def set_step(self, n: int, window: bool = False) -> None:
        """``p.step(n)``: counting is explicit from now on; ``window``: step ``n`` is recorded
        whole (WINDOW; ignored inside a root forward)."""
        self.counting = Counting.EXPLICIT
        self.step = n
        self.move(Event.STEP, self.phase if self.in_forward else Phase.WINDOW if window else Phase.STEP)
        self.resume = Phase.STEP

    def pause(self) -> None:
        if self.in_forward:
            self.resume = Phase.PAUSED
            self.move(Event.PAUSE, self.phase)
        else:
            self.move(Event.PAUSE, Phase.PAUSED)

    def close(self) -> None:
        self.depth = 0
        self.move(Event.CLOSE, Phase.CLOSED)

    def __repr__(self) -> str:
        return f"Lifecycle({self.phase.name}, step={self.step}, {self.counting.name.lower()})"
