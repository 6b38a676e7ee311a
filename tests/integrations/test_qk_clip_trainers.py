"""``ProbeCallback(qk_clip=τ)`` in real Hugging Face and Lightning trainers: every optimizer step is
clipped (sampled by ``every`` or not), the records reach the summary, and the first layer's max
logit on every training batch ends at or below τ (a learning rate of 0: only the clip moves the
weights, and a clip only shrinks a head's logits)."""

from __future__ import annotations


import pytest
import torch

from tests.qk_clip_util import GrabSDPA

TAU = 2.0


def _layer0_max(model, batches, call) -> float:
    tops = []
    for batch in batches:
        grab = GrabSDPA()
        with torch.no_grad(), grab:
            call(model, batch)
        tops.append(float(grab.tops[0].max()))
    return max(tops)


def test_hugging_face_trainer(tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from probe.integrations.huggingface import ProbeCallback

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    ids = torch.randint(0, 64, (8, 9), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": i, "labels": i} for i in ids]
    call = lambda m, b: m(input_ids=b, use_cache=False)  # noqa: E731
    tau = _layer0_max(model, ids.split(2), call) / 3
    cb = ProbeCallback(every=2, qk_clip=tau)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4, learning_rate=0.0,
                             report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                             dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    summary = cb.probe.summary()
    site = "model.layers.0.self_attn"
    assert summary.info(site)["qk_clip"].startswith("q: model.layers.0.self_attn.q_proj.weight rows")
    assert summary.value(site, "qk_clip_steps").sum() >= 1
    assert "entropy" in summary.metrics(site)  # sampled steps keep every statistic
    assert _layer0_max(model, ids.split(2), call) <= tau * (1 + 1e-5)



def test_hugging_face_trainer_with_gradient_accumulation_clips(tmp_path, recwarn):
    """Two micro-batches a step: each forward is traced alone (one window per micro-batch), not
    taken for one forward using every projection twice ("weights shared across layers")."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from probe.integrations.huggingface import ProbeCallback

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager"))
    ids = torch.randint(0, 64, (8, 6), generator=torch.Generator().manual_seed(1))
    cb = ProbeCallback(every=1, qk_clip=100.0)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=2, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                             seed=0, dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=[{"input_ids": i, "labels": i} for i in ids], callbacks=[cb]).train()
    summary = cb.probe.summary()
    site = "model.layers.0.self_attn"
    assert summary.info(site)["qk_clip"].startswith("q: model.layers.0.self_attn.q_proj.weight rows")
    assert not [w for w in recwarn if "qk_clip does not clip" in str(w.message)]
    assert summary.steps == 2 and summary.info(site)["calls"] == 4  # both micro-batches of both steps

def test_lightning_trainer(tmp_path):
    try:
        import lightning.pytorch as pl
    except ImportError:
        pl = pytest.importorskip("pytorch_lightning")
    from probe.integrations.lightning import ProbeCallback
    from tests.helpers import SDPAModel

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = SDPAModel(layers=2, d_model=32, heads=2)
            with torch.no_grad():
                for layer in self.net.layers:
                    layer.q.weight.mul_(8)
                    layer.kv.weight.mul_(8)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    x = torch.randn(8, 5, 32, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=2)
    module = Module()
    call = lambda m, b: m.net(b)  # noqa: E731
    assert _layer0_max(module, x.split(2), call) > 2 * TAU
    cb = ProbeCallback(every=3, qk_clip=TAU)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         default_root_dir=str(tmp_path), callbacks=[cb])
    trainer.fit(module, loader)
    summary = cb.probe.summary()
    assert summary.info("net.layers.0")["qk_clip"].startswith("q: net.layers.0.q.weight rows")
    assert summary.value("net.layers.0", "qk_clip_steps").sum() >= 1
    assert _layer0_max(module, x.split(2), call) <= TAU * (1 + 1e-5)
