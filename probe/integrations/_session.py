"""What the trainer callbacks share: options, step bookkeeping, thresholds judged as the run goes.

Both callbacks derive from :class:`SessionCallback` (their options, ``probe``, ``violations``,
``close``: one place to add an option) and translate their framework's events into four calls on
:class:`Session`: ``start`` (training begins: watch the model, paused), ``begin_step(n)`` (a
micro-batch of the optimization step the trainer's logger numbers ``n`` begins), ``end_step(done)``
(a micro-batch ended; ``done`` when it ended the optimization step) and ``close`` (training ended
or raised). Between ``end_step`` and the next ``begin_step`` the probe is paused, so evaluation
forwards are not counted in a training step.

Which steps are sampled: every ``every``-th optimization step, counted from 1, as the trainers'
own logging intervals count (``logging_steps``, ``log_every_n_steps``), so that ``every`` equal to
the logging interval puts probe's scalars on the steps the loss is logged at. A trainer that
numbers its first optimization step ``first`` (Hugging Face 1, Lightning 0) samples the steps
``n`` with ``n % every == (first - 1) % every``.

Thresholds are judged on probe's writer thread by a sink (:class:`Judge`) that sees each
flushed window, the statistics of one sampled step; the training thread picks up its verdicts at
the end of each optimizer step.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, Union

from probe.errors import ProbeError
from probe.session.profiler import Probe, watch
from probe.ci.runs import ContinueRun
from probe.summary import Summary
from probe.ci.thresholds import Threshold, ThresholdLike, Violation, as_thresholds, check, format_value

__all__ = ["Judge", "Session", "SessionCallback", "logger"]

logger = logging.getLogger("probe.integrations")

#: Options of :func:`probe.watch` the callbacks pass through (``model``, ``logdir``, ``every`` and the
#: sampling ``offset`` are theirs).
_OWN_OPTIONS = frozenset({"self", "model", "logdir", "every", "offset"})
_WATCH_OPTIONS = frozenset(inspect.signature(Probe.__init__).parameters) - _OWN_OPTIONS


def describe(step: int, v: Violation) -> str:
    """One log line naming step, site, head, metric, scale, value and the limit."""
    head = "all heads" if v.head is None else f"head {v.head}"
    return (f"probe: step {step}: attention stability violation at {v.site} {head}: "
            f"{v.metric}@{v.scale} = {format_value(v.value)} (limit {v.op} {v.limit:g}, threshold {v.threshold!r})")


class Judge:
    """A sink that checks each flushed window against the thresholds (on the writer thread).

    A window a threshold cannot judge (a glob matching none of its sites, a metric it lacks, a
    site with no data) is reported once as a warning in the log; training goes on.
    """

    def __init__(self, thresholds: List[Threshold]) -> None:
        self.thresholds = thresholds
        self._lock = threading.Lock()
        self._pending: List[Tuple[int, Violation]] = []
        self._errors: Set[str] = set()

    def write(self, step: int, summary: Summary) -> None:
        try:
            found = check(summary, self.thresholds)
        except ProbeError as err:
            message = str(err)
            if message not in self._errors:
                self._errors.add(message)
                logger.warning("probe: step %d: thresholds could not be judged: %s", step, message)
            return
        with self._lock:
            self._pending.extend((step, v) for v in found)

    def take(self) -> List[Tuple[int, Violation]]:
        """The violations found since the last call, in step order."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Session:
    """One training run's probe, driven by a trainer callback (see the module docstring)."""

    def __init__(self, every: int, thresholds: Any, stop_on_violation: bool, logdir: Any,
                 watch_options: Dict[str, Any], first: int = 0, window: bool = False) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ProbeError(f"expected `every` to be a positive int, got {every!r}")
        unknown = sorted(set(watch_options) - _WATCH_OPTIONS)
        if unknown:
            raise ProbeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                             f"ProbeCallback passes these to probe.watch: {', '.join(sorted(_WATCH_OPTIONS))}")
        if logdir is not None and not isinstance(logdir, str) and not hasattr(logdir, "add_scalar"):
            if not hasattr(logdir, "__fspath__"):
                raise ProbeError(f"expected `logdir` to be a path or a SummaryWriter, got {type(logdir).__name__}")
        self.every = every
        self.offset = (first - 1) % every  # sampled: step % every == offset (module docstring)
        self.window = window  # record whatever runs during a sampled step, not only the model's forwards
        self.thresholds = as_thresholds(thresholds)  # a malformed expression fails here, not mid-run
        self.stop_on_violation = bool(stop_on_violation)
        self.logdir = logdir
        self.watch_options = dict(watch_options)
        self.probe: Optional[Probe] = None  # the last run's probe, kept after close for summary()
        self._open = False
        self.violations: List[Tuple[int, Violation]] = []
        self._judge: Optional[Judge] = None
        self._logged: Set[Tuple[str, str, Optional[int], str, str]] = set()
        self._step: Optional[int] = None

    @property
    def active(self) -> bool:
        return self._open

    def start(self, model: Any, logdir: Any, writes: bool, resumed: bool = False) -> None:
        """Watch ``model`` (paused until the first step); ``writes``: this process judges and writes;
        ``resumed``: the trainer resumed from a checkpoint, its steps continue the run in ``logdir``
        (without it, a ``logdir`` path holding an earlier run gives way to ``logdir-2``)."""
        self.close()  # a previous run that raised before its end event
        if resumed and isinstance(logdir, (str, os.PathLike)):
            logdir = ContinueRun(os.fspath(logdir))
        options = dict(self.watch_options)
        sinks = list(options.pop("sinks", ()))
        self._judge = Judge(self.thresholds) if writes else None
        if self._judge is not None:
            sinks.append(self._judge)
        self.probe = watch(model, logdir=logdir if writes else None, every=self.every, offset=self.offset,
                           sinks=sinks, **options)
        self._open = True
        self.probe.pause(flush=False)
        self._step = None

    def sampled(self, step: int) -> bool:
        return step % self.every == self.offset

    def begin_step(self, step: int) -> None:
        """A micro-batch of the optimization step numbered ``step`` begins (every micro-batch
        calls this). With ``window``, every attention call until :meth:`end_step` is recorded,
        whatever module runs it."""
        if self._open:
            self._step = step
            self.probe.step(step, window=self.window)

    def end_step(self, done: bool, agree: Optional[Callable[[bool], bool]] = None) -> bool:
        """A micro-batch ended; ``done``: the optimizer stepped, the step is over.

        Args:
            agree: under several processes, a collective that returns rank 0's flag on every
                rank; called on sampled steps when ``stop_on_violation`` is set.

        Returns:
            whether training should stop (``stop_on_violation`` and a threshold was violated).
        """
        if not self._open:
            return False
        step = self._step
        judged = done and step is not None and self.sampled(step)
        # stop_on_violation waits for the step's verdict, so a run stops at the step that broke a limit
        self.probe.pause(flush=done, wait=judged and self.stop_on_violation)
        if not done:
            return False
        violated = self._report()
        if not (judged and self.stop_on_violation):
            return False
        if agree is not None:
            violated = agree(violated)
        if violated:
            logger.warning("probe: stopping training after step %s: a stability threshold was violated "
                           "(stop_on_violation=True)", step)
        return violated

    def _report(self) -> bool:
        """Log new violations (once per threshold, site and head); whether any came."""
        if self._judge is None:
            return False
        found = self._judge.take()
        for step, v in found:
            self.violations.append((step, v))
            key = (v.threshold, v.site, v.head, v.metric, v.scale)
            if key not in self._logged:
                self._logged.add(key)
                logger.warning(describe(step, v))
        return bool(found)

    def close(self) -> None:
        """Close the probe (flush, write ``probe_summary.json``); safe to call twice."""
        if not self._open or self.probe is None:
            return
        self._open = False
        try:
            self.probe.close()
        finally:
            self._report()


class SessionCallback:
    """The options and attributes both trainer callbacks share; each framework's callback class
    derives from it and its framework's callback base, and documents its own step rule.

    Subclasses set :attr:`first_step` (the number their trainer's logger gives the first
    optimization step) and :attr:`window` (record whatever runs during a sampled step).
    """

    first_step = 0
    window = False

    def __init__(
        self,
        every: int = 1,
        thresholds: Union[None, ThresholdLike, Iterable[ThresholdLike]] = None,
        stop_on_violation: bool = False,
        logdir: Any = None,
        **watch_options: Any,
    ) -> None:
        self._session = Session(every, thresholds, stop_on_violation, logdir, watch_options,
                                first=self.first_step, window=self.window)

    @property
    def probe(self) -> Optional[Probe]:
        """The run's :class:`probe.Probe` (kept after training for ``probe.summary()``)."""
        return self._session.probe

    @property
    def violations(self) -> List[Tuple[int, Violation]]:
        """``(step, probe.Violation)`` for every violation found."""
        return self._session.violations

    def close(self) -> None:
        """Close the probe now (flush, write ``probe_summary.json``); safe to call twice."""
        self._session.close()

    def __enter__(self) -> "SessionCallback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
