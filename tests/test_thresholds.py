"""Threshold expressions, check / assert_stable, NaN handling and config discovery."""

from __future__ import annotations

import math

import pytest
import torch

import probe
from probe.ci.thresholds import (
    DEFAULT_THRESHOLDS,
    Threshold,
    evaluate,
    find_config,
    load_thresholds,
    parse_threshold,
)
from tests.helpers import SDPAModel, reference_metrics

NAN = float("nan")


def _summary(**sites):
    """Summary({site: {metric: {scale: values}}}) with a 'heads' info entry."""
    return probe.Summary({
        name: {"info": {"heads": len(next(iter(next(iter(m.values())).values())))}, "metrics": m}
        for name, m in sites.items()
    })


def _two_sites():
    return _summary(**{
        "enc.0.attn.self": {
            "logit_max": {"actual": [10.0, 99.0, 100.0], "unscaled": [40.0, 396.0, 400.0],
                          "standard": [10.0, 99.0, 100.0], "half": [5.0, 49.5, 50.0]},
            "entropy": {"actual": [0.5, 0.02, 0.01], "unscaled": [0.1, 0.001, 0.0],
                        "standard": [0.5, 0.02, 0.01], "half": [0.7, 0.3, 0.2]},
            "nonfinite": {"actual": [0.0, 0.0, 0.0]},
        },
        "enc.1.attn.self": {
            "logit_max": {"actual": [5.0, 150.0, 20.0], "unscaled": [20.0, 600.0, 80.0],
                          "standard": [5.0, 150.0, 20.0], "half": [2.5, 75.0, 10.0]},
            "entropy": {"actual": [0.9, 0.8, 0.7], "unscaled": [0.3, 0.2, 0.1],
                        "standard": [0.9, 0.8, 0.7], "half": [0.95, 0.9, 0.85]},
            "nonfinite": {"actual": [0.0, 3.0, 0.0]},
        },
    })


def _heads(violations):
    return sorted((v.site, v.head) for v in violations)


# -- parsing ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,site,metric,scale,op,limit",
    [
        ("logit_max < 100", None, "logit_max", "actual", "<", 100.0),
        ("logit_max<=1e2", None, "logit_max", "actual", "<=", 100.0),
        ("  entropy@unscaled > 0.01 ", None, "entropy", "unscaled", ">", 0.01),
        ("*.self:saturation@standard >= -.5", "*.self", "saturation", "standard", ">=", -0.5),
        ("layers.[!0]*:max_prob@half < 0.9", "layers.[!0]*", "max_prob", "half", "<", 0.9),
        ("enc.0.attn#2 : grad_q < 3", "enc.0.attn#2", "grad_q", "actual", "<", 3.0),
    ],
)
def test_parse(text, site, metric, scale, op, limit):
    t = parse_threshold(text)
    assert (t.site, t.metric, t.scale, t.op, t.limit) == (site, metric, scale, op, limit)
    assert t.text == text.strip()


@pytest.mark.parametrize(
    "text,pos,words",
    [
        ("", 0, "empty"),
        ("logit_max 100", 13, "operator"),
        ("logit_max == 100", 10, "unsupported operator"),
        ("logit_max != 100", 10, "unsupported operator"),
        ("logit_max =< 100", 10, "unsupported operator"),
        ("logit_max <> 100", 11, "unsupported operator"),
        ("logit_max <", 11, "expected a number"),
        ("logit_max < abc", 12, "expected a number"),
        ("logit_max < nan", 12, "finite"),
        ("logit_max < inf", 12, "finite"),
        ("logit_max < 1 2", 13, "unexpected text"),
        ("entropyy > 0.1", 0, "unknown metric 'entropyy'"),
        ("*.self: entropyy > 0.1", 8, "unknown metric"),
        ("logit-max < 1", 5, "metric name"),
        ("logit_max@ < 1", 10, "scale name"),
        ("logit_max@un/scaled < 1", 12, "scale name"),
        (":logit_max < 1", 0, "empty site glob"),
        ("< 1", 0, "metric name"),
    ],
)
def test_parse_errors_name_the_position(text, pos, words):
    with pytest.raises(probe.ProbeError) as info:
        parse_threshold(text)
    message = str(info.value)
    assert f"at position {pos}:" in message and words in message
    assert message.splitlines()[-1] == "  " + " " * pos + "^"


