"""The record kinds of the eager tracer: what it knows about a tensor, and where it came from.

The tracer (:mod:`probe.capture.eager`) keeps one record per tensor it follows, keyed by the
tensor (weakly: a record dies with its tensor). Rules (:mod:`probe.capture.rules`) map an op and
the records of its inputs to the record of its output. The kinds, from the projections to the
product with v:

* :class:`Operand` - an activation on its way from its projection to a product (a q or a k):
  the scalar factors applied to it (in place or not), the layout facts the product needs (heads
  merged into the batch, a kv head repeated), and whether an op probe does not model touched it
  after a factor (``opaque``: its scale cannot be attributed). **Reading q / k provenance**
  (QK-Clip and friends): ``EagerFrontEnd.operand(t)`` gives the record of a tensor while a
  sampled forward runs, and every :class:`Scores` keeps the records of its two operands as they
  met in the product (``Scores.operands``). A tensor with no record came straight from an op that
  starts features (a projection, a norm, an input): factor 1.
* :class:`Scores` - ``scale · q·kᵀ + biases``, masks, soft cap: what a softmax over it records.
* :class:`Slice` - a part of the scores, maybe written back into them.
* :class:`Moved` - scores or probabilities with their dims permuted (heads last for a linear mix).
* :class:`Shift`, :class:`LogProbs`, :class:`Exp`, :class:`ExpSum` - the steps of a softmax
  written out (``exp(x - logsumexp(x))``, ``e = exp(x); e / e.sum(-1, keepdim=True)``).
* :class:`Probs` - a softmax output waiting for its product with v.
* :class:`Derived` - a function of the scores (or of a scaled operand) that is none of the above:
  never taken for a fixed bias.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

from torch import Tensor

from probe.call import AttentionCall

__all__ = ["Derived", "Exp", "ExpSum", "LogProbs", "Moved", "Operand", "PRIORITY", "Probs", "Scores", "Shift",
           "Slice", "hide", "learned"]

GradOf = Tuple[Tuple[str, Optional[Tensor], Any], ...]  # (name, tensor, fn), or (name, None, why not measured)


@dataclasses.dataclass(frozen=True)
class Operand:
    """What the tracer knows about an activation that may become q or k.

    The tensor ``t`` this record describes equals ``base * factor`` (times ``factor_t``) when
    ``base`` is set; ``ops`` names what was applied since the first factor, in order.

    Attributes:
        base: ``t`` without its factors (the model's own tensor, or ``t / c`` after an in-place
            ``t.mul_(c)``); ``None`` when ``t`` carries no factor.
        factor: the product of the scalar factors read as Python numbers.
        factor_t: the product of one-element tensor factors (kept on their device: no sync).
        how: the factors in words (``"multiplied by 0.125"``), for ``info["scale_from"]``.
        ops: the ops applied since the first factor (``("mul", "transpose", "mul_")``).
        merged: ``(B, H)`` when dim -3 of ``t`` is ``B·H`` rows (heads folded into the batch),
            ``(B, H, "hb")`` when those rows are head-major (row ``h·B + b``).
        kv: the ``(B, Hk, n, d)`` tensor that ``t`` repeats per query group (``repeat_kv``), in
            ``t``'s own layout of the last two dims.
        opaque: why the factor can no longer be read (an op probe does not model touched ``t``
            after it): a product with it has an unknown scale.
        batch_at: where the batch dim (dim 0 of the projection's output) is now, counted from the
            end, when a permutation moved it (``q.permute(2, 0, 1, 3)``: ``-3``); a reshape that
            folds heads into the batch tells head-major rows from batch-major ones by it.
        lead: ``(B, H)`` (as ``merged``) when dim 0 of ``t`` holds the ``B·H`` rows of a fold and
            views kept it there while the rest changed (windows: ``(B·H, W, n, d)``, local-attention).
        loose: the factor was taken on a 2-d tensor (learned queries ``(N, d)``, rows flattened to
            ``(B·T, D)``, but also position tables and weights): followed through views, factors
            and sums into a product, and forgotten, not made opaque, by any other op (:func:`hide`).
    """

    base: Optional[Tensor] = None
    factor: float = 1.0
    factor_t: Optional[Tensor] = None
    how: str = ""
    ops: Tuple[str, ...] = ()
    merged: Optional[Tuple[Any, ...]] = None
    kv: Optional[Tensor] = None
    opaque: Optional[str] = None
    batch_at: Optional[int] = None
    lead: Optional[Tuple[Any, ...]] = None
    loose: bool = False

    @property
    def scaled(self) -> bool:
        """Whether a factor was applied (so an op probe does not model hides it)."""
        return self.base is not None or self.opaque is not None


@dataclasses.dataclass(frozen=True)
class Scores:
    """Where a score tensor came from. Biases and masks keep the layout (3 or 4 dims) the
    scores had when they were applied; they are lifted to ``(B, H, L, S)`` at emit time."""

    q: Tensor  # (B, H, L, d)
    k: Tensor  # (B, Hk, S, d)
    ndim: int  # dims of the score tensor this record describes (3 or 4, more with extra leading dims)
    merged: Optional[Tuple[int, int]] = None  # (B, H) of a (B*H, L, S) layout, when known
    scale: float = 1.0
    scale_t: Optional[Tensor] = None  # tensor factor: 1 value or one per head
    biases: Tuple[Tuple[Tensor, float, Any], ...] = ()  # (tensor, coefficient, layout)
    masks: Tuple[Tuple[Tensor, bool, Any, Optional[Tensor]], ...] = ()  # (mask, invert, layout, fill)
    softcap: Optional[float] = None
    tanh: bool = False  # tanh applied, waiting for its ``* c``
    unknown: Optional[str] = None  # an op the record cannot describe touched the scores (why)
    unattributed: Optional[str] = None  # the logits are exact, the scale's provenance is not complete (why)
    grad_of: GradOf = ()  # see AttentionCall.grad_of
    scale_from: Optional[str] = None
    head_dim: Optional[int] = None  # d of the heads mixed into q, k (talking heads)
    mix: Optional[Tuple["Scores", Tensor, int]] = None  # (scores before the mix, M (H, G), biases it made)
    operands: Tuple[Optional[Operand], Optional[Operand]] = (None, None)  # q's and k's records at the product
    heads_from: Optional[str] = None  # how the heads of a (B·H, L, d) product were found, when not seen
    learned: bool = False  # q is a parameter (learned queries): followed only on the way to its softmax (learned())


@dataclasses.dataclass(frozen=True)
class Slice:
    """``scores[idx]``, viewed, cast and with tensors added: written back in place (``scores[idx]
    = slice + bias``, timm MViTv2's relative positions) it changes the scores ``of`` by a bias
    that does not scale with σ."""

    of: Scores


@dataclasses.dataclass(frozen=True)
class Moved:
    """Scores or probabilities with their dims permuted (``perm`` of the original layout): heads
    last for a linear mix over them (talking heads as ``nn.Linear``, DeepViT's norm over heads).
    Only a permutation back to the original layout makes them scores / probabilities again."""

    of: Any  # Scores or Probs
    perm: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Shift:
    """A row statistic of the scores ``of`` over the keys: ``amax`` / ``max`` (``kind="max"``)
    or ``logsumexp`` (``kind="lse"``), with ``keepdim=True``."""

    of: Scores
    kind: str


@dataclasses.dataclass(frozen=True)
class LogProbs:
    """``log_softmax(scores)`` or ``scores - logsumexp(scores)``: ``exp`` of it is the softmax
    over ``logits`` (the scores' tensor)."""

    of: Scores
    logits: Tensor


@dataclasses.dataclass(frozen=True)
class Exp:
    """``exp(scores)`` or ``exp(scores - rowmax)``: divided by its own row sum it is the softmax
    over ``logits`` (the tensor ``exp`` was applied to)."""

    of: Scores
    logits: Tensor


@dataclasses.dataclass(frozen=True)
class ExpSum:
    """``e.sum(-1, keepdim=True)`` of an :class:`Exp` ``e``."""

    of: Exp


@dataclasses.dataclass(frozen=True)
class Derived:
    """A function of scores, or of an operand after its factor, that the records do not describe.
    ``scaled``: it carries a factor of the model's scale (derived from a scaled q or k, or from
    scaled scores): added to the scores it changes with σ, so it is never a fixed bias."""

    scaled: bool
    why: str


@dataclasses.dataclass
class Probs:
    """A softmax over scores, waiting for its product with v (then the call gets v and output).
    ``key``: the site reserved when the softmax ran (the call is named after that module)."""

    call: AttentionCall
    merged: Optional[Tuple[int, int]]
    emit: Callable[..., None]
    key: Any = None
    done: bool = False

    def fire(self, v: Optional[Tensor] = None, output: Optional[Tensor] = None,
             v_grad: Optional[Tuple[Tensor, Callable[[Tensor], Tensor]]] = None) -> None:
        if not self.done:
            self.done = True
            grad_of = self.call.grad_of if v_grad is None else {**(self.call.grad_of or {}), "v": v_grad}
            call = dataclasses.replace(self.call, v=v, output=output, grad_of=grad_of)
            if self.key is None:
                self.emit(call)
            else:
                self.emit(call, self.key)


#: which input's record decides the rule of an op (the first kind found among its inputs)
PRIORITY: Tuple[type, ...] = (Scores, Moved, Exp, LogProbs, Shift, ExpSum, Probs, Slice, Derived, Operand)


def hide(subject: "Operand", why: str) -> Optional["Operand"]:
    """The record of a tensor made from ``subject`` by an op the rules do not model: opaque (a
    product with it has an unknown scale), or none for a loose ``subject`` (a 2-d table's factor is
    not the model's scale unless it reaches q straight)."""
    return None if subject.loose else Operand(opaque=subject.opaque or why)


def learned(record: Any) -> bool:
    """Whether ``record`` is on the way from learned-query scores (``Scores.learned``: a parameter
    times an activation's tokens, :func:`probe.capture.rules_products.start`) to their softmax: the
    scores, or a step of a softmax spelled out over them."""
    while isinstance(record, (Shift, LogProbs, Exp, ExpSum)):
        record = record.of
    return isinstance(record, Scores) and record.learned
