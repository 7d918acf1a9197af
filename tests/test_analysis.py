"""Static analysis: Krypton's theoretical speedups, tau, positions, bad input."""

from __future__ import annotations

import pytest
import torch.nn as nn
from conftest import zoo_model

from incrinf import analyze


@pytest.mark.parametrize("name,size,expected", [("vgg16", 224, 6.5), ("resnet18", 224, 2.2)])
def test_theoretical_speedup_matches_krypton(name: str, size: int, expected: float) -> None:
    report = analyze(zoo_model(name), (3, size, size), 16)
    assert report.theoretical_speedup == pytest.approx(expected, rel=0.10)
    assert report.flops_full > report.flops_incremental > 0


@pytest.mark.parametrize("name,size,expected",
                         [("vgg16", 224, 11.4), ("resnet18", 224, 7.7), ("inception_v3", 299, 8.5)])
def test_tau_04_matches_krypton(name: str, size: int, expected: float) -> None:
    report = analyze(zoo_model(name), (3, size, size), 16, tau=0.4)
    assert report.theoretical_speedup == pytest.approx(expected, rel=0.15)


def test_positions_corner_costs_less_than_centre_and_all_is_between() -> None:
    model = zoo_model("resnet18")
    centre = analyze(model, "3x96x96", 16)
    corner = analyze(model, "3x96x96", 16, position=(0, 0))
    every = analyze(model, "3x96x96", 16, stride=8, position="all")
    assert corner.theoretical_speedup > centre.theoretical_speedup
    assert every.positions == 11 * 11
    assert corner.theoretical_speedup >= every.theoretical_speedup >= centre.theoretical_speedup


def test_report_table_has_rows_and_totals() -> None:
    report = analyze(zoo_model("resnet18"), (3, 64, 64), 8)
    text = report.table()
    assert "theoretical_speedup" in text and "conv1" in text and "reuse stops at" in text
    conv1 = next(r for r in report.rows if r.name == "conv1")
    # centre patch at 28..35 under a 7x7/2 conv with padding 3 reaches outputs ceil(25/2)=13 .. (35+3)//2=19
    assert conv1.kind == "local" and conv1.region == "7x7"
    assert conv1.flops_incremental < conv1.flops_full


@pytest.mark.parametrize("kwargs,match", [
    (dict(input_shape=(3, 0, 32), patch=4), "input_shape"),
    (dict(input_shape=(3, 32, 32), patch=40), "larger than"),
    (dict(input_shape=(3, 32, 32), patch=4, stride=0), "stride"),
    (dict(input_shape=(3, 32, 32), patch=4, tau=0.0), "tau"),
    (dict(input_shape=(3, 32, 32), patch=4, tau=1.2), "tau"),
    (dict(input_shape=(3, 32, 32), patch=4, position="middle"), "position"),
    (dict(input_shape=(3, 32, 32), patch=4, position=(40, 0)), "outside"),
])
def test_bad_input(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        analyze(nn.Sequential(nn.Conv2d(3, 4, 3)), **kwargs)
