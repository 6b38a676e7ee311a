"""The registration list of capture front ends: every probe routes attention through these."""

from __future__ import annotations

from typing import List, Tuple, Type

from probe.capture.eager import EagerFrontEnd
from probe.capture.flex import FlexFrontEnd
from probe.capture.frontend import FrontEnd
from probe.capture.mha import MHAFrontEnd
from probe.capture.sdpa import SDPAFrontEnd

__all__ = ["FRONT_ENDS", "default_frontends"]

#: Every front end, one instance per probe (they keep per-forward state). Adding a front end:
#: one file under probe/capture/, one entry here, one case in tests/capture/test_conformance.py.
FRONT_ENDS: Tuple[Type[FrontEnd], ...] = (SDPAFrontEnd, EagerFrontEnd, MHAFrontEnd, FlexFrontEnd)


def default_frontends() -> List[FrontEnd]:
    """Fresh instances of :data:`FRONT_ENDS`; SDPA asks the eager front end for a scalar
    factor applied to q or k before the call (``q_proj(h) * s`` then ``scale=1``: OPT, Whisper)."""
    frontends = [cls() for cls in FRONT_ENDS]
    eager = next((f for f in frontends if isinstance(f, EagerFrontEnd)), None)
    for f in frontends:
        if isinstance(f, SDPAFrontEnd) and eager is not None:
            f.prescaled = eager.prescaled
    return frontends
