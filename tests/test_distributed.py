"""torch.distributed: 2-process gloo run vs one process on the union of the batches.

The ranks run in subprocesses (tests/distributed_worker.py) under a timeout, so a hang fails the
test instead of blocking CI. The references are computed here, in one plain process.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from typing import Any, Dict

import numpy as np
import pytest
import torch
from torch import nn

import probe
from probe.capture.mode import site_names
from probe.state.distributed import combine_ranks, resolve_group
from probe.stats.pool import chan_pair
from tests import distributed_worker as worker
from tests.helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 150
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Dict[str, Any]:
    """Run both ranks once for every test here; kill them if they outlive the timeout."""
    outdir = str(tmp_path_factory.mktemp("dist"))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for attempt in range(2):
        port = free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.distributed_worker", str(r), str(WORLD), str(port), outdir],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for r in range(WORLD)
        ]
        logs = []
        try:
            for proc in procs:
                out, _ = proc.communicate(timeout=TIMEOUT_S)
                logs.append(out)
        except subprocess.TimeoutExpired:
            for proc in procs:
                proc.kill()
            pytest.fail(f"the 2-process run did not finish within {TIMEOUT_S} s (a collective hung?)")
        # free_port() releases its port before rank 0 binds it: another process may take it in
        # between. Only that failure is retried, once, on another port.
        if attempt == 0 and any(p.returncode != 0 and "EADDRINUSE" in log for p, log in zip(procs, logs)):
            continue
        break
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
    results = {}
    for r in range(WORLD):
        with open(os.path.join(outdir, f"rank{r}.json"), encoding="utf-8") as f:
            results[r] = json.load(f)
    return {"outdir": outdir, "results": results, "logs": logs}


def _assert_same(summary: probe.Summary, reference: probe.Summary, rtol: float = 1e-4, calls: bool = True) -> None:
    assert summary.sites == reference.sites
    for site in reference.sites:
        assert summary.metrics(site) == reference.metrics(site), site
        for metric in reference.metrics(site):
            assert summary.scales(site, metric) == reference.scales(site, metric)
            for scale in reference.scales(site, metric):
                got, want = summary.value(site, metric, scale), reference.value(site, metric, scale)
                np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-9, err_msg=f"{site} {metric}@{scale}")
        if calls:
            assert summary.info(site)["calls"] == reference.info(site)["calls"]


def test_rank0_equals_one_process_on_the_full_batch_with_grads(ranks):
    model = worker.parity_model()
    with probe.watch(model) as p:
        for step in range(4):
            model(worker.full_batch(step)).square().sum().backward()
    reference = p.summary()
    assert "grad_q" in reference.metrics("layers.0")  # the comparison below covers grad metrics
    got = probe.Summary.from_dict(ranks["results"][0]["parity"]["summary"])
    assert got.sites == ["layers.0", "layers.1"]  # DDP's `module.` prefix is gone
    _assert_same(got, reference, calls=False)
    assert got.steps == reference.steps == 4
    assert got.info("layers.0")["calls"] == 8  # each rank's forward is a call: 2 ranks x 4 steps


def test_fsdp2_fully_shard_equals_one_process(ranks):
    if not worker.fsdp_on_cpu():
        pytest.skip(f"FSDP2 does not run on a CPU mesh with torch {torch.__version__} (no torch.cpu.Stream.record_event)")
    model = worker.parity_model()
    with probe.watch(model) as p:
        for step in range(2):
            model(worker.full_batch(step)).square().sum().backward()
    got = probe.Summary.from_dict(ranks["results"][0]["fsdp"]["summary"])
    _assert_same(got, p.summary(), calls=False)
    assert "grad_k" in got.metrics("layers.1")


def test_every_rank_reads_the_global_summary(ranks):
    s0 = ranks["results"][0]["parity"]["summary"]
    s1 = ranks["results"][1]["parity"]["summary"]
    assert s0 == s1


def test_only_rank0_writes(ranks):
    run = os.path.join(ranks["outdir"], "run")
    events = glob.glob(os.path.join(run, "**", "events.out.tfevents.*"), recursive=True)
    assert len(events) == 1, events
    saved = probe.Summary.load(run)
    assert saved.to_dict() == ranks["results"][0]["parity"]["summary"]


def test_one_collective_per_flush_in_steady_state(ranks):
    counts = ranks["results"][0]["parity"]["collectives"]
    # 1st flush: gather (unknown layout) + object exchange + gather; then one gather per flush
    # (4 steps: flushes at the start of steps 1, 2, 3 and at close).
    assert counts == [3, 4, 5, 6]
    assert len(ranks["results"][0]["parity"]["timings"]) == 4


def test_no_collective_on_unsampled_steps(ranks):
    after = ranks["results"][0]["sampling"]["collectives_after_step"]
    # every=3: steps 0, 3, 6 sampled; their windows close at the start of steps 1 and 4, and at close.
    assert after == [0, 3, 3, 3, 4, 4, 4, 5]
    assert ranks["results"][0]["sampling"]["steps"] == 3


def test_ranks_at_different_steps_warn(ranks):
    for r in range(WORLD):
        found = [w for w in ranks["results"][r]["mismatch"]["warnings"] if "ranks flushed at different steps" in w]
        assert len(found) == 1 and "[0, 10]" in found[0], ranks["results"][r]["mismatch"]["warnings"]


def test_bad_logdir_is_rejected_on_every_rank(ranks):
    for r in range(WORLD):
        assert "expected `logdir` to be a path or a SummaryWriter, got float" in ranks["results"][r]["sampling"]["bad_logdir"]


def test_uneven_lengths_and_rank_only_sites_match_one_process(ranks):
    # One process seeing both ranks' inputs of each step, as one step.
    model = worker.Branchy()
    p = probe.watch(model)
    plans = [worker.uneven_plan(r) for r in range(WORLD)]
    for step in range(len(plans[0])):
        p.step(step)
        for plan in plans:
            s = plan[step]
            x = worker.full_batch(s["seed"], batch=2, length=s["length"])
            model(x, extra=s["extra"], skip=s["skip"]).square().sum().backward()
    p.close()
    reference = p.summary()
    got = probe.Summary.from_dict(ranks["results"][0]["uneven"]["summary"])
    assert set(got.sites) == {"body.layers.0", "body.layers.1", "extra#1", "extra#2"}
    assert got.sites == reference.sites
    _assert_same(got, reference)
    assert got.info("extra#1")["calls"] == 1 and got.info("body.layers.0")["calls"] == 5


def test_explicit_steps_with_a_rank_that_runs_no_forward(ranks):
    model = worker.parity_model()
    p = probe.watch(model)
    plans = [worker.manual_plan(r) for r in range(WORLD)]
    for step in range(len(plans[0])):
        p.step(step)
        for plan in plans:
            for seed in plan[step]["seeds"]:
                model(worker.full_batch(seed, batch=1)).square().sum().backward()
    p.close()
    got = probe.Summary.from_dict(ranks["results"][0]["manual"]["summary"])
    _assert_same(got, p.summary())
    assert got.steps == 3
    assert ranks["results"][0]["manual"]["collectives"] == ranks["results"][1]["manual"]["collectives"]


# -- pieces, in one process --------------------------------------------------------------------
def test_combine_ranks_matches_float64_reference():
    rng = np.random.default_rng(0)
    chunks = [rng.normal(3.0, 2.0, size=(n, 4)) for n in (5, 17, 1)]
    moments = torch.tensor(np.stack([[c.shape[0] * np.ones(4), c.mean(0), ((c - c.mean(0)) ** 2).sum(0)] for c in chunks]))
    absent = torch.zeros(1, 3, 4, dtype=torch.float64)
    values = torch.cat([moments[:1], absent, moments[1:]])
    present = torch.tensor([True, False, True, True])
    got = combine_ranks("logit@actual", values, present)
    union = np.concatenate(chunks)
    np.testing.assert_allclose(got[0].numpy(), union.shape[0])
    np.testing.assert_allclose(got[1].numpy(), union.mean(0), rtol=1e-12)
    np.testing.assert_allclose((got[2] / got[0]).numpy(), union.var(0), rtol=1e-12)
    pair = lambda a, b: torch.stack(chan_pair(a[0], a[1], a[2], b[0], b[1], b[2]))  # noqa: E731
    chained = pair(pair(moments[0], moments[1]), moments[2])
    np.testing.assert_allclose(got.numpy(), chained.numpy(), rtol=1e-12)
    maxima = torch.tensor([[1.0, -5.0], [-float("inf"), -float("inf")], [0.5, -7.0]], dtype=torch.float64)
    np.testing.assert_array_equal(combine_ranks("logit_max@actual", maxima, torch.tensor([True, False, True])).numpy(), [1.0, -5.0])
    sums = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]], dtype=torch.float64)
    np.testing.assert_array_equal(combine_ranks("rows", sums, torch.tensor([True, False, True])).numpy(), [4.0, 6.0])
    scales = torch.tensor([[0.1], [0.2], [float("nan")]], dtype=torch.float64)
    np.testing.assert_array_equal(combine_ranks("scale", scales, torch.tensor([True, True, False])).numpy(), [0.2])


def test_group_option_without_process_group():
    assert resolve_group(None) is None and resolve_group(False) is None
    with pytest.raises(probe.ProbeError, match="expected `group` to be None, False or a torch.distributed.ProcessGroup, got str"):
        probe.watch(worker.parity_model(), group="world")


def test_wrapper_prefixes_are_stripped():
    model = worker.parity_model()
    wrapped = nn.DataParallel(model)  # CPU DataParallel just forwards; names as for DDP
    names = site_names(wrapped)
    assert names[id(model.layers[0])] == "layers.0" and names[id(model)] == "root"
    holder = nn.Module()
    holder._orig_mod = wrapped  # torch.compile(DataParallel(model)) holds it like this
    assert site_names(holder)[id(model.layers[1])] == "layers.1"
    outer = nn.Module()
    outer.module = model  # "module" is only a wrapper segment under (Distributed)DataParallel
    assert site_names(outer)[id(model.layers[1])] == "module.layers.1"
    with probe.watch(wrapped) as p:
        wrapped(worker.full_batch(0))
    assert p.summary().sites == ["layers.0", "layers.1"]
