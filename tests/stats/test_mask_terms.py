"""The centred path's mask-derived terms are computed once per mask, not once per call.

Every layer of a forward passes the same mask, so ``masks.mask_terms`` keeps an earlier call's
(the weights, the valid-key counts per row, the key bias) and gives them to the next call whose
mask is the same unchanged memory seen the same way. These tests check that the kept terms are
never the wrong ones: a mask changed in place, a new mask in the freed memory of the old one, a
mask seen through another view, other shapes or causality all compute them again, and the
statistics equal those of calls that never share them.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from probe.call import AttentionCall
from probe.stats.forward import forward_stats
from probe.stats import masks


def _stats(call):
    return forward_stats(call, {"actual": call.scale, "unscaled": 1.0})


def _forget():
    masks._TERMS.clear()
    masks._unmasked_terms.cache_clear()


def _fresh(call):
    _forget()
    return _stats(call)


def _equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, equal_nan=True, msg=key)


def _qkv(seed, b=2, h=4, l=24, d=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, l, d, generator=g) for _ in range(3))


def _padding(b=2, l=24, pad=(0, 6)):
    mask = torch.ones(b, 1, 1, l, dtype=torch.bool)
    for row, count in enumerate(pad):
        if count:
            mask[row, ..., l - count:] = False
    return mask


@pytest.mark.parametrize("causal", [False, True])
def test_calls_sharing_a_mask_get_the_values_of_calls_that_do_not(causal):
    mask = _padding()
    calls = [AttentionCall(q=q, k=k, v=v, scale=0.35, mask=mask[..., :], causal=causal)  # a new view each
             for q, k, v in (_qkv(s) for s in range(3))]
    alone = [_fresh(c) for c in calls]
    _forget()
    shared = [_stats(c) for c in calls]
    assert masks._TERMS  # the centred path ran and kept them
    for a, b in zip(shared, alone):
        _equal(a, b)


def test_a_mask_changed_in_place_is_read_again():
    q, k, v = _qkv(1)
    mask = _padding()
    _stats(AttentionCall(q=q, k=k, v=v, scale=0.35, mask=mask))
    mask[0, ..., 10:] = False  # the first row padded too: the same memory, a new version
    got = _stats(AttentionCall(q=q, k=k, v=v, scale=0.35, mask=mask))
    _equal(got, _fresh(AttentionCall(q=q, k=k, v=v, scale=0.35, mask=mask.clone())))
    assert got["rows"].sum() > 0


def test_a_new_mask_in_the_old_ones_memory_is_read_again():
    """Two masks over the same memory, one after the other, both unchanged since made (version
    0): the first one's storage is gone when the second comes, which only the kept weak
    reference tells (NumPy holds the memory, so the pointer is the same for certain)."""
    q, k, v = _qkv(2)
    memory = np.ones((2, 1, 1, 24), dtype=bool)
    memory[1, ..., 18:] = False
    first = torch.from_numpy(memory)
    _stats(AttentionCall(q=q, k=k, v=v, scale=0.35, mask=first))
    pointer = first.data_ptr()
    del first
    gc.collect()
    memory[:] = True
    memory[0, ..., 4:] = False  # other contents, written by NumPy: no torch version moved
    second = torch.from_numpy(memory)
    assert second.data_ptr() == pointer and second._version == 0
    got = _stats(AttentionCall(q=q, k=k, v=v, scale=0.35, mask=second))
    _equal(got, _fresh(AttentionCall(q=q, k=k, v=v, scale=0.35, mask=second.clone())))


def test_the_same_memory_seen_otherwise_is_read_again():
    """A view of another shape, or the same mask for a call of other shapes, causal or not."""
    mask = _padding(l=24)
    q, k, v = _qkv(3)
    _stats(AttentionCall(q=q, k=k, v=v, scale=0.35, mask=mask))
    short = mask[..., :16]  # the same storage and pointer, fewer keys
    q2, k2, v2 = (t[:, :, :16] for t in (q, k, v))
    got = _stats(AttentionCall(q=q2, k=k2, v=v2, scale=0.35, mask=short))
    _equal(got, _fresh(AttentionCall(q=q2, k=k2, v=v2, scale=0.35, mask=short.clone())))
    got = _stats(AttentionCall(q=q, k=k, v=v, scale=0.35, mask=mask, causal=True))
    _equal(got, _fresh(AttentionCall(q=q, k=k, v=v, scale=0.35, mask=mask.clone(), causal=True)))
    q3, k3, v3 = _qkv(4, h=2)  # fewer heads, the same mask
    got = _stats(AttentionCall(q=q3, k=k3, v=v3, scale=0.35, mask=mask))
    _equal(got, _fresh(AttentionCall(q=q3, k=k3, v=v3, scale=0.35, mask=mask.clone())))
