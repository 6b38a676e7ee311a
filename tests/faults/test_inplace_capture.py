"""A prescaled q changed in place by an op probe does not model (``add_``, ``clamp_``, ``exp_``, an
in-place op on a view of it, a division by its own norm): probe must not keep describing it as
``q * factor`` (a stale record measured the logits of ``q * factor`` before the change: entropy,
max_prob and logit_max silently wrong), nor as features of scale 1 (the factor is still in it:
`unscaled` would be wrong). It is measured at `actual` only, exactly, and the site is named by a
warning (issue 25: scale provenance complete or unknown). A full overwrite (``copy_``) makes it
features again. Oracle: the model's own probabilities (as in tests/capture/test_patterns.py)."""

from __future__ import annotations

import pytest
import torch

from tests.capture.test_patterns import D, S0, check, keep, run


def _add(q):
    qs = q * S0
    qs.add_(1.0)
    return qs


def _clamp(q):
    qs = q * S0
    qs.clamp_(-0.1, 0.1)
    return qs


def _exp(q):
    qs = q * S0
    qs.exp_()
    return qs


def _copy(q):
    qs = q * S0
    qs.copy_(torch.linspace(-1, 1, qs.numel()).view(qs.shape))
    return qs


def _view(q):
    qs = q * S0
    qs[..., : D // 2].mul_(3.0)  # through a view: qs's own record never sees the op
    return qs


def _norm(q):
    qs = q * S0
    qs.div_(qs.norm(dim=-1, keepdim=True))
    return qs


def _own(q):
    q = q.clone()
    q.mul_(S0)
    q.add_(0.3)
    return q


@pytest.mark.parametrize("change", [_add, _clamp, _exp, _view, _norm, _own], ids=lambda f: f.__name__[1:])
def test_a_prescaled_q_changed_in_place_is_measured_at_actual_and_named(change):
    import numpy as np

    from tests.capture.test_patterns import entropy_ref

    def core(m, q, k, v):
        qs = change(q)
        m.raw = (qs.detach().double(), k.detach().double())
        return keep(m, (qs @ k.transpose(-1, -2)).softmax(-1)) @ v

    net, s, warned = run(core, grads=False)
    for name, block in zip(s.sites, net.blocks):
        assert s.info(name)["scale"] is None
        assert any(name in w and "`actual` only" in w for w in warned), warned
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(block.probs), rtol=1e-5, atol=1e-6)


def test_a_prescaled_q_overwritten_by_copy_is_measured_as_it_is():
    def core(m, q, k, v):
        qs = _copy(q)
        m.raw = (qs.detach().double(), k.detach().double())
        return keep(m, (qs @ k.transpose(-1, -2)).softmax(-1)) @ v

    net, s, _ = run(core, grads=False)
    check(net, s, 1.0, grads=False)


def test_q_multiplied_in_place_is_taken_into_the_scale_once():
    # q.mul_(s) on a fresh q: the factor is the scale (q / s the unscaled q), not applied twice
    # (measuring q * s²) nor dropped (scale 1: issue 25)
    def core(m, q, k, v):
        q = q.clone()
        m.raw = (q.detach().double(), k.detach().double())
        q.mul_(S0)
        return keep(m, (q @ k.transpose(-1, -2)).softmax(-1)) @ v

    net, s, _ = run(core)
    check(net, s, S0)


def test_scores_changed_in_place_are_reported_at_actual_with_a_warning():
    import numpy as np

    from tests.capture.test_patterns import entropy_ref

    def core(m, q, k, v):
        scores = q @ k.transpose(-1, -2) * S0
        scores.sigmoid_()  # an op probe does not follow: the scale of what reaches the softmax is unknown
        return keep(m, scores.softmax(-1)) @ v

    net, s, warned = run(core, grads=False)
    assert s.info("blocks.0")["scale"] is None
    assert any("blocks.0" in w and "`actual` only" in w for w in warned), warned
    np.testing.assert_allclose(s.value("blocks.0", "entropy"), entropy_ref(net.blocks[0].probs), rtol=1e-5)
