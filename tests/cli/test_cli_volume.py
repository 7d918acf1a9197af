"""``incrinf explain VOLUME.nii.gz``: the real fMRI volume nibabel ships, a montage written; bad volumes and
models are clear errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from incrinf import cli

nibabel = pytest.importorskip("nibabel")
pytest.importorskip("monai")

from incrinf.cli.volume import read_volume  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(nibabel.__file__), "tests", "data", "example4d.nii.gz")


def test_explain_a_real_volume_writes_a_montage(tmp_path, capsys) -> None:
    out = tmp_path / "montage.png"
    assert cli.main(["explain", EXAMPLE, "--resize", "32x32x32", "--patch", "16", "--stride", "16",
                     "--baseline", "mean_img", "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "of a 32x32x32 volume with 8 positions" in text and "montage written" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_read_volume_axes_and_standardisation(tmp_path) -> None:
    data = np.random.default_rng(0).normal(5.0, 3.0, (6, 7, 8)).astype(np.float32)  # (x, y, z)
    path = tmp_path / "v.nii"
    nibabel.save(nibabel.Nifti1Image(data, np.eye(4)), path)
    volume = read_volume(str(path))
    assert volume.shape == (1, 8, 7, 6)  # (C, D, H, W) = (1, z, y, x)
    assert abs(float(volume.mean())) < 1e-5 and abs(float(volume.std(unbiased=False)) - 1) < 1e-4
    expected = (data[2, 3, 4] - data.mean()) / data.std()
    assert abs(float(volume[0, 4, 3, 2]) - expected) < 1e-4
    fmri = read_volume(EXAMPLE, index=1)
    assert fmri.shape == (1, 24, 96, 128) and torch.isfinite(fmri).all()


def test_bad_volumes_and_models(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.nii.gz"
    bad.write_bytes(b"not a volume")
    with pytest.raises(SystemExit, match="cannot read volume"):
        cli.main(["explain", str(bad), "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match="not found"):
        cli.main(["explain", str(tmp_path / "missing.nii")])
    with pytest.raises(SystemExit, match="out of range"):
        cli.main(["explain", EXAMPLE, "--volume-index", "5"])
    assert cli.main(["explain", EXAMPLE, "--model", "resnet18"]) == 2
    assert "needs a 3-D model" in capsys.readouterr().err
    assert cli.main(["explain", "--model", "monai_densenet121_3d"]) == 2
    assert "NIfTI" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["explain", EXAMPLE, "--resize", "32x32"])
    # the fMRI volume has 24 slices: too few for DenseNet121's five halvings, a clear capture error
    assert cli.main(["explain", EXAMPLE, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "fails on an input of shape (1, 1, 24, 96, 128)" in err and "smaller than kernel size" in err
    assert "ShapeProp" not in err and "Traceback" not in err  # the model's own error, not torch.fx's wrapping
    assert "resample it with --resize, e.g. --resize 32x96x128" in err  # the smallest power of two that runs


def test_volume_approximation_options_and_several_inputs(tmp_path, capsys) -> None:
    out = tmp_path / "montage.png"
    assert cli.main(["explain", EXAMPLE, "--resize", "32x32x32", "--patch", "16", "--stride", "16",
                     "--feature-threshold", "0.5", "--measure-quality", "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "approximate: feature threshold 0.5" in text and "vs the exact map" in text and "max |error|" in text
    assert cli.main(["explain", EXAMPLE, "--drill-down", "0.25", "--quiet"]) == 2
    assert "--drill-down is for images" in capsys.readouterr().err
    # several volumes are a dataset run (tests/explain/dataset/test_dataset_volumes.py); with an image, an error
    photo = tmp_path / "photo.png"
    from PIL import Image

    Image.new("RGB", (8, 8)).save(photo)
    assert cli.main(["explain", EXAMPLE, str(photo), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    assert "mix 1 NIfTI volume(s)" in capsys.readouterr().err
