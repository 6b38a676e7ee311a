"""examples/custom_sink.py runs and its user sink sees what the summary holds."""

from __future__ import annotations

import os
import runpy


def test_custom_sink_example_runs(capsys):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    module = runpy.run_path(os.path.join(root, "examples", "custom_sink.py"))
    module["main"]()
    out = capsys.readouterr().out
    assert "step 0: site '0' heads" in out and "collapsed" in out
    assert "JSON Lines:" in out and "(220 records)" in out  # 5 steps × 2 sites × 22 metric/scale pairs
    assert "Summary(2 sites, 5 steps)" in out
