"""``probe check`` and ``probe report``: judge or print finished runs from the command line.

A run is a ``probe_summary.json`` (written by ``probe.watch(model, logdir=...)`` on close), or a
directory holding one; without that file, the TensorBoard event files of the directory are read
(see :mod:`probe.ci.runs`). A directory holding neither is searched for runs below it, and each is
judged: ``probe check runs/demo`` judges ``runs/demo/with-divisor`` and ``runs/demo/no-divisor`` and exits
with the worst verdict. Every output says which source and which probed steps its values come from.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from probe.errors import ProbeError
from probe.ci.exit_codes import ExitCode
from probe.names import printable

if TYPE_CHECKING:  # pragma: no cover - the CLI's parser imports this module: no numpy until a command runs
    from probe.ci.runs import StepWindow
    from probe.summary import Summary

__all__ = ["add_commands", "positive_int", "report_table", "steps_line"]

TENSORBOARD_NOTE = (
    "read from TensorBoard event files: only head-aggregated scalars exist there (head mean; max for "
    "logit_max, sum for nonfinite) unless the run used per_head=True; a single collapsed head can hide "
    "in a mean. Write probe_summary.json (probe.watch(model, logdir=...)) for per-head checks."
)
WINDOW_NOTE = (
    "read from TensorBoard event files: only head-aggregated scalars exist there (head mean; max for "
    "logit_max, sum for nonfinite), so a single collapsed head can hide in a mean. The run's "
    "probe_summary.json has every head, as run totals: judge the directory without --last / --steps for "
    "that, or log with probe.watch(..., per_head=True) to judge each head per step."
)


def _source_note(path: str, summary: "Summary", source: str) -> Optional[str]:
    """What reading the event files left out of this run, and what would keep it: nothing when
    every site has per-head values; the summary file when the run has none, a whole-run check or
    ``per_head=True`` when it has one (a step window cannot use it)."""
    import os

    from probe.summary import SUMMARY_FILE

    if source != "tensorboard" or not any(summary.info(site).get("heads_aggregated") for site in summary.sites):
        return None
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    return WINDOW_NOTE if os.path.isfile(os.path.join(folder, SUMMARY_FILE)) else TENSORBOARD_NOTE
ESTIMATE_NOTE = (
    "some checked values are estimates from sampled query rows (rows=, default 128 for longer calls), "
    "shown as value ± standard error; a value within a few standard errors of its limit is not decided "
    "by this run. probe.watch(model, rows=None) measures every row exactly."
)
REDUCTION = "over steps: max for logit_max, sum for nonfinite, root-mean-square for grad_*, mean otherwise"


def steps_line(summary: Summary, window: Optional[StepWindow] = None) -> str:
    """Which probed steps the values come from, and how they were folded over them."""
    n = summary.steps
    first, last = summary.meta.get("first_step"), summary.meta.get("last_step")
    span = f" ({first}..{last})" if first is not None and last is not None else ""
    which = f"{window}: {n} probed step{'s' if n != 1 else ''}{span}" if window else \
        f"all {n} probed step{'s' if n != 1 else ''}{span}"
    return f"values from {which}; {REDUCTION}"


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.4g}"


def _cell(summary: Summary, site: str, metric: str, scale: str) -> str:
    """The head aggregate at one scale; for an estimate ``value ± se``, ``se`` the heads' mean
    standard error (at least the standard error of their mean)."""
    from probe.metrics import head_reduce
    from probe.summary import format_estimate

    value = head_reduce(metric, summary.value(site, metric, scale))
    se = summary.standard_error(site, metric, scale)
    return format_estimate(value, None if se is None else head_reduce(f"{metric}_se", se))


def report_table(summary: Summary) -> str:
    """Per site: its info line, then one row per metric with the head aggregate at each scale
    (mean; max for ``logit_max``, sum for ``nonfinite``) and the range over heads at ``actual``.
    Columns line up across all sites."""
    import numpy as np

    from probe.sinks.tags import scale_label
    from probe.summary import compact_values

    builtin = ("actual", "unscaled", "standard")  # then extra scales, in the order seen
    scales: List[str] = []
    for site in summary.sites:
        for m in summary.metrics(site):
            scales += [s for s in summary.scales(site, m) if s not in scales]
    scales.sort(key=lambda s: builtin.index(s) if s in builtin else len(builtin))
    blocks: List[Tuple[str, List[List[str]]]] = []
    for site in summary.sites:
        info = summary.info(site)
        known = [f"{k} {info[k]}" for k in ("kind", "heads", "kv_heads", "d_k") if info.get(k) is not None]
        if info.get("scale") is not None:
            known.append(f"scale {scale_label(info['scale'], info.get('d_k'))}")
        if info.get("calls") is not None:
            known.append(f"calls {info['calls']}")
        if info.get("heads_aggregated"):
            known.append("head aggregates only")
        note = summary.estimate_note(site)
        if note:
            sampled = note[len("est., "):] if note.startswith("est., ") else "query rows"
            known.append(f"{sampled} sampled: ± marks an estimate and its standard error")
        if "verified" in info:  # checked against the model's own computation (issue 25)
            known.append({True: "verified", False: "UNVERIFIED", None: "unchecked"}[info["verified"]])
        rows = []
        metrics = summary.metrics(site)
        for m in metrics:
            if m.endswith("_se") and m[: -len("_se")] in metrics:
                continue  # shown with its metric, as ± se
            have = summary.scales(site, m)
            row = [m] + [_cell(summary, site, m, s) if s in have else "-" for s in scales]
            if "actual" in have and not info.get("heads_aggregated"):
                v = summary.value(site, m, "actual")
                v = v[~np.isnan(v)]
                row.append(f"{_fmt(v.min())}..{_fmt(v.max())}" if v.size else "no data")
            else:
                row.append("-")
            rows.append(row)
        rows += [[f"not measured: {compact_values(values)}: {why}"] for why, values in summary.not_measured(site).items()]
        blocks.append((printable(site) + (f"  ({', '.join(known)})" if known else ""), rows))
    header = ["metric"] + scales + ["heads @actual (min..max)"]
    widths = [max([len(header[c])] + [len(r[c]) for _, rows in blocks for r in rows if len(r) > 1])
              for c in range(len(header))]
    line = lambda r: "  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()  # noqa: E731
    out: List[str] = []
    for title, rows in blocks:
        out += [title, line(header)] + [line(r) for r in rows] + [""]
    return "\n".join(out).rstrip()


def _window(args: argparse.Namespace) -> Optional["StepWindow"]:
    from probe.ci.runs import StepWindow

    if getattr(args, "last", None) is not None:
        return StepWindow(last=args.last)
    if getattr(args, "steps", None) is not None:
        return args.steps
    return None


def _error(args: argparse.Namespace, message: str) -> int:
    print(f"probe {args.command}: error: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": message, "exit": int(ExitCode.USAGE)}))
    return ExitCode.USAGE


def _judge(path: str, args: argparse.Namespace, rules: List[Any], origin: str) -> Tuple[int, Dict[str, Any], List[str]]:
    """One run: (exit code, JSON object, text lines)."""
    from probe.ci.runs import load_run
    from probe.ci.thresholds import evaluate, format_table

    window = _window(args)
    try:
        summary, source = load_run(path, window)
        judged = evaluate(summary, rules)
    except ProbeError as err:
        return ExitCode.USAGE, {"ok": False, "run": path, "error": str(err), "exit": int(ExitCode.USAGE)}, \
            [f"error: {printable(str(err))}"]
    violations = sorted((v for v in judged if not v.ok), key=lambda v: -v.excess)
    estimated = ESTIMATE_NOTE if any(v.se is not None for v in judged) else None
    notes = [n for n in (_source_note(path, summary, source), summary.meta.get("note"), estimated) if n]
    code = ExitCode.VIOLATIONS if violations else ExitCode.OK
    data = {
        "ok": not violations, "run": path, "source": source, "thresholds": [str(t) for t in rules],
        "thresholds_from": origin, "sites": len(summary), "checked": len(judged), "steps": summary.steps,
        "first_step": summary.meta.get("first_step"), "last_step": summary.meta.get("last_step"),
        "violations": [v.to_dict() for v in violations], "note": " ".join(notes) or None, "exit": int(code),
    }
    lines = [f"probe check {printable(path)} ({source}: {len(summary)} sites, {summary.steps} probed steps)",
             steps_line(summary, window),
             f"thresholds from {origin}: " + ", ".join(str(t) for t in rules)]
    lines += [f"note: {n}" for n in notes]
    if violations:
        n = len(violations)
        lines += [f"FAIL: {n} violation{'s' if n != 1 else ''} (worst first)", format_table(violations)]
    else:
        lines.append(f"PASS: {len(judged)} head values checked")
    return code, data, lines


def _cmd_check(args: argparse.Namespace) -> int:
    from probe.ci.runs import find_runs
    from probe.ci.thresholds import as_thresholds, load_thresholds

    try:
        if args.threshold:
            rules, origin = as_thresholds(args.threshold), "--threshold"
        else:
            rules, found = load_thresholds(args.config)
            origin = found or "the defaults"
        runs = find_runs(args.run)
    except ProbeError as err:
        return _error(args, str(err))
    results = [_judge(path, args, rules, origin) for path in runs]
    if len(runs) == 1:
        code, data, lines = results[0]
        if code == ExitCode.USAGE:
            return _error(args, data["error"])
        print(json.dumps(data, indent=1) if args.json else "\n".join(lines))
        return code
    worst = max(code for code, _, _ in results)
    if args.json:
        print(json.dumps({"ok": worst == ExitCode.OK, "run": args.run, "runs": [d for _, d, _ in results],
                          "exit": int(worst)}, indent=1))
        return worst
    print(f"probe check {printable(args.run)}: {len(runs)} runs below it")
    for path, (_, _, lines) in zip(runs, results):
        print(f"\n== {printable(path)}")
        print("\n".join(lines))
    print("\nverdicts (worst first):")
    verdict = {ExitCode.OK: "PASS ", ExitCode.VIOLATIONS: "FAIL ", ExitCode.USAGE: "ERROR"}
    for path, (code, data, _) in sorted(zip(runs, results), key=lambda r: -r[1][0]):
        detail = f"{len(data['violations'])} violations" if code == ExitCode.VIOLATIONS else data.get("error", "")
        print(f"  {verdict[ExitCode(code)]}  {printable(path)}" + (f"  ({printable(detail)})" if detail else ""))
    return worst


def _cmd_report(args: argparse.Namespace) -> int:
    from probe.ci.runs import find_runs, load_run

    window = _window(args)
    try:
        runs = find_runs(args.run)
        loaded = []
        for path in runs:
            summary, source = load_run(path, window)
            if not summary.sites:
                raise ProbeError(f"the run {path!r} holds no attention site (nothing was probed)")
            loaded.append((path, summary, source))
    except ProbeError as err:
        return _error(args, str(err))
    if args.json:
        objects = [{"run": path, "source": source, "steps": summary.steps,
                    "note": _source_note(path, summary, source), "summary": summary.to_dict()}
                   for path, summary, source in loaded]
        print(json.dumps(objects[0] if len(objects) == 1 else {"run": args.run, "runs": objects}, indent=1))
        return ExitCode.OK
    for i, (path, summary, source) in enumerate(loaded):
        if i:
            print()
        print(f"probe report {printable(path)} ({source}: {len(summary)} sites, {summary.steps} probed steps)")
        print(steps_line(summary, window))
        for note in (_source_note(path, summary, source), summary.meta.get("note")):
            if note:
                print(f"note: {note}")
        print(report_table(summary))
    return ExitCode.OK


def _step_range(text: str) -> "StepWindow":
    from probe.ci.runs import StepWindow

    start, sep, stop = text.partition(":")
    try:
        lo = int(start) if start.strip() else None
        hi = int(stop) if stop.strip() else None
    except ValueError:
        lo = hi = None
        sep = ""
    if not sep or (lo is not None and hi is not None and lo > hi) or (lo is None and hi is None):
        raise argparse.ArgumentTypeError(f"expected a step range A:B (A:, :B also work; both ends included), got {text!r}")
    return StepWindow(start=lo, stop=hi)


def int_at_least(minimum: int, what: str):
    """An argparse type: an int >= ``minimum``; ``what`` names it in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive_int = int_at_least(1, "a positive int")


