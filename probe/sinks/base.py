"""The sink interface and the background worker that feeds sinks off the training thread."""

from __future__ import annotations

import queue
import threading
import warnings
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from probe.summary import Summary

__all__ = ["Sink", "Worker"]


@runtime_checkable
class Sink(Protocol):
    """Receives the metrics of each flush. Like ``SummaryWriter``: lazy, flushable, safe to
    close twice. A sink is a few lines::

        class PrintSink:
            def write(self, step, summary):
                for site in summary.sites:
                    print(step, site, summary.value(site, "entropy").mean())
            def flush(self): pass
            def close(self): pass
    """

    def write(self, step: int, summary: Summary) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class Worker:
    """Runs jobs in order on one daemon thread, so training never waits on sink I/O.

    A job that raises produces one warning (per distinct message) and the worker goes on: a
    sink failure never breaks training.
    """

    def __init__(self, name: str = "probe-writer") -> None:
        self._queue: "queue.Queue[Optional[Callable[[], Any]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._name = name
        self._warned: set = set()
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], Any]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put(job)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                job()
            except Exception as err:  # noqa: BLE001 - a failing sink must not stop training
                self.warn(f"probe: a sink failed and was skipped: {type(err).__name__}: {err}")
            finally:
                self._queue.task_done()

    def warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def join(self) -> None:
        """Wait until every submitted job has run."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._thread = None
