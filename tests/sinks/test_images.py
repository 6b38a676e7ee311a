"""Heatmap colours against plainly written formulas and matplotlib's viridis endpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest

from probe.sinks.images import colour_scale, colourize, grid_of, render_heatmap


def test_fixed_ranges_map_values_by_their_documented_transform():
    unit = colour_scale("entropy")
    np.testing.assert_allclose(unit.position(np.array([-0.5, 0.0, 0.3, 1.0, 2.0])), [0, 0, 0.3, 1, 1])
    assert colour_scale("max_prob") == colour_scale("saturation") == unit

    var = colour_scale("logit_var")  # log10 over [1e-2, 1e4]
    for v in (1e-3, 1e-2, 1.0, 128.0, 1e4, 1e5):
        want = min(1.0, max(0.0, (math.log10(v) + 2) / 6))
        assert var.position(np.array([v]))[0] == pytest.approx(want)
    assert var.position(np.array([0.0]))[0] == 0.0  # a zero variance is the bottom, not NaN

    mx = colour_scale("logit_max")  # symlog over [-10, 1000]
    lo, hi = -math.log10(11), math.log10(1001)
    for v in (-50.0, -10.0, -1.0, 0.0, 5.0, 100.0, 1000.0, 5000.0):
        t = math.copysign(math.log10(1 + abs(v)), v)
        want = min(1.0, max(0.0, (t - lo) / (hi - lo)))
        assert mx.position(np.array([v]))[0] == pytest.approx(want)

    grad = colour_scale("grad_q")
    assert grad.position(np.array([1e-3]))[0] == pytest.approx(0.5)
    assert colour_scale("nonfinite").position(np.array([0.0, 1e6]))[0] == 0.0
    assert math.isnan(unit.position(np.array([np.nan]))[0])


def test_colourize_viridis_endpoints_and_grey_for_missing():
    rgb = colourize(np.array([0.0, 0.5, 1.0, np.nan]), colour_scale("entropy"))
    assert rgb.dtype == np.uint8 and rgb.shape == (4, 3)
    np.testing.assert_array_equal(rgb[0], [68, 1, 84])  # matplotlib viridis(0.0)
    np.testing.assert_allclose(rgb[1], [33, 145, 140], atol=2)  # viridis(0.5)
    np.testing.assert_array_equal(rgb[2], [253, 231, 37])  # viridis(1.0)
    np.testing.assert_array_equal(rgb[3], [200, 200, 200])
    # monotone in brightness along the ramp, so darker always means lower
    ramp = colourize(np.linspace(0, 1, 50), colour_scale("entropy")).astype(float)
    luminance = ramp @ np.array([0.2126, 0.7152, 0.0722])
    assert np.all(np.diff(luminance) > 0)


def test_grid_pads_sites_with_fewer_heads_with_nan():
    grid, heads = grid_of([np.array([1.0, 2.0, 3.0]), np.array([4.0])])
    assert heads == [3, 1]
    np.testing.assert_array_equal(grid[0], [1, 2, 3])
    assert grid[1, 0] == 4 and np.isnan(grid[1, 1:]).all()


def _count(img: np.ndarray, rgb) -> int:
    return int(np.all(img == np.asarray(rgb, dtype=np.uint8), axis=-1).sum())


def test_heatmap_has_one_block_per_cell_in_its_fixed_colour():
    values = np.array([[0.0, 0.25, 0.5], [0.75, 1.0, np.nan]])
    img = render_heatmap(values, ["layers.0", "layers.1"], "entropy", "unscaled", 7)
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
    colours = colourize(values, colour_scale("entropy"))
    # each cell is one solid block (cells are 36 px wide here, at least 16 px high)
    for rgb in colours.reshape(-1, 3):
        assert _count(img, rgb) >= 16 * 16, rgb
    # the same values at another step give the same cell colours: the scale does not follow the data
    img2 = render_heatmap(values * 0 + 0.25, ["layers.0", "layers.1"], "entropy", "unscaled", 8)
    assert _count(img2, colours[0, 1]) >= 5 * 16 * 16


def test_heatmap_scales_to_many_sites_and_rejects_a_wrong_grid():
    grid = np.random.default_rng(0).uniform(0, 200, (48, 32))
    img = render_heatmap(grid, [f"model.layers.{i}.self_attn" for i in range(48)], "logit_max", "actual", 0)
    assert img.shape[0] < 1000 and img.shape[1] < 1000
    with pytest.raises(ValueError, match="grid"):
        render_heatmap(np.zeros((2, 3)), ["a"], "entropy", "actual", 0)
