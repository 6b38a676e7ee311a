"""The op rules of :mod:`probe.capture.provenance`: which ops make a source, and which copies keep a shadow.

A *shadow* says, for each element of a traced storage, the source feature it is a multiple of
(``-1``: none). :class:`Rules` is the part of :class:`~probe.capture.provenance.Trace` that
applies one intercepted op to the shadows (the trace supplies the tables: ``_entry``, ``_put``,
``_dep``, ``_owner``, ``_poison``, ``_mark``, ``_sources``, ``_param_uses``, ``_names``):

* sources: ``F.linear`` (rows of ``W``), ``torch.addmm`` / ``x @ W`` (GPT-2's ``Conv1D``: columns;
  ``x @ W.t()``: rows), ``F.layer_norm`` / ``F.rms_norm`` and ``weight * x`` (gain entries);
* copies keeping each element's feature (casts, ``contiguous``, ``clone``, dropout, ``neg``),
  moving them (reshapes, indexing, ``repeat_interleave``: the same op runs on the shadow), joining
  them (``cat``, ``stack``), scaling them by a number or a tensor independent of the source, and
  adding two tensors of one source (the pair of features is kept: a rotation such as rotary's);
* in place: a scale keeps the shadow, ``copy_`` / ``t[idx] = v`` write the value's shadow into
  the region, anything else poisons the storage.

Anything else reading a traced tensor is a *use* (:class:`Use`) and its result is not traced.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from probe.capture import ops

__all__ = ["Rules"]

_TB = torch._C.TensorBase


def _funcs(names: str, *extra: Callable[..., Any]) -> FrozenSet[Callable[..., Any]]:
    methods = [getattr(cls, n) for n in names.split() for cls in (_TB, Tensor) if hasattr(cls, n)]
    return frozenset([*methods, *extra])


# The kinds of the op vocabulary (probe.capture.ops, shared with the eager tracer and the audit),
# every spelling included (``x * c``, ``x.mul(c)``, ``torch.mul``, ``x *= c``), plus a few
# functions the vocabulary leaves as OTHER that move elements without changing them.
#: Value-preserving copies: each element keeps its feature.
_SAME = ops.funcs_of(ops.CAST, ops.DROPOUT, ops.NEG) | _funcs("positive __pos__", torch.positive)
#: Copies that move elements: the same op runs on the shadow (data arguments replaced by shadows).
_MOVE = ops.funcs_of(ops.VIEW, ops.TRANSPOSE, ops.PERMUTE, ops.EXPAND, ops.INDEX) \
    | _funcs("flip roll index_select", torch.flip, torch.roll, torch.index_select)
#: Copies of several tensors along a dim: every tensor of the first argument is data.
_JOIN = ops.funcs_of(ops.JOIN)
MUL = ops.funcs_of(ops.MUL)
_DIV = ops.funcs_of(ops.DIV)
_ADD = ops.funcs_of(ops.ADD)
_SUB = ops.funcs_of(ops.SUB)
_SCALE_INPLACE = ops.funcs_of(ops.MUL, ops.DIV, ops.NEG)  # only where the op changed its input in place
_ASSIGN = ops.funcs_of(ops.SETITEM, ops.COPY)
PRODUCTS = ops.funcs_of(ops.PRODUCT) | _funcs("mm", torch.mm)
ADDMM = _funcs("addmm", torch.addmm)
NORMS = frozenset(f for f in (F.layer_norm, getattr(F, "rms_norm", None)) if f is not None)
#: Functions that read metadata only (shape, strides, dtype): not a use of the values.
META = frozenset({"__get__", "size", "dim", "stride", "storage_offset", "numel", "is_contiguous", "data_ptr",
                   "untyped_storage", "element_size", "__len__", "is_floating_point", "is_complex", "nelement",
                   "ndimension", "get_device", "is_inference", "requires_grad_", "retain_grad", "register_hook"})


# -- what the trace keeps --------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Source:
    id: int
    module: "weakref.ref[nn.Module]"
    name: str
    weight: str
    bias: Optional[str]
    layout: str
    features: int
    param: int  # id() of the weight
    pairs: List[Tensor] = dataclasses.field(default_factory=list)  # (n, 2) features mixed by an add
    uses: List["Use"] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Entry:
    """A traced storage: per storage element, the source feature it is a multiple of (-1: none)."""

    ref: StorageWeakRef
    itemsize: int
    version: int
    source: Source
    modulus: int = 0  # shadow(o) = o % modulus (a fresh contiguous projection output), else `dense`
    dense: Optional[Tensor] = None
    mult: FrozenSet[int] = frozenset()  # sources the multipliers on the way depended on
    ops: Tuple[str, ...] = ()

    def shadow(self, t: Tensor) -> Tensor:
        """The features of ``t``'s elements (``t`` a view of this storage), int64, ``t``'s shape."""
        if self.dense is not None:
            return self.dense.as_strided(t.shape, t.stride(), t.storage_offset()).long()
        return _modular(tuple(t.shape), t.stride(), t.storage_offset(), self.modulus)

    def densify(self, numel: int) -> Tensor:
        """The shadow of the whole storage as a writable int32 tensor (``numel`` elements)."""
        if self.dense is None:
            self.dense = (torch.arange(numel) % self.modulus).to(torch.int32)
            self.modulus = 0
        return self.dense


@dataclasses.dataclass(eq=False)
class Use:
    """One op reading a traced tensor (not a rule the trace follows): which features it read."""

    event: int
    op: str
    modulus: int
    dense: Optional[Tensor]  # the entry's shadow then (the entry may change later)
    geometry: Tuple[Tuple[int, ...], Tuple[int, ...], int]

    def features(self) -> Tensor:
        shape, stride, offset = self.geometry
        if self.dense is not None:
            s = self.dense.as_strided(shape, stride, offset).long()
        else:
            s = _modular(shape, stride, offset, self.modulus)
        return torch.unique(s[s >= 0])


def _modular(shape: Tuple[int, ...], stride: Tuple[int, ...], offset: int, modulus: int) -> Tensor:
    """``(storage offset of each element) % modulus`` for a view of the given geometry."""
    out = torch.full((), offset, dtype=torch.long)
    for dim, (size, step) in enumerate(zip(shape, stride)):
        view = [1] * len(shape)
        view[dim] = size
        out = out + torch.arange(size).mul_(step).view(view)
    return out.expand(shape) % modulus



def storage_key(t: Tensor) -> Optional[Tuple[int, str, int]]:
    """A storage as read by ``t``: its memory and the size of an element (a complex view of a
    float storage has shadows of its own, one per complex element)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without plain storage (meta, a subclass)
        return None
    return (ptr, str(t.device), t.element_size()) if ptr else None


