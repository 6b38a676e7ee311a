"""A disk that fills up for a moment and a read-only logdir (issue 26, faults 3 and 8), made real:
the operating system refuses the writes (``RLIMIT_FSIZE``: an event file that may not grow, half
a record written; an immutable directory), in a separate process. The run goes on; the flushes
that failed are kept and reach the event file once it can grow again; no partial record is left
for TensorBoard's reader or ``probe check``; nothing but one warning reaches stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import probe
from tests.sinks.test_failures import _steps_in_events

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FULL_FOR_A_MOMENT = textwrap.dedent(
    """
    import glob, os, resource, signal, sys
    import probe
    from tests.sinks.sinkutil import model_and_inputs, train_step

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    logdir = sys.argv[1]
    model, xs = model_and_inputs(10)
    p = probe.watch(model, logdir=logdir)
    for i, x in enumerate(xs):
        if i == 3:  # steps 0..2 are on disk; from now on the event file cannot grow ("disk full")
            p.flush()
            (events,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
            resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(events) + 300, hard))
        if i == 7:  # steps 3..6 met the full disk; space returns
            p.flush()
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        train_step(model, x)
    p.close()
    print("done", flush=True)
    """
)


def _run(script, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)


def _probe_lines(stderr):
    return [line for line in stderr.splitlines() if "Warning: probe:" in line]


@pytest.mark.skipif(not hasattr(os, "setrlimit") and sys.platform == "win32", reason="POSIX resource limits")
def test_a_disk_full_for_a_moment_loses_no_step_and_leaves_a_readable_run(tmp_path):
    run = tmp_path / "run"
    done = _run(FULL_FOR_A_MOMENT, run)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # nothing from TensorBoard's thread
    lines = _probe_lines(done.stderr)
    assert len(lines) == 1 and "TensorBoardSink" in lines[0] and "File too large" in lines[0], lines
    assert _steps_in_events(run) == list(range(10))  # steps 3..6 written once the file could grow
    assert probe.Summary.load(run).steps == 10
    check = subprocess.run([sys.executable, "-m", "probe", "check", str(run), "--last", "4"], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr  # not "killed mid-write" (exit 2)


READ_ONLY = textwrap.dedent(
    """
    import sys
    import probe
    from tests.sinks.sinkutil import model_and_inputs, train_step

    model, xs = model_and_inputs(3)
    with probe.watch(model, logdir=sys.argv[1]) as p:
        for x in xs:
            train_step(model, x)
    assert p.summary().steps == 3
    print("done", flush=True)
    """
)


def _make_read_only(path):
    """A directory even root cannot write into (immutable), or None where that cannot be made."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        return lambda: os.chmod(path, 0o755)
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        return None
    return lambda: subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def test_a_read_only_logdir_is_one_warning_per_file_and_no_traceback(tmp_path):
    logdir = tmp_path / "ro"
    logdir.mkdir()
    undo = _make_read_only(logdir)
    if undo is None:
        pytest.skip("no way to make a directory read-only for this user here (chattr failed as root)")
    try:
        done = _run(READ_ONLY, logdir)
    finally:
        undo()
    assert done.returncode == 0 and "done" in done.stdout, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = _probe_lines(done.stderr)
    sink = [line for line in lines if "TensorBoardSink" in line]
    summary = [line for line in lines if "could not write probe_summary.json" in line]
    assert len(sink) == 1 and len(summary) == 1 and len(lines) == 2, lines
    assert not os.listdir(logdir)


def test_a_summary_file_that_cannot_be_written_warns_once_however_often_it_is_tried(tmp_path, monkeypatch):
    # Each try writes a new temporary file, so its name differs from try to try: the refresher's
    # write and close()'s final one were two warnings (seen once in ten suite runs).
    import warnings

    from probe.state.writer import Writer
    from probe.summary import Summary

    def refuse(self, path):
        raise PermissionError(13, "Permission denied", f"{path}.{os.urandom(4).hex()}.tmp")

    monkeypatch.setattr(Summary, "save", refuse)
    writer = Writer(summary_path=str(tmp_path / "probe_summary.json"))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not writer.save(Summary({}), version=1)
            assert not writer.save(Summary({}), final=True)
    finally:
        writer.close(timeout=5.0)
    assert len([w for w in caught if "could not write probe_summary.json" in str(w.message)]) == 1
