"""Every forward and backward statistic of random calls against float64 formulas written here.

Each seed draws a call: batch, heads, grouped-query attention, query and key lengths (1 to 130,
equal or not), head dim, the inputs' size and a mean offset of k (mean-dominated logits), Hugging
Face's transposed layout or not, float32/bfloat16/float16, causal or not, no mask / key padding
(left or right) / a full boolean mask (per head or broadcast) / an additive bias, a scale (the
default, 0.05, 1, 2 or one per head) and a soft cap. The reference computes ``σR`` (logit moments and max,
over valid entries), ``Z = σR + A`` (capped) and its softmax in float64 from the same inputs,
independently of probe's paths; tolerances are float32's (each well above what the seeds reach:
a soft cap or an unscaled softmax of logits in the hundreds is near one-hot, where float32 rounds
``e^Z`` by its own size).
"""

from __future__ import annotations

import math
import random
from typing import Dict, Tuple

import pytest
import torch
from torch import Tensor

from probe.call import AttentionCall
from probe.stats.backward import grad_logits_stats
from probe.stats.forward import forward_stats


def _draw(seed: int) -> Tuple[AttentionCall, Dict[str, object], Tensor, Tensor]:
    """A random call, its scales, the valid entries ``(B, H, L, S)`` and an output gradient."""
    rnd = random.Random(seed)
    batch, kv, groups = rnd.randint(1, 3), rnd.randint(1, 3), rnd.choice([1, 1, 2, 3])
    heads = kv * groups
    length = rnd.choice([1, 2, 5, 17, 64, 130])
    keys = rnd.choice([1, 3, 17, 64, 130]) if rnd.random() < 0.5 else length
    dim = rnd.choice([4, 8, 16, 32])
    size = rnd.choice([0.3, 1.0, 3.0, 10.0])
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=gen) * size
    k = torch.randn(batch, kv, keys, dim, generator=gen) * size + rnd.choice([0.0, 0.0, 5.0])
    v = torch.randn(batch, kv, keys, dim, generator=gen)
    if rnd.random() < 0.3:  # Hugging Face's (B, L, H, d) memory under the (B, H, L, d) view
        q, k = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
    causal = rnd.random() < 0.4
    valid = torch.ones(batch, heads, length, keys, dtype=torch.bool)
    mask = bias = None
    kind = rnd.choice(["none", "padding", "padding", "full", "bias"])
    if kind == "padding":
        keep = torch.ones(batch, keys, dtype=torch.bool)
        for b in range(batch):
            cut = rnd.randint(0, keys - 1)
            if rnd.random() < 0.5:
                keep[b, keys - cut :] = False
            else:
                keep[b, :cut] = False
        mask = keep.view(batch, 1, 1, keys)
    elif kind == "full":
        mask = torch.rand(batch, 1 if rnd.random() < 0.5 else heads, length, keys, generator=gen) < 0.8
    elif kind == "bias":
        bias = torch.randn(1, heads, length, keys, generator=gen)
    if mask is not None:
        valid &= mask
    if causal:
        valid &= torch.ones(length, keys, dtype=torch.bool).tril()
    choice = rnd.choice(["default", 0.05, 1.0, 2.0, "per head"])
    scale = (dim**-0.5 if choice == "default" else
             torch.rand(heads, generator=gen) * 0.5 + 0.05 if choice == "per head" else choice)
    softcap = rnd.choice([None, None, None, 5.0])
    dtype = rnd.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    call = AttentionCall(q=q, k=k, v=v, scale=scale, mask=mask, bias=bias, causal=causal, softcap=softcap)
    scales = {"actual": scale} if softcap is not None else {"actual": scale, "unscaled": 1.0}
    grad_out = torch.randn(batch, heads, length, dim, generator=gen)
    return call, scales, valid, grad_out


