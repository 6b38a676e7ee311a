"""One state engine: the device accumulator (pairwise, torch), the run totals (a window layout
folded on numpy arrays) and the cross-rank reduction (k-way, torch) combine random states into
the same state, and that state is the float64 reference computed from the raw values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probe.state.accumulator import Accumulator
from probe.state.combine import GRAD_STEPS, Layout, combine, kind, merge_states
from probe.state.distributed import combine_ranks
from probe.state.results import Results

HEADS = 3
# one field of every kind: moments, max, min, sum (counts and sums), last, and grad_steps
FIELDS = ("logit@actual", "logit_max@actual", "qk_clip_factor", "entropy@actual", "rows", "scale", GRAD_STEPS)


def _raw_parts(rng: np.random.Generator, parts: int):
    """Per part and head: raw logits (some parts empty for some heads), plus sums and a scale."""
    out = []
    for _ in range(parts):
        counts = rng.integers(0, 6, size=HEADS)
        logits = [rng.normal(rng.normal(0, 50), rng.uniform(0.1, 20), size=c) for c in counts]
        out.append({
            "logits": logits,
            "entropy": rng.uniform(0, 5, size=HEADS),
            "factor": rng.uniform(0.1, 1.0, size=HEADS),
            "rows": rng.integers(1, 9, size=HEADS).astype(float),
            "scale": rng.uniform(0.05, 1.0, size=HEADS),
            "steps": float(rng.integers(0, 2)),
        })
    return out


def _state(part) -> dict:
    """A part's state as probe keeps it (float64 tensors, one value per head)."""
    n = np.array([len(x) for x in part["logits"]], dtype=float)
    mean = np.array([x.mean() if len(x) else 0.0 for x in part["logits"]])
    m2 = np.array([((x - x.mean()) ** 2).sum() if len(x) else 0.0 for x in part["logits"]])
    mx = np.array([x.max() if len(x) else -math.inf for x in part["logits"]])
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    return {
        "logit@actual": t(np.stack([n, mean, m2])),
        "logit_max@actual": t(mx),
        "qk_clip_factor": t(part["factor"]),
        "entropy@actual": t(part["entropy"]),
        "rows": t(part["rows"]),
        "scale": t(part["scale"]),
        GRAD_STEPS: t([part["steps"]]),
    }


def _reference(parts, across: str) -> dict:
    """The combined state from the raw values of every part, in float64."""
    logits = [np.concatenate([p["logits"][h] for p in parts]) for h in range(HEADS)]
    n = np.array([len(x) for x in logits], dtype=float)
    steps = [p["steps"] for p in parts]
    return {
        "logit@actual": np.stack([
            n,
            [x.mean() if len(x) else 0.0 for x in logits],
            [((x - x.mean()) ** 2).sum() if len(x) else 0.0 for x in logits],
        ]),
        "logit_max@actual": np.array([x.max() if len(x) else -math.inf for x in logits]),
        "qk_clip_factor": np.min([p["factor"] for p in parts], axis=0),
        "entropy@actual": np.sum([p["entropy"] for p in parts], axis=0),
        "rows": np.sum([p["rows"] for p in parts], axis=0),
        "scale": parts[-1]["scale"],
        GRAD_STEPS: np.array([max(steps) if across == "ranks" else sum(steps)]),
    }


