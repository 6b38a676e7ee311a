"""Writing never blocks or breaks training: slow sinks, failing sinks, bad logdirs, interpreter exit."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest

import probe
from probe.sinks.base import BaseSink
from tests.sinks.sinkutil import RecordingSink, model_and_inputs, train_step


def _probe_warnings(record):
    return [str(w.message) for w in record if str(w.message).startswith("probe:")]


def _steps_in_events(logdir, tag="probe.entropy@actual/layers.0"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


class SlowSink(BaseSink):
    """Blocks in its first write until released (at most `patience` seconds)."""

    def __init__(self, patience: float = 120.0) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.patience = patience
        self.timed_out = False
        self.steps: list = []

    def write(self, step, summary):
        self.entered.set()
        if not self.release.wait(self.patience):
            self.timed_out = True
        self.steps.append(step)


def test_training_thread_never_waits_on_a_slow_sink():
    model, xs = model_and_inputs(6)
    slow = SlowSink()
    p = probe.watch(model, sinks=[slow])
    try:
        for x in xs:
            train_step(model, x)
        # every forward and backward has run while the sink still sits in its first write
        assert slow.entered.wait(30), "the first flush never reached the sink"
        assert slow.steps == [] and not slow.timed_out
        assert p.current_step == 5
    finally:
        slow.release.set()
        p.close()
    assert not slow.timed_out  # released by the test, not by its patience running out
    assert slow.steps == [0, 1, 2, 3, 4, 5]  # close flushed everything, in order
    assert p.summary().steps == 6


def test_a_raising_sink_warns_once_and_other_sinks_and_summary_are_intact():
    class Broken(BaseSink):
        calls = 0

        def write(self, step, summary):
            Broken.calls += 1
            raise ValueError("cannot reach the tracking server")

        def close(self):
            raise RuntimeError("close failed too")

    model, xs = model_and_inputs(4)
    rec = RecordingSink()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with probe.watch(model, sinks=[Broken(), rec]) as p:
            for x in xs:
                train_step(model, x)
    messages = _probe_warnings(record)
    assert len(messages) == 2, messages  # one for write (4 failures), one for close
    assert "sink Broken failed in write() at step 0: ValueError: cannot reach the tracking server" in messages[0]
    assert "Probe.summary()" in messages[0]
    assert "sink Broken failed in close(): RuntimeError" in messages[1]
    assert Broken.calls == 4
    assert [step for step, _ in rec.writes] == [0, 1, 2, 3]
    assert p.summary().steps == 4 and "grad_q" in p.summary().metrics("layers.0")


def test_unwritable_logdir_warns_and_keeps_statistics(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    logdir = blocker / "runs"  # mkdir fails with ENOTDIR, also as root
    model, xs = model_and_inputs(3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with probe.watch(model, logdir=logdir) as p:  # no error at construction
            for x in xs:
                train_step(model, x)
            p.flush()  # waits for the sink: it has failed on steps 0 and 1 by now
            during = [m for m in _probe_warnings(record) if "could not write probe_summary.json" not in m]
    assert len(during) == 1, during
    assert "sink TensorBoardSink failed in write() at step 0: NotADirectoryError" in during[0]
    # the summary file cannot be written either (while the run goes, and at close): one warning
    summary_warnings = [m for m in _probe_warnings(record) if "could not write probe_summary.json" in m]
    assert len(summary_warnings) == 1, _probe_warnings(record)
    assert p.summary().steps == 3 and p.summary().sites == ["layers.0", "layers.1"]


def test_vanished_logdir_warns_once_and_writing_resumes_in_a_new_event_file(tmp_path):
    logdir = tmp_path / "run"
    model, xs = model_and_inputs(4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with probe.watch(model, logdir=logdir) as p:
            for x in xs[:2]:
                train_step(model, x)
            p.flush()  # step 0 reached the event file; step 1 is flushed when step 2 begins
            shutil.rmtree(logdir)
            for x in xs[2:]:
                train_step(model, x)
    messages = _probe_warnings(record)
    assert len(messages) == 1 and "vanished" in messages[0], messages
    assert _steps_in_events(logdir) == [1, 2, 3]
    assert json.loads((logdir / "probe_summary.json").read_text())["steps"] == 4


def test_full_disk_warns_once_and_every_step_reaches_the_event_file_when_space_returns(tmp_path, monkeypatch):
    from probe.ci.eventfiles import check_event_files
    from probe.sinks.eventfile import EventFile

    original = EventFile._write
    full = threading.Event()

    def write(self, data):
        if full.is_set():
            original(self, data[: len(data) // 2])  # half of it reaches the disk, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(self, data)

    monkeypatch.setattr(EventFile, "_write", write)
    model, xs = model_and_inputs(7)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with probe.watch(model, logdir=tmp_path) as p:
            for i, x in enumerate(xs):
                # step i - 1 is flushed when step i begins
                if i == 2:
                    p.flush()  # step 0 is on disk
                    full.set()
                if i == 5:
                    assert not p.flush()  # steps 1..3 met a full disk: kept, not written
                    check_event_files(str(tmp_path))  # whole records only: the half record was cut back
                    full.clear()
                train_step(model, x)
    messages = _probe_warnings(record)
    assert len(messages) == 1, messages
    assert "No space left on device" in messages[0] and "TensorBoardSink" in messages[0]
    assert _steps_in_events(tmp_path) == [0, 1, 2, 3, 4, 5, 6]  # the kept steps written once space returned
    assert len([f for f in os.listdir(tmp_path) if f.startswith("events.out.tfevents")]) == 1
    check_event_files(str(tmp_path))
    assert p.summary().steps == 7  # nothing lost from the statistics


ATEXIT_SCRIPT = textwrap.dedent(
    """
    import sys
    import probe
    from probe.sinks.jsonl import JSONLSink
    from tests.sinks.sinkutil import model_and_inputs, train_step

    model, xs = model_and_inputs(3)
    p = probe.watch(model, logdir=sys.argv[1], sinks=[JSONLSink(sys.argv[2])])
    for x in xs:
        train_step(model, x)
    print("exiting without close", flush=True)
    """
)


def test_nothing_is_lost_when_the_interpreter_exits_without_close(tmp_path):
    logdir, jsonl = tmp_path / "run", tmp_path / "probe.jsonl"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", ATEXIT_SCRIPT, str(logdir), str(jsonl)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "exiting without close" in done.stdout
    assert _steps_in_events(logdir) == [0, 1, 2]
    summary = probe.Summary.load(logdir)
    assert summary.steps == 3 and "grad_v" in summary.metrics("layers.1")
    steps = {json.loads(line)["step"] for line in jsonl.read_text().splitlines()}
    assert steps == {0, 1, 2}


def test_a_logdir_that_is_a_file_is_still_an_error_at_construction(tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    model, _ = model_and_inputs(1)
    with pytest.raises(probe.ProbeError, match="`logdir` to be a directory"):
        probe.watch(model, logdir=f)


def test_a_failed_flush_is_cut_back_or_the_next_one_starts_a_new_file(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from probe.ci.eventfiles import check_event_files
    from probe.sinks.eventfile import EventFile

    def steps(path):
        return [e.step for e in EventFileLoader(path).Load() if e.HasField("summary")]

    def flush(events, step, fail_after=None):
        events.add_text("t", f"step {step}", step)
        if fail_after is not None:
            original = EventFile._write

            def half(self, data):
                original(self, data[:fail_after])
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(EventFile, "_write", half)
        try:
            events.flush()
        finally:
            monkeypatch.undo()

    events = EventFile(str(tmp_path))
    flush(events, 1)
    first = events.path
    size = os.path.getsize(first)
    with pytest.raises(OSError, match="No space left"):
        flush(events, 2, fail_after=7)  # 7 bytes of the record reach the disk
    assert os.path.getsize(first) == size  # cut back to the last whole flush
    flush(events, 3)
    assert events.path == first and steps(first) == [1, 3]
    check_event_files(str(tmp_path))

    size = os.path.getsize(first)
    monkeypatch.setattr(os, "truncate", lambda *a: (_ for _ in ()).throw(PermissionError(errno.EACCES, "read-only")))
    with pytest.raises(OSError):
        flush(events, 4, fail_after=5)  # cannot be cut back now: the next flush starts a new file
    assert os.path.getsize(first) == size + 5
    monkeypatch.undo()
    flush(events, 5)  # ... and cuts the first one back, now that it can
    events.close()
    assert events.path != first and steps(events.path) == [5]
    assert os.path.getsize(first) == size and steps(first) == [1, 3]
    check_event_files(str(tmp_path))
