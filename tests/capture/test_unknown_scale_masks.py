"""Masks on the unknown-scale path: the softmax input measured as it is, its masked keys excluded.

When an op between ``q·kᵀ`` and the softmax makes the scale unknown (a ``clamp``, a ``tanh``
without its factor), probe measures the softmax input ``Z`` itself, at ``actual`` only
(:mod:`probe.stats.paths.logits`). A mask applied on the way with a finite fill (``-1e9``,
``-1e4``: at most ``MASK_BIAS``) or as an additive term still says which keys are masked; counted
as logits, the fills made a causal call's ``logit_var`` 2.5e17 and its entropy normalised over
every key, with the site reported verified and no word but "scale unknown".

Oracle: the model's own q and k in float64, the same op, the model's own mask; per-head metrics by
their definitions over the valid keys (``tests.helpers.reference_metrics`` with the logits given).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Dict

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import probe

B, H, L, D = 2, 2, 8, 16


class Scores(nn.Module):
    """One attention layer whose scores go through ``shape(scores, mask)`` before the softmax."""

    def __init__(self, shape: Callable[[Tensor, Tensor], Tensor]) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.shape = shape
        self.raw = None

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        self.raw = (q.detach().double(), k.detach().double())
        z = self.shape(q @ k.transpose(-1, -2) / math.sqrt(D), valid)
        return (z.softmax(-1) @ v).sum()


CAUSAL = torch.ones(L, L, dtype=torch.bool).tril().expand(B, H, L, L)
PADDED = torch.ones(B, H, L, L, dtype=torch.bool)
PADDED[1, :, :, 5:] = False

# (what the model does to its scores, which keys it masks, what the plain scores become in float64)
CASES: Dict[str, tuple] = {
    "clamp, then a -1e9 causal fill": (
        lambda s, m: s.clamp(max=50).masked_fill(~m, -1e9), CAUSAL, lambda z: z.clamp(max=50)),
    "clamp, then torch.where with -1e4": (
        lambda s, m: torch.where(m, s.clamp(max=50), -1e4), CAUSAL, lambda z: z.clamp(max=50)),
    "clamp, then an additive -1e4 padding mask": (
        lambda s, m: s.clamp(max=50) + (~m[:, :1, :1]).float() * -1e4, PADDED, lambda z: z.clamp(max=50)),
    "tanh, then an additive -1e4 padding mask": (
        lambda s, m: torch.tanh(s) + (~m[:, :1, :1]).float() * -1e4, PADDED, torch.tanh),
    "a -1e9 fill, then clamp": (
        lambda s, m: s.masked_fill(~m, -1e9).clamp(max=50), CAUSAL, lambda z: z.clamp(max=50)),
}


def _reference(z: Tensor, valid: Tensor) -> Dict[str, np.ndarray]:
    """logit_var, logit_max, entropy, max_prob per head over the valid keys of float64 ``z``."""
    out: Dict[str, list] = {"logit_var": [], "logit_max": [], "entropy": [], "max_prob": []}
    for h in range(H):
        zh, vh = z[:, h], valid[:, h]
        out["logit_var"].append(zh[vh].var(unbiased=False).item())
        out["logit_max"].append(zh[vh].max().item())
        ent, top = [], []
        for b in range(B):
            for i in range(L):
                keys = vh[b, i]
                if keys.sum() < 2:
                    continue
                p = zh[b, i][keys].softmax(-1)
                ent.append((-(p * p.log()).sum() / math.log(int(keys.sum()))).item())
                top.append(p.max().item())
        out["entropy"].append(np.mean(ent))
        out["max_prob"].append(np.mean(top))
    return {k: np.array(v) for k, v in out.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_masked_keys_are_not_logits_when_the_scale_is_unknown(case: str) -> None:
    shape, valid, plain = CASES[case]
    torch.manual_seed(0)
    model = Scores(shape)
    x = torch.randn(B, L, H * D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1, rows=None) as p:
            model(x, valid).backward()
        s = p.summary()
    info = s.info("root")
    assert info["scale"] is None and info["scale_unknown"], info  # the unknown-scale path it tests
    assert any("could not be recovered" in str(w.message) for w in caught)
    q, k = model.raw
    ref = _reference(plain(q @ k.transpose(-1, -2) / math.sqrt(D)), valid)
    for metric in ("logit_var", "logit_max"):
        np.testing.assert_allclose(s.value("root", metric, "actual"), ref[metric], rtol=1e-5, err_msg=metric)
    for metric in ("entropy", "max_prob"):
        np.testing.assert_allclose(s.value("root", metric, "actual"), ref[metric], rtol=1e-5, atol=1e-6,
                                   err_msg=metric)


def test_a_fill_above_the_mask_bias_stays_a_logit() -> None:
    """A fill of -50 is not a mask (``MASK_BIAS`` is -100, as for every other fill): its entries
    are logits of the softmax input, as docs/metrics.md says, and counted as such."""
    torch.manual_seed(0)
    model = Scores(lambda s, m: s.clamp(max=50).masked_fill(~m, -50.0))
    x = torch.randn(B, L, H * D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with probe.watch(model, every=1, rows=None) as p:
            model(x, CAUSAL).backward()
    q, k = model.raw
    z = (q @ k.transpose(-1, -2) / math.sqrt(D)).clamp(max=50).masked_fill(~CAUSAL, -50.0)
    ref = _reference(z, torch.ones_like(CAUSAL))
    np.testing.assert_allclose(p.summary().value("root", "logit_var", "actual"), ref["logit_var"], rtol=1e-5)


def test_keys_joined_after_a_mask_keep_the_call_measured() -> None:
    """A mask recorded before the scores are joined with a sink column no longer matches the
    softmax input's keys: the call is still measured (from the input as it is), not dropped."""
    class Sink(Scores):
        def forward(self, x: Tensor, valid: Tensor) -> Tensor:
            q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
            z = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~valid, -1e9)
            z = torch.cat([z, torch.zeros(B, H, L, 1)], -1)
            return (z.softmax(-1)[..., :-1] @ v).sum()

    torch.manual_seed(0)
    model = Sink(lambda s, m: s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1, rows=None) as p:
            model(torch.randn(B, L, H * D), CAUSAL).backward()
    assert not any("NOT measured" in str(w.message) and "failed" in str(w.message) for w in caught)
    assert "logit_var" in p.summary().metrics("root")
