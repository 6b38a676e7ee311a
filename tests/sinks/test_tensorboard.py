"""The TensorBoard sink, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from PIL import Image

import probe
from probe.sinks.base import scalar_tag
from probe.sinks.images import grid_of, render_heatmap
from probe.sinks.tensorboard import custom_scalars_layout
from probe.metrics import head_reduce
from tests.sinks.sinkutil import RecordingSink, model_and_inputs, reference_summary, train_step

EVERYTHING = {"images": 0, "histograms": 0, "scalars": 0, "tensors": 0}


def _events(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance=EVERYTHING)
    acc.Reload()
    return acc


def _layout(acc):
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors(metadata.CONFIG_SUMMARY_TAG)[-1].tensor_proto.string_val[0])
    return layout


def test_every_tag_holds_the_values_of_each_step(tmp_path):
    steps = 3
    model, xs = model_and_inputs(steps)
    with probe.watch(model, logdir=tmp_path, per_head=True) as p:
        for x in xs:
            train_step(model, x)
    refs = [reference_summary(model, [x]) for x in xs]  # each step measured on its own
    acc = _events(tmp_path)
    tags = acc.Tags()
    s = p.summary()
    assert s.sites == ["layers.0", "layers.1"] and s.steps == steps
    n_tags = 0
    for site in s.sites:
        for metric in s.metrics(site):
            assert metric in refs[0].metrics(site)
            for scale in s.scales(site, metric):
                events = acc.Scalars(scalar_tag(metric, scale, site))
                assert [e.step for e in events] == list(range(steps))
                for e, ref in zip(events, refs):
                    want = head_reduce(metric, ref.value(site, metric, scale))
                    assert e.value == pytest.approx(want, rel=1e-4, abs=1e-6), (site, metric, scale, e.step)
                for h in range(4):
                    head_events = acc.Scalars(scalar_tag(metric, scale, site, h))
                    got = [e.value for e in head_events]
                    want = [ref.value(site, metric, scale)[h] for ref in refs]
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
                n_tags += 5
    # the headline group: every head of every site at actual, folded as one site's heads are
    for metric in ("entropy", "logit_max", "saturation"):
        events = acc.Scalars(f"attention/{metric}")
        assert [e.step for e in events] == list(range(steps))
        for e, ref in zip(events, refs):
            every_head = np.concatenate([ref.value(site, metric, "actual") for site in s.sites])
            assert e.value == pytest.approx(head_reduce(metric, every_head), rel=1e-4, abs=1e-6)
    assert len(tags["scalars"]) == n_tags + 3
    # the aggregate summary is the one-step reference over all inputs (variance combined exactly)
    agg = reference_summary(model, xs)
    np.testing.assert_allclose(s.value("layers.1", "logit_var", "unscaled"),
                               agg.value("layers.1", "logit_var", "unscaled"), rtol=1e-5)

    for metric in s.metrics("layers.0"):
        for scale in s.scales("layers.0", metric):
            hist = acc.Histograms(f"probe.{metric}.hist/{scale}")
            # pictures on their own cadence: the first flush, then the last state at close
            assert [h.step for h in hist] == [0, steps - 1]
            images = acc.Images(f"probe.{metric}.heatmap/{scale}")
            assert [i.step for i in images] == [0, steps - 1]
            for i, ref in zip((0, 1), (refs[0], refs[-1])):
                values = np.concatenate([ref.value(site, metric, scale) for site in ref.sites])
                finite = values[np.isfinite(values)]
                hv = hist[i].histogram_value
                assert hv.num == finite.size == 8
                assert hv.min == pytest.approx(finite.min(), rel=1e-4, abs=1e-6)
                assert hv.max == pytest.approx(finite.max(), rel=1e-4, abs=1e-6)
                assert hv.sum == pytest.approx(finite.sum(), rel=1e-4, abs=1e-6)
            # the image of the last step is the heatmap of that step's values, pixel for pixel
            decoded = np.asarray(Image.open(io.BytesIO(images[-1].encoded_image_string)).convert("RGB"))
            grid, _ = grid_of([refs[-1].value(site, metric, scale) for site in s.sites])
            expected = render_heatmap(grid, s.sites, metric, scale, steps - 1)
            assert decoded.shape == expected.shape
            # float32 events vs the float64 reference may move a colour by one step at most
            assert np.abs(decoded.astype(int) - expected.astype(int)).max() <= 2

    text = acc.Tensors("probe.sites/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "| layers.0 | sdpa | 4 | 4 | 16 | 1/√16 |" in text and "| layers.1 |" in text

    layout = _layout(acc)
    categories = {c.title: c for c in layout.category}
    assert [c.title for c in layout.category][0] == "attention"  # the headline first
    assert set(categories) == {"attention"} | {f"probe.{m}" for m in s.metrics("layers.0")}
    headline = categories["attention"].chart
    assert [c.title for c in headline] == ["loss (every tag with 'loss' in it)", "entropy at actual, mean of every head",
                                           "logit_max at actual, max of every head",
                                           "saturation at actual, mean of every head"]
    assert [t for t in tags["scalars"] if re.match(headline[1].multiline.tag[0], t)] == ["attention/entropy"]
    for tag in ("loss/train", "train/loss", "eval/Loss"):  # the loss chart's regex (TensorBoard matches from the start)
        assert re.match(headline[0].multiline.tag[0], tag)
    assert not [t for t in tags["scalars"] if re.match(headline[0].multiline.tag[0], t)]  # none of probe's
    for metric in s.metrics("layers.0"):
        charts = categories[f"probe.{metric}"].chart
        if s.scales("layers.0", metric) == ["actual"]:  # grad_q/k/v, nonfinite: a Multiline chart per site
            assert [c.title for c in charts] == ["layers.0", "layers.1"]
            for chart in charts:
                (regex,) = chart.multiline.tag
                assert [t for t in tags["scalars"] if re.search(regex, t)] == [scalar_tag(metric, "actual", chart.title)]
            continue
        # every scale: actual as a line in a band from standard to unscaled, one Margin chart per site
        assert [c.title for c in charts] == [f"{site}: actual, band standard–unscaled" for site in ("layers.0", "layers.1")]
        for chart, site in zip(charts, ("layers.0", "layers.1")):
            (series,) = chart.margin.series
            assert (series.value, series.lower, series.upper) == tuple(
                scalar_tag(metric, sc, site) for sc in ("actual", "standard", "unscaled"))
            assert {series.value, series.lower, series.upper} <= set(tags["scalars"])


def test_layout_escapes_site_names_and_excludes_head_tags():
    layout = custom_scalars_layout({"entropy": ["a.b#2"]})
    (kind, (regex,)) = layout["probe.entropy"]["a.b#2"]
    assert kind == "Multiline"
    assert re.search(regex, "probe.entropy@unscaled/a.b#2")
    assert re.search(regex, "probe.entropy@half/a.b#2")  # extra scales join the chart
    assert not re.search(regex, "probe.entropy@unscaled/axb#2")
    assert not re.search(regex, "probe.entropy@unscaled/a.b#2/head00")
    assert not re.search(regex, "probe.logit_max@unscaled/a.b#2")
    # with the scales known: a Margin chart (exact tags, names encoded), plus a Multiline chart for extra scales
    layout = custom_scalars_layout({"entropy": ["a/b"]}, {("entropy", "a/b"): {"actual", "standard", "unscaled", "half"}})
    charts = layout["probe.entropy"]
    assert charts["a/b: actual, band standard–unscaled"] == [
        "Margin", ["probe.entropy@actual/a%2Fb", "probe.entropy@standard/a%2Fb", "probe.entropy@unscaled/a%2Fb"]]
    assert re.search(charts["a/b: every scale"][1][0], "probe.entropy@half/a%2Fb")


def test_writes_beside_the_users_own_writer_at_their_global_step(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    model, xs = model_and_inputs(3)
    writer = SummaryWriter(log_dir=str(tmp_path))
    with probe.watch(model, logdir=writer) as p:
        for i, x in enumerate(xs):
            gs = 100 * (i + 1)
            p.step(gs)
            train_step(model, x)
            writer.add_scalar("train/loss", float(i), gs)
    writer.add_scalar("train/after_close", 1.0, 400)  # probe did not close the user's writer
    writer.close()
    assert p.summary().steps == 3
    acc = _events(tmp_path)
    assert [e.step for e in acc.Scalars("train/loss")] == [100, 200, 300]
    assert [e.step for e in acc.Scalars("train/after_close")] == [400]
    assert [e.step for e in acc.Scalars("probe.entropy@actual/layers.0")] == [100, 200, 300]
    assert [e.step for e in acc.Images("probe.entropy.heatmap/unscaled")] == [100, 200, 300]
    assert (tmp_path / "probe_summary.json").exists()


def test_a_writer_of_another_class_gets_add_scalar_for_each_tag():
    from probe.sinks.base import head_scalars, overview_scalars
    from probe.sinks.tensorboard import TensorBoardSink

    class Recording:  # add_scalar and friends, but not torch's private _get_file_writer
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

        add_image = add_histogram = add_custom_scalars = add_text = flush = lambda self, *args, **kwargs: None

    summary = reference_summary(*model_and_inputs(1))
    writer = Recording()
    TensorBoardSink(writer, per_head=True).write(7, summary)
    expected = [(tag, value, 7) for tag, value in [*overview_scalars(summary), *head_scalars(summary, per_head=True)]]
    assert len(writer.scalars) == len(expected) > 3
    for (tag, value, step), (want_tag, want, want_step) in zip(writer.scalars, expected):
        assert (tag, step) == (want_tag, want_step)
        assert value == want or (np.isnan(value) and np.isnan(want))


def test_flush_every_aggregates_windows_and_writes_at_their_last_step(tmp_path):
    model, xs = model_and_inputs(7)
    rec = RecordingSink()
    with probe.watch(model, logdir=tmp_path, flush_every=3, sinks=[rec]) as p:
        for x in xs:
            train_step(model, x)
            # a window is handed to the sinks when the next window's first step begins
    assert [step for step, _ in rec.writes] == [2, 5, 6]
    assert [s.steps for _, s in rec.writes] == [3, 3, 1]
    assert set(rec.threads) == {"probe-writer-RecordingSink"}  # each sink has its own writer thread
    assert rec.closed == 1
    for (step, got), window in zip(rec.writes, (xs[0:3], xs[3:6], xs[6:7])):
        ref = reference_summary(model, window)
        for metric in ("logit_var", "logit_max", "entropy", "saturation", "grad_logits", "grad_q"):
            # gradient norms: the one-step reference is the norm over the whole window; the window
            # reports the root mean square over its steps, that norm / sqrt(steps)
            per_step = np.sqrt(len(window)) if metric.startswith("grad") else 1.0
            np.testing.assert_allclose(got.value("layers.0", metric, "unscaled" if metric != "grad_q" else "actual"),
                                       ref.value("layers.0", metric, "unscaled" if metric != "grad_q" else "actual") / per_step,
                                       rtol=1e-4, atol=1e-6, err_msg=f"{metric} at {step}")
    acc = _events(tmp_path)
    assert [e.step for e in acc.Scalars("probe.max_prob@standard/layers.1")] == [2, 5, 6]
    assert p.summary().steps == 7


def test_every_and_flush_every_count_sampled_steps(tmp_path):
    model, xs = model_and_inputs(8)
    rec = RecordingSink()
    with probe.watch(model, every=2, flush_every=2, sinks=[rec]):
        for x in xs:
            train_step(model, x)
    assert [(step, s.steps) for step, s in rec.writes] == [(2, 2), (6, 2)]


def test_sink_close_twice_and_context_manager(tmp_path):
    from probe.sinks.tensorboard import TensorBoardSink

    with TensorBoardSink(tmp_path) as sink:
        sink.write(0, reference_summary(*model_and_inputs(1)))
    sink.close()
    sink.flush()
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_sites_appearing_later_and_extra_scales_reach_every_panel(tmp_path):
    import torch
    from torch import nn

    from tests.helpers import SDPAAttention

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = SDPAAttention(), SDPAAttention()

        def forward(self, x, second=False):
            x = self.a(x)
            return self.b(x) if second else x

    model = Branchy()
    x = torch.randn(1, 5, 64)
    with probe.watch(model, logdir=tmp_path, scales={"half": lambda d: 0.5 * d**-0.5}, per_head=True):
        model(x)
        model(x, second=True)
    acc = _events(tmp_path)
    layout = _layout(acc)  # the last layout written, which TensorBoard shows
    entropy = next(c for c in layout.category if c.title == "probe.entropy")
    assert [c.title for c in entropy.chart] == [
        "a: actual, band standard–unscaled", "a: every scale", "b: actual, band standard–unscaled", "b: every scale"]
    (regex,) = entropy.chart[3].multiline.tag
    assert sorted(t for t in acc.Tags()["scalars"] if re.search(regex, t)) == [  # no /headNN tags
        f"probe.entropy@{s}/b" for s in ("actual", "half", "standard", "unscaled")]
    assert [e.step for e in acc.Scalars("probe.entropy@half/b")] == [1]
    assert [i.step for i in acc.Images("probe.entropy.heatmap/half")] == [0, 1]
    # the heatmap of step 0 has one row (site a), of step 1 two: it grew with the sites
    for image, sites in zip(acc.Images("probe.entropy.heatmap/half"), (["a"], ["a", "b"])):
        decoded = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"))
        grid = np.array([[next(e.value for e in acc.Scalars(scalar_tag("entropy", "half", site, h)) if e.step == image.step)
                          for h in range(4)] for site in sites])
        expected = render_heatmap(grid, sites, "entropy", "half", image.step)
        assert decoded.shape == expected.shape
        assert np.abs(decoded.astype(int) - expected.astype(int)).max() <= 2
    tables = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("probe.sites/text_summary")]
    assert len(tables) == 2 and "| b |" not in tables[0] and "| b | sdpa |" in tables[1]


def test_pictures_follow_their_own_cadence(tmp_path):
    """Scalars at every flush; heatmaps and histograms at the first flush, then at the first flush
    at least `image_every` steps after the last pictures, and the last state at close."""
    from probe.sinks.tensorboard import TensorBoardSink

    model, xs = model_and_inputs(7)
    sink = TensorBoardSink(tmp_path, image_every=3)
    with probe.watch(model, sinks=[sink], every=1):
        for x in xs:
            train_step(model, x)
    acc = _events(tmp_path)
    tag = next(t for t in acc.Tags()["scalars"] if t.startswith("probe.entropy@actual/"))
    assert [e.step for e in acc.Scalars(tag)] == list(range(7))
    assert [i.step for i in acc.Images("probe.entropy.heatmap/actual")] == [0, 3, 6]
    assert [h.step for h in acc.Histograms("probe.entropy.hist/actual")] == [0, 3, 6]
    with pytest.raises(probe.ProbeError, match="image_every"):
        TensorBoardSink(tmp_path, image_every=0)


def test_last_pictures_written_at_close(tmp_path):
    from probe.sinks.tensorboard import TensorBoardSink

    model, xs = model_and_inputs(5)
    with probe.watch(model, sinks=[TensorBoardSink(tmp_path, image_every=3)], every=1):
        for x in xs:
            train_step(model, x)
    acc = _events(tmp_path)
    assert [i.step for i in acc.Images("probe.max_prob.heatmap/standard")] == [0, 3, 4]


def test_scalar_tags_of_this_and_earlier_layouts_read_back():
    from probe.sinks.tags import ScalarTag, parse_scalar_tag

    # this layout: one group per metric and scale, spelt as thresholds spell it
    assert scalar_tag("entropy", "unscaled", "a/b") == "probe.entropy@unscaled/a%2Fb"
    assert parse_scalar_tag("probe.entropy@unscaled/a%2Fb") == ScalarTag("entropy", "unscaled", "a/b", None)
    assert parse_scalar_tag("probe.entropy@0.5/l.1/head03") == ScalarTag("entropy", "0.5", "l.1", 3)
    # the layouts before it: probe.{metric}/{scale}/{site}, and probe/{metric}/{scale}/{site}
    assert parse_scalar_tag("probe.entropy/unscaled/a%2Fb/head01") == ScalarTag("entropy", "unscaled", "a/b", 1)
    assert parse_scalar_tag("probe/entropy/actual/a/b") == ScalarTag("entropy", "actual", "a/b", None)
    # not probe's per-site scalars: the headline, pictures, the user's own, malformed
    for tag in ("attention/entropy", "probe.entropy.heatmap/actual", "probe.entropy.hist/actual", "loss/train",
                "probe.entropy@actual/l.1/x", "probe.@actual/l.1", "probe.entropy@/l.1", "probe.a.b@actual/l.1"):
        assert parse_scalar_tag(tag) is None, tag


def test_a_counterfactual_heatmap_says_it_is_one():
    from probe.sinks.images import scale_words

    assert scale_words("actual") == "what the model computes"
    assert scale_words("unscaled") == "what if: the same q, k at scale 1 (no divisor)"
    assert scale_words("standard") == "what if: the same q, k at scale 1/sqrt(d_k)"
    assert scale_words("half") == "what if: the same q, k at scale half"
    grid = np.array([[0.9, 0.01]])
    actual, unscaled = (render_heatmap(grid, ["a"], "entropy", s, 3) for s in ("actual", "unscaled"))
    width = min(actual.shape[1], unscaled.shape[1])  # the longer line makes a wider image
    actual, unscaled = actual[:, :width], unscaled[:, :width]
    # the line under the title differs, in another colour; the cells are the same
    assert (actual[24:36] != unscaled[24:36]).any()
    assert (unscaled[24:36, :, 0].astype(int) - unscaled[24:36, :, 2] > 100).any()  # the counterfactual's orange-red
    assert (actual[74:90] == unscaled[74:90]).all()
