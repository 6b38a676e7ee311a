"""Stratified sampling of query rows (the ``rows=`` budget): the design, its Horvitz-Thompson
totals and their variance estimate.

Design (:func:`sample_rows`): of ``N`` rows of ``L``, the first ``E = N // 4`` positions are
taken whole; the other ``L − E`` are cut into ``(N − E) // 2`` strata of consecutive positions
(sizes differing by at most one), two positions per stratum drawn without replacement (the last
stratum takes a third when ``N − E`` is odd; ``N = 1`` is one stratum of one row). A stratum
``h`` of ``L_h`` positions with ``n_h`` drawn gives each of them the weight ``L_h / n_h``, so
``T̂ = Σ_h (L_h/n_h) Σ_i y_hi`` is an unbiased estimate of the total ``Σ_l y_l``, with the
unbiased variance estimate ``V̂ = Σ_h L_h² (1 − n_h/L_h) / n_h · s_h²``, ``s_h²`` the sample
variance of the stratum's ``y`` (Cochran, *Sampling Techniques*, 5.9). Only the spread *within*
strata enters: a trend over positions (early causal rows see few keys) does not.

The design is a function of ``(L, N)`` alone, so the positions are all a consumer needs: the
forward and the backward both rebuild the weights from them (:func:`row_design`).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections import OrderedDict
from typing import List, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

__all__ = ["Design", "row_design", "sample_rows", "strata_sizes", "stratified_variance"]

#: ``(weight, stratum, L_h, n_h)`` of sampled positions (:func:`row_design`).
Design = Tuple[Tensor, Tensor, Tensor, Tensor]


#: The first ``N // 4`` positions are always computed (a stratum drawn whole: weight 1, no
#: variance). Early causal rows see few keys, and their metrics move fastest with the position
#: (max_prob ~ 1/n; the first row, one key, has no entropy at all): a stratum mixing them with
#: later rows gives an unbiased but very skewed variance estimate (measured on the Llama
#: workload: with N = 128 and no such stratum, errors of 30-150 reported standard errors
#: whenever position 0 was not drawn).
_HEAD_FRACTION = 4


@functools.lru_cache(maxsize=64)
def strata_sizes(length: int, rows: int) -> Tuple[Tensor, Tensor]:
    """``(L_h, n_h)`` of the design for ``rows < length`` sampled of ``length``, int64 on the CPU:
    first the head ``N // 4`` positions drawn whole, then ``(N − head) // 2`` strata of the rest.
    Cached (every call of a model has the same few ``(L, N)``): callers must not change them."""
    head = rows // _HEAD_FRACTION
    rest = rows - head
    strata = max(1, rest // 2)
    bounds = head + torch.div(torch.arange(strata + 1) * (length - head), strata, rounding_mode="floor")
    sizes = bounds[1:] - bounds[:-1]
    drawn = torch.full((strata,), 2 if rest >= 2 else 1, dtype=torch.int64)
    drawn[-1] += rest - int(drawn.sum())  # an odd rest: the last stratum draws three
    if head:
        sizes, drawn = torch.cat([torch.tensor([head]), sizes]), torch.cat([torch.tensor([head]), drawn])
    return sizes, drawn


def sample_rows(length: int, rows: int, generator: Optional[torch.Generator] = None,
                device: Optional[torch.device] = None) -> Tensor:
    """``min(rows, length)`` distinct query positions of ``range(length)``, sorted, drawn by the
    stratified design (module docstring); every position when ``rows >= length``.

    Drawn on the CPU in ``O(rows)`` (``generator`` is a CPU generator; the same generator state
    gives the same positions) and moved to ``device`` without waiting. The draws are torch's
    (one ``rand`` for the pairs, a ``randperm`` for a stratum of another count), turned into
    positions by a few NumPy operations over every pair at once (host numbers: a torch
    operation's dispatch costs more than the arithmetic). Positions drawn here are known to
    follow the design (:func:`row_design` then skips its check) while they are unchanged.
    """
    if rows >= length:
        idx = torch.arange(length)
    else:
        first, size, others = _strata(length, rows)
        parts: List[np.ndarray] = []
        if first.shape[0]:  # two distinct uniform positions per stratum: a of m, then b of the other m - 1
            u = torch.rand(first.shape[0], 2, generator=generator, dtype=torch.float64).numpy()
            a = np.floor(u[:, 0] * size)
            b = np.floor(u[:, 1] * (size - 1))
            b += b >= a
            parts += (np.minimum(a, b) + first, np.maximum(a, b) + first)
        for start, count, n in others:  # the head (whole), or 1 or 3 draws
            if n == count:
                parts.append(np.arange(start, start + count, dtype=np.float64))
            else:
                parts.append(torch.randperm(count, generator=generator)[:n].numpy() + float(start))
        idx = torch.from_numpy(np.sort(np.concatenate(parts)).astype(np.int64))
        _DRAWN[id(idx)] = (weakref.ref(idx), length, idx._version)
        while len(_DRAWN) > _MAX_DRAWN:
            _DRAWN.popitem(last=False)
    return idx.to(device, non_blocking=True) if device is not None else idx


# The latest positions drawn by sample_rows, by id: (the tensor, weakly; length; its version
# when drawn). row_design trusts an entry whose tensor is the one asked about and unchanged.
_DRAWN: "OrderedDict[int, Tuple[weakref.ref, int, int]]" = OrderedDict()
_MAX_DRAWN = 64


@functools.lru_cache(maxsize=64)
def _strata(length: int, rows: int) -> Tuple[np.ndarray, np.ndarray, Tuple[Tuple[int, int, int], ...]]:
    """The design's strata: the first position and size (float64) of each stratum drawing two, in
    order, and ``(first, size, draws)`` of the others (the head, a stratum of one or three).
    Cached: callers must not change the tensors."""
    sizes, drawn = strata_sizes(length, rows)
    starts = (torch.cumsum(sizes, 0) - sizes).tolist()
    pairs, others = [], []
    for first, size, n in zip(starts, sizes.tolist(), drawn.tolist()):
        (pairs.append((first, size)) if n == 2 else others.append((first, size, n)))
    table = np.array(pairs, dtype=np.float64).reshape(-1, 2)
    return table[:, 0].copy(), table[:, 1].copy(), tuple(others)


def row_design(positions: Union[Tensor, int], length: int) -> Design:
    """``(weight, stratum, L_h, n_h)`` of sorted ``positions`` drawn by :func:`sample_rows`:
    per position its weight ``L_h/n_h`` (float64) and stratum index; per stratum its size and
    draw count. All on the CPU (``positions`` are host positions). An int ``N`` stands for
    ``N`` positions drawn by the design (sorted, they fall ``n_h`` to a stratum in order).

    Positions not drawn by the design (other counts per stratum, as an arbitrary subset may
    have) are treated as one uniform sample of ``N`` (weight ``L/N``)."""
    if isinstance(positions, int):
        return _drawn_design(positions, length)
    n = positions.shape[0]
    drawn_here = _DRAWN.get(id(positions))
    if drawn_here is not None and drawn_here[0]() is positions and drawn_here[1:] == (length, positions._version):
        return _drawn_design(n, length)  # drawn by sample_rows and unchanged
    sizes, drawn = strata_sizes(length, max(1, n))
    stratum = torch.searchsorted(torch.cumsum(sizes, 0), positions.cpu(), right=True)
    if torch.equal(torch.bincount(stratum, minlength=sizes.shape[0]), drawn):
        return _drawn_design(n, length)  # sorted, n_h to a stratum in order: the same design
    sizes, drawn = torch.tensor([length]), torch.tensor([n])
    stratum = torch.zeros(n, dtype=torch.int64)
    weight = sizes.double()[stratum] / drawn.double()[stratum]
    return weight, stratum, sizes, drawn


@functools.lru_cache(maxsize=64)
def _drawn_design(rows: int, length: int) -> Design:
    """:func:`row_design` of ``rows`` positions drawn by the design (sorted, they fall ``n_h`` to a
    stratum in order): a function of ``(L, N)`` alone, cached (the plan of every sampled call
    asks for it; callers must not change the tensors)."""
    sizes, drawn = strata_sizes(length, max(1, rows))
    stratum = torch.repeat_interleave(torch.arange(sizes.shape[0]), drawn)
    return sizes.double()[stratum] / drawn.double()[stratum], stratum, sizes, drawn


# Per (stratum, L_h, n_h, device, dtype): the design's constants of the variance estimate, most
# recent last; an entry holds its tensors, so their ids are not reused while it lives.
_TERMS: "OrderedDict[tuple, tuple]" = OrderedDict()
_MAX_TERMS = 64


def _variance_terms(stratum: Tensor, sizes: Tensor, drawn: Tensor, device: torch.device,
                    dtype: torch.dtype) -> tuple:
    """``(stratum, n_h, factor, whole, pairs)`` on ``device``: ``factor_h = L_h² (1 − n_h/L_h) / n_h
    / (n_h − 1)`` (NaN for a stratum of one draw that is not the whole stratum), ``whole`` the
    strata drawn whole (exact: 0), and ``pairs = (first column, count, factor_h / 2)`` when the
    columns are strata drawn whole and then strata of two draws each, in order (the design's
    usual layout, :func:`sample_rows`), else ``None``. Built once per design (the cached designs
    of :func:`_drawn_design` come back every call)."""
    key = (id(stratum), id(sizes), id(drawn), device, dtype)
    hit = _TERMS.get(key)
    if hit is not None and hit[0] is stratum and hit[1] is sizes and hit[2] is drawn:
        _TERMS.move_to_end(key)
        return hit[3:]
    L_h, n_h = sizes.to(dtype), drawn.to(dtype)
    factor = torch.where(n_h > 1, L_h.square() * (1 - n_h / L_h) / n_h / (n_h - 1).clamp(min=1), math.nan)
    terms = tuple(t.to(device) for t in (stratum, n_h, factor, n_h >= L_h))
    _TERMS[key] = (stratum, sizes, drawn) + terms + (_pairs(stratum, sizes, drawn, factor, device),)
    while len(_TERMS) > _MAX_TERMS:
        _TERMS.popitem(last=False)
    return _TERMS[key][3:]


def _pairs(stratum: Tensor, sizes: Tensor, drawn: Tensor, factor: Tensor, device: torch.device
           ) -> Optional[Tuple[int, int, Tensor]]:
    """:func:`_variance_terms`' ``pairs``, or ``None``."""
    counts, lengths = drawn.tolist(), sizes.tolist()
    head = 0
    while head < len(counts) and counts[head] >= lengths[head]:
        head += 1
    rest = counts[head:]
    if not rest or any(n != 2 or size <= 2 for n, size in zip(rest, lengths[head:])):
        return None
    order = torch.repeat_interleave(torch.arange(len(counts)), drawn)
    if not torch.equal(stratum.cpu(), order):
        return None
    return sum(counts[:head]), len(rest), (factor[head:] / 2).to(device)


def stratified_variance(y: Tensor, stratum: Tensor, sizes: Tensor, drawn: Tensor) -> Tensor:
    """The estimated variance of the stratified total of ``y`` ``(H, N)`` (one column per sampled
    position): ``Σ_h L_h² (1 − n_h/L_h) / n_h · s_h²``, per row of ``y``. NaN where a stratum has
    one draw (``rows=1``: one row estimates the total, not its spread, and 0 would read as
    exact). ``stratum``, ``sizes``, ``drawn`` from :func:`row_design`."""
    dev = y.device
    g, n_h, factor, whole, pairs = _variance_terms(stratum, sizes, drawn, dev, y.dtype)
    if pairs is not None:  # strata of two draws: s_h² (n_h − 1) = (y_a − y_b)² / 2, strata drawn whole 0
        first, count, half = pairs
        two = y[:, first : first + 2 * count].unflatten(1, (count, 2))
        return ((two[..., 0] - two[..., 1]).square() * half).sum(-1)
    heads, count = y.shape[0], sizes.shape[0]
    mean = torch.zeros(heads, count, dtype=y.dtype, device=dev).index_add_(1, g, y) / n_h
    ss = torch.zeros(heads, count, dtype=y.dtype, device=dev).index_add_(1, g, (y - mean[:, g]).square())
    return torch.where(whole, 0.0, factor * ss).sum(-1)  # a whole stratum: exact
