"""Reading a TensorBoard run with TensorBoard's own reader."""

from __future__ import annotations

from typing import Dict, List

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def scalars(run_dir: str) -> Dict[str, List[int]]:
    """tag -> sorted steps of every scalar in the run (all event files of the directory)."""
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: sorted(e.step for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}


def probe_steps(tags: Dict[str, List[int]]) -> List[int]:
    """The steps at which probe wrote its scalars (the same for every probe tag)."""
    steps = {tuple(v) for k, v in tags.items() if k.startswith("probe.")}
    assert len(steps) == 1, steps
    return list(steps.pop())


class Recorder:
    """A user sink: (step, cumulative calls per site) at every write."""

    def __init__(self) -> None:
        self.writes = []

    def write(self, step, summary) -> None:
        self.writes.append((step, {s: summary.info(s)["calls"] for s in summary.sites}))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
