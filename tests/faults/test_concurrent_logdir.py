"""Two runs open at once with the same ``logdir`` (a teacher and a student, two models of one
script): the second one starts before the first has written anything there, and must still not
write into the first one's directory (one summary would overwrite the other)."""

from __future__ import annotations

import json

import pytest

import probe
from probe.summary import SUMMARY_FILE
from tests.sinks.sinkutil import model_and_inputs, train_step


def test_a_run_opened_while_another_writes_to_the_same_logdir_goes_to_a_fresh_one(tmp_path):
    first, xs = model_and_inputs(3)
    second, _ = model_and_inputs(3)
    logdir = tmp_path / "exp"
    p1 = probe.watch(first, logdir=logdir, grads=False)
    with pytest.warns(RuntimeWarning, match=r"exp-2"):
        p2 = probe.watch(second, logdir=logdir, grads=False)
    with pytest.warns(RuntimeWarning, match=r"exp-3"):  # neither exp nor exp-2 holds a file yet
        probe.watch(second, logdir=logdir, grads=False).close()
    for x in xs:
        train_step(first, x)
    train_step(second, xs[0])
    p1.close()
    p2.close()
    assert json.loads((logdir / SUMMARY_FILE).read_text())["steps"] == 3
    assert json.loads((tmp_path / "exp-2" / SUMMARY_FILE).read_text())["steps"] == 1



@pytest.mark.parametrize("given", [".", "./", "sub/.."])
def test_a_run_in_the_current_directory_goes_to_a_sibling_named_after_it(tmp_path, monkeypatch, given):
    from probe.ci.runs import fresh_logdir

    run = tmp_path / "exp"
    (run / "sub").mkdir(parents=True)
    (run / SUMMARY_FILE).write_text("{}")
    monkeypatch.chdir(run)
    with pytest.warns(RuntimeWarning, match="exp-2"):
        assert fresh_logdir(given) == str(tmp_path / "exp-2")  # not '.-2', a hidden directory inside it
