"""Shared pieces of the sink tests: a sink that records, a few training steps, a per-step reference."""

from __future__ import annotations

import threading
from typing import List, Tuple

import torch

import probe
from probe.sinks.base import BaseSink
from tests.helpers import SDPAModel


class RecordingSink(BaseSink):
    """Keeps every (step, summary) it is given, and which thread wrote it."""

    def __init__(self) -> None:
        self.writes: List[Tuple[int, probe.Summary]] = []
        self.threads: List[str] = []
        self.closed = 0

    def write(self, step: int, summary: probe.Summary) -> None:
        self.writes.append((step, summary))
        self.threads.append(threading.current_thread().name)

    def close(self) -> None:
        self.closed += 1


def model_and_inputs(steps: int, seed: int = 0):
    """A 2-layer causal SDPA model (4 heads, d_k 16) and one different input per step."""
    torch.manual_seed(seed)
    model = SDPAModel(layers=2, causal=True)
    xs = [torch.randn(2, 6, 64) * (1 + i) for i in range(steps)]
    return model, xs


def train_step(model, x) -> None:
    # a sum over samples (not a mean), so one batch of several inputs has the same gradients
    # per sample as separate steps: gradient norms of windows combine like one concatenated batch
    model.zero_grad(set_to_none=True)
    (model(x).square().sum() * 1e-3).backward()


def reference_summary(model, xs) -> probe.Summary:
    """What probe measures for these inputs as one step: an independent run, no sinks."""
    with probe.watch(model) as p:
        train_step(model, torch.cat(list(xs)))
    return p.summary()
