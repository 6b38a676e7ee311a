"""Attention stability checks for CI, with probe's pytest plugin.

Copy this file into your tests and the ``[tool:probe]`` section of ``setup.cfg`` (beside it) into
your repository's ``setup.cfg``; replace ``build_model`` / ``batch`` / ``train_step`` with your own.
Run here with ``python -m pytest examples/ci -q``. See docs/ci.md.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe


# -- replace with your model, a real batch and your loss ------------------------------------------
class Block(nn.Module):
    def __init__(self, d_model: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale: 1/sqrt(d_k)
        return x + self.out(y.transpose(1, 2).reshape(b, n, d))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, d_model: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model) for _ in range(layers))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM()


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))


def train_step(model: nn.Module, ids: torch.Tensor) -> None:
    logits = model(ids[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()


# -- the checks ------------------------------------------------------------------------------------
def test_attention_is_stable(attention_probe):
    """Thresholds from [tool:probe] in setup.cfg (or logit_max < 100, nonfinite <= 0)."""
    model = build_model()
    with attention_probe(model):
        train_step(model, batch())


@pytest.mark.probe(thresholds=["logit_max < 30", "blocks.*:entropy@actual > 0.5", "saturation <= 0.1"])
def test_stricter_limits_for_one_test(attention_probe):
    """A marker overrides the config for one test: tighter limits, and no saturated rows."""
    model = build_model()
    with attention_probe(model):
        train_step(model, batch())


@pytest.mark.xfail(raises=probe.StabilityError, strict=True, reason="demonstration: delete when copying")
def test_a_collapsed_head_fails(attention_probe):
    """What a failure looks like: head 2 of blocks.1 with grown query/key weights, as in the
    attention-logit growth of unstable runs; its max logit passes 100 despite 1/sqrt(d_k)."""
    model = build_model()
    with torch.no_grad():
        rows = torch.arange(2 * 16, 3 * 16)  # head 2 of the 4 heads of d_k = 16
        model.blocks[1].qkv.weight[rows] *= 10.0           # queries
        model.blocks[1].qkv.weight[64 + rows] *= 10.0      # keys
    with attention_probe(model):
        train_step(model, batch())
