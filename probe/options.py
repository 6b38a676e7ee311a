"""Validation of :class:`probe.Probe`'s arguments (errors name the argument)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Optional, Union

from probe.errors import ProbeError

__all__ = ["BUILTIN_SCALES", "ExtraScale", "check_int", "check_scales"]

#: An extra named scale: a float, or a callable of d_k.
ExtraScale = Union[float, Callable[[int], float]]

#: Scales every metric is reported at (docs/metrics.md).
BUILTIN_SCALES = ("actual", "unscaled", "standard")


def check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ProbeError(f"expected `{name}` to be {kind}, got {value!r}")
    return value


def check_scales(scales: Optional[Mapping[str, ExtraScale]]) -> Dict[str, ExtraScale]:
    if scales is None:
        return {}
    if not isinstance(scales, Mapping):
        raise ProbeError(
            f"expected `scales` to be a dict of name -> float or callable(d_k) -> float, got {type(scales).__name__}"
        )
    out: Dict[str, ExtraScale] = {}
    for name, value in scales.items():
        if not isinstance(name, str) or not name or any(c in name for c in "/@ "):
            raise ProbeError(f"expected `scales` names to be non-empty strings without '/', '@' or spaces, got {name!r}")
        if name in BUILTIN_SCALES:
            raise ProbeError(f"`scales` name {name!r} is built in; choose another name")
        if callable(value):
            out[name] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
        else:
            raise ProbeError(f"expected `scales[{name!r}]` to be a finite float or a callable(d_k), got {value!r}")
    return out
