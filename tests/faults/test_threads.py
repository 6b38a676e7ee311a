"""p.summary() from another thread while training runs (issue 26, fault 7): a dashboard thread or
a notebook widget reads the summary while the training thread records, flushes and runs the
backward. Every read succeeds and is consistent: the steps it reports are whole."""

from __future__ import annotations

import threading

import torch

import probe
from tests.helpers import SDPAModel


def test_summary_is_safe_from_another_thread_while_training_runs():
    torch.manual_seed(0)
    model = SDPAModel(layers=12, d_model=32, heads=2)
    x = torch.randn(1, 4, 32)
    errors, reads, steps_seen = [], [0], []
    stop = threading.Event()

    def dashboard(p):
        while not stop.is_set():
            try:
                s = p.summary()
                steps_seen.append(s.steps)
                for site in s.sites:  # every site the summary names has its metrics
                    s.metrics(site)
            except Exception as err:  # noqa: BLE001 - the test reports any
                errors.append(f"{type(err).__name__}: {err}")
            reads[0] += 1

    with probe.watch(model, rows=None) as p:
        reader = threading.Thread(target=dashboard, args=(p,))
        reader.start()
        try:
            for _ in range(20):
                model(x).sum().backward()
        finally:
            stop.set()
            reader.join(60)
    assert not errors, errors[:3]
    assert reads[0] > 0 and steps_seen == sorted(steps_seen)  # never a step counted then lost
    assert p.summary().steps == 20
