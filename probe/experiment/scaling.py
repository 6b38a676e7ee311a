"""Scale interventions: :func:`probe.scaling`, and the mode that applies overrides.

An intervention changes what attention computes: :func:`scaling` overrides the scale for a
``with`` block, :mod:`probe.variants` installs learnable per-head scales and biases. Both only
*register* an override in :mod:`probe.experiment.overrides` (a :class:`Scaling` is a scale rule) and make
sure a capture front end applies it: the front ends look overrides up and apply them in their
own files (``probe/capture/sdpa.py``, ``mha.py``, ``eager.py``).

Who applies it: on a probe's sampled step, the probe's own capture mode (its front ends record
the overridden scale as ``actual``); otherwise an :class:`InterventionMode`, a capture mode that
records nothing, entered by the ``with`` block (or by a variant module's pre-hook). The
ordering pitfall this design avoids: probe's capture mode is entered at each sampled root
forward, so it is the innermost TorchFunctionMode and sees an attention call *before* a mode
entered earlier (``with probe.scaling(...)`` around the forward); the capturing front end
applies the override itself and runs the changed call flagged (:func:`probe.experiment.overrides.applying`),
so the outer mode passes it through. An intervention mode that sees a call *first* (a variant's,
entered in the attention module's own pre-hook) leaves it to a recording capture mode below it
(see :meth:`probe.capture.mode.CaptureMode.consults_overrides`). See docs/architecture.md.
"""

from __future__ import annotations

import contextvars
import fnmatch
import math
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple, Union

import torch
from torch import Tensor, nn

from probe.capture.mode import CaptureMode
from probe.capture.registry import default_frontends
from probe.capture.sites import SiteStack, SitesFilter, site_filter, site_names
from probe.errors import ProbeError
from probe.once import WarnOnce
from probe.experiment.overrides import ModuleOverride, active, push_module_override, push_rule, reset_module_override, reset_rule

__all__ = [
    "InterventionMode",
    "ModuleOverride",
    "Scaling",
    "ScaleSpec",
    "SiteStack",
    "active",
    "modules_by_site",
    "push_module_override",
    "reset_module_override",
    "scaling",
]

#: What ``probe.scaling`` accepts for one site: a name, a float, or a 1-D tensor (one per head).
ScaleSpec = Union[str, float, int, Tensor]

_NAMES = ("actual", "unscaled", "standard")


def modules_by_site(root: nn.Module) -> Dict[str, nn.Module]:
    """Site name → module, with probe's naming (``root`` is ``root`` itself; the outermost module
    wins when a wrapper and the module it wraps share a name)."""
    out: Dict[str, nn.Module] = {"root": root}
    by_id = {id(m): m for m in root.modules()}
    for module_id, name in site_names(root).items():
        out.setdefault(name, by_id[module_id])
    return out


# -- probe.scaling -----------------------------------------------------------------------------
def parse_spec(value: Any, what: str) -> Union[None, str, float, Tensor]:
    """Validate one scale: ``None`` for "actual", "standard", a float >= 0, or a float64 tensor."""
    expected = ("'unscaled', 'standard', 'actual', a finite float >= 0 or a 1-D tensor of "
                "per-head scales")
    if isinstance(value, str):
        if value not in _NAMES:
            raise ProbeError(f"expected `{what}` to be {expected}, got {value!r}")
        return None if value == "actual" else (1.0 if value == "unscaled" else "standard")
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.numel() == 0 or value.is_complex():
            raise ProbeError(f"expected `{what}` to be {expected}, got a tensor of shape {tuple(value.shape)}")
        host = value.detach().to("cpu", torch.float64)
        if not bool(torch.isfinite(host).all()) or bool((host < 0).any()):
            raise ProbeError(f"expected `{what}` to hold finite scales >= 0, got {host.tolist()}")
        return host
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise ProbeError(f"expected `{what}` to be {expected}, got {value!r}")
        return float(value)
    raise ProbeError(f"expected `{what}` to be {expected}, got {type(value).__name__}")


