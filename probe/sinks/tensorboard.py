"""TensorBoard sink: scalars, heatmaps, histograms, a custom-scalars layout and the sites table.

The tag names are defined in :mod:`probe.sinks.tags` (the headline ``attention/{metric}``,
``probe.{metric}@{scale}/{site}``, ``probe.{metric}.heatmap/{scale}``, ``probe.{metric}.hist/{scale}``,
custom-scalars categories ``attention`` and ``probe.{metric}``, text ``probe.sites``): one
TensorBoard group per metric and scale; site names encoded so ``/`` or a newline cannot split a tag.

Every write runs on probe's background worker, never on the training thread.

Cadence: scalars at every flush; heatmaps and histograms at the first flush, then at the first
flush at least ``image_every`` steps (default 100) after the last pictures, and at ``close()``
for the last flush if it had none. Pictures are views over many steps (TensorBoard keeps 10
images per tag by default) and cost far more than scalars: rendering and encoding 30 heatmaps and
histograms took about 0.2-0.4 s of CPU per flush on a 2-core machine, 100 times the scalars.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import numpy as np

from probe.errors import ProbeError
from probe.sinks import tags
from probe.sinks.eventfile import EventFile
from probe.sinks.base import head_scalars, overview_scalars, scalar_tag
from probe.sinks.images import grid_of, render_heatmap
from probe.sinks.tags import custom_scalars_layout  # the layout is part of the tag contract (tags.py)
from probe.summary import Summary, compact_values

__all__ = ["TensorBoardSink", "custom_scalars_layout", "scalar_tag", "sites_table"]


def _cell(text: Any) -> str:
    return tags.printable(str(text)).replace("|", "\\|")  # a markdown table cell


def sites_table(summary: Summary, step: Optional[int] = None) -> str:
    """A markdown table of the detected sites (TensorBoard renders text summaries as markdown);
    ``calls`` counts the site's probed attention calls up to ``step``."""
    lines = [] if step is None else [f"Attention sites found by step {step} (calls: probed calls up to then).", ""]
    lines += ["| site | kind | heads | kv heads | d_k | actual scale | calls | verified | not measured |",
              "|---|---|---|---|---|---|---|---|---|"]
    for site in summary.sites:
        i = summary.info(site)
        verified = {True: "yes", False: "**NO**", None: "unchecked"}.get(i.get("verified"), "-")
        missing = "; ".join(f"{compact_values(values)}: {why}" for why, values in summary.not_measured(site).items())
        lines.append(
            f"| {_cell(site)} | {i.get('kind')} | {i.get('heads')} | {i.get('kv_heads')} | {i.get('d_k')} "
            f"| {tags.scale_label(i.get('scale'), i.get('d_k'))} | {i.get('calls')} | {verified} | {_cell(missing or '-')} |"
        )
    return "\n".join(lines)


def _add_image(w: Any, tag: str, image: np.ndarray, step: int) -> None:
    """``w.add_image(tag, image, step, dataformats="HWC")`` for a uint8 RGB image, PNG-encoded at
    zlib level 1 when ``w`` is torch's ``SummaryWriter``: its own encoder (level 6, after a float
    round trip and a resize to the same size) took 2.4 times as long for files 5 % smaller."""
    file_writer = getattr(w, "_get_file_writer", None)
    if file_writer is None:  # another writer class: its own add_image
        w.add_image(tag, image, step, dataformats="HWC")
        return
    import io

    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
    encoded = SummaryProto.Image(height=image.shape[0], width=image.shape[1], colorspace=3,
                                 encoded_image_string=buffer.getvalue())
    file_writer().add_summary(SummaryProto(value=[SummaryProto.Value(tag=tag, image=encoded)]), step)


def _add_scalars(w: Any, scalars: List[Tuple[str, float]], step: int) -> None:
    """``w.add_scalar(tag, value, step)`` for each pair: when ``w`` is torch's ``SummaryWriter``, as
    one event per flush holding every value (TensorBoard reads each value of an event as its own
    point: the same tags, steps and float32 values), not one event, queue hand-off and checksum
    per scalar (88 events for a 4-site model cost about 5 ms of the writer thread's CPU)."""
    file_writer = getattr(w, "_get_file_writer", None)
    if file_writer is None:  # another writer class: its own add_scalar
        for tag, value in scalars:
            w.add_scalar(tag, value, step)
        return
    from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto

    for start in range(0, len(scalars), _SCALARS_PER_EVENT):
        values = [SummaryProto.Value(tag=tag, simple_value=value) for tag, value in scalars[start:start + _SCALARS_PER_EVENT]]
        file_writer().add_summary(SummaryProto(value=values), step)


#: Scalars per event: a per_head run of a large model stays in events of a few hundred KiB.
_SCALARS_PER_EVENT = 4096


