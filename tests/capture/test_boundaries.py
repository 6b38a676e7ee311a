"""Module boundaries ask front ends only what they may answer: held calls after FrontEnd.held,
fused kernels for the declared module types (probe.capture.frontend, probe.capture.mode)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

import probe.capture.frontend as frontend
from probe.capture.frontend import FrontEnd
from probe.capture.mode import CaptureMode, ModuleStack


class _Holder(FrontEnd):
    """Records every ``torch.tanh`` call and names it only at the next module boundary."""

    funcs: Tuple[Callable[..., Any], ...] = (torch.tanh,)

    def __init__(self) -> None:
        self.pending: List[str] = []
        self.drained: List[Tuple[str, int]] = []
        self.asked = 0

    def handle(self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any], emit: Any) -> Any:
        self.pending.append("tanh")
        self.held()
        return func(*args, **kwargs)

    def has_pending(self) -> bool:
        self.asked += 1
        return bool(self.pending)

    def drain(self, emit: Any, site: str) -> None:
        self.drained.append((site, len(self.pending)))
        self.pending = []


class _Block(nn.Module):
    def __init__(self, squash: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.squash = squash

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.tanh(y) if self.squash else y


def _run(model: nn.Module, frontends: List[FrontEnd]) -> None:
    stack, mode = ModuleStack(model), CaptureMode(frontends, [].append)
    stack.activate()
    try:
        with mode, torch.no_grad():
            model(torch.randn(2, 4))
    finally:
        stack.deactivate()


def test_held_calls_are_drained_at_their_modules_return_also_after_quiet_boundaries():
    # blocks 0, 1 record nothing (their boundaries settle), block 2 records two calls, block 3 one
    model = nn.Sequential(_Block(False), _Block(False), _Block(True), _Block(True))
    model[2].forward = lambda x, b=model[2]: torch.tanh(torch.tanh(b.lin(x)))  # type: ignore[method-assign]
    holder = _Holder()
    _run(model, [holder])
    assert holder.drained == [("2", 2), ("3", 1)]
    # asked only at the boundaries after a call was held (two per held call: the module's own
    # return drains it, the next boundary settles), not at each of the 13 module entries and exits
    assert 0 < holder.asked <= 6
    assert frontend.HELD[0] is False


def test_a_front_end_that_never_holds_is_never_asked():
    holder = _Holder()
    holder.funcs = ()  # records nothing
    frontend.settled()
    _run(nn.Sequential(_Block(True), _Block(True)), [holder])
    assert holder.asked == 0 and holder.drained == []


def test_fusers_are_asked_for_their_declared_module_types_only():
    asked: List[str] = []
    before = frontend.FUSED_TYPES[0]

    class _Typed(FrontEnd):
        fused_types = (nn.Linear,)

        def runs_fused(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Any, parent: Any = None,
                       inside: bool = False) -> bool:
            asked.append(type(module).__name__)
            return False

    class _Untyped(FrontEnd):  # no declared types: every module is asked
        def runs_fused(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Any, parent: Any = None,
                       inside: bool = False) -> bool:
            asked.append("any:" + type(module).__name__)
            return False

    try:
        assert nn.Linear in frontend.FUSED_TYPES[0] and nn.Module in frontend.FUSED_TYPES[0]
        _run(nn.Sequential(_Block(False)), [_Typed()])
        assert asked == ["Linear"]
        asked.clear()
        _run(nn.Sequential(_Block(False)), [_Untyped()])
        assert asked == ["any:_Block", "any:Linear"]
    finally:  # the registry is global: leave it as the library's front ends made it
        frontend.FUSED_TYPES[0] = before
    assert nn.Module not in frontend.FUSED_TYPES[0]
