"""Peak tensor memory of a block of code, measured at the dispatcher (CPU tensors included).

``tracemalloc`` does not see torch's CPU allocations and the CPU allocator keeps no statistics,
so :class:`PeakMemory` watches every aten op while it is active: each new output storage is
counted until it is freed (a weak reference to the storage, checked after every op), and the
largest sum is the peak. Factory calls (``empty``, ``ones``, ...) asking for more than ``cap``
bytes are refused before they allocate, so a regression fails the test instead of taking the
machine's memory; the refusals are recorded in ``refused``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
_FACTORIES = {aten.empty.memory_format, aten.empty_strided.default, aten.ones.default, aten.zeros.default,
              aten.full.default, aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
              aten.new_full.default}


def _requested_bytes(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> int:
    size = args[1] if func.__name__.startswith("new_") else args[0]
    dtype = kwargs.get("dtype") or (args[0].dtype if func.__name__.startswith("new_") else torch.get_default_dtype())
    element = torch.empty((), dtype=dtype).element_size()
    return math.prod(int(n) for n in size) * element


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory(cap) as m: ...``; then ``m.peak`` (bytes) and ``m.refused``.

    ``exclude``: tensors made before the block (inputs) whose storages are not counted when an
    op inside returns a view of them (without it, a view counts its whole storage as new)."""

    def __init__(self, cap: int = 256 * 2**20, exclude: Tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.cap = cap
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: Dict[int, Tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        self.refused: List[str] = []

    def _sweep(self) -> None:
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES:
            requested = _requested_bytes(func, args, kwargs)
            if requested > self.cap:
                self.refused.append(f"{func}: {requested} bytes")
                raise MemoryError(f"PeakMemory refused {func} of {requested} bytes (cap {self.cap})")
        out = func(*args, **kwargs)
        self._sweep()  # before adding: a freed storage's address may be reused by the output
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() and key not in self.live and key not in self.excluded:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out
