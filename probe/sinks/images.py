"""Heatmaps of one metric over sites × heads, with colour scales that are fixed per metric.

A heatmap is only comparable across steps, runs and scales when its colours mean the same number
everywhere, so each metric has one fixed range (never the min and max of the current image),
declared in the metric catalogue (:mod:`probe.metrics`):

=====================================  ===========  ==========================================
metric                                 transform    range (values outside are clipped)
=====================================  ===========  ==========================================
``entropy``, ``max_prob``,             linear       [0, 1]
``saturation``
``logit_var``                          log10        [1e-2, 1e4] (unit-variance q, k: d_k·σ²)
``logit_max``                          symlog       [-10, 1e3]; symlog(x) = sign(x)·log10(1+|x|)
``grad_*``                             log10        [1e-8, 1e2]
``nonfinite``                          log10(1+x)   [0, 1e6] counts
anything else (user metrics)           log10        [1e-6, 1e6]
=====================================  ===========  ==========================================

The colour map is viridis (dark purple = low, yellow = high); grey cells are heads a site does
not have or NaN values (nothing valid to average). A collapsing head is a dark cell in the
``entropy`` map and a bright one in ``max_prob`` / ``saturation``. The title says which scale
the map is at and, for any but ``actual``, that it is a counterfactual: the same q and k at
another scale, not what the model computes.

The colour arithmetic is numpy; Pillow (a dependency of ``tensorboard``) draws the text.
"""

from __future__ import annotations

import functools
import math
from typing import List, NamedTuple, Sequence, Tuple

import numpy as np

from probe import metrics

__all__ = ["ColourScale", "SCALE_WORDS", "colour_scale", "colourize", "grid_of", "render_heatmap", "scale_words"]

