"""What probe costs per training step: arms interleaved round by round in one process.

Workloads (``benchmarks/workloads.py``): ``bert-padded`` (HF BERT, SDPA, 4 layers, hidden 256,
batch 2, seq 512, padding mask with 25 % padding on the second row) and ``llama-gqa`` (HF
Llama, SDPA, 4 layers, hidden 256, 8 heads / 2 kv heads, batch 1, seq 1024, causal) by default;
``bert`` (no mask) on request. Each step is forward + backward. Arms:

- ``bare``: no probe.
- ``unsampled``: a probe attached with ``every`` so large that the timed steps are never sampled.
- ``every=1``: every step probed (all metrics, three scales, gradients), no logdir; the default
  ``rows=128`` (calls longer than 128 query rows estimate their exponential metrics).
- ``every=1+tb``: the same with a TensorBoard ``logdir``.
- ``every=10+tb``: one step in ten probed, TensorBoard; a round is a 10-step window, reported
  per step.
- ``max_logit``: QK-Clip's measurement, ``probe.watch(model, every=None, qk_clip=1e9)``: every
  step's max logits only (one ``q·kᵀ`` per call, no exponential; τ so large that nothing is
  clipped, and no optimizer step in the timed step: this is the measurement alone).
- ``plain`` (``--plain``): a straightforward implementation of the same statistics, written
  below: full logits and a separate softmax per scale, ``.item()`` per head and metric.
- ``every=1,rows=N`` (``--rows N``): every step probed with a budget of N sampled query rows
  for the exponential metrics and ``grad_logits`` (estimates with standard errors);
  ``--rows none`` gives ``every=1,rows=None``, every statistic exact.
- ``before:...`` (``--before MODULE``): the same arms with another version of probe imported
  under another name (``benchmarks/before.sh`` makes one from a git commit), side by side.
- ``one-model`` (``--one-model``): one copy of the model watched with ``every=2``; a round is two
  steps, the sampled one and the unsampled one after it, and the arm's ``paired`` is the median
  over rounds of sampled / unsampled. Both steps run on the same tensors, so the few percent by
  which where a copy lies in memory moves a whole arm (the ``unsampled`` arm against ``bare``:
  0.97–1.04) cancel; what the unsampled step costs (two Python hook calls) and the sampled step's
  results handed over at the start of the next step count against the reference, not the arm.
  Its ``x bare`` column is the sampled step over ``bare`` like every other arm's.

Beside every arm: its ``floor``, the physical floor of probing this workload's step (``Floor``:
``1 +`` the FLOPs of the products probe cannot avoid, one ``q·kᵀ`` over every row forward and
``q·kᵀ``, ``dO·vᵀ`` over the sampled rows backward, over the bare step's FLOPs), and ``to
floor``, the arm's ratio minus it: what probe costs above the arithmetic it must do.

Every round ends by waiting for the arm's background writer, and that wait is timed: what the
writer could not finish during the step is charged to the arm, and no arm's writing spills into
another's timing. The arms rotate who goes first each round. Prints medians and ratios to
``bare``; after the rounds, ``close_s`` is how long ``close()`` took after a run of ``--close``
probed steps with TensorBoard (``every=1``).

Timings on a shared machine are noisy: trust the ratios of medians of interleaved rounds, not
single numbers. ``paired`` is the median over rounds of each round's ratio to that round's bare
step (a slow period of the machine slows every arm of its round and cancels there). Each arm runs
its own copy of the model, and where a copy's tensors happen to lie in memory can move a whole
arm by a few percent: the ``unsampled`` arm, two Python hook calls per step, has read 0.97–1.04
on a quiet machine. ``paired 95 %`` is a distribution-free interval of that median (order
statistics of the rounds): it covers the noise within one process only; ``--processes N`` runs the
whole measurement in N fresh processes and prints the spread of their paired medians, which on a
shared machine is the wider one.

Usage::

    python benchmarks/overhead.py                      # both workloads, 20 rounds
    python benchmarks/overhead.py --quick              # 7 rounds
    python benchmarks/overhead.py --workload bert --seq 128 512 --plain
    python benchmarks/overhead.py --floor              # only the floors (no timing)
    python benchmarks/overhead.py --ops                # torch operations per probed call (no timing)
    python benchmarks/overhead.py --workload bert-padded --only every=1 --processes 5 \
        --rounds 15 --threads 1 --clock cpu --close 0  # the spread between processes
    python benchmarks/overhead.py --workload bert-padded --only every=1 one-model --one-model \
        --processes 5 --rounds 15 --threads 1 --clock cpu --close 0  # sampled / unsampled, one copy
    benchmarks/before.sh 7fc42e4 /tmp/before && \
      PYTHONPATH=$PWD:/tmp/before python benchmarks/overhead.py --before probe_before
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe  # noqa: E402
from workloads import WORKLOADS, build  # noqa: E402

def build_bert(seq: int) -> torch.nn.Module:
    """The unmasked BERT encoder of the ``bert`` workload (used by ``benchmarks/gpu.py``)."""
    return build("bert", seq).model


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


# -- the physical floor -------------------------------------------------------------------------
class _Shapes(TorchFunctionMode):
    """Records the shapes of every SDPA call of a step (q, k, v and whether it is causal)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[Dict[str, Any]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            bound = dict(zip(names, args), **kwargs)
            q, k, v = bound["query"], bound["key"], bound["value"]
            self.calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape),
                               "causal": bool(bound.get("is_causal")), "grad": q.requires_grad})
        return func(*args, **kwargs)


