"""incrinf.captum's drop-ins under Captum's wrappers: ``NoiseTunnel`` (which calls ``attribute.__wrapped__``) and
``captum.attr.visualization.visualize_image_attr`` give what they give around Captum's own classes, while the
attributions inside are still computed incrementally."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

captum_attr = pytest.importorskip("captum.attr")
visualization = captum_attr.visualization  # captum.attr.visualization (an attribute, not an importable module)

from incrinf.captum import FeatureAblation, Occlusion  # noqa: E402

SHAPE = (3, 12, 14)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, stride=2, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5)).eval()


def image(seed: int = 1) -> torch.Tensor:
    return torch.randn((1, *SHAPE), generator=torch.Generator().manual_seed(seed))


MASK = (torch.arange(12)[:, None] // 4 * 4 + torch.arange(14)[None, :] // 4).view(1, 1, 12, 14)
CASES = {
    "occlusion": (Occlusion, captum_attr.Occlusion, {"sliding_window_shapes": (3, 4, 4), "strides": (3, 2, 3)}),
    "ablation": (FeatureAblation, captum_attr.FeatureAblation, {"feature_mask": MASK}),
}


def test_attribute_is_wrapped_like_captums() -> None:
    for ours, theirs in ((Occlusion, captum_attr.Occlusion), (FeatureAblation, captum_attr.FeatureAblation)):
        assert hasattr(theirs.attribute, "__wrapped__")  # what NoiseTunnel relies on
        assert ours.attribute.__wrapped__.__qualname__ == f"{ours.__name__}.attribute"  # ours, not Captum's


@pytest.mark.parametrize("nt_type", ["smoothgrad", "smoothgrad_sq", "vargrad"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_noise_tunnel_matches_captum(case, nt_type) -> None:
    ours_cls, theirs_cls, kwargs = CASES[case]
    net, x = model(), image()
    ours = ours_cls(net)
    results = []
    for method in (ours, theirs_cls(net)):
        torch.manual_seed(7)  # the same noise for both (drawn by NoiseTunnel before each attribute call)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # ours must not fall back to Captum
            results.append(captum_attr.NoiseTunnel(method).attribute(
                x, nt_type=nt_type, nt_samples=3, nt_samples_batch_size=2, stdevs=0.3, target=2, **kwargs))
    got, want = results
    assert got.shape == x.shape and want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    # the last batch NoiseTunnel passed (nt_samples_batch_size=2 of 3 samples: one noisy copy) ran incrementally
    assert len(ours.last_stats) == 1 and ours.last_stats[0]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("method,sign", [("heat_map", "all"), ("blended_heat_map", "absolute_value"),
                                         ("masked_image", "positive")])
def test_visualize_image_attr_draws_ours_as_captums(case, method, sign) -> None:
    ours_cls, theirs_cls, kwargs = CASES[case]
    net, x = model(), image(2)
    picture = (x[0] - x.min()) / (x.max() - x.min())
    drawn = []
    for cls in (ours_cls, theirs_cls):
        attribution = cls(net).attribute(x, target=3, **kwargs)
        figure, axis = visualization.visualize_image_attr(
            attribution[0].permute(1, 2, 0).detach().numpy(), picture.permute(1, 2, 0).numpy(), method=method,
            sign=sign, use_pyplot=False, show_colorbar=True)
        images = axis.get_images()
        assert figure is axis.figure and images
        drawn.append(np.asarray(images[-1].get_array(), dtype=np.float64))
    got, want = drawn
    assert got.shape == want.shape == (12, 14) or got.shape == want.shape == (12, 14, 3)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