def test_parse_rejects_non_strings():
    with pytest.raises(probe.ProbeError, match="expected a threshold expression string, got int"):
        parse_threshold(100)


# -- operators, scales, globs ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "expr,failing",
    [
        ("logit_max < 100", [("enc.0.attn.self", 2), ("enc.1.attn.self", 1)]),   # 100 is not < 100
        ("logit_max <= 100", [("enc.1.attn.self", 1)]),                          # 100 <= 100 holds
        ("entropy > 0.02", [("enc.0.attn.self", 1), ("enc.0.attn.self", 2)]),    # 0.02 is not > 0.02
        ("entropy >= 0.02", [("enc.0.attn.self", 2)]),
    ],
)
def test_every_operator_at_its_boundary(expr, failing):
    assert _heads(probe.check(_two_sites(), [expr])) == failing


@pytest.mark.parametrize(
    "expr,failing",
    [
        ("logit_max@actual < 100", [("enc.0.attn.self", 2), ("enc.1.attn.self", 1)]),
        ("logit_max@unscaled < 100", [("enc.0.attn.self", 1), ("enc.0.attn.self", 2), ("enc.1.attn.self", 1)]),
        ("logit_max@standard < 100", [("enc.0.attn.self", 2), ("enc.1.attn.self", 1)]),
        ("logit_max@half < 50", [("enc.0.attn.self", 2), ("enc.1.attn.self", 1)]),
        ("entropy@unscaled > 0.1", [("enc.0.attn.self", 0), ("enc.0.attn.self", 1), ("enc.0.attn.self", 2),
                                     ("enc.1.attn.self", 2)]),
    ],
)
def test_every_scale(expr, failing):
    got = probe.check(_two_sites(), expr)
    assert _heads(got) == failing
    assert all(v.scale == (expr.split("@")[1].split()[0]) for v in got)


def test_unknown_scale_is_an_error():
    with pytest.raises(probe.ProbeError, match="'logit_max@double < 1'.*no scale 'double'"):
        probe.check(_two_sites(), "logit_max@double < 1")


@pytest.mark.parametrize(
    "glob,sites",
    [
        ("*", ["enc.0.attn.self", "enc.1.attn.self"]),
        ("*.self", ["enc.0.attn.self", "enc.1.attn.self"]),
        ("enc.1.attn.self", ["enc.1.attn.self"]),
        ("enc.[!1].*", ["enc.0.attn.self"]),
        ("enc.?.attn.*", ["enc.0.attn.self", "enc.1.attn.self"]),
    ],
)
def test_site_globs(glob, sites):
    judged = evaluate(_two_sites(), f"{glob}:logit_max < 1000")
    assert sorted({v.site for v in judged}) == sites
    assert all(v.ok for v in judged) and len(judged) == 3 * len(sites)


def test_site_glob_matching_no_site_is_an_error():
    with pytest.raises(probe.ProbeError, match=r"site glob 'dec\.\*' matches no site; sites: enc.0.attn.self, enc.1"):
        probe.check(_two_sites(), "dec.*:logit_max < 100")


# -- defaults, empty input, missing metrics -------------------------------------------------------
def test_defaults_when_none_given():
    assert [str(parse_threshold(t)) for t in DEFAULT_THRESHOLDS] == ["logit_max < 100", "nonfinite <= 0"]
    got = probe.check(_two_sites())
    assert [(v.site, v.head, v.metric) for v in got] == [
        ("enc.1.attn.self", 1, "nonfinite"),   # excess 3 (absolute, limit 0)
        ("enc.1.attn.self", 1, "logit_max"),   # excess 0.5 (relative)
        ("enc.0.attn.self", 2, "logit_max"),   # excess 0
    ]
    with pytest.raises(probe.StabilityError) as info:
        probe.assert_stable(_two_sites())
    assert "3 attention stability violations" in str(info.value)


def test_assert_stable_passes_and_its_error_is_an_assertion():
    probe.assert_stable(_two_sites(), "logit_max < 151", "*.self:entropy@half > 0.1")
    assert issubclass(probe.StabilityError, AssertionError)


