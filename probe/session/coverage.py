"""``probe.coverage(model, *inputs)``: what probe sees of a model's attention, and what it misses.

One forward (and, by default, one backward through ``torch.autograd.grad``, so no ``.grad`` of
the model changes) runs with a probe and an :class:`probe.capture.audit.Audit`. The audit finds every
attention independently of the capture front ends (every softmax over scores derived from a
product of two activations, every SDPA / ``nn.MultiheadAttention`` call); the report lists,
per attention module, whether probe captured it (and if not, why), under which front end, at
which scale (and where that scale came from), and which gradient metrics exist after a backward.

Example:
    >>> report = probe.coverage(model, input_ids)
    >>> print(report)                 # a table, one row per attention site
    >>> report.missed                 # [] when probe sees every attention
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from probe.capture.audit import Event
from probe.errors import ProbeError
from probe.summary import compact_values

__all__ = ["Coverage", "Row", "coverage"]

GRADS = ("grad_logits", "grad_q", "grad_k", "grad_v")


@dataclasses.dataclass
class Row:
    """One attention site of the report."""

    site: str
    captured: bool
    front_end: Optional[str] = None  # "sdpa", "eager", "mha", "flex"
    scale: Any = None  # float, a per-head list, or None when unknown
    d_k: Optional[int] = None
    scale_source: Optional[str] = None
    grads: Tuple[str, ...] = ()
    why: str = ""  # why it is not captured, or what is wrong with it
    #: whether probe's reconstruction matched what the model computed (None: it could not be checked)
    verified: Optional[bool] = None
    verification: str = ""  # what the check compared, and how closely
    #: values the site does not report, by reason (``Summary.not_measured``)
    not_measured: Dict[str, List[str]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Coverage:
    """The coverage report of one model: :attr:`rows`, :attr:`missed`, ``str()`` is a table."""

    rows: List[Row]
    backward: bool

    @property
    def missed(self) -> List[Row]:
        """Sites with an attention probe does not report (or reports under another module's name)."""
        return [r for r in self.rows if not r.captured]

    @property
    def unverified(self) -> List[Row]:
        """Captured sites whose reconstruction did not match what the model computed."""
        return [r for r in self.rows if r.captured and r.verified is False]

    def to_dict(self) -> Dict[str, Any]:
        return {"rows": [r.to_dict() for r in self.rows], "backward": self.backward}

    def __str__(self) -> str:
        head = ("site", "captured", "verified", "front end", "scale", "scale from", "gradient metrics")
        lines = [head]
        for r in self.rows:
            scale = _fmt_scale(r.scale)
            grads = ", ".join(g[5:] for g in r.grads) if r.grads else ("-" if self.backward else "(no backward)")
            verified = "-" if not r.captured else {True: "yes", False: "NO", None: "unchecked"}[r.verified]
            lines.append((r.site, "yes" if r.captured else "NO", verified, r.front_end or "-", scale,
                          r.scale_source or "-", grads))
        widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
        out = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
        out.insert(1, "  ".join("-" * w for w in widths))
        for r in self.rows:
            if r.why:
                out.append(f"{r.site}: {r.why}")
            if r.captured and r.verified is not True and r.verification:
                out.append(f"{r.site}: {'UNVERIFIED' if r.verified is False else 'verification'}: {r.verification}")
            for why, values in r.not_measured.items():
                out.append(f"{r.site}: not measured: {compact_values(values)}: {why}")
        captured = sum(r.captured for r in self.rows)
        verified = sum(r.captured and r.verified is True for r in self.rows)
        if not self.rows:
            out.append("no attention ran in this forward (0 attention sites)")
        else:
            out.append(f"{captured} of {len(self.rows)} attention sites captured, {verified} verified against the "
                       "model's own computation")
        return "\n".join(out)


def _fmt_scale(scale: Any) -> str:
    if scale is None:
        return "unknown"
    if isinstance(scale, (list, tuple)):
        values = sorted(set(round(float(s), 6) for s in scale))
        return f"{values[0]:.4g}" if len(values) == 1 else f"per head {values[0]:.4g}..{values[-1]:.4g}"
    return f"{float(scale):.4g}"


def _float_outputs(out: Any) -> Iterator[Tensor]:
    if isinstance(out, Tensor):
        if out.is_floating_point() and out.requires_grad:
            yield out
    elif isinstance(out, dict):
        for v in out.values():
            yield from _float_outputs(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            yield from _float_outputs(v)


def _backward(out: Any, model: nn.Module) -> bool:
    """A random projection of every float output, differentiated with ``autograd.grad`` (the
    model's ``.grad`` stay as they are). A plain sum could be flat (a LayerNorm output sums to
    β·n whatever its input), which would make every gradient metric zero."""
    outputs = list(_float_outputs(out))
    params = [p for p in model.parameters() if p.requires_grad]
    if not outputs or not params:
        return False
    g = torch.Generator().manual_seed(0)
    loss = sum((t.float() * torch.randn(t.shape, generator=g).to(t.device)).sum() for t in outputs)
    try:
        torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    except RuntimeError as err:
        if "use_reentrant" not in str(err):
            raise
        # reentrant activation checkpointing refuses autograd.grad: a plain backward into fresh
        # .grad tensors, then the parameters' own .grad put back untouched (hooks that act on
        # accumulated gradients, an optimizer stepping inside backward, would see this one)
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss.backward()
        finally:
            for p, grad in zip(params, saved):
                p.grad = grad
    return True


def coverage(model: nn.Module, *args: Any, backward: bool = True, **kwargs: Any) -> Coverage:
    """Run ``model(*args, **kwargs)`` once under probe and report every attention it contains.

    Args:
        model: any ``nn.Module``; its parameters, ``.grad`` and training mode are left as they are.
        *args, **kwargs: example inputs, passed to ``model`` as is.
        backward: also run one backward (``torch.autograd.grad`` of a random projection of the
            float outputs) to list which gradient metrics exist.

    Returns:
        a :class:`Coverage`: one :class:`Row` per attention site; ``print`` it for a table.

    Raises:
        ProbeError: ``model`` is not an ``nn.Module``, or its forward raised.
    """
    from probe.session.profiler import Probe

    if not isinstance(model, nn.Module):
        raise ProbeError(f"expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report says what the warnings would
        p = Probe(model, grads=backward, audit="quiet")
    ran_backward = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                with torch.enable_grad() if backward else torch.no_grad():
                    out = model(*args, **kwargs)
                    if backward:
                        ran_backward = _backward(out, model)
            except Exception as err:
                raise ProbeError(f"the model's forward (or backward) raised {type(err).__name__}: {err}") from err
            summary = p.summary()
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p.close()
    return Coverage(rows=_rows(p.audit_events, summary, ran_backward), backward=ran_backward)


def _rows(events: List[Event], summary: Any, backward: bool = True) -> List[Row]:
    rows: Dict[str, Row] = {}
    for event in events:
        site = event.reported if event.reported is not None else event.module
        if site not in summary.sites and f"{site}#1" in summary.sites:
            site = f"{site}#1"  # a module's first call, named before its second made the name `name#1`
        misnamed = event.reported is not None and event.reported.split("#")[0] != event.module
        if misnamed:
            row = rows.setdefault(event.module, Row(site=event.module, captured=False))
            row.captured = False
            row.why = (f"its metrics are reported under {event.reported!r}, not under the module that ran the "
                       "softmax")
            continue
        row = rows.get(site)
        if row is None:
            row = rows[site] = Row(site=site, captured=event.reported is not None)
        if event.reported is None:
            row.captured = False
            row.why = row.why or event.why
        row.front_end = row.front_end or event.front_end
    for site in summary.sites:  # a site the audit did not find is reported all the same
        rows.setdefault(site, Row(site=site, captured=True))
    for site, row in rows.items():
        if site not in summary.sites:
            if row.captured:  # recorded, yet nothing measured: its statistics failed (probe warned)
                row.captured = False
                row.why = row.why or "recorded by the capture but NOT measured: its statistics failed (see probe's warning)"
            continue
        info = summary.info(site)
        row.verified, row.verification = info.get("verified"), info.get("verification") or ""
        row.not_measured = {why: values for why, values in summary.not_measured(site).items()
                            if backward or not all(v.startswith("grad_") for v in values)}
        row.front_end = info.get("kind", row.front_end)
        row.scale = info.get("scale")
        row.d_k = info.get("d_k")
        row.scale_source = info.get("scale_from")
        metrics = summary.metrics(site) if hasattr(summary, "metrics") else {}
        row.grads = tuple(g for g in GRADS if g in metrics)
        if row.captured and row.scale is None and not row.why:
            row.why = "scale unknown: reported at `actual` only"
    return list(rows.values())


# -- the command line: ``probe coverage MODULE:FUNCTION`` --------------------------------------------
def _load(spec: str) -> Tuple[nn.Module, tuple, dict]:
    """``pkg.module:function`` (or ``path/to/file.py:function``) returning a model, or
    ``(model, args)``, or ``(model, args, kwargs)``."""
    import importlib
    import importlib.util
    import os
    import sys

    if ":" not in spec:
        raise ProbeError(f"expected MODULE:FUNCTION (e.g. mypkg.models:build), got {spec!r}")
    where, func_name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py") or os.sep in where:
            module_spec = importlib.util.spec_from_file_location("_probe_coverage_target", where)
            if module_spec is None or module_spec.loader is None:
                raise ProbeError(f"cannot load {where!r}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except ProbeError:
        raise
    except Exception as err:
        raise ProbeError(f"could not import {where!r}: {type(err).__name__}: {err}") from err
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ProbeError(f"{where!r} has no callable {func_name!r}")
    built = func()
    if isinstance(built, nn.Module):
        raise ProbeError(f"{spec} returned a model without example inputs: return (model, args) or (model, args, kwargs)")
    if not isinstance(built, tuple) or len(built) not in (2, 3) or not isinstance(built[0], nn.Module):
        raise ProbeError(f"expected {spec} to return (model, args) or (model, args, kwargs), got {type(built).__name__}")
    model, args = built[0], built[1]
    kwargs = built[2] if len(built) == 3 else {}
    args = args if isinstance(args, tuple) else (args,)
    if not isinstance(kwargs, dict):
        raise ProbeError(f"expected the kwargs {spec} returned to be a dict, got {type(kwargs).__name__}")
    return model, args, kwargs


def cmd_coverage(args: Any) -> int:
    import json
    import sys

    try:
        model, margs, mkwargs = _load(args.target)
        report = coverage(model, *margs, backward=not args.no_backward, **mkwargs)
    except ProbeError as err:
        print(f"probe coverage: {err}", file=sys.stderr)
        return 2
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    return 1 if report.missed or report.unverified else 0
