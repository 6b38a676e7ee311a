"""TensorBoard sink: ``probe/{metric}/{scale}/{site}`` scalars and the ``probe/sites`` table."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple, Union

from probe.stats.finalize import head_reduce
from probe.summary import Summary

__all__ = ["TensorBoardSink", "scalar_tag", "sites_table"]


def scalar_tag(metric: str, scale: str, site: str, head: Optional[int] = None) -> str:
    tag = f"probe/{metric}/{scale}/{site}"
    return tag if head is None else f"{tag}/head{head:02d}"


def _fmt_scale(scale: Any) -> str:
    if scale is None:
        return "unknown"
    if isinstance(scale, list):
        return "per-head [" + ", ".join(f"{s:.4g}" for s in scale) + "]"
    return f"{scale:.6g}"


def sites_table(summary: Summary) -> str:
    """A markdown table of the detected sites (TensorBoard renders text summaries as markdown)."""
    lines = ["| site | kind | heads | kv heads | d_k | actual scale | calls |", "|---|---|---|---|---|---|---|"]
    for site in summary.sites:
        i = summary.info(site)
        lines.append(
            f"| {site} | {i.get('kind')} | {i.get('heads')} | {i.get('kv_heads')} | {i.get('d_k')} "
            f"| {_fmt_scale(i.get('scale'))} | {i.get('calls')} |"
        )
    return "\n".join(lines)


class TensorBoardSink:
    """Writes each flush as TensorBoard scalars.

    Args:
        logdir: a directory, or an existing ``torch.utils.tensorboard.SummaryWriter`` (probe
            then writes beside the user's own scalars and never closes it).
        per_head: also write ``.../head{h:02d}`` scalars.
    """

    def __init__(self, logdir: Union[str, os.PathLike, Any], per_head: bool = False) -> None:
        self._target = logdir
        self._writer: Any = None
        self._owns = not hasattr(logdir, "add_scalar")
        self.per_head = per_head
        self._sites_written: Tuple[str, ...] = ()
        self._infos: Dict[str, Dict[str, Any]] = {}

    @property
    def writer(self) -> Any:
        if self._writer is None:
            if self._owns:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=os.fspath(self._target))
            else:
                self._writer = self._target
        return self._writer

    def write(self, step: int, summary: Summary) -> None:
        w = self.writer
        for site in summary.sites:
            for metric in summary.metrics(site):
                for scale in summary.scales(site, metric):
                    values = summary.value(site, metric, scale)
                    w.add_scalar(scalar_tag(metric, scale, site), head_reduce(metric, values), step)
                    if self.per_head:
                        for h, v in enumerate(values):
                            w.add_scalar(scalar_tag(metric, scale, site, h), float(v), step)
        for site in summary.sites:
            self._infos[site] = summary.info(site)
        if tuple(self._infos) != self._sites_written:
            table = Summary({s: {"info": i} for s, i in self._infos.items()})
            w.add_text("probe/sites", sites_table(table), step)
            self._sites_written = tuple(self._infos)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            if self._owns:
                self._writer.close()
            self._writer = None
