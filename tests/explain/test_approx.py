"""Approximate occlusion: tau (projective field thresholding) and adaptive drill-down."""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pytest
import torch
import torch.fx
import torch.nn as nn
from conftest import zoo_model

from incrinf.analysis import analyze, occlusion_grid
from incrinf.engine import BatchEngine
from incrinf.explain.drilldown import (
    DrillDown,
    coincident_cells,
    drill_down_speedup,
    grid_shape,
    highest_speedup,
    select_cells,
    upsample,
)
from incrinf.explain.occlusion import ERROR_SAMPLE_CELLS, occlusion
from incrinf.explain.occlusion import occlusion as exact_occlusion
from incrinf.explain.quality import heatmap_ssim
from incrinf.explain.runner import OcclusionRunner
from incrinf.geometry import RegionKind, input_boxes, propagate
from incrinf.graph import NodeKind, captured_graph


def small_net() -> nn.Module:
    """Convs (3x3, a strided 5x5), pools and a head: enough layers for the region to hit the tau cap."""
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 12, 5, stride=2, padding=2), nn.ReLU(),
        nn.MaxPool2d(2), nn.Conv2d(12, 12, 3, padding=1), nn.ReLU(), nn.Conv2d(12, 16, 3, padding=1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval()


def image(size: int = 64) -> torch.Tensor:
    return torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(7))


# --- tau ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["resnet18", "small"])
def test_tau_one_is_the_exact_path_bit_for_bit(name: str) -> None:
    model = small_net() if name == "small" else zoo_model(name)
    x = image()
    exact = exact_occlusion(model, x, patch=16, stride=12, progress=False)
    for kwargs in ({}, {"tau": 1}):
        result = occlusion(model, x, patch=16, stride=12, progress=False, **kwargs)
        assert np.array_equal(result.heatmap, exact.heatmap)
        assert result.fine.all() and result.stats["approximate"] is False
        assert result.stats["tau"] == 1.0 and result.stats["stage_one_stride"] is None
        assert "sampled_max_abs_error" not in result.stats  # nothing approximate to measure


def _reference_capped(model: nn.Module, x: torch.Tensor, pos: tuple[int, int], patch: tuple[int, int],
                      tau: float) -> torch.Tensor:
    """Projective field thresholding, one position, on full tensors: every node keeps its new values only inside
    its (capped) output box and holds its base values elsewhere; a capped node reads its whole input."""
    graph = captured_graph(model, x.shape[1:])
    prop = propagate(graph, input_boxes(np.array([pos]), patch, x.shape[-2:]), tau=tau, uniform=True)
    base = BatchEngine(graph, x).base
    occluded = x.clone()
    occluded[..., pos[0]:pos[0] + patch[0], pos[1]:pos[1] + patch[1]] = 0.0
    env: dict[str, torch.Tensor] = {}

    class Capped(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node):
            node = graph.by_name.get(n.name)
            out = occluded if n.op == "placeholder" else super().run_node(n)
            if node is not None and isinstance(out, torch.Tensor) and node.kind not in (
                    NodeKind.CONSTANT, NodeKind.META, NodeKind.INPUT):
                region = prop.regions[n.name]
                if region.kind == RegionKind.NONE:
                    out = base[n.name]
                elif region.kind == RegionKind.BOX and out.dim() == 4:
                    (y, x_), (h, w) = region.boxes.start()[0].tolist(), region.boxes.sizes()[0].tolist()
                    kept = base[n.name].clone()
                    kept[..., y:y + h, x_:x_ + w] = out[..., y:y + h, x_:x_ + w]
                    out = kept
            env[n.name] = out
            return out

        def fetch_args_kwargs_from_env(self, n: torch.fx.Node):
            return (torch.fx.node.map_arg(n.args, lambda a: env[a.name]),
                    torch.fx.node.map_arg(n.kwargs, lambda a: env[a.name]))

    with torch.no_grad():
        return Capped(graph.module).run(x)


