"""A tensor computed from another one passed to the same attention shares its gradient.

``q = queries.repeat(B, 1, 1)``, ``k = x.transpose(-1, -2)``, ``v = x`` (vit-pytorch's
``PatchMerger`` with its queries repeated per batch row): autograd's gradient of x holds k's (its
view) and v's, so grad_v was reported as their sum (1.4x here) without a word. It is now named,
like a tensor passed as two of q, k, v.
"""

from __future__ import annotations

import warnings
from typing import List, Tuple

import torch
from torch import Tensor, nn

import probe

B, T, D, N, H = 2, 9, 16, 4, 2
SCALE = D ** -0.5


def _run(model: nn.Module, x: Tensor) -> Tuple[object, List[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1, rows=None) as p:
            model(x).backward()
        s = p.summary()
    return s, [str(w.message) for w in caught]



def test_k_a_view_of_v_names_grad_v() -> None:
    """``q = queries.repeat(B, 1, 1)`` was measured before learned queries (an activation), with
    grad_v the gradient of x: v's and k's (``xᵀ``) summed, 1.4x the true value here."""
    class Repeated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.queries = nn.Parameter(torch.randn(N, D))

        def forward(self, x: Tensor) -> Tensor:
            q = self.queries.repeat(x.shape[0], 1, 1)
            return torch.matmul((q @ x.transpose(-1, -2) * SCALE).softmax(-1), x).square().sum()

    torch.manual_seed(0)
    s, caught = _run(Repeated(), torch.randn(B, T, D, requires_grad=True))
    assert "grad_v" in s.info("root").get("not_measured", {}), s.info("root")
    assert any("grad_v" in w and "computed from the tensor passed as v" in w for w in caught), caught
