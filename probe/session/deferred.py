"""The forward statistics' finishing of a forward's calls, run once at its end.

A call's per-row statistics (:func:`probe.stats.forward.forward_rows`) are computed when the call
runs: they read its tensors, which the model may change or free afterwards. What turns rows into
accumulator fields (the reducer, :func:`probe.stats.forward.finish_fields`) reads only those
rows, and runs here for every deferred call of the forward at once, stacked on the head dimension
where calls reduce alike (every layer of a model, typically). Run between the model's operations,
each call's finishing paid for caches the model had just filled with its own tensors; run back
to back it does not (docs/performance.md, "Seventh round").

The deferred rows are ``O(B·H·L)`` per call; calls whose rows would take the deferred total past
its budget are finished at once, as are the calls of a forward that QK-Clip reads (it needs each
call's max logit as the call returns).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import Tensor

from probe.call import AttentionCall
from probe.state.accumulator import Accumulator
from probe.stats.forward import finish_fields
from probe.stats.plan import CallPlan
from probe.stats.rows import Rows

__all__ = ["Deferred", "add_or_name", "scale_field"]


def scale_field(scale: Tensor, heads: int, rows: Tensor) -> Tensor:
    """The ``scale`` field of a call with a per-head scale tensor: its value per query head, in
    the dtype of the call's ``rows`` field (finished at once or deferred alike)."""
    return scale.detach().reshape(-1).expand(heads).to(rows.dtype)


class Deferred:
    """Calls whose rows wait for their finishing, within ``budget_bytes`` of rows, and what
    their fields go into (``acc``, at ``saturation``; ``failed(site, message)`` names a failure)."""

    def __init__(self, budget_bytes: int, acc: Accumulator, saturation: float,
                 failed: Callable[[str, str], None]) -> None:
        self.budget_bytes, self.acc, self.saturation, self.failed = budget_bytes, acc, saturation, failed
        # (site key, site name, a per-head scale tensor or None, heads, rows, plan): not the record,
        # whose q, k and v a forward without autograd would otherwise free layer by layer
        self.items: List[Tuple[Any, str, Optional[Tensor], int, Rows, CallPlan]] = []
        self.bytes = 0

    def __bool__(self) -> bool:
        return bool(self.items)

    def offer(self, key: Any, call: AttentionCall, scales: Dict[str, Any], rows: Rows, plan: CallPlan) -> bool:
        """Defer the call's finishing if its rows fit in the budget (``False``: finish it now)."""
        size = sum(t.numel() * t.element_size() for t in vars(rows).values() if isinstance(t, Tensor))
        if self.bytes + size > self.budget_bytes:
            return False
        scale = call.scale.detach() if isinstance(call.scale, Tensor) and scales else None
        self.items.append((key, call.site or "", scale, call.heads, rows, plan))
        self.bytes += size
        return True

    def finish(self) -> None:
        """Every deferred call's fields into the accumulator, in the order the calls ran (the
        caller holds the recorder's lock). A finishing that fails names each of its calls, as a
        failing call does."""
        items, self.items, self.bytes = self.items, [], 0
        if not items:
            return
        try:
            fields = finish_fields([(rows, plan) for *_, rows, plan in items], self.saturation)
        except Exception as err:  # noqa: BLE001 - a record probe cannot measure is named, never fatal
            for _, site, *_ in items:
                self.failed(site, f"probe: the attention at site {site!r} is NOT measured: its statistics "
                            f"failed ({type(err).__name__}: {err}); please report the model (probe.coverage(model, "
                            "...) lists the site)")
            return
        for (key, site, scale, heads, _, _), out in zip(items, fields):
            if not out:
                continue
            if scale is not None:
                out["scale"] = scale_field(scale, heads, out["rows"])
            add_or_name(self.acc, key, out, site, self.failed)


def add_or_name(acc: Accumulator, key: Any, fields: Dict[str, Tensor], site: str,
                failed: Callable[[str, str], None]) -> None:
    """``acc.add(key, fields)``, or, when the site's state cannot take them, the call named NOT
    measured (``failed(site, message)``): inside the model's forward nothing of probe raises."""
    try:
        acc.add(key, fields)
    except Exception as err:  # noqa: BLE001 - a record probe cannot measure is named, never fatal
        failed(site, f"probe: the attention at site {site!r} is NOT measured: its statistics could not join the "
               f"site's ({type(err).__name__}: {err}); please report the model")
