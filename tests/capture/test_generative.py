"""A generative test (issue 25): attention implementations drawn at random from a grammar of the
ways real code spells them (``tests/capture/grammar.py``), each checked against float64 from its
own probabilities and its unscaled q, k: measured exactly, or named in a warning, never silently
wrong; outputs and gradients bitwise unchanged. Seeded; ``benchmarks/generative.py`` runs
thousands and prints the counts."""

from __future__ import annotations

import warnings
from typing import List, Tuple

import pytest
import torch

import probe
from tests.capture.grammar import Program, Spec, draw, inputs, judge

PROGRAMS = 240
PER_TEST = 40


def run_program(spec: Spec) -> Tuple[str, str]:
    """Run one program bare and under probe; assert outputs and gradients are bitwise the same;
    return the outcome of :func:`~tests.capture.grammar.judge`."""
    torch.manual_seed(spec.seed)
    model = Program(spec)
    x, mask = inputs(spec)
    torch.manual_seed(spec.seed)
    bare = model(x, mask)
    bare.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            torch.manual_seed(spec.seed)
            out = model(x, mask)
            out.sum().backward()
        summary = p.summary()
    assert torch.equal(out, bare), spec
    assert all(torch.equal(a.grad, b) for a, b in zip(model.parameters(), grads)), spec
    warned = [str(w.message) for w in caught if "probe" in str(w.message)]
    return judge(summary, model.truth, warned)


@pytest.mark.parametrize("start", range(0, PROGRAMS, PER_TEST))
def test_no_program_is_silently_wrong(start: int) -> None:
    """Every program is measured exactly, or named; one that applies no op probe does not model
    (``Spec.hazardous``) is measured exactly."""
    wrong: List[str] = []
    for seed in range(start, start + PER_TEST):
        spec = draw(seed)
        outcome, detail = run_program(spec)
        if outcome == "silent" or (outcome != "exact" and not spec.hazardous):
            wrong.append(f"{outcome}: {spec}: {detail}")
    assert not wrong, "\n".join(wrong)


def test_the_grammar_reaches_every_choice() -> None:
    from tests.capture.grammar import CHOICES

    seen = {name: set() for name in CHOICES}
    for seed in range(PROGRAMS):
        spec = draw(seed)
        for name in CHOICES:
            seen[name].add(str(getattr(spec, name)))
    for name, options in CHOICES.items():
        assert seen[name] == set(map(str, options)), (name, set(map(str, options)) - seen[name])


def test_hazards_are_named() -> None:
    """A program with an op probe does not model on q, k or the scores after the factor is never
    reported at a counterfactual scale: the site is named (scale unknown)."""
    hazards = [draw(seed) for seed in range(1000, 1400) if draw(seed).hazardous][:12]
    assert len(hazards) >= 10
    for spec in hazards:
        assert run_program(spec)[0] in ("named", "exact"), spec  # exact: the op changed nothing probe reports
