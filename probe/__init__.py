"""probe: see, and guard in CI, what the 1/sqrt(d_k) scaling in attention does to your model.

The public names below resolve on first use (PEP 562). The pytest plugin's entry point imports
this package in every pytest session of an environment where probe is installed; resolving
lazily keeps that import free of torch (about 1.7 s) until a test actually uses probe.
"""

from typing import TYPE_CHECKING
from typing import Any
from typing import List

__version__ = "0.2.0"  # the one source: setup.cfg reads it (attr:), probe --version prints it

__all__ = [
    "AttentionCall",
    "Probe",
    "ProbeError",
    "StabilityError",
    "Summary",
    "Violation",
    "__version__",
    "assert_stable",
    "check",
    "compare",
    "coverage",
    "qk_clip",
    "scaling",
    "variants",
    "watch",
]

# public name -> the module that defines it ("variants" is a submodule)
_WHERE = {
    "AttentionCall": "probe.call",
    "Probe": "probe.session.profiler",
    "ProbeError": "probe.errors",
    "StabilityError": "probe.errors",
    "Summary": "probe.summary",
    "Violation": "probe.ci.thresholds",
    "assert_stable": "probe.ci.thresholds",
    "check": "probe.ci.thresholds",
    "compare": "probe.experiment.compare",
    "coverage": "probe.session.coverage",  # the function (README, docs/models.md and probe's warnings name it)
    "qk_clip": "probe.experiment.qk_clip",
    "scaling": "probe.experiment.scaling",
    "variants": "probe.experiment.variants",
    "watch": "probe.session.profiler",
}


# resolving these needs no torch (a caller can catch ProbeError before torch is checked)
_TORCH_FREE = frozenset({"ProbeError", "StabilityError"})


def __getattr__(name: str) -> Any:
    import importlib

    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'probe' has no attribute {name!r}")
    if name not in _TORCH_FREE:
        from probe.torch_support import check_torch

        check_torch()  # an unsupported torch: a ProbeError naming what it lacks, here, not in a forward
    module = importlib.import_module(where)
    value = module if name == "variants" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from probe.experiment import variants
    from probe.call import AttentionCall
    from probe.experiment.compare import compare
    from probe.errors import ProbeError
    from probe.errors import StabilityError
    from probe.experiment.qk_clip import qk_clip
    from probe.experiment.scaling import scaling
    from probe.session.profiler import Probe
    from probe.session.profiler import watch
    from probe.summary import Summary
    from probe.ci.thresholds import Violation
    from probe.ci.thresholds import assert_stable
    from probe.ci.thresholds import check
