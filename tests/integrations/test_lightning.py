"""probe.integrations.lightning.ProbeCallback inside a real Lightning Trainer (tiny model, CPU)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

try:  # the callback supports both distributions of Lightning; test with the one installed
    import lightning.pytorch as pl
except ImportError:
    pl = pytest.importorskip("pytorch_lightning")

import probe  # noqa: E402
from probe.integrations.lightning import ProbeCallback  # noqa: E402
from tests.helpers import SDPAModel  # noqa: E402
from tests.integrations.tbutil import Recorder, probe_steps, scalars  # noqa: E402

SITES = ["net.layers.0", "net.layers.1"]


class Module(pl.LightningModule):
    def __init__(self, fail_at: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = SDPAModel(layers=2, d_model=32, heads=2)
        self.fail_at = fail_at

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("bad batch")
        (x,) = batch
        loss = self(x).square().mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val_loss", self(x).square().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(n: int = 16):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(n, 5, 32, generator=g)), batch_size=2)


def fit(tmp_path, callback, module=None, ckpt_path=None, val=False, logger=True, **kwargs):
    defaults = dict(accelerator="cpu", devices=1, max_steps=4, log_every_n_steps=1, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                    logger=pl.loggers.TensorBoardLogger(str(tmp_path), name="tb", version=0) if logger else False,
                    num_sanity_val_steps=0)
    defaults.update(kwargs)
    trainer = pl.Trainer(callbacks=[callback], **defaults)
    trainer.fit(module or Module(), loader(), loader(4) if val else None, ckpt_path=ckpt_path)
    return trainer


def test_lightning_run_holds_logged_metrics_and_probe_scalars_at_optimizer_steps(tmp_path) -> None:
    rec = Recorder()
    cb = ProbeCallback(sinks=[rec])
    trainer = fit(tmp_path, cb, accumulate_grad_batches=2, val=True, val_check_interval=2,
                  num_sanity_val_steps=1)
    assert trainer.global_step == 4
    tags = scalars(os.path.join(str(tmp_path), "tb", "version_0"))
    assert tags["train_loss"] == [0, 1, 2, 3]     # Lightning's numbering: global_step, from 0
    assert probe_steps(tags) == [0, 1, 2, 3]
    for site in SITES:
        assert f"probe.entropy/unscaled/{site}" in tags and f"probe.grad_logits/actual/{site}" in tags
    # both micro-batches of each step, no validation or sanity-check forward: 2 calls a step a site
    assert rec.writes == [(n, {s: 2 * (n + 1) for s in SITES}) for n in range(4)]
    assert os.path.isfile(os.path.join(str(tmp_path), "tb", "version_0", "probe_summary.json"))
    assert not cb.probe.model._forward_hooks and not cb.probe.model._forward_pre_hooks


def test_every_and_own_logdir_without_a_logger(tmp_path) -> None:
    cb = ProbeCallback(every=2, grads=False)
    fit(tmp_path, cb, max_steps=5, logger=False)
    assert probe_steps(scalars(os.path.join(str(tmp_path), "probe"))) == [0, 2, 4]


def test_violation_sets_should_stop(tmp_path, caplog) -> None:
    cb = ProbeCallback(thresholds=["logit_max@unscaled < 0.001"], stop_on_violation=True, grads=False)
    with caplog.at_level(logging.WARNING, logger="probe.integrations"):
        trainer = fit(tmp_path, cb, max_steps=20)
    assert trainer.global_step == 1 and trainer.should_stop
    assert {(s, v.site) for s, v in cb.violations} >= {(0, site) for site in SITES}
    assert any(f"step 0: attention stability violation at {SITES[0]} head 0: logit_max@unscaled" in r.getMessage()
               for r in caplog.records)


def test_resume_from_checkpoint_continues_the_step_count(tmp_path) -> None:
    first = fit(tmp_path, ProbeCallback(grads=False), max_steps=2)
    ckpt = str(tmp_path / "two.ckpt")
    first.save_checkpoint(ckpt)
    cb = ProbeCallback(grads=False, logdir=str(tmp_path / "resumed"))
    fit(tmp_path, cb, max_steps=4, ckpt_path=ckpt)
    assert probe_steps(scalars(str(tmp_path / "resumed"))) == [2, 3]


def test_training_that_raises_closes_the_probe(tmp_path) -> None:
    module = Module(fail_at=2)
    cb = ProbeCallback(grads=False)
    with pytest.raises(RuntimeError, match="bad batch"):
        fit(tmp_path, cb, module=module)
    assert not cb._session.active
    assert not module._forward_hooks and not module._forward_pre_hooks
    assert cb.probe.summary().steps == 2
    assert probe_steps(scalars(os.path.join(str(tmp_path), "tb", "version_0"))) == [0, 1]


def test_bad_option_fails_at_construction() -> None:
    with pytest.raises(probe.ProbeError, match="`every` to be a positive int"):
        ProbeCallback(every=-1)
