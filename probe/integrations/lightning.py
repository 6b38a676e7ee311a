"""``ProbeCallback`` for a Lightning ``Trainer`` (``pip install attention-probe[lightning]``).

Works with both distributions of Lightning: ``lightning`` (``import lightning.pytorch``) and
``pytorch-lightning`` (``import pytorch_lightning``); the callback is an instance of the
``Callback`` class of each one installed.

Example:
    >>> from probe.integrations.lightning import ProbeCallback
    >>> trainer = lightning.pytorch.Trainer(max_steps=1000, callbacks=[ProbeCallback(every=10)])
    >>> trainer.fit(module, loader)

Steps are ``trainer.global_step`` as the optimizer step begins, the number Lightning logs that
step's ``self.log(...)`` metrics with (it counts from 0): every micro-batch of gradient
accumulation belongs to it. Validation and sanity checking between steps are not probed.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Iterable, List, Optional, Tuple, Union

from probe.integrations._session import Session
from probe.ci.thresholds import ThresholdLike

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


class ProbeCallback(*_CALLBACKS):  # type: ignore[misc]
    """Watches the ``LightningModule`` with :func:`probe.watch` while it trains.

    Args:
        every: probe one optimizer step in ``every`` (``trainer.global_step % every == 0``).
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

    Only global rank zero writes and judges; under DDP the statistics of all ranks are reduced
    as :func:`probe.watch` does. The probe closes when training ends or raises
    (``on_exception``), before Lightning finalizes its loggers.

    Attributes:
        probe: the run's :class:`probe.Probe` (kept after training for ``probe.summary()``).
        violations: ``(step, probe.Violation)`` for every violation found.
    """

    def __init__(
        self,
        every: int = 1,
        thresholds: Union[None, ThresholdLike, Iterable[ThresholdLike]] = None,
        stop_on_violation: bool = False,
        logdir: Any = None,
        **watch_options: Any,
    ) -> None:
        super().__init__()
        self._session = Session(every, thresholds, stop_on_violation, logdir, watch_options)
        self._started_at: Optional[int] = None

    @property
    def probe(self) -> Any:
        return self._session.probe

    @property
    def violations(self) -> list:
        return self._session.violations

    # -- Lightning hooks ----------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        writes = bool(trainer.is_global_zero)
        logdir = self._session.logdir
        if logdir is None and writes:
            logdir = _trainer_logdir(trainer)
        self._session.start(pl_module, logdir, writes, resumed=trainer.global_step > 0)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._started_at = trainer.global_step
        self._session.begin_step(trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # global_step moved: this micro-batch ended an optimizer step (automatic optimization
        # steps before this hook; under accumulation the other micro-batches leave it unchanged).
        done = self._started_at is not None and trainer.global_step != self._started_at
        if self._session.end_step(done, agree=lambda flag: bool(trainer.strategy.broadcast(flag, src=0))):
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._session.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._session.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._session.close()

    def close(self) -> None:
        """Close the probe now (flush, write ``probe_summary.json``); safe to call twice."""
        self._session.close()


def _trainer_logdir(trainer: Any) -> Any:
    """The trainer's ``TensorBoardLogger`` experiment (a ``SummaryWriter``), or a directory."""
    for logger in trainer.loggers:
        if isinstance(logger, _TB_LOGGERS):
            return logger.experiment
    return os.path.join(trainer.default_root_dir, "probe")
