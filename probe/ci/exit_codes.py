"""The exit codes of the ``probe`` command line (a leaf module: every command imports it)."""

from __future__ import annotations

import enum

__all__ = ["ExitCode"]


class ExitCode(enum.IntEnum):
    """``0`` pass, ``1`` violations, ``2`` usage error or unreadable input."""

    OK = 0
    VIOLATIONS = 1
    USAGE = 2
