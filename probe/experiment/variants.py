"""Learnable scaling variants installed on an existing model: ``headwise`` and ``scale_bias``.

Both replace the fixed scale of every SDPA attention call with learnable per-head parameters
registered on the attention modules themselves (so optimizers, ``state_dict`` and ``.to()`` see
them), and both start out computing exactly what the model computed:

- :func:`headwise`: ``softmax(s_h · q·kᵀ + mask)`` with a learnable ``s_h`` per query head,
  initialised at the model's actual scale. It can sharpen or flatten each head (a temperature)
  but not change which keys a head prefers.
- :func:`scale_bias`: the same per-head scale plus a learnable additive bias ``b[h, j]`` per
  head and *key position* ``j`` (up to ``max_len``), initialised at zero:
  ``softmax(s_h · q·kᵀ + b[h, :S] + mask)``. It can add a content-independent preference for
  positions (an attention sink on token 0, a recency window). A bias that is constant along a
  row (depending only on the head or the query position) cannot change anything: softmax is
  invariant to adding a constant to all logits of a row; only differences between key
  positions matter, and only among keys the mask leaves valid.

Mechanics: SDPA takes one float scale, so ``s_h`` is applied as ``q * (s_h / s_ref)`` with
``scale=s_ref`` (``s_ref`` the model's own scale: at initialisation the factor is exactly 1.0);
the bias is passed as a float ``attn_mask`` combined with the model's mask, ``is_causal`` folded
into it (SDPA forbids a mask together with ``is_causal``). The rewrite goes through
:mod:`probe.experiment.overrides` (applied by :mod:`probe.capture.sdpa`), so a probe attached to the model records the learned scale
as ``actual``. Under :func:`probe.scaling` the context's scale replaces ``s_h`` (the bias stays).

Example:
    >>> handle = probe.variants.headwise(model, example=batch["input_ids"])
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # includes the new scales
    >>> ...train...
    >>> handle.scales()          # {site: tensor of learned per-head scales}
    >>> handle.remove()          # the model is as it was (its other weights trained, of course)
"""

from __future__ import annotations

import contextvars
import math
from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from probe.capture.mode import SitesFilter, site_filter
from probe.capture.sdpa import bind_sdpa
from probe.errors import ProbeError
from probe.capture.sites import SiteStack
from probe.experiment.scaling import InterventionMode, modules_by_site
from probe.experiment.overrides import ModuleOverride, push_module_override, reset_module_override

__all__ = ["SCALE_PARAM", "BIAS_PARAM", "Variant", "headwise", "scale_bias"]

#: Names of the parameters registered on each attention module.
SCALE_PARAM = "probe_scale"
BIAS_PARAM = "probe_bias"

Example = Union[Tensor, Sequence[Any], Dict[str, Any]]


class _Discover(TorchFunctionMode):
    """Records, per issuing module, the heads, dtype and scale of its SDPA calls."""

    def __init__(self, stack: SiteStack) -> None:
        super().__init__()
        self.stack = stack
        self.found: Dict[str, Dict[str, Any]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.stack.root_running:
            bound = bind_sdpa(args, kwargs)
            q = bound.get("query")
            if isinstance(q, Tensor) and q.dim() >= 3:
                name, _ = self.stack.next_site()
                heads = q.shape[-3] if q.dim() >= 4 else 1
                own = bound.get("scale")
                scale = 1.0 / math.sqrt(q.shape[-1]) if own is None else float(own)
                entry = {"heads": heads, "scale": scale, "dtype": q.dtype, "device": q.device}
                old = self.found.setdefault(name, entry)
                if (old["heads"], old["scale"]) != (heads, scale):
                    raise ProbeError(
                        f"site {name!r} issues attention calls with different heads or scales "
                        f"({old['heads']}, {old['scale']}) and ({heads}, {scale}); a variant needs one"
                    )
        return func(*args, **kwargs)


def _run_example(model: nn.Module, example: Example) -> Dict[str, Dict[str, Any]]:
    """One forward on ``example`` (no grad, RNG restored) to find the attention sites."""
    stack = SiteStack(model)
    mode = _Discover(stack)
    devices = sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"} - {None})
    stack.activate()
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), mode:
            if isinstance(example, Tensor):
                model(example)
            elif isinstance(example, dict):
                model(**example)
            elif isinstance(example, (tuple, list)):
                model(*example)
            else:
                raise ProbeError(f"expected `example` to be a tensor, a tuple of args or a dict of kwargs, "
                                 f"got {type(example).__name__}")
    finally:
        stack.deactivate()
    return mode.found


