"""The writer never hangs training, summary() or close(), never silently drops a step, and keeps
what finished on disk: a bounded queue that merges when full, per-sink threads, a close() timeout
naming the sink, a sink raising SystemExit, and SIGKILL / SIGTERM / a second Ctrl-C of a real run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import probe
from probe.sinks.base import BaseSink
from probe.state.writer import Writer
from tests.sinks.sinkutil import RecordingSink, model_and_inputs, train_step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe_warnings(record):
    return [str(w.message) for w in record if str(w.message).startswith("probe:")]


class BlockingSink(BaseSink):
    """Blocks in every write until released (at most `patience` seconds)."""

    def __init__(self, patience: float = 60.0) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.patience = patience
        self.writes: list = []

    def write(self, step, summary):
        self.entered.set()
        self.release.wait(self.patience)
        self.writes.append((step, summary))


def test_a_blocked_sink_never_blocks_summary_and_close_is_bounded(tmp_path):
    model, xs = model_and_inputs(4)
    blocked = BlockingSink()
    rec = RecordingSink()
    p = probe.watch(model, logdir=tmp_path, sinks=[blocked, rec], close_timeout=1.0)
    for x in xs:
        train_step(model, x)
    assert blocked.entered.wait(30)
    t0 = time.monotonic()
    s = p.summary()  # the blocked sink holds step 0; the totals do not wait for it
    assert time.monotonic() - t0 < 5 and s.steps == 4
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        p.close()
        took = time.monotonic() - t0
    blocked.release.set()
    assert took < 10, took  # close_timeout=1 s, plus slack for a loaded machine
    messages = _probe_warnings(record)
    assert any("sink BlockingSink did not finish within close_timeout=1 s (still in write() at step 0)" in m
               for m in messages), messages
    # the other sink and the summary file are complete
    assert [step for step, _ in rec.writes] == [0, 1, 2, 3] and rec.closed == 1
    assert probe.Summary.load(tmp_path).steps == 4


def test_a_sink_raising_system_exit_does_not_hang_close():
    class Exiting(BaseSink):
        def write(self, step, summary):
            raise SystemExit(3)

    model, xs = model_and_inputs(3)
    rec = RecordingSink()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with probe.watch(model, sinks=[Exiting(), rec], close_timeout=20) as p:
            for x in xs:
                train_step(model, x)
        # close returned: SystemExit was caught as a sink failure, not a lane stopper
    messages = _probe_warnings(record)
    assert any("sink Exiting failed in write() at step 0: SystemExit: 3" in m for m in messages), messages
    assert not any("did not finish" in m for m in messages), messages
    assert [step for step, _ in rec.writes] == [0, 1, 2]
    assert p.summary().steps == 3


def test_a_full_queue_merges_windows_with_a_warning_and_drops_nothing():
    model, xs = model_and_inputs(12)
    blocked = BlockingSink()
    p = probe.watch(model, sinks=[blocked])
    p._out.writer.max_pending = 3
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for x in xs:
            train_step(model, x)
        lane = p._out.writer._lanes[0]
        assert len(lane._queue) <= 3  # bounded: 11 flushes so far, the sink still holds step 0
        blocked.release.set()
        p.close()
    messages = _probe_warnings(record)
    assert any("sink BlockingSink is falling behind (3 flushes waiting)" in m and "nothing is dropped" in m
               for m in messages), messages
    # every step reached the sink, in order, some points covering several steps
    assert sum(s.steps for _, s in blocked.writes) == 12
    steps = [step for step, _ in blocked.writes]
    assert steps == sorted(steps) and steps[-1] == 11 and len(steps) < 12
    # a merged point holds the same numbers as the totals of its steps: logit_max is a max
    total = p.summary()
    per_point = np.max([s.value("layers.0", "logit_max", "actual") for _, s in blocked.writes], axis=0)
    np.testing.assert_allclose(per_point, total.value("layers.0", "logit_max", "actual"))


def test_sinks_are_flushed_within_the_refresh_interval_without_a_call():
    class Flushes(RecordingSink):
        def __init__(self):
            super().__init__()
            self.flushed = threading.Event()

        def flush(self):
            self.flushed.set()

    model, xs = model_and_inputs(2)
    sink = Flushes()
    with probe.watch(model, sinks=[sink]) as p:
        p._out.writer.refresh_seconds = 0.2
        for x in xs:
            train_step(model, x)
        assert sink.flushed.wait(20), "the sink was never flushed while the run went on"


def test_the_summary_file_is_refreshed_while_the_run_goes(tmp_path):
    model, xs = model_and_inputs(3)
    p = probe.watch(model, logdir=tmp_path)
    p._out.writer.refresh_seconds = 0.1
    for x in xs:
        train_step(model, x)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if probe.Summary.load(tmp_path).steps == 2:  # steps 0 and 1 are flushed; step 2 is not yet
                break
        except probe.ProbeError:
            pass
        time.sleep(0.05)
    else:
        pytest.fail("probe_summary.json was not refreshed during the run")
    p.close()
    assert probe.Summary.load(tmp_path).steps == 3  # close writes the final one


def test_writer_save_never_lets_an_older_snapshot_overwrite_the_final_one(tmp_path):
    w = Writer(summary_path=str(tmp_path / "probe_summary.json"))
    assert w.save(probe.Summary({}, steps=5), final=True)
    assert not w.save(probe.Summary({}, steps=4), version=10)
    assert probe.Summary.load(tmp_path).steps == 5


KILLED_RUN = textwrap.dedent(
    """
    import sys, time
    import probe
    from tests.sinks.sinkutil import model_and_inputs, train_step

    model, xs = model_and_inputs(5)
    p = probe.watch(model, logdir=sys.argv[1])
    for x in xs:
        train_step(model, x)
    print("trained", flush=True)
    time.sleep(300)  # killed here, never closed
    """
)


def _start(script, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_and_sigterm_leave_a_recent_summary_and_the_events(tmp_path):
    from tests.sinks.test_failures import _steps_in_events

    runs = {sig: tmp_path / sig.name for sig in (signal.SIGKILL, signal.SIGTERM)}
    procs = {sig: _start(KILLED_RUN, logdir) for sig, logdir in runs.items()}
    try:
        for sig, proc in procs.items():
            assert proc.stdout.readline().strip() == "trained", proc.stderr.read()
        # steps 0..3 were flushed when the next step began; within ~2 s they are on disk
        deadline = time.monotonic() + 30
        pending = dict(runs)
        while pending and time.monotonic() < deadline:
            for sig, logdir in list(pending.items()):
                try:
                    if probe.Summary.load(logdir).steps == 4 and _steps_in_events(logdir) == [0, 1, 2, 3]:
                        pending.pop(sig)
                except probe.ProbeError:
                    pass
            time.sleep(0.1)
        for sig, proc in procs.items():
            proc.send_signal(sig)
            proc.wait(30)
            assert proc.returncode == -sig
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    assert not pending, f"not on disk within 30 s: {sorted(s.name for s in pending)}"
    for logdir in runs.values():
        summary = probe.Summary.load(logdir)
        assert summary.steps == 4 and "grad_v" in summary.metrics("layers.1")
        assert _steps_in_events(logdir) == [0, 1, 2, 3]
        assert not [f for f in os.listdir(logdir) if "tmp" in f]


INTERRUPTED_CLOSE = textwrap.dedent(
    """
    import os, signal, sys, threading, time, warnings
    import probe
    from probe.sinks.base import BaseSink
    from tests.sinks.sinkutil import model_and_inputs, train_step

    class Stuck(BaseSink):
        def write(self, step, summary):
            time.sleep(300)

    # Python turns SIGINT into KeyboardInterrupt only if it was not ignored when the process
    # started, and a shell's background job (`cmd &`) starts its children with it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    model, xs = model_and_inputs(3)
    p = probe.watch(model, logdir=sys.argv[1], sinks=[Stuck()], close_timeout=120)
    for x in xs:
        train_step(model, x)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C during close()
    t0 = time.monotonic()
    try:
        p.close()
    except KeyboardInterrupt:
        print("interrupted after", round(time.monotonic() - t0, 1), flush=True)
    """
)


def test_ctrl_c_during_close_keeps_the_summary_and_returns_at_once(tmp_path):
    proc = _start(INTERRUPTED_CLOSE, tmp_path)
    try:
        out, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "interrupted after" in out, (out, err)
    assert float(out.split()[-1]) < 30  # not the 120 s close_timeout, not the stuck sink's 300 s
    assert probe.Summary.load(tmp_path).steps == 3


def test_ctrl_c_while_the_summary_is_written_returns_without_waiting_on_a_stuck_sink(tmp_path, monkeypatch):
    # The subprocess test above sends its Ctrl-C after 1 s; on a loaded machine close() was still
    # writing the summary then, and the interrupt waited for the sinks (close_timeout) before it
    # propagated. Here the interrupt lands inside that write, every time.
    sink = BlockingSink(patience=60.0)
    model, xs = model_and_inputs(3)
    p = probe.watch(model, logdir=str(tmp_path), sinks=[sink], close_timeout=60)
    for x in xs:
        train_step(model, x)
    original = probe.Summary.save
    calls = []

    def interrupted_once(self, path):
        calls.append(path)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return original(self, path)

    monkeypatch.setattr(probe.Summary, "save", interrupted_once)
    t0 = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(KeyboardInterrupt):
                p.close()
        assert time.monotonic() - t0 < 10  # not the 60 s close_timeout
        monkeypatch.setattr(probe.Summary, "save", original)
        assert probe.Summary.load(tmp_path).steps == 3
    finally:
        sink.release.set()
