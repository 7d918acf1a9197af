"""Model zoo and preprocessing."""

from __future__ import annotations

import pytest
import torch

from incrinf import models


@pytest.mark.parametrize("name,size", [("efficientnet_lite0", 224), ("efficientnet_lite1", 240)])
def test_efficientnet_lite_real_weights_classify_the_cat(name: str, size: int) -> None:
    model = models.load(name)
    x = models.preprocess(models.sample_image(), name)
    assert x.shape == (3, size, size) and models.info(name).pretrained
    with torch.no_grad():
        assert int(model(x[None]).argmax()) == 285  # Egyptian cat


def test_preprocess_without_crop_keeps_aspect() -> None:
    x = models.preprocess(models.sample_image(), "resnet18", crop=False)
    assert x.shape[1] == 224 and x.shape[2] > 224


def test_state_dict_round_trip(tmp_path) -> None:
    model = models.load("squeezenet1_1")
    path = tmp_path / "w.pth"
    torch.save(model.state_dict(), path)
    again = models.load("squeezenet1_1", weights=path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown model"):
        models.load("resnet9000")
    with pytest.raises(FileNotFoundError):
        models.load("resnet18", weights=tmp_path / "missing.pth")
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match="could not read"):
        models.load("resnet18", weights=corrupt)
    with pytest.raises(ValueError):
        models.preprocess(torch.zeros(3, 4, 4).numpy())