def op_name(func: Any) -> str:
    return getattr(func, "__name__", type(func).__name__)


NOT_MODELLED = "{op} is not modelled (only projections, shape, dtype, scalar and rotary ops are)"



class Rules:
    """The op rules of a :class:`~probe.capture.provenance.Trace` (a mixin; see the module docstring)."""

    # -- sources --------------------------------------------------------------------------------
    def _new_source(self, owner: Tuple[nn.Module, str], bias: Any, layout: str, features: int) -> Optional[Source]:
        module, attr = owner
        bias_attr = None
        if bias is not None:
            found = self._owner(bias)
            if found is None or found[0] is not module:
                return None  # a bias that is not the module's own parameter: not scaled with the rows
            bias_attr = found[1]
        weight = module._parameters[attr]
        source = Source(len(self._sources), weakref.ref(module), self._names.get(id(module), type(module).__name__),
                         attr, bias_attr, layout, features, id(weight))
        self._sources.append(source)
        for p in (x for x in (weight, bias) if x is not None):
            self._param_uses[id(p)] = self._param_uses.get(id(p), 0) + 1
        return source

    def _source(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> Optional[Source]:
        """Trace ``out`` as a new source's output when ``func`` is a projection or a gain."""
        if not isinstance(out, Tensor) or not out.is_floating_point():
            return None
        a = list(args)
        if func is F.linear:
            weight = a[1] if len(a) > 1 else kwargs.get("weight")
            owner = self._owner(weight)
            if owner is None or weight.dim() != 2:
                return None
            source = self._new_source(owner, a[2] if len(a) > 2 else kwargs.get("bias"), "rows", weight.shape[0])
            return self._projection(source, out, "linear")
        if func in ADDMM or func in PRODUCTS:
            if len(a) < (3 if func in ADDMM else 2) or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
                return None
            x, mat = (a[1], a[2]) if func in ADDMM else (a[0], a[1])
            if not isinstance(mat, Tensor) or mat.dim() != 2:
                return None
            owner, layout = self._owner(mat), "cols"  # x @ W: GPT-2's Conv1D, column j makes feature j
            base = mat._base
            if owner is None and isinstance(base, nn.Parameter) and base.dim() == 2 \
                    and mat.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() \
                    and mat.storage_offset() == base.storage_offset() \
                    and mat.shape == base.shape[::-1] and mat.stride() == base.stride()[::-1]:
                owner, layout = self._owner(base), "rows"  # x @ W.t()
            if owner is None:
                return None
            source = self._new_source(owner, a[0] if func in ADDMM else None, layout, mat.shape[1])
            return self._projection(source, out, op_name(func))
        if func in NORMS:
            weight = a[2] if len(a) > 2 else kwargs.get("weight")
            bias = (a[3] if len(a) > 3 else kwargs.get("bias")) if func is F.layer_norm else None
            owner = self._owner(weight)
            if owner is None:
                return None
            return self._gain(self._new_source(owner, bias, "gain", weight.numel()), weight, out, op_name(func))
        if func in MUL and len(a) == 2:
            params = [x for x in a if isinstance(x, nn.Parameter) and self._owner(x) is not None]
            other = [x for x in a if not any(x is p for p in params)]
            if len(params) != 1 or len(other) != 1 or not isinstance(other[0], Tensor) or self._entry(other[0]):
                return None
            return self._gain(self._new_source(self._owner(params[0]), None, "gain", params[0].numel()), params[0],
                              out, "gain")
        return None

    def _projection(self, source: Optional[Source], out: Tensor, op: str) -> Optional[Source]:
        if source is None:
            return None
        if out.is_contiguous() and out.storage_offset() == 0 and out.shape[-1] == source.features:
            self._put(out, source, None, frozenset(), (op,), modulus=source.features)
        else:
            shape = [1] * out.dim()
            shape[-1] = source.features
            self._put(out, source, torch.arange(source.features).view(shape).expand(out.shape), frozenset(), (op,))
        return source

    def _gain(self, source: Optional[Source], weight: Tensor, out: Tensor, op: str) -> Optional[Source]:
        if source is None:
            return None
        try:
            shadow = torch.broadcast_to(torch.arange(weight.numel()).view(weight.shape), out.shape)
        except RuntimeError:
            return None
        self._put(out, source, shadow, frozenset(), (op,))
        return source

    # -- copies ---------------------------------------------------------------------------------
    def _copy(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Tensor,
              seen: List[Tuple[Tensor, Entry, int]]) -> Optional[str]:
        """Trace a fresh output that a rule describes; else the reason it is not traced (a use)."""
        name = op_name(func)
        sources = {id(e.source) for _, e, _ in seen}
        if len(sources) != 1:
            return f"{name} combines the outputs of {len(sources)} projections (an adapter such as LoRA?)"
        source = seen[0][1].source
        mult = frozenset().union(*(e.mult for _, e, _ in seen))
        ops = max((e.ops for _, e, _ in seen), key=len)
        first = args[0] if args else None
        head = self._entry(first)
        if func is torch.view_as_complex and head is not None:  # Meta's reference rotary: pairs become one value
            pair = head.shadow(first)
            re, im = pair[..., 0], pair[..., 1]
            both = torch.stack([re.reshape(-1), im.reshape(-1)], 1)
            source.pairs.append(torch.unique(both[(both >= 0).all(1)], dim=0))
            self._put(out, source, torch.where((re >= 0) & (im >= 0), re, -1), mult, ops + (name,))
            return None
        if func is torch.view_as_real and head is not None:
            value = head.shadow(first)
            self._put(out, source, value.unsqueeze(-1).expand(*value.shape, 2), mult, ops + (name,))
            return None
        if func in _SAME and head is not None and out.shape == first.shape:
            self._put(out, source, head.shadow(first), mult, ops + (name,))
            return None
        if func in _MOVE and head is not None:
            shadow = func(head.shadow(first), *args[1:], **kwargs)
            if isinstance(shadow, Tensor) and shadow.shape == out.shape:
                self._put(out, source, shadow, mult, ops + (name,))
                return None
            return NOT_MODELLED.format(op=name)
        if func in _JOIN and isinstance(first, (list, tuple)):
            parts = [self._entry(t).shadow(t) if self._entry(t) is not None
                     else torch.full(t.shape, -1, dtype=torch.long) for t in first]
            self._put(out, source, func(parts, *args[1:], **kwargs), mult, ops + (name,))
            return None
        if func in MUL or func in _DIV:
            traced = [x for x in args if self._entry(x) is not None]
            if len(args) != 2 or len(traced) != 1 or kwargs.get("rounding_mode") is not None \
                    or (func in _DIV and traced[0] is not args[0]):
                return f"{name} of the projection's output by itself (not linear in its rows)"
            t = traced[0]
            other = args[1] if t is args[0] else args[0]
            if source.id in self._dep(other):
                return f"{name} by a function of the projection's own output (a normalization)"
            what = "tensor" if isinstance(other, Tensor) else "number"
            self._put(out, source, torch.broadcast_to(self._entry(t).shadow(t), out.shape), mult | self._dep(other),
                      ops + (f"{name} by {what}",))
            return None
        if func in _ADD or func in _SUB:
            if len(args) != 2 or not all(self._entry(x) is not None for x in args):
                return (f"{name} of a tensor to the projection's output (a bias added after it, a position "
                        "embedding): not a multiple of its rows")
            a, b = (torch.broadcast_to(self._entry(x).shadow(x), out.shape) for x in args)
            pairs = torch.stack([a.reshape(-1), b.reshape(-1)], 1)
            source.pairs.append(torch.unique(pairs[(pairs >= 0).all(1)], dim=0))
            self._put(out, source, torch.where((a >= 0) & (b >= 0), a, -1), mult, ops + (name,))
            return None
        return NOT_MODELLED.format(op=name)

    # -- in place -------------------------------------------------------------------------------
    def _in_place(self, func: Any, args: Tuple[Any, ...], changed: List[Tuple[Tensor, Entry]],
                  tensors: List[Tensor], deps: FrozenSet[int]) -> None:
        name = op_name(func)
        target = args[0] if args else None
        for t, entry in changed:
            other = args[1] if len(args) > 1 else None
            if t is not target:
                self._poison(t, f"changed in place by {name}")
            elif func in _SCALE_INPLACE and entry.source.id in self._dep(other):
                self._poison(t, f"{name} by a function of the projection's own output (a normalization)")
            elif func in _SCALE_INPLACE and (len(args) == 1 or self._entry(other) is None):
                entry.mult = entry.mult | self._dep(other)
                entry.version = t._version
                entry.ops = entry.ops + (name,)
            elif func in _ASSIGN:
                value = args[-1]
                found = self._entry(value) if isinstance(value, Tensor) else None
                dense = entry.densify(t.untyped_storage().nbytes() // t.element_size())
                region = dense.as_strided(t.shape, t.stride(), t.storage_offset())
                ours = found is not None and found.source is entry.source
                values = found.shadow(value).to(torch.int32) if ours else -1
                if name == "copy_":
                    region.copy_(torch.broadcast_to(torch.as_tensor(values, dtype=torch.int32), t.shape))
                else:
                    region[args[1]] = values
                entry.version = t._version
                entry.ops = entry.ops + (name,)
            else:
                self._poison(t, f"changed in place by {name}")
        for t in tensors:
            self._mark(self._deps, t, self._dep(t) | deps)


def through(fn: Any, shadow: Tensor, shape: Tuple[int, ...]) -> Optional[Tensor]:
    """The features of a record made from a traced tensor by a linear map ``fn`` (a reshape, a
    permutation, a factor, a sum over repeated copies: the gradient map of ``AttentionCall.grad_of``),
    or ``None`` when an element of the record is not a multiple of one feature. Exact: with
    ``m = fn(1)``, an element is one feature ``f`` iff ``fn(s)/m = f`` and ``fn(s²)/m = f²``
    (a mix of features has a mean of squares above its squared mean), in float64."""
    s = shadow.double()
    try:
        with torch.no_grad():
            m, a, b = fn(torch.ones_like(s)), fn(s), fn(s * s)
    except Exception:  # noqa: BLE001 - a map that does not take this tensor: not traced
        return None
    if tuple(m.shape) != shape or not bool((m != 0).all()):
        return None
    f = a / m
    r = f.round()
    if not (bool(((f - r).abs() <= 1e-6).all()) and bool(((b / m - r * r).abs() <= 1e-6 * (1 + r * r)).all())):
        return None
    return r.long()
