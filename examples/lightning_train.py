"""probe inside a Lightning ``Trainer``: one callback, one TensorBoard run.

Run: ``python examples/lightning_train.py`` (under a minute on 2 CPU cores). It trains a tiny
``nn.TransformerEncoder`` language model on a synthetic next-token task with gradient
accumulation and validation. ``ProbeCallback`` probes one optimizer step in 5 and writes through
the trainer's ``TensorBoardLogger``, so ``train_loss`` and ``probe/...`` are one run:

    tensorboard --logdir runs/lightning

Works with ``import lightning.pytorch`` and with ``import pytorch_lightning``.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from probe.integrations.lightning import ProbeCallback

VOCAB, LENGTH = 128, 16


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, VOCAB)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(LENGTH - 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids), mask=self.causal, is_causal=True))

    def loss(self, batch) -> torch.Tensor:
        (ids,) = batch
        logits = self(ids[:, :-1])
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


def main(argv=None) -> ProbeCallback:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--out", default="runs/lightning")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")  # shows probe's violation lines

    torch.manual_seed(0)
    callback = ProbeCallback(every=5, thresholds=["logit_max < 100", "entropy@actual > 0.05"])
    trainer = pl.Trainer(
        max_steps=args.max_steps, accumulate_grad_batches=2, val_check_interval=10, log_every_n_steps=5,
        accelerator="cpu", devices=1, callbacks=[callback], default_root_dir=args.out,
        logger=pl.loggers.TensorBoardLogger(args.out, name="", version="tiny_lm"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(TinyLM(), copy_task(512, 0), copy_task(32, 1))

    summary = callback.probe.summary()
    site = summary.sites[0]
    print(f"probed {summary.steps} optimizer steps; sites: {summary.sites}")
    print(f"{site}: entropy per head at actual scale {summary.value(site, 'entropy', 'actual').round(3)}, "
          f"unscaled {summary.value(site, 'entropy', 'unscaled').round(3)}")
    print(f"{len(callback.violations)} threshold violations")
    print(f"tensorboard --logdir {args.out}")
    return callback


if __name__ == "__main__":
    main()
