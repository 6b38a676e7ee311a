"""Reused flat buffers for the chunks of one call (and, on CPUs, the next call of the thread).

A fresh chunk-sized tensor per operation costs page faults on CPUs (measured: 7 of 17 ms of a
T5-shaped call on the general path); the same chunk shapes come back every layer and step.
"""

from __future__ import annotations

import math
import threading
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["KEEP_BYTES", "KEPT_PATHS", "KEPT_POOL_BYTES", "Scratch", "call_scratch", "drop_kept", "give_back", "kept_buffer",
           "release", "take_scratch"]


class Scratch:
    """Flat buffers of one call, reused by every chunk. ``size`` is the widest chunk's
    ``B·H·rows·S``. :func:`take_scratch` keeps them for the thread's next call."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self.keep = False  # handed back to the thread by release() (set by take_scratch)
        self._buffers: Dict[str, Tensor] = {}
        self._views: Dict[tuple, Tensor] = {}  # (name, shape, dtype) -> its view, while the buffer lasts

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> Tensor:
        """A ``shape`` view of the buffer ``name`` (contents undefined)."""
        key = (name, tuple(shape), dtype)
        view = self._views.get(key)
        if view is not None:  # the same chunk shape again (every chunk of a call asks): no slice, no view
            return view
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(max(n, self.size), dtype=dtype, device=self.device)
            self._views = {k: v for k, v in self._views.items() if k[0] != name}  # views of the old one
        if len(self._views) >= 64:  # a thread's kept buffers meet many shapes over time
            self._views.clear()
        view = self._views[key] = buf[:n].view(key[1])
        return view


#: Bytes of buffers a thread keeps between calls on CPUs (:func:`take_scratch`).
KEEP_BYTES = 16 * 2**20

_KEPT = threading.local()


def take_scratch(size: int, device: torch.device) -> Scratch:
    """The buffers of one call: on CPUs the calling thread's, kept from its previous call while
    they total at most :data:`KEEP_BYTES` (fresh ones cost their page faults every call, measured
    2.5 of 6.8 ms forward and 2.4 of 5.0 ms backward on a T5-shaped call); elsewhere (the caching
    allocators of accelerators) new ones. Call :func:`release` when done."""
    if device.type != "cpu":
        return Scratch(size, device)
    kept = getattr(_KEPT, "scratch", None)
    _KEPT.scratch = None  # taken: a nested call (none is expected) would get its own
    if kept is None:
        kept = Scratch(size, device)
    kept.size, kept.keep = size, True
    return kept


#: The paths whose buffers a thread keeps between calls: the general path's (measured: 7 of 17 ms
#: of a T5-shaped call were page faults of fresh buffers). The centred and shifted paths' were
#: measured on the realistic steps kept and not kept (BERT-512: 1.251× and 1.254×; Llama-1024:
#: 1.240× and 1.232×): no difference, so they hold no memory between calls.
KEPT_PATHS = ("general", "logits")


def call_scratch(path: str, size: int, device: torch.device) -> Scratch:
    """The buffers of one call on ``path``: the thread's kept ones for :data:`KEPT_PATHS`
    (:func:`take_scratch`; hand them back with :func:`release`), else new ones."""
    return take_scratch(size, device) if path in KEPT_PATHS else Scratch(size, device)


def release(buffers: Scratch) -> None:
    """Hand a call's buffers back to its thread (CPUs, within :data:`KEEP_BYTES`; only those
    :func:`take_scratch` gave)."""
    if buffers.keep and buffers.device.type == "cpu" and buffers.nbytes() <= KEEP_BYTES:
        _KEPT.scratch = buffers


def kept() -> bool:
    """Whether the calling thread holds buffers for its next call."""
    return getattr(_KEPT, "scratch", None) is not None


def forget() -> None:
    """Drop the calling thread's kept buffers."""
    _KEPT.scratch = None


#: Bytes of memory a backward hands back for the next forward's kept exponentials (CPUs,
#: :func:`kept_buffer`): at most the kept share of the default ``memory_budget``
#: (:data:`probe.session.recorder.KEEP_SHARE` × 64 MiB).
KEPT_POOL_BYTES = 32 * 2**20


class _KeptPool:
    """Flat float32 CPU tensors a backward finished with (:func:`give_back`), reused by the next
    forward's kept exponentials (:func:`kept_buffer`), at most :data:`KEPT_POOL_BYTES` in all.

    What a forward keeps lives from its forward to its backward, so the thread's per-call
    :class:`Scratch` cannot hold it; fresh each call, its megabytes were new memory every step
    (measured inside the real steps, arms alternating: BERT's forward statistics 40.9 → 38.9 ms
    per step and the step 4.5 ms shorter with the memory reused)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: List[Tensor] = []

    def take(self, count: int) -> Optional[Tensor]:
        with self.lock:
            best = None
            for i, t in enumerate(self.free):  # the smallest that fits
                if t.numel() >= count and (best is None or t.numel() < self.free[best].numel()):
                    best = i
            return None if best is None else self.free.pop(best)

    def give(self, flat: Tensor) -> None:
        with self.lock:
            held = sum(t.numel() for t in self.free) * 4
            if held + flat.numel() * 4 <= KEPT_POOL_BYTES and all(t.data_ptr() != flat.data_ptr() for t in self.free):
                self.free.append(flat)


_POOL = _KeptPool()


def kept_buffer(shape: Sequence[int], device: torch.device) -> Tensor:
    """A float32 tensor of ``shape`` (contents undefined) for what a forward keeps for its
    backward: on CPUs memory an earlier backward handed back (:func:`give_back`) when some fits,
    else new; always a view of a flat tensor, which :func:`give_back` returns to the pool."""
    count = math.prod(shape)
    flat = _POOL.take(count) if device.type == "cpu" else None
    if flat is None:
        flat = torch.empty(count, device=device)
    return flat[:count].view(tuple(shape))


def give_back(kept: Tensor) -> None:
    """Hand a :func:`kept_buffer` tensor's memory back for the next forward (CPUs, within
    :data:`KEPT_POOL_BYTES`; the caller no longer reads it)."""
    flat = kept._base if kept._base is not None else kept
    if flat.device.type == "cpu" and flat.dtype == torch.float32 and flat.dim() == 1 and flat.is_contiguous():
        _POOL.give(flat)


def drop_kept() -> None:
    """Release the pooled memory (:func:`kept_buffer`)."""
    with _POOL.lock:
        _POOL.free.clear()
