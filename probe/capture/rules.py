"""The rule table of the eager tracer: one rule per (op kind, record kind), and a default per record kind.

An op the capture mode routes to the eager tracer has a kind (:mod:`probe.capture.ops`) and
inputs that may carry records (:mod:`probe.capture.records`). Its *subject* is the input record
that comes first in :data:`~probe.capture.records.PRIORITY` (scores before probabilities before
operands); the rule ``RULES[(kind, type(subject))]`` (``type(None)`` when no input carries a
record: the rules that *start* records) sets the records of the op's outputs. No rule: the
default of the subject's kind (:func:`default`), which never lets a record describe a tensor it
no longer describes:

* scores: the output is scores of an unknown scale (reported at ``actual`` only, from the softmax
  input) when it has their shape, else :class:`~probe.capture.records.Derived` (never a fixed bias);
* an operand after its factor: ``opaque`` (a product with it has an unknown scale);
* a part, a permutation or a step of a softmax spelled out, and anything derived: ``Derived``;
* probabilities and anything else: no record.

Both the defaults (:data:`DEFAULTS`) and whether a record carries a factor of the model's scale
(:func:`carries_scale`) are tables keyed by the record kind, like the rules.

Rules live in ``rules_*.py`` by the record kind they are about; adding a spelling of a known
pattern is a line in :mod:`probe.capture.ops`, a new pattern one rule there and one test case.
A rule receives the tracer and an :class:`Op` and sets records with ``tracer.set(tensor, record)``;
it must never raise for a model's sake (the tracer warns once and moves on) nor change values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from torch import Tensor

from probe.capture.ops import name_of
from probe.capture.records import Derived, Exp, ExpSum, LogProbs, Moved, Operand, Scores, Shift, Slice, hide

__all__ = ["BEFORE", "DEFAULTS", "Op", "RULES", "before", "carries_scale", "default", "find", "rule", "rule_table"]


@dataclasses.dataclass
class Op:
    """One intercepted call, as a rule sees it.

    Attributes:
        func, kind, args, kwargs: the call and its kind.
        out: its result (``None`` while a ``before`` rule runs).
        records: ``id(tensor) -> record`` of the inputs that carried one *before* the call.
        subject: the deciding input record (``None``: no input carried one), ``subject_t`` its tensor.
        emit: where a completed call goes (``None`` while only applying overrides).
    """

    func: Any
    kind: str
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    records: Dict[int, Any]
    subject: Any = None
    subject_t: Optional[Tensor] = None
    out: Any = None
    emit: Any = None  # the capture mode's emit (None: only applying overrides)

    def rec(self, x: Any) -> Any:
        """The record an input carried before the call (``None`` for anything else)."""
        return self.records.get(id(x)) if isinstance(x, Tensor) else None

    @property
    def name(self) -> str:
        return name_of(self.func)

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        """Positional argument ``i`` or keyword ``name``."""
        return self.args[i] if len(self.args) > i else self.kwargs.get(name, default)

    @property
    def outs(self) -> List[Tensor]:
        """The tensors the call returned (one, or each of a tuple / list)."""
        if isinstance(self.out, Tensor):
            return [self.out]
        if isinstance(self.out, (list, tuple)):
            return [o for o in self.out if isinstance(o, Tensor)]
        return []


Rule = Callable[[Any, Op], None]
RecordType = Union[type, None]
#: (op kind, record type or ``type(None)``) -> rule run after the call
RULES: Dict[Tuple[str, type], Rule] = {}
#: (op kind, record type) -> rule run before the call (it sees the inputs before an in-place change)
BEFORE: Dict[Tuple[str, type], Rule] = {}


def _types(records: Iterable[RecordType]) -> List[type]:
    return [type(None) if r is None else r for r in records]


def rule(kinds: Union[str, Tuple[str, ...]], *records: RecordType) -> Callable[[Rule], Rule]:
    """Register a rule for every (kind, record type) pair; ``None`` stands for "no record"."""
    kinds = (kinds,) if isinstance(kinds, str) else kinds

    def register(fn: Rule) -> Rule:
        for kind in kinds:
            for r in _types(records):
                if (kind, r) in RULES:
                    raise ValueError(f"two rules for ({kind}, {r.__name__})")
                RULES[(kind, r)] = fn
        return fn

    return register


def before(kinds: Union[str, Tuple[str, ...]], *records: RecordType) -> Callable[[Rule], Rule]:
    """Register a rule that runs before the call (for ops that change their input in place)."""
    kinds = (kinds,) if isinstance(kinds, str) else kinds

    def register(fn: Rule) -> Rule:
        for kind in kinds:
            for r in _types(records):
                BEFORE[(kind, r)] = fn
        return fn

    return register


def find(kind: str, subject: Any) -> Rule:
    """The rule of ``kind`` for ``subject``'s record kind, else the default of that kind."""
    found = RULES.get((kind, type(subject)))
    return found if found is not None else default


