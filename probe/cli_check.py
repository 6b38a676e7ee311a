"""``probe check`` and ``probe report``: judge or print a finished run from the command line.

A run is a ``probe_summary.json`` (written by ``probe.watch(model, logdir=...)`` on close), or a
directory holding one. Without that file, the TensorBoard event files of the directory are read
instead; they hold only head-aggregated scalars (the head mean; the max for ``logit_max``, the sum
for ``nonfinite``) unless the run used ``per_head=True``, so a single collapsed head can hide in a
mean there. Both commands say which source they used.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from probe.errors import ProbeError
from probe.summary import SUMMARY_FILE, Summary

__all__ = ["add_commands", "load_run", "report_table", "summary_from_events"]

_EVENTS = "events.out.tfevents"
_HEAD = re.compile(r"head(\d+)")
TENSORBOARD_NOTE = (
    "read from TensorBoard event files: only head-aggregated scalars exist there (head mean; max for "
    "logit_max, sum for nonfinite) unless the run used per_head=True, reduced over steps (max for "
    "logit_max, sum for nonfinite, root-sum-square for grad_*, mean otherwise); a single collapsed "
    "head can hide in a mean. Write probe_summary.json (probe.watch(model, logdir=...)) for per-head checks."
)


def _step_reduce(metric: str, values: np.ndarray) -> float:
    """Fold one tag's values over steps the way the summary folds steps (NaN steps ignored).

    ``logit_max`` max, ``nonfinite`` sum and ``grad_*`` root-sum-square are exact; the mean of
    per-step means equals the summary's row-weighted mean only when each step has as many rows.
    """
    finite = values[~np.isnan(values)]
    if finite.size == 0:
        return math.nan
    if metric == "logit_max":
        return float(finite.max())
    if metric == "nonfinite":
        return float(finite.sum())
    if metric.startswith("grad"):
        return float(np.sqrt(np.square(finite).sum()))
    return float(finite.mean())


def summary_from_events(path: str) -> Summary:
    """A :class:`Summary` rebuilt from ``probe/{metric}/{scale}/{site}[/headNN]`` scalars.

    Sites without per-head tags get one value per metric (the head aggregate) and
    ``info["heads_aggregated"] = True``; violations on them have ``head=None``.
    """
    try:
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    except ImportError as err:  # pragma: no cover - tensorboard is a dependency
        raise ProbeError(f"reading TensorBoard event files needs the tensorboard package: {err}") from err
    from probe.eventfiles import check_event_files

    check_event_files(path)  # a truncated or corrupted file is an error, not "fewer steps"
    acc = EventAccumulator(path, size_guidance={SCALARS: 0})  # 0: keep every event, do not sample
    try:
        acc.Reload()
    except Exception as err:  # noqa: BLE001 - corrupt files raise many kinds of error
        raise ProbeError(f"cannot read TensorBoard events in {path!r}: {type(err).__name__}: {err}") from err
    # (site, metric, scale) -> head (None = aggregate) -> reduced value
    found: Dict[Tuple[str, str, str], Dict[Optional[int], float]] = {}
    steps = set()
    for tag in acc.Tags().get("scalars", []):
        parts = tag.split("/")
        if len(parts) < 4 or parts[0] != "probe":
            continue
        metric, scale, rest = parts[1], parts[2], parts[3:]
        head: Optional[int] = None
        match = _HEAD.fullmatch(rest[-1]) if len(rest) > 1 else None
        if match:
            head, rest = int(match.group(1)), rest[:-1]
        events = acc.Scalars(tag)
        steps.update(e.step for e in events)
        values = np.array([e.value for e in events], dtype=np.float64)
        found.setdefault(("/".join(rest), metric, scale), {})[head] = _step_reduce(metric, values)
    per_head_sites = {site for (site, _, _), heads in found.items() if any(h is not None for h in heads)}
    sites: Dict[str, Dict[str, Any]] = {}
    for (site, metric, scale), heads in found.items():
        entry = sites.setdefault(site, {"info": {"heads_aggregated": site not in per_head_sites}, "metrics": {}})
        if site in per_head_sites:
            numbered = {h: v for h, v in heads.items() if h is not None}
            if not numbered:
                continue
            values = [numbered.get(h, math.nan) for h in range(max(numbered) + 1)]
        else:
            values = [heads[None]]
        entry["metrics"].setdefault(metric, {})[scale] = values
    return Summary(sites, steps=len(steps), meta={"source": "tensorboard", "path": path})


def load_run(path: str) -> Tuple[Summary, str]:
    """Read a run: ``(summary, source)`` with source ``"summary"`` or ``"tensorboard"``.

    Args:
        path: a ``probe_summary.json``, an event file, or a directory holding either.

    Raises:
        ProbeError: the path does not exist, or holds neither a summary nor event files, or the
            file cannot be read.
    """
    if not os.path.exists(path):
        raise ProbeError(f"expected a run directory or a {SUMMARY_FILE}, got a path that does not exist: {path!r}")
    if not os.path.isdir(path):  # a file, or a FIFO / device that Summary.load refuses
        if os.path.basename(path).startswith(_EVENTS):
            return summary_from_events(path), "tensorboard"
        return Summary.load(path), "summary"
    if os.path.isfile(os.path.join(path, SUMMARY_FILE)):
        return Summary.load(path), "summary"
    if any(name.startswith(_EVENTS) for name in os.listdir(path)):
        return summary_from_events(path), "tensorboard"
    raise ProbeError(f"expected {SUMMARY_FILE} or TensorBoard event files in {path!r}, found neither")


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.4g}"


def report_table(summary: Summary) -> str:
    """Per site: its info line, then one row per metric with the head aggregate at each scale
    (mean; max for ``logit_max``, sum for ``nonfinite``) and the range over heads at ``actual``."""
    from probe.stats.finalize import head_reduce

    out: List[str] = []
    for site in summary.sites:
        info = summary.info(site)
        known = [f"{k} {info[k]}" for k in ("kind", "heads", "kv_heads", "d_k", "scale", "calls") if info.get(k) is not None]
        if info.get("heads_aggregated"):
            known.append("head aggregates only")
        out.append(f"{site}" + (f"  ({', '.join(known)})" if known else ""))
        metrics = summary.metrics(site)
        scales: List[str] = []
        for m in metrics:
            scales += [s for s in summary.scales(site, m) if s not in scales]
        builtin = ("actual", "unscaled", "standard")  # then extra scales, in the order seen
        scales.sort(key=lambda s: builtin.index(s) if s in builtin else len(builtin))
        rows = [["metric"] + scales + ["heads @actual (min..max)"]]
        for m in metrics:
            row = [m]
            for s in scales:
                row.append(_fmt(head_reduce(m, summary.value(site, m, s))) if s in summary.scales(site, m) else "-")
            if "actual" in summary.scales(site, m) and not info.get("heads_aggregated"):
                v = summary.value(site, m, "actual")
                v = v[~np.isnan(v)]
                row.append(f"{_fmt(v.min())}..{_fmt(v.max())}" if v.size else "no data")
            else:
                row.append("-")
            rows.append(row)
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        out += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        out.append("")
    return "\n".join(out).rstrip()


def _fail(args: argparse.Namespace, message: str) -> int:
    from probe.cli import ExitCode

    print(f"probe {args.command}: error: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": message, "exit": int(ExitCode.USAGE)}))
    return ExitCode.USAGE


def _cmd_check(args: argparse.Namespace) -> int:
    from probe.cli import ExitCode
    from probe.thresholds import as_thresholds, evaluate, format_table, load_thresholds

    try:
        if args.threshold:
            rules, origin = as_thresholds(args.threshold), "--threshold"
        else:
            rules, found = load_thresholds(args.config)
            origin = found or "the defaults"
        summary, source = load_run(args.run)
        judged = evaluate(summary, rules)
    except ProbeError as err:
        return _fail(args, str(err))
    violations = sorted((v for v in judged if not v.ok), key=lambda v: -v.excess)
    note = TENSORBOARD_NOTE if source == "tensorboard" else None
    if args.json:
        print(json.dumps({
            "ok": not violations, "run": args.run, "source": source, "thresholds": [str(t) for t in rules],
            "thresholds_from": origin, "sites": len(summary), "checked": len(judged),
            "violations": [v.to_dict() for v in violations], "note": note,
        }, indent=1))
    else:
        print(f"probe check {args.run} ({source}: {len(summary)} sites, {summary.steps} steps)")
        print(f"thresholds from {origin}: " + ", ".join(str(t) for t in rules))
        if note:
            print(f"note: {note}")
        if violations:
            n = len(violations)
            print(f"FAIL: {n} violation{'s' if n != 1 else ''} (worst first)")
            print(format_table(violations))
        else:
            print(f"PASS: {len(judged)} head values checked")
    return ExitCode.VIOLATIONS if violations else ExitCode.OK


def _cmd_report(args: argparse.Namespace) -> int:
    from probe.cli import ExitCode

    try:
        summary, source = load_run(args.run)
        if not summary.sites:
            raise ProbeError(f"the run {args.run!r} holds no attention site (nothing was probed)")
        table = report_table(summary)
    except ProbeError as err:
        return _fail(args, str(err))
    note = TENSORBOARD_NOTE if source == "tensorboard" else None
    if args.json:
        print(json.dumps({"run": args.run, "source": source, "note": note, "summary": summary.to_dict()}, indent=1))
    else:
        print(f"probe report {args.run} ({source}: {len(summary)} sites, {summary.steps} steps)")
        if note:
            print(f"note: {note}")
        print(table)
    return ExitCode.OK


def add_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register ``check`` and ``report`` on the ``probe`` parser's subcommands."""
    check = sub.add_parser(
        "check", help="assert stability thresholds on a run; exit 0 pass, 1 violations, 2 usage or unreadable input",
        description="Judge every head of a run against thresholds [SITE_GLOB:]METRIC[@SCALE] OP VALUE. "
                    "Thresholds: --threshold, else --config FILE, else [tool:probe] in pytest.ini / tox.ini / "
                    "setup.cfg ([tool.probe] in pyproject.toml) found from the current directory upward, "
                    "else logit_max < 100 and nonfinite <= 0.",
    )
    check.add_argument("run", metavar="RUN_DIR_OR_SUMMARY", help="a probe logdir, probe_summary.json or event file")
    check.add_argument("--threshold", "-t", action="append", metavar="EXPR", help="e.g. 'logit_max < 100' (repeatable)")
    check.add_argument("--config", metavar="FILE", help="read the probe section's thresholds from FILE")
    check.add_argument("--json", action="store_true", help="print a JSON object for machines")
    check.set_defaults(func=_cmd_check)
    report = sub.add_parser("report", help="print the per-site metrics of a run, without judging")
    report.add_argument("run", metavar="RUN_DIR_OR_SUMMARY", help="a probe logdir, probe_summary.json or event file")
    report.add_argument("--json", action="store_true", help="print the summary as JSON")
    report.set_defaults(func=_cmd_report)
