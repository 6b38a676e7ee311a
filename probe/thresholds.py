"""Stability thresholds: ``[SITE_GLOB:]METRIC[@SCALE] OP VALUE`` expressions, checks, config.

A threshold states a limit every head must respect, e.g. ``logit_max < 100`` (every head of
every site, at the model's actual scale) or ``*.self:entropy@unscaled > 0.01``. :func:`check`
returns the heads that break one; :func:`assert_stable` raises :class:`probe.StabilityError`
with a table of them, worst first. Nothing passes by mistake: a malformed expression, an
unknown metric or scale, a glob matching no site, a metric the summary lacks, an empty summary
or a site with no data for a checked metric is a :class:`probe.ProbeError`, never a pass.

NaN values: for the forward metrics (``logit_var``, ``logit_max``, ``entropy``, ``max_prob``,
``saturation``) a NaN head had nothing to measure (no valid logits, or no row with two valid
keys) and is skipped, unless the site counted non-finite logits for that head (``nonfinite > 0``
at ``actual``): then NaN is a violation of every limit. For ``nonfinite`` and the gradient norms
NaN never means "no data" and is always a violation. A site where every head is NaN for a checked
metric is an error ("no data"), so a limit is never met vacuously.
"""

from __future__ import annotations

import configparser
import fnmatch
import math
import operator
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from probe.errors import ProbeError, StabilityError
from probe.stats.finalize import METRIC_ORDER
from probe.summary import Summary

__all__ = [
    "CONFIG_FILES",
    "CONFIG_SECTION",
    "DEFAULT_THRESHOLDS",
    "Threshold",
    "Violation",
    "as_thresholds",
    "assert_stable",
    "check",
    "evaluate",
    "find_config",
    "format_table",
    "format_value",
    "load_thresholds",
    "parse_threshold",
]

#: Used when no threshold is given: the QK-Clip max-logit limit τ = 100 (Kimi K2,
#: Megatron-LM) and no NaN/Inf among the logits or probabilities.
DEFAULT_THRESHOLDS: Tuple[str, ...] = ("logit_max < 100", "nonfinite <= 0")