def _assert_state(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for field, value in want.items():
        g = got[field].numpy() if isinstance(got[field], torch.Tensor) else np.asarray(got[field])
        # moments: the mean to 1e-12 relative of the values' spread, M2 and sums to 1e-12 relative
        np.testing.assert_allclose(g, value, rtol=1e-11, atol=1e-9, err_msg=field)


@pytest.mark.parametrize("seed", range(40))
def test_accumulator_totals_and_ranks_agree_with_float64(seed):
    rng = np.random.default_rng(seed)
    parts = _raw_parts(rng, int(rng.integers(1, 7)))
    states = [_state(p) for p in parts]

    # 1. the device accumulator: calls added pairwise, in order
    acc = Accumulator()
    for s in states:
        acc.add("site", {f: v.clone() for f, v in s.items()})
    _assert_state(acc.states["site"], _reference(parts, "steps"))

    # 2. the run totals: each part a flushed window, folded on numpy arrays (fields in a shuffled
    #    order per window, so the window layout differs from the totals')
    results = Results()
    for s in states:
        order = list(FIELDS)
        rng.shuffle(order)
        results.add_states({"site": {f: s[f] for f in order}}, {"site": {}})
    totals = results.summary({}, {}, steps=len(parts))
    from_acc = Results().summary({"site": acc.states["site"]}, {"site": {}}, steps=len(parts))
    for metric in ("logit_var", "logit_max", "entropy"):
        np.testing.assert_allclose(totals.value("site", metric, "actual"), from_acc.value("site", metric, "actual"),
                                   rtol=1e-11, atol=1e-9, err_msg=metric)
    ref = _reference(parts, "steps")
    n, _, m2 = ref["logit@actual"]
    with np.errstate(all="ignore"):
        np.testing.assert_allclose(totals.value("site", "logit_var", "actual"), np.where(n > 0, m2 / n, np.nan),
                                   rtol=1e-11, atol=1e-9)
        np.testing.assert_allclose(totals.value("site", "entropy", "actual"), ref["entropy@actual"] / ref["rows"],
                                   rtol=1e-12)

    # 3. the ranks: each part one rank's state, some ranks absent for some fields
    present = torch.tensor(rng.random((len(parts), len(FIELDS))) < 0.8)
    present[rng.integers(0, len(parts))] = True  # every field present on some rank
    got = {}
    for j, field in enumerate(FIELDS):
        values = torch.stack([s[field] for s in states])
        got[field] = combine_ranks(field, values, present[:, j])
    kept = {f: [p for p, here in zip(parts, present[:, j].tolist()) if here] for j, f in enumerate(FIELDS)}
    want = {f: _reference(kept[f], "ranks")[f] for f in FIELDS}
    _assert_state(got, want)


def test_window_fold_is_the_pairwise_combine_element_for_element():
    rng = np.random.default_rng(7)
    a, b = (_state(p) for p in _raw_parts(rng, 2))
    entries = [("site", f, tuple(a[f].shape)) for f in FIELDS]
    layout = Layout(entries)
    flat = lambda s: np.concatenate([s[f].numpy().reshape(-1) for f in FIELDS])  # noqa: E731
    totals = flat(a)
    layout.fold(totals, flat(b))
    paired = {f: combine(f, a[f], b[f]) for f in FIELDS}
    np.testing.assert_array_equal(totals, flat(paired))  # numpy and torch: the same arithmetic
    t = torch.from_numpy(flat(a))
    layout.fold(t, torch.from_numpy(flat(b)))
    np.testing.assert_array_equal(t.numpy(), flat(paired))


def test_identities_change_nothing():
    rng = np.random.default_rng(3)
    (a,) = (_state(p) for p in _raw_parts(rng, 1))
    layout = Layout([("s", f, tuple(a[f].shape)) for f in FIELDS if f != "scale"])
    flat = np.concatenate([a[f].numpy().reshape(-1) for f in FIELDS if f != "scale"])
    totals = flat.copy()
    layout.fold(totals, layout.identity())
    np.testing.assert_array_equal(totals, flat)
    empty = layout.identity()
    layout.fold(empty, flat)
    np.testing.assert_array_equal(empty, flat)


def test_merge_adopts_new_fields_and_kinds_follow_the_catalogue():
    into = {"rows": torch.tensor([1.0])}
    merge_states(into, {"rows": torch.tensor([2.0]), "logit_max@unscaled": torch.tensor([4.0])})
    assert into["rows"].item() == 3.0 and into["logit_max@unscaled"].item() == 4.0
    assert [kind(f) for f in FIELDS] == ["moments", "max", "min", "sum", "sum", "last", "sum"]
    assert kind(GRAD_STEPS, "ranks") == "max" and kind("rows", "ranks") == "sum"
