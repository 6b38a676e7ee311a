"""One rank of the 2-process gloo run behind tests/test_qk_clip_distributed.py.

``python -m tests.qk_clip_worker RANK WORLD PORT OUTDIR``: each rank clips a copy of the toy model
from its own batch, under DDP and under FSDP2, and writes the resulting q/k weights (gathered
in full) and the clip's records to ``OUTDIR/rank{RANK}.pt``.
"""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import probe
from tests.helpers import leave


def batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(2, 7, 32, generator=g) * (1.0 + rank)  # rank 1's logits are larger


def model():
    from tests.test_qk_clip import Toy

    torch.manual_seed(0)
    m = Toy(heads=4, kv_heads=2)
    with torch.no_grad():
        m.q.weight.mul_(3.0)
        m.k.weight.mul_(3.0)
    return m


TAU = 6.0


def _step(wrapped, x):
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2's note on a returned view
        with probe.watch(wrapped, qk_clip=TAU, every=None) as p:
            for _ in range(2):  # the second step's flush: every rank flushes at the same steps
                wrapped(x).pow(2).mean().backward()
                opt.step()
    return p.summary()


def main() -> None:
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    out = {}
    try:
        x = batch(rank)
        ddp = torch.nn.parallel.DistributedDataParallel(model())
        s = _step(ddp, x)
        out["ddp"] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        records = ("qk_clip_logit", "qk_clip_factor")
        out["ddp_records"] = {m: torch.from_numpy(s.value("root", m)) for m in records} if rank == 0 else None

        from torch.distributed.fsdp import fully_shard

        sharded = model()
        fully_shard(sharded)
        s = _step(sharded, x)
        out["fsdp"] = {n: p.full_tensor().detach().clone() for n, p in sharded.named_parameters()}
        out["fsdp_info"] = s.info("root").get("qk_clip") if rank == 0 else None
        dist.barrier()
    finally:
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    leave()


if __name__ == "__main__":
    main()
