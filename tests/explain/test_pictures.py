"""Heat-map pictures: a diverging colour map centred at zero by default (zero white, limits symmetric, so equal
drops and gains get equally strong colours), another map and data-range limits on request, in 1-D, 2-D and 3-D."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib import colormaps
from PIL import Image

from incrinf.explain.pictures import DEFAULT_CMAP, colour_scale, heatmap_figure, save_heatmap

WHITE = np.ones(3)


def signed_map(shape: tuple[int, ...]) -> np.ndarray:
    """Positive (occluding lowered the score) in the first half of the last axis, a weaker negative in the rest."""
    pixel = np.zeros(shape)
    half = shape[-1] // 2
    pixel[..., :half] = np.linspace(0.5, 2.0, half)
    pixel[..., half:] = -0.5
    return pixel


@pytest.mark.parametrize("low,high", [(-0.5, 2.0), (-3.0, 1.0), (0.0, 4.0), (-2.0, -1.0)])
def test_limits_symmetric_about_the_centre(low, high) -> None:
    pixel = np.array([[low, high], [np.nan, (low + high) / 2]])  # NaN ignored
    reach = max(abs(low), abs(high))
    assert colour_scale(pixel) == {"cmap": DEFAULT_CMAP, "vmin": -reach, "vmax": reach}
    assert colour_scale(pixel, "viridis", centre=None) == {"cmap": "viridis", "vmin": low, "vmax": high}
    shifted = colour_scale(pixel, centre=1.0)
    assert shifted["vmin"] + shifted["vmax"] == pytest.approx(2.0)
    assert shifted["vmin"] <= low and shifted["vmax"] >= high


def test_constant_maps_get_a_usable_range() -> None:
    for centre in (0.0, None):
        scale = colour_scale(np.zeros((3, 3)), centre=centre)
        assert scale["vmin"] < scale["vmax"]


def test_unknown_colour_map_is_named() -> None:
    with pytest.raises(ValueError, match="unknown colour map 'rainbow_ish'.*RdBu_r"):
        colour_scale(np.zeros(4), "rainbow_ish")


def test_2d_picture_white_at_zero_red_drop_blue_gain() -> None:
    pixel = signed_map((8, 10))
    pixel[0, 0] = 0.0
    fig = heatmap_figure(pixel, None, "t", "drop")
    shown = fig.axes[0].get_images()[-1]
    assert shown.get_cmap().name == DEFAULT_CMAP and shown.norm.vmin == -shown.norm.vmax == -2.0
    rgba = shown.to_rgba(pixel)[..., :3]
    assert np.abs(rgba[0, 0] - WHITE).max() < 0.05  # zero: the neutral middle
    assert (rgba[:, 1:5, 0] > rgba[:, 1:5, 2] + 0.1).all()  # drops red
    assert (rgba[:, 5:, 2] > rgba[:, 5:, 0] + 0.1).all()  # gains blue
    # equal magnitudes, equal strength: +v and -v sit at mirrored places of the colour map
    np.testing.assert_allclose(shown.norm(pixel) + shown.norm(-pixel), 1.0)


def test_3d_montage_shares_one_centred_scale_and_another_map_on_request() -> None:
    pixel = signed_map((5, 6, 8))
    fig = heatmap_figure(pixel, np.random.default_rng(0).random((1, 5, 6, 8)), "t", "drop")
    images = [ax.get_images()[-1] for ax in fig.axes if ax.get_images()]
    assert len(images) == 5 and {(im.norm.vmin, im.norm.vmax) for im in images} == {(-2.0, 2.0)}
    fig = heatmap_figure(pixel, None, "t", "drop", cmap="viridis", centre=None)
    images = [ax.get_images()[-1] for ax in fig.axes if ax.get_images()]
    assert {(im.get_cmap().name, im.norm.vmin, im.norm.vmax) for im in images} == {("viridis", -0.5, 2.0)}


def test_1d_curve_coloured_by_the_same_scale() -> None:
    pixel = signed_map((20,))
    fig = heatmap_figure(pixel, np.random.default_rng(0).random((2, 20)), "t", "drop")
    curves = [c for ax in fig.axes for c in ax.collections if c.get_array() is not None]
    assert curves and curves[0].get_cmap().name == DEFAULT_CMAP
    assert (curves[0].norm.vmin, curves[0].norm.vmax) == (-2.0, 2.0)
    bars = [p for ax in fig.axes for p in ax.patches]
    red = colormaps[DEFAULT_CMAP](1.0)
    assert bars and bars[-1].get_facecolor()[2] > bars[-1].get_facecolor()[0]  # the last (a gain) blue
    assert bars[9].get_facecolor()[0] > bars[9].get_facecolor()[2] and red[0] > red[2]


def test_saved_png_is_written_without_touching_pyplot(tmp_path) -> None:
    import matplotlib
    import matplotlib.pyplot as plt

    backend, figures = matplotlib.get_backend(), plt.get_fignums()
    out = save_heatmap(signed_map((8, 10)), tmp_path / "sub" / "map.png", np.full((8, 10, 3), 0.5), "t", "drop")
    assert matplotlib.get_backend() == backend and plt.get_fignums() == figures
    with Image.open(out) as picture:
        assert picture.size == (600, 500)
