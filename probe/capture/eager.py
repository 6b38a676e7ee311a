"""Front end for eager attention: ``softmax(q @ k.T * s + bias)`` written out op by op.

While the capture mode is active (sampled forwards only), the tracer keeps a *record* of where
each followed tensor came from (:mod:`probe.capture.records`), in a table keyed by ``id(tensor)``
with a weak reference (an entry dies with its tensor; the table is cleared when the mode exits).
Each intercepted op has a kind (:mod:`probe.capture.ops`, the vocabulary the audit shares); one
rule per (op kind, record kind) (:mod:`probe.capture.rules` and the ``rules_*`` files) sets the
records of its outputs:

* a product of two batched activations (``matmul``, ``@``, ``bmm``, ``baddbmm``, a two-operand
  ``einsum``) starts *scores* (``q = a``, ``k = b.transpose(-1, -2)``) with the factors that the
  operands' records carry (``q * s``, ``k / c``, ``q.mul_(s)``, through views, rotary
  embeddings and casts);
* factors, biases, masks, a soft cap, floors, views, casts and in-place writes fold into the
  scores' record; a softmax over their last dim (``softmax``, ``exp(x - logsumexp(x))``,
  ``e / e.sum(-1, keepdim=True)``, ``log_softmax(x).exp()``) makes an
  :class:`~probe.call.AttentionCall` (kind ``"eager"``), emitted when its probabilities meet
  ``P @ v`` (which gives ``v`` and ``output``), else at the next softmax or when the forward ends.

An op no rule describes makes its record unknown, never stale: scores become scores of unknown
scale (reported at ``actual`` only, from the softmax input), a q or k after its factor becomes
*opaque* (a product with it is reported at ``actual`` only, :attr:`AttentionCall.scale_unknown`).
While any record is live, the capture mode routes every op to this front end (ops outside the
vocabulary meet the default rule); an op whose inputs carry no record and whose kind cannot start
one is rejected before any work (:meth:`EagerFrontEnd.passes`), so a model that only calls SDPA
pays one dict lookup per op.

Pitfalls: every op runs exactly as the model called it and its own result is returned, so outputs
are bitwise unchanged; reading a tensor factor never syncs (it stays a tensor).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from probe.capture import ops as K
from probe.capture import rules_operand, rules_products, rules_scores, rules_softmax  # noqa: F401 - registration
from probe.capture.eager_scores import number
from probe.capture.frontend import Emit, FrontEnd
from probe.capture.mode import running_modules, running_site
from probe.capture.ops import ATTENTION, DIV, FIRST, MUL, OPS, OTHER, PERMUTE, SOFTMAX, STARTS, TRANSPOSE, VIEW
from probe.capture.records import PRIORITY, Derived, Operand, Probs, Scores, hide, learned
from probe.capture.rules import BEFORE, Op, find, unknown
from probe.capture.rules_softmax import rewrite
from probe.experiment import overrides
from probe.once import WarnOnce

__all__ = ["EagerFrontEnd", "HEAD_ATTRS"]

#: attributes through which attention modules declare their head count (torch, timm, Hugging Face,
#: x-transformers, nanoGPT, vit-pytorch, fairseq, ...)
HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "heads", "nhead", "num_head",
              "attention_heads", "n_heads_q", "head_count")


#: the op kinds between learned-query scores and their softmax (factors, biases, masks, a soft cap,
#: floors, casts, views, the softmax in any spelling); any other op forgets them (_forget_learned)
_TO_SOFTMAX = frozenset({K.MUL, K.DIV, K.ADD, K.SUB, K.MASKED_FILL, K.WHERE, K.TANH, K.FLOOR, K.MAX, K.CAST,
                         K.DETACH, K.VIEW, K.SOFTMAX, K.LOG_SOFTMAX, K.EXP, K.LSE, K.SUM})


def _version(t: Tensor) -> int:
    """Bumped by every in-place op on ``t`` or a view of it; -1 for inference tensors."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _splits_features(x: Tensor, args: Tuple[Any, ...]) -> bool:
    """A view of ``(T, B, E)`` as ``(T, B·H, d)``, from the target shape alone."""
    shape = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple, torch.Size)) else args[1:]
    return (len(shape) == 3 and isinstance(shape[-1], int) and 0 < shape[-1] < x.shape[-1]
            and x.shape[-1] % shape[-1] == 0)


