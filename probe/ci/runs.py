"""Finding and reading finished runs for ``probe check`` and ``probe report``.

A run is a directory holding ``probe_summary.json`` (written by ``probe.watch(model, logdir=...)``)
or TensorBoard event files, or one such file. A directory holding neither is a parent: every run
below it is found (``runs/demo`` holds ``runs/demo/with-divisor`` and ``runs/demo/no-divisor``).

The summary holds run totals only. The event files hold one value per probed step and tag (head
aggregates, or each head with ``per_head=True``): they are what a step window (``--last N``,
``--steps A:B``) is read from, folded over the window's steps as the metric catalogue says (:func:`probe.metrics.step_reduce`: max for
``logit_max``, sum for ``nonfinite``, root mean square for ``grad_*``, mean otherwise).
"""

from __future__ import annotations

import math
import os
import re
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from probe.errors import ProbeError
from probe.metrics import step_reduce
from probe.sinks.tags import PREFIX, parse_scalar_tag
from probe.summary import SUMMARY_FILE, Summary

__all__ = ["EVENTS", "ContinueRun", "StepWindow", "find_runs", "fresh_logdir", "load_run", "summary_from_events"]

EVENTS = "events.out.tfevents"
_STAMP = re.compile(re.escape(EVENTS) + r"\.(\d+)")


@dataclass(frozen=True)
class StepWindow:
    """The probed steps to judge: the last ``last`` of them, or those in ``[start, stop]``."""

    last: Optional[int] = None
    start: Optional[int] = None
    stop: Optional[int] = None

    def select(self, steps: List[int]) -> List[int]:
        """The chosen steps among ``steps`` (sorted)."""
        if self.last is not None:
            return steps[-self.last:]
        lo = -math.inf if self.start is None else self.start
        hi = math.inf if self.stop is None else self.stop
        return [s for s in steps if lo <= s <= hi]

    def __str__(self) -> str:
        if self.last is not None:
            return f"the last {self.last} probed steps"
        return f"steps {'' if self.start is None else self.start}..{'' if self.stop is None else self.stop}"


def _event_files(path: str) -> List[str]:
    if os.path.isfile(path):
        return [path]
    names = [n for n in os.listdir(path) if n.startswith(EVENTS) and os.path.isfile(os.path.join(path, n))]

    def written(name: str) -> Tuple[int, float, str]:
        match = _STAMP.match(name)
        return (int(match.group(1)) if match else 0, os.path.getmtime(os.path.join(path, name)), name)

    return [os.path.join(path, n) for n in sorted(names, key=written)]


def _read_scalars(file: str) -> Dict[str, List[Tuple[int, float]]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    except ImportError as err:  # pragma: no cover - tensorboard is a dependency
        raise ProbeError(f"reading TensorBoard event files needs the tensorboard package: {err}") from err
    from probe.ci.eventfiles import check_event_files

    check_event_files(file)  # a truncated or corrupted file is an error, not "fewer steps"
    acc = EventAccumulator(file, size_guidance={SCALARS: 0})  # 0: keep every event, do not sample
    try:
        acc.Reload()
    except Exception as err:  # noqa: BLE001 - corrupt files raise many kinds of error
        raise ProbeError(f"cannot read TensorBoard events in {file!r}: {type(err).__name__}: {err}") from err
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags().get("scalars", []) if parse_scalar_tag(tag)}


def _latest_run(path: str) -> Tuple[Dict[str, List[Tuple[int, float]]], Optional[str]]:
    """The probe scalars of the last run written into ``path``, and a note when earlier ones were left
    out: a file whose steps start at or below the steps already read is a new run in the same
    directory (a re-run), not a continuation (a writer that reopened after a disk error)."""
    merged: Dict[str, List[Tuple[int, float]]] = {}
    top, dropped = -math.inf, 0
    for file in _event_files(path):
        scalars = _read_scalars(file)
        steps = [s for events in scalars.values() for s, _ in events]
        if not steps:
            continue
        if min(steps) <= top:
            dropped += 1
            merged, top = {}, -math.inf
        for tag, events in scalars.items():
            merged.setdefault(tag, []).extend(events)
        top = max(top, max(steps))
    note = None
    if dropped:
        note = (f"{path} holds more than one run's event files (its steps restart); read the last run only. "
                f"Give each run its own directory to keep both.")
    return merged, note


