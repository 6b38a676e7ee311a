"""Attention patterns of real timm models (the real-timm sweep), written by hand so that the tests
run without timm: each must be found in every block, named, verified against the model's own
probabilities and have grad_q / grad_k / grad_v after a backward.

timm's ``Attention2d`` (CoAtNet, MaxViT's conv-attention ``fused_attn=False`` path) keeps q, k, v
channels-first, ``(B, H, d, N)``: ``attn = q.transpose(-2, -1) @ k``, ``x = v @ attn.transpose(-2, -1)``,
then a 1x1 ``Conv2d`` projection. Before: the first block lacked grad_v, and every later block
was missed (the product ``v @ Pᵀ`` was not taken as ``P·v``; its output stayed "derived from
scores" through the convolutions and the residual, so no later q·kᵀ started scores).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn

import probe
from probe.session.coverage import coverage

HEADS, DIM = 2, 16


class Attention2d(nn.Module):
    """timm ``maxxvit.Attention2d``, eager path (keeps its probabilities for the oracle)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.dim_head = HEADS, DIM // HEADS
        self.scale = self.dim_head ** -0.5
        self.qkv = nn.Conv2d(DIM, DIM * 3, 1)
        self.proj = nn.Conv2d(DIM, DIM, 1)
        self.probs: Tensor = torch.empty(0)

    def forward(self, x: Tensor) -> Tensor:
        b, _, h, w = x.shape
        q, k, v = self.qkv(x).view(b, self.num_heads, self.dim_head * 3, -1).chunk(3, dim=2)
        q = q * self.scale
        attn = (q.transpose(-2, -1) @ k).softmax(dim=-1)
        self.probs = attn.detach().double()
        return self.proj((v @ attn.transpose(-2, -1)).view(b, -1, h, w))


class Net(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention2d() for _ in range(blocks))
        self.norm = nn.BatchNorm2d(DIM)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = self.norm(x + block(x))
        return x


def test_channels_first_attention_every_block_with_grad_v() -> None:
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, DIM, 4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = coverage(model, x)
    rows = {r.site: r for r in report.rows}
    assert sorted(rows) == ["blocks.0", "blocks.1", "blocks.2"]
    for row in rows.values():
        assert row.captured, row.why
        assert row.verified is True, row.verification
        assert abs(row.scale - (DIM // HEADS) ** -0.5) < 1e-9
        assert {"grad_q", "grad_k", "grad_v"} <= set(row.grads)


def test_channels_first_attention_values_and_bitwise_outputs() -> None:
    torch.manual_seed(0)
    model = Net().train()
    twin = Net().train()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(2, DIM, 4, 4)
    out = model(x)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    with probe.watch(twin, every=1, rows=None) as p:
        out2 = twin(x)
        grads2 = torch.autograd.grad(out2.square().sum(), list(twin.parameters()))
    assert torch.equal(out, out2)
    assert all(torch.equal(g, g2) for g, g2 in zip(grads, grads2))
    summary = p.summary()
    for i, block in enumerate(twin.blocks):
        probs = block.probs
        ent = -(probs * probs.clamp_min(1e-300).log()).sum(-1) / math.log(probs.shape[-1])
        got = summary.value(f"blocks.{i}", "entropy", "actual").mean()
        assert abs(float(got) - float(ent.mean())) < 1e-5
        assert abs(float(summary.value(f"blocks.{i}", "max_prob", "actual").mean()) - float(probs.amax(-1).mean())) < 1e-5
        assert "grad_v" in summary.metrics(f"blocks.{i}")