def _reference(call: AttentionCall, scale: object, valid: Tensor, grad_out: Tensor) -> Dict[str, Tensor]:
    """Per head, float64: count, mean, variance and max of ``σR`` over valid entries and the
    largest ``|σ|·Σ_i |q_i·k_i|``; the sums over rows (two valid keys or more) of normalized entropy and max
    probability, the rows whose max probability is within 1e-4 of 0.99 (either side may count
    them); ``Σ (∂L/∂Z)²`` and how far float32 may round it."""
    heads = call.q.shape[1]
    groups = heads // call.k.shape[1]
    q, k, v = call.q.double(), call.k.double().repeat_interleave(groups, 1), call.v.double().repeat_interleave(groups, 1)
    sigma = scale.double().view(1, heads, 1, 1) if isinstance(scale, Tensor) else float(scale)
    sr = sigma * (q @ k.transpose(-1, -2))
    z = sr if call.softcap is None else call.softcap * torch.tanh(sr / call.softcap)
    z = z + (0.0 if call.bias is None else call.bias.double())
    count = valid.sum((0, 2, 3)).double()
    mean = torch.where(valid, sr, 0.0).sum((0, 2, 3)) / count.clamp(min=1)
    var = torch.where(valid, sr - mean.view(1, heads, 1, 1), 0.0).square().sum((0, 2, 3)) / count.clamp(min=1)
    p = torch.nan_to_num(torch.softmax(z.masked_fill(~valid, -math.inf), -1), nan=0.0)
    n = valid.sum(-1)
    rows = n >= 2
    entropy = -torch.where(p > 0, p * p.log(), 0.0).sum(-1) / torch.log(n.clamp(min=2).double())
    top = p.amax(-1)
    dp = grad_out.double() @ v.transpose(-1, -2)
    dz = p * (dp - (p * dp).sum(-1, keepdim=True))
    # float32 rounds each ∂L/∂Z_j by about 2⁻²⁴·P_j·(|dP_j| + Σ_k P_k·|dP_k|): the subtraction of
    # c = Σ P·dP cancels in a near one-hot row (the model's own float32 backward rounds alike),
    # so a head of such rows is known to float32 only to that size; 1e-5 is 170 times 2⁻²⁴
    slack = 1e-5 * p * (dp.abs() + (p * dp.abs()).sum(-1, keepdim=True))
    slack = slack.square().sum((0, 2, 3)).sqrt()
    # a float32 product rounds q·k by about 2⁻²⁴·Σ_i |q_i·k_i| (the logit's size for the tolerances)
    size = (sigma.abs() if isinstance(sigma, Tensor) else abs(sigma)) * (q.abs() @ k.abs().transpose(-1, -2))
    return {"count": count, "mean": mean, "var": var, "abs": torch.where(valid, size, 0.0).amax((0, 2, 3)),
            "max": sr.masked_fill(~valid, -math.inf).amax((0, 2, 3)),
            "entropy": torch.where(rows, entropy, 0.0).sum((0, 2)), "max_prob": torch.where(rows, top, 0.0).sum((0, 2)),
            "saturated": (rows & (top >= 0.99)).sum((0, 2)).double(),
            "near": (rows & ((top - 0.99).abs() < 1e-4)).sum((0, 2)).double(),
            "rows": rows.sum((0, 2)).double(), "grad": dz.square().sum((0, 2, 3)),
            "grad_slack": 2 * dz.square().sum((0, 2, 3)).sqrt() * slack + slack.square()}


def _close(name: str, got: Tensor, want: Tensor, atol: Tensor, rtol: float) -> None:
    got = got.double()
    ok = (got - want).abs() <= atol + rtol * want.abs()
    assert bool(ok.all()), f"{name}: got {got.tolist()}, float64 {want.tolist()}"


@pytest.mark.parametrize("budget", [64 * 2**20, 2**14], ids=["default budget", "16 KiB: chunks and key blocks"])
@pytest.mark.parametrize("first", range(0, 400, 50))
def test_random_calls_match_float64(first, budget):
    for seed in range(first, first + 50):
        call, scales, valid, grad_out = _draw(seed)
        got = forward_stats(call, scales, budget_bytes=budget, rows=None)
        grads = grad_logits_stats(call, grad_out, scales, budget_bytes=budget)
        for name, scale in scales.items():
            want = _reference(call, scale, valid, grad_out)
            seen = want["count"] > 0
            where = f"seed {seed}, {name}"
            n, mean, m2 = got[f"logit@{name}"].double()
            assert torch.equal(n, want["count"]), where
            size = want["abs"][seen]
            _close(f"{where} mean", mean[seen], want["mean"][seen], 1e-5 * size + 1e-9, 1e-5)
            _close(f"{where} var", (m2 / n.clamp(min=1))[seen], want["var"][seen], 1e-6 * size**2 + 1e-12, 1e-4)
            _close(f"{where} max", got[f"logit_max@{name}"].double()[seen], want["max"][seen], 1e-5 * size + 1e-9, 0)
            rows = want["rows"]
            _close(f"{where} entropy", got[f"entropy@{name}"], want["entropy"], 1e-4 * rows + 1e-9, 0)
            _close(f"{where} max_prob", got[f"max_prob@{name}"], want["max_prob"], 1e-4 * rows + 1e-9, 0)
            _close(f"{where} saturated", got[f"saturated@{name}"], want["saturated"], want["near"], 0)
            _close(f"{where} grad_logits", grads[f"grad_logits_sq@{name}"], want["grad"], want["grad_slack"] + 1e-30, 1e-4)


def test_logits_joined_with_a_sink_are_measured_over_their_own_width():
    # x-transformers' attention sink: a logit per head joined to the scores, softmax over S + 1,
    # only the S scores' probabilities meet v. From its own logits the call has S + 1 keys.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(3))
    z = torch.cat([torch.full((2, 3, 5, 1), 0.5), q @ k.transpose(-1, -2) / 8**0.5], -1)
    call = AttentionCall(q=q, k=k, v=v, scale=None, logits=z)
    got = forward_stats(call, {"actual": None})
    p = z.double().softmax(-1)
    entropy = (-(p * p.log()).sum(-1) / math.log(6)).sum((0, 2))
    torch.testing.assert_close(got["entropy@actual"].double(), entropy, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got["logit_max@actual"].double(), z.double().amax((0, 2, 3)), rtol=1e-6, atol=0)
    dp = torch.randn(2, 3, 5, 6, generator=gen)  # ∂L/∂P, the sink's column included
    grads = grad_logits_stats(call, None, {"actual": None}, grad_probs=dp)
    dz = p * (dp.double() - (p * dp.double()).sum(-1, keepdim=True))
    torch.testing.assert_close(grads["grad_logits_sq@actual"].double(), dz.square().sum((0, 2, 3)), rtol=1e-5, atol=0)
    # ∂L/∂out · vᵀ has v's S columns, not the softmax's S + 1: no dP to measure from
    assert grad_logits_stats(call, torch.randn(2, 3, 5, 8, generator=gen), {"actual": None}) == {}
