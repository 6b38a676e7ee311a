"""torch.compile under probe: sampled steps run eagerly and report eager's statistics exactly;
unsampled steps run the compiled code; unsupported setups warn or fail, never stay silent."""

from __future__ import annotations

import warnings
from typing import List

import numpy as np
import pytest
import torch
import torch._dynamo
from torch import nn

import probe
from tests.helpers import SDPAModel


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    assert torch._dynamo.eval_frame._stance.stance == "default"  # probe left the stance as it found it


def _model() -> SDPAModel:
    torch.manual_seed(0)
    return SDPAModel(layers=2, heads=4, kv_heads=2, causal=True)


def _batches(n: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 7, 64, generator=g) for _ in range(n)]


def _eager_reference(batches: List[torch.Tensor]) -> probe.Summary:
    model = _model()
    with probe.watch(model) as p:
        for x in batches:
            model(x).square().sum().backward()
    return p.summary()


def _assert_equal(got: probe.Summary, want: probe.Summary) -> None:
    assert got.sites == want.sites
    for site in want.sites:
        assert got.metrics(site) == want.metrics(site)
        for metric in want.metrics(site):
            for scale in want.scales(site, metric):
                np.testing.assert_allclose(got.value(site, metric, scale), want.value(site, metric, scale),
                                           rtol=1e-6, err_msg=f"{site} {metric}@{scale}")
        assert got.info(site)["calls"] == want.info(site)["calls"]


class _CountingBackend:
    """A Dynamo backend that runs the graph as is and counts its runs (to see compiled steps)."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        def run(*args):
            self.runs += 1
            return gm.forward(*args)

        return run


def test_watch_inductor_compiled_module_equals_eager():
    # Inference only and one compile thread: inductor's C++ build of a training graph takes
    # minutes on a shared 2-core runner; the forward graph shows the same thing. The thread count
    # is set with inductor's own config.patch: on torch 2.6, pytest's monkeypatch.setattr on its
    # config module hides the option for the rest of the process when it restores it, and every
    # later compile then fails with "torch._inductor.config.compile_threads does not exist".
    import torch._inductor.config

    batches = _batches(3)
    model = _model()
    with torch.no_grad(), torch._inductor.config.patch(compile_threads=1):
        with probe.watch(model) as p:
            for x in batches[0::2]:
                model(x)
        reference = p.summary()
        compiled = torch.compile(model, backend="inductor")
        with probe.watch(compiled, every=2) as p:
            outs = [compiled(x) for x in batches]
    _assert_equal(p.summary(), reference)
    np.testing.assert_allclose(outs[1], model(batches[1]).detach(), rtol=1e-4, atol=1e-5)  # step 1 ran compiled


def test_watch_compiled_module_equals_eager():
    batches = _batches(4)
    reference = _eager_reference(batches[0::2])  # every=2 probes steps 0 and 2
    counting = _CountingBackend()
    model = _model()
    compiled = torch.compile(model, backend=counting)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no probe warning on the supported path
        with probe.watch(compiled, every=2) as p:
            for x in batches:
                compiled(x).square().sum().backward()
    summary = p.summary()
    assert summary.sites == ["layers.0", "layers.1"]  # no `_orig_mod.` prefix
    _assert_equal(summary, reference)
    assert "grad_q" in summary.metrics("layers.0")
    assert counting.runs == 2  # steps 1 and 3 ran the compiled graph, steps 0 and 2 ran eagerly


@pytest.mark.parametrize("how", ["compile_after_watch", "compiled_step"])
def test_root_compiled_after_watch_warns_then_probes_later_sampled_steps(how):
    batches = _batches(5)
    reference = _eager_reference(batches[2::2])  # steps 2 and 4; step 0 is skipped with a warning
    model = _model()
    p = probe.watch(model, every=2)
    if how == "compile_after_watch":
        run = torch.compile(model, backend="eager")
    else:
        run = torch.compile(lambda x: model(x), backend="eager")
    with pytest.warns(UserWarning, match="step 0 was sampled but the model's root forward already runs compiled"):
        run(batches[0]).square().sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning only
        for x in batches[1:]:
            run(x).square().sum().backward()
        p.close()
    _assert_equal(p.summary(), reference)
    assert p.summary().steps == 2


@pytest.mark.parametrize("fullgraph", [False, True])
def test_module_compile_after_watch_compiles_the_forward_and_is_probed_from_step_0(fullgraph):
    """``model.compile()`` on a watched root compiles its forward: probe's hooks stay out of the
    graph, so step 0 is probed and ``fullgraph=True`` works (it died on the hooks' graph break)."""
    batches = _batches(4)
    reference = _eager_reference(batches[0::2])
    model = _model()
    counting = _CountingBackend()
    own = nn.Module.compile
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=2) as p:
            model.compile(backend=counting, fullgraph=fullgraph)
            for x in batches:
                model(x).square().sum().backward()
    assert not [w for w in caught if str(w.message).startswith("probe:")]  # nothing skipped
    _assert_equal(p.summary(), reference)
    assert counting.runs == 2  # steps 1 and 3 ran the compiled forward, steps 0 and 2 eagerly
    assert nn.Module.compile is own  # put back at close


def test_a_module_class_with_its_own_compile_keeps_it():
    """Keras models (torch backend) define ``compile(optimizer, loss)``: probe leaves it alone."""
    class Trainable(SDPAModel):
        def compile(self, optimizer=None, loss=None):
            self.configured = (optimizer, loss)

    model = Trainable(layers=2, heads=4, kv_heads=2, causal=True)
    with probe.watch(model):
        model.compile(optimizer="sgd", loss="mse")
    assert model.configured == ("sgd", "mse")


def test_module_compiled_in_place_before_watch_is_probed_from_step_0():
    batches = _batches(3)
    reference = _eager_reference(batches[0::2])
    model = _model()
    model.compile(backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=2) as p:
            for x in batches:
                model(x).square().sum().backward()
    assert not [w for w in caught if str(w.message).startswith("probe:")]  # nothing skipped
    _assert_equal(p.summary(), reference)


def test_compiled_submodule_runs_eagerly_on_sampled_steps():
    batches = _batches(2)
    reference = _eager_reference(batches)
    model = _model()
    model.layers[1] = torch.compile(model.layers[1], backend="eager")
    with probe.watch(model) as p:
        for x in batches:
            model(x).square().sum().backward()
    _assert_equal(p.summary(), reference)


def test_torchscript_is_refused_or_reported():
    model = _model()
    x = _batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's own tracer warnings
        traced = torch.jit.trace(model, x)
    with pytest.raises(probe.ProbeError, match="got a TorchScript"):
        probe.watch(traced)
    holder = nn.Sequential(traced)
    with pytest.warns(UserWarning, match="TorchScript sub-modules 0 is invisible"):
        p = probe.watch(holder)
    with pytest.warns(UserWarning, match="step 0 was sampled but no attention call was captured"):
        holder(x)
    p.close()
    assert p.summary().sites == []


def test_nested_probes_restore_the_compiler_stance():
    """Nested probes leave their forward hooks in registration order, not stack order: the
    shared force_eager stance must still be restored to what it was."""
    model = _model()
    outer = probe.watch(model)
    with probe.watch(model):
        model(torch.randn(1, 4, 64))
        assert torch._dynamo.eval_frame._stance.stance == "default"
    outer.close()
    assert torch._dynamo.eval_frame._stance.stance == "default"
