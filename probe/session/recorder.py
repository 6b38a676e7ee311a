"""The recorder: what probe does with each captured attention call.

Front ends only produce :class:`~probe.call.AttentionCall` records; the recorder decides what is
computed from them: it names the site (``name`` or ``name#n``), filters it (``sites=``),
validates the record, computes the forward statistics at every scale into the running
:class:`~probe.state.accumulator.Accumulator`, keeps the per-site info, and registers the
backward hooks (:class:`~probe.capture.grads.BackwardHooks`) whose gradients it reduces to the
backward statistics.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import weakref
import zlib
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from probe.call import AttentionCall, Scale
from probe.capture.mode import ModuleStack
from probe.once import WarnOnce
from probe.errors import ProbeError
from probe.session.empty_steps import EmptySteps
from probe.session.grad_hooks import GradHooks, grad_scales
from probe.session.options import ExtraScale, scale_value
from probe.session.site_info import SiteInfo, SiteKey, changed_heads, kv_fields_that_differ
from probe.session.verify import Verifier, warn_once_per_site
from probe.state.accumulator import GRAD_STEPS, Accumulator, State
from probe.state.writer import Window, to_host
from probe.session.deferred import Deferred, add_or_name, scale_field
from probe.stats.forward import finish_fields, forward_rows
from probe.stats.masks import simplify
from probe.stats.max_logit import max_logit
from probe.stats.plan import CallPlan, plan_call
from probe.stats.sampling import sample_rows

__all__ = ["GradHooks", "Recorder", "SiteInfo", "SiteKey", "grad_scales"]

#: The share of ``memory_budget`` that a step's forwards may keep for their backward (the sampled
#: rows' exponentials, :attr:`probe.stats.plan.CallPlan.carry`), all calls of the step together.
KEEP_SHARE = 0.5


class Recorder:
    """Turns emitted calls into per-site state (see the module docstring).

    Args:
        model: the watched root module (deferred gradients look up its sub-modules).
        stack: the running modules, for site names.
        frontends: the front ends (a recomputation under checkpointing runs them again).
        extra_scales: extra named scales (validated by the profiler).
        saturation, memory_budget, rows: as for :class:`probe.Probe`.
        grads: whether to register backward hooks.
        site_ok: the ``sites=`` predicate, ``None`` for every site.
        warn: the worker's warning channel (one message per failure).
    """

    def __init__(self, model: nn.Module, stack: ModuleStack, frontends: Sequence[Any], *,
                 extra_scales: Mapping[str, ExtraScale], saturation: float, memory_budget: int,
                 rows: Optional[int], grads: bool, site_ok: Optional[Callable[[str], bool]],
                 warn: Callable[[str], None]) -> None:
        # weakly: the model's hooks hold the probe that holds this recorder, and a probe its user
        # forgot must be collected with its model (probe.session.profiler)
        self._model = weakref.ref(model)
        self.stack = stack
        self.frontends = frontends
        self.extra_scales = extra_scales
        self.saturation = saturation
        self.memory_budget = memory_budget
        self.rows = rows
        self.grads = grads
        self.site_ok = site_ok
        self._warn = warn
        self._row_generator = torch.Generator()  # row sampling, seeded per call (_sample)
        self.acc = Accumulator()
        self.infos: Dict[SiteKey, SiteInfo] = {}
        self.multi: Set[str] = set()  # modules seen issuing several calls in one invocation
        self.filtered_out: Set[str] = set()
        self.window: List[int] = []  # sampled steps whose statistics sit in the accumulator
        self._grad_counted: Set[Tuple[Hashable, int]] = set()  # (site, step) whose grad_steps is counted
        self.step = 0
        self._kept = (0, 0)  # (step, bytes its forwards kept for their backward: _forward_fields)
        self.emitted = 0  # attention calls seen, to detect a compiled graph that hides them
        self.grad_hooks = GradHooks(self._add_grads, warn, self.site_name)
        self._warn_unknown_scale = WarnOnce()
        self._warn_scale = warn
        self.observer: Optional[Callable[[AttentionCall, str], None]] = None  # probe.coverage's audit
        self.empty_steps = EmptySteps(model)  # a sampled step that measured nothing is warned
        #: Held while the running state changes and while a snapshot reads it: ``Probe.summary()``
        #: may run on another thread (a dashboard) while training records, and backward hooks
        #: may run on autograd's device threads.
        self.lock = threading.RLock()
        #: ``probe.watch(..., qk_clip=τ)`` (probe.session.clipping): receives ``(site key, call, max
        #: logit per head)`` of every recorded call (``None``: not measured, scale unknown or unverified)
        self.on_logit_max: Optional[Callable[[SiteKey, AttentionCall, Optional[Tensor]], None]] = None
        #: measure the max logits only (QK-Clip on a step that is not sampled): one q·kᵀ per call
        self.max_logit_only = False
        self.verifier = Verifier(memory_budget, warn_once_per_site())  # each site's record checked
        self._warn_failed = warn_once_per_site()  # a record whose statistics fail: named once
        # rows finished at the forward's end (session.deferred; call finish() holding the lock)
        self.deferred = Deferred(memory_budget // 4, self.acc, saturation, self._warn_failed)

    def scales_for(self, call: AttentionCall) -> Dict[str, Scale]:
        scales: Dict[str, Scale] = {"actual": call.scale, "unscaled": 1.0, "standard": call.standard_scale}
        if call.scale_unknown is not None:  # the logits are exact, their attribution is not: `actual` only
            return {"actual": call.scale}
        for name, value in self.extra_scales.items():
            if not callable(value):
                scales[name] = value
                continue
            try:
                scales[name] = scale_value(name, value, call.d_k)
            except ProbeError as err:  # never inside the model's forward: that scale is skipped
                self._warn_scale(f"probe: {err}; that scale is skipped at site {call.site!r}")
        return scales

    def site_name(self, key: SiteKey) -> str:
        name, index = key
        return f"{name}#{index + 1}" if name in self.multi else name

    def reserve(self) -> SiteKey:
        """The site of a call issued now but emitted later (an eager softmax waiting for its
        ``P @ v``): the module running now, which ran the softmax (the capture mode's ``reserve``)."""
        return self.stack.next_site()

    def emit(self, call: AttentionCall, key: Optional[SiteKey] = None) -> None:
        """Record one call of the current step (the capture mode's ``emit``), issued by the
        module running now or, with ``key``, by the site :meth:`reserve` returned."""
        self.emitted += 1
        name, index = self.stack.next_site() if key is None else key
        with self.lock:
            if not self.max_logit_only:
                self.open_step(self.step)
            if index > 0:
                self.multi.add(name)
        call = dataclasses.replace(call, site=self.site_name((name, index)))
        changed = changed_heads(self.infos.get((name, index)), call)
        if changed is not None:
            self._warn_failed(call.site, changed)
            return
        if self.max_logit_only:
            self._max_logit_only((name, index), call)
            return
        if self.observer is not None:
            self.observer(call, call.site)  # the audit of the first sampled forward (probe.coverage)
        if self.site_ok is not None and not (self.site_ok(call.site) or self.site_ok(name)):
            self.filtered_out.add(call.site)
            return
        try:
            call.validate()
        except ValueError as err:
            self._warn(f"probe: skipped an attention call at {call.site!r}: {err}")
            return
        scales = self.scales_for(call)
        length = call.q.shape[2]
        # the query rows of the exponential metrics, forward and backward (None: every row)
        rows = None if self.rows is None or length <= self.rows else self._sample(call.site, length)
        key = (name, index)
        try:
            backward = self.grads and torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (call.q, call.k, call.v))
            call, scales, fields, stats_plan = self._forward_fields(call, key, scales, rows, backward)
        except Exception as err:  # noqa: BLE001 - a record probe cannot measure is named, never fatal
            self._warn_failed(call.site, f"probe: the attention at site {call.site!r} is NOT measured: its "
                              f"statistics failed ({type(err).__name__}: {err}); please report the model "
                              "(probe.coverage(model, ...) lists the site)")
            return
        if fields is not None:  # (None: finished at the forward's end, session.deferred)
            if not fields:
                return
            if isinstance(call.scale, Tensor) and scales:
                fields["scale"] = scale_field(call.scale, call.heads, fields["rows"])
        with self.lock:
            if fields is not None:
                self.deferred.finish()  # earlier calls first: the state merges in the calls' order
                add_or_name(self.acc, key, fields, call.site or "", self._warn_failed)
            self._update_info(key, call)
        if self.on_logit_max is not None:
            top = fields.get("logit_max@actual") if call.scale is not None and scales else None
            self.on_logit_max(key, call, None if self.verifier.unverified(key) else top)
        if self.grads and torch.is_grad_enabled():
            self.grad_hooks.register(call, key, self.step, scales, self.memory_budget, stats_plan)
        elif self.grads and self.grad_hooks.root_grad:  # no_grad inside a training forward: reentrant checkpoint
            root = self._model()
            module = None if root is None else root.get_submodule(name) if name != "root" else root
            scales_for = (lambda c: {}) if not scales else self.scales_for
            if module is not None:
                self.grad_hooks.defer(module, key, self.step, scales_for, self.memory_budget, self.frontends)

    def _max_logit_only(self, key: SiteKey, call: AttentionCall) -> None:
        """A call of a forward measured for QK-Clip only: its max logit per head, nothing else
        (the record still checked against the model's own result, as every recorded call)."""
        if self.on_logit_max is None or (self.site_ok is not None and not (self.site_ok(call.site)
                                                                           or self.site_ok(key[0]))):
            return
        try:
            call.validate()
        except ValueError:
            return
        top = None
        if call.scale is not None and call.logits is None:
            with torch.no_grad():
                call = simplify(call, self.memory_budget)
                self.verifier.verify(key, call, self.step)
                if not self.verifier.unverified(key):
                    top = max_logit(call, self.memory_budget)
        self.on_logit_max(key, call, top)

    def forward_end(self, step: int, calls: int, auto: bool, output: Any, compiled: bool = False) -> None:
        """A captured root forward of ``step`` ended, having emitted ``calls`` attention calls
        (``auto``: automatic steps, one forward per step; ``compiled``: the root runs compiled or
        scripted code); ``output`` is its result."""
        with self.lock:
            self.deferred.finish()
        self.empty_steps.forward_end(step, calls, auto, compiled)
        if self.grads and calls:
            self.grad_hooks.watch_backward(output, step)  # whether a backward ran: missing gradients named after it

    def _forward_fields(self, call: AttentionCall, key: SiteKey, scales: Dict[str, Scale], rows: Optional[Tensor],
                        backward: bool = False) -> Tuple[AttentionCall, Dict[str, Scale], Optional[State], CallPlan]:
        """(record, scales, forward fields, plan) of one call: from its own logits (scale
        unknown), from the record once it is checked against the model, or from the model's own
        probabilities when it does not match (no scale then: no counterfactual, no grad_logits).
        The plan (probe.stats.plan: path, scale groups, sampled rows) is made once and carried to
        the call's backward. ``backward``: a backward is expected, so the forward may keep its
        sampled rows' exponentials for it (``plan.carry``), within :data:`KEEP_SHARE` of
        ``memory_budget`` over the step's calls (the backward takes them, or they go with the
        step's hooks)."""
        spent = self._kept[1] if self._kept[0] == self.step else 0
        keep_bytes = max(0, int(self.memory_budget * KEEP_SHARE) - spent) if backward else 0
        with torch.no_grad():
            if call.logits is not None or call.scale_unknown is not None:
                self._warn_unknown(call)  # `actual` only (an eager softmax input when its scale is unknown)
            # the mask simplified in the plan (a float mask as a boolean one, HF's (B, 1, L, S)
            # mask as causal + key padding): the statistics take their fast paths, and the
            # backward's record holds the small key mask instead of the model's L × S one
            call, stats_plan = plan_call(call, scales, self.memory_budget, rows, keep_bytes=keep_bytes)
            # the record checked against what the model computed (probe.session.verify)
            if (call.logits is None and self.verifier.verify(key, call, self.step) is not None
                    and self.verifier.unverified(key)):
                return call, {}, self.verifier.fallback_fields(call, self.saturation), stats_plan
            rows = forward_rows(call, stats_plan)
            if stats_plan.carry:
                self._kept = (self.step, spent + stats_plan.kept_bytes(*call.q.shape[:2]))
            if rows is None:
                return call, scales, {}, stats_plan
            with self.lock:  # (fields None: finished at the forward's end, session.deferred; QK-Clip reads them now)
                if self.on_logit_max is None and self.deferred.offer(key, call, scales, rows, stats_plan):
                    return call, scales, None, stats_plan
            return call, scales, finish_fields([(rows, stats_plan)], self.saturation)[0], stats_plan

    def _sample(self, site: str, length: int) -> Tensor:
        """The stratified query positions of one call (probe.stats.sampling), seeded by the site,
        the step and the rank: the same run draws the same positions, whatever other sites do,
        and ranks draw independently (their variance estimates add when reduced)."""
        assert self.rows is not None
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._row_generator.manual_seed(zlib.crc32(f"{site}@{self.step}@{rank}".encode()))
        return sample_rows(length, self.rows, self._row_generator)

    def _update_info(self, key: SiteKey, call: AttentionCall) -> None:
        info = self.infos.get(key)
        if info is None:
            info = self.infos[key] = SiteInfo(call.kind, call.heads, call.kv_heads, call.d_k, softcap=call.softcap,
                                              scale_from=call.scale_from)
        length = call.q.shape[2]
        if self.rows is not None and length > self.rows and (info.sampled is None or length > info.sampled[1]):
            info.sampled = [self.rows, length]  # the longest call's (its rows are the sparsest)
            info.rows = (f"{self.rows} of {length} query rows sampled (the first {self.rows // 4} whole, the rest "
                         "stratified) for entropy, max_prob, saturation, grad_logits: estimates, standard errors "
                         "in *_se; logit_var, logit_max, nonfinite exact")
        if not isinstance(call.scale, Tensor):
            info.scale = None if call.scale is None else float(call.scale)
        if call.scale_unknown is not None:
            info.scale, info.scale_unknown = None, call.scale_unknown
        verdict = self.verifier.verdicts.get(key)
        if verdict is not None:
            told = verdict.info()
            info.verified, info.verification = told["verified"], told["verification"]
            if verdict.status == "mismatch":
                info.scale = None  # no scale is attributed to a record that does not match the model
        elif call.logits is not None:
            info.verified, info.verification = True, "measured from the model's own softmax input"
        info.calls += 1

    def _warn_unknown(self, call: AttentionCall) -> None:
        why = f" ({call.scale_unknown})" if call.scale_unknown else ""
        source = ", from the softmax input" if call.scale is None else ""
        self._warn_unknown_scale(
            call.site, f"probe: the attention scale at site {call.site!r} could not be recovered from its "
            f"ops{why}; it is reported at `actual` only{source} (info scale = None)",
        )

    def _add_grads(self, key: Hashable, step: int, fields: State, counted: Optional[Tensor] = None) -> None:
        """Fold backward fields (called from the hooks, inside backward) into the step's state;
        ``counted``: the step's ``grad_steps`` (a loss-scaled backward's: 0 when it overflowed,
        :mod:`probe.session.loss_scale`), 1 otherwise."""
        with self.lock:
            self.deferred.finish()  # a forward's fields before its backward's (no root forward ended: parts called)
            if step not in self.window:  # the window was flushed before this backward ran: in order, so that
                bisect.insort(self.window, step)  # the window is written at its last step, not this one
            if (key, step) not in self._grad_counted:  # count each step once: grad_* are RMS over steps
                self._grad_counted.add((key, step))
                ref = next(iter(fields.values()))
                fields = {**fields, GRAD_STEPS: torch.ones(1, dtype=ref.dtype, device=ref.device)
                          if counted is None else counted}
            info = self.infos.get(key)  # type: ignore[arg-type]
            differ = kv_fields_that_differ(info, fields)
            if differ:  # k repeated to the query heads on this call only: those cannot join
                fields = {name: value for name, value in fields.items() if name not in differ}
                site = self.site_name(key)  # type: ignore[arg-type]
                self._warn_failed(site, f"probe: grad_k and grad_v of the calls at site {site!r} whose k has another "
                                  f"number of heads than its first call's ({info.kv_heads}) are NOT measured (k and v "
                                  "repeated to the query heads on some calls only); every other metric is")
            self.acc.add(key, fields)
            if info is not None:
                info.grad_kv_heads = info.kv_heads  # grad_k / grad_v have one value per kv head

    def info_dicts(self) -> Dict[SiteKey, Dict[str, Any]]:
        """The site infos in their JSON form (copies), with ``not_measured``: what the site does
        not report and why (:meth:`not_measured`)."""
        self.verifier.resolve()
        self.grad_hooks.settle()  # the reasons of a backward that is over (warned when its step ends)
        out = {}
        with self.lock:
            for key, info in self.infos.items():
                entry = out[key] = info.to_dict()
                missing = self.not_measured(key, info)
                if missing:
                    entry["not_measured"] = missing
        return out

    def begin_forward(self, step: int) -> None:
        """A root forward of ``step`` begins: the hooks of an earlier step's backward go (it is
        over, or never came; :meth:`GradHooks.next_step` keeps those whose backward may still
        come), and whether this forward runs with grad is noted (a ``no_grad`` call inside it is
        then a reentrant checkpoint, whose gradients are deferred)."""
        self.grad_hooks.next_step(step)
        live = {step, *self.grad_hooks.held_steps()}
        self._grad_counted = {(key, s) for key, s in self._grad_counted if s in live}
        self.grad_hooks.root_grad = torch.is_grad_enabled()

    def open_step(self, step: int) -> None:
        """Count ``step`` in the current window (a sampled step is flushed with the others even
        when it records nothing: ranks must flush at the same steps)."""
        with self.lock:
            if not self.window or self.window[-1] != step:
                self.window.append(step)

    @property
    def pending(self) -> bool:
        """Whether a window is open: recorded state or sampled steps not handed out yet."""
        with self.lock:
            return bool(self.window) or bool(self.acc) or bool(self.deferred)

    def snapshot(self, reset: bool = True, reducer: Any = None) -> Optional[Window]:
        """The statistics recorded since the last snapshot, as one flush window for the writer.

        Args:
            reset: hand the window out (the running state starts empty, the steps are closed);
                ``False``: a copy of what is pending, for ``Probe.summary()``; nothing changes.
            reducer: under ``torch.distributed``, a :class:`probe.state.distributed.Reducer`: the
                window holds every rank's state reduced (a collective; needs ``reset``).

        Returns:
            the window (the device→host copy started), or ``None`` when there is nothing to
            report. Any thread may call it.
        """
        with self.lock:
            self.deferred.finish()
            steps = list(self.window)
            step = steps[-1] if steps else self.step
            if reducer is not None:
                flat, layout, infos = reducer.reduce(self.acc.states, self.info_dicts(), step)
                self.multi.update(reducer.multi_names())  # "#n" suffixes as any rank saw them
                event = None
            elif self.acc:
                flat, layout = self.acc.pack()
                infos = self.info_dicts()
                flat, event = to_host(flat) if reset else (flat, None)
            else:
                layout = []
            if reset:
                self.acc.reset()
                self.window = []
            if not layout:
                return None
            names = {key: self.site_name(key) for key in dict.fromkeys(key for key, _, _ in layout)}  # once per site
        # (no sampled step: QK-Clip's records of the unsampled steps since the last flush, which a
        # close() hands out on their own; they cover no probed step)
        clip_only = not steps and all(field.startswith("qk_clip_") for _, field, _ in layout)
        return Window(step, [] if clip_only else steps or [step], flat, event, layout, names, infos)

    def not_measured(self, key: SiteKey, info: SiteInfo) -> Dict[str, str]:
        """Values the site does not report, and why: ``{"metric": why}`` (at every scale),
        ``{"metric@scale": why}`` or ``{"@scale": why}`` (every metric at that scale)
        (:meth:`probe.summary.Summary.accounting` reads them)."""
        out: Dict[str, str] = {}
        counterfactual = ["unscaled", "standard", *self.extra_scales]
        verdict = self.verifier.verdicts.get(key)
        if verdict is not None and verdict.status == "mismatch":
            why = "unverified: probe's reconstruction does not match the model's computation (info 'verification')"
            out.update({f"@{s}": why for s in counterfactual})
            out.update({m: why for m in ("logit_var", "logit_max", "nonfinite", "grad_logits")})
            if info.kind != "eager":  # no probabilities of the model's own to fall back on
                out.update({m: why for m in ("entropy", "max_prob", "saturation")})
        elif info.scale_unknown is not None or info.verification == "measured from the model's own softmax input":
            why = f"scale unknown ({info.scale_unknown or 'an op probe does not model touched the scores'}): `actual` only"
            out.update({f"@{s}": why for s in counterfactual})
        out.update(self.grad_hooks.ledger.reasons.get(key, {}))
        return out
