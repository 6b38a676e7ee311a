"""A diverging run keeps its summary: inf and NaN statistics round-trip losslessly, close() never
raises because a write failed, gradient norms do not overflow where the model's gradients are
finite, and no temporary file is left behind."""

from __future__ import annotations

import json
import math
import os
import warnings

import numpy as np
import pytest
import torch

import probe
from probe.cli.main import main
from tests.helpers import OneCall, SDPAModel


def _files(path):
    return sorted(os.listdir(path))


def _temp_files(path):
    return [f for f in os.listdir(path) if "tmp" in f or f.startswith(".")]


def _huge_logits_model():
    # q·k of about 1e20 per entry: finite in float32, a finite output, logit_max ~ 1e20 at every
    # scale, and unscaled variance ~1e40: beyond float32 (each row's float32 sum of squares
    # overflows), measured again rescaled on CPUs (probe.stats.forward), exact in float64
    torch.manual_seed(0)
    q = torch.randn(1, 2, 5, 8) * 1e10
    k = torch.randn(1, 2, 5, 8) * 1e10
    v = torch.randn(1, 2, 5, 8)
    return OneCall(q, k, v)


def test_summary_round_trips_inf_and_nan_losslessly(tmp_path):
    values = [1.5, math.inf, -math.inf, math.nan]
    s = probe.Summary({"a": {"info": {"scale": math.nan, "softcap": math.inf, "kind": "sdpa"},
                             "metrics": {"logit_max": {"actual": values}}}}, steps=2)
    s.save(tmp_path / "probe_summary.json")
    text = (tmp_path / "probe_summary.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON token {c}"))  # strict JSON
    back = probe.Summary.load(tmp_path)
    got = back.value("a", "logit_max")
    assert got[0] == 1.5 and got[1] == math.inf and got[2] == -math.inf and math.isnan(got[3])
    info = back.info("a")
    assert math.isnan(info["scale"]) and info["softcap"] == math.inf and info["kind"] == "sdpa"
    assert _files(tmp_path) == ["probe_summary.json"]


def test_huge_logits_close_writes_the_summary_and_check_fails(tmp_path, capsys):
    model = _huge_logits_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the write succeeds
        with probe.watch(model, logdir=tmp_path / "run") as p:
            out = model()
        assert torch.isfinite(out).all()
    saved = probe.Summary.load(tmp_path / "run")
    live = p.summary()
    for scale in ("actual", "unscaled"):
        np.testing.assert_array_equal(saved.value("root", "logit_var", scale), live.value("root", "logit_var", scale))
    q, k = model.args[0], model.args[1]
    logits = q.double() @ k.double().transpose(-1, -2)  # ~1e40 variance: exact, not inf
    want = logits.var(dim=(0, 2, 3), unbiased=False).numpy()
    np.testing.assert_allclose(saved.value("root", "logit_var", "unscaled"), want, rtol=1e-5)
    assert _temp_files(tmp_path / "run") == []
    assert main(["check", str(tmp_path / "run"), "-t", "logit_var@unscaled < 1e30"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out


def test_inf_logit_max_is_a_violation_through_the_cli(tmp_path, capsys):
    probe.Summary({"s": {"info": {}, "metrics": {"logit_max": {"actual": [3.0, math.inf]},
                                                 "nonfinite": {"actual": [0.0, 0.0]}}}}, steps=1).save(tmp_path / "probe_summary.json")
    assert main(["check", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-standard JSON token {c}"))
    (v,) = report["violations"]
    assert v["head"] == 1 and v["value"] == "inf" and v["metric"] == "logit_max"


def test_sdpa_with_nan_scale_keeps_the_summary(tmp_path):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    model = OneCall(q, k, v, scale=math.nan)
    with probe.watch(model, logdir=tmp_path) as p:
        model()
    saved = probe.Summary.load(tmp_path)
    assert math.isnan(saved.info("root")["scale"])
    assert saved.value("root", "nonfinite", "actual").sum() > 0
    assert saved.sites == p.summary().sites
    assert _temp_files(tmp_path) == []


def test_close_warns_instead_of_raising_when_the_summary_cannot_be_written(tmp_path, monkeypatch):
    model = SDPAModel(layers=1)
    p = probe.watch(model, logdir=tmp_path)
    model(torch.randn(1, 3, 64))

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        p.close()  # does not raise
    assert any("could not write probe_summary.json" in str(w.message) and "No space left" in str(w.message)
               for w in record)
    assert _temp_files(tmp_path) == []  # the temp file was removed
    assert p.summary().steps == 1  # the statistics are still there


def test_gradient_norms_do_not_overflow_when_the_models_gradients_are_finite():
    torch.manual_seed(0)
    model = SDPAModel(layers=1)
    x = torch.randn(2, 5, 64)
    with probe.watch(model) as p:
        (model(x).square().sum() * 1e30).backward()  # the loss is huge, but finite in float32
    grads = {n: t.grad for n, t in model.named_parameters()}
    assert all(torch.isfinite(g).all() for g in grads.values())
    s = p.summary()
    for metric in ("grad_q", "grad_k", "grad_v", "grad_logits"):
        for scale in s.scales("layers.0", metric):
            value = s.value("layers.0", metric, scale)
            assert np.isfinite(value).all() and (value > 1e25).all(), (metric, scale, value)
    # and they are the same numbers as at a loss of 1, scaled by 1e30 (norms are linear in the loss)
    with probe.watch(model) as q:
        model.zero_grad()
        model(x).square().sum().backward()
    ref = q.summary()
    for metric in ("grad_q", "grad_v", "grad_logits"):
        np.testing.assert_allclose(s.value("layers.0", metric, "actual"), ref.value("layers.0", metric, "actual") * 1e30,
                                   rtol=1e-4)


def test_the_jsonl_sink_writes_inf_as_strict_json(tmp_path):
    from probe.sinks.jsonl import JSONLSink

    s = probe.Summary({"a": {"info": {}, "metrics": {"logit_max": {"actual": [1.0, math.inf]},
                                                     "entropy": {"actual": [math.nan, 0.5]}}}}, steps=1)
    with JSONLSink(tmp_path / "p.jsonl") as sink:
        sink.write(3, s)
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON token {c}"))
               for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    by_metric = {r["metric"]: r for r in records}
    assert by_metric["logit_max"]["value"] == "inf" and by_metric["logit_max"]["heads"] == [1.0, "inf"]
    assert by_metric["entropy"]["heads"] == [None, 0.5]
