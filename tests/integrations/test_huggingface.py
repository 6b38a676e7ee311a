"""probe.integrations.huggingface.ProbeCallback inside a real transformers.Trainer (tiny BERT, CPU)."""

from __future__ import annotations

import glob
import logging
import os
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import probe  # noqa: E402
from probe.integrations.huggingface import ProbeCallback  # noqa: E402
from tests.integrations.tbutil import Recorder, probe_steps, scalars  # noqa: E402

from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

SITES = ["bert.encoder.layer.0.attention.self", "bert.encoder.layer.1.attention.self"]


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, length: int = 6) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, length), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=16, attn_implementation="eager")
    return BertForSequenceClassification(cfg)


def make_trainer(out, callback, model=None, **args) -> Trainer:
    defaults = dict(output_dir=str(out), per_device_train_batch_size=2, logging_steps=1, report_to=["tensorboard"],
                    save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    defaults.update(args)
    return Trainer(model=model or tiny_bert(), args=TrainingArguments(**defaults), train_dataset=Data(),
                   eval_dataset=Data(4), callbacks=[callback])


def run_dirs(out) -> list:
    return sorted({os.path.dirname(f) for f in glob.glob(os.path.join(str(out), "runs", "*", "events.out.tfevents.*"))})


def test_trainer_run_holds_loss_and_probe_scalars_at_optimizer_steps(tmp_path) -> None:
    rec = Recorder()
    cb = ProbeCallback(every=1, sinks=[rec])
    # 4 optimizer steps of 2 micro-batches each, with an evaluation every 2 steps
    trainer = make_trainer(tmp_path, cb, max_steps=4, gradient_accumulation_steps=2,  # kept: a closed probe
                           eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)  # holds its model weakly
    trainer.train()
    dirs = run_dirs(tmp_path)
    assert len(dirs) == 1, dirs                  # one TensorBoard run: the Trainer's
    tags = scalars(dirs[0])
    assert tags["train/loss"] == [1, 2, 3, 4]
    assert probe_steps(tags) == [1, 2, 3, 4]     # probe's steps are the optimizer steps
    for site in SITES:
        assert f"probe.entropy@unscaled/{site}" in tags
        assert f"probe.grad_logits@actual/{site}" in tags
    # both micro-batches of each step are in it, evaluation forwards are not: 2 calls a step a site
    assert rec.writes == [(n, {s: 2 * n for s in SITES}) for n in (1, 2, 3, 4)]
    assert os.path.isfile(os.path.join(dirs[0], "probe_summary.json"))
    assert not cb.probe.model._forward_hooks and not cb.probe.model._forward_pre_hooks  # closed
    assert cb.probe.summary().steps == 4


def test_every_samples_the_steps_logging_steps_logs(tmp_path) -> None:
    cb = ProbeCallback(every=3, grads=False)
    make_trainer(tmp_path, cb, max_steps=7, logging_steps=3, gradient_accumulation_steps=2, eval_strategy="steps",
                 eval_steps=3, per_device_eval_batch_size=2).train()
    tags = scalars(run_dirs(tmp_path)[0])
    assert tags["train/loss"] == probe_steps(tags) == [3, 6]
    # evaluation during training, logged at the same steps (and after the last step), is not probed
    assert tags["eval/loss"] == [3, 6, 7] and cb.probe.summary().info(SITES[0])["calls"] == 2 * 2


def test_violation_is_logged_and_stops_training(tmp_path, caplog) -> None:
    cb = ProbeCallback(thresholds=["logit_max@unscaled < 0.001"], stop_on_violation=True, grads=False)
    with caplog.at_level(logging.WARNING, logger="probe.integrations"):
        out = make_trainer(tmp_path, cb, max_steps=20).train()
    assert out.global_step == 1                  # stopped through the Trainer's control flow
    assert {(step, v.site, v.metric, v.scale) for step, v in cb.violations} >= {(1, s, "logit_max", "unscaled") for s in SITES}
    lines = [r.getMessage() for r in caplog.records if "violation at" in r.getMessage()]
    assert any(f"step 1: attention stability violation at {SITES[0]} head 0: logit_max@unscaled = " in m for m in lines)
    assert probe_steps(scalars(run_dirs(tmp_path)[0])) == [1]


def test_violation_without_stop_only_logs(tmp_path) -> None:
    cb = ProbeCallback(thresholds="entropy > 1000", grads=False)
    out = make_trainer(tmp_path, cb, max_steps=3).train()
    assert out.global_step == 3
    assert sorted({step for step, _ in cb.violations}) == [1, 2, 3]


def test_resume_from_checkpoint_continues_the_step_count(tmp_path) -> None:
    first = ProbeCallback(every=1, grads=False)
    make_trainer(tmp_path, first, max_steps=2, save_strategy="steps", save_steps=2, gradient_accumulation_steps=2).train()
    assert os.path.isdir(tmp_path / "checkpoint-2")
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(tmp_path / "tb")  # one run for both halves
    try:
        second = ProbeCallback(every=1, grads=False)
        make_trainer(tmp_path, second, max_steps=4, gradient_accumulation_steps=2).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    finally:
        del os.environ["TENSORBOARD_LOGGING_DIR"]
    tags = scalars(str(tmp_path / "tb"))
    assert probe_steps(tags) == [3, 4] and tags["train/loss"] == [3, 4]


def test_explicit_logdir_and_no_tensorboard_report(tmp_path) -> None:
    cb = ProbeCallback(logdir=str(tmp_path / "mine"), grads=False)
    make_trainer(tmp_path, cb, max_steps=2, report_to="none").train()
    assert probe_steps(scalars(str(tmp_path / "mine"))) == [1, 2]


def test_training_that_raises_leaves_no_hook_after_close(tmp_path) -> None:
    class Boom(Data):
        def __getitem__(self, i):
            if i == 5:
                raise RuntimeError("bad batch")
            return super().__getitem__(i)

    model = tiny_bert()
    with ProbeCallback(grads=False) as cb:
        trainer = make_trainer(tmp_path, cb, model=model, max_steps=8)
        trainer.train_dataset = Boom()
        with pytest.raises(RuntimeError, match="bad batch"):
            trainer.train()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert cb.probe.summary().steps >= 1


@pytest.mark.parametrize("kwargs,match", [
    ({"every": 0}, "`every` to be a positive int, got 0"),
    ({"thresholds": "logit_max <"}, "expected a number after the operator"),
    ({"bogus": 1}, "unknown option 'bogus'"),
    ({"logdir": 3}, "`logdir` to be a path or a SummaryWriter"),
])
def test_bad_options_fail_at_construction(kwargs, match) -> None:
    with pytest.raises(probe.ProbeError, match=match):
        ProbeCallback(**kwargs)


def test_a_compute_loss_that_calls_the_models_parts_is_recorded_as_its_forward_would_be(tmp_path) -> None:
    # compute_loss calls model.bert and model.classifier itself (the model's forward never runs):
    # the callback records the whole optimizer step, so the run reads exactly as the default one
    # (same seed, same dropout draws: the parts are called as BertForSequenceClassification.forward
    # calls them).
    class PartsTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            hidden = model.dropout(model.bert(input_ids=inputs["input_ids"]).pooler_output)
            loss = torch.nn.functional.cross_entropy(model.classifier(hidden), inputs["labels"])
            return (loss, None) if return_outputs else loss

    summaries = []
    for trainer_class in (Trainer, PartsTrainer):
        cb = ProbeCallback()
        args = TrainingArguments(output_dir=str(tmp_path / trainer_class.__name__), per_device_train_batch_size=2,
                                 max_steps=3, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                                 seed=0)
        trainer = trainer_class(model=tiny_bert(), args=args, train_dataset=Data(), callbacks=[cb])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        assert not [str(w.message) for w in caught if str(w.message).startswith("probe:")]
        summaries.append(cb.probe.summary())
    default, parts = summaries
    assert parts.sites == default.sites == [f"bert.encoder.layer.{i}.attention.self" for i in range(2)]
    assert parts.steps == default.steps == 3
    for site in default.sites:
        assert parts.metrics(site) == default.metrics(site)
        assert {"grad_logits", "grad_q", "grad_k", "grad_v"} <= set(parts.metrics(site))
        for metric in default.metrics(site):
            assert parts.scales(site, metric) == default.scales(site, metric)
            for scale in default.scales(site, metric):
                np.testing.assert_allclose(parts.value(site, metric, scale), default.value(site, metric, scale),
                                           rtol=1e-6, atol=1e-9)
