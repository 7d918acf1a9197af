"""``incrinf explain --feature-mask FILE`` and ``--target all``: the CLI's maps equal the Python API's on the same
input, for an image with a segment image and for a volume with a label volume; bad masks are clear errors."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

from incrinf import cli
from incrinf.cli.feature_mask import fit_image_mask, read_image_mask, read_volume_mask, target_value

nibabel = pytest.importorskip("nibabel")
pytest.importorskip("monai")
EXAMPLE = os.path.join(os.path.dirname(nibabel.__file__), "tests", "data", "example4d.nii.gz")


def test_target_value_and_image_mask_geometry(tmp_path) -> None:
    assert target_value("all") == "all" and target_value("3") == 3
    with pytest.raises(Exception, match="class index or 'all'"):
        target_value("every")
    ids = np.arange(12 * 8).reshape(12, 8) // 8  # one id per row
    np.save(tmp_path / "m.npy", ids)
    mask = fit_image_mask(read_image_mask(str(tmp_path / "m.npy")), (12, 8), 4)
    # shorter side 8 -> 4 (scale 0.5), 12 -> 6 rows, centre crop of rows 1..4: nearest labels, never blended
    assert mask.shape == (4, 4) and mask.dtype == torch.int64
    assert set(mask.unique().tolist()) <= set(range(12)) and (mask[:, 0] == mask[:, 3]).all()
    rgb = np.zeros((6, 6, 3), np.uint8)
    rgb[:3] = (255, 0, 0)
    from skimage.io import imsave

    imsave(tmp_path / "seg.png", rgb, check_contrast=False)
    assert set(np.unique(read_image_mask(str(tmp_path / "seg.png"))).tolist()) == {0, 1}
    np.save(tmp_path / "f.npy", np.full((4, 4), 0.5))
    with pytest.raises(ValueError, match="integer ids"):
        read_image_mask(str(tmp_path / "f.npy"))
    with pytest.raises(ValueError, match="the image's size"):
        fit_image_mask(np.zeros((5, 5), np.int64), (6, 6), 4)


def test_missing_and_corrupt_mask_files_are_clear_errors(tmp_path) -> None:
    """Both readers: a missing file names itself; a corrupt .npy, image or NIfTI file, or a 4-D volume's index
    out of range, is a ValueError naming the file and what the reader said; a wrong shape names both shapes."""
    for name in ("gone.npy", "gone.png", "gone.nii.gz"):
        with pytest.raises(FileNotFoundError, match=f"feature mask not found: .*{name}"):
            read_image_mask(str(tmp_path / name))
        with pytest.raises(FileNotFoundError, match=f"feature mask not found: .*{name}"):
            read_volume_mask(str(tmp_path / name), (2, 2, 2))
    for name in ("bad.npy", "bad.png", "bad.nii.gz"):
        (tmp_path / name).write_bytes(b"not a mask at all")
        reader = read_volume_mask if name.endswith(".nii.gz") else read_image_mask
        args = ((2, 2, 2),) if reader is read_volume_mask else ()
        with pytest.raises(ValueError, match=f"cannot read feature mask .*{name}: [A-Za-z]+"):
            reader(str(tmp_path / name), *args)
    said = "ValueError: it holds 2 volumes; index 5 is out of range"
    with pytest.raises(ValueError, match=f"cannot read feature mask {re.escape(EXAMPLE)}: {said}"):
        read_volume_mask(EXAMPLE, (2, 2, 2), index=5)
    with pytest.raises(ValueError, match=r"has shape 24x96x128 but the volume is 2x2x2"):
        read_volume_mask(EXAMPLE, (2, 2, 2))
    np.save(tmp_path / "flat.npy", np.zeros(5, np.int64))
    with pytest.raises(ValueError, match=r"must be an \(H, W\) map of ids, got shape \(5,\)"):
        read_image_mask(str(tmp_path / "flat.npy"))
    with pytest.raises(ValueError, match=r"must be a 3-D label volume, got shape \(5,\)"):
        read_volume_mask(str(tmp_path / "flat.npy"), (5,))


def test_volume_feature_mask_and_every_class_equal_the_api(tmp_path, capsys) -> None:
    import incrinf
    from incrinf import models
    from incrinf.cli.volume import read_volume, resize

    shape = (24, 96, 128)  # the fMRI volume's (D, H, W)
    labels = np.zeros(shape, np.int16)
    labels[:, :48] = 1
    labels[:12, 48:, 64:] = 2
    path = tmp_path / "labels.nii.gz"
    nibabel.save(nibabel.Nifti1Image(labels.transpose(2, 1, 0).copy(), np.eye(4)), path)  # stored (x, y, z)
    out = tmp_path / "m.png"
    args = ["explain", EXAMPLE, "--resize", "32x32x32", "--feature-mask", str(path), "--target", "all",
            "--output", "prob", "--out", str(out), "--quiet"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "explained every class with 3 features" in text and out.read_bytes()[:4] == b"\x89PNG"
    volume = resize(read_volume(EXAMPLE), (32, 32, 32))
    mask = torch.nn.functional.interpolate(torch.from_numpy(labels.astype(np.float64))[None, None], size=(32, 32, 32),
                                           mode="nearest")[0, 0].long()
    model = models.load("monai_densenet121_3d")
    every = incrinf.occlusion(model, volume, target="all", feature_mask=mask, output="prob", progress=False)
    assert every.heatmap.shape == (2, 3)
    assert cli.main(["explain", EXAMPLE, "--resize", "32x32x32", "--feature-mask", str(path), "--target", "1",
                     "--output", "prob", "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    top = every.features[int(np.argmax(every.heatmap[1]))]
    assert f"largest drop {every.heatmap[1].max():.3f} at feature {top}" in text
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((4, 4, 4), np.int64))
    with pytest.raises(SystemExit, match="has shape 4x4x4 but the volume is 24x96x128"):
        cli.main(["explain", EXAMPLE, "--feature-mask", str(wrong), "--quiet"])
    with pytest.raises(SystemExit, match="feature mask not found"):
        cli.main(["explain", EXAMPLE, "--feature-mask", str(tmp_path / "none.nii"), "--quiet"])


def test_image_feature_mask_matches_the_api(tmp_path, capsys) -> None:
    import incrinf
    from incrinf import models

    photo = models.sample_image()
    segments = (np.arange(photo.shape[0])[:, None] // (photo.shape[0] // 4 + 1)) * 4 \
        + np.arange(photo.shape[1])[None, :] // (photo.shape[1] // 4 + 1)
    np.save(tmp_path / "seg.npy", segments)
    assert cli.main(["explain", "--model", "resnet18", "--feature-mask", str(tmp_path / "seg.npy"),
                     "--target", "3", "--output", "prob", "--out", str(tmp_path / "h.png"), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "explained class 3 with 16 features" in text and "largest drop" in text
    x = models.preprocess(photo, "resnet18")
    mask = fit_image_mask(segments, photo.shape[:2], x.shape[-1])
    assert len(mask.unique()) == 16
    result = incrinf.occlusion(models.load("resnet18"), x, target=3, feature_mask=mask, output="prob",
                               progress=False)
    top = result.features[int(np.argmax(result.heatmap))]
    assert f"largest drop {result.heatmap.max():.3f} at feature {top}" in text
