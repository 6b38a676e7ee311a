"""A BaseException inside a sampled forward (KeyboardInterrupt, SystemExit, GeneratorExit) skips
torch's always_call forward hooks; probe restores its state anyway: the capture mode is popped,
the global module hooks are removed, an unrelated model's attention is not recorded, and steps
keep counting."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import probe
from tests.helpers import SDPAModel


class Interruptible(nn.Module):
    """Raises `exc` after its attention ran, on the forward numbered `when`."""

    def __init__(self, exc: BaseException, when: int = 1) -> None:
        super().__init__()
        self.inner = SDPAModel(layers=1)
        self.exc, self.when, self.calls = exc, when, 0

    def forward(self, x):
        y = self.inner(x)
        self.calls += 1
        if self.calls - 1 == self.when:
            raise self.exc
        return y


def _global_hooks() -> int:
    m = nn.modules.module
    return len(m._global_forward_pre_hooks) + len(m._global_forward_hooks)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(1), GeneratorExit()], ids=lambda e: type(e).__name__)
def test_state_is_restored_after_a_base_exception_in_a_sampled_forward(exc):
    model = Interruptible(exc)
    x = torch.randn(1, 4, 64)
    hooks_before = _global_hooks()
    with probe.watch(model) as p:
        model(x)
        with pytest.raises(type(exc)):
            model(x)  # step 1 ends in the exception, as a Ctrl-C caught by a notebook
        # an unrelated model's attention, while probe's mode may still sit on the stack
        other = SDPAModel(layers=1)
        other(x)
        model(x)
        model(x)
        assert p.current_step == 3  # steps kept counting
        s = p.summary()
        assert s.sites == ["inner.layers.0"]  # no root#1 / root#2 from the other model
        assert s.steps == 4 and s.info("inner.layers.0")["calls"] == 4
        # between forwards nothing of probe is left on the stack or in the global hooks
        assert not any(type(m).__name__ == "CaptureMode" for m in _get_current_function_mode_stack())
        assert _global_hooks() == hooks_before
    assert _get_current_function_mode_stack() == [] and _global_hooks() == hooks_before


def test_an_interrupted_forward_does_not_read_as_a_part_run_outside_the_next_one(recwarn):
    # the recovery at the next forward's start re-armed the watch for parts run outside the
    # root's forward, inside that forward: 'inner' was then said to run outside it
    model = Interruptible(KeyboardInterrupt())
    x = torch.randn(1, 4, 64)
    with probe.watch(model):
        model(x)
        with pytest.raises(KeyboardInterrupt):
            model(x)
        model(x)
    assert not [w for w in recwarn if "ran outside the watched module's forward" in str(w.message)]


def test_state_is_restored_when_the_probe_is_asked_right_after_the_interrupt():
    model = Interruptible(KeyboardInterrupt(), when=0)
    p = probe.watch(model)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(1, 4, 64))
    assert p.summary().steps == 1  # the call on the probe restores the state first
    assert _get_current_function_mode_stack() == []
    p.close()
    assert _get_current_function_mode_stack() == [] and _global_hooks() == 0


def test_a_root_that_calls_itself_is_not_mistaken_for_an_interrupted_one():
    class Recursive(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = SDPAModel(layers=1)

        def forward(self, x, again=True):
            y = self.inner(x)
            return self(y, again=False) if again else y

    model = Recursive()
    with probe.watch(model) as p:
        model(torch.randn(1, 4, 64))
        model(torch.randn(1, 4, 64))
    assert p.summary().steps == 2 and p.summary().info("inner.layers.0")["calls"] == 4
