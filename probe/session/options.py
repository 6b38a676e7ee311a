"""Validation of :class:`probe.Probe`'s arguments (errors name the argument)."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from probe.errors import ProbeError
from probe.ci.expressions import SCALE_NAME

__all__ = ["BUILTIN_SCALES", "DEFAULT_ROWS", "ExtraScale", "check_audit", "check_every", "check_fraction", "check_int",
           "check_scales", "check_seconds", "check_tau", "output_sinks", "scale_value", "tensorboard_sink"]

#: An extra named scale: a float, or a callable of d_k.
ExtraScale = Union[float, Callable[[int], float]]

#: Scales every metric is reported at (docs/metrics.md).
BUILTIN_SCALES = ("actual", "unscaled", "standard")

#: The default ``rows=`` budget: calls with more query rows estimate their exponential metrics
#: from this many. Chosen by measurement (docs/performance.md, "Sampled rows"): on the benchmark
#: steps, 128 rows cost about what 64 do (fixed costs dominate) and 256 rows 0.1x more per step;
#: the standard error per call is at most 0.02 for entropy and 0.03 for max_prob even on
#: sharp heads, and shrinks as 1/sqrt(calls) over a run.
DEFAULT_ROWS = 128


def check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ProbeError(f"expected `{name}` to be {kind}, got {value!r}")
    return value


def check_tau(name: str, value: Any) -> float:
    """A positive finite threshold (QK-Clip's τ)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(float(value)) and value > 0):
        raise ProbeError(f"expected `{name}` to be a positive finite max logit τ (such as 100.0), got {value!r}")
    return float(value)


def check_every(every: Any, qk_clip: Any) -> Optional[int]:
    """``every``: a positive int; ``None`` (no statistics but QK-Clip's max logits) with ``qk_clip`` only."""
    if every is None and qk_clip is not None:
        return None
    if every is None:
        raise ProbeError("expected `every` to be a positive int, got None (every=None, no statistics, only "
                         "makes sense with qk_clip=)")
    return check_int("every", every, 1)


def check_scales(scales: Optional[Mapping[str, ExtraScale]]) -> Dict[str, ExtraScale]:
    if scales is None:
        return {}
    if not isinstance(scales, Mapping):
        raise ProbeError(
            f"expected `scales` to be a dict of name -> float or callable(d_k) -> float, got {type(scales).__name__}"
        )
    out: Dict[str, ExtraScale] = {}
    for name, value in scales.items():
        if not isinstance(name, str) or not SCALE_NAME.fullmatch(name) or not name.isascii():
            raise ProbeError(
                "expected `scales` names to be ASCII identifiers (letters, digits, '_', '.', '-'; not starting "
                f"with a digit) that thresholds can address as METRIC@NAME, got {name!r}"
            )
        if name in BUILTIN_SCALES:
            raise ProbeError(f"`scales` name {name!r} is built in; choose another name")
        if callable(value):
            scale_value(name, value, 64)  # a callable that fails, fails here, not in the forward
            out[name] = value
        elif isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
            out[name] = float(value)  # np.float32 as well as float
        else:
            raise ProbeError(f"expected `scales[{name!r}]` to be a finite float or a callable(d_k), got {value!r}")
    return out


def scale_value(name: str, fn: Callable[[int], float], d_k: int) -> float:
    """``float(fn(d_k))`` for an extra scale callable, or a ProbeError naming the scale."""
    try:
        value = fn(d_k)
    except Exception as err:  # noqa: BLE001 - reported with the scale's name
        raise ProbeError(f"`scales[{name!r}]`({d_k}) raised {type(err).__name__}: {err}") from err
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ProbeError(f"expected `scales[{name!r}]`(d_k) to return a finite float, got {value!r} for d_k={d_k}")
    return float(value)


def check_fraction(name: str, value: Any) -> float:
    """A float in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ProbeError(f"expected `{name}` to be a float in (0, 1], got {value!r}")
    return float(value)


def check_audit(value: Any) -> Union[bool, str]:
    if not isinstance(value, bool) and value != "quiet":
        raise ProbeError(f"expected `audit` to be True, False or 'quiet', got {value!r}")
    return value


def output_sinks(logdir: Any, per_head: bool, sinks: Sequence[Any], writes: bool) -> Tuple[List[Any], Optional[str]]:
    """The sinks a probe feeds and the directory of its ``probe_summary.json`` (``None``: none):
    TensorBoard in ``logdir`` (validated on every rank) and the user's ``sinks``, on the process
    that ``writes`` only (rank 0 of a group)."""
    from probe.sinks.base import Sink

    for sink in sinks:
        if not isinstance(sink, Sink):
            raise ProbeError(f"expected every sink to have write/flush/close, got {type(sink).__name__}")
    out: List[Any] = []
    path: Optional[str] = None
    if logdir is not None:
        sink, path = tensorboard_sink(logdir, per_head)
        out.append(sink)
    if not writes:
        return [], None
    return out + list(sinks), path


def check_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise ProbeError(f"expected `{name}` to be a positive number of seconds, got {value!r}")
    return float(value)


def tensorboard_sink(logdir: Any, per_head: bool) -> Tuple[Any, Optional[str]]:
    """The TensorBoard sink for ``logdir`` (a path or a ``SummaryWriter``) and the directory
    ``probe_summary.json`` goes to (None for a writer that does not say). A path that holds an
    earlier run is replaced by a fresh one (:func:`probe.ci.runs.fresh_logdir`)."""
    from probe.sinks.tensorboard import TensorBoardSink

    if hasattr(logdir, "add_scalar"):  # an existing SummaryWriter
        return TensorBoardSink(logdir, per_head), (logdir.get_logdir() if hasattr(logdir, "get_logdir") else None)
    if not isinstance(logdir, (str, os.PathLike)):
        raise ProbeError(f"expected `logdir` to be a path or a SummaryWriter, got {type(logdir).__name__}")
    path = os.fspath(logdir)
    if not path:
        raise ProbeError("expected `logdir` to be a directory path, got an empty string "
                         "(use logdir=None to keep the statistics in memory only)")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ProbeError(f"expected `logdir` to be a directory, got a file: {path!r}")
    from probe.ci.runs import fresh_logdir

    path = fresh_logdir(logdir if isinstance(logdir, str) else path)  # an earlier run there: path-2, with a warning
    return TensorBoardSink(path, per_head), path
