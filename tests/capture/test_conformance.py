"""The conformance harness: every capture front end is run through the same checks.

For each :class:`Case` (a tiny model whose attention goes through one front end):

* outputs and parameter gradients are bitwise unchanged with a probe attached;
* the records are valid: frozen :class:`~probe.AttentionCall` s of the case's kind, at the
  case's site, whose ``validate()`` passes;
* the forward metrics at ``actual`` match an independent float64 reference (q and k recomputed
  from the model's weights, written plainly in :mod:`tests.helpers`);
* overrides are applied (``probe.scaling``): the same outputs with and without a probe attached,
  different from the unscaled run, and the probe reports the overridden scale as ``actual``;
* gradient metrics are present after a backward pass.

Adding a front end (or a model family that takes a new path through one): write a ``make``
function returning ``(model, inputs)`` and a ``reference`` function returning the float64
reference's arguments per site, and add one :class:`Case` to :data:`CASES`. ``scaling=False``
for a front end that does not apply overrides (say why in ``note``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from probe.call import KINDS, AttentionCall
from probe.capture.mode import CaptureMode, ModuleStack
from probe.capture.registry import default_frontends
from tests.helpers import SDPAAttention, reference_metrics

D_MODEL, HEADS, LENGTH = 32, 4, 6
D_HEAD = D_MODEL // HEADS
METRICS = ("logit_var", "logit_max", "entropy", "max_prob")

Inputs = Tuple[torch.Tensor, ...]
#: site -> keyword arguments of tests.helpers.reference_metrics (q, k, scale, valid, bias, softcap)
Reference = Dict[str, Dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Case:
    """One model through one front end.

    Attributes:
        name: the test id.
        kind: the ``AttentionCall.kind`` its records carry.
        make: ``() -> (model, inputs)``; the model in train mode without dropout (fused
            inference paths differ from the unfused ones by rounding).
        reference: ``(model, inputs) -> {site: reference_metrics kwargs}`` at the model's scale.
        scaling: whether ``probe.scaling`` reaches this front end.
        grads: whether the model can run a backward pass here (else every check runs under
            ``no_grad`` and the gradient checks are skipped).
        note: why a check does not apply.
    """

    name: str
    kind: str
    make: Callable[[], Tuple[nn.Module, Inputs]]
    reference: Callable[[nn.Module, Inputs], Reference]
    scaling: bool = True
    grads: bool = True
    note: str = ""


def _x() -> torch.Tensor:
    return torch.randn(2, LENGTH, D_MODEL)


def _heads(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], t.shape[1], HEADS, D_HEAD).transpose(1, 2)


def _all_valid() -> torch.Tensor:
    return torch.ones(2, HEADS, LENGTH, LENGTH, dtype=torch.bool)


# -- SDPA ------------------------------------------------------------------------------------------
class SDPAWrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = SDPAAttention(D_MODEL, HEADS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def make_sdpa() -> Tuple[nn.Module, Inputs]:
    return SDPAWrapper(), (_x(),)


def reference_sdpa(model: nn.Module, inputs: Inputs) -> Reference:
    attn, (x,) = model.attn, inputs
    with torch.no_grad():
        q = _heads(attn.q(x))
        k = _heads(attn.kv(x)[..., :D_MODEL])
    return {"attn": dict(q=q, k=k, scale=1 / math.sqrt(D_HEAD), valid=_all_valid())}


# -- eager -----------------------------------------------------------------------------------------
class EagerAttention(nn.Module):
    """Attention written out op by op (causal, GPT-2 style)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.o = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t) for t in self.qkv(x).split(D_MODEL, dim=-1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(D_HEAD)
        future = torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return self.o((probs @ v).transpose(1, 2).reshape(x.shape))


class EagerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = EagerAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def make_eager() -> Tuple[nn.Module, Inputs]:
    return EagerModel(), (_x(),)


def reference_eager(model: nn.Module, inputs: Inputs) -> Reference:
    (x,) = inputs
    with torch.no_grad():
        q, k, _ = (_heads(t) for t in model.attn.qkv(x).split(D_MODEL, dim=-1))
    valid = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril().expand(2, HEADS, LENGTH, LENGTH)
    return {"attn": dict(q=q, k=k, scale=1 / math.sqrt(D_HEAD), valid=valid)}


class SpelledAttention(EagerAttention):
    """The same attention spelled otherwise (issue 25): the factor on k in place, the softmax as
    ``exp(x - logsumexp(x))``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t) for t in self.qkv(x).split(D_MODEL, dim=-1))
        k = k.clone()
        k.mul_(1 / math.sqrt(D_HEAD))
        future = torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1)
        scores = torch.einsum("bhid,bhjd->bhij", q, k).masked_fill(future, float("-inf"))
        probs = torch.exp(scores - torch.logsumexp(scores, -1, keepdim=True))
        return self.o((probs @ v).transpose(1, 2).reshape(x.shape))


def make_spelled() -> Tuple[nn.Module, Inputs]:
    model = EagerModel()
    model.attn.__class__ = SpelledAttention
    return model, (_x(),)


# -- nn.MultiheadAttention -------------------------------------------------------------------------
class MHAModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def make_mha() -> Tuple[nn.Module, Inputs]:
    return MHAModel(), (_x(),)


def reference_mha(model: nn.Module, inputs: Inputs) -> Reference:
    (x,) = inputs
    w, b = model.attn.in_proj_weight, model.attn.in_proj_bias
    with torch.no_grad():
        q = _heads(F.linear(x, w[:D_MODEL], b[:D_MODEL]))
        k = _heads(F.linear(x, w[D_MODEL:2 * D_MODEL], b[D_MODEL:2 * D_MODEL]))
    return {"attn": dict(q=q, k=k, scale=1 / math.sqrt(D_HEAD), valid=_all_valid())}


# -- FlexAttention ---------------------------------------------------------------------------------
class FlexProjected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = (_heads(t) for t in self.qkv(x).split(D_MODEL, dim=-1))
        return flex_attention(q, k, v) * 1.0


class FlexModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = FlexProjected()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def make_flex() -> Tuple[nn.Module, Inputs]:
    pytest.importorskip("torch.nn.attention.flex_attention")
    return FlexModel(), (_x(),)


def reference_flex(model: nn.Module, inputs: Inputs) -> Reference:
    (x,) = inputs
    with torch.no_grad():
        q, k, _ = (_heads(t) for t in model.attn.qkv(x).split(D_MODEL, dim=-1))
    return {"attn": dict(q=q, k=k, scale=1 / math.sqrt(D_HEAD), valid=_all_valid())}


CASES: List[Case] = [
    Case("sdpa", "sdpa", make_sdpa, reference_sdpa),
    Case("eager", "eager", make_eager, reference_eager),
    Case("eager-spelled", "eager", make_spelled, reference_eager, scaling=False,
         note="probe.scaling rewrites only the softmax spellings; a spelled-out one is left unchanged and told"),
    Case("mha", "mha", make_mha, reference_mha),
    Case("flex", "flex", make_flex, reference_flex, scaling=False, grads=torch.cuda.is_available(),
         note="FlexAttention's operator runs inside a compiled region, where probe.scaling does not "
              "reach it; it has no backward on CPU"),
]

pytestmark = [
    pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES]),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]


def _built(case: Case) -> Tuple[nn.Module, Inputs]:
    torch.manual_seed(0)
    model, inputs = case.make()
    return model.train(), inputs


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum()


def _grads(model: nn.Module) -> List[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_outputs_and_gradients_bitwise_unchanged(case):
    model, inputs = _built(case)
    if not case.grads:
        with torch.no_grad():
            out = model(*inputs)
            with probe.watch(model) as p:
                assert torch.equal(model(*inputs), out)
        assert p.summary().sites, "the probe saw no attention call"
        return  # outputs only (see case.note); test_gradient_metrics_are_present skips
    out = model(*inputs)
    _loss(out).backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    with probe.watch(model) as p:
        probed = model(*inputs)
        _loss(probed).backward()
    assert torch.equal(out, probed)
    assert all(torch.equal(a, b) for a, b in zip(grads, _grads(model)))
    assert p.summary().sites, "the probe saw no attention call"


def test_records_are_valid(case):
    model, inputs = _built(case)
    calls: List[AttentionCall] = []
    stack, mode = ModuleStack(model), CaptureMode(default_frontends(), calls.append)
    stack.activate()
    try:
        with mode, torch.no_grad():
            model(*inputs)
    finally:
        stack.deactivate()
    assert calls
    for call in calls:
        assert isinstance(call, AttentionCall) and call.kind == case.kind and call.kind in KINDS
        call.validate()
        with pytest.raises(dataclasses.FrozenInstanceError):
            call.site = "elsewhere"  # type: ignore[misc]


def test_forward_metrics_match_the_float64_reference(case):
    model, inputs = _built(case)
    with probe.watch(model, grads=False) as p, torch.no_grad():
        model(*inputs)
    s = p.summary()
    reference = case.reference(model, inputs)
    assert set(s.sites) == set(reference)
    for site, args in reference.items():
        assert s.info(site)["kind"] == case.kind
        ref = reference_metrics(**args)
        for metric in METRICS:
            np.testing.assert_allclose(s.value(site, metric), ref[metric], rtol=1e-4, atol=1e-6,
                                       err_msg=f"{site} {metric}")


def test_overrides_are_applied(case):
    if not case.scaling:
        pytest.skip(case.note)
    model, inputs = _built(case)
    with torch.no_grad():
        plain = model(*inputs)
        with probe.scaling(model, "actual"):
            assert torch.equal(model(*inputs), plain)
        with probe.scaling(model, 0.3):  # applied by the intervention mode (no probe)
            alone = model(*inputs)
        with probe.watch(model, grads=False) as p, probe.scaling(model, 0.3):  # by the probe's front end
            probed = model(*inputs)
    assert torch.equal(alone, probed)
    assert not torch.equal(alone, plain)
    s = p.summary()
    for site, args in case.reference(model, inputs).items():
        assert s.info(site)["scale"] == pytest.approx(0.3)
        ref = reference_metrics(**{**args, "scale": 0.3})
        np.testing.assert_allclose(s.value(site, "logit_var"), ref["logit_var"], rtol=1e-4)


def test_gradient_metrics_are_present(case):
    if not case.grads:
        pytest.skip(case.note)
    model, inputs = _built(case)
    with probe.watch(model) as p:
        _loss(model(*inputs)).backward()
    s = p.summary()
    for site in case.reference(model, inputs):
        for metric in ("grad_logits", "grad_q", "grad_k", "grad_v"):
            values = s.value(site, metric)
            assert np.isfinite(values).all() and (values > 0).all(), (site, metric, values)
