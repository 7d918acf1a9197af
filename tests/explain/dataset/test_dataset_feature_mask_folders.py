"""Dataset runs with a folder of feature masks, one per input, matched by name: each input is explained with its
own mask (its heat map equals the single-input run with that mask), an input without a mask (or with two) is an
error row saying so, an interrupted run resumes, and an edited or added mask redoes exactly its input. Local
worker processes and Ray send each input's mask with it."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np
import pytest
from dataset_fixtures import (
    SHAPE,
    VOLUME_OPTIONS,
    CountingOcclusion,
    scans_fixture,  # noqa: F401 (the scans fixture)
    small_net,
)

import incrinf
from incrinf import cli
from incrinf.cli.feature_mask import read_volume_mask
from incrinf.cli.volume import read_volume
from incrinf.explain.dataset import DatasetInterrupted, explain_dataset

nibabel = pytest.importorskip("nibabel")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def read_table(out: Path, folder: Path) -> dict[str, dict[str, str]]:
    """The results table by input name (relative to the scans ``folder``, posix)."""
    with open(out / "results.csv", newline="") as fh:
        return {Path(r["path"]).relative_to(folder.resolve()).as_posix(): r for r in csv.DictReader(fh)}


def labels(split: int, parts: int) -> np.ndarray:
    """(x, y, z) ids of a scan's file shape: ``parts`` slabs along x from ``split`` on (1..3 features)."""
    out = np.zeros(SHAPE, np.int16)
    out[split:] = 1
    if parts > 2:
        out[split:, 6:] = 2
    return out


