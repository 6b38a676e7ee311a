"""Summary: per-site, per-head metrics, aggregated over probed steps, with a JSON round trip."""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Union

import numpy as np

from probe.errors import ProbeError

__all__ = ["SUMMARY_FILE", "Summary"]

#: The file name a probe writes into its logdir on close.
SUMMARY_FILE = "probe_summary.json"
_FORMAT = "probe.summary/1"


def _clean(values: Iterable[float]) -> List[Optional[float]]:
    return [None if (v is None or math.isnan(v)) else float(v) for v in values]


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

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict; NaN becomes ``null``."""
        return {
            "format": _FORMAT,
            "steps": self.steps,
            "meta": self.meta,
            "sites": {
                name: {
                    "info": entry["info"],
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
        if not isinstance(data, Mapping) or data.get("format") != _FORMAT or not isinstance(data.get("sites"), Mapping):
            raise ProbeError(f"not a probe summary (expected format {_FORMAT!r})")
        sites = {
            name: {
                "info": entry.get("info", {}),
                "metrics": {
                    m: {s: [np.nan if x is None else x for x in v] for s, v in by_scale.items()}
                    for m, by_scale in entry.get("metrics", {}).items()
                },
            }
            for name, entry in data["sites"].items()
        }
        return cls(sites, steps=data.get("steps", 0), meta=data.get("meta"))

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the JSON file (atomically: a reader never sees half a file)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1, allow_nan=False)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Summary":
        """Read a ``probe_summary.json``, or the one inside a run directory."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, SUMMARY_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as err:
            raise ProbeError(f"cannot read probe summary {path!r}: {err}") from err
        return cls.from_dict(data)

    def __repr__(self) -> str:
        return f"Summary({len(self._sites)} sites, {self.steps} steps)"
