"""probe's own TensorBoard event file: written on probe's sink thread, whole flushes or nothing.

``torch.utils.tensorboard.SummaryWriter`` hands every event to a thread of its own, which writes
it record by record. When a write fails there (a full disk, a read-only directory), that thread
prints a traceback, dies, and leaves the record it was writing half on disk: TensorBoard's reader
stops there quietly and ``probe check`` reports the run as killed mid-write from then on.

probe writes on its own background thread already (one per sink, :mod:`probe.state.writer`), so
:class:`EventFile` writes synchronously there, in the TFRecord framing TensorBoard reads
(length, masked CRC-32C of the length, data, masked CRC-32C of the data), with the file's
``brain.Event:2`` header first. Records of one flush are collected and written in one go at
:meth:`EventFile.flush`. If that write fails, the file is cut back to where the flush began, so
the file only ever holds whole flushes; the records are dropped (the sink keeps the flush and
writes it again: :class:`probe.sinks.tensorboard.TensorBoardSink`). A file that cannot be cut
back is left for a new event file, started at the next flush; each successful flush after
that tries again to cut it back. Nothing is printed; the caller gets the ``OSError``.

It offers what :class:`~probe.sinks.tensorboard.TensorBoardSink` uses of ``SummaryWriter``
(``add_summary`` through ``_get_file_writer()``, ``add_text``, ``add_histogram``,
``add_custom_scalars``, ``flush``, ``close``), so the sink writes to either.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from typing import Any, BinaryIO, List, Mapping, Optional, Tuple

from probe.sinks.checksum import masked_crc32c

__all__ = ["EventFile"]

_UIDS = itertools.count()


def _next_uid() -> int:
    """The number in an event file's name: from TensorBoard's own counter where there is one, so
    that probe's files and a ``SummaryWriter``'s, made by one process in the same second, sort in
    the order they were made (TensorBoard reads a directory's files in name order)."""
    try:
        from tensorboard.summary.writer.event_file_writer import _global_uid

        return int(_global_uid.get())
    except (ImportError, AttributeError):
        return next(_UIDS)


def _frame(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def _truncate(path: str, size: int) -> bool:
    """Cut ``path`` back to ``size`` bytes; whether it holds no more than that now (a vanished
    file counts: nothing of it is left to read)."""
    try:
        if os.path.getsize(path) > size:
            os.truncate(path, size)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


class EventFile:
    """A TensorBoard event file in ``logdir`` (see the module docstring).

    The file is created at the first flush with something to write (creating ``logdir``), named
    as TensorBoard names its own (``events.out.tfevents.{time}.{host}.{pid}.{n}``) with the suffix
    ``.probe``.
    """

    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        self.path: Optional[str] = None  # the current file, once created
        self._file: Optional[BinaryIO] = None
        self._size = 0  # bytes of whole flushes in the current file
        self._records: List[bytes] = []
        self._abandoned: List[Tuple[str, int]] = []  # (file, size of its whole flushes) not cut back yet

    # -- what the sink calls -----------------------------------------------------------------------
    def _get_file_writer(self) -> "EventFile":
        return self

    def get_logdir(self) -> str:
        return self.logdir

    def add_summary(self, summary: Any, global_step: Optional[int] = None, walltime: Optional[float] = None) -> None:
        from tensorboard.compat.proto import event_pb2

        event = event_pb2.Event(summary=summary, wall_time=time.time() if walltime is None else walltime)
        if global_step is not None:
            event.step = int(global_step)
        self._records.append(_frame(event.SerializeToString()))

    def add_text(self, tag: str, text: str, global_step: Optional[int] = None) -> None:
        from torch.utils.tensorboard.summary import text as text_summary

        self.add_summary(text_summary(tag, text), global_step)

    def add_histogram(self, tag: str, values: Any, global_step: Optional[int] = None, bins: Any = "auto") -> None:
        from torch.utils.tensorboard.summary import histogram

        self.add_summary(histogram(tag, values, bins), global_step)

    def add_custom_scalars(self, layout: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import custom_scalars

        self.add_summary(custom_scalars(layout))

    def flush(self) -> None:
        """Write the records added since the last flush, all or none (see the module docstring).

        Raises:
            OSError: the write failed; the file holds what it held before.
        """
        records, self._records = self._records, []
        if not records:
            return
        data = b"".join(records)
        try:
            if self._file is None:
                self._open()
            self._write(data)
        except OSError:
            self._cut_back()
            raise
        self._size += len(data)
        if self._abandoned:
            self._abandoned = [(path, size) for path, size in self._abandoned if not _truncate(path, size)]

    def close(self) -> None:
        """Write what is pending, close the file. Safe to call twice."""
        try:
            self.flush()
        finally:
            file, self._file = self._file, None
            if file is not None:
                file.close()

    # -- the file ----------------------------------------------------------------------------------
    def _open(self) -> None:
        from tensorboard.compat.proto import event_pb2

        if self.path is None:
            os.makedirs(self.logdir, exist_ok=True)
            name = "events.out.tfevents.%010d.%s.%s.%s.probe" % (time.time(), socket.gethostname(), os.getpid(),
                                                                  _next_uid())
            self.path = os.path.join(self.logdir, name)
            self._size = 0
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - kept open between flushes
        if self._size == 0:
            header = event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
            try:
                self._write(_frame(header.SerializeToString()))
            except OSError:
                self._cut_back()
                raise
            self._size = self._file.tell()

    def _write(self, data: bytes) -> None:
        assert self._file is not None
        view = memoryview(data)
        while view:  # a raw file may write part of it and return the count
            written = self._file.write(view)
            if not written:
                raise OSError("short write to the TensorBoard event file")
            view = view[written:]

    def _close_file(self) -> None:
        """Close the open file, if any, ignoring a failure (what it holds is kept or cut back)."""
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass

    def _cut_back(self) -> None:
        """After a failed write: the file back to its whole flushes, or a new file next time."""
        self._close_file()
        if self.path is None:
            return
        if self._size == 0:  # not even the header: no file
            try:
                os.remove(self.path)
            except OSError:
                pass
            self.path = None
        elif not _truncate(self.path, self._size):
            # cannot be cut back now (read-only now?): the next flush starts a new file, and each
            # successful flush tries again to cut this one back
            self._abandoned.append((self.path, self._size))
            self.path = None

    @property
    def vanished(self) -> bool:
        """The file was created and is gone (its directory deleted under a running writer)."""
        return self.path is not None and self._size > 0 and not os.path.exists(self.path)

    def restart(self) -> None:
        """Start a new event file at the next flush (the records pending are kept)."""
        self._close_file()
        self.path = None
