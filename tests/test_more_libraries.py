"""A lean subset of the survey's libraries (issue 25), each checked by values: every site found,
named, verified against the model's own computation, its entropy / max_prob / saturation within
1e-4 of what the model computed (float64, from its own probabilities or SDPA arguments), and every
problem named by a warning. A library that is not installed skips its test.

The whole set, with more configurations: ``benchmarks/coverage_survey.py --only more``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

_SURVEY = Path(__file__).resolve().parent.parent / "benchmarks" / "coverage_survey.py"


def _survey() -> Any:
    spec = importlib.util.spec_from_file_location("coverage_survey_lean", _SURVEY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(library: str, name: str, problems_allowed: int = 0) -> dict:
    pytest.importorskip(library)
    survey = _survey()
    cases = {case[0]: case for case in (survey.hf_cases() if name.startswith("hf/") else survey.more_cases())}
    case = cases[name]
    result = survey.check(*case, quiet=True)
    assert result is not None, f"{name} could not be built"
    assert result["silent"] == 0, result["problems"]
    assert result["captured"] == result["sites"] > 0, result["problems"]
    assert result["verified"] == result["sites"], result["problems"]
    assert result["values_checked"] == result["sites"], "every site checked by values"
    assert not any("values:" in p for p in result["problems"]), result["problems"]
    assert result["bad"] <= problems_allowed, result["problems"]
    return result


def test_diffusers_unet_with_the_eager_attention_processor():
    _run("diffusers", "diffusers/unet/eager")


def test_peft_lora_on_a_frozen_llama_names_the_frozen_k():
    result = _run("peft", "peft/lora_llama/sdpa", problems_allowed=1)  # named: grad_k (the scale is known)
    assert any(p.startswith("base_model.model.model.layers.0.self_attn:") and "no grad_k" in p
               for p in result["problems"]), result["problems"]
    assert not any("scale" in p for p in result["problems"]), result["problems"]  # LoRA's factor: its projection's


def test_fair_esm_esm2():
    _run("esm", "fair-esm/esm2")


def test_perceiver_pytorch():
    _run("perceiver_pytorch", "perceiver-pytorch/perceiver")


@pytest.mark.parametrize("name", ["hf/llama/eager/left-padded", "hf/llama/sdpa/left-padded",
                                  "hf/bert/sdpa/right-padded", "hf/t5/eager/right-padded"])
def test_hugging_face_padded_batches(name):
    # left padding gives a causal model query rows that see no key: Hugging Face's eager attention
    # spreads them uniformly (not counted: docs/metrics.md), its SDPA path unmasks them (counted)
    _run("transformers", name)
