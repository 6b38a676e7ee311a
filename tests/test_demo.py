"""`probe demo` end to end, with few steps."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import probe
from probe.cli.demo import run_demo


def test_demo_shows_saturation_without_scaling(tmp_path):
    out = io.StringIO()
    results = run_demo(steps=25, logdir=str(tmp_path), out=out)
    text = out.getvalue()
    assert "tensorboard --logdir" in text and "blocks.0.attn" in text
    scaled, unscaled = results["scaled"]["summary"], results["unscaled"]["summary"]
    for site in scaled.sites:
        assert unscaled.value(site, "saturation").mean() > scaled.value(site, "saturation").mean() + 0.3
        assert unscaled.value(site, "entropy").mean() < scaled.value(site, "entropy").mean()
    for run in ("scaled", "unscaled"):
        files = os.listdir(tmp_path / run)
        assert "probe_summary.json" in files and any(f.startswith("events.out.tfevents") for f in files)
        assert probe.Summary.load(tmp_path / run).sites == ["blocks.0.attn", "blocks.1.attn"]
    # the table: first and last probed step (0 and 20), one aligned row per layer and run
    lines = text.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("layer"))
    assert lines[header].split()[2:6] == ["step", "0", "step", "20"]
    rows = lines[header + 2: header + 6]
    assert [r.split()[0] for r in rows[::2]] == ["blocks.0.attn", "blocks.1.attn"]
    assert len({len(r) for r in rows}) == 1  # aligned
    step0 = results["unscaled"]["steps"][0]
    assert f"{step0.value('blocks.0.attn', 'entropy').mean():.3f}" in rows[1]
    # the last column: the softmax gradient without the divisor over with it (same q, k, dP), head means
    ratio = (step0.value("blocks.0.attn", "grad_logits", "unscaled").mean()
             / step0.value("blocks.0.attn", "grad_logits", "standard").mean())
    assert rows[1].split()[-2] == f"{ratio:.3f}"
    assert "Reading: at step 0" in text and "(grad ratio): without the divisor it is" in text


def test_demo_logs_loss_and_never_mixes_runs(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_demo(steps=3, logdir=str(tmp_path), out=io.StringIO())
    out = io.StringIO()
    run_demo(steps=3, logdir=str(tmp_path), out=out)
    assert sorted(os.listdir(tmp_path)) == ["scaled", "scaled-2", "unscaled", "unscaled-2"]
    assert "already holds a demo run" in out.getvalue()
    for run in os.listdir(tmp_path):
        assert len([f for f in os.listdir(tmp_path / run) if f.startswith("events.out")]) == 1
        acc = EventAccumulator(str(tmp_path / run))
        acc.Reload()
        assert [e.step for e in acc.Scalars("loss/train")] == [0, 1, 2]  # loss beside probe's scalars
        assert [e.step for e in acc.Scalars("probe.entropy@actual/blocks.0.attn")] == [0]


def test_cli_demo_and_usage_errors(tmp_path):
    run = subprocess.run([sys.executable, "-m", "probe", "demo", "--steps", "5", "--logdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "scaled" in run.stdout and "unscaled" in run.stdout
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
                   "logit_max": {"actual": [40.0, 50.0]},
                   "grad_logits": {"actual": [1e-3, 1e-3], "standard": [2e-3, 2e-3], "unscaled": [2e-3 * ratio] * 2}}
        steps[step] = probe.Summary({"a": {"info": {}, "metrics": metrics}}, steps=1)
    return {"summary": steps[95], "steps": steps, "first_loss": first_loss, "loss": loss}


def test_reading_says_what_the_grad_ratio_shows_and_no_more():
    from probe.cli.demo import format_table, reading

    # the ratio at each step: 0.75 is "not vanished", 0.1 is "10x smaller", 1.0 is "no smaller"
    text = reading({"scaled": _fake_run((1.0, 1.0)), "unscaled": _fake_run((0.75, 0.1))}, d_k=128)
    assert "0.75x its value with the divisor (not vanished) at step 0, and 10x smaller at step 95 (max logit 50)" in text
    text = reading({"scaled": _fake_run((1.0, 1.0)), "unscaled": _fake_run((1.0, 0.9))}, d_k=128)
    assert "1.00x its value with the divisor (no smaller) at step 0, and 0.90x (not vanished) at step 95" in text
    assert "smaller at step 95" not in text
    table = format_table({"scaled": _fake_run((1.0, 1.0)), "unscaled": _fake_run((0.75, 0.1))})
    assert table.splitlines()[-1].split()[-2:] == ["0.750", "0.100"]  # the grad ratio column
