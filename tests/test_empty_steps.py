"""A sampled step that measured no attention is a warning naming what was watched (issue 25)."""

from __future__ import annotations

import warnings
from typing import List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe


class Attention(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)


class Wrapper(nn.Module):
    """A LightningModule-like wrapper: training code calls ``encoder`` and ``head`` directly."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Attention()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _probe_messages(run) -> List[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if str(w.message).startswith("probe:")]


def _x() -> torch.Tensor:
    return torch.randn(2, 5, 8)


def test_explicit_steps_whose_root_forward_never_runs_name_the_submodules_that_ran():
    model, x = Wrapper(), _x()

    def run() -> None:
        with probe.watch(model) as p:
            for step in range(3):
                p.step(step)
                model.head(model.encoder(x)).sum().backward()
            assert p.summary().sites == []

    messages = _probe_messages(run)
    assert len(messages) == 1, messages  # once per probe
    assert "step 0 was sampled but the forward of the watched module (Wrapper) never ran" in messages[0]
    assert "ran directly instead: encoder, head" in messages[0]


def test_a_forward_without_attention_is_warned_once():
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU()), _x()

    def run() -> None:
        with probe.watch(model):
            for _ in range(3):
                model(x)

    messages = _probe_messages(run)
    assert len(messages) == 1, messages
    assert "step 0 was sampled but no attention call was captured inside the watched module (Sequential)" in messages[0]


def test_explicit_steps_judge_the_whole_step():
    """Two forwards in one step (micro-batches), the second with attention: nothing to say."""

    class Sometimes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()

        def forward(self, x: torch.Tensor, attend: bool) -> torch.Tensor:
            return self.attn(x) if attend else x * 2

    model, x = Sometimes(), _x()

    def run() -> None:
        with probe.watch(model) as p:
            p.step(0)
            model(x, False)
            model(x, True)
            p.step(1)
            model(x, False)
            p.step(2)

    messages = _probe_messages(run)
    assert len(messages) == 1, messages
    assert "step 1 was sampled but no attention call was captured" in messages[0]
    assert "ran 1 time(s)" in messages[0]


def test_no_warning_when_attention_runs_or_the_step_is_not_sampled():
    model, x = Wrapper(), _x()

    def run() -> None:
        with probe.watch(model) as p:
            for step in range(3):
                p.step(step)
                model(x).sum().backward()
        with probe.watch(model, every=2) as p:
            p.step(0)
            model(x)
            p.step(1)  # not sampled: calling parts directly is nobody's business
            model.head(model.encoder(x))
            p.step(2)
            model(x)

    assert _probe_messages(run) == []


def test_an_evaluation_under_pause_is_not_taken_for_a_step_without_forward():
    model, x = Wrapper(), _x()

    def run() -> None:
        with probe.watch(model) as p:
            p.step(0)
            model(x)
            p.pause()
            with torch.no_grad():
                model(x)
            p.step(1)
            model(x)

    assert _probe_messages(run) == []


def test_the_watcher_leaves_no_global_hook():
    from torch.nn.modules import module as module_mod

    before = (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks))
    model, x = Wrapper(), _x()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = probe.watch(model)
        p.step(0)
        model.encoder(x)  # the watcher is armed: the root's forward has not run
        assert len(module_mod._global_forward_pre_hooks) == before[0] + 1
        p.close()
    assert (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks)) == before


@pytest.mark.parametrize("grad", [True, False])
def test_outputs_unchanged_while_the_watcher_is_armed(grad: bool):
    model, x = Wrapper(), _x()
    with torch.set_grad_enabled(grad):
        expected = model.head(model.encoder(x))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with probe.watch(model) as p:
                p.step(0)
                got = model.head(model.encoder(x))
    assert torch.equal(got, expected)


def test_a_step_that_raised_before_any_forward_is_not_warned_at_close():
    model, x = Wrapper(), _x()

    def run() -> None:
        p = probe.watch(model)
        p.step(0)
        model(x)
        p.step(1)
        p.close()  # step 1 raised before anything ran (a failed training step)
        p2 = probe.watch(model)
        p2.step(0)
        model.encoder(x)
        p2.close()  # parts ran: the pattern is there, said at close

    messages = _probe_messages(run)
    assert len(messages) == 1 and "ran directly instead: encoder" in messages[0], messages


class Hooked(nn.Module):
    """TransformerLens' shape: ``run_with_hooks`` calls ``self.forward`` directly (so do
    ``HookedTransformer.generate`` and any ``model.forward(x)``), skipping ``nn.Module.__call__``
    and with it the watched module's own hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Attention(), Attention()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return h

    def run_with_hooks(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


def test_a_direct_forward_call_under_automatic_steps_is_named():
    # before: nothing measured and not a word (a TransformerLens run_with_hooks under probe.watch)
    model, x = Hooked(), _x()

    def run() -> None:
        with probe.watch(model, every=1) as p:
            for _ in range(2):
                model.run_with_hooks(x).sum().backward()
            model.forward(x)
            assert p.summary().sites == []

    messages = _probe_messages(run)
    assert len(messages) == 1, messages  # once per probe
    # named after the first part that may run attention (torch.nn leaves such as its Linear embedding are not watched)
    assert "'blocks.0' (Attention), a submodule of the watched module Hooked, ran outside the watched module's " \
        "forward" in messages[0]
    assert "NOT measured" in messages[0] and "p.step(n, window=True)" in messages[0]


def test_a_direct_forward_after_ordinary_ones_is_named_too():
    model, x = Hooked(), _x()

    def run() -> None:
        with probe.watch(model, every=1) as p:
            model(x).sum().backward()
            model.run_with_hooks(x)
            assert p.summary().sites == ["blocks.0", "blocks.1"]

    messages = _probe_messages(run)
    assert len(messages) == 1 and "'blocks.0' (Attention)" in messages[0], messages


class Checkpointed(Hooked):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.embed(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=False)
        return h


def test_no_outside_warning_for_calls_through_the_module_a_backward_recompute_or_a_pause():
    model, x = Checkpointed(), _x()
    loss_fn = nn.MSELoss()

    def run() -> None:
        with probe.watch(model, every=1) as p:
            for _ in range(2):
                loss_fn(model(x), torch.zeros(2, 5, 8)).backward()  # the blocks rerun in the backward
            p.pause()
            with torch.no_grad():
                model.blocks[0](x)  # an evaluation the user paused for
        with probe.watch(model, every=1) as p:
            p.step(0)
            model(x)
            p.step(1)
            model(x)  # explicit steps keep their own watcher
        other = Hooked()
        with probe.watch(model, every=1):
            model(x)
            other.forward(x)  # another model's parts are nobody's business

    assert _probe_messages(run) == []


def test_a_direct_forward_in_a_recording_window_is_measured_and_no_hook_is_left():
    from torch.nn.modules import module as module_mod

    before = len(module_mod._global_forward_pre_hooks)
    model, x = Hooked(), _x()
    expected = model.forward(x)

    def run() -> None:
        with probe.watch(model, every=1) as p:
            p.step(0, window=True)
            got = model.run_with_hooks(x)
            assert torch.equal(got, expected)
        assert p.summary().sites == ["blocks.0", "blocks.1"]

    assert _probe_messages(run) == []
    assert len(module_mod._global_forward_pre_hooks) == before


def test_the_outside_watch_leaves_an_encoder_layers_fast_path_alone():
    """``nn.TransformerEncoderLayer`` takes its fused fast path (eval, no grad) only without a
    hook on it or inside it: the watch for parts run outside the root's forward must not put one
    there (it did: every step of a watched ``Sequential(layer)`` then ran the unfused path, outputs
    2.4e-7 off)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True).eval()
    model = nn.Sequential(layer)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        bare = model(x)
        with probe.watch(model, every=2) as p:
            assert not any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules())
            model(x)  # step 0: sampled
            unsampled = model(x)  # step 1
            assert not any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules())
        assert p.summary().sites
    assert torch.equal(unsampled, bare)
