"""The sampled audit's tile draws (incrinf.stream.audits.SampledAudit.tiles)."""

import numpy as np
import pytest

from incrinf.stream.audits import _UNIFORM, SampledAudit
from incrinf.stream.change_mask import change_mask
from incrinf.stream.config import StreamConfig


class _Probe:
    dims = (72, 96)
    tile = 4


def _drawn_by_choice(sampler: SampledAudit, mask, frame_size) -> list[tuple[int, int, int, int]]:
    """The draws as ``Generator.choice`` with the cells' weights makes them, one call per weighted tile."""
    (ph, pw), t, (h, w) = sampler.probe.dims, sampler.probe.tile, frame_size
    diff = np.minimum(mask.cell_diff.astype(np.float64), max(sampler.config.pixel_threshold, 1e-6))
    weights = diff.reshape(-1) / diff.sum()
    out = []
    for _ in range(sampler.n_tiles):
        if sampler.rng.random() >= _UNIFORM:
            gy, gx = divmod(int(sampler.rng.choice(len(weights), p=weights)), mask.cells.shape[1])
            cy = (gy + sampler.rng.random()) * mask.cell * ph / h
            cx = (gx + sampler.rng.random()) * mask.cell * pw / w
        else:
            cy, cx = sampler.rng.random() * ph, sampler.rng.random() * pw
        y = int(min(max(round(cy - t / 2), 0), ph - t))
        x = int(min(max(round(cx - t / 2), 0), pw - t))
        out.append((y, y + t, x, x + t))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_tiles_are_the_draws_of_generator_choice(seed):
    """The weighted cells are drawn from one distribution built per frame: the tiles ``Generator.choice`` would draw
    from the same state, and the generator left in the same state (the next frame's draws follow on)."""
    rng = np.random.default_rng(100 + seed)
    frame = rng.integers(0, 256, (288, 384, 3), dtype=np.uint8)
    reference = frame.copy()
    for _ in range(3):  # a few changed patches: most weight on a few cells, the rest uniform
        y, x = rng.integers(0, 250), rng.integers(0, 350)
        reference[y:y + 30, x:x + 30] = rng.integers(0, 256, (30, 30, 3), dtype=np.uint8)
    mask = change_mask(frame, reference, 16, 12.0)
    samplers = []
    for _ in range(2):
        sampler = SampledAudit(StreamConfig(), seed=seed)
        sampler.probe, sampler.n_tiles = _Probe(), 16
        samplers.append(sampler)
    fast, by_choice = samplers
    tiles = fast.tiles(mask, (288, 384))
    assert tiles == _drawn_by_choice(by_choice, mask, (288, 384))
    assert fast.rng.random() == by_choice.rng.random()
    weighted = {(y0 * 288 // 72 // 16, x0 * 384 // 96 // 16) for y0, _, x0, _ in tiles}
    assert any(mask.cells[cell] for cell in weighted)  # the weights did steer draws to changed cells
