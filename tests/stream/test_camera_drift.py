"""The camera engine's notes on its drift fields (which are nonzero, which reach half a position) stay those of the
fields themselves through pans and still frames, and a still frame reads every map in place while no drift reaches
half a position."""

from __future__ import annotations

import cv2
import numpy as np
import skimage.data
import torch

from incrinf import models
from incrinf.graph import capture
from incrinf.stream.camera import CameraEngine


def _frames() -> list[np.ndarray]:
    photo = cv2.resize(skimage.data.chelsea(), (320, 240), interpolation=cv2.INTER_AREA)
    # a sub-stride pan (the deep maps' content drifts from where it is kept), then a still camera
    shifts = [0.0, 1.0, 2.0, 3.0, 3.0, 3.0]
    return [np.ascontiguousarray(photo[40:120, 60 + int(s):156 + int(s)]) for s in shifts], shifts


def _x(frame: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(frame).permute(2, 0, 1)[None].float() / 255.0).contiguous(
        memory_format=torch.channels_last)


def test_drift_notes_follow_the_fields_and_a_still_frame_moves_only_large_drifts():
    torch.manual_seed(0)
    model = models.load("mobilenet_v2").eval()
    frames, shifts = _frames()
    engine = CameraEngine(capture(model, (3, *frames[0].shape[:2])), max_misalignment=0.5)
    engine.full(_x(frames[0]))
    for prev_shift, shift, frame in zip(shifts, shifts[1:], frames[1:]):
        matrix = np.array([[1.0, 0.0, -(shift - prev_shift)], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
        changed = np.zeros(frame.shape[:2], bool)
        changed[:, -8:] = shift != prev_shift  # the strip the pan uncovered
        out = engine.cached(_x(frame), changed, matrix)
        if engine.full_reason:  # the motion left the cache unusable: a full frame, drift reset
            assert not engine._drifting and not engine._moving_drift
            continue
        fields = engine._drift
        assert engine._drifting == any(bool(d.any()) for d in fields.values())
        large = {res for res, d in fields.items() if np.abs(d).max() >= 0.5}
        assert engine._moving_drift == large
        # a still frame reads every map in place when no drift reaches half a position (a map whose drift does is
        # moved through its index map, which may still come out the identity)
        engine._memo = None
        if not large:
            assert engine._motion(np.eye(3)) is None
        assert torch.isfinite(out).all()
    assert engine._drifting  # the sub-stride pan left drift behind: the notes were checked with fields in use


def test_the_frames_own_resolution_has_one_read_only_zero_drift():
    """The frame's own resolution is never cached: its drift is zeros made once and read-only (nothing may write
    into the field every frame shares), still and panning frames alike; the cached maps' fields stay writable."""
    model = models.load("mobilenet_v2").eval()
    frames, _ = _frames()
    engine = CameraEngine(capture(model, (3, *frames[0].shape[:2])), max_misalignment=0.5)
    engine.full(_x(frames[0]))
    own = engine.input_dims
    assert own not in engine.engine.cached_resolutions
    seen = []
    for matrix in (np.eye(3), np.array([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]), np.eye(3)):
        engine._memo = None
        warps = engine._warps(matrix)
        drift = warps[own].drift
        assert drift.shape == (2, *own) and not drift.any() and not drift.flags.writeable
        seen.append(drift)
        assert all(warps[res].drift.flags.writeable for res in warps if res in engine.engine.cached_resolutions)
    assert all(d is seen[0] for d in seen)
    out = engine.cached(_x(frames[1]), np.ones(frames[1].shape[:2], bool), np.eye(3))  # runs with the shared field
    assert torch.isfinite(out).all() and not seen[0].any()