def test_table_worst_first_names_site_head_metric_value_limit():
    with pytest.raises(AssertionError) as info:
        probe.assert_stable(_two_sites(), "logit_max < 100", "entropy@unscaled > 0.05")
    lines = str(info.value).splitlines()
    assert lines[0] == "4 attention stability violations (worst first):"
    assert lines[1].split() == ["site", "head", "metric@scale", "value", "limit", "threshold"]
    rows = [ln.split() for ln in lines[2:]]
    # excess: entropy 0.0 vs > 0.05 -> 1.0; 0.001 -> 0.98; logit_max 150 vs < 100 -> 0.5; 100 -> 0.
    excess = [v.excess for v in probe.check(_two_sites(), ["logit_max < 100", "entropy@unscaled > 0.05"])]
    assert excess == sorted(excess, reverse=True)
    assert rows[0][:6] == ["enc.0.attn.self", "2", "entropy@unscaled", "0", ">", "0.05"]
    assert rows[1][:4] == ["enc.0.attn.self", "1", "entropy@unscaled", "0.001"]
    assert rows[2][:6] == ["enc.1.attn.self", "1", "logit_max@actual", "150", "<", "100"]
    assert rows[-1][:4] == ["enc.0.attn.self", "2", "logit_max@actual", "100"]


def test_empty_threshold_list_is_an_error_not_a_pass():
    with pytest.raises(probe.ProbeError, match="at least one expression"):
        probe.check(_two_sites(), [])


@pytest.mark.parametrize("bad", [3.5, {"logit_max": 1}.items()])
def test_bad_threshold_types(bad):
    with pytest.raises(probe.ProbeError):
        probe.check(_two_sites(), bad)


def test_empty_summary_is_an_error():
    with pytest.raises(probe.ProbeError, match="summary is empty"):
        probe.check(probe.Summary({}), "logit_max < 100")
    with pytest.raises(probe.ProbeError, match="expected `summary` to be a probe.Summary, got dict"):
        probe.check({}, "logit_max < 100")


def test_metric_the_summary_lacks_is_an_error():
    with pytest.raises(probe.ProbeError, match="no metric 'grad_q'.*backward pass"):
        probe.check(_two_sites(), "grad_q < 10")


# -- NaN ---------------------------------------------------------------------------------------------
def test_nan_head_without_data_is_skipped_but_heads_with_data_are_judged():
    s = _summary(a={"entropy": {"actual": [NAN, 0.001, 0.5]}, "nonfinite": {"actual": [0.0, 0.0, 0.0]}})
    judged = evaluate(s, "entropy > 0.01")
    assert [v.head for v in judged] == [1, 2]
    assert _heads(probe.check(s, "entropy > 0.01")) == [("a", 1)]


def test_site_with_no_data_is_an_error():
    s = _summary(a={"entropy": {"actual": [0.4, 0.5]}}, b={"entropy": {"actual": [NAN, NAN]}})
    with pytest.raises(probe.ProbeError, match="site 'b' has no data for entropy@actual"):
        probe.check(s, "entropy > 0.01")
    assert probe.check(s, "a:entropy > 0.01") == []


def test_nan_from_nonfinite_logits_is_a_violation():
    s = _summary(a={"logit_max": {"actual": [3.0, NAN]}, "nonfinite": {"actual": [0.0, 12.0]}})
    got = probe.check(s, "logit_max < 100")
    assert len(got) == 1 and got[0].head == 1 and math.isnan(got[0].value)
    assert got[0].excess == math.inf and got[0].to_dict()["value"] is None


def test_nan_gradient_is_always_a_violation():
    s = _summary(a={"grad_q": {"actual": [1.0, NAN]}})
    assert [(v.head, math.isnan(v.value)) for v in probe.check(s, "grad_q < 100")] == [(1, True)]


def test_json_round_trip_keeps_nan_semantics(tmp_path):
    s = _summary(a={"logit_max": {"actual": [NAN, 120.0]}, "nonfinite": {"actual": [0.0, 0.0]}})
    s.save(tmp_path / "probe_summary.json")
    back = probe.Summary.load(tmp_path)
    assert _heads(probe.check(back)) == [("a", 1)]