def summary_from_events(path: str, window: Optional[StepWindow] = None) -> Summary:
    """A :class:`Summary` rebuilt from the ``probe.{metric}/{scale}/{site}[/headNN]`` scalars.

    Sites without per-head tags get one value per metric (the head aggregate) and
    ``info["heads_aggregated"] = True``; violations on them have ``head=None``. ``meta`` holds
    ``source``, ``path``, ``first_step`` and ``last_step`` (the steps the values come from) and
    ``note`` when earlier runs in the same directory were left out.

    Raises:
        ProbeError: unreadable files, or no probed step in ``window``.
    """
    scalars, note = _latest_run(path)
    all_steps = sorted({s for events in scalars.values() for s, _ in events})
    chosen = set(window.select(all_steps) if window else all_steps)
    if window is not None and not chosen:
        have = f"{all_steps[0]}..{all_steps[-1]}" if all_steps else "none"
        raise ProbeError(f"no probed step in {window} in {path!r} (probed steps: {have})")
    # (site, metric, scale) -> head (None = aggregate) -> reduced value
    found: Dict[Tuple[str, str, str], Dict[Optional[int], float]] = {}
    for tag, events in scalars.items():
        parsed = parse_scalar_tag(tag)
        assert parsed is not None  # _read_scalars kept probe tags only
        values = np.array([v for s, v in events if s in chosen], dtype=np.float64)
        if values.size:
            key = (parsed.site, parsed.metric, parsed.scale)
            found.setdefault(key, {})[parsed.head] = step_reduce(parsed.metric, values)
    per_head_sites = {site for (site, _, _), heads in found.items() if any(h is not None for h in heads)}
    sites: Dict[str, Dict[str, Any]] = {}
    for (site, metric, scale), heads in found.items():
        entry = sites.setdefault(site, {"info": {"heads_aggregated": site not in per_head_sites}, "metrics": {}})
        if site in per_head_sites:
            numbered = {h: v for h, v in heads.items() if h is not None}
            if not numbered:
                continue
            values = [numbered.get(h, math.nan) for h in range(max(numbered) + 1)]
        else:
            values = [heads[None]]
        entry["metrics"].setdefault(metric, {})[scale] = values
    meta: Dict[str, Any] = {"source": "tensorboard", "path": path}
    if chosen:
        meta.update(first_step=min(chosen), last_step=max(chosen))
    if note:
        meta["note"] = note
    return Summary(sites, steps=len(chosen), meta=meta)


def _is_run(path: str) -> bool:
    names = os.listdir(path)
    return SUMMARY_FILE in names or any(n.startswith(EVENTS) for n in names)


def find_runs(path: str) -> List[str]:
    """``[path]`` for a run or a run's file; else every run directory below ``path``, sorted.

    Raises:
        ProbeError: the path does not exist, or no run is found at or below it.
    """
    if not os.path.exists(path):
        raise ProbeError(f"expected a run directory or a {SUMMARY_FILE}, got a path that does not exist: {path!r}")
    if not os.path.isdir(path) or _is_run(path):
        return [path]
    runs = []
    for root, dirs, _ in os.walk(path):
        dirs.sort()
        if root != path and _is_run(root):
            runs.append(root)
    if not runs:
        raise ProbeError(f"expected {SUMMARY_FILE} or TensorBoard event files in {path!r} or below it, found neither")
    return runs


class ContinueRun(str):
    """A logdir path that :func:`fresh_logdir` leaves as it is, even when it holds an earlier run.

    The trainer integrations pass their trainer's directory this way: the trainer chose it and
    numbers the steps, and a resumed training continues its run there.
    """


def _holds_probe_run(path: str, events: int = 1000) -> bool:
    """``probe_summary.json`` in ``path``, or a probe scalar among the first ``events`` events of
    one of its event files (a run killed before its summary was first written, about 2 s in)."""
    if os.path.isfile(os.path.join(path, SUMMARY_FILE)):
        return True
    if not os.path.isdir(path):
        return False
    files = [f for f in _event_files(path) if os.path.isfile(f)]
    if not files:
        return False
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    except ImportError:  # pragma: no cover - tensorboard is a dependency
        return False
    for file in files:
        if not _may_hold_probe_tags(file):
            continue
        try:
            for i, event in enumerate(EventFileLoader(file).Load()):
                if any(parse_scalar_tag(v.tag) for v in event.summary.value):
                    return True
                if i >= events:
                    break
        except Exception:  # noqa: BLE001 - an unreadable file is not taken for a run
            continue
    return False


