"""A call's mask in the form the fast paths take: boolean, and causal plus key padding where it is.

Eager attention (Hugging Face's ``attn_implementation="eager"``, GPT-2, BERT, Llama, ...) adds
its mask to the logits as a float tensor: 0 where a key is attended, ``finfo.min`` or ``-inf``
where it is not. Recorded as an additive ``bias``, such a call would take the general path
(:mod:`probe.stats.general`), about twice the cost of the shifted and centred paths. A bias
whose every entry is 0 or at most :data:`~probe.stats.chunks.MASK_BIAS` adds nothing to a
valid logit and removes the others: it *is* a mask, and :func:`simplify` records it as one.

Hugging Face also passes causality and padding as one ``(B, 1, L, S)`` mask (SDPA with
``is_causal=False``, eager as a bias). :func:`simplify` turns a mask that is the causal
pattern and/or key padding (:func:`~probe.stats.moments.key_validity`) into ``causal=True``
and a ``(b, h, 1, S)`` key mask, so the statistics trim each causal chunk at its last query
(about half the work) and no chunk indexes the ``L × S`` mask.

Both readings are exact: the statistics see the same valid entries and the same logits. They
need the verdict on the host, so they run on CPUs only (elsewhere reading it would synchronize)
and once per mask: every layer of a model receives the same one, and the verdict is kept, with
weak references, for as long as that mask lives and is unchanged.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from probe.call import AttentionCall
from probe.stats.chunks import MASK_BIAS
from probe.stats.moments import key_validity

__all__ = ["simplify"]

# Verdicts per mask, most recent last: an encoder-decoder passes two or three masks in turn.
# A front end may hand each layer its own alias of the model's one mask (a detached tensor: the
# same memory, another object), so an entry is keyed by the memory it reads (address, shape,
# strides, dtype) and holds weak references to the aliases it has seen: while one of them lives
# that memory cannot belong to another tensor, and the version counter (shared by aliases)
# tells an in-place change. The entry dies with its last alias.
_MAX_ENTRIES = 8
_Verdict = Tuple[bool, Optional[Tensor], bool]  # (simplified, key mask (b, h, 1, S) or None, causal)


class _Entry:
    __slots__ = ("refs", "check", "value")

    def __init__(self, check: tuple, value) -> None:
        self.refs: list = []
        self.check = check
        self.value = value


_CACHE: "OrderedDict[tuple, _Entry]" = OrderedDict()


def _where(t: Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _check(t: Tensor, causal: bool, length: int, keys: int) -> tuple:
    return (t._version, causal, length, keys)


def _watch(entry: _Entry, key: tuple, t: Tensor) -> None:
    """Hold a weak reference to ``t`` in ``entry`` (once per object)."""
    if any(ref() is t for ref in entry.refs):
        return

    def forget(ref: "weakref.ref", key: tuple = key, entry: _Entry = entry) -> None:
        if ref in entry.refs:
            entry.refs.remove(ref)
        if not entry.refs and _CACHE.get(key) is entry:
            del _CACHE[key]

    entry.refs.append(weakref.ref(t, forget))


def _cached(t: Tensor, check: tuple):
    key = _where(t)
    entry = _CACHE.get(key)
    if entry is not None and entry.check == check and any(ref() is not None for ref in entry.refs):
        _CACHE.move_to_end(key)
        _watch(entry, key, t)
        return True, entry.value
    return False, None


def _store(t: Tensor, check: tuple, value) -> None:
    key = _where(t)
    entry = _CACHE[key] = _Entry(check, value)
    _CACHE.move_to_end(key)
    _watch(entry, key, t)
    while len(_CACHE) > _MAX_ENTRIES:
        _CACHE.popitem(last=False)


def bias_mask(bias: Tensor) -> Optional[Tensor]:
    """``bias > MASK_BIAS`` (True = attend) when every entry of ``bias`` is 0 or at most
    ``MASK_BIAS`` (a float mask), else ``None``. NaN and ``+inf`` entries are not masks."""
    valid = ~(bias <= MASK_BIAS)  # NaN: not masked (it reaches the logits, and nonfinite)
    if not bool(torch.where(valid, bias == 0, True).all()):
        return None
    return valid


def _key_mask(call: AttentionCall) -> _Verdict:
    """(simplified, key mask, causal) of a call with a boolean mask and no bias."""
    supported, valid, causal = key_validity(call)
    if not supported:
        return False, None, call.causal
    if valid is None or bool(valid.all()):
        return True, None, causal
    return True, valid.unsqueeze(-2).clone(), causal  # (b, h, 1, S): not a view of the big mask


def simplify(call: AttentionCall) -> AttentionCall:
    """The same computation with a float bias that only masks as a boolean mask, and a causal /
    key-padding mask as ``causal`` plus a ``(b, h, 1, S)`` key mask (module docstring). Calls on
    other devices, with a genuine bias, or whose mask is neither, come back unchanged (or with
    the bias as a boolean mask)."""
    if call.q.device.type != "cpu" or (call.bias is None and call.mask is None):
        return call
    length, keys = call.q.shape[2], call.k.shape[2]
    if call.bias is not None:
        bias = call.bias
        check = _check(bias, call.causal, length, keys)
        hit, value = _cached(bias, check)
        if not hit:
            converted = bias_mask(bias)
            value = None
            if converted is not None:
                as_mask = dataclasses.replace(call, bias=None, mask=converted)
                ok, keymask, causal = _key_mask(as_mask) if call.mask is None else (False, None, call.causal)
                value = (True, keymask, causal) if ok else converted
            _store(bias, check, value)
        if value is None:
            return call  # a genuine bias
        if isinstance(value, Tensor):  # a mask, but neither causal nor key padding (or with a
            mask = value if call.mask is None else call.mask & value  # boolean mask besides: rare)
            return dataclasses.replace(call, bias=None, mask=mask)
        _, keymask, causal = value
        return dataclasses.replace(call, bias=None, mask=keymask, causal=causal)
    mask = call.mask
    assert mask is not None
    if mask.dim() == 4 and mask.shape[-2] == 1 and mask.shape[-1] == keys:
        return call  # already a key mask
    check = _check(mask, call.causal, length, keys)
    hit, value = _cached(mask, check)
    if not hit:
        value = _key_mask(call)
        _store(mask, check, value)
    ok, keymask, causal = value  # type: ignore[misc]
    if not ok:
        return call
    return dataclasses.replace(call, mask=keymask, causal=causal)
