"""Dataset runs: discovery, the CLI over folders and globs, errors in the table, resume, masks, atomic writes."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from dataset_fixtures import (
    BAD,
    GOOD,
    MODEL,
    OPTIONS,
    SIZE,
    CountingOcclusion,
    photo,
    photos_fixture,  # noqa: F401 (the photos fixture)
    save,
)

import incrinf
from incrinf import cli, models
from incrinf.explain.dataset import DatasetInterrupted, explain_dataset
from incrinf.explain.dataset.inputs import discover_inputs, find_masks
from incrinf.explain.dataset.stats import grid_positions, pixel_map
from incrinf.explain.dataset.store import atomic_write_bytes

# One torch thread: pytest-xdist runs another test on the second core, and two OpenMP threads on one busy core
# stall (the root conftest's fixture).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def read_table(out: Path) -> list[dict[str, str]]:
    with open(out / "results.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def cli_args(*inputs: str, out: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return ["explain", *inputs, "--out", str(out), "--model", MODEL, "--size", str(SIZE), "--patch", "16",
            "--stride", "16", "--output", "prob", "--quiet", *extra]  # the fixtures' OPTIONS


# --- discovery ------------------------------------------------------------------------------------------------


def test_discovery_walks_folders_expands_globs_and_dedupes(photos) -> None:
    data = photos / "data"
    selection = discover_inputs([str(data), str(photos / "extra" / "*.png"), str(data / "coffee.png")])
    rels = [item.rel for item in selection.items]
    assert rels == ["broken.jpg", "cats/chelsea.jpg", "cats/more/chelsea_flipped.png", "coffee.png", "notes.png",
                    "space/astronaut.png", "space/rocket.jpg", "camera.png", "coins.png"]  # coffee.png once
    assert [p.name for p in selection.skipped_non_images] == ["readme.txt"]
    ids = [item.id for item in selection.items]
    assert len(set(ids)) == len(ids) and all("/" not in i for i in ids)
    assert discover_inputs([str(data)]).items[1].id == selection.items[1].id  # stable across runs
    recursive = discover_inputs([str(photos / "**" / "*.jpg")])
    assert sorted(i.rel for i in recursive.items) == ["data/broken.jpg", "data/cats/chelsea.jpg",
                                                       "data/space/rocket.jpg"]


def test_discovery_errors_name_the_problem(photos, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="input not found"):
        discover_inputs([str(photos / "nope")])
    with pytest.raises(FileNotFoundError, match="no file matches"):
        discover_inputs([str(photos / "*.webp")])
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "labels.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="no image or volume files"):
        discover_inputs([str(tmp_path / "empty")])
    with pytest.raises(ValueError, match="no inputs"):
        discover_inputs([])


# --- the CLI over a real folder ---------------------------------------------------------------------------------


def test_cli_folder_glob_corrupt_and_non_image(photos, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    code = cli.main(cli_args(str(photos / "data"), str(photos / "extra" / "*.png"), out=out))
    assert code == 1  # two inputs failed
    rows = read_table(out)
    assert len(rows) == GOOD + BAD
    by_name = {Path(r["path"]).name: r for r in rows}
    assert by_name["broken.jpg"]["status"] == "error" and "truncated" in by_name["broken.jpg"]["error"]
    assert by_name["notes.png"]["status"] == "error" and "not an image" in by_name["notes.png"]["error"]
    good = [r for r in rows if r["status"] == "ok"]
    assert len(good) == GOOD
    assert by_name["chelsea.jpg"]["target"] == "285" and by_name["chelsea.jpg"]["class_name"] == "Egyptian cat"
    for row in good:
        heat = np.load(out / row["heatmap_file"])
        assert heat.shape == (4, 4) and heat.dtype == np.float32
        assert float(row["largest_drop"]) == pytest.approx(float(heat.max()))
        assert (out / row["overlay_file"]).read_bytes()[:4] == b"\x89PNG"
        assert row["positions"] == "16" and float(row["theoretical_speedup"]) > 1
        record = json.loads((out / "items" / f"{row['id']}.json").read_text())
        assert record["status"] == "ok" and set(record["files"]) >= {"heatmap", "overlay", "image", "thumb"}
    assert not list(out.rglob(".*.tmp*"))  # no temporary file left behind
    text = capsys.readouterr().out
    assert f"{GOOD + BAD} inputs: {GOOD} explained, {BAD} failed" in text and "readme.txt" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == BAD and summary["class_means"]

    # the dataset path computes what incrinf.occlusion computes on the same preprocessed image
    model = models.load(MODEL)
    x = models.preprocess(photo("chelsea")[:, ::-1].copy(), MODEL, size=SIZE)
    direct = incrinf.occlusion(model, x, progress=False, **OPTIONS)
    flipped = by_name["chelsea_flipped.png"]
    np.testing.assert_allclose(np.load(out / flipped["heatmap_file"]), direct.heatmap, rtol=0, atol=1e-6)


def test_cli_usage_errors(photos, tmp_path, capsys) -> None:
    assert cli.main(cli_args(str(photos / "data" / "nothing_here"), str(photos / "extra"), out=tmp_path)) == 2
    assert "input not found" in capsys.readouterr().err
    assert cli.main(["explain", str(photos / "extra"), "--out", str(tmp_path / "x.png"), "--quiet"]) == 2
    assert "give --out DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --ray would swallow the folder as its address
        cli.main(["explain", "--ray", str(photos / "extra"), "--out", str(tmp_path)])
    assert "not a Ray address" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["explain", str(photos / "extra"), "--out", str(tmp_path), "--mask-threshold", "2"])


# --- resume ---------------------------------------------------------------------------------------------------


def test_interrupted_run_then_rerun_does_exactly_the_rest(photos, tmp_path, monkeypatch) -> None:
    inputs = [str(photos / "data" / "cats"), str(photos / "data" / "space"), str(photos / "extra")]
    out, n, k = tmp_path / "run", 6, 2
    run = CountingOcclusion(monkeypatch, interrupt_at=k + 1)  # Ctrl-C while explaining input k + 1
    with pytest.raises(DatasetInterrupted) as stop:
        explain_dataset(MODEL, inputs, out, size=SIZE, progress=False, **OPTIONS)
    report = stop.value.report
    assert report.exit_code == 130 and report.count("ok") == k and report.count("pending") == n - k
    assert [r["status"] for r in read_table(out)] == ["ok"] * k + ["pending"] * (n - k)  # table kept up to date
    done_first = {r["id"] for r in read_table(out) if r["status"] == "ok"}

    explained = []
    run = CountingOcclusion(monkeypatch)
    report = explain_dataset(MODEL, inputs, out, size=SIZE, progress=False, callback=explained.append, **OPTIONS)
    assert run.calls == n - k and report.computed == n - k and report.skipped == k
    assert {r["id"] for r in explained}.isdisjoint(done_first)
    assert report.exit_code == 0 and [r["status"] for r in read_table(out)] == ["ok"] * n

    run = CountingOcclusion(monkeypatch)
    assert explain_dataset(MODEL, inputs, out, size=SIZE, progress=False, **OPTIONS).skipped == n
    assert run.calls == 0

    # partial outputs are redone: a truncated overlay, a missing heat map, a record from other settings
    rows = read_table(out)
    overlay = out / rows[0]["overlay_file"]
    overlay.write_bytes(overlay.read_bytes()[:100])
    (out / rows[1]["heatmap_file"]).unlink()
    record_path = out / "items" / f"{rows[2]['id']}.json"
    record = json.loads(record_path.read_text())
    record_path.write_text(json.dumps(dict(record, settings="0" * 16)))
    run = CountingOcclusion(monkeypatch)
    report = explain_dataset(MODEL, inputs, out, size=SIZE, progress=False, **OPTIONS)
    assert run.calls == 3 and report.computed == 3

    run = CountingOcclusion(monkeypatch)
    explain_dataset(MODEL, inputs, out, size=SIZE, progress=False, overwrite=True, **OPTIONS)
    assert run.calls == n
    run = CountingOcclusion(monkeypatch)  # another stride is another result: nothing counts as complete
    explain_dataset(MODEL, inputs, out, size=SIZE, progress=False, **dict(OPTIONS, stride=8))
    assert run.calls == n
    assert np.load(out / read_table(out)[0]["heatmap_file"]).shape == (7, 7)


def test_changed_input_file_is_explained_again(photos, tmp_path, monkeypatch) -> None:
    folder = tmp_path / "in"
    shutil.copytree(photos / "extra", folder)
    out = tmp_path / "run"
    explain_dataset(MODEL, folder, out, size=SIZE, progress=False, **OPTIONS)
    save(folder / "coins.png", photo("coffee"))  # same name, new picture
    run = CountingOcclusion(monkeypatch)
    report = explain_dataset(MODEL, folder, out, size=SIZE, progress=False, **OPTIONS)
    assert run.calls == 1 and report.skipped == 1


def test_second_writer_on_the_same_folder_is_refused(photos, tmp_path) -> None:
    from incrinf.explain.dataset.store import RunFolder

    with RunFolder(tmp_path / "run"):
        with pytest.raises(RuntimeError, match="another incrinf run"):
            explain_dataset(MODEL, photos / "extra", tmp_path / "run", size=SIZE, progress=False, **OPTIONS)


# --- atomic writes ----------------------------------------------------------------------------------------------


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path) -> None:
    from incrinf.explain.dataset.store import atomic_write

    target = tmp_path / "table.csv"
    atomic_write_bytes(target, b"old")

    def half_then_crash(tmp: Path) -> None:
        tmp.write_bytes(b"ne")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, half_then_crash)
    assert target.read_bytes() == b"old" and list(tmp_path.iterdir()) == [target]


# --- statistics: pixel maps, masks, class means ------------------------------------------------------------------


def test_pixel_map_equals_occlusion_result_pixel_map() -> None:
    rng = np.random.default_rng(0)
    for hw, patch, stride in [((64, 64), (16, 16), (16, 16)), ((50, 37), (9, 7), (4, 3)), ((30, 30), (8, 8), (7, 7))]:
        positions = incrinf.analysis.occlusion_grid(hw, patch, stride)  # windows may pass the edge
        rows = -(-(hw[0] - patch[0]) // stride[0]) + 1
        heat = rng.normal(size=(rows, len(positions) // rows)).astype(np.float32)
        np.testing.assert_array_equal(grid_positions(heat.shape, stride), positions)
        expected = incrinf.OcclusionResult(heat, positions, 0, patch, stride, hw).pixel_map()
        np.testing.assert_allclose(pixel_map(heat, positions, patch, hw), expected, rtol=1e-12, atol=1e-12)


def test_masks_flag_explanations_outside_them(photos, tmp_path) -> None:
    folder = tmp_path / "in"
    shutil.copytree(photos / "data" / "space", folder)
    masks = tmp_path / "masks"
    side = photo("astronaut").shape
    save(masks / "astronaut.png", np.full(side, 255, np.uint8))  # everything inside: share 1
    rocket = np.zeros(photo("rocket").shape, np.uint8)
    rocket[:16, 30:46] = 255  # a tag near the top edge: most heat falls outside it
    save(masks / "rocket.png", rocket)
    out = tmp_path / "run"
    report = explain_dataset(MODEL, folder, out, size=SIZE, progress=False, masks=masks, **OPTIONS)
    rows = {Path(r["path"]).stem: r for r in read_table(out)}
    assert float(rows["astronaut"]["mask_inside_share"]) == pytest.approx(1.0)
    assert rows["astronaut"]["mask_outside"] == "False"
    assert float(rows["rocket"]["mask_inside_share"]) < 0.1 and rows["rocket"]["mask_outside"] == "True"
    assert [Path(r["path"]).stem for r in report.mask_outside] == ["rocket"]
    summary = json.loads((out / "summary.json").read_text())
    assert [Path(r["path"]).stem for r in summary["mask_outside"]] == ["rocket"]
    assert "Explanations mostly outside the mask" in (out / "index.html").read_text()

    # masks given on a re-run are applied to the complete inputs without recomputing them; one file for all
    report = explain_dataset(MODEL, folder, out, size=SIZE, progress=False, masks=masks / "astronaut.png",
                             mask_threshold=0.2, **OPTIONS)
    assert report.computed == 0 and report.mask_outside == []
    assert all(float(r["mask_inside_share"]) == pytest.approx(1.0) for r in read_table(out))


def test_find_masks_by_relative_path_then_stem(tmp_path) -> None:
    from incrinf.explain.dataset.inputs import InputItem

    items = [InputItem(Path("/d/a/x.jpg"), "a/x.jpg", "x1"), InputItem(Path("/d/y.jpg"), "y.jpg", "y1"),
             InputItem(Path("/d/z.jpg"), "z.jpg", "z1")]
    for rel in ("a/x.png", "x.png", "y.png"):
        save(tmp_path / rel, np.zeros((4, 4, 3), np.uint8))
    found = find_masks(items, tmp_path)
    assert found == {"x1": (tmp_path / "a/x.png").resolve(), "y1": (tmp_path / "y.png").resolve()}
    with pytest.raises(FileNotFoundError, match="masks not found"):
        find_masks(items, tmp_path / "none")


def test_class_means_average_aligned_maps(photos, tmp_path) -> None:
    out = tmp_path / "run"
    report = explain_dataset(MODEL, photos / "data" / "cats", out, size=SIZE, progress=False,
                             **dict(OPTIONS, target=285))  # the mirror image alone would be a tiger cat (282)
    assert [(m.target, m.count) for m in report.class_means] == [(285, 2)]
    from incrinf.explain.dataset.store import RunFolder

    folder = RunFolder(out)
    maps = [folder.load_pixel_map(folder.read_record(r["id"])) for r in report.rows]
    assert report.class_means[0].peak == pytest.approx(float(np.mean(maps, axis=0).max()))
    assert (out / report.class_means[0].picture).read_bytes()[:4] == b"\x89PNG"


def test_misspelt_option_fails_before_any_work(photos, tmp_path) -> None:
    with pytest.raises(TypeError, match="not an option of incrinf.occlusion"):
        explain_dataset(MODEL, photos / "extra", tmp_path, size=SIZE, progress=False, strides=8)
    assert not (tmp_path / "results.csv").exists()
