"""Provenance of q and k: which rows of which parameter each head's queries and keys scale with.

QK-Clip (:mod:`probe.experiment.qk_clip`) rescales "the query and key projection rows of a head".
Which rows those are is a property of the model's forward, not of its class names: a fused
``qkv`` split three ways, GPT-2's ``Conv1D`` (columns, not rows), grouped kv heads, a rotary
embedding, a factor on q, a QK-norm's gain. :class:`Trace` finds them by following one forward,
op by op (a ``TorchFunctionMode`` above the capture mode), and answers *exactly or not at all*.

**What is followed.** A *source* is a parameter whose entries each output feature is
proportional to: ``F.linear(x, W, b)`` (feature ``j`` = row ``j`` of ``W`` and ``b[j]``),
``torch.addmm(b, x, W)`` / ``x @ W`` (GPT-2's ``Conv1D``: column ``j``), a norm's gain
(``F.layer_norm`` / ``F.rms_norm`` weight and bias, ``weight * x``): feature ``j`` = entry ``j``.
Every storage holding values derived from a source gets a *shadow*: for each element, the
source feature it is a multiple of. Views need no rule: any tensor sharing a traced storage
reads its shadow at its own strides. Copies follow rules that keep "a multiple of feature j"
true: casts, ``contiguous``, ``clone``, dropout, ``neg`` keep each element's feature; reshapes,
``cat``, ``stack``, ``repeat_interleave``, indexing move features with the elements (the same op
is run on the shadow); ``* c`` and ``/ c`` keep them when ``c`` is a number or a tensor that does
not depend on the traced projections of the site (rotary ``cos``/``sin``, a scale); ``a + b`` of
two tensors of the same source keeps the pair of features ``(a_j, b_j)`` together (a rotation
such as rotary's ``q·cos + rotate_half(q)·sin`` mixes features within a head; the pair's rows
are then scaled alike, so the rotation commutes with the factor). Anything else that reads a
traced tensor is a *use*; its result is not traced.

**What is refused** (:class:`Refusal`, with the reason in words): q or k not traced to one
source (an adapter such as LoRA adds a second projection; an op the rules do not model, such as a
bias added after the projection or a normalization without a per-head gain); a feature shared by
two heads (a QK-norm gain over ``head_dim`` applied to every head); rows of q or k also read by
another use (a second attention call, an ``einsum`` with position embeddings, the value path); a
multiplier that depends on the site's own projections; a parameter tied to another module or used
by several calls per forward; eager scores whose scale probe could not recover.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from probe.call import AttentionCall
from probe.capture.provenance_mha import mha_site
from probe.capture.provenance_rules import (
    ADDMM, MUL, META, NORMS, NOT_MODELLED, PRODUCTS, Rules, Entry, Source, Use, op_name, storage_key,
    through,
)

__all__ = ["Pending", "Refusal", "Rows", "SiteProvenance", "Trace"]


# -- results ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Rows:
    """The entries of one parameter that one role (q or k) of a site scales with, per head.

    Attributes:
        module: the module holding the parameter (a weak reference: the model owns it).
        name: the module's qualified name in the watched model (for messages).
        weight: the parameter's attribute name on ``module``; ``bias``: the bias scaled with it.
        layout: ``"rows"`` (``W[j, :]``, ``nn.Linear``), ``"cols"`` (``W[:, j]``, GPT-2's
            ``Conv1D``) or ``"gain"`` (``g.view(-1)[j]``, a norm's per-feature gain).
        features: the number of features ``j`` of the source.
        head_of: ``(features,)`` long tensor: the head each feature belongs to, ``-1`` for
            features the role does not read (scaled by exactly 1.0).
    """

    module: "weakref.ref[nn.Module]"
    name: str
    weight: str
    bias: Optional[str]
    layout: str
    features: int
    head_of: Tensor

    def describe(self) -> str:
        heads = int(self.head_of.max()) + 1 if self.head_of.numel() else 0
        what = {"rows": "rows", "cols": "columns", "gain": "gain entries"}[self.layout]
        bias = f" and {self.bias} entries" if self.bias else ""
        per_head = int((self.head_of >= 0).sum()) // max(heads, 1)
        return f"{self.name}.{self.weight} {what}{bias} ({heads} heads x {per_head})"


@dataclasses.dataclass(frozen=True)
class SiteProvenance:
    """Where one site's q and k come from: per query head and per kv head, the entries to scale.
    ``kv_of``: the kv head (``k.head_of``'s numbering) each query head reads."""

    q: Rows
    k: Rows
    path: str
    kv_of: Tensor

    def describe(self) -> str:
        return f"q: {self.q.describe()}; k: {self.k.describe()}; path: {self.path}"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A site QK-Clip will not touch, and why (in words a user can act on)."""

    reason: str

    def describe(self) -> str:
        return f"refused: {self.reason}"


Result = Union[SiteProvenance, Refusal]


@dataclasses.dataclass(eq=False)
class Pending:
    """A site resolved during the forward, to be confirmed by :meth:`Trace.finish` once it ended
    (a later op may still read its rows, or use its weights again)."""

    q: Source
    k: Source
    q_of: Tensor
    k_of: Tensor
    path: str
    kv_of: Tensor


class Trace(Rules, TorchFunctionMode):
    """Follows one forward of ``root`` (see the module docstring).

    Enter it above the capture mode for one root forward; for each recorded call, while it is
    alive, :meth:`resolve` gives a :class:`Pending` (or a :class:`Refusal`), and once the forward
    ended :meth:`finish` confirms it into a :class:`SiteProvenance` (or refuses it).

    Args:
        root: the watched model.
        names: ``id(module)`` → its name in messages (:func:`probe.capture.sites.site_names`).
    """

    rides_capture = True  # leaves the mode stack with the capture mode (a fused nested-tensor module)

    def __init__(self, root: nn.Module, names: Dict[int, str]) -> None:
        super().__init__()
        self._root = root
        self._names = names
        self._entries: Dict[Tuple[int, str, int], Entry] = {}
        self._deps: Dict[Tuple[int, str, int], Tuple[StorageWeakRef, FrozenSet[int]]] = {}
        self._why: Dict[Tuple[int, str, int], Tuple[StorageWeakRef, str]] = {}
        self._sources: List[Source] = []
        self._param_uses: Dict[int, int] = {}
        self._owners: Dict[int, List[Tuple[nn.Module, str]]] = {}
        self._shared: Set[int] = set()
        self._events = itertools.count()
        self._ops = 0
        #: once set, every op passes through untouched (the forward is over: its sites are settled)
        self.passive = False
        self.errors: List[str] = []
        self._index_params()

    # -- parameters -----------------------------------------------------------------------------
    def _index_params(self) -> None:
        owners: Dict[int, List[Tuple[nn.Module, str]]] = {}
        for module in self._root.modules():
            for attr, p in module._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), []).append((module, attr))
        self._owners = owners
        count: Dict[int, int] = {}
        for _, module in self._root.named_modules(remove_duplicate=False):
            count[id(module)] = count.get(id(module), 0) + 1
        self._shared = {id(p) for m in self._root.modules() if count.get(id(m), 0) > 1
                        for p in m._parameters.values() if p is not None}

    def _owner(self, p: Any) -> Optional[Tuple[nn.Module, str]]:
        if not isinstance(p, nn.Parameter):
            return None
        if id(p) not in self._owners:  # swapped in during the forward (FSDP2's unsharded parameters)
            self._index_params()
        owners = self._owners.get(id(p))
        return owners[0] if owners else None

    # -- storage tables -------------------------------------------------------------------------
    def _entry(self, t: Any) -> Optional[Entry]:
        if not isinstance(t, Tensor):
            return None
        key = storage_key(t)
        entry = None if key is None else self._entries.get(key)
        if entry is None or entry.ref.expired() or entry.itemsize != t.element_size() or entry.version != t._version:
            return None
        return entry

    def _lookup(self, table: Dict[Tuple[int, str, int], Any], t: Tensor) -> Any:
        key = storage_key(t)
        found = None if key is None else table.get(key)
        return None if found is None or found[0].expired() else found[1]

    def _dep(self, t: Any) -> FrozenSet[int]:
        return (self._lookup(self._deps, t) or frozenset()) if isinstance(t, Tensor) else frozenset()

    def why(self, t: Tensor) -> Optional[str]:
        """Why the storage of ``t`` is not traced, when an op said so."""
        return self._lookup(self._why, t)

    def _mark(self, table: Dict[Tuple[int, str, int], Any], t: Tensor, value: Any) -> None:
        key = storage_key(t)
        if key is not None:
            table[key] = (StorageWeakRef(t.untyped_storage()), value)

    def _put(self, t: Tensor, source: Source, shadow: Optional[Tensor], mult: FrozenSet[int],
             ops: Tuple[str, ...], modulus: int = 0) -> None:
        """Trace the fresh storage of ``t``: per element ``shadow`` (``t``'s shape), or ``modulus``."""
        key = storage_key(t)
        if key is None or any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            return
        entry = Entry(StorageWeakRef(t.untyped_storage()), t.element_size(), t._version, source, mult=mult,
                       ops=tuple(dict.fromkeys(ops))[-12:])
        if modulus:
            entry.modulus = modulus
        else:
            assert shadow is not None
            dense = torch.full((t.untyped_storage().nbytes() // t.element_size(),), -1, dtype=torch.int32)
            dense.as_strided(t.shape, t.stride(), t.storage_offset()).copy_(shadow)
            entry.dense = dense
        self._entries[key] = entry
        self._why.pop(key, None)

    def _poison(self, t: Tensor, why: str) -> None:
        key = storage_key(t)
        if key is not None:
            self._entries.pop(key, None)
            self._mark(self._why, t, why)

    def _sweep(self) -> None:
        for key in [k for k, e in self._entries.items() if e.ref.expired()]:
            del self._entries[key]
        for table in (self._deps, self._why):
            for key in [k for k, v in table.items() if v[0].expired()]:
                del table[key]

    # -- the mode -------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if self.passive:
            return func(*args, **kwargs)
        flat = tree_flatten((args, kwargs))[0]
        tensors = [t for t in flat if isinstance(t, Tensor)]
        seen = [(t, e, t._version) for t in tensors for e in (self._entry(t),) if e is not None]
        deps = frozenset().union(*(self._dep(t) for t in tensors)) if tensors else frozenset()
        out = func(*args, **kwargs)
        if not seen and not deps and not (func is F.linear or func in ADDMM or func in PRODUCTS or func in NORMS
                                          or func in MUL):
            return out
        try:
            with torch._C.DisableTorchFunction():  # the shadows' ops go to no mode below (the capture's)
                self._after(func, args, kwargs, out, tensors, seen, deps)
        except Exception as err:  # noqa: BLE001 - bookkeeping never breaks the model; its sites are refused
            self.errors.append(f"{op_name(func)}: {type(err).__name__}: {err}")
            for t, _, _ in seen:
                self._poison(t, f"probe could not follow {op_name(func)} ({type(err).__name__}: {err})")
        self._ops += 1
        if self._ops % 4096 == 0:
            self._sweep()
        return out

    def _after(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any, tensors: List[Tensor],
               seen: List[Tuple[Tensor, Entry, int]], deps: FrozenSet[int]) -> None:
        name = op_name(func)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, Tensor)]
        if not outs and name in META:
            return
        changed = [(t, e) for t, e, v in seen if t._version != v]
        if changed:
            self._in_place(func, args, changed, tensors, deps)
            return
        if not outs:  # ``untraced[idx] = traced``, ``.item()``, ``.tolist()``: the values leave the trace
            if seen:
                self._use(seen, name)
            return
        source = self._source(func, args, kwargs, out)
        for o in outs:
            self._mark(self._deps, o, deps | ({source.id} if source is not None else frozenset()))
        if source is not None:
            self._use(seen, name)  # a projection of a traced tensor reads it
            return
        mine = {storage_key(t) for t, _, _ in seen}
        fresh = [o for o in outs if storage_key(o) not in mine]
        if not seen:  # an untraced result of untraced tensors: keep the first reason given
            why = next((w for w in (self.why(t) for t in tensors) if w is not None), None)
            if why is not None:
                for o in fresh:
                    self._mark(self._why, o, why)
            return
        if not fresh:
            return  # views of traced storages read their shadows at their own strides
        why = self._copy(func, args, kwargs, fresh[0], seen) if len(outs) == 1 else NOT_MODELLED.format(op=name)
        if why is None:
            return
        self._use(seen, name)
        for o in fresh:
            self._mark(self._why, o, why)

    def _use(self, seen: List[Tuple[Tensor, Entry, int]], name: str) -> None:
        event = next(self._events)
        for t, entry, _ in seen:
            entry.source.uses.append(Use(event, name, entry.modulus, entry.dense,
                                          (tuple(t.shape), t.stride(), t.storage_offset())))

    # -- answers --------------------------------------------------------------------------------
    def resolve(self, call: AttentionCall, module: Optional[nn.Module] = None) -> Union[Pending, Refusal]:
        """The rows ``call``'s q and k (``(B, H, L, d)``, ``(B, Hk, S, d)``) scale with, to be
        confirmed by :meth:`finish`; call it while the call's tensors are alive. ``module``: the
        one that issued it (an ``nn.MultiheadAttention`` is resolved from its layout)."""
        found_mha = mha_site(module, call, self._new_source, Pending, Refusal)
        if found_mha is not None:
            return found_mha
        if call.scale is None:
            return Refusal("its eager scores were changed by an op probe does not model (scale unknown)")
        if call.head_dim is not None:
            return Refusal("heads are mixed before the softmax (talking heads)")
        found = []
        for role, t in (("q", call.q), ("k", call.k)):
            traced = self._shadow(role, t, call)
            if isinstance(traced, Refusal):
                return traced
            found.append((role, t, *traced))
        sources = {entry.source.id for _, _, entry, _ in found}
        heads = {}
        for role, t, entry, shadow in found:
            if entry.mult & sources:
                return Refusal(f"{role} is multiplied by a tensor computed from the site's own projections")
            grouped = self._heads(role, shadow, entry)
            if isinstance(grouped, Refusal):
                return grouped
            heads[role] = grouped
        (_, _, eq, _), (_, _, ek, _) = found
        (q_of, _), (k_of, k_group) = heads["q"], heads["k"]
        if eq.source is ek.source and bool(((q_of >= 0) & (k_of >= 0)).any()):
            return Refusal(f"q and k read the same entries of {eq.source.name}.{eq.source.weight}")
        h, hk = call.q.shape[1], call.k.shape[1]
        kv_of = k_group[torch.arange(h) // (h // hk)]  # the kv head (group of identical record heads) of each q head
        path = f"q: {' -> '.join(eq.ops)}; k: {' -> '.join(ek.ops)}"
        return Pending(eq.source, ek.source, q_of, k_of, path, kv_of)

    def _shadow(self, role: str, t: Tensor, call: AttentionCall) -> Union[Tuple[Entry, Tensor], Refusal]:
        """The entry and features of the recorded ``t``: read at its strides when it is a view of a
        traced storage; else, when the front end recorded a tensor of its own (q with its factor
        taken out, a repeated k collapsed, heads unfolded from the batch), through
        ``call.grad_of[role]``: the model's own tensor and the linear map from it to the record."""
        entry = self._entry(t)
        if entry is not None:
            return entry, entry.shadow(t)
        own = (call.grad_of or {}).get(role)
        if own is not None and self._entry(own[0]) is not None:
            base = self._entry(own[0])
            mapped = through(own[1], base.shadow(own[0]), tuple(t.shape))
            if mapped is not None:
                return base, mapped
        why = self.why(t) or (self.why(own[0]) if own is not None else None)
        return Refusal(f"{role} is not traced to one parameter's rows: "
                       f"{why or 'it is not a view or known copy of a projection output'}")

    def finish(self, pending: Union[Pending, Refusal]) -> Result:
        """Confirm a resolved site once the forward ended: every read of its rows was the
        attention call, and its parameters are its own and used once."""
        if isinstance(pending, Refusal):
            return pending
        refusal = self._check_uses(pending)
        if refusal is not None:
            return refusal
        for source in dict.fromkeys((pending.q, pending.k)):
            module = source.module()
            if module is None:
                return Refusal(f"{source.name} no longer exists")
            for attr in filter(None, (source.weight, source.bias)):
                param = module._parameters.get(attr)
                if param is None:
                    return Refusal(f"{source.name}.{attr} is not a registered parameter")
                if len(self._owners.get(id(param), [])) > 1 or id(param) in self._shared:
                    return Refusal(f"{source.name}.{attr} is tied to another module's parameter")
                if self._param_uses.get(id(param), 0) > 1:
                    return Refusal(f"{source.name}.{attr} is used by {self._param_uses[id(param)]} calls between "
                                   "two optimizer steps (weights shared across layers, or a module called again)")
        return SiteProvenance(self._rows(pending.q, pending.q_of), self._rows(pending.k, pending.k_of), pending.path,
                              pending.kv_of)

    def _rows(self, source: Source, head_of: Tensor) -> Rows:
        return Rows(source.module, source.name, source.weight, source.bias, source.layout, source.features, head_of)

    def _heads(self, role: str, shadow: Tensor, entry: Entry) -> Union[Tuple[Tensor, Tensor], Refusal]:
        """For the features ``shadow`` of a ``(B, H, n, d)`` record: the head of each source feature
        (-1: none), closed over the features mixed with them (rotary pairs), and the head of each
        record head. Record k heads reading the very same features are one kv head (a k repeated
        per query head: ``repeat_interleave``, a broadcast); otherwise a feature read by two
        heads is refused."""
        what = f"{entry.source.name}.{entry.source.weight}"
        if bool((shadow < 0).any()):
            return Refusal(f"part of {role} is not a multiple of entries of {what}")
        heads, features = shadow.shape[1], entry.source.features
        sets = [torch.unique(shadow[:, h]) for h in range(heads)]
        group = list(range(heads))
        if role == "k":  # identical record heads: copies of one kv head
            for h in range(heads):
                group[h] = next(g for g in range(h + 1) if torch.equal(sets[g], sets[h]))
        distinct = sorted(set(group))
        index = {g: i for i, g in enumerate(distinct)}
        feature = torch.cat([sets[g] for g in distinct])
        if torch.unique(feature).numel() != feature.numel():
            return Refusal(f"an entry of {what} feeds several {role} heads (a QK-norm gain shared by every head "
                           "cannot clip one head)")
        head_of = torch.full((features,), -1, dtype=torch.long)
        for g in distinct:
            head_of[sets[g]] = index[g]
        of_record = torch.tensor([index[g] for g in group], dtype=torch.long)
        if not entry.source.pairs:
            return head_of, of_record
        pairs = torch.cat(entry.source.pairs)
        while True:  # rotations mix features within a head: the mixed features belong to it
            a, b = head_of[pairs[:, 0]], head_of[pairs[:, 1]]
            if bool(((a >= 0) & (b >= 0) & (a != b)).any()):
                return Refusal(f"an op mixes entries of {what} across {role} heads")
            grow = (a >= 0) != (b >= 0)
            if not bool(grow.any()):
                return head_of, of_record
            head_of[pairs[grow & (a >= 0), 1]] = a[grow & (a >= 0)]
            head_of[pairs[grow & (b >= 0), 0]] = b[grow & (b >= 0)]

    def _check_uses(self, pending: Pending) -> Optional[Refusal]:
        """Every read of q's and k's rows is one op (the attention call), each of its operands
        reading q's rows only or k's rows only."""
        roles = {"q": (pending.q, pending.q_of), "k": (pending.k, pending.k_of)}
        events: Dict[int, str] = {}
        for source in dict.fromkeys((pending.q, pending.k)):
            mine = {role: of for role, (s, of) in roles.items() if s is source}
            for use in source.uses:
                feats = use.features()
                touched = [role for role, of in mine.items() if bool((of[feats] >= 0).any())]
                if not touched:
                    continue
                if len(touched) > 1 or not bool((mine[touched[0]][feats] >= 0).all()):
                    return Refusal(f"{use.op} reads rows of {source.name}.{source.weight} that feed "
                                   f"{' and '.join(touched)} together with other rows")
                events[use.event] = use.op
        if len(events) > 1:
            ops = ", ".join(sorted(set(events.values())))
            return Refusal(f"the rows of q or k are read by {len(events)} ops ({ops}), "
                           "not only by the attention call")
        return None

