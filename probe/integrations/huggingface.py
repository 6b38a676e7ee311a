"""``ProbeCallback`` for the Hugging Face ``transformers.Trainer`` (``pip install attention-probe[hf]``).

Example:
    >>> from probe.integrations.huggingface import ProbeCallback
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds,
    ...                   callbacks=[ProbeCallback(every=10, thresholds=["logit_max < 100"])])
    >>> trainer.train()

Steps: probe's step for an optimizer step is the step the Trainer logs that step's ``train/loss``
with (``state.global_step`` once the optimizer has stepped, from 1; every micro-batch of gradient
accumulation, forward and backward, belongs to it), and ``every=N`` samples the steps
``logging_steps=N`` logs: N, 2N, ... Evaluation, prediction and saving between steps are not
probed.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState
    from transformers.training_args import TrainingArguments
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "probe.integrations.huggingface needs transformers: pip install 'attention-probe[hf]'"
    ) from err

from probe.integrations._session import SessionCallback

__all__ = ["ProbeCallback"]


class ProbeCallback(SessionCallback, TrainerCallback):
    """Watches the Trainer's model with :func:`probe.watch` while it trains.

    Args:
        every: probe one optimizer step in ``every``: the steps the Trainer logs with
            ``logging_steps=every`` (``every``, ``2·every``, ...: the Trainer numbers steps from 1).
        thresholds: limits judged on each probed step as the run goes (``probe.check``
            expressions, e.g. ``"logit_max < 100"``); ``None``: probe's defaults. A violated
            limit is logged (logger ``probe.integrations``) with step, site, head, metric, scale
            and value, once per threshold, site and head; all are kept in :attr:`violations`.
        stop_on_violation: end training (``control.should_training_stop``) after the first
            probed step that violates a threshold. The step then waits for its verdict.
        logdir: where probe writes TensorBoard events: a directory or a ``SummaryWriter``.
            ``None`` (default): the directory of the Trainer's own TensorBoard run (its
            ``TensorBoardCallback``), so ``train/loss`` and ``probe/...`` are one run.
        **watch_options: passed to :func:`probe.watch` (``grads``, ``sites``, ``scales``,
            ``per_head``, ``rows``, ``sinks``, ...).

    What is recorded: every attention call that runs from ``on_step_begin`` to ``on_step_end`` of
    a sampled step (a recording window, ``Probe.step(n, window=True)``), forward and backward, all
    micro-batches: the model's forward, or whatever parts of the model a custom ``compute_loss``
    calls; sites are named by the model's attributes. Evaluation, prediction and saving run
    outside and are never recorded.

    Only the main process writes and judges; under DDP the statistics of all ranks are reduced
    as :func:`probe.watch` does and a stop is agreed by every rank. The probe closes when training
    ends. ``transformers`` tells a callback nothing when ``train()`` raises: then the probe is
    closed by :meth:`close`, by using the callback as a context manager around ``train()``, by the
    next ``train()`` or at interpreter exit.

    Attributes:
        probe: the run's :class:`probe.Probe` (kept after training for ``probe.summary()``).
        violations: ``(step, probe.Violation)`` for every violation found.
    """

    first_step = 1  # the Trainer logs the first optimizer step at global_step 1
    window = True  # compute_loss may call any part of the model: record the whole optimizer step

    # -- Trainer events -----------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, **kwargs: Any) -> None:
        writes = bool(state.is_world_process_zero)
        logdir = self._session.logdir
        if logdir is None and writes:
            logdir = trainer_logdir(args)
        self._session.start(model, logdir, writes, resumed=state.global_step > 0)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        # The Trainer increments global_step after the optimizer step: the micro-batches running
        # now belong to step global_step + 1, the number train/loss is logged with.
        self._session.begin_step(state.global_step + 1)

    def on_substep_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        # A micro-batch of gradient accumulation ended (not the last): one window per micro-batch,
        # as under Lightning, so each forward is one forward (qk_clip follows one at a time).
        self._session.end_step(done=False)
        self._session.begin_step(state.global_step + 1)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        if self._session.end_step(done=True, agree=_agree_with_rank_zero):
            control.should_training_stop = True
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._session.close()


def trainer_logdir(args: TrainingArguments) -> str:
    """The directory of the TensorBoard run the Trainer reports to.

    transformers hands a callback neither the Trainer nor its other callbacks, but the
    ``CallbackHandler`` calling this event holds them: its ``TensorBoardCallback`` (which ran
    ``on_train_begin`` before any user callback) knows the directory. Without one (``report_to``
    without ``"tensorboard"``) it is the directory that callback would have chosen:
    ``$TENSORBOARD_LOGGING_DIR`` or ``{output_dir}/runs/{date}_{host}``.
    """
    from transformers.integrations import TensorBoardCallback

    for callback in _sibling_callbacks():
        if isinstance(callback, TensorBoardCallback):
            writer = getattr(callback, "tb_writer", None)
            if writer is not None and hasattr(writer, "get_logdir"):
                return writer.get_logdir()
            path = getattr(callback, "logging_dir", None)
            if isinstance(path, str):
                return path
    env = os.getenv("TENSORBOARD_LOGGING_DIR")
    if env:
        return os.path.expanduser(env)
    from transformers.integrations.integration_utils import default_logdir

    return os.path.join(args.output_dir or ".", default_logdir())


def _sibling_callbacks() -> list:
    frame = inspect.currentframe()
    try:
        for _ in range(8):  # the handler is a few frames up: call_event <- on_train_begin <- ...
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return []
            handler = frame.f_locals.get("self")
            if isinstance(handler, CallbackHandler):
                return list(handler.callbacks)
        return []
    finally:
        del frame  # frames reference their locals: break the cycle


def _agree_with_rank_zero(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a broadcast) when several processes train; else ``flag``."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.broadcast(t, src=0)
    return bool(t.item())
