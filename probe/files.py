"""Reading and writing probe's files safely: no hang on a FIFO, no half-written or hijacked file.

* :func:`read_regular_file` opens without blocking (a FIFO would otherwise wait for a writer
  forever), refuses anything but a regular file (``/dev/null``, a device, a socket) and caps the
  size, raising :class:`probe.ProbeError` naming the path.
* :func:`atomic_write` writes a fresh temporary file beside the target (a random name, created
  with ``O_EXCL | O_NOFOLLOW``: a planted file or symlink is never opened), flushes it to disk and
  renames it over the target with ``os.replace`` (which replaces a symlink at the target rather
  than writing through it). Readers see the old file or the new one, never half of one; the
  temporary file is removed if anything fails.
"""

from __future__ import annotations

import os
import secrets
import stat
from typing import Union

from probe.errors import ProbeError

__all__ = ["atomic_write", "read_regular_file"]

PathLike = Union[str, "os.PathLike[str]"]


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_regular_file(path: PathLike, what: str, max_bytes: int = 1 << 30) -> bytes:
    """The bytes of the regular file ``path``.

    Args:
        path: the file.
        what: what it should be, for messages ("probe summary", "config file").
        max_bytes: refuse larger files (a wrong path must fail fast, not fill memory).

    Raises:
        ProbeError: ``cannot read {what} {path!r}: ...`` for a missing or unreadable path, a FIFO,
            a device, a directory, or a file larger than ``max_bytes``.
    """
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ProbeError(f"cannot read {what} {path!r}: {err.strerror or err}") from err
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ProbeError(f"cannot read {what} {path!r}: it is {_kind(mode)}, expected a regular file")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise ProbeError(f"cannot read {what} {path!r}: {err.strerror or err}") from err
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > max_bytes:
        raise ProbeError(f"cannot read {what} {path!r}: larger than {max_bytes} bytes")
    return data


def atomic_write(path: PathLike, text: str) -> None:
    """Replace ``path`` with a file holding ``text`` (UTF-8), atomically (see the module docstring).

    Raises:
        OSError: the directory is not writable, the disk is full, ...
    """
    path = os.fspath(path)
    directory, base = os.path.split(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:  # pragma: no cover - 64 random bits
            continue
    else:  # pragma: no cover
        raise FileExistsError(f"could not create a unique temporary file beside {path!r}")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