def _keys_seen(length: int, keys: int, causal: bool, positions: Optional[List[int]] = None) -> int:
    """Keys a set of query rows is multiplied with: every key, or under causal masking (trimmed at
    the diagonal, as probe's chunks are) keys ``0 .. i`` for row ``i``."""
    rows = range(length) if positions is None else positions
    return sum(min(i + 1, keys) for i in rows) if causal else len(rows) * keys


class Floor:
    """The physical floor of probing a workload's step: the FLOPs of the products probe cannot
    avoid, over the bare step's FLOPs (``1 + extra / bare``).

    Bare: every FLOP ``torch.utils.flop_counter.FlopCounterMode`` counts in one forward + backward,
    plus SDPA's own products, which it does not count on CPUs (``sdpa_flop_count`` and
    ``sdpa_backward_flop_count`` of each call's shapes, causal calls at the trimmed share of keys).
    Extra, per probed call: one ``q·kᵀ`` over every row (the exact logit moments and max need
    every logit), and in the backward one ``q·kᵀ`` and one ``dO·vᵀ`` over the rows
    ``grad_logits`` is computed on (``rows=N``: the stratified sample, one draw; ``None``: every
    row), causal products trimmed at the diagonal; an arm probing one step in ``every`` pays a
    ``1/every`` share. Everything else probe does (exponentials, reductions, Python) is above the
    floor.
    """

    def __init__(self, workload: str, seq: int, batch: int) -> None:
        from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

        w = build(workload, seq, batch)
        shapes = _Shapes()
        with FlopCounterMode(display=False) as counter, shapes:
            w.step(w.model)
        self.calls = shapes.calls
        attention = 0
        for c in self.calls:
            q, k, v = c["q"], c["k"], c["v"]
            k_full, v_full = (q[0], q[1], k[2], k[3]), (q[0], q[1], v[2], v[3])  # kv heads repeated
            share = _keys_seen(q[2], k[2], c["causal"]) / (q[2] * k[2])
            flops = sdpa_flop_count(q, k_full, v_full)
            if c["grad"]:
                flops += sdpa_backward_flop_count((*q[:3], v[3]), q, k_full, v_full)
            attention += flops * share
        self.bare = counter.get_total_flops() + attention

    def extra(self, rows: Optional[int], every: int = 1) -> float:
        """FLOPs of the unavoidable products per step for an arm (``rows``: its ``rows=`` budget)."""
        from probe.stats.sampling import sample_rows

        total = 0
        for c in self.calls:
            (batch, heads, length, dim), keys, dv = c["q"], c["k"][2], c["v"][3]
            total += 2 * batch * heads * dim * _keys_seen(length, keys, c["causal"])  # forward q·kᵀ
            if c["grad"]:
                positions = None if rows is None or rows >= length else sample_rows(
                    length, rows, torch.Generator().manual_seed(0)).tolist()
                total += 2 * batch * heads * (dim + dv) * _keys_seen(length, keys, c["causal"], positions)
        return total / every

    def ratio(self, rows: Optional[int], every: int = 1) -> float:
        return 1.0 + self.extra(rows, every) / self.bare