@pytest.mark.parametrize("name", ["small", "resnet18"])
def test_tau_below_one_caps_every_box_and_reads_whole_inputs(name: str) -> None:
    model = small_net() if name == "small" else zoo_model(name)
    x = image()
    positions = np.array([[0, 0], [24, 40], [48, 48], [40, 8]])
    runner = OcclusionRunner(model, x, tau=0.5)
    outputs, _ = runner.run(positions, (16, 16), 0.0, batch_size=4)
    naive = []
    for k, (py, px) in enumerate(positions):
        expected = _reference_capped(model, x, (int(py), int(px)), (16, 16), 0.5)
        torch.testing.assert_close(outputs[k:k + 1], expected, atol=1e-4, rtol=1e-4)
        occluded = x.clone()
        occluded[..., py:py + 16, px:px + 16] = 0.0
        with torch.no_grad():
            naive.append(model(occluded))
    # and it is an approximation: some box was capped and the outputs moved
    prop = propagate(runner.graph, input_boxes(positions, (16, 16), x.shape[-2:]), tau=0.5)
    assert any(step.crop.any() for step in prop.steps.values())
    assert (outputs - torch.cat(naive)).abs().max() > 1e-5


def test_tau_below_one_is_cheaper_and_reports_its_error() -> None:
    model = zoo_model("resnet18")
    x = image()
    exact = exact_occlusion(model, x, patch=16, stride=12, progress=False)
    approx = occlusion(model, x, patch=16, stride=12, progress=False, tau=0.5, target=exact.target)
    assert approx.stats["approximate"] is True and approx.stats["tau"] == 0.5
    assert approx.stats["theoretical_speedup"] > 1.2 * exact.stats["theoretical_speedup"]
    assert approx.stats["realized_flop_ratio"] > 1.2 * exact.stats["realized_flop_ratio"]
    assert not np.allclose(approx.heatmap, exact.heatmap, atol=1e-4)
    # the sampled error is the true error at the sampled cells
    n = exact.heatmap.size
    cells = np.unique(np.linspace(0, n - 1, min(ERROR_SAMPLE_CELLS, n)).round().astype(int))
    err = np.abs(approx.heatmap.ravel()[cells] - exact.heatmap.ravel()[cells])
    assert approx.stats["sampled_cells"] == len(cells)
    assert approx.stats["sampled_max_abs_error"] == pytest.approx(err.max(), abs=1e-4)
    assert approx.stats["sampled_mean_abs_error"] == pytest.approx(err.mean(), abs=1e-4)
    # measure_quality: SSIM and errors against the full exact map
    measured = occlusion(model, x, patch=16, stride=12, progress=False, tau=0.5, measure_quality=True,
                         target=exact.target)
    assert measured.stats["ssim"] == pytest.approx(heatmap_ssim(exact.heatmap, approx.heatmap), abs=1e-6)
    assert measured.stats["ssim"] < 1.0
    assert measured.stats["max_abs_error"] == pytest.approx(np.abs(approx.heatmap - exact.heatmap).max(), abs=1e-4)


def test_analyze_with_tau_reports_more_speedup() -> None:
    model = zoo_model("resnet18")
    speedups = [analyze(model, (3, 96, 96), 16, tau=t).theoretical_speedup for t in (1.0, 0.7, 0.4)]
    assert speedups[0] < speedups[1] < speedups[2]


# --- drill-down: the equations -----------------------------------------------------------------------------


@pytest.mark.parametrize(("fraction", "target", "stride"), [(0.25, 3.0, 4), (0.1, 5.0, 4), (0.4, 2.0, 2),
                                                            (0.25, 2.0, 8), (0.5, 1.5, 3)])
def test_stage_one_stride_follows_the_seed_equation(fraction: float, target: float, stride: int) -> None:
    drill = DrillDown(fraction, target)
    s1 = drill.stage_one_stride((stride, stride), (224, 224))
    expected = math.ceil(math.sqrt(target / (1 - fraction * target)) * stride - 1e-9)
    assert s1 == (expected, expected)
    assert drill_down_speedup(s1, (stride, stride), fraction) >= target - 1e-9
    if s1[0] - 1 >= stride:  # rounding up is the smallest stride that reaches the target
        assert drill_down_speedup((s1[0] - 1, s1[1] - 1), (stride, stride), fraction) < target


def test_krypton_imagenet_setting() -> None:
    # r = 0.25, target 3, S2 = 4: S1 = sqrt(12) * 4 = 13.86 -> 14
    assert DrillDown(0.25, 3.0).stage_one_stride((4, 4), (224, 224)) == (14, 14)


