"""Send probe's statistics somewhere of your own: a sink is one class with ``write``.

Run: ``python examples/custom_sink.py``. It trains a tiny attention model for a few steps with
three sinks at once: TensorBoard (``logdir=``), the shipped JSON Lines sink, and a user sink that
prints the heads whose attention has collapsed (normalised entropy below 0.1).

A Weights & Biases adapter is the same few lines (wandb is not a dependency of probe)::

    from probe.sinks.base import BaseSink, head_scalars

    class WandbSink(BaseSink):
        def __init__(self, run):
            self.run = run
        def write(self, step, summary):
            self.run.log(dict(head_scalars(summary)), step=step)

    probe.watch(model, sinks=[WandbSink(wandb.init(project="attention"))])
"""

from __future__ import annotations

import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import probe
from probe.sinks.base import BaseSink
from probe.sinks.jsonl import JSONLSink


class CollapsedHeads(BaseSink):
    """Prints, at each flush, the heads whose normalised entropy at the model's scale is below
    ``threshold`` (attention concentrated on about one key)."""

    def __init__(self, threshold: float = 0.1) -> None:
        self.threshold = threshold

    def write(self, step: int, summary: probe.Summary) -> None:
        for site in summary.sites:
            entropy = summary.value(site, "entropy")  # one value per head, NaN if nothing valid
            low = [h for h, e in enumerate(entropy) if e < self.threshold]
            if low:
                print(f"step {step}: site {site!r} heads {low} collapsed (entropy {entropy.round(3).tolist()})")


class Attention(nn.Module):
    def __init__(self, d_model: int = 64, heads: int = 4, scale: float = 1.0) -> None:
        super().__init__()
        self.heads, self.scale = heads, scale  # scale 1.0: no 1/sqrt(d_k) divisor
        self.qkv = nn.Linear(d_model, 3 * d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return y.transpose(1, 2).reshape(b, n, d)


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Attention(), Attention())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logdir = tempfile.mkdtemp(prefix="probe-custom-sink-")
    with probe.watch(model, logdir=logdir, sinks=[JSONLSink(f"{logdir}/probe.jsonl"), CollapsedHeads()]) as p:
        for _ in range(5):
            loss = model(torch.randn(8, 16, 64) * 4).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    print(f"TensorBoard: tensorboard --logdir {logdir}")
    print(f"JSON Lines:  {logdir}/probe.jsonl ({sum(1 for _ in open(f'{logdir}/probe.jsonl'))} records)")
    print(p.summary())


if __name__ == "__main__":
    main()
