"""Ablation of the 1/sqrt(d_k) divisor on a small transformer with d_k = 256, on CPU.

Three runs of the same model (probe's demo transformer: copy task, pre-LN, unit-variance q and k
at initialisation), same seed, same batches:

- ``scaled``: the model as built, SDPA's default scale 1/sqrt(256) = 0.0625;
- ``unscaled``: the same model trained entirely inside ``probe.scaling(model, "unscaled")``;
- ``headwise``: the unscaled model with ``probe.variants.headwise``: a learnable scale per head,
  starting at 1 (no divisor); does training find its way back to a small scale?

Each run logs to TensorBoard (``runs/scaling_ablation/<run>``) and the script prints, per layer,
entropy, saturation and ``grad_logits`` at the scale the run used, the loss, and the learned
scales::

    python examples/scaling_ablation.py            # ~300 steps per run, a few minutes on 2 cores
    python examples/scaling_ablation.py --steps 50
    tensorboard --logdir runs/scaling_ablation
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Dict, List, Optional

import torch

import probe
from probe.cli.demo_model import DemoConfig, TinyTransformer, copy_batch, copy_loss

RUNS = ("scaled", "unscaled", "headwise")
COLUMNS = ("entropy", "saturation", "grad_logits")


def train(name: str, config: DemoConfig, logdir: str, every: int) -> Dict[str, object]:
    torch.manual_seed(config.seed)
    model = TinyTransformer(config, scale=1.0 if name == "headwise" else None)
    gen = torch.Generator().manual_seed(config.seed + 1)
    variant = None
    if name == "headwise":  # install before watching: its discovery forward is not a probe step
        variant = probe.variants.headwise(model, example=copy_batch(config, gen)[:, :-1])
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr)  # includes the variant's scales
    override = probe.scaling(model, "unscaled") if name == "unscaled" else contextlib.nullcontext()
    losses: List[torch.Tensor] = []
    with probe.watch(model, logdir=os.path.join(logdir, name), every=every) as p, override:
        for _ in range(config.steps):
            loss = copy_loss(model, copy_batch(config, gen), config.length)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    result: Dict[str, object] = {
        "first": losses[0].item(),
        "loss": torch.stack(losses[-10:]).mean().item(),
        "summary": p.summary(),
        "scales": variant.scales() if variant is not None else None,
    }
    return result


def _cell(summary: probe.Summary, site: str, metric: str) -> float:
    if metric not in summary.metrics(site):
        return float("nan")
    values = summary.value(site, metric)
    return float(values.mean()) if metric != "grad_logits" else float((values**2).sum() ** 0.5)


def format_table(results: Dict[str, Dict[str, object]]) -> str:
    names = list(results)
    width = 12 * len(COLUMNS)
    head = f"{'layer':<16}" + "".join(f"| {n:^{width}} " for n in names)
    sub = f"{'':<16}" + "".join("| " + "".join(f"{c:>12}" for c in COLUMNS) + " " for _ in names)
    lines = [head, sub, "-" * len(sub)]
    first = results[names[0]]["summary"]
    assert isinstance(first, probe.Summary)
    for site in first.sites:
        row = f"{site:<16}"
        for n in names:
            s = results[n]["summary"]
            assert isinstance(s, probe.Summary)
            row += "| " + "".join(f"{_cell(s, site, c):>12.4g}" for c in COLUMNS) + " "
        lines.append(row)
    lines.append("-" * len(sub))
    lines.append(f"{'loss first/last':<16}" + "".join(
        f"| {results[n]['first']:>{width // 2}.3f}{results[n]['loss']:>{width - width // 2}.3f} " for n in names))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict[str, Dict[str, object]]:
    parser = argparse.ArgumentParser(description="Train with and without the 1/sqrt(d_k) divisor (d_k = 256).")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--every", type=int, default=10, help="probe one step in N (default 10)")
    parser.add_argument("--logdir", default="runs/scaling_ablation")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = DemoConfig(task="copy", length=12, d_model=256, heads=1, layers=2, steps=args.steps, batch=args.batch,
                        seed=args.seed)
    print(f"copy task, {config.layers} layers, 1 head, d_k = 256, {args.steps} steps per run, "
          f"probing every {args.every}; values are means over probed steps, at each run's own scale")
    results: Dict[str, Dict[str, object]] = {}
    for name in RUNS:
        start = time.perf_counter()
        results[name] = train(name, config, args.logdir, args.every)
        print(f"  {name:<9} loss {results[name]['first']:.3f} -> {results[name]['loss']:.3f} "
              f"({time.perf_counter() - start:.0f} s)")
    print()
    print(format_table(results))
    learned = results["headwise"]["scales"]
    assert isinstance(learned, dict)
    print("\nlearned per-head scales (headwise, started at 1.0; the divisor would be 0.0625): " +
          ", ".join(f"{site} {t.tolist()[0]:.4f}" for site, t in learned.items()))
    print(f"TensorBoard: tensorboard --logdir {args.logdir}")
    return results


if __name__ == "__main__":
    main()
