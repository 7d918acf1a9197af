"""incrinf.captum.Occlusion equals captum.attr.Occlusion."""

from __future__ import annotations

import warnings

import pytest
import torch
from captum.attr import Occlusion as CaptumOcclusion
from conftest import zoo_model

from incrinf.captum import Occlusion

CASES = [
    # window, strides, baselines, target, perturbations_per_eval
    ((3, 11, 11), (3, 7, 8), None, [3, 7], 8),
    ((1, 9, 9), (1, 8, 8), 0.5, 5, 16),
    ((3, 48, 5), (1, 1, 4), "tensor", "tensor", 5),
    ((2, 7, 13), (1, 6, 6), "per-example", 2, 8),
    ((3, 16, 16), 8, None, 0, 2),
]


def _materialise(spec, x):
    if spec == "tensor":
        return torch.randn(1, *x.shape[1:])
    if spec == "per-example":
        return torch.randn(*x.shape)
    return spec


@pytest.mark.parametrize("window,strides,baselines,target,ppe", CASES)
@pytest.mark.parametrize("name", ["resnet18", "squeezenet1_1"])
def test_parity(name, window, strides, baselines, target, ppe) -> None:
    model = zoo_model(name)
    x = torch.randn(2, 3, 48, 56)
    baselines = _materialise(baselines, x)
    if target == "tensor":
        target = torch.tensor([1, 2])
    want = CaptumOcclusion(model).attribute(x, window, strides=strides, baselines=baselines, target=target,
                                            perturbations_per_eval=ppe)
    got = Occlusion(model).attribute(x, window, strides=strides, baselines=baselines, target=target,
                                     perturbations_per_eval=ppe)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert want.abs().max() > 0
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_uncapturable_forward_func_warns_and_matches() -> None:
    model = zoo_model("resnet18")
    x = torch.randn(1, 3, 64, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = Occlusion(lambda t: model(t)).attribute(x, (3, 16, 16), strides=16, target=3)
    assert any("cannot capture" in str(w.message) for w in caught)
    want = CaptumOcclusion(model).attribute(x, (3, 16, 16), strides=16, target=3)
    torch.testing.assert_close(got, want)


def test_incremental_path_reports_speedup_stats() -> None:
    occ = Occlusion(zoo_model("resnet18"))
    occ.attribute(torch.randn(1, 3, 64, 64), (3, 8, 8), strides=8, target=1, perturbations_per_eval=16)
    assert occ.last_stats and occ.last_stats[0]["theoretical_speedup"] > 1.0


@pytest.mark.parametrize("window,strides,match", [((3, 80, 8), 4, "does not fit"), ((3, 8, 8), 9, "stride"),
                                                  ((8, 8), 4, "sliding_window_shapes")])
def test_bad_arguments(window, strides, match) -> None:
    with pytest.raises(ValueError, match=match):
        Occlusion(zoo_model("resnet18")).attribute(torch.randn(1, 3, 64, 64), window, strides=strides, target=0)
