"""probe.compare: per-scale values equal independent runs and a float64 autograd reference; the
caller's grads, buffers and RNG state are untouched; same RNG per run; CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from probe.cli.main import main
from probe.experiment.compare import COLUMNS, compare
from tests.helpers import SDPAAttention, SDPAModel

D = 64


class LeafAttention(nn.Module):
    """q, k, v are the module's own parameters: their .grad is what grad_q/k/v measure."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, n: int = 6, d: int = 8) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(2, heads, n, d))
        self.k = nn.Parameter(torch.randn(2, kv_heads, n, d))
        self.v = nn.Parameter(torch.randn(2, kv_heads, n, d))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True, enable_gqa=True)
        return (out * w).sum()


def _reference(model: LeafAttention, w: torch.Tensor, scale: float):
    """float64 autograd of the same loss with an explicit softmax at ``scale``."""
    q, k, v = (t.detach().double().requires_grad_() for t in (model.q, model.k, model.v))
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    n = q.shape[2]
    z = scale * q @ kk.transpose(-1, -2)
    z = z.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(z, -1)
    loss = ((p @ vv) * w.double()).sum()
    loss.backward()
    norms = {name: float(t.grad.norm()) for name, t in (("grad_q", q), ("grad_k", k), ("grad_v", v))}
    norms["param_grad"] = math.sqrt(sum(float(t.grad.square().sum()) for t in (q, k, v)))
    rows = p[:, :, 1:]  # the first causal row has one valid key: not a softmax row
    ent = -(rows * torch.log(rows.clamp_min(1e-300))).sum(-1) / torch.log(torch.arange(2, n + 1).double())
    norms["entropy"] = float(ent.detach().mean(dim=(0, 2)).mean())
    return float(loss.detach()), norms


@pytest.mark.parametrize("spec,value", [("actual", 8**-0.5), ("unscaled", 1.0), (0.05, 0.05)])
def test_values_match_a_float64_autograd_reference(spec, value):
    model = LeafAttention()
    w = torch.randn(2, 4, 6, 8)
    result = compare(model, w, lambda m, b: m(b), scales=[spec])
    label = result.scales[0]
    loss, ref = _reference(model, w, value)
    assert result.sites == ["root"]
    assert result.loss[label] == pytest.approx(loss, rel=1e-5)
    for column, expected in ref.items():
        assert result.value("root", column, label) == pytest.approx(expected, rel=1e-4), column
    assert all(p.grad is None for p in model.parameters())  # the caller had none


def test_equal_to_independent_runs_of_a_model_built_at_that_scale():
    model = SDPAModel(causal=True)
    twin = SDPAModel(causal=True, scale=1.0)
    twin.load_state_dict(model.state_dict())
    x, target = torch.randn(2, 6, D), torch.randn(2, 6, D)

    def loss_fn(m, batch):
        return F.mse_loss(m(batch[0]), batch[1])

    result = compare(model, (x, target), loss_fn)
    assert result.scales == ["actual", "unscaled"]
    with probe.watch(twin) as p:
        loss = loss_fn(twin, (x, target))
        loss.backward()
    s = p.summary()
    assert result.loss["unscaled"] == pytest.approx(float(loss.detach()), rel=1e-6)
    for site in ("layers.0", "layers.1"):
        assert result.value(site, "entropy", "unscaled") == pytest.approx(float(s.value(site, "entropy").mean()), rel=1e-6)
        for column in ("grad_logits", "grad_q", "grad_k", "grad_v"):
            expected = float(np.sqrt(np.sum(s.value(site, column) ** 2)))
            assert result.value(site, column, "unscaled") == pytest.approx(expected, rel=1e-5)
        module = twin.get_submodule(site)
        expected = math.sqrt(sum(float(p.grad.double().square().sum()) for p in module.parameters()))
        assert result.value(site, "param_grad", "unscaled") == pytest.approx(expected, rel=1e-5)
    assert result.summaries["unscaled"].info("layers.0")["scale"] == 1.0
    text = result.table()
    assert "layers.1" in text and all(c in text for c in COLUMNS)
    assert json.loads(json.dumps(result.to_dict()))["scales"] == ["actual", "unscaled"]


