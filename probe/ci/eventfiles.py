"""Integrity of TensorBoard event files: a truncated or corrupted file is reported, never read as
"fewer steps" without a word.

An event file is a sequence of TFRecords: ``uint64 length``, ``uint32 masked_crc32c(length)``,
``length`` bytes of data, ``uint32 masked_crc32c(data)``. TensorBoard's reader stops quietly at
the first bad record, so a check on such a file would silently judge a prefix of the run.
:func:`check_event_file` walks the frames (headers only: cheap), then counts what TensorBoard's
own loader reads (it verifies each record's data checksum) and compares.
"""

from __future__ import annotations

import os
import struct
from typing import List

from probe.errors import ProbeError

__all__ = ["EVENTS_PREFIX", "check_event_file", "check_event_files", "event_files"]

EVENTS_PREFIX = "events.out.tfevents"


def event_files(path: str) -> List[str]:
    """The event files at ``path``: the file itself, or those in the directory (sorted)."""
    if os.path.isdir(path):
        return [os.path.join(path, name) for name in sorted(os.listdir(path)) if name.startswith(EVENTS_PREFIX)]
    return [path]


def _frames(path: str) -> int:
    """The number of complete, well-framed records; raises ProbeError on a bad or partial frame."""
    from tensorboard.summary.writer.record_writer import masked_crc32c

    size = os.path.getsize(path)
    count = offset = 0
    with open(path, "rb") as f:
        while offset < size:
            header = f.read(12)
            if len(header) < 12:
                raise ProbeError(f"TensorBoard event file {path!r} is truncated: it ends {size - offset} bytes into "
                                 f"the header of record {count + 1} (after {count} complete records); the run was "
                                 "killed while writing, or the file was cut")
            (length,) = struct.unpack("<Q", header[:8])
            (crc,) = struct.unpack("<I", header[8:])
            if masked_crc32c(header[:8]) != crc:
                raise ProbeError(f"TensorBoard event file {path!r} is corrupted at byte {offset}: the header of "
                                 f"record {count + 1} fails its checksum (after {count} good records)")
            end = offset + 12 + length + 4
            if end > size:
                raise ProbeError(f"TensorBoard event file {path!r} is truncated: record {count + 1} needs "
                                 f"{end - offset} bytes from byte {offset}, the file ends after {size - offset} "
                                 f"(after {count} complete records); the run was killed while writing, or the "
                                 "file was cut")
            f.seek(end)
            offset = end
            count += 1
    return count


def check_event_file(path: str) -> int:
    """Check one event file; returns its number of records.

    Raises:
        ProbeError: the file is truncated (a partial record at its end) or corrupted (a record
            whose header or data fails its checksum, or does not parse), naming the file, the
            byte offset or record and how many records came before.
    """
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

    framed = _frames(path)
    try:
        loaded = sum(1 for _ in RawEventFileLoader(path).Load())
    except Exception as err:  # noqa: BLE001 - the reader raises several kinds of error
        raise ProbeError(f"TensorBoard event file {path!r} is corrupted: {type(err).__name__}: {err}") from err
    if loaded < framed:
        raise ProbeError(f"TensorBoard event file {path!r} is corrupted: record {loaded + 1} of {framed} fails its "
                         f"data checksum; TensorBoard would read only the first {loaded} records")
    return framed


def check_event_files(path: str) -> None:
    """:func:`check_event_file` for every event file at ``path`` (a file or a directory)."""
    for name in event_files(path):
        check_event_file(name)
