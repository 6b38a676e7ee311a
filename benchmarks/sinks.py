"""What writing costs the training loop: in-memory probe vs TensorBoard (full, scalars only) vs JSONL.

A Hugging Face BERT encoder built from a config (SDPA, 4 layers, hidden 256, 4 heads, batch 2,
sequence 128), forward + backward, every step probed (``every=1``, the most writing there is).
Each arm has its own model copy and probe, alive for the whole run; the arms run interleaved,
a few steps each per round, so machine noise hits them alike:

- ``memory``: no sink (statistics kept for ``summary()`` only), the baseline here;
- ``tensorboard``: ``logdir=`` (scalars, heatmaps, histograms, layout, text);
- ``tb_scalars``: a ``TensorBoardSink`` with ``images=False, histograms=False``;
- ``jsonl``: ``JSONLSink`` only.

Prints the median step time of each arm and its ratio to ``memory`` (the cost the writer thread
imposes on the training thread: GIL time, not waiting), and how long ``close()`` took (the backlog
the writer still had to drain: writing that did not keep up with training).

Usage::

    python benchmarks/sinks.py            # 20 rounds
    python benchmarks/sinks.py --quick    # 6 rounds, about a minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from typing import Dict, List

import torch

import probe
from probe.sinks.jsonl import JSONLSink
from probe.sinks.tensorboard import TensorBoardSink


def build_bert() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=512, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
    )
    return BertModel(config).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3, help="steps per arm per round")
    args = parser.parse_args()
    rounds = args.rounds or (6 if args.quick else 20)
    torch.set_num_threads(2)
    base = build_bert()
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(0))
    root = tempfile.mkdtemp(prefix="probe-bench-sinks-")

    def make(arm: str):
        model = copy.deepcopy(base)
        if arm == "memory":
            p = probe.watch(model)
        elif arm == "tensorboard":
            p = probe.watch(model, logdir=f"{root}/tb")
        elif arm == "tb_scalars":
            p = probe.watch(model, sinks=[TensorBoardSink(f"{root}/tbs", images=False, histograms=False)])
        else:
            p = probe.watch(model, sinks=[JSONLSink(f"{root}/probe.jsonl")])
        return model, p

    arms = ("memory", "tensorboard", "tb_scalars", "jsonl")
    setups = {arm: make(arm) for arm in arms}
    times: Dict[str, List[float]] = {arm: [] for arm in arms}

    def step(model: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids).last_hidden_state.square().mean().backward()

    for arm in arms:  # warm-up: first event file, fonts, allocator
        step(setups[arm][0])
    for _ in range(rounds):
        for arm in arms:
            model, _ = setups[arm]
            for _ in range(args.steps):
                start = time.perf_counter()
                step(model)
                times[arm].append(time.perf_counter() - start)
    drain: Dict[str, float] = {}
    for arm in arms:
        start = time.perf_counter()
        setups[arm][1].close()
        drain[arm] = time.perf_counter() - start

    ref = statistics.median(times["memory"])
    print(f"BERT 4x256, 4 heads, batch 2 x 128, every=1, {rounds} rounds x {args.steps} steps per arm")
    print(f"{'arm':<12} {'median step':>12} {'ratio':>7} {'close()':>9}")
    for arm in arms:
        med = statistics.median(times[arm])
        print(f"{arm:<12} {med * 1e3:>10.1f}ms {med / ref:>7.2f} {drain[arm]:>8.2f}s")


if __name__ == "__main__":
    main()
