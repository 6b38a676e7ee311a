"""The frameworks are optional: probe never imports them, the adapters say how to install them."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning", "keras", "tensorflow", "jax")


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_importing_probe_imports_no_framework() -> None:
    run = _run(
        "import sys, probe, probe.integrations\n"
        "probe.watch, probe.check, probe.Probe, probe.Summary\n"
        "import probe.session.profiler, probe.ci.thresholds, probe.sinks.tensorboard, probe.integrations._session\n"
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))\n"
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_a_missing_framework_names_the_extra_to_install() -> None:
    run = _run(
        "import sys\n"
        "sys.modules['transformers'] = None\n"
        "sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None\n"
        "for name in ('huggingface', 'lightning'):\n"
        "    try:\n"
        "        __import__('probe.integrations.' + name)\n"
        "    except ImportError as err:\n"
        "        print(err)\n"
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines == [
        "probe.integrations.huggingface needs transformers: pip install 'attention-probe[hf]'",
        "probe.integrations.lightning needs Lightning: pip install 'attention-probe[lightning]' (or pip install lightning)",
    ]
