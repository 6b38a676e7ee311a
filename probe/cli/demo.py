"""``probe demo``: a small transformer trained with and without the 1/sqrt(d_k) divisor, side by side.

The model and the majority task are in :mod:`probe.cli.demo_model`. Each run writes its training
loss (``loss/train``) beside probe's scalars in its own TensorBoard run directory, named
``with-divisor`` and ``no-divisor`` (never a scale name: TensorBoard shows scales and runs side by
side); a directory that already holds a run is never written into again (``with-divisor-2``, ...),
so TensorBoard never mixes two runs' steps. The terminal gets a per-layer table, a reading of the
two runs from their own numbers and the verdicts of ``probe check``'s default thresholds.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Dict, List, Optional, TextIO, Tuple

import torch
from torch import Tensor

import probe
from probe.cli.demo_model import DemoConfig, TinyTransformer, copy_batch, copy_loss, majority_batch, majority_bound
from probe.cli.demo_model import majority_loss
from probe.names import printable
from probe.sinks.base import BaseSink
from probe.metrics import head_reduce

__all__ = [
    "RUNS", "DemoConfig", "TinyTransformer", "copy_batch", "copy_loss", "facts", "format_table", "majority_batch",
    "majority_bound", "majority_loss", "reading", "run_demo", "train", "verdict",
]


class _Steps(BaseSink):
    """Keeps the flush of each probed step (the demo flushes every probed step)."""

    def __init__(self) -> None:
        self.by_step: Dict[int, probe.Summary] = {}

    def write(self, step: int, summary: probe.Summary) -> None:
        self.by_step[step] = summary


#: The tag of the demo's training loss: its own TensorBoard group, beside probe's.
LOSS_TAG = "loss/train"


def train(config: DemoConfig, scale: Optional[float], logdir: Optional[str]) -> Dict[str, Any]:
    """Train one model on the majority task under probe, logging its loss beside probe's scalars.

    Returns:
        ``losses`` (every step's), ``loss`` (mean of the last 10 steps), ``first_loss``,
        ``counting`` and ``one_token`` (:func:`majority_bound` with every token so far and with
        the current token alone, means over the last 10 batches), ``summary`` (the run's
        :class:`probe.Summary`) and ``steps`` (probed step -> that step's :class:`probe.Summary`).
    """
    torch.manual_seed(config.seed)
    model = TinyTransformer(config, scale)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr)
    gen = torch.Generator().manual_seed(config.seed + 1)
    losses: List[Tensor] = []
    bounds: List[Tuple[float, float]] = []
    writer = None
    if logdir is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=logdir)
    steps = _Steps()
    try:
        with probe.watch(model, logdir=writer, every=config.every, sinks=[steps]) as p:
            for step in range(config.steps):
                tokens, hidden = majority_batch(config, gen)
                loss = majority_loss(model, tokens, hidden)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
                if step >= config.steps - 10:
                    bounds.append((majority_bound(config, tokens, hidden), majority_bound(config, tokens, hidden, 1)))
                if writer is not None:
                    writer.add_scalar(LOSS_TAG, loss.item(), step)
    finally:
        if writer is not None:
            writer.close()
    values = [x.item() for x in losses]
    return {"losses": values, "loss": sum(values[-10:]) / len(values[-10:]), "first_loss": values[0],
            "counting": sum(b for b, _ in bounds) / len(bounds), "one_token": sum(a for _, a in bounds) / len(bounds),
            "summary": p.summary(), "steps": steps.by_step}


#: Table columns: (key, heading). Each is the head mean at the model's own scale, except
#: ``logit_max`` (the max over heads) and ``grad_ratio``, the counterfactual: the softmax gradient
#: at scale 1 over the one at 1/sqrt(d_k), for the same q, k and upstream gradient (head means).
COLUMNS = (("entropy", "entropy"), ("saturation", "saturation"), ("logit_max", "max logit"),
           ("grad_logits", "softmax grad"), ("grad_ratio", "grad ratio"))


def _value(summary: Optional[probe.Summary], site: str, metric: str, scale: str) -> float:
    if summary is None or site not in summary.sites or metric not in summary.metrics(site):
        return math.nan
    if scale not in summary.scales(site, metric):
        return math.nan
    return head_reduce(metric, summary.value(site, metric, scale))


def _cell(summary: Optional[probe.Summary], site: str, key: str) -> float:
    if key == "grad_ratio":
        with_divisor = _value(summary, site, "grad_logits", "standard")
        if not 0 < with_divisor < math.inf:  # x / inf is 0 or NaN, no measurement of the ratio
            return math.nan
        return _value(summary, site, "grad_logits", "unscaled") / with_divisor
    return _value(summary, site, key, "actual")


def _num(x: float) -> str:
    if math.isnan(x):
        return "-"
    if x == 0 or 1e-3 <= abs(x) < 10:
        return f"{x:.3f}"
    if 10 <= abs(x) < 1e3:
        return f"{x:.1f}"
    return f"{x:,.0f}" if 1e3 <= abs(x) < 1e6 else f"{x:.1e}"


def _ends(result: Dict[str, Any]) -> List[int]:
    probed = sorted(result["steps"])
    return [probed[0], probed[-1]] if len(probed) > 1 else probed[:1]


def format_table(results: Dict[str, Dict[str, Any]]) -> str:
    """Per layer and run, at the first and the last probed step: entropy, saturation, max logit,
    the softmax gradient ``grad_logits`` (at the model's own scale; head mean, head max for the
    max logit) and ``grad_logits@unscaled / grad_logits@standard``, what the softmax would pass
    back without the divisor relative to with it, for the same q, k and upstream gradient.
    Columns are aligned; the headings say which step each value is from."""
    names = list(results)
    ends = _ends(results[names[0]])
    sites = list(results[names[0]]["summary"].sites)
    cell_w = 7
    group_w = len(ends) * cell_w + (len(ends) - 1)
    site_w = max(len("layer"), *(len(printable(s)) for s in sites))
    run_w = max(len("run"), *(len(n) for n in names))
    left = f"{'':<{site_w}}  {'':<{run_w}}"
    widths = [max(group_w, len(heading)) for _, heading in COLUMNS]
    line1 = left + "".join(f"  {heading:^{w}}" for (_, heading), w in zip(COLUMNS, widths))
    steps = " ".join(f"{'step ' + str(s):>{cell_w}}" for s in ends)
    line2 = f"{'layer':<{site_w}}  {'run':<{run_w}}" + "".join(f"  {steps:>{w}}" for w in widths)
    lines = [line1.rstrip(), line2, "-" * len(line2)]
    for site in sites:
        for i, name in enumerate(names):
            by_step = results[name]["steps"]
            cells = []
            for (key, _), w in zip(COLUMNS, widths):
                group = " ".join(f"{_num(_cell(by_step.get(s), site, key)):>{cell_w}}" for s in ends)
                cells.append(f"  {group:>{w}}")
            lines.append(f"{printable(site) if i == 0 else '':<{site_w}}  {name:<{run_w}}" + "".join(cells))
    return "\n".join(lines)


def _estimate_note(results: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """A line under the table when its entropy, saturation and softmax gradients are estimates
    from sampled query rows (sequences longer than the ``rows=`` budget), with the largest
    standard error of an entropy head; ``None`` when every value is exact."""
    worst, note = 0.0, None
    for result in results.values():
        summary = result["summary"]
        for site in summary.sites:
            se = summary.standard_error(site, "entropy") if "entropy" in summary.metrics(site) else None
            if se is not None:
                note = summary.estimate_note(site)
                worst = max([worst] + [float(x) for x in se if not math.isnan(x)])
    if note is None:
        return None
    return (f"entropy, saturation, softmax grad and grad ratio are estimates ({note}; entropy ± up to "
            f"{worst:.2g}, one standard error): probe.watch(..., rows=None) measures every row")


def _mean_over_sites(result: Dict[str, Any], step: int, key: str) -> float:
    summary = result["steps"].get(step)
    values = [_cell(summary, site, key) for site in (summary.sites if summary else [])]
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def _max_over_sites(result: Dict[str, Any], step: int, key: str) -> float:
    summary = result["steps"].get(step)
    values = [_cell(summary, site, key) for site in (summary.sites if summary else [])]
    values = [v for v in values if not math.isnan(v)]
    return max(values) if values else math.nan


#: The two runs: (name, attention scale); ``None`` is SDPA's 1/sqrt(d_k). The names are not
#: scale names (``actual``, ``standard``, ``unscaled``), which TensorBoard shows beside them.
RUNS = (("with-divisor", None), ("no-divisor", 1.0))
WITH, WITHOUT = (name for name, _ in RUNS)
#: What the reading calls saturated rows, collapsed and spread attention (head means, at the model's scale).
COLLAPSED, SPREAD = 0.1, 0.5


def _window_mean(losses: List[float], start: int, stop: int) -> float:
    part = losses[max(0, start):max(0, stop)]
    return sum(part) / len(part) if part else math.nan


def verdict(summary: probe.Summary) -> Dict[str, Any]:
    """The run against ``probe check``'s default thresholds (``logit_max < 100``, ``nonfinite <= 0``):
    ``ok``, ``violations`` (how many heads break one), ``thresholds`` and ``logit_max``, the
    largest max logit of any head over the run, the value ``probe check`` judges."""
    from probe.ci.thresholds import as_thresholds, evaluate

    rules = as_thresholds(None)
    judged = evaluate(summary, rules)
    bad = [v for v in judged if not v.ok]
    maxima = [v.value for v in judged if v.metric == "logit_max" and not math.isnan(v.value)]
    return {"ok": not bad, "violations": len(bad), "thresholds": [str(t) for t in rules],
            "logit_max": max(maxima) if maxima else math.nan}


def facts(results: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Per run, the numbers the reading states: at the first and last probed step (``*_first``,
    ``*_last``) the head means over both layers of entropy, saturation and grad ratio and the
    largest max logit; the loss at the start, its mean over the middle ten and the last ten
    steps; the counting and one-token bounds; the verdict of the default thresholds."""
    out: Dict[str, Dict[str, float]] = {}
    for name, result in results.items():
        first, last = _ends(result)[0], _ends(result)[-1]
        losses = result["losses"]
        middle = len(losses) // 2
        row: Dict[str, Any] = {"first": first, "last": last}
        for key in ("entropy", "saturation", "grad_ratio"):
            row[f"{key}_first"] = _mean_over_sites(result, first, key)
            row[f"{key}_last"] = _mean_over_sites(result, last, key)
        row["logit_max_first"] = _max_over_sites(result, first, "logit_max")
        row["logit_max_last"] = _max_over_sites(result, last, "logit_max")
        row.update(loss_first=result["first_loss"], loss_middle=_window_mean(losses, middle - 5, middle + 5),
                   loss_last=result["loss"], middle=middle, counting=result["counting"], one_token=result["one_token"])
        row["verdict"] = verdict(result["summary"])
        out[name] = row
    return out


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


def _entropy_word(x: float) -> str:
    if math.isnan(x):
        return "not measured"
    return "collapsed onto one token" if x < COLLAPSED else "spread over the tokens" if x > SPREAD else "sharpened"


def _progress(row: Dict[str, Any]) -> str:
    """Where the run's loss ended between the two bounds of its batches: nearer what the current
    token alone scores (attention that sees one token), or nearer what counting scores."""
    nearer_one = abs(row["loss_last"] - row["one_token"]) < abs(row["loss_last"] - row["counting"])
    return "stalls nearer the one-token score" if nearer_one else "nears the counting score"


def _verdict_line(name: str, v: Dict[str, Any]) -> str:
    limit = 100.0  # the default logit_max < 100 (QK-Clip's tau)
    m = v["logit_max"]
    if v["ok"]:
        margin = f", {limit / m:.0f}x below the limit" if m > 0 else ""
        return f"  {name:<12}  PASS  largest max logit {_num(m)}{margin}"
    heads = v["violations"]
    return (f"  {name:<12}  FAIL  largest max logit {_num(m)}, {m / limit:.0f}x the limit "
            f"({heads} head value{'s' if heads != 1 else ''} over a threshold)")


def _ratio_words(ratio: float, first: bool) -> str:
    """``ratio`` (no divisor over 1/sqrt(d_k)) in words."""
    if math.isnan(ratio):
        return "not measured"
    if ratio == 0:  # a saturated softmax passes back exactly 0 in float32
        return "0 (no gradient at all)"
    if ratio < 0.5:
        times = 1 / ratio
        return (f"{times:.0f}" if times < 1e6 else f"{times:.1e}") + "x smaller" + (" than with it" if first else "")
    words = f"{ratio:.2f}x its value with the divisor" if first else f"{ratio:.2f}x"
    return words + (" (not vanished)" if ratio < 0.95 else " (no smaller)")


def reading(results: Dict[str, Dict[str, Any]], d_k: int) -> str:
    """What the two runs show, line by line, from their own numbers (:func:`facts`)."""
    f = facts(results)
    w, o = f[WITH], f[WITHOUT]
    a, b = o["first"], o["last"]
    lines = [
        f"Reading (head means over both layers at the model's own scale; step {a}: before any learning):",
        f"  Saturated rows (99% of the weight on one token): without 1/√{d_k} {_pct(o['saturation_first'])} at step "
        f"{a} and {_pct(o['saturation_last'])} at step {b}; with it {_pct(w['saturation_first'])} and "
        f"{_pct(w['saturation_last'])}.",
        f"  Entropy (1 = weight spread evenly over the tokens so far, 0 = all on one): without the divisor "
        f"{o['entropy_first']:.2f} -> {o['entropy_last']:.3f}, {_entropy_word(o['entropy_last'])}; with it "
        f"{w['entropy_first']:.2f} -> {w['entropy_last']:.2f}, {_entropy_word(w['entropy_last'])}"
        f"{', which counting needs' if w['entropy_last'] > SPREAD else ''}.",
        f"  Max logit (largest head): without the divisor {_num(o['logit_max_first'])} -> {_num(o['logit_max_last'])}; "
        f"with it {_num(w['logit_max_first'])} -> {_num(w['logit_max_last'])}.",
        "  Softmax gradient for the same q, k and upstream gradient (grad ratio): without the divisor it is",
        f"  {_ratio_words(o['grad_ratio_first'], True)} at step {a}",
    ]
    if b != a:
        lines[-1] += f", and {_ratio_words(o['grad_ratio_last'], False)} at step {b}."
    else:
        lines[-1] += "."
    mid = o["middle"]
    if len(results[WITHOUT]["losses"]) >= 20:
        lines.append(f"  Loss at step 0, mean of steps {mid - 5}-{mid + 4}, of the last 10: without the divisor "
                     f"{o['loss_first']:.2f}, {o['loss_middle']:.2f}, {o['loss_last']:.2f}; with it "
                     f"{w['loss_first']:.2f}, {w['loss_middle']:.2f}, {w['loss_last']:.2f}.")
    else:
        lines.append(f"  Loss: without the divisor {o['loss_first']:.2f} -> {o['loss_last']:.2f}, with it "
                     f"{w['loss_first']:.2f} -> {w['loss_last']:.2f} (mean of the last 10 steps).")
    lines.append(f"  On the same batches counting every token so far scores {w['counting']:.2f}, the current token alone "
                 f"{w['one_token']:.2f}: without the divisor the loss {_progress(o)}, with it the loss {_progress(w)}.")
    lines.append("Verdicts of probe check's default thresholds (" + ", ".join(w["verdict"]["thresholds"]) + "):")
    lines += [_verdict_line(name, f[name]["verdict"]) for name in (WITH, WITHOUT)]
    return "\n".join(lines)


def _fresh_dirs(logdir: str, names: List[str]) -> List[str]:
    """``logdir/name`` for each name, or ``logdir/name-N`` with the smallest N free for all of them:
    a new run never writes into a directory that holds an earlier one."""
    def taken(path: str) -> bool:
        return os.path.exists(path) and (not os.path.isdir(path) or bool(os.listdir(path)))

    suffix, n = "", 1
    while any(taken(os.path.join(logdir, name + suffix)) for name in names):
        n += 1
        suffix = f"-{n}"
    return [os.path.join(logdir, name + suffix) for name in names]


def run_demo(steps: int = 100, logdir: str = "runs/demo", out: Optional[TextIO] = None, seed: int = 0) -> Dict[str, Dict[str, Any]]:
    """Train the demo model with the divisor and without, print the comparison."""
    import sys

    out = out or sys.stdout
    config = DemoConfig(steps=steps, seed=seed)
    d_k = config.d_model // config.heads
    probed = len(range(0, steps, config.every))
    threads = torch.get_num_threads()
    print(f"probe demo: the majority task ({config.length} tokens from {config.vocab}; each is a hidden token with "
          f"chance {config.signal:.0%}, noise otherwise; name the hidden token at every position),\n"
          f"  {config.layers} layers, {config.heads} heads, d_k = {d_k}, {steps} steps per run, probing every "
          f"{config.every}th ({probed} probed steps), {threads} torch thread{'s' if threads != 1 else ''}", file=out)
    dirs = _fresh_dirs(logdir, [name for name, _ in RUNS])
    if dirs[0] != os.path.join(logdir, RUNS[0][0]):
        print(f"  {logdir} already holds a demo run: this one goes to {dirs[0]} and {dirs[1]} "
              f"(TensorBoard shows both; delete the older ones to see only this)", file=out)
    results: Dict[str, Dict[str, Any]] = {}
    for (name, scale), folder in zip(RUNS, dirs):
        start = time.perf_counter()
        results[name] = train(config, scale, folder)
        label = f"1/√{d_k}" if scale is None else "1 (no divisor)"
        print(f"  {name:<12} scale {label:<15} loss {results[name]['first_loss']:.3f} -> "
              f"{results[name]['loss']:.3f} (mean of the last 10 steps)  "
              f"{time.perf_counter() - start:.1f} s  -> {folder}", file=out)
    print("", file=out)
    print("Per layer and run, at the first and the last probed step, at the model's own scale: head mean (max "
          "logit: head max;\nsoftmax grad: |dL/dlogits|; grad ratio: softmax grad without the divisor ÷ with it, "
          "for the same q, k and upstream gradient;\nsee docs/gradients.md)", file=out)
    print(format_table(results), file=out)
    estimated = _estimate_note(results)
    if estimated:
        print(estimated, file=out)
    print("", file=out)
    print(reading(results, d_k), file=out)
    print("", file=out)
    print(f"See it in TensorBoard:  tensorboard --logdir {logdir} --samples_per_plugin images=100", file=out)
    print("                        (it opens on the group 'attention'; to see step 0, untick Settings >"
          " 'Ignore outliers in chart scaling')", file=out)
    print(f"Judge it as CI would:   probe check {logdir}", file=out)
    return results
