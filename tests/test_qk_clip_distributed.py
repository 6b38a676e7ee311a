"""QK-Clip under torch.distributed (2 processes, gloo, CPU): every rank applies the same factors,
from the max over the ranks' max logits; under FSDP2 each rank scales its own shard of the rows.

The reference is the published rule applied in one plain process to the max of the two ranks'
batches' max logits (tests/test_qk_clip.py's hand-written rule, GQA split as probe documents it).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from probe.experiment.clip_rule import factors
from tests import qk_clip_worker as worker
from tests.helpers import free_port
from tests.test_qk_clip import _max_logits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 150


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = str(tmp_path_factory.mktemp("qkclip_dist"))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for attempt in range(2):
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, "-m", "tests.qk_clip_worker", str(r), "2", port, outdir], cwd=ROOT,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
        logs = []
        try:
            for proc in procs:
                logs.append(proc.communicate(timeout=TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for proc in procs:
                proc.kill()
            pytest.fail(f"the 2-process run did not finish within {TIMEOUT_S} s")
        if attempt == 0 and any(p.returncode != 0 and "EADDRINUSE" in log for p, log in zip(procs, logs)):
            continue
        break
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
    return [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(2)]


def _reference():
    m = worker.model()
    top = torch.maximum(_max_logits(m, worker.batch(0)), _max_logits(m, worker.batch(1)))
    _, a, b = factors(top.float(), worker.TAU, 2)
    with torch.no_grad():
        for h in range(4):
            m.q.weight[h * 8:(h + 1) * 8] *= a[h]
            m.q.bias[h * 8:(h + 1) * 8] *= a[h]
        for g in range(2):
            m.k.weight[g * 8:(g + 1) * 8] *= b[g]
            m.k.bias[g * 8:(g + 1) * 8] *= b[g]
    return m, top


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_every_rank_applies_the_factors_of_the_max_over_ranks(ranks, mode):
    ref, top = _reference()
    mine = _max_logits(worker.model(), worker.batch(0))
    assert ((top > worker.TAU) & (mine <= worker.TAU)).any()  # rank 0 alone would not clip a head it must
    for name, want in ref.named_parameters():
        for r in range(2):
            torch.testing.assert_close(ranks[r][mode][name], want, rtol=1e-6, atol=1e-7, msg=f"rank {r} {name}")
        assert torch.equal(ranks[0][mode][name], ranks[1][mode][name]), name  # the replicas stay identical


def test_records_are_the_global_values(ranks):
    ref, top = _reference()
    records = ranks[0]["ddp_records"]
    torch.testing.assert_close(records["qk_clip_logit"], top, rtol=1e-5, atol=1e-5)
    assert ranks[0]["fsdp_info"].startswith("q: q.weight rows")
