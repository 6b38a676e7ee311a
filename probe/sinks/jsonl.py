"""Line-oriented sinks: JSON Lines and CSV, one record per step, site, metric and scale (and head).

Both load straight into pandas (``pd.read_json(path, lines=True)``, ``pd.read_csv(path)``) or
any tool that reads lines. Use them beside or instead of TensorBoard::

    from probe.sinks.jsonl import JSONLSink
    with probe.watch(model, sinks=[JSONLSink("runs/exp/probe.jsonl")]) as p:
        ...
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from typing import Any, BinaryIO, Optional, Union

from probe.errors import ProbeError
from probe.sinks.base import BaseSink
from probe.metrics import head_reduce
from probe.summary import Summary, json_number

__all__ = ["CSVSink", "JSONLSink"]


def _check_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ProbeError(f"expected `path` to be a file path, got {type(path).__name__}")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ProbeError(f"expected `path` to be a file path, got a directory: {path!r}")
    return path


def _num(v: float) -> Any:
    """As in ``probe_summary.json``: NaN is ``null``, ±inf ``"inf"`` / ``"-inf"`` (strict JSON)."""
    return json_number(v)


class _FileSink(BaseSink):
    """Opens its file lazily on the first write (creating parent directories); flush and close
    are safe to call at any time and twice.

    Each flush is written whole or not at all: a write that fails (a full disk) cuts the file
    back to where it was and raises ``OSError``, so the file only ever holds whole lines; probe's
    writer keeps the flush and writes it again later (:mod:`probe.state.writer`).
    """

    def __init__(self, path: Union[str, os.PathLike], append: bool = False) -> None:
        self.path = _check_path(path)
        self.append = bool(append)
        self._file: Optional[BinaryIO] = None
        self._fresh = False  # the file is new: the header goes first

    def _open(self) -> BinaryIO:
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._fresh = not self.append or not os.path.exists(self.path) or os.path.getsize(self.path) == 0
            self._file = open(self.path, "ab" if self.append else "wb", buffering=0)  # noqa: SIM115
            self.append = True  # a reopen after close (or after a failed write) continues the same file
        return self._file

    def _header(self) -> str:
        return ""

    def _append(self, text: str) -> None:
        """Write ``text`` (and the header first, into a new file) whole, or cut the file back."""
        f = self._open()
        data = ((self._header() if self._fresh else "") + text).encode("utf-8")
        start = f.seek(0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                written = f.write(view)
                if not written:
                    raise OSError(f"short write to {self.path!r}")
                view = view[written:]
        except OSError:
            self._file = None
            try:
                f.close()
                os.truncate(self.path, start)
            except OSError:
                pass
            raise
        self._fresh = False

    def flush(self) -> None:
        pass  # every write reaches the file whole (unbuffered)

    def close(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            f.close()


class JSONLSink(_FileSink):
    """One JSON object per (step, site, metric, scale)::

        {"step": 5, "site": "layers.0", "metric": "entropy", "scale": "unscaled",
         "value": 0.41, "heads": [0.38, 0.44], "steps": 1}

    ``value`` is the head summary TensorBoard shows (mean; max for ``logit_max``; sum for
    ``nonfinite``); ``heads`` the per-head values; NaN is written as ``null`` and ±inf as
    ``"inf"`` / ``"-inf"`` (strict JSON, as in ``probe_summary.json``).

    Args:
        path: the ``.jsonl`` file (overwritten unless ``append``).
        append: append to an existing file instead of starting a new one.
    """

    def write(self, step: int, summary: Summary) -> None:
        lines = []
        for site in summary.sites:
            for metric in summary.metrics(site):
                for scale in summary.scales(site, metric):
                    values = summary.value(site, metric, scale)
                    record = {
                        "step": step, "site": site, "metric": metric, "scale": scale,
                        "value": _num(head_reduce(metric, values)), "heads": [_num(v) for v in values],
                        "steps": summary.steps,
                    }
                    lines.append(json.dumps(record, allow_nan=False) + "\n")
        self._append("".join(lines))


class CSVSink(_FileSink):
    """Long-format CSV, one row per (step, site, metric, scale, head): the columns are
    ``step,site,metric,scale,head,value`` (empty value for NaN).

    Args:
        path: the ``.csv`` file (overwritten unless ``append``).
        append: append to an existing file instead of starting a new one (no second header).
    """

    COLUMNS = ("step", "site", "metric", "scale", "head", "value")

    def _header(self) -> str:
        buffer = io.StringIO()
        csv.writer(buffer).writerow(self.COLUMNS)
        return buffer.getvalue()

    def write(self, step: int, summary: Summary) -> None:
        buffer = io.StringIO()
        out = csv.writer(buffer)
        for site in summary.sites:
            for metric in summary.metrics(site):
                for scale in summary.scales(site, metric):
                    for head, v in enumerate(summary.value(site, metric, scale)):
                        out.writerow((step, site, metric, scale, head, "" if math.isnan(v) else repr(float(v))))
        self._append(buffer.getvalue())
