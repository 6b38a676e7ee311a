"""A watched model can be deep-copied, pickled and torch.save'd (EMA copies, whole-model
checkpoints); the copy is not watched, the original still is."""

from __future__ import annotations

import copy
import io
import pickle

import torch

import probe
from tests.helpers import SDPAModel


def _hook_count(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_deepcopy_pickle_and_torch_save_of_a_watched_model():
    torch.manual_seed(0)
    model = SDPAModel(layers=1)
    x = torch.randn(2, 4, 64)
    with probe.watch(model) as p:
        model(x).sum().backward()
        ema = copy.deepcopy(model)
        pickled = pickle.loads(pickle.dumps(model))
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for clone in (ema, pickled, loaded):
            torch.testing.assert_close(clone(x), model(x))  # same weights, same output
            assert _hook_count(clone) == 0  # the inert copies of probe's hooks removed themselves
        model(x)
    assert p.summary().steps == 5  # 5 forwards of model; the clones' forwards were not counted
    assert _hook_count(model) == 0
    # a copy taken before close keeps working after it
    torch.testing.assert_close(ema(x), model(x))