def _may_hold_probe_tags(file: str, limit: int = 2**20) -> bool:
    """False when ``file`` (at most ``limit`` bytes, read whole) holds no ``probe.`` bytes: every
    probe tag starts so, and protobuf stores tags as plain bytes. Parsing event by event instead
    costs about 0.3 ms an event (TensorBoard checks CRCs in Python), seconds for a directory of a
    trainer's own logs."""
    try:
        with open(file, "rb") as f:
            head = f.read(limit + 1)
    except OSError:  # unreadable: not taken for a run
        return False
    return len(head) > limit or PREFIX.encode() in head


# Directories given to a run of this process (realpaths): such a run writes its first file only
# when it flushes, so a second run opened before that would find the directory empty.
_CLAIMED: Set[str] = set()
_CLAIM_LOCK = threading.Lock()


def _taken(path: str) -> bool:
    return os.path.realpath(path) in _CLAIMED or _holds_probe_run(path)


def fresh_logdir(path: str) -> str:
    """Where a new run given ``logdir=path`` writes: ``path``, unless it holds an earlier probe run
    (its ``probe_summary.json``, or event files with probe's scalars); then ``path-2``,
    ``path-3``, ..., the first that does not exist or is empty, with a warning naming both.
    Appending would show the earlier run's steps and this one's in the same TensorBoard run (step 0
    twice) and overwrite the earlier run's summary.

    A directory given to an earlier run of this process counts as holding a run, also before that
    run wrote anything (two models watched at once with one ``logdir``) and after it was deleted.
    A :class:`ContinueRun` is returned as it is.
    """
    if isinstance(path, ContinueRun):
        return path
    with _CLAIM_LOCK:
        fresh = _fresh(path)
        _CLAIMED.add(os.path.realpath(fresh))
    if fresh == path:
        return path
    warnings.warn(f"probe: {path!r} already holds a run; this run writes to {fresh!r} so that "
                  f"the two runs' steps never mix (to continue a run there, pass "
                  f"logdir=SummaryWriter({path!r}) instead)",
                  RuntimeWarning, stacklevel=5)  # points at the caller of probe.watch
    return fresh


def _fresh(path: str) -> str:
    if not _taken(path):
        return path
    base, n = path.rstrip("/\\") or path, 2
    if os.path.basename(base) in (".", ".."):  # '.-2' would be a hidden directory inside it
        base = os.path.abspath(base)
    while (os.path.realpath(f"{base}-{n}") in _CLAIMED
           or os.path.exists(f"{base}-{n}") and (not os.path.isdir(f"{base}-{n}") or os.listdir(f"{base}-{n}"))):
        n += 1
    return f"{base}-{n}"


def load_run(path: str, window: Optional[StepWindow] = None) -> Tuple[Summary, str]:
    """Read one run: ``(summary, source)`` with source ``"summary"`` or ``"tensorboard"``.

    Args:
        path: a ``probe_summary.json``, an event file, or a directory holding either (the
            summary is preferred: it has every head).
        window: judge these probed steps only; read from the event files, which hold each step.

    Raises:
        ProbeError: the path does not exist, holds neither file, cannot be read, or a window
            was asked of a run without event files.
    """
    if not os.path.exists(path):
        raise ProbeError(f"expected a run directory or a {SUMMARY_FILE}, got a path that does not exist: {path!r}")
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    is_events = not os.path.isdir(path) and os.path.basename(path).startswith(EVENTS)
    if window is not None or is_events:
        source = path if is_events else folder
        if not _event_files(source):
            raise ProbeError(f"judging {window} needs the run's TensorBoard event files (one value per step); "
                             f"{path!r} has none: {SUMMARY_FILE} holds run totals only")
        return summary_from_events(source, window), "tensorboard"
    if not os.path.isdir(path):  # a file, or a FIFO / device that Summary.load refuses
        return Summary.load(path), "summary"
    if os.path.isfile(os.path.join(path, SUMMARY_FILE)):
        return Summary.load(path), "summary"
    if _event_files(path):
        return summary_from_events(path), "tensorboard"
    raise ProbeError(f"expected {SUMMARY_FILE} or TensorBoard event files in {path!r}, found neither")
