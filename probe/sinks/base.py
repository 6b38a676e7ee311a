"""The sink interface and the background worker that feeds sinks off the training thread."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Optional, Protocol, Set, Tuple, Type, runtime_checkable

import numpy as np

from probe.metrics import head_reduce
from probe.sinks.tags import OVERVIEW_METRICS, overview_tag
from probe.sinks.tags import scalar_tag  # re-exported: the tag names live in probe.sinks.tags
from probe.summary import Summary

__all__ = ["BaseSink", "Sink", "SinkGuard", "head_scalars", "overview_scalars", "scalar_tag"]


@runtime_checkable
class Sink(Protocol):
    """Receives the metrics of each flush. Like ``SummaryWriter``: lazy, flushable, safe to
    close twice.

    ``write(step, summary)`` runs on a background thread of its own, once per flush, in step order;
    ``summary`` holds the flush window only (``summary.steps`` probed steps, the last being
    ``step``; several flushes merged into one when the sink fell behind, see
    :mod:`probe.state.writer`), not the running total. An exception from any method is caught
    and warned about once (:class:`SinkGuard`); it never reaches the training loop. A ``write``
    that raises ``OSError`` (a full disk) gets the same flush again later, so it should write a
    flush whole or not at all. A sink is a few lines::

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


class BaseSink:
    """A convenient base: ``flush``/``close`` do nothing, context manager included. A user sink
    then only defines ``write``::

        class WandbSink(BaseSink):
            def __init__(self, run):
                self.run = run
            def write(self, step, summary):
                self.run.log(dict(head_scalars(summary)), step=step)
    """

    def write(self, step: int, summary: Summary) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "BaseSink":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def head_scalars(summary: Summary, per_head: bool = False) -> Iterator[Tuple[str, float]]:
    """(tag, value) for every site, metric and scale of ``summary``, as probe writes them to
    TensorBoard: the head mean (head max for ``logit_max``, sum for ``nonfinite``), and each
    head when ``per_head``. Values may be NaN (nothing valid to average on that flush)."""
    for site in summary.sites:
        for metric in summary.metrics(site):
            for scale in summary.scales(site, metric):
                values = summary.value(site, metric, scale)
                yield scalar_tag(metric, scale, site), head_reduce(metric, values)
                if per_head:
                    for h, v in enumerate(values):
                        yield scalar_tag(metric, scale, site, h), float(v)


def overview_scalars(summary: Summary) -> Iterator[Tuple[str, float]]:
    """The headline: (``attention/{metric}``, value) for entropy, logit_max and saturation at
    ``actual``, folded over every head of every site as one site's heads are (mean; max for
    ``logit_max``). Nothing for a metric no site has at ``actual``."""
    for metric in OVERVIEW_METRICS:
        values = [summary.value(site, metric, "actual") for site in summary.sites
                  if metric in summary.metrics(site) and "actual" in summary.scales(site, metric)]
        if values:
            yield overview_tag(metric), head_reduce(metric, np.concatenate([np.ravel(v) for v in values]))


class SinkGuard:
    """Calls sink methods so that a failing sink never breaks training.

    The first failure of each (sink, exception type) produces one warning saying what failed and
    that the statistics stay available from ``Probe.summary()``; later failures of the same kind
    are counted silently (a full disk would otherwise warn at every flush). The sink is still
    called at later flushes, so it recovers when the cause goes away (space freed, directory
    recreated).

    Args:
        warn: how to emit a warning (the worker's, so warnings are also deduplicated by text).
    """

    def __init__(self, warn: Callable[[str], None]) -> None:
        self._warn = warn
        self._seen: Set[Tuple[int, Type[BaseException]]] = set()
        self.failures: Dict[str, int] = {}

    def call(self, sink: Any, method: str, *args: Any) -> Optional[BaseException]:
        """``getattr(sink, method)(*args)``; returns what it raised (after at most one warning),
        ``None`` when it returned."""
        try:
            getattr(sink, method)(*args)
            return None
        except BaseException as err:  # noqa: BLE001 - a sink failure never breaks training, SystemExit included
            name = type(sink).__name__
            self.failures[name] = self.failures.get(name, 0) + 1
            key = (id(sink), type(err))
            if key not in self._seen:
                self._seen.add(key)
                where = f"{method}() at step {args[0]}" if method == "write" and args else f"{method}()"
                kept = (" probe keeps what the sink could not write and gives it to the sink again at the next "
                        "flush and at close(); if the sink never recovers, those steps are only in Probe.summary() "
                        "and the summary file." if isinstance(err, OSError) and method == "write" else "")
                self._warn(
                    f"probe: sink {name} failed in {where}: {type(err).__name__}: {err}. Training "
                    f"continues and the statistics stay available from Probe.summary().{kept} Further "
                    f"{type(err).__name__} failures of this sink are not reported."
                )
            return err
