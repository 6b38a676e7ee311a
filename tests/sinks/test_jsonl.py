"""JSONL and CSV sinks: every record matches what the flush held; bad paths are ProbeErrors."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

import probe
from probe.sinks.jsonl import CSVSink, JSONLSink
from tests.sinks.sinkutil import RecordingSink, model_and_inputs, train_step


def _run(tmp_path, steps=3, **kw):
    model, xs = model_and_inputs(steps)
    rec = RecordingSink()
    jl, cs = JSONLSink(tmp_path / "out" / "probe.jsonl", **kw), CSVSink(tmp_path / "out" / "probe.csv", **kw)
    with probe.watch(model, sinks=[rec, jl, cs]) as p:
        for x in xs:
            train_step(model, x)
    return rec, p


def test_jsonl_and_csv_hold_every_value_of_every_flush(tmp_path):
    rec, p = _run(tmp_path)
    records = [json.loads(line) for line in (tmp_path / "out" / "probe.jsonl").read_text().splitlines()]
    rows = list(csv.DictReader((tmp_path / "out" / "probe.csv").open()))
    expected = 0
    by_key = {(r["step"], r["site"], r["metric"], r["scale"]): r for r in records}
    csv_by_key = {(int(r["step"]), r["site"], r["metric"], r["scale"], int(r["head"])): r["value"] for r in rows}
    for step, summary in rec.writes:
        for site in summary.sites:
            for metric in summary.metrics(site):
                for scale in summary.scales(site, metric):
                    values = summary.value(site, metric, scale)
                    r = by_key[(step, site, metric, scale)]
                    assert r["steps"] == 1
                    heads = np.array([np.nan if v is None else v for v in r["heads"]])
                    np.testing.assert_allclose(heads, values, rtol=0, atol=0, equal_nan=True)
                    finite = values[~np.isnan(values)]
                    plain = {"logit_max": max, "nonfinite": sum}.get(metric, lambda v: sum(v) / len(v))
                    assert r["value"] == pytest.approx(plain(list(finite)))
                    for h, v in enumerate(values):
                        got = csv_by_key[(step, site, metric, scale, h)]
                        assert (got == "" and math.isnan(v)) or float(got) == v
                    expected += 1
    assert len(records) == expected and len(rows) == expected * 4
    assert {r["step"] for r in records} == {0, 1, 2}
    assert list(rows[0]) == ["step", "site", "metric", "scale", "head", "value"]


def test_nan_is_null_in_strict_json(tmp_path):
    sink = JSONLSink(tmp_path / "x.jsonl")
    summary = probe.Summary({"s": {"info": {}, "metrics": {"entropy": {"actual": [np.nan, 0.5]}}}}, steps=1)
    sink.write(4, summary)
    sink.close()
    sink.close()  # twice is fine
    (record,) = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert record["heads"] == [None, 0.5] and record["value"] == 0.5 and record["step"] == 4


def test_new_file_by_default_append_on_request(tmp_path):
    _run(tmp_path, steps=1)
    one = (tmp_path / "out" / "probe.jsonl").read_text().count("\n")
    _run(tmp_path, steps=1)
    assert (tmp_path / "out" / "probe.jsonl").read_text().count("\n") == one
    _run(tmp_path, steps=1, append=True)
    assert (tmp_path / "out" / "probe.jsonl").read_text().count("\n") == 2 * one
    lines = (tmp_path / "out" / "probe.csv").read_text().splitlines()
    assert sum(line.startswith("step,") for line in lines) == 1  # no second header when appending


def test_bad_paths_raise_probe_error(tmp_path):
    with pytest.raises(probe.ProbeError, match="expected `path` to be a file path, got int"):
        JSONLSink(3)
    with pytest.raises(probe.ProbeError, match="got a directory"):
        CSVSink(tmp_path)
