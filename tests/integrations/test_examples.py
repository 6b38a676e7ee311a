"""examples/hf_trainer.py and examples/lightning_train.py run (4 steps) and leave one run whose
loss and probe scalars share steps."""

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
    callback = _example("hf_trainer.py")["main"](["--max-steps", "4", "--every", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "probed 2 optimizer steps" in out and "model.layers.1.self_attn: entropy@actual" in out
    (run,) = {os.path.dirname(f) for f in glob.glob(str(tmp_path / "runs" / "*" / "events.out.tfevents.*"))}
    tags = scalars(run)
    assert tags["train/loss"] == probe_steps(tags) == [2, 4]
    assert callback.probe.summary().steps == 2


def test_lightning_example(tmp_path, capsys) -> None:
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError:
        pytest.importorskip("pytorch_lightning")
    _example("lightning_train.py")["main"](["--max-steps", "4", "--every", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "probed 2 optimizer steps" in out and "encoder.layers.1.self_attn: entropy@actual" in out
    tags = scalars(str(tmp_path / "tiny_lm"))
    assert tags["train_loss"] == probe_steps(tags) == [1, 3]
