"""probe.coverage, the CLI ``probe coverage`` and the audit behind them (probe.capture.audit)."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import _get_current_function_mode_stack

import probe
from probe.capture.audit import Audit
from probe.call import AttentionCall
from probe.cli.main import main
from probe.session.coverage import coverage
from tests.helpers import hook_count, module_state

D, H = 16, 4


class Attn(nn.Module):
    def __init__(self, mode: str = "plain") -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.o = nn.Linear(D, D)
        self.mode = mode

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D // H).permute(2, 0, 3, 1, 4)
        if self.mode == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v)
        else:
            s = q @ k.transpose(-1, -2) * 0.5
            if self.mode == "flatten":  # an op after which the eager front end cannot tell the keys
                s = s.flatten(2).unflatten(2, (n, n))
            if self.mode == "script":
                s = _scripted(s)
            if self.mode == "conv":  # talking heads as a 1x1 convolution over the heads
                s = F.conv2d(s, torch.eye(H).view(H, H, 1, 1) * 0 + self.mix)
                s = s.permute(0, 1, 2, 3)
            o = s.softmax(-1) @ v
        return self.o(o.transpose(1, 2).reshape(b, n, D))

    @property
    def mix(self) -> Tensor:
        return torch.eye(H).view(H, H, 1, 1)


@torch.jit.script
def _scripted(t: Tensor) -> Tensor:
    return (t / 10.0).tanh() * 10.0


class Net(nn.Module):
    def __init__(self, modes) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Attn(m) for m in modes)
        self.router = nn.Linear(D, 3)
        self.head = nn.Linear(D, 10)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + layer(x)
        gate = self.router(x).softmax(-1)  # a router: not attention
        return self.head(x * gate[..., :1]).log_softmax(-1)  # an output layer: not attention


def x() -> Tensor:
    return torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0))


def test_captured_sites_front_end_scale_and_grads() -> None:
    torch.manual_seed(0)
    report = coverage(Net(["plain", "sdpa"]), x())
    assert [r.site for r in report.rows] == ["layers.0", "layers.1"]
    assert [r.front_end for r in report.rows] == ["eager", "sdpa"]
    assert report.rows[0].scale == pytest.approx(0.5) and report.rows[1].scale == pytest.approx(0.5)
    for row in report.rows:
        assert row.captured and not row.why
        assert set(row.grads) == {"grad_logits", "grad_q", "grad_k", "grad_v"}
    assert report.missed == []
    text = str(report)
    assert "2 of 2 attention sites captured" in text and "layers.1" in text


def test_a_miss_is_listed_with_the_op_that_lost_it() -> None:
    torch.manual_seed(0)
    report = coverage(Net(["plain", "flatten"]), x())
    missed = report.missed
    assert [r.site for r in missed] == ["layers.1"]
    assert "`flatten`" in missed[0].why
    assert "1 of 2 attention sites captured" in str(report)


def test_scores_through_torchscript_are_listed() -> None:
    torch.manual_seed(0)
    report = coverage(Net(["script"]), x())
    assert [r.site for r in report.missed] == ["layers.0"]
    assert "TorchScript" in report.missed[0].why


def test_a_mix_over_heads_keeps_scores() -> None:
    torch.manual_seed(0)
    report = coverage(Net(["conv"]), x())
    assert [r.site for r in report.rows] == ["layers.0"]


def test_no_backward() -> None:
    torch.manual_seed(0)
    report = coverage(Net(["plain"]), x(), backward=False)
    assert report.rows[0].captured and report.rows[0].grads == ()
    assert "(no backward)" in str(report)


def test_model_left_as_it_was() -> None:
    torch.manual_seed(0)
    model = Net(["plain", "sdpa", "flatten"]).train()
    before = module_state(model)
    with torch.no_grad():
        expected = model.eval()(x())
    model.train()
    coverage(model, x())
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    assert hook_count(model) == 0
    assert not _get_current_function_mode_stack()
    after = module_state(model)
    assert [(n, a) for n, a, _ in before] == [(n, a) for n, a, _ in after]
    for (_, _, s0), (_, _, s1) in zip(before, after):
        assert all(torch.equal(s0[k], s1[k]) for k in s0)
    with torch.no_grad():
        assert torch.equal(model.eval()(x()), expected)


def test_bad_input_and_a_raising_forward() -> None:
    with pytest.raises(probe.ProbeError, match="torch.nn.Module"):
        coverage("model", x())

    class Raises(Net):
        def forward(self, x: Tensor) -> Tensor:
            super().forward(x)
            raise RuntimeError("boom")

    model = Raises(["plain"])
    with pytest.raises(probe.ProbeError, match="boom"):
        coverage(model, x())
    assert hook_count(model) == 0 and not _get_current_function_mode_stack()


def test_audit_reports_a_call_under_another_module_as_a_miss() -> None:
    model = Net(["plain"])
    audit = Audit(model)
    inputs = x()  # made outside: a tensor made by a factory inside the audit is a constant
    with audit:
        model(inputs)
    assert [e.module for e in audit.events] == ["layers.0"]
    event = audit.events[0]
    audit.reported(AttentionCall(q=torch.zeros(1, 1, 1, 1), k=torch.zeros(1, 1, 1, 1), v=None, scale=1.0,
                                 kind="eager"), "layers.9")
    assert audit.misses() == [event]  # emitted outside the softmax: not this event


def test_real_hf_models_are_fully_covered() -> None:
    pytest.importorskip("transformers")
    from tests.helpers import tiny_llama

    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    for attn in ("eager", "sdpa"):
        report = coverage(tiny_llama(attn), ids)
        assert [r.site for r in report.rows] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        assert all(r.captured and r.front_end == attn and set(r.grads) >= {"grad_q", "grad_k", "grad_v"}
                   for r in report.rows), str(report)
        assert all(r.scale == pytest.approx(8 ** -0.5) for r in report.rows)


def test_cli(tmp_path, capsys) -> None:
    target = tmp_path / "target.py"
    target.write_text(textwrap.dedent("""
        import torch
        from tests.test_coverage import Net

        def ok():
            torch.manual_seed(0)
            return Net(["plain"]), (torch.randn(2, 5, 16),)

        def missed():
            torch.manual_seed(0)
            return Net(["plain", "flatten"]), (torch.randn(2, 5, 16),), {}

        def model_only():
            return Net(["plain"])
    """))
    assert main(["coverage", f"{target}:ok", "--json", str(tmp_path / "r.json")]) == 0
    assert "1 of 1 attention sites captured" in capsys.readouterr().out
    assert (tmp_path / "r.json").read_text().startswith("{")
    assert main(["coverage", f"{target}:missed"]) == 1
    assert "layers.1: the scores were lost at `flatten`" in capsys.readouterr().out
    assert main(["coverage", f"{target}:model_only"]) == 2
    assert "example inputs" in capsys.readouterr().err
    assert main(["coverage", "no_colon"]) == 2
    assert main(["coverage", f"{target}:absent"]) == 2
    assert "no callable 'absent'" in capsys.readouterr().err


def test_watch_warns_once_per_missed_attention_on_the_first_sampled_forward() -> None:
    torch.manual_seed(0)
    model = Net(["plain", "flatten", "sdpa"])
    with pytest.warns(UserWarning, match=r"attention at 'layers.1' is NOT measured: the scores were lost at `flatten`"):
        with probe.watch(model) as p:
            model(x())
    assert p.summary().sites == ["layers.0", "layers.2"]
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, audit=False) as p:
            model(x())
        with probe.watch(Net(["plain", "sdpa"])) as p:  # nothing missed: nothing said
            model2 = p.model
            model2(x())
            model2(x())
    assert not [w for w in caught if "NOT measured" in str(w.message)]
    assert hook_count(model) == 0 and not _get_current_function_mode_stack()


def test_audit_pays_only_on_the_first_sampled_forward() -> None:
    model = Net(["plain"])
    with probe.watch(model) as p:
        model(x())
        assert p._audit.done and p._rec.observer is None
        model(x())
    assert p.summary().sites == ["layers.0"]
    assert not _get_current_function_mode_stack()


class _Twice(nn.Module):
    """Attention run twice in one forward (diffusers' SlicedAttnProcessor: one call per slice)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D // H).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return F.scaled_dot_product_attention(o, k, v).transpose(1, 2).reshape(b, n, D)


def test_a_module_calling_attention_twice_has_no_phantom_missed_row() -> None:
    # its first call is reported as `attn` before the second renames it `attn#1`: that row was
    # listed as NOT captured ("its statistics failed"), and `probe coverage` exited 1
    torch.manual_seed(0)
    report = coverage(nn.Sequential(_Twice()), x())
    assert [r.site for r in report.rows] == ["0#1", "0#2"]
    assert report.missed == [] and all(r.captured and r.verified for r in report.rows)


class Attn2d(nn.Module):
    """Attention over both axes of a (B, X, Y, C) grid at once (Keras' MultiHeadAttention with
    attention_axes=(1, 2)): a softmax over two key axes, spelled exp(s - logsumexp(s, (4, 5)))."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        b, gx, gy, _ = x.shape
        q, k = self.q(x).view(b, gx, gy, H, D // H), self.k(x).view(b, gx, gy, H, D // H)
        s = torch.einsum("afgde,abcde->adbcfg", k, q)
        p = torch.exp(s - torch.logsumexp(s, dim=(4, 5), keepdim=True))
        return torch.einsum("adbcfg,afgde->abcde", p, q).reshape(b, gx, gy, D)


def test_a_softmax_over_several_key_axes_is_an_attention_named_when_missed() -> None:
    # was: not an event (the audit took only a logsumexp over the last dim): no site, no warning
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seq = Attn()
            self.grid = Attn2d()

        def forward(self, t: Tensor) -> Tensor:
            return self.grid(self.seq(t).view(2, 3, 3, D))

    torch.manual_seed(0)
    inp = torch.randn(2, 9, D)
    report = coverage(Both(), inp)
    assert [(r.site, r.captured) for r in report.rows] == [("seq", True), ("grid", False)]
    model = Both()
    with pytest.warns(UserWarning, match="attention at 'grid' is NOT measured"):
        with probe.watch(model):
            model(inp)