# -- a real model, against a float64 reference -----------------------------------------------------
def test_collapsed_heads_of_a_real_model_match_the_reference():
    model = SDPAModel(layers=2, d_model=32, heads=4, scale=1.0).eval()
    with torch.no_grad():  # large query weights: the logits of an unscaled model blow up
        for layer in model.layers:
            layer.q.weight.mul_(torch.tensor([1.0, 2.0, 4.0, 8.0]).repeat_interleave(8)[:, None])
    x = torch.randn(2, 7, 32)
    inputs = {}
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
               for i, layer in enumerate(model.layers)]
    try:
        with probe.watch(model, grads=False) as p, torch.no_grad():
            model(x)
        summary = p.summary()
    finally:
        for h in handles:
            h.remove()
    limit = 10.0
    expected = []
    for i, layer in enumerate(model.layers):
        xn = inputs[i].double()
        b, n, _ = xn.shape
        q = (xn @ layer.q.weight.double().T + layer.q.bias.double()).view(b, n, 4, 8).transpose(1, 2)
        kv = (xn @ layer.kv.weight.double().T + layer.kv.bias.double()).view(b, n, 2, 4, 8).permute(2, 0, 3, 1, 4)
        ref = reference_metrics(q, kv[0], 1.0, torch.ones(b, 4, n, n, dtype=torch.bool))
        expected += [(f"layers.{i}", h, ref["logit_max"][h]) for h in range(4) if ref["logit_max"][h] >= limit]
    got = probe.check(summary, f"logit_max < {limit}")
    assert 0 < len(expected) < 8, "the large query weights should push some heads, not all, past the limit"
    assert sorted((v.site, v.head) for v in got) == sorted((s, h) for s, h, _ in expected)
    want = {(s, h): value for s, h, value in expected}
    for v in got:
        assert v.value == pytest.approx(want[(v.site, v.head)], rel=1e-4)
    with pytest.raises(probe.ProbeError, match="grad"):
        probe.check(summary, "grad_v < 1e3")  # inference only: no grad metrics


# -- config -------------------------------------------------------------------------------------------
def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_config_found_upward_first_file_with_section_wins(tmp_path, monkeypatch):
    _write(tmp_path / "setup.cfg", "[tool:probe]\nthresholds =\n    logit_max < 50\n    # a comment\n    entropy > 0.1\n")
    _write(tmp_path / "pkg" / "tox.ini", "[tox]\nenvlist = py\n")            # no section: skipped
    _write(tmp_path / "pkg" / "setup.cfg", "[metadata]\nname = x\n")         # no section: skipped
    start = tmp_path / "pkg" / "tests"
    start.mkdir()
    assert find_config(start) == str(tmp_path / "setup.cfg")
    monkeypatch.chdir(start)
    thresholds, path = load_thresholds()
    assert path == str(tmp_path / "setup.cfg")
    assert [t.text for t in thresholds] == ["logit_max < 50", "entropy > 0.1"]


def test_config_closest_directory_and_file_order(tmp_path):
    _write(tmp_path / "setup.cfg", "[tool:probe]\nthresholds = logit_max < 1\n")
    sub = tmp_path / "sub"
    _write(sub / "setup.cfg", "[tool:probe]\nthresholds = logit_max < 3\n")
    _write(sub / "tox.ini", "[tool:probe]\nthresholds = logit_max < 2\n")
    assert [t.limit for t in load_thresholds(start=sub)[0]] == [2.0]          # tox.ini before setup.cfg
    _write(sub / "pytest.ini", "[pytest]\n[tool:probe]\nthresholds = logit_max < 4\n")
    assert [t.limit for t in load_thresholds(start=sub)[0]] == [4.0]          # pytest.ini first
    assert [t.limit for t in load_thresholds(start=tmp_path)[0]] == [1.0]
    assert find_config(sub / "pytest.ini") == str(sub / "pytest.ini")         # a file: its directory


