"""``benchmarks/gpu.py`` runs before a GPU is lent: its ``--dry-run`` drives the same arms on the
CPU (every probe closed, every arm timed), and without CUDA the plain run says so and exits 0.
Not a timing test: nothing here reads the numbers."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

_BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _gpu_script():
    sys.path.insert(0, str(_BENCH))
    try:
        spec = importlib.util.spec_from_file_location("probe_gpu_benchmark", _BENCH / "gpu.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(_BENCH))
    return module


def test_dry_run_times_every_arm_on_the_cpu(capsys):
    gpu = _gpu_script()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        warnings.filterwarnings("error", message=".*never closed.*")
        assert gpu.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dry run on the CPU" in out and "(128 tokens)" in out
    for arm in ("bare", "unsampled", "every=1", "every=10", "plain"):
        assert any(line.split()[:1] == [arm] for line in out.splitlines()), arm


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the script measures")
def test_without_cuda_the_script_says_so_and_exits_0(capsys):
    assert _gpu_script().main([]) == 0
    assert "no CUDA device visible" in capsys.readouterr().out
