"""Site and scale names made safe where they are shown or used as keys; the summary keeps them raw.

A site is named after a module path, but a model may name a module anything: ``a/head03`` (read
back from a tag as head 3 of a site ``a``), a newline (which broke TensorBoard's writer), ``|`` (a
markdown table cell), an ANSI escape (which a terminal would execute).
"""

from __future__ import annotations

import re

__all__ = ["decode_name", "encode_name", "printable"]

_UNSAFE = re.compile(r"[%/\x00-\x1f\x7f-\x9f]")
_ESCAPED = re.compile(r"%([0-9A-F]{2})")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def encode_name(name: str) -> str:
    """A site or scale name as one tag component: ``%``, ``/`` and control characters as ``%XX``."""
    return _UNSAFE.sub(lambda m: f"%{ord(m.group()):02X}", name)


def decode_name(text: str) -> str:
    """Inverse of :func:`encode_name`."""
    return _ESCAPED.sub(lambda m: chr(int(m.group(1), 16)), text)


def printable(name: str) -> str:
    """``name`` for a terminal or a table: control characters (newline, ANSI escape ``\\x1b``) are
    written as Python escapes, so they are seen, never executed; everything else is unchanged."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], name)
