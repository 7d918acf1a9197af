"""The dataset path (``incrinf explain DIR --out DIR``) with the options issue 17 added to ``explain``: an occluder
mode reaches every input's occlusion run; the image defaults apply (patch 16, stride 4, the default model)."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from dataset_fixtures import MODEL, SIZE, photo
from dataset_fixtures import photos_fixture as photos_fixture  # noqa: F401 (the photos fixture)

import incrinf
from incrinf import cli, models

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_dataset_run_forwards_the_baseline_mode(photos, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert cli.main(["explain", str(photos / "extra"), "--out", str(out), "--model", MODEL, "--size", str(SIZE),
                     "--patch", "16", "--stride", "16", "--baseline", "mean_img", "--output", "prob",
                     "--quiet"]) == 0
    with open(out / "results.csv", newline="") as fh:
        rows = {row["path"].rsplit("/", 1)[-1]: row for row in csv.DictReader(fh)}
    model = models.load(MODEL)
    x = models.preprocess(photo("coins"), MODEL, size=SIZE)
    want = incrinf.occlusion(model, x, patch=16, stride=16, output="prob", baseline="mean_img", progress=False)
    zero = incrinf.occlusion(model, x, patch=16, stride=16, output="prob", progress=False)
    heat = np.load(out / rows["coins.png"]["heatmap_file"])
    np.testing.assert_allclose(heat, want.heatmap, rtol=0, atol=1e-6)
    assert np.abs(want.heatmap - zero.heatmap).max() > 1e-3  # the mode made a difference


def test_dataset_run_uses_the_image_defaults(photos, tmp_path) -> None:
    out = tmp_path / "run"
    assert cli.main(["explain", str(photos / "extra" / "coins.png"), "--out", f"{out}/", "--size", str(SIZE),
                     "--quiet"]) == 0
    with open(out / "results.csv", newline="") as fh:
        row = next(csv.DictReader(fh))
    assert np.load(out / row["heatmap_file"]).shape == (13, 13)  # 64 px, patch 16, stride 4
