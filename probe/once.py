"""Warn once per key: probe's diagnostics repeat at every step, the user should read them once."""

from __future__ import annotations

import warnings
from typing import Hashable, Set, Type

__all__ = ["WarnOnce"]


class WarnOnce:
    """``warn(key, message)`` warns the first time ``key`` is seen, and is silent after."""

    def __init__(self, category: Type[Warning] = UserWarning) -> None:
        self.category = category
        self._seen: Set[Hashable] = set()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seen

    def __call__(self, key: Hashable, message: str, stacklevel: int = 2) -> bool:
        """Warn unless ``key`` was seen (``stacklevel`` as for ``warnings.warn``, counted from the
        caller); returns whether it warned."""
        if key in self._seen:
            return False
        self._seen.add(key)
        warnings.warn(message, self.category, stacklevel=stacklevel + 1)
        return True
