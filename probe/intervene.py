"""Scale interventions: :func:`probe.scaling` and the one hook point front ends consult.

An intervention changes what attention computes: :func:`scaling` overrides the scale for a
``with`` block, :mod:`probe.variants` installs learnable per-head scales and biases. Both are
*registered* here (context variables), and one function, :func:`sdpa_change`, turns an
``F.scaled_dot_product_attention`` call into the call to run instead (:func:`mha_change` does the
same for ``F.multi_head_attention_forward`` under ``probe.scaling``, :func:`eager_scale` gives
the scale of an eager softmax over ``q·kᵀ``). Two things consult it:

- probe's SDPA front end (:mod:`probe.capture.sdpa`), while a probe captures a sampled step, so
  the recorded :class:`~probe.call.AttentionCall` carries the overridden scale as ``actual``;
- :class:`InterventionMode`, a TorchFunctionMode that applies the change when no capturing front
  end will (no probe attached, or an unsampled step).

The ordering pitfall this design avoids: probe's capture mode is entered at each sampled root
forward, so it is the innermost TorchFunctionMode and sees an SDPA call *before* a mode entered
earlier (``with probe.scaling(...)`` around the forward). Were the override applied by that
outer mode, probe would already have recorded the original scale. So the capturing front end
applies the override itself and runs the changed call with a flag set; any intervention mode
that sees the call afterwards passes it through (never applied twice). An intervention mode
that sees a call *first* (a variant's, entered in the attention module's own pre-hook) passes
it on untouched when a capture mode below it will consult the registry (see
:meth:`probe.capture.mode.CaptureMode.consults_overrides`).

Per-head scales: SDPA takes one float ``scale``, so a per-head scale ``s_h`` is applied by
scaling ``q`` per head, ``q * (s_h / s_ref)``, and calling SDPA with ``scale=s_ref``, where
``s_ref`` is the call's own scale. The factor is then exactly 1.0 when ``s_h == s_ref``
(bitwise-identical outputs); otherwise results match a per-head SDPA call to rounding.
"""

from __future__ import annotations

import contextvars
import fnmatch
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple, Union

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from probe.capture.mode import SitesFilter, in_front_end, site_filter, site_names
from probe.errors import ProbeError

__all__ = [
    "InterventionMode",
    "ModuleOverride",
    "MHAChange",
    "SDPAChange",
    "Scaling",
    "ScaleSpec",
    "SiteStack",
    "active",
    "modules_by_site",
    "push_module_override",
    "reset_module_override",
    "mha_change",
    "eager_scale",
    "scaling",
    "sdpa_change",
]

#: What ``probe.scaling`` accepts for one site: a name, a float, or a 1-D tensor (one per head).
ScaleSpec = Union[str, float, int, Tensor]

_NAMES = ("actual", "unscaled", "standard")
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MHA_PARAMS = ("query", "key", "value", "embed_dim_to_check", "num_heads")  # the leading ones we read

_SCALINGS: contextvars.ContextVar[Tuple["Scaling", ...]] = contextvars.ContextVar("probe_scalings", default=())
_MODULES: contextvars.ContextVar[Tuple["ModuleOverride", ...]] = contextvars.ContextVar("probe_module_overrides", default=())
_APPLYING: contextvars.ContextVar[bool] = contextvars.ContextVar("probe_applying", default=False)


# -- the registry ------------------------------------------------------------------------------
@dataclass
class ModuleOverride:
    """A change bound to one module, active while that module's forward runs (a variant).

    Attributes:
        module: the attention module the parameters are registered on.
        site: its qualified name (for error messages).
        scale: learnable per-head scales ``(H,)``, or ``None`` to keep the call's own scale.
        bias: learnable additive bias ``(H, max_len)`` over key positions, or ``None``.
        reference: ``s_ref``, the scale SDPA is called with when ``scale`` is per head.
    """

    module: nn.Module
    site: str
    scale: Optional[Tensor]
    bias: Optional[Tensor]
    reference: float


def push_module_override(override: ModuleOverride) -> contextvars.Token:
    """Make ``override`` the innermost module override; undo with :func:`reset_module_override`."""
    return _MODULES.set(_MODULES.get() + (override,))


