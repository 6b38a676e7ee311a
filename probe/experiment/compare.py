"""``probe.compare`` (module ``probe.experiment.compare``): one forward and backward per scale on the same batch, side by side.

For each scale the model runs ``loss_fn(model, batch)`` and its backward under a fresh probe
and, unless the scale is ``"actual"``, under :func:`probe.scaling`. The same RNG state starts
every run (dropout draws the same masks), and the caller's ``.grad`` of every parameter, the
model's buffers and the global RNG state are restored afterwards: comparing leaves a training
loop exactly where it was (no optimizer step is taken).

Per site and scale the table holds ``entropy`` and ``saturation`` (head means),
``grad_logits``, ``grad_q``, ``grad_k``, ``grad_v`` (the norm over all heads,
``sqrt(Σ_h g_h²)``, at the scale the model ran at) and ``param_grad``, the gradient norm of the
parameters of the module that issued the attention call (its projections, when they live in
it), plus the loss per scale.

Pitfall: a probe already attached to the model sees these forwards as its own steps; compare
before attaching one, or accept the extra probed steps.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.experiment.scaling import ScaleSpec, SitesFilter, parse_spec, modules_by_site, scaling
from probe.session.profiler import watch
from probe.summary import Summary

__all__ = ["COLUMNS", "Comparison", "compare"]

#: The per-site quantities of a comparison, in table order.
COLUMNS = ("entropy", "saturation", "grad_logits", "grad_q", "grad_k", "grad_v", "param_grad")
_MEAN = ("entropy", "saturation")  # head means; the grad metrics combine as norms


def _label(spec: Any) -> str:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Tensor):
        return "[" + ",".join(f"{v:g}" for v in spec.detach().reshape(-1).tolist()) + "]"
    return f"{spec:g}" if isinstance(spec, (int, float)) else repr(spec)


def _specs(scales: Union[Sequence[ScaleSpec], Mapping[str, ScaleSpec]]) -> List[Tuple[str, ScaleSpec]]:
    if isinstance(scales, Mapping):
        items = [(str(k), v) for k, v in scales.items()]
    elif isinstance(scales, (list, tuple)):
        items = [(_label(v), v) for v in scales]
    else:
        raise ProbeError(f"expected `scales` to be a list of scales or a dict of label -> scale, got {scales!r}")
    if not items:
        raise ProbeError("expected `scales` to name at least one scale, got none")
    labels = [label for label, _ in items]
    if len(set(labels)) != len(labels):
        raise ProbeError(f"expected distinct labels in `scales`, got {labels}")
    for label, spec in items:
        parse_spec(spec, f"scales[{label!r}]")
    return items


class Comparison:
    """The result of :func:`compare`: a value per (site, column, scale) and the loss per scale.

    Attributes:
        scales: the scale labels, in the order given.
        sites: the attention sites seen.
        loss: scale label → loss.
        summaries: scale label → the full :class:`probe.Summary` of that run (per-head values).
    """

    def __init__(self, scales: List[str], loss: Dict[str, float], summaries: Dict[str, Summary],
                 param_grad: Dict[str, Dict[str, float]]) -> None:
        self.scales = scales
        self.loss = loss
        self.summaries = summaries
        self._param_grad = param_grad
        seen: Dict[str, None] = {}
        for label in scales:
            seen.update(dict.fromkeys(summaries[label].sites))
        self.sites = list(seen)

    def value(self, site: str, column: str, scale: str) -> float:
        """One cell: ``column`` (see :data:`COLUMNS`) of ``site`` under ``scale``; NaN if absent."""
        if scale not in self.summaries:
            raise ProbeError(f"unknown scale {scale!r}; this comparison has: {', '.join(self.scales)}")
        if column not in COLUMNS:
            raise ProbeError(f"unknown column {column!r}; expected one of: {', '.join(COLUMNS)}")
        if column == "param_grad":
            return self._param_grad[scale].get(site, math.nan)
        summary = self.summaries[scale]
        if site not in summary.sites or column not in summary.metrics(site):
            return math.nan
        heads = summary.value(site, column)
        return float(np.mean(heads)) if column in _MEAN else float(np.sqrt(np.sum(np.square(heads))))

    def to_dict(self) -> Dict[str, Any]:
        def clean(x: float) -> Optional[float]:
            return None if math.isnan(x) else x

        return {
            "scales": self.scales,
            "loss": {s: clean(v) for s, v in self.loss.items()},
            "sites": {site: {col: {s: clean(self.value(site, col, s)) for s in self.scales} for col in COLUMNS}
                      for site in self.sites},
        }

    def table(self) -> str:
        """A plain-text table: the loss per scale, then per site one row per column."""
        width = max(10, *(len(s) + 2 for s in self.scales))
        site_w = max(12, *(len(s) + 2 for s in self.sites)) if self.sites else 12
        head = f"{'site':<{site_w}}{'':<12}" + "".join(f"{s:>{width}}" for s in self.scales)
        lines = [head, "-" * len(head)]
        lines.append(f"{'(model)':<{site_w}}{'loss':<12}" + "".join(f"{self.loss[s]:>{width}.4g}" for s in self.scales))
        for site in self.sites:
            for i, col in enumerate(COLUMNS):
                cells = "".join(f"{self.value(site, col, s):>{width}.4g}" for s in self.scales)
                lines.append(f"{site if i == 0 else '':<{site_w}}{col:<12}" + cells)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Comparison(scales={self.scales}, sites={len(self.sites)})"


def _grad_norm(module: Optional[nn.Module]) -> float:
    if module is None:
        return math.nan
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return math.nan
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:  # after backward, outside forward: reading the value here is fine
        total += g.detach().double().square().sum().cpu()
    return float(total.sqrt())


def compare(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    scales: Union[Sequence[ScaleSpec], Mapping[str, ScaleSpec]] = ("actual", "unscaled"),
    sites: SitesFilter = None,
) -> Comparison:
    """Run forward and backward once per scale on the same batch and tabulate per site.

    Args:
        model: the model; nothing of it changes (grads, buffers and RNG state are restored).
        batch: passed to ``loss_fn`` as is.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, e.g.
            ``lambda m, b: m(**b).loss`` or ``lambda m, b: F.cross_entropy(m(b[0]), b[1])``.
        scales: what :func:`probe.scaling` accepts (``"actual"`` runs the model as it is), as a
            list (labelled by their value) or a dict ``{label: scale}``.
        sites: only probe these sites (as in :func:`probe.watch`); the override applies to all.

    Returns:
        A :class:`Comparison`; ``print(result.table())``.

    Raises:
        ProbeError: bad ``scales`` or ``loss_fn``, or a loss that is not a scalar tensor.
    """
    if not isinstance(model, nn.Module):
        raise ProbeError(f"expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise ProbeError(f"expected `loss_fn` to be a callable (model, batch) -> loss, got {type(loss_fn).__name__}")
    specs = _specs(scales)
    by_site = modules_by_site(model)
    params = list(model.parameters())
    saved_grads = [p.grad for p in params]
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index for p in params if p.device.type == "cuda"} - {None})
    losses: Dict[str, float] = {}
    summaries: Dict[str, Summary] = {}
    param_grad: Dict[str, Dict[str, float]] = {}
    try:
        with torch.random.fork_rng(devices=devices):  # every run starts from this state; restored after
            cpu_rng = torch.get_rng_state()
            cuda_rng = [torch.cuda.get_rng_state(d) for d in devices]
            for label, spec in specs:
                torch.set_rng_state(cpu_rng)
                for d, state in zip(devices, cuda_rng):
                    torch.cuda.set_rng_state(state, d)
                for p in params:
                    p.grad = None
                override = contextlib.nullcontext() if spec == "actual" else scaling(model, spec)
                with watch(model, grads=True, sites=sites) as p_, override:
                    loss = loss_fn(model, batch)
                    if not isinstance(loss, Tensor) or loss.numel() != 1:
                        raise ProbeError(f"expected `loss_fn` to return a scalar tensor, got "
                                         f"{type(loss).__name__}{'' if not isinstance(loss, Tensor) else tuple(loss.shape)}")
                    loss.backward()
                summaries[label] = p_.summary()
                losses[label] = float(loss.detach())
                param_grad[label] = {site: _grad_norm(by_site.get(site.split("#")[0]))
                                     for site in summaries[label].sites}
                for buffer, value in saved_buffers:
                    buffer.copy_(value)
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for buffer, value in saved_buffers:
                buffer.copy_(value)
    return Comparison([label for label, _ in specs], losses, summaries, param_grad)
