"""The `probe` command answers --help, --version and argument errors without importing torch, and
the notes it prints are true for the run at hand."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import probe
from probe.ci.exit_codes import ExitCode
from probe.cli.main import main
from tests.helpers import SDPAModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = """
import sys
from probe.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_:
    code = exit_.code
heavy = sorted(m for m in ("torch", "numpy", "tensorboard") if m in sys.modules)
print("EXIT", code, "IMPORTED", ",".join(heavy) or "-", file=sys.stderr)
"""


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0), (["--version"], 0), ([], 2), (["demo", "--steps", "0"], 2), (["demo", "--help"], 0),
    (["check"], 2), (["check", "--help"], 0), (["compare", "--batch", "x"], 2), (["coverage"], 2), (["nope"], 2),
])
def test_help_version_and_argument_errors_import_no_torch(argv, code):
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, env=env, timeout=120)
    last = done.stderr.strip().splitlines()[-1].split()
    assert last[:2] == ["EXIT", str(code)], done.stderr[-2000:]
    assert last[3] == "-", f"probe {' '.join(argv)} imported {last[3]}"  # nor numpy or tensorboard: parsing is all it does
    if argv == ["--version"]:
        assert done.stdout.strip() == f"probe {probe.__version__} (attention-probe)"


def test_python_m_probe_help_imports_no_torch_module():
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "probe", "--help"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0 and all(cmd in done.stdout for cmd in ("demo", "check", "report", "compare", "coverage"))
    imported = [line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "probe.cli.main" in imported and not [m for m in imported if m.split(".")[0] in ("torch", "numpy")]


def _run(logdir):
    model = SDPAModel(layers=1, d_model=16, heads=2, scale=1.0)
    with probe.watch(model, logdir=str(logdir)):
        for _ in range(3):
            model(torch.randn(2, 5, 16)).sum().backward()


def test_check_notes_say_what_this_run_holds(tmp_path, capsys):
    _run(tmp_path / "run")
    assert os.path.isfile(tmp_path / "run" / "probe_summary.json")
    # the whole run: read from probe_summary.json, every head; no note about event files
    main(["check", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "(summary:" in out and "note:" not in out
    # a window reads the event files: the note says the summary exists and what it is good for
    assert main(["check", str(tmp_path / "run"), "--last", "2"]) in (ExitCode.OK, ExitCode.VIOLATIONS)
    out = capsys.readouterr().out
    assert "(tensorboard:" in out and "Write probe_summary.json" not in out
    assert "The run's probe_summary.json has every head, as run totals: judge the directory without --last" in out
    # without the summary file, the note tells how to get one
    os.remove(tmp_path / "run" / "probe_summary.json")
    main(["check", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "Write probe_summary.json (probe.watch(model, logdir=...)) for per-head checks." in out
    # per-head scalars leave nothing out: no note
    model = SDPAModel(layers=1, d_model=16, heads=2)
    with probe.watch(model, logdir=str(tmp_path / "per_head"), per_head=True):
        model(torch.randn(2, 5, 16)).sum().backward()
    main(["check", str(tmp_path / "per_head"), "--last", "1"])
    out = capsys.readouterr().out
    assert "(tensorboard:" in out and "note:" not in out
