"""Probe lifecycle: attach, sample, name sites, flush, close; outputs untouched."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import probe
from tests.helpers import SDPAModel, tiny_bert, tiny_llama


def _hooks(model: nn.Module):
    left = []
    for name, m in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(m, attr):
                left.append((name, attr))
    globals_ = [
        d for d in (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks) if d
    ]
    return left, globals_


def _assert_clean(model):
    left, globals_ = _hooks(model)
    assert not left and not globals_, (left, globals_)
    assert not _get_current_function_mode_stack()


def _outputs_and_grads(model, make_inputs, probe_it):
    model.zero_grad(set_to_none=True)
    inputs = make_inputs()
    p = probe.watch(model) if probe_it else None
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    out = out[0] if isinstance(out, tuple) else getattr(out, "logits", getattr(out, "last_hidden_state", out))
    out.float().square().mean().backward()
    grads = [q.grad.clone() for q in model.parameters() if q.grad is not None]
    if p is not None:
        summary = p.summary()
        p.close()
        assert summary.sites, "nothing was captured"
    return out.detach().clone(), grads


@pytest.mark.parametrize(
    "name,factory,inputs",
    [
        ("custom", lambda: SDPAModel(causal=True), lambda: torch.randn(2, 9, 64)),
        ("custom_gqa", lambda: SDPAModel(kv_heads=2), lambda: torch.randn(2, 9, 64)),
        ("bert", tiny_bert, lambda: {"input_ids": torch.randint(0, 64, (2, 9)),
                                     "attention_mask": torch.tensor([[1] * 9, [1] * 6 + [0] * 3])}),
        ("llama", tiny_llama, lambda: {"input_ids": torch.randint(0, 64, (2, 9))}),
    ],
)
def test_outputs_and_gradients_bitwise_identical(name, factory, inputs):
    model = factory()
    torch.manual_seed(3)
    batch = inputs()
    ref_out, ref_grads = _outputs_and_grads(model, lambda: batch, probe_it=False)
    out, grads = _outputs_and_grads(model, lambda: batch, probe_it=True)
    assert torch.equal(out, ref_out)
    assert len(grads) == len(ref_grads)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)
    _assert_clean(model)


def test_site_names_are_qualified_module_names():
    model = tiny_bert()
    with probe.watch(model) as p:
        model(input_ids=torch.randint(0, 64, (1, 5)))
    assert p.summary().sites == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    info = p.summary().info("encoder.layer.0.attention.self")
    assert info.pop("verified") is True and info.pop("verification").startswith("its output, against P·v")
    assert info == {"kind": "sdpa", "heads": 4, "kv_heads": 4, "d_k": 8, "scale": pytest.approx(8**-0.5), "calls": 1}


def test_llama_gqa_sites():
    model = tiny_llama()
    with probe.watch(model) as p:
        model(input_ids=torch.randint(0, 64, (1, 5)))
    s = p.summary()
    assert s.sites == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert s.info(s.sites[0])["kv_heads"] in (2, 4)  # HF may repeat kv heads before SDPA


class TwoCalls(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v) + F.scaled_dot_product_attention(q, k, v, scale=1.0)


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = TwoCalls()

    def forward(self, q, k, v):
        return self.inner(q, k, v) + F.scaled_dot_product_attention(q, k, v)


def test_several_calls_in_one_module_get_suffixes_and_root_calls_are_root():
    q = k = v = torch.randn(1, 2, 4, 8)
    model = Wrapper()
    with probe.watch(model) as p:
        model(q, k, v)
        model(q, k, v)
    s = p.summary()
    assert s.sites == ["inner#1", "inner#2", "root"]
    assert s.info("inner#2")["scale"] == 1.0
    assert s.info("inner#1")["calls"] == 2
    assert s.steps == 2


def test_every_samples_steps_and_step_sets_them():
    model = SDPAModel(layers=1)
    x = torch.randn(1, 4, 64)
    with probe.watch(model, every=3) as p:
        for _ in range(7):  # steps 0..6: 0, 3, 6 sampled
            model(x)
    assert p.summary().steps == 3
    assert p.summary().info("layers.0")["calls"] == 3

    with probe.watch(model, every=2) as p:
        for step in range(4):
            p.step(step)
            model(x)
            model(x)  # two micro-batches per step
    s = p.summary()
    assert s.steps == 2 and s.info("layers.0")["calls"] == 4


def test_unsampled_step_enters_no_mode():
    seen = []

    class Spy(nn.Module):
        def forward(self, x):
            seen.append(len(_get_current_function_mode_stack()))
            return x

    model = Spy()
    with probe.watch(model, every=2, audit=False):  # the audit of the first forward is a mode too
        model(torch.ones(1))
        model(torch.ones(1))
    assert seen == [1, 0]


def test_no_hooks_or_mode_left_after_close_also_when_forward_raises():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = SDPAModel(layers=1)

        def forward(self, x):
            self.attn(x)
            raise RuntimeError("boom")

    model = Boom()
    with pytest.raises(RuntimeError, match="boom"):
        with probe.watch(model) as p:
            model(torch.randn(1, 3, 64))
    _assert_clean(model)
    assert p.summary().sites == ["attn.layers.0"]  # what was captured before the error is kept
    p.close()  # closing twice is harmless
    _assert_clean(model)


def test_nested_probes_each_remove_only_their_own_hooks():
    model = SDPAModel(layers=1)
    x = torch.randn(1, 3, 64)
    outer = probe.watch(model)
    with probe.watch(model) as inner:
        model(x)
    model(x)
    assert inner.summary().info("layers.0")["calls"] == 1
    assert outer.summary().info("layers.0")["calls"] == 2
    outer.close()
    _assert_clean(model)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(every=0), "`every` to be a positive int, got 0"),
        (dict(every=1.5), "`every`"),
        (dict(saturation=1.5), "`saturation`"),
        (dict(scales={"actual": 2.0}), "built in"),
        (dict(scales={"x": "big"}), "scales\\['x'\\]"),
        (dict(scales=[1.0]), "`scales`"),
        (dict(sites=3), "`sites`"),
        (dict(logdir=3), "`logdir`"),
    ],
)
def test_bad_arguments_raise_probe_error(kwargs, match):
    model = SDPAModel(layers=1)
    with pytest.raises(probe.ProbeError, match=match):
        probe.watch(model, **kwargs)
    _assert_clean(model)


def test_bad_model_and_logdir_file(tmp_path):
    with pytest.raises(probe.ProbeError, match="torch.nn.Module"):
        probe.watch(lambda x: x)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(probe.ProbeError, match="directory, got a file"):
        probe.watch(SDPAModel(), logdir=f)


def test_summary_errors_name_the_unknown_thing():
    model = SDPAModel(layers=1)
    with probe.watch(model, grads=False) as p:
        model(torch.randn(1, 3, 64))
    s = p.summary()
    with pytest.raises(probe.ProbeError, match="unknown site 'nope'.*layers.0"):
        s.value("nope", "entropy")
    with pytest.raises(probe.ProbeError, match="no scale 'huge'"):
        s.value("layers.0", "entropy", "huge")
    with pytest.raises(probe.ProbeError, match="no metric 'grad_q'.*backward"):
        s.value("layers.0", "grad_q")


def test_sites_filter_glob_list_predicate_and_warning():
    model = SDPAModel(layers=3)
    x = torch.randn(1, 3, 64)
    for sites, expected in [("layers.1", ["layers.1"]), (["layers.0", "*.2"], ["layers.0", "layers.2"]),
                            (lambda n: n.endswith("2"), ["layers.2"])]:
        with probe.watch(model, sites=sites) as p:
            model(x)
        assert p.summary().sites == expected
    with pytest.warns(UserWarning, match="matched none of the attention sites seen: layers.0, layers.1"):
        with probe.watch(model, sites="decoder.*") as p:
            model(x)
            model(x)
    assert p.summary().sites == []


def test_summary_json_round_trip_and_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = SDPAModel(layers=2, causal=True)
    x = torch.randn(2, 6, 64)
    with probe.watch(model, logdir=tmp_path) as p:
        for _ in range(3):
            model(x)
    s = p.summary()
    loaded = probe.Summary.load(tmp_path)
    assert loaded.sites == s.sites and loaded.steps == 3
    for site in s.sites:
        for metric in s.metrics(site):
            for scale in s.scales(site, metric):
                np.testing.assert_allclose(loaded.value(site, metric, scale), s.value(site, metric, scale))
    assert json.loads((tmp_path / "probe_summary.json").read_text())["format"] == "probe.summary/1"

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for metric in ("logit_var", "logit_max", "entropy", "max_prob", "saturation"):
        for scale in ("actual", "unscaled", "standard"):
            assert f"probe.{metric}@{scale}/layers.1" in tags
    events = acc.Scalars("probe.entropy@unscaled/layers.0")
    assert [e.step for e in events] == [0, 1, 2]
    # the same input every step: each step's value equals the aggregate
    assert events[-1].value == pytest.approx(float(s.value("layers.0", "entropy", "unscaled").mean()), rel=1e-5)
    assert acc.Scalars("probe.logit_max@actual/layers.0")[0].value == pytest.approx(
        float(s.value("layers.0", "logit_max").max()), rel=1e-5)
    assert "probe.sites/text_summary" in acc.Tags()["tensors"]


def test_variance_combines_exactly_across_steps():
    model = SDPAModel(layers=1)
    xs = [torch.randn(1, 5, 64) * (i + 1) for i in range(3)]
    with probe.watch(model) as p:
        for x in xs:
            model(x)
    combined = p.summary().value("layers.0", "logit_var", "unscaled")
    # one step with all three inputs as a batch sees the same logits
    with probe.watch(model) as one:
        model(torch.cat(xs))
    np.testing.assert_allclose(combined, one.summary().value("layers.0", "logit_var", "unscaled"), rtol=1e-6)
