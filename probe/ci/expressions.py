"""Threshold expressions: ``[SITE_GLOB:]METRIC[@SCALE] OP VALUE``, parsed into :class:`Threshold`.

A leaf module (it imports no other part of probe but the metric names and errors), so that the
checks (:mod:`probe.ci.thresholds`), the config files and ``probe.watch``'s scale-name validation
share one grammar. Public names are re-exported by :mod:`probe.ci.thresholds`.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

from probe.errors import ProbeError
from probe.metrics import METRIC_ORDER

__all__ = ["DEFAULT_THRESHOLDS", "SCALE_NAME", "Threshold", "ThresholdLike", "as_thresholds", "parse_threshold"]

#: Used when no threshold is given: the QK-Clip max-logit limit τ = 100 (Kimi K2,
#: Megatron-LM) and no NaN/Inf among the logits or probabilities.
DEFAULT_THRESHOLDS: Tuple[str, ...] = ("logit_max < 100", "nonfinite <= 0")

OPS: Dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: What a scale name may be: thresholds address it as ``METRIC@SCALE``.
SCALE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")

ThresholdLike = Union[str, "Threshold"]


def _err(text: str, pos: int, message: str) -> ProbeError:
    caret = " " * pos + "^"
    return ProbeError(f"bad threshold {text!r} at position {pos}: {message}\n  {text}\n  {caret}")


@dataclass(frozen=True)
class Threshold:
    """One parsed expression: heads of sites matching ``site`` must have ``metric@scale OP limit``."""

    metric: str
    op: str
    limit: float
    scale: str = "actual"
    site: Optional[str] = None  # a glob; None means every site
    text: str = ""

    def holds(self, value: float) -> bool:
        """``value OP limit``; False for NaN (comparisons with NaN are all false)."""
        return OPS[self.op](value, self.limit)

    def __str__(self) -> str:
        return self.text or (
            f"{self.site + ':' if self.site else ''}{self.metric}@{self.scale} {self.op} {self.limit:g}"
        )


def _find_operator(text: str) -> int:
    """Index of the first operator character outside ``[...]`` (a glob's ``[!0]`` is not ``!=``)."""
    inside = False
    for j, c in enumerate(text):
        if c == "[":
            inside = True
        elif c == "]":
            inside = False
        elif c in "<>=!" and not inside:
            return j
    return -1


def _unclosed_bracket(text: str) -> int:
    """Index of a ``[`` with no ``]`` after it, or -1."""
    opened = -1
    for j, c in enumerate(text):
        if c == "[" and opened < 0:
            opened = j
        elif c == "]":
            opened = -1
    return opened


def parse_threshold(text: str) -> Threshold:
    """Parse ``[SITE_GLOB:]METRIC[@SCALE] OP VALUE`` (OP one of ``< <= > >=``).

    Site globs use :func:`fnmatch.fnmatchcase` (``*`` also matches dots); the scale defaults to
    ``actual``; the value is a finite float (a NaN limit would make every comparison false).

    Raises:
        ProbeError: naming the 0-based position of the problem, e.g. an unknown metric, a missing
            or unsupported operator (``==``, ``!=``, ``=<``) or a value that is not a number.
    """
    if isinstance(text, (bytes, bytearray)):
        raise ProbeError(f"expected a threshold expression string, got bytes {bytes(text)!r} (decode it first)")
    if not isinstance(text, str):
        raise ProbeError(f"expected a threshold expression string, got {type(text).__name__} {text!r}")
    if not text.strip():
        raise _err(text, 0, "empty expression, expected METRIC OP VALUE such as 'logit_max < 100'")
    i = _find_operator(text)
    if i < 0:
        bracket = _unclosed_bracket(text)
        if bracket >= 0:
            raise _err(text, bracket, "'[' is never closed by ']' (a site glob's character class, e.g. "
                                      "'layers.[0-3]:logit_max < 100')")
        raise _err(text, len(text), "expected an operator (one of < <= > >=)")
    if text[i] in "=!":
        raise _err(text, i, f"unsupported operator starting with {text[i]!r}, expected one of < <= > >=")
    op = text[i] + "=" if text[i + 1: i + 2] == "=" else text[i]
    after = i + len(op)
    if text[after: after + 1] in ("<", ">", "=", "!"):
        raise _err(text, after, f"unsupported operator {text[i: after + 1]!r}, expected one of < <= > >=")

    # the value
    rest = text[after:]
    vpos = after + len(rest) - len(rest.lstrip())
    token = rest.strip()
    if not token:
        raise _err(text, vpos, "expected a number after the operator")
    if any(c.isspace() for c in token):
        raise _err(text, vpos + token.index(next(c for c in token if c.isspace())), "unexpected text after the number")
    try:
        limit = float(token)
    except ValueError:
        raise _err(text, vpos, f"expected a number, got {token!r}") from None
    if not math.isfinite(limit):
        raise _err(text, vpos, f"expected a finite number, got {token!r}")

    # the left side: [SITE_GLOB:]METRIC[@SCALE]
    left = text[:i]
    site: Optional[str] = None
    start = 0
    if ":" in left:
        colon = left.rindex(":")
        glob = left[:colon].strip()
        if not glob:
            raise _err(text, colon, "empty site glob before ':'")
        site, start = glob, colon + 1
    while start < len(left) and left[start].isspace():
        start += 1
    end = len(left.rstrip())
    target = left[start:end]
    if not target:
        raise _err(text, start, "expected a metric name before the operator")
    metric_text, at, scale_text = target.partition("@")
    m = _NAME.match(metric_text)
    if m is None or m.end() != len(metric_text):
        pos = start + (m.end() if m else 0)
        raise _err(text, pos, f"expected a metric name, got {metric_text!r}")
    if metric_text not in METRIC_ORDER:
        raise _err(text, start, f"unknown metric {metric_text!r}; known metrics: {', '.join(METRIC_ORDER)}")
    scale = "actual"
    if at:
        spos = start + len(metric_text) + 1
        s = SCALE_NAME.match(scale_text)
        if s is None or s.end() != len(scale_text):
            raise _err(text, spos + (s.end() if s else 0), f"expected a scale name after '@', got {scale_text!r}")
        scale = scale_text
    return Threshold(metric=metric_text, op=op, limit=limit, scale=scale, site=site, text=text.strip())


def as_thresholds(thresholds: Union[None, ThresholdLike, Iterable[ThresholdLike]]) -> List[Threshold]:
    """Parsed thresholds: None gives :data:`DEFAULT_THRESHOLDS`; a string is one expression; an
    empty list is an error (a check with no limit would pass vacuously)."""
    if thresholds is None:
        return [parse_threshold(t) for t in DEFAULT_THRESHOLDS]
    if isinstance(thresholds, (bytes, bytearray)):
        raise ProbeError(f"expected `thresholds` to be an expression string, got bytes {bytes(thresholds)!r} "
                         "(decode it first)")
    if isinstance(thresholds, (str, Threshold)):
        thresholds = [thresholds]
    try:
        items = list(thresholds)
    except TypeError:
        raise ProbeError(
            f"expected `thresholds` to be an expression, a list of expressions or None, got {type(thresholds).__name__}"
        ) from None
    if not items:
        raise ProbeError("expected `thresholds` to hold at least one expression, got an empty list "
                         "(pass None for the defaults: " + ", ".join(DEFAULT_THRESHOLDS) + ")")
    return [t if isinstance(t, Threshold) else parse_threshold(t) for t in items]
