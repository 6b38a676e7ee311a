"""Every value accounted for (issue 25): a gradient metric a sampled backward did not produce is
named with its reason, in one warning and in the summary, the coverage report and its JSON."""

from __future__ import annotations

import warnings
from typing import List

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import probe
from probe.summary import Summary


class Attention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, ckpt: bool = False) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * d)
        self.heads, self.ckpt = heads, ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.ckpt:
            o = checkpoint(F.scaled_dot_product_attention, q, k, v, use_reentrant=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v)
        return o.transpose(1, 2).reshape(b, n, d)


class Model(nn.Module):
    def __init__(self, ckpt: bool = False, side: bool = False) -> None:
        super().__init__()
        self.emb = nn.Linear(16, 16)
        self.layers = nn.ModuleList([Attention(ckpt=ckpt), Attention(ckpt=ckpt)])
        self.side = Attention() if side else None

    def forward(self, x: torch.Tensor):
        x = self.emb(x)
        for layer in self.layers:
            x = x + layer(x)
        if self.side is None:
            return x
        return x, self.side(x)  # an output the loss does not use


def _lora_like() -> Model:
    """A frozen base under an adapter: only the q projections train, so k and v of the first
    layer (projections of a frozen input) do not require grad."""
    model = Model()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("layers.") and ".q." in name)
    return model


def _run(model: nn.Module, loss=lambda out: out.sum(), steps: int = 2):
    x = torch.randn(2, 5, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            for _ in range(steps):
                loss(model(x)).backward()
    return p.summary(), [str(w.message) for w in caught if "gradient metrics NOT measured" in str(w.message)]


def test_a_frozen_k_and_v_are_named_once_with_their_reason():
    s, messages = _run(_lora_like())
    assert len(messages) == 1, messages
    assert "grad_k, grad_v at 1 site(s) ('layers.0')" in messages[0]
    assert "does not require grad" in messages[0] and "LoRA" in messages[0]
    assert "grad_k" not in s.metrics("layers.0") and "grad_q" in s.metrics("layers.0")
    assert {"grad_q", "grad_k", "grad_v"} <= set(s.metrics("layers.1"))  # its k, v come from a trained q path
    missing = s.not_measured("layers.0")
    assert list(missing.values()) == [["grad_k", "grad_v"]]
    accounted = {(a.metric, a.scale): a for a in s.accounting("layers.0")}
    assert accounted[("grad_k", "actual")].status == "not measured"
    assert accounted[("grad_q", "actual")].status == "measured"
    assert accounted[("entropy", "standard")].status == "measured"
    assert s.not_measured("layers.1") == {}


def test_a_checkpointed_function_loses_all_four_at_every_site_and_says_why():
    s, messages = _run(Model(ckpt=True))
    assert len(messages) == 1, messages
    assert "grad_logits, grad_q, grad_k, grad_v at 2 site(s) ('layers.0', 'layers.1')" in messages[0]
    assert "reentrant activation checkpointing" in messages[0]
    for site in ("layers.0", "layers.1"):
        assert not any(m.startswith("grad_") for m in s.metrics(site))
        (why, values), = s.not_measured(site).items()
        assert set(values) == {"grad_logits@actual", "grad_logits@unscaled", "grad_logits@standard", "grad_q",
                               "grad_k", "grad_v"}


def test_a_checkpointed_module_has_its_gradients_and_nothing_to_say():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.attn, x, use_reentrant=True)

    model = nn.Sequential(nn.Linear(16, 16), Block())
    s, messages = _run(model)
    assert messages == []
    assert {"grad_logits", "grad_q", "grad_k", "grad_v"} <= set(s.metrics("1.attn"))


def test_an_output_the_loss_does_not_use_is_named():
    s, messages = _run(Model(side=True), loss=lambda out: out[0].sum())
    assert len(messages) == 1 and "('side')" in messages[0] and "did not reach its hook" in messages[0]
    assert "grad_q" not in s.metrics("side")


def test_no_backward_no_warning():
    model, x = Model(), torch.randn(2, 5, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            model(x)  # grad on, but no backward (an evaluation without no_grad)
            with torch.no_grad():
                model(x)
    assert not [w for w in caught if "gradient metrics" in str(w.message)]
    accounted = {(a.metric, a.scale): a for a in p.summary().accounting("layers.0")}
    assert accounted[("grad_q", "actual")].status == "not measured"
    assert "no backward pass" in accounted[("grad_q", "actual")].note


def test_the_reasons_survive_the_summary_file(tmp_path):
    model, x = _lora_like(), torch.randn(2, 5, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with probe.watch(model, logdir=str(tmp_path)):
            model(x).sum().backward()
            model(x).sum().backward()
    loaded = Summary.load(tmp_path)
    assert list(loaded.not_measured("layers.0").values()) == [["grad_k", "grad_v"]]


def test_coverage_lists_what_is_not_measured_and_why():
    report = probe.coverage(_lora_like(), torch.randn(2, 5, 16))
    text = str(report)
    assert "layers.0: not measured: grad_k, grad_v: the tensor does not require grad" in text
    assert "2 of 2 attention sites captured, 2 verified" in text
    report = probe.coverage(Model(ckpt=True), torch.randn(2, 5, 16))  # autograd.grad refuses: a backward
    assert all(r.not_measured for r in report.rows)
    assert all(p.grad is None for p in Model(ckpt=True).parameters())


def test_coverage_leaves_grads_as_they_were_under_reentrant_checkpointing():
    model, x = Model(ckpt=True), torch.randn(2, 5, 16)
    model(x).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    probe.coverage(model, x)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_probe_report_and_the_sites_table_show_what_is_not_measured(tmp_path, capsys):
    from probe.cli.main import main
    from probe.sinks.tensorboard import sites_table

    model, x = _lora_like(), torch.randn(2, 5, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with probe.watch(model, logdir=str(tmp_path)) as p:
            model(x).sum().backward()
            model(x).sum().backward()
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "layers.0  (kind sdpa, heads 2, kv_heads 2, d_k 8, scale 1/√8, calls 2, verified)" in out
    assert "  not measured: grad_k, grad_v: the tensor does not require grad there" in out
    table = sites_table(p.summary())
    assert "| verified | not measured |" in table
    row = next(line for line in table.splitlines() if line.startswith("| layers.0 "))
    assert "| yes | grad_k, grad_v: the tensor does not require grad there" in row
