"""Hugging Face's ``pack_gqa``: a decoding step of grouped-query attention runs SDPA on the kv heads.

transformers' SDPA attention, for one query token with a mask, reshapes q ``(B, H, 1, d)`` to
``(B, H/g, g, d)``: the query heads of each kv head become its rows. Recorded as it is, a site's
decoding steps had ``H/g`` heads where its prompt had ``H``: every head's statistics were pooled
over its group, and merging the two shapes raised out of the model's forward (a ``generate`` under
``probe.watch`` died) or out of ``summary()``. probe now records such a call per query head.
"""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe

B, H, KV, S, D = 2, 4, 2, 6, 8
G = H // KV


class Packed(nn.Module):
    """One decoding step as transformers runs it: ``pack_gqa`` of q, SDPA over the kv heads."""

    def __init__(self) -> None:
        super().__init__()
        self.num_key_value_groups = G
        self.config = types.SimpleNamespace(num_attention_heads=H)
        self.proj = nn.Linear(D, D)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        packed = self.proj(q).reshape(B, KV, G, D)  # (B, H, 1, d) -> (B, H/g, g, d)
        out = F.scaled_dot_product_attention(packed, k, v, attn_mask=mask)
        return out.reshape(B, H, 1, D)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=gen) * 3
    k, v = torch.randn(B, KV, S, D, generator=gen), torch.randn(B, KV, S, D, generator=gen)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[1, ..., :2] = False  # left padding
    return q, k, v, mask


def test_a_packed_decoding_step_is_measured_per_query_head():
    model = Packed()
    q, k, v, mask = _inputs()
    with probe.watch(model, every=1) as p:
        model(q, k, v, mask).sum().backward()
    s = p.summary()
    assert s.info("root")["heads"] == H and s.info("root")["verified"] is True
    with torch.no_grad():  # per query head h (kv head h // g), from the model's own q
        qh = model.proj(q).double()
        logits = qh @ k.double().repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(D)
        prob = logits.masked_fill(~mask, -math.inf).softmax(-1)
    valid = mask.expand(B, H, 1, S).sum(-1).double()
    entropy = (-(prob * prob.clamp(min=1e-300).log()).sum(-1) / valid.log()).mean((0, 2))
    torch.testing.assert_close(torch.as_tensor(s.value("root", "entropy")).double(), entropy, rtol=1e-5, atol=1e-7)
    top = prob.amax(-1).mean((0, 2))
    torch.testing.assert_close(torch.as_tensor(s.value("root", "max_prob")).double(), top, rtol=1e-5, atol=1e-7)
    assert len(s.value("root", "grad_q")) == H


def test_a_per_head_scale_reaches_the_rows_of_its_head():
    model = Packed()
    q, k, v, mask = _inputs()
    scales = torch.tensor([0.1, 0.2, 0.3, 0.4])
    with probe.scaling(model, scales):  # (before: "expected one value per head (2), got 4" raised)
        out = model(q, k, v, mask)
    with torch.no_grad():
        logits = scales.view(1, H, 1, 1) * (model.proj(q) @ k.repeat_interleave(G, 1).transpose(-1, -2))
        want = logits.masked_fill(~mask, -math.inf).softmax(-1) @ v.repeat_interleave(G, 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_generate_with_grouped_query_attention_survives_and_keeps_its_heads():
    tr = pytest.importorskip("transformers")
    config = tr.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = tr.MistralForCausalLM(config).eval()
    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    bare = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1) as p:  # prompt and decoding steps: one watched forward each
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                 pad_token_id=0)
    assert torch.equal(out, bare)
    s = p.summary()
    site = "model.layers.0.self_attn"
    assert s.sites == [site] and s.info(site)["heads"] == 4 and len(s.value(site, "entropy")) == 4
    assert s.info(site)["calls"] == 3 and s.info(site)["verified"] is True  # the prompt and two decoding steps
    assert not [str(w.message) for w in caught if "NOT measured" in str(w.message)]


class Varying(nn.Module):
    """SDPA whose head count follows its input (no attribute says why): 4 heads, then 2."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q.flip(-2), q * 0.5)


@pytest.mark.parametrize("every_step", [True, False], ids=["a window per step", "both calls in one window"])
def test_a_site_whose_head_count_changes_is_named_and_never_raises(every_step):
    model = Varying()
    gen = torch.Generator().manual_seed(0)
    with pytest.warns(UserWarning, match="has 2 heads where its earlier calls had 4: it is NOT measured"):
        with probe.watch(model, every=1, flush_every=1 if every_step else 100) as p:
            model(torch.randn(1, 4, 5, 8, generator=gen, requires_grad=True)).sum().backward()
            model(torch.randn(1, 2, 5, 8, generator=gen, requires_grad=True)).sum().backward()
        s = p.summary()
    assert s.info("root")["heads"] == 4 and len(s.value("root", "entropy")) == 4


def test_grouped_query_calls_with_and_without_repeated_keys_share_their_site():
    # transformers repeats k and v to the query heads for a masked grouped-query call and passes
    # the kv heads (enable_gqa) for an unmasked one: the site's second call was dropped whole
    tr = pytest.importorskip("transformers")
    config = tr.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(config)
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    padded = torch.ones(2, 6, dtype=torch.long)
    padded[0, :2] = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1) as p:
            for mask in (padded, torch.ones(2, 6, dtype=torch.long)):
                model(input_ids=ids, attention_mask=mask).logits.square().mean().backward()
        s = p.summary()
    site = "model.layers.0.self_attn"
    assert s.info(site)["calls"] == 2 and len(s.value(site, "entropy")) == 4 and len(s.value(site, "grad_q")) == 4
    said = [str(w.message) for w in caught if "NOT measured" in str(w.message)]
    assert len(said) == 1 and "grad_k and grad_v of the calls" in said[0], said  # the second call's only
