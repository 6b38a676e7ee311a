"""``ProbeCallback(qk_clip=τ)`` under Lightning's manual optimization: every optimizer step clips
the heads of the modules it updates, from their forwards since their last clip.

Each run is compared with a twin: the same modules, data and steps in a plain loop, clipped by
hand with the published rule (per head ``S`` = the max of ``σ·q·kᵀ`` over the module's training
forwards since its last clip, in float64; after the step of the optimizer holding the module,
its q and k rows and biases times ``√min(1, τ/S)``). A learning rate above 0 makes the order
matter: clipping a module after another module's step, or one step late, gives other weights.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

try:
    import lightning.pytorch as pl
except ImportError:
    pl = pytest.importorskip("pytorch_lightning")

from probe.integrations.lightning import ProbeCallback  # noqa: E402
from tests.qk_clip_util import max_logit64  # noqa: E402

TAU = 2.5


class Attn(nn.Module):
    """Separate q, k, v projections and one SDPA call; ``measured`` (twin only): per forward with
    autograd on, the float64 max logit per head."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        with torch.no_grad():
            self.q.weight.mul_(6)
            self.k.weight.mul_(6)
        self.measured = None

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (lin(x).view(b, n, self.h, self.dh).transpose(1, 2) for lin in (self.q, self.k, self.v))
        if self.measured is not None and torch.is_grad_enabled():
            self.measured.append(max_logit64(q, k))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))


def clip_by_hand(module: Attn) -> None:
    """The rule, applied after the step of the optimizer holding ``module``."""
    if not module.measured:
        return
    s = torch.stack(module.measured).amax(0)
    module.measured.clear()
    gamma = (TAU / s).clamp(max=1.0).float()
    root = gamma.sqrt().repeat_interleave(module.dh)
    with torch.no_grad():
        for lin in (module.q, module.k):
            lin.weight.mul_(root[:, None])
            lin.bias.mul_(root)


def critic_after_generator(m, x, step):  # the GAN of the fault: the critic runs after the generator's step
    opt_g, opt_d = step.optimizers
    fake = m.gen(x)
    step.run(opt_g, fake.square().mean())
    step.run(opt_d, m.critic(fake.detach()).square().mean())


def critic_first(m, x, step):  # the critic steps first, then runs again for the generator's loss
    opt_g, opt_d = step.optimizers
    fake = m.gen(x)
    step.run(opt_d, m.critic(fake.detach()).square().mean())
    step.run(opt_g, -m.critic(fake).square().mean())


def one_optimizer_twice(m, x, step):  # one optimizer for both, stepped after each module
    (opt,) = step.optimizers
    fake = m.gen(x)
    step.run(opt, fake.square().mean())
    step.run(opt, m.critic(fake.detach()).square().mean())


def accumulated(m, x, step):  # one optimizer stepped every second batch (accumulation by hand)
    (opt,) = step.optimizers
    loss = m.critic(m.gen(x)).square().mean()
    step.run(opt, loss, stepping=step.batch % 2 == 1)


def real_and_fake(m, x, step):  # the critic runs twice before its step (on real and on fake samples)
    opt_g, opt_d = step.optimizers
    fake = m.gen(x)
    step.run(opt_d, m.critic(x).square().mean() - m.critic(fake.detach()).square().mean())
    step.run(opt_g, m.critic(fake).square().mean())




PATTERNS = {"critic_after_generator": (critic_after_generator, 2), "critic_first": (critic_first, 2),
            "one_optimizer_twice": (one_optimizer_twice, 1), "accumulated": (accumulated, 1),
            "real_and_fake": (real_and_fake, 2)}
CLIPPED = ["accumulated", "critic_after_generator", "critic_first", "one_optimizer_twice"]  # every module, exactly


class Step:
    """What a training step pattern needs: its optimizers and one backward (and step) each."""

    def __init__(self, optimizers, backward, clip=None) -> None:
        self.optimizers, self.backward, self.clip, self.batch = optimizers, backward, clip, 0

    def run(self, opt, loss, stepping: bool = True) -> None:
        self.backward(loss)
        if stepping:
            opt.step()
            opt.zero_grad()
            if self.clip is not None:
                self.clip(opt)


