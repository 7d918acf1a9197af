"""StreamSession and the sparse executor: exactness, fallbacks, bad input, recovery (incrinf.stream.session)."""

import cv2
import numpy as np
import pytest
import skimage.data
import torch
import torch.nn as nn

from incrinf import models
from incrinf.engine import frame_regions
from incrinf.stream import change_finder as change_finder_module
from incrinf.stream.camera import CameraEngine
from incrinf.stream.config import StreamConfig
from incrinf.stream.session import StreamSession as GuardedSession
from incrinf.stream.stats import Cause, FrameStats

H, W = 80, 96
# the cached path's mechanics, tested without the guards that would choose full inference or audit instead
# (tests/stream/test_stream_guards.py tests the guards), and with a back-off that tolerates three misses in a row (the
# sequences below were written for it; tests/stream/test_lean_frames.py tests the default of one)
UNGUARDED = {"speed_guard": False, "quality_guard": False, "backoff_after": 3}


def StreamSession(*args, **kwargs) -> GuardedSession:  # noqa: N802 (stands in for the class in this module)
    return GuardedSession(*args, **{**UNGUARDED, **kwargs})


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    """A 240 x 320 photo to cut frames from."""
    return cv2.resize(skimage.data.chelsea(), (320, 240), interpolation=cv2.INTER_AREA)


@pytest.fixture(scope="module")
def zoo() -> dict[str, nn.Module]:
    return {name: models.load(name) for name in ("resnet18", "mobilenet_v2", "efficientnet_lite0")}


def _full(model: nn.Module, frame: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(frame).permute(2, 0, 1)[None].float() / 255.0
    with torch.no_grad():
        return model((x - 0.5) / 0.5)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    scale = ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * scale)


def _crop(photo: np.ndarray, y: int, x: int, h: int = H, w: int = W) -> np.ndarray:
    return np.ascontiguousarray(photo[y:y + h, x:x + w])


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "efficientnet_lite0"])
def test_static_frames_equal_full_inference(zoo, photo, name):
    model = zoo[name]
    session = StreamSession(model)
    frame = _crop(photo, 40, 60)
    outputs = [session(frame) for _ in range(3)]
    ref = _full(model, frame)
    for out in outputs:
        _assert_close(out, ref)
    first, *cached = session.stats
    assert (first.mode, first.reason) == ("full", "first frame")
    for stats in cached:
        assert (stats.mode, stats.reason, stats.recompute_fraction) == ("cached", "ok", 0.0)
        assert stats.flops_ratio == float("inf")  # nothing ran: the previous output was reused
        assert np.allclose(stats.homography, np.eye(3))


@pytest.mark.parametrize("name", ["resnet18", "efficientnet_lite0"])
def test_identity_motion_threshold_zero_reproduces_full_inference(zoo, photo, name):
    model = zoo[name]
    session = StreamSession(model, pixel_threshold=0.0, feature_threshold=0.0, max_ratio=1.0, **UNGUARDED)
    a, b = _crop(photo, 40, 60), _crop(photo, 100, 150)  # unrelated content: every position changes
    session(a)
    out = session(b, homography=np.eye(3))
    assert (session.stats[-1].mode, session.stats[-1].recompute_fraction) == ("cached", 1.0)
    _assert_close(out, _full(model, b))


@pytest.mark.parametrize("name", ["mobilenet_v2", "efficientnet_lite0"])
def test_local_change_recomputes_only_what_it_reaches(zoo, photo, name):
    model = zoo[name]
    session = StreamSession(model, pixel_threshold=0.01, feature_threshold=0.0)
    frame = _crop(photo, 40, 60)
    session(frame)
    changed = frame.copy()
    changed[30:42, 50:62] = 255 - changed[30:42, 50:62]
    out = session(changed, homography=np.eye(3))
    stats = session.stats[-1]
    assert stats.mode == "cached"
    assert 0 < stats.recompute_fraction < 0.2
    assert stats.flops_ratio > 1.05
    _assert_close(out, _full(model, changed))