#: The floor's (rows, every) of each arm (``None``: no floor: the plain arm computes other things).
def _floor_args(name: str) -> Optional[tuple]:
    name = name.split(":", 1)[-1]
    if name == "bare" or name == "unsampled":
        return (None, 0)
    if name.startswith("every=1,rows="):
        value = name.split("=", 2)[2]
        return (None if value == "None" else int(value), 1)
    if name.startswith("every=10"):
        return (128, 10)
    if name.startswith("every=1") or name == "one-model":
        return (128, 1)
    return None


# -- arms ---------------------------------------------------------------------------------------
#: What a round is timed with: wall time (default) or, with ``--clock cpu``, the CPU time of the
#: whole process (every thread, the background writer's included), which other jobs on a shared
#: machine disturb far less.
CLOCK: List[Callable[[], float]] = [time.perf_counter]

#: ``--only``: the probe arms to run (with ``bare``; empty: all of them).
ONLY: List[str] = []

#: ``--one-model``: add the one-model arm (sampled over unsampled steps of one copy).
ONE_MODEL: List[bool] = [False]


def _drain(p: Any) -> None:
    """Wait until the probe's background writer has written everything submitted so far."""
    if hasattr(p, "flush"):  # this version: waits until every sink wrote and flushed
        p.flush()
        return
    worker = getattr(p, "_worker", None)  # versions before Probe.flush (7fc42e4): one worker thread
    if worker is not None and hasattr(worker, "join"):
        worker.join()
    else:
        p.summary()


class Arms:
    """Arm name -> a function running one round and returning seconds per step."""

    def __init__(self, workload: str, seq: int, batch: int, plain: bool, before: Optional[str],
                 tmp: str, rows: Optional[int] = None) -> None:
        w = build(workload, seq, batch)
        self.description = w.description
        self.step = w.step
        self.probes: List[Any] = []
        self.arms: Dict[str, Callable[[], float]] = {"bare": self._timed(copy.deepcopy(w.model))}
        impls = [("", probe)]
        if before:
            impls.append(("before:", importlib.import_module(before)))
        for prefix, impl in impls:
            self._probe_arms(prefix, impl, w.model, tmp)
        if rows is not None:  # another budget (0: rows=None, every row exact), this version only
            model = copy.deepcopy(w.model)
            p = probe.watch(model, every=1, rows=rows or None)
            self.probes.append(p)
            self.arms[f"every=1,rows={rows or None}"] = self._timed(model, 1, p)
        #: the one-model arm's unsampled steps, round by round (its run returns the sampled one's)
        self.unsampled_of_one: List[float] = []
        if ONE_MODEL[0] and not (ONLY and "one-model" not in ONLY):
            self.arms["one-model"] = self._one_model(copy.deepcopy(w.model))
        if plain:
            self.plain = PlainStats()
            model = copy.deepcopy(w.model)
            self.arms["plain"] = self._timed(model, wrap=lambda: PlainMode(self.plain))

    def _probe_arms(self, prefix: str, impl: Any, base: torch.nn.Module, tmp: str) -> None:
        specs = {"unsampled": (10**9, False, 1), "every=1": (1, False, 1),
                 "every=1+tb": (1, True, 1), "every=10+tb": (10, True, 10), "max_logit": (None, False, 1)}
        for name, (every, tb, steps) in specs.items():
            if (ONLY and name not in ONLY) or (name == "max_logit" and prefix):  # older versions: no qk_clip
                continue
            model = copy.deepcopy(base)
            logdir = os.path.join(tmp, (prefix + name).replace(":", "_")) if tb else None
            p = impl.watch(model, logdir=logdir, every=every, **({"qk_clip": 1e9} if every is None else {}))
            self.probes.append(p)
            if name == "unsampled":
                self.step(model)  # step 0 is sampled; every later step is not
                _drain(p)
            self.arms[prefix + name] = self._timed(model, steps, p)

    def _timed(self, model: torch.nn.Module, steps: int = 1, p: Any = None,
               wrap: Optional[Callable[[], Any]] = None) -> Callable[[], float]:
        def run() -> float:
            t0 = CLOCK[0]()
            for _ in range(steps):
                if wrap is None:
                    self.step(model)
                else:
                    with wrap():
                        self.step(model)
            if p is not None:
                _drain(p)
            return (CLOCK[0]() - t0) / steps
        return run

    def _one_model(self, model: torch.nn.Module) -> Callable[[], float]:
        """The ``one-model`` arm: ``every=2``, two steps per round; returns the sampled step's
        time and keeps the unsampled one's in :attr:`unsampled_of_one`."""
        p = probe.watch(model, every=2)
        self.probes.append(p)

        def run() -> float:
            times = {}
            for _ in range(2):
                t0 = CLOCK[0]()
                self.step(model)
                # the step that forward belonged to (automatic counting)
                times[p._sampled(p.current_step)] = CLOCK[0]() - t0
            if set(times) != {True, False}:
                raise RuntimeError(f"one-model: a round of two steps was not one sampled and one not ({times})")
            self.unsampled_of_one.append(times[False])
            return times[True]
        return run

    def close(self) -> None:
        for p in self.probes:
            p.close()


