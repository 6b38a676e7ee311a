"""probe inside a Hugging Face ``Trainer``: one callback, one TensorBoard run.

Run: ``python examples/hf_trainer.py`` (about a minute on 2 CPU cores). It trains a tiny Llama
(random weights, built from a config) on a synthetic next-token task with gradient accumulation
and an evaluation every 10 steps. ``ProbeCallback`` probes one optimizer step in 5, judges two
stability thresholds as the run goes and writes into the Trainer's own TensorBoard run, so
``train/loss`` and ``probe/...`` share one step axis:

    tensorboard --logdir runs/hf_trainer/runs

Add ``stop_on_violation=True`` to end training at the first probed step that breaks a limit.
"""

from __future__ import annotations

import argparse
import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from probe.integrations.huggingface import ProbeCallback


class CopyTask(torch.utils.data.Dataset):
    """Random token sequences that repeat their first half: the second half is predictable."""

    def __init__(self, n: int, length: int = 16, vocab: int = 128, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        half = torch.randint(0, vocab, (n, length // 2), generator=g)
        self.ids = torch.cat([half, half], dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv=None) -> ProbeCallback:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--out", default="runs/hf_trainer")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")  # shows probe's violation lines

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    callback = ProbeCallback(
        every=5,
        thresholds=["logit_max < 100", "entropy@actual > 0.05"],  # probe.check expressions
    )
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=3e-3, logging_steps=5, eval_strategy="steps",
        eval_steps=10, report_to=["tensorboard"], save_strategy="no", use_cpu=True, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=CopyTask(256), eval_dataset=CopyTask(16, seed=1),
                      callbacks=[callback])
    with callback:  # closes the probe even if train() raises
        trainer.train()

    summary = callback.probe.summary()
    site = summary.sites[0]
    print(f"probed {summary.steps} optimizer steps; sites: {summary.sites}")
    print(f"{site}: entropy per head at actual scale {summary.value(site, 'entropy', 'actual').round(3)}, "
          f"unscaled {summary.value(site, 'entropy', 'unscaled').round(3)}")
    print(f"{len(callback.violations)} threshold violations")
    print(f"tensorboard --logdir {args.out}/runs")
    return callback


if __name__ == "__main__":
    main()
