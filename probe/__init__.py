"""probe: see, and guard in CI, what the 1/sqrt(d_k) scaling in attention does to your model."""

from probe.call import AttentionCall
from probe.compare import compare
from probe.errors import ProbeError
from probe.errors import StabilityError
from probe.intervene import scaling
from probe.profiler import Probe
from probe.profiler import watch
from probe.summary import Summary
from probe.thresholds import Violation
from probe.thresholds import assert_stable
from probe.thresholds import check

from probe import variants  # submodule: probe.variants.headwise, probe.variants.scale_bias

__version__ = "0.1.0"

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
    "scaling",
    "watch",
]