class Scaling:
    """Context manager: attention of ``model`` runs at another scale; see :func:`scaling`."""

    def __init__(self, model: nn.Module, scale: Union[ScaleSpec, Mapping[str, ScaleSpec]],
                 sites: SitesFilter = None) -> None:
        if not isinstance(model, nn.Module):
            raise ProbeError(f"expected `model` to be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self._rules: List[Tuple[str, Union[None, str, float, Tensor]]] = []
        if isinstance(scale, Mapping):
            if sites is not None:
                raise ProbeError("expected either a dict `scale` (site -> scale) or `sites=`, got both")
            if not scale:
                raise ProbeError("expected `scale` to be a non-empty dict of site -> scale, got {}")
            for pattern, value in scale.items():
                if not isinstance(pattern, str) or not pattern:
                    raise ProbeError(f"expected the keys of `scale` to be site names or globs, got {pattern!r}")
                self._rules.append((pattern, parse_spec(value, f"scale[{pattern!r}]")))
            self._site_ok: Optional[Callable[[str], bool]] = None
        else:
            self._default = parse_spec(scale, "scale")
            self._site_ok = site_filter(sites)
        self._is_dict = isinstance(scale, Mapping)
        self._sites_arg = sites
        self._stack = SiteStack(model)
        self._mode: Optional[InterventionMode] = None
        self._token: Optional[contextvars.Token] = None
        self._on_device: Dict[Tuple[torch.device, torch.dtype], Tensor] = {}
        self._seen: Set[str] = set()
        self._matched: Set[str] = set()
        self._left = WarnOnce()  # eager sites left unchanged (soft cap, unknown scale)

    # the ScaleRule of probe.experiment.overrides: called by lookup, once per attention call while active
    def resolve(self, heads: int, d_k: int, like: Tensor) -> Tuple[Optional[str], Union[None, float, Tensor]]:
        """(site, scale) for the next attention call; site ``None``: not this model's call;
        scale ``None``: unchanged.

        A per-head tensor comes back on ``like``'s device and dtype (copied once per device).
        """
        if not self._stack.root_running:
            return None, None
        name, index = self._stack.next_site()
        names = (name, f"{name}#{index + 1}")
        self._seen.add(name)
        spec: Union[None, str, float, Tensor] = None
        if self._is_dict:
            match = next((r for r in self._rules if r[0] in names), None)
            if match is None:
                match = next((r for r in self._rules if any(fnmatch.fnmatchcase(n, r[0]) for n in names)), None)
            if match is None:
                return name, None
            self._matched.add(match[0])
            spec = match[1]
        else:
            if self._site_ok is not None and not any(self._site_ok(n) for n in names):
                return name, None
            self._matched.add("*")
            spec = self._default
        if spec == "standard":
            return name, 1.0 / math.sqrt(d_k)  # SDPA's own default expression
        if isinstance(spec, Tensor) and spec.numel() != heads:
            raise ProbeError(
                f"expected `scale` to hold one value per head of site {name!r} ({heads}), got {spec.numel()}"
            )
        if isinstance(spec, Tensor):
            key = (like.device, like.dtype)
            if key not in self._on_device:
                self._on_device[key] = spec.to(device=like.device, dtype=like.dtype)
            return name, self._on_device[key]
        return name, None if isinstance(spec, str) else spec

    def left_unchanged(self, site: str) -> None:
        self._left(site, f"probe.scaling: eager attention at site {site!r} has a soft cap or an op probe cannot "
                   "describe between q·kᵀ and the softmax; it runs at its own scale (NOT rewritten)", stacklevel=5)

    def __enter__(self) -> "Scaling":
        self._stack.activate()  # the root is not running yet: calls before it belong to no site
        self._token = push_rule(self)
        self._mode = InterventionMode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mode is not None:
                mode, self._mode = self._mode, None
                mode.__exit__(None, None, None)
        finally:
            if self._token is not None:
                reset_rule(self._token)
                self._token = None
            self._stack.deactivate()
        if exc[0] is None:
            self._warn_unmatched()

    def _warn_unmatched(self) -> None:
        if not self._seen:
            return
        if self._is_dict:
            missing = [repr(p) for p, _ in self._rules if p not in self._matched]
        else:
            missing = [] if (self._site_ok is None or self._matched) else [repr(self._sites_arg)]
        if missing:
            warnings.warn(
                f"probe.scaling: {', '.join(missing)} matched none of the attention sites seen: "
                f"{', '.join(sorted(self._seen))}",
                UserWarning,
                stacklevel=3,
            )

    def __repr__(self) -> str:
        return f"Scaling({self._rules if self._is_dict else self._default!r})"


def scaling(model: nn.Module, scale: Union[ScaleSpec, Mapping[str, ScaleSpec]], sites: SitesFilter = None) -> Scaling:
    """Run every attention call of ``model`` at another scale inside a ``with`` block.

    ``softmax(s · q·kᵀ + mask)`` is computed with ``s`` replaced: ``"unscaled"`` (s = 1, no
    divisor), ``"standard"`` (s = 1/sqrt(d_k) of each call), ``"actual"`` (unchanged), a float,
    or a 1-D tensor with one scale per query head. ``sites`` restricts it to some sites (a glob,
    a list, a predicate on the site name, as in :func:`probe.watch`); a dict ``{site: scale}``
    gives each site (name or glob; exact names win) its own. Nothing of the model is changed: no
    parameter, attribute or hook; on exit it computes what it did before.

    A probe attached to the model reports the overridden scale as ``actual`` (and ``unscaled``,
    ``standard`` stay counterfactuals of the same q, k).

    Pitfalls: a per-head scale is applied by multiplying q per head (SDPA takes one float), so
    it matches a per-head SDPA call to rounding, not bitwise. A model whose own scale is applied
    outside the attention call (q pre-multiplied) is scaled again on top. Overrides reach SDPA
    calls and ``nn.MultiheadAttention`` calls (:func:`probe.capture.mha.lookup_mha`; they run as probe's mirror of
    ``F.multi_head_attention_forward``) and eager attention (a softmax over ``q·kᵀ`` that
    probe's eager front end recognises, :func:`probe.capture.eager_scores.rescaled`: the softmax input ``Z`` runs as
    ``Z + (s' - s)·q·kᵀ``, with ``q`` before any pre-scaling, which counts in ``s``); an eager
    site with a soft cap or an op probe cannot describe runs unchanged, with one warning naming
    it. Calls outside the model's forward are untouched.

    Example:
        >>> with probe.scaling(model, "unscaled", sites="*.self"):
        ...     loss = model(**batch).loss

    Raises:
        ProbeError: an unknown scale name, a negative / NaN / infinite scale, a tensor that is
            not 1-D, or (during the forward) a tensor whose length is not the site's head count.
    """
    return Scaling(model, scale, sites)


# -- applying overrides --------------------------------------------------------------------------
class InterventionMode(CaptureMode):
    """A capture mode that records nothing: its front ends (those that apply overrides) apply
    the registered overrides to the calls no recording capture mode handles (no probe attached,
    or an unsampled step). See :class:`~probe.capture.mode.CaptureMode` for when it steps aside.
    """

    def __init__(self) -> None:
        super().__init__([f for f in default_frontends() if f.applies_overrides], None)
