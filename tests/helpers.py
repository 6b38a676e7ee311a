"""Shared tiny models and the independent float64 reference for the tests."""

from __future__ import annotations

import math
import os
import socket
import sys
from typing import Dict, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


# -- tiny models ------------------------------------------------------------------------------
class SDPAAttention(nn.Module):
    """A custom module calling F.scaled_dot_product_attention (optionally GQA / causal)."""

    def __init__(self, d_model: int = 64, heads: int = 4, kv_heads: Optional[int] = None,
                 causal: bool = False, scale: Optional[float] = None) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.d = d_model // heads
        self.q = nn.Linear(d_model, heads * self.d)
        self.kv = nn.Linear(d_model, 2 * self.kv_heads * self.d)
        self.o = nn.Linear(heads * self.d, d_model)
        self.causal, self.scale = causal, scale

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.d).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=self.causal, scale=self.scale,
            enable_gqa=self.kv_heads != self.heads,
        )
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


class OneCall(nn.Module):
    """Issues exactly one SDPA call with fixed tensors and keyword arguments."""

    def __init__(self, q, k, v, **kwargs) -> None:
        super().__init__()
        self.args, self.kwargs = (q, k, v), kwargs

    def forward(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(*self.args, **self.kwargs)


class SDPAModel(nn.Module):
    def __init__(self, layers: int = 2, d_model: int = 64, heads: int = 4, **kw) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SDPAAttention(d_model, heads, **kw) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(self.norm(x), mask)
        return x


def tiny_bert(attn: str = "sdpa"):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, attn_implementation=attn)
    return BertModel(config).eval()


def tiny_llama(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation=attn)
    return LlamaForCausalLM(config).eval()


# -- model bookkeeping ----------------------------------------------------------------------
def module_state(model: nn.Module):
    """Every module's attribute names and a copy of its state_dict: to prove nothing changed."""
    return [(name, sorted(vars(m)), {k: v.clone() for k, v in m.state_dict().items()})
            for name, m in model.named_modules()]


def hook_count(model: nn.Module) -> int:
    """Forward, forward-pre and backward hooks registered on the model's modules."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


# -- the float64 reference, written plainly --------------------------------------------------
def reference_metrics(
    q: torch.Tensor, k: torch.Tensor, scale: float, valid: torch.Tensor,
    bias: Optional[torch.Tensor] = None, tau: float = 0.99, softcap: Optional[float] = None,
) -> Dict[str, np.ndarray]:
    """Per-head metrics by their textbook definitions, in float64 numpy, loops over rows.

    ``valid`` is a full (B, H, L, S) boolean array; ``bias`` a full (B, H, L, S) float array
    (values at invalid entries are ignored).
    """
    q64 = q.detach().double().numpy()
    k64 = k.detach().double().numpy()
    b_, h_, l_, _ = q64.shape
    groups = h_ // k64.shape[1]
    k64 = np.repeat(k64, groups, axis=1)
    valid = np.broadcast_to(valid.numpy(), (b_, h_, l_, k64.shape[2]))
    bias64 = None if bias is None else np.broadcast_to(bias.detach().double().numpy(), valid.shape)
    out = {m: np.full(h_, np.nan) for m in ("logit_var", "logit_max", "entropy", "max_prob", "saturation")}
    out["nonfinite"] = np.zeros(h_)
    for h in range(h_):
        logits = []
        ent, maxp, sat = [], [], []
        for b in range(b_):
            for i in range(l_):
                keys = np.nonzero(valid[b, h, i])[0]
                if keys.size == 0:
                    continue
                r = np.array([scale * q64[b, h, i] @ k64[b, h, j] for j in keys])
                logits.extend(r.tolist())
                if keys.size < 2:
                    continue
                z = r if softcap is None else softcap * np.tanh(r / softcap)
                if bias64 is not None:
                    z = z + bias64[b, h, i, keys]
                p = np.exp(z - z.max())
                p = p / p.sum()
                nz = p[p > 0]
                ent.append(-(nz * np.log(nz)).sum() / math.log(keys.size))
                maxp.append(p.max())
                sat.append(float(p.max() >= tau))
        if logits:
            arr = np.array(logits)
            out["logit_var"][h] = arr.var()
            out["logit_max"][h] = arr.max()
        if ent:
            out["entropy"][h] = np.mean(ent)
            out["max_prob"][h] = np.mean(maxp)
            out["saturation"][h] = np.mean(sat)
    return out


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a multi-process rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def masked_logits64(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
                    key_mask: Optional[torch.Tensor] = None):
    """``(z, valid)``: float64 logits ``scale·q·kᵀ`` (kv heads repeated for GQA) and the keys each
    row may attend to (causal and ``key_mask``), the independent reference the row tests share."""
    k64 = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    z = scale * q.double() @ k64.transpose(-1, -2)
    b, h, l, s = z.shape
    valid = torch.ones(b, h, l, s, dtype=torch.bool)
    if causal:
        valid &= torch.ones(l, s, dtype=torch.bool).tril()
    if key_mask is not None:
        valid &= key_mask
    return z, valid


def leave() -> None:
    """Exit 0 without the interpreter's teardown, once the rank's report is written.

    With the group destroyed, the teardown still aborted rank 1 now and then (SIGABRT, exit -6,
    "terminate called without an active exception", no Python frame: a C++ thread of the
    distributed runtime destroyed at exit), failing a run whose work was done and checked.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def watched_once(model: nn.Module, *inputs, **watch_kwargs):
    """One forward of ``model`` under ``probe.watch``: ``(probe, output, warning messages)``, the
    output checked bitwise against the same forward unwatched (what probe must never change)."""
    import warnings

    import probe

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, **watch_kwargs) as p:
            out = model(*inputs)
    assert torch.equal(out, model(*inputs))
    return p, out, [str(w.message) for w in caught]

