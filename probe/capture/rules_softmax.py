"""Rules for the softmax in any spelling, and for the probabilities on their way to ``P @ v``.

A softmax over the last dim of scores makes the call: ``softmax`` (any spelling, with or without
``dtype=``), ``exp(x - logsumexp(x, -1, keepdim=True))``, ``log_softmax(x, -1).exp()``,
``e = exp(x)`` (or ``exp(x - x.amax(-1, keepdim=True))``) then ``e / e.sum(-1, keepdim=True)``.
The call waits (:class:`~probe.capture.records.Probs`) for its product with v, through casts,
dropout, views, a gated mix with other probabilities, a renormalisation, a mix over heads or a
norm over them between two permutations (ConViT, DeepViT). A softmax over anything else (an
output layer, a router) is not attention and records nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

from probe.capture import ops as K
from probe.capture.eager_scores import rescaled, to_call, unfold
from probe.capture.mode import reserve_site
from probe.capture.records import Exp, ExpSum, LogProbs, Moved, Probs, Scores, Shift
from probe.capture.rules import Op, default, rule
from probe.experiment import overrides

__all__ = ["centred", "fire", "rewrite"]


def _last_dim(op: Op, x: Any, default: Any = None) -> bool:
    dim = op.arg(1, "dim", default)
    return isinstance(x, Tensor) and isinstance(dim, int) and dim in (-1, x.dim() - 1)


def rewrite(tracer: Any, op: Op) -> Optional[Any]:
    """``probe.scaling`` on a softmax over recognised scores (:func:`probe.experiment.overrides.lookup`):
    ``None`` when not consulted; else runs the softmax (its input rewritten by
    :func:`~probe.capture.eager_scores.rescaled` when the scale changes) flagged as applied, records
    it and returns its output. A site the records cannot describe (soft cap, unknown op) is left
    unchanged."""
    x = op.arg(0, "input")
    node = op.subject
    if not _last_dim(op, x):
        return None
    describable = not (node.unknown or node.tanh or node.softcap is not None or node.unattributed)
    change = overrides.lookup(node.q.shape[1], node.head_dim or node.q.shape[-1], x, variants=False,
                              describable=describable)
    if change is None:
        return None
    args, kwargs, record = op.args, op.kwargs, None
    if change.scale is not None:
        z, record = rescaled(node, x, change.scale)
        args, kwargs = ((z, *op.args[1:]), op.kwargs) if op.args else (op.args, {**op.kwargs, "input": z})
    with overrides.applying():
        out = op.func(*args, **kwargs)
    try:  # left unchanged (not describable: a soft cap): recorded as it is
        fire(tracer, op, record if record is not None else node, x, out)
    except Exception as err:  # noqa: BLE001 - bookkeeping must never break the model
        tracer.warn("op", f"probe: eager attention capture skipped a softmax under probe.scaling "
                    f"({type(err).__name__}: {err})")
    return out


def fire(tracer: Any, op: Op, node: Scores, x: Tensor, out: Any) -> None:
    """A softmax over scores ``node`` (tensor ``x``) gave ``out``: emit or wait for ``P @ v``."""
    tracer.fire_pending()
    if op.emit is None:
        return  # applying overrides only: nothing is recorded
    call = to_call(node, x)
    key = reserve_site()  # named after the module running now, which ran the softmax, whenever P·v comes
    if node.heads_from and isinstance(key, tuple):
        tracer.warn(f"heads:{key[0]}", f"probe: the attention at site {key[0]!r}: {node.heads_from}; per-head "
                    "values may pool several heads")
    if call.scale is None or not isinstance(out, Tensor):
        if key is None:
            op.emit(call)
        else:
            op.emit(call, key)
        return
    call = dataclasses.replace(call, probs=out)  # its gradient is dP itself: exact under dropout too
    if node.merged is not None and len(node.merged) > 2 and out.dim() == (4 if node.merged[2] == "win" else 3):
        # head-major (H·B, L, S) rows, or (B·H, W, L, S) windows: the record reads them as (B', H, L, S),
        # its hook stays on the model's own P
        m = node.merged
        with torch.no_grad():
            view = unfold(out.detach(), m).contiguous()
        call = dataclasses.replace(call, probs=view, grad_of={**(call.grad_of or {}),
                                                               "probs": (out, lambda g, m=m: unfold(g, m))})
    probs = Probs(call, node.merged, op.emit, key)
    tracer.wait_for_v(probs)
    tracer.set(out, probs)


def _spelled(tracer: Any, op: Op, node: Scores, x: Tensor) -> None:
    """A softmax spelled out: ``probe.scaling`` cannot rewrite it (told, left unchanged)."""
    overrides.lookup(node.q.shape[1], node.head_dim or node.q.shape[-1], x, variants=False, describable=False)
    fire(tracer, op, node, x, op.out)


# -- softmax -------------------------------------------------------------------------------------------
@rule(K.SOFTMAX, Scores)
def softmax(tracer: Any, op: Op) -> None:
    x = op.arg(0, "input")
    if _last_dim(op, x):
        fire(tracer, op, op.subject, x, op.out)


@rule(K.SOFTMAX, Moved)
def softmax_moved(tracer: Any, op: Op) -> None:
    """A softmax over permuted scores whose batch and head dims stayed: the keys attend over the
    queries (``(σ·q·kᵀ + b)ᵀ = σ·k·qᵀ + bᵀ``, LookViT's reverse cross-attention reusing its
    lookup's scores): recorded with q and k swapped and every bias and mask transposed, at the
    scores' own scale. One probe cannot swap (grouped kv heads, heads mixed) is not recorded, and
    the audit names it. Over heads: not attention."""
    x, moved = op.arg(0, "input"), op.subject
    if isinstance(moved.of, Scores) and _last_dim(op, x) and len(moved.perm) >= 3 \
            and moved.perm[:-2] == tuple(range(len(moved.perm) - 2)):
        node = _transposed(moved.of)
        if node is not None:
            fire(tracer, op, node, x, op.out)


def _swap_last(t: Any) -> Any:
    """A bias, mask or fill applied to ``(..., L, S)`` scores, for the ``(..., S, L)`` transpose."""
    if not isinstance(t, Tensor) or t.dim() == 0:
        return t
    return (t.unsqueeze(0) if t.dim() == 1 else t).transpose(-1, -2)


def _transposed(node: Scores) -> Optional[Scores]:
    """The record of ``scoresᵀ`` (the last two dims swapped): k's rows are the queries."""
    if node.mix is not None or node.q.shape[1] != node.k.shape[1] or node.q.shape[0] != node.k.shape[0]:
        return None
    names = {"q": "k", "k": "q"}
    return dataclasses.replace(
        node, q=node.k, k=node.q, operands=node.operands[::-1],
        biases=tuple((_swap_last(t), c, layout) for t, c, layout in node.biases),
        masks=tuple((_swap_last(m), inv, layout, _swap_last(fill)) for m, inv, layout, fill in node.masks),
        grad_of=tuple((names.get(n, n), t, f) for n, t, f in node.grad_of))


@rule(K.LOG_SOFTMAX, Scores)
def log_softmax(tracer: Any, op: Op) -> None:
    x = op.arg(0, "input")
    if _last_dim(op, x) and isinstance(op.out, Tensor):
        tracer.set(op.out, LogProbs(op.subject, x))


@rule(K.LSE, Scores)
def logsumexp(tracer: Any, op: Op) -> None:
    x = op.arg(0, "input")
    dim = op.arg(1, "dim")
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    if isinstance(x, Tensor) and isinstance(dim, int) and dim in (-1, x.dim() - 1) and op.arg(2, "keepdim", False):
        tracer.set(op.out, Shift(op.subject, "lse"))


def centred(tracer: Any, op: Op, node: Scores, shift: Shift) -> None:
    """``scores - rowmax`` (for a stable ``exp``: a row constant, kept as an additive bias that the
    softmax does not see) or ``scores - logsumexp`` (log-probabilities)."""
    if shift.kind == "lse":
        tracer.set(op.out, LogProbs(node, op.args[0]))
    elif node.unknown or node.tanh:
        tracer.set(op.out, node)
    else:
        layout = tuple(op.out.shape) if node.ndim > 4 else node.ndim
        tracer.set(op.out, dataclasses.replace(node, biases=node.biases + ((op.args[1], -1.0, layout),)))


@rule(K.EXP, Scores, LogProbs)
def exp(tracer: Any, op: Op) -> None:
    x, record = op.arg(0, "input"), op.subject
    if not isinstance(op.out, Tensor) or op.out is x:
        return tracer.set(op.out, None)  # ``exp_`` in place: the scores are gone
    if isinstance(record, LogProbs):
        _spelled(tracer, op, record.of, record.logits)
    else:
        tracer.set(op.out, Exp(record, x))


@rule(K.SUM, Exp)
def row_sum(tracer: Any, op: Op) -> None:
    x = op.arg(0, "input")
    dim = op.arg(1, "dim")
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    if isinstance(x, Tensor) and isinstance(dim, int) and dim in (-1, x.dim() - 1) and op.arg(2, "keepdim", False):
        tracer.set(op.out, ExpSum(op.subject))


@rule(K.DIV, Exp)
def normalised(tracer: Any, op: Op) -> None:
    """``e / e.sum(-1, keepdim=True)``: the softmax of the scores ``e`` was taken of."""
    e = op.subject
    if len(op.args) == 2 and op.rec(op.args[0]) is e and isinstance(op.rec(op.args[1]), ExpSum) \
            and op.rec(op.args[1]).of is e and isinstance(op.out, Tensor) and op.out is not op.args[0]:
        _spelled(tracer, op, e.of, e.logits)


# -- the probabilities on their way to P @ v ------------------------------------------------------------
@rule((K.MUL, K.DIV, K.ADD, K.WHERE, K.MASKED_FILL, K.NAN_TO_NUM), Probs)
def probs_changed(tracer: Any, op: Op) -> None:
    """P changed after the softmax (a gated mix, a renormalisation, masked rows zeroed,
    ``where(isnan(P), 0, P)``: TransformerLens): still on its way to P·v."""
    if isinstance(op.out, Tensor) and op.out.dim() >= 3:
        tracer.set(op.out, op.subject)


@rule((K.CAST, K.DROPOUT), Probs)
def probs_kept(tracer: Any, op: Op) -> None:
    if isinstance(op.out, Tensor):
        tracer.set(op.out, op.subject)


@rule(K.VIEW, Probs)
def probs_viewed(tracer: Any, op: Op) -> None:
    x = op.args[0] if op.args else None
    if isinstance(op.out, Tensor) and isinstance(x, Tensor) and x.shape[-2:] == op.out.shape[-2:]:
        tracer.set(op.out, op.subject)


@rule(K.NORM, Probs, Moved)
def probs_normed(tracer: Any, op: Op) -> None:
    """A norm of the probabilities on their way to ``P @ v`` (DeepViT's re-attention norm over
    the heads) keeps them there: v, and so ``grad_v``, are still found."""
    x = op.arg(0, "input")
    record = op.subject
    if isinstance(record, Moved) and not isinstance(record.of, Probs):
        return default(tracer, op)
    if isinstance(op.out, Tensor) and isinstance(x, Tensor) and op.out.shape == x.shape:
        tracer.set(op.out, record)

