"""``ProbeCallback`` for a Lightning ``Trainer`` (``pip install attention-probe[lightning]``).

Works with both distributions of Lightning: ``lightning`` (``import lightning.pytorch``) and
``pytorch-lightning`` (``import pytorch_lightning``); the callback is an instance of the
``Callback`` class of each one installed.

Example:
    >>> from probe.integrations.lightning import ProbeCallback
    >>> trainer = lightning.pytorch.Trainer(max_steps=1000, log_every_n_steps=10,
    ...                                     callbacks=[ProbeCallback(every=10)])
    >>> trainer.fit(module, loader)

What is recorded: every attention call that runs during a sampled training batch, from
``on_train_batch_start`` to ``on_train_batch_end`` (``training_step``, its backward and the
optimizer step), whatever ``training_step`` calls: ``self(x)``, ``self.model(x)``,
``self.encoder(x)``, several models, manual optimization. Validation, sanity checking and
prediction run outside those windows and are never recorded.

Steps: probe's step for a training batch is the step Lightning's logger writes that batch's
``self.log`` metrics with (``fit_loop.epoch_loop._batches_that_stepped``, from 0: one per optimizer
step under automatic optimization, whose accumulated micro-batches all belong to it; one per
training batch under manual optimization, however many optimizers step in it), and ``every=N``
samples the steps ``log_every_n_steps=N`` logs: N-1, 2N-1, ...
"""

from __future__ import annotations

import importlib
import os
from typing import Any, List, Tuple

from probe.integrations._session import SessionCallback

__all__ = ["ProbeCallback"]


def _lightning() -> List[Any]:
    """The installed Lightning packages' ``pytorch`` modules (``lightning.pytorch`` first)."""
    found = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            pass
    if not found:
        raise ImportError("probe.integrations.lightning needs Lightning: pip install 'attention-probe[lightning]' "
                          "(or pip install lightning)")
    return found


_PACKAGES = _lightning()
_CALLBACKS: Tuple[type, ...] = tuple(pl.Callback for pl in _PACKAGES)
_TB_LOGGERS: Tuple[type, ...] = tuple(pl.loggers.TensorBoardLogger for pl in _PACKAGES)


class ProbeCallback(SessionCallback, *_CALLBACKS):  # type: ignore[misc]
    """Records the attention of the ``LightningModule``'s training steps with :func:`probe.watch`.

    Args:
        every: probe one optimization step in ``every``: the steps Lightning logs with
            ``log_every_n_steps=every`` (N-1, 2N-1, ...: Lightning numbers steps from 0).
        thresholds: limits judged on each probed step as the run goes (``probe.check``
            expressions); ``None``: probe's defaults. A violation is logged (logger
            ``probe.integrations``) with step, site, head, metric, scale and value, once per
            threshold, site and head; all are kept in :attr:`violations`.
        stop_on_violation: set ``trainer.should_stop`` after the first probed step that
            violates a threshold (agreed by every rank). The step then waits for its verdict.
        logdir: a directory or ``SummaryWriter`` for probe's TensorBoard events. ``None``
            (default): the experiment of the trainer's ``TensorBoardLogger``, so ``self.log``
            metrics and ``probe/...`` are one run; without one, ``{trainer.default_root_dir}/probe``.
        **watch_options: passed to :func:`probe.watch` (``grads``, ``sites``, ``scales``,
            ``per_head``, ``rows``, ``sinks``, ...).

    Every attention call that runs while a sampled training batch runs is recorded, whatever
    ``training_step`` calls (see the module docstring); sites are named after the module's
    attributes (``encoder.layers.0.self_attn``). Only global rank zero writes and judges; under
    DDP the statistics of all ranks are reduced as :func:`probe.watch` does. The probe closes when
    training ends or raises (``on_exception``), before Lightning finalizes its loggers.

    Attributes:
        probe: the run's :class:`probe.Probe` (kept after training for ``probe.summary()``).
        violations: ``(step, probe.Violation)`` for every violation found.
    """

    first_step = 0  # Lightning logs the first optimization step at step 0
    window = True  # training_step may call any part of the module: record the whole batch

    # -- Lightning hooks ----------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        writes = bool(trainer.is_global_zero)
        logdir = self._session.logdir
        if logdir is None and writes:
            logdir = _trainer_logdir(trainer)
        self._session.start(pl_module, logdir, writes, resumed=_logger_step(trainer) > 0)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._session.begin_step(_logger_step(trainer))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        agree = lambda flag: bool(trainer.strategy.broadcast(flag, src=0))  # noqa: E731 - rank 0's verdict
        if self._session.end_step(_ends_step(trainer), agree=agree):
            trainer.should_stop = True

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # A batch skipped by ``on_train_batch_start`` returning -1 has no batch-end event: never
        # let its window run on into validation.
        self._session.end_step(False)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._session.end_step(False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._session.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._session.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._session.close()


def _logger_step(trainer: Any) -> int:
    """The step Lightning's logger writes the current training batch's metrics with.

    ``_LoggerConnector.log_metrics`` uses ``fit_loop.epoch_loop._batches_that_stepped``: it counts
    training batches that ended an optimization step (once a batch, however many optimizers
    stepped: not ``trainer.global_step``, which counts every ``optimizer.step()``), is restored
    from a checkpoint, and is what ``log_every_n_steps`` counts.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return int(step) if isinstance(step, int) else int(trainer.global_step)


def _ends_step(trainer: Any) -> bool:
    """Whether the training batch now ending ends its optimization step (Lightning's own test:
    it counts ``_batches_that_stepped`` up after it unless the batch only accumulates)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    should_accumulate = getattr(loop, "_should_accumulate", None)
    if callable(should_accumulate):
        try:
            return not should_accumulate()
        except Exception:  # noqa: BLE001 - a Lightning without the method's state: assume it steps
            return True
    return True


def _trainer_logdir(trainer: Any) -> Any:
    """The trainer's ``TensorBoardLogger`` experiment (a ``SummaryWriter``), or a directory."""
    for logger in trainer.loggers:
        if isinstance(logger, _TB_LOGGERS):
            return logger.experiment
    return os.path.join(trainer.default_root_dir, "probe")
