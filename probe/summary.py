"""Summary: per-site, per-head metrics, aggregated over probed steps, with a JSON round trip.

JSON encoding (``probe.summary/1``): strict JSON (no ``NaN`` / ``Infinity`` tokens, so ``jq``,
browsers and other languages read it). In metric values NaN is ``null`` and ±inf are the strings
``"inf"`` / ``"-inf"``; elsewhere (``info``, ``meta``, where ``null`` means "unknown") a
non-finite float is ``"nan"``, ``"inf"`` or ``"-inf"``. :meth:`Summary.load` turns them back into
floats, so a diverging run round-trips losslessly (docs/guarantees.md).
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Union

import numpy as np

from probe.errors import ProbeError
from probe.files import atomic_write, read_regular_file
from probe.metrics import METRICS

__all__ = ["SCALE_FREE", "SUMMARY_FILE", "Account", "Summary", "compact_values", "format_estimate", "json_number"]

#: Metrics without a scale: reported under ``actual``.
SCALE_FREE = frozenset({"nonfinite", "grad_q", "grad_k", "grad_v", "qk_clip_logit", "qk_clip_factor", "qk_clip_steps"})
#: The reason of a gradient metric that no explanation covers.
_NO_BACKWARD = ("no backward pass reached it on a sampled step (inference, grads=False, or no backward yet)")


class Account(NamedTuple):
    """One value of a site: ``status`` is ``"measured"``, ``"estimated"`` (from sampled query
    rows: ``note`` says how many) or ``"not measured"`` (``note`` says why)."""

    metric: str
    scale: str
    status: str
    note: str = ""

#: The file name a probe writes into its logdir (refreshed as the run goes, final on close).
SUMMARY_FILE = "probe_summary.json"
_FORMAT = "probe.summary/1"
_NONFINITE = {"inf": math.inf, "+inf": math.inf, "-inf": -math.inf, "nan": math.nan}
# A summary is a few MiB at most (100 layers x 64 heads x 10 metrics x 4 scales); refuse to read
# far beyond that, so a wrong path (a dataset, a device) fails fast instead of filling memory.
_MAX_BYTES = 1 << 30


def json_number(v: Any) -> Any:
    """A metric value: a finite float, ``None`` for NaN, ``"inf"`` / ``"-inf"``."""
    if v is None:
        return None
    v = float(v)
    if math.isnan(v):
        return None
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def format_estimate(value: float, se: Optional[float] = None, note: Optional[str] = None, digits: int = 4) -> str:
    """``"0.812"`` for an exact value; ``"0.812 ± 0.004 (est., 128 of 1024 rows)"`` for an
    estimate with standard error ``se`` (:meth:`Summary.standard_error`) and ``note``
    (:meth:`Summary.estimate_note`)."""
    shown = "nan" if math.isnan(value) else f"{value:.{digits}g}"
    if se is None:
        return shown
    return f"{shown} ± {'nan' if math.isnan(se) else f'{se:.2g}'}" + (f" ({note})" if note else "")


def _clean(values: Iterable[float]) -> List[Any]:
    return [json_number(v) for v in values]


def _encode_any(obj: Any) -> Any:
    """info / meta values as strict JSON: numpy scalars as Python ones, non-finite floats as strings."""
    if isinstance(obj, Mapping):
        return {str(k): _encode_any(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode_any(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [_encode_any(v) for v in obj.tolist()]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj


def _decode_any(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _decode_any(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_any(v) for v in obj]
    if isinstance(obj, str) and obj in _NONFINITE:
        return _NONFINITE[obj]
    return obj


def _bad(where: str, got: Any, expected: str) -> ProbeError:
    shown = repr(got)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return ProbeError(f"not a valid probe summary: {where} is {shown} ({type(got).__name__}), expected {expected}")


def _decode_values(where: str, values: Any) -> List[float]:
    if not isinstance(values, list):
        raise _bad(where, values, "a list of per-head numbers")
    out: List[float] = []
    for i, x in enumerate(values):
        if x is None:
            out.append(math.nan)
        elif isinstance(x, str) and x in _NONFINITE:
            out.append(_NONFINITE[x])
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            out.append(float(x))
        else:
            raise _bad(f"{where}[{i}]", x, "a number, null (NaN), \"inf\" or \"-inf\"")
    return out


def _decode_sites(sites: Any) -> Dict[str, Dict[str, Any]]:
    if not isinstance(sites, dict):
        raise _bad('"sites"', sites, "an object of site name -> {info, metrics}")
    out: Dict[str, Dict[str, Any]] = {}
    for name, entry in sites.items():
        where = f"sites[{name!r}]"
        if not isinstance(entry, dict):
            raise _bad(where, entry, 'an object with "info" and "metrics"')
        info = entry.get("info", {})
        if not isinstance(info, dict):
            raise _bad(f"{where}['info']", info, "an object")
        metrics = entry.get("metrics", {})
        if not isinstance(metrics, dict):
            raise _bad(f"{where}['metrics']", metrics, "an object of metric -> scale -> values")
        decoded: Dict[str, Dict[str, List[float]]] = {}
        for metric, by_scale in metrics.items():
            if not isinstance(by_scale, dict):
                raise _bad(f"{where}['metrics'][{metric!r}]", by_scale, "an object of scale -> values")
            decoded[metric] = {
                scale: _decode_values(f"{where}['metrics'][{metric!r}][{scale!r}]", values)
                for scale, values in by_scale.items()
            }
        out[name] = {"info": _decode_any(info), "metrics": decoded}
    return out


def compact_values(values: List[str]) -> str:
    """``metric@scale`` names in few words: a metric listed at every scale that occurs is named
    once (``grad_logits`` for ``grad_logits@actual, grad_logits@unscaled, ...``)."""
    by_metric: Dict[str, List[str]] = {}
    for v in values:
        metric, _, scale = v.partition("@")
        by_metric.setdefault(metric, []).append(scale)
    scales = {s for ss in by_metric.values() for s in ss if s}
    parts = []
    for metric, ss in by_metric.items():
        if not ss[0] or len(scales) <= 1 or set(ss) == scales:
            parts.append(metric if not ss[0] or set(ss) == scales and len(scales) > 1 else f"{metric}@{ss[0]}")
        else:
            parts.append(", ".join(f"{metric}@{x}" for x in ss))
    return ", ".join(parts)


class Summary:
    """Per-head metrics of every attention site, as numpy arrays.

    Example:
        >>> s = p.summary()
        >>> s.sites
        ['encoder.layer.0.attention.self', ...]
        >>> s.value("encoder.layer.0.attention.self", "entropy", "unscaled")
        array([0.12, 0.09, 0.31, 0.05])
    """

    def __init__(
        self,
        sites: Mapping[str, Mapping[str, Any]],
        steps: int = 0,
        meta: Optional[Mapping[str, Any]] = None,
    ) -> None:
        # sites: name -> {"info": {...}, "metrics": {metric: {scale: np.ndarray}}}
        self._sites: Dict[str, Dict[str, Any]] = {}
        for name, entry in sites.items():
            metrics = {
                m: {s: np.asarray(v, dtype=np.float64) for s, v in by_scale.items()}
                for m, by_scale in entry.get("metrics", {}).items()
            }
            self._sites[name] = {"info": dict(entry.get("info", {})), "metrics": metrics}
        self.steps = int(steps)
        self.meta: Dict[str, Any] = dict(meta or {})

    # -- queries -----------------------------------------------------------------------------
    @property
    def sites(self) -> List[str]:
        """Site names in the order they were first seen."""
        return list(self._sites)

    def __len__(self) -> int:
        return len(self._sites)

    def _site(self, site: str) -> Dict[str, Any]:
        try:
            return self._sites[site]
        except KeyError:
            known = ", ".join(self._sites) or "none (nothing was probed)"
            raise ProbeError(f"unknown site {site!r}; sites in this summary: {known}") from None

    def metrics(self, site: str) -> List[str]:
        """The metrics this site has (grad metrics only where a backward pass was seen)."""
        return list(self._site(site)["metrics"])

    def scales(self, site: str, metric: str) -> List[str]:
        """The scales a metric was measured at for this site."""
        return list(self._metric(site, metric))

    def _metric(self, site: str, metric: str) -> Dict[str, np.ndarray]:
        metrics = self._site(site)["metrics"]
        if metric not in metrics:
            hint = ""
            if metric.startswith("grad"):
                hint = " (grad metrics need a backward pass on a sampled step, and grads=True)"
            raise ProbeError(
                f"site {site!r} has no metric {metric!r}{hint}; it has: {', '.join(metrics) or 'none'}"
            )
        return metrics[metric]

    def value(self, site: str, metric: str, scale: str = "actual") -> np.ndarray:
        """Per-head values of ``metric`` at ``scale`` for ``site`` (a copy).

        Raises:
            ProbeError: naming the unknown site, metric or scale and listing the known ones.
        """
        by_scale = self._metric(site, metric)
        if scale not in by_scale:
            raise ProbeError(
                f"metric {metric!r} of site {site!r} has no scale {scale!r}; it has: {', '.join(by_scale)}"
            )
        return by_scale[scale].copy()

    def info(self, site: str) -> Dict[str, Any]:
        """kind, heads, kv_heads, d_k, scale (the actual one), calls, and more where known."""
        return copy.deepcopy(self._site(site)["info"])

    def standard_error(self, site: str, metric: str, scale: str = "actual") -> Optional[np.ndarray]:
        """Per-head standard errors of ``metric`` when its values are estimates from sampled query
        rows (``rows=``: ``entropy``, ``max_prob``, ``saturation``, ``grad_logits`` of calls
        longer than the budget), ``None`` when they are exact.

        Example:
            >>> s.standard_error(site, "entropy")  # with s.value(site, "entropy"): 0.812 ± 0.004
            array([0.004, 0.003, 0.005, 0.004])
        """
        self.value(site, metric, scale)  # the metric and scale exist
        by_scale = self._site(site)["metrics"].get(f"{metric}_se", {})
        return by_scale[scale].copy() if scale in by_scale else None

    def estimate_note(self, site: str) -> Optional[str]:
        """``"est., 128 of 1024 rows"`` for a site whose exponential metrics are estimates from
        sampled query rows, ``None`` when every value is exact."""
        sampled = self._site(site)["info"].get("sampled")
        if not sampled:
            return "est." if any(m.endswith("_se") for m in self._site(site)["metrics"]) else None
        return f"est., {sampled[0]} of {sampled[1]} rows"

    def accounting(self, site: str) -> List[Account]:
        """Every value of ``site``, metric by metric and scale by scale (the run's scales,
        ``meta["scales"]``; scale-free metrics at ``actual``): measured, estimated, or not
        measured with the reason (the site's ``info["not_measured"]``: an unverified
        reconstruction, an unknown scale, a gradient that never came and why).

        Example:
            >>> [a for a in s.accounting("layers.0.attn") if a.status == "not measured"]
            [Account('grad_k', 'actual', 'not measured', 'k does not require grad here (...)')]
        """
        entry = self._site(site)
        info, metrics = entry["info"], entry["metrics"]
        why_not: Mapping[str, str] = info.get("not_measured") or {}
        scales = list(self.meta.get("scales") or ("actual", "unscaled", "standard"))
        for by_scale in metrics.values():
            scales += [sc for sc in by_scale if sc not in scales]
        sampled = info.get("sampled")
        estimate = f"estimated from {sampled[0]} of {sampled[1]} query rows" if sampled else "estimated"
        out: List[Account] = []
        for spec in METRICS:
            name = spec.name
            if name.endswith("_se") or (spec.optional and name not in metrics):
                continue  # a standard error goes with its metric; qk_clip's only where asked for
            for scale in ("actual",) if name in SCALE_FREE else scales:
                have = metrics.get(name, {})
                if scale in have:
                    est = scale in metrics.get(f"{name}_se", {})
                    out.append(Account(name, scale, "estimated" if est else "measured", estimate if est else ""))
                    continue
                why = (why_not.get(f"{name}@{scale}") or why_not.get(name) or why_not.get(f"@{scale}")
                       or (_NO_BACKWARD if spec.backward else "not produced at this site"))
                out.append(Account(name, scale, "not measured", why))
        return out

    def not_measured(self, site: str) -> Dict[str, List[str]]:
        """What ``site`` does not report, grouped by reason: ``{why: ["metric@scale", ...]}``
        (scale-free metrics without ``@``); empty when every value is measured or estimated."""
        out: Dict[str, List[str]] = {}
        for a in self.accounting(site):
            if a.status == "not measured":
                out.setdefault(a.note, []).append(a.metric if a.metric in SCALE_FREE else f"{a.metric}@{a.scale}")
        return out

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """A strict-JSON-ready dict: NaN metric values become ``null``, ±inf ``"inf"`` / ``"-inf"``
        (see the module docstring)."""
        return {
            "format": _FORMAT,
            "steps": self.steps,
            "meta": _encode_any(self.meta),
            "sites": {
                name: {
                    "info": _encode_any(entry["info"]),
                    "metrics": {
                        m: {s: _clean(v.tolist()) for s, v in by_scale.items()}
                        for m, by_scale in entry["metrics"].items()
                    },
                }
                for name, entry in self._sites.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Summary":
        """The inverse of :meth:`to_dict`.

        Raises:
            ProbeError: naming the first entry that is not what a summary holds (a site that is
                not an object, a value that is not a number, a nested list, ...).
        """
        if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
            got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ProbeError(f"not a probe summary: expected format {_FORMAT!r}, got {got!r}")
        steps = data.get("steps", 0)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise _bad('"steps"', steps, "an int >= 0")
        meta = data.get("meta") or {}
        if not isinstance(meta, Mapping):
            raise _bad('"meta"', meta, "an object")
        return cls(_decode_sites(data.get("sites")), steps=steps, meta=_decode_any(dict(meta)))

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the JSON file atomically: a reader sees the old file or the new one, never half
        (:func:`probe.files.atomic_write`: an exclusive, randomly named temporary file, never a
        planted symlink, then ``os.replace``).

        Raises:
            OSError: the directory is not writable, the disk is full, ...
        """
        atomic_write(path, json.dumps(self.to_dict(), indent=1, allow_nan=False))

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Summary":
        """Read a ``probe_summary.json``, or the one inside a run directory.

        Raises:
            ProbeError: the path is missing, not a regular file (a FIFO, ``/dev/null``, a
                device), not JSON, nested too deeply, or JSON of the wrong shape, naming the path
                and the problem.
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, SUMMARY_FILE)
        raw = read_regular_file(path, "probe summary", _MAX_BYTES)
        if not raw.strip():
            raise ProbeError(f"cannot read probe summary {path!r}: the file is empty")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ProbeError(f"cannot read probe summary {path!r}: not UTF-8 text ({err.reason} at byte {err.start})") from err
        except ValueError as err:
            raise ProbeError(f"cannot read probe summary {path!r}: not valid JSON: {err}") from err
        except RecursionError:
            raise ProbeError(f"cannot read probe summary {path!r}: JSON nested too deeply") from None
        try:
            return cls.from_dict(data)
        except ProbeError as err:
            raise ProbeError(f"{path!r}: {err}") from None

    def __repr__(self) -> str:
        return f"Summary({len(self._sites)} sites, {self.steps} steps)"
