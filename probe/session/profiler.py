"""Probe: attaches to a model, samples steps, wires capture → stats → sinks."""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from probe.capture.audit_warning import FirstForwardAudit
from probe.session.clipping import Riders, clipping
from probe.capture.mode import CaptureMode, ModuleStack, SitesFilter, site_filter
from probe.capture.registry import default_frontends
from probe.session.compiled import EagerSteps, check_model, is_compiled, outside_graph, skipped_compiled
from probe.state.distributed import resolve_group
from probe.stats.buffers import drop_kept
from probe.errors import ProbeError
from probe.session.forward_guard import ForwardFrame, RootHook
from probe.session import loss_scale
from probe.session.lifecycle import Counting, Event, Lifecycle, Phase
from probe.session.transforms import StepAside, transform_running
from probe.once import WarnOnce
from probe.session.options import (BUILTIN_SCALES, DEFAULT_ROWS, ExtraScale, check_audit, check_every, check_fraction,
                                   check_int, check_scales, check_seconds, output_sinks)
from probe.session.recorder import Recorder
from probe.session.schedule import Action, Schedule
from probe.sinks.base import Sink
from probe.session.outputs import Outputs
from probe.summary import Summary

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
        audit: warn once per attention the first sampled forward shows probe misses (:mod:`probe.capture.audit`);
            ``"quiet"``: audit that forward without warning (its findings in :attr:`audit_events`).
        offset: sample the steps with ``step % every == offset`` (a trainer logging N-1, 2N-1, ...).
        qk_clip: τ: after each optimizer step, scale the q and k weights of every head whose max logit
            exceeded τ on that step so that it is τ (QK-Clip, docs/qk_clip.md). Every training forward
            is then measured (its max logits only, unless sampled); ``every=None``: nothing else.
    """

    # The model is held in a slot, outside ``__dict__``: the finalizer closes a forgotten probe
    # from its ``__dict__``, which therefore must not reach the model (its hooks hold the probe).
    __slots__ = ("_root", "__dict__", "__weakref__")

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
        audit: Union[bool, str] = True,
        offset: int = 0,
        qk_clip: Optional[float] = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ProbeError(f"expected `model` to be a torch.nn.Module, got {type(model).__name__}")
        check_model(model)
        self.every = check_every(every, qk_clip)  # None: QK-Clip's max logits only
        self.flush_every = check_int("flush_every", flush_every, 1)
        self._schedule = Schedule(self.every or 1, self.flush_every, check_int("offset", offset, 0))
        self.memory_budget = check_int("memory_budget", memory_budget, 1)
        self.rows = None if rows is None else check_int("rows", rows, 1)
        self.saturation = check_fraction("saturation", saturation)
        self.close_timeout = check_seconds("close_timeout", close_timeout)
        self.extra_scales = check_scales(scales)
        self.grads = bool(grads)
        audit = check_audit(audit)
        self.per_head = bool(per_head)
        self._site_ok = site_filter(sites)
        self._dist = resolve_group(group)  # None: statistics stay local to this process
        writes = self._dist is None or self._dist.rank == 0  # only rank 0 of the group writes
        sinks, logdir = output_sinks(logdir, per_head, sinks, writes)

        self._root: Optional[nn.Module] = model  # a slot: strong while open (see _close_forgotten)
        self._model_ref = weakref.ref(model)
        self._stack = ModuleStack(model)
        self._frontends = default_frontends()
        self._mode: Optional[CaptureMode] = None
        self._eager = EagerSteps()  # torch.compile: sampled steps run eagerly (probe.session.compiled)
        self._eager.attach(model)
        self._emitted_before = 0
        self._warned_compiled = WarnOnce()
        self._aside = StepAside()  # torch.jit.trace, torch.export, torch.func, fake and meta tensors
        self._out = Outputs(sinks, logdir, self._meta(), self._dist, sites, self._site_ok)  # writer, results
        self._frame = ForwardFrame()  # the root forward in progress, to notice one a BaseException ended
        self._rec = Recorder(model, self._stack, self._frontends, extra_scales=self.extra_scales,
                             saturation=self.saturation, memory_budget=self.memory_budget, rows=self.rows,
                             grads=self.grads, site_ok=self._site_ok, warn=self._out.writer.warn)
        self._out.rec = self._rec
        # what rides on the capture mode: the first-forward audit and, with qk_clip, the clip's trace
        clip = clipping(model, qk_clip, self._rec, self._out.writer.warn, writes, self.every)
        self._audit = Riders(FirstForwardAudit(model, self._frontends, done=not audit, warn=audit != "quiet"),
                             clip, self._sampled)
        self._life = Lifecycle()  # READY; every phase change goes through it (probe.session.lifecycle)
        self._rec.empty_steps.outside(True)  # its parts run outside its forward: said (probe.session.empty_steps)
        self._handles = [
            # RootHook: a deepcopy / pickle / torch.save of the model copies them as inert hooks
            model.register_forward_pre_hook(RootHook(self._on_forward_start), with_kwargs=True),
            model.register_forward_hook(RootHook(self._on_forward_end), with_kwargs=True, always_call=True),
            self._audit,  # its remove() removes the clip's optimizer hook
        ]
        if self.grads:  # a GradScaler's loss scale taken out of the gradient metrics (until close)
            self._loss_scale = loss_scale.acquire()
        # Closed without close() when collected or at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _close_forgotten, type(self), self.__dict__)

    @property
    def model(self) -> Optional[nn.Module]:
        """The watched module. A closed probe holds it weakly: ``None`` once it was collected."""
        root = getattr(self, "_root", None)
        return root if root is not None else self._model_ref()

    # -- steps ---------------------------------------------------------------------------------
    @property
    def current_step(self) -> int:
        """The step attention calls recorded now belong to."""
        return self._rec.step

    @property
    def phase(self) -> Phase:
        """Where the probe is in its lifecycle (:class:`probe.session.lifecycle.Phase`)."""
        return self._life.phase

    @property
    def audit_events(self) -> List[Any]:
        """What the audited first sampled forward found (:class:`probe.capture.audit.Event`s)."""
        return self._audit.events

    def step(self, n: int, window: bool = False) -> None:
        """Set the step number: forwards until the next ``step`` call belong to step ``n``
        (e.g. several micro-batches of gradient accumulation). Turns off automatic counting.
        ``window``: a sampled step is recorded whole, whatever module runs (``Phase.WINDOW``)."""
        self._check_open("step")
        self._recover_if_interrupted()
        n = check_int("n", n, 0)
        self._close_window()
        self._life.set_step(n, window and (self._sampled(n) or self._audit.measures()))
        self._rec.step = n  # calls emitted from now on belong to this step
        self._rec.empty_steps.begin(n, self._sampled(n))  # a sampled step that measures nothing is warned
        self._maybe_flush()
        if self._dist is not None and self._sampled(n):
            # Under torch.distributed, explicit steps alone decide the flushes: a rank that runs no
            # forward in a sampled step still takes part in that step's flush.
            self._rec.open_step(n)
        self._eager.arm(self._sampled(n))
        if self._life.phase is Phase.WINDOW:
            self._rec.begin_forward(n)
            self._start_capture()

    def _close_window(self) -> None:
        if self._life.phase is Phase.WINDOW:  # the caller moves on to the next phase
            self._stop_capture()
            self._rec.empty_steps.window_end(self._rec.step, self._rec.emitted - self._emitted_before)

    def pause(self, flush: bool = True, wait: bool = False) -> None:
        """Probe no forward until the next :meth:`step` call, e.g. a trainer's evaluation between
        two training steps (it would otherwise count as part of the next step).

        Args:
            flush: the current step is over: hand its statistics to the sinks now (under
                ``flush_every``, once the window is full) rather than when the next step begins.
                Under ``torch.distributed`` this is a collective: every rank pauses alike.
            wait: also wait until the sinks have written them.
        """
        if self._life.closed:
            return
        self._close_window()
        self._life.pause()
        self._eager.arm(False)
        self._rec.empty_steps.outside(False)
        if flush and self._schedule.window_full(self._rec.window):
            self._flush()
        if wait:
            self._out.writer.flush()

    def _sampled(self, step: int) -> bool:
        return self.every is not None and self._schedule(step) is Action.RECORD

    def _maybe_flush(self) -> None:
        if self._schedule.flush_due(self._rec.window, self._rec.step):
            self._flush()

    def _arm_next(self) -> None:
        """Before the next root forward: ``force_eager`` if it will be recorded (torch.compile)."""
        life = self._life
        self._eager.arm(not life.paused and self._sampled(life.following_step()))
        self._rec.empty_steps.outside(life.counting is Counting.AUTO and not life.paused and not life.closed)

    # -- root hooks: FORWARD_START and FORWARD_END ---------------------------------------------
    def _on_forward_start(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._rec.empty_steps.outside(False)  # (also traced: the modules it calls run inside it)
        if torch.compiler.is_compiling():  # Dynamo traces the root's hooks: leave the graph
            if torch.compiler.is_exporting():  # torch.export: no graph break allowed, nothing to measure
                self._aside(args, kwargs, "torch.export")
                return None
            return outside_graph(self._on_traced_forward_start, module, args, kwargs)
        if self._aside(args, kwargs):  # the model runs as without probe
            self._aside.nested += self._life.in_forward  # its end must not end the running forward
            return None
        self._recover_if_interrupted()  # (which re-arms the watch for parts run outside a forward)
        self._rec.empty_steps.outside(False)
        life = self._life
        if life.in_forward:  # the root called again from inside its own forward
            life.depth += 1
            return
        if life.closed or life.phase is Phase.WINDOW:  # a window captures already
            return
        self._frame.enter()
        new_step = life.next_step() if life.counting is Counting.AUTO else None
        step = self._rec.step if new_step is None else new_step
        self._rec.step = step
        self._rec.begin_forward(step)
        self._maybe_flush()
        sampled = not life.paused and self._sampled(step)
        capture = sampled or (not life.paused and self._audit.measures())  # qk_clip: every training forward
        if sampled and self._dist is not None:
            # Ranks must flush at the same steps: a sampled step opens the window even on a rank
            # whose forward issues no attention call.
            self._rec.open_step(step)
        if capture and self._eager.in_graph and not self._eager.active:
            self._warned_compiled("skipped", skipped_compiled(step), stacklevel=3)
            capture = False
        life.start_forward(capture, new_step)
        if capture:
            self._start_capture()
            self._stack.claim_root(args, kwargs)  # an nn.MultiheadAttention / nn.Transformer* root

    def _on_traced_forward_start(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._eager.hooks_traced = self._eager.in_graph = True
        try:
            self._on_forward_start(module, args, kwargs)
        finally:
            self._eager.in_graph = False

    def _on_forward_end(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            if torch.compiler.is_exporting():
                return None
            return outside_graph(self._on_forward_end, module, args, kwargs, output)
        life = self._life
        if not life.in_forward:
            return
        if self._aside.nested and transform_running(args, kwargs) is not None:  # stepped aside at its start
            self._aside.nested -= 1
            return None
        if life.depth > 1:
            life.depth -= 1
            return
        self._frame.exit()
        captured = life.phase is Phase.CAPTURE and not self._rec.max_logit_only  # a sampled capture
        self._stop_capture()
        life.end_forward()
        if captured:  # no attention call captured: warned (probe.session.empty_steps)
            calls = self._rec.emitted - self._emitted_before
            # whether compiled code may have hidden the calls: asked only when there were none
            # (a walk over every module, at the end of every sampled forward otherwise)
            self._rec.forward_end(self._rec.step, calls, life.counting is Counting.AUTO, output,
                                  compiled=not calls and (self._eager.hooks_traced or is_compiled(self.model)))
        self._arm_next()

    def _emit(self, call: Any, key: Any = None) -> None:
        if self._frame.stale():
            # The root forward ended with a BaseException; this call is someone else's. The mode
            # cannot pop itself from inside its own handler: it goes inert here, and the next
            # forward or call on the probe pops it.
            if self._mode is not None:
                self._mode.pass_through()
            self._stack.deactivate()
            return
        if self._aside.call(call.q):  # a transform inside a recorded window (torch.func, fake tensors)
            return
        self._rec.emit(call, key)

    def _recover_if_interrupted(self) -> None:
        """INTERRUPTED: restore the state a root forward left when a BaseException
        (KeyboardInterrupt, SystemExit, GeneratorExit) skipped its forward hook
        (:mod:`probe.session.forward_guard`): capture mode popped, global module hooks removed,
        depth reset, so steps keep counting. Called where popping the mode is safe: outside any
        torch function."""
        if not self._life.in_forward or not self._frame.stale():
            return
        self._frame.exit()
        self._stop_capture()
        self._life.end_forward(Event.INTERRUPTED)
        self._arm_next()

    def _start_capture(self) -> None:
        self._eager.enter()  # compiled code in this forward runs eagerly, so the capture sees it
        self._emitted_before = self._rec.emitted
        self._stack.activate()
        self._mode = CaptureMode(self._frontends, self._emit, self._rec.reserve)
        self._mode.__enter__()
        self._audit.start(self._rec)  # above the capture mode: it sees the model's ops first

    def _stop_capture(self) -> None:
        self._audit.stop()
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)  # emits what the front ends still held
        self._stack.deactivate()
        self._audit.finish(self._rec)
        self._eager.exit()

    # -- flush and results -------------------------------------------------------------------------
    def _flush(self) -> None:
        self._out.flush()

    def summary(self) -> Summary:
        """Metrics aggregated over every probed step so far (including the current one). Safe
        from any thread while training runs (a dashboard, a notebook widget).

        Under ``torch.distributed`` (a reducer is active) every rank returns the same global
        summary as of the last flush: the current, unflushed window is another rank's business
        until the next flush, and reading it here must not need a collective.
        """
        self._recover_if_interrupted()
        return self._out.summary()

    def _meta(self) -> Dict[str, Any]:
        return {"every": self.every, "saturation": self.saturation, "scales": list(BUILTIN_SCALES) + list(self.extra_scales)}

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every sink has written and flushed the statistics flushed so far (at most
        ``timeout`` seconds). Returns whether they all did. Training never needs this: sinks catch
        up on their own within a couple of seconds (docs/guarantees.md)."""
        return self._out.writer.flush(timeout)

    # -- lifecycle: CLOSE --------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook, flush, write ``probe_summary.json``. Safe to call twice."""
        if self._life.closed:
            return
        self._recover_if_interrupted()
        self._close_window()
        self._life.close()
        self._finalizer.detach()
        EagerSteps.detach(self._model_ref())  # its own compile back
        self._root = None  # a closed probe keeps nothing of the model alive
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._rec.empty_steps.end(closing=True)
        self._rec.grad_hooks.remove()
        if self.__dict__.pop("_loss_scale", False):  # (once, also for a forgotten probe's stand-in)
            loss_scale.release()
        self._stop_capture()
        drop_kept()  # the memory kept exponentials reused between steps (probe.stats.buffers)
        self._out.close(self.close_timeout)

    def _check_open(self, what: str) -> None:
        if self._life.closed:
            raise ProbeError(f"this probe is closed: {what} needs an open one (probe.watch(model) again)")

    def __enter__(self) -> "Probe":
        self._check_open("`with probe:`")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Probe(every={self.every}, step={self._rec.step}, {self._life.phase.name.lower()})"


def _close_forgotten(cls: type, state: Dict[str, Any]) -> None:
    """``weakref.finalize``'s callback for a probe collected, or alive at interpreter exit, that
    was never closed: a stand-in over the same attributes closes it (flush, summary file, sinks),
    with a warning. On one of the probe's own writer threads (a collection can happen anywhere),
    the closing runs on a new thread: a lane cannot wait for itself."""
    probe = cls.__new__(cls)
    probe.__dict__ = state  # the same attributes, not a copy: at exit the probe may still be alive
    if probe._life.closed:
        return
    where = f" writing to {probe._out.logdir!r}" if probe._out.logdir else ""
    warnings.warn(f"probe: a Probe{where} was never closed; probe closed it when it was collected or at interpreter "
                  "exit (its summary and last window are written). Call p.close(), or use `with probe.watch(...)`.",
                  UserWarning, stacklevel=2)
    if probe._out.writer.on_own_thread():
        threading.Thread(target=probe.close, name="probe-close").start()
    else:
        probe.close()


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
