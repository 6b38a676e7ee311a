"""What probe costs per training step, side by side with a plain implementation.

A Hugging Face BERT encoder built from a config (SDPA attention, 4 layers, hidden 256, 4 heads so
d_k = 64, batch 2), forward + backward, at sequence 128 and 512. The arms run interleaved round by
round in one process, so machine noise (other jobs, frequency changes) hits them alike:

- ``bare``: no probe.
- ``unsampled``: a probe attached with ``every`` so large that the timed steps are never sampled.
- ``every=1``: every step probed (all metrics, three scales, gradients).
- ``every=10``: one step in ten probed; each round runs ten steps and reports their mean.
- ``plain``: a straightforward implementation of the same statistics, written below: full logits
  per scale, a separate softmax per scale, ``.item()`` per head and metric, and the same for the
  softmax's gradient in backward.

Prints per-arm medians and ratios to the bare step, and probe's overhead as a fraction of the
plain implementation's. Timings on a shared machine are noisy: trust medians of interleaved
rounds, not single numbers.

Usage::

    python benchmarks/overhead.py            # 30 rounds per sequence length
    python benchmarks/overhead.py --quick    # about 2 minutes on 2 CPU cores
    python benchmarks/overhead.py --quick --seq 512 --threads 1   # steadier on a busy machine
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import probe

SCALE_NAMES = ("actual", "unscaled", "standard")


def build_bert(seq: int) -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=max(512, seq), hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
    )
    return BertModel(config).train()


# -- the plain reference implementation ------------------------------------------------------
class PlainStats:
    """Per-head statistics the obvious way, for comparison; results go to ``self.values``."""

    def __init__(self, tau: float = 0.99) -> None:
        self.tau = tau
        self.values: List[float] = []

    def _softmax_metrics(self, z: torch.Tensor, valid: torch.Tensor) -> None:
        p = torch.softmax(z, dim=-1)
        n_keys = valid.sum(-1).clamp(min=2).float()
        ent = -(torch.where(p > 0, p * torch.log(p), 0.0)).sum(-1) / torch.log(n_keys)
        ent = ent.expand(p.shape[:-1])
        pmax = p.amax(-1)
        for h in range(z.shape[1]):
            self.values.append(ent[:, h].mean().item())
            self.values.append(pmax[:, h].mean().item())
            self.values.append((pmax[:, h] >= self.tau).float().mean().item())

    def forward(self, q, k, v, mask, causal, scale, out) -> None:
        with torch.no_grad():
            valid, bias = _valid_and_bias(q, k, mask, causal)
            d = q.shape[-1]
            for sigma in (scale, 1.0, d**-0.5):
                logits = (q.float() @ k.float().transpose(-1, -2)) * sigma
                z = logits + bias
                full = valid.expand_as(logits)
                for h in range(q.shape[1]):
                    lh = logits[:, h][full[:, h]]
                    self.values.append(lh.var(unbiased=False).item())
                    self.values.append(lh.max().item())
                    self.values.append((~torch.isfinite(lh)).sum().item())
                self._softmax_metrics(z, valid)
        if out.requires_grad:
            out.register_hook(lambda g: self.backward(q, k, v, valid, bias, scale, g))
        for t in (q, k, v):
            if t.requires_grad:
                t.register_hook(self._grad_norm)

    def _grad_norm(self, g: torch.Tensor) -> None:
        for h in range(g.shape[1]):
            self.values.append(g[:, h].float().norm().item())

    def backward(self, q, k, v, valid, bias, scale, grad_out) -> None:
        with torch.no_grad():
            dp = grad_out.float() @ v.float().transpose(-1, -2)
            for sigma in (scale, 1.0, q.shape[-1] ** -0.5):
                z = (q.float() @ k.float().transpose(-1, -2)) * sigma + bias
                p = torch.softmax(z, dim=-1)
                dz = p * (dp - (p * dp).sum(-1, keepdim=True))
                for h in range(q.shape[1]):
                    self.values.append(dz[:, h].norm().item())


def _valid_and_bias(q, k, mask, causal):
    b, h, l, _ = q.shape
    s = k.shape[2]
    valid = torch.ones(1, 1, l, s, dtype=torch.bool, device=q.device)
    bias = torch.zeros(1, 1, l, s, device=q.device)
    if causal:
        valid = valid & torch.ones(l, s, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            valid = valid & mask
        else:
            ok = mask > torch.finfo(mask.dtype).min / 2
            valid = valid & ok
            bias = torch.where(ok, mask.float(), 0.0)
    bias = torch.where(valid, bias, -math.inf)
    return valid, bias


class PlainMode(TorchFunctionMode):
    """Captures q, k, v of every SDPA call and runs :class:`PlainStats` on it."""

    def __init__(self, stats: PlainStats) -> None:
        super().__init__()
        self.stats = stats

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            bound = dict(zip(names, args), **kwargs)
            q, k, v = bound["query"], bound["key"], bound["value"]
            scale = bound.get("scale") or q.shape[-1] ** -0.5
            self.stats.forward(q, k, v, bound.get("attn_mask"), bool(bound.get("is_causal")), scale, out)
        return out


# -- arms ---------------------------------------------------------------------------------------
def make_arms(seq: int, batch: int) -> Dict[str, Callable[[], float]]:
    """Arm name → a function that runs its work for one round and returns seconds per step."""
    base = build_bert(seq)
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (batch, seq))

    def step(model: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids).last_hidden_state
        out.float().square().mean().backward()

    def timed(model: torch.nn.Module, steps: int = 1, wrap: Optional[Callable[[], Any]] = None) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                if wrap is None:
                    step(model)
                else:
                    with wrap():
                        step(model)
            return (time.perf_counter() - t0) / steps
        return run

    models = {name: copy.deepcopy(base) for name in ("bare", "unsampled", "every=1", "every=10", "plain")}
    probes = {
        "unsampled": probe.watch(models["unsampled"], every=10**9),
        "every=1": probe.watch(models["every=1"], every=1),
        "every=10": probe.watch(models["every=10"], every=10),
    }
    step(models["unsampled"])  # step 0 is sampled; every later step is not
    plain = PlainStats()

    arms = {
        "bare": timed(models["bare"]),
        "unsampled": timed(models["unsampled"]),
        "every=1": timed(models["every=1"]),
        "every=10": timed(models["every=10"], steps=10),
        "plain": timed(models["plain"], wrap=lambda: PlainMode(plain)),
    }
    arms["_probes"] = probes  # type: ignore[assignment]
    arms["_plain"] = plain  # type: ignore[assignment]
    return arms


def run_length(seq: int, batch: int, rounds: int, warmup: int) -> Dict[str, Any]:
    arms = make_arms(seq, batch)
    probes = arms.pop("_probes")
    plain = arms.pop("_plain")
    times: Dict[str, List[float]] = {name: [] for name in arms}
    for r in range(warmup + rounds):
        order = list(arms)
        order = order[r % len(order):] + order[: r % len(order)]  # rotate who goes first
        for name in order:
            t = arms[name]()
            if r >= warmup:
                times[name].append(t)
    for p in probes.values():
        p.close()
    assert plain.values, "the plain arm captured nothing"
    med = {name: statistics.median(ts) for name, ts in times.items()}
    bare = med["bare"]
    result = {
        "seq": seq, "batch": batch, "rounds": rounds,
        "median_ms": {n: 1e3 * m for n, m in med.items()},
        "ratio": {n: m / bare for n, m in med.items()},
    }
    plain_over = med["plain"] - bare
    result["overhead_vs_plain"] = (med["every=1"] - bare) / plain_over if plain_over > 0 else float("nan")
    return result


def print_result(res: Dict[str, Any]) -> None:
    print(f"\nBERT 4 layers, hidden 256, 4 heads (d_k 64), batch {res['batch']}, seq {res['seq']}, "
          f"forward + backward, {res['rounds']} interleaved rounds, torch threads {torch.get_num_threads()}")
    print(f"{'arm':<12}{'median ms':>12}{'x bare':>10}")
    for name, ms in res["median_ms"].items():
        print(f"{name:<12}{ms:>12.1f}{res['ratio'][name]:>10.3f}")
    print(f"probe overhead / plain overhead (every=1): {res['overhead_vs_plain']:.3f}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about 2 minutes on 2 cores)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 is steadier on a machine shared with other jobs)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (7 if args.quick else 30)
    results = []
    for seq in args.seq:
        res = run_length(seq, args.batch, rounds, warmup=2)
        print_result(res)
        sys.stdout.flush()
        results.append(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
