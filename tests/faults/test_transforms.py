"""PyTorch's transforms over a watched model (issue 26, faults 1 and 4): torch.jit.trace,
SummaryWriter.add_graph, torch.export, torch.func.grad, vmap(grad(functional_call)), FakeTensorMode
and meta-device forwards. probe steps aside for such a forward: the model runs as without probe
(same result), one warning names what was skipped, and no statistic or step is touched; the run
goes on and closes with its summary on disk."""

from __future__ import annotations

import copy
import json
import os
import warnings

import pytest
import torch

import probe
from probe.summary import SUMMARY_FILE
from tests.helpers import SDPAModel


def _jit_trace(model, x):
    return torch.jit.trace(model, x)(x)


def _add_graph(model, x, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "graph")) as writer:
        writer.add_graph(model, x)
    return None


def _export(model, x):
    return torch.export.export(model, (x,)).module()(x)


def _export_strict(model, x):
    return torch.export.export(model, (x,), strict=True).module()(x)


def _grad(model, x):
    from torch.func import functional_call, grad

    params = {k: v.detach() for k, v in model.named_parameters()}
    return grad(lambda p: functional_call(model, p, (x,)).square().sum())(params)


def _per_sample_grads(model, x):
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi):
        return functional_call(model, p, (xi[None],)).square().sum()

    return vmap(grad(loss), in_dims=(None, 0))(params, x)


def _fake(model, x):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        return tuple(model(mode.from_tensor(x)).shape)


TRANSFORMS = {
    "jit_trace": (_jit_trace, "torch.jit.trace"),
    "add_graph": (_add_graph, "torch.jit.trace"),
    "export": (_export, "torch.export"),
    "export_strict": (_export_strict, "torch.export"),
    "func_grad": (_grad, "torch.func"),
    "vmap_grad": (_per_sample_grads, "torch.func"),
    "fake_tensor_mode": (_fake, "FakeTensorMode"),
}


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _train(model, x, steps):
    for _ in range(steps):
        model.zero_grad()
        model(x).square().sum().backward()


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_probe_steps_aside_for_a_transform(name, every, tmp_path):
    transform, named = TRANSFORMS[name]
    model = SDPAModel(layers=1)
    x = torch.randn(2, 5, 64)
    bare = copy.deepcopy(model)
    args = (tmp_path,) if name == "add_graph" else ()
    expected = transform(bare, x, *args)

    p = probe.watch(model, logdir=str(tmp_path / "run"), every=every)
    _train(model, x, 3)
    before = p.summary().to_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = transform(model, x, *args)
    assert _same(got, expected)  # the model ran as without probe
    mine = [str(w.message) for w in caught if str(w.message).startswith("probe:")]
    if name == "export_strict":
        # Dynamo traces probe's hooks and discards their side effects, the warning too: probe
        # did nothing, there is nothing to say (docs/guarantees.md)
        assert mine == []
    else:
        assert len(mine) == 1 and named in mine[0] and "stepped aside" in mine[0], mine
    assert p.summary().to_dict() == before  # nothing measured, no step counted
    assert p.current_step == 2

    _train(model, x, 1)  # the run goes on: step 3
    p.close()
    with open(tmp_path / "run" / SUMMARY_FILE) as f:
        saved = json.load(f)
    assert saved["steps"] == (4 if every == 1 else 2)
    assert saved["meta"]["last_step"] == (3 if every == 1 else 2)


def test_a_meta_device_forward_is_not_measured(tmp_path):
    """Shape inference on meta tensors before the weights exist (to_empty), then training."""
    with torch.device("meta"):
        model = SDPAModel(layers=1)
    p = probe.watch(model, logdir=str(tmp_path))
    with pytest.warns(UserWarning, match="meta-device tensors; probe stepped aside"):
        out = model(torch.randn(2, 5, 64, device="meta"))
    assert out.is_meta
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    _train(model, torch.randn(2, 5, 64), 2)
    p.close()
    summary = probe.Summary.load(os.path.join(str(tmp_path), SUMMARY_FILE))
    assert summary.steps == 2 and summary.sites == ["layers.0"]


def test_a_transform_inside_a_training_forward_keeps_probe_state():
    """add_graph of the model every step, as some training scripts log it: each step still
    counts once and the graph is written."""
    model = SDPAModel(layers=1)
    x = torch.randn(2, 5, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with probe.watch(model) as p:
            for _ in range(3):
                torch.jit.trace(model, x, check_trace=False)
                _train(model, x, 1)
    assert p.summary().steps == 3


@pytest.mark.parametrize("name", ["func_grad", "vmap_grad", "fake_tensor_mode", "jit_trace"])
def test_a_transform_inside_a_recorded_window_is_not_measured(name):
    """A training step recorded whole (p.step(n, window=True), as the Lightning callback does)
    that also computes per-sample gradients, or traces the model: the transform's attention calls
    are not measured, the step's own are, one warning names the transform."""
    transform, named = TRANSFORMS[name]
    model = SDPAModel(layers=1)
    x = torch.randn(2, 5, 64)
    expected = transform(copy.deepcopy(model), x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, audit=False) as p:
            p.step(0, window=True)
            got = transform(model, x)
            _train(model, x, 1)
    assert _same(got, expected)
    mine = [str(w.message) for w in caught if str(w.message).startswith("probe:")]
    assert len(mine) == 1 and named in mine[0], mine
    assert p.summary().steps == 1 and p.summary().info("layers.0")["calls"] == 1


def test_a_transformed_call_of_the_root_inside_its_own_forward_does_not_end_it():
    """The root calls itself under torch.func.vmap from inside its forward (depth bookkeeping)."""

    class SelfCalling(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = SDPAModel(layers=1)
            self.nested = False

        def forward(self, x):
            if self.nested:
                return self.inner(x)
            self.nested = True
            try:
                torch.func.vmap(lambda xi: self(xi[None])[0])(x)  # stepped aside
            finally:
                self.nested = False
            return self.inner(x)  # still this forward's: captured

    model = SelfCalling()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            model(torch.randn(2, 5, 64)).sum().backward()
    assert [str(w.message) for w in caught if "stepped aside" in str(w.message)]
    assert p.summary().steps == 1 and p.summary().info("inner.layers.0")["calls"] == 1
