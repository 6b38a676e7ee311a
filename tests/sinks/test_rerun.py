"""A second run given the same ``logdir`` never mixes its steps with the first run's."""

from __future__ import annotations

import json
import os

import pytest

import probe
from probe.ci.runs import ContinueRun, load_run
from probe.summary import SUMMARY_FILE
from tests.sinks.sinkutil import model_and_inputs, train_step


def _run(model, xs, logdir, **kw):
    with probe.watch(model, logdir=logdir, grads=False, **kw) as p:
        for x in xs:
            train_step(model, x)
    return p


def _steps(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    # sorted: the reader takes a directory's event files in name order, and files written in the
    # same second differ by a process-wide counter (`...vm.24281.100` sorts before `...vm.24281.98`):
    # which file comes first depends on how many writers the process made before, not on probe
    return sorted(e.step for e in acc.Scalars("probe.entropy@actual/layers.0"))


def test_a_second_run_goes_to_a_fresh_directory_and_says_so(tmp_path):
    model, xs = model_and_inputs(3)
    logdir = tmp_path / "exp"
    _run(model, xs, logdir)
    first_summary = (logdir / SUMMARY_FILE).read_text()
    with pytest.warns(RuntimeWarning, match=r"already holds a run; this run writes to '.*exp-2'"):
        _run(model, xs[:2], logdir)
    assert _steps(logdir) == [0, 1, 2]  # the first run, untouched
    assert (logdir / SUMMARY_FILE).read_text() == first_summary
    assert _steps(tmp_path / "exp-2") == [0, 1]
    assert json.loads((tmp_path / "exp-2" / SUMMARY_FILE).read_text())["steps"] == 2
    with pytest.warns(RuntimeWarning, match="exp-3"):  # the third run skips both
        _run(model, xs[:1], str(logdir) + os.sep)
    assert load_run(str(tmp_path / "exp-3"))[0].steps == 1


def test_a_run_killed_before_its_summary_is_recognised_by_its_events(tmp_path):
    from probe.sinks.tensorboard import TensorBoardSink

    model, xs = model_and_inputs(2)
    with probe.watch(model, grads=False, sinks=[TensorBoardSink(tmp_path / "exp")]):  # events, no summary
        for x in xs:
            train_step(model, x)
    assert not (tmp_path / "exp" / SUMMARY_FILE).exists()
    with pytest.warns(RuntimeWarning, match="exp-2"):
        _run(model, xs[:1], tmp_path / "exp")
    assert _steps(tmp_path / "exp") == [0, 1] and _steps(tmp_path / "exp-2") == [0]


def test_a_directory_without_a_probe_run_is_written_into(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as w:  # the user's own events (a trainer's loss, say)
        w.add_scalar("loss", 1.0, 0)
    model, xs = model_and_inputs(2)
    _run(model, xs, tmp_path)
    assert _steps(tmp_path) == [0, 1] and (tmp_path / SUMMARY_FILE).is_file()
    assert not (tmp_path.parent / (tmp_path.name + "-2")).exists()


def test_a_continued_run_and_the_users_writer_append(tmp_path, recwarn):
    from torch.utils.tensorboard import SummaryWriter

    model, xs = model_and_inputs(4)
    _run(model, xs[:2], tmp_path)
    p = probe.watch(model, logdir=ContinueRun(str(tmp_path)), grads=False)  # a resumed trainer: steps go on
    with p:
        for step, x in enumerate(xs[2:], start=2):
            p.step(step)
            train_step(model, x)
    assert _steps(tmp_path) == [0, 1, 2, 3]
    with SummaryWriter(str(tmp_path)) as writer:  # your writer, your directory, your steps
        with probe.watch(model, logdir=writer, grads=False) as p:
            p.step(4)
            train_step(model, xs[0])
    assert _steps(tmp_path) == [0, 1, 2, 3, 4]
    assert not any("already holds a run" in str(w.message) for w in recwarn.list)
    assert not (tmp_path.parent / (tmp_path.name + "-2")).exists()
