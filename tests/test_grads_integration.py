"""Backward metrics inside real training patterns: parity, hook ownership, gradient accumulation,
retain_graph, no backward, grads=False, activation checkpointing, failures."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from tests.helpers import SDPAModel, tiny_bert, tiny_llama

GRAD_METRICS = ("grad_logits", "grad_q", "grad_k", "grad_v")


class SpyAttention(nn.Module):
    """An SDPA block that keeps the tensors it passed to attention, to inspect their hooks."""

    def __init__(self, d_model: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.d = heads, d_model // heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        self.seen.append((q, k, v, out))
        return out.transpose(1, 2).reshape(b, n, -1)


def _n_hooks(t: torch.Tensor) -> int:
    return len(t._backward_hooks or {})


def _grad_values(s: probe.Summary):
    return {(site, m, sc): s.value(site, m, sc) for site in s.sites for m in s.metrics(site) if m in GRAD_METRICS
            for sc in s.scales(site, m)}


def _assert_same(a, b, rtol=1e-5):
    assert a.keys() == b.keys() and a
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, err_msg=str(key))


# -- parity ------------------------------------------------------------------------------------
def _hf_out(out):
    return getattr(out, "logits", getattr(out, "last_hidden_state", out))


@pytest.mark.parametrize(
    "factory,inputs",
    [
        (lambda: SDPAModel(kv_heads=2, causal=True), lambda: torch.randn(2, 9, 64)),
        (tiny_bert, lambda: {"input_ids": torch.randint(0, 64, (2, 9)),
                             "attention_mask": torch.tensor([[1] * 9, [1] * 6 + [0] * 3])}),
        (tiny_llama, lambda: {"input_ids": torch.randint(0, 64, (2, 9))}),
    ],
    ids=["custom_gqa", "bert", "llama"],
)
def test_outputs_and_gradients_bitwise_identical_with_grad_hooks(factory, inputs):
    model = factory()
    batch = inputs()
    results = []
    for attach in (False, True):
        model.zero_grad(set_to_none=True)
        p = probe.watch(model, grads=True) if attach else None
        out = _hf_out(model(**batch) if isinstance(batch, dict) else model(batch))
        out.float().square().mean().backward()
        results.append((out.detach().clone(), [w.grad.clone() for w in model.parameters() if w.grad is not None]))
        if p is not None:
            s = p.summary()
            p.close()
    (ref_out, ref_grads), (out, grads) = results
    assert torch.equal(out, ref_out)
    assert len(grads) == len(ref_grads) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    for site in s.sites:  # the hooks did fire
        assert set(GRAD_METRICS) <= set(s.metrics(site)), site
        assert len(s.value(site, "grad_k")) == s.info(site)["grad_kv_heads"] == s.info(site)["kv_heads"]
        assert np.isfinite(s.value(site, "grad_logits", "unscaled")).all()


# -- hook ownership ----------------------------------------------------------------------------
def test_grads_false_registers_no_hook_at_all():
    model = SpyAttention()
    with probe.watch(model, grads=False) as p:
        model(torch.randn(2, 5, 32)).sum().backward()
    assert all(_n_hooks(t) == 0 for t in model.seen[0])
    assert not set(GRAD_METRICS) & set(p.summary().metrics("root"))


def test_hooks_are_removed_on_close_when_backward_never_happens():
    model = SpyAttention()
    p = probe.watch(model)
    model(torch.randn(2, 5, 32))
    assert [_n_hooks(t) for t in model.seen[0]] == [1, 1, 1, 1]  # q, k, v, output
    p.close()
    assert [_n_hooks(t) for t in model.seen[0]] == [0, 0, 0, 0]
    assert not set(GRAD_METRICS) & set(p.summary().metrics("root"))  # absent, not zero


def test_next_step_removes_the_previous_steps_hooks():
    model = SpyAttention()
    with probe.watch(model, every=2):
        model(torch.randn(1, 4, 32))  # step 0, sampled
        model(torch.randn(1, 4, 32))  # step 1, not sampled: step 0's hooks go
        assert sum(_n_hooks(t) for t in model.seen[0]) == 0
        assert sum(_n_hooks(t) for t in model.seen[1]) == 0


def test_inference_under_no_grad_registers_nothing_and_reports_no_grad_metrics():
    model = SpyAttention()
    with probe.watch(model) as p, torch.no_grad():
        model(torch.randn(2, 5, 32))
    assert all(_n_hooks(t) == 0 for t in model.seen[0])
    s = p.summary()
    assert "entropy" in s.metrics("root") and not set(GRAD_METRICS) & set(s.metrics("root"))
    with pytest.raises(probe.ProbeError, match="no metric 'grad_q'"):
        s.value("root", "grad_q")


def test_nested_probes_remove_only_their_own_grad_hooks():
    model = SpyAttention()
    outer = probe.watch(model)
    with probe.watch(model):
        model(torch.randn(1, 4, 32))
    assert [_n_hooks(t) for t in model.seen[0]] == [1, 1, 1, 1]  # the outer probe's
    outer.close()
    assert [_n_hooks(t) for t in model.seen[0]] == [0, 0, 0, 0]


# -- accumulation, retain_graph, late backward -----------------------------------------------
def test_gradient_accumulation_equals_one_batch():
    """Micro-batches with a sum loss: every per-example gradient equals the big batch's, so the
    root of the summed squares over micro-batches equals the norm over the whole batch."""
    model = SDPAModel(layers=2, kv_heads=2, causal=True)
    xs = [torch.randn(2, 6, 64), torch.randn(3, 6, 64)]
    with probe.watch(model) as one:
        model(torch.cat(xs)).square().sum().backward()
    with probe.watch(model) as explicit:
        explicit.step(0)
        for x in xs:  # one step, two forwards, two backwards
            model(x).square().sum().backward()
    with probe.watch(model) as auto:
        for x in xs:  # each forward its own step
            model(x).square().sum().backward()
    ref = _grad_values(one.summary())
    _assert_same(_grad_values(explicit.summary()), ref)
    # counted as two steps, the run value is the root mean square over them: the norm / sqrt(2)
    _assert_same(_grad_values(auto.summary()), {k: v / math.sqrt(2.0) for k, v in ref.items()})
    assert explicit.summary().steps == 1 and auto.summary().steps == 2


def test_retain_graph_every_backward_pass_counts():
    model = SDPAModel(layers=1)
    x = torch.randn(2, 5, 64)
    with probe.watch(model) as once:
        model(x).square().sum().backward()
    with probe.watch(model) as twice:
        loss = model(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
    single, double = _grad_values(once.summary()), _grad_values(twice.summary())
    _assert_same(double, {k: v * math.sqrt(2.0) for k, v in single.items()})


def test_backward_after_the_step_was_flushed_is_kept():
    model = SDPAModel(layers=1)
    with probe.watch(model) as p:
        p.step(0)
        out = model(torch.randn(1, 4, 64))
        p.step(1)  # flushes step 0 before its backward
        out.sum().backward()
    s = p.summary()
    assert set(GRAD_METRICS) <= set(s.metrics("layers.0")) and s.steps == 1


def test_tensorboard_gets_grad_scalars_per_scale(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = SDPAModel(layers=1, kv_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failing sink would warn
        with probe.watch(model, logdir=tmp_path):
            for _ in range(2):
                model(torch.randn(1, 4, 64)).sum().backward()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for scale in ("actual", "unscaled", "standard"):
        assert f"probe.grad_logits@{scale}/layers.0" in tags
    for metric in ("grad_q", "grad_k", "grad_v"):
        assert f"probe.{metric}@actual/layers.0" in tags
    events = acc.Scalars("probe.grad_q@actual/layers.0")
    assert [e.step for e in events] == [0, 1]
    assert probe.Summary.load(tmp_path).value("layers.0", "grad_k").shape == (2,)


# -- activation checkpointing ------------------------------------------------------------------
def _train_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, attn_implementation="sdpa",
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertModel(config).train()


def _train_llama():
    return tiny_llama().train()


def _checkpointed_run(factory, reentrant):
    model = factory()
    if reentrant is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the HF alias is deprecated, still common
            kwargs = None if reentrant is False else {"use_reentrant": True}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # HF default: non-reentrant
    torch.manual_seed(5)
    ids = torch.randint(0, 64, (2, 9))
    kwargs = {"use_cache": False} if factory is _train_llama else {}
    with probe.watch(model) as p:
        _hf_out(model(input_ids=ids, **kwargs)).square().mean().backward()
    return p.summary(), [w.grad.clone() for w in model.parameters() if w.grad is not None]


@pytest.mark.parametrize("factory", [_train_bert, _train_llama], ids=["bert", "llama"])
def test_activation_checkpointing(factory):
    plain, plain_grads = _checkpointed_run(factory, None)
    ckpt, ckpt_grads = _checkpointed_run(factory, False)
    # the hooks sit on the original forward's tensors, which the recomputed backward still reaches
    _assert_same(_grad_values(ckpt), _grad_values(plain), rtol=1e-6)
    assert len(_grad_values(plain)) == len(plain.sites) * (3 + 3)  # grad_logits x 3 scales + q, k, v

    # reentrant checkpointing runs the forward under no_grad and recomputes it inside backward,
    # outside the probed forward: the recomputation is captured on the issuing modules
    reentrant, reentrant_grads = _checkpointed_run(factory, True)
    _assert_same(_grad_values(reentrant), _grad_values(plain), rtol=1e-6)
    assert [reentrant.info(site)["calls"] for site in reentrant.sites] == [1] * len(plain.sites)  # counted once
    for a, b, c in zip(plain_grads, ckpt_grads, reentrant_grads):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-7)


def test_frozen_no_grad_block_inside_a_training_forward_gets_no_grad_metrics_and_no_hooks_left():
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen, self.trained = SDPAModel(layers=1), SDPAModel(layers=1)

        def forward(self, x):
            with torch.no_grad():
                x = self.frozen(x)
            return self.trained(x)

    model = Frozen()
    with probe.watch(model) as p:
        model(torch.randn(1, 4, 64)).sum().backward()
        model(torch.randn(1, 4, 64)).sum().backward()  # the next step removes the first one's hooks
        submodule_hooks = [n for n, m in model.named_modules() if n and (m._forward_hooks or m._forward_pre_hooks)]
        # the current step's watch on the no-grad block; the root's children carry only the watch
        # for a part run outside the root's forward (probe.session.empty_steps), a pre-hook each
        children = ["frozen", "trained"]
        assert [n for n in submodule_hooks if n not in children] == ["frozen.layers.0"]
        assert all(len(model.get_submodule(n)._forward_pre_hooks) == 1 and not model.get_submodule(n)._forward_hooks
                   for n in children)
    s = p.summary()
    assert not set(GRAD_METRICS) & set(s.metrics("frozen.layers.0"))
    assert set(GRAD_METRICS) <= set(s.metrics("trained.layers.0"))
    assert not [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]


# -- failures ----------------------------------------------------------------------------------
def test_a_failing_backward_reduction_warns_and_leaves_training_intact(monkeypatch):
    import probe.session.grad_hooks as capture_grads  # the recorder's hooks compute backward statistics

    def boom(*args, **kwargs):
        raise RuntimeError("reduction exploded")

    model = SDPAModel(layers=1)
    x = torch.randn(1, 4, 64)
    model(x).sum().backward()
    ref = [w.grad.clone() for w in model.parameters()]
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(capture_grads, "grad_logits_stats", boom)
    with pytest.warns(RuntimeWarning, match="grad_logits failed at 'layers.0'.*reduction exploded"):
        with probe.watch(model) as p:
            model(x).sum().backward()
    assert all(torch.equal(w.grad, r) for w, r in zip(model.parameters(), ref))
    metrics = p.summary().metrics("layers.0")
    assert "grad_q" in metrics and "grad_logits" not in metrics


# -- what the backward keeps alive ----------------------------------------------------------
class _Projected(nn.Module):
    """Attention on views of Linear outputs, as Hugging Face lays them out: after SDPA's own
    backward nothing but a hook's record would still reference those outputs."""

    def __init__(self, dim: int = 512, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, dim = x.shape
        q = self.q(x).view(b, length, self.heads, -1).transpose(1, 2)
        k, v = self.kv(x).view(b, length, 2 * self.heads, -1).transpose(1, 2).chunk(2, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_the_backward_does_not_keep_q_k_v_alive():
    """Tensors alive when the backward reaches the input (after SDPA's backward and the
    projections'), grads=True over grads=False: less than the projections' outputs (12 MiB here),
    which the logits hook's record kept alive through the rest of the backward (at
    (1, 8, 16384, 64) that raised the backward's peak by 31.5 MiB of tensors)."""
    from tests.faults.memory import PeakMemory

    torch.manual_seed(0)
    model = _Projected()
    alive = {}
    for grads in (False, True):
        x = torch.randn(1, 2048, 512, requires_grad=True)
        with probe.watch(model, grads=grads) as p:
            model(x).sum().backward()  # the first step runs code paths once
            with PeakMemory(cap=2**30) as mem:
                def at_input(grad: torch.Tensor) -> None:
                    mem._sweep()
                    alive[grads] = mem.current  # storages made in this step and still alive

                x.register_hook(at_input)
                model(x).sum().backward()
            if grads:
                assert set(GRAD_METRICS) <= set(p.summary().metrics("root"))
    projections = 3 * x.numel() * 4
    assert alive[True] - alive[False] < projections / 4, (alive, projections)


def test_a_weakened_record_gives_back_its_views_while_they_live():
    from probe.call import AttentionCall
    from probe.capture.grads import _Record

    base = torch.randn(2, 6, 4, 8)
    q = base.transpose(1, 2)
    k, v = torch.randn(2, 4, 6, 8).chunk(2, dim=1)
    record = _Record(AttentionCall(q=q, k=k, v=v, scale=0.5, causal=True))
    assert record.get().q is q
    record.weaken()
    got = record.get()
    assert got.scale == 0.5 and got.causal
    for new, old in zip((got.q, got.k, got.v), (q, k, v)):
        assert new.data_ptr() == old.data_ptr() and new.stride() == old.stride() and torch.equal(new, old)
    del base, q, got, new, old
    assert record.get() is None  # q's storage freed: nothing to compute from


def test_a_record_whose_tensors_have_no_plain_storage_stays_strong():
    # a tensor subclass without a storage (as DTensor): weakening must not raise inside the
    # backward hook; the record keeps holding it, as before weak records
    from probe.call import AttentionCall
    from probe.capture.grads import _Record

    class NoStorage(torch.Tensor):
        def untyped_storage(self):
            raise RuntimeError("no storage")

    q = torch.randn(1, 2, 3, 4).as_subclass(NoStorage)
    record = _Record(AttentionCall(q=q, k=torch.randn(1, 2, 3, 4), v=None, scale=0.5))
    record.weaken()
    assert record.get().q is q
