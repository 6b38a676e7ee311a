"""When probe acts: a pure map from step number to action, as ``torch.profiler.schedule``.

:class:`Schedule` knows nothing of models or tensors: ``schedule(step)`` says whether a step is
recorded, :meth:`Schedule.flush_due` whether a window of recorded steps is complete. The
profiler asks it at each root forward (and at ``p.step(n)``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

from probe.errors import ProbeError

__all__ = ["Action", "Schedule"]


class Action(enum.Enum):
    """What probe does during one step."""

    SKIP = "skip"  #: the step runs untouched (two Python hook calls)
    RECORD = "record"  #: the step's attention calls are captured and measured


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Record steps ``offset, offset + every, ...`` (``offset`` 0 by default); flush once
    ``flush_every`` recorded steps are complete (a step is complete once the next step began:
    its backward pass belongs to it).

    Example:
        >>> s = Schedule(every=2, flush_every=1)
        >>> [s(n).name for n in range(4)]
        ['RECORD', 'SKIP', 'RECORD', 'SKIP']
    """

    every: int = 1
    flush_every: int = 1
    offset: int = 0  #: record ``step % every == offset`` (a trainer logging N-1, 2N-1, ...: N-1)

    def __post_init__(self) -> None:
        if not 0 <= self.offset < self.every:
            raise ProbeError(f"expected `offset` to be in [0, every) = [0, {self.every}), got {self.offset!r}")

    def __call__(self, step: int) -> Action:
        return Action.RECORD if step % self.every == self.offset else Action.SKIP

    def window_full(self, window: Sequence[int]) -> bool:
        """Whether the recorded steps ``window`` are enough for a flush (once they are complete)."""
        return bool(window) and len(window) >= self.flush_every

    def flush_due(self, window: Sequence[int], step: int) -> bool:
        """Whether the recorded steps ``window`` (ascending) form a complete flush at ``step``."""
        return self.window_full(window) and window[-1] != step
