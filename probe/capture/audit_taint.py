"""The audit's rules (:mod:`probe.capture.audit`) over the shared op vocabulary (:mod:`probe.capture.ops`).

A :class:`Taint` follows scores from a product of two activations to a softmax; :func:`step`
says what an op makes of it: where the key dim went (a linear layer over another dim is a mix
over heads, over the keys an output layer), and the steps of a softmax spelled out (``exp``,
its row sum, ``logsumexp``, ``x - logsumexp(x)``, ``log_softmax``), whose completing op is an
attention event like a softmax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from probe.capture import ops
from probe.capture.ops import funcs_of, name_of

__all__ = ["ATTENTION", "CUTS", "Event", "learned_queries", "GRAPH_CUTS", "GRAPH_DEPTH", "PRODUCTS", "SOFTMAX", "LOG_SOFTMAX", "EXP",
           "DIV", "Taint", "keeps_scores", "operands", "step", "tensors_in"]

PRODUCTS = funcs_of(ops.PRODUCT, ops.BADDBMM, ops.EINSUM, ops.DISTANCE)
BADDBMM = funcs_of(ops.BADDBMM)
SOFTMAX = funcs_of(ops.SOFTMAX)
LOG_SOFTMAX = funcs_of(ops.LOG_SOFTMAX)
EXP = funcs_of(ops.EXP)
LSE = funcs_of(ops.LSE)
SUM = funcs_of(ops.SUM)
DIV = funcs_of(ops.DIV)
SUB = funcs_of(ops.SUB)
MOVES = funcs_of(ops.TRANSPOSE, ops.PERMUTE)
CUTS = ops.CUTS  # a convolution over heads (talking heads) keeps scores; a linear layer over them too
ATTENTION = {F.scaled_dot_product_attention: "sdpa", F.multi_head_attention_forward: "mha"}
#: a normalisation over the scores that is not a softmax probe measures: an event ("named, not
#: measured"); F.gumbel_softmax draws its noise inside one call the modes cannot look into, a
#: sigmoid (sigmoid attention) is an event once its output multiplies an activation (``P @ v``)
GUMBEL = frozenset({F.gumbel_softmax})
SIGMOID = frozenset(f for f in (torch.sigmoid, F.sigmoid, torch.special.expit, Tensor.sigmoid,
                                torch._C.TensorBase.sigmoid) if f is not None)
#: the arc-cosine kernel of normalized scores (YOSO's expectation attention, ``(1 - acos(q̂·k̂)/π)^τ @ v``):
#: an event, as a sigmoid is, once it multiplies an activation
KERNEL = frozenset(f for f in (torch.acos, torch.arccos, Tensor.acos, Tensor.arccos) if f is not None)
#: powers, between such a kernel and its product with v
POW = frozenset(f for f in (torch.pow, Tensor.pow, Tensor.__pow__) if f is not None)
#: how far back the autograd graph is searched for scores that went through unseen code
GRAPH_DEPTH = 24
#: autograd nodes of contractions with weights: the search stops there (what lies behind is
#: not scores any more: a linear layer over the attention output, an embedding lookup)
GRAPH_CUTS = frozenset({"AddmmBackward0", "MmBackward0", "ConvolutionBackward0", "EmbeddingBackward0",
                         "LinearBackward0", "AccumulateGrad"})
@dataclasses.dataclass(frozen=True)
class Taint:
    ops: Tuple[str, ...]  # op names since the product (the product first)
    lost_at: Optional[str] = None  # the first op after which capture had no record of the scores
    shapes: str = ""  # the product's operand shapes
    axis: Optional[int] = -1  # where the key dim is (from the end), None when no longer known
    exp: Optional[int] = None  # a softmax spelled out: the token of the `exp` this tensor comes from
    summed: bool = False  # ... its row sum
    lse: bool = False  # a logsumexp of the scores over the keys
    logprobs: Optional["Event"] = None  # log_softmax of the scores: its event (exp of it completes it)
    lse_centred: bool = False  # scores - logsumexp(scores): log-probabilities (exp of them is the softmax)
    weights: Optional["Event"] = None  # sigmoid(scores): its event (a product with an activation completes it)
    learned: bool = False  # scores of learned queries (learned_queries): attention only softmaxed over the tokens
    origin: int = 0  # the product these scores come from (a token: two taints of one product share it)
    series: bool = False  # that product's operands carried scores themselves (a matrix power series' terms)

    def over_weight_rows(self, dim: Optional[int] = None) -> bool:
        """Learned-query scores normalised other than over the tokens (over the weight's rows: a
        classifier's softmax), which is not attention."""
        return self.learned and (dim is not None or self.axis != -1)


@dataclasses.dataclass
class Event:
    """One attention the audit saw: a softmax over product-derived scores, or an attention op."""

    module: str
    kind: str  # "softmax", "sdpa", "mha"
    ops: Tuple[str, ...] = ()
    lost_at: Optional[str] = None
    shapes: str = ""
    unseen: bool = False  # the scores reached the softmax through code the audit could not see
    dim: Optional[int] = None  # a softmax over another dim than the last (the keys)
    reported: Optional[str] = None  # the site probe reported it under
    front_end: Optional[str] = None

    @property
    def why(self) -> str:
        """Why capture did not report this event (only meaningful when ``reported`` is None)."""
        if self.unseen:
            return ("the scores reached the softmax through code probe cannot see (a TorchScript function or "
                    "a C++ extension)")
        if self.kind == "gumbel_softmax":
            return "F.gumbel_softmax over the scores (its Gumbel noise is drawn inside the call: not measured)"
        if self.kind == "sigmoid":
            return "sigmoid attention (a sigmoid over the scores, not a softmax: not measured)"
        if self.kind == "kernel":
            return "kernel attention (an arc-cosine kernel of the scores, not a softmax: not measured)"
        if self.kind == "exp":
            return ("a softmax spelled around its product with v (exp(scores - max) @ v, normalised after it, as "
                    "flash-style chunks are): not measured")
        if self.kind == "linear":
            return ("linear attention (the scores times v with no softmax, as in retention or a gated delta rule: "
                    "not measured)")
        if self.kind != "softmax":
            return f"the {self.kind} call was not understood"
        if self.dim is not None:
            return f"a softmax over dim {self.dim}, not over the keys (the last dim)"
        chain = " -> ".join(self.ops)
        if self.lost_at is None:
            return f"not recognised ({chain} -> softmax)"
        if self.lost_at == self.ops[0]:
            return f"`{self.ops[0]}` of {self.shapes} was not taken as q·kᵀ ({chain} -> softmax)"
        return f"the scores were lost at `{self.lost_at}` ({chain} -> softmax)"


_name = name_of


def tensors_in(x: Any) -> Iterator[Tensor]:
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from tensors_in(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from tensors_in(item)


def permutation(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], n: int) -> Optional[List[int]]:
    """The dims of a transpose or permute (``out`` dim ``i`` is input dim ``perm[i]``)."""
    name = _name(func)
    if name in ("mT",):
        dims = [n - 2, n - 1]
    elif name == "t":
        dims = [0, 1]
    elif name == "movedim":
        return None
    elif name in ("transpose", "swapaxes", "swapdims"):
        dims = [d % n for d in args[1:3] if isinstance(d, int)]
    else:
        given = args[1:] if len(args) > 2 or not isinstance(args[1] if len(args) > 1 else None, (list, tuple)) \
            else args[1]
        given = list(kwargs.get("dims", given))
        return [d % n for d in given] if len(given) == n and all(isinstance(d, int) for d in given) else None
    if len(dims) != 2:
        return None
    perm = list(range(n))
    perm[dims[0]], perm[dims[1]] = perm[dims[1]], perm[dims[0]]
    return perm


def over_last(args: Tuple[Any, ...], kwargs: Dict[str, Any], n: Optional[int]) -> bool:
    """Whether a reduction runs over the keys: the last dim, or several trailing dims with it (a
    softmax over several key axes, ``exp(x - logsumexp(x, (4, 5)))``: Keras' 2-D attention_axes)."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if n is not None and isinstance(dim, (list, tuple)) and dim and all(isinstance(d, int) for d in dim):
        return sorted(d % n for d in dim) == list(range(n - len(dim), n))
    return n is not None and isinstance(dim, int) and dim in (-1, n - 1)



def step(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], taint: Taint, outs: List[Tensor],
         taint_of: Callable[[Any], Optional[Taint]]) -> Taint:
    """The taint of an op's outputs: where the key dim went, and the steps of a softmax spelled out."""
    x = args[0] if args and isinstance(args[0], Tensor) else None
    fields: Dict[str, Any] = {"ops": taint.ops + (_name(func),)}
    n = x.dim() if x is not None else None
    if func in MOVES and n is not None and taint.axis is not None:
        perm = permutation(func, args, kwargs, n)
        fields["axis"] = None if perm is None else perm.index(taint.axis % n) - n
    elif not outs or n is None or any(o.dim() != n for o in outs):
        fields["axis"] = None if not (outs and n is not None and outs[0].dim() >= 2 and taint.axis == -1
                                      and outs[0].shape[-1] == x.shape[-1]) else -1
    last = over_last(args, kwargs, n)
    if func in EXP:
        fields.update(exp=id(outs[0]) if outs else None, summed=False, lse=False, logprobs=None)
    elif func in SUM and taint.exp is not None and last:
        fields["summed"] = True
    elif func in LSE and last:
        fields.update(lse=True, exp=None)
    elif func in SUB and len(args) >= 2:
        ta, tb = taint_of(args[0]), taint_of(args[1])
        if ta is not None and not ta.lse and tb is not None and tb.lse:
            fields["lse_centred"] = True
    elif func not in ops.funcs_of(ops.CAST, ops.VIEW, ops.DETACH):
        fields.update(summed=False, lse=False, lse_centred=False, logprobs=None,
                      exp=taint.exp if func in DIV or func in funcs_of(ops.MUL, ops.DROPOUT) else None)
    return dataclasses.replace(taint, **fields)


def operands(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[List[Tensor]]:
    """The two multiplied tensors of a product op, or None."""
    if func is torch.einsum:
        pair = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        return pair if len(pair) == 2 and all(isinstance(t, Tensor) for t in pair) else None
    if func in BADDBMM:
        b1 = args[1] if len(args) > 1 else kwargs.get("batch1")
        b2 = args[2] if len(args) > 2 else kwargs.get("batch2")
        pair = [b1, b2]
    else:
        a = args[0] if args else kwargs.get("input")
        b = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
        pair = [b, a] if _name(func) == "__rmatmul__" else [a, b]
    if not all(isinstance(t, Tensor) and t.dim() >= 2 for t in pair):
        return None
    return pair

def keeps_scores(func: Any, args: Tuple[Any, ...], operands: List[Tensor],
                 taint_of: Callable[[Any], Optional[Taint]]) -> bool:
    """A product of scores with a constant keeps them scores only as an einsum that keeps
    the scores' last two indices (a linear mix over heads)."""
    if func is not torch.einsum or not isinstance(args[0], str) or "->" not in args[0]:
        return False
    ins, res = args[0].replace(" ", "").split("->")
    specs = ins.split(",")
    for spec, t in zip(specs, operands):
        if taint_of(t) is not None and len(spec) >= 2 and "." not in spec:
            return spec[-2] in res and spec[-1] in res
    return False


def learned_queries(func: Any, args: Tuple[Any, ...], operands: List[Tensor], constant: Callable[[Tensor], bool]) -> bool:
    """A product of a constant (queries computed from weights: ``self.queries``, ``self.to_q(self.latents)``,
    ``(self.queries * s)``) and a batched activation whose rows make the product's last dim: scores of
    learned queries over the tokens (attention pooling, ``PatchMerger``). A constant whose rows make the
    last dim (``x @ Wᵀ``: a classifier, a router) is not."""
    a, b = operands
    if not constant(a) or constant(b) or b.dim() < 3:
        return False
    if func is not torch.einsum:
        return True  # matmul / bmm / baddbmm: the last dim is b's
    if not isinstance(args[0], str) or "->" not in args[0]:
        return False
    ins, res = args[0].replace(" ", "").split("->")
    specs = ins.split(",")
    if len(specs) != 2 or not res or "." in args[0]:
        return False
    last = res[-1]
    return last in specs[1] and last not in specs[0] and bool(set(specs[0]) & set(specs[1]) - set(res))

