"""Agreement measures (incrinf.stream.agreement), the clip set (incrinf.testing.clips) and PNet's loader."""

import zipfile

import numpy as np
import pytest
import torch

from incrinf.stream.agreement import OutputKind, compare, output_kind, primary_tensor, top1_margin
from incrinf.testing.clips import CLIP_NAMES, Camera, Subject, load_clip
from incrinf.testing.pnet import PNet, load_pnet


def test_labels_agree_on_top1_and_measure_the_margin_used():
    full = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    same = compare(full + 0.1, full, 0.99)
    assert (same.kind, same.agreement, same.risk) == (OutputKind.LABEL, 1.0, pytest.approx(0.0, abs=1e-6))
    closer = compare(torch.tensor([[2.0, 1.5, 0.0, -1.0]]), full, 0.99)
    assert closer.agreement == 1.0 and closer.risk == pytest.approx(0.75) and closer.lead_lost == pytest.approx(1.5)
    # a cache that erred in the top class's favour is as far off as one that erred against it
    gained = compare(torch.tensor([[3.5, 1.0, 0.0, -1.0]]), full, 0.99)
    assert gained.risk == pytest.approx(0.0, abs=1e-6) and gained.lead_lost == pytest.approx(0.5)
    flipped = compare(torch.tensor([[1.0, 2.0, 0.0, -1.0]]), full, 0.99)
    assert flipped.agreement == 0.0 and flipped.risk >= 1.0
    assert top1_margin(full) == pytest.approx(2.0)


def test_maps_agree_per_position_and_dicts_and_tuples_are_read():
    full = torch.zeros(1, 3, 4, 5)
    full[:, 1] = 1.0
    cached = full.clone()
    cached[0, 2, 0, :2] = 5.0  # two of 20 positions change class
    result = compare({"out": cached, "aux": cached}, {"out": full, "aux": full}, 0.95)
    assert result.kind == OutputKind.MAP and result.agreement == pytest.approx(0.9)
    assert result.risk == pytest.approx(0.1 / 0.05)
    assert compare((cached, None), (full, None), 0.95, target_error=10.0).agreement == pytest.approx(0.9)
    logits = torch.randn(1, 1, 6, 6)
    assert compare(logits, logits, 0.99).agreement == 1.0 and output_kind(logits) == OutputKind.MAP
    assert np.isnan(top1_margin(full))
    with pytest.raises(TypeError, match="no tensor"):
        primary_tensor({"a": 1})
    with pytest.raises(ValueError, match="shape"):
        compare(torch.zeros(1, 3), torch.zeros(1, 4), 0.99)


def test_clip_set_loads_small_clips():
    assert len(CLIP_NAMES) >= 6
    for name in ("hall", "yard", "walkers"):
        clip = load_clip(name, 3)
        assert len(clip.frames) == 3 and clip.size == (288, 384) and clip.camera == Camera.STILL
        assert all(f.dtype == np.uint8 and f.shape == (288, 384, 3) for f in clip.frames)
        assert np.array_equal(load_clip(name, 3).frames[2], clip.frames[2])  # deterministic
        assert not np.array_equal(clip.frames[0], clip.frames[2])
    assert load_clip("hall", 2).subject == Subject.SMALL and load_clip("yard", 2).subject == Subject.LARGE
    # several people at once: the change mask has several clusters, far apart
    from incrinf.stream.change_mask import change_mask

    walkers = load_clip("walkers", 12).frames
    clusters = change_mask(walkers[11], walkers[10], 16, 10.0).clusters()
    assert len(clusters) >= 3 and max(b[3] for b in clusters) - min(b[2] for b in clusters) > 192
    resized = load_clip("carphone@224", 2)
    assert resized.size == (224, 274) and load_clip("carphone", 2).size == (144, 176)
    pan = load_clip("pan_zoom", 3)
    assert pan.camera == Camera.MOVING and len(pan.homographies) == 3
    with pytest.raises(ValueError, match="unknown clip"):
        load_clip("nope")
    with pytest.raises(ValueError, match="n_frames"):
        load_clip("hall", 0)


def test_pnet_architecture_and_loader_errors(tmp_path):
    model = PNet().eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 48, 64))
    assert out.shape == (1, 2, 19, 27) and torch.allclose(out.sum(1), torch.ones(1, 19, 27))
    weights = tmp_path / "pnet.pt"
    torch.save(model.state_dict(), weights)
    loaded = load_pnet(weights)
    torch.testing.assert_close(loaded.conv3.weight, model.conv3.weight)
    wheel = tmp_path / "facenet_pytorch-2.6.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(weights, "facenet_pytorch/data/pnet.pt")
    torch.testing.assert_close(load_pnet(wheel).conv1.bias, model.conv1.bias)
    with pytest.raises(FileNotFoundError):
        load_pnet(tmp_path / "missing.pt")
    empty = tmp_path / "other.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("x.txt", "no weights")
    with pytest.raises(ValueError, match="facenet-pytorch"):
        load_pnet(empty)
    torch.save({"fc.weight": torch.zeros(2)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a PNet"):
        load_pnet(tmp_path / "bad.pt")