#: Files searched for the probe section, in this order in each directory (pytest's order).
CONFIG_FILES: Tuple[str, ...] = ("pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
CONFIG_SECTION = "tool:probe"

#: Metrics that finalize reports as NaN when a head had nothing to measure.
NAN_MEANS_NO_DATA = frozenset({"logit_var", "logit_max", "entropy", "max_prob", "saturation"})

_OPS: Dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SCALE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")

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
        return _OPS[self.op](value, self.limit)

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


def parse_threshold(text: str) -> Threshold:
    """Parse ``[SITE_GLOB:]METRIC[@SCALE] OP VALUE`` (OP one of ``< <= > >=``).

    Site globs use :func:`fnmatch.fnmatchcase` (``*`` also matches dots); the scale defaults to
    ``actual``; the value is a finite float (a NaN limit would make every comparison false).

    Raises:
        ProbeError: naming the 0-based position of the problem, e.g. an unknown metric, a missing
            or unsupported operator (``==``, ``!=``, ``=<``) or a value that is not a number.
    """
    if not isinstance(text, str):
        raise ProbeError(f"expected a threshold expression string, got {type(text).__name__}")
    if not text.strip():
        raise _err(text, 0, "empty expression, expected METRIC OP VALUE such as 'logit_max < 100'")
    i = _find_operator(text)
    if i < 0:
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
        s = _SCALE.match(scale_text)
        if s is None or s.end() != len(scale_text):
            raise _err(text, spos + (s.end() if s else 0), f"expected a scale name after '@', got {scale_text!r}")
        scale = scale_text
    return Threshold(metric=metric_text, op=op, limit=limit, scale=scale, site=site, text=text.strip())


def as_thresholds(thresholds: Union[None, ThresholdLike, Iterable[ThresholdLike]]) -> List[Threshold]:
    """Parsed thresholds: None gives :data:`DEFAULT_THRESHOLDS`; a string is one expression; an
    empty list is an error (a check with no limit would pass vacuously)."""
    if thresholds is None:
        return [parse_threshold(t) for t in DEFAULT_THRESHOLDS]
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


@dataclass(frozen=True)
class Violation:
    """One head that breaks one threshold: ``value OP limit`` does not hold.

    ``head`` indexes query heads, kv heads for ``grad_k`` / ``grad_v`` under GQA, and is None when
    the value is a head aggregate (TensorBoard scalars without per-head tags); ``value`` is NaN
    when the head had non-finite values. :func:`evaluate` also returns passing heads in this
    form (``ok`` True, ``excess`` the negative margin).
    """

    site: str
    head: Optional[int]
    metric: str
    scale: str
    value: float
    op: str
    limit: float
    threshold: str = ""

    @property
    def excess(self) -> float:
        """How far beyond the limit, relative to ``|limit|`` (absolute for a zero limit); +inf for
        NaN. Negative when the limit holds: a margin."""
        if math.isnan(self.value):
            return math.inf
        gap = self.value - self.limit if self.op in ("<", "<=") else self.limit - self.value
        return gap / (abs(self.limit) if self.limit != 0 else 1.0)

    @property
    def ok(self) -> bool:
        return _OPS[self.op](self.value, self.limit)

    def to_dict(self) -> Dict[str, object]:
        return {
            "site": self.site, "head": self.head, "metric": self.metric, "scale": self.scale,
            "value": None if math.isnan(self.value) else self.value, "op": self.op, "limit": self.limit,
            "threshold": self.threshold, "excess": None if math.isnan(self.value) else self.excess,
        }


def _matching_sites(summary: Summary, t: Threshold) -> List[str]:
    if t.site is None:
        return summary.sites
    sites = [s for s in summary.sites if fnmatch.fnmatchcase(s, t.site)]
    if not sites:
        raise ProbeError(f"threshold {str(t)!r}: site glob {t.site!r} matches no site; sites: {', '.join(summary.sites)}")
    return sites


def _nonfinite_heads(summary: Summary, site: str) -> Optional[np.ndarray]:
    if "nonfinite" not in summary.metrics(site) or "actual" not in summary.scales(site, "nonfinite"):
        return None
    return summary.value(site, "nonfinite", "actual") > 0


def evaluate(
    summary: Summary, thresholds: Union[None, ThresholdLike, Iterable[ThresholdLike]] = None
) -> List[Violation]:
    """Every (threshold, site, head) judged, as :class:`Violation` records whose ``ok`` tells
    whether the limit holds (``excess`` is the margin). :func:`check` keeps the failing ones.

    Raises:
        ProbeError: as :func:`check`.
    """
    if not isinstance(summary, Summary):
        raise ProbeError(f"expected `summary` to be a probe.Summary, got {type(summary).__name__}")
    rules = as_thresholds(thresholds)
    if not summary.sites:
        raise ProbeError("the summary is empty: no attention site was probed (was the model run inside "
                         "probe.watch, on a sampled step, and does it call a supported attention?)")
    out: List[Violation] = []
    for t in rules:
        for site in _matching_sites(summary, t):
            try:
                values = summary.value(site, t.metric, t.scale)
            except ProbeError as err:
                raise ProbeError(f"threshold {str(t)!r}: {err}") from err
            aggregated = bool(summary.info(site).get("heads_aggregated", False))
            nan = np.isnan(values)
            if t.metric in NAN_MEANS_NO_DATA:
                bad = _nonfinite_heads(summary, site)
                if bad is None:
                    bad = np.zeros_like(nan)
                elif bad.shape != values.shape:  # e.g. a head-aggregated nonfinite
                    bad = np.broadcast_to(bad.any(), values.shape)
                judged = ~nan | bad
            else:  # grad norms and counts are never NaN for want of data: NaN is a finding
                judged = np.ones_like(nan)
            if not judged.any():
                raise ProbeError(
                    f"threshold {str(t)!r}: site {site!r} has no data for {t.metric}@{t.scale} "
                    f"(every head is NaN: no valid logits, or no row with two valid keys)"
                )
            for h in np.flatnonzero(judged):
                out.append(Violation(site, None if aggregated else int(h), t.metric, t.scale,
                                     float(values[h]), t.op, t.limit, str(t)))
    return out


def check(
    summary: Summary, thresholds: Union[None, ThresholdLike, Iterable[ThresholdLike]] = None
) -> List[Violation]:
    """The heads that break a threshold, worst first (largest relative excess; NaN first).

    Args:
        summary: a :class:`probe.Summary` (``p.summary()`` or ``probe.Summary.load(path)``).
        thresholds: expressions or :class:`Threshold` objects; None means
            :data:`DEFAULT_THRESHOLDS`. An empty list is an error, not a vacuous pass.

    Returns:
        One :class:`Violation` per (threshold, site, head) where ``value OP limit`` fails.

    Raises:
        ProbeError: a malformed expression, an unknown metric or scale, a glob that matches no
            site, a metric the summary lacks (grad metrics of an inference-only run), an empty
            summary, or a site whose heads are all NaN for a checked metric.

    Example:
        >>> probe.check(p.summary(), ["logit_max < 50", "*.self:entropy@unscaled > 0.01"])
        [Violation(site='layers.0', head=2, metric='logit_max', scale='actual', value=61.2, ...)]
    """
    failed = [v for v in evaluate(summary, thresholds) if not v.ok]
    return sorted(failed, key=lambda v: -v.excess)


def format_value(x: float) -> str:
    """6 significant digits, ``nan`` for NaN."""
    return "nan" if math.isnan(x) else f"{x:.6g}"


def format_table(violations: Sequence[Violation]) -> str:
    """A plain-text table: site, head, metric@scale, value, limit, threshold."""
    header = ("site", "head", "metric@scale", "value", "limit", "threshold")
    rows = [header] + [
        (v.site, "agg" if v.head is None else str(v.head), f"{v.metric}@{v.scale}", format_value(v.value),
         f"{v.op} {v.limit:g}", v.threshold)
        for v in violations
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def assert_stable(summary: Summary, *thresholds: ThresholdLike) -> None:
    """Raise :class:`probe.StabilityError` (an ``AssertionError``) if any head breaks a threshold.

    With no thresholds, :data:`DEFAULT_THRESHOLDS` apply. The message is a table of every
    violation, worst first, naming site, head, metric, scale, value and limit.

    Example:
        >>> probe.assert_stable(p.summary(), "logit_max < 100", "entropy@actual > 0.05")
    """
    violations = check(summary, list(thresholds) if thresholds else None)
    if violations:
        n = len(violations)
        raise StabilityError(
            f"{n} attention stability violation{'s' if n != 1 else ''} (worst first):\n" + format_table(violations)
        )


# -- config ----------------------------------------------------------------------------------------
def find_config(start: Union[None, str, os.PathLike] = None) -> Optional[str]:
    """The first of ``pytest.ini``, ``pyproject.toml``, ``tox.ini``, ``setup.cfg`` holding a probe
    section (``[tool:probe]``; ``[tool.probe]`` in ``pyproject.toml``), searching ``start``
    (default: the current directory) and then each parent, like pytest's rootdir search. Files
    without the section are skipped. None when there is none."""
    here = os.path.abspath(os.fspath(start) if start is not None else os.getcwd())
    if os.path.isfile(here):
        here = os.path.dirname(here)
    while True:
        for name in CONFIG_FILES:
            path = os.path.join(here, name)
            if os.path.isfile(path) and _has_section(path):
                return path
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _toml() -> Any:
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # pragma: no cover - depends on the Python version
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            return None
    return tomllib


def _section_name(path: str) -> str:
    return "[tool.probe]" if path.endswith(".toml") else f"[{CONFIG_SECTION}]"


def _probe_section(path: str) -> Optional[Dict[str, Any]]:
    """The probe section of a config file as a dict; None when the file has none (or is a
    ``pyproject.toml`` on a Python without a TOML reader).

    Raises:
        ProbeError: the file cannot be read or parsed.
    """
    if path.endswith(".toml"):
        toml = _toml()
        if toml is None:
            return None
        try:
            with open(path, "rb") as f:
                data = toml.load(f)
        except (OSError, ValueError) as err:  # TOMLDecodeError is a ValueError
            raise ProbeError(f"cannot read config file {path!r}: {err}") from err
        tool = data.get("tool")
        section = tool.get("probe") if isinstance(tool, dict) else None
        return section if isinstance(section, dict) else None
    parser = configparser.ConfigParser(interpolation=None)
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f, source=path)
    except (OSError, UnicodeDecodeError, configparser.Error) as err:
        raise ProbeError(f"cannot read config file {path!r}: {err}") from err
    return dict(parser.items(CONFIG_SECTION)) if parser.has_section(CONFIG_SECTION) else None


def _has_section(path: str) -> bool:
    try:
        return _probe_section(path) is not None
    except ProbeError:
        return False  # an unrelated, unparsable file does not stop the search


def load_thresholds(
    path: Union[None, str, os.PathLike] = None, start: Union[None, str, os.PathLike] = None
) -> Tuple[List[Threshold], Optional[str]]:
    """Thresholds from the ``thresholds`` key of the probe section and the file they came from.

    In ``pytest.ini`` / ``tox.ini`` / ``setup.cfg`` the key holds one expression a line (lines
    starting with ``#`` or ``;`` are comments); in ``pyproject.toml`` it is a list of strings::

        [tool:probe]                        [tool.probe]
        thresholds =                        thresholds = ["logit_max < 100", "nonfinite <= 0"]
            logit_max < 100
            nonfinite <= 0

    Args:
        path: a config file to read (it must have the section); None searches upward from
            ``start`` with :func:`find_config`.
        start: where the search begins (default: the current directory).

    Returns:
        ``(thresholds, path)``; the defaults and ``None`` when no config file is found, the
        defaults and the path when the section has no ``thresholds`` key.

    Raises:
        ProbeError: an unreadable file, a missing section in an explicit ``path``, an empty or
            mistyped ``thresholds`` value, or a malformed expression (naming the file).
    """
    if path is None:
        found = find_config(start)
        if found is None:
            return as_thresholds(None), None
        path = found
    path = os.fspath(path)
    section = _probe_section(path)
    where = f"config file {path!r}"
    if section is None:
        raise ProbeError(f"{where} has no {_section_name(path)} section")
    if "thresholds" not in section:
        return as_thresholds(None), path
    raw = section["thresholds"]
    if isinstance(raw, str):
        raw = raw.splitlines()
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise ProbeError(f"{where}: expected {_section_name(path)} thresholds to be a list of strings, "
                         f"got {type(raw).__name__}")
    lines = [ln.strip() for ln in raw]
    lines = [ln for ln in lines if ln and not ln.startswith(("#", ";"))]
    if not lines:
        raise ProbeError(f"{where}: expected {_section_name(path)} thresholds to list at least one "
                         "expression, got an empty value")
    try:
        return [parse_threshold(ln) for ln in lines], path
    except ProbeError as err:
        raise ProbeError(f"{where}: {err}") from err
