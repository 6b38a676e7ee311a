"""Bad input to the CLI, the config and the threshold parser is exit 2 (or a ProbeError) with a
message naming the problem: never a traceback, never exit 1 ("violations"), never a silent pass.
Real FIFOs, /dev/null, real truncated and corrupted TensorBoard event files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

import probe
from probe.cli.main import main
from probe.ci.thresholds import as_thresholds, load_thresholds, parse_threshold

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOOD = {"format": "probe.summary/1", "steps": 1, "meta": {},
        "sites": {"a": {"info": {}, "metrics": {"logit_max": {"actual": [1.0, 2.0]}, "nonfinite": {"actual": [0, 0]}}}}}


def _check(capsys, *args):
    code = main(["check", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("content, message", [
    ({"format": "probe.summary/1", "sites": {"a": 5}}, "sites['a'] is 5 (int)"),
    ({"format": "probe.summary/1", "sites": {"a": {"metrics": {"logit_max": {"actual": ["1", "2"]}}}}},
     "['actual'][0] is '1' (str), expected a number"),
    ({"format": "probe.summary/1", "sites": {"a": {"metrics": {"logit_max": {"actual": [[1.0], [2.0, 3.0]]}}}}},
     "['actual'][0] is [1.0] (list)"),
    ({"format": "probe.summary/1", "sites": {"a": {"metrics": {"logit_max": [1.0]}}}}, "expected an object of scale"),
    ({"format": "probe.summary/1", "steps": "3", "sites": {}}, '"steps" is \'3\''),
    ({"format": "probe.summary/1", "sites": []}, '"sites" is []'),
    ([1, 2], "expected format"),
])
def test_wrongly_typed_summary_json_is_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "probe_summary.json"
    path.write_text(json.dumps(content))
    code, out, err = _check(capsys, path)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_deeply_nested_json_devnull_and_a_fifo_are_exit_2_without_hanging(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # nobody ever writes to it: opening it for reading must not wait
    for path, message in ((deep, "nested too deeply"), ("/dev/null", "character device"), (fifo, "it is a FIFO"),
                          (tmp_path / "missing.json", "does not exist")):
        code, _, err = _check(capsys, path)
        assert code == 2 and message in err, (path, err)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "probe_summary.json").write_text("")
    assert _check(capsys, empty)[0] == 2


def test_summary_load_raises_probe_error_for_a_fifo(tmp_path):
    fifo = tmp_path / "probe_summary.json"
    os.mkfifo(fifo)
    with pytest.raises(probe.ProbeError, match="FIFO"):
        probe.Summary.load(tmp_path)


def _closed_pipe_run(*args):
    """Run the CLI with its stdout a pipe whose reader has already gone (``... | head -1``)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "probe", *args], stdout=w, stderr=subprocess.PIPE,
                              env=env, text=True, timeout=120)
    finally:
        os.close(w)
    return proc


def test_a_closed_pipe_is_quiet_and_keeps_the_exit_code(tmp_path):
    (tmp_path / "probe_summary.json").write_text(json.dumps(GOOD))
    passing = _closed_pipe_run("check", str(tmp_path))
    assert passing.returncode == 0 and passing.stderr == "", passing.stderr
    failing = _closed_pipe_run("check", str(tmp_path), "-t", "logit_max < 1.5")
    assert failing.returncode == 1 and failing.stderr == "", failing.stderr
    report = _closed_pipe_run("report", str(tmp_path))
    assert report.returncode == 0 and report.stderr == "", report.stderr


@pytest.mark.parametrize("name, text, message", [
    ("tox.ini", "[tool:probe]\nthresholds = logit_max < 1\nthresholds = logit_max < 2\n", "already exists"),
    ("setup.cfg", "[tool:probe]\nthresholds = logit_max < 1\n[tool:probe]\n", "already exists"),
    ("pytest.ini", "[tool:probe\nthresholds = logit_max < 1\n", "no section headers"),
    ("pyproject.toml", "[tool.probe]\nthresholds = [\n", "does not parse"),
])
def test_a_config_file_that_fails_to_parse_is_exit_2_naming_it(tmp_path, capsys, monkeypatch, name, text, message):
    (tmp_path / name).write_text(text)
    (tmp_path / "probe_summary.json").write_text(json.dumps(GOOD))
    monkeypatch.chdir(tmp_path)
    code, _, err = _check(capsys, tmp_path)
    assert code == 2 and message in err and name in err, err


def test_invalid_utf8_in_a_config_file_is_an_error(tmp_path):
    (tmp_path / "setup.cfg").write_bytes(b"[tool:probe]\nthresholds = logit_max < 1 \xff\n")
    with pytest.raises(probe.ProbeError, match="setup.cfg.*not UTF-8"):
        load_thresholds(start=tmp_path)


def test_an_unknown_key_in_the_probe_section_warns_once(tmp_path):
    (tmp_path / "tox.ini").write_text("[DEFAULT]\nother = 1\n[tool:probe]\nthreshold = logit_max < 1\n")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rules, path = load_thresholds(start=tmp_path)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and "unknown key 'threshold'" in messages[0] and "did you mean 'thresholds'" in messages[0]
    assert path.endswith("tox.ini") and [str(r) for r in rules] == ["logit_max < 100", "nonfinite <= 0"]


def _event_run(tmp_path):
    from tests.sinks.sinkutil import model_and_inputs, train_step

    model, xs = model_and_inputs(3)
    run = tmp_path / "run"
    with probe.watch(model, logdir=run):
        for x in xs:
            train_step(model, x)
    os.remove(run / "probe_summary.json")  # probe check then reads the event file
    (event,) = [f for f in os.listdir(run) if f.startswith("events.out.tfevents")]
    return run, event


def test_truncated_and_corrupted_event_files_are_reported(tmp_path, capsys):
    run, event = _event_run(tmp_path)
    data = (run / event).read_bytes()
    assert _check(capsys, run)[0] == 0  # the intact file passes
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / event).write_bytes(data[: len(data) * 2 // 3])
    code, _, err = _check(capsys, cut)
    assert code == 2 and "is truncated" in err and "complete records" in err, err
    bad = tmp_path / "bad"
    bad.mkdir()
    middle = len(data) // 2
    (bad / event).write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
    code, _, err = _check(capsys, bad)
    assert code == 2 and "is corrupted" in err, err


@pytest.mark.parametrize("text, message", [
    ("[:logit_max < 100", "'[' is never closed"),
    (b"logit_max < 100", "got bytes b'logit_max < 100' (decode it first)"),
])
def test_threshold_messages_name_the_real_problem(text, message):
    with pytest.raises(probe.ProbeError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        as_thresholds(text)
    if isinstance(text, str):
        with pytest.raises(probe.ProbeError):
            parse_threshold(text)
