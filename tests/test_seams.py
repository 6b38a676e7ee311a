"""The small seams of docs/architecture.md on their own: overrides lookup, schedule, metric catalogue."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from probe.experiment import overrides
from probe.errors import ProbeError
from probe.metrics import METRIC_ORDER, METRICS, NAN_MEANS_NO_DATA, field_reduction, head_reduce, spec, step_reduce
from probe.once import WarnOnce
from probe.session.schedule import Action, Schedule


class Rule:
    """A scale rule that names every call ``site`` and answers ``scale``."""

    def __init__(self, scale, site="layer"):
        self.scale, self.site, self.calls, self.left = scale, site, 0, []

    def resolve(self, heads, d_k, like):
        self.calls += 1
        return self.site, self.scale

    def left_unchanged(self, site):
        self.left.append(site)


def test_lookup_is_not_consulted_without_interventions_or_while_applying():
    like = torch.zeros(1)
    assert overrides.lookup(4, 8, like) is None
    outer = Rule(2.0)
    token = overrides.push_rule(outer)
    try:
        with overrides.applying():
            assert overrides.is_applying()
            assert overrides.lookup(4, 8, like) is None
        assert outer.calls == 0
        assert overrides.lookup(4, 8, like).scale == 2.0
    finally:
        overrides.reset_rule(token)
    assert not overrides.active()


def test_every_rule_counts_the_call_and_the_innermost_match_wins():
    outer, inner, silent = Rule(2.0), Rule(3.0), Rule(None)
    tokens = [overrides.push_rule(r) for r in (outer, inner, silent)]
    try:
        change = overrides.lookup(4, 8, torch.zeros(1))
    finally:
        for t in reversed(tokens):
            overrides.reset_rule(t)
    assert change.scale == 3.0 and change.changes
    assert (outer.calls, inner.calls, silent.calls) == (1, 1, 1)


def test_an_undescribable_site_is_told_and_left_unchanged():
    rule = Rule(2.0, site="layers.0")
    token = overrides.push_rule(rule)
    try:
        change = overrides.lookup(4, 8, torch.zeros(1), describable=False)
    finally:
        overrides.reset_rule(token)
    assert change is not None and change.scale is None and not change.changes
    assert rule.left == ["layers.0"]


def test_a_variant_gives_its_scale_reference_and_bias_and_a_rule_replaces_its_scale():
    module = nn.Linear(1, 1)
    scale, bias = torch.tensor([0.5, 0.25]), torch.arange(10.0).reshape(2, 5)
    token = overrides.push_module_override(overrides.ModuleOverride(module, "attn", scale, bias, 0.35))
    try:
        change = overrides.lookup(2, 8, torch.zeros(1, dtype=torch.float64), keys=3)
        assert change.scale is scale and change.reference == 0.35
        assert change.bias.shape == (1, 2, 1, 3) and change.bias.dtype == torch.float64
        assert torch.equal(change.bias[0, :, 0], bias[:, :3].double())
        assert overrides.lookup(2, 8, torch.zeros(1), variants=False) is None  # eager / MHA: rules only
        rule_token = overrides.push_rule(Rule(1.0))
        try:
            ruled = overrides.lookup(2, 8, torch.zeros(1), keys=3)
        finally:
            overrides.reset_rule(rule_token)
        assert ruled.scale == 1.0 and ruled.reference is None and ruled.bias is not None
        with pytest.raises(ProbeError, match="max_len"):
            overrides.lookup(2, 8, torch.zeros(1), keys=6)
        with pytest.raises(ProbeError, match="has 2 heads"):
            overrides.lookup(3, 8, torch.zeros(1), keys=3)
    finally:
        overrides.reset_module_override(token)


def test_schedule_is_a_pure_function_of_the_step():
    s = Schedule(every=3, flush_every=2)
    assert [s(n) for n in range(7)] == [Action.RECORD, Action.SKIP, Action.SKIP] * 2 + [Action.RECORD]
    assert not s.flush_due([], 5)
    assert not s.flush_due([0], 3)  # one recorded step, two wanted
    assert not s.flush_due([0, 3], 3)  # step 3 still running (its backward belongs to it)
    assert s.flush_due([0, 3], 4)


def test_the_catalogue_declares_every_metric_once_in_report_order():
    assert METRIC_ORDER == ("logit_var", "logit_max", "entropy", "max_prob", "saturation", "nonfinite",
                            "grad_logits", "grad_q", "grad_k", "grad_v",
                            "entropy_se", "max_prob_se", "saturation_se", "grad_logits_se",  # these four with rows=
                            "qk_clip_logit", "qk_clip_factor", "qk_clip_steps")  # these three with qk_clip=
    assert len({m.field for m in METRICS}) == len(METRICS)
    assert NAN_MEANS_NO_DATA == {"logit_var", "logit_max", "entropy", "max_prob", "saturation",
                                 "entropy_se", "max_prob_se", "saturation_se", "qk_clip_logit"}
    assert [field_reduction(f) for f in ("logit@actual", "logit_max@unscaled", "entropy@standard", "scale",
                                         "rows", "grad_q_sq", "grad_logits_sq@actual")] == [
        "moments", "max", "sum", "last", "sum", "sum", "sum"]
    assert all(spec(m).backward == m.startswith("grad_") for m in METRIC_ORDER)


def test_head_and_step_folds_ignore_nan():
    values = np.array([1.0, np.nan, 3.0])
    assert head_reduce("entropy", values) == 2.0
    assert head_reduce("logit_max", values) == 3.0
    assert head_reduce("nonfinite", values) == 4.0
    assert step_reduce("grad_q", values) == pytest.approx(math.sqrt(10.0 / 2))  # RMS over steps
    assert math.isnan(head_reduce("entropy", np.array([np.nan])))


def test_warn_once_warns_once_per_key():
    warn = WarnOnce(RuntimeWarning)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert warn("a", "first a") and not warn("a", "again a") and warn("b", "first b")
    assert [str(w.message) for w in seen] == ["first a", "first b"]
    assert all(w.category is RuntimeWarning for w in seen) and "a" in warn
