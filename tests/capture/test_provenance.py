"""probe.capture.provenance: which parameter entries each head's q and k scale with, or a refusal by name.

Each module below issues one attention call; ``probe.watch(model, qk_clip=τ)`` traces its first
forward and ``summary.info(site)["qk_clip"]`` says what it found. Accepted layouts are also
clipped and re-measured (tests/test_qk_clip.py, tests/test_qk_clip_models.py); here the point is
that every layout is recognised, and that anything not known exactly is refused with its reason.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe

D, H, DH = 16, 2, 8


def _heads(t: torch.Tensor, b: int, n: int) -> torch.Tensor:
    return t.view(b, n, -1, DH).transpose(1, 2)


class Attn(nn.Module):
    """q, k, v from nn.Linear, then a variant of the path to SDPA (``how``)."""

    def __init__(self, how: str = "plain") -> None:
        super().__init__()
        self.how = how
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.a, self.b = nn.Linear(D, 2, bias=False), nn.Linear(2, D, bias=False)
        self.shift = nn.Parameter(torch.zeros(D))
        self.q_norm, self.k_norm = nn.LayerNorm(DH), nn.LayerNorm(DH)  # over head_dim: shared by the heads
        self.q_gain, self.k_gain = nn.RMSNorm(D), nn.RMSNorm(D)  # over all heads: a gain per head
        self.register_buffer("per_feature", torch.linspace(0.5, 1.5, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, n, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        how = self.how
        if how == "lora":
            q = q + self.b(self.a(x))
        elif how == "bias_after":
            q = q + self.shift
        elif how == "normalize":
            q = F.normalize(q, dim=-1)
        elif how == "per_head_gain":
            q, k = self.q_gain(q), self.k_gain(k)
        elif how == "factor":
            q = q * self.per_feature  # a factor per feature (a number would be folded into the scale)
        elif how == "tied":
            k = self.q(x)
        elif how == "clamp":
            q = q.clamp(-1, 1)
        q, k, v = _heads(q, bsz, n), _heads(k, bsz, n), _heads(v, bsz, n)
        if how == "shared_gain":
            q, k = self.q_norm(q), self.k_norm(k)
        if how == "complex_rotary":
            freqs = torch.polar(torch.ones(n, DH // 2), torch.arange(n * DH // 2).float().view(n, DH // 2))
            q = torch.view_as_real(torch.view_as_complex(q.float().reshape(bsz, H, n, DH // 2, 2)) * freqs).flatten(3)
        y = F.scaled_dot_product_attention(q, k, v)
        if how == "reused":
            y = y + q
        return y.transpose(1, 2).reshape(bsz, n, D)


class Conv1DAttn(nn.Module):
    """GPT-2's layout: ``torch.addmm(b, x, W)`` with W (in, 3·out), then a split."""

    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.transposed = transposed
        self.weight = nn.Parameter(torch.randn(3 * D, D) / 4 if transposed else torch.randn(D, 3 * D) / 4)
        self.bias = nn.Parameter(torch.randn(3 * D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, n, _ = x.shape
        if self.transposed:  # x @ W.t(): rows of W
            qkv = x @ self.weight.t()
        else:
            qkv = torch.addmm(self.bias, x.view(-1, D), self.weight).view(bsz, n, 3 * D)
        q, k, v = (_heads(t, bsz, n) for t in qkv.split(D, dim=2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Shared(nn.Module):
    """One attention module run twice per forward (ALBERT-style shared layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = Attn()
        self.layers = nn.ModuleList([self.layer, self.layer])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _info(model: nn.Module, x: torch.Tensor) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with probe.watch(model, qk_clip=100.0, every=None) as p:
            model(x).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.0).step()  # the clip (records) comes after a step
    summary = p.summary()
    return {site: summary.info(site).get("qk_clip") for site in summary.sites}


X = torch.randn(2, 5, D)


@pytest.mark.parametrize("how,expect", [
    ("plain", "q: q.weight rows and bias entries (2 heads x 8); k: k.weight rows and bias entries"),
    ("factor", "path: q: linear -> mul by tensor; k: linear"),
    ("per_head_gain", "q: q_gain.weight gain entries (2 heads x 8); k: k_gain.weight gain entries"),
    ("complex_rotary", "q: linear -> view_as_complex -> mul by tensor -> view_as_real; k: linear"),
])
def test_accepted_layouts_name_what_is_scaled(how, expect):
    torch.manual_seed(0)
    (found,) = _info(Attn(how), X).values()
    assert expect in found, found


@pytest.mark.parametrize("transposed,what", [(False, "columns"), (True, "rows")])
def test_conv1d_columns_and_transposed_weight_rows(transposed, what):
    torch.manual_seed(0)
    (found,) = _info(Conv1DAttn(transposed), X).values()
    assert found.startswith(f"q: root.weight {what}"), found
    assert ("bias" in found) == (not transposed)


@pytest.mark.parametrize("how,reason", [
    ("lora", "combines the outputs of 2 projections (an adapter such as LoRA?)"),
    ("bias_after", "a bias added after it"),
    ("normalize", "not modelled"),
    ("shared_gain", "feeds several q heads (a QK-norm gain shared by every head"),
    ("tied", "used by 2 calls between two optimizer steps"),
    ("reused", "read by 2 ops"),
    ("clamp", "clamp is not modelled"),
])
def test_refusals_name_the_reason(how, reason):
    torch.manual_seed(0)
    (found,) = _info(Attn(how), X).values()
    assert found.startswith("refused: ") and reason in found, found


def test_shared_layers_are_refused():
    torch.manual_seed(0)
    infos = _info(Shared(), X)
    assert infos and all(v.startswith("refused: ") and "tied" in v for v in infos.values()), infos


def test_multihead_attention_with_a_learned_key_bias_is_refused_by_name():
    mha = nn.MultiheadAttention(D, H, batch_first=True, add_bias_kv=True)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    infos = _info(M().train(), X)
    assert infos and all(v.startswith("refused: ") for v in infos.values()), infos


def test_refusals_warn_once_per_site_by_name():
    torch.manual_seed(0)
    model = Attn("lora")
    with pytest.warns(UserWarning, match=r"qk_clip does not clip site 'root': q is not traced"):
        with probe.watch(model, qk_clip=100.0, every=None):
            model(X)
            model(X)


def test_trace_leaves_outputs_and_gradients_bitwise_unchanged():
    torch.manual_seed(0)
    for how in ("plain", "per_head_gain", "lora"):
        model = Attn(how)
        x = X.clone().requires_grad_(True)
        out = model(x)
        out.sum().backward()
        want, grad = out.detach().clone(), x.grad.clone()
        x.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with probe.watch(model, qk_clip=1e9, every=None):
                out2 = model(x)
                out2.sum().backward()
        assert torch.equal(out2, want) and torch.equal(x.grad, grad), how


class Interleaved(nn.Module):
    """GPT-NeoX's fused layout: one projection viewed as (B, L, H, 3·d), q, k, v per head side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, n, _ = x.shape
        qkv = self.qkv(x).view(bsz, n, H, 3 * DH)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(DH, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bsz, n, D)


def test_interleaved_fused_qkv_clips_each_heads_own_rows():
    torch.manual_seed(0)
    model = Interleaved()
    with torch.no_grad():
        model.qkv.weight.mul_(8)
    x = torch.randn(2, 5, D)
    weight = model.qkv.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with probe.watch(model, qk_clip=1e-3, every=None) as p:  # every head clipped
            model(x).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.0).step()
    assert p.summary().info("root")["qk_clip"].startswith("q: qkv.weight rows and bias entries (2 heads x 8)")
    changed = (model.qkv.weight != weight).any(1).view(H, 3, DH)  # rows per head: q, k, v
    assert changed[:, :2].all() and not changed[:, 2].any()  # q and k rows of both heads, never v


def test_qwen3_qk_norm_over_head_dim_is_refused():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attn_implementation="sdpa"))
    ids = torch.randint(0, 64, (2, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with probe.watch(model, qk_clip=1e-3, every=None) as p:
            model(input_ids=ids, use_cache=False).logits.sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.0).step()
    found = p.summary().info("model.layers.0.self_attn")["qk_clip"]
    assert found.startswith("refused: an entry of model.layers.0.self_attn.q_norm.weight feeds several q heads"), found


def test_multihead_attention_in_proj_rows_are_clipped_exactly():
    from tests.qk_clip_util import max_logit64

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=32, dropout=0.0, batch_first=True).train()
    with torch.no_grad():
        layer.self_attn.in_proj_weight[: 2 * D].mul_(6)
    x = torch.randn(2, 5, D)
    seen = []
    hook = layer.self_attn.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))

    def tops() -> torch.Tensor:  # from the module's own weights, written out
        w, b = layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias
        q, k = (F.linear(seen[0], w[i * D:(i + 1) * D], b[i * D:(i + 1) * D]) for i in (0, 1))
        return max_logit64(_heads(q, 2, 5), _heads(k, 2, 5))

    layer(x)
    before = tops()
    tau = float(before.mean())
    v_rows = layer.self_attn.in_proj_weight[2 * D:].detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with probe.watch(layer, qk_clip=tau, every=None) as p:
            layer(x).sum().backward()
            torch.optim.SGD(layer.parameters(), lr=0.0).step()
    hook.remove()
    assert p.summary().info("self_attn")["qk_clip"].startswith("q: self_attn.in_proj_weight rows and in_proj_bias")
    after = tops()
    over = before > tau
    assert over.any() and not over.all()
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=2e-6, atol=0)
    assert torch.equal(after[~over], before[~over])
    assert torch.equal(layer.self_attn.in_proj_weight[2 * D:], v_rows)