class Noisy(nn.Module):
    """A BatchNorm and dropout: buffers and RNG that a careless comparison would disturb. They sit
    *before* the attention, so the loss sees the attention output itself (a train-mode BatchNorm
    after it would normalize away what the scale changed)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)
        self.attn = SDPAAttention(D, heads=4)

    def forward(self, x):
        return self.attn(self.drop(self.bn(x)))


def test_caller_state_untouched_and_same_rng_per_run():
    torch.manual_seed(0)
    model = Noisy().train()
    x = torch.randn(3, 6, D)
    model(x).sum().backward()  # the caller's accumulated grads
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grad_objects = [p.grad for p in model.parameters()]
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    result = compare(model, x, lambda m, b: m(b).square().mean(), scales={"a": "actual", "b": "actual", "u": "unscaled"})
    assert result.loss["a"] == result.loss["b"]  # the same dropout masks
    # Unscaled (d_k = 16: logits 4x larger) the softmax is sharper, so each output row, a convex
    # combination of value rows, keeps more of their norm: the mean square is about twice as large
    # (2.05 to 2.77 over seeds 0-9), far beyond any rounding.
    assert result.loss["u"] > 1.5 * result.loss["a"]
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is g for p, g in zip(model.parameters(), grad_objects))
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())


def test_bad_input_raises_probe_error_and_restores_grads():
    model = SDPAModel()
    x = torch.randn(1, 4, D)
    with pytest.raises(probe.ProbeError, match="scales\\['huge'\\]"):
        compare(model, x, lambda m, b: m(b).sum(), scales=["huge"])
    with pytest.raises(probe.ProbeError, match="distinct labels"):
        compare(model, x, lambda m, b: m(b).sum(), scales=["actual", "actual"])
    with pytest.raises(probe.ProbeError, match="`loss_fn`"):
        compare(model, x, "loss")
    marker = torch.ones_like(model.norm.weight)
    model.norm.weight.grad = marker
    with pytest.raises(probe.ProbeError, match="scalar tensor, got Tensor\\(1, 4, 64\\)"):
        compare(model, x, lambda m, b: m(b))
    assert model.norm.weight.grad is marker
    assert not probe.experiment.scaling.active()


def test_cli_compare(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    code = main(["compare", "--batch", "4", "--scale", "actual", "--scale", "unscaled", "--scale", "0.02",
                 "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "blocks.1.attn" in text and "grad_q" in text and "unscaled" in text
    data = json.loads(out.read_text())
    assert data["scales"] == ["actual", "unscaled", "0.02"]
    assert data["sites"]["blocks.0.attn"]["entropy"]["unscaled"] < data["sites"]["blocks.0.attn"]["entropy"]["actual"]
    assert main(["compare", "--scale", "tiny"]) == 2
    assert "scales['tiny']" in capsys.readouterr().err


# -- the examples (in-process, tiny settings) -------------------------------------------------------
def _example(name):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dk_sweep_example_measures_the_seed_claims(tmp_path):
    sweep = _example("dk_sweep")
    rows = sweep.sweep(steps=1, batch=2, heads=2, length=16, logdir=str(tmp_path), seed=0)
    assert list(rows) == list(sweep.DIMS)
    for d_k, row in rows.items():
        assert 0.7 < row["logit_var@standard"] < 1.4
        assert 0.7 < row["logit_var@unscaled"] / d_k < 1.4
        assert row["entropy@standard"] > 0.7
    assert rows[1024]["entropy@unscaled"] < rows[16]["entropy@unscaled"] < rows[16]["entropy@standard"]
    assert "grad_logits@unsc" in sweep.format_table(rows)
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


def test_scaling_ablation_example_runs_and_trains_the_learnable_scales(tmp_path, capsys):
    ablation = _example("scaling_ablation")
    results = ablation.main(["--steps", "2", "--every", "1", "--batch", "4", "--logdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "blocks.1.attn" in out and "learned per-head scales" in out
    assert results["unscaled"]["summary"].info("blocks.0.attn")["scale"] == 1.0
    assert results["scaled"]["summary"].info("blocks.0.attn")["scale"] == pytest.approx(256**-0.5)
    learned = results["headwise"]["scales"]
    assert all(t.shape == (1,) and float(t) != 1.0 for t in learned.values())  # the optimizer moved them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["headwise", "scaled", "unscaled"]
