"""examples/hf_trainer.py and examples/lightning_train.py run (2 steps) and leave one run."""

from __future__ import annotations

import glob
import os
import runpy

import pytest

from tests.integrations.tbutil import probe_steps, scalars

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example(name: str) -> dict:
    return runpy.run_path(os.path.join(ROOT, "examples", name))


def test_hf_trainer_example(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    callback = _example("hf_trainer.py")["main"](["--max-steps", "5", "--out", str(tmp_path)])
    assert "probed 1 optimizer steps" in capsys.readouterr().out
    (run,) = {os.path.dirname(f) for f in glob.glob(str(tmp_path / "runs" / "*" / "events.out.tfevents.*"))}
    tags = scalars(run)
    assert probe_steps(tags) == [5] and 5 in tags["train/loss"]
    assert callback.probe.summary().steps == 1


def test_lightning_example(tmp_path, capsys) -> None:
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError:
        pytest.importorskip("pytorch_lightning")
    _example("lightning_train.py")["main"](["--max-steps", "6", "--out", str(tmp_path)])
    assert "probed 2 optimizer steps" in capsys.readouterr().out
    tags = scalars(str(tmp_path / "tiny_lm"))
    assert probe_steps(tags) == [0, 5] and "train_loss" in tags
