"""A probe its user never closed (issue 26, fault 2): closed when it is collected or at
interpreter exit, whichever comes first, with its summary and last window on disk and a warning
that it was not closed. And a closed probe keeps nothing of the model alive (fault 6)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings
import weakref

import torch

import probe
from tests.sinks.sinkutil import model_and_inputs, train_step
from tests.sinks.test_failures import _steps_in_events

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _forgotten_run(logdir, steps=3):
    """A sweep's trial: watch, train, return without close()."""
    model, xs = model_and_inputs(steps)
    p = probe.watch(model, logdir=logdir)
    for x in xs:
        train_step(model, x)
    return weakref.ref(model), weakref.ref(p)


def test_a_forgotten_probe_is_closed_when_collected(tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model, p = _forgotten_run(tmp_path / "run")
        gc.collect()
    assert model() is None and p() is None  # the probe does not keep its model alive
    messages = [str(w.message) for w in record if "never closed" in str(w.message)]
    assert len(messages) == 1 and str(tmp_path / "run") in messages[0], messages
    summary = probe.Summary.load(tmp_path / "run")
    assert summary.steps == 3 and summary.meta["last_step"] == 2  # the last window too
    assert "grad_v" in summary.metrics("layers.1")
    assert _steps_in_events(tmp_path / "run") == [0, 1, 2]


EXIT_SCRIPT = textwrap.dedent(
    """
    import gc, sys
    import probe
    from tests.sinks.sinkutil import model_and_inputs, train_step

    def trial(logdir):
        model, xs = model_and_inputs(3)
        p = probe.watch(model, logdir=logdir)
        for x in xs:
            train_step(model, x)

    gc.disable()  # nothing collects the trial before the interpreter exits
    trial(sys.argv[1])
    model, xs = model_and_inputs(2)
    kept = probe.watch(model, logdir=sys.argv[2])  # alive at exit
    for x in xs:
        train_step(model, x)
    print("exiting without close", flush=True)
    """
)


def test_forgotten_probes_are_closed_at_interpreter_exit(tmp_path):
    trial, kept = tmp_path / "trial", tmp_path / "kept"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(trial), str(kept)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "exiting without close" in done.stdout
    assert done.stderr.count("was never closed") == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    for logdir, steps in ((trial, 3), (kept, 2)):
        assert probe.Summary.load(logdir).steps == steps
        assert _steps_in_events(logdir) == list(range(steps))


def test_a_closed_probe_holds_no_reference_to_the_model(tmp_path):
    model, xs = model_and_inputs(2)
    p = probe.watch(model, logdir=tmp_path)
    for x in xs:
        train_step(model, x)
    loss = model(xs[0]).sum()  # a forward whose backward never came: its records hold q, k, v
    p.close()
    refs = [weakref.ref(model)] + [weakref.ref(t) for t in model.parameters()]
    del model, loss
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert p.model is None
    assert p.summary().steps == 3 and p.summary().sites == ["layers.0", "layers.1"]  # the results stay


def test_a_closed_probe_still_gives_its_model_while_the_user_holds_it():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with probe.watch(model) as p:
        assert p.model is model
    assert p.model is model
