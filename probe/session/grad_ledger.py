"""Every gradient metric accounted for: hooked and arrived, or named with the reason it did not.

On a sampled step each call registers backward hooks (:class:`probe.capture.grads.BackwardHooks`)
for ``grad_logits`` (on its output or softmax output) and ``grad_q``, ``grad_k``, ``grad_v`` (on the
model's own q, k, v), or says why one cannot be hooked (``last_plan``: a tensor that does not
require grad, q and k one tensor, logits that cannot be rebuilt, an unverified site). A call that
ran under ``no_grad`` inside a training forward (reentrant activation checkpointing) waits for its
recomputation in the backward. :class:`GradLedger` keeps, per site and step, what was planned and
what arrived, and knows whether a backward ran at all (a hook on the root forward's outputs).

When a sampled step is over (the next step begins and its hooks go, :meth:`GradHooks.next_step
<probe.session.grad_hooks.GradHooks.next_step>`, or the probe closes) and its backward ran,
each gradient metric that did not arrive at a site gets its reason (``info["not_measured"]``)
and one ``UserWarning`` per reason names the sites and metrics: the plan's reason, a
recomputation probe did not see, or a hook the backward never reached. A step without a backward
(inference, evaluation) warns about nothing: its gradient metrics are simply absent.
"""

from __future__ import annotations

import warnings
from typing import Dict, Hashable, List, Optional, Set, Tuple

__all__ = ["GRADS", "GradLedger"]

#: The gradient metrics, by the name the hooks use.
GRADS = ("logits", "q", "k", "v")

_RECOMPUTE = ("it ran under torch.no_grad inside a training forward and probe saw no recomputation of it in the "
              "backward: a frozen block (no gradient flows there), or reentrant activation checkpointing "
              "(use_reentrant=True) of a function rather than a module's forward "
              "(checkpoint(F.scaled_dot_product_attention, ...): checkpoint the module that calls it, or use "
              "use_reentrant=False)")
_UNREACHED = "the backward did not reach its hook (its output does not take part in the loss)"
#: A hook that ran and whose reduction failed: its own warning said so.
FAILED = "its gradient reached probe but the reduction failed (warned when it happened)"


class GradLedger:
    """What each site's backward should give and what it gave (module docstring)."""

    def __init__(self) -> None:
        self._plans: Dict[int, Dict[Hashable, Dict[str, Optional[str]]]] = {}  # step -> key -> name -> why not
        self._arrived: Dict[int, Set[Tuple[Hashable, str]]] = {}
        self._backward: Set[int] = set()
        self._reached: Set[Tuple[int, Hashable, str]] = set()
        self.reasons: Dict[Hashable, Dict[str, str]] = {}  # key -> grad metric -> why it is not measured
        self._measured: Set[Tuple[Hashable, str]] = set()
        self._warned: Set[str] = set()
        self.quiet: Set[str] = {FAILED}  # reasons another warning already says

    def planned(self, key: Hashable, step: int, plan: Dict[str, Optional[str]]) -> None:
        """A call of ``key`` on ``step`` hooked the names whose plan is ``None``; the others say
        why not. Several calls of one site: a hook wins over a reason."""
        entry = self._plans.setdefault(step, {}).setdefault(key, {})
        for name, why in plan.items():
            if why is None or entry.get(name, "") is not None:
                entry[name] = why

    def deferred(self, key: Hashable, step: int) -> None:
        """A call of ``key`` ran under ``no_grad`` in a training forward: its hooks come with its
        recomputation, if probe sees it."""
        entry = self._plans.setdefault(step, {}).setdefault(key, {})
        for name in GRADS:
            entry.setdefault(name, _RECOMPUTE)

    def arrived(self, key: Hashable, step: int, names: List[str]) -> None:
        """The backward of ``step`` gave these gradient metrics at ``key``."""
        self._backward.add(step)
        for name in names:
            self._arrived.setdefault(step, set()).add((key, name))
            self._measured.add((key, name))
            self.reasons.get(key, {}).pop(f"grad_{name}", None)

    def reached(self, key: Hashable, step: int, name: str) -> None:
        """A hook of ``key`` on ``step`` received its gradient (its reduction may still fail)."""
        self._backward.add(step)
        self._reached.add((step, key, name))

    def backward_ran(self, step: int) -> None:
        """A backward pass went through the root forward's outputs of ``step``."""
        self._backward.add(step)

    def backward_seen(self, step: int) -> bool:
        """Whether a backward pass reached ``step``'s outputs or hooks."""
        return step in self._backward

    def settle(self, final: bool, sites: Dict[Hashable, str], steps: Optional[Set[int]] = None) -> None:
        """Name what did not arrive. ``final``: the steps are over (the next step began, or the
        probe closes): warn once per reason and forget them; otherwise (a summary read) only
        update the reasons. ``sites``: key -> site name, for the warnings. ``steps``: only these
        (``None``: every step)."""
        missing: Dict[str, List[Tuple[str, str]]] = {}
        for step, plans in list(self._plans.items()):
            if steps is not None and step not in steps:
                continue
            if step not in self._backward:
                if final:
                    del self._plans[step]
                continue
            arrived = self._arrived.get(step, set())
            for key, plan in plans.items():
                for name in GRADS:
                    if (key, name) in arrived or (key, name) in self._measured or name not in plan:
                        continue
                    why = plan[name] if plan[name] is not None else (
                        FAILED if (step, key, name) in self._reached else _UNREACHED)
                    self.reasons.setdefault(key, {})[f"grad_{name}"] = why
                    missing.setdefault(why, []).append((sites.get(key, str(key)), f"grad_{name}"))
            if final:
                del self._plans[step]
                self._arrived.pop(step, None)
        if final:
            if steps is None:
                self._backward.clear()
                self._reached.clear()
            else:
                self._backward -= steps
                self._reached = {r for r in self._reached if r[0] not in steps}
            for why, where in missing.items():
                if why in self._warned or why in self.quiet:
                    continue
                self._warned.add(why)
                warnings.warn(_message(why, where), UserWarning, stacklevel=4)


def _message(why: str, where: List[Tuple[str, str]]) -> str:
    by_site: Dict[str, List[str]] = {}
    for site, metric in where:
        if metric not in by_site.setdefault(site, []):
            by_site[site].append(metric)
    groups: Dict[Tuple[str, ...], List[str]] = {}
    for site, metrics in by_site.items():
        groups.setdefault(tuple(metrics), []).append(site)
    parts = []
    for metrics, sites in groups.items():
        shown = ", ".join(repr(s) for s in sites[:4]) + (f" and {len(sites) - 4} more" if len(sites) > 4 else "")
        parts.append(f"{', '.join(metrics)} at {len(sites)} site(s) ({shown})")
    return f"probe: gradient metrics NOT measured after a sampled backward: {'; '.join(parts)}: {why}"
