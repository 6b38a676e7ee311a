"""The one record between capture and statistics: :class:`AttentionCall`."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, FrozenSet, Literal, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = ["KINDS", "AttentionCall", "Kind", "Scale"]

#: A scale is a Python float (the same for every head) or a 1-D tensor with one value per head.
Scale = Union[float, Tensor]
#: Which front end made a record.
Kind = Literal["sdpa", "eager", "mha", "flex"]
KINDS: FrozenSet[str] = frozenset({"sdpa", "eager", "mha", "flex"})


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One attention computation, normalized whatever front end captured it.

    Immutable: a stage that needs another value makes a copy (``dataclasses.replace``), so a
    record handed to one consumer never changes under another.

    Shapes follow ``F.scaled_dot_product_attention``: ``q`` is ``(B, H, L, d)``, ``k`` is
    ``(B, Hk, S, d)`` with ``H % Hk == 0`` (grouped-query attention when ``Hk < H``; query head
    ``h`` reads kv head ``h // (H // Hk)``), ``v`` is ``(B, Hk, S, dv)``.

    The logits the model turns into probabilities are ``Z = scale * q @ k.T + bias`` with
    invalid entries removed (``mask`` False, ``causal`` above the top-left diagonal, ``bias``
    at or below ``-100``: its weight ``e^-100`` vanishes, so ``-inf``, Hugging Face's
    ``finfo.min`` and Swin's ``-100`` all mask; ``probe.stats.chunks.MASK_BIAS``). With ``softcap = c``
    they are ``c * tanh(scale * q @ k.T / c) + bias`` (Gemma 2).

    Attributes:
        q, k, v: the attention inputs, exactly as the model passed them (not copied).
        scale: the scale the model used; ``None`` when it could not be recovered.
        bias: an additive float bias broadcastable to ``(B, H, L, S)``, or ``None``.
        mask: a boolean mask broadcastable to ``(B, H, L, S)``, True = attend, or ``None``.
        causal: top-left aligned causal masking (``torch.ones(L, S).tril()``), as SDPA does.
        softcap: logit soft-capping constant, or ``None``.
        output: the attention output ``(B, H, L, dv)``, for the backward hook.
        site: the qualified name of the module that issued the call.
        kind: which front end made the record: ``"sdpa"``, ``"eager"``, ``"mha"``, ``"flex"``.
        logits: the softmax input ``(B, H, L, S)`` of an eager call whose scale could not be
            recovered (``scale`` is then ``None``); probe reports such a call at ``actual`` only,
            from these logits (see :mod:`probe.stats.paths.logits`). ``None`` otherwise.
        probs: the softmax output ``P`` of an eager call, exactly as the model produced it (any
            layout with ``B·H·L·S`` elements), for the backward hook: its gradient is
            ``dP = ∂L/∂P``, dropout between the softmax and ``P @ v`` included; preferred over
            ``output`` for ``grad_logits`` when both are set. ``None`` otherwise.
        grad_of: for ``"q"``, ``"k"``, ``"v"``, ``"output"``, ``"probs"`` whose record is not the
            model's own tensor (q with a scalar factor taken out, k behind a ``repeat_kv`` copy, a
            5-D q flattened to 4-D, an einsum operand permuted, probabilities of ``(H·B, L, S)``
            head-major rows recorded as ``(B, H, L, S)``): ``(tensor, fn)``, the model's own
            tensor to hook and how its gradient becomes the record's (``fn(grad)``); ``(None, why)``
            when that gradient cannot be measured (learned queries broadcast over the batch).
        scale_from: where the scale came from, in words (``info["scale_from"]``).
        head_dim: ``d_k`` when it is not ``q.shape[-1]``: heads mixed before the softmax (talking
            heads) are recorded as ``q'_g = [M_1g·q_1, ..., M_Hg·q_H]`` and ``k'_g = [k_1, ...,
            k_H]`` (so that ``q'_g·k'_g = Σ_h M_hg·q_h·k_h``), whose last dim is ``H·d``.
        scale_unknown: why the model's scale cannot be attributed, in words (an op probe does not
            model touched q or k between their projection and the product, or the scores before the
            softmax); ``None`` when it is known. When set, only ``actual`` is measured and nothing
            is reported at a counterfactual scale: ``scale`` is then either the multiplier that
            reproduces the model's own logits from ``q`` and ``k`` exactly (``q`` and ``k`` as they
            entered the product; its value is no claim about the model's scale) or ``None`` with
            ``logits`` set. A record with ``scale is None`` is unknown too (:attr:`scale_known`).
        rerun: for a call whose ``output`` carries randomness (attention dropout), the model's own
            function run again without it: ``rerun(entries, pos)`` gives the output rows ``pos`` of
            batch entries ``0 .. entries-1``, ``(entries, H, len(pos), dv)``, which the recorder's
            check of the reconstruction compares with ``P·v`` instead of ``output``
            (:mod:`probe.session.verify`). ``None`` otherwise.
    """

    q: Tensor
    k: Tensor
    v: Optional[Tensor]
    scale: Optional[Scale]
    bias: Optional[Tensor] = None
    mask: Optional[Tensor] = None
    causal: bool = False
    softcap: Optional[float] = None
    output: Optional[Tensor] = None
    site: str = "root"
    kind: Kind = "sdpa"
    logits: Optional[Tensor] = None
    probs: Optional[Tensor] = None
    grad_of: Optional[Mapping[str, Tuple[Tensor, Callable[[Tensor], Tensor]]]] = None
    scale_from: Optional[str] = None
    head_dim: Optional[int] = None
    scale_unknown: Optional[str] = None
    rerun: Optional[Callable[[int, Tensor], Tensor]] = None

    @property
    def scale_known(self) -> bool:
        """Whether ``scale`` is the model's own scale, so that every scale can be reported."""
        return self.scale is not None and self.scale_unknown is None

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def d_k(self) -> int:
        return self.q.shape[-1] if self.head_dim is None else self.head_dim

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def standard_scale(self) -> float:
        # The same expression SDPA uses for scale=None, so that "actual" and "standard" coincide
        # bit for bit on a default SDPA call and are computed once.
        return 1.0 / math.sqrt(self.d_k)

    def validate(self) -> None:
        """Check the shapes; raises ``ValueError`` naming the inconsistent field."""
        if self.q.dim() != 4 or self.k.dim() != 4:
            raise ValueError(
                f"expected 4-D q and k (B, H, L, d), got {tuple(self.q.shape)} and {tuple(self.k.shape)}"
            )
        if self.q.shape[-1] != self.k.shape[-1]:
            raise ValueError(f"q and k head dims differ: {self.q.shape[-1]} vs {self.k.shape[-1]}")
        if self.heads % self.kv_heads:
            raise ValueError(f"query heads {self.heads} are not a multiple of kv heads {self.kv_heads}")
        if isinstance(self.scale, Tensor) and self.scale.dim() == 1 and self.scale.numel() not in (1, self.heads):
            raise ValueError(f"a per-head scale needs {self.heads} values, got {self.scale.numel()}")
        if self.mask is not None and self.mask.dtype != torch.bool:
            raise ValueError(f"mask must be boolean, got {self.mask.dtype}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, got {self.kind!r}")
