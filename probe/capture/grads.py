"""Backward capture: tensor hooks on an attention call's output and on its q, k, v.

On a sampled step, for every captured call that takes part in autograd, :class:`BackwardHooks`
registers (during the forward):

* a hook on the attention output: it receives ``∂L/∂out``; when an eager record carries the
  softmax output (``call.probs``), the hook sits there instead and receives ``dP = ∂L/∂P``
  directly (dropout after the softmax included). The gradient goes to ``on_logits`` with a slim,
  detached copy of the record (the recorder turns it into ``grad_logits`` at every scale);
* a hook on each of q, k, v that requires grad: its gradient goes to ``on_input``.

Each hook only reads its gradient and returns ``None``, so gradients are unchanged. Every
backward pass through a hooked call contributes, to every gradient metric alike (gradient
accumulation over micro-batches, several ``backward(retain_graph=True)`` calls, a second-order
pass through ``create_graph=True``). What is computed from the gradients is the
recorder's business (:mod:`probe.session.recorder`): this module computes no statistic.

Ownership: :class:`BackwardHooks` keeps every handle and removes them in
:meth:`BackwardHooks.remove` (the profiler calls it when the next step's forward begins and on
``close``); removing twice is harmless, and a probe removes only its own hooks. A logits hook
keeps the call's q, k, v until it first runs (before the attention's own backward, while the
graph holds them anyway) and only weakly after (:class:`_Record`): they are not kept alive
through the rest of the backward and the optimizer step. Masks, bias and the record's other
fields stay until the hooks are removed.

Reentrant activation checkpointing runs the forward under ``no_grad`` and again inside backward:
:class:`probe.session.recompute.Recompute` watches the issuing modules and hooks the recomputed calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Hashable, List, Optional

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.hooks import RemovableHandle

from probe.call import AttentionCall

__all__ = ["BackwardHooks", "OnInput", "OnLogits"]

#: ``on_logits(record, key, step, payload, grad, from_probs)``: ``grad`` is ``dP`` when
#: ``from_probs``, else ``∂L/∂out``; ``payload`` is what :meth:`BackwardHooks.register` got.
OnLogits = Callable[[AttentionCall, Hashable, int, Any, Tensor, bool], None]
#: ``on_input(name, key, step, grad)``: the gradient of q, k or v (``name``).
OnInput = Callable[[str, Hashable, int, Tensor], None]


def _detached(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach()


def _retains_graph() -> bool:
    """Whether the backward pass running now keeps its graph (``retain_graph=True``,
    ``create_graph=True``): another pass through it may come."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    try:
        return bool(keep_graph()) if keep_graph is not None else False
    except RuntimeError:  # not inside a backward pass
        return False


class _Held:
    """A tensor held weakly: its storage by a weak reference and its view by shape, strides,
    offset and dtype. :meth:`get` rebuilds the same view while anything else (the autograd
    graph, the caller) keeps the storage; ``None`` once it is freed."""

    __slots__ = ("ref", "meta")

    def __init__(self, t: Tensor) -> None:
        self.ref = StorageWeakRef(t.untyped_storage())
        self.meta = (t.dtype, t.device, t.shape, t.stride(), t.storage_offset())

    def get(self) -> Optional[Tensor]:
        storage = torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata)  # None once freed
        if storage is None:
            return None
        dtype, device, shape, stride, offset = self.meta
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)


