"""Value-based pruning in occlusion runs: off by default and bit-equal to the exact path at 0; when on, boxes only
shrink inside the exact regions, work drops and the error is measured (incrinf.engine stores, occlusion)."""

import numpy as np
import pytest
import torch
from conftest import zoo_model

import incrinf
from incrinf.engine import BatchEngine
from incrinf.explain.occlusion import occlusion as exact_occlusion
from incrinf.geometry import input_boxes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _image(size: int = 64) -> torch.Tensor:
    return torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "googlenet", "efficientnet_lite0"])
def test_threshold_zero_is_bit_equal_to_the_exact_path(name):
    model, x = zoo_model(name), _image()
    exact = exact_occlusion(model, x, patch=16, stride=16, progress=False)
    zero = incrinf.occlusion(model, x, patch=16, stride=16, progress=False, feature_threshold=0.0)
    assert np.array_equal(zero.heatmap, exact.heatmap)
    assert zero.stats["approximate"] is False


def _walk(engine: BatchEngine, positions: np.ndarray, feature_threshold: float):
    boxes = input_boxes(positions, (16, 16), (64, 64))
    values = torch.zeros(len(positions), 3, 16, 16)
    boxes.values = values
    return engine.run(boxes, feature_threshold=feature_threshold)


@pytest.mark.parametrize("name", ["resnet18", "efficientnet_lite0"])
def test_pruned_boxes_stay_inside_the_exact_regions(name):
    engine = BatchEngine(incrinf.capture(zoo_model(name), (3, 64, 64)), _image())
    positions = np.array([[0, 0], [24, 40], [48, 16]])
    exact, pruned = _walk(engine, positions, 0.0), _walk(engine, positions, 0.5)
    assert pruned.committed, "the threshold left nothing to commit"
    shrunk = 0
    for name_, box in pruned.committed.items():
        full = exact.committed[name_]
        lo, hi = box.start(), box.start() + np.asarray(box.size)
        full_lo, full_hi = full.start(), full.start() + np.asarray(full.size)
        assert (lo >= full_lo).all() and (hi <= full_hi).all(), name_
        shrunk += box.area < full.area
    assert shrunk > 0
    assert len(pruned.committed) <= len(exact.committed)
    assert pruned.flops < exact.flops


def test_pruning_is_approximate_faster_in_flops_and_measures_its_error():
    model, x = zoo_model("resnet18"), _image()
    exact = exact_occlusion(model, x, patch=16, stride=8, progress=False)
    pruned = incrinf.occlusion(model, x, patch=16, stride=8, progress=False, feature_threshold=0.2,
                               target=exact.target)
    s = pruned.stats
    assert s["approximate"] is True and s["feature_threshold"] == 0.2
    assert s["realized_flop_ratio"] > exact.stats["realized_flop_ratio"]
    assert s["sampled_cells"] > 0 and s["sampled_max_abs_error"] >= 0
    assert not np.array_equal(pruned.heatmap, exact.heatmap)
    assert np.corrcoef(pruned.heatmap.ravel(), exact.heatmap.ravel())[0, 1] > 0.5
    with pytest.raises(ValueError, match="feature_threshold"):
        incrinf.occlusion(model, x, patch=16, stride=8, progress=False, feature_threshold=-1)