@pytest.mark.parametrize(("fraction", "target"), [(0.25, 4.0), (0.25, 5.0), (0.5, 1.995), (0.25, 3.98)])
def test_unreachable_target_says_the_highest_reachable(fraction: float, target: float) -> None:
    best = highest_speedup((4, 4), fraction, (96, 96))
    assert best == pytest.approx(24.0**2 / (1.0 + fraction * 24.0**2))  # W / S2 = 24
    with pytest.raises(ValueError, match="highest reachable is") as info:
        DrillDown(fraction, target).stage_one_stride((4, 4), (96, 96))
    assert f"{best:.3f}" in str(info.value)
    # just under the bound is fine
    s1 = DrillDown(fraction, best - 1e-3).stage_one_stride((4, 4), (96, 96))
    assert s1[0] <= 96


@pytest.mark.parametrize("kwargs", [{"fraction": 0.0}, {"fraction": 1.0}, {"target_speedup": 0},
                                    {"fraction": "0.2"}, {"target_speedup": float("nan")}])
def test_drill_down_validates(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DrillDown(**kwargs)


def test_upsample_and_select() -> None:
    hw, patch = (64, 64), (16, 16)
    coarse_pos = occlusion_grid(hw, patch, (16, 16))
    fine_pos = occlusion_grid(hw, patch, (4, 4))
    yy, xx = np.meshgrid(np.arange(4.0), np.arange(4.0), indexing="ij")
    coarse = yy * 10 + xx  # linear in the window centre: interpolation is exact
    up = upsample(coarse, coarse_pos, fine_pos, hw, patch)
    assert up.shape == grid_shape(hw, patch, (4, 4)) == (13, 13)
    fy, fx = np.meshgrid(np.arange(13) / 4.0, np.arange(13) / 4.0, indexing="ij")
    np.testing.assert_allclose(up, fy * 10 + fx)
    mask = select_cells(up, 0.25)
    assert mask.sum() == round(0.25 * 169)
    assert up[mask].min() >= up[~mask].max()
    repeat = coincident_cells(coarse_pos, fine_pos)
    assert (repeat >= 0).sum() == 16 and np.array_equal(coarse_pos[repeat[repeat >= 0]], fine_pos[repeat >= 0])


# --- drill-down: runs --------------------------------------------------------------------------------------


def test_drill_down_fine_cells_are_exact_and_cover_the_fraction() -> None:
    model = small_net()
    x = image(96)
    exact = exact_occlusion(model, x, patch=16, stride=4, progress=False)
    drill = DrillDown(0.25, 3.0)
    result = occlusion(model, x, patch=16, stride=4, progress=False, drill_down=drill, target=exact.target)
    s = result.stats
    assert result.heatmap.shape == exact.heatmap.shape and result.fine.shape == exact.heatmap.shape
    assert s["stage_one_stride"] == (14, 14) and s["stage_two_stride"] == (4, 4)
    coarse_pos = occlusion_grid((96, 96), (16, 16), (14, 14))
    repeat = coincident_cells(coarse_pos, result.positions)
    assert s["stage_one_positions"] == len(coarse_pos)
    selected = round(0.25 * exact.heatmap.size)
    # fine = the selected quarter plus the cells stage one already computed
    assert selected <= result.fine.sum() <= selected + (repeat >= 0).sum()
    assert s["stage_two_positions"] == result.fine.sum() - (repeat >= 0).sum()
    assert abs(s["fine_fraction"] - 0.25) < 0.05
    # stage two runs with tau = 1: fine cells are the exact heat map
    np.testing.assert_allclose(result.heatmap[result.fine], exact.heatmap[result.fine], atol=1e-4, rtol=1e-4)
    assert not result.fine.all()
    assert s["drill_down_speedup"] >= 3.0
    run = s["stage_one_positions"] + s["stage_two_positions"]
    assert s["query_speedup"] == pytest.approx(exact.heatmap.size / run)
    assert s["query_speedup"] > 2.5
    assert s["theoretical_speedup"] > 2.5 * exact.stats["theoretical_speedup"]
    # the selected cells are where stage one saw the largest drops
    fine_only = result.fine & (repeat.reshape(result.fine.shape) < 0)
    assert result.heatmap[fine_only].mean() > exact.heatmap.mean()
    # errors are reported; measure_quality compares with the exact map
    assert s["sampled_cells"] > 0
    measured = occlusion(model, x, patch=16, stride=4, progress=False, drill_down=drill, measure_quality=True,
                         target=exact.target)
    assert measured.stats["ssim"] == pytest.approx(heatmap_ssim(exact.heatmap, measured.heatmap), abs=1e-6)


def test_drill_down_with_tau_and_unreachable_target() -> None:
    model = small_net()
    x = image()
    result = occlusion(model, x, patch=16, stride=4, progress=False, drill_down=DrillDown(0.25, 2.0), tau=0.6)
    assert result.stats["tau"] == 0.6 and result.stats["approximate"] is True
    with pytest.raises(ValueError, match="highest reachable is 3.938"):  # 16^2 / (1 + 16^2 / 4)
        occlusion(model, x, patch=16, stride=4, progress=False, drill_down=DrillDown(0.25, 3.95))
    with pytest.raises(TypeError):
        occlusion(model, x, patch=16, stride=4, progress=False, drill_down=0.25)


def test_target_ssim_needs_a_profile_and_excludes_tau(tmp_path) -> None:
    model = small_net()
    with pytest.raises(ValueError, match="profile"):
        occlusion(model, image(), patch=16, stride=8, progress=False, target_ssim=0.9)
    with pytest.raises(FileNotFoundError):
        occlusion(model, image(), patch=16, stride=8, progress=False, target_ssim=0.9,
                  profile=tmp_path / "missing.json")


# --- CLI options of incrinf explain ------------------------------------------------------------------------


def test_explain_options(tmp_path) -> None:
    import argparse

    from incrinf.cli.approx_options import add_explain_options, apply_explain_options, describe_approximation
    from incrinf.explain.tuning_profile import Setting, TuningProfile

    parser = argparse.ArgumentParser()
    add_explain_options(parser)
    assert apply_explain_options(parser.parse_args([])) == {"tau": 1.0, "measure_quality": False}
    kwargs = apply_explain_options(parser.parse_args(["--tau", "0.7", "--drill-down", "0.1", "--target-speedup",
                                                      "5", "--measure-quality"]))
    assert kwargs == {"tau": 0.7, "drill_down": DrillDown(0.1, 5.0), "measure_quality": True}
    assert apply_explain_options(parser.parse_args(["--target-speedup", "2"]))["drill_down"] == DrillDown(0.25, 2.0)
    assert apply_explain_options(parser.parse_args(["--drill-down", "0.3"]))["drill_down"] == DrillDown(0.3, 3.0)
    settings = [asdict(Setting()), asdict(Setting(tau=0.5))]
    path = TuningProfile(model="Net", signature="s", input_shape=[1, 3, 64, 64], patch=[16, 16], stride=[8, 8],
                         output="logit", target_ssim=0.8, coverage=0.8, settings=settings,
                         ssim=[[1.0, 0.9]], speed=[[1.0, 2.0]], check=[], chosen=1).save(tmp_path / "p.json")
    kwargs = apply_explain_options(parser.parse_args(["--target-ssim", "0.8", "--profile", str(path)]))
    assert kwargs["target_ssim"] == 0.8 and kwargs["profile"].setting == Setting(tau=0.5)
    with pytest.raises(ValueError, match="--profile"):
        apply_explain_options(parser.parse_args(["--target-ssim", "0.9"]))
    with pytest.raises(ValueError, match="not both"):
        apply_explain_options(parser.parse_args(["--tau", "0.5", "--profile", str(path)]))
    with pytest.raises(ValueError, match="fraction"):
        apply_explain_options(parser.parse_args(["--drill-down", "1.5"]))
    fresh = argparse.ArgumentParser()
    add_explain_options(fresh)  # adds --tau when missing
    assert fresh.parse_args(["--tau", "0.6"]).tau == 0.6
    result = occlusion(small_net(), image(), patch=16, stride=8, progress=False, tau=0.5)
    assert "tau 0.5" in describe_approximation(result.stats) and "recomputed exactly" in \
        describe_approximation(result.stats)
    exact = occlusion(small_net(), image(), patch=16, stride=8, progress=False)
    assert describe_approximation(exact.stats).startswith("exact")
