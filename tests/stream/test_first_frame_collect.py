"""The first full frame of a frame size runs the garbage collection that tracing the model made due (incrinf.stream
.session), so that it does not land in a later frame (where its pause read as a cached frame's miss)."""

import gc

import cv2
import pytest
import torch
from stream_scenes import H, W, full_inference, still_camera, wide_classifier

from incrinf.stream.session import StreamSession

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_one_collection_per_frame_size_after_its_first_full_frame(monkeypatch):
    """One full collection after the first frame, none in the frames after it, one more after the first frame of a
    new size; the outputs are full inference's."""
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or 0)
    model = wide_classifier()
    session = StreamSession(model, feature_threshold=0.0)
    frames = still_camera(4)
    for k, frame in enumerate(frames):
        torch.testing.assert_close(session(frame), full_inference(model, frame), rtol=1e-4, atol=1e-4)
        assert len(collections) == 1, k  # the first frame's, and no other
    smaller = cv2.resize(frames[0], (W // 2 + 8, H // 2 + 8))
    session(smaller)
    assert session.stats[-1].mode == "full" and len(collections) == 2
    session(cv2.resize(frames[1], (W // 2 + 8, H // 2 + 8)))
    assert len(collections) == 2
