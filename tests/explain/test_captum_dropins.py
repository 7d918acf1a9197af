"""incrinf.captum's Occlusion and FeatureAblation are Captum's classes (subclasses) and equal Captum's results on
1-D, 2-D and 3-D inputs; what they cannot capture Captum computes, with a warning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

captum_attr = pytest.importorskip("captum.attr")

from incrinf.captum import FeatureAblation, Occlusion  # noqa: E402

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
POOL = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}
DIMS = {1: (23,), 2: (11, 13), 3: (7, 8, 9)}


def net(d: int) -> nn.Module:
    torch.manual_seed(d)
    return nn.Sequential(CONV[d](2, 6, 3, padding=1), nn.ReLU(), CONV[d](6, 6, 3, stride=2, padding=1), nn.ReLU(),
                         POOL[d](1), nn.Flatten(), nn.Linear(6, 4)).eval()


def _close(got, want) -> None:
    assert got.shape == want.shape and want.abs().max() > 0
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_real_subclasses_with_every_public_method() -> None:
    model = net(2)
    for ours, theirs in ((Occlusion(model), captum_attr.Occlusion(model)),
                         (FeatureAblation(model), captum_attr.FeatureAblation(model))):
        assert isinstance(ours, type(theirs)) and isinstance(ours, captum_attr.Attribution)
        public = {name for name in dir(theirs) if not name.startswith("_")}
        assert public <= set(dir(ours))
        assert ours.get_name() == theirs.get_name() and ours.has_convergence_delta() is False
        assert ours.multiplies_by_inputs == theirs.multiplies_by_inputs
    # methods Captum answers with NotImplementedError answer the same
    with pytest.raises(NotImplementedError):
        captum_attr.Occlusion(model).attribute_future()
    with pytest.raises(NotImplementedError):
        Occlusion(model).attribute_future()


def test_feature_ablation_attribute_future_is_captums() -> None:
    model = net(2)
    x = torch.randn(1, 2, *DIMS[2])
    mask = torch.arange(4).repeat_interleave(3)[:11, None].expand(11, 13)[None, None]

    def future_forward(t):
        fut = torch.futures.Future()
        fut.set_result(model(t))
        return fut

    want = captum_attr.FeatureAblation(future_forward).attribute_future(x, target=1, feature_mask=mask).wait()
    got = FeatureAblation(future_forward).attribute_future(x, target=1, feature_mask=mask).wait()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_occlusion_parity_in_every_dimension(d) -> None:
    model = net(d)
    x = torch.randn(2, 2, *DIMS[d])
    window, strides = (1, *[3] * d), (1, *[2] * d)
    baselines = torch.randn(1, 2, *DIMS[d])
    kwargs = dict(strides=strides, baselines=baselines, target=[0, 3], perturbations_per_eval=5)
    ours = Occlusion(model)
    _close(ours.attribute(x, window, **kwargs), captum_attr.Occlusion(model).attribute(x, window, **kwargs))
    assert len(ours.last_stats) == 2 and ours.last_stats[0]["positions"] > 0


@pytest.mark.parametrize("d", [1, 2, 3])
def test_feature_ablation_parity_in_every_dimension(d) -> None:
    model = net(d)
    x = torch.randn(2, 2, *DIMS[d])
    shared = torch.randint(0, 6, (1, 1, *DIMS[d]))
    per_example = torch.randint(0, 5, (2, 2, *DIMS[d]))
    for mask, baselines, target in ((shared, 0.3, 1), (per_example, torch.randn(2, 2, *DIMS[d]), torch.tensor([2, 0]))):
        kwargs = dict(baselines=baselines, target=target, feature_mask=mask, perturbations_per_eval=4)
        ours = FeatureAblation(model)
        _close(ours.attribute(x, **kwargs), captum_attr.FeatureAblation(model).attribute(x, **kwargs))
        assert ours.last_stats and ours.last_stats[0]["theoretical_speedup"] >= 1.0


def test_feature_ablation_without_a_mask_and_in_a_one_tuple() -> None:
    model = net(2)
    x = torch.randn(1, 2, 5, 6)
    _close(FeatureAblation(model).attribute(x, target=2), captum_attr.FeatureAblation(model).attribute(x, target=2))
    mask = torch.randint(0, 3, (1, 1, 5, 6))
    got = FeatureAblation(model).attribute((x,), target=2, feature_mask=(mask,))
    want = captum_attr.FeatureAblation(model).attribute((x,), target=2, feature_mask=(mask,))
    assert isinstance(got, tuple) and len(got) == 1
    _close(got[0], want[0])


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = net(2), net(2)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


class BatchSum(nn.Module):  # aggregates the batch: one output for all examples
    def __init__(self) -> None:
        super().__init__()
        self.body = net(2)

    def forward(self, x):
        return self.body(x).sum()


@pytest.mark.parametrize("case", ["tuple", "extra_args", "function", "aggregate"])
def test_what_cannot_be_captured_falls_back_to_captum(case) -> None:
    x = torch.randn(1, 2, *DIMS[2])
    mask = torch.randint(0, 3, (1, 1, *DIMS[2]))
    if case == "tuple":
        model, inputs, extra = TwoInputs().eval(), (x, torch.randn(1, 2, *DIMS[2])), None
        masks = (mask, mask + 3)
    elif case == "extra_args":
        model, inputs, extra, masks = (lambda t, scale: net(2)(t) * scale), x, 2.0, mask
    elif case == "function":
        body = net(2)
        model, inputs, extra, masks = (lambda t: body(t)), x, None, mask
    else:
        model, inputs, extra, masks = BatchSum().eval(), x, None, mask
    target = None if case == "aggregate" else 1
    for ours_cls, theirs_cls, args in ((FeatureAblation, captum_attr.FeatureAblation, {"feature_mask": masks}),
                                       (Occlusion, captum_attr.Occlusion, {})):
        if ours_cls is Occlusion:
            args = {"sliding_window_shapes": ((2, 3, 3),) * 2 if case == "tuple" else (2, 3, 3)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = ours_cls(model).attribute(inputs, target=target, additional_forward_args=extra, **args)
        assert any("cannot capture" in str(w.message) for w in caught)
        want = theirs_cls(model).attribute(inputs, target=target, additional_forward_args=extra, **args)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w)
