"""QK-Clip (``qk_clip=``) against a hand-written reference of the published rule, and its lifecycle.

The reference is Kimi K2's MuonClip as published: the max logit S_h of each head comes from the
forward of the step; after the optimizer's update, a head with S_h > τ has its query and key
projection rows (and bias entries) multiplied by √(τ/S_h). Written here with plain tensor code
on a toy model whose q and k projections are known by construction.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from probe.errors import ProbeError
from probe.experiment.clip_rule import factors


class Toy(nn.Module):
    """One attention layer, separate q/k/v projections with biases, H heads over Hk kv heads."""

    def __init__(self, d: int = 32, heads: int = 4, kv_heads: int = 4) -> None:
        super().__init__()
        self.h, self.hk, self.dh = heads, kv_heads, d // heads
        self.q = nn.Linear(d, heads * self.dh)
        self.k = nn.Linear(d, kv_heads * self.dh)
        self.v = nn.Linear(d, kv_heads * self.dh)
        self.o = nn.Linear(heads * self.dh, d)

    def qk(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.dh).transpose(1, 2)
        k = self.k(x).view(b, n, self.hk, self.dh).transpose(1, 2)
        return q, k

    def forward(self, x):
        b, n, _ = x.shape
        q, k = self.qk(x)
        v = self.v(x).view(b, n, self.hk, self.dh).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.hk != self.h)
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


def _max_logits(model: Toy, x: torch.Tensor) -> torch.Tensor:
    """S_h: max over batch, query and causal key of q·k/√d, float64, written out."""
    q, k = (t.detach().double() for t in model.qk(x))
    k = k.repeat_interleave(model.h // model.hk, 1)
    z = q @ k.transpose(-1, -2) / math.sqrt(model.dh)
    z = z.masked_fill(torch.ones(z.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return z.amax((0, 2, 3))


def _between(s: torch.Tensor) -> float:
    """A τ halfway between the second and third largest heads' max logits (no head near τ)."""
    top = s.sort(descending=True).values
    return float(top[1] + top[2]) / 2


def _reference_step(model: Toy, x: torch.Tensor, tau: float, lr: float) -> Toy:
    """The published rule: S from this step's forward, SGD update, then √(τ/S) on q and k rows (MHA)."""
    ref = copy.deepcopy(model)
    s = _max_logits(ref, x)
    loss = ref(x).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= lr * p.grad
        for h in range(ref.h):
            if s[h] > tau:
                f = math.sqrt(tau / float(s[h]))
                rows = slice(h * ref.dh, (h + 1) * ref.dh)
                for lin in (ref.q, ref.k):
                    lin.weight[rows] *= f
                    lin.bias[rows] *= f
    return ref


def _probe_step(model: Toy, x: torch.Tensor, tau: float, lr: float, **options) -> probe.Probe:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with probe.watch(model, qk_clip=tau, **options) as p:
        model(x).pow(2).mean().backward()
        opt.step()
    return p


def _model_and_batch(seed: int = 0, heads: int = 4, kv_heads: int = 4):
    torch.manual_seed(seed)
    model = Toy(heads=heads, kv_heads=kv_heads)
    with torch.no_grad():
        model.q.weight.mul_(4.0)
        model.k.weight.mul_(4.0)
    return model, torch.randn(3, 7, 32)


@pytest.mark.parametrize("every", [None, 1])  # max-logit-only steps, and fully probed steps
def test_matches_the_published_rule_after_an_update(every):
    model, x = _model_and_batch()
    s = _max_logits(model, x)
    tau = float(s.sort().values[1:3].mean())  # two heads above, two below
    ref = _reference_step(model, x, tau, lr=0.05)
    _probe_step(model, x, tau, lr=0.05, every=every)
    clipped = s > tau
    assert clipped.sum() == 2
    for (name, got), (_, want) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)
    # rows of unclipped heads: the plain update, bit for bit (multiplied by exactly 1.0)
    for h in range(4):
        if not clipped[h]:
            rows = slice(h * 8, (h + 1) * 8)
            assert torch.equal(model.q.weight[rows], ref.q.weight[rows])
            assert torch.equal(model.k.bias[rows], ref.k.bias[rows])


def test_same_batch_max_logit_is_tau_after_a_clip_without_update():
    model, x = _model_and_batch(1)
    s = _max_logits(model, x)
    tau = _between(s)
    p = _probe_step(model, x, tau, lr=0.0, every=None)
    after = _max_logits(model, x)
    over = s > tau
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-6, atol=0)
    assert torch.equal(after[~over], s[~over])
    summary = p.summary()
    torch.testing.assert_close(torch.from_numpy(summary.value("root", "qk_clip_logit")), s, rtol=1e-5, atol=1e-5)
    factor = torch.from_numpy(summary.value("root", "qk_clip_factor"))
    torch.testing.assert_close(factor, torch.where(over, tau / s, 1.0), rtol=1e-5, atol=0)
    assert summary.value("root", "qk_clip_steps").tolist() == over.double().tolist()