def close_time(workload: str, seq: int, batch: int, steps: int, tmp: str, impl: Any = probe) -> float:
    """Wall seconds ``close()`` takes after ``steps`` probed steps with TensorBoard (``every=1``)."""
    w = build(workload, seq, batch)
    p = impl.watch(w.model, logdir=os.path.join(tmp, f"close-{impl.__name__}"), every=1)
    for _ in range(steps):
        w.step(w.model)
    t0 = time.perf_counter()
    p.close()
    return time.perf_counter() - t0


def run_workload(workload: str, seq: int, batch: int, rounds: int, warmup: int, plain: bool,
                 before: Optional[str], close_steps: int, rows: Optional[int] = None) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        arms = Arms(workload, seq, batch, plain, before, tmp, rows)
        times: Dict[str, List[float]] = {name: [] for name in arms.arms}
        for r in range(warmup + rounds):
            order = list(arms.arms)
            order = order[r % len(order):] + order[: r % len(order)]  # rotate who goes first
            for name in order:
                t = arms.arms[name]()
                if r >= warmup:
                    times[name].append(t)
        unsampled_of_one = arms.unsampled_of_one[warmup:]
        arms.close()
        close_s = close_time(workload, seq, batch, close_steps, tmp) if close_steps else None
        close_before = (close_time(workload, seq, batch, close_steps, tmp, importlib.import_module(before))
                        if close_steps and before else None)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    bare = med["bare"]
    floor = Floor(workload, seq, batch)
    floors: Dict[str, Optional[float]] = {}
    for name in times:
        args = _floor_args(name)
        floors[name] = None if args is None else (1.0 if args[1] == 0 else floor.ratio(*args))
    result: Dict[str, Any] = {
        "workload": workload, "description": arms.description, "rounds": rounds,
        "threads": torch.get_num_threads(), "clock": "cpu" if CLOCK[0] is time.process_time else "wall",
        "median_ms": {n: 1e3 * m for n, m in med.items()},
        "ratio": {n: m / bare for n, m in med.items()},
        # the median over rounds of each round's time over that round's bare step: a slow period
        # of the machine slows every arm of its round, and cancels here
        "paired": {n: statistics.median(t / b for t, b in zip(ts, times["bare"])) for n, ts in times.items()},
        # a distribution-free 95 % interval of that median (order statistics): on a shared
        # machine rounds scatter by several percent, and a goal is met only when the interval is
        "paired_ci": {n: median_interval([t / b for t, b in zip(ts, times["bare"])]) for n, ts in times.items()},
        "close_s": close_s, "close_steps": close_steps, "close_before_s": close_before,
        "floor": floors, "bare_gflop": floor.bare / 1e9,
    }
    if "one-model" in times:  # paired with its own unsampled step, not with the bare copy's
        ratios = [t / u for t, u in zip(times["one-model"], unsampled_of_one)]
        result["paired"]["one-model"] = statistics.median(ratios)
        result["paired_ci"]["one-model"] = median_interval(ratios)
        result["one_model_unsampled_ms"] = 1e3 * statistics.median(unsampled_of_one)
    if plain:
        assert arms.plain.values, "the plain arm captured nothing"
        plain_over = med["plain"] - bare
        result["overhead_vs_plain"] = (med["every=1"] - bare) / plain_over if plain_over > 0 else math.nan
    return result