class _Record:
    """The record a logits hook computes from: held strongly until the hook runs in a pass that
    frees its graph, which is before the attention's own backward (the graph holds q, k, v then
    anyway), and weakly after, so that q, k, v are not kept alive past that backward (a model
    whose q, k, v are views of projection outputs frees them there: 96 MiB at (1, 8, 16384, 64)).
    A pass with ``retain_graph=True`` keeps it strong: the next pass needs q, k, v, which the
    graph may not hold (eager ``q @ kᵀ`` on transposed views saves reshaped copies); the hooks'
    removal at the next step or ``close`` frees it."""

    __slots__ = ("strong", "weak", "rest")

    def __init__(self, record: AttentionCall) -> None:
        self.strong: Optional[AttentionCall] = record
        self.weak: Optional[tuple] = None
        self.rest: Optional[AttentionCall] = None

    def get(self) -> Optional[AttentionCall]:
        if self.strong is not None:
            return self.strong
        held = [None if h is None else h.get() for h in self.weak]  # type: ignore[union-attr]
        if any(h is not None and t is None for h, t in zip(self.weak, held)):  # type: ignore[arg-type]
            return None  # freed: no graph holds them any more
        q, k, v = held
        return dataclasses.replace(self.rest, q=q, k=k, v=v)  # type: ignore[arg-type]

    def weaken(self) -> None:
        record = self.strong
        if record is None:
            return
        try:
            weak = tuple(None if t is None else _Held(t) for t in (record.q, record.k, record.v))
        except Exception:  # noqa: BLE001 - a tensor without a plain storage (a DTensor, a
            return  # subclass): keep holding it strongly, as before this class
        self.weak = weak
        # the rest (scale, masks, bias, logits) stays; empty tensors (no view of q, k, v: a view
        # would keep their storage) stand in for q, k, v until get() puts them back
        self.rest = dataclasses.replace(record, q=record.q.new_empty(0), k=record.k.new_empty(0),
                                        v=None if record.v is None else record.v.new_empty(0))
        self.strong = None


def _made_from(other: Tensor, t: Tensor, depth: int = 6) -> bool:
    """Whether ``other`` is computed from ``t`` within ``depth`` autograd steps (``other =
    t.transpose(-1, -2)``): then ``t``'s gradient holds ``other``'s. Outputs of one node (q, k, v
    of ``qkv.unbind()``) are told apart by their output number: siblings are not made from each other."""
    target, nr = t.grad_fn, t.output_nr
    frontier, seen = list(getattr(other.grad_fn, "next_functions", ())), set()
    for _ in range(depth):
        nxt = []
        for node, index in frontier:
            if node is None:
                continue
            if (node is target and index == nr) or (target is None and getattr(node, "variable", None) is t):
                return True  # (AccumulateGrad: t a leaf)
            if node not in seen:
                seen.add(node)
                nxt.extend(node.next_functions)
        frontier = nxt
    return False