def save_nifti(path: Path, ids: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nibabel.save(nibabel.Nifti1Image(ids, np.eye(4)), path)
    return path


@pytest.fixture(name="folder")
def folder_fixture(scans, tmp_path) -> Path:
    """``scans/``: p01.nii.gz, p02.nii, p03.nii.gz and site-b/p04.nii.gz, all of SHAPE."""
    folder = tmp_path / "scans"
    shutil.copytree(scans, folder, ignore=shutil.ignore_patterns("p05*", "p06*", "p07*", "README*"))
    return folder


@pytest.fixture(name="masks")
def masks_fixture(tmp_path) -> Path:
    """Each scan's own mask, in every way a mask is matched: the same name (p01), another suffix (p02 as a
    (D, H, W) .npy), the relative path (site-b/p04 as .nii). p03 has none."""
    masks = tmp_path / "masks"
    save_nifti(masks / "p01.nii.gz", labels(5, 3))
    masks.joinpath("p02.npy").parent.mkdir(exist_ok=True)
    np.save(masks / "p02.npy", labels(9, 2).transpose(2, 1, 0))  # .npy masks are in (D, H, W) order
    save_nifti(masks / "site-b" / "p04.nii", labels(3, 3))
    return masks


def single(model, scan: Path, mask: Path):
    """What ``incrinf explain SCAN --feature-mask MASK`` computes for one scan."""
    volume = read_volume(str(scan))
    ids = read_volume_mask(str(mask), tuple(volume.shape[1:]))
    return incrinf.occlusion(model, volume, spatial_dims=3, feature_mask=ids, progress=False, **VOLUME_OPTIONS)


def check_own_masks(out: Path, folder: Path, masks: Path, model) -> dict[str, dict[str, str]]:
    """Each explained scan's heat map is its single run's with its own mask; p03 is an error row."""
    rows = read_table(out, folder)
    own = {"p01.nii.gz": masks / "p01.nii.gz", "p02.nii": masks / "p02.npy",
           "site-b/p04.nii.gz": masks / "site-b" / "p04.nii"}
    for name, mask in own.items():
        want = single(model, folder / name, mask)
        assert rows[name]["status"] == "ok" and int(rows[name]["features"]) == len(want.features)
        np.testing.assert_array_equal(np.load(out / rows[name]["heatmap_file"]),
                                      np.asarray(want.heatmap, np.float32))
    missing = rows["p03.nii.gz"]
    assert missing["status"] == "error" and missing["error_kind"] == "mask"
    assert f"no feature mask for p03.nii.gz in {masks}" in missing["error"]
    return rows


def test_each_scan_takes_its_own_mask_and_a_missing_mask_is_an_error_row(folder, masks, tmp_path) -> None:
    model, out = small_net(), tmp_path / "run"
    report = explain_dataset(model, folder, out, feature_mask=masks, progress=False, **VOLUME_OPTIONS)
    assert report.exit_code == 1 and report.count("ok") == 3 and report.count("error") == 1
    rows = check_own_masks(out, folder, masks, model)
    # the masks differ, so the maps do: p02's mask has 2 features, the others 3 (cut in other places)
    assert [rows[n]["features"] for n in ("p01.nii.gz", "p02.nii", "site-b/p04.nii.gz")] == ["3", "2", "3"]
    p01 = np.load(out / rows["p01.nii.gz"]["heatmap_file"])
    other = single(model, folder / "p01.nii.gz", masks / "site-b" / "p04.nii")  # p01 under p04's mask
    assert not np.array_equal(p01, np.asarray(other.heatmap, np.float32))
    np.testing.assert_array_equal(np.load(out / "items" / f"{rows['p02.nii']['id']}.features.npy"), [0, 1])


def test_two_matching_masks_or_a_mask_of_another_shape_are_error_rows(folder, masks, tmp_path) -> None:
    np.save(masks / "p01.npy", labels(5, 3).transpose(2, 1, 0))  # p01 now has .nii.gz and .npy
    save_nifti(masks / "p03.nii.gz", np.zeros((4, 4, 4), np.int16))
    out = tmp_path / "run"
    explain_dataset(small_net(), folder, out, feature_mask=masks, progress=False, **VOLUME_OPTIONS)
    rows = read_table(out, folder)
    assert rows["p01.nii.gz"]["error_kind"] == "mask"
    assert "two feature masks match p01.nii.gz" in rows["p01.nii.gz"]["error"]
    assert "p01.nii.gz and p01.npy" in rows["p01.nii.gz"]["error"]
    assert rows["p03.nii.gz"]["error_kind"] == "mask"
    assert "has shape 4x4x4 but the volume is 10x12x16" in rows["p03.nii.gz"]["error"]
    assert rows["p02.nii"]["status"] == "ok"


def test_interrupted_run_resumes_and_an_edited_or_added_mask_redoes_its_scan(folder, masks, tmp_path,
                                                                              monkeypatch) -> None:
    model, out = small_net(), tmp_path / "run"
    options = dict(VOLUME_OPTIONS, feature_mask=masks, progress=False)
    CountingOcclusion(monkeypatch, interrupt_at=2)  # Ctrl-C while explaining the second scan with a mask
    with pytest.raises(DatasetInterrupted) as stop:
        explain_dataset(model, folder, out, **options)
    assert stop.value.report.count("ok") == 1
    run = CountingOcclusion(monkeypatch)
    report = explain_dataset(model, folder, out, **options)
    assert run.calls == 2 and report.skipped == 1 and report.count("ok") == 3
    check_own_masks(out, folder, masks, model)
    run = CountingOcclusion(monkeypatch)
    explain_dataset(model, folder, out, **options)
    assert run.calls == 0  # complete (the mask-less scan is an error row, and error rows cost no occlusion)

    before = {name: row["heatmap_file"] for name, row in read_table(out, folder).items() if row["status"] == "ok"}
    stamps = {name: (out / f).stat().st_mtime_ns for name, f in before.items()}
    save_nifti(masks / "site-b" / "p04.nii", labels(7, 2))  # p04's mask edited
    save_nifti(masks / "p03.nii.gz", labels(4, 3))  # p03's mask added
    run = CountingOcclusion(monkeypatch)
    report = explain_dataset(model, folder, out, **options)
    assert run.calls == 2 and report.count("ok") == 4
    rows = read_table(out, folder)
    for name in ("p01.nii.gz", "p02.nii"):  # untouched masks: their outputs are kept
        assert (out / rows[name]["heatmap_file"]).stat().st_mtime_ns == stamps[name]
    for name, mask in (("site-b/p04.nii.gz", masks / "site-b" / "p04.nii"), ("p03.nii.gz", masks / "p03.nii.gz")):
        np.testing.assert_array_equal(np.load(out / rows[name]["heatmap_file"]),
                                      np.asarray(single(model, folder / name, mask).heatmap, np.float32))


def test_worker_processes_send_each_scan_its_mask(folder, masks, tmp_path) -> None:
    model, out = small_net(), tmp_path / "run"
    report = explain_dataset(model, folder, out, feature_mask=masks, workers=2, progress=False, **VOLUME_OPTIONS)
    assert report.executor != "in-process" and report.workers == 2
    check_own_masks(out, folder, masks, model)


def test_ray_actors_send_each_scan_its_mask(folder, masks, tmp_path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'incrinf[ray]')")
    model, out = small_net(), tmp_path / "run"
    report = explain_dataset(model, folder, out, feature_mask=masks, ray=True, workers=1, progress=False,
                             **VOLUME_OPTIONS)
    assert report.executor == "ray"
    check_own_masks(out, folder, masks, model)


def test_cli_feature_mask_folder(folder, masks, tmp_path, monkeypatch, capsys) -> None:
    from incrinf import models

    small = small_net()
    monkeypatch.setattr(models, "load", lambda name, weights=None: small)  # the zoo's DenseNet121 is too slow here
    out = tmp_path / "results"
    args = ["explain", str(folder), "--out", f"{out}/", "--quiet", "--patch", "4", "--stride", "4", "--output", "prob"]
    assert cli.main([*args, "--feature-mask", str(masks)]) == 1  # p03 has no mask
    text = capsys.readouterr().out
    assert "4 inputs: 3 explained, 1 failed" in text and "no feature mask for p03.nii.gz" in text
    check_own_masks(out, folder, masks, small)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main([*args, "--feature-mask", str(empty)]) == 2
    assert f"feature mask folder {empty} holds no mask file" in capsys.readouterr().err
    one = ["explain", str(folder / "p01.nii.gz"), "--out", str(tmp_path / "one.png"), "--quiet"]
    with pytest.raises(SystemExit, match="is a folder: a folder of each input's own mask is for dataset runs"):
        cli.main([*one, "--feature-mask", str(masks)])
    with pytest.raises(SystemExit):
        cli.main(["explain", "--help"])
    assert "the input sub/scan01.nii.gz takes DIR/sub/scan01.EXT, else DIR/scan01.EXT" in \
        " ".join(capsys.readouterr().out.split())
