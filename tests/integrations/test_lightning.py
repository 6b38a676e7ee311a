"""probe.integrations.lightning.ProbeCallback inside a real Lightning Trainer (tiny models, CPU).

Each pattern reads the TensorBoard run back with TensorBoard's reader: the metrics the module
logs with ``self.log`` and probe's scalars share steps.
"""

from __future__ import annotations

import logging
import os

import numpy as np
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
    """A module with a ``forward`` that ``training_step`` calls through ``self(x)``."""

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


class Direct(pl.LightningModule):
    """As most Lightning modules are written: no ``forward``, ``training_step`` calls its parts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(32, 32)
        self.enc = SDPAModel(layers=2, d_model=32, heads=2)

    def training_step(self, batch, batch_idx):
        loss = self.enc(self.embed(batch[0])).pow(2).mean()
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.enc(self.embed(batch[0])).pow(2).mean())

    def predict_step(self, batch, batch_idx):
        return self.enc(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class GAN(pl.LightningModule):
    """Manual optimization with two optimizers: two ``optimizer.step()`` per training batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = SDPAModel(layers=1, d_model=32, heads=2)
        self.critic = SDPAModel(layers=1, d_model=32, heads=2)

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        fake = self.generator(batch[0])
        loss_d = self.critic(fake.detach()).pow(2).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = -self.critic(fake).pow(2).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.log("loss_d", loss_d)

    def configure_optimizers(self):
        return (torch.optim.SGD(self.generator.parameters(), lr=0.01),
                torch.optim.SGD(self.critic.parameters(), lr=0.01))


def loader(n: int = 16):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(n, 5, 32, generator=g)), batch_size=2)


def fit(tmp_path, callback, module=None, ckpt_path=None, val=False, logger=True, **kwargs):
    defaults = dict(accelerator="cpu", devices=1, max_steps=4, log_every_n_steps=1, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                    logger=pl.loggers.TensorBoardLogger(str(tmp_path), name="tb", version=0) if logger else False,
                    num_sanity_val_steps=0)
    defaults.update(kwargs)
    callbacks = [callback, *defaults.pop("callbacks", [])]
    trainer = pl.Trainer(callbacks=callbacks, **defaults)
    trainer.fit(module or Module(), loader(), loader(4) if val else None, ckpt_path=ckpt_path)
    return trainer


def run_tags(tmp_path) -> dict:
    return scalars(os.path.join(str(tmp_path), "tb", "version_0"))


def test_lightning_run_holds_logged_metrics_and_probe_scalars_at_optimizer_steps(tmp_path) -> None:
    rec = Recorder()
    cb = ProbeCallback(sinks=[rec])
    trainer = fit(tmp_path, cb, accumulate_grad_batches=2, val=True, val_check_interval=2,
                  num_sanity_val_steps=1)
    assert trainer.global_step == 4
    tags = run_tags(tmp_path)
    assert tags["train_loss"] == [0, 1, 2, 3]     # Lightning's numbering: from 0
    assert probe_steps(tags) == [0, 1, 2, 3]
    for site in SITES:
        assert f"probe.entropy@unscaled/{site}" in tags and f"probe.grad_logits@actual/{site}" in tags
    # both micro-batches of each step, no validation or sanity-check forward: 2 calls a step a site
    assert rec.writes == [(n, {s: 2 * (n + 1) for s in SITES}) for n in range(4)]
    assert os.path.isfile(os.path.join(str(tmp_path), "tb", "version_0", "probe_summary.json"))
    assert not cb.probe.model._forward_hooks and not cb.probe.model._forward_pre_hooks


def test_a_module_whose_training_step_calls_its_parts_is_recorded_whole(tmp_path) -> None:
    rec = Recorder()
    cb = ProbeCallback(sinks=[rec])
    module = Direct()
    trainer = fit(tmp_path, cb, module=module, accumulate_grad_batches=2, val=True, val_check_interval=2,
                  num_sanity_val_steps=1)
    tags = run_tags(tmp_path)
    assert tags["loss"] == probe_steps(tags) == [0, 1, 2, 3]
    sites = ["enc.layers.0", "enc.layers.1"]
    for site in sites:  # forward and backward statistics of the parts training_step calls
        assert f"probe.entropy@actual/{site}" in tags and f"probe.grad_logits@actual/{site}" in tags
    # both micro-batches of each step; the sanity check and validation (which call self.enc too) are not
    assert rec.writes == [(n, {s: 2 * (n + 1) for s in sites}) for n in range(4)]
    summary = cb.probe.summary()
    trainer.validate(module, loader(4), verbose=False)
    trainer.predict(module, loader(4))  # after training: the probe is closed, nothing changes
    assert cb.probe.summary().value("enc.layers.0", "entropy", "actual").tolist() == \
        summary.value("enc.layers.0", "entropy", "actual").tolist()
    assert summary.info("enc.layers.0")["calls"] == 8
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in module.modules())


def test_manual_optimization_with_two_optimizers_counts_one_step_a_batch(tmp_path) -> None:
    rec = Recorder()
    cb = ProbeCallback(every=2, sinks=[rec])
    trainer = fit(tmp_path, cb, module=GAN(), max_steps=8, log_every_n_steps=2)
    assert trainer.global_step == 8                     # every optimizer.step() of both optimizers
    tags = run_tags(tmp_path)
    assert tags["loss_d"] == probe_steps(tags) == [1, 3]  # every=2 probes what log_every_n_steps=2 logs
    for site in ("generator.layers.0", "critic.layers.0"):
        assert f"probe.grad_q@actual/{site}" in tags
    # per sampled batch: the generator ran once, the critic twice (on the detached and the live fake)
    assert rec.writes == [(1, {"generator.layers.0": 1, "critic.layers.0": 2}),
                          (3, {"generator.layers.0": 2, "critic.layers.0": 4})]


