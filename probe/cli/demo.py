"""``probe demo``: a small transformer trained with and without the 1/sqrt(d_k) divisor.

The model is a pre-LN causal transformer that uses ``F.scaled_dot_product_attention``; its
projections are initialised so that q and k have unit variance, the setting of the scaling
argument: the dot products then have variance d_k, which the divisor brings back to 1. The task
is copying a random sequence (``a1 .. an SEP a1 .. an``), which needs attention to work.

Each run writes its training loss (``loss/train``) beside probe's scalars in its own TensorBoard
run directory; a directory that already holds a run is never written into again (``scaled-2``,
``unscaled-2``, ... are used instead), so TensorBoard never mixes two runs' steps.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, TextIO

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import probe
from probe.names import printable
from probe.sinks.base import BaseSink
from probe.metrics import head_reduce

__all__ = ["DemoConfig", "TinyTransformer", "copy_batch", "format_table", "run_demo", "train"]


@dataclass
class DemoConfig:
    vocab: int = 16
    length: int = 12  # tokens to copy; a sequence is 2 * length + 1 long
    d_model: int = 256
    heads: int = 2  # d_k = 128: large enough for the unscaled logits to saturate
    layers: int = 2
    batch: int = 32
    steps: int = 100  # the scaled run has learned the copy by step ~20; the unscaled one stalls near loss 2
    lr: float = 3e-3
    every: int = 5
    seed: int = 0


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, scale: Optional[float]) -> None:
        super().__init__()
        self.heads = heads
        self.scale = scale  # None: SDPA's default 1/sqrt(d_k)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        nn.init.normal_(self.qkv.weight, std=d_model**-0.5)  # unit-variance q, k, v
        nn.init.normal_(self.out.weight, std=d_model**-0.5)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, scale: Optional[float]) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads, scale)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A causal transformer small enough to train on 2 CPU cores in seconds.

    Args:
        scale: the attention scale; ``None`` is SDPA's ``1/sqrt(d_k)``, ``1.0`` is unscaled.
    """

    def __init__(self, config: DemoConfig, scale: Optional[float] = None) -> None:
        super().__init__()
        n = 2 * config.length + 1
        self.embed = nn.Embedding(config.vocab + 1, config.d_model)
        self.pos = nn.Parameter(torch.randn(n, config.d_model))
        self.blocks = nn.ModuleList(Block(config.d_model, config.heads, scale) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab + 1)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def copy_batch(config: DemoConfig, generator: torch.Generator) -> Tensor:
    """Random ``a1 .. an SEP a1 .. an`` sequences (SEP is token ``vocab``)."""
    a = torch.randint(0, config.vocab, (config.batch, config.length), generator=generator)
    sep = torch.full((config.batch, 1), config.vocab)
    return torch.cat([a, sep, a], dim=1)


def copy_loss(model: nn.Module, tokens: Tensor, length: int) -> Tensor:
    """Cross-entropy on the copied half only (the first half is unpredictable)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits[:, length:].reshape(-1, logits.shape[-1]), tokens[:, length + 1 :].reshape(-1))


class _Steps(BaseSink):
    """Keeps the flush of each probed step (the demo flushes every probed step)."""

    def __init__(self) -> None:
        self.by_step: Dict[int, probe.Summary] = {}

    def write(self, step: int, summary: probe.Summary) -> None:
        self.by_step[step] = summary


def train(config: DemoConfig, scale: Optional[float], logdir: Optional[str]) -> Dict[str, Any]:
    """Train one model under probe, logging its loss beside probe's scalars.

    Returns:
        ``loss`` (mean of the last 10 steps), ``first_loss``, ``summary`` (the run's
        :class:`probe.Summary`) and ``steps`` (probed step -> that step's :class:`probe.Summary`).
    """
    torch.manual_seed(config.seed)
    model = TinyTransformer(config, scale)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr)
    gen = torch.Generator().manual_seed(config.seed + 1)
    losses: List[Tensor] = []
    writer = None
    if logdir is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=logdir)
    steps = _Steps()
    try:
        with probe.watch(model, logdir=writer, every=config.every, sinks=[steps]) as p:
            for step in range(config.steps):
                loss = copy_loss(model, copy_batch(config, gen), config.length)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
                if writer is not None:
                    writer.add_scalar("loss/train", loss.item(), step)
    finally:
        if writer is not None:
            writer.close()
    tail = torch.stack(losses[-10:]).mean().item()
    return {"loss": tail, "first_loss": losses[0].item(), "summary": p.summary(), "steps": steps.by_step}


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
    """A few lines that read the difference between the runs, from the numbers (not a script)."""
    scaled, unscaled = results["scaled"], results["unscaled"]
    first, last = _ends(scaled)[0], _ends(unscaled)[-1]
    e_s, e_u = (_mean_over_sites(r, first, "entropy") for r in (scaled, unscaled))
    s_s, s_u = (_mean_over_sites(r, first, "saturation") for r in (scaled, unscaled))
    r_first, r_last = (_mean_over_sites(unscaled, step, "grad_ratio") for step in (first, last))
    m_last = max(_cell(unscaled["steps"].get(last), site, "logit_max") for site in unscaled["summary"].sites)
    lines = [
        f"Reading: at step {first}, before any learning, attention entropy is {e_u:.2f} without 1/√{d_k} and "
        f"{e_s:.2f} with it;",
        f"  {s_u:.0%} of rows are saturated without it, {s_s:.0%} with it.",
        f"  Softmax gradient for the same q, k and upstream gradient (grad ratio): without the divisor it is",
        f"  {_ratio_words(r_first, True)} at step {first}",
    ]
    if last != first:
        lines[-1] += f", and {_ratio_words(r_last, False)} at step {last} (max logit {m_last:,.0f})."
    else:
        lines[-1] += "."
    lines.append(f"  Loss {unscaled['first_loss']:.3f} -> {unscaled['loss']:.3f} without the divisor, "
                 f"{scaled['first_loss']:.3f} -> {scaled['loss']:.3f} with it.")
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
    """Train the demo model with standard scaling and without, print the comparison."""
    import sys

    out = out or sys.stdout
    config = DemoConfig(steps=steps, seed=seed)
    d_k = config.d_model // config.heads
    probed = len(range(0, steps, config.every))
    print(f"probe demo: copy task, {config.layers} layers, {config.heads} heads, d_k = {d_k}, {steps} steps per run, "
          f"probing every {config.every}th ({probed} probed steps)", file=out)
    runs = [("scaled", None), ("unscaled", 1.0)]
    dirs = _fresh_dirs(logdir, [name for name, _ in runs])
    if dirs[0] != os.path.join(logdir, "scaled"):
        print(f"  {logdir} already holds a demo run: this one goes to {dirs[0]} and {dirs[1]} "
              f"(TensorBoard shows both; delete the older ones to see only this)", file=out)
    results: Dict[str, Dict[str, Any]] = {}
    for (name, scale), folder in zip(runs, dirs):
        start = time.perf_counter()
        results[name] = train(config, scale, folder)
        label = f"1/√{d_k}" if scale is None else "1 (no divisor)"
        print(f"  {name:<9} scale {label:<15} loss {results[name]['first_loss']:.3f} -> "
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
    print(f"See it in TensorBoard:  tensorboard --logdir {logdir} --samples_per_plugin images=100", file=out)
    print("                        (in its Settings, untick 'Ignore outliers in chart scaling' to see step 0)", file=out)
    print(f"Judge it as CI would:   probe check {logdir}", file=out)
    return results
