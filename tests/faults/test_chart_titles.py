"""Custom Scalars chart titles are site names made printable; two sites printed alike ("a\\nb" with a
newline, "a\\\\nb" with a backslash) must still get a chart each (a dict key: one overwrote the other)."""

from __future__ import annotations

from probe.sinks.tags import custom_scalars_layout


def test_sites_printed_alike_keep_a_chart_each():
    sites = ["a\nb", "a\\nb", "x"]
    band = {("entropy", s): ["actual", "standard", "unscaled", "half"] for s in sites}
    for scales in (band, None):
        charts = custom_scalars_layout({"entropy": sites}, scales)["probe.entropy"]
        assert len(charts) == (2 if scales else 1) * len(sites)
        tags = [t for spec in charts.values() for t in spec[1]]
        assert len(set(tags)) == len(tags)  # every chart shows its own site
