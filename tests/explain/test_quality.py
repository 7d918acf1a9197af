"""Heat-map quality metrics in one module: one window rule and one data-range rule for the SSIM of raw heat maps
over 1, 2 and 3 grid axes, and Krypton's SSIM of rendered overlays."""

from __future__ import annotations

import numpy as np
import pytest

from incrinf.explain.quality import grid_ssim, heatmap_ssim, map_ssim, overlay_ssim, ssim_data_range, ssim_window


def test_window_and_data_range_rules() -> None:
    assert ssim_window((20, 30)) == 7 and ssim_window((6, 30)) == 5 and ssim_window((5, 9, 9)) == 5
    assert ssim_window((2, 9)) < 3  # too small for SSIM
    exact = np.array([[0.0, 2.0], [1.0, 1.0]])
    assert ssim_data_range(exact, exact + 5) == 2.0
    assert ssim_data_range(np.zeros((3, 3)), np.full((3, 3), 0.5)) == 0.5  # flat exact map: the departure


def test_grid_ssim_agrees_with_the_2d_rule_and_covers_1d_3d() -> None:
    rng = np.random.default_rng(0)
    exact = rng.normal(size=(12, 12))
    noisy = exact + 0.3 * rng.normal(size=exact.shape)
    assert grid_ssim(exact, noisy) == heatmap_ssim(exact, noisy) < 1.0
    for shape in ((40,), (8, 9, 10)):
        e = rng.normal(size=shape)
        assert grid_ssim(e, e.copy()) == 1.0
        slight, bad = grid_ssim(e, e + 0.05 * rng.normal(size=shape)), grid_ssim(e, e + rng.normal(size=shape))
        assert 1.0 > slight > bad
    assert grid_ssim(exact[:2], exact[:2] + 1) is None
    with pytest.raises(ValueError, match="3x3"):
        heatmap_ssim(exact[:2], exact[:2] + 1)
    with pytest.raises(ValueError, match="one shape"):
        grid_ssim(exact, exact[:5])
    every = np.stack([exact, 2 * exact])
    approx = np.stack([noisy, 2 * exact])
    assert map_ssim(every, approx, every_class=True) == pytest.approx((heatmap_ssim(exact, noisy) + 1.0) / 2)
    assert map_ssim(exact[0], noisy[0], features=True) is None


def test_overlay_ssim_is_krypton_measure_on_rendered_pictures() -> None:
    rng = np.random.default_rng(1)
    picture = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    assert overlay_ssim(picture, picture.copy()) == pytest.approx(1.0)
    shifted = np.clip(picture.astype(int) + rng.integers(-40, 40, size=picture.shape), 0, 255).astype(np.uint8)
    assert 0.0 < overlay_ssim(picture, shifted) < 1.0
    as_float = overlay_ssim(picture / 255.0, shifted / 255.0)
    assert as_float == pytest.approx(overlay_ssim(picture, shifted), abs=1e-6)  # data range follows the type
    with pytest.raises(ValueError, match="H, W, 3"):
        overlay_ssim(picture[..., 0], shifted[..., 0])
