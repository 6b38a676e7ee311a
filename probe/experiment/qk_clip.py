"""``probe.qk_clip``: QK-Clip (Kimi K2's MuonClip) for any model, from the measured max logits.

After each optimizer step, every attention head whose max logit ``S = max σ·q·kᵀ`` exceeded ``τ``
on that step has its query and key weights scaled so that its logits are multiplied by
``τ / S`` (√(τ/S) on each side; see :mod:`probe.experiment.clip_rule` for grouped kv heads). The
max logits are measured on every training forward (one ``q·kᵀ`` per attention call, no
exponential); which weights a head's q and k come from is traced from the model's own forward
(:mod:`probe.capture.provenance`), and a site whose path is not known exactly is refused by
name, never clipped on a guess. docs/qk_clip.md has the rule for each layout.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from probe.session.profiler import Probe

__all__ = ["qk_clip"]


def qk_clip(model: nn.Module, tau: float = 100.0, logdir: Any = None, every: Optional[int] = None,
            **options: Any) -> Probe:
    """Clip ``model``'s attention logits at ``tau`` after every optimizer step (QK-Clip).

    The same as ``probe.watch(model, logdir, every=every, qk_clip=tau, **options)``: with
    ``every=None`` (default) probe measures only the max logits (every training forward) and
    records what the clip did: per site and head ``qk_clip_logit`` (S), ``qk_clip_factor``
    (γ = min(1, τ/S)) and ``qk_clip_steps`` (steps clipped); ``every=N`` also takes probe's full
    statistics on every N-th step. ``summary().info(site)["qk_clip"]`` says which weights a site
    scales, or why it is refused.

    Args:
        model: the model being trained (its root forward is one training step's forward).
        tau: the cap τ on each head's max logit (Kimi K2 uses 100).
        logdir: a directory or ``SummaryWriter`` for the records (TensorBoard, ``probe_summary.json``).
        every: also probe every N-th step fully; ``None``: the max logits only.
        **options: other :func:`probe.watch` options (``sites=`` restricts the clip as well).

    Example:
        >>> clip = probe.qk_clip(model, tau=100.0)
        >>> for batch in loader:
        ...     model(**batch).loss.backward()
        ...     optimizer.step()          # the clip runs right after, from this step's max logits
        ...     optimizer.zero_grad()
        >>> clip.close()
    """
    return Probe(model, logdir, every, qk_clip=tau, **options)
