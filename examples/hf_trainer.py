"""probe inside a Hugging Face ``Trainer``: one callback, one TensorBoard run.

Run: ``python examples/hf_trainer.py`` (under a minute on 2 CPU cores, one thread). It trains a
tiny Llama (random weights, built from a config) to copy: each sequence repeats its first half,
so a token of the second half is predictable once a head learns to look back half a sequence.
Gradient accumulation (2 micro-batches a step) and an evaluation every 50 steps run as in a real
fine-tune. ``ProbeCallback`` probes one optimizer step in 10, on the steps the Trainer logs
``train/loss`` at (``logging_steps=10``), judges two stability thresholds as the run goes and
writes into the Trainer's own TensorBoard run:

    tensorboard --logdir runs/hf_trainer/runs

What the dashboard shows: ``train/loss`` falls from ln 32 = 3.47 towards the floor of the task
(about 1.7: the first half stays random) around step 100, when the heads learn the copy:
``probe.entropy@actual`` of ``model.layers.1.self_attn`` falls from near 1 (attention spread over
the prefix) as its heads lock onto the token half a sequence back, and ``probe.logit_max`` rises.

Add ``stop_on_violation=True`` to end training at the first probed step that breaks a limit.
"""

from __future__ import annotations

import argparse
import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from probe.integrations.huggingface import ProbeCallback

VOCAB, LENGTH = 32, 32


class CopyTask(torch.utils.data.Dataset):
    """Random token sequences that repeat their first half: the second half is predictable."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        half = torch.randint(0, VOCAB, (n, LENGTH // 2), generator=g)
        self.ids = torch.cat([half, half], dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class EntropyTrace:
    """A probe sink (``write`` / ``flush`` / ``close``): each probed step's mean entropy per site."""

    def __init__(self) -> None:
        self.steps: list = []

    def write(self, step: int, summary) -> None:  # one probed step's statistics
        self.steps.append((step, {s: float(summary.value(s, "entropy", "actual").mean()) for s in summary.sites}))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def report(trace: EntropyTrace) -> None:
    (first, before), (last, after) = trace.steps[0], trace.steps[-1]
    for site in before:
        print(f"{site}: entropy@actual {before[site]:.2f} at step {first} -> {after[site]:.2f} at step {last}")


def main(argv=None) -> ProbeCallback:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10, help="probe (and log) one optimizer step in EVERY")
    parser.add_argument("--out", default="runs/hf_trainer")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")  # shows probe's violation lines

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH)
    model = LlamaForCausalLM(config)
    trace = EntropyTrace()
    callback = ProbeCallback(
        every=args.every,
        thresholds=["logit_max < 100", "entropy@actual > 0.01"],  # probe.check expressions
        sinks=[trace],  # any probe.watch option passes through
    )
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=2, learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=args.every,
        eval_strategy="steps", eval_steps=50, report_to=["tensorboard"], save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=CopyTask(16 * args.max_steps),
                      eval_dataset=CopyTask(64, seed=1), callbacks=[callback])
    with callback:  # closes the probe even if train() raises
        trainer.train()

    losses = [(log["step"], log["loss"]) for log in trainer.state.log_history if "loss" in log]
    print(f"probed {callback.probe.summary().steps} optimizer steps; train/loss {losses[0][1]:.2f} at step "
          f"{losses[0][0]} -> {losses[-1][1]:.2f} at step {losses[-1][0]}")
    report(trace)
    print(f"{len(callback.violations)} threshold violations; tensorboard --logdir {args.out}/runs")
    return callback


if __name__ == "__main__":
    main()