def test_integer_pan_by_the_largest_stride_is_exact(zoo, photo):
    # a 32 px shift is a whole number of positions at every stride of ResNet-18: the cache is reused exactly
    model = zoo["resnet18"]
    session = StreamSession(model, keyframe_interval=None, **UNGUARDED)
    session(_crop(photo, 40, 40))
    for k in (1, 2):
        frame = _crop(photo, 40, 40 + 32 * k)
        out = session(frame, homography=np.array([[1.0, 0, -32], [0, 1, 0], [0, 0, 1]]))
        assert session.stats[-1].mode == "cached"
        assert session.stats[-1].flops_ratio > 1.0
        _assert_close(out, _full(model, frame))


def test_estimated_pan_stays_close_to_full_inference(zoo, photo):
    model = zoo["efficientnet_lite0"]
    session = StreamSession(model, keyframe_interval=None, matcher_options={"refine": True}, **UNGUARDED)
    errors, agree = [], 0
    for k in range(6):
        frame = _crop(photo, 50 + 2 * k, 40 + 4 * k)  # pure integer shifts, estimated by matching
        out, ref = session(frame), _full(model, frame)
        errors.append(float((out - ref).norm() / ref.norm()))
        agree += int(out.argmax() == ref.argmax())
    modes = [s.mode for s in session.stats[1:]]
    assert modes.count("cached") >= 3, [s.reason for s in session.stats]
    assert agree == 6
    assert max(errors) < 0.1, errors
    for stats in session.stats[1:]:
        if stats.mode == "cached":  # the view moves by (2, 4) px: the content by (-2, -4)
            assert abs(stats.homography[0, 2] + 4) < 0.5 and abs(stats.homography[1, 2] + 2) < 0.5


def test_fallbacks_run_full_inference(zoo, photo):
    model = zoo["mobilenet_v2"]
    session = StreamSession(model, keyframe_interval=4, **UNGUARDED)
    frame = _crop(photo, 40, 60)
    noise = np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)
    bigger = _crop(photo, 40, 60, H + 16, W + 16)
    sequence = [
        (frame, "full", "first frame"),
        (frame, "cached", "ok"),
        (noise, "full", "match failed"),
        (frame, "full", "match failed"),  # noise has no keypoints to match either
        (frame, "cached", "ok"),
        (frame, "cached", "ok"),
        (frame, "cached", "ok"),
        (frame, "full", "keyframe"),  # 4 frames after the last full inference
        (bigger, "full", "frame size changed"),
    ]
    for image, mode, reason in sequence:
        out = session(image)
        stats = session.stats[-1]
        assert (stats.mode, stats.reason.split(":")[0]) == (mode, reason), stats
        _assert_close(out, _full(model, image))
    # a frame that changes more than max_ratio of the pixels (matched through a known homography)
    session(bigger)
    moved = _crop(photo, 140, 200, H + 16, W + 16)
    out = session(moved, homography=np.eye(3))
    stats = session.stats[-1]
    assert stats.mode == "full" and stats.reason.startswith("changed fraction") and "> max_ratio 0.6" in stats.reason
    _assert_close(out, _full(model, moved))
    assert [s.index for s in session.stats] == list(range(len(session.stats)))
    assert session.stats[2].homography_found is False and session.stats[1].homography_found is True


