"""The command line: analyze, explain (the README's main command), errors."""

from __future__ import annotations

import numpy as np
import pytest

from incrinf import cli


def test_analyze_prints_table_and_totals(capsys) -> None:
    assert cli.main(["analyze", "--model", "resnet18", "--patch", "16", "--input", "3x96x96"]) == 0
    out = capsys.readouterr().out
    assert "conv1" in out and "theoretical_speedup" in out and "flops_full" in out


@pytest.mark.parametrize("command", ["analyze", "stream", "tune", "explain"])
def test_an_unknown_model_name_is_refused_before_anything_runs(command: str, capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main([command, "--model", "nosuchnet"])
    assert "unknown model 'nosuchnet'" in capsys.readouterr().err


def test_analyze_bad_arguments_exit_with_message(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["analyze", "--model", "nosuchnet"])
    assert "unknown model" in capsys.readouterr().err
    assert cli.main(["analyze", "--model", "resnet18", "--patch", "500", "--input", "3x64x64"]) == 2
    assert "larger than" in capsys.readouterr().err
    assert cli.main(["analyze", "--model", "resnet18", "--tau", "1.5", "--input", "3x64x64"]) == 2


def test_explain_default_heatmap_is_on_the_cat(tmp_path, capsys, monkeypatch) -> None:
    import incrinf.explain.occlusion as occ

    results = []
    original = occ.occlusion

    def spy(*args, **kwargs):
        results.append(original(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(occ, "occlusion", spy)
    out = tmp_path / "heat.png"
    assert cli.main(["explain", "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "explained class 285" in text  # Egyptian cat
    assert out.read_bytes()[:4] == b"\x89PNG"
    pixel = results[0].pixel_map()
    hot = pixel >= np.quantile(pixel, 0.98)
    ys, xs = np.nonzero(hot)
    # the cat's face fills the centre crop below the top fur: the hottest pixels sit on the face
    assert 60 <= ys.mean() <= 215 and 20 <= xs.mean() <= 205


def test_explain_unreadable_image(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(SystemExit, match="cannot read image"):
        cli.main(["explain", str(bad), "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match="not found"):
        cli.main(["explain", str(tmp_path / "missing.jpg")])


def test_explain_unknown_colour_map_names_close_ones(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["explain", "--cmap", "virdis", "--quiet"])
    err = capsys.readouterr().err
    assert "unknown colour map 'virdis'" in err and "viridis" in err


def test_explain_writes_the_picture_in_the_chosen_colour_map(tmp_path, monkeypatch) -> None:
    import incrinf.explain.result as occlusion_module

    drawn = []
    monkeypatch.setattr(occlusion_module, "save_heatmap", lambda *args, **kwargs: drawn.append(kwargs) or args[1])
    args = ["explain", "--model", "squeezenet1_1", "--patch", "64", "--stride", "64", "--quiet", "--out",
            str(tmp_path / "h.png")]
    assert cli.main(args) == 0
    assert cli.main([*args, "--cmap", "viridis", "--no-centre"]) == 0
    assert drawn == [{"cmap": "RdBu_r", "centre": 0.0}, {"cmap": "viridis", "centre": None}]
