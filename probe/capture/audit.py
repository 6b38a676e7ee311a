"""An independent check that capture misses no attention: :class:`Audit`.

The capture front ends recognise attention by the shape of the code (``softmax(q @ kᵀ · s + b)``
op by op, an SDPA call, ...). The audit does not: it follows every op of one forward and asks a
simpler question, *which softmaxes consume scores derived from a product of two activations?*
Each such softmax, and each SDPA / ``nn.MultiheadAttention`` call, is an attention *event*; the
profiler tells the audit every call it reports, and an event no reported call accounts for is a
miss, with the reason (the op after which the scores were no longer followed).

Rules (a taint follows the scores from the product to the softmax):

* a *product of two activations* (``matmul``, ``@``, ``bmm``, ``baddbmm``, two-operand ``einsum``)
  starts a taint; *constants* are the model's parameters and buffers and what is computed only
  from them or from factories (position tables, masks, ``arange``), anything else is an activation;
  so does a constant on the left of a batched activation whose tokens make the last dim (learned
  queries: ``(self.queries * s) @ xᵀ``), which is an event only softmaxed over those tokens
  (:func:`~probe.capture.audit_taint.learned_queries`; a softmax over the constant's rows is not);
* every other op whose tensor inputs carry a taint passes it on (views, reshapes, masks, biases,
  floors, clamps, ``torch.max``, indexing, in-place writes into another tensor...), except
  contractions with constants that consume the key dim (``F.linear`` over the keys, ``scores @
  W``), which end it; a linear mix over heads (talking heads: ``einsum("bhij,hg->bgij")``, a 1x1
  convolution, an ``nn.Linear`` over the heads of permuted scores) passes it on;
* a softmax spelled out is an event at the op that completes it (over the last dim, or several
  trailing dims with it: a softmax over several key axes): ``exp`` of log-probabilities
  (``log_softmax(x)``, ``x - logsumexp(x)``), ``e / e.sum(-1)`` of an ``e = exp(scores)``
  (:mod:`probe.capture.audit_taint`: the same op vocabulary as the eager tracer,
  :mod:`probe.capture.ops`);
* weights that are not a softmax probe measures are events it names, never measures:
  ``F.gumbel_softmax`` of scores (its noise is drawn inside one call), and a sigmoid of the scores
  of one product (no norm or other product since) once it multiplies an activation (sigmoid
  attention, ``sigmoid(q·kᵀ·s) @ v``), and so an arc-cosine kernel of them (YOSO's
  ``(1 - acos(q̂·k̂)/π)^τ @ v``) and the scores themselves, masked, scaled or divided only, times an
  activation over their keys (linear attention: RetNet's retention ``(q·kᵀ ⊙ D / norm) @ v``, Gated
  DeltaNet's chunks) unless that activation is made from the same product or from a product of
  scores (a matrix power series: Nyström's pseudo-inverse);
* a tensor produced where the audit could not see (a TorchScript function, a C++ extension) has
  no taint; with autograd on, a softmax input whose graph reaches a tainted tensor within a few
  nodes is still an event ("went through code probe cannot see");
* the module of an event is the innermost running module, skipping parameterless ``torch.nn``
  leaves (``nn.Softmax``, ``nn.Dropout``, and Keras' ``Softmax`` / ``Dropout`` layers: probe.capture.sites):
  the module that ran the softmax.

Cost: one Python dispatch per op; the profiler audits only the first sampled forward.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from probe.capture.audit_taint import (ATTENTION, CUTS, DIV, EXP, GRAPH_CUTS, GRAPH_DEPTH, GUMBEL, KERNEL,
                                       LOG_SOFTMAX, POW, PRODUCTS, SIGMOID, SOFTMAX, Event, Taint, keeps_scores,
                                       learned_queries, operands, step, tensors_in)
from probe.capture.ops import (ADD, CAST, DETACH, DIV as DIV_, DROPOUT, EXPAND, FIRST, INDEX, MASKED_FILL, MUL, NORM,
                               PERMUTE, PRODUCT, RSUB, SUB, TRANSPOSE, VIEW, WHERE, funcs_of, kind_of, name_of)

__all__ = ["Audit", "Event"]

_name = name_of
#: ops after which a tensor is no longer the scores of one product (another product, a norm)
_NOT_SCORES = frozenset(map(name_of, PRODUCTS | funcs_of(NORM)))
#: ops between a sigmoid (or kernel) of scores and its product with v that keep it the weights
_KEEP_WEIGHTS = funcs_of(CAST, DETACH, DROPOUT, VIEW, TRANSPOSE, PERMUTE, EXPAND, INDEX, MASKED_FILL, WHERE, MUL, DIV_,
                         ADD, SUB, RSUB) | POW


_MATMUL = funcs_of(PRODUCT)
_LINEAR_OPS = frozenset(map(name_of, _KEEP_WEIGHTS - POW))


def _weighted(func: Any, args: Tuple[Any, ...], pair: List[Tensor], taint_of: Callable[[Any], Optional[Taint]]
              ) -> Tuple[Optional[str], Optional[Taint]]:
    """Weights that are not a softmax probe measures, contracted over their keys with a v:
    ``("linear", taint)`` for scores of one product of two plain activations through masks, factors
    and divisors only (RetNet's retention ``(q·kᵀ ⊙ D / norm) @ v``; Gated DeltaNet's chunks, whose v
    is solved from another product, ``k·kᵀ``; by ``matmul`` only: einsums of state-space scans
    contract such products with activations too), with a v that is not made from the same product
    nor from a product of scores (a matrix power series is: Nyström's pseudo-inverse,
    ``xz @ (7I - xz)``); ``("exp", taint)`` for ``exp(scores - max) @ v`` normalised after the
    product, v carrying no scores (flash-style chunks: memory-efficient-attention); ``(None, None)``
    otherwise."""
    for i in ((0, 1) if func is torch.einsum else (0,)) if func in _MATMUL or func is torch.einsum else ():
        t, v = pair[i], pair[1 - i]
        taint, v_taint = taint_of(t), taint_of(v)
        if taint is None or t.dim() < 3 or taint.axis != -1 or not _keys_contracted(func, args, i):
            continue
        if taint.exp is not None and not taint.summed and v_taint is None:
            return "exp", taint
        if func in _MATMUL and taint.weights is None and taint.exp is None and taint.logprobs is None and not (
                taint.learned or taint.summed or taint.lse or taint.lse_centred or taint.series) and all(
                op in _LINEAR_OPS for op in taint.ops[1:]) and (
                v_taint is None or not (v_taint.series or v_taint.origin == taint.origin)):
            return "linear", taint
    return None, None


def _keys_contracted(func: Any, args: Tuple[Any, ...], i: int) -> bool:
    """Whether operand ``i``'s last dim is contracted (``P @ v``; an einsum summing its last letter)."""
    if func is not torch.einsum:
        return i == 0
    eq = args[0].replace(" ", "") if args and isinstance(args[0], str) else ""
    if "->" not in eq or "." in eq or eq.count(",") != 1:
        return False
    specs, out = eq.split("->")[0].split(","), eq.split("->")[1]
    return bool(specs[i]) and specs[i][-1] not in out and specs[i][-1] in specs[1 - i]


