"""The gallery of a dataset run: one self-contained static ``index.html`` (inline CSS and JavaScript, no server,
no network) next to the run's pictures, which it references by relative paths.

Every explained input is a thumbnail card with its class, score and largest drop; the cards sort by name,
score or largest drop and filter by class and by name; a click opens the overlay beside the model's input.
Below: the mean heat map per class, the inputs whose explanation falls mostly outside their mask, and the
failures.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from incrinf.explain.dataset.store import STATUS_ERROR, STATUS_OK, atomic_write_bytes

if TYPE_CHECKING:
    from incrinf.explain.dataset.report import DatasetReport


def write_gallery(root: Path, report: DatasetReport, labels: Sequence[str] | None = None) -> Path:
    """Write ``root/index.html`` for ``report``; returns its path."""
    items = [_card(row) for row in report.rows if row["status"] == STATUS_OK]
    classes = sorted({item["target"] for item in items})
    names = {c: (labels[c] if labels and 0 <= c < len(labels) else "") for c in classes}
    page = _PAGE.format(
        title=html.escape(f"incrinf: occlusion explanations of {len(report.rows)} inputs"),
        counts=html.escape(f"{report.count(STATUS_OK)} explained, {report.count(STATUS_ERROR)} failed, "
                           f"{len(report.rows) - report.count(STATUS_OK) - report.count(STATUS_ERROR)} not done"),
        class_options="".join(f'<option value="{c}">{c} {html.escape(names[c])} '
                              f'({sum(i["target"] == c for i in items)})</option>' for c in classes),
        class_means=_class_means(report, names),
        mask_section=_mask_section(report),
        failures=_failures(report),
        data=json.dumps(items).replace("</", "<\\/"),
        style=_STYLE,
        script=_SCRIPT,
    )
    path = root / "index.html"
    atomic_write_bytes(path, page.encode("utf-8"))
    return path


def _card(row: dict[str, Any]) -> dict[str, Any]:
    item_id = row["id"]
    return {
        "id": item_id, "name": Path(row["path"]).name, "path": row["path"], "target": row["target"],
        "label": row.get("class_name") or "", "score": row["score"], "drop": row["largest_drop"],
        "at": [v for v in (row.get("drop_z"), row["drop_y"], row["drop_x"]) if v is not None],
        "patch": row["patch"], "seconds": row["seconds"],
        "maskInside": row.get("mask_inside_share"),
        "thumb": f"items/{item_id}.thumb.png", "overlay": f"items/{item_id}.overlay.png",
        "image": f"items/{item_id}.image.png", "voxels": row.get("voxels_file"),
    }


def _class_means(report: DatasetReport, names: dict[int, str]) -> str:
    if not report.class_means:
        return "<p>No explained inputs yet.</p>"
    figures = []
    for mean in sorted(report.class_means, key=lambda m: (-m.count, m.target)):
        label = html.escape(f"{mean.target} {names.get(mean.target, '')}".strip())
        figures.append(f'<figure class="mean" data-target="{mean.target}" title="show only class {mean.target}">'
                       f'<img src="{html.escape(mean.picture)}" alt="mean heat map of class {mean.target}">'
                       f"<figcaption>{label}<br>{mean.count} input{'s' if mean.count != 1 else ''}, "
                       f"peak {mean.peak:.3g}</figcaption></figure>")
    return '<div class="means">' + "".join(figures) + "</div>"


def _mask_section(report: DatasetReport) -> str:
    checked = [r for r in report.rows if r.get("mask_inside_share") is not None]
    if not checked:
        return ""
    rows = "".join(f'<tr><td><a href="#" data-open="{html.escape(r["id"])}">{html.escape(r["path"])}</a></td>'
                   f"<td>{r['mask_inside_share']:.2f}</td><td>{1 - r['mask_inside_share']:.2f}</td></tr>"
                   for r in sorted(report.mask_outside, key=lambda r: r["mask_inside_share"]))
    body = (f"<table><thead><tr><th>input</th><th>heat inside</th><th>heat outside</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>") if rows else "<p>None.</p>"
    return (f'<section id="mask-check"><h2>Explanations mostly outside the mask</h2>'
            f"<p>{len(report.mask_outside)} of {len(checked)} inputs with a mask have more than "
            f"{report.mask_threshold:.0%} of their positive heat outside it (a sign of shortcut learning).</p>"
            f"{body}</section>")


def _failures(report: DatasetReport) -> str:
    failed = [r for r in report.rows if r["status"] == STATUS_ERROR]
    if not failed:
        return ""
    rows = "".join(f"<tr><td>{html.escape(r['path'])}</td><td>{html.escape(str(r.get('error_kind')))}</td>"
                   f"<td>{html.escape(str(r.get('error')))}</td></tr>" for r in failed)
    return (f'<section id="failures"><h2>Failed inputs ({len(failed)})</h2><table><thead><tr><th>input</th>'
            f"<th>kind</th><th>error</th></tr></thead><tbody>{rows}</tbody></table></section>")


_STYLE = """
body{font-family:system-ui,sans-serif;margin:0 1.5em 2em;color:#222;background:#fafafa}
header{position:sticky;top:0;background:#fafafa;padding:.6em 0;border-bottom:1px solid #ddd;z-index:1}
h1{font-size:1.3em;margin:.2em 0}h2{font-size:1.1em;margin-top:1.6em}
.controls{display:flex;gap:.8em;align-items:center;flex-wrap:wrap}
.controls button{border:1px solid #999;background:#fff;border-radius:4px;padding:.25em .7em;cursor:pointer}
.controls button.active{background:#246;color:#fff}
#grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(170px,1fr));gap:.8em;margin-top:1em}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px;cursor:pointer;font-size:.82em}
.card:hover{border-color:#246}.card img{width:100%;height:auto;display:block;image-rendering:auto}
.card .name{font-weight:600;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.means{display:flex;gap:1em;flex-wrap:wrap}.mean{margin:0;cursor:pointer;font-size:.82em;text-align:center}
.mean img{height:128px;width:auto}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ddd;padding:.2em .5em;text-align:left}
#viewer{position:fixed;inset:0;background:rgba(0,0,0,.8);display:flex;flex-direction:column;
 align-items:center;justify-content:center;z-index:2;color:#fff}
#viewer[hidden]{display:none}#viewer .pair{display:flex;gap:1em;align-items:center}
#viewer figure{margin:0;text-align:center}#viewer img{max-height:75vh;max-width:45vw;background:#fff}
#viewer button{margin-top:.8em}
"""

_SCRIPT = """
"use strict";
const items = JSON.parse(document.getElementById("data").textContent);
const grid = document.getElementById("grid");
const state = {key: "drop", desc: true, cls: "", text: ""};
const fmt = (v) => (v === null || v === undefined) ? "" : Number(v).toPrecision(3);
function card(it) {
  const el = document.createElement("div");
  el.className = "card"; el.dataset.id = it.id; el.dataset.target = it.target;
  const img = document.createElement("img");
  img.src = it.thumb; img.alt = "heat map of " + it.name; img.loading = "lazy";
  const name = document.createElement("div"); name.className = "name"; name.textContent = it.name;
  name.title = it.path;
  const meta = document.createElement("div");
  meta.textContent = "class " + it.target + (it.label ? " " + it.label : "") + " \\u00b7 score " + fmt(it.score) +
    " \\u00b7 drop " + fmt(it.drop) + (it.maskInside === null || it.maskInside === undefined ? "" :
    " \\u00b7 in mask " + fmt(it.maskInside));
  el.append(img, name, meta);
  el.addEventListener("click", () => openViewer(it));
  return el;
}
const cards = new Map(items.map((it) => [it.id, card(it)]));
const byText = (x, y) => (x < y ? -1 : x > y ? 1 : 0);  // code-point order, as the results table sorts
const byName = (a, b) => byText(a.name, b.name) || byText(a.path, b.path);
function compare(a, b) {
  const k = state.key;
  const d = k === "name" ? byName(a, b) : (a[k] - b[k]) || byName(a, b);
  return state.desc ? -d : d;
}
function render() {
  const shown = items.filter((it) => (state.cls === "" || String(it.target) === state.cls) &&
    (state.text === "" || it.path.toLowerCase().includes(state.text)));
  shown.sort(compare);
  grid.replaceChildren(...shown.map((it) => cards.get(it.id)));
  document.getElementById("shown").textContent = shown.length + " of " + items.length + " shown";
  for (const b of document.querySelectorAll("button[data-sort]")) {
    const on = b.dataset.sort === state.key;
    b.classList.toggle("active", on);
    b.textContent = b.dataset.label + (on ? (state.desc ? " \\u2193" : " \\u2191") : "");
  }
}
for (const b of document.querySelectorAll("button[data-sort]")) {
  b.addEventListener("click", () => {
    if (state.key === b.dataset.sort) state.desc = !state.desc;
    else { state.key = b.dataset.sort; state.desc = b.dataset.sort !== "name"; }
    render();
  });
}
const classFilter = document.getElementById("class-filter");
classFilter.addEventListener("change", () => { state.cls = classFilter.value; render(); });
document.getElementById("search").addEventListener("input", (e) => {
  state.text = e.target.value.trim().toLowerCase(); render();
});
for (const fig of document.querySelectorAll("figure.mean")) {
  fig.addEventListener("click", () => {
    classFilter.value = fig.dataset.target; state.cls = fig.dataset.target; render(); window.scrollTo(0, 0);
  });
}
const viewer = document.getElementById("viewer");
function figure(src, caption) {
  const f = document.createElement("figure");
  const img = document.createElement("img"); img.src = src; img.alt = caption;
  const c = document.createElement("figcaption"); c.textContent = caption;
  f.append(img, c); return f;
}
function openViewer(it) {
  const pair = viewer.querySelector(".pair");
  pair.replaceChildren(figure(it.overlay, "occlusion heat map"),
    figure(it.image, it.voxels ? "model input (slices)" : "model input"));
  viewer.querySelector(".details").textContent = it.path + " \\u2014 class " + it.target +
    (it.label ? " (" + it.label + ")" : "") + ", score " + fmt(it.score) + ", largest drop " + fmt(it.drop) +
    " at " + it.at.map((v, i) => (it.at.length === 3 ? "zyx" : "yx")[i] + "=" + v).join(", ") +
    " (window " + it.patch + "), " + fmt(it.seconds) + " s" + (it.voxels ? "; voxel heat map " + it.voxels : "");
  viewer.hidden = false;
}
function closeViewer() { viewer.hidden = true; viewer.querySelector(".pair").replaceChildren(); }
viewer.addEventListener("click", (e) => { if (e.target === viewer || e.target.id === "close") closeViewer(); });
document.addEventListener("keydown", (e) => { if (e.key === "Escape") closeViewer(); });
for (const a of document.querySelectorAll("a[data-open]")) {
  a.addEventListener("click", (e) => {
    e.preventDefault(); const it = items.find((x) => x.id === a.dataset.open); if (it) openViewer(it);
  });
}
render();
"""

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
<header>
<h1>{title}</h1>
<p>{counts}. Heat: the drop in the explained class's score when a window is occluded (red = large drop).</p>
<div class="controls">
<span>Sort by</span>
<button type="button" data-sort="name" data-label="name">name</button>
<button type="button" data-sort="score" data-label="score">score</button>
<button type="button" data-sort="drop" data-label="largest drop">largest drop</button>
<label>Class <select id="class-filter"><option value="">all</option>{class_options}</select></label>
<label>Name <input id="search" type="search" placeholder="filter by path"></label>
<span id="shown"></span>
</div>
</header>
<main id="grid"></main>
<section id="class-means"><h2>Mean heat map per class</h2>
<p>Pixel-wise (voxel-wise for volumes: a montage of slices) mean over the inputs explained for each class (same
input size); click one to show its inputs.</p>
{class_means}
</section>
{mask_section}
{failures}
<div id="viewer" hidden><div class="pair"></div><p class="details"></p>
<button type="button" id="close">close (Esc)</button></div>
<script id="data" type="application/json">{data}</script>
<script>{script}</script>
</body>
</html>
"""