# viridis, sampled at 9 evenly spaced points (matplotlib's table); linear in between.
_VIRIDIS = np.array(
    [
        [68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
        [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37],
    ],
    dtype=np.float64,
)
_MISSING = np.array([200, 200, 200], dtype=np.uint8)
_BACKGROUND = (255, 255, 255)
_INK = (20, 20, 20)


class ColourScale(NamedTuple):
    """A fixed range and the transform under which colours are spaced evenly."""

    lo: float
    hi: float
    transform: str  # "linear", "log10", "symlog" or "log1p"
    ticks: Tuple[float, ...]

    def position(self, values: np.ndarray) -> np.ndarray:
        """Map values to [0, 1] (clipped); NaN stays NaN."""
        t = _transform(self.transform, values)
        lo, hi = _transform(self.transform, np.array([self.lo, self.hi]))
        return np.clip((t - lo) / (hi - lo), 0.0, 1.0)


def _transform(kind: str, x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == "linear":
            return x
        if kind == "log10":
            # non-positive values sit at the bottom of the range, not NaN (a zero gradient is real)
            return np.log10(np.where(x > 0, x, np.finfo(np.float64).tiny))
        if kind == "symlog":
            return np.sign(x) * np.log10(1.0 + np.abs(x))
        if kind == "log1p":
            return np.log10(1.0 + np.maximum(x, 0.0))
    raise ValueError(f"unknown transform {kind!r}")


_UNIT = ColourScale(0.0, 1.0, "linear", (0.0, 0.25, 0.5, 0.75, 1.0))  # the colour bar's ramp


def colour_scale(metric: str) -> ColourScale:
    """The fixed colour scale of ``metric`` (the catalogue's, :func:`probe.metrics.colour`; see the
    module docstring for the table)."""
    c = metrics.colour(metric)
    return ColourScale(c.lo, c.hi, c.transform, c.ticks)


def colourize(values: np.ndarray, scale: ColourScale) -> np.ndarray:
    """RGB uint8 colours (``values.shape + (3,)``) of ``values`` under ``scale``; NaN is grey."""
    pos = scale.position(values)
    nan = np.isnan(pos)
    x = np.where(nan, 0.0, pos) * (len(_VIRIDIS) - 1)
    i = np.minimum(np.floor(x).astype(np.int64), len(_VIRIDIS) - 2)
    f = (x - i)[..., None]
    rgb = _VIRIDIS[i] * (1.0 - f) + _VIRIDIS[i + 1] * f
    out = np.rint(rgb).astype(np.uint8)
    out[nan] = _MISSING
    return out


@functools.lru_cache(maxsize=None)
def _font(size: int):  # -> PIL font; cached: loading the TrueType font costs more than drawing
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has only the fixed bitmap font
        return ImageFont.load_default()


@functools.lru_cache(maxsize=4096)
def _text_length(text: str, size: int) -> float:
    from PIL import Image, ImageDraw

    return float(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(text, font=_font(size)))


@functools.lru_cache(maxsize=4096)
def _text_mask(text: str, size: int):  # -> PIL "L" image: the text's coverage, drawn once
    from PIL import Image, ImageDraw

    font = _font(size)
    right, bottom = font.getbbox(text)[2:]
    mask = Image.new("L", (max(1, int(right)), max(1, int(bottom))), 0)
    ImageDraw.Draw(mask).text((0, 0), text, fill=255, font=font)
    return mask


def _text(img, xy: Tuple[float, float], text: str, size: int, fill: Tuple[int, int, int]) -> None:
    """Draw ``text`` at ``xy`` from a cached rendering: labels, ticks and notes repeat in every
    heatmap of every flush, and rasterizing them was half of a heatmap's cost."""
    mask = _text_mask(text, size)
    img.paste(fill, (int(round(xy[0])), int(round(xy[1]))), mask)


def _fmt_tick(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.0e}".replace("e+0", "e").replace("e-0", "e-")
    return f"{v:g}"


#: What each scale's map shows, on the line under its title (ASCII: the default font has no σ or √).
SCALE_WORDS = {
    "actual": "what the model computes",
    "unscaled": "what if: the same q, k at scale 1 (no divisor)",
    "standard": "what if: the same q, k at scale 1/sqrt(d_k)",
}


def scale_words(scale: str) -> str:
    """The words under a map's title: what the model computes, or which counterfactual."""
    return SCALE_WORDS.get(scale, f"what if: the same q, k at scale {_shorten(scale, 24)}")


def _shorten(text: str, limit: int = 42) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def render_heatmap(
    grid: np.ndarray, sites: Sequence[str], metric: str, scale: str, step: int
) -> np.ndarray:
    """Render a sites × heads heatmap with labelled axes and a colour bar.

    Args:
        grid: ``(len(sites), max_heads)`` float array; NaN for heads a site lacks.
        sites: row labels, top to bottom.
        metric: selects the fixed colour scale (:func:`colour_scale`).
        scale: the scale name, for the title.
        step: the step, for the title.

    Returns:
        An ``(H, W, 3)`` uint8 image (``SummaryWriter.add_image(..., dataformats="HWC")``).

    Pitfall: the colour range is fixed per metric, so a uniformly coloured map is information
    (every head sits in the same place of the range), not a rendering failure.
    """
    from PIL import Image, ImageDraw

    grid = np.asarray(grid, dtype=np.float64)
    if grid.ndim != 2 or grid.shape[0] != len(sites):
        raise ValueError(f"expected `grid` of shape (len(sites)={len(sites)}, heads), got {grid.shape}")
    n_sites, n_heads = grid.shape
    cs = colour_scale(metric)
    font = _font(13)
    cw = int(min(36, max(8, 560 // max(n_heads, 1))))
    ch = int(min(24, max(4, 640 // max(n_sites, 1))))
    labels = [_shorten(s) for s in sites]
    text_h = 14
    label_every = max(1, math.ceil(text_h / ch))
    label_w = max([_text_length(t, 11) for t in labels] + [40])

    left = int(label_w) + 14
    top = 74
    bar_gap, bar_w = 18, 16
    grid_w, grid_h = n_heads * cw, n_sites * ch
    tick_w = max(_text_length(_fmt_tick(t), 11) for t in cs.ticks)
    width = left + grid_w + bar_gap + bar_w + 8 + int(tick_w) + 10
    bar_h = max(grid_h, 120)
    height = top + max(bar_h, grid_h + 34) + 12
    title = f"{metric} @ {scale}, step {step}"
    words = scale_words(scale)
    note = f"fixed range [{_fmt_tick(cs.lo)}, {_fmt_tick(cs.hi)}] {cs.transform}, grey = none"
    width = max(width, *(int(_text_length(t, size)) + 16 for t, size in ((title, 13), (words, 11), (note, 11))))

    img = Image.new("RGB", (width, height), _BACKGROUND)
    draw = ImageDraw.Draw(img)
    draw.text((8, 6), title, fill=_INK, font=font)
    _text(img, (8, 24), words, 11, _INK if scale == "actual" else (170, 60, 20))
    _text(img, (8, 38), note, 11, (90, 90, 90))

    cells = colourize(grid, cs)  # (S, H, 3)
    block = np.repeat(np.repeat(cells, ch, axis=0), cw, axis=1)
    img.paste(Image.fromarray(block), (left, top))
    # thin separators between heads and sites when cells are large enough to spare a pixel
    if cw >= 12:
        for h in range(1, n_heads):
            draw.line([(left + h * cw, top), (left + h * cw, top + grid_h - 1)], fill=_BACKGROUND)
    if ch >= 10:
        for s in range(1, n_sites):
            draw.line([(left, top + s * ch), (left + grid_w - 1, top + s * ch)], fill=_BACKGROUND)

    # axes: head indices below the grid, site names to the left, "site \ head" in the corner
    head_every = max(1, math.ceil(22 / cw))
    for h in range(0, n_heads, head_every):
        t = str(h)
        x = left + h * cw + (cw - _text_length(t, 11)) / 2
        _text(img, (x, top + grid_h + 3), t, 11, _INK)
    head_label_x = left + (grid_w - _text_length("head", 11)) / 2
    _text(img, (head_label_x, top + grid_h + 18), "head", 11, (90, 90, 90))
    for s in range(0, n_sites, label_every):
        t = labels[s]
        x = left - 6 - _text_length(t, 11)
        y = top + s * ch + (ch - text_h) / 2
        _text(img, (x, y), t, 11, _INK)
    _text(img, (8, top - 16), "site", 11, (90, 90, 90))

    # colour bar, low at the bottom
    bx, by = left + grid_w + bar_gap, top
    ramp = np.linspace(1.0, 0.0, bar_h)[:, None]
    colours = colourize(ramp, _UNIT)
    img.paste(Image.fromarray(np.repeat(colours, bar_w, axis=1)), (bx, by))
    draw.rectangle([bx - 1, by - 1, bx + bar_w, by + bar_h], outline=_INK)
    for tick in cs.ticks:
        p = float(cs.position(np.array([tick]))[0])
        y = by + (1.0 - p) * (bar_h - 1)
        draw.line([(bx + bar_w, y), (bx + bar_w + 4, y)], fill=_INK)
        _text(img, (bx + bar_w + 7, y - 7), _fmt_tick(tick), 11, _INK)
    return np.asarray(img, dtype=np.uint8)


def grid_of(values: Sequence[np.ndarray]) -> Tuple[np.ndarray, List[int]]:
    """Stack per-site head vectors of different lengths into a NaN-padded grid."""
    heads = [int(np.asarray(v).size) for v in values]
    grid = np.full((len(values), max(heads, default=0)), np.nan)
    for row, v in enumerate(values):
        grid[row, : heads[row]] = np.asarray(v, dtype=np.float64).reshape(-1)
    return grid, heads
