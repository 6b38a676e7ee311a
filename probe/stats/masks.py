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
and once per mask tensor: every layer of a model receives the same one, and the verdict is kept,
with a weak reference, for as long as that tensor lives and is unchanged.
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

# Verdicts per source tensor (a bias or a mask), most recent last: an encoder-decoder passes
# two or three masks in turn. Each entry dies with its tensor (the weak reference's callback).
_MAX_ENTRIES = 8
_Verdict = Tuple[bool, Optional[Tensor], bool]  # (simplified, key mask (b, h, 1, S) or None, causal)
_CACHE: "OrderedDict[int, Tuple[weakref.ref, tuple, Union[_Verdict, Tensor, None]]]" = OrderedDict()


def _key(t: Tensor, causal: bool, length: int, keys: int) -> tuple:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t._version, causal, length, keys)


def _cached(t: Tensor, key: tuple):
    entry = _CACHE.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] == key:
        _CACHE.move_to_end(id(t))
        return True, entry[2]
    return False, None


def _store(t: Tensor, key: tuple, value) -> None:
    ident = id(t)

    def forget(ref: "weakref.ref", ident: int = ident) -> None:
        entry = _CACHE.get(ident)
        if entry is not None and entry[0] is ref:
            del _CACHE[ident]

    _CACHE[ident] = (weakref.ref(t, forget), key, value)
    _CACHE.move_to_end(ident)
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
        key = _key(bias, call.causal, length, keys)
        hit, value = _cached(bias, key)
        if not hit:
            converted = bias_mask(bias)
            value = None
            if converted is not None:
                as_mask = dataclasses.replace(call, bias=None, mask=converted)
                ok, keymask, causal = _key_mask(as_mask) if call.mask is None else (False, None, call.causal)
                value = (True, keymask, causal) if ok else converted
            _store(bias, key, value)
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
    key = _key(mask, call.causal, length, keys)
    hit, value = _cached(mask, key)
    if not hit:
        value = _key_mask(call)
        _store(mask, key, value)
    ok, keymask, causal = value  # type: ignore[misc]
    if not ok:
        return call
    return dataclasses.replace(call, mask=keymask, causal=causal)
