"""The demo's model and tasks: a small pre-LN causal transformer over SDPA, the majority task
``probe demo`` trains it on, and the copy task of ``examples/scaling_ablation.py``.

The projections are initialised so that q and k have unit variance, the setting of the scaling
argument: the dot products then have variance d_k, which the divisor brings back to 1.

**The majority task.** Each sequence has a hidden token; each of its ``length`` tokens is the hidden
one with chance ``signal`` (30 %) and a uniform draw from the 16-token vocabulary otherwise; at every
position the model names the hidden token. The best answer counts how often each token has appeared
so far (:func:`majority_bound`), so a healthy head spreads its attention over the whole prefix; a
head that puts all its weight on one token sees one noisy sample. The task was chosen for the demo
because its healthy run keeps its attention spread and its logits small however long it trains,
while the run without the divisor saturates from step 0 (a copy task instead rewards one-hot
attention, and its healthy run's logits grow past ``probe check``'s default limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DemoConfig", "TinyTransformer", "copy_batch", "copy_loss", "majority_batch", "majority_bound",
           "majority_loss"]


@dataclass
class DemoConfig:
    """The demo's model and task. ``task="majority"`` is the demo's; ``"copy"`` (copying
    ``a1 .. an SEP a1 .. an``, which rewards one-hot attention) is kept for
    ``examples/scaling_ablation.py``."""

    task: str = "majority"
    vocab: int = 16
    length: int = 24  # majority: tokens per sequence; copy: tokens to copy (a sequence is 2 * length + 1)
    signal: float = 0.3  # majority: chance that a position holds the hidden token (else a uniform draw)
    d_model: int = 256
    heads: int = 2  # d_k = 128: large enough for the unscaled logits to saturate
    layers: int = 2
    batch: int = 32
    steps: int = 100
    lr: float = 3e-3
    every: int = 5
    seed: int = 0

    @property
    def positions(self) -> int:
        """The longest sequence the model sees."""
        return 2 * self.length + 1 if self.task == "copy" else self.length

    @property
    def classes(self) -> int:
        """Output classes: the tokens (and SEP for the copy task)."""
        return self.vocab + 1 if self.task == "copy" else self.vocab


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
        self.embed = nn.Embedding(config.vocab + 1, config.d_model)
        self.pos = nn.Parameter(torch.randn(config.positions, config.d_model))
        self.blocks = nn.ModuleList(Block(config.d_model, config.heads, scale) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.classes)

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


def majority_batch(config: DemoConfig, generator: torch.Generator) -> Tuple[Tensor, Tensor]:
    """``(tokens, hidden)``: per sequence a hidden token, and ``length`` tokens each of which is the
    hidden one with chance ``signal`` and a uniform draw from the vocabulary otherwise."""
    hidden = torch.randint(0, config.vocab, (config.batch,), generator=generator)
    noise = torch.randint(0, config.vocab, (config.batch, config.length), generator=generator)
    keep = torch.rand((config.batch, config.length), generator=generator) < config.signal
    return torch.where(keep, hidden[:, None], noise), hidden


def majority_loss(model: nn.Module, tokens: Tensor, hidden: Tensor) -> Tensor:
    """Cross-entropy of naming the hidden token at every position, from the tokens up to it."""
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), hidden[:, None].expand_as(tokens).reshape(-1))


def majority_bound(config: DemoConfig, tokens: Tensor, hidden: Tensor, window: Optional[int] = None) -> float:
    """The loss of the exact posterior of the hidden token given the last ``window`` tokens up to
    each position (``None``: every token so far), on this batch.

    Each token is the hidden one with probability ``p = signal + (1 - signal) / vocab``, any other
    given one with ``r = (1 - signal) / vocab``, so with a uniform prior ``log P(hidden = j | tokens)
    = n_j · log(p / r) + const``, ``n_j`` the count of ``j`` among them: counting is all it takes,
    and the fewer tokens a position sees, the higher its loss.
    """
    p_hit = config.signal + (1 - config.signal) / config.vocab
    weight = math.log(p_hit / ((1 - config.signal) / config.vocab))
    counts = F.one_hot(tokens, config.vocab).to(torch.float64).cumsum(dim=1)
    if window is not None:
        counts[:, window:] -= counts[:, :-window].clone()
    logp = torch.log_softmax(counts * weight, dim=-1)
    return -logp.gather(-1, hidden[:, None, None].expand(-1, tokens.shape[1], 1)).mean().item()
