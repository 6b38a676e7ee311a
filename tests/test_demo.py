"""`probe demo` end to end: at its default settings, at one and at two torch threads, its verdicts
and its reading agree with the runs it wrote, and the story holds with a margin."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

import probe
from probe.ci.runs import StepWindow, summary_from_events
from probe.cli.demo import RUNS, WITH, WITHOUT, run_demo

SITES = ["blocks.0.attn", "blocks.1.attn"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _numbers(line):
    """The numbers of a line, each with its precision: (value, half a unit of its last digit)."""
    out = []
    for text in re.findall(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?%?", line):
        percent = text.endswith("%")
        digits = text.rstrip("%").replace(",", "")
        decimals = len(digits.split(".")[1]) if "." in digits else 0
        scale = 0.01 if percent else 1.0
        out.append((float(digits) * scale, 0.5 * 10 ** -decimals * scale))
    return out


def _agrees(line, expected):
    """The numbers of ``line`` after its label (steps and 1/√d_k left out) are ``expected``, each to
    the precision it is printed with."""
    values = re.sub(r"steps? \d+(-\d+)?|1/√\d+", "", line.split(": ", 1)[-1])
    found = _numbers(values)
    return len(found) == len(expected) and all(abs(v - e) <= tol * 1.001 + 1e-9 for (v, tol), e in zip(found, expected))


def _at(run_dir, step):
    """The run's head aggregates at one probed step, read back from its event files."""
    return summary_from_events(run_dir, StepWindow(start=step, stop=step))


def _mean(summary, metric, scale="actual"):
    return sum(float(summary.value(site, metric, scale)[0]) for site in SITES) / len(SITES)


def _ratio(summary):
    return sum(float(summary.value(site, "grad_logits", "unscaled")[0] / summary.value(site, "grad_logits", "standard")[0])
               for site in SITES) / len(SITES)


@pytest.fixture(scope="module", params=[1, 2], ids=["1-thread", "2-threads"])
def demo(request, tmp_path_factory):
    """``probe demo`` at its defaults in a fresh process with OMP_NUM_THREADS=1 or 2, then ``probe check``."""
    logdir = tmp_path_factory.mktemp(f"demo{request.param}")
    env = dict(os.environ, OMP_NUM_THREADS=str(request.param), PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-m", "probe", "demo", "--logdir", str(logdir)],
                         capture_output=True, text=True, env=env, timeout=1800)  # ~20 s on an idle 2-core machine
    assert run.returncode == 0, run.stderr[-3000:]
    check = subprocess.run([sys.executable, "-m", "probe", "check", str(logdir), "--json"],
                           capture_output=True, text=True, env=env, timeout=300)
    return request.param, logdir, run.stdout, check


def test_the_verdicts_hold_with_a_wide_margin(demo):
    threads, logdir, out, check = demo
    assert f"{threads} torch thread" in out.splitlines()[1]
    runs = {name: probe.Summary.load(logdir / name) for name, _ in RUNS}
    maxima = {name: max(float(s.value(site, "logit_max").max()) for site in SITES) for name, s in runs.items()}
    assert maxima[WITH] < 40 and maxima[WITHOUT] > 400  # the limit is 100: 2.5x below, 4x above
    # probe check, as README says to run it, agrees with the demo's own verdict lines
    assert check.returncode == 1, check.stderr
    verdicts = {os.path.basename(r["run"]): r["ok"] for r in json.loads(check.stdout)["runs"]}
    assert verdicts == {WITH: True, WITHOUT: False}
    lines = out.splitlines()
    mine = {line.split()[0]: line for line in lines if re.match(r"\s+(with|no)-divisor\s+(PASS|FAIL)", line)}
    assert mine[WITH].split()[1] == "PASS" and mine[WITHOUT].split()[1] == "FAIL"
    for name in mine:
        assert _agrees(": " + re.search(r"largest max logit ([\d,.]+)", mine[name]).group(1), [maxima[name]])


