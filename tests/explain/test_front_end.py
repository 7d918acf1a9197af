"""One occlusion front end with a typed record of what ran: ``incrinf.occlusion`` is defined once, no module of the
package imports another's private names, and ``OcclusionResult.stats`` is an :class:`OcclusionStats` whose fields
(setting, error estimate with its method, drill-down stages, counts) agree with the flat view dataset records
keep."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch.nn as nn
from test_approx import image, small_net

import incrinf
from incrinf.cli.approx_options import describe_approximation
from incrinf.explain.occlusion import ERROR_SAMPLE_CELLS
from incrinf.explain.quality import heatmap_ssim
from incrinf.explain.result import ChosenSetting, DrillDownStages, ErrorEstimate, OcclusionStats

PACKAGE = Path(incrinf.__file__).parent


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))]


def test_one_occlusion_function_in_the_package() -> None:
    defined = [path.relative_to(PACKAGE) for path, tree in _modules() for node in ast.walk(tree)
               if isinstance(node, ast.FunctionDef) and node.name == "occlusion"]
    assert defined == [Path("explain/occlusion.py")]
    assert incrinf.occlusion.__module__ == "incrinf.explain.occlusion"


def test_no_module_imports_another_modules_private_names() -> None:
    private = [f"{path.relative_to(PACKAGE)}: from {node.module} import {alias.name}"
               for path, tree in _modules() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("incrinf")
               for alias in node.names if alias.name.startswith("_")]
    assert private == []


def test_exact_run_records_its_setting_and_no_error() -> None:
    result = incrinf.occlusion(small_net(), image(), patch=16, stride=12, progress=False)
    s = result.stats
    assert isinstance(s, OcclusionStats) and not s.approximate
    assert s.setting == ChosenSetting() and s.drill_down is None
    assert s.error.method == "exact" and s.error.max_abs_error == 0.0
    assert s.positions == result.heatmap.size and s.batches >= 1 and s.flops_full > 0
    assert s.theoretical_speedup > 1.0 and s.seconds_per_position == pytest.approx(s.seconds / s.positions)
    assert describe_approximation(s).startswith("exact")


def test_sampled_and_measured_errors_are_typed_and_agree_with_the_flat_view() -> None:
    model, x = small_net(), image()
    exact = incrinf.occlusion(model, x, patch=16, stride=8, progress=False)
    fast = incrinf.occlusion(model, x, patch=16, stride=8, progress=False, tau=0.5)
    error = fast.stats.error
    assert fast.stats.approximate and fast.stats.setting.tau == 0.5 and fast.stats.setting.source == "argument"
    assert error.method == "sampled" and error.cells == min(ERROR_SAMPLE_CELLS, exact.heatmap.size)
    cells = np.unique(np.linspace(0, exact.heatmap.size - 1, error.cells).round().astype(np.int64))
    err = np.abs(fast.heatmap.ravel()[cells] - exact.heatmap.ravel()[cells])
    assert error.max_abs_error == pytest.approx(err.max(), abs=1e-4) and err.max() > 0
    assert 0.0 < error.ssim <= 1.0 and error.seconds > 0
    flat = fast.stats.as_dict()
    assert flat["sampled_max_abs_error"] == error.max_abs_error and flat["estimated_ssim"] == error.ssim
    fixed = ("capture_seconds", "executor_seconds", "base_seconds", "plan_seconds", "plan_hit")
    assert all(flat[k] == getattr(fast.stats, k) for k in fixed) and flat["base_seconds"] > 0
    assert fast.stats["tau"] == 0.5 and "max_abs_error" not in fast.stats
    assert "estimated SSIM" in describe_approximation(fast.stats)

    measured = incrinf.occlusion(model, x, patch=16, stride=8, progress=False, tau=0.5, measure_quality=True)
    m = measured.stats.error
    assert m.method == "measured" and m.cells == exact.heatmap.size
    assert m.ssim == pytest.approx(heatmap_ssim(exact.heatmap, measured.heatmap), abs=1e-9) and m.ssim < 1.0
    assert m.max_abs_error == pytest.approx(np.abs(measured.heatmap - exact.heatmap).max(), abs=1e-4)
    assert m.exact_range == pytest.approx(float(exact.heatmap.max() - exact.heatmap.min()), rel=1e-5)
    assert measured.stats["ssim"] == m.ssim and "sampled_cells" not in measured.stats
    assert "measured SSIM" in describe_approximation(measured.stats)


def test_drill_down_stages_are_typed() -> None:
    result = incrinf.occlusion(small_net(), image(), patch=16, stride=4, progress=False,
                               drill_down=incrinf.DrillDown(0.25, 3.0))
    stages = result.stats.drill_down
    assert isinstance(stages, DrillDownStages) and isinstance(result.stats.error, ErrorEstimate)
    assert stages.stage_two_stride == (4, 4) and stages.stage_one_stride[0] > 4
    assert stages.fine_positions == result.heatmap.size
    assert result.stats.positions == stages.stage_one_positions + stages.stage_two_positions < stages.fine_positions
    assert stages.query_speedup == pytest.approx(stages.fine_positions / result.stats.positions)
    assert stages.fine_fraction == pytest.approx(result.fine.mean())
    assert result.stats.setting.drill_down == incrinf.DrillDown(0.25, 3.0)
    assert result.stats["stage_one_stride"] == stages.stage_one_stride
    assert "drill-down: stage one stride" in describe_approximation(result.stats)


def test_output_is_checked_before_tracing() -> None:
    class Untraceable(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
                return x
            return -x

    with pytest.raises(ValueError, match="'logit' or 'prob'"):
        incrinf.occlusion(Untraceable(), image(), output="probs", progress=False)
