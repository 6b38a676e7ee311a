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
import difflib
import fnmatch
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from probe.errors import ProbeError, StabilityError
from probe.files import read_regular_file
from probe.names import printable
from probe.summary import Summary, format_estimate, json_number
from probe.ci.expressions import DEFAULT_THRESHOLDS, Threshold, ThresholdLike, as_thresholds, parse_threshold
from probe.ci.expressions import OPS

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

#: Files searched for the probe section, in this order in each directory (pytest's order).
CONFIG_FILES: Tuple[str, ...] = ("pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
CONFIG_SECTION = "tool:probe"
#: The keys the probe section may hold.
CONFIG_KEYS: Tuple[str, ...] = ("thresholds",)

#: Metrics that finalize reports as NaN when a head had nothing to measure.
NAN_MEANS_NO_DATA = frozenset({"logit_var", "logit_max", "entropy", "max_prob", "saturation"})


@dataclass(frozen=True)
class Violation:
    """One head that breaks one threshold: ``value OP limit`` does not hold.

    ``head`` indexes query heads, kv heads for ``grad_k`` / ``grad_v`` under GQA, and is None when
    the value is a head aggregate (TensorBoard scalars without per-head tags); ``value`` is NaN
    when the head had non-finite values. :func:`evaluate` also returns passing heads in this
    form (``ok`` True, ``excess`` the negative margin). ``se`` is the value's standard error when
    it is an estimate from sampled query rows (``rows=``), ``estimate`` then says from how many
    (``"est., 128 of 1024 rows"``); both ``None`` for an exact value.
    """

    site: str
    head: Optional[int]
    metric: str
    scale: str
    value: float
    op: str
    limit: float
    threshold: str = ""
    se: Optional[float] = None
    estimate: Optional[str] = None

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
        return OPS[self.op](self.value, self.limit)

    def to_dict(self) -> Dict[str, object]:
        """Strict JSON, encoded as in ``probe_summary.json``: NaN is ``null``, ±inf ``"inf"`` /
        ``"-inf"``."""
        out = {
            "site": self.site, "head": self.head, "metric": self.metric, "scale": self.scale,
            "value": json_number(self.value), "op": self.op, "limit": self.limit,
            "threshold": self.threshold, "excess": None if math.isnan(self.value) else json_number(self.excess),
        }
        if self.se is not None:
            out.update(se=json_number(self.se), estimate=self.estimate)
        return out


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
            se = summary.standard_error(site, t.metric, t.scale)
            note = summary.estimate_note(site) if se is not None else None
            for h in np.flatnonzero(judged):
                out.append(Violation(site, None if aggregated else int(h), t.metric, t.scale,
                                     float(values[h]), t.op, t.limit, str(t),
                                     None if se is None else float(se[h]), note))
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
    """A plain-text table: site, head, metric@scale, value, limit, threshold. An estimate's value
    reads ``0.812 ± 0.004 (est., 128 of 1024 rows)`` (:func:`probe.summary.format_estimate`)."""
    header = ("site", "head", "metric@scale", "value", "limit", "threshold")
    rows = [header] + [
        (printable(v.site), "agg" if v.head is None else str(v.head), f"{v.metric}@{v.scale}",
         format_value(v.value) if v.se is None else format_estimate(v.value, v.se, v.estimate, 6),
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
    without the section are skipped; a candidate file that cannot be parsed is an error (it may
    hold the section: skipping it would let the defaults pass a check silently). None when there
    is none.

    Raises:
        ProbeError: a candidate file cannot be read or parsed, naming it.
    """
    return _find_section(start)[0]


def _find_section(start: Union[None, str, os.PathLike]) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    here = os.path.abspath(os.fspath(start) if start is not None else os.getcwd())
    if os.path.isfile(here):
        here = os.path.dirname(here)
    while True:
        for name in CONFIG_FILES:
            path = os.path.join(here, name)
            if os.path.isfile(path):
                section = _probe_section(path)
                if section is not None:
                    return path, section
        parent = os.path.dirname(here)
        if parent == here:
            return None, None
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
    raw = read_regular_file(path, "config file", 16 << 20)
    if path.endswith(".toml"):
        toml = _toml()
        if toml is None:
            return None
        try:
            data = toml.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ProbeError(f"cannot read config file {path!r}: not UTF-8 text ({err.reason} at byte {err.start})") from err
        except ValueError as err:  # TOMLDecodeError is a ValueError
            raise ProbeError(f"cannot read config file {path!r}: it does not parse: {err}") from err
        tool = data.get("tool")
        section = tool.get("probe") if isinstance(tool, dict) else None
        if section is not None and not isinstance(section, dict):
            raise ProbeError(f"config file {path!r}: expected [tool.probe] to be a table, got {type(section).__name__}")
        return _checked_keys(section, path)
    # no DEFAULT section: its keys would leak into [tool:probe]
    parser = configparser.ConfigParser(interpolation=None, default_section="\0no default section")
    try:
        parser.read_string(raw.decode("utf-8"), source=path)
    except UnicodeDecodeError as err:
        raise ProbeError(f"cannot read config file {path!r}: not UTF-8 text ({err.reason} at byte {err.start})") from err
    except configparser.Error as err:  # duplicate section or key, a line outside a section, a missing ']'
        raise ProbeError(f"cannot read config file {path!r}: it does not parse: {err}") from err
    return _checked_keys(dict(parser.items(CONFIG_SECTION)) if parser.has_section(CONFIG_SECTION) else None, path)


def _checked_keys(section: Optional[Dict[str, Any]], path: str) -> Optional[Dict[str, Any]]:
    """``section``, after a warning for each key probe does not know (a typo such as
    ``threshold =`` must not pass unnoticed while the defaults apply)."""
    for key in section or ():
        if key not in CONFIG_KEYS:
            close = difflib.get_close_matches(key, CONFIG_KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            warnings.warn(f"probe: unknown key {key!r} in {_section_name(path)} of {path!r} is ignored "
                          f"(known keys: {', '.join(CONFIG_KEYS)}){hint}", UserWarning, stacklevel=4)
    return section


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
        found, section = _find_section(start)
        if found is None:
            return as_thresholds(None), None
        path = found
    else:
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