def optimizers(m, count: int):
    groups = (m.gen.parameters(), m.critic.parameters()) if count == 2 else (m.parameters(),)
    return [torch.optim.SGD(g, lr=0.2) for g in groups]


class GAN(pl.LightningModule):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.pattern, self.count = PATTERNS[pattern]
        self.gen, self.critic = Attn(), Attn()

    def training_step(self, batch, batch_idx):
        opts = self.optimizers()
        step = Step(opts if isinstance(opts, list) else [opts], self.manual_backward)
        step.batch = batch_idx
        self.pattern(self, batch[0], step)

    def configure_optimizers(self):
        return optimizers(self, self.count)


def data():
    return torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(1))


def twin(module: GAN, clipped=("gen", "critic")) -> GAN:
    """The plain loop, the ``clipped`` modules clipped by hand (``module``: a copy of the Lightning
    run's initial state)."""
    opts = optimizers(module, module.count)
    parts = [getattr(module, name) for name in clipped]
    for m in parts:
        m.measured = []

    def clip(opt):
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        for m in parts:
            if id(m.q.weight) in held:
                clip_by_hand(m)

    step = Step(opts, lambda loss: loss.backward(), clip)
    for i, x in enumerate(data().split(2)):
        step.batch = i
        module.pattern(module, x, step)
    return module


def fit(module: GAN, callback) -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data()), batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[callback])
    trainer.fit(module, loader)


@pytest.mark.parametrize("pattern", CLIPPED)
def test_lightning_manual_optimization_clips_every_module_after_its_own_step(tmp_path, pattern):
    module = GAN(pattern)
    reference = twin(copy.deepcopy(module))
    for m in (reference.gen, reference.critic):
        assert m.measured == [] or pattern == "critic_first"  # the critic's second forward waits for its step
    cb = ProbeCallback(qk_clip=TAU, logdir=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(module, cb)
    assert not [str(w.message) for w in caught if "qk_clip" in str(w.message)]
    summary = cb.probe.summary()
    for site in ("gen", "critic"):
        assert summary.info(site)["qk_clip"].startswith(f"q: {site}.q.weight rows"), site
        assert summary.value(site, "qk_clip_steps").min() >= 1, site  # both heads were over τ
        for name, p in getattr(module, site).named_parameters():
            torch.testing.assert_close(p, getattr(reference, site).get_parameter(name), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{site}.{name}: {m}")


def test_lightning_module_whose_weights_no_optimizer_holds_is_named(tmp_path):
    """A trainable module left out of every optimizer is never clipped: named when training ends."""

    class Partial(GAN):
        def configure_optimizers(self):
            return torch.optim.SGD(self.gen.parameters(), lr=0.2)

    module = Partial("accumulated")
    before = copy.deepcopy(module.critic.state_dict())
    with pytest.warns(UserWarning, match=r"qk_clip never clipped site 'critic'.*critic\.q\.weight"):
        fit(module, ProbeCallback(qk_clip=TAU, logdir=str(tmp_path)))
    for name, value in module.critic.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_lightning_module_run_twice_between_two_steps_is_refused_by_name_for_the_whole_run(tmp_path):
    """Two calls of the critic's weights before the critic's step are refused (a limit of the
    trace, named); its single call before the generator's step does not undo the refusal."""
    module = GAN("real_and_fake")
    reference = twin(copy.deepcopy(module), clipped=("gen",))
    cb = ProbeCallback(qk_clip=TAU, logdir=str(tmp_path))
    with pytest.warns(UserWarning, match=r"qk_clip does not clip site 'critic': .* used by 2 calls"):
        fit(module, cb)
    summary = cb.probe.summary()
    assert summary.info("critic")["qk_clip"].startswith("refused: ")
    assert summary.value("critic", "qk_clip_steps").sum() == 0
    assert summary.value("critic", "qk_clip_factor").min() == 1.0
    assert summary.info("gen")["qk_clip"].startswith("q: gen.q.weight rows")
    for name, p in module.named_parameters():  # the generator clipped as the rule says, the critic never
        torch.testing.assert_close(p, reference.get_parameter(name), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