@pytest.mark.parametrize("kv_heads", [2, 1])  # GQA, MQA
def test_grouped_kv_heads_every_query_head_of_a_group_lands_at_or_below_tau(kv_heads):
    model, x = _model_and_batch(2, heads=4, kv_heads=kv_heads)
    s = _max_logits(model, x)
    k_before = model.k.weight.detach().clone()
    for tau in (_between(s), float(s.min()) / 2):  # some heads of a group clipped; then all
        model_t = copy.deepcopy(model)
        _probe_step(model_t, x, tau, lr=0.0, every=None)
        after = _max_logits(model_t, x)
        over = s > tau
        torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-6, atol=0)
        assert torch.equal(after[~over], s[~over])
        group = 4 // kv_heads
        for g in range(kv_heads):
            rows = slice(g * 8, (g + 1) * 8)
            all_over = bool(over[g * group:(g + 1) * group].all())
            # a kv head is scaled only when every query head of its group is clipped
            assert torch.equal(model_t.k.weight[rows], k_before[rows]) != all_over


def test_factors_split_gamma_between_query_and_shared_key():
    top = torch.tensor([200.0, 50.0, 400.0, 300.0, float("nan"), float("inf")])
    g, a, b = factors(top, 100.0, 3)
    assert g.tolist()[:4] == pytest.approx([0.5, 1.0, 0.25, 1 / 3])
    assert g[4] == 1.0 and g[5] == 1.0  # non-finite: never a reason to scale
    assert b[0] == 1.0 and a[0] == pytest.approx(0.5) and a[1] == 1.0  # group 0 has an unclipped head
    assert b[1] == pytest.approx(math.sqrt(1 / 3)) and (a[2] * b[1]) == pytest.approx(0.25)
    assert (a <= 1).all() and (b <= 1).all()


def test_max_over_micro_batches_and_not_over_evaluation():
    model, x = _model_and_batch(3)
    x2 = x.flip(1) * 2
    s = torch.maximum(_max_logits(model, x), _max_logits(model, x2))
    tau = _between(s)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with probe.watch(model, qk_clip=tau, every=None):
        for batch in (x, x2):  # gradient accumulation: one optimizer step
            model(batch).sum().backward()
        with torch.no_grad():
            model(x * 100)  # an evaluation forward: not counted
        opt.step()
    after = torch.maximum(_max_logits(model, x), _max_logits(model, x2))
    over = s > tau
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-6, atol=0)
    assert torch.equal(model.v.weight, ref.v.weight)