class Audit(TorchFunctionMode):
    """Finds every attention of one forward, independently of the capture front ends.

    Args:
        model: the watched model (its parameters and buffers are constants; its modules name events).
        followed: ``followed(tensor)`` says whether capture still holds a score record for a
            tensor (the eager front end's provenance table); used only to say *where* scores were lost.

    Enter it above the capture mode (it must see the model's ops first), call :meth:`reported`
    for every reported call, read :meth:`misses` once the capture mode emitted what it held.
    """

    rides_capture = True  # leaves the mode stack with the capture mode (a fused nested-tensor module)

    def __init__(self, model: nn.Module, followed: Optional[Callable[[Tensor], bool]] = None) -> None:
        super().__init__()
        from probe.capture.mode import site_names
        from probe.capture.sites import function_module

        self._names = site_names(model)
        self._wrappers = {id(m) for m in model.modules() if function_module(m)}
        self._consts: Set[int] = {id(t) for t in (*model.parameters(), *model.buffers())}
        self._const_refs: Dict[int, weakref.ref] = {}
        self._taints: Dict[int, Tuple[weakref.ref, Taint]] = {}
        self._graph: Dict[Any, None] = {}  # grad_fn of tainted tensors (autograd on)
        self._followed = followed
        self._stack: List[str] = ["root"]
        self._handles: List[RemovableHandle] = []
        self.events: List[Event] = []
        self._by_probs: Dict[int, Tuple[weakref.ref, Event]] = {}
        self._current: Optional[Event] = None
        self._products = 0  # products of two activations so far (each scores' origin)
        self._capture: Any = None  # the capture mode below this audit, if any

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> "Audit":
        from probe.capture.mode import CaptureMode
        from torch.overrides import _get_current_function_mode_stack

        self._capture = next((m for m in reversed(_get_current_function_mode_stack()) if isinstance(m, CaptureMode)), None)
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._push),
            nn.modules.module.register_module_forward_hook(self._pop, always_call=True),
        ]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._taints.clear()
            self._graph.clear()

    def _quiet(self) -> bool:
        """Whether capture is measuring (a paused or suspended capture mode): its ops are not the model's."""
        capture = self._capture
        if capture is None:
            return False
        if getattr(capture, "_paused", False):
            return True
        from probe.capture.mode import is_mode_active

        return not is_mode_active(capture)

    def _push(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is not None and id(module) not in self._wrappers and name != "root":
            self._stack.append(name)

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if len(self._stack) > 1 and self._stack[-1] == self._names.get(id(module)):
            self._stack.pop()

    # -- the profiler's side -------------------------------------------------------------------------
    def reported(self, call: Any, site: str) -> None:
        """A call probe reported, under ``site``: it accounts for the event it came from."""
        event = None
        own = (getattr(call, "grad_of", None) or {}).get("probs")  # the model's own P behind a record's view
        for probs in (getattr(call, "probs", None), own[0] if own else None):
            if isinstance(probs, Tensor) and event is None:
                entry = self._by_probs.get(id(probs))
                if entry is not None and entry[0]() is probs:
                    event = entry[1]
        if event is None and self._current is not None and self._current.reported is None:
            event = self._current  # emitted while the audit's own softmax / attention op ran
        if event is None:
            self.events.append(Event(module=site.split("#")[0], kind=getattr(call, "kind", "?"),
                                     reported=site, front_end=getattr(call, "kind", None)))
            return
        if event.reported is None:
            event.reported, event.front_end = site, getattr(call, "kind", None)

    def misses(self) -> List[Event]:
        """Attention events that no reported call accounts for, or reported under another module."""
        return [e for e in self.events if e.reported is None or e.reported.split("#")[0] != e.module]

    # -- the taint ---------------------------------------------------------------------------------
    def _is_const(self, t: Tensor) -> bool:
        key = id(t)
        if key in self._consts:
            return True
        ref = self._const_refs.get(key)
        if ref is not None and ref() is t:
            return True
        base = t._base
        return base is not None and self._is_const(base)

    def _mark_const(self, t: Tensor) -> None:
        key = id(t)
        table = self._const_refs

        def drop(ref: weakref.ref, key: int = key) -> None:
            if table.get(key) is ref:
                del table[key]
        table[key] = weakref.ref(t, drop)

    def _taint(self, t: Any) -> Optional[Taint]:
        if not isinstance(t, Tensor):
            return None
        entry = self._taints.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _set(self, t: Tensor, taint: Taint) -> None:
        if not t.is_floating_point():
            return
        if taint.lost_at is None and self._followed is not None and not self._followed(t):
            taint = dataclasses.replace(taint, lost_at=taint.ops[-1])
        key = id(t)
        table = self._taints

        def drop(ref: weakref.ref, key: int = key) -> None:
            entry = table.get(key)
            if entry is not None and entry[0] is ref:
                del table[key]

        table[key] = (weakref.ref(t, drop), taint)
        if t.grad_fn is not None:
            self._graph[t.grad_fn] = None

    def _module(self) -> str:
        return self._stack[-1]

    # -- dispatch ----------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if torch.compiler.is_compiling() or self._quiet():
            return func(*args, **kwargs)
        kind = ATTENTION.get(func)
        if kind is not None:
            return self._attention_op(func, kind, args, kwargs)
        if func in SOFTMAX or func in LOG_SOFTMAX:
            return self._softmax(func, args, kwargs)
        if func in GUMBEL:  # one call the modes cannot look into: its softmax is named, not measured
            with torch._C.DisableTorchFunction():
                taint = self._taint(args[0] if args else kwargs.get("logits"))
            if taint is not None:
                return self._around(dataclasses.replace(self._event(taint), kind="gumbel_softmax"), func, args, kwargs)
        with torch._C.DisableTorchFunction():  # the audit's own reads of tensors are not the model's ops
            try:
                event = self._spelled(func, args, kwargs)
            except Exception:  # noqa: BLE001 - the audit never breaks the model
                event = None
        if event is not None:
            return self._around(event, func, args, kwargs)
        out = func(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            try:
                self._follow(func, args, kwargs, out)
            except Exception:  # noqa: BLE001 - the audit never breaks the model
                pass
        return out

    def _around(self, event: "Event", func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Run the op that completes a softmax ``event``: the call capture emits meanwhile, or later
        with its output as probabilities, accounts for it."""
        if event not in self.events:
            self.events.append(event)
        outer, self._current = self._current, event
        try:
            out = func(*args, **kwargs)
        finally:
            self._current = outer
        if isinstance(out, Tensor):
            self._by_probs[id(out)] = (weakref.ref(out), event)
        return out

    def _spelled(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional["Event"]:
        """The event of a softmax spelled out, at the op that completes it: ``exp`` of
        log-probabilities (``log_softmax(x)``, ``x - logsumexp(x)``), or ``e / e.sum(-1)`` of an
        ``e = exp(scores)``."""
        if func in EXP:
            taint = self._taint(args[0] if args else kwargs.get("input"))
            if taint is not None and (taint.logprobs is not None or taint.lse_centred) and not taint.over_weight_rows():
                return taint.logprobs or self._event(taint)
        elif func in DIV and len(args) >= 2:
            ta, tb = self._taint(args[0]), self._taint(args[1])
            if ta is not None and tb is not None and ta.exp is not None and ta.exp == tb.exp and tb.summed \
                    and not ta.summed and not ta.over_weight_rows():
                return self._event(ta)
        return None

    def _event(self, taint: "Taint", dim: Optional[int] = None) -> "Event":
        return Event(module=self._module(), kind="softmax", ops=taint.ops, lost_at=taint.lost_at,
                     shapes=taint.shapes, dim=dim)

    def _attention_op(self, func: Any, kind: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        event = Event(module=self._module(), kind=kind)
        self.events.append(event)
        outer, self._current = self._current, event
        try:
            return func(*args, **kwargs)
        finally:
            self._current = outer

    def _softmax(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        x = args[0] if args else kwargs.get("input")
        with torch._C.DisableTorchFunction():
            taint = self._taint(x)
            event = None
            if taint is not None:
                dim = args[1] if len(args) > 1 else kwargs.get("dim")
                other = isinstance(dim, int) and isinstance(x, Tensor) and dim not in (-1, x.dim() - 1)
                if not taint.over_weight_rows(dim if other else None):
                    event = self._event(taint, dim if other else None)
            elif isinstance(x, Tensor) and x.dim() >= 2 and self._reaches_scores(x):
                event = Event(module=self._module(), kind="softmax", unseen=True)
        if event is None:
            return func(*args, **kwargs)
        out = self._around(event, func, args, kwargs)
        if func in LOG_SOFTMAX and isinstance(out, Tensor) and taint is not None:
            with torch._C.DisableTorchFunction():  # exp of it completes the softmax (the call comes then)
                self._set(out, dataclasses.replace(taint, ops=taint.ops + (_name(func),), logprobs=event))
        return out

    def _reaches_scores(self, x: Tensor) -> bool:
        """Whether ``x``'s autograd graph reaches a tainted tensor within a few nodes."""
        if x.grad_fn is None or not self._graph or self._taint(x) is not None:
            return False
        frontier, seen = [x.grad_fn], set()
        for _ in range(GRAPH_DEPTH):
            nxt = []
            for node in frontier:
                if node in self._graph:
                    return True
                if type(node).__name__ in GRAPH_CUTS:
                    continue
                for parent, _ in getattr(node, "next_functions", ()):
                    if parent is not None and parent not in seen:
                        seen.add(parent)
                        nxt.append(parent)
            if not nxt:
                return False
            frontier = nxt
        return False

    def _follow(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        inputs = list(tensors_in(args)) + list(tensors_in(kwargs))
        outs = list(tensors_in(out))
        if inputs and all(self._is_const(t) for t in inputs):
            for t in outs:
                self._mark_const(t)
            return
        if not inputs and outs:  # a factory (arange, ones, full): a constant
            for t in outs:
                self._mark_const(t)
            return
        name = _name(func)
        if func in PRODUCTS:
            pair = operands(func, args, kwargs)
            if pair is not None and not any(self._is_const(t) for t in pair):
                for t in pair:  # sigmoid(scores) @ v: sigmoid attention (named, not measured)
                    weights = getattr(self._taint(t), "weights", None)
                    if weights is not None and weights not in self.events:
                        self.events.append(weights)
                kind, scores = _weighted(func, args, pair, self._taint)
                if kind is not None:  # retention ((q·kᵀ ⊙ D / norm) @ v), or exp(scores - max) @ v
                    self.events.append(dataclasses.replace(self._event(scores), kind=kind))
                shapes = " × ".join(str(tuple(t.shape)) for t in pair)
                series = any(self._taint(t) is not None for t in pair)
                self._products += 1
                for t in outs:
                    self._set(t, Taint(ops=(name,), shapes=shapes, origin=self._products, series=series))
                return
            if pair is not None and learned_queries(func, args, pair, self._is_const):
                shapes = " × ".join(str(tuple(t.shape)) for t in pair)
                for t in outs:  # learned queries over the tokens (a weight-made q): scores too
                    self._set(t, Taint(ops=(name,), shapes=shapes, learned=True))
                return
            if pair is not None and not keeps_scores(func, args, pair, self._taint):
                return  # scores @ W: a contraction of the key dim, not scores any more
        # ops whose data is their first argument (``p.type_as(scores)``: ESM-2, torchscale) take its taint only
        first = args[0] if args and isinstance(args[0], Tensor) and kind_of(func) in FIRST else None
        taint = next((tt for tt in map(self._taint, [first] if first is not None else inputs) if tt is not None), None)
        if taint is None:
            return
        if func in CUTS and (taint.axis is None or taint.axis == -1):
            return  # a linear layer over the keys: an output layer; over the heads (axis moved) a mix
        taint = step(func, args, kwargs, taint, outs, self._taint)
        if (func in SIGMOID or func in KERNEL) and inputs[0].dim() >= 3 and \
                not any(op in _NOT_SCORES for op in taint.ops[1:]):
            # weights of sigmoid or kernel attention once they multiply v (scores from one product, no norm since)
            kind = "sigmoid" if func in SIGMOID else "kernel"
            taint = dataclasses.replace(taint, weights=dataclasses.replace(self._event(taint), kind=kind))
        elif taint.weights is not None and func not in _KEEP_WEIGHTS:
            taint = dataclasses.replace(taint, weights=None)  # not the weights any more (a conv, a sum...)
        targets = outs
        if out is None or name.endswith("_") or name == "__setitem__":
            first = args[0] if args else None
            targets = outs + ([first] if isinstance(first, Tensor) else [])
        for t in targets:
            self._set(t, taint)
