"""probe inside a Lightning ``Trainer``: one callback, one TensorBoard run.

Run: ``python examples/lightning_train.py`` (under a minute on 2 CPU cores, one thread). It trains
a tiny causal ``nn.TransformerEncoder`` language model to copy: each sequence repeats its first
half, so a token of the second half is predictable once a head learns to look back half a
sequence. The ``LightningModule`` is written as most are: ``training_step`` calls its parts
(``self.encoder``, ...) directly and has no ``forward``; gradient accumulation (2 micro-batches a
step) and a validation every 50 steps run as in a real training. ``ProbeCallback`` records every
attention of one optimizer step in 10, on the steps Lightning logs ``train_loss`` at
(``log_every_n_steps=10``), and writes through the trainer's ``TensorBoardLogger``:

    tensorboard --logdir runs/lightning

What the dashboard shows: ``train_loss`` falls from ln 32 = 3.47 towards the floor of the task
(about 1.7: the first half stays random) around step 90, when the heads learn the copy:
``probe.entropy@actual`` of ``encoder.layers.1.self_attn`` falls from near 1 (attention spread
over the prefix) as its heads lock onto the token half a sequence back, and ``probe.max_prob``
rises towards 1.

Works with ``import lightning.pytorch`` and with ``import pytorch_lightning``.
"""

from __future__ import annotations

import argparse
import logging
import math

import torch
from torch import nn

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from probe.integrations.lightning import ProbeCallback

VOCAB, LENGTH, WIDTH = 32, 32, 64


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(LENGTH, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(LENGTH - 1))

    def loss(self, batch) -> torch.Tensor:
        (ids,) = batch
        x = self.embed(ids[:, :-1]) + self.position.weight[: LENGTH - 1]
        logits = self.head(self.encoder(x, mask=self.causal, is_causal=True))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def copy_task(n: int, seed: int) -> torch.utils.data.DataLoader:
    """Random sequences that repeat their first half."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(0, VOCAB, (n, LENGTH // 2), generator=g)
    data = torch.utils.data.TensorDataset(torch.cat([half, half], dim=1))
    return torch.utils.data.DataLoader(data, batch_size=8)


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
    parser.add_argument("--out", default="runs/lightning")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")  # shows probe's violation lines

    torch.manual_seed(0)
    trace = EntropyTrace()
    callback = ProbeCallback(every=args.every, thresholds=["logit_max < 100", "entropy@actual > 0.01"],
                             sinks=[trace])  # any probe.watch option passes through
    trainer = pl.Trainer(
        max_steps=args.max_steps, accumulate_grad_batches=2, log_every_n_steps=args.every,
        val_check_interval=100, check_val_every_n_epoch=None,  # validate every 100 batches (50 steps)
        accelerator="cpu", devices=1, callbacks=[callback], default_root_dir=args.out,
        logger=pl.loggers.TensorBoardLogger(args.out, name="", version="tiny_lm"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(TinyLM(), copy_task(16 * args.max_steps, 0), copy_task(64, 1))

    loss = float(trainer.callback_metrics["train_loss"])
    print(f"probed {callback.probe.summary().steps} optimizer steps; train_loss {loss:.2f} at the end "
          f"(ln {VOCAB} = {math.log(VOCAB):.2f} at first)")
    report(trace)
    print(f"{len(callback.violations)} threshold violations; tensorboard --logdir {args.out}")
    return callback


if __name__ == "__main__":
    main()
