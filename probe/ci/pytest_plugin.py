"""pytest plugin: assert attention stability in a test (entry point ``pytest11``: ``probe``).

Use the ``attention_probe`` fixture; when the ``with`` block exits, the thresholds are asserted::

    def test_attention_is_stable(attention_probe):
        model = build_model()
        with attention_probe(model):
            model(batch).loss.backward()

Thresholds, first found wins: ``attention_probe(model, thresholds=[...])``, the test's marker
``@pytest.mark.probe(thresholds=[...])`` (or ``@pytest.mark.probe("logit_max < 50", ...)``), the
``[tool:probe]`` section of ``pytest.ini`` / ``tox.ini`` / ``setup.cfg`` (``[tool.probe]`` of
``pyproject.toml``) found from the test file's directory upward, then the defaults
(``logit_max < 100``, ``nonfinite <= 0``). ``--probe-logdir DIR`` writes each block's TensorBoard
run and ``probe_summary.json`` under ``DIR/<test id>``; a terminal summary section lists the heads
closest to (or past) their limits across the session.

Inert until used: the hooks below only add an option, register the marker and, at the end, print
a section if the fixture ran; nothing is watched, read or written unless the fixture is called.
Loading this module imports neither torch nor the rest of probe (``probe/__init__.py`` resolves
its names lazily); ``-p no:probe`` turns the plugin off entirely. The session summary is per process: under pytest-xdist each worker keeps its
own and the controller prints none.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from probe.session.profiler import Probe
    from probe.summary import Summary
    from probe.ci.thresholds import Threshold, Violation

__all__ = ["AttentionProbe", "attention_probe"]

#: (test id, Violation) of every judged head, kept worst first, a few per block.
_RECORDS = pytest.StashKey[List[Tuple[str, "Violation"]]]()
_KEEP_PER_BLOCK = 10
_SHOW = 10


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("probe", "attention stability (probe)")
    group.addoption(
        "--probe-logdir",
        metavar="DIR",
        default=None,
        help="write the TensorBoard run and probe_summary.json of each attention_probe block under DIR/<test id>",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "probe(*thresholds, thresholds=[...]): stability thresholds the attention_probe fixture asserts in "
        "this test, instead of [tool:probe] or the defaults",
    )


def _sanitize(nodeid: str) -> str:
    """A test id as one directory name: ``tests/test_a.py::test_x[1]`` -> ``tests_test_a.py_test_x_1``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_.") or "test"


class _Block:
    """One ``with attention_probe(model):`` block: watches on enter, checks on exit."""

    def __init__(self, owner: "AttentionProbe", model: Any, thresholds: List["Threshold"], source: str,
                 kwargs: Dict[str, Any]) -> None:
        self._owner, self._model, self._thresholds, self._source = owner, model, thresholds, source
        self._kwargs = kwargs
        self.probe: Optional["Probe"] = None

    def __enter__(self) -> "Probe":
        import probe

        self.probe = probe.watch(self._model, **self._kwargs)
        self._owner._open.append(self.probe)
        return self.probe

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        __tracebackhide__ = True  # pytest shows the user's `with` line, not probe's frames
        p = self.probe
        if p is None:  # __exit__ without __enter__
            return False
        p.close()
        if exc_type is not None:  # the block failed on its own: report that, not a stability verdict
            return False
        self._owner._finish(p.summary(), self._thresholds, self._source)
        return False


