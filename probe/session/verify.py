"""Verify, don't assume: each site's reconstruction checked against what the model computed.

probe measures an attention call from its record (q, k, scale, bias, mask, causal, softcap), so a
record that misdescribes the model's computation (an op the capture did not model, a mask read
the wrong way) would be measured exactly and reported wrongly. :class:`Verifier` compares the
record with the model's own result on a few query rows (:mod:`probe.stats.verify`):

* eager attention: the softmax output the model produced (``AttentionCall.probs``);
* SDPA, ``nn.MultiheadAttention``, FlexAttention: the call's own output against ``P·v``; when
  the output carries attention dropout, the model's function run again without it on those rows
  (``AttentionCall.rerun``).

When: the first call of every site (:data:`CHECK_ROWS` rows, then the verdict is read at once),
then every :data:`CHECK_EVERY`-th call of the site (:data:`LATER_ROWS` rows; on a CUDA GPU its
verdict is copied to the host without waiting and read at a later call or summary; this path is
not exercised by the CPU test suite). A site whose check fails is
*unverified* from then on, with one warning naming it and the size of the mismatch: its
``entropy``, ``max_prob`` and ``saturation`` at ``actual`` come from the model's own
probabilities where it has them (eager attention), and every logit-based value, every
counterfactual scale and ``grad_logits`` are not measured (``grad_q``, ``grad_k``, ``grad_v`` are
the model's own gradients and stay). A call the check cannot read (no output: a fused kernel
measured from the module's weights; probabilities changed in place after the softmax) is
*unchecked*, with the reason in the site's info.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, Hashable, List, Optional, Tuple

import torch
from torch import Tensor

from probe.call import AttentionCall
from probe.stats.verify import (check_positions, check_shape, masked_in_effect, output_distance, probs_distance,
                                probs_fields)

__all__ = ["CHECK_EVERY", "CHECK_ROWS", "LATER_ROWS", "Verdict", "Verifier", "probs_view"]

#: Query rows of a site's first check.
CHECK_ROWS = 8
#: Query rows of the later checks.
LATER_ROWS = 2
#: A site's calls from one later check to the next.
CHECK_EVERY = 32

VERIFIED, MISMATCH, UNCHECKED = "verified", "mismatch", "unchecked"


@dataclasses.dataclass
class Verdict:
    """The last word on one site's reconstruction.

    Attributes:
        status: ``"verified"``, ``"mismatch"`` (the site is unverified) or ``"unchecked"``.
        against: what the record was compared with (``"the softmax output"``, ...).
        distance, tolerance: the largest distance found and the tolerance it was held to.
        rows: how many query rows (of how many batch entries) the check read.
        step: the step of the check that decided it.
        reason: why it could not be checked (``"unchecked"``).
        checks: how many checks ran at this site.
    """

    status: str
    against: str = ""
    distance: float = 0.0
    tolerance: float = 0.0
    rows: str = ""
    step: int = 0
    reason: str = ""
    checks: int = 0

    @property
    def ok(self) -> bool:
        return self.status != MISMATCH

    def info(self) -> Dict[str, Any]:
        """``info["verified"]`` (True, False, or None when it could not be checked) and
        ``info["verification"]``, in words."""
        if self.status == UNCHECKED:
            return {"verified": None, "verification": f"not checked: {self.reason}"}
        text = (f"{self.against}, {self.rows}: distance {self.distance:.2g} "
                f"{'<=' if self.status == VERIFIED else '>'} tolerance {self.tolerance:.2g}")
        if self.status == MISMATCH:
            text += f" (step {self.step})"
        return {"verified": self.status == VERIFIED, "verification": text}


def probs_view(call: AttentionCall) -> Optional[Tensor]:
    """The model's softmax output as ``(B, H, L, S)`` without a copy, ``None`` when it has no such
    view (the backward reads it in the same element order: ``reshape(B, H, L, S)``)."""
    probs = call.probs
    if probs is None:
        return None
    shape = (call.q.shape[0], call.q.shape[1], call.q.shape[2], call.k.shape[2])
    if probs.numel() != shape[0] * shape[1] * shape[2] * shape[3]:
        return None
    try:
        return probs.detach().view(shape)
    except RuntimeError:
        return None


class Verifier:
    """Runs the checks of one probe and keeps each site's :class:`Verdict` (module docstring).

    Args:
        budget_bytes: memory a check may use (``memory_budget``).
        warn: ``warn(site, message)``, once per site.
    """

    def __init__(self, budget_bytes: int, warn: Any) -> None:
        self.budget_bytes = budget_bytes
        self._warn = warn
        self.verdicts: Dict[Hashable, Verdict] = {}
        self._calls: Dict[Hashable, int] = {}
        self._pending: List[Tuple[Hashable, str, int, Tensor, Any, str, str]] = []

    def verify(self, key: Hashable, call: AttentionCall, step: int) -> Optional[Verdict]:
        """Check ``call`` (site key ``key``) when it is due; returns the site's verdict."""
        self.resolve()
        n = self._calls.get(key, 0)
        self._calls[key] = n + 1
        verdict = self.verdicts.get(key)
        if verdict is not None and (verdict.status == MISMATCH or n % CHECK_EVERY):
            return verdict
        first = verdict is None or verdict.status == UNCHECKED
        try:
            result = self._check(call, CHECK_ROWS if first else LATER_ROWS)
        except Exception as err:  # noqa: BLE001 - a diagnostic never breaks the model
            result = f"the check failed ({type(err).__name__}: {err})"
        if isinstance(result, str):
            if verdict is None or verdict.status == UNCHECKED:
                verdict = self.verdicts[key] = Verdict(UNCHECKED, reason=result, step=step,
                                                       checks=(verdict.checks if verdict else 0))
            return verdict
        distance, tolerance, against, rows = result
        if call.bias is not None and first:
            hidden = int(masked_in_effect(call, *self._rows(call, CHECK_ROWS)))
            if hidden:  # P matches, but the valid keys (entropy's normalization) would not
                self._decide(key, call.site, step, float("inf"), float(tolerance),
                             f"{hidden} key(s) masked in effect (a bias at least 100 below the row's largest: a -100 "
                             "mask added to a positive bias) counted as valid", rows)
                return self.verdicts[key]
        if first or distance.device.type != "cuda":
            self._decide(key, call.site, step, float(distance), float(tolerance), against, rows)
        else:  # a later check on a GPU: copied without waiting, read at a later call
            host = torch.empty(2, dtype=torch.float64, pin_memory=True)
            host.copy_(torch.stack([distance, tolerance]).to(torch.float64), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((key, call.site, step, host, event, against, rows))
        return self.verdicts[key]

    def _rows(self, call: AttentionCall, rows: int) -> Tuple[int, Tensor]:
        entries, n = check_shape(call, rows, self.budget_bytes // 4)
        return entries, check_positions(call.q.shape[2], n, call.q.device)

    def _check(self, call: AttentionCall, rows: int) -> Any:
        """``(distance, tolerance, against, rows)`` as 0-d tensors and words, or why not checked."""
        entries, pos = self._rows(call, rows)
        where = f"{pos.numel()} row(s) of {entries} batch entr{'y' if entries == 1 else 'ies'}"
        if call.probs is not None:
            if call.probs._version != 0:
                return "the probabilities were changed in place after the softmax"
            probs = probs_view(call)
            if probs is None:
                return "the softmax output has no (B, H, L, S) view"
            return (*probs_distance(call, probs, entries, pos), "the softmax output", where)
        if call.v is None:
            return "no output to compare (measured from the module's weights)"
        if call.rerun is not None:
            with torch.no_grad():
                rerun = call.rerun(entries, pos)
            return (*output_distance(call, rerun, entries, pos, rows_only=True),
                    "its own function without dropout, against P·v", where)
        if call.output is None or call.output.shape[:3] != call.q.shape[:3]:
            return "no output to compare"
        return (*output_distance(call, call.output.detach(), entries, pos), "its output, against P·v", where)

    def _decide(self, key: Hashable, site: str, step: int, distance: float, tolerance: float, against: str,
                rows: str) -> None:
        old = self.verdicts.get(key)
        checks = (old.checks if old else 0) + 1
        if distance <= tolerance:
            if old is None or old.status != MISMATCH:
                self.verdicts[key] = Verdict(VERIFIED, against, max(distance, old.distance if old and old.status ==
                                                                    VERIFIED else 0.0), tolerance, rows, step,
                                             checks=checks)
            return
        was_verified = old is not None and old.status == VERIFIED
        self.verdicts[key] = Verdict(MISMATCH, against, distance, tolerance, rows, step, checks=checks)
        since = f" from step {step} on (earlier steps were checked)" if was_verified else ""
        self._warn(site, (
            f"probe: the attention at site {site!r} is UNVERIFIED{since}: probe's reconstruction (q, k, scale, "
            f"bias, mask, softcap) does not match what the model computed ({against}, {rows}: distance "
            f"{distance:.3g}, tolerance {tolerance:.2g}). Reported there: entropy, max_prob and saturation at "
            "`actual` from the model's own probabilities where it has them (eager attention); logit_var, "
            "logit_max, nonfinite, every other scale and grad_logits are not measured. Please report the model "
            "(probe.coverage(model, ...) lists the site; see docs/models.md)."))

    def resolve(self, wait: bool = False) -> None:
        """Read the verdicts of later checks whose copies have arrived (all of them with ``wait``)."""
        still = []
        for key, site, step, host, event, against, rows in self._pending:
            if not wait and not event.query():
                still.append((key, site, step, host, event, against, rows))
                continue
            event.synchronize()
            self._decide(key, site, step, float(host[0]), float(host[1]), against, rows)
        self._pending = still

    def unverified(self, key: Hashable) -> bool:
        verdict = self.verdicts.get(key)
        return verdict is not None and verdict.status == MISMATCH

    def fallback_fields(self, call: AttentionCall, saturation: float) -> Dict[str, Tensor]:
        """The forward fields of an unverified call: ``entropy``, ``max_prob``, ``saturation`` at
        ``actual`` from the model's own probabilities (eager); otherwise only the row count."""
        probs = probs_view(call)
        if probs is None and call.probs is not None and call.probs.numel() == call.q.shape[0] * call.q.shape[1] * \
                call.q.shape[2] * call.k.shape[2]:
            probs = call.probs.detach().reshape(call.q.shape[0], call.q.shape[1], call.q.shape[2], call.k.shape[2])
        if probs is not None:
            return probs_fields(probs, saturation, self.budget_bytes)
        return {"rows": torch.zeros(call.heads, dtype=torch.float64 if call.q.device.type != "mps" else torch.float32,
                                    device=call.q.device)}


def warn_once_per_site() -> Any:
    """A ``warn(site, message)`` that warns once per site (``UserWarning``)."""
    seen = set()

    def warn(site: str, message: str) -> None:
        if site not in seen:
            seen.add(site)
            warnings.warn(message, UserWarning, stacklevel=4)

    return warn
