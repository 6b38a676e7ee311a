"""A real ``tensorboard --logdir`` server serves every probe dashboard from what probe wrote."""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
from PIL import Image

import probe
from probe.metrics import head_reduce
from tests.sinks.sinkutil import model_and_inputs, reference_summary, train_step

STARTUP_S = 90  # two shared CPU cores: TensorBoard imports slowly when the machine is busy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base: str, route: str, **params) -> bytes:
    url = f"{base}/{route}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=20) as r:  # noqa: S310 - localhost only
        return r.read()


def _json(base: str, route: str, **params):
    return json.loads(_get(base, route, **params))


@pytest.fixture
def server(tmp_path):
    steps = 3
    model, xs = model_and_inputs(steps)
    with probe.watch(model, logdir=tmp_path / "run", per_head=True):
        for x in xs:
            train_step(model, x)
    refs = [reference_summary(model, [x]) for x in xs]
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path), "--host", "127.0.0.1",
         "--port", str(port), "--load_fast=false", "--reload_interval=1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tensorboard exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                # ready once the run's scalars have been loaded (the first reload is asynchronous)
                if "run" in _json(base, "data/plugin/scalars/tags"):
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tensorboard did not serve the run within {STARTUP_S} s")
            time.sleep(0.5)
        yield base, refs
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stderr.close()


def test_tensorboard_serves_scalars_images_histograms_layout_and_text(server):
    base, refs = server
    sites = refs[0].sites
    assert sites == ["layers.0", "layers.1"]

    # scalars: every head-summary and per-head tag, with each step's value
    tags = _json(base, "data/plugin/scalars/tags")["run"]
    for site in sites:
        for metric in refs[0].metrics(site):
            for scale in refs[0].scales(site, metric):
                tag = f"probe.{metric}@{scale}/{site}"
                assert tag in tags and f"{tag}/head03" in tags
    points = _json(base, "data/plugin/scalars/scalars", run="run", tag="probe.entropy@unscaled/layers.1")
    assert [p[1] for p in points] == [0, 1, 2]
    want = [head_reduce("entropy", r.value("layers.1", "entropy", "unscaled")) for r in refs]
    np.testing.assert_allclose([p[2] for p in points], want, rtol=1e-5)

    # images: one heatmap per metric and scale, on their cadence (first flush, last state at close)
    image_tags = _json(base, "data/plugin/images/tags")["run"]
    assert "probe.entropy.heatmap/unscaled" in image_tags and "probe.grad_q.heatmap/actual" in image_tags
    meta = _json(base, "data/plugin/images/images", run="run", tag="probe.saturation.heatmap/unscaled")
    assert [m["step"] for m in meta] == [0, 2]
    png = _get(base, "data/plugin/images/individualImage?" + meta[-1]["query"])
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG" and img.size[0] > 100 and img.size[1] > 100

    # histograms: all heads of all sites, with the images
    hist_tags = _json(base, "data/plugin/histograms/tags")["run"]
    assert "probe.logit_max.hist/standard" in hist_tags
    hist = _json(base, "data/plugin/histograms/histograms", run="run", tag="probe.logit_max.hist/standard")
    assert [h[1] for h in hist] == [0, 2]
    for (_, _, buckets), ref in zip(hist, (refs[0], refs[-1])):
        assert sum(b[2] for b in buckets) == pytest.approx(8)  # 2 sites × 4 heads
        values = np.concatenate([ref.value(s, "logit_max", "standard") for s in sites])
        assert buckets[0][0] == pytest.approx(values.min(), rel=1e-4)
        assert buckets[-1][1] == pytest.approx(values.max(), rel=1e-4)

    # custom scalars: the headline first (the loss, then attention/*), then one category per metric,
    # one chart per site: a band chart (actual in the band from standard to unscaled) where all
    # three scales exist, else a line chart
    layout = _json(base, "data/plugin/custom_scalars/layout")
    titles = [c["title"] for c in layout["category"]]
    assert titles == ["attention"] + [f"probe.{m}" for m in refs[0].metrics("layers.0")]
    headline = layout["category"][0]["chart"]
    (regex,) = headline[1]["multiline"]["tag"]
    lines = _json(base, "data/plugin/custom_scalars/scalars", run="run", tag=regex)
    assert lines["regex_valid"] and list(lines["tag_to_events"]) == ["attention/entropy"]
    (regex,) = headline[0]["multiline"]["tag"]  # the loss: none in this run, but a valid regex
    assert _json(base, "data/plugin/custom_scalars/scalars", run="run", tag=regex)["regex_valid"]
    chart = layout["category"][titles.index("probe.entropy")]["chart"][1]
    assert chart["title"] == "layers.1: actual, band standard–unscaled"
    (series,) = chart["margin"]["series"]
    assert [series["value"], series["lower"], series["upper"]] == [
        "probe.entropy@actual/layers.1", "probe.entropy@standard/layers.1", "probe.entropy@unscaled/layers.1"]
    for tag in series.values():
        assert [p[1] for p in _json(base, "data/plugin/scalars/scalars", run="run", tag=tag)] == [0, 1, 2]
    chart = layout["category"][titles.index("probe.grad_q")]["chart"][1]
    assert chart["title"] == "layers.1"
    (regex,) = chart["multiline"]["tag"]
    lines = _json(base, "data/plugin/custom_scalars/scalars", run="run", tag=regex)
    assert lines["regex_valid"] and sorted(lines["tag_to_events"]) == ["probe.grad_q@actual/layers.1"]

    # text: the sites table
    assert _json(base, "data/plugin/text/tags")["run"] == ["probe.sites/text_summary"]
    (entry,) = _json(base, "data/plugin/text/text", run="run", tag="probe.sites/text_summary")
    assert re.search(r"<td>layers\.1</td>\s*<td>sdpa</td>\s*<td>4</td>", entry["text"])
