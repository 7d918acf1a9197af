"""The gallery in a real headless Chromium: no console errors, every image loads, sorting, filtering and the
enlarged view work, and nothing is fetched from the network."""

from __future__ import annotations

import asyncio
import csv
import re
from pathlib import Path

import pytest
from cdp_browser import Page, chromium_path
from dataset_fixtures import (  # noqa: F401 (the photos and scans fixtures)
    BAD,
    BAD_SCANS,
    GOOD,
    GOOD_SCANS,
    MODEL,
    OPTIONS,
    SIZE,
    VOLUME_OPTIONS,
    photos_fixture,
    scans_fixture,
    small_net,
)

from incrinf.explain.dataset import explain_dataset

pytestmark = [pytest.mark.skipif(chromium_path() is None,
                                 reason="Chromium is not installed (apt-get install chromium; .ci/run installs it)"),
              pytest.mark.usefixtures("one_torch_thread")]  # the other xdist worker has the second core

ORDER = "[...document.querySelectorAll('#grid .card')].map((c) => c.dataset.id)"
IMAGES = """(async () => {
  const images = [...document.images];
  await Promise.all(images.map((i) => i.complete ? null : new Promise((r) => { i.onload = i.onerror = r; })));
  return images.map((i) => [i.getAttribute("src"), i.naturalWidth]);
})()"""


@pytest.fixture(scope="module")
def gallery_run(photos, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gallery")
    report = explain_dataset(MODEL, [photos / "data", str(photos / "extra" / "*.png")], out, size=SIZE,
                             progress=False, **OPTIONS)
    assert report.count("ok") == GOOD
    return out


def rows(out: Path) -> list[dict[str, str]]:
    with open(out / "results.csv", newline="") as fh:
        return [r for r in csv.DictReader(fh) if r["status"] == "ok"]


def test_gallery_is_self_contained(gallery_run) -> None:
    page = (gallery_run / "index.html").read_text()
    assert not re.search(r"(src|href)=\"(https?:)?//", page) and "http://" not in page and "https://" not in page
    for src in re.findall(r'src="([^"]+)"', page):
        assert (gallery_run / src).is_file(), src


def test_gallery_in_headless_chromium(gallery_run) -> None:
    table = rows(gallery_run)
    by_drop = [r["id"] for r in sorted(table, key=lambda r: -float(r["largest_drop"]))]  # no ties here
    by_name = [r["id"] for r in sorted(table, key=lambda r: (Path(r["path"]).name, r["path"]))]
    cat = "285"

    async def session():
        async with Page() as page:
            await page.goto((gallery_run / "index.html").resolve().as_uri())
            # lazy thumbnails all fit in the 1400x2000 window; load the rest (class means) too
            images = await page.evaluate(IMAGES)
            first_order = await page.evaluate(ORDER)
            await page.evaluate("document.querySelector('button[data-sort=name]').click()")
            name_order = await page.evaluate(ORDER)
            await page.evaluate("document.querySelector('button[data-sort=name]').click()")
            name_reversed = await page.evaluate(ORDER)
            await page.evaluate(f"(() => {{ const s = document.getElementById('class-filter'); s.value = '{cat}';"
                                " s.dispatchEvent(new Event('change')); })()")
            cats = await page.evaluate("[...document.querySelectorAll('#grid .card')].map((c) => c.dataset.target)")
            await page.evaluate("document.querySelector('#grid .card').click()")
            viewer = await page.evaluate("""(async () => {
              const v = document.getElementById('viewer');
              const imgs = [...v.querySelectorAll('img')];
              await Promise.all(imgs.map((i) => i.complete ? null : new Promise((r) => { i.onload = i.onerror = r; })));
              return {hidden: v.hidden, images: imgs.map((i) => [i.getAttribute('src'), i.naturalWidth])};
            })()""")
            return page.errors, images, first_order, name_order, name_reversed, cats, viewer

    errors, images, first_order, name_order, name_reversed, cats, viewer = asyncio.run(session())
    assert errors == []
    thumbs = [src for src, _ in images if src.endswith(".thumb.png")]
    assert len(thumbs) == GOOD and len(images) == GOOD + len(list((gallery_run / "stats").glob("*.png")))
    assert all(width > 0 for _, width in images), images
    assert first_order == by_drop  # default: largest drop first
    assert name_order == by_name and name_reversed == by_name[::-1]
    assert cats and set(cats) == {cat} and len(cats) == sum(r["target"] == cat for r in table)
    assert viewer["hidden"] is False and len(viewer["images"]) == 2
    assert viewer["images"][0][0].endswith(".overlay.png") and viewer["images"][1][0].endswith(".image.png")
    assert all(width > 0 for _, width in viewer["images"])
    assert BAD == 2  # the failed inputs are listed, not shown as broken images
    assert "Failed inputs (2)" in (gallery_run / "index.html").read_text()


def test_volume_gallery_in_headless_chromium(scans, tmp_path) -> None:
    out = tmp_path / "volumes"
    report = explain_dataset(small_net(), scans, out, progress=False, **VOLUME_OPTIONS)
    assert report.count("ok") == GOOD_SCANS and report.count("error") == BAD_SCANS
    page_text = (out / "index.html").read_text()
    assert f"Failed inputs ({BAD_SCANS})" in page_text
    best = max(rows(out), key=lambda r: float(r["largest_drop"]))

    async def session():
        async with Page() as page:
            await page.goto((out / "index.html").resolve().as_uri())
            images = await page.evaluate(IMAGES)
            order = await page.evaluate(ORDER)
            await page.evaluate("document.querySelector('#grid .card').click()")
            viewer = await page.evaluate("""(async () => {
              const v = document.getElementById('viewer');
              const imgs = [...v.querySelectorAll('img')];
              await Promise.all(imgs.map((i) => i.complete ? null : new Promise((r) => { i.onload = i.onerror = r; })));
              return {hidden: v.hidden, images: imgs.map((i) => [i.getAttribute('src'), i.naturalWidth]),
                      details: v.querySelector('.details').textContent};
            })()""")
            return page.errors, images, order, viewer

    errors, images, order, viewer = asyncio.run(session())
    assert errors == []
    assert len([src for src, _ in images if src.endswith(".thumb.png")]) == GOOD_SCANS
    assert all(width > 0 for _, width in images), images  # montages of slices, and the class mean's montage
    assert order[0] == best["id"]
    assert viewer["hidden"] is False and all(width > 0 for _, width in viewer["images"])
    corner = f"z={best['drop_z']}, y={best['drop_y']}, x={best['drop_x']}"
    assert corner in viewer["details"] and best["voxels_file"] in viewer["details"]
