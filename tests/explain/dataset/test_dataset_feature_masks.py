"""Dataset runs with one feature mask for every input (a label volume over a folder of scans, a segment image over
a folder of photos) and with ``target="all"``: each input's maps equal the single-input run's, an input of
another shape is an error row with both shapes, interrupted runs resume without redoing finished inputs, and a
changed mask or target is computed again rather than reused. The CLI takes ``--feature-mask`` and ``--target all``
with a folder."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from dataset_fixtures import (
    SHAPE,
    VOLUME_OPTIONS,
    CountingOcclusion,
    affine,
    scans_fixture,  # noqa: F401 (the scans fixture)
    small_net,
)

import incrinf
from incrinf import cli
from incrinf.cli.feature_mask import fit_image_mask, read_image_mask, read_volume_mask
from incrinf.cli.volume import read_volume
from incrinf.explain.dataset import DatasetInterrupted, explain_dataset
from incrinf.explain.dataset.volumes import read_nifti

nibabel = pytest.importorskip("nibabel")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 3  # scans of SHAPE in the folder the tests copy


def read_table(out: Path) -> list[dict[str, str]]:
    with open(out / "results.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def label_volume(path: Path, split: int = 5) -> Path:
    """A label volume of the scans' file shape (x, y, z): three regions, cut at x = ``split`` and y = 6."""
    labels = np.zeros(SHAPE, np.int16)
    labels[split:] = 1
    labels[split:, 6:] = 2
    nibabel.save(nibabel.Nifti1Image(labels, np.eye(4)), path)
    return path


@pytest.fixture(name="folder")
def folder_fixture(scans, tmp_path) -> Path:
    """Three readable scans of SHAPE (the fixture's p01-p03) and one of another shape."""
    folder = tmp_path / "scans"
    shutil.copytree(scans, folder, ignore=shutil.ignore_patterns("p04*", "p05*", "p06*", "p07*", "README*",
                                                                 "site-b"))
    rng = np.random.default_rng(1)
    nibabel.save(nibabel.Nifti1Image(rng.normal(size=(12, 12, 10)).astype(np.float32), affine(9)),
                 folder / "p09-other.nii.gz")
    return folder


def single(model: nn.Module, scan: str, mask: Path | None, **options) -> incrinf.OcclusionResult:
    """What ``incrinf explain SCAN --feature-mask MASK`` computes for one scan."""
    volume = read_volume(scan)
    labels = None if mask is None else read_volume_mask(str(mask), tuple(volume.shape[1:]))
    return incrinf.occlusion(model, volume, spatial_dims=3, feature_mask=labels, progress=False,
                             **{**VOLUME_OPTIONS, **options})


def test_label_mask_over_a_folder_equals_single_runs_and_skips_another_shape(folder, tmp_path) -> None:
    model, out, mask = small_net(), tmp_path / "run", label_volume(tmp_path / "atlas.nii.gz")
    report = explain_dataset(model, folder, out, feature_mask=mask, progress=False, **VOLUME_OPTIONS)
    rows = {Path(r["path"]).name: r for r in read_table(out)}
    assert report.exit_code == 1 and report.count("ok") == N
    other = rows.pop("p09-other.nii.gz")
    assert other["status"] == "error" and other["error_kind"] == "mask"
    assert f"feature mask {mask} has shape 10x12x16 but the volume is 10x12x12" in other["error"]
    for row in rows.values():
        want = single(model, row["path"], mask)
        heat = np.load(out / row["heatmap_file"])
        assert heat.shape == want.heatmap.shape == (3,) and row["features"] == "3"
        np.testing.assert_array_equal(heat, np.asarray(want.heatmap, np.float32))
        np.testing.assert_array_equal(np.load(out / "items" / f"{row['id']}.features.npy"), want.features)
        assert int(row["target"]) == want.target
        voxels, _ = read_nifti(out / row["voxels_file"])
        np.testing.assert_allclose(voxels, want.pixel_map(), rtol=0, atol=1e-6)


def test_every_class_over_a_folder_equals_single_runs(folder, tmp_path) -> None:
    model, out = small_net(), tmp_path / "run"
    explain_dataset(model, folder, out, target="all", progress=False, **VOLUME_OPTIONS)
    rows = read_table(out)
    assert [r["status"] for r in rows] == ["ok"] * (N + 1)  # no mask: the fourth scan's shape is fine
    for row in rows:
        want = single(model, row["path"], None, target="all")
        heat = np.load(out / row["heatmap_file"])
        assert heat.shape == want.heatmap.shape and heat.shape[0] == 3 and row["every_class"] == "True"
        np.testing.assert_array_equal(heat, np.asarray(want.heatmap, np.float32))
        assert int(row["target"]) == want.predicted  # the drawn map, as the single-input picture draws it
        voxels, _ = read_nifti(out / row["voxels_file"])
        np.testing.assert_allclose(voxels, want.pixel_map()[want.predicted], rtol=0, atol=1e-6)
    mask = label_volume(tmp_path / "atlas.nii.gz")
    explain_dataset(model, folder, out, target="all", feature_mask=mask, progress=False, **VOLUME_OPTIONS)
    for row in (r for r in read_table(out) if r["status"] == "ok"):
        want = single(model, row["path"], mask, target="all")
        assert np.load(out / row["heatmap_file"]).shape == (3, 3)
        np.testing.assert_array_equal(np.load(out / row["heatmap_file"]), np.asarray(want.heatmap, np.float32))