class Variant:
    """The handle of an installed variant: its parameters, and :meth:`remove` to undo it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.modules: Dict[str, nn.Module] = {}
        self._overrides: Dict[str, ModuleOverride] = {}
        self._handles: List[RemovableHandle] = []
        self._running: Dict[int, List[Tuple[contextvars.Token, InterventionMode]]] = {}
        self._removed = False

    @property
    def sites(self) -> List[str]:
        return list(self.modules)

    def parameters(self) -> List[nn.Parameter]:
        """The variant's parameters (also reachable through ``model.parameters()``)."""
        out: List[nn.Parameter] = []
        for module in self.modules.values():
            for name in (SCALE_PARAM, BIAS_PARAM):
                param = module._parameters.get(name)
                if param is not None:
                    out.append(param)
        return out

    def _values(self, name: str) -> Dict[str, Tensor]:
        out: Dict[str, Tensor] = {}
        for site, module in self.modules.items():
            param = module._parameters.get(name)
            if param is not None:
                out[site] = param.detach().clone()
        return out

    def scales(self) -> Dict[str, Tensor]:
        """The current per-head scales, per site (detached copies)."""
        return self._values(SCALE_PARAM)

    def biases(self) -> Dict[str, Tensor]:
        """The current ``(heads, max_len)`` biases, per site (``scale_bias`` only)."""
        return self._values(BIAS_PARAM)

    def _install(self, site: str, module: nn.Module, reference: float, params: Dict[str, nn.Parameter]) -> None:
        for name, param in params.items():
            module.register_parameter(name, param)
        self.modules[site] = module
        self._overrides[site] = ModuleOverride(module, site, None, None, reference)
        self._handles.append(module.register_forward_pre_hook(self._enter(site)))
        self._handles.append(module.register_forward_hook(self._exit(site), always_call=True))

    def _enter(self, site: str) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            override = self._overrides[site]
            # Read the parameters at each forward: .to() or load_state_dict may have replaced them.
            override.scale = module._parameters.get(SCALE_PARAM)
            override.bias = module._parameters.get(BIAS_PARAM)
            token = push_module_override(override)
            mode = InterventionMode()
            mode.__enter__()
            self._running.setdefault(id(module), []).append((token, mode))
        return hook

    def _exit(self, site: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            running = self._running.get(id(module))
            if running:
                token, mode = running.pop()
                try:
                    mode.__exit__(None, None, None)
                finally:
                    reset_module_override(token)
        return hook

    def remove(self) -> None:
        """Remove the hooks and the parameters: ``state_dict`` keys are as before. Idempotent."""
        if self._removed:
            return
        self._removed = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self.modules.values():
            for name in (SCALE_PARAM, BIAS_PARAM):
                module._parameters.pop(name, None)

    def __enter__(self) -> "Variant":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Variant({self.kind!r}, sites={self.sites}, removed={self._removed})"


def _install(kind: str, model: nn.Module, example: Example, sites: SitesFilter,
             make: Callable[[Dict[str, Any]], Dict[str, nn.Parameter]]) -> Variant:
    if not isinstance(model, nn.Module):
        raise ProbeError(f"expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    keep = site_filter(sites)
    found = _run_example(model, example)
    chosen = {name: e for name, e in found.items() if keep is None or keep(name)}
    if not chosen:
        seen = ", ".join(found) or "none"
        raise ProbeError(f"expected `sites` to match an SDPA attention site of the model, got {sites!r} "
                         f"(sites seen on `example`: {seen})")
    variant = Variant(kind)
    by_site = modules_by_site(model)
    modules = {name: by_site[name] for name in chosen}
    for name, module in modules.items():
        for pname in (SCALE_PARAM, BIAS_PARAM):
            if hasattr(module, pname):
                raise ProbeError(f"site {name!r} already has `{pname}`: a variant is installed; remove it first")
    for name, entry in chosen.items():
        variant._install(name, modules[name], entry["scale"], make(entry))
    return variant


def _float_dtype(entry: Dict[str, Any]) -> torch.dtype:
    return entry["dtype"] if entry["dtype"].is_floating_point else torch.get_default_dtype()


def headwise(model: nn.Module, example: Example, sites: SitesFilter = None) -> Variant:
    """Give every attention site a learnable scale per query head, initialised at its actual scale.

    Args:
        model: the model; one forward on ``example`` (no grad, RNG state restored) finds its SDPA
            sites and their heads and scales. Install before attaching a probe, or that forward
            counts as a probe step.
        example: inputs for that forward: a tensor, a tuple of positional args or a dict of kwargs.
        sites: only these sites (glob, list, predicate); default every site.

    Returns:
        A :class:`Variant`; ``remove()`` undoes it. Each site module gets a parameter
        ``probe_scale`` of shape ``(heads,)``.
    """
    def make(entry: Dict[str, Any]) -> Dict[str, nn.Parameter]:
        value = torch.full((entry["heads"],), entry["scale"], dtype=_float_dtype(entry), device=entry["device"])
        return {SCALE_PARAM: nn.Parameter(value)}

    return _install("headwise", model, example, sites, make)


def scale_bias(model: nn.Module, example: Example, max_len: int, sites: SitesFilter = None) -> Variant:
    """Learnable per-head scales plus a learnable additive bias per head and key position.

    The logits become ``s_h · q·kᵀ + b[h, j] + mask`` for key positions ``j < max_len``
    (``b`` starts at zero, ``s_h`` at the actual scale). A call with more than ``max_len`` keys
    raises :class:`probe.ProbeError`. Only differences of ``b`` across keys matter (softmax is
    shift invariant per row).

    Args:
        model, example, sites: as in :func:`headwise`.
        max_len: the number of key positions with a bias (parameter ``probe_bias`` of shape
            ``(heads, max_len)``).
    """
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ProbeError(f"expected `max_len` to be a positive int, got {max_len!r}")

    def make(entry: Dict[str, Any]) -> Dict[str, nn.Parameter]:
        dtype = _float_dtype(entry)
        scale = torch.full((entry["heads"],), entry["scale"], dtype=dtype, device=entry["device"])
        bias = torch.zeros(entry["heads"], max_len, dtype=dtype, device=entry["device"])
        return {SCALE_PARAM: nn.Parameter(scale), BIAS_PARAM: nn.Parameter(bias)}

    return _install("scale_bias", model, example, sites, make)
