"""Talking heads whose mix is scaled after it (``s - 0.5 * conv1x1(s)``): the factor on the mixed
term belongs to the mix. It was dropped (measured ``s - conv1x1(s)``): entropy and max_prob
silently wrong, no warning. Oracle: the model's own probabilities (tests/capture/test_patterns.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.capture.test_patterns import B, H, L, MIX, S0, entropy_ref, keep, run


def _conv(sim):
    return F.conv2d(sim, MIX.t().reshape(H, H, 1, 1))


@pytest.mark.parametrize("combine", [
    lambda sim: sim - _conv(sim) * 0.5,
    lambda sim: sim + 0.5 * _conv(sim),
    lambda sim: sim * 2.0 + _conv(sim),  # scores scaled, then mixed with themselves: not one root
    lambda sim: torch.add(sim, _conv(sim) / 4.0, alpha=2),
], ids=["minus_half", "plus_half", "scaled_root", "alpha"])
def test_a_factor_on_the_mixed_term_is_part_of_the_mix(combine):
    def core(m, q, k, v):
        return keep(m, combine(q @ k.transpose(-1, -2) * S0).softmax(-1)) @ v

    net, s, _ = run(core, grads=False)
    for name, block in zip(s.sites, net.blocks):
        probs = block.probs.detach().double().reshape(B, H, L, -1)
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(block.probs), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(s.value(name, "max_prob"), probs.amax(-1).mean((0, 2)).numpy(), rtol=1e-5)