def median_interval(values: List[float], level: float = 0.95) -> Tuple[float, float]:
    """A distribution-free ``level`` confidence interval of the median of ``values``: the order
    statistics ``x_(k)`` and ``x_(n+1-k)`` with the largest ``k`` such that a Binomial(n, 1/2)
    falls below ``k`` with probability at most ``(1 - level) / 2`` (the whole range when ``n``
    is too small for any: fewer than 6 values at 95 %)."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return (math.nan, math.nan)
    tail, k = (1.0 - level) / 2, 0
    below = 0.0  # P(Bin(n, 1/2) < k + 1)
    for j in range(n):
        below += math.comb(n, j) / 2.0**n
        if below > tail:
            break
        k = j + 1
    k = max(k, 1)
    return (xs[k - 1], xs[n - k])


def print_result(res: Dict[str, Any]) -> None:
    print(f"\n{res['description']}\nforward + backward, {res['rounds']} interleaved rounds, "
          f"torch threads {res['threads']}, {res['clock']} time")
    print(f"bare step {res['bare_gflop']:.2f} GFLOP; floor = 1 + the FLOPs of the products probe cannot avoid "
          "over the bare step's (see Floor); to floor = x bare - floor")
    print(f"{'arm':<22}{'median ms':>12}{'x bare':>10}{'paired':>10}{'paired 95 %':>16}{'floor':>9}{'to floor':>10}")
    for name, ms in res["median_ms"].items():
        fl = res["floor"].get(name)
        tail = f"{fl:>9.3f}{res['ratio'][name] - fl:>+10.3f}" if fl is not None else f"{'-':>9}{'-':>10}"
        lo, hi = res["paired_ci"][name]
        print(f"{name:<22}{ms:>12.1f}{res['ratio'][name]:>10.3f}{res['paired'][name]:>10.3f}"
              f"{f'{lo:.3f}-{hi:.3f}':>16}{tail}")
    print("paired 95 %: a distribution-free interval of the paired median (order statistics of the rounds)")
    if "one_model_unsampled_ms" in res:
        print(f"one-model: paired = its sampled step over its own unsampled step "
              f"({res['one_model_unsampled_ms']:.1f} ms), on the same copy of the model")
    if "overhead_vs_plain" in res:
        print(f"probe overhead / plain overhead (every=1): {res['overhead_vs_plain']:.3f}")
    if res["close_s"] is not None:
        print(f"close() after {res['close_steps']} probed TensorBoard steps: {res['close_s']:.2f} s")
    if res.get("close_before_s") is not None:
        print(f"before: close() after {res['close_steps']} probed TensorBoard steps: {res['close_before_s']:.2f} s")


class _OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while active (forward and, on CPUs, the backward,
    which runs on the calling thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def op_counts(workload: str, seq: int = 0, batch: int = 0, module: Any = probe) -> Dict[str, float]:
    """Torch operations per step: bare, probed with ``every=1`` (default ``rows``), and what probe
    adds per attention call, counted (no clock: the same on every machine). Each operation costs
    the dispatcher and Python a few microseconds however small its tensor, so this is the Python
    overhead of a probed call in the units that bound it."""
    w = build(workload, seq, batch)

    def count() -> int:
        w.step(w.model)  # warm: first-call paths (plans, provenance) are not the steady state
        with _OpCounter() as counter:
            w.step(w.model)
        return counter.count

    bare = count()
    p = module.watch(w.model, every=1)
    try:
        probed = count()
        calls = len(p.summary().sites)  # one call per site and step in these workloads
    finally:
        p.close()
    return {"bare": bare, "probed": probed, "added": probed - bare, "calls": calls,
            "per_call": (probed - bare) / max(1, calls)}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", default=["bert-padded", "llama-gqa"], choices=list(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="7 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seq", type=int, nargs="+", default=[0], help="sequence lengths (0: the workload's)")
    parser.add_argument("--batch", type=int, default=0, help="batch size (0: the workload's)")
    parser.add_argument("--plain", action="store_true", help="add the plain reference arm")
    parser.add_argument("--before", default=None, help="module name of another probe version to run side by side")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="time rounds by wall clock or by the process's CPU time (steadier on a shared machine)")
    parser.add_argument("--rows", type=lambda t: 0 if t == "none" else int(t), default=None,
                        help="add an every=1 arm with this rows= budget ('none': every row exact; "
                             "the every=1 arms use the default, rows=128)")
    parser.add_argument("--close", type=int, default=100, help="probed steps before timing close() (0: skip)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 is steadier on a machine shared with other jobs)")
    parser.add_argument("--only", nargs="+", default=[],
                        help="run only these probe arms (and bare), e.g. --only every=1 (each version's)")
    parser.add_argument("--ops", action="store_true",
                        help="only count the torch operations of a bare and a probed step (every=1) and exit "
                             "(with --before: that version's too)")
    parser.add_argument("--floor", action="store_true",
                        help="only print each workload's floor (rows=128, rows=None; every=1, every=10) and exit")
    parser.add_argument("--processes", type=int, default=1,
                        help="run the whole measurement in this many fresh processes, one after another, and "
                             "print the spread of their paired medians (a machine's state differs between "
                             "processes more than rounds within one do)")
    parser.add_argument("--one-model", action="store_true",
                        help="add the one-model arm: every=2 on one copy, each sampled step over the "
                             "unsampled step after it (no copy-to-copy placement noise)")
    args = parser.parse_args(argv)
    ONLY[:] = args.only
    ONE_MODEL[0] = args.one_model
    if args.processes > 1:
        return _across_processes(args.processes, list(sys.argv[1:] if argv is None else argv), args.json)
    if args.ops:
        versions = [("probe", probe)] + ([(args.before, importlib.import_module(args.before))] if args.before else [])
        for workload in args.workload:
            for seq in args.seq:
                for label, module in versions:
                    c = op_counts(workload, seq, args.batch, module)
                    print(f"{workload} (seq {seq or 'default'}) {label}: bare {c['bare']} ops per step, probed "
                          f"{c['probed']}: +{c['added']} ({c['per_call']:.0f} per attention call, {c['calls']} calls)")
        return 0
    if args.floor:
        for workload in args.workload:
            for seq in args.seq:
                f = Floor(workload, seq, args.batch)
                print(f"{workload} (seq {seq or 'default'}): bare {f.bare / 1e9:.2f} GFLOP; floor every=1 rows=128 "
                      f"{f.ratio(128):.3f}, rows=None {f.ratio(None):.3f}; every=10 rows=128 {f.ratio(128, 10):.4f}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
    rounds = args.rounds or (7 if args.quick else 20)
    results = []
    for workload in args.workload:
        for seq in args.seq:
            res = run_workload(workload, seq, args.batch, rounds, 2, args.plain, args.before, args.close, args.rows)
            print_result(res)
            sys.stdout.flush()
            results.append(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


def _across_processes(count: int, argv: List[str], json_path: Optional[str]) -> int:
    """Run this script ``count`` times (``argv`` without ``--processes`` and ``--json``), each in a
    fresh process writing its results to a temporary JSON file, then print per workload and arm
    the median, min and max of the processes' paired medians."""
    rest: List[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in ("--processes", "--json"):
            skip = True
            continue
        if a.startswith(("--processes=", "--json=")):
            continue
        rest.append(a)
    runs: List[List[Dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(count):
            out = os.path.join(tmp, f"run{i}.json")
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *rest, "--json", out], check=False)
            if done.returncode != 0:
                print(f"process {i + 1} of {count} failed (exit {done.returncode})", file=sys.stderr)
                return done.returncode
            with open(out) as fh:
                runs.append(json.load(fh))
    print(f"\nacross {count} processes: the paired median of each (median, min-max of the processes)")
    for index, first in enumerate(runs[0]):
        print(f"\n{first['description']}")
        print(f"{'arm':<22}{'median':>10}{'min':>9}{'max':>9}   each")
        for name in first["paired"]:
            values = [run[index]["paired"][name] for run in runs]
            each = " ".join(f"{v:.3f}" for v in values)
            print(f"{name:<22}{statistics.median(values):>10.3f}{min(values):>9.3f}{max(values):>9.3f}   {each}")
        _print_differences(first["paired"], [run[index]["paired"] for run in runs])
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(runs, fh, indent=2)
    return 0


def _print_differences(arms: Dict[str, float], per_run: List[Dict[str, float]]) -> None:
    """With ``--before``: per process, each arm's paired median minus the other version's same arm
    (the two ran interleaved in that process, so the machine's state of the moment cancels),
    with their median and mean. The spread of these, not of the arms, says whether a change
    moved the step."""
    pairs = [(name, f"before:{name}") for name in arms if f"before:{name}" in arms]
    if not pairs:
        return
    print(f"{'now - before':<22}{'median':>10}{'mean':>9}{'above 0':>9}   each")
    for name, other in pairs:
        diffs = [run[name] - run[other] for run in per_run]
        each = " ".join(f"{d:+.3f}" for d in diffs)
        above = sum(d > 0 for d in diffs)
        print(f"{name:<22}{statistics.median(diffs):>+10.3f}{statistics.mean(diffs):>+9.3f}"
              f"{f'{above}/{len(diffs)}':>9}   {each}")


if __name__ == "__main__":
    sys.exit(main())
