"""Shared by the QK-Clip tests: an independent max-logit reference, per attention module, and tiny models.

The reference reads the q, k and mask that reach ``F.scaled_dot_product_attention`` (a test-local
``TorchFunctionMode``, nothing of probe's), repeats kv heads for GQA and takes the max of
``scale·q·kᵀ`` over the valid entries in float64. Eager models are measured through their SDPA
twin (the same weights): the logits are the same numbers.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


class GrabSDPA(TorchFunctionMode):
    """Records every SDPA call: its float64 max logit per head and its output."""

    def __init__(self) -> None:
        super().__init__()
        self.tops: List[torch.Tensor] = []
        self.outputs: List[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            bound = {**dict(zip(names, args)), **kwargs}
            self.tops.append(max_logit64(bound["query"], bound["key"], bound.get("scale"), bound.get("attn_mask"),
                                         bool(bound.get("is_causal", False))))
            self.outputs.append(out.detach().clone())
        return out


def max_logit64(q, k, scale=None, mask=None, causal=False) -> torch.Tensor:
    """Per head, max over valid (b, i, j) of scale·q_i·k_j in float64 (kv heads repeated)."""
    q64, k64 = q.detach().double(), k.detach().double()
    if q64.dim() == 3:
        q64, k64 = q64.unsqueeze(1), k64.unsqueeze(1)
    k64 = k64.repeat_interleave(q64.shape[1] // k64.shape[1], 1)
    scale = 1 / math.sqrt(q64.shape[-1]) if scale is None else scale
    z = scale * q64 @ k64.transpose(-1, -2)
    valid = torch.ones(z.shape, dtype=torch.bool)
    if mask is not None:
        valid &= (mask if mask.dtype == torch.bool else mask > -100).expand(z.shape)
    if causal:
        valid &= torch.ones(z.shape[-2:], dtype=torch.bool).tril()
    return z.masked_fill(~valid, -math.inf).amax((0, 2, 3))


class ModuleInputs:
    """Keeps the inputs of the given modules in one forward, to run each alone again later."""

    def __init__(self, modules: Dict[str, nn.Module]) -> None:
        self.modules = modules
        self.inputs: Dict[str, Tuple[Any, Any]] = {}
        self._handles = [m.register_forward_pre_hook(self._hook(name), with_kwargs=True) for name, m in modules.items()]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            self.inputs.setdefault(name, (args, kwargs))
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def measure(self, modules: Optional[Dict[str, nn.Module]] = None) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        """Per module: (max logit per head, SDPA output) of the module alone on its kept inputs."""
        out = {}
        for name, module in (modules or self.modules).items():
            args, kwargs = self.inputs[name]
            grab = GrabSDPA()
            with torch.no_grad(), grab:
                module(*args, **kwargs)
            assert len(grab.tops) == 1, f"{name}: {len(grab.tops)} SDPA calls"
            out[name] = (grab.tops[0], grab.outputs[0])
        return out


# -- tiny models beyond tests/helpers ----------------------------------------------------------------
class NanoAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: one fused c_attn, split, flash (SDPA) or the manual path."""

    def __init__(self, n_embd: int = 32, n_head: int = 4, block_size: int = 16, flash: bool = True) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.flash = n_head, n_embd, flash
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = 64, n_embd: int = 32, n_layer: int = 2, n_head: int = 4,
                 flash: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(16, n_embd)
        self.h = nn.ModuleList(nn.ModuleDict({"ln_1": nn.LayerNorm(n_embd),
                                              "attn": NanoAttention(n_embd, n_head, flash=flash),
                                              "ln_2": nn.LayerNorm(n_embd),
                                              "mlp": nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                                                   nn.Linear(4 * n_embd, n_embd))})
                               for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def set_flash(self, flash: bool) -> None:
        for block in self.h:
            block["attn"].flash = flash

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = x + block["attn"](block["ln_1"](x))
            x = x + block["mlp"](block["ln_2"](x))
        return self.lm_head(self.ln_f(x))