class AttentionProbe:
    """The ``attention_probe`` fixture: ``with attention_probe(model, **watch_kwargs) as p:``.

    Attributes:
        summaries: the :class:`probe.Summary` of each finished block, in order.
        violations: the violations of the last finished block (empty when it passed).
    """

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self._open: List["Probe"] = []
        self._blocks = 0
        self.summaries: List["Summary"] = []
        self.violations: List["Violation"] = []

    def __call__(self, model: Any, *, thresholds: Optional[Sequence[str]] = None, **watch_kwargs: Any) -> _Block:
        """A context manager that runs ``model`` under :func:`probe.watch` (``watch_kwargs``
        forwarded) and asserts the thresholds when the block exits without an exception.

        Raises:
            probe.ProbeError: bad thresholds or config, at this call (before the model runs).
        """
        rules, source = self._resolve(thresholds)
        self._blocks += 1
        logdir = self._request.config.getoption("--probe-logdir")
        if logdir is not None and "logdir" not in watch_kwargs:
            name = _sanitize(self._request.node.nodeid)
            if self._blocks > 1:
                name += f"-{self._blocks}"
            watch_kwargs["logdir"] = os.path.join(logdir, name)
        return _Block(self, model, rules, source, watch_kwargs)

    def _resolve(self, thresholds: Optional[Sequence[str]]) -> Tuple[List["Threshold"], str]:
        from probe.ci.thresholds import as_thresholds, load_thresholds

        if thresholds is not None:
            return as_thresholds(thresholds), "the attention_probe call"
        marker = self._request.node.get_closest_marker("probe")
        if marker is not None and (marker.args or "thresholds" in marker.kwargs):
            given = marker.kwargs.get("thresholds", marker.args)
            return as_thresholds(given), "@pytest.mark.probe"
        # from the test file's directory upward: the nearest config wins, even when pytest's
        # rootdir is a parent (a monorepo, or examples/ inside a project)
        rules, path = load_thresholds(start=str(self._request.path.parent))
        return rules, path or "the defaults"

    def _finish(self, summary: "Summary", rules: List["Threshold"], source: str) -> None:
        __tracebackhide__ = True
        from probe.errors import StabilityError
        from probe.ci.thresholds import evaluate, format_table

        self.summaries.append(summary)
        judged = sorted(evaluate(summary, rules), key=lambda v: -v.excess)
        records = self._request.config.stash.setdefault(_RECORDS, [])
        # a count within its limit (nonfinite 0 <= 0) says nothing about how close a head came
        shown = [v for v in judged if not (v.ok and v.metric == "nonfinite")]
        records.extend((self._request.node.nodeid, v) for v in shown[:_KEEP_PER_BLOCK])
        self.violations = [v for v in judged if not v.ok]
        if self.violations:
            n = len(self.violations)
            raise StabilityError(
                f"{n} attention stability violation{'s' if n != 1 else ''} (worst first; thresholds from "
                f"{source}):\n{format_table(self.violations)}"
            )

    def _close_all(self) -> None:
        for p in self._open:
            p.close()  # safe twice; a block left without exiting must not leave hooks behind
        self._open = []


@pytest.fixture
def attention_probe(request: pytest.FixtureRequest) -> Any:
    """Run a model under probe and assert stability thresholds when the ``with`` block exits.

    Example:
        >>> @pytest.mark.probe(thresholds=["logit_max < 50", "entropy > 0.05"])
        ... def test_stable(attention_probe):
        ...     with attention_probe(model, grads=False):
        ...         model(x)
    """
    fixture = AttentionProbe(request)
    try:
        yield fixture
    finally:
        fixture._close_all()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    records = config.stash.get(_RECORDS, None)
    if not records:
        return
    from probe.ci.thresholds import format_value

    worst = sorted(records, key=lambda r: -r[1].excess)[:_SHOW]
    tr = terminalreporter
    tr.write_sep("=", "probe: worst attention heads (closest to or past their limits)")
    rows = [("test", "site", "head", "metric@scale", "value", "limit", "")]
    for nodeid, v in worst:
        rows.append((nodeid, v.site, "agg" if v.head is None else str(v.head), f"{v.metric}@{v.scale}",
                     format_value(v.value), f"{v.op} {v.limit:g}", "ok" if v.ok else "FAIL"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        tr.write_line("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    logdir = config.getoption("--probe-logdir")
    if logdir is not None:
        tr.write_line(f"TensorBoard runs: tensorboard --logdir {logdir}")
