"""What is known about one site (``summary.info(site)``), and the calls a site cannot mix."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from probe.call import AttentionCall

__all__ = ["SiteInfo", "SiteKey", "changed_heads", "kv_fields_that_differ"]

SiteKey = Tuple[str, int]  # (module name, call index within one invocation)


@dataclasses.dataclass
class SiteInfo:
    """What is known about one site (reported as ``summary.info(site)``).

    Attributes:
        kind: the front end that made its records.
        heads, kv_heads, d_k: its shapes.
        scale: the actual scale as a float (``None`` when per head or not recovered).
        calls: how many calls were recorded.
        softcap: the logit soft cap, when the site has one.
        rows: a note when query rows were sampled (``rows=``).
        sampled: ``[rows, length]`` of the longest sampled call: its exponential metrics are
            estimates from ``rows`` of ``length`` query rows (``None``: every call exact).
        grad_kv_heads: values of ``grad_k``/``grad_v`` (kv heads), once a backward was seen.
        scale_from: where the scale came from (a call's ``scale=``, SDPA's default, a factor on q
            or k before the product: see ``AttentionCall.scale_from``).
        scale_unknown: why the scale could not be attributed (``AttentionCall.scale_unknown``):
            the site is measured at ``actual`` only and ``scale`` is ``None``.
        qk_clip: what QK-Clip scales at this site, or why it refuses it (``qk_clip=``).
    """

    kind: str
    heads: int
    kv_heads: int
    d_k: int
    scale: Optional[float] = None
    calls: int = 0
    softcap: Optional[float] = None
    rows: Optional[str] = None
    sampled: Optional[List[int]] = None
    grad_kv_heads: Optional[int] = None
    scale_from: Optional[str] = None
    scale_unknown: Optional[str] = None
    qk_clip: Optional[str] = None
    verified: Optional[bool] = None
    verification: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form (optional fields only when set)."""
        out: Dict[str, Any] = {"kind": self.kind, "heads": self.heads, "kv_heads": self.kv_heads,
                               "d_k": self.d_k, "scale": self.scale, "calls": self.calls}
        for name in ("softcap", "rows", "sampled", "grad_kv_heads", "scale_from", "scale_unknown", "qk_clip"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.verification is not None:
            out["verified"], out["verification"] = self.verified, self.verification
        return out


def changed_heads(info: Optional[SiteInfo], call: AttentionCall) -> Optional[str]:
    """Why ``call`` cannot be measured with its site's earlier calls (``None``: it can): its
    statistics are per query head, and one site's state cannot mix head counts (the merge would
    raise, inside the model's forward or in ``summary()``). Another number of kv heads is fine
    here (transformers repeats k for a masked grouped-query call, not for an unmasked one): only
    ``grad_k`` and ``grad_v`` are per kv head (:func:`kv_fields_that_differ`)."""
    if info is None or call.heads == info.heads:
        return None
    return (f"probe: a call at site {call.site!r} has {call.heads} heads where its earlier calls had {info.heads}: "
            "it is NOT measured (one site's per-head statistics cannot mix head counts); please report the model")


def kv_fields_that_differ(info: Optional[SiteInfo], fields: Dict[str, Any]) -> List[str]:
    """The per-kv-head gradient fields (``grad_k_sq``, ``grad_v_sq``) of one call whose length is
    not its site's kv heads (a grouped-query site whose k is repeated to the query heads on some
    calls only): they cannot join the site's state."""
    if info is None:
        return []
    return [name for name in ("grad_k_sq", "grad_v_sq") if name in fields
            and tuple(fields[name].shape) != (info.kv_heads,)]