def test_the_reading_states_the_runs_numbers_and_the_story(demo):
    threads, logdir, out, _ = demo
    lines = out.splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith("Reading")))
    reading = {ln.split(":")[0].strip(): ln for ln in lines[start + 1:start + 9]}
    w0, w95 = _at(logdir / WITH, 0), _at(logdir / WITH, 95)
    u0, u95 = _at(logdir / WITHOUT, 0), _at(logdir / WITHOUT, 95)

    # saturation: most rows saturated without the divisor from step 0, almost none with it
    sat = [_mean(u0, "saturation"), _mean(u95, "saturation"), _mean(w0, "saturation"), _mean(w95, "saturation")]
    assert _agrees(reading["Saturated rows (99% of the weight on one token)"], sat)
    assert sat[0] > 0.3 and sat[1] > 0.8 and sat[2] < 0.02 and sat[3] < 0.2
    # entropy: collapsed without the divisor, spread with it
    ent = [_mean(u0, "entropy"), _mean(u95, "entropy"), _mean(w0, "entropy"), _mean(w95, "entropy")]
    line = reading["Entropy (1 = weight spread evenly over the tokens so far, 0 = all on one)"]
    assert _agrees(line, ent)
    assert ent[1] < 0.05 and ent[3] > 0.5
    assert line.index("collapsed onto one token") < line.index("with it") < line.index("spread over the tokens")
    # max logit: past the limit without the divisor, far below it with it
    top = [max(float(s.value(site, "logit_max")[0]) for site in SITES) for s in (u0, u95, w0, w95)]
    assert _agrees(reading["Max logit (largest head)"], top)
    assert top[1] > 300 and top[3] < 40
    # the softmax gradient vanishes without the divisor as training goes on
    ratio = _ratio(u95)
    words = lines[lines.index(reading["Softmax gradient for the same q, k and upstream gradient (grad ratio)"]) + 1]
    # The run without the divisor is chaotic: this ratio was 0.17-0.20 on one machine, 0.37 on another
    # (one thread, same seed) and 0.16-0.50 over seeds. The words must state the number, whatever it is;
    # the story needs it well below 1.
    said = f"{1 / ratio:.0f}x smaller at step 95" if ratio < 0.5 else f"{ratio:.2f}x (not vanished) at step 95"
    assert ratio < 0.75 and said in words
    # the loss: stuck without the divisor, falling towards what counting reaches with it
    w_steps = probe.Summary.load(logdir / WITH).steps
    assert w_steps == 20
    line = reading["Loss at step 0, mean of steps 45-54, of the last 10"]
    u_first, u_mid, u_last, w_first, w_mid, w_last = (float(x) for x in re.findall(r"\d+\.\d+", line))
    bounds = next(ln for key, ln in reading.items() if key.startswith("On the same batches"))
    counting, one_token = (float(x) for x in re.findall(r"\d+\.\d+", bounds))
    assert counting < w_last < (counting + one_token) / 2 - 0.2 < u_last - 0.4 < one_token  # measured 1.00 and 1.88-1.89
    # nearer the one-token score from mid-run on (the chaotic run moved 1.97 -> 1.81 on one
    # machine, flat on another: a plateau is not what the words claim); with it still falling
    assert min(u_mid, u_last) > (counting + one_token) / 2 and w_last < w_mid - 0.1
    assert bounds.index("stalls nearer the one-token score") < bounds.index("with it the loss nears the counting score")


def test_the_table_is_aligned_and_states_step_values(demo):
    _, logdir, out, _ = demo
    lines = out.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("layer"))
    assert lines[header].split()[2:6] == ["step", "0", "step", "95"]
    rows = lines[header + 2: header + 6]
    assert [r.split()[0] for r in rows[::2]] == SITES and [r.split()[-11] for r in rows] == [WITH, WITHOUT] * 2
    assert len({len(r) for r in rows}) == 1  # aligned
    u0 = _at(logdir / WITHOUT, 0)
    entropy0 = float(u0.value("blocks.0.attn", "entropy", "actual")[0])
    ratio0 = float(u0.value("blocks.0.attn", "grad_logits", "unscaled")[0] / u0.value("blocks.0.attn", "grad_logits", "standard")[0])
    assert _agrees(" ".join(rows[1].split()[1:2]), [entropy0]) and _agrees(rows[1].split()[-2], [ratio0])


