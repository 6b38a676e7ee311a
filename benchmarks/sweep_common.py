"""The command line the fidelity sweeps share (``keras_sweep.py``, ``tlens_sweep.py``,
``mha_sweep.py``): run every case (or those ``--only`` names), print one line per case and the
count of each verdict, and write the rows as JSON (``--json``). A case that raises is a row with an
``ERROR`` verdict, reported, not hidden."""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Dict, List, Mapping, Tuple

import numpy as np

#: metric -> (relative, absolute) tolerance of a per-head value against its float64 reference:
#: float32 rounding, relative on logits, absolute on probabilities
TOLERANCES = dict(logit_var=(1e-4, 1e-6), logit_max=(1e-4, 1e-5), entropy=(0.0, 2e-5), max_prob=(0.0, 2e-5))


def agree(got: Mapping[str, Any], ref: Mapping[str, Any]) -> Tuple[bool, float]:
    """Whether probe's per-head values match the reference within :data:`TOLERANCES` (NaN where
    both are NaN agrees); the worst relative (logits) / absolute (probabilities) error."""
    worst, ok = 0.0, True
    for m, (rel, ab) in TOLERANCES.items():
        g, r = np.asarray(got[m], float), np.asarray(ref[m], float)
        if g.shape != r.shape:
            return False, float("inf")
        both_nan = np.isnan(g) & np.isnan(r)
        err = np.where(both_nan, 0.0, np.abs(g - r))
        ok = ok and bool(np.all(np.nan_to_num(err, nan=np.inf) <= ab + rel * np.abs(r)))
        scale = np.abs(r) if rel else 1.0
        worst = max(worst, float(np.nanmax(np.where(both_nan, 0.0, err / np.maximum(scale, 1e-12)))))
    return ok, worst


def sweep_main(cases: Mapping[str, Any], run_case: Callable[[str, Any], Dict[str, Any]],
               line: Callable[[str, Dict[str, Any]], str],
               error_row: Callable[[str, Any, Exception], Dict[str, Any]],
               verbose: Callable[[Dict[str, Any]], str] = lambda row: str(row.get("warnings"))) -> List[Dict[str, Any]]:
    """Run the sweep from the command line: ``run_case(name, case)`` gives a row with a
    ``verdict``; ``line(name, row)`` is the case's printed line; ``error_row(name, case, err)`` the
    row of a case that raised; ``verbose(row)`` what ``-v`` prints after it."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--only", help="comma-separated substrings of case names")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    rows = []
    for name, case in cases.items():
        if a.only and not any(s in name for s in a.only.split(",")):
            continue
        try:
            row = run_case(name, case)
        except Exception as err:  # a case that does not run is reported, not hidden
            row = error_row(name, case, err)
        rows.append(row)
        print(line(name, row), flush=True)
        if a.verbose:
            print("   ", verbose(row))
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    print(f"\n{len(rows)} cases: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return rows