class _Pair(nn.Module):
    """A generator and a critic, each to be stepped by its own optimizer (a GAN)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gen, self.critic = Toy(), Toy()

    def forward(self, x):
        return self.critic(self.gen(x))


def test_each_optimizer_clips_the_sites_it_updates_after_its_own_step():
    """The critic's optimizer steps first: the generator's heads wait for the generator's step,
    so they are clipped after its update, as the rule says, not before it."""
    model, x = _Pair(), torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(model)
    with torch.no_grad():
        s = {"gen": _max_logits(ref.gen, x), "critic": _max_logits(ref.critic, ref.gen(x))}
    tau = float(torch.cat(list(s.values())).min()) / 2  # every head is clipped
    ref(x).pow(2).mean().backward()
    with torch.no_grad():
        for name, part in (("critic", ref.critic), ("gen", ref.gen)):
            for p in part.parameters():
                p -= 0.5 * p.grad
            f = (tau / s[name]).sqrt().float().repeat_interleave(part.dh)
            for lin in (part.q, part.k):
                lin.weight.mul_(f[:, None])
                lin.bias.mul_(f)
    opt_g = torch.optim.SGD(model.gen.parameters(), lr=0.5)
    opt_d = torch.optim.SGD(model.critic.parameters(), lr=0.5)
    with probe.watch(model, qk_clip=tau, every=None) as p:
        model(x).pow(2).mean().backward()
        opt_d.step()
        opt_g.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref.state_dict()[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert p.summary().value("gen", "qk_clip_steps").tolist() == [1.0] * 4


def test_no_clip_without_an_optimizer_step_nor_for_another_models_optimizer():
    model, x = _model_and_batch(4)
    other = nn.Linear(3, 3)
    before = copy.deepcopy(model.state_dict())
    with probe.watch(model, qk_clip=1e-3, every=None):
        model(x).sum().backward()
        torch.optim.SGD(other.parameters(), lr=0.1).step()  # holds none of the model's weights
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_close_removes_the_optimizer_hook():
    model, x = _model_and_batch(5)
    p = probe.watch(model, qk_clip=1e-3, every=None)
    p.close()
    before = copy.deepcopy(model.state_dict())
    model(x).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    from torch.optim.optimizer import _global_optimizer_post_hooks
    assert not _global_optimizer_post_hooks


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "100", True])
def test_bad_tau_is_a_probe_error_naming_it(bad):
    with pytest.raises(ProbeError, match="qk_clip"):
        probe.watch(Toy(), qk_clip=bad)


def test_every_none_needs_qk_clip():
    with pytest.raises(ProbeError, match="every"):
        probe.watch(Toy(), every=None)


def test_refused_site_is_warned_once_recorded_and_left_alone():
    class Lora(Toy):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 2, bias=False), nn.Linear(2, 32, bias=False)

        def qk(self, x):
            b, n, _ = x.shape
            q = (self.q(x) + self.b(self.a(x))).view(b, n, self.h, self.dh).transpose(1, 2)
            return q, self.k(x).view(b, n, self.hk, self.dh).transpose(1, 2)

    torch.manual_seed(0)
    model = Lora()
    x = torch.randn(2, 5, 32) * 10
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.warns(UserWarning, match="qk_clip does not clip site 'root'.*LoRA") as record:
        with probe.watch(model, qk_clip=1e-3, every=None) as p:
            for _ in range(3):
                model(x).sum().backward()
                opt.step()
    assert sum("does not clip" in str(w.message) for w in record) == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    info = p.summary().info("root")
    assert info["qk_clip"].startswith("refused: q is not traced")
    assert (p.summary().value("root", "qk_clip_factor") == 1).all()
    assert (p.summary().value("root", "qk_clip_logit") > 1e-3).all()


def test_watch_with_sampled_steps_keeps_full_statistics_and_clips_every_step():
    model, x = _model_and_batch(6)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = _max_logits(model, x)
    tau = _between(s)
    with probe.watch(model, qk_clip=tau, every=3) as p:
        for _ in range(4):
            model(x).sum().backward()
            opt.step()
    summary = p.summary()
    assert {"entropy", "logit_max", "qk_clip_logit", "qk_clip_factor"} <= set(summary.metrics("root"))
    # clipped at the first step, then at τ to rounding (a later step may shave off an ulp)
    over = s > tau
    steps = torch.from_numpy(summary.value("root", "qk_clip_steps"))
    assert (steps[over] >= 1).all() and (steps[~over] == 0).all()
    torch.testing.assert_close(torch.from_numpy(summary.value("root", "qk_clip_factor")).float(),
                               torch.where(over, tau / s, 1.0).float(), rtol=1e-5, atol=0)


def _copy_task(clip: bool, tau: float, steps: int = 25):
    """An Adam run whose learning rate makes the max logit explode (a copy task on a fixed batch:
    sharper attention always lowers the loss). Returns per step and head the max logit S_t
    (measured before the step's forward) and r_t, what the step's update alone multiplied it by
    (measured after the update, before the clip)."""
    torch.manual_seed(0)
    model = Toy()
    x = torch.randn(2, 12, 32)
    y = x.roll(1, dims=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.2)
    tops, grown = [], []
    # per-optimizer post-hooks run before probe's global one: this sees the update without the clip
    opt.register_step_post_hook(lambda o, a, k: grown.append(_max_logits(model, x)))
    p = probe.watch(model, qk_clip=tau, every=None) if clip else None
    try:
        for _ in range(steps):
            tops.append(_max_logits(model, x))
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
    finally:
        if p is not None:
            p.close()
    return torch.stack(tops), torch.stack(grown) / torch.stack(tops)


def test_exploding_run_is_capped_at_tau_up_to_one_updates_growth():
    tau = 20.0
    free, _ = _copy_task(False, tau)
    assert free.max() > 10 * tau  # without the clip the max logit explodes
    tops, growth = _copy_task(True, tau)
    # The published rule caps the logits of the batch that measured them at τ; the next forward
    # sees the weights after one more update, which multiplied each head's max logit by r_t. On
    # one layer and one batch this is exact, per head: S_{t+1} = min(S_t, τ)·r_t.
    torch.testing.assert_close(tops[1:], torch.clamp(tops[:-1], max=tau) * growth[:-1], rtol=1e-4, atol=1e-6)
    assert (tops > tau).any()  # the clip had work to do
    assert tops.max() < free.max() / 10


def test_probe_qk_clip_is_watch_with_the_option(tmp_path):
    model, x = _model_and_batch(7)
    s = _max_logits(model, x)
    tau = _between(s)
    with probe.qk_clip(model, tau, logdir=str(tmp_path / "run")) as p:
        assert p.every is None
        model(x).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    saved = probe.Summary.load(str(tmp_path / "run"))
    assert saved.metrics("root") == ["qk_clip_logit", "qk_clip_factor", "qk_clip_steps"]
    assert saved.value("root", "qk_clip_steps").tolist() == (s > tau).double().tolist()


@pytest.mark.parametrize("every", [None, 1])
def test_an_unverified_site_is_refused(every):
    from tests.test_verify import ReusedBuffer  # its record no longer matches the model after the softmax

    torch.manual_seed(0)
    model, x = ReusedBuffer(), torch.randn(2, 8, 16) * 5
    before = copy.deepcopy(model.state_dict())
    with pytest.warns(UserWarning, match="qk_clip does not clip site 'root'.*unverified"):
        with probe.watch(model, qk_clip=1e-3, every=every) as p:
            model(x).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.0).step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert "unverified" in p.summary().info("root")["qk_clip"]


def test_a_forgotten_clip_keeps_no_model_alive():
    import gc
    import weakref

    def trial():
        model, x = _model_and_batch(8)
        p = probe.qk_clip(model, 1.0)
        model(x).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
        return weakref.ref(model), weakref.ref(p)

    with pytest.warns(UserWarning, match="never closed"):
        model, p = trial()
        gc.collect()
    assert model() is None and p() is None
    from torch.optim.optimizer import _global_optimizer_post_hooks
    assert not _global_optimizer_post_hooks


def test_factors_follow_any_grouping_of_query_heads_onto_kv_heads():
    # a k repeated per query head (repeat_interleave) is one kv head per group whatever the record says
    top = torch.tensor([200.0, 400.0, 50.0, 300.0])
    g, a, b = factors(top, 100.0, torch.tensor([0, 1, 0, 1]))
    assert b[0] == 1.0 and b[1] == pytest.approx(math.sqrt(1 / 3))
    torch.testing.assert_close(a * b[torch.tensor([0, 1, 0, 1])], g)


def test_a_compiled_model_is_refused_at_watch():
    with pytest.raises(ProbeError, match="qk_clip measures every training forward in eager mode"):
        probe.watch(torch.compile(Toy()), qk_clip=100.0)


def test_the_example_runs(tmp_path, monkeypatch, capsys):
    import os
    import runpy

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setattr("sys.argv", ["qk_clip.py", "--steps", "6", "--tau", "10", "--logdir", str(tmp_path)])
    runpy.run_path(os.path.join(root, "examples", "qk_clip.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "largest over the run" in out and "steps clipped per head" in out
    assert probe.Summary.load(str(tmp_path / "clipped")).metrics("blocks.0.attn")[0] == "qk_clip_logit"


def test_tensorboard_has_what_the_clip_did_per_head_and_over_heads(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, x = _model_and_batch(7)
    s = _max_logits(model, x)
    tau = _between(s)
    with probe.qk_clip(model, tau, logdir=str(tmp_path), per_head=True):
        model(x).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    events = EventAccumulator(str(tmp_path))
    events.Reload()

    def read(metric, head=None):
        tag = f"probe.{metric}@actual/root" + ("" if head is None else f"/head{head:02d}")
        (point,) = events.Scalars(tag)
        assert point.step == 0
        return point.value

    factor = (tau / s).clamp(max=1.0)
    for h in range(len(s)):
        assert read("qk_clip_logit", h) == pytest.approx(float(s[h]), rel=1e-5)
        assert read("qk_clip_factor", h) == pytest.approx(float(factor[h]), rel=1e-5)
        assert read("qk_clip_steps", h) == float(s[h] > tau)
    # over heads: the largest S, the smallest factor, the clipped heads counted
    assert read("qk_clip_logit") == pytest.approx(float(s.max()), rel=1e-5)
    assert read("qk_clip_factor") == pytest.approx(float(factor.min()), rel=1e-5)
    assert read("qk_clip_steps") == float((s > tau).sum())


def test_a_run_ending_on_an_unsampled_step_counts_only_its_sampled_steps():
    # close() hands out the clip records of the unsampled steps since the last flush on their own:
    # that window covers no probed step (it counted one: 3 steps where 0 and 2 were sampled)
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            heads = [t.view(2, 6, 2, 8).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x))]
            return F.scaled_dot_product_attention(*heads).sum()

    for clip in (None, 100.0):
        torch.manual_seed(0)
        model, x = Tiny(), torch.randn(2, 6, 16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with probe.watch(model, every=2, qk_clip=clip) as p:
            for _ in range(4):  # steps 0 and 2 sampled, 3 the last
                model(x).backward()
                opt.step()
                opt.zero_grad()
        assert p.summary().steps == 2, clip