def test_demo_logs_loss_and_never_mixes_runs(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_demo(steps=3, logdir=str(tmp_path), out=io.StringIO())
    out = io.StringIO()
    run_demo(steps=3, logdir=str(tmp_path), out=out)
    assert sorted(os.listdir(tmp_path)) == sorted([WITH, WITH + "-2", WITHOUT, WITHOUT + "-2"])
    assert "already holds a demo run" in out.getvalue()
    for run in os.listdir(tmp_path):
        assert len([f for f in os.listdir(tmp_path / run) if f.startswith("events.out")]) == 1
        acc = EventAccumulator(str(tmp_path / run))
        acc.Reload()
        assert [e.step for e in acc.Scalars("loss/train")] == [0, 1, 2]  # loss beside probe's scalars
        assert [e.step for e in acc.Scalars("probe.entropy@actual/blocks.0.attn")] == [0]
        assert [e.step for e in acc.Scalars("attention/saturation")] == [0]  # the headline TensorBoard opens on
    assert {WITH, WITHOUT}.isdisjoint({"actual", "standard", "unscaled", "scaled"})  # run names are no scale names


def test_cli_usage_errors():
    bad = subprocess.run([sys.executable, "-m", "probe", "demo", "--steps", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "positive int" in bad.stderr
    none = subprocess.run([sys.executable, "-m", "probe"], capture_output=True, text=True)
    assert none.returncode == 2


def _fake_run(grad_ratios, first_loss=3.0, loss=2.0):
    """A demo result with two probed steps (0, 95) of one site: entropy, saturation, logit_max and
    grad_logits with the given unscaled/standard ratio at each step (no training)."""
    steps = {}
    for step, ratio in zip((0, 95), grad_ratios):
        metrics = {"entropy": {"actual": [0.5, 0.5]}, "saturation": {"actual": [0.25, 0.25]},
                   "logit_max": {"actual": [40.0, 50.0]}, "nonfinite": {"actual": [0.0, 0.0]},
                   "grad_logits": {"actual": [1e-3, 1e-3], "standard": [2e-3, 2e-3], "unscaled": [2e-3 * ratio] * 2}}
        steps[step] = probe.Summary({"a": {"info": {}, "metrics": metrics}}, steps=1)
    losses = [first_loss] + [loss] * 99
    return {"summary": steps[95], "steps": steps, "first_loss": first_loss, "loss": loss, "losses": losses,
            "counting": 0.7, "one_token": 2.4}


def test_reading_says_what_the_grad_ratio_shows_and_no_more():
    from probe.cli.demo import format_table, reading

    # the ratio at each step: 0.75 is "not vanished", 0.1 is "10x smaller", 1.0 is "no smaller"
    text = reading({WITH: _fake_run((1.0, 1.0)), WITHOUT: _fake_run((0.75, 0.1))}, d_k=128)
    assert "0.75x its value with the divisor (not vanished) at step 0, and 10x smaller at step 95." in text
    text = reading({WITH: _fake_run((1.0, 1.0)), WITHOUT: _fake_run((1.0, 0.9))}, d_k=128)
    assert "1.00x its value with the divisor (no smaller) at step 0, and 0.90x (not vanished) at step 95" in text
    assert "smaller at step 95" not in text
    table = format_table({WITH: _fake_run((1.0, 1.0)), WITHOUT: _fake_run((0.75, 0.1))})
    assert table.splitlines()[-1].split()[-2:] == ["0.750", "0.100"]  # the grad ratio column
    # a head mean of 0.5 is neither collapsed nor spread: the reading says so
    assert "0.50 -> 0.500, sharpened" in text
