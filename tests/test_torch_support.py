"""An unsupported PyTorch fails at the first public name or command, with a ProbeError naming
what it lacks; the supported one passes. Old torch is simulated by removing the features."""

import subprocess
import sys

import pytest
import torch

import probe
from probe import torch_support
from probe.cli.main import main
from probe.errors import ProbeError


@pytest.fixture
def old_torch(monkeypatch):
    """This torch, dressed as 2.4.1: no set_stance, no enable_gqa in SDPA's docstring."""
    monkeypatch.setattr(torch_support, "_checked", None)
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    monkeypatch.delattr(torch.compiler, "set_stance")
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _sdpa_without_gqa)
    monkeypatch.delitem(probe.__dict__, "watch", raising=False)
    monkeypatch.delitem(probe.__dict__, "scaling", raising=False)
    yield
    monkeypatch.setattr(torch_support, "_checked", None)


def _sdpa_without_gqa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None)"""
    raise AssertionError("not called")


def test_the_installed_torch_is_supported():
    assert torch_support.parse_version(torch.__version__) >= torch_support.MINIMUM
    assert torch_support.missing_features() == []
    torch_support.check_torch()


def test_declared_minimum_matches_setup_cfg():
    import configparser
    import os

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.cfg"))
    requires = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
    major, minor = torch_support.MINIMUM
    assert f"torch>={major}.{minor}" in requires


@pytest.mark.parametrize("text, expected", [("2.6.0+cu124", (2, 6)), ("2.13.0+cpu", (2, 13)), ("2.10.0a0+git1", (2, 10)),
                                            ("3.0", (3, 0)), ("garbage", (0, 0))])
def test_parse_version(text, expected):
    assert torch_support.parse_version(text) == expected


def test_old_torch_fails_at_the_first_public_name_naming_what_is_missing(old_torch):
    with pytest.raises(ProbeError) as info:
        probe.watch  # noqa: B018 - the attribute access is what is tested
    message = str(info.value)
    assert "PyTorch >= 2.6" in message and "found torch 2.4.1+cu121" in message
    assert "torch.compiler.set_stance (PyTorch 2.6; for sampled steps of torch.compile'd models)" in message
    assert "enable_gqa= in F.scaled_dot_product_attention (PyTorch 2.5" in message
    assert "pip install 'torch>=2.6'" in message
    with pytest.raises(ProbeError):  # `from probe import x` raises the same error, not an ImportError
        from probe import scaling  # noqa: F401
    assert probe.ProbeError is ProbeError  # the error itself stays reachable, to be caught


def test_a_version_string_alone_below_the_minimum_fails(monkeypatch):
    monkeypatch.setattr(torch_support, "_checked", None)
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(ProbeError, match=r"found torch 2\.5\.1"):
        torch_support.check_torch()


def test_old_torch_fails_the_command_line_with_exit_2(old_torch, capsys):
    assert main(["demo", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("probe: error: probe needs PyTorch >= 2.6") and "set_stance" in err


def test_import_probe_stays_torch_free_and_version_is_readable():
    code = "import sys, probe; print(probe.__version__); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == [probe.__version__, "False"]


def test_every_public_name_resolves_in_a_fresh_interpreter():
    # probe.coverage(model, ...) is what README, docs/models.md and probe's own warnings tell users
    # to call: the function, not its module
    code = ("import probe, torch; [getattr(probe, n) for n in probe.__all__]; "
            "r = probe.coverage(torch.nn.MultiheadAttention(8, 2, batch_first=True), *[torch.randn(1, 3, 8)] * 3); "
            "print(type(r).__name__, len(r.rows))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["Coverage", "1"]


def test_version_has_one_source(capsys):
    import configparser
    import os

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.cfg"))
    assert cfg["metadata"]["version"] == "attr: probe.__version__"  # the wheel's version is read from probe
    assert cfg["metadata"]["name"] == "attention-probe"
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"probe {probe.__version__} (attention-probe)"
