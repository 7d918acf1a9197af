"""Exact tiles of a cached tensor recomputed through their cones (incrinf.engine.tiles): what a sampled audit
compares the cache with must equal full inference there, tile by tile or through one cone around all tiles."""

import math

import pytest
import torch
from conftest import zoo_model

from incrinf.engine import FrameEngine
from incrinf.engine.tiles import choose_probe, exact_tiles

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "efficientnet_lite0"])
def test_exact_tiles_equal_full_inference_at_the_probe(name):
    from incrinf.graph import capture

    model = zoo_model(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 64, 72, generator=g).contiguous(memory_format=torch.channels_last)
    engine = FrameEngine(capture(model, x.shape[1:]))
    engine.full(x)
    for budget in (math.inf, engine.costs.full_seconds / 8):  # the deepest probe, and a shallower one
        probe = choose_probe(engine.program, engine.costs, budget)
        assert probe is not None
        h, w = probe.dims
        t = probe.tile
        full = engine.cache.map(probe.name)
        # far apart (one cone per tile is cheaper) and side by side (one cone around both is)
        for tiles in ([(0, t, 0, t), (h - t, h, w - t, w), ((h - t) // 2, (h - t) // 2 + t, 0, t)],
                      [(0, t, 0, t), (0, t, min(t, w - t), min(2 * t, w))]):
            for costs in (None, engine.costs):
                got = exact_tiles(engine.program, x, probe, tiles, costs)
                for (a, b, c, d), tile in zip(tiles, got):
                    torch.testing.assert_close(tile, full[..., a:b, c:d], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["mobilenet_v2", "efficientnet_lite0"])
def test_tiles_inside_the_maps_run_as_one_batch_and_equal_full_inference(name):
    """Tiles whose cones read no padding are translates of one another: each step of the cone runs once for all of
    them (a sample's cost is mostly per-call overhead), and the values still equal full inference's; a tile at the
    border (its cone reads padding) runs its own cone beside the batch of the others."""
    from incrinf.graph import capture

    model = zoo_model(name)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 128, 160, generator=g).contiguous(memory_format=torch.channels_last)
    engine = FrameEngine(capture(model, x.shape[1:]))
    engine.full(x)
    program = engine.program
    probe = choose_probe(program, engine.costs, engine.costs.full_seconds / 40)
    assert probe is not None and probe.step >= 2
    h, w = probe.dims
    t = probe.tile
    corners = ((h // 2 - 3, w // 2 - 5), (h // 2 + 2, w // 2), (h // 2 - 1, w // 2 + 4))
    inside = [(y, y + t, x, x + t) for y, x in corners]
    calls = []
    for step in program.steps[:probe.step + 1]:
        if step.window is not None:
            step.op = _counting(step.op, step.out, calls)
    full = engine.cache.map(probe.name)
    got = exact_tiles(program, x, probe, inside)
    for (a, b, c, d), tile in zip(inside, got):
        torch.testing.assert_close(tile, full[..., a:b, c:d], rtol=1e-4, atol=1e-4)
    assert len(calls) == len(set(calls)) > 0  # every window step of the cone ran once, for the three tiles
    calls.clear()
    border = inside[:2] + [(0, t, 0, t)]
    got = exact_tiles(program, x, probe, border)
    for (a, b, c, d), tile in zip(border, got):
        torch.testing.assert_close(tile, full[..., a:b, c:d], rtol=1e-4, atol=1e-4)
    assert len(calls) == 2 * len(set(calls))  # the two inside as one batch, the border tile's cone alone


def _counting(op, name: str, calls: list):
    def counted(x):
        calls.append(name)
        return op(x)
    return counted
