"""The command line the fidelity sweeps share (``keras_sweep.py``, ``tlens_sweep.py``,
``mha_sweep.py``): run every case (or those ``--only`` names), print one line per case and the
count of each verdict, and write the rows as JSON (``--json``). A case that raises is a row with an
``ERROR`` verdict, reported, not hidden."""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Dict, List, Mapping


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
