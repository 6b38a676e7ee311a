"""Probe: attaches to a model, samples steps, wires capture → stats → sinks."""

from __future__ import annotations

import atexit
import os
import warnings
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set

import torch
from torch import nn

from probe.capture.audit_warning import FirstForwardAudit
from probe.capture.mode import CaptureMode, ModuleStack, SitesFilter, site_filter
from probe.capture.registry import default_frontends
from probe.session.compiled import EagerSteps, check_model, is_compiled, outside_graph
from probe.state.distributed import resolve_group
from probe.errors import ProbeError
from probe.session.forward_guard import ForwardFrame, RootHook
from probe.once import WarnOnce
from probe.session.options import BUILTIN_SCALES, DEFAULT_ROWS, ExtraScale, check_int, check_scales, check_seconds, tensorboard_sink
from probe.session.recorder import Recorder
from probe.state.results import Results, pending_states, step_ends
from probe.session.schedule import Action, Schedule
from probe.sinks.base import Sink
from probe.state.writer import Window, Writer, to_host
from probe.state.accumulator import State
from probe.summary import SUMMARY_FILE, Summary

__all__ = ["BUILTIN_SCALES", "Probe", "watch"]


class Probe:
    """Watches every attention computation of ``model`` on sampled steps.

    Each forward of the root module is a step (or set it with :meth:`step`); on steps where
    ``step % every == 0`` a TorchFunctionMode intercepts attention calls during the root
    forward and per-head statistics accumulate on the tensors' device. Statistics are flushed to
    the sinks when the next step begins (so a step's backward pass belongs to it), on
    :meth:`summary` reads and on :meth:`close`.

    Args:
        model: the root module; it is not modified (two hooks on it, removed by ``close``).
        logdir: a directory (TensorBoard events, ``probe_summary.json``) or a ``SummaryWriter``; ``None``: memory only.
        every: probe one step in ``every``.
        scales: extra named scales, ``{"half": 0.0625}`` or ``{"half": lambda d: 0.5 * d**-0.5}``.
        grads: also measure gradients on sampled steps.
        sites: keep only these sites: a glob, a list of names/globs, or a predicate on the name.
        saturation: τ, a row counts as saturated when its max probability is at least τ.
        per_head: also write per-head TensorBoard scalars.
        flush_every: flush after this many sampled steps.
        memory_budget: bytes of extra memory the statistics of one call may use (rows in chunks).
        sinks: extra sinks receiving each flush (see :class:`probe.sinks.base.Sink`).
        rows: query-row budget (default 128): ``entropy``, ``max_prob``, ``saturation``, ``grad_logits``
            of a call with more query rows are estimates from ``rows`` positions (the first
            quarter whole, the rest stratified; seeded per site and step) with standard errors
            ``entropy_se``, ..., ``grad_logits_se``, marked as estimates in reports; shorter calls,
            ``logit_var``, ``logit_max``, ``nonfinite`` stay exact (docs/performance.md). ``None``: all exact.
        close_timeout: seconds :meth:`close` waits for the sinks (a sink still busy: warned, left behind).
        group: under ``torch.distributed``, the process group whose ranks' statistics are reduced
            at each flush (default: the default group when initialized with several ranks;
            ``False``: per-rank statistics). Only rank 0 writes (TensorBoard, sinks, summary file);
            every rank's :meth:`summary` is the global one as of the last flush, and every rank
            must flush at the same steps (``docs/distributed.md``).
        audit: warn once per attention the first sampled forward shows probe misses (:mod:`probe.capture.audit`).
    """

    def __init__(
        self,
        model: nn.Module,
        logdir: Any = None,
        every: int = 1,
        scales: Optional[Mapping[str, ExtraScale]] = None,
        grads: bool = True,
        sites: SitesFilter = None,
        saturation: float = 0.99,
        per_head: bool = False,
        *,
        flush_every: int = 1,
        memory_budget: int = 64 * 2**20,
        sinks: Sequence[Sink] = (),
        group: Any = None,
        rows: Optional[int] = DEFAULT_ROWS,
        close_timeout: float = 30.0,
        audit: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ProbeError(f"expected `model` to be a torch.nn.Module, got {type(model).__name__}")
        check_model(model)
        self.every = check_int("every", every, 1)
        self.flush_every = check_int("flush_every", flush_every, 1)
        self._schedule = Schedule(self.every, self.flush_every)
        self.memory_budget = check_int("memory_budget", memory_budget, 1)
        self.rows = None if rows is None else check_int("rows", rows, 1)
        if isinstance(saturation, bool) or not isinstance(saturation, (int, float)) or not 0 < saturation <= 1:
            raise ProbeError(f"expected `saturation` to be a float in (0, 1], got {saturation!r}")
        self.saturation = float(saturation)
        self.close_timeout = check_seconds("close_timeout", close_timeout)
        self.extra_scales = check_scales(scales)
        self.grads = bool(grads)
        self.per_head = bool(per_head)
        self._sites_filter = sites
        self._site_ok = site_filter(sites)
        for sink in sinks:
            if not isinstance(sink, Sink):
                raise ProbeError(f"expected every sink to have write/flush/close, got {type(sink).__name__}")

        self._dist = resolve_group(group)  # None: statistics stay local to this process
        writes = self._dist is None or self._dist.rank == 0  # only rank 0 of the group writes
        self._logdir: Optional[str] = None
        self._sinks: List[Sink] = []
        if logdir is not None:
            sink, self._logdir = tensorboard_sink(logdir, per_head)  # validates `logdir` on every rank
            if writes:
                self._sinks.append(sink)
            else:
                self._logdir = None  # no probe_summary.json either
        if writes:
            self._sinks.extend(sinks)

        self.model = model
        self._stack = ModuleStack(model)
        self._frontends = default_frontends()
        self._mode: Optional[CaptureMode] = None
        self._eager = EagerSteps()  # torch.compile: sampled steps run eagerly (probe.session.compiled)
        self._eager.attach(model)
        self._emitted_before = 0
        self._warned_compiled = WarnOnce()
        self._results = Results()
        summary_path = None if self._logdir is None else os.path.join(self._logdir, SUMMARY_FILE)
        # the writer folds flushes into the results and feeds the sinks and the summary file
        self._writer = Writer(self._sinks, self._results, summary_path, meta=self._meta())
        self._frame = ForwardFrame()  # the root forward in progress, to notice one a BaseException ended
        self._rec = Recorder(model, self._stack, self._frontends, extra_scales=self.extra_scales,
                             saturation=self.saturation, memory_budget=self.memory_budget, rows=self.rows,
                             grads=self.grads, site_ok=self._site_ok, warn=self._writer.warn)
        self._grad_hooks = self._rec.grad_hooks
        self._audit = FirstForwardAudit(model, self._frontends, done=not audit)
        self._started = False
        self._auto_step = True
        self._paused = False
        self._depth = 0
        self._probed_steps: Set[int] = set()
        self._warned_filter = False
        self._closed = False
        self._handles = [
            # RootHook: a deepcopy / pickle / torch.save of the model copies them as inert hooks
            model.register_forward_pre_hook(RootHook(self._on_forward_start)),
            model.register_forward_hook(RootHook(self._on_forward_end), always_call=True),
        ]
        ref = weakref.ref(self)
        self._atexit = lambda: (lambda p: p.close() if p is not None else None)(ref())
        atexit.register(self._atexit)

    # -- steps ---------------------------------------------------------------------------------
    @property
    def _step(self) -> int:
        return self._rec.step

    @_step.setter
    def _step(self, value: int) -> None:
        self._rec.step = value  # calls emitted from now on belong to this step

    @property
    def _window(self) -> List[int]:
        return self._rec.window

    @_window.setter
    def _window(self, value: List[int]) -> None:
        self._rec.window = value

    @property
    def current_step(self) -> int:
        return self._step

    def step(self, n: int) -> None:
        """Set the step number: forwards until the next ``step`` call belong to step ``n``
        (e.g. several micro-batches of gradient accumulation). Turns off automatic counting."""
        self._check_open("step")
        self._recover_if_interrupted()
        self._step = check_int("n", n, 0)
        self._started = True
        self._auto_step = False
        self._paused = False
        self._rec.empty_steps.begin(n, self._sampled())  # a sampled step that measures nothing is warned
        self._maybe_flush()
        if self._dist is not None and self._sampled() and (not self._window or self._window[-1] != n):
            # Under torch.distributed, explicit steps alone decide the flushes: a rank that runs no
            # forward in a sampled step still takes part in that step's flush.
            self._window.append(n)
        self._eager.arm(self._sampled())

    def pause(self, flush: bool = True, wait: bool = False) -> None:
        """Probe no forward until the next :meth:`step` call, e.g. a trainer's evaluation between
        two training steps (it would otherwise count as part of the next step).

        Args:
            flush: the current step is over: hand its statistics to the sinks now (under
                ``flush_every``, once the window is full) rather than when the next step begins.
                Under ``torch.distributed`` this is a collective: every rank pauses alike.
            wait: also wait until the sinks have written them.
        """
        self._paused = True
        self._eager.arm(False)
        if flush and self._window and len(self._window) >= self._schedule.flush_every:
            self._flush()
        if wait:
            self._writer.flush()

    def _sampled(self, step: Optional[int] = None) -> bool:
        return self._schedule(self._step if step is None else step) is Action.RECORD

    def _maybe_flush(self) -> None:
        if self._schedule.flush_due(self._window, self._step):
            self._flush()

    # -- root hooks ----------------------------------------------------------------------------
    def _on_forward_start(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # Dynamo traces the root's hooks: leave the graph
            return outside_graph(self._on_traced_forward_start, module, args)
        self._recover_if_interrupted()
        self._depth += 1
        if self._depth > 1:  # the root called again from inside its own forward
            return
        self._frame.enter()
        if self._auto_step:
            self._step = self._step + 1 if self._started else 0
            self._started = True
        if self._grad_hooks.step is not None and self._grad_hooks.step != self._step:
            self._grad_hooks.remove()  # the previous step's backward is over (or never came)
        self._grad_hooks.root_grad = torch.is_grad_enabled()
        self._maybe_flush()
        if self._paused or not self._sampled():
            return
        if self._dist is not None and (not self._window or self._window[-1] != self._step):
            # Ranks must flush at the same steps: a sampled step opens the window even on a rank
            # whose forward issues no attention call.
            self._window.append(self._step)
        if self._eager.in_graph and not self._eager.active:
            self._warn_compiled("skipped", f"probe: step {self._step} was sampled but the model's root forward "
                                "already runs compiled (torch.compile applied after probe.watch, model.compile() or "
                                "a compiled training step); probe skipped it and runs later sampled steps eagerly. "
                                "To probe from the first step, watch the compiled module: "
                                "probe.watch(torch.compile(model)).")
            return
        self._eager.enter()  # compiled code in this forward runs eagerly, so the capture sees it
        self._emitted_before = self._rec.emitted
        self._stack.activate()
        self._mode = CaptureMode(self._frontends, self._emit, self._rec.reserve)
        self._mode.__enter__()
        self._audit.start(self._rec)  # above the capture mode: it sees the model's ops first

    def _on_traced_forward_start(self, module: nn.Module, args: Any) -> None:
        self._eager.hooks_traced = self._eager.in_graph = True
        try:
            self._on_forward_start(module, args)
        finally:
            self._eager.in_graph = False

    def _on_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return outside_graph(self._on_forward_end, module, args, output)
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._frame.exit()
            captured = self._mode is not None
            self._stop_capture()
            self._eager.exit()
            if captured:  # no attention call captured: warned (probe.session.empty_steps)
                self._rec.forward_end(self._step, self._rec.emitted - self._emitted_before, self._auto_step, output,
                                      compiled=self._eager.hooks_traced or is_compiled(self.model))
            self._eager.arm(not self._paused and self._sampled((self._step + 1) if self._auto_step else self._step))

    def _warn_compiled(self, kind: str, message: str) -> None:
        self._warned_compiled(kind, message, stacklevel=3)

    def _emit(self, call: Any, key: Any = None) -> None:
        if self._frame.stale():
            # The root forward ended with a BaseException; this call is someone else's. The mode
            # cannot pop itself from inside its own handler: it goes inert here, and the next
            # forward or call on the probe pops it.
            if self._mode is not None:
                self._mode._paused = True
            self._stack.deactivate()
            return
        self._rec.emit(call, key)

    def _recover_if_interrupted(self) -> None:
        """Restore the state a root forward left when a BaseException (KeyboardInterrupt,
        SystemExit, GeneratorExit) skipped its forward hook (:mod:`probe.session.forward_guard`): capture
        mode popped, global module hooks removed, depth reset, so steps keep counting. Called
        where popping the mode is safe: outside any torch function."""
        if self._depth == 0 or not self._frame.stale():
            return
        self._frame.exit()
        self._depth = 0
        self._stop_capture()
        self._eager.exit()
        self._eager.arm(self._sampled((self._step + 1) if self._auto_step else self._step))

    def _stop_capture(self) -> None:
        self._audit.stop()
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)  # emits what the front ends still held
        self._stack.deactivate()
        self._audit.finish(self._rec)

    # -- flush -----------------------------------------------------------------------------------
    def _flush(self) -> None:
        """Pack the accumulator, start one device→host copy, hand the rest to the worker."""
        window, self._window = self._window, []
        self._check_filter()
        if self._dist is not None:
            self._flush_distributed(window)
            return
        acc = self._rec.acc
        if not acc:
            return
        self._probed_steps.update(window)
        flat, layout = acc.pack()
        acc.reset()
        names = {key: self._rec.site_name(key) for key, _, _ in layout}
        infos = self._rec.info_dicts()
        host, event = to_host(flat)
        self._writer.submit(Window(window[-1], window, host, event, layout, names, infos))

    def _flush_distributed(self, window: List[int]) -> None:
        """Reduce the window across the group's ranks (a collective, on the training thread, so
        that it is ordered with the training's own collectives), then hand it to the worker."""
        assert self._dist is not None
        step = window[-1] if window else self._step
        flat, layout, infos = self._dist.reduce(self._rec.acc.states, self._rec.info_dicts(), step)
        self._rec.acc.reset()
        self._rec.multi.update(self._dist.multi_names())  # "#n" suffixes as any rank saw them
        if not layout:
            return
        self._probed_steps.update(window)
        names = {key: self._rec.site_name(key) for key, _, _ in layout}
        self._writer.submit(Window(step, window or [step], flat, None, layout, names, infos))

    def _check_filter(self) -> None:
        filtered_out = self._rec.filtered_out
        if self._warned_filter or self._site_ok is None or not filtered_out:
            return
        if not self._rec.acc and self._writer.empty:
            self._warned_filter = True
            warnings.warn(
                f"probe: `sites` filter {self._sites_filter!r} matched none of the attention sites seen: "
                f"{', '.join(sorted(filtered_out))}",
                UserWarning,
                stacklevel=3,
            )

    # -- results ---------------------------------------------------------------------------------
    def summary(self) -> Summary:
        """Metrics aggregated over every probed step so far (including the current one).

        Under ``torch.distributed`` (a reducer is active) every rank returns the same global
        summary as of the last flush: the current, unflushed window is another rank's business
        until the next flush, and reading it here must not need a collective.
        """
        self._recover_if_interrupted()
        self._writer.fold_all()  # flushed windows into the totals; never waits on a sink
        local = self._dist is None
        rec = self._rec
        pending: Dict[str, State] = {}
        if rec.acc and local:
            flat, layout = rec.acc.pack()
            pending = pending_states(flat, layout, {key: rec.site_name(key) for key, _, _ in layout})
        infos = {rec.site_name(key): info for key, info in rec.info_dicts().items()} if local else {}
        probed = self._probed_steps | (set(self._window) if local else set())  # meta: which steps (for the CLI)
        return self._results.summary(pending, infos, len(probed), {**self._meta(), **step_ends(probed)})

    def _meta(self) -> Dict[str, Any]:
        return {"every": self.every, "saturation": self.saturation, "scales": list(BUILTIN_SCALES) + list(self.extra_scales)}

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every sink has written and flushed the statistics flushed so far (at most
        ``timeout`` seconds). Returns whether they all did. Training never needs this: sinks catch
        up on their own within a couple of seconds (docs/guarantees.md)."""
        return self._writer.flush(timeout)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook, flush, write ``probe_summary.json``. Safe to call twice."""
        if self._closed:
            return
        self._recover_if_interrupted()
        self._closed = True
        atexit.unregister(self._atexit)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._rec.empty_steps.end(closing=True)
        self._grad_hooks.remove()
        self._stop_capture()
        self._eager.exit()
        try:
            if self._dist is not None:
                # A collective: every rank closes and flushes, even one with nothing to add.
                if self._dist.usable():
                    self._flush()
                elif self._window or self._rec.acc:
                    self._writer.warn("probe: torch.distributed was shut down before Probe.close(); the last "
                                      "window of statistics was not reduced (close the probe first)")
            elif self._window or self._rec.acc:
                self._flush()
            if self._logdir is not None:
                # Before waiting on the sinks: a slow sink or a second Ctrl-C cannot cost the summary.
                self._writer.save(self.summary(), final=True)
        finally:
            self._writer.close(self.close_timeout)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ProbeError(f"this probe is closed: {what} needs an open one (probe.watch(model) again)")

    def __enter__(self) -> "Probe":
        self._check_open("`with probe:`")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Probe(every={self.every}, step={self._step}, closed={self._closed})"


def watch(
    model: nn.Module,
    logdir: Any = None,
    every: int = 1,
    scales: Optional[Mapping[str, ExtraScale]] = None,
    grads: bool = True,
    sites: SitesFilter = None,
    saturation: float = 0.99,
    per_head: bool = False,
    **options: Any,
) -> Probe:
    """Attach a :class:`Probe` to ``model``; use it as a context manager or call ``close()``.

    Example:
        >>> with probe.watch(model, logdir="runs/exp") as p:
        ...     for batch in loader:
        ...         model(**batch).loss.backward()
        >>> p.summary().value("encoder.layer.0.attention.self", "entropy", "unscaled")
    """
    return Probe(model, logdir, every, scales, grads, sites, saturation, per_head, **options)
