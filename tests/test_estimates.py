"""The default ``rows=`` budget and how estimates are reported: exact at or below the budget,
sampled above it, reproducible, and marked with their standard error in the Summary, its JSON,
``probe report``, ``probe check`` and threshold failures."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from probe.cli.main import ExitCode, main
from probe.ci.check import report_table
from probe.cli.demo import _estimate_note
from probe.session.options import DEFAULT_ROWS
from probe.ci.thresholds import check, format_table


class _Causal(nn.Module):
    def __init__(self, length: int, heads: int = 2, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.q, self.k, self.v = (nn.Parameter(torch.randn(1, heads, length, 8, generator=g) * s) for s in (2, 1, 1))

    def forward(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True)


def _run(length: int, steps: int = 2, **kwargs) -> probe.Summary:
    model = _Causal(length)
    with probe.watch(model, **kwargs) as p:
        for _ in range(steps):
            model().square().sum().backward()
    return p.summary()


def test_the_default_budget_applies_only_above_its_length():
    assert DEFAULT_ROWS == 128
    exact = _run(DEFAULT_ROWS)
    site = exact.sites[0]
    assert "entropy_se" not in exact.metrics(site) and "rows" not in exact.info(site)
    assert exact.standard_error(site, "entropy") is None and exact.estimate_note(site) is None
    sampled = _run(DEFAULT_ROWS + 1)
    site = sampled.sites[0]
    assert sampled.info(site)["sampled"] == [DEFAULT_ROWS, DEFAULT_ROWS + 1]
    for metric in ("entropy", "max_prob", "saturation", "grad_logits"):
        assert sampled.standard_error(site, metric) is not None, metric
    for metric in ("logit_var", "logit_max", "nonfinite", "grad_q"):
        assert sampled.standard_error(site, metric) is None, metric
    assert sampled.estimate_note(site) == f"est., {DEFAULT_ROWS} of {DEFAULT_ROWS + 1} rows"


def test_rows_none_is_exact_and_an_explicit_budget_is_kept():
    s = _run(300, rows=None)
    assert s.standard_error(s.sites[0], "entropy") is None and "sampled" not in s.info(s.sites[0])
    s = _run(300, rows=50)
    assert s.info(s.sites[0])["sampled"] == [50, 300]


def test_the_same_run_draws_the_same_rows_and_steps_draw_new_ones():
    a, b = _run(300, steps=3), _run(300, steps=3)
    site = a.sites[0]
    for metric in a.metrics(site):
        for scale in a.scales(site, metric):
            np.testing.assert_array_equal(a.value(site, metric, scale), b.value(site, metric, scale))
    with probe.watch(_Causal(8)) as p:
        rec = p._rec
        first = rec._sample("layer", 300)
        assert torch.equal(first, rec._sample("layer", 300))
        rec.step += 1
        assert not torch.equal(first, rec._sample("layer", 300))
        assert not torch.equal(first, rec._sample("other", 300))


def test_the_summary_json_keeps_the_estimates(tmp_path):
    s = _run(300)
    site = s.sites[0]
    path = tmp_path / "probe_summary.json"
    s.save(path)
    back = probe.Summary.load(path)
    np.testing.assert_array_equal(back.standard_error(site, "entropy"), s.standard_error(site, "entropy"))
    assert back.estimate_note(site) == "est., 128 of 300 rows"
    data = json.loads(path.read_text())
    assert data["sites"][site]["info"]["sampled"] == [128, 300]


def test_threshold_failures_report_the_estimate_and_its_standard_error():
    s = _run(300)
    failed = check(s, ["entropy > 0.99", "logit_max < 1"])
    est = [v for v in failed if v.metric == "entropy"]
    exact = [v for v in failed if v.metric == "logit_max"]
    assert est and exact
    assert all(v.se is not None and v.se > 0 and v.estimate == "est., 128 of 300 rows" for v in est)
    assert all(v.se is None and "se" not in v.to_dict() for v in exact)
    assert est[0].to_dict()["se"] == est[0].se
    table = format_table(failed)
    assert "± " in table and "(est., 128 of 300 rows)" in table
    line = next(row for row in table.splitlines() if "logit_max" in row)
    assert "±" not in line


def test_report_and_check_mark_estimates(tmp_path, capsys):
    model = _Causal(300)
    with probe.watch(model, logdir=str(tmp_path / "run")) as p:
        model().square().sum().backward()
    table = report_table(p.summary())
    entropy = next(row for row in table.splitlines() if row.strip().startswith("entropy"))
    logit_var = next(row for row in table.splitlines() if row.strip().startswith("logit_var"))
    assert "±" in entropy and "±" not in logit_var and "entropy_se" not in table
    assert "128 of 300 rows sampled" in table
    assert main(["check", str(tmp_path / "run"), "-t", "entropy > 0.99"]) == ExitCode.VIOLATIONS
    out = capsys.readouterr().out
    assert "(est., 128 of 300 rows)" in out and "estimates from sampled query rows" in out
    assert main(["check", str(tmp_path / "run"), "-t", "logit_max < 1000"]) == ExitCode.OK
    assert "estimates" not in capsys.readouterr().out  # only exact values were checked


def test_the_demo_says_when_its_table_holds_estimates():
    assert _estimate_note({"a": {"summary": _run(64)}}) is None
    note = _estimate_note({"a": {"summary": _run(300)}})
    assert note is not None and "est., 128 of 300 rows" in note and "rows=None" in note


@pytest.mark.parametrize("bad", ["auto", 0, 1.5])
def test_bad_rows(bad):
    with pytest.raises(probe.ProbeError, match="`rows`"):
        probe.watch(nn.Linear(2, 2), rows=bad)
