"""Which PyTorch probe runs on, and a clear error on one it does not.

probe declares ``torch>=2.6`` (``MINIMUM``). pip enforces that on install, but a checkout on
``PYTHONPATH``, ``pip install --no-deps`` or a torch replaced later can still put probe beside an
older PyTorch; there, the first use of a public name (``probe.watch``, ``probe.scaling``, ...)
or of the ``probe`` command raises :class:`~probe.errors.ProbeError` naming the torch found and
each feature it lacks, instead of an ``AttributeError`` deep inside a forward.

What probe needs, and since when (PyTorch release notes; each row is checked on the installed
torch by looking for the feature itself, not only by comparing version strings):

==========================================================  =====  ==================================
feature                                                     since  used for
==========================================================  =====  ==================================
``always_call=`` in forward hooks (module and global)       2.1    leaving a site's scope on errors
``torch.compiler.is_compiling``                             2.3    root hooks, on every step
``enable_gqa=`` in ``F.scaled_dot_product_attention``       2.5    grouped-query SDPA (Llama, Mistral)
FlexAttention (``torch.nn.attention.flex_attention``)       2.5    capturing ``flex_attention`` calls
``torch.compiler.set_stance``                               2.6    sampled steps of compiled models
==========================================================  =====  ==================================

PyTorch 2.6 is also the oldest release the Hugging Face transformers 5 line supports. The test
matrix (``.ci/torch-matrix``, results in docs/install.md) runs the suite on the minimum and on the
newest release.
"""

from __future__ import annotations

import inspect
import re
from typing import Callable, List, NamedTuple, Optional, Tuple

from probe.errors import ProbeError

__all__ = ["MINIMUM", "Feature", "FEATURES", "check_torch", "missing_features", "parse_version"]

MINIMUM: Tuple[int, int] = (2, 6)


class Feature(NamedTuple):
    """One PyTorch feature probe relies on."""

    name: str
    since: Tuple[int, int]
    used_for: str
    present: Callable[[], bool]


def parse_version(text: str) -> Tuple[int, int]:
    """``"2.6.0+cu124"`` -> ``(2, 6)``; ``(0, 0)`` when unreadable."""
    found = re.match(r"\s*(\d+)\.(\d+)", str(text))
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _has_kwarg(fn: Callable[..., object], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _always_call() -> bool:
    from torch import nn

    return _has_kwarg(nn.Module.register_forward_hook, "always_call") and _has_kwarg(
        nn.modules.module.register_module_forward_hook, "always_call")


def _is_compiling() -> bool:
    import torch

    return callable(getattr(getattr(torch, "compiler", None), "is_compiling", None))


def _enable_gqa() -> bool:
    import torch.nn.functional as F

    # A builtin: no inspectable signature, but its docstring opens with it.
    return "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _flex() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _set_stance() -> bool:
    import torch

    return callable(getattr(getattr(torch, "compiler", None), "set_stance", None))


FEATURES: Tuple[Feature, ...] = (
    Feature("always_call= in nn.Module forward hooks", (2, 1), "leaving a site's scope when a forward raises",
            _always_call),
    Feature("torch.compiler.is_compiling", (2, 3), "probe's hooks, on every step", _is_compiling),
    Feature("enable_gqa= in F.scaled_dot_product_attention", (2, 5), "grouped-query SDPA (Llama, Mistral)",
            _enable_gqa),
    Feature("FlexAttention (torch.nn.attention.flex_attention)", (2, 5), "capturing flex_attention", _flex),
    Feature("torch.compiler.set_stance", (2, 6), "sampled steps of torch.compile'd models", _set_stance),
)


def missing_features() -> List[Feature]:
    """The features of :data:`FEATURES` the installed torch lacks."""
    out = []
    for feature in FEATURES:
        try:
            ok = feature.present()
        except Exception:  # a half-present feature counts as missing
            ok = False
        if not ok:
            out.append(feature)
    return out


_checked: Optional[bool] = None


def check_torch() -> None:
    """Raise :class:`ProbeError` unless the installed torch is one probe supports (checked once).

    The message names the torch found (version and location), each missing feature with the
    release that brought it, and the fix.
    """
    global _checked
    if _checked:
        return
    try:
        import torch
    except ImportError as err:
        raise ProbeError(f"probe needs PyTorch >= {MINIMUM[0]}.{MINIMUM[1]}, and torch does not import: {err}; "
                         f"install it: pip install 'torch>={MINIMUM[0]}.{MINIMUM[1]}'") from None
    version = getattr(torch, "__version__", "unknown")
    lacking = missing_features()
    if parse_version(version) < MINIMUM or lacking:
        where = getattr(torch, "__file__", None) or "?"
        lines = [f"probe needs PyTorch >= {MINIMUM[0]}.{MINIMUM[1]}; found torch {version} ({where})."]
        if lacking:
            lines.append("It lacks:")
            lines += [f"  - {f.name} (PyTorch {f.since[0]}.{f.since[1]}; for {f.used_for})" for f in lacking]
        lines.append(f"Upgrade it: pip install 'torch>={MINIMUM[0]}.{MINIMUM[1]}'")
        raise ProbeError("\n".join(lines))
    _checked = True