def test_interrupted_mask_run_resumes_and_a_changed_mask_or_target_is_not_reused(folder, tmp_path,
                                                                                  monkeypatch) -> None:
    (folder / "p09-other.nii.gz").unlink()
    model, out, mask = small_net(), tmp_path / "run", label_volume(tmp_path / "atlas.nii.gz")
    options = dict(VOLUME_OPTIONS, feature_mask=mask, progress=False)
    run = CountingOcclusion(monkeypatch, interrupt_at=2)  # Ctrl-C while explaining the second scan
    with pytest.raises(DatasetInterrupted) as stop:
        explain_dataset(model, folder, out, **options)
    assert stop.value.report.count("ok") == 1
    first = {r["id"]: (out / r["heatmap_file"]).stat().st_mtime_ns for r in read_table(out) if r["status"] == "ok"}
    run = CountingOcclusion(monkeypatch)
    report = explain_dataset(model, folder, out, **options)
    assert run.calls == N - 1 and report.skipped == 1 and report.count("ok") == N
    assert {r["id"]: (out / r["heatmap_file"]).stat().st_mtime_ns for r in read_table(out) if r["id"] in first} \
        == first
    run = CountingOcclusion(monkeypatch)
    explain_dataset(model, folder, out, **options)
    assert run.calls == 0  # complete: nothing redone

    label_volume(mask, split=8)  # the same file, other labels: every scan again, with the new mask
    run = CountingOcclusion(monkeypatch)
    explain_dataset(model, folder, out, **options)
    assert run.calls == N
    row = read_table(out)[0]
    np.testing.assert_array_equal(np.load(out / row["heatmap_file"]),
                                  np.asarray(single(model, row["path"], mask).heatmap, np.float32))
    for changed in (dict(target="all"), dict(feature_mask=None)):  # another target, or windows: again
        run = CountingOcclusion(monkeypatch)
        explain_dataset(model, folder, out, **{**options, **changed})
        assert run.calls == N


def test_segment_image_over_a_folder_of_photos(tmp_path) -> None:
    """Images: one segment image for every photo of its size (resized and cropped as the photo is, nearest ids),
    equal to the single-image run; a photo of another size is an error row."""
    from PIL import Image

    rng = np.random.default_rng(2)
    folder = tmp_path / "photos"
    folder.mkdir()
    for name, (h, w) in (("a.png", (40, 48)), ("b.png", (40, 48)), ("c.png", (36, 36))):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / name)
    segments = np.zeros((40, 48), np.uint8)
    segments[:, 24:] = 1
    segments[20:, :] += 2
    Image.fromarray(segments).save(tmp_path / "segments.png")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 5)).eval()
    out = tmp_path / "run"
    explain_dataset(model, folder, out, size=32, normalization="imagenet", feature_mask=tmp_path / "segments.png",
                    target="all", progress=False, **VOLUME_OPTIONS)
    rows = {Path(r["path"]).name: r for r in read_table(out)}
    assert rows["c.png"]["error_kind"] == "mask" and "is 40x48 but the image is 36x36" in rows["c.png"]["error"]
    from incrinf import models

    for name in ("a.png", "b.png"):
        rgb = np.array(Image.open(folder / name).convert("RGB"))
        x = models.preprocess(rgb, "imagenet", size=32)
        labels = fit_image_mask(read_image_mask(str(tmp_path / "segments.png")), rgb.shape[:2], 32)
        want = incrinf.occlusion(model, x, feature_mask=labels, target="all", progress=False, **VOLUME_OPTIONS)
        np.testing.assert_array_equal(np.load(out / rows[name]["heatmap_file"]), np.asarray(want.heatmap, np.float32))


def test_cli_feature_mask_and_target_all_with_a_folder(folder, tmp_path, monkeypatch, capsys) -> None:
    from incrinf import models

    small = small_net(3)
    original = models.load
    monkeypatch.setattr(models, "load", lambda name, weights=None: small if name == "monai_densenet121_3d"
                        else original(name, weights))  # the zoo's DenseNet121 is too slow for a unit test
    mask = label_volume(tmp_path / "atlas.nii.gz")
    out = tmp_path / "results"
    args = ["explain", str(folder), "--out", f"{out}/", "--feature-mask", str(mask), "--target", "all", "--quiet"]
    assert cli.main(args) == 1  # the scan of another shape
    text = capsys.readouterr().out
    assert f"{N + 1} inputs: {N} explained, 1 failed" in text and "p09-other.nii.gz" in text
    row = read_table(out)[0]
    want = incrinf.occlusion(small, read_volume(row["path"]), spatial_dims=3, target="all", progress=False,
                             feature_mask=read_volume_mask(str(mask), (10, 12, 16)))
    np.testing.assert_array_equal(np.load(out / row["heatmap_file"]), np.asarray(want.heatmap, np.float32))
    assert cli.main(args) == 1 and f"{N} already complete" in capsys.readouterr().out
    np.save(tmp_path / "float.npy", np.full((10, 12, 16), 0.5))
    (tmp_path / "empty").mkdir()
    for bad, message in ((tmp_path / "gone.nii.gz", "feature mask not found"),
                         (tmp_path / "float.npy", "must hold integer ids"),
                         (folder / "p01.nii.gz", "must hold integer ids"),
                         (tmp_path / "empty", "holds no mask file")):
        assert cli.main([*args[:4], "--feature-mask", str(bad), "--quiet"]) == 2
        assert message in capsys.readouterr().err
