"""`probe demo` end to end, with few steps."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import probe
from probe.demo import run_demo


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


def test_cli_demo_and_usage_errors(tmp_path):
    run = subprocess.run([sys.executable, "-m", "probe", "demo", "--steps", "5", "--logdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "scaled" in run.stdout and "unscaled" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "probe", "demo", "--steps", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "positive int" in bad.stderr
    none = subprocess.run([sys.executable, "-m", "probe"], capture_output=True, text=True)
    assert none.returncode == 2
