"""Dataset runs over folders of NIfTI volumes: heat maps equal single-volume occlusion, voxel maps carry the scan's
affine, a run resumes after an interruption, a corrupt scan is an error row, class means per voxel, the CLI, and
clear errors for mixed folders and options of the other kind."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from dataset_fixtures import (
    BAD_SCANS,
    GOOD_SCANS,
    SHAPE,
    VOLUME_OPTIONS,
    CountingOcclusion,
    affine,
    scans_fixture,  # noqa: F401 (the scans fixture)
    small_net,
)

import incrinf
from incrinf import cli
from incrinf.cli.volume import read_volume
from incrinf.explain.dataset import DatasetInterrupted, explain_dataset
from incrinf.explain.dataset.stats import pixel_map
from incrinf.explain.dataset.volumes import decode_volume, read_nifti, resampled

nibabel = pytest.importorskip("nibabel")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

OPTIONS = VOLUME_OPTIONS
GOOD, BAD = GOOD_SCANS, BAD_SCANS


def read_table(out: Path) -> list[dict[str, str]]:
    with open(out / "results.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_heat_maps_equal_single_volume_occlusion_and_carry_the_scan_affine(scans, tmp_path) -> None:
    model = small_net()
    out = tmp_path / "run"
    report = explain_dataset(model, scans, out, progress=False, **OPTIONS)
    rows = read_table(out)
    assert report.exit_code == 1 and report.kind == "volumes"
    assert [r["status"] for r in rows].count("ok") == GOOD and [r["status"] for r in rows].count("error") == BAD
    assert report.skipped_non_images == [str(scans / "README.txt")]
    for row in (r for r in rows if r["status"] == "ok"):
        volume = read_volume(row["path"])  # what `incrinf explain VOLUME` explains
        want = incrinf.occlusion(model, volume, output="prob", patch=4, stride=4, spatial_dims=3, progress=False)
        heat = np.load(out / row["heatmap_file"])
        assert heat.shape == want.heatmap.shape == (3, 3, 4)
        np.testing.assert_allclose(heat, want.heatmap, rtol=0, atol=1e-6)
        assert int(row["target"]) == want.target
        voxels, world = read_nifti(out / row["voxels_file"])
        np.testing.assert_allclose(voxels, want.pixel_map(), rtol=0, atol=1e-6)
        np.testing.assert_allclose(world, nibabel.load(row["path"]).affine, atol=1e-5)
        stored = nibabel.load(out / row["voxels_file"])
        assert stored.shape == SHAPE  # the scan's own (x, y, z) order: it overlays the scan in any viewer
        corner = want.positions[int(np.argmax(want.heatmap))]
        assert [int(row[k]) for k in ("drop_z", "drop_y", "drop_x")] == corner.tolist()
        for kind in ("overlay", "image", "thumb"):
            assert (out / "items" / f"{row['id']}.{kind}.png").read_bytes()[:4] == b"\x89PNG"
    gallery = (out / "index.html").read_text()
    assert gallery.count('"voxels": "items/') == GOOD and "p06-broken.nii.gz" in gallery


def test_corrupt_scans_are_error_rows_with_their_reason(scans, tmp_path) -> None:
    out = tmp_path / "run"
    explain_dataset(small_net(), scans, out, progress=False, **OPTIONS)
    errors = {Path(r["path"]).name: r for r in read_table(out) if r["status"] == "error"}
    assert set(errors) == {"p06-broken.nii.gz", "p07-text.nii"}
    for row in errors.values():
        assert row["error_kind"] == "decode" and row["error"].startswith(f"cannot read volume {Path(row['path']).name}")
    assert "cut short" in errors["p06-broken.nii.gz"]["error"]


def test_interrupted_volume_run_resumes_without_redoing_finished_scans(scans, tmp_path, monkeypatch) -> None:
    folder = tmp_path / "scans"
    shutil.copytree(scans, folder, ignore=shutil.ignore_patterns("p06*", "p07*", "README*"))
    model, out, n, k = small_net(), tmp_path / "run", GOOD, 2
    run = CountingOcclusion(monkeypatch, interrupt_at=k + 1)  # Ctrl-C while explaining scan k + 1
    with pytest.raises(DatasetInterrupted) as stop:
        explain_dataset(model, folder, out, progress=False, **OPTIONS)
    assert stop.value.report.count("ok") == k and stop.value.report.count("pending") == n - k
    first = {r["id"]: (out / r["voxels_file"]).stat().st_mtime_ns for r in read_table(out) if r["status"] == "ok"}
    assert len(first) == k

    explained = []
    run = CountingOcclusion(monkeypatch)
    report = explain_dataset(model, folder, out, progress=False, callback=explained.append, **OPTIONS)
    assert run.calls == n - k and report.computed == n - k and report.skipped == k
    assert {r["id"] for r in explained}.isdisjoint(first)
    rows = read_table(out)
    assert [r["status"] for r in rows] == ["ok"] * n
    assert {r["id"]: (out / r["voxels_file"]).stat().st_mtime_ns for r in rows if r["id"] in first} == first

    # a lost voxel map is redone; another resize is another result for every scan
    (out / rows[0]["voxels_file"]).unlink()
    run = CountingOcclusion(monkeypatch)
    explain_dataset(model, folder, out, progress=False, **OPTIONS)
    assert run.calls == 1
    run = CountingOcclusion(monkeypatch)
    explain_dataset(model, folder, out, progress=False, resize=(8, 8, 8), **OPTIONS)
    assert run.calls == n
    assert np.load(out / read_table(out)[0]["heatmap_file"]).shape == (2, 2, 2)


def test_class_means_are_per_voxel(scans, tmp_path) -> None:
    out = tmp_path / "run"
    report = explain_dataset(small_net(), scans, out, progress=False, **dict(OPTIONS, target=1))
    (mean,) = report.class_means
    assert mean.target == 1 and mean.count == GOOD
    maps = [read_nifti(out / r["voxels_file"])[0] for r in read_table(out) if r["status"] == "ok"]
    values, world = read_nifti(out / mean.volume)
    np.testing.assert_allclose(values, np.mean(maps, axis=0), atol=1e-6)
    assert values.shape == (10, 12, 16) and world.shape == (4, 4)
    assert (out / mean.picture).read_bytes()[:4] == b"\x89PNG"


def test_resampled_affine_maps_new_voxel_centres_to_the_old_grid() -> None:
    rng = np.random.default_rng(1)
    scan = decode_volume(_nifti_bytes(rng.normal(size=(16, 12, 8)).astype(np.float32), affine(3)), "s")
    half = resampled(scan, (4, 6, 8))  # (D, H, W): every axis halved
    # with align_corners=False new voxel i spans old voxels 2i, 2i + 1: its centre is old coordinate 2i + 0.5
    for new in ([0, 0, 0], [3, 5, 1], [7, 2, 3]):
        old = [2 * v + 0.5 for v in new]
        np.testing.assert_allclose(half.affine @ [*new, 1], scan.affine @ [*old, 1], atol=1e-9)
    assert half.voxels.shape == (4, 6, 8)
    assert resampled(scan, None) is scan


def test_nifti_decoding_reads_gzip_nifti2_and_4d_and_refuses_the_rest() -> None:
    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    plain = decode_volume(_nifti_bytes(data, np.eye(4)), "a")
    assert plain.voxels.shape == (4, 3, 2) and abs(float(plain.voxels.mean())) < 1e-6
    np.testing.assert_allclose(plain.voxels, decode_volume(_nifti_bytes(data, np.eye(4), gz=True), "a").voxels)
    four = np.stack([data, 2 * data + 1], axis=-1)
    np.testing.assert_allclose(decode_volume(_nifti_bytes(four, np.eye(4)), "b", index=1).voxels, plain.voxels,
                               atol=1e-6)  # standardised: 2x + 1 reads as x
    with pytest.raises(ValueError, match="cannot read volume b: it holds 2 volumes; volume index 2"):
        decode_volume(_nifti_bytes(four, np.eye(4)), "b", index=2)
    with pytest.raises(ValueError, match="cannot read volume c: the file is empty"):
        decode_volume(b"", "c")
    with pytest.raises(ValueError, match="not NIfTI"):
        decode_volume(b"P5 not a scan", "d")
    with pytest.raises(ValueError, match=r"not a 3-D volume \(shape \(3, 4\)\)"):
        decode_volume(_nifti_bytes(data[0], np.eye(4)), "e")
    bad = data.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        decode_volume(_nifti_bytes(bad, np.eye(4)), "f")


def test_pixel_map_of_volumes_equals_occlusion_result() -> None:
    rng = np.random.default_rng(2)
    result = incrinf.OcclusionResult(rng.normal(size=(3, 2, 4)), _corners((3, 2, 4), (3, 5, 2)), 0, (4, 6, 3),
                                     (3, 5, 2), (10, 11, 9))
    np.testing.assert_allclose(pixel_map(result.heatmap, result.positions, result.patch, result.image_shape),
                               result.pixel_map(), atol=1e-12)


def test_mixed_folders_and_options_of_the_other_kind_are_clear_errors(scans, tmp_path) -> None:
    from PIL import Image

    mixed = tmp_path / "mixed"
    shutil.copytree(scans, mixed, ignore=shutil.ignore_patterns("p0[2-7]*", "site-b"))
    Image.new("RGB", (8, 8)).save(mixed / "photo.png")
    with pytest.raises(ValueError, match=r"mix 1 NIfTI volume\(s\) \(e.g. p01.nii.gz\) with 1 other file\(s\) "
                                         r"\(e.g. photo.png\)"):
        explain_dataset(small_net(), mixed, tmp_path / "run", progress=False)
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (8, 8)).save(images / "photo.png")
    model = small_net()
    cases = [
        (dict(inputs=scans, model="resnet18"), "resnet18 explains RGB images, and these inputs are NIfTI volumes"),
        (dict(inputs=images, model="monai_densenet121_3d"), "explains 3-D volumes, and these inputs are images"),
        (dict(inputs=scans, size=64), "size= are for images"),
        (dict(inputs=images, resize=(8, 8, 8)), "are for NIfTI volumes; these inputs are images"),
        (dict(inputs=scans, resize=(8, 8)), r"resize must be three positive ints \(D, H, W\), got \(8, 8\)"),
        (dict(inputs=scans, volume_index=-1), "volume_index must be an int >= 0"),
        (dict(inputs=scans, masks=images), "a volume run has none"),
        (dict(inputs=scans, feature_mask=scans / "p01.nii.gz"), "must hold integer ids"),
        (dict(inputs=scans, spatial_dims=2), "volumes have 3 spatial axes"),
    ]
    for kwargs, message in cases:
        kwargs = {"model": model, **kwargs}
        with pytest.raises(ValueError, match=message):
            explain_dataset(kwargs.pop("model"), kwargs.pop("inputs"), tmp_path / "bad", progress=False, **kwargs)
    assert not (tmp_path / "bad" / "results.csv").exists()


def test_cli_explains_a_folder_of_scans(scans, tmp_path, monkeypatch, capsys) -> None:
    from incrinf import models

    small = small_net(3)
    original = models.load
    monkeypatch.setattr(models, "load", lambda name, weights=None: small if name == "monai_densenet121_3d"
                        else original(name, weights))  # the zoo's DenseNet121 is too slow for a unit test
    out = tmp_path / "results"
    args = ["explain", str(scans), "--out", f"{out}/", "--patch", "4", "--stride", "4", "--resize", "8x8x12",
            "--quiet"]
    assert cli.main(args) == 1  # two corrupt scans
    text = capsys.readouterr().out
    assert f"{GOOD + BAD} inputs: {GOOD} explained, {BAD} failed" in text and "p06-broken.nii.gz" in text
    rows = read_table(out)
    heat = np.load(out / rows[0]["heatmap_file"])
    want = incrinf.occlusion(small, torch.nn.functional.interpolate(read_volume(rows[0]["path"])[None],
                                                                    size=(8, 8, 12), mode="trilinear")[0],
                             patch=4, stride=4, progress=False)
    np.testing.assert_allclose(heat, want.heatmap, atol=1e-6)
    assert cli.main(args) == 1  # resumed: only the failed scans are tried again
    assert f"this run: {BAD} computed" in (text := capsys.readouterr().out) and f"{GOOD} already complete" in text
    for extra, message in ((["--size", "64"], "--size is for images"),
                           (["--feature-mask", str(scans / "p01.nii.gz")], "must hold integer ids")):
        assert cli.main([*args, *extra]) == 2
        assert message in capsys.readouterr().err


def _nifti_bytes(data: np.ndarray, world: np.ndarray, gz: bool = False) -> bytes:
    import gzip

    raw = nibabel.Nifti1Image(data, world).to_bytes()
    return gzip.compress(raw) if gz else raw


def _corners(grid: tuple[int, ...], stride: tuple[int, ...]) -> np.ndarray:
    axes = np.meshgrid(*[np.arange(n) * s for n, s in zip(grid, stride)], indexing="ij")
    return np.stack([a.ravel() for a in axes], axis=1)


def test_volume_index_of_4d_files_and_a_scan_too_thin_for_the_window(tmp_path) -> None:
    folder = tmp_path / "scans"
    folder.mkdir()
    rng = np.random.default_rng(3)
    series = rng.normal(size=(*SHAPE, 3)).astype(np.float32)  # a 4-D (x, y, z, t) file
    nibabel.save(nibabel.Nifti1Image(series, affine(0)), folder / "series.nii.gz")
    nibabel.save(nibabel.Nifti1Image(rng.normal(size=(4, 4, 1)).astype(np.float32), affine(0)),
                 folder / "thin.nii.gz")  # one slice: thinner than the window
    model = small_net()
    out = tmp_path / "run"
    report = explain_dataset(model, folder, out, volume_index=2, progress=False, **OPTIONS)
    rows = {Path(r["path"]).name: r for r in read_table(out)}
    assert report.count("ok") == 1 and rows["thin.nii.gz"]["error_kind"] == "explain"
    assert "patch 4x4x4 is larger than the 1x4x4 input" in rows["thin.nii.gz"]["error"]
    want = incrinf.occlusion(model, read_volume(str(folder / "series.nii.gz"), index=2), output="prob", patch=4,
                             stride=4, spatial_dims=3, progress=False)
    np.testing.assert_allclose(np.load(out / rows["series.nii.gz"]["heatmap_file"]), want.heatmap, atol=1e-6)
    explain_dataset(model, folder, out, volume_index=3, progress=False, **OPTIONS)
    rows = {Path(r["path"]).name: r for r in read_table(out)}
    assert rows["series.nii.gz"]["error_kind"] == "decode"
    assert "it holds 3 volumes; volume index 3 is out of range" in rows["series.nii.gz"]["error"]