def _scalar(a: Any) -> bool:
    return number(a) or (isinstance(a, Tensor) and a.numel() == 1)


def _keeps_dim0(kind: str, args: Tuple[Any, ...]) -> bool:
    """A transpose or permutation that leaves dim 0 where it is (the common ``transpose(1, 2)``)."""
    x = args[0] if args else None
    if not isinstance(x, Tensor) or len(args) < 2:
        return True  # ``t.mT``, ``t.t()`` without dims: the last two
    n = x.dim()
    if kind == TRANSPOSE:
        return all(not isinstance(d, int) or d % max(n, 1) != 0 for d in args[1:3])
    first = args[1][0] if isinstance(args[1], (list, tuple)) and args[1] else args[1]
    return isinstance(first, int) and first % max(n, 1) == 0


class EagerFrontEnd(FrontEnd):
    """Recovers q, k, scale, bias, mask and softcap from the ops leading into a softmax."""

    funcs: Tuple[Callable[..., Any], ...] = tuple(f for f, kind in OPS.items() if kind != ATTENTION)
    applies_overrides = True  # probe.scaling: the softmax runs at the overridden scale (rules_softmax.rewrite)
    catch_all = True  # while records are live, ops outside the vocabulary come here too (the default rule)

    def __init__(self) -> None:
        self._table: Dict[int, Tuple[weakref.ref, Any, int]] = {}
        self._pending: List[Probs] = []
        self._warn_once = WarnOnce(RuntimeWarning)
        self.saved: Any = None  # what a ``before`` rule keeps for its rule after the call
        self._folds: Dict[Tuple[Any, int], Tuple[Any, ...]] = {}  # (module, B·H rows) -> merged (fold_seen)

    # -- protocol --------------------------------------------------------------------------------
    def overrides_active(self) -> bool:
        return overrides.rules_active()  # variants do not reach eager attention

    def passes(self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        """Whether the mode may run ``func`` untouched: its kind cannot start a record (a
        transpose or permutation that keeps dim 0 in place cannot) and none of its inputs carries
        one (one dict lookup when no record is live)."""
        if self._table and self._carries(args, kwargs):
            return False
        kind = OPS.get(func, OTHER)
        if kind in (TRANSPOSE, PERMUTE):
            return _keeps_dim0(kind, args)
        if kind == VIEW:  # only a fold of heads into the batch or a repeat_kv starts a record: from >= 4-D,
            x = args[0] if args else None  # or (T, B, H·d) viewed (T, B·H, d) (fairseq)
            return not (isinstance(x, Tensor) and (x.dim() >= 4 or (x.dim() == 3 and _splits_features(x, args))))
        if kind in (MUL, DIV):  # only a scalar factor starts one (a product of two plain tensors does not)
            return not any(_scalar(a) for a in args[:2])
        return kind not in STARTS

    def watching(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], func: Any = None) -> bool:
        """Whether an op outside the vocabulary must meet the default rule (an input carries a
        record). Attribute reads (``t._base``, ``t.grad``, ``t.shape``: a property's getter) are
        not data flow: never."""
        return bool(self._table) and getattr(func, "__name__", None) != "__get__" and self._carries(args, kwargs)

    def _carries(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        table = self._table
        for a in (*args, *kwargs.values()):
            if isinstance(a, Tensor):
                if id(a) in table:
                    return True
            elif isinstance(a, (list, tuple)):
                if any(isinstance(t, Tensor) and id(t) in table for t in a):
                    return True
        return False

    def handle(
        self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
        emit: Optional[Emit],
    ) -> Any:
        if emit is None and not overrides.rules_active():
            return func(*args, **kwargs)  # only applying overrides, and none reaches eager attention
        kind = OPS.get(func, OTHER)
        seen = self._inputs(args, kwargs)
        follow = [r for _, _, r in seen if learned(r)]
        if follow and (kind not in _TO_SOFTMAX or len(follow) < len(seen)):
            return self._forget_learned(func, args, kwargs, emit, seen)
        if not seen and kind not in STARTS:
            return func(*args, **kwargs)
        records = {id(t): r for t, _, r in seen}
        subject, subject_t = None, None
        if kind in FIRST:  # t.type_as(other), F.linear(t, w): decided by t's record
            first = args[0] if args else kwargs.get("input")
            if isinstance(first, Tensor) and id(first) in records:
                subject_t, subject = first, records[id(first)]
            elif kind not in STARTS:
                return func(*args, **kwargs)  # the record is on another argument: nothing follows
        else:
            for cls in PRIORITY:
                found = next(((t, r) for t, _, r in seen if type(r) is cls), None)
                if found is not None:
                    subject_t, subject = found
                    break
        op = Op(func, kind, args, kwargs, records, subject, subject_t)
        op.emit = emit
        if kind == SOFTMAX and isinstance(subject, Scores):
            done = rewrite(self, op)  # probe.scaling consulted: runs flagged (never applied twice)
            if done is not None:
                return done
        pre = BEFORE.get((kind, type(subject)))
        if pre is not None:
            self._run(pre, op)
        out = func(*args, **kwargs)
        op.out = out
        changed = [(t, self._table.get(id(t))) for t, v, r in seen if _version(t) != v]  # in place: the rule judges it
        self._run(find(kind, subject), op)
        if follow:  # learned queries: only scores (or a softmax of them) come out, else nothing
            for t in op.outs:
                if not (learned(self.get(t)) or isinstance(self.get(t), Probs)):
                    self.set(t, None)
        for t, entry in changed:  # a record no rule set again describes t before the change
            if entry is not None and self._table.get(id(t)) is entry:
                self.set(t, self._stale(entry[1], f"`{op.name}` in place"))
        return out

    def _forget_learned(self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
                        emit: Optional[Emit], seen: List[Tuple[Tensor, int, Any]]) -> Any:
        """An op off the way from learned-query scores to their softmax (a product, a permutation,
        a mix with other records: a channels-first projection ``W @ x`` that is no attention): it
        runs as if they carried no record, as before probe followed them; changed in place, they
        carry none."""
        hidden = [(t, self._table.pop(id(t))) for t in {id(t): t for t, _, r in seen if learned(r)}.values()]
        try:
            out = self.handle(func, args, kwargs, emit)
        finally:
            for t, entry in hidden:
                if _version(t) == entry[2] and id(t) not in self._table:
                    self._table[id(t)] = entry
        return out

    def _run(self, fn: Callable[..., None], op: Op) -> None:
        try:
            fn(self, op)
        except Exception as err:  # noqa: BLE001 - bookkeeping must never break the model
            site = running_site()
            self._warn_once(f"op:{site}", f"probe: eager attention capture skipped `{op.name}` at site {site!r} "
                            f"({type(err).__name__}: {err}): an attention there may not be measured; please report "
                            "the model", stacklevel=4)

    def warn(self, key: str, message: str) -> None:
        self._warn_once(key, message, stacklevel=4)

    def reset(self) -> None:
        """Emit what still waits for its ``P @ v``, forget every record (the capture mode exits)."""
        try:
            self.fire_pending()
        except Exception as err:  # noqa: BLE001 - runs from the root's forward hook
            self._warn_once("op", f"probe: eager attention capture skipped an op ({type(err).__name__}: {err})")
        finally:
            self._table.clear()
            self._pending = []
            self.saved = None
            self._folds = {}

    def fire_pending(self) -> None:
        """Emit every softmax still waiting for its product with v (without v)."""
        pending, self._pending = self._pending, []
        for p in pending:
            if not p.done and isinstance(p.key, tuple) and p.key:
                self._warn_once(f"no v:{p.key[0]}", f"probe: the attention probabilities at site {p.key[0]!r} never "
                                "met their product with v (an op probe does not follow changed them after the "
                                "softmax): grad_v is not measured there", stacklevel=2)
            p.fire()

    def wait_for_v(self, probs: Probs) -> None:
        self._pending.append(probs)

    # -- the provenance table --------------------------------------------------------------------
    def get(self, t: Any) -> Any:
        """The current record of ``t`` (``None``: no record, or a tensor the tracer does not follow)."""
        if not isinstance(t, Tensor):
            return None
        entry = self._table.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        if entry[2] != _version(t):  # changed in place by an op no rule saw (an op on a view of it)
            return self._stale(entry[1], "changed in place through a view")
        return entry[1]

    def set(self, t: Any, value: Any) -> None:
        """Make ``value`` the record of ``t`` (``None``: forget it)."""
        if not isinstance(t, Tensor):
            return
        key, table = id(t), self._table
        if value is None:
            table.pop(key, None)
            return

        def drop(ref: weakref.ref, key: int = key, table: Dict[int, Any] = table) -> None:
            entry = table.get(key)
            if entry is not None and entry[0] is ref:
                del table[key]

        table[key] = (weakref.ref(t, drop), value, _version(t))

    def _inputs(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Tuple[Tensor, int, Any]]:
        """``(tensor, version, record)`` of the inputs whose records are current."""
        if not self._table:
            return []
        found = []
        for a in (*args, *kwargs.values()):
            items = a if isinstance(a, (list, tuple)) else (a,)
            for t in items:
                if isinstance(t, Tensor) and id(t) in self._table:
                    r = self.get(t)
                    if r is not None:
                        found.append((t, _version(t), r))
        return found

    @staticmethod
    def _stale(record: Any, why: str) -> Any:
        if isinstance(record, Scores):
            return unknown(record, f"the scores {why}")
        if isinstance(record, Operand) and record.scaled:
            return hide(record, f"q or k {why} after its factor")
        if isinstance(record, Derived):
            return record
        return None

    def fold_seen(self, merged: Tuple[Any, ...], rows: int) -> None:
        """A fold of heads into ``rows = B·H`` batch rows seen in the running module (``merged``):
        a later product over ``rows`` rows in the same module whose own records lost it (ops that
        keep no layout fact: a rotary embedding written out) reads its heads from here."""
        modules = running_modules()
        key = (id(modules[0]) if modules else None, rows)
        seen = self._folds.get(key)
        self._folds[key] = merged if seen is None or seen == merged else ()  # () : two different folds

    def fold_of(self, rows: int) -> Optional[Tuple[Any, ...]]:
        modules = running_modules()
        return self._folds.get((id(modules[0]) if modules else None, rows)) or None

    def declared_heads(self) -> Optional[Tuple[int, str]]:
        """``(H, attribute)`` of the innermost running module that declares its head count (an int
        attribute named as :data:`HEAD_ATTRS` lists, above 1): the heads of a product over
        ``(B·H, n, d)`` rows whose fold probe did not see."""
        for module in running_modules():
            for attr in HEAD_ATTRS:
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                    return value, attr
        return None

    # -- for other front ends and readers ----------------------------------------------------------
    def operand(self, t: Any) -> Optional[Operand]:
        """What the tracer knows about ``t`` as a q or k (:class:`~probe.capture.records.Operand`),
        while a sampled forward runs; ``None`` when nothing was applied to it since its origin."""
        record = self.get(t)
        return record if isinstance(record, Operand) else None

    def prescaled(self, t: Any) -> Optional[Tuple[Optional[Tensor], float, Optional[Tensor], str]]:
        """``(base, factor, tensor factor, how)`` when ``t`` is ``base`` times a scalar (for SDPA);
        ``(None, 1.0, None, why)`` when ``t`` is opaque (its scale cannot be attributed)."""
        record = self.operand(t)
        if record is not None and record.opaque:
            return None, 1.0, None, record.opaque
        if record is not None and record.base is not None:
            return record.base, record.factor, record.factor_t, record.how
        return None


if __name__ == "__main__":  # python -m probe.capture.eager: the rule table (docs/architecture.md)
    from probe.capture.rules import rule_table

    print(rule_table())
