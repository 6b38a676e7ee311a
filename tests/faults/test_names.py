"""Site names a model may give its modules: `/`, newline, `|`, ANSI escapes, `%`.

The summary keeps the raw names; TensorBoard tags encode them (so `a/head03` stays one site and
a newline cannot break the writer); tables and terminal output show control characters escaped.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch
from torch import nn

import probe
from probe.cli.main import main
from probe.names import decode_name, encode_name, printable
from probe.ci.runs import load_run
from probe.sinks.tags import parse_scalar_tag, scalar_tag
from tests.helpers import SDPAAttention

NAMES = ["a/head03", "a", "new\nline", "pipe|name", "red\x1b[31mX\x1b[0m", "100%", "tab\tand space"]


class Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name in NAMES:
            self.add_module(name, SDPAAttention(d_model=16, heads=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(getattr(self, name)(x) for name in NAMES)


def _run(logdir):
    torch.manual_seed(0)
    model = Named()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sink failure (e.g. the writer rejecting a tag) warns
        with probe.watch(model, logdir=str(logdir), per_head=True) as p:
            for _ in range(2):
                model(torch.randn(2, 5, 16)).sum().backward()
    return p.summary()


def test_encoding_round_trips_and_parses():
    for name in NAMES + ["%2F", "x%", "%%41"]:
        assert decode_name(encode_name(name)) == name
        assert "/" not in encode_name(name) and "\n" not in encode_name(name)
        tag = parse_scalar_tag(scalar_tag("entropy", "actual", name, 3))
        assert (tag.metric, tag.scale, tag.site, tag.head) == ("entropy", "actual", name, 3)
    assert printable("red\x1b[31mX\nY") == "red\\x1b[31mX\\nY"


def test_summary_keeps_raw_names_and_events_read_back_the_same_sites(tmp_path):
    summary = _run(tmp_path)
    assert summary.sites == NAMES
    assert probe.Summary.load(tmp_path).sites == NAMES
    os.remove(tmp_path / "probe_summary.json")
    events, source = load_run(str(tmp_path))
    assert source == "tensorboard" and sorted(events.sites) == sorted(NAMES)  # no phantom site `a` head 3
    for site in NAMES:
        assert events.info(site)["heads_aggregated"] is False
        np.testing.assert_allclose(events.value(site, "logit_max"), summary.value(site, "logit_max"), rtol=1e-5)


def test_tables_and_terminal_show_names_escaped(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(tmp_path)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    table = acc.Tensors("probe.sites/text_summary")[-1].tensor_proto.string_val[0].decode()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "sdpa" in line]
    assert len(rows) == len(NAMES)  # the newline did not split a row
    assert all(row.count(" | ") == 8 for row in rows)  # `|` escaped as `\|` (9 columns: verified, not measured)
    assert "| pipe\\|name |" in table and "new\\nline" in table and "\x1b" not in table

    assert main(["report", str(tmp_path)]) == 0
    assert main(["check", str(tmp_path), "-t", "logit_max < 0"]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "red\\x1b[31mX\\x1b[0m" in out and "new\\nline" in out
    assert "new\nline" not in out and "tab\tand" not in out