def test_tensor_frames_match_uint8_frames(zoo, photo):
    model = zoo["efficientnet_lite0"]
    frame = _crop(photo, 40, 60)
    x = (torch.from_numpy(frame).permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5
    by_array, by_tensor = StreamSession(model), StreamSession(model)
    for _ in range(2):
        _assert_close(by_tensor(x), by_array(frame))
        _assert_close(by_tensor(x[None]), by_array(frame))
    assert [s.mode for s in by_tensor.stats] == ["full", "cached", "cached", "cached"]


def test_default_preprocessing_upscales_small_frames(zoo, photo):
    model = zoo["resnet18"]
    session = StreamSession(model)
    small = _crop(photo, 10, 10, 48, 40)
    session(small)
    assert session.cache_bytes().kept_bytes > 0
    assert session._shape[-2:] == (77, 64)  # shorter side to 64, aspect kept
    fixed = StreamSession(model, input_size=(64, 72))
    fixed(small)
    assert fixed._shape[-2:] == (64, 72)


@pytest.mark.parametrize("frame, error, match", [
    (np.zeros((H, W, 3), np.float32), TypeError, "uint8"),
    (np.zeros((H, W), np.uint8), ValueError, "shape"),
    (np.zeros((H, W, 4), np.uint8), ValueError, "3 channels"),
    (np.zeros((0, W, 3), np.uint8), ValueError, "empty"),
    ([[0, 0, 0]], TypeError, "numpy array or a float torch tensor"),
    (torch.zeros(3, H, W, dtype=torch.uint8), TypeError, "floating-point"),
    (torch.zeros(2, 3, H, W), ValueError, r"\(3, H, W\)"),
    (torch.zeros(4, H, W), ValueError, "3 channels"),
    (torch.full((3, H, W), float("nan")), ValueError, "NaN"),
])
def test_bad_frames_raise_clear_errors_and_the_session_carries_on(zoo, photo, frame, error, match):
    session = StreamSession(zoo["resnet18"])
    good = _crop(photo, 40, 60)
    session(good)
    with pytest.raises(error, match=match):
        session(frame)
    out = session(good)
    assert [s.mode for s in session.stats] == ["full", "cached"]
    _assert_close(out, _full(zoo["resnet18"], good))


def test_bad_homography_is_rejected(zoo, photo):
    session = StreamSession(zoo["resnet18"])
    with pytest.raises(ValueError, match="homography"):
        session(_crop(photo, 40, 60), homography=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="homography"):
        session(_crop(photo, 40, 60), homography=np.eye(2))
    assert session.stats == []


def test_a_failure_inside_a_frame_does_not_corrupt_the_next(zoo, photo, monkeypatch):
    model = zoo["mobilenet_v2"]
    session = StreamSession(model, pixel_threshold=0.01, feature_threshold=0.0)
    frame = _crop(photo, 40, 60)
    session(frame)

    def boom(*args, **kwargs):
        raise RuntimeError("simulated failure in the middle of the cached path")

    monkeypatch.setattr(frame_regions, "run_box", boom)
    changed = frame.copy()
    changed[10:20, 10:20] = 0
    with pytest.raises(RuntimeError, match="simulated"):
        session(changed, homography=np.eye(3))
    monkeypatch.undo()
    out = session(changed)
    assert (session.stats[-1].mode, session.stats[-1].reason) == ("full", "previous frame failed")
    _assert_close(out, _full(model, changed))
    out = session(frame, homography=np.eye(3))
    assert session.stats[-1].mode == "cached"
    _assert_close(out, _full(model, frame))


def test_model_without_spatial_layers_is_rejected_at_construction():
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))
    with pytest.raises(ValueError, match="no convolution or pooling"):
        StreamSession(mlp)
    with pytest.raises(TypeError, match="nn.Module"):
        StreamSession(lambda x: x)


