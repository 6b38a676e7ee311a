"""The run totals (probe.state.results.Results) fold windows in a few array operations by cached plans:
the same values as merging the windows' states field by field (probe.state.combine.merge_states),
as layouts change (sites and fields appearing, missing from a window, windows merged)."""

from __future__ import annotations

import numpy as np
import torch

from probe.state.results import Results
from probe.state.combine import merge_states

SPECIALS = torch.tensor([0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e-300, 1e300, 3.0])
FIELDS = ("logit@actual", "logit_max@actual", "entropy@actual", "rows", "scale", "grad_q_sq", "logit@unscaled",
          "grad_steps", "nonfinite")


def _values(gen, shape):
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-3, 3, shape, generator=gen)
    special = torch.rand(*shape, generator=gen) < 0.2
    return torch.where(special, SPECIALS[torch.randint(0, len(SPECIALS), shape, generator=gen)], x)


def _window(gen, heads):
    """Random per-site states; a site or a field may be missing from a window."""
    states = {}
    for site, h in heads.items():
        if torch.rand(1, generator=gen) < 0.2:
            continue
        fields = [f for f in FIELDS if torch.rand(1, generator=gen) < 0.8]
        state = {}
        for field in fields:
            value = _values(gen, (3, h) if field.startswith("logit@") else (h,))
            if field.startswith("logit@"):
                value[0] = torch.randint(0, 4, (h,), generator=gen).double()  # counts
            state[field] = value
        if state:
            states[site] = state
    return states


def _same(a, b):
    assert list(a) == list(b)
    for site in a:
        assert list(a[site]) == list(b[site]), site
        for field in a[site]:
            x, y = a[site][field].numpy(), b[site][field].numpy()
            assert x.shape == y.shape
            assert np.array_equal(x, y, equal_nan=True), (site, field, x, y)  # ±0 equal


def test_totals_are_the_field_by_field_merge():
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        heads = {f"layers.{i}": 1 + (trial + i) % 6 for i in range(1 + trial % 4)}
        results, reference = Results(), {}
        for _ in range(12):
            states = _window(gen, heads)
            if not states:
                continue
            infos = {site: {"heads": heads[site]} for site in states}
            if trial % 2:  # packed values given, as the writer's windows have them
                fields = [(s, f, tuple(v.shape)) for s, st in states.items() for f, v in st.items()]
                flat = torch.cat([v.reshape(-1) for st in states.values() for v in st.values()]).numpy()
                results.add_states(states, infos, flat, fields)
            else:
                results.add_states(states, infos)
            for site, state in states.items():
                merge_states(reference.setdefault(site, {}), {f: v.clone() for f, v in state.items()})
            _same(results._states(), reference)
        summary = results.summary({}, {}, 1)
        assert summary.sites == list(reference)


def test_summary_sees_a_snapshot_of_the_totals():
    results = Results()
    state = {"rows": torch.tensor([2.0, 4.0], dtype=torch.float64), "entropy@actual": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    results.add_states({"a": state}, {"a": {}})
    before = results._states()
    results.add_states({"a": state}, {"a": {}})
    assert before["a"]["rows"].tolist() == [2.0, 4.0]  # not changed by the later fold
    assert results._states()["a"]["rows"].tolist() == [4.0, 8.0]