def test_accumulation_and_log_every_n_steps_share_steps(tmp_path) -> None:
    rec = Recorder()
    cb = ProbeCallback(every=3, sinks=[rec], grads=False)
    fit(tmp_path, cb, module=Direct(), max_steps=7, accumulate_grad_batches=2, log_every_n_steps=3)
    tags = run_tags(tmp_path)
    assert tags["loss"] == probe_steps(tags) == [2, 5]
    assert rec.writes == [(2, {"enc.layers.0": 2, "enc.layers.1": 2}), (5, {"enc.layers.0": 4, "enc.layers.1": 4})]


def test_every_and_own_logdir_without_a_logger(tmp_path) -> None:
    cb = ProbeCallback(every=2, grads=False)
    fit(tmp_path, cb, max_steps=5, logger=False)
    assert probe_steps(scalars(os.path.join(str(tmp_path), "probe"))) == [1, 3]


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


def test_resume_from_a_checkpoint_saved_during_training_shares_the_loggers_steps(tmp_path) -> None:
    # ModelCheckpoint saves at on_train_batch_end, before Lightning counts the batch: on restart
    # Lightning moves its logging step on by one, and probe must follow it
    def run(max_steps, ckpt_path=None):
        saver = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
        return fit(tmp_path, ProbeCallback(every=2, grads=False), module=Direct(), max_steps=max_steps,
                   accumulate_grad_batches=2, log_every_n_steps=2, enable_checkpointing=True, callbacks=[saver],
                   ckpt_path=ckpt_path)

    run(4)
    tags = run_tags(tmp_path)
    assert tags["loss"] == probe_steps(tags) == [1, 3]
    run(8, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"))
    tags = run_tags(tmp_path)                       # the same logger run, both halves
    assert tags["loss"] == probe_steps(tags) == [1, 3, 5, 7]


def test_training_that_raises_closes_the_probe(tmp_path) -> None:
    module = Module(fail_at=2)
    cb = ProbeCallback(grads=False)
    with pytest.raises(RuntimeError, match="bad batch"):
        fit(tmp_path, cb, module=module)
    assert not cb._session.active
    assert not module._forward_hooks and not module._forward_pre_hooks
    assert cb.probe.summary().steps == 2
    assert probe_steps(run_tags(tmp_path)) == [0, 1]
    assert not torch.overrides._is_torch_function_mode_enabled()  # the step's window was closed


def test_bad_option_fails_at_construction() -> None:
    with pytest.raises(probe.ProbeError, match="`every` to be a positive int"):
        ProbeCallback(every=-1)


class NoAttention(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())

    def training_step(self, batch, batch_idx):
        loss = self.mlp(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_sampled_step_that_records_nothing_is_a_warning_naming_what_ran(tmp_path) -> None:
    with pytest.warns(UserWarning, match="probe: step 0 was sampled") as caught:
        fit(tmp_path, ProbeCallback(), module=NoAttention(), max_steps=3)
    messages = [str(w.message) for w in caught if str(w.message).startswith("probe:")]
    assert len(messages) == 1, messages             # once per run
    assert "not only the forward of the watched module NoAttention" in messages[0]
    assert "its submodules mlp ran" in messages[0]


def test_no_warning_when_the_training_step_calls_attention_through_its_parts(tmp_path, recwarn) -> None:
    fit(tmp_path, ProbeCallback(every=2, grads=False), module=GAN(), max_steps=8)
    assert not [w for w in recwarn if str(w.message).startswith("probe:")]


def test_a_module_wrapping_a_hugging_face_model_with_eager_attention(tmp_path, recwarn) -> None:
    pytest.importorskip("transformers")
    from tests.helpers import tiny_llama

    class Wrapped(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama("eager").train()

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    ids = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 12), generator=g)),
                                      batch_size=4)
    cb = ProbeCallback()
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         logger=pl.loggers.TensorBoardLogger(str(tmp_path), name="tb", version=0))
    trainer.fit(Wrapped(), ids)
    tags = run_tags(tmp_path)
    assert tags["loss"] == probe_steps(tags) == [0, 1]
    assert cb.probe.summary().sites == ["model.model.layers.0.self_attn", "model.model.layers.1.self_attn"]
    assert "probe.grad_logits@actual/model.model.layers.1.self_attn" in tags
    assert not [w for w in recwarn if str(w.message).startswith("probe:")]  # the audit of the whole step: no miss


def test_sixteen_bit_mixed_precision_reads_gradients_in_the_losss_units(tmp_path) -> None:
    """precision "16-mixed" scales the loss by its GradScaler (65536 at first): probe reads the
    gradient metrics as with a scale of 1 (fp16 autocast on CPU; the plugin takes the scaler)."""
    from pytorch_lightning.plugins import MixedPrecision

    values = {}
    for scale in (2.0**16, 1.0):
        cb = ProbeCallback(rows=None)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=scale))
        fit(tmp_path / str(scale), cb, logger=False, max_steps=2, plugins=[plugin])
        values[scale] = {m: cb.probe.summary().value(SITES[0], m) for m in ("grad_logits", "grad_q", "grad_v")}
    for metric, value in values[1.0].items():  # fp16's own rounding differs with the scale (3e-6 seen)
        np.testing.assert_allclose(values[2.0**16][metric], value, rtol=1e-3, err_msg=metric)
