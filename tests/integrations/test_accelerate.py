"""accelerate and a transformers.Trainer under 2 processes (gloo, CPU).

Each rank runs tests/integrations/accelerate_worker.py in a subprocess under a timeout, so a
hang (ranks disagreeing on a collective) fails the test instead of blocking CI.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import free_port

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("accelerate"))
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.integrations.accelerate_worker", out], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=400)
            # the traceback, not the warnings after it (a rank's last lines are often DDP's)
            at = stderr.rfind("Traceback")
            assert p.returncode == 0, (f"rank exited with {p.returncode}; stdout: {stdout[-500:]!r}; stderr: "
                                       + (stderr[at : at + 6000] if at >= 0 else stderr[-3000:]))
            reports.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out, reports


def test_watch_of_a_prepared_model_reports_unwrapped_names(ranks) -> None:
    out, reports = ranks
    for r in reports:
        assert r["wrapper"] == "DistributedDataParallel"
        assert r["sites"] == ["layers.0", "layers.1"] and r["steps"] == 2
    assert reports[0]["entropy"] == reports[1]["entropy"]         # one global summary on every rank
    assert len(glob.glob(os.path.join(out, "accelerate", "events.out.tfevents.*"))) == 1   # rank 0 writes


def test_trainer_under_two_processes_stops_on_every_rank(ranks) -> None:
    out, reports = ranks
    assert [r["global_step"] for r in reports] == [1, 1]          # both ranks stopped (no hang)
    assert reports[0]["violations"] > 0 and reports[1]["violations"] == 0  # rank 0 judges
    events = glob.glob(os.path.join(out, "trainer", "events.out.tfevents.*"))
    assert len(events) == 2, events  # the Trainer's and probe's writers, both on rank 0, one run
    assert os.path.isfile(os.path.join(out, "trainer", "probe_summary.json"))
