"""Where a probe's measurements go: the recorder's windows to the writer, and the run summary.

:class:`Outputs` is the output side of :class:`~probe.session.profiler.Probe`: a flush takes one
window from the recorder (:meth:`~probe.session.recorder.Recorder.snapshot`) and hands it to the
writer (:mod:`probe.state.writer`); :meth:`Outputs.summary` combines the flushed totals with what
is still pending; :meth:`Outputs.close` flushes the last window, writes ``probe_summary.json``
and stops the sinks. Both flush and summary hold the recorder's lock, so a summary read on
another thread (a dashboard, a notebook widget) while training runs sees every window exactly
once: in the totals or pending, never in both or neither.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence

from probe.once import WarnOnce
from probe.session.recorder import Recorder
from probe.state.results import Results, step_ends
from probe.state.writer import Writer
from probe.summary import SUMMARY_FILE, Summary

__all__ = ["Outputs"]


class Outputs:
    """The flushes and the summary of one probe (see the module docstring).

    Args:
        sinks: the sinks to feed (already limited to the rank that writes).
        logdir: where ``probe_summary.json`` goes (``None``: nowhere).
        meta: the summary's ``meta`` (every, saturation, scales).
        reducer: under ``torch.distributed``, the cross-rank reducer (``None``: local statistics).
        sites: the ``sites=`` filter as given, and ``site_ok`` its predicate (for the warning that
            it matched nothing).

    Attributes:
        rec: the probe's recorder (set by the probe: the recorder warns through :attr:`writer`).
    """

    rec: Recorder

    def __init__(self, sinks: Sequence[Any], logdir: Optional[str], meta: Dict[str, Any], reducer: Any,
                 sites: Any, site_ok: Optional[Callable[[str], bool]]) -> None:
        self.logdir = logdir
        self.meta = meta
        self.reducer = reducer
        self.results = Results()
        summary_path = None if logdir is None else os.path.join(logdir, SUMMARY_FILE)
        # the writer folds flushes into the results and feeds the sinks and the summary file
        self.writer = Writer(sinks, self.results, summary_path, meta=meta)
        self._sites, self._site_ok = sites, site_ok
        self._warned = WarnOnce()

    def flush(self) -> None:
        """Hand the recorder's window to the writer: one packed tensor, one device→host copy
        started (under ``torch.distributed``: reduced across the group's ranks first, a
        collective on the training thread, ordered with the training's own collectives)."""
        self._check_filter()
        with self.rec.lock:  # a summary() on another thread sees the window in one place or the other
            window = self.rec.snapshot(reducer=self.reducer)
            if window is not None:
                self.writer.submit(window)

    def _check_filter(self) -> None:
        unmatched = self.rec.filtered_out
        if self._site_ok is not None and unmatched and not (self.rec.acc or self.rec.deferred) and self.writer.empty:
            self._warned("sites", f"probe: `sites` filter {self._sites!r} matched none of the attention sites seen: "
                         f"{', '.join(sorted(unmatched))}", stacklevel=3)

    def summary(self) -> Summary:
        """The totals plus what is pending (see :meth:`probe.session.profiler.Probe.summary`)."""
        local = self.reducer is None
        with self.rec.lock:
            window = self.rec.snapshot(reset=False) if local else None
            open_steps: List[int] = list(self.rec.window) if local else []
            probed, _ = self.writer.fold_all()  # flushed windows into the totals; never waits on a sink
        pending = {} if window is None else window.materialize()
        infos = {} if window is None else window.infos
        probed.update(open_steps)  # meta: which steps (for the CLI)
        return self.results.summary(pending, infos, len(probed), {**self.meta, **step_ends(probed)})

    def close(self, timeout: float) -> None:
        """The last window to the writer, ``probe_summary.json`` written, the sinks stopped (at
        most ``timeout`` seconds for them)."""
        try:
            if self.reducer is not None:
                # A collective: every rank closes and flushes, even one with nothing to add.
                if self.reducer.usable():
                    self.flush()
                elif self.rec.pending:
                    self.writer.warn("probe: torch.distributed was shut down before Probe.close(); the last "
                                     "window of statistics was not reduced (close the probe first)")
            elif self.rec.pending:
                self.flush()
            if self.logdir is not None:
                # Before waiting on the sinks: a slow sink or a second Ctrl-C cannot cost the summary.
                self.writer.save(self.summary(), final=True)
        except Exception:
            self.writer.close(timeout)  # the sinks still get their bounded wait
            raise
        except BaseException:
            # Ctrl-C (or SystemExit) before the sinks' wait: leave at once, as the user asked, and
            # never with a summary file older than the statistics if it can be written in time.
            self.writer.stop()
            if self.logdir is not None:
                try:
                    self.writer.save(self.summary(), final=True)
                except Exception:  # noqa: BLE001 - save warns; the interrupt is what propagates
                    pass
            raise
        self.writer.close(timeout)