def test_no_config_gives_the_defaults(tmp_path):
    (tmp_path / "setup.cfg").write_text("[metadata]\nname = x\n")
    assert find_config(tmp_path) is None, "a [tool:probe] config above the temporary directory"
    thresholds, path = load_thresholds(start=tmp_path)
    assert path is None and [t.text for t in thresholds] == list(DEFAULT_THRESHOLDS)
    _write(tmp_path / "tox.ini", "[tool:probe]\nother = 1\n")                 # section, no key
    thresholds, path = load_thresholds(start=tmp_path)
    assert path == str(tmp_path / "tox.ini") and [t.text for t in thresholds] == list(DEFAULT_THRESHOLDS)


def test_config_errors(tmp_path):
    plain = _write(tmp_path / "a" / "setup.cfg", "[metadata]\nname = x\n")
    with pytest.raises(probe.ProbeError, match=r"has no \[tool:probe\] section"):
        load_thresholds(plain)
    empty = _write(tmp_path / "b" / "setup.cfg", "[tool:probe]\nthresholds =\n")
    with pytest.raises(probe.ProbeError, match="at least one"):
        load_thresholds(empty)
    bad = _write(tmp_path / "c" / "setup.cfg", "[tool:probe]\nthresholds =\n    logit_max < 1\n    entropyy > 1\n")
    with pytest.raises(probe.ProbeError, match=r"setup.cfg.*unknown metric 'entropyy'"):
        load_thresholds(bad)
    with pytest.raises(probe.ProbeError, match="cannot read config file"):
        load_thresholds(tmp_path / "missing.cfg")
    broken = _write(tmp_path / "d" / "setup.cfg", "no section header\n")
    with pytest.raises(probe.ProbeError, match="cannot read config file"):
        load_thresholds(broken)


def test_threshold_objects_are_accepted():
    t = Threshold(metric="logit_max", op="<", limit=100.0, site="enc.1.*")
    assert _heads(probe.check(_two_sites(), [t])) == [("enc.1.attn.self", 1)]
    assert str(t) == "enc.1.*:logit_max@actual < 100"


def test_pyproject_toml(tmp_path):
    _write(tmp_path / "setup.cfg", "[tool:probe]\nthresholds = logit_max < 3\n")
    _write(tmp_path / "pyproject.toml", '[project]\nname = "x"\n')                      # no [tool.probe]
    assert [t.limit for t in load_thresholds(start=tmp_path)[0]] == [3.0]
    _write(tmp_path / "pyproject.toml", '[tool.probe]\nthresholds = ["logit_max < 2", "*.self:entropy > 0.1"]\n')
    thresholds, path = load_thresholds(start=tmp_path)                                  # before tox.ini, setup.cfg
    assert path == str(tmp_path / "pyproject.toml")
    assert [(t.site, t.metric, t.limit) for t in thresholds] == [(None, "logit_max", 2.0), ("*.self", "entropy", 0.1)]
    _write(tmp_path / "pytest.ini", "[tool:probe]\nthresholds = logit_max < 1\n")
    assert [t.limit for t in load_thresholds(start=tmp_path)[0]] == [1.0]               # pytest.ini first
    bad = _write(tmp_path / "b" / "pyproject.toml", "[tool.probe]\nthresholds = 100\n")
    with pytest.raises(probe.ProbeError, match=r"\[tool.probe\] thresholds to be a list of strings, got int"):
        load_thresholds(bad)
    broken = _write(tmp_path / "c" / "pyproject.toml", "[tool.probe\n")
    with pytest.raises(probe.ProbeError, match="cannot read config file .*pyproject.toml.*does not parse"):
        find_config(broken.parent)  # an error while searching too: it may hold the section (issue 12)
    with pytest.raises(probe.ProbeError, match="cannot read config file"):
        load_thresholds(broken)                                                         # an error when named
    with pytest.raises(probe.ProbeError, match=r"has no \[tool.probe\] section"):
        load_thresholds(_write(tmp_path / "d" / "pyproject.toml", "[tool.other]\nx = 1\n"))


def test_gqa_grad_k_is_judged_per_kv_head():
    s = _summary(a={"logit_max": {"actual": [1.0, 2.0, 3.0, 4.0]}, "nonfinite": {"actual": [0.0] * 4},
                    "grad_k": {"actual": [0.5, 2.0]}})
    assert [(v.head, v.value) for v in probe.check(s, ["grad_k < 1", "logit_max < 100"])] == [(1, 2.0)]
