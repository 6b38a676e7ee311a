"""A timm-style attention block (timm itself cannot be installed beside this torch build).

Mirrors ``timm.layers.Attention`` / ``timm.models.vision_transformer.Attention``: a fused path
through ``F.scaled_dot_product_attention`` without ``scale=`` (so SDPA's default ``1/sqrt(d)``
applies) and an eager path that scales q *before* the product, ``q = q * self.scale;
attn = q @ k.transpose(-2, -1)``, switched by the ``fused_attn`` attribute, as timm does.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 4, qkv_bias: bool = True) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = True
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            if attn_mask is not None:
                attn = attn + attn_mask
            attn = attn.softmax(dim=-1)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """Patch tokens in, pooled features out: two timm-style blocks."""

    def __init__(self, dim: int = 32, depth: int = 2, num_heads: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def set_fused_attn(self, fused: bool) -> None:
        for m in self.modules():
            if isinstance(m, Attention):
                m.fused_attn = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x))
