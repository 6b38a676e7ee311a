"""One rank of the 2-process gloo run behind tests/test_distributed.py.

Run as ``python -m tests.distributed_worker RANK WORLD PORT OUTDIR``; writes ``OUTDIR/rank{RANK}.json``
with every scenario's summaries, so that the test process compares them with a float64
single-process run without ever holding a process group itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import probe
from tests.helpers import SDPAModel, leave


def full_batch(seed: int, batch: int = 4, length: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, 64, generator=g)


def parity_model() -> SDPAModel:
    torch.manual_seed(0)
    return SDPAModel(layers=2, heads=4, kv_heads=2, causal=True)


class Twice(nn.Module):
    """One module issuing two attention calls per invocation (sites ``extra#1``, ``extra#2``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.proj(x).view(b, n, 4, 16).transpose(1, 2)
        y = F.scaled_dot_product_attention(h, h, h)
        y = F.scaled_dot_product_attention(y, h, h, is_causal=True)
        return y.transpose(1, 2).reshape(b, n, 64)


class Branchy(nn.Module):
    """Two layers always; ``extra`` only when asked; no attention call at all when skipped."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.body = SDPAModel(layers=2, heads=4)
        self.extra = Twice()

    def forward(self, x: torch.Tensor, extra: bool = False, skip: bool = False) -> torch.Tensor:
        if skip:
            return self.body.norm(x) * 2  # parameters, but no attention call
        x = self.body(x)
        if extra:
            x = x + self.extra(x)
        return x


def uneven_plan(rank: int) -> List[Dict[str, Any]]:
    """Per step: this rank's sequence length, whether it takes the branch or skips attention."""
    length = 7 if rank == 0 else 12
    return [
        {"seed": 100 + rank, "length": length, "extra": False, "skip": False},
        {"seed": 110 + rank, "length": length, "extra": rank == 1, "skip": False},
        {"seed": 120 + rank, "length": length, "extra": False, "skip": rank == 0},
    ]


def run_parity(rank: int, world: int, logdir: str) -> Dict[str, Any]:
    model = parity_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    p = probe.watch(ddp, logdir=logdir)
    timings: List[float] = []
    counts: List[int] = []
    reducer = p._dist
    reduce = reducer.reduce

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return reduce(*args, **kwargs)
        finally:
            timings.append(time.perf_counter() - start)
            counts.append(reducer.collectives)

    reducer.reduce = timed
    per = 4 // world
    for step in range(4):
        x = full_batch(step)[rank * per : (rank + 1) * per]
        ddp(x).square().sum().backward()
    p.close()
    summary = p.summary().to_dict()
    return {"summary": summary, "timings": timings, "collectives": counts}


def fsdp_on_cpu() -> bool:
    """Whether this torch's FSDP2 runs on a CPU mesh: its all-gather records an event on the
    device's stream, and torch 2.6's ``torch.cpu.Stream`` has no ``record_event`` (fully_shard
    then fails inside FSDP, before any probe code runs)."""
    return hasattr(torch.cpu.Stream, "record_event")


def run_fsdp(rank: int, world: int) -> Dict[str, Any]:
    """FSDP2 ``fully_shard`` on a CPU mesh (gloo): parameters sharded, attention unchanged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = parity_model()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    p = probe.watch(model)
    per = 4 // world
    for step in range(2):
        x = full_batch(step)[rank * per : (rank + 1) * per]
        model(x).square().sum().backward()
    p.close()
    return {"summary": p.summary().to_dict()}


def manual_plan(rank: int) -> List[Dict[str, Any]]:
    """Explicit steps: two micro-batches on step 0, none at all on rank 1 in step 1 (its loader ran
    dry), one on step 2."""
    forwards = [2, 1 if rank == 0 else 0, 1]
    return [{"seeds": [200 + 10 * step + 2 * i + rank for i in range(n)]} for step, n in enumerate(forwards)]


def run_manual(rank: int) -> Dict[str, Any]:
    model = parity_model()
    p = probe.watch(model)
    for step, plan in enumerate(manual_plan(rank)):
        p.step(step)
        for seed in plan["seeds"]:
            model(full_batch(seed, batch=1)).square().sum().backward()
    p.close()
    return {"summary": p.summary().to_dict(), "collectives": p._dist.collectives}


def run_mismatch(rank: int) -> Dict[str, Any]:
    """Ranks number their steps differently (same number of flushes): a warning, not a hang."""
    import warnings

    model = parity_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = probe.watch(model)
        for step in range(2):
            p.step(step + 10 * rank)
            model(full_batch(step)[rank : rank + 1])
        p.close()
    return {"warnings": [str(w.message) for w in caught]}


def run_sampling(rank: int) -> Dict[str, Any]:
    model = parity_model()
    try:  # a bad logdir fails on every rank, not only on the one that writes
        probe.watch(model, logdir=3.5).close()
        rejected = ""
    except probe.ProbeError as err:
        rejected = str(err)
    p = probe.watch(model, every=3)
    after: List[int] = []
    for step in range(7):
        model(full_batch(step)[rank : rank + 1]).sum().backward()
        after.append(p._dist.collectives)
    p.close()
    after.append(p._dist.collectives)
    return {"collectives_after_step": after, "steps": p.summary().steps, "bad_logdir": rejected}


def run_uneven(rank: int) -> Dict[str, Any]:
    model = Branchy()
    p = probe.watch(model)
    for step in uneven_plan(rank):
        x = full_batch(step["seed"], batch=2, length=step["length"])
        model(x, extra=step["extra"], skip=step["skip"]).square().sum().backward()
    p.close()
    return {"summary": p.summary().to_dict()}


def main() -> None:
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        out = {
            "parity": run_parity(rank, world, os.path.join(outdir, "run")),
            "sampling": run_sampling(rank),
            "uneven": run_uneven(rank),
            "fsdp": run_fsdp(rank, world) if fsdp_on_cpu() else None,
            "manual": run_manual(rank),
            "mismatch": run_mismatch(rank),
        }
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(out, f)
    leave()



if __name__ == "__main__":
    main()
