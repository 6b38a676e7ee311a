"""Exceptions raised by probe."""

from __future__ import annotations

__all__ = ["ProbeError", "StabilityError"]


class ProbeError(Exception):
    """A usage error: a bad argument, an unknown name, unreadable input.

    Messages name the argument, what was expected and what came, e.g.
    ``expected `every` to be a positive int, got 0``.
    """


class StabilityError(AssertionError):
    """A stability threshold was violated.

    Subclasses ``AssertionError`` so pytest reports it as a test failure, not an error.
    """
