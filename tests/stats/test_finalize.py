"""finalize (numpy on the host) gives bit for bit what the torch formulas give, NaN, ±inf, ±0 and
float32 states included."""

from __future__ import annotations

import math

import numpy as np
import torch

from probe.state.finalize import finalize

SPECIALS = torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e-300, 1e300, 3.0])
SCALES = ("actual", "unscaled", "standard")
PER_HEAD = ("entropy", "max_prob", "saturated", "entropy_var", "max_prob_var", "saturated_var",
            "grad_logits_sq", "grad_logits_var")


def _torch_reference(state):
    """The formulas as torch computed them (finalize before it moved to numpy)."""
    t = {f: v.to(torch.float64) for f, v in state.items()}
    rows = t.get("rows")
    counted = float(t["grad_steps"].max()) if "grad_steps" in t else 1.0
    steps = max(counted, 1) if counted > 0 else math.nan  # no step counted: NaN (loss-scaler overflows)
    out = {}
    for scale in SCALES:
        n, _, m2 = t[f"logit@{scale}"]
        out[("logit_var", scale)] = torch.where(n > 0, m2 / n.clamp(min=1), torch.nan)
        out[("logit_max", scale)] = torch.where(n > 0, t[f"logit_max@{scale}"], torch.nan)
        if rows is not None:
            for field, metric in (("entropy", "entropy"), ("max_prob", "max_prob"), ("saturated", "saturation")):
                v = t[f"{field}@{scale}"]
                out[(metric, scale)] = torch.where(rows > 0, v / rows.clamp(min=1), torch.nan)
                var = t[f"{field}_var@{scale}"]
                out[(f"{metric}_se", scale)] = torch.where(rows > 0, var.clamp(min=0).sqrt() / rows.clamp(min=1), torch.nan)
        total = t[f"grad_logits_sq@{scale}"]
        out[("grad_logits", scale)] = (total.clamp(min=0) / steps).sqrt()
        total = total.clamp(min=0)
        var = t[f"grad_logits_var@{scale}"]
        out[("grad_logits_se", scale)] = torch.where(total > 0, var.clamp(min=0).sqrt() / (2 * (total * steps).sqrt()), 0.0 * steps)
    for name in ("grad_q", "grad_other"):
        out[(name, "actual")] = (t[f"{name}_sq"].clamp(min=0) / steps).sqrt()
    out[("nonfinite", "actual")] = t["nonfinite"]
    return out


def _state(gen, heads, with_rows, with_steps):
    def values(*shape):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-5, 5, shape, generator=gen)
        special = torch.rand(*shape, generator=gen) < 0.3
        return torch.where(special, SPECIALS[torch.randint(0, len(SPECIALS), shape, generator=gen)], x)

    state = {}
    for scale in SCALES:
        state[f"logit@{scale}"] = values(3, heads)
        state[f"logit_max@{scale}"] = values(heads)
        for field in PER_HEAD:
            state[f"{field}@{scale}"] = values(heads)
    for field in ("grad_q_sq", "grad_other_sq", "nonfinite", "scale"):
        state[field] = values(heads)
    if with_rows:
        state["rows"] = values(heads)
    if with_steps:
        state["grad_steps"] = torch.randint(0, 4, (heads,), generator=gen).double()
    return state


def test_bit_for_bit_the_torch_formulas():
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(400):
        state = _state(gen, 1 + trial % 8, trial % 3 != 0, trial % 4 != 0)
        if trial % 5 == 0:
            state = {f: v.float() for f, v in state.items()}
        got = finalize(state)
        for (metric, scale), want in _torch_reference(state).items():
            value = got[metric][scale]
            assert value.dtype == np.float64
            want = want.numpy()
            assert np.array_equal(value, want, equal_nan=True), (metric, scale, value, want)
            finite = ~np.isnan(want)
            assert np.array_equal(np.signbit(value[finite]), np.signbit(want[finite])), (metric, scale)
            checked += 1
        if "rows" not in state:
            assert "entropy" not in got and "entropy_se" not in got
    assert checked > 5000
