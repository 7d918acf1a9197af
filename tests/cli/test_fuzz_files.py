"""Fuzzing the file readers: truncated and corrupted images (PNG, JPEG, BMP, TIFF, GIF) for ``incrinf explain``'s
``read_rgb`` and the dataset reader's ``decode_rgb``, and videos (MP4, AVI) for
``incrinf.stream.video.read_frames``. Each gives frames or a clear ValueError, never another exception or a crash,
and a good file reads normally afterwards."""

from __future__ import annotations

import io
import struct

import cv2
import numpy as np
import pytest
import skimage.data
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from incrinf.cli import main
from incrinf.cli.common import read_rgb
from incrinf.explain.dataset.inputs import decode_rgb
from incrinf.stream.video import read_frames

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
PHOTO = cv2.resize(skimage.data.chelsea(), (48, 32), interpolation=cv2.INTER_AREA)


def _image_bytes(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(PHOTO).save(buffer, format=fmt)
    return buffer.getvalue()


IMAGES = {fmt: _image_bytes(fmt) for fmt in ("PNG", "JPEG", "BMP", "TIFF", "GIF")}


@st.composite
def corrupted(draw, original: bytes) -> bytes:
    """``original`` truncated, with bytes overwritten, inserted or deleted (the header included)."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["truncate", "overwrite", "insert", "delete", "header"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "truncate":
            del data[at:]
        elif kind == "overwrite" and data:
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[at:at + len(chunk)] = chunk
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=64))
        elif kind == "delete":
            del data[at:at + draw(st.integers(1, 64))]
        else:  # the first bytes decide the format and the sizes
            data[:8] = draw(st.binary(min_size=8, max_size=8))
    return bytes(data)


def _check_image(image: np.ndarray) -> None:
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3 and min(image.shape[:2]) >= 1


@pytest.mark.parametrize("fmt", sorted(IMAGES))
def test_read_rgb_reads_every_format(tmp_path, fmt):
    path = tmp_path / f"photo.{fmt.lower()}"
    path.write_bytes(IMAGES[fmt])
    image = read_rgb(str(path))
    _check_image(image)
    assert image.shape == PHOTO.shape


@FUZZ
@given(data=st.data(), fmt=st.sampled_from(sorted(IMAGES)))
def test_read_rgb_corrupt_images(tmp_path_factory, data, fmt):
    folder = tmp_path_factory.mktemp("images")
    path = folder / f"bad.{fmt.lower()}"
    path.write_bytes(data.draw(corrupted(IMAGES[fmt])))
    try:
        image = read_rgb(str(path))
    except ValueError as exc:  # the message names the file
        assert str(path) in str(exc)
    else:  # some damage still decodes (a truncated JPEG's top rows, say): then it is a valid RGB image
        _check_image(image)
    good = folder / f"good.{fmt.lower()}"
    good.write_bytes(IMAGES[fmt])
    assert read_rgb(str(good)).shape == PHOTO.shape


@FUZZ
@given(data=st.data(), fmt=st.sampled_from(sorted(IMAGES)))
def test_decode_rgb_corrupt_images(data, fmt):
    damaged = data.draw(corrupted(IMAGES[fmt]))
    try:
        image = decode_rgb(damaged, name=f"bad.{fmt.lower()}")
    except ValueError as exc:
        assert f"bad.{fmt.lower()}" in str(exc)
    else:
        _check_image(image)
    assert decode_rgb(IMAGES[fmt]).shape == PHOTO.shape


def _bomb() -> bytes:
    """A GIF whose header claims 65535 x 65535 pixels."""
    data = bytearray(IMAGES["GIF"])
    data[6:10] = struct.pack("<HH", 65535, 65535)
    return bytes(data)


def test_read_rgb_refuses_a_huge_claimed_size(tmp_path):
    path = tmp_path / "bomb.gif"
    path.write_bytes(_bomb())
    with pytest.raises(ValueError, match="exceeds limit"):
        read_rgb(str(path))


def test_decode_rgb_refuses_a_huge_claimed_size():
    with pytest.raises(ValueError, match="cannot read image bomb.gif: its claimed size exceeds the limit"):
        decode_rgb(_bomb(), "bomb.gif")


def test_explain_command_on_a_corrupt_image(tmp_path):
    path = tmp_path / "cut.png"
    path.write_bytes(IMAGES["PNG"][:40])
    with pytest.raises(SystemExit, match="cannot read image .*cut.png"):  # before any model is loaded
        main(["explain", str(path), "--model", "squeezenet1_1", "--out", str(tmp_path / "heat.png")])
    assert not (tmp_path / "heat.png").exists()


def _video_bytes(tmp_path_factory, suffix: str, fourcc: str) -> bytes | None:
    path = tmp_path_factory.mktemp("video") / f"clip{suffix}"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), 10.0, (48, 32))
    if not writer.isOpened():
        return None
    for k in range(12):
        writer.write(np.ascontiguousarray(np.roll(PHOTO[:, :, ::-1], 2 * k, axis=1)))
    writer.release()
    return path.read_bytes()


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, bytes]:
    made = {suffix: _video_bytes(tmp_path_factory, suffix, fourcc) for suffix, fourcc in ((".mp4", "mp4v"),
                                                                                          (".avi", "MJPG"))}
    made = {suffix: data for suffix, data in made.items() if data}
    if ".mp4" not in made:
        pytest.skip("this OpenCV build cannot write MP4")
    return made


def test_read_frames_reads_the_clips(tmp_path, videos):
    for suffix, data in videos.items():
        path = tmp_path / f"clip{suffix}"
        path.write_bytes(data)
        frames = list(read_frames(path))
        assert len(frames) == 12 and all(f.shape == (32, 48, 3) and f.dtype == np.uint8 for f in frames)


@FUZZ
@given(data=st.data())
def test_read_frames_corrupt_videos(tmp_path_factory, videos, data):
    suffix = data.draw(st.sampled_from(sorted(videos)))
    folder = tmp_path_factory.mktemp("videos")
    path = folder / f"bad{suffix}"
    path.write_bytes(data.draw(corrupted(videos[suffix])))
    try:
        frames = list(read_frames(path, max_frames=20))
    except ValueError as exc:
        assert "could not decode any frame" in str(exc)
    else:  # whatever still decodes: at least the first frame, every one a valid RGB image
        assert 1 <= len(frames) <= 20
        for frame in frames:
            _check_image(frame)
    good = folder / f"good{suffix}"
    good.write_bytes(videos[suffix])
    assert len(list(read_frames(good))) == 12


def test_read_frames_empty_and_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_frames(tmp_path / "missing.mp4")
    (tmp_path / "empty.mp4").write_bytes(b"")
    with pytest.raises(ValueError, match="could not decode any frame"):
        read_frames(tmp_path / "empty.mp4")