@pytest.mark.parametrize("kwargs, match", [
    ({"pixel_threshold": -1}, "pixel_threshold"),
    ({"cell": 0}, "cell"),
    ({"max_ratio": 1.5}, "max_ratio"),
    ({"keyframe_interval": -2}, "keyframe_interval"),
    ({"input_size": (4, 4)}, "input_size"),
    ({"feature_threshold": -0.1}, "feature_threshold"),
    ({"matcher": "surf"}, "matcher"),
])
def test_bad_settings_raise(zoo, kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamSession(zoo["resnet18"], **kwargs)


def test_reset_cache_memory_and_stats(zoo, photo):
    session = StreamSession(zoo["efficientnet_lite0"], input_size=(H, W), background_update=True)
    memory = session.cache_bytes()
    assert 0 < memory.kept_bytes < memory.naive_bytes and memory.kept_tensors < memory.naive_tensors
    frame = _crop(photo, 40, 60)
    session(frame)
    session(frame)
    session.reset()
    session(frame)
    assert [s.reason for s in session.stats] == ["first frame", "ok", "first frame"]
    assert all(isinstance(s, FrameStats) and s.seconds > 0 for s in session.stats)
    assert session.stats[1].cache_ratio == 1.0


def test_feature_threshold_prunes_work_and_stays_close(zoo, photo):
    model = zoo["efficientnet_lite0"]
    exact = StreamSession(model, pixel_threshold=0.01, feature_threshold=0.0)
    pruned = StreamSession(model, pixel_threshold=0.01, feature_threshold=0.2)
    frame = _crop(photo, 40, 60)
    changed = frame.copy()
    changed[20:36, 30:46] = np.clip(changed[20:36, 30:46].astype(int) + 40, 0, 255).astype(np.uint8)
    for session in (exact, pruned):
        session(frame)
        session(changed, homography=np.eye(3))
    ref = _full(model, changed)
    assert pruned.stats[-1].flops_ratio > exact.stats[-1].flops_ratio
    out = pruned(changed, homography=np.eye(3))
    assert float((out - ref).norm() / ref.norm()) < 0.2


def test_change_mask_uses_the_pixels_the_model_sees(zoo, photo, monkeypatch):
    seen = []
    original = change_finder_module.change_mask

    def spy(curr, warped, *args, **kwargs):
        seen.append(curr.shape)
        return original(curr, warped, *args, **kwargs)

    monkeypatch.setattr(change_finder_module, "change_mask", spy)
    session = StreamSession(zoo["resnet18"], input_size=(64, 80))
    big = _crop(photo, 0, 0, 160, 200)
    session(big)
    session(big)
    assert seen == [(64, 80, 3)]


def test_stream_cli_runs_a_video_and_writes_stats(tmp_path, capsys):
    import argparse
    import csv

    from incrinf.cli import stream as cli

    parser = argparse.ArgumentParser(prog="incrinf")
    cli.register(parser.add_subparsers(dest="command", required=True))
    out_csv = tmp_path / "stats.csv"
    args = parser.parse_args(["stream", "--model", "resnet18", "--max-frames", "3", "--size", "64x80",
                              "--csv", str(out_csv), "--quiet"])
    assert args.func(args) == 0
    summary = capsys.readouterr().out
    assert "3 frames of carphone_pristine.mp4" in summary and "speedup" in summary and "top-1 agreement" in summary
    with open(out_csv) as fh:
        rows = list(csv.DictReader(fh))
    assert [r["mode"] for r in rows][0] == "full" and len(rows) == 3
    assert float(rows[0]["relative_error"]) < 1e-4  # the first frame is full inference
    bad = parser.parse_args(["stream", str(tmp_path / "missing.mp4")])
    with pytest.raises(FileNotFoundError):
        bad.func(bad)
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    bad = parser.parse_args(["stream", str(empty)])
    with pytest.raises(ValueError, match="could not decode"):
        bad.func(bad)
    with pytest.raises(SystemExit):
        parser.parse_args(["stream", "--max-frames", "0"])


def test_stream_cli_passes_the_sample_seed_and_opencv_threads_and_rejects_bad_values(tmp_path, capsys):
    """``--sample-seed`` and ``--opencv-threads`` reach the session's config (OpenCV's process-wide thread count is
    set when the session is built); a negative seed, zero threads or a non-integer exit with a usage error."""
    import argparse

    import cv2

    from incrinf.cli import stream as cli

    parser = argparse.ArgumentParser(prog="incrinf")
    cli.register(parser.add_subparsers(dest="command", required=True))
    defaults = cli.stream_config(parser.parse_args(["stream"]))
    assert defaults.sample_seed == StreamConfig().sample_seed and defaults.opencv_threads is None
    args = parser.parse_args(["stream", "--model", "resnet18", "--max-frames", "2", "--size", "64x80", "--quiet",
                              "--sample-seed", "7", "--opencv-threads", "1"])
    config = cli.stream_config(args)
    assert config.sample_seed == 7 and config.opencv_threads == 1
    before = cv2.getNumThreads()
    try:
        cv2.setNumThreads(2)
        assert args.func(args) == 0
        assert cv2.getNumThreads() == 1  # the session set OpenCV's threads
    finally:
        cv2.setNumThreads(before)
    assert "2 frames of carphone_pristine.mp4" in capsys.readouterr().out
    for bad in (["--sample-seed", "-1"], ["--sample-seed", "1.5"], ["--opencv-threads", "0"],
                ["--opencv-threads", "two"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["stream", *bad])
    assert "--sample-seed" in capsys.readouterr().err


def test_settings_are_one_validated_config(zoo):
    config = StreamConfig(pixel_threshold=4, keyframe_interval=None)
    session = StreamSession(zoo["mobilenet_v2"], config, max_ratio=0.5)
    assert session.config == StreamConfig(pixel_threshold=4.0, keyframe_interval=0, max_ratio=0.5, **UNGUARDED)
    with pytest.raises(TypeError, match="unknown stream setting.*policy"):
        StreamSession(zoo["mobilenet_v2"], policy="local_cached")
    with pytest.raises(ValueError, match="max_misalignment"):
        StreamConfig(max_misalignment=0.7)
    with pytest.raises(ValueError, match="matcher"):
        StreamSession(zoo["mobilenet_v2"], matcher="surf")


class _CountingEstimator:
    """Wraps a HomographyEstimator and counts keypoint detections."""

    def __init__(self, inner) -> None:
        self.inner, self.detections = inner, 0

    def detect(self, frame):
        self.detections += 1
        return self.inner.detect(frame)

    def match(self, prev, curr):
        return self.inner.match(prev, curr)


def test_still_camera_skips_keypoint_matching(zoo, photo):
    model = zoo["mobilenet_v2"]
    frame = _crop(photo, 40, 60)
    changed = frame.copy()
    # a local change on a still background (the phase-correlation peak stays clear)
    changed[30:42, 50:62] = np.clip(changed[30:42, 50:62].astype(int) + 60, 0, 255)
    moved = _crop(photo, 46, 72)  # the camera moved: most cells change under the identity
    gated, always = StreamSession(model, still_fraction=0.25), StreamSession(model, still_fraction=0.0)
    for session in (gated, always):
        session._change.estimator = _CountingEstimator(session._change.estimator)
    for image in (frame, frame, changed, moved):
        out_gated, out_always = gated(image), always(image)
        _assert_close(out_gated, out_always)
    # the gate accepted the still frames without detecting keypoints; the moved one was matched
    assert [s.mode for s in gated.stats] == ["full", "cached", "cached", "cached"]
    assert [s.n_matches > 0 for s in gated.stats] == [False, False, False, True]
    assert gated._change.estimator.detections == 2  # the moved frame and, lazily, the frame before it
    assert always._change.estimator.detections == 4  # every frame once (the first lazily)
    assert gated.stats[2].recompute_fraction > 0 and np.array_equal(gated.stats[2].homography, np.eye(3))
    assert gated.stats[3].recompute_fraction > gated.config.still_fraction
    with pytest.raises(ValueError, match="still_fraction"):
        StreamSession(model, still_fraction=1.5)


def test_back_off_after_frames_that_cannot_use_the_cache(zoo, photo):
    model = zoo["mobilenet_v2"]
    session = StreamSession(model, keyframe_interval=None, max_backoff=4)
    session._change.estimator = _CountingEstimator(session._change.estimator)
    rng = np.random.default_rng(1)
    noise = [rng.integers(0, 256, (H, W, 3), dtype=np.uint8) for _ in range(12)]  # nothing to match
    frame = _crop(photo, 40, 60)
    reasons, kept = [], []
    for image in [frame, *noise, frame, frame, frame, frame]:
        out = session(image)
        reasons.append(session.stats[-1].reason.split(":")[0])
        kept.append(session._engines[session._shape].has_cache)
        _assert_close(out, _full(model, image))
    # three misses, 2 frames off, a probe (miss), 4 off (the cap), a probe (miss), 4 off ... then recovery
    assert reasons[:13] == ["first frame", *["match failed"] * 3, *["backing off"] * 2, "match failed",
                            *["backing off"] * 4, "match failed", "backing off"]
    # a miss that starts a stretch and the stretch's frames but its last keep no cache: no frame after them uses it
    assert kept[:13] == [True, True, True, False, False, True, False, False, False, False, True, False, False]
    assert reasons[13:] == ["backing off", "backing off", "backing off", "ok"]  # the probe reuses the cache
    assert session.stats[-1].mode == "cached" and session._backoff.skip == session._backoff.stretch == 0
    detections = session._change.estimator.detections
    assert detections < 2 * 6  # no keypoints were detected on the frames run without trying
    never = StreamSession(model, keyframe_interval=None, max_backoff=0)
    for image in [frame, *noise[:5]]:
        never(image)
    assert all(s.reason.startswith("match failed") for s in never.stats[1:])
    with pytest.raises(ValueError, match="max_backoff"):
        StreamSession(model, max_backoff=-1)


def test_sub_stride_motion_is_found_unusable_before_the_change_mask(zoo, photo, monkeypatch):
    # a 3 px pan is 1.5 positions of the first (stride-2) map: every cached position would be read half a
    # position off, so the frame runs fully; the session sees that from the homography alone
    model = zoo["mobilenet_v2"]
    calls = []
    original = change_finder_module.change_mask
    monkeypatch.setattr(change_finder_module, "change_mask", lambda *a, **k: calls.append(1) or original(*a, **k))
    session = StreamSession(model, still_fraction=0)
    session(_crop(photo, 40, 60))
    moved = _crop(photo, 40, 63)
    out = session(moved, homography=np.array([[1.0, 0, -3], [0, 1, 0], [0, 0, 1]]))
    stats = session.stats[-1]
    assert stats.mode == "full" and stats.reason.startswith("cache unusable") and "misaligned" in stats.reason
    assert stats.homography_found and calls == []
    _assert_close(out, _full(model, moved))
    out = session(moved, homography=np.eye(3))  # the full frame refilled the cache
    assert session.stats[-1].mode == "cached"
    _assert_close(out, _full(model, moved))


def test_a_frame_buffer_refilled_in_place_is_not_taken_as_the_reference(zoo, photo):
    # camera loops often decode every frame into the same array: the session must keep its own copy
    model = zoo["mobilenet_v2"]
    session = StreamSession(model, pixel_threshold=0.01, feature_threshold=0.0)
    first, second = _crop(photo, 40, 60), _crop(photo, 40, 60)
    second[20:30, 30:40] = 255 - second[20:30, 30:40]
    buffer = first.copy()
    session(buffer)
    buffer[...] = second  # the caller refills its buffer with the next frame
    out = session(buffer, homography=np.eye(3))
    assert session.stats[-1].mode == "cached" and 0 < session.stats[-1].recompute_fraction < 0.5
    _assert_close(out, _full(model, second))


def test_cached_frames_that_save_little_count_towards_the_back_off(zoo, photo):
    # a camera moving by whole positions (32 px) over unrelated content: the cached frames recompute everything
    # (saving ~1x), which the session treats like a miss, so after three of them it runs plain frames without
    # matching for a while; a still camera's expensive frames do not count (the next one may be cheap again)
    model = zoo["mobilenet_v2"]
    session = StreamSession(model, pixel_threshold=0.01, max_ratio=1.0, feature_threshold=0.0, keyframe_interval=None,
                            max_backoff=4, **UNGUARDED)
    a, b = _crop(photo, 40, 60), _crop(photo, 100, 150)
    pan = np.array([[1.0, 0, -32], [0, 1, 0], [0, 0, 1]])
    sequence = [(a, None), (b, pan), (a, pan), (b, pan), (a, pan), (b, pan), (a, pan), *[(a, np.eye(3))] * 5]
    for image, homography in sequence:
        out = session(image, homography=homography)
        _assert_close(out, _full(model, image))
    reasons = [s.reason.split(":")[0] for s in session.stats]
    assert reasons[:7] == ["first frame", "ok", "ok", "ok", "backing off", "backing off", "ok"]
    assert [s.flops_ratio < 1.25 for s in session.stats[1:4]] == [True] * 3
    # the probe at 6 saved little again: 4 frames off, then a still frame probes, saves everything, resets
    assert reasons[7:] == ["backing off"] * 4 + ["ok"]
    assert session.stats[-1].flops_ratio == float("inf") and session._backoff.skip == session._backoff.stretch == 0
    still = StreamSession(model, pixel_threshold=0.01, max_ratio=1.0, feature_threshold=0.0, keyframe_interval=None,
                          **UNGUARDED)
    for image in [a, b, a, b, a, b]:
        still(image, homography=np.eye(3))
    assert [s.reason for s in still.stats[1:]] == ["ok"] * 5 and max(s.flops_ratio for s in still.stats[1:]) < 1.25


def test_default_feature_threshold_prunes_still_frames_only(zoo, photo):
    model = zoo["efficientnet_lite0"]
    frame = _crop(photo, 40, 60)
    changed = frame.copy()
    changed[20:36, 30:46] = np.clip(changed[20:36, 30:46].astype(int) + 40, 0, 255).astype(np.uint8)
    default, exact = StreamSession(model), StreamSession(model, feature_threshold=0.0)
    for session in (default, exact):
        session(frame)
        session(changed, homography=np.eye(3))
    executor = next(iter(default._engines.values()))
    still = StreamConfig.STILL_FEATURE_THRESHOLD
    assert (executor.feature_threshold, executor.moving_feature_threshold) == (still, 0.0)
    assert default.stats[-1].flops_ratio > exact.stats[-1].flops_ratio  # pruned on a still camera
    ref = _full(model, changed)
    assert float((default(changed, homography=np.eye(3)) - ref).norm() / ref.norm()) < 0.2
    fixed = StreamSession(model, feature_threshold=0.1)
    fixed(frame)
    executor = next(iter(fixed._engines.values()))
    assert (executor.feature_threshold, executor.moving_feature_threshold) == (0.1, 0.1)


def test_background_update_gives_the_same_outputs(zoo, photo):
    model = zoo["mobilenet_v2"]
    sessions = [StreamSession(model, background_update=flag, **UNGUARDED) for flag in (False, True)]
    frames = [_crop(photo, 40, 60)]
    for k in range(1, 6):
        frame = _crop(photo, 40, 60 + (32 if k >= 3 else 0))
        frame[10 + 5 * k:20 + 5 * k, 30:44] = 255 - frame[10 + 5 * k:20 + 5 * k, 30:44]
        frames.append(frame)
    pan = np.array([[1.0, 0, -32], [0, 1, 0], [0, 0, 1]])
    homographies = [None, np.eye(3), np.eye(3), pan, np.eye(3), np.eye(3)]
    for frame, homography in zip(frames, homographies):
        a, b = (s(frame, homography=homography) for s in sessions)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [s.mode for s in sessions[0].stats] == [s.mode for s in sessions[1].stats]
    assert sum(s.mode == "cached" for s in sessions[1].stats) >= 4


def test_a_moving_frame_builds_its_index_maps_once(zoo, photo, monkeypatch):
    # the session asks whether the motion leaves the cache usable before the frame runs: the executor reuses
    # those index maps for the frame instead of building them again
    model = zoo["resnet18"]
    session = StreamSession(model, keyframe_interval=None)
    session(_crop(photo, 40, 40))
    calls = []
    original = CameraEngine._warp_maps
    monkeypatch.setattr(CameraEngine, "_warp_maps", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    frame = _crop(photo, 40, 72)
    out = session(frame, homography=np.array([[1.0, 0, -32], [0, 1, 0], [0, 0, 1]]))
    assert session.stats[-1].mode == "cached" and calls == [1]
    _assert_close(out, _full(model, frame))


def test_integer_pan_moves_a_stride_one_stem(photo):
    # the first cached map has the frame's own size (a stride-1 stem, as VGG's): it moves with the camera too
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()
    session = StreamSession(model, keyframe_interval=None, still_fraction=0)
    session(_crop(photo, 40, 40))
    frame = _crop(photo, 40, 56)
    out = session(frame, homography=np.array([[1.0, 0, -16], [0, 1, 0], [0, 0, 1]]))
    assert session.stats[-1].mode == "cached" and session.stats[-1].flops_ratio > 1.0
    _assert_close(out, _full(model, frame))


def test_keyframe_interval_one_runs_full_inference_on_every_frame(zoo, photo):
    # a natural thing to ask for: the dependent settings (the audit interval, with the quality guard on) adapt
    model = zoo["mobilenet_v2"]
    # min_saving=0: the profile's measured seconds on a loaded machine may judge that this small input's cache cannot
    # pay ("no reuse", full frames for another reason), which is not what this test is about
    session = GuardedSession(model, keyframe_interval=1, min_saving=0.0)
    frames = [_crop(photo, 40 + k, 60) for k in (0, 0, 0, 2)]
    for frame in frames:
        _assert_close(session(frame), _full(model, frame))
    assert [s.mode for s in session.stats] == ["full"] * 4
    assert [s.reason for s in session.stats[1:]] == ["keyframe"] * 3
    assert not any(s.audit for s in session.stats)


def test_opencv_threads_is_set_for_the_process_and_validated(zoo):
    before = cv2.getNumThreads()
    try:
        cv2.setNumThreads(2)
        StreamSession(zoo["mobilenet_v2"])  # None: OpenCV's setting is left as it is
        assert cv2.getNumThreads() == 2
        session = StreamSession(zoo["mobilenet_v2"], opencv_threads=1)
        assert session.config.opencv_threads == 1 and cv2.getNumThreads() == 1
    finally:
        cv2.setNumThreads(before)
    for bad in (0, -2, 1.5, "2"):
        with pytest.raises(ValueError, match="opencv_threads"):
            StreamConfig(opencv_threads=bad)


def test_stats_are_bounded_by_keep_stats(zoo, photo):
    session = StreamSession(zoo["mobilenet_v2"], keep_stats=3)
    frame = _crop(photo, 40, 60)
    for _ in range(8):
        session(frame)
    assert 3 <= len(session.stats) <= 4 and session.stats[-1].index == 7
    assert session.stats.dropped + len(session.stats) == 8
    times = session.stats[-1].times
    assert times.engine > 0 and times.prepare > 0 and session.stats[-1].seconds >= sum(times.as_dict().values())


def test_one_load_spike_does_not_start_a_back_off_while_the_attempts_around_it_saved():
    """With the speed guard a stretch starts when the latest attempts' median net saving is not positive: three
    misses in a row start one only if the attempts did not typically save, whatever one slow frame cost."""
    import math

    from incrinf.stream.backoff import BackOff

    def run(frames: list[tuple[Cause | None, float]]) -> BackOff:
        backoff = BackOff(StreamConfig(backoff_after=3))
        for cause, seconds in frames:
            paid = backoff.paid(cause, True, math.inf, 0.036, seconds, 0.003)
            backoff.count(cause, paid, 0.036)
        return backoff

    saved = [(None, 0.015)] * 4  # cached frames 21 ms under a full one
    spike = [(None, 0.097), (None, 0.059), (None, 0.048)]  # a load spike: three slow cached frames
    assert not run(saved + spike).active
    assert run([(None, 0.040)] * 4 + spike).active  # nothing saved around them: back off


def test_a_frame_without_a_kept_cache_says_so_and_runs_full(zoo, photo):
    """A cache dropped without a failure (the last full frame ran plain) is its own cause, not "previous frame
    failed", and the frame after the full one that refills it is cached again."""
    model = zoo["mobilenet_v2"]
    session = StreamSession(model, pixel_threshold=0.01, feature_threshold=0.0)
    frame = _crop(photo, 40, 60)
    session(frame)
    next(iter(session._engines.values())).engine.reset()
    out = session(frame, homography=np.eye(3))
    assert (session.stats[-1].mode, session.stats[-1].cause) == ("full", Cause.NO_CACHE)
    _assert_close(out, _full(model, frame))
    out = session(frame, homography=np.eye(3))
    assert session.stats[-1].mode == "cached"
    _assert_close(out, _full(model, frame))
