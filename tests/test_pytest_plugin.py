"""The pytest plugin end to end, through pytester: fixture, marker, config, --probe-logdir, summary."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

# A two-block model whose per-head query gains make head 1 of blocks.1 collapse (unscaled SDPA).
MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class Attn(nn.Module):
    def __init__(self, gains):
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.k = nn.Linear(16, 16)
        with torch.no_grad():
            self.q.weight.mul_(torch.tensor(gains).repeat_interleave(8)[:, None])

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 2, 8).transpose(1, 2)
        k = self.k(x).view(b, n, 2, 8).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, k, scale=1.0)
        return x + y.transpose(1, 2).reshape(b, n, 16)


class Net(nn.Module):
    def __init__(self, gain):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Attn([1.0, 1.0]), Attn([1.0, gain])])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def batch():
    return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))


class NoAttention(nn.Module):
    def forward(self, x):
        return x * 2
'''

HEALTHY, COLLAPSED = 0.05, 40.0


def _reference_logit_max(gain):
    """Per-site, per-head max of q·kᵀ (scale 1) in float64, written plainly."""
    ns: dict = {}
    exec(MODEL, ns)
    net, x = ns["Net"](gain).requires_grad_(False), ns["batch"]().double()
    out = {}
    for i, block in enumerate(net.blocks):
        q = x @ block.q.weight.double().T + block.q.bias.double()
        k = x @ block.k.weight.double().T + block.k.bias.double()
        heads = []
        for h in range(2):
            qh, kh = q[..., 8 * h: 8 * h + 8], k[..., 8 * h: 8 * h + 8]
            heads.append(max(float(qh[b, r] @ kh[b, c]) for b in range(2) for r in range(6) for c in range(6)))
        out[f"blocks.{i}"] = heads
        y = torch.nn.functional.scaled_dot_product_attention(
            q.view(2, 6, 2, 8).transpose(1, 2), k.view(2, 6, 2, 8).transpose(1, 2),
            k.view(2, 6, 2, 8).transpose(1, 2), scale=1.0)
        x = x + y.transpose(1, 2).reshape(2, 6, 16)
    return out


def _test_file(pytester, body, name="test_model"):
    pytester.makepyfile(**{"model_src": MODEL, name: "import pytest, torch\nfrom model_src import Net, NoAttention, batch\n\n" + body})


def test_passing_model_and_the_session_summary(pytester):
    _test_file(pytester, f'''
def test_ok(attention_probe):
    net = Net({HEALTHY})
    with attention_probe(net) as p:
        net(batch()).sum().backward()
    assert p.summary().sites == ["blocks.0", "blocks.1"]
    assert attention_probe.violations == [] and len(attention_probe.summaries) == 1
''')
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*probe: worst attention heads*", "test*site*head*metric@scale*value*limit*",
                                 "test_model.py::test_ok*blocks.*logit_max@actual*< 100*ok"])


def test_failing_model_names_site_head_metric_value_limit(pytester):
    ref = _reference_logit_max(COLLAPSED)
    assert ref["blocks.1"][1] > 100 > max(ref["blocks.0"] + ref["blocks.1"][:1])
    _test_file(pytester, f'''
def test_collapsed(attention_probe):
    net = Net({COLLAPSED})
    with attention_probe(net, grads=False):
        net(batch())
''')
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    value = ref["blocks.1"][1]
    lines = [ln for ln in result.stdout.lines if ln.startswith("E ") and "blocks.1" in ln]
    assert len(lines) == 1, result.stdout.str()
    cells = lines[0][1:].split()
    assert cells[:3] == ["blocks.1", "1", "logit_max@actual"]
    assert float(cells[3]) == pytest.approx(value, rel=1e-4)
    assert cells[4:6] == ["<", "100"]
    result.stdout.fnmatch_lines(["*StabilityError: 1 attention stability violation (worst first; thresholds from the defaults)*",
                                 "*test_model.py::test_collapsed*blocks.1*1*logit_max@actual*FAIL*"])


def test_marker_overrides_per_test(pytester):
    ref = _reference_logit_max(HEALTHY)
    strict = 0.5 * max(ref["blocks.0"])  # below the healthy model's largest logit
    _test_file(pytester, f'''
@pytest.mark.probe(thresholds=["logit_max < 1e6", "nonfinite <= 0"])
def test_relaxed(attention_probe):
    net = Net({COLLAPSED})
    with attention_probe(net, grads=False):
        net(batch())

@pytest.mark.probe("blocks.0:logit_max < {strict!r}")
def test_strict(attention_probe):
    net = Net({HEALTHY})
    with attention_probe(net, grads=False):
        net(batch())

@pytest.mark.probe(thresholds=["blocks.0:logit_max < 1e6"])
def test_call_beats_marker(attention_probe):
    net = Net({HEALTHY})
    with attention_probe(net, thresholds=["blocks.1:logit_max < {strict!r}"], grads=False):
        net(batch())
''')
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*thresholds from @pytest.mark.probe*", "E *blocks.0 *logit_max@actual*"])
    result.stdout.fnmatch_lines(["*thresholds from the attention_probe call*", "E *blocks.1 *logit_max@actual*"])


def test_config_in_setup_cfg_nearest_to_the_test_file_wins(pytester):
    pytester.makefile(".cfg", setup="[tool:probe]\nthresholds =\n    entropy@unscaled > 0.999\n")
    body = f'''
def test_cfg(attention_probe):
    net = Net({HEALTHY})
    with attention_probe(net, grads=False):
        net(batch())
'''
    _test_file(pytester, body)
    sub = pytester.mkpydir("sub")
    (sub / "setup.cfg").write_text("[tool:probe]\nthresholds = logit_max < 1e6\n")
    (sub / "test_sub.py").write_text("import pytest, torch\nfrom model_src import Net, batch\n" + body)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["FAILED test_model.py::test_cfg*"])
    result.stdout.fnmatch_lines([f"*thresholds from {pytester.path / 'setup.cfg'}*", "E *blocks.*entropy@unscaled*> 0.999*"])


def test_probe_logdir_writes_one_run_per_test(pytester, tmp_path):
    logdir = tmp_path / "runs"
    _test_file(pytester, f'''
@pytest.mark.parametrize("n", [1, 2])
def test_logged(attention_probe, n):
    net = Net({HEALTHY})
    for _ in range(n):
        with attention_probe(net, grads=False):
            net(batch())
''')
    result = pytester.runpytest("--probe-logdir", str(logdir))
    result.assert_outcomes(passed=2)
    runs = sorted(os.listdir(logdir))
    assert runs == ["test_model.py_test_logged_1", "test_model.py_test_logged_2",
                    "test_model.py_test_logged_2-2"]
    for run in runs:
        files = os.listdir(logdir / run)
        assert any(f.startswith("events.out.tfevents") for f in files)
        data = json.loads((logdir / run / "probe_summary.json").read_text())
        got = data["sites"]["blocks.0"]["metrics"]["logit_max"]["actual"]
        np.testing.assert_allclose(got, _reference_logit_max(HEALTHY)["blocks.0"], rtol=1e-4)
    result.stdout.fnmatch_lines([f"TensorBoard runs: tensorboard --logdir {logdir}"])


def test_bad_input_is_never_a_pass(pytester):
    _test_file(pytester, f'''
@pytest.mark.probe(thresholds=["logit_max =< 3"])
def test_bad_marker(attention_probe):
    attention_probe(Net({HEALTHY}))

@pytest.mark.probe(thresholds=[])
def test_empty_marker(attention_probe):
    attention_probe(Net({HEALTHY}))

def test_nothing_probed(attention_probe):
    model = NoAttention()
    with attention_probe(model):
        model(batch())

def test_grads_of_inference(attention_probe):
    net = Net({HEALTHY})
    with attention_probe(net, thresholds=["grad_q < 1e9"], grads=False):
        net(batch())

def test_block_raises(attention_probe):
    net = Net({COLLAPSED})
    with attention_probe(net) as p:
        net(batch())
        raise KeyError("from the test")
''')
    result = pytester.runpytest()
    result.assert_outcomes(failed=5)
    out = result.stdout.str()
    assert "at position 10: unsupported operator" in out
    assert "at least one expression" in out
    assert "summary is empty" in out
    assert "no metric 'grad_q'" in out
    assert "KeyError: 'from the test'" in out and "StabilityError" not in out  # the test's own error


def test_inert_when_unused(pytester):
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)
    assert "probe:" not in result.stdout.str()


def test_hooks_removed_after_a_failing_block(pytester):
    _test_file(pytester, f'''
NETS = []

def test_fails(attention_probe):
    NETS.append(Net({COLLAPSED}))
    with attention_probe(NETS[0], grads=False):
        NETS[0](batch())

def test_clean_afterwards():
    from torch.overrides import _get_current_function_mode_stack
    assert len(NETS) == 1
    leftover = [n for n, m in NETS[0].named_modules() if m._forward_hooks or m._forward_pre_hooks]
    assert leftover == [] and not _get_current_function_mode_stack()
''')
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)


def test_the_shipped_ci_example(pytester):
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "ci")
    for name in ("test_attention_stability.py", "setup.cfg"):
        with open(os.path.join(example, name), encoding="utf-8") as f:
            (pytester.path / name).write_text(f.read())
    result = pytester.runpytest("--runxfail")  # the demonstration of a collapsed head must really fail
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        f"*thresholds from {pytester.path / 'setup.cfg'}*",
        "E *blocks.1  2     logit_max@actual  1*< 100*",
        "E *blocks.1  2     entropy@actual*> 0.05*",
        "FAILED test_attention_stability.py::test_a_collapsed_head_fails*",
    ])


def test_loading_the_plugin_imports_no_torch():
    """Every pytest session of an environment with probe installed loads the plugin: it must not
    pay torch's import time unless a test uses probe."""
    import subprocess
    import sys

    code = "import sys, probe, probe.ci.pytest_plugin; assert 'torch' not in sys.modules, 'torch imported'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
