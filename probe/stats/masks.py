"""A call's mask in the form the fast paths take: boolean, and causal plus key padding where it is.

Eager attention (Hugging Face's ``attn_implementation="eager"``, GPT-2, BERT, Llama, ...) adds
its mask to the logits as a float tensor: 0 where a key is attended, ``finfo.min`` or ``-inf``
where it is not. Recorded as an additive ``bias``, such a call would take the general path
(:mod:`probe.stats.paths.general`), about twice the cost of the shifted and centred paths. A bias
whose every entry is 0 or at most :data:`~probe.stats.chunks.MASK_BIAS` adds nothing to a
valid logit and removes the others: it *is* a mask, and :func:`simplify` records it as one.

Hugging Face also passes causality and padding as one ``(B, 1, L, S)`` mask (SDPA with
``is_causal=False``, eager as a bias). :func:`simplify` turns a mask that is the causal
pattern and/or key padding (:func:`row_pattern`) into ``causal=True``
and a ``(b, h, 1, S)`` key mask, so the statistics trim each causal chunk at its last query
(about half the work) and no chunk indexes the ``L × S`` mask.

Both readings are exact: the statistics see the same valid entries and the same logits. They
need the verdict on the host, so they run on CPUs only (elsewhere reading it would synchronize)
and once per mask: every layer of a model receives the same one, and the verdict is kept, with a
weak reference to the mask's memory, for as long as that memory lives and is unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections import OrderedDict
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from probe.call import AttentionCall
from probe.stats.chunks import MASK_BIAS, as_4d

__all__ = ["MaskTerms", "is_mask", "key_validity", "mask_terms", "row_pattern", "simplify"]

# Verdicts per mask, most recent last: an encoder-decoder passes two or three masks in turn.
# A front end may hand each layer its own alias of the model's one mask (a detached tensor: the
# same memory, another object), and the backward's record holds yet another; so an entry is
# keyed by the memory it reads (address, shape, strides, dtype) and holds a weak reference to
# that memory's storage: while it lives the address cannot belong to another tensor, and the
# version counter (shared by aliases) tells an in-place change. Entries whose storage died are
# dropped at the next call.
_MAX_ENTRIES = 8
_Verdict = Tuple[bool, Optional[Tensor], bool]  # (simplified, key mask (b, h, 1, S) or None, causal)

# The last mask key_validity checked for row-independence and the verdict (a weak reference: never
# kept alive).
_CHECKED: Dict[str, Tuple["weakref.ref[Tensor]", tuple, Optional[bool]]] = {}


class _Entry:
    __slots__ = ("ref", "check", "value")

    def __init__(self, ref: StorageWeakRef, check: tuple, value) -> None:
        self.ref = ref
        self.check = check
        self.value = value


_CACHE: "OrderedDict[tuple, _Entry]" = OrderedDict()


def _where(t: Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _check(t: Tensor, causal: bool, length: int, keys: int) -> tuple:
    return (t._version, causal, length, keys)


def _sweep(cache: "OrderedDict[tuple, _Entry]") -> None:
    for key in [key for key, entry in cache.items() if entry.ref.expired()]:
        del cache[key]


def _cached(t: Tensor, check: tuple, cache: "OrderedDict[tuple, _Entry]" = _CACHE):
    _sweep(cache)
    key = _where(t)
    entry = cache.get(key)
    if entry is not None and entry.check == check:
        cache.move_to_end(key)
        return True, entry.value
    return False, None


def _store(t: Tensor, check: tuple, value, cache: "OrderedDict[tuple, _Entry]" = _CACHE) -> None:
    key = _where(t)
    cache[key] = _Entry(StorageWeakRef(t.untyped_storage()), check, value)
    cache.move_to_end(key)
    while len(cache) > _MAX_ENTRIES:
        cache.popitem(last=False)


def key_validity(call: AttentionCall) -> Tuple[bool, Optional[Tensor], bool]:
    """``(supported, valid, causal)``: whether the call's mask is ``None`` or a key-padding mask
    (with causal masking, on the causal part), the valid keys, ``(b, h, S)`` bool with ``b``,
    ``h`` 1 or full (``None``: every key), and whether the call is causal — also when the mask
    holds the causal pattern itself (Hugging Face passes padding and causality as one
    ``(B, 1, L, S)`` mask with ``is_causal=False``). A mask with a row dim is checked on CPUs
    (passes over the bool mask, not over the logits; the verdict is kept for the same unchanged
    tensor, which every layer of a model receives); elsewhere it is unsupported."""
    mask = call.mask
    if mask is None:
        return True, None, call.causal
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.dim() > 4:
        return False, None, call.causal
    length, keys = call.q.shape[2], call.k.shape[2]
    if mask.shape[-2] == 1 or mask.stride(-2) == 0:
        return True, mask[..., 0, :].expand(*mask.shape[:2], keys), call.causal
    if mask.device.type != "cpu":
        return False, None, call.causal
    key = (mask.data_ptr(), mask.shape, mask.stride(), mask._version, call.causal)
    cached = _CHECKED.get("mask")
    if cached is not None and cached[0]() is call.mask and cached[1] == key:
        verdict = cached[2]  # the same mask as the previous call's
    else:
        verdict = row_pattern(lambda r0, r1: mask[..., r0:r1, :], call.causal, length, keys,
                              mask.shape[0] * mask.shape[1] * keys)[0]
        _CHECKED["mask"] = (weakref.ref(call.mask), key, verdict)
    if verdict is None:
        return False, None, call.causal
    # the last row sees every key a causal row can see (keys after it are never valid)
    row = mask[..., -1 if verdict else 0, :]
    return True, row.expand(*mask.shape[:2], keys), verdict


# Bytes of one boolean row block while a mask's pattern is checked: the check's temporaries stay
# a few of these whatever L and S are (a whole-mask comparison took several B·L·S-byte copies).
_PATTERN_BYTES = 2 * 2**20


def row_pattern(rows: Callable[[int, int], Tensor], causal: bool, length: int, keys: int,
                per_row: int) -> Tuple[Optional[bool], Optional[Tensor]]:
    """``(verdict, key row)`` of a mask given by ``rows(r0, r1)`` (bool, ``(b, h, r1 − r0, S)``,
    True = valid): verdict ``False`` when every row is the same (the key row: row 0), ``True``
    when it is the causal (top-left) pattern of its last row's keys (the key row: the last row),
    ``None`` when neither. Checked in blocks of rows of at most ``_PATTERN_BYTES`` (``per_row``:
    the bytes of one row of the block); on the host."""
    step = max(1, _PATTERN_BYTES // max(1, per_row))
    first, last = rows(0, 1), rows(length - 1, length)
    starts = range(0, length, step)
    # every row the same (key padding) first: a padding mask, the common case, then takes one
    # comparison per block, and a causal one fails it at its first block of two or more rows
    if not causal and all(_same_rows(b, first) for b in (rows(r0, min(length, r0 + step)) for r0 in starts)):
        return False, first
    if not (causal or length == keys):
        return None, None
    cols = torch.arange(keys, device=first.device)
    for r0 in starts:
        r1 = min(length, r0 + step)
        block = rows(r0, r1)
        tril = torch.arange(r0, r1, device=block.device).unsqueeze(-1) >= cols
        lhs = block & tril if causal else block
        if not torch.equal(lhs, (last & tril).expand_as(lhs)):
            return None, None
    return True, last


def _same_rows(block: Tensor, row: Tensor) -> bool:
    """Whether every row of ``block`` equals ``row`` (NaN equals nothing). A boolean block whose
    rows are whole 8-byte words is compared a word at a time (measured on BERT's (2, 1, 512, 512)
    mask: 65 us, against 510 us by ``torch.equal`` of the bools and 330 us by broadcasting)."""
    if block.dtype == torch.bool and block.shape[-1] % 8 == 0:
        try:
            words, first = block.view(torch.int64), row.view(torch.int64)
        except RuntimeError:  # a view that does not fall on word boundaries
            pass
        else:
            return torch.equal(words, first.expand_as(words))
    return torch.equal(block, row.expand_as(block))


def _rows_of(t: Tensor, length: int):
    """``rows(r0, r1)`` of a 4-D tensor broadcastable over rows (a row dim of 1 or stride 0)."""
    if t.shape[-2] == 1 or t.stride(-2) == 0:
        row = t[..., :1, :]
        return lambda r0, r1: row.expand(*row.shape[:2], r1 - r0, row.shape[-1])
    return lambda r0, r1: t[..., r0:r1, :]


def is_mask(bias: Tensor) -> bool:
    """Whether every entry of ``bias`` is 0 or at most ``MASK_BIAS`` (NaN and ``+inf`` are not),
    checked in blocks of rows (bounded temporaries)."""
    t = as_4d(bias)
    rows = t.shape[-2]
    step = max(1, _PATTERN_BYTES // max(1, t.shape[0] * t.shape[1] * t.shape[-1]))
    r0, size = 0, 1  # a genuine bias (T5's, ALiBi) shows in its first row: blocks grow from one row
    while r0 < rows:
        block = t[..., r0 : r0 + size, :]
        if not bool((block == 0).logical_or_(block <= MASK_BIAS).all()):
            return False
        r0, size = r0 + size, min(step, 2 * size)
    return True


def _verdict(valid_rows, causal: bool, length: int, keys: int, b: int, h: int) -> Optional[_Verdict]:
    """(True, key mask or None, causal) for a causal and/or key-padding mask given by rows, else None."""
    verdict, row = row_pattern(valid_rows, causal, length, keys, b * h * keys)
    if verdict is None:
        return None
    assert row is not None
    keymask = None if bool(row.all()) else row.clone()  # (b, h, 1, S): not a view of the big mask
    return True, keymask, bool(verdict)


def simplify(call: AttentionCall, budget_bytes: int = 64 * 2**20) -> AttentionCall:
    """The same computation with a float bias that only masks as a boolean mask, and a causal /
    key-padding mask as ``causal`` plus a ``(b, h, 1, S)`` key mask (module docstring). A float
    mask of neither pattern becomes a boolean ``(B, H, L, S)`` mask only when that fits in
    ``budget_bytes``; calls on other devices, with a genuine bias, or whose boolean mask is
    neither pattern come back unchanged. The checks run in blocks of rows: their temporaries
    stay a few MiB at any length."""
    if call.q.device.type != "cpu" or (call.bias is None and call.mask is None):
        return call
    length, keys = call.q.shape[2], call.k.shape[2]
    if call.bias is not None:
        bias = call.bias
        check = _check(bias, call.causal, length, keys) + (budget_bytes,)
        hit, value = _cached(bias, check)
        if not hit:
            value = None  # a genuine bias
            if is_mask(bias):
                t = as_4d(bias)
                if t.shape[-1] == 1 and keys > 1:  # one value for every key (a per-head constant): a view
                    t = t.expand(*t.shape[:-1], keys)
                b, h = t.shape[:2]
                valid_rows = _rows_of(t, length)
                found = (_verdict(lambda r0, r1: valid_rows(r0, r1) > MASK_BIAS, call.causal, length, keys, b, h)
                         if call.mask is None else None)
                if found is not None:
                    value = found
                elif b * h * t.shape[-2] * keys <= budget_bytes:
                    value = t > MASK_BIAS  # a mask of another pattern (or with a boolean mask besides)
            _store(bias, check, value)
        if value is None:
            return call
        if isinstance(value, Tensor):
            mask = value if call.mask is None else call.mask & value
            return dataclasses.replace(call, bias=None, mask=mask)
        _, keymask, causal = value
        return dataclasses.replace(call, bias=None, mask=keymask, causal=causal)
    mask = as_4d(call.mask)  # type: ignore[arg-type]
    if mask.shape[-2] == 1 and mask.shape[-1] == keys:
        return call  # already a key mask
    check = _check(mask, call.causal, length, keys)
    hit, value = _cached(call.mask, check)  # type: ignore[arg-type]
    if not hit:
        value = _verdict(_rows_of(mask, length), call.causal, length, keys, *mask.shape[:2])
        _store(call.mask, check, value)  # type: ignore[arg-type]
    if value is None:
        return call
    _, keymask, causal = value  # type: ignore[misc]
    return dataclasses.replace(call, mask=keymask, causal=causal)


class MaskTerms:
    """What a call's key validity gives the centred path (:mod:`probe.stats.paths.centred`), the
    same for every layer of a forward (one mask for all): ``w`` (``(B, Hk, S)`` float32 weights,
    ``None`` without a mask), ``n`` (``w``, or ones over the keys), ``count`` (each (batch, kv
    head)'s valid keys, at least 1, ``(B, Hk, 1, 1)``), ``rows`` (each row's count of valid keys,
    ``(B, H, L)``) and ``keybias`` (``(b, h, 1, S)``: 0 or ``neg``)."""

    def __init__(self, valid: Optional[Tensor], shape: tuple, device: torch.device, neg: float) -> None:
        batch, kv, keys, length, heads, g, causal = shape
        w = None if valid is None else valid.to(torch.float32).expand(batch, kv, keys)
        n = torch.ones(1, 1, keys, device=device) if w is None else w
        self.w, self.n = w, n
        self.count = None if w is None else w.sum(-1).clamp(min=1)[..., None, None]
        if causal:
            # each row's count of valid keys (rows after the last key: all)
            counts = n.cumsum(-1)
            rows = counts.index_select(-1, torch.arange(length, device=device).clamp(max=keys - 1))
        else:
            rows = n.sum(-1, keepdim=True).expand(*n.shape[:2], length)
        self.rows = rows.unsqueeze(2).expand(batch, kv, g, length).reshape(batch, heads, length)
        self.keybias = None if w is None else torch.where(valid, 0.0, neg).unsqueeze(-2)


# The terms per mask, kept as the verdicts are (_cached, _store: keyed by the memory, a weak
# reference to its storage, the version in the check) in a cache of their own. Every layer of a
# forward passes the same mask (a new view of one storage: Hugging Face's, or simplify's cached key
# mask), and these 12-16 small tensor operations per call (about 10 us each inside a step) then run
# once per mask.
_TERMS: "OrderedDict[tuple, _Entry]" = OrderedDict()


def mask_terms(valid: Optional[Tensor], shape: tuple, device: torch.device, neg: float) -> MaskTerms:
    """:class:`MaskTerms` of ``valid`` (a bool key mask or ``None``) for a call of ``shape``
    ``(batch, kv, keys, length, heads, g, causal)``: an earlier call's when the mask is the same
    unchanged memory seen the same way (its storage alive, its pointer, shape, strides, dtype and
    version equal), else computed."""
    if valid is None:
        return _unmasked_terms(shape, device, neg)
    check = (valid._version, shape, device, neg)
    hit, terms = _cached(valid, check, _TERMS)
    if not hit:
        terms = MaskTerms(valid, shape, device, neg)
        _store(valid, check, terms, _TERMS)
    return terms


@functools.lru_cache(maxsize=_MAX_ENTRIES)
def _unmasked_terms(shape: tuple, device: torch.device, neg: float) -> MaskTerms:
    """:class:`MaskTerms` of a call without a mask (cached: callers must not change them)."""
    return MaskTerms(None, shape, device, neg)
