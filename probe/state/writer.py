"""The writer: running totals, and sinks fed off the training thread, bounded in memory and time.

A flush hands the writer one :class:`Window` (a packed host copy of the statistics of a few
steps). From there:

* **Totals.** A window is folded into the running totals exactly once, by whichever thread needs
  it first (:meth:`Writer.totals`, a sink's lane or the summary refresher), under one lock that is
  never held while a sink runs: ``Probe.summary()`` never waits on a sink.
* **Sinks.** Each sink has its own *lane*: a queue and a daemon thread that calls ``write`` in
  step order, ``flush`` at most ``refresh_seconds`` after a write, and ``close`` at the end. A slow
  or blocked sink delays only itself.
* **Bounded queue.** A lane holds at most ``max_pending`` windows. When a new window arrives at a
  full lane, it is *merged* into the newest waiting one (sums added, maxima kept: the same rule
  that folds steps into the totals), and one warning says so. Nothing is dropped: every step's
  statistics still reach the sink, in fewer, wider points (a point's ``summary.steps`` says how
  many probed steps it covers), and the totals and ``probe_summary.json`` are exact.
* **Summary file.** With a ``summary_path``, a refresher thread rewrites it atomically at most
  every ``refresh_seconds`` while new windows arrive, independently of the sinks, so a killed run
  (SIGKILL, SIGTERM, OOM) leaves a summary at most a couple of seconds old.
* **Close.** :meth:`Writer.close` waits for the lanes up to a deadline; a sink that has not
  finished by then is named in a warning and left behind (its thread is a daemon).

Every sink call goes through :class:`~probe.sinks.base.SinkGuard`, which catches *any*
exception, ``SystemExit`` included: nothing a sink raises reaches training or stops a lane.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import warnings
from typing import Any, Deque, Dict, Hashable, List, Mapping, Optional, Sequence, Set, Tuple

from probe.state.results import Results
from probe.sinks.base import Sink, SinkGuard
from probe.state.window import Window, to_host  # re-exported: a flush hands the writer a Window
from probe.summary import Summary

__all__ = ["Window", "Writer", "to_host"]


class _Lane:
    """One sink's queue and thread."""

    def __init__(self, sink: Sink, writer: "Writer") -> None:
        self.sink = sink
        self.name = type(sink).__name__
        self._writer = writer
        self._queue: Deque[Window] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self.done = threading.Event()
        self.doing: Optional[str] = None  # what the sink is being asked right now, for close()'s warning
        self.merged = 0
        self._force = False  # flush the sink as soon as the queue is empty (Writer.flush)
        #: Windows the sink could not write (an ``OSError``: a full disk, a read-only directory),
        #: oldest first: written again before the next window, at Writer.flush() and at close.
        self.failed: Deque[Window] = collections.deque()

    def put(self, window: Window) -> None:
        with self._cond:
            if self._stopping:
                return
            if len(self._queue) >= self._writer.max_pending:
                tail = self._queue.pop()
                self._writer.fold(tail)
                self._writer.fold(window)
                window = Window.merged(tail, window)
                self.merged += 1
                if self.merged == 1:
                    self._writer.warn(
                        f"probe: sink {self.name} is falling behind ({self._writer.max_pending} flushes waiting); "
                        "further flushes are merged into the newest waiting one, so its points cover several "
                        "steps each from now on (nothing is dropped; Probe.summary() and probe_summary.json are "
                        "exact). Probe less often (every=...), or make the sink faster."
                    )
            self._queue.append(window)
            self._start()
            self._cond.notify()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"probe-writer-{self.name}", daemon=True)
            self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def thread(self) -> Optional[threading.Thread]:
        return self._thread

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._start()  # so that close() reaches the sink even if nothing was ever written
            self._cond.notify()

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and self.doing is None and not self._force

    @property
    def unwritten(self) -> List[int]:
        """The steps of the windows kept because the sink could not write them."""
        return [step for window in list(self.failed) for step in window.steps]

    def _call(self, method: str, *args: Any) -> Optional[BaseException]:
        self.doing = f"{method}() at step {args[0]}" if method == "write" else f"{method}()"
        try:
            return self._writer.guard.call(self.sink, method, *args)
        finally:
            self.doing = None

    def request_flush(self) -> None:
        with self._cond:
            self._force = True
            self._cond.notify()

    def _run(self) -> None:
        refresh = self._writer.refresh_seconds
        dirty = False
        last_flush = time.monotonic()
        try:
            while True:
                with self._cond:
                    if not self._queue and not self._stopping and not self._force:
                        self._cond.wait(None if not dirty else max(0.0, last_flush + refresh - time.monotonic()))
                    window = self._queue.popleft() if self._queue else None
                    if window is None and self._stopping:
                        break
                    force = self._force and not self._queue
                    if window is not None:
                        self.doing = f"write() at step {window.step}"
                if window is not None:
                    self._write(window)
                    dirty = True
                elif force and self.failed:
                    self._retry()
                    dirty = True
                if dirty and (force or time.monotonic() - last_flush >= refresh):
                    self._call("flush")
                    dirty, last_flush = False, time.monotonic()
                if force:
                    with self._cond:
                        self._force = bool(self._queue)
            if self.failed:
                self._retry()
                dirty = True
            if dirty:
                self._call("flush")
            self._call("close")
        finally:
            self.doing = None
            self.done.set()

    def _write(self, window: Window) -> None:
        try:
            self._writer.fold(window)
            window.summary()
        except BaseException as err:  # noqa: BLE001 - a bad window must not stop the lane
            self.doing = None
            self._writer.warn(f"probe: could not prepare step {window.step} for sink {self.name}: "
                              f"{type(err).__name__}: {err}")
            return
        if self.failed and not self._retry():
            self._keep(window)  # in step order, after the ones still waiting
            return
        if isinstance(self._call("write", window.step, window.summary()), OSError):
            self._keep(window)

    def _retry(self) -> bool:
        """Write the kept windows again, oldest first; whether all were written."""
        while self.failed:
            window = self.failed[0]
            if self._call("write", window.step, window.summary()) is not None:
                return False
            self.failed.popleft()
        return True

    def _keep(self, window: Window) -> None:
        """Keep a window the sink could not write; beyond ``max_pending`` kept windows, the newest
        two are merged (sums added, maxima kept): bounded, nothing dropped, fewer points."""
        if len(self.failed) >= self._writer.max_pending:
            window = Window.merged(self.failed.pop(), window)
        self.failed.append(window)

    def join(self, deadline: float) -> bool:
        """Wait for the lane's thread to finish, at most until ``deadline`` (monotonic)."""
        thread = self._thread
        if thread is None:
            return True
        return self.done.wait(max(0.0, deadline - time.monotonic()))

    def wait_idle(self, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if self.idle():
                return True
            time.sleep(0.005)
        return self.idle()


class Writer:
    """Running totals plus one lane per sink (see the module docstring).

    Args:
        sinks: the sinks to feed.
        results: the run totals windows are folded into.
        summary_path: where to keep ``probe_summary.json`` fresh while the run goes (None: nowhere).
        meta: the summary's ``meta``.
        refresh_seconds: the bound on a sink's flush lag and on the summary file's age.
        max_pending: windows a lane holds before it merges new ones.
    """

    def __init__(self, sinks: Sequence[Sink] = (), results: Optional[Results] = None, summary_path: Optional[str] = None,
                 meta: Optional[Mapping[str, Any]] = None, refresh_seconds: float = 2.0,
                 max_pending: int = 16) -> None:
        self.refresh_seconds = float(refresh_seconds)
        self.max_pending = int(max_pending)
        self.summary_path = summary_path
        self.meta: Dict[str, Any] = dict(meta or {})
        self._warned: Set[Hashable] = set()
        self._warn_lock = threading.Lock()
        self.guard = SinkGuard(self.warn)
        self.results = results if results is not None else Results()
        self._lock = threading.Lock()  # folding; never held while a sink runs
        self._steps: Set[int] = set()
        self._unfolded: List[Window] = []
        self._version = 0  # windows folded into the totals
        self._lanes = [_Lane(sink, self) for sink in sinks]
        self._save_lock = threading.Lock()
        self._saved_version: float = 0
        self._refresher: Optional[threading.Thread] = None
        self._wake = threading.Event()
        self._closed = False

    # -- warnings ----------------------------------------------------------------------------
    def warn(self, message: str, key: Optional[Hashable] = None) -> None:
        """Warn once per distinct ``key`` (default: the message), from any thread."""
        key = message if key is None else key
        with self._warn_lock:
            if key in self._warned:
                return
            self._warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    # -- totals ------------------------------------------------------------------------------
    def submit(self, window: Window) -> None:
        """Hand over one flush (training thread; returns at once)."""
        if self._closed:
            return
        with self._lock:
            self._unfolded.append(window)
        for lane in self._lanes:
            lane.put(window)
        if self.summary_path is not None and self._refresher is None:
            self._refresher = threading.Thread(target=self._refresh_loop, name="probe-summary", daemon=True)
            self._refresher.start()

    def fold(self, window: Window) -> None:
        """Fold ``window`` into the totals (once; any thread)."""
        with self._lock:
            self._fold_locked(window)

    def _fold_locked(self, window: Window) -> None:
        if window.ready and window not in self._unfolded:
            return
        states = window.materialize()
        if window in self._unfolded:
            self._unfolded.remove(window)
            self.results.add_states(states, window.infos, window.host, window.fields)
            self._steps.update(window.steps)
            self._version += 1

    def fold_all(self) -> Tuple[Set[int], int]:
        """Fold every submitted window into the totals; returns (probed steps, version).

        Waits for a device copy still in flight, never for a sink.
        """
        with self._lock:
            for window in list(self._unfolded):
                self._fold_locked(window)
            return set(self._steps), self._version

    def summary(self) -> Summary:
        """The totals as a :class:`Summary` (what the refresher writes)."""
        steps, _ = self.fold_all()
        return self.results.summary({}, {}, len(steps), dict(self.meta))

    @property
    def empty(self) -> bool:
        """Nothing was submitted yet."""
        with self._lock:
            return not self._unfolded and not self.results

    # -- the summary file --------------------------------------------------------------------
    def save(self, summary: Summary, version: float = 0, final: bool = False) -> bool:
        """Write ``summary`` to ``summary_path`` unless a newer one was written (``version``: the
        windows it holds; ``final``: the last one, never overwritten by the refresher). Warns,
        never raises, on failure. Returns whether the file now holds it."""
        if self.summary_path is None:
            return False
        if final:
            version = float("inf")
        with self._save_lock:
            if version < self._saved_version:
                return False
            try:
                directory = os.path.dirname(self.summary_path)
                if directory:
                    os.makedirs(directory, exist_ok=True)
                summary.save(self.summary_path)
            except Exception as err:  # noqa: BLE001 - a failed write never breaks training or close()
                # once per kind of failure: the message names a temporary file, new on every try
                self.warn(f"probe: could not write {os.path.basename(self.summary_path)} into "
                          f"{os.path.dirname(self.summary_path)!r}: {type(err).__name__}: {err}",
                          key=("summary file", type(err).__name__))
                return False
            self._saved_version = version
            return True

    def _refresh_loop(self) -> None:
        while not self._closed:
            self._wake.wait(self.refresh_seconds)
            if self._closed:
                return
            try:
                with self._lock:
                    behind = self._version > self._saved_version or bool(self._unfolded)
                if behind:
                    steps, version = self.fold_all()
                    self.save(self.results.summary({}, {}, len(steps), dict(self.meta)), version)
            except BaseException as err:  # noqa: BLE001 - the refresher must not die silently
                self.warn(f"probe: could not refresh the summary file: {type(err).__name__}: {err}")

    # -- lifecycle ---------------------------------------------------------------------------
    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every lane has written what was submitted, windows it kept after a failed
        write tried again (at most ``timeout`` seconds); returns whether they all were written."""
        deadline = time.monotonic() + (1e9 if timeout is None else timeout)
        for lane in self._lanes:
            if lane.started:
                lane.request_flush()
        return all(lane.wait_idle(deadline) and not lane.failed for lane in self._lanes)

    def close(self, timeout: float) -> List[str]:
        """Stop the lanes (each writes what it holds, flushes and closes its sink), waiting at most
        ``timeout`` seconds in all. Returns a description of each sink that did not finish (after
        warning about it)."""
        self.stop()
        deadline = time.monotonic() + timeout
        late: List[str] = []
        for lane in self._lanes:
            if not lane.join(deadline):
                doing = lane.doing or "its queue"
                late.append(f"{lane.name} ({doing})")
                self.warn(
                    f"probe: sink {lane.name} did not finish within close_timeout={timeout:g} s (still in {doing}); "
                    "close() returns without it: its last points may be missing from its output. The statistics "
                    "are complete in Probe.summary() and probe_summary.json."
                )
        return late

    def stop(self) -> None:
        """Tell the refresher and every lane to finish (each writes what it holds, flushes and
        closes its sink on its own thread) without waiting for them: what a Ctrl-C during
        ``close()`` gets, so that it returns at once."""
        self._closed = True
        self._wake.set()
        for lane in self._lanes:
            lane.stop()

    def on_own_thread(self) -> bool:
        """Whether the caller runs on one of this writer's threads (a lane or the refresher)."""
        me = threading.current_thread()
        return me is self._refresher or any(lane.thread is me for lane in self._lanes)

    @property
    def failures(self) -> Dict[str, int]:
        return self.guard.failures