def reset_module_override(token: contextvars.Token) -> None:
    _MODULES.reset(token)


def modules_by_site(root: nn.Module) -> Dict[str, nn.Module]:
    """Site name → module, with probe's naming (``root`` is ``root`` itself; the outermost module
    wins when a wrapper and the module it wraps share a name)."""
    out: Dict[str, nn.Module] = {"root": root}
    by_id = {id(m): m for m in root.modules()}
    for module_id, name in site_names(root).items():
        out.setdefault(name, by_id[module_id])
    return out


def active() -> bool:
    """Whether any intervention (a scaling context or a running variant module) is registered."""
    return bool(_SCALINGS.get()) or bool(_MODULES.get())


class SiteStack:
    """The running modules of one model, kept by global forward hooks while a context is active.

    Names sites as probe does (the qualified name of the innermost running module of the model;
    ``root`` for the model itself; a call index per module invocation), but lives across many
    root forwards: the root's call counter restarts at each root forward, and calls made while
    the root is not running (another model) belong to no site. Kept apart from probe's own
    stack so that interventions work with or without a probe, and never touch its mode.
    """

    def __init__(self, root: nn.Module) -> None:
        self._root = root
        self._names: Dict[int, str] = {}
        self._stack: List[List[Any]] = []  # [module id, name, calls issued]
        self._handles: List[RemovableHandle] = []
        self.root_running = 0

    def activate(self) -> None:
        self._names = site_names(self._root)  # probe's own naming (wrapper prefixes stripped)
        self._stack, self.root_running = [], 0
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._push),
            nn.modules.module.register_module_forward_hook(self._pop, always_call=True),
        ]

    def deactivate(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._stack, self.root_running = [], [], 0

    def _push(self, module: nn.Module, args: Any) -> None:
        if module is self._root:
            if self.root_running == 0:
                self._stack = [[id(module), "root", 0]]
            self.root_running += 1
            return
        name = self._names.get(id(module))
        if name is not None and self.root_running:
            self._stack.append([id(module), name, 0])

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if module is self._root:
            self.root_running = max(0, self.root_running - 1)
        elif len(self._stack) > 1 and self._stack[-1][0] == id(module):
            self._stack.pop()

    def next_site(self) -> Tuple[str, int]:
        """(qualified name, index of this call within the module's current invocation)."""
        top: List[Any] = self._stack[-1] if self._stack else [id(self._root), "root", 0]
        index = int(top[2])
        top[2] += 1
        return str(top[1]), index


# -- probe.scaling -----------------------------------------------------------------------------
def _parse_spec(value: Any, what: str) -> Union[None, str, float, Tensor]:
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
                self._rules.append((pattern, _parse_spec(value, f"scale[{pattern!r}]")))
            self._site_ok: Optional[Callable[[str], bool]] = None
        else:
            self._default = _parse_spec(scale, "scale")
            self._site_ok = site_filter(sites)
        self._is_dict = isinstance(scale, Mapping)
        self._sites_arg = sites
        self._stack = SiteStack(model)
        self._mode: Optional[InterventionMode] = None
        self._token: Optional[contextvars.Token] = None
        self._on_device: Dict[Tuple[torch.device, torch.dtype], Tensor] = {}
        self._seen: Set[str] = set()
        self._matched: Set[str] = set()
        self._left: Set[str] = set()  # eager sites left unchanged (soft cap, unknown scale): warned once

    # called by sdpa_change, once per attention call of the model while active
    def resolve(self, heads: int, d_k: int, like: Tensor) -> Tuple[bool, Optional[str], Union[None, float, Tensor]]:
        """(this model's call?, site, scale) for the next attention call; scale ``None``: unchanged.

        A per-head tensor comes back on ``like``'s device and dtype (copied once per device).
        """
        if not self._stack.root_running:
            return False, None, None
        name, index = self._stack.next_site()
        names = (name, f"{name}#{index + 1}")
        self._seen.add(name)
        spec: Union[None, str, float, Tensor] = None
        if self._is_dict:
            match = next((r for r in self._rules if r[0] in names), None)
            if match is None:
                match = next((r for r in self._rules if any(fnmatch.fnmatchcase(n, r[0]) for n in names)), None)
            if match is None:
                return True, name, None
            self._matched.add(match[0])
            spec = match[1]
        else:
            if self._site_ok is not None and not any(self._site_ok(n) for n in names):
                return True, name, None
            self._matched.add("*")
            spec = self._default
        if spec == "standard":
            return True, name, 1.0 / math.sqrt(d_k)  # SDPA's own default expression
        if isinstance(spec, Tensor) and spec.numel() != heads:
            raise ProbeError(
                f"expected `scale` to hold one value per head of site {name!r} ({heads}), got {spec.numel()}"
            )
        if isinstance(spec, Tensor):
            key = (like.device, like.dtype)
            if key not in self._on_device:
                self._on_device[key] = spec.to(device=like.device, dtype=like.dtype)
            return True, name, self._on_device[key]
        return True, name, None if isinstance(spec, str) else spec

    def __enter__(self) -> "Scaling":
        self._stack.activate()
        self._stack.root_running = 0
        self._token = _SCALINGS.set(_SCALINGS.get() + (self,))
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
                _SCALINGS.reset(self._token)
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
    calls and ``nn.MultiheadAttention`` calls (:func:`mha_change`; they run as probe's mirror of
    ``F.multi_head_attention_forward``) and eager attention (a softmax over ``q·kᵀ`` that
    probe's eager front end recognises, :func:`eager_scale`: the softmax input ``Z`` runs as
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


# -- the hook point ------------------------------------------------------------------------------
@dataclass
class SDPAChange:
    """An SDPA call rewritten by the active interventions.

    ``args`` / ``kwargs`` are what runs; ``record_args`` / ``record_kwargs`` describe the call as
    probe should record it: the original ``q`` and the effective ``scale`` (a float or a
    per-head tensor), with the combined mask.
    """

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    record_args: Tuple[Any, ...]
    record_kwargs: Dict[str, Any]

    def run(self, func: Callable[..., Any]) -> Any:
        """Call ``func`` on the rewritten arguments; modes below see it as already applied."""
        token = _APPLYING.set(True)
        try:
            return func(*self.args, **self.kwargs)
        finally:
            _APPLYING.reset(token)


def _per_head(value: Tensor, like: Tensor) -> Tensor:
    # (H,) -> broadcastable to q's (..., H, L, E) and to logits (..., H, L, S).
    return value.to(device=like.device, dtype=like.dtype).reshape(-1, 1, 1)


def _fold_masks(mask: Any, bias: Tensor, causal: bool, q: Tensor, k: Tensor) -> Tensor:
    """One float mask: the model's mask (bool or additive), causal, plus the variant's bias."""
    if causal:
        # SDPA forbids attn_mask with is_causal: fold top-left causal (tril) into the float mask.
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = keep if mask is None else mask
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, float("-inf"))  # a Python scalar: no host-to-device copy
    return mask + bias


def sdpa_change(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[SDPAChange]:
    """The rewrite of one SDPA call under the active interventions; ``None`` when none applies.

    Consult it exactly once per call: scaling contexts count calls to name sites. Precedence: a
    ``probe.scaling`` scale (innermost context that matches the site) replaces a variant's
    learnable scale; a variant's bias is kept under it.
    """
    if _APPLYING.get():
        return None
    scalings, modules = _SCALINGS.get(), _MODULES.get()
    if not scalings and not modules:
        return None
    bound = dict(zip(_SDPA_PARAMS, args))
    bound.update(kwargs)
    q, k = bound.get("query"), bound.get("key")
    if not isinstance(q, Tensor) or not isinstance(k, Tensor) or q.dim() < 3:
        return None
    heads = q.shape[-3] if q.dim() >= 4 else 1
    d_k = q.shape[-1]
    own = bound.get("scale")
    own_scale = 1.0 / math.sqrt(d_k) if own is None else float(own)

    new_scale: Union[None, float, Tensor] = None
    for ctx in reversed(scalings):  # every context counts this call; the innermost match wins
        _, _, value = ctx.resolve(heads, d_k, q)
        if new_scale is None and value is not None:
            new_scale = value
    variant = modules[-1] if modules else None
    bias = None
    if variant is not None:
        for t, what in ((variant.scale, "scale"), (variant.bias, "bias")):
            if t is not None and t.shape[0] != heads:
                raise ProbeError(f"variant `{what}` of site {variant.site!r} has {t.shape[0]} heads, "
                                 f"the attention call has {heads}")
        if new_scale is None and variant.scale is not None:
            new_scale = variant.scale
        if variant.bias is not None:
            keys = k.shape[-2]
            if keys > variant.bias.shape[1]:
                raise ProbeError(f"expected at most `max_len`={variant.bias.shape[1]} key positions at site "
                                 f"{variant.site!r}, got {keys}")
            bias = variant.bias[:, :keys].to(q.dtype).contiguous()[None, :, None, :]  # (1, H, 1, S); a strided mask takes another kernel path
    if new_scale is None and bias is None:
        return None

    run = dict(bound)
    record = dict(bound)
    if isinstance(new_scale, Tensor):
        reference = variant.reference if (variant is not None and new_scale is variant.scale) else own_scale
        reference = reference if reference != 0 else 1.0
        run["query"] = q * (_per_head(new_scale, q) / reference)
        if reference != own_scale:  # else keep the call's own `scale` (None stays None: same kernel path)
            run["scale"] = reference
        record["scale"] = new_scale.detach()
    elif new_scale is not None:
        run["scale"] = record["scale"] = float(new_scale)
    if bias is not None:
        mask = _fold_masks(bound.get("attn_mask"), bias, bool(bound.get("is_causal", False)), q, k)
        run["attn_mask"], run["is_causal"] = mask, False
        record["attn_mask"], record["is_causal"] = mask.detach(), False
    return SDPAChange((), run, (), record)


@dataclass
class MHAChange:
    """The verdict on one ``F.multi_head_attention_forward`` call under ``probe.scaling``.

    ``scale`` is the scale to run at (a float or a per-head tensor), ``None`` to run the call at
    its own scale. :meth:`run` runs the call with the "applied" flag set, so the SDPA call inside
    it is never rewritten again.
    """

    scale: Union[None, float, Tensor]

    def run(self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
            emit: Optional[Callable[[Any], None]] = None) -> Any:
        """``func(*args, **kwargs)`` at :attr:`scale`: probe's mirror
        (:func:`probe.capture.mha.mha_forward`) when the scale changes or ``emit`` records."""
        from probe.capture.mha import mha_forward, mirrors

        token = _APPLYING.set(True)
        try:
            if (self.scale is None and emit is None) or not mirrors(args, kwargs):
                return func(*args, **kwargs)
            return mha_forward(*args, **kwargs, emit=emit, scale_override=self.scale)
        finally:
            _APPLYING.reset(token)


def mha_change(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[MHAChange]:
    """The scale one ``F.multi_head_attention_forward`` call runs at under ``probe.scaling``.

    ``None`` when no scaling context is active (or the call is already applied); otherwise an
    :class:`MHAChange`, whose ``scale`` is ``None`` when no context matches the site. Consult it
    exactly once per call (contexts count calls to name sites), and run the call through
    :meth:`MHAChange.run`. Variants (module overrides) do not reach ``nn.MultiheadAttention``.
    """
    if _APPLYING.get():
        return None
    scalings = _SCALINGS.get()
    if not scalings:
        return None
    bound = dict(zip(_MHA_PARAMS, args))
    bound.update(kwargs)
    q, embed_dim, heads = bound.get("query"), bound.get("embed_dim_to_check"), bound.get("num_heads")
    if not isinstance(q, Tensor) or not isinstance(embed_dim, int) or not isinstance(heads, int) or heads <= 0:
        return None
    d_k = embed_dim // heads
    new_scale: Union[None, float, Tensor] = None
    for ctx in reversed(scalings):  # every context counts this call; the innermost match wins
        _, _, value = ctx.resolve(heads, d_k, q)
        if new_scale is None and value is not None:
            new_scale = value
    return MHAChange(new_scale)


def eager_scale(heads: int, d_k: int, like: Tensor, describable: bool) -> Tuple[bool, Union[None, float, Tensor]]:
    """(consulted?, scale) for one eager softmax over ``s · q·kᵀ (+ bias/mask)`` under ``probe.scaling``.

    ``consulted`` is False when no scaling context is active or the call is already applied;
    otherwise the caller runs the softmax with the "applied" flag set (consulted once). The scale
    is ``None`` when no context matches the site, or when the site is not ``describable`` (a soft
    cap, an op the eager front end cannot describe): it is then left unchanged, with one warning
    naming the site. Consult it exactly once per softmax (contexts count calls to name sites).
    """
    if _APPLYING.get():
        return False, None
    scalings = _SCALINGS.get()
    if not scalings:
        return False, None
    new_scale: Union[None, float, Tensor] = None
    owner: Optional[Tuple[Scaling, Optional[str]]] = None
    for ctx in reversed(scalings):  # every context counts this call; the innermost match wins
        _, name, value = ctx.resolve(heads, d_k, like)
        if new_scale is None and value is not None:
            new_scale, owner = value, (ctx, name)
    if new_scale is not None and not describable and owner is not None:
        ctx, name = owner
        if str(name) not in ctx._left:
            ctx._left.add(str(name))
            warnings.warn(
                f"probe.scaling: eager attention at site {name!r} has a soft cap or an op probe cannot "
                "describe between q·kᵀ and the softmax; it runs at its own scale (NOT rewritten)",
                UserWarning,
                stacklevel=4,
            )
        new_scale = None
    return True, new_scale


def _eager_funcs() -> Tuple[Any, Any]:
    global _EAGER
    if _EAGER is None:
        from probe.capture.eager import EagerFrontEnd

        _EAGER = (EagerFrontEnd, frozenset(EagerFrontEnd().funcs))
    return _EAGER


_EAGER: Optional[Tuple[Any, Any]] = None


def _ignore(call: Any) -> None:
    return None


class InterventionMode(TorchFunctionMode):
    """Applies :func:`sdpa_change` to SDPA calls, :func:`mha_change` to
    ``F.multi_head_attention_forward`` calls and :func:`eager_scale` to eager softmax attention
    (through its own provenance-tracking ``EagerFrontEnd``) that no capturing front end will handle.

    Passes a call through untouched when it is already applied (a front end runs it under the
    flag), when a capture front end issues it internally (its recorded scale must stay true), or
    when a capture mode below this one consults the registry itself.
    """

    def __init__(self) -> None:
        super().__init__()
        self._eager: Any = None  # an EagerFrontEnd tracking provenance (no capturing probe)

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._eager is not None:
                self._eager.reset()
                self._eager = None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func not in _REWRITTEN:
            cls, funcs = _eager_funcs()
            if (func not in funcs or not _SCALINGS.get() or _APPLYING.get() or in_front_end()
                    or _capture_below(func)):
                return func(*args, **kwargs)
            if self._eager is None:
                self._eager = cls()
            out = self._eager.handle(func, args, kwargs, _ignore)
            if self._eager._pending:
                self._eager._pending = []  # no v needed: nothing is recorded
            return out
        if _APPLYING.get() or in_front_end() or _capture_below(func):
            return func(*args, **kwargs)
        if func is torch.nn.functional.multi_head_attention_forward:
            verdict = mha_change(args, kwargs)
            if verdict is None:
                return func(*args, **kwargs)
            return verdict.run(func, args, kwargs)  # flagged even when unchanged: consulted once
        change = sdpa_change(args, kwargs)
        if change is None:
            return func(*args, **kwargs)
        return change.run(func)


_REWRITTEN = (torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.multi_head_attention_forward)


def _capture_below(func: Callable[..., Any]) -> bool:
    # Inside __torch_function__ this mode is popped: the stack holds only the modes below it.
    from torch.overrides import _get_current_function_mode_stack

    return any(getattr(m, "consults_overrides", None) is not None and m.consults_overrides(func)
               for m in _get_current_function_mode_stack())
