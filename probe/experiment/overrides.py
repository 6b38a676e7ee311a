"""What scale applies to an attention call: the one seam between interventions and front ends.

Interventions *register* here (context variables): a :func:`probe.scaling` context is a
:class:`ScaleRule`, a running variant module a :class:`ModuleOverride`. Capture front ends *look
up* here, once per attention call, with :func:`lookup`, and apply the answer in their own file
(``probe/capture/sdpa.py``, ``mha.py``, ``eager.py``). Nothing else knows about overrides; this
module imports nothing from probe but :mod:`probe.errors`.

The lookup protocol, for a front end:

1. ``change = lookup(heads, d_k, like)``: ``None`` means "not consulted" (no intervention is
   active, or the call is already being applied by another front end): run the call as is.
2. Otherwise run the call at ``change.scale`` (``None``: its own scale) plus ``change.bias``
   inside ``with applying():``, even when nothing changes: the lookup counted the call (scaling
   contexts name sites by counting calls), and every front end below sees the flag and leaves
   the call alone, so an override is never applied or counted twice.
3. Record the call with the effective scale as ``actual``.

See docs/architecture.md ("Overrides").
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional, Protocol, Tuple, Union

from torch import Tensor, nn

from probe.errors import ProbeError

__all__ = [
    "ModuleOverride",
    "Override",
    "ScaleRule",
    "active",
    "applying",
    "is_applying",
    "lookup",
    "push_module_override",
    "push_rule",
    "reset_module_override",
    "reset_rule",
    "rules_active",
]

#: A scale to run at: one float for every head or a 1-D tensor with one value per query head.
NewScale = Union[None, float, Tensor]


class ScaleRule(Protocol):
    """A registered scaling context (:class:`probe.experiment.scaling.Scaling`)."""

    def resolve(self, heads: int, d_k: int, like: Tensor) -> Tuple[Optional[str], NewScale]:
        """(site, scale) for the next attention call; site ``None``: not this rule's model;
        scale ``None``: unchanged. Called exactly once per call (it counts calls)."""

    def left_unchanged(self, site: str) -> None:
        """The front end could not apply this rule's scale at ``site`` (warn once)."""


@dataclasses.dataclass
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


@dataclasses.dataclass(frozen=True)
class Override:
    """The verdict of :func:`lookup` on one attention call.

    Attributes:
        scale: the scale to run at (a float, or a per-head tensor on ``like``'s device), ``None``
            to keep the call's own scale.
        reference: for a variant's per-head ``scale``, the ``s_ref`` to call SDPA with (q is
            multiplied by ``scale / s_ref``); ``None`` means the call's own scale.
        bias: a variant's additive bias ``(1, H, 1, S)`` over key positions, in ``like``'s dtype.
    """

    scale: NewScale = None
    reference: Optional[float] = None
    bias: Optional[Tensor] = None

    @property
    def changes(self) -> bool:
        return self.scale is not None or self.bias is not None


_RULES: contextvars.ContextVar[Tuple[ScaleRule, ...]] = contextvars.ContextVar("probe_scalings", default=())
_MODULES: contextvars.ContextVar[Tuple[ModuleOverride, ...]] = contextvars.ContextVar("probe_module_overrides", default=())
_APPLYING: contextvars.ContextVar[bool] = contextvars.ContextVar("probe_applying", default=False)


def push_rule(rule: ScaleRule) -> contextvars.Token:
    """Make ``rule`` the innermost scaling rule; undo with :func:`reset_rule`."""
    return _RULES.set(_RULES.get() + (rule,))


def reset_rule(token: contextvars.Token) -> None:
    _RULES.reset(token)


def push_module_override(override: ModuleOverride) -> contextvars.Token:
    """Make ``override`` the innermost module override; undo with :func:`reset_module_override`."""
    return _MODULES.set(_MODULES.get() + (override,))


def reset_module_override(token: contextvars.Token) -> None:
    _MODULES.reset(token)


def active() -> bool:
    """Whether any intervention (a scaling context or a running variant module) is registered."""
    return bool(_RULES.get()) or bool(_MODULES.get())


def rules_active() -> bool:
    """Whether a scaling context is registered (variants alone reach SDPA calls only)."""
    return bool(_RULES.get())


def is_applying() -> bool:
    """Whether the running call was already looked up (run inside :func:`applying`)."""
    return _APPLYING.get()


@contextlib.contextmanager
def applying() -> Iterator[None]:
    """Run a looked-up call: front ends below leave it (and the calls it makes) alone."""
    token = _APPLYING.set(True)
    try:
        yield
    finally:
        _APPLYING.reset(token)


def lookup(heads: int, d_k: int, like: Tensor, *, keys: int = 0, variants: bool = True,
           describable: bool = True) -> Optional[Override]:
    """The override for the next attention call, or ``None`` when not consulted.

    Consult it exactly once per call: every scaling rule counts the call to name its site.
    Precedence: the innermost rule that matches the site replaces a variant's learnable scale; a
    variant's bias is kept under it.

    Args:
        heads, d_k: the call's query heads and head dim (``"standard"`` is ``1/sqrt(d_k)``).
        like: a tensor of the call (per-head scales come on its device and dtype).
        keys: key positions, for a variant's bias.
        variants: whether this front end applies variants (module overrides); else only
            scaling rules are consulted.
        describable: False when the front end cannot rewrite this call (an eager soft cap): the
            matching rule is told, and the scale is left unchanged.

    Raises:
        ProbeError: a variant whose parameters do not fit the call (heads, ``max_len``), or a
            rule's per-head tensor of the wrong length.
    """
    if _APPLYING.get():
        return None
    rules = _RULES.get()
    modules = _MODULES.get() if variants else ()
    if not rules and not modules:
        return None
    scale: NewScale = None
    owner: Optional[Tuple[ScaleRule, str]] = None
    for rule in reversed(rules):  # every rule counts this call; the innermost match wins
        site, value = rule.resolve(heads, d_k, like)
        if scale is None and value is not None:
            scale, owner = value, (rule, str(site))
    if scale is not None and not describable and owner is not None:
        owner[0].left_unchanged(owner[1])
        scale = None
    variant = modules[-1] if modules else None
    if variant is None:
        return Override(scale)
    for t, what in ((variant.scale, "scale"), (variant.bias, "bias")):
        if t is not None and t.shape[0] != heads:
            raise ProbeError(f"variant `{what}` of site {variant.site!r} has {t.shape[0]} heads, "
                             f"the attention call has {heads}")
    reference = None
    if scale is None and variant.scale is not None:
        scale, reference = variant.scale, variant.reference
    bias = None
    if variant.bias is not None:
        if keys > variant.bias.shape[1]:
            raise ProbeError(f"expected at most `max_len`={variant.bias.shape[1]} key positions at site "
                             f"{variant.site!r}, got {keys}")
        # (1, H, 1, S); contiguous: a strided mask takes another kernel path
        bias = variant.bias[:, :keys].to(like.dtype).contiguous()[None, :, None, :]
    return Override(scale, reference, bias)