class TensorBoardSink:
    """Writes each flush to TensorBoard (see the module docstring for the tags).

    Args:
        logdir: a directory, or an existing ``torch.utils.tensorboard.SummaryWriter`` (probe
            then writes beside the user's own scalars, at the step probe was given, and never
            closes it).
        per_head: also write ``.../head{h:02d}`` scalars.
        images: write the heatmap images (``probe.{metric}.heatmap/{scale}``).
        histograms: write the histograms (``probe.{metric}.hist/{scale}``).
        image_every: steps between two flushes with images and histograms (1: every flush).

    Failures: in a directory, probe writes its own event file (:class:`probe.sinks.eventfile.EventFile`,
    on probe's sink thread, whole flushes or nothing). A write that fails (a full disk, a
    read-only directory) leaves the file as it was and raises ``OSError``: probe's writer keeps
    that flush and gives it to :meth:`write` again before the next one, and at close
    (:mod:`probe.state.writer`). Nothing reaches stderr.

    Pitfall: a run has one custom-scalars layout; with a user's writer that already has its own
    layout, the later one wins in TensorBoard's Custom Scalars tab.
    """

    def __init__(
        self,
        logdir: Union[str, os.PathLike, Any],
        per_head: bool = False,
        images: bool = True,
        histograms: bool = True,
        image_every: int = 100,
    ) -> None:
        if isinstance(image_every, bool) or not isinstance(image_every, int) or image_every < 1:
            raise ProbeError(f"expected `image_every` to be a positive int, got {image_every!r}")
        self._target = logdir
        self._writer: Any = None
        self._owns = not hasattr(logdir, "add_scalar")
        self.per_head = per_head
        self.images = images
        self.histograms = histograms
        self.image_every = image_every
        self._pictures_at: Optional[int] = None  # step of the last flush with pictures
        self._pending: Optional[Tuple[int, Summary]] = None  # the last flush, when it had none
        self._sites_written: Tuple[str, ...] = ()
        self._layout_written: Dict[str, List[str]] = {}
        self._layout_scales: Dict[Tuple[str, str], Set[str]] = {}
        self._infos: Dict[str, Dict[str, Any]] = {}
        self._closed = False

    @property
    def writer(self) -> Any:
        """probe's :class:`~probe.sinks.eventfile.EventFile` in the directory, or the user's
        ``SummaryWriter``."""
        if self._writer is None:
            self._writer = EventFile(os.fspath(self._target)) if self._owns else self._target
            self._new_file()
        return self._writer

    def _new_file(self) -> None:
        # a new event file holds its own layout, sites table and pictures
        self._sites_written, self._layout_written, self._layout_scales = (), {}, {}
        self._pictures_at = None

    def write(self, step: int, summary: Summary) -> None:
        """Write one flush. An ``OSError`` (a full disk, a read-only directory) leaves probe's
        event file as it was and propagates: the caller keeps the flush and writes it again."""
        self._closed = False
        self._reopen_if_vanished()
        pictures = self._pictures_at, self._pending
        try:
            self._write(self.writer, step, summary)
        except OSError:
            # nothing of this flush is on disk: the layout, the sites table and the pictures are
            # written again with it
            self._sites_written, self._layout_written, self._layout_scales = (), {}, {}
            self._pictures_at, self._pending = pictures
            raise

    def _pictures_due(self, step: int) -> bool:
        last = self._pictures_at
        return last is None or step - last >= self.image_every or step < last

    def _write(self, w: Any, step: int, summary: Summary) -> None:
        _add_scalars(w, list(overview_scalars(summary)) + list(head_scalars(summary, self.per_head)), step)
        if (self.images or self.histograms) and self._pictures_due(step):
            self._write_pictures(w, step, summary)
        else:
            self._pending = (step, summary)
        self._write_layout(w, summary)
        for site in summary.sites:
            self._infos[site] = summary.info(site)
        if tuple(self._infos) != self._sites_written:
            table = Summary({s: {"info": i} for s, i in self._infos.items()})
            w.add_text(tags.SITES_TAG, sites_table(table, step), step)
            self._sites_written = tuple(self._infos)
        w.flush()  # on the worker thread: TensorBoard sees each flush without the training loop waiting

    def _write_pictures(self, w: Any, step: int, summary: Summary) -> None:
        self._pictures_at, self._pending = step, None
        by_metric: Dict[Tuple[str, str], List[Tuple[str, np.ndarray]]] = {}
        for site in summary.sites:
            for metric in summary.metrics(site):
                for scale in summary.scales(site, metric):
                    by_metric.setdefault((metric, scale), []).append((site, summary.value(site, metric, scale)))
        for (metric, scale), rows in by_metric.items():
            if self.images:
                grid, _ = grid_of([v for _, v in rows])
                image = render_heatmap(grid, [tags.printable(s) for s, _ in rows], metric, scale, step)
                _add_image(w, tags.heatmap_tag(metric, scale), image, step)
            if self.histograms:
                values = np.concatenate([v for _, v in rows])
                values = values[np.isfinite(values)]
                if values.size:
                    w.add_histogram(tags.histogram_tag(metric, scale), values, step, bins="auto")

    def _write_layout(self, w: Any, summary: Summary) -> None:
        grown = False
        for site in summary.sites:
            for metric in summary.metrics(site):
                sites = self._layout_written.setdefault(metric, [])
                if site not in sites:
                    sites.append(site)
                    grown = True
                scales = self._layout_scales.setdefault((metric, site), set())
                if not scales.issuperset(summary.scales(site, metric)):
                    scales.update(summary.scales(site, metric))
                    grown = True
        if grown:
            w.add_custom_scalars(custom_scalars_layout(self._layout_written, self._layout_scales))

    def _reopen_if_vanished(self) -> None:
        # An event file deleted under an open writer swallows every later event (the inode is
        # unlinked); start a new file, which recreates the directory.
        if self._owns and isinstance(self._writer, EventFile) and self._writer.vanished:
            warnings.warn(
                f"probe: the TensorBoard event file {self._writer.path!r} vanished (logdir deleted?); "
                f"writing to a new event file from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            self._writer.restart()
            self._new_file()

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush; close the writer if probe created it. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            try:
                if self._pending is not None:  # the last state, pictured even off the cadence
                    step, summary = self._pending
                    self._write_pictures(self._writer, step, summary)
                self._writer.flush()
            finally:
                if self._owns:
                    self._writer.close()
                self._writer = None

    def __enter__(self) -> "TensorBoardSink":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
