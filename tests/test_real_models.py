"""The wider real-model set of issue 17, kept apart from README's test command (it builds about 140
models from real libraries and compiles FlexAttention: minutes, not seconds):

    PROBE_REAL_MODELS=1 python -m pytest -q tests/test_real_models.py
    PROBE_REAL_MODELS=1 PYTHONPATH=. /work/timm-venv/bin/python -m pytest -q tests/test_real_models.py  # timm

Without ``PROBE_REAL_MODELS`` every test here is skipped; a library that is not installed
(transformers, timm, x-transformers, vit-pytorch, rotary-embedding-torch) skips its cases.

The cases are those of ``benchmarks/coverage_survey.py`` (Hugging Face architectures from tiny
configs, eager and sdpa; nanoGPT / minGPT style, x-transformers, rotary-embedding-torch,
vit-pytorch; real timm models, fused and eager). Oracle per attention site: the independent
audit of :func:`probe.coverage` (found and named), the scale the model's own code uses, the
Hugging Face eager and sdpa runs agreeing, the values (entropy, max_prob, saturation within 1e-4
of what the model computed, in float64; probe's own check of each record), and grad_q / grad_k /
grad_v after a backward. No run may *silently* miss a site, misname one, misreport a scale or a
value or lose a gradient metric: every problem must be named by ``probe.watch``'s own warnings.
The libraries of ``benchmarks/survey_more.py`` (diffusers, peft, fair-esm, perceiver-pytorch,
flamingo-pytorch, reformer-pytorch) are the ``more`` cases.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any, List

import pytest
import torch
from torch import nn

import probe

ENABLED = bool(os.environ.get("PROBE_REAL_MODELS"))
pytestmark = pytest.mark.skipif(not ENABLED, reason="the wider real-model set runs apart: "
                                "PROBE_REAL_MODELS=1 python -m pytest tests/test_real_models.py")

_SURVEY = Path(__file__).resolve().parent.parent / "benchmarks" / "coverage_survey.py"


def _survey() -> Any:
    spec = importlib.util.spec_from_file_location("coverage_survey", _SURVEY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SURVEY = _survey() if ENABLED else None


def _cases(group: str) -> List[Any]:
    if SURVEY is None:
        return [pytest.param(None, None, None, id="disabled")]
    try:
        return [pytest.param(*case, id=case[0]) for case in getattr(SURVEY, f"{group}_cases")()]
    except ImportError:
        return [pytest.param(None, None, None, id=f"{group}-not-installed",
                             marks=pytest.mark.skip(reason=f"{group}: library not installed"))]


def _check(name: str, build: Any, expected: Any) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = SURVEY.check(name, build, expected, quiet=True)
    if result is None:
        pytest.skip(f"{name}: could not be built (or fails by itself) with this library version")
    return result


def _hf_pairs() -> List[Any]:
    cases = _cases("hf")
    if cases[0].values[0] is None:  # disabled, or transformers not installed
        return [pytest.param(None, id=cases[0].id, marks=cases[0].marks)]
    by_model: dict = {}
    for case in cases:
        by_model.setdefault(case.values[0].rsplit("/", 1)[0], []).append(case.values)
    return [pytest.param(runs, id=model) for model, runs in by_model.items()]


@pytest.mark.parametrize("runs", _hf_pairs())
def test_hugging_face_no_silent_problem(runs: Any) -> None:
    # eager and sdpa runs of one architecture, which must also report the same scale per site
    results = []
    for name, build, expected in runs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = SURVEY.check(name, build, expected, quiet=True)
        if r is not None:
            results.append(r)
    if not results:
        pytest.skip("not buildable with this transformers version")
    SURVEY._hf_parity(results)
    assert all(r["silent"] == 0 for r in results), [p for r in results for p in r["problems"]]


@pytest.mark.parametrize("name,build,expected", _cases("thirdparty") + _cases("more") + _cases("timm"))
def test_third_party_and_timm_no_silent_problem(name: str, build: Any, expected: Any) -> None:
    result = _check(name, build, expected)
    assert result["silent"] == 0, result["problems"]


def test_compiled_flex_attention_outputs() -> None:
    # torch.compile(flex_attention), as Hugging Face's flex_attention implementation calls it: a
    # sampled step runs flex's eager path (probe sets force_eager), an unsampled one the compiled
    # kernel. Each is bitwise the output of its own path; the two differ by float32 rounding,
    # within the bound docs/models.md states.
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx >= kv_idx

    def rel(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + (q_idx - kv_idx) * 0.1

    compiled = torch.compile(flex.flex_attention)

    class Model(nn.Module):
        def __init__(self, block_mask: Any) -> None:
            super().__init__()
            self.block_mask = block_mask

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return compiled(q, k, v, score_mod=rel, block_mask=self.block_mask)

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    block_mask = flex.create_block_mask(causal, None, None, 128, 128, device="cpu")
    model = Model(block_mask)
    with warnings.catch_warnings(), torch._inductor.config.patch(compile_threads=1):
        warnings.simplefilter("ignore")
        kernel = model(q, k, v)
        eager = flex.flex_attention(q, k, v, score_mod=rel, block_mask=block_mask)
        with probe.watch(model, every=2) as p:
            outs = [model(q, k, v) for _ in range(4)]
    assert torch.equal(outs[0], eager) and torch.equal(outs[2], eager)  # sampled: flex's eager path
    assert torch.equal(outs[1], kernel) and torch.equal(outs[3], kernel)  # unsampled: the compiled kernel
    assert float((outs[0] - kernel).abs().max()) <= 1e-5  # docs/models.md: float32 rounding, ~1e-6 here
    assert p.summary().info("root")["calls"] == 2
