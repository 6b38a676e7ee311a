"""`probe check` / `probe report`: exit codes through a subprocess, sources, config, JSON output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import probe
from probe.cli.main import ExitCode, main
from probe.ci.runs import StepWindow, load_run
from tests.helpers import SDPAModel

NAN = float("nan")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "probe", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _save(path, logit_max, nonfinite=(0.0, 0.0, 0.0)):
    s = probe.Summary({
        "enc.0.attn": {
            "info": {"kind": "sdpa", "heads": 3, "kv_heads": 3, "d_k": 16, "scale": 0.25, "calls": 2},
            "metrics": {"logit_max": {"actual": list(logit_max), "unscaled": [4 * v for v in logit_max]},
                        "entropy": {"actual": [0.5, 0.4, NAN]}, "nonfinite": {"actual": list(nonfinite)}},
        },
    }, steps=2)
    path.mkdir(parents=True, exist_ok=True)
    s.save(path / "probe_summary.json")
    return path


# -- the three exit codes, through a subprocess ----------------------------------------------------
def test_exit_0_pass(tmp_path):
    run = _save(tmp_path / "run", [10.0, 20.0, 30.0])
    r = _run("check", str(run), cwd=tmp_path)
    assert r.returncode == ExitCode.OK == 0, r.stderr
    assert "thresholds from the defaults: logit_max < 100, nonfinite <= 0" in r.stdout
    assert "PASS: 6 head values checked" in r.stdout


def test_exit_1_violations_table_and_json(tmp_path):
    run = _save(tmp_path / "run", [10.0, 150.0, 120.0])
    r = _run("check", str(run / "probe_summary.json"), "-t", "logit_max < 100", "--threshold",
             "entropy > 0.45", cwd=tmp_path)
    assert r.returncode == ExitCode.VIOLATIONS == 1, r.stderr
    lines = r.stdout.splitlines()
    assert "FAIL: 3 violations (worst first)" in lines
    rows = [ln.split() for ln in lines[lines.index("FAIL: 3 violations (worst first)") + 2:]]
    assert [r_[:6] for r_ in rows] == [
        ["enc.0.attn", "1", "logit_max@actual", "150", "<", "100"],
        ["enc.0.attn", "2", "logit_max@actual", "120", "<", "100"],
        ["enc.0.attn", "1", "entropy@actual", "0.4", ">", "0.45"],
    ]


def test_check_json(tmp_path, capsys):
    run = _save(tmp_path / "run", [10.0, 150.0, 120.0])
    assert main(["check", str(run), "--json"]) == ExitCode.VIOLATIONS
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["source"] == "summary" and out["thresholds_from"] == "the defaults"
    assert [(v["head"], v["value"], v["limit"]) for v in out["violations"]] == [(1, 150.0, 100.0), (2, 120.0, 100.0)]


def test_exit_2_unreadable_or_missing_input(tmp_path):
    r = _run("check", str(tmp_path / "missing"), cwd=tmp_path)
    assert r.returncode == ExitCode.USAGE == 2
    assert "does not exist" in r.stderr and r.stdout == ""


# -- more exit-2 cases, in process ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "make,args,message",
    [
        (lambda d: None, ["check"], "required"),                                           # argparse usage
        (lambda d: _save(d / "r", [1.0, 2.0, 3.0]), ["check", "r", "-t", "logit_max =< 3"], "at position 10"),
        (lambda d: (d / "empty").mkdir(), ["check", "empty"], "found neither"),
        (lambda d: (d / "bad.json").write_text("{not json"), ["check", "bad.json"], "cannot read probe summary"),
        (lambda d: (d / "other.json").write_text("{}"), ["check", "other.json"], "not a probe summary"),
        (lambda d: probe.Summary({}).save(d / "probe_summary.json"), ["check", "."], "summary is empty"),
        (lambda d: _save(d / "r", [1.0, 2.0, 3.0]), ["check", "r", "-t", "grad_q < 1"], "no metric 'grad_q'"),
        (lambda d: _save(d / "r", [1.0, 2.0, 3.0]), ["check", "r", "-t", "dec*:logit_max < 1"], "matches no site"),
        (lambda d: _save(d / "r", [1.0, 2.0, 3.0]), ["check", "r", "-t", "logit_max@x < 1"], "no scale 'x'"),
        (lambda d: _save(d / "r", [1.0, 2.0, 3.0]), ["check", "r", "--config", "nope.cfg"], "cannot read config"),
        (lambda d: _save(d / "r", [NAN, NAN, NAN]), ["check", "r"], "no data"),
        (lambda d: None, ["report", "nowhere"], "does not exist"),
    ],
)
def test_exit_2_cases(tmp_path, monkeypatch, capsys, make, args, message):
    monkeypatch.chdir(tmp_path)
    make(tmp_path)
    assert main(args) == ExitCode.USAGE
    assert message in capsys.readouterr().err


def test_json_error_object(tmp_path, capsys):
    assert main(["check", str(tmp_path / "missing"), "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["exit"] == 2 and "does not exist" in out["error"]


# -- config discovery and precedence -------------------------------------------------------------------
def test_config_found_from_the_current_directory_upward(tmp_path, monkeypatch, capsys):
    run = _save(tmp_path / "run", [10.0, 20.0, 30.0])
    (tmp_path / "setup.cfg").write_text("[tool:probe]\nthresholds =\n    logit_max < 25\n")
    (tmp_path / "deep" / "er").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "deep" / "er")
    assert main(["check", str(run)]) == ExitCode.VIOLATIONS
    out = capsys.readouterr().out
    assert f"thresholds from {tmp_path / 'setup.cfg'}: logit_max < 25" in out and "30" in out
    other = tmp_path / "other.ini"
    other.write_text("[tool:probe]\nthresholds = logit_max < 31\n")
    assert main(["check", str(run), "--config", str(other)]) == ExitCode.OK            # --config wins
    assert main(["check", str(run), "--config", str(other), "-t", "logit_max < 5"]) == 1  # -t wins


# -- TensorBoard events instead of a summary ------------------------------------------------------
def _real_run(logdir, per_head):
    model = SDPAModel(layers=2, d_model=32, heads=4, scale=1.0)
    with torch.no_grad():  # head 2 of each layer gets large logits
        for layer in model.layers:
            layer.q.weight.mul_(torch.tensor([1.0, 1.0, 30.0, 1.0]).repeat_interleave(8)[:, None])
    with probe.watch(model, logdir=str(logdir), per_head=per_head):
        for _ in range(3):
            model(torch.randn(2, 5, 32)).sum().backward()
    full = probe.Summary.load(logdir)
    os.remove(logdir / "probe_summary.json")
    return full


def test_tensorboard_events_head_aggregated(tmp_path, capsys):
    from probe.sinks.tensorboard import TensorBoardSink

    steps = {  # step -> per-head values of one site
        0: {"logit_max": [10.0, 50.0], "entropy": [0.5, 0.3], "nonfinite": [0.0, 1.0]},
        4: {"logit_max": [140.0, 20.0], "entropy": [0.1, 0.3], "nonfinite": [0.0, 2.0]},
    }
    sink = TensorBoardSink(str(tmp_path / "tb"))
    for step, metrics in steps.items():
        sink.write(step, probe.Summary({"a.attn": {"info": {"heads": 2}, "metrics": {
            m: {"actual": v} for m, v in metrics.items()}}}))
    sink.close()
    events, source = load_run(str(tmp_path / "tb"))
    assert source == "tensorboard" and events.sites == ["a.attn"] and events.steps == 2
    assert events.info("a.attn")["heads_aggregated"] is True
    assert events.value("a.attn", "logit_max").tolist() == [140.0]                  # max over heads, steps
    assert events.value("a.attn", "nonfinite").tolist() == [3.0]                    # sum over heads, steps
    np.testing.assert_allclose(events.value("a.attn", "entropy"), [(0.4 + 0.2) / 2])  # mean of head means
    assert main(["check", str(tmp_path / "tb"), "-t", "logit_max < 100"]) == ExitCode.VIOLATIONS
    out = capsys.readouterr().out
    assert "only head-aggregated scalars" in out
    assert "a.attn  agg   logit_max@actual  140" in out


def test_tensorboard_events_per_head_match_the_summary(tmp_path):
    full = _real_run(tmp_path / "tb", per_head=True)
    events, _ = load_run(str(tmp_path / "tb"))
    for site in full.sites:
        assert events.info(site)["heads_aggregated"] is False
        for metric in ("logit_max", "nonfinite", "grad_q", "grad_v"):  # exact step reductions
            np.testing.assert_allclose(events.value(site, metric), full.value(site, metric), rtol=1e-5)
        np.testing.assert_allclose(events.value(site, "logit_max", "unscaled"),
                                   full.value(site, "logit_max", "unscaled"), rtol=1e-5)
    event_file = next(f for f in os.listdir(tmp_path / "tb") if f.startswith("events.out.tfevents"))
    assert load_run(str(tmp_path / "tb" / event_file))[1] == "tensorboard"


# -- report --------------------------------------------------------------------------------------------
def test_report_and_json(tmp_path, capsys):
    run = _save(tmp_path / "run", [10.0, 150.0, 120.0])
    assert main(["report", str(run)]) == ExitCode.OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("values from all 2 probed steps;")
    assert lines[2].startswith("enc.0.attn  (kind sdpa, heads 3, kv_heads 3, d_k 16, scale 1/√16, calls 2)")
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[3:]}
    assert rows["metric"] == ["actual", "unscaled", "heads", "@actual", "(min..max)"]
    assert rows["logit_max"] == ["150", "600", "10..150"]      # head max; unscaled = 4x
    assert rows["entropy"] == ["0.45", "-", "0.4..0.5"]       # head mean, NaN head ignored
    assert main(["report", str(run), "--json"]) == ExitCode.OK
    data = json.loads(capsys.readouterr().out)
    assert probe.Summary.from_dict(data["summary"]).value("enc.0.attn", "logit_max").tolist() == [10.0, 150.0, 120.0]


# -- a directory of runs, step windows -------------------------------------------------------------
def test_parent_directory_judges_every_run_and_exits_with_the_worst(tmp_path, capsys):
    _save(tmp_path / "demo" / "scaled", [10.0, 20.0, 30.0])
    _save(tmp_path / "demo" / "unscaled", [10.0, 150.0, 30.0])
    assert main(["check", str(tmp_path / "demo")]) == ExitCode.VIOLATIONS
    out = capsys.readouterr().out
    assert "2 runs below it" in out
    verdicts = out[out.index("verdicts (worst first):"):].splitlines()[1:]
    assert verdicts[0].split()[:2] == ["FAIL", str(tmp_path / "demo" / "unscaled")]
    assert verdicts[1].split()[:2] == ["PASS", str(tmp_path / "demo" / "scaled")]
    (tmp_path / "demo" / "broken").mkdir()
    (tmp_path / "demo" / "broken" / "probe_summary.json").write_text("{")
    assert main(["check", str(tmp_path / "demo"), "--json"]) == ExitCode.USAGE
    data = json.loads(capsys.readouterr().out)
    assert [r["exit"] for r in data["runs"]] == [2, 0, 1] and data["ok"] is False
    assert main(["report", str(tmp_path / "demo" / "scaled")]) == ExitCode.OK


def _sink_run(logdir, per_step):
    from probe.sinks.tensorboard import TensorBoardSink

    with TensorBoardSink(str(logdir), images=False, histograms=False) as sink:
        for step, (logit_max, grad) in per_step.items():
            sink.write(step, probe.Summary({"a.attn": {"info": {"heads": 1}, "metrics": {
                "logit_max": {"actual": [logit_max]}, "nonfinite": {"actual": [0.0]}, "grad_q": {"actual": [grad]}}}}))


def test_last_n_and_step_range_judge_a_window(tmp_path, capsys):
    _sink_run(tmp_path / "tb", {0: (150.0, 3.0), 5: (90.0, 4.0), 10: (40.0, 0.0)})
    assert main(["check", str(tmp_path / "tb")]) == ExitCode.VIOLATIONS
    assert main(["check", str(tmp_path / "tb"), "--last", "2"]) == ExitCode.OK
    out = capsys.readouterr().out
    assert "values from the last 2 probed steps: 2 probed steps (5..10)" in out
    assert main(["check", str(tmp_path / "tb"), "--steps", "0:5", "-t", "logit_max < 100"]) == 1
    events, _ = load_run(str(tmp_path / "tb"), StepWindow(start=5))
    assert events.value("a.attn", "logit_max").tolist() == [90.0]
    np.testing.assert_allclose(events.value("a.attn", "grad_q"), [np.sqrt((16.0 + 0.0) / 2)])  # RMS over steps
    assert main(["check", str(tmp_path / "tb"), "--steps", "20:"]) == ExitCode.USAGE
    assert "no probed step in steps 20.." in capsys.readouterr().err
    _save(tmp_path / "summary_only", [1.0, 2.0, 3.0])
    assert main(["check", str(tmp_path / "summary_only"), "--last", "3"]) == ExitCode.USAGE
    assert "needs the run's TensorBoard event files" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "tb"), "--steps", "9:3"]) == ExitCode.USAGE


def test_a_rerun_into_the_same_directory_is_not_mixed_in(tmp_path, capsys):
    import time

    _sink_run(tmp_path / "tb", {0: (150.0, 1.0), 5: (150.0, 1.0)})
    time.sleep(1.1)  # event file names carry the second they were created
    _sink_run(tmp_path / "tb", {0: (10.0, 1.0), 5: (20.0, 1.0)})
    events, _ = load_run(str(tmp_path / "tb"))
    assert events.steps == 2 and events.value("a.attn", "logit_max").tolist() == [20.0]
    assert "holds more than one run" in events.meta["note"]
