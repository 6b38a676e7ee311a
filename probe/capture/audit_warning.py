"""The warning of ``probe.watch``: no attention probe misses goes unsaid (issue 17).

The first sampled forward of a probe runs under an :class:`probe.capture.audit.Audit`; each attention it
finds that probe did not report, or reported under another module's name, gets one
``UserWarning`` naming the module and why. Later forwards pay nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Set

from torch import nn

from probe.capture.audit import Audit, Event

__all__ = ["FirstForwardAudit"]

class FirstForwardAudit:
    """The profiler's use of :class:`Audit`: the first sampled forward runs audited, and each
    attention it finds that probe did not report (or reported under another module) gets one
    ``UserWarning`` naming the module and why. Later forwards pay nothing.

    The profiler calls :meth:`start` after entering its capture mode, :meth:`stop` before leaving
    it, :meth:`reported` for every call it reports and :meth:`finish` once the capture mode has
    emitted what it still held.
    """

    def __init__(self, model: nn.Module, frontends: Any, warn: bool = True, done: bool = False) -> None:
        self._model = weakref.ref(model)  # weakly: a forgotten probe must be collected with its model
        self._frontends = frontends
        self._audit: Optional[Audit] = None
        self._warn = warn
        self.done = done  # True: no audit (``probe.watch(..., audit=False)``)
        self.events: List[Event] = []  # what the audited forward found (probe.coverage reads it)

    def start(self, recorder: Any) -> None:
        """Audit this forward, if it is the first; ``recorder.observer`` then reports to it."""
        if self.done:
            return
        self.done = True
        recorder.observer = self.reported
        try:
            from probe.capture.eager import EagerFrontEnd
            from probe.capture.records import Scores as _Scores

            eager = next((f for f in self._frontends if isinstance(f, EagerFrontEnd)), None)
            followed = None if eager is None else (lambda t: isinstance(eager.get(t), _Scores))
            model = self._model()
            if model is None:
                return
            self._audit = Audit(model, followed)
            self._audit.__enter__()
        except Exception:  # noqa: BLE001 - the audit never breaks the model
            self._audit = None

    def stop(self) -> None:
        audit = self._audit
        if audit is not None and audit._handles:
            audit.__exit__(None, None, None)  # one pop per push, as the capture modes do (nested probes)

    def reported(self, call: Any, site: str) -> None:
        if self._audit is not None:
            self._audit.reported(call, site)

    def finish(self, recorder: Any = None) -> None:
        import warnings

        if recorder is not None:
            recorder.observer = None
        audit, self._audit = self._audit, None
        if audit is None:
            return
        self.events = audit.events
        if not self._warn:
            return
        seen: Set[str] = set()
        for event in audit.misses():
            if event.module in seen:
                continue
            seen.add(event.module)
            if event.reported is None:
                message = f"probe: an attention at {event.module!r} is NOT measured: {event.why}"
            else:
                message = (f"probe: the attention at {event.module!r} is reported under {event.reported!r}, not "
                           "under the module that ran its softmax")
            warnings.warn(message + " (probe.coverage(model, ...) lists every attention; see docs/models.md)",
                          UserWarning, stacklevel=3)
