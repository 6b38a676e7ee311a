"""``probe demo``: a small transformer trained with and without the 1/sqrt(d_k) divisor.

The model is a pre-LN causal transformer that uses ``F.scaled_dot_product_attention``; its
projections are initialised so that q and k have unit variance, the setting of the scaling
argument: the dot products then have variance d_k, which the divisor brings back to 1. The task
is copying a random sequence (``a1 .. an SEP a1 .. an``), which needs attention to work.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, TextIO

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import probe

__all__ = ["DemoConfig", "TinyTransformer", "copy_batch", "run_demo", "train"]


@dataclass
class DemoConfig:
    vocab: int = 16
    length: int = 12  # tokens to copy; a sequence is 2 * length + 1 long
    d_model: int = 256
    heads: int = 2  # d_k = 128: large enough for the unscaled logits to saturate
    layers: int = 2
    batch: int = 32
    steps: int = 200
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


def train(config: DemoConfig, scale: Optional[float], logdir: Optional[str]) -> Dict[str, object]:
    """Train one model under probe; returns its final loss and probe summary."""
    torch.manual_seed(config.seed)
    model = TinyTransformer(config, scale)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr)
    gen = torch.Generator().manual_seed(config.seed + 1)
    losses: List[float] = []
    with probe.watch(model, logdir=logdir, every=config.every) as p:
        for _ in range(config.steps):
            loss = copy_loss(model, copy_batch(config, gen), config.length)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    tail = torch.stack(losses[-10:]).mean().item()
    return {"loss": tail, "first_loss": losses[0].item(), "summary": p.summary()}


def _row(summary: probe.Summary, site: str) -> Dict[str, float]:
    entropy = summary.value(site, "entropy")
    return {
        "entropy": float(entropy.mean()),
        "saturation": float(summary.value(site, "saturation").mean()),
        "logit_max": float(summary.value(site, "logit_max").max()),
    }


def format_table(results: Dict[str, Dict[str, object]]) -> str:
    """Side by side, per layer: entropy, saturation, max logit (at the model's own scale)."""
    names = list(results)
    head = f"{'layer':<18}" + "".join(f"| {n:^34} " for n in names)
    sub = f"{'':<18}" + "".join(f"| {'entropy':>9} {'saturat.':>9} {'max logit':>12} " for _ in names)
    lines = [head, sub, "-" * len(sub)]
    first = results[names[0]]["summary"]
    assert isinstance(first, probe.Summary)
    for site in first.sites:
        cells = []
        for n in names:
            s = results[n]["summary"]
            assert isinstance(s, probe.Summary)
            r = _row(s, site)
            cells.append(f"| {r['entropy']:>9.3f} {r['saturation']:>9.3f} {r['logit_max']:>12.1f} ")
        lines.append(f"{site:<18}" + "".join(cells))
    lines.append("-" * len(sub))
    lines.append(f"{'loss (last 10)':<18}" + "".join(f"| {results[n]['loss']:>34.3f} " for n in names))
    return "\n".join(lines)


def run_demo(steps: int = 200, logdir: str = "runs/demo", out: Optional[TextIO] = None, seed: int = 0) -> Dict[str, Dict[str, object]]:
    """Train the demo model with standard scaling and without, print the comparison."""
    import sys

    out = out or sys.stdout
    config = DemoConfig(steps=steps, seed=seed)
    d_k = config.d_model // config.heads
    print(
        f"probe demo: copy task, {config.layers} layers, {config.heads} heads, d_k = {d_k}, "
        f"{steps} steps per run, probing every {config.every}",
        file=out,
    )
    results: Dict[str, Dict[str, object]] = {}
    for name, scale in (("scaled", None), ("unscaled", 1.0)):
        start = time.perf_counter()
        results[name] = train(config, scale, os.path.join(logdir, name))
        label = f"1/sqrt({d_k})" if scale is None else "1 (no divisor)"
        print(f"  {name:<9} scale {label:<15} loss {results[name]['first_loss']:.3f} -> "
              f"{results[name]['loss']:.3f}  ({time.perf_counter() - start:.1f} s)", file=out)
    print("", file=out)
    print(format_table(results), file=out)
    print("", file=out)
    print(f"Without the divisor the logits have variance ~d_k = {d_k} instead of ~1: the softmax saturates.", file=out)
    print(f"See it in TensorBoard:  tensorboard --logdir {logdir}", file=out)
    return results
