"""The op vocabulary: which torch function is which *kind* of op, for the eager tracer and the audit.

Every function the capture mode may route (``torch.*``, ``torch.nn.functional.*`` and tensor
methods, in every spelling: ``x * c``, ``x.mul(c)``, ``torch.mul``, ``x.mul_(c)``, ``x *= c``) is
named here once, with its kind. The eager tracer (:mod:`probe.capture.eager`) keeps one rule per
(kind, record kind) (:mod:`probe.capture.rules`); the first-forward audit
(:mod:`probe.capture.audit`) reads the same kinds (what starts scores, what is a softmax in any
spelling, what ends them). A function not named here has the kind :data:`OTHER`: the tracer's
default rule applies to it when one of its inputs carries a record, so an op the tracer does not
model makes its record *unknown* rather than vanish.

Adding a spelling: one line in :data:`_SPELLINGS` (and, when it is a new kind, its rules).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, Iterable, List

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ATTENTION", "CAST", "DETACH", "DIV", "DROPOUT", "EINSUM", "EXP", "FACTORY", "FLOOR", "INDEX",
           "LINEAR", "LOG_SOFTMAX", "LSE", "MASKED_FILL", "MEAN", "NAN_TO_NUM", "MAX", "MUL", "NEG", "NORM", "OTHER", "PERMUTE", "PRODUCT",
           "RECIPROCAL", "RSUB", "SETITEM", "SOFTMAX", "SUM", "ADD", "SUB", "TANH", "TRANSPOSE", "VIEW", "WHERE", "BADDBMM",
           "CONV", "DISTANCE", "JOIN", "COPY", "CLAMP", "EXPAND", "FIRST", "LINEAR_IN", "OPS", "STARTS", "CUTS", "funcs_of", "kind_of", "name_of", "tensors"]

# -- kinds ---------------------------------------------------------------------------------------------
PRODUCT = "product"          # a @ b, matmul, bmm: two operands contracted over the last / second-last dims
BADDBMM = "baddbmm"          # beta * input + alpha * (b1 @ b2)
EINSUM = "einsum"
MUL = "mul"
DIV = "div"
RECIPROCAL = "reciprocal"    # 1 / x, c / x: not linear in x
ADD = "add"
SUB = "sub"                  # a - b
RSUB = "rsub"                # c - x
NEG = "neg"
MASKED_FILL = "masked_fill"
NAN_TO_NUM = "nan_to_num"
WHERE = "where"
TANH = "tanh"
FLOOR = "floor"              # clamp(min=...), torch.max(x, y), maximum: a floor (or a cap)
CLAMP = "clamp"              # clamp_max, minimum: a cap
CAST = "cast"                # dtype / memory-format changes that keep every value
DETACH = "detach"
DROPOUT = "dropout"
VIEW = "view"                # shape changes that keep the element order
TRANSPOSE = "transpose"      # two dims swapped (transpose, swapaxes, mT, .T)
PERMUTE = "permute"          # any dims permuted (permute, movedim)
EXPAND = "expand"            # broadcast views and copies (expand, repeat)
INDEX = "index"              # parts: getitem, select, narrow, unbind, chunk, split
JOIN = "join"                # cat, stack
SETITEM = "setitem"          # t[idx] = value
COPY = "copy"                # t.copy_(src): t takes src's values
SOFTMAX = "softmax"
LOG_SOFTMAX = "log_softmax"
EXP = "exp"
LSE = "logsumexp"
SUM = "sum"
MEAN = "mean"
MAX = "max"                  # a reduction over a dim (amax, max(dim=...)); torch.max(x, y) is a FLOOR
LINEAR = "linear"            # F.linear: a contraction of the last dim with a weight
CONV = "conv"
NORM = "norm"                # layer_norm, rms_norm, group_norm, normalize: a new origin
FACTORY = "factory"          # *_like, new_*: values unrelated to the input's
LINEAR_IN = "linear_in"      # linear ops with a hidden coefficient probe does not read (addcmul, lerp, ...)
DISTANCE = "distance"          # cdist: scores from distances between activations (-|q - k|²)
ATTENTION = "attention"      # fused attention (SDPA, nn.MultiheadAttention's function): other front ends
OTHER = "other"              # anything else: the default rule of the record kind

_TB = torch._C.TensorBase


def _methods(names: str) -> List[Any]:
    found = []
    for n in names.split():
        for cls in (_TB, Tensor):
            f = getattr(cls, n, None)
            if isinstance(f, property) or type(f).__name__ == "getset_descriptor":
                f = f.__get__  # a property (``t.mT``): the mode receives its getter
            if f is not None and f not in found:
                found.append(f)
    return found


#: (kind, tensor method names, other functions)
_SPELLINGS: List[tuple] = [
    (PRODUCT, "matmul __matmul__ __rmatmul__ bmm", (torch.matmul, torch.bmm)),
    (BADDBMM, "baddbmm", (torch.baddbmm,)),
    (EINSUM, "", (torch.einsum,)),
    (MUL, "mul mul_ __mul__ __rmul__ __imul__ multiply multiply_", (torch.mul, torch.multiply)),
    (DIV, "div div_ __truediv__ __itruediv__ divide divide_ true_divide true_divide_",
     (torch.div, torch.divide, torch.true_divide)),
    (RECIPROCAL, "__rdiv__ __rtruediv__ reciprocal reciprocal_", (torch.reciprocal,)),
    (ADD, "add add_ __add__ __radd__ __iadd__", (torch.add,)),
    (SUB, "sub sub_ __sub__ __isub__ subtract subtract_", (torch.sub, torch.subtract)),
    (RSUB, "__rsub__", (torch.rsub,)),
    (NEG, "neg neg_ __neg__ negative", (torch.neg, torch.negative)),
    (MASKED_FILL, "masked_fill masked_fill_", (torch.masked_fill,)),
    (WHERE, "where", (torch.where,)),
    (NAN_TO_NUM, "nan_to_num nan_to_num_", (torch.nan_to_num,)),
    (TANH, "tanh", (torch.tanh, F.tanh)),
    (FLOOR, "clamp clamp_ clamp_min clamp_min_ clip clip_ maximum", (torch.clamp, torch.clamp_min, torch.clip,
                                                                   torch.maximum)),
    (CLAMP, "clamp_max clamp_max_ minimum", (torch.clamp_max, torch.minimum)),
    (CAST, "float to type type_as contiguous half bfloat16 double clone", (torch.clone,)),
    (DETACH, "detach", (torch.detach,)),
    (DROPOUT, "", (F.dropout, torch.dropout)),
    (VIEW, "view view_as reshape reshape_as flatten unflatten squeeze unsqueeze",
     (torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze)),
    (TRANSPOSE, "transpose swapaxes swapdims mT t", (torch.transpose, torch.swapaxes, torch.swapdims, torch.t)),
    (PERMUTE, "permute movedim", (torch.permute, torch.movedim)),
    (EXPAND, "expand expand_as repeat repeat_interleave tile", (torch.repeat_interleave, torch.tile)),
    (INDEX, "__getitem__ select narrow unbind chunk split tensor_split",
     (torch.select, torch.narrow, torch.unbind, torch.chunk, torch.split, torch.tensor_split)),
    (JOIN, "", (torch.cat, torch.stack, torch.concat, torch.concatenate)),
    (SETITEM, "__setitem__", ()),
    (COPY, "copy_", ()),
    (SOFTMAX, "softmax", (torch.softmax, F.softmax)),
    (LOG_SOFTMAX, "log_softmax", (torch.log_softmax, F.log_softmax)),
    (EXP, "exp exp_", (torch.exp,)),
    (LSE, "logsumexp", (torch.logsumexp,)),
    (SUM, "sum", (torch.sum,)),
    (MEAN, "mean", (torch.mean,)),
    (MAX, "amax max", (torch.amax, torch.max)),
    (LINEAR, "", (F.linear,)),
    (CONV, "", (F.conv1d, F.conv2d, torch.conv1d, torch.conv2d)),
    (NORM, "", (F.layer_norm, torch.layer_norm, F.group_norm, F.normalize, getattr(F, "rms_norm", None))),
    (FACTORY, "new_zeros new_ones new_full new_empty new_tensor",
     (torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like, torch.rand_like, torch.randn_like)),
    (LINEAR_IN, "addcmul addcmul_ addcdiv addcdiv_ lerp lerp_", (torch.addcmul, torch.addcdiv, torch.lerp)),
    (DISTANCE, "", (torch.cdist,)),
    (ATTENTION, "", (F.scaled_dot_product_attention, F.multi_head_attention_forward)),
]


def _build() -> Dict[Callable[..., Any], str]:
    table: Dict[Callable[..., Any], str] = {}
    for kind, names, funcs in _SPELLINGS:
        for f in (*_methods(names), *funcs):
            if f is not None and f not in table:
                table[f] = kind
    # complex views (Meta's reference rotary) keep values: linear in the tensor they view
    for f in (torch.view_as_complex, torch.view_as_real):
        table[f] = VIEW
    return table


#: every named function and its kind (the eager tracer's routing table)
OPS: Dict[Callable[..., Any], str] = _build()
#: kinds whose rules may make a record from inputs that carry none (the tracer's cheap rejection:
#: an op of another kind on unrecorded inputs runs untouched)
STARTS: FrozenSet[str] = frozenset({PRODUCT, BADDBMM, EINSUM, MUL, DIV, VIEW, LINEAR_IN, TRANSPOSE, PERMUTE})
#: kinds whose data is their first argument only (``t.type_as(other)``, ``t.view_as(other)``,
#: ``F.linear(t, w)``): the tracer's rule is decided by its record alone
FIRST: FrozenSet[str] = frozenset({CAST, DETACH, VIEW, TRANSPOSE, PERMUTE, EXPAND, INDEX, DROPOUT, TANH, SOFTMAX,
                                   LOG_SOFTMAX, EXP, LSE, SUM, MEAN, MAX, NORM, LINEAR, CONV, FACTORY, MASKED_FILL, NEG,
                                   RECIPROCAL})
#: kinds that end scores in the audit's eyes (a contraction of the key dim with a weight: an output
#: layer), unless they contract another dim (a linear mix over heads: talking heads)
CUTS: FrozenSet[Callable[..., Any]] = frozenset({F.linear, F.bilinear, F.embedding})


def kind_of(func: Any) -> str:
    """The kind of an intercepted function (:data:`OTHER` when it is not in the vocabulary)."""
    return OPS.get(func, OTHER)


def name_of(func: Any) -> str:
    """A short readable name (``mul``, ``__getitem__``, ``mT``) for warnings."""
    name = getattr(func, "__name__", None)
    if name == "__get__":  # a property getter
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", None) or "property"
    return name or repr(func)


def funcs_of(*kinds: str) -> FrozenSet[Callable[..., Any]]:
    """Every function of the given kinds (the audit's sets)."""
    return frozenset(f for f, k in OPS.items() if k in kinds)


def tensors(x: Any) -> Iterable[Tensor]:
    """The tensors in an argument (one level of lists and tuples: ``torch.cat([a, b])``)."""
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            if isinstance(item, Tensor):
                yield item
