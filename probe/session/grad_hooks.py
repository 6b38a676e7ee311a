"""The recorder's backward side: hooks whose gradients become backward statistics, and the
ledger that names every gradient metric a sampled backward did not produce.

:class:`GradHooks` registers, through :class:`probe.capture.grads.BackwardHooks`, the hooks of each
recorded call (or defers them to a recomputation under reentrant activation checkpointing,
:class:`probe.session.recompute.Recompute`) and reduces what they receive to
``grad_logits_sq@{scale}`` (:func:`probe.stats.backward.grad_logits_stats`) and ``grad_{q,k,v}_sq``
(:func:`probe.stats.backward.head_sq`). It also hooks the root forward's outputs, to know whether a
backward ran, and keeps a :class:`~probe.session.grad_ledger.GradLedger`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Hashable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from probe.call import AttentionCall, Scale
from probe.capture.grads import BackwardHooks
from probe.session.grad_ledger import GradLedger
from probe.session.loss_scale import ScaledFields
from probe.session.recompute import Recompute
from probe.stats.backward import grad_logits_stats, head_sq
from probe.stats.plan import CallPlan

__all__ = ["AddFields", "GradHooks", "grad_scales"]

#: ``add(site_key, step, fields)``: folds backward fields into the running state.
AddFields = Callable[[Hashable, int, Dict[str, Tensor]], None]

#: Why an unverified site has no grad_logits.
UNVERIFIED = "the site is unverified: nothing is computed from a reconstruction that does not match the model"


def grad_scales(call: AttentionCall, scales: Mapping[str, Optional[Scale]]) -> Dict[str, Optional[Scale]]:
    """The scales ``grad_logits`` is measured at: every scale of a call whose scale is known;
    ``actual`` only (from the call's own logits) when it is not; none for an unverified site
    (``scales`` empty)."""
    if call.scale is None:
        return {"actual": None} if call.logits is not None else {}
    if not scales:  # an unverified site: nothing from its reconstruction
        return {}
    if call.scale_unknown is not None:
        return {"actual": scales["actual"]}
    return {name: value for name, value in scales.items() if value is not None}


def _outputs(out: Any, depth: int = 0) -> Iterator[Tensor]:
    """Float tensors that require grad in a forward's result (tensors, tuples, lists, dicts)."""
    if isinstance(out, Tensor):
        if out.requires_grad and out.is_floating_point():
            yield out
    elif depth < 3 and isinstance(out, (tuple, list)):
        for item in out[:16]:
            yield from _outputs(item, depth + 1)
    elif depth < 3 and isinstance(out, Mapping):
        for item in list(out.values())[:16]:
            yield from _outputs(item, depth + 1)


#: Earlier steps whose hooks wait for their backward at most (:meth:`GradHooks.next_step`).
HELD_STEPS = 4


class _Held(NamedTuple):
    """An earlier step's hooks, waiting for its backward."""

    step: int
    hooks: BackwardHooks
    sentinels: List[RemovableHandle]
    outputs: List["weakref.ref[Tensor]"]


class GradHooks:
    """Backward hooks whose gradients are reduced to backward statistics.

    ``register(call, key, step, scales, budget)`` hooks one call; each gradient becomes fields
    ``grad_logits_sq@{scale}`` and ``grad_{q,k,v}_sq``, handed to ``add(key, step, fields)``.

    Args:
        add: receives ``(site key, step, fields)`` from inside backward.
        warn: receives a message when a backward reduction fails.
        names: site key -> site name (the ledger's warnings name sites).
    """

    def __init__(self, add: AddFields, warn: Callable[[str], None],
                 names: Optional[Callable[[Hashable], str]] = None) -> None:
        self._add = ScaledFields(add, warn)  # a loss-scaled backward's fields in the loss's units
        self.hooks = BackwardHooks(self._on_logits, self._on_input, warn)
        self.recompute = Recompute(self._register_recomputed)
        self.ledger = GradLedger()
        self.ledger.quiet.add(UNVERIFIED)  # the site's own warning says it
        self._names = names or str
        self._sentinels: List[RemovableHandle] = []
        self._outputs: List["weakref.ref[Tensor]"] = []  # the current step's root outputs, weakly
        self._held: List[_Held] = []  # earlier steps whose backward may still come (next_step)
        self._warn = warn
        #: Whether the current root forward began with grad enabled (set by the profiler).
        self.root_grad = False
        self._budget = 64 * 2**20  # memory_budget of the hooked calls (head_sq's chunks)

    def __len__(self) -> int:
        return len(self.hooks)

    @property
    def step(self) -> Optional[int]:
        """The step whose backward the registered hooks wait for (``None``: no hook)."""
        return self.hooks.step

    def register(self, call: AttentionCall, key: Hashable, step: int, scales: Mapping[str, Optional[Scale]],
                 budget_bytes: int, stats_plan: Optional[CallPlan] = None) -> int:
        """Hook one call; ``stats_plan``: its forward statistics' plan (path, scale groups, sampled
        query rows; :func:`probe.stats.plan.plan_call`), which ``grad_logits`` follows
        (:func:`grad_logits_stats`; ``None``: planned in the backward, every row)."""
        self._budget = budget_bytes
        measured = grad_scales(call, scales)
        count = self.hooks.register(call, key, step, (measured, budget_bytes, stats_plan))
        plan = dict(self.hooks.last_plan)
        if plan and plan.get("logits", "") is None and not measured:
            plan["logits"] = UNVERIFIED if not scales else "its logits cannot be rebuilt (scale unknown)"
        if plan:
            self.ledger.planned(key, step, plan)
        return count

    def _register_recomputed(self, call: AttentionCall, key: Hashable, step: int, payload: Any) -> int:
        count = self.hooks.register(call, key, step, payload)
        plan = dict(self.hooks.last_plan)
        if plan and plan.get("logits", "") is None and not payload[0]:
            plan["logits"] = UNVERIFIED
        if plan:
            self.ledger.planned(key, step, plan)
        return count

    def defer(self, module: nn.Module, key: Hashable, step: int,
              scales_for: Callable[[AttentionCall], Mapping[str, Optional[Scale]]], budget_bytes: int,
              frontends: Sequence[Any]) -> None:
        def payload(call: AttentionCall) -> Tuple[Dict[str, Optional[Scale]], int, None]:
            return grad_scales(call, scales_for(call)), budget_bytes, None  # recomputed: every row

        self.hooks.step = step
        self._budget = budget_bytes
        self.ledger.deferred(key, step)
        self.recompute.defer(module, key, step, frontends, payload)

    def watch_backward(self, output: Any, step: int) -> None:
        """Hook the root forward's outputs of ``step``: whether a backward ran through them
        (the ledger names missing gradient metrics only after a backward), and keep them weakly
        (:meth:`next_step`: a step whose outputs live and saw no backward keeps its hooks)."""
        if not torch.is_grad_enabled():
            return
        ledger = self.ledger
        for i, out in enumerate(_outputs(output)):
            self._outputs.append(weakref.ref(out))  # every one: the loss may come from any
            if i == 0:  # one sentinel is enough: the backward runs through the outputs the loss is made of first
                self._sentinels.append(out.register_hook(lambda grad, step=step: ledger.backward_ran(step)))
                if self.hooks.step is None:
                    self.hooks.step = step

    def settle(self, final: bool = False) -> None:
        """Name the gradient metrics a finished backward did not produce (:class:`GradLedger`)."""
        self.ledger.settle(final, {})

    def next_step(self, step: int) -> None:
        """A root forward of ``step`` begins. The hooks of an earlier step go, and what its
        backward did not produce is named, unless that backward may still come: no backward ran
        through its outputs yet and they are alive (two forwards before one backward: two views
        of a batch through one model, or an evaluation forward between a forward and its
        backward). Those hooks stay, up to :data:`HELD_STEPS` steps, until their backward ran or
        their outputs are gone; their gradients count for their own step."""
        current = self.hooks.step
        candidates = list(self._held)
        if current is not None and current != step:
            candidates.append(_Held(current, self.hooks, self._sentinels, self._outputs))
            self.hooks = BackwardHooks(self._on_logits, self._on_input, self._warn)
            self._sentinels, self._outputs = [], []
            self.recompute.remove()  # (a checkpointed call of a held step is named, not recomputed)
        held, done = [], []
        for h in candidates:
            (held if self._waits(h) else done).append(h)
        while len(held) > HELD_STEPS:
            done.append(held.pop(0))
        self._held = held
        if done:
            self._release(done)

    def held_steps(self) -> List[int]:
        """The earlier steps whose hooks wait for their backward (:meth:`next_step`)."""
        return [h.step for h in self._held]

    def _waits(self, held: "_Held") -> bool:
        return not self.ledger.backward_seen(held.step) and any(ref() is not None for ref in held.outputs)

    def _release(self, done: List["_Held"]) -> None:
        try:
            self.ledger.settle(True, _Names(self._names), steps={h.step for h in done})
        finally:
            for h in done:
                h.hooks.remove()
                for handle in h.sentinels:
                    handle.remove()

    def remove(self) -> None:
        """The steps are over (the probe closes): name what their backward did not produce,
        then remove every hook (tensor and module hooks; harmless twice)."""
        try:
            self.ledger.settle(True, _Names(self._names))
        finally:
            self.recompute.remove()
            self.hooks.remove()
            sentinels, self._sentinels, self._outputs = self._sentinels, [], []
            held, self._held = self._held, []
            for handle in sentinels + [handle for h in held for handle in h.sentinels]:
                handle.remove()
            for h in held:
                h.hooks.remove()

    def _on_logits(self, record: AttentionCall, key: Hashable, step: int, payload: Any, grad: Tensor,
                   from_probs: bool) -> None:
        scales, budget, stats_plan = payload
        if not scales:
            return
        self.ledger.reached(key, step, "logits")
        if from_probs:
            fields = grad_logits_stats(record, None, scales, budget, grad_probs=grad, plan=stats_plan)
        else:
            fields = grad_logits_stats(record, grad, scales, budget, plan=stats_plan)
        if fields:
            self._add(key, step, fields)
            self.ledger.arrived(key, step, ["logits"])

    def _on_input(self, name: str, key: Hashable, step: int, grad: Tensor) -> None:
        self.ledger.reached(key, step, name)
        self._add(key, step, {f"grad_{name}_sq": head_sq(grad, self._budget)})
        self.ledger.arrived(key, step, [name])


class _Names(dict):
    """Site key -> name, looked up when a warning needs it."""

    def __init__(self, names: Callable[[Hashable], str]) -> None:
        super().__init__()
        self._names = names

    def get(self, key: Hashable, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self._names(key)
        except Exception:  # noqa: BLE001 - a name for a warning never breaks anything
            return default
