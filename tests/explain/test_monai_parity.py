"""incrinf.monai.OcclusionSensitivity equals MONAI's OcclusionSensitivity: 2-D and 3-D, every mode, overlaps,
bounding boxes, activations; MONAI computes what incrinf cannot capture."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

monai_visualize = pytest.importorskip("monai.visualize")

from incrinf.monai import OcclusionSensitivity  # noqa: E402

CONV = {2: nn.Conv2d, 3: nn.Conv3d}
POOL = {2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}


def net(d: int, channels: int) -> nn.Module:
    torch.manual_seed(d + channels)
    return nn.Sequential(CONV[d](channels, 6, 3, padding=1), nn.ReLU(), CONV[d](6, 6, 3, stride=2), nn.ReLU(),
                         POOL[d](1), nn.Flatten(), nn.Linear(6, 3)).eval()


def _same(model: nn.Module, x: torch.Tensor, b_box=None, **options) -> OcclusionSensitivity:
    want_map, want_class = monai_visualize.OcclusionSensitivity(model, verbose=False, **options)(x, b_box=b_box)
    ours = OcclusionSensitivity(model, verbose=False, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the incremental path: no fallback warning
        got_map, got_class = ours(x, b_box=b_box)
    assert got_map.shape == want_map.shape and got_class.shape == want_class.shape
    assert ((got_map - want_map).abs().max() / want_map.abs().max()).item() < 1e-4
    assert torch.equal(got_class, want_class)
    return ours


CASES_2D = [  # (options, input channels: MONAI activates with a sigmoid for one, a softmax otherwise, b_box)
    (dict(mask_size=6), 1, [2, 12, -1, -1]),  # gaussian, overlap 0.6
    (dict(mask_size=(5, 7), mode="mean_patch", overlap=0.3), 2, [-1, -1, 3, 20]),
    (dict(mask_size=6, mode="mean_img", activate=False), 1, None),
    (dict(mask_size=4, mode=0.5, overlap=0.0), 2, None),
    (dict(mask_size=5, mode=-1.0, overlap=0.75, activate=torch.tanh), 2, [0, 9, 4, 16]),
]


@pytest.mark.parametrize("options,channels,b_box", CASES_2D)
def test_2d_parity(options, channels, b_box) -> None:
    model = net(2, channels)
    x = torch.randn(1, channels, 18, 22)
    ours = _same(model, x, n_batch=5, **options)
    assert ours.last_stats["positions"] > 0 and ours.last_stats["theoretical_speedup"] >= 1.0
    if b_box is not None:
        _same(model, x, b_box=b_box, n_batch=5, **options)


@pytest.mark.parametrize("options,b_box", [(dict(mask_size=4), [2, 6, -1, -1, 3, 10]),
                                           (dict(mask_size=(3, 4, 5), mode="mean_patch", overlap=0.5), None),
                                           (dict(mask_size=4, mode="mean_img", overlap=0.25), None),
                                           (dict(mask_size=5, mode=0.0), [-1, -1, 0, 6, -1, -1])])
def test_3d_parity(options, b_box) -> None:
    model = net(3, 1)
    x = torch.randn(1, 1, 8, 10, 12)
    _same(model, x, n_batch=16, b_box=b_box, **options)


def test_monai_3d_densenet_parity() -> None:
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    model = nets.DenseNet(spatial_dims=3, in_channels=1, out_channels=3, init_features=8, growth_rate=8,
                          block_config=(3, 4, 3)).eval()
    _same(model, torch.randn(1, 1, 16, 16, 16), mask_size=8, n_batch=8, overlap=0.25)


def test_callable_mode_is_applied_to_each_window() -> None:
    # MONAI 1.6 accepts a callable mode but then raises; the drop-in applies it: a function that fills the window
    # with 0.5 equals MONAI's constant mode 0.5
    model = net(2, 2)
    x = torch.randn(1, 2, 20, 24)
    want, _ = monai_visualize.OcclusionSensitivity(model, mask_size=6, mode=0.5, verbose=False)(x)
    got, _ = OcclusionSensitivity(model, mask_size=6, mode=lambda image, box: torch.full_like(box, 0.5),
                                  verbose=False)(x)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = net(2, 1)

    def forward(self, x, scale: float = 1.0):
        return self.body(x) * scale


def test_extra_forward_arguments_fall_back_to_monai() -> None:
    model = Scaled().eval()
    x = torch.randn(1, 1, 16, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _ = OcclusionSensitivity(model, mask_size=4, verbose=False)(x, scale=2.0)
    assert any("cannot capture" in str(w.message) for w in caught)
    want, _ = monai_visualize.OcclusionSensitivity(model, mask_size=4, verbose=False)(x, scale=2.0)
    torch.testing.assert_close(got, want)


def test_subclass_and_errors() -> None:
    model = net(2, 1)
    occ = OcclusionSensitivity(model, mask_size=30, verbose=False)
    assert isinstance(occ, monai_visualize.OcclusionSensitivity)
    with pytest.raises(ValueError, match="should be bigger than mask"):
        occ(torch.randn(1, 1, 16, 16))
    with pytest.raises(ValueError, match="batch size of 1"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        OcclusionSensitivity(model, mask_size=4, verbose=False)(torch.randn(2, 1, 16, 16))
    with pytest.raises(NotImplementedError):
        OcclusionSensitivity(model, mode="blur")
