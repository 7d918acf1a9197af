"""Fuzzing the frame entry points (StreamSession, OffloadingSession): any shape, dtype, NaN/inf, non-contiguous
array or tensor gets a result or a clear TypeError/ValueError, and the session serves the next good frame as if
the bad one had never come."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import skimage.data
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from incrinf.offload.session import OffloadingSession
from incrinf.stream.session import StreamSession

SIZE = 64
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()


MODEL = _model()
GOOD = cv2.resize(skimage.data.chelsea(), (SIZE, SIZE), interpolation=cv2.INTER_AREA)
with torch.no_grad():
    GOOD_OUTPUT = MODEL((torch.from_numpy(GOOD).permute(2, 0, 1)[None].float() / 255 - 0.5) / 0.5)

DTYPES = st.sampled_from([np.uint8, np.int8, np.uint16, np.int32, np.float16, np.float32, np.float64, np.bool_,
                          np.complex64])
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=40)


@st.composite
def arrays(draw) -> np.ndarray:
    """Arrays of any dtype and shape (frame-like ones often), values including NaN/inf, often non-contiguous."""
    dtype = np.dtype(draw(DTYPES))
    shape = draw(st.one_of(SHAPES, st.tuples(st.integers(0, 40), st.integers(0, 40), st.sampled_from([1, 3, 4]))))
    elements = None
    if dtype.kind == "f":
        elements = st.floats(allow_nan=True, allow_infinity=True, width=8 * dtype.itemsize)
    array = draw(hnp.arrays(dtype, shape, elements=elements))
    view = draw(st.sampled_from(["as is", "transposed", "strided", "reversed"]))
    if view == "transposed" and array.ndim >= 2:
        array = np.swapaxes(array, 0, 1)
    elif view == "strided" and array.ndim >= 1:
        array = array[::2]
    elif view == "reversed" and array.ndim >= 1:
        array = array[::-1]
    return array


@st.composite
def tensors(draw) -> torch.Tensor:
    """Torch tensors: float (with NaN/inf) or integer, 0-5 dims, sometimes non-contiguous."""
    shape = draw(st.one_of(hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=12),
                           st.tuples(st.just(1), st.sampled_from([1, 3]), st.integers(1, 40), st.integers(1, 40))))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64, torch.uint8]))
    tensor = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.randint(0, 255, shape).to(dtype)
    if dtype.is_floating_point and tensor.numel() and draw(st.booleans()):
        tensor.view(-1)[draw(st.integers(0, tensor.numel() - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    if tensor.dim() >= 2 and draw(st.booleans()):
        tensor = tensor.transpose(-1, -2)
    return tensor


JUNK = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(0, 255), max_size=4),
                 st.just([[[0, 0, 0]]]), st.just(b"\x00" * 12))


@pytest.fixture(scope="module")
def session() -> StreamSession:
    # no keyframes, no back-off and no guards (no audits, no timing-dependent choice; the guards' state across a
    # refused frame is tested in test_stream_guards): after the bad frame, the good one must come from the cache
    s = StreamSession(MODEL, input_size=(SIZE, SIZE), keyframe_interval=0, max_backoff=0, speed_guard=False,
                      quality_guard=False)
    s(GOOD)
    return s


@FUZZ
@given(frame=st.one_of(arrays(), tensors(), JUNK))
def test_stream_session_any_frame(session, frame):
    before = len(session.stats)
    try:
        out = session(frame)
    except (TypeError, ValueError) as exc:
        assert str(exc)  # a clear message, never an empty one
        assert len(session.stats) == before  # nothing recorded for a refused frame
    else:  # a valid frame (uint8 RGB of any size, or a finite float tensor): a finite output
        assert out.shape == (1, 4) and torch.isfinite(out).all()
        session(GOOD)  # a good frame again, so the next check starts from it
    # the session serves the good frame next; unchanged, so from the cache and exactly full inference
    out = session(GOOD)
    assert session.stats[-1].mode == "cached", session.stats[-1].reason
    torch.testing.assert_close(out, GOOD_OUTPUT, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def offloading() -> OffloadingSession:
    return OffloadingSession(MODEL, policy="local_cached", input_size=(SIZE, SIZE), mean=(0.5,) * 3, std=(0.5,) * 3,
                             timing_repeats=1)


@FUZZ
@given(frame=st.one_of(arrays(), tensors(), JUNK))
def test_offloading_session_any_frame(offloading, frame):
    before = len(offloading.stats)
    try:
        out = offloading(frame)
    except (TypeError, ValueError) as exc:
        assert str(exc)
        assert len(offloading.stats) == before
    else:
        assert out.shape == (1, 4) and torch.isfinite(out).all()
    out = offloading(GOOD)
    torch.testing.assert_close(out, GOOD_OUTPUT, rtol=1e-4, atol=1e-5)


@pytest.mark.xfail(strict=True, reason="OpenCV 5's phaseCorrelate windows its inputs in place, and "
                   "StreamSession._looks_still keeps that windowed array as the next frame's _prev_gray: from the "
                   "third frame on the still-camera test fails and frames too small for keypoints run fully "
                   "(incrinf/stream/session.py, reported to the lead; remove this mark with the fix)")
def test_still_camera_stays_cached_on_small_frames():
    frame = cv2.resize(skimage.data.chelsea(), (32, 32), interpolation=cv2.INTER_AREA)
    session = StreamSession(MODEL, input_size=(32, 32))
    for _ in range(4):
        session(frame)
    assert [s.mode for s in session.stats] == ["full", "cached", "cached", "cached"]
