"""QK-Clip on a run whose max logits explode: the same model trained twice, without and with the clip.

probe's demo transformer (copy task, d_k = 128) trained with Adam at a learning rate high enough
that its attention logits keep growing. The first run only measures the max logit of every head
at every step (``probe.watch(model, every=None, qk_clip=1e9)``: a τ nothing reaches); the second
clips at ``--tau`` (``probe.qk_clip(model, tau)``). The script prints, every few steps, the
largest max logit over the heads and the loss of both runs, then what the clip recorded per
layer: how often each head was clipped and its smallest factor. The clipped run's max logit sits
a little above τ: each step clips the logits its own forward measured to τ, and the next step's
update grows them again (at this learning rate by up to ~1.4x; docs/qk_clip.md)::

    python examples/qk_clip.py                 # 60 steps per run, about a minute on 2 cores
    python examples/qk_clip.py --steps 20 --tau 30
    tensorboard --logdir runs/qk_clip          # qk_clip_logit / qk_clip_factor per step
"""

from __future__ import annotations

import argparse
import os
from typing import List, Tuple

import torch

import probe
from probe.cli.demo import DemoConfig, TinyTransformer, copy_batch, copy_loss
from probe.sinks.base import BaseSink


class MaxLogits(BaseSink):
    """Keeps, per flushed step, the largest max logit over every head of every site."""

    def __init__(self) -> None:
        self.steps: List[Tuple[int, float]] = []

    def write(self, step: int, summary: probe.Summary) -> None:
        top = max(float(summary.value(s, "qk_clip_logit").max()) for s in summary.sites)
        self.steps.append((step, top))


def train(config: DemoConfig, tau: float, logdir: str, clip: bool) -> Tuple[MaxLogits, List[float], probe.Summary]:
    torch.manual_seed(config.seed)
    model = TinyTransformer(config)
    gen = torch.Generator().manual_seed(config.seed + 1)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    sink = MaxLogits()
    losses = []
    with probe.qk_clip(model, tau if clip else 1e9, logdir=logdir, sinks=[sink]) as p:
        for _ in range(config.steps):
            loss = copy_loss(model, copy_batch(config, gen), config.length)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()  # the clip runs here, from this step's max logits
            losses.append(loss.item())
    return sink, losses, p.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tau", type=float, default=50.0)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--logdir", default=os.path.join("runs", "qk_clip"))
    args = parser.parse_args()
    config = DemoConfig(task="copy", length=12, steps=args.steps, lr=args.lr, d_model=128, batch=16)
    free, free_loss, _ = train(config, args.tau, os.path.join(args.logdir, "free"), clip=False)
    capped, capped_loss, summary = train(config, args.tau, os.path.join(args.logdir, "clipped"), clip=True)
    print(f"max logit over all heads (τ = {args.tau:g})")
    print(f"{'step':>6}{'no clip':>12}{'loss':>9}{'qk_clip':>12}{'loss':>9}")
    for (step, a), (_, b) in list(zip(free.steps, capped.steps))[:: max(1, args.steps // 12)]:
        print(f"{step:>6}{a:>12.1f}{free_loss[step]:>9.3f}{b:>12.1f}{capped_loss[step]:>9.3f}")
    print(f"largest over the run: {max(a for _, a in free.steps):.1f} without the clip, "
          f"{max(b for _, b in capped.steps):.1f} with it")
    for site in summary.sites:
        steps = summary.value(site, "qk_clip_steps").astype(int).tolist()
        factor = summary.value(site, "qk_clip_factor")
        print(f"{site}: steps clipped per head {steps}, smallest factor {factor.min():.3f}; "
              f"{summary.info(site)['qk_clip']}")


if __name__ == "__main__":
    main()
