"""probe under torchrun + DDP (and optionally torch.compile), on CPU with gloo or GPUs with NCCL.

    torchrun --nproc_per_node 2 examples/distributed_train.py --logdir runs/ddp
    torchrun --nproc_per_node 2 examples/distributed_train.py --compile

Each rank trains a small causal transformer on its own random batches; probe measures every rank's
attention and rank 0 writes the statistics of all ranks' batches together (TensorBoard events and
probe_summary.json in --logdir), then prints the per-layer entropy and max logit.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import probe


class Block(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.out, self.norm = heads, nn.Linear(d, 3 * d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, n, d))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="runs/distributed")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (sampled steps run eagerly)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun provides RANK, WORLD_SIZE, MASTER_*
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Embedding(128, 64), *[Block() for _ in range(2)], nn.Linear(64, 128)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    net = torch.compile(ddp) if args.compile else ddp
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    p = probe.watch(net, logdir=args.logdir, every=args.every)  # after init_process_group
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for step in range(args.steps):
        p.step(step)  # the same step on every rank: flushes are collectives
        tokens = torch.randint(0, 128, (8, 33), generator=g).to(device)
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 128), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    p.close()  # a collective too: every rank, before destroy_process_group

    if rank == 0:
        s = p.summary()
        for site in s.sites:
            print(f"{site}: entropy {s.value(site, 'entropy').round(3)}  logit_max {s.value(site, 'logit_max').round(2)}"
                  f"  calls {s.info(site)['calls']} (all ranks)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