class BackwardHooks:
    """Registers and owns the backward hooks of one probe.

    Args:
        on_logits: receives the gradient at the attention output (or softmax output).
        on_input: receives the gradients of q, k, v.
        warn: receives a message when a callback fails (training is never broken by a
            diagnostic).
    """

    def __init__(self, on_logits: OnLogits, on_input: OnInput, warn: Callable[[str], None]) -> None:
        self._on_logits = on_logits
        self._on_input = on_input
        self._warn = warn
        self._handles: List[RemovableHandle] = []
        self.step: Optional[int] = None
        #: the last :meth:`register`'s plan: "logits", "q", "k", "v" → None (hooked) or why not
        self.last_plan: Dict[str, Optional[str]] = {}

    def __len__(self) -> int:
        return len(self._handles)

    def register(self, call: AttentionCall, key: Hashable, step: int, payload: Any = None) -> int:
        """Hook ``call``'s output (an eager call's softmax output) and q, k, v; returns how many
        hooks were registered. ``payload`` is handed back to ``on_logits``.

        Nothing is registered when grad mode is off or no tensor requires grad (inference), so
        grad metrics are then absent, not zero. Tensors passed as more than one of q, k, v (the
        same object, or one a view of the other: ``k = x.transpose(-1, -2)``, ``v = x``) are
        skipped for grad_q/k/v: autograd gives only their summed gradient. A call whose scale is
        unknown and that carries no logits gets no output hook (its logits cannot be rebuilt).
        """
        self.last_plan = {}
        if not torch.is_grad_enabled():
            return 0
        before = len(self._handles)
        self.step = step
        out, probs = call.output, call.probs
        source, source_fn = None, None
        own_out, out_fn = (call.grad_of or {}).get("output", (out, None))
        probs, probs_fn = (call.grad_of or {}).get("probs", (probs, None))
        if isinstance(probs, Tensor) and probs.requires_grad:
            source, source_fn = probs, probs_fn  # an eager softmax output: its gradient is dP itself, dropout included
        elif isinstance(own_out, Tensor) and own_out.requires_grad and call.v is not None:
            source, source_fn = own_out, out_fn  # its gradient ∂L/∂out gives dP = ∂L/∂out · vᵀ
        plan = self.last_plan  # why a gradient metric will not come (None: hooked)
        if source is None:
            plan["logits"] = ("its output does not require grad (no parameter or input that requires grad "
                              "reaches it)") if call.v is not None or probs is not None else (
                              "no P·v was seen after its softmax (no output to hook)")
        elif call.scale is None and call.logits is None:
            plan["logits"] = "its logits cannot be rebuilt (scale unknown)"
        if source is not None and (call.scale is not None or call.logits is not None):
            plan["logits"] = None
            # A slim copy of the record: detached tensors, no reference to the hooked tensor
            # itself (it holds the hook; a reference back would make a cycle only GC can free).
            record = AttentionCall(
                q=call.q.detach(), k=call.k.detach(), v=_detached(call.v), scale=call.scale,
                bias=_detached(call.bias), mask=_detached(call.mask), causal=call.causal,
                softcap=call.softcap, site=call.site, kind=call.kind, logits=_detached(call.logits),
            )
            hook = self._dp_hook(record, key, step, payload, from_probs=source is probs, fn=source_fn)
            self._handles.append(source.register_hook(hook))
        # the model's own tensors (call.grad_of: a record made from them, and how their gradient
        # becomes the record's)
        sources = call.grad_of or {}
        targets = {name: sources.get(name, (t, None)) for name, t in (("q", call.q), ("k", call.k), ("v", call.v))}
        for name, (t, fn) in targets.items():
            if not isinstance(t, Tensor):
                plan[name] = fn if isinstance(fn, str) else (  # (None, why): the front end said why not
                    f"its {name} was not recorded (probabilities that met no P·v probe follows, or an eager call "
                    "recorded at its softmax because its scale is unknown)")
                continue
            if not t.requires_grad:
                plan[name] = ("the tensor does not require grad there (computed from frozen weights and inputs: e.g. "
                              "a base model frozen under a LoRA adapter, or the first layer's projection of a "
                              "frozen embedding)")
                continue
            shared = [other_name for other_name, (other, _) in targets.items() if other_name != name and other is t]
            if shared:
                plan[name] = (f"{name} is the same tensor as {' and '.join(shared)}: autograd gives only their "
                              "summed gradient")
                continue
            within = [other_name for other_name, (other, _) in targets.items()
                      if other_name != name and isinstance(other, Tensor) and _made_from(other, t)]
            if within:  # k = x.transpose(-1, -2), v = x (vit-pytorch's PatchMerger): x's gradient holds k's too
                plan[name] = (f"{' and '.join(within)} is computed from the tensor passed as {name} (a view of it): "
                              f"autograd gives {name} only their summed gradient")
                continue
            plan[name] = None
            self._handles.append(t.register_hook(self._input_hook(name, key, step, fn)))
        return len(self._handles) - before

    def _dp_hook(self, record: AttentionCall, key: Hashable, step: int, payload: Any,
                 from_probs: bool, fn: Optional[Callable[[Tensor], Tensor]] = None) -> Callable[[Tensor], None]:
        held = _Record(record)
        site = record.site
        del record  # only `held` keeps it (weakly after the first pass)

        def hook(grad: Tensor) -> None:
            try:
                current = held.get()
                if current is None:  # a later pass whose graph no longer holds q, k, v
                    self._warn(f"probe: grad_logits skipped at {site!r}: its q, k, v were freed before "
                               "this backward pass reached it")
                    return
                with torch.no_grad():
                    self._on_logits(current, key, step, payload, grad if fn is None else fn(grad), from_probs)
            except Exception as err:  # noqa: BLE001 - a diagnostic never breaks training
                self._warn(f"probe: grad_logits failed at {site!r}: {type(err).__name__}: {err}")
            finally:
                if not _retains_graph():  # another pass may come: keep q, k, v for it (eager
                    held.weaken()         # matmul keeps reshaped copies, not these tensors)

        return hook

    def _input_hook(self, name: str, key: Hashable, step: int,
                    fn: Optional[Callable[[Tensor], Tensor]] = None) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            try:
                with torch.no_grad():
                    self._on_input(name, key, step, grad if fn is None else fn(grad))
            except Exception as err:  # noqa: BLE001
                self._warn(f"probe: grad_{name} failed at {key!r}: {type(err).__name__}: {err}")

        return hook

    def remove(self) -> None:
        """Remove every hook this object registered (harmless twice, and for freed tensors)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self.step = None