def unknown(node: Scores, why: str) -> Scores:
    """``node`` touched by an op it cannot describe (the first reason is kept)."""
    return node if node.unknown else dataclasses.replace(node, unknown=why)


#: record kind -> whether a tensor with such a record carries a factor of the model's scale
_CARRIES: Dict[type, Callable[[Any], bool]] = {
    Operand: lambda r: False,  # a tensor times a number added to the scores is a bias times that number
    Derived: lambda r: r.scaled,
    Scores: lambda r: r.scale != 1.0 or r.scale_t is not None or any(o is not None and o.scaled for o in r.operands),
    Moved: lambda r: carries_scale(r.of), Slice: lambda r: carries_scale(r.of), Shift: lambda r: carries_scale(r.of),
    LogProbs: lambda r: carries_scale(r.of), Exp: lambda r: carries_scale(r.of), ExpSum: lambda r: carries_scale(r.of),
}


def carries_scale(record: Any) -> bool:
    """Whether a tensor with this record carries a factor of the model's scale: made from scores
    with a scale, or from a product with a scaled operand."""
    found = _CARRIES.get(type(record))
    return found is not None and found(record)


def _default_scores(subject: Scores, x: Any, out: Tensor, why: str) -> Any:
    same = x is not None and out.shape == x.shape
    return unknown(subject, f"{why} on the scores") if same else Derived(carries_scale(subject), f"{why} on the scores")


def _default_operand(subject: Operand, x: Any, out: Tensor, why: str) -> Any:
    if not subject.scaled:
        return None
    return hide(subject, f"{why} on q or k after its factor ({subject.how or 'in place'})")


def _default_derived(subject: Any, x: Any, out: Tensor, why: str) -> Any:
    return Derived(carries_scale(subject), subject.why if isinstance(subject, Derived) else f"{why} on the scores")


#: the default rule of each record kind (Probs and anything else: no record; a softmax that never
#: meets v is warned when it is emitted)
DEFAULTS: Dict[type, Callable[[Any, Any, Tensor, str], Any]] = {
    Scores: _default_scores, Operand: _default_operand,
    **{kind: _default_derived for kind in (Moved, Shift, LogProbs, Exp, ExpSum, Slice, Derived)},
}


def default(tracer: Any, op: Op) -> None:
    """The rule of an op no rule describes for its subject (see the module docstring)."""
    make = DEFAULTS.get(type(op.subject))
    if make is None:
        return
    for out in op.outs:
        if out.is_floating_point() or out.is_complex():
            record = make(op.subject, op.subject_t, out, f"`{op.name}`")
            if record is not None:
                tracer.set(out, record)


def rule_table() -> str:
    """The rule table as markdown, one row per record kind: the op kinds with a rule of their own
    (and the rule's name); every other op kind meets :func:`default`. The rules register when
    :mod:`probe.capture.eager` is imported (docs/architecture.md shows this table;
    ``python -m probe.capture.eager`` prints it)."""
    from probe.capture.records import PRIORITY

    lines = ["| record kind | op kind → rule (any other op kind: `default`) |", "| --- | --- |"]
    for kind in (type(None), *reversed(PRIORITY)):
        found = sorted((op, fn.__name__) for (op, rec), fn in RULES.items() if rec is kind)
        name = "no record (rules that start one)" if kind is type(None) else f"`{kind.__name__}`"
        lines.append(f"| {name} | " + ", ".join(f"{op} → `{fn}`" for op, fn in found) + " |")
    return "\n".join(lines)