def _add_window(cmd: argparse.ArgumentParser) -> None:
    group = cmd.add_mutually_exclusive_group()
    group.add_argument("--last", type=positive_int, metavar="N",
                       help="only the last N probed steps (read from the run's TensorBoard event files)")
    group.add_argument("--steps", type=_step_range, metavar="A:B",
                       help="only the probed steps A..B, both included (from the event files)")


def add_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register ``check`` and ``report`` on the ``probe`` parser's subcommands."""
    check = sub.add_parser(
        "check", help="assert stability thresholds on runs; exit 0 pass, 1 violations, 2 usage or unreadable input",
        description="Judge every head of a run (or of every run below a directory) against thresholds "
                    "[SITE_GLOB:]METRIC[@SCALE] OP VALUE. Thresholds: --threshold, else --config FILE, else "
                    "[tool:probe] in pytest.ini / tox.ini / setup.cfg ([tool.probe] in pyproject.toml) found from "
                    "the current directory upward, else logit_max < 100 and nonfinite <= 0. Exits with the worst "
                    "verdict of the runs.",
    )
    check.add_argument("run", metavar="RUN", help="a probe logdir, probe_summary.json, event file, or a directory of runs")
    check.add_argument("--threshold", "-t", action="append", metavar="EXPR", help="e.g. 'logit_max < 100' (repeatable)")
    check.add_argument("--config", metavar="FILE", help="read the probe section's thresholds from FILE")
    _add_window(check)
    check.add_argument("--json", action="store_true", help="print a JSON object for machines")
    check.set_defaults(func=_cmd_check)
    report = sub.add_parser("report", help="print the per-site metrics of runs, without judging")
    report.add_argument("run", metavar="RUN", help="a probe logdir, probe_summary.json, event file, or a directory of runs")
    _add_window(report)
    report.add_argument("--json", action="store_true", help="print the summary as JSON")
    report.set_defaults(func=_cmd_report)
