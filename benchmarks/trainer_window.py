"""A sampled training step recorded whole (a window) against one recorded by the root's forward.

The Lightning callback records a sampled training batch with ``Probe.step(n, window=True)``:
everything from ``on_train_batch_start`` to ``on_train_batch_end`` runs under probe's capture mode,
so the backward's Python hooks and the optimizer's own ops pass through it too, where a probe
that captures the root's forward only sees the forward. Here the same training step (the
examples' tiny causal encoder on the copy task: forward, backward, optimizer step) runs bare,
recorded by the root's forward (``p.step(n)``) and recorded whole (``p.step(n, window=True)``),
interleaved round by round; the ratios of the median step times are printed.

Usage::

    python benchmarks/trainer_window.py                    # AdamW, 5 rounds of 30 steps, 1 thread
    python benchmarks/trainer_window.py --optimizer sgd --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

import probe

VOCAB, LENGTH, WIDTH = 32, 32, 64


class TinyLM(nn.Module):
    """examples/lightning_train.py's model, with a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(LENGTH, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(LENGTH - 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids[:, :-1]) + self.position.weight[: LENGTH - 1]
        return self.head(self.encoder(x, mask=self.causal, is_causal=True))


def median_step(model: nn.Module, step: Callable[[], None], mode: str, steps: int) -> float:
    """Median seconds of ``steps`` training steps, every one sampled."""
    p: Optional[probe.Probe] = None if mode == "bare" else probe.watch(model, audit=False)
    times: List[float] = []
    try:
        for n in range(steps):
            start = time.perf_counter()
            if p is not None:
                p.step(n, window=mode == "window")
            step()
            if p is not None:
                p.pause()
            times.append(time.perf_counter() - start)
    finally:
        if p is not None:
            p.close()
    return statistics.median(times)


def main(argv: Optional[List[str]] = None) -> Dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = (torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD)(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (16, LENGTH))

    def step() -> None:
        loss = nn.functional.cross_entropy(model(ids).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    median_step(model, step, "window", 5)  # warm up every path once
    rounds: Dict[str, List[float]] = {"bare": [], "forward": [], "window": []}
    for _ in range(args.rounds):
        for mode in rounds:
            rounds[mode].append(median_step(model, step, mode, args.steps))
    med = {mode: statistics.median(times) for mode, times in rounds.items()}
    ratios = {"forward/bare": med["forward"] / med["bare"], "window/bare": med["window"] / med["bare"],
              "window/forward": med["window"] / med["forward"]}
    print(f"{args.optimizer}, {args.threads} thread(s), {args.rounds} rounds of {args.steps} sampled steps; "
          f"median step: bare {med['bare'] * 1e3:.1f} ms, forward {med['forward'] * 1e3:.1f} ms, "
          f"window {med['window'] * 1e3:.1f} ms")
    print("  ".join(f"{name} {value:.3f}" for name, value in ratios.items()))
    return ratios


if __name__ == "__main__":
    main()
