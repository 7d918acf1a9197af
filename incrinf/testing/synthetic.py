"""A virtual camera moving over a photo, with exactly known frame-to-frame homographies.

Each frame ``k`` is the photo seen through a similarity ``C_k`` (photo coords -> frame coords, rendered with
``cv2.warpPerspective``), so the true homography previous -> current frame is ``C_k @ inv(C_{k-1})``.
Coordinates follow :mod:`incrinf.stream.matching`: ``(x, y)``, pixel centres at integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from incrinf.extras import require

cv2 = require("cv2", "stream", "camera streams")

Motion = Literal["pan", "zoom", "pan_zoom"]

_PAN_SPEED = 3.0  # photo pixels per frame
_ZOOM_STEP = 1.01  # relative zoom per frame
_MAX_ZOOM_RANGE = 1.6  # zoom bounces between z_min and z_min * this


@dataclass(frozen=True)
class SyntheticFrame:
    """One rendered frame.

    Attributes:
        frame: (H, W, 3) uint8 RGB.
        homography: (3, 3) float64 mapping previous-frame coords to this frame's (identity for frame 0). It
            describes the background only, not the inserted object.
        object_box: ``(y0, y1, x0, x1)`` (end-exclusive) of the inserted object in this frame, or None.
    """

    frame: np.ndarray
    homography: np.ndarray
    object_box: tuple[int, int, int, int] | None


def _camera_matrix(centre: np.ndarray, zoom: float, size: tuple[int, int]) -> np.ndarray:
    """Similarity mapping photo point ``centre`` to the frame centre, scaling by ``zoom``."""
    h, w = size
    frame_centre = np.array([(w - 1) / 2, (h - 1) / 2])
    t = frame_centre - zoom * centre
    return np.array([[zoom, 0.0, t[0]], [0.0, zoom, t[1]], [0.0, 0.0, 1.0]])


def _object_texture(shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """A smooth two-colour gradient: clearly unlike the photo, but with few keypoints of its own, so the
    background still dominates the matches (a textured object would drag the homography along with it)."""
    h, w = shape
    colours = rng.integers(0, 256, size=(2, 3)).astype(np.float64)
    t = np.linspace(0.0, 1.0, w)[None, :, None]
    row = (1 - t) * colours[0] + t * colours[1]
    return np.repeat(row, h, axis=0).round().astype(np.uint8)


def synthetic_scene(
    image: np.ndarray,
    n_frames: int,
    size: tuple[int, int] = (224, 224),
    motion: Motion = "pan",
    seed: int = 0,
    insert_object: bool = False,
) -> list[SyntheticFrame]:
    """Render ``n_frames`` of a camera panning and/or zooming over ``image``.

    The camera starts at a random position (from ``seed``), moves ~3 photo pixels per frame in a random
    direction and/or zooms by ~1% per frame, bouncing off the photo's borders so every frame is fully
    covered by the photo.

    Args:
        image: (Hp, Wp, 3) uint8 RGB photo (or (Hp, Wp) grayscale, replicated to RGB).
        n_frames: number of frames.
        size: (height, width) of the frames.
        motion: ``"pan"``, ``"zoom"`` or ``"pan_zoom"``.
        seed: seeds the start position, direction and object.
        insert_object: paste a gradient-filled rectangle (about size/5) that moves independently of the
            camera, so consecutive frames have regions the homography does not explain.

    Returns:
        ``n_frames`` :class:`SyntheticFrame`.
    """
    if motion not in ("pan", "zoom", "pan_zoom"):
        raise ValueError(f"unknown motion {motion!r}; expected 'pan', 'zoom' or 'pan_zoom'")
    photo = np.asarray(image)
    if photo.ndim == 2:
        photo = np.repeat(photo[:, :, None], 3, axis=2)
    photo = np.ascontiguousarray(photo.astype(np.uint8, copy=False))
    rng = np.random.default_rng(seed)
    h, w = size
    ph, pw = photo.shape[:2]
    # Smallest zoom at which the view (size / zoom photo pixels) fits inside the photo, with a margin; no
    # zooming out past 2x downsampling, which would only alias the photo's texture.
    z_fit = max((h + 2) / ph, (w + 2) / pw) * 1.001
    z_min = max(z_fit, 1.0 if motion == "pan" else 0.5)
    z_max = z_min * _MAX_ZOOM_RANGE
    zoom = z_min if motion == "pan" else z_min * 1.05
    pans = motion in ("pan", "pan_zoom")
    angle = rng.uniform(0, 2 * np.pi)
    velocity = _PAN_SPEED * np.array([np.cos(angle), np.sin(angle)]) if pans else np.zeros(2)
    zoom_step = _ZOOM_STEP if motion != "pan" else 1.0

    def half_view(z: float) -> np.ndarray:
        return np.array([(w - 1) / 2, (h - 1) / 2]) / z + 1.0

    lo, hi = half_view(zoom), np.array([pw - 1, ph - 1]) - half_view(zoom)
    centre = rng.uniform(lo, hi)

    obj_shape = (max(h // 5, 4), max(w // 4, 4))
    texture = _object_texture(obj_shape, rng)
    obj_pos = rng.uniform([0, 0], [h - obj_shape[0], w - obj_shape[1]])
    obj_vel = rng.uniform(-4, 4, size=2)

    frames: list[SyntheticFrame] = []
    prev_cam: np.ndarray | None = None
    for _ in range(n_frames):
        cam = _camera_matrix(centre, zoom, size)
        frame = cv2.warpPerspective(
            photo, cam, (w, h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT_101
        )
        homography = np.eye(3) if prev_cam is None else cam @ np.linalg.inv(prev_cam)
        box = None
        if insert_object:
            y0, x0 = (int(round(v)) for v in obj_pos)
            box = (y0, y0 + obj_shape[0], x0, x0 + obj_shape[1])
            frame[box[0] : box[1], box[2] : box[3]] = texture
        frames.append(SyntheticFrame(frame, homography / homography[2, 2], box))
        prev_cam = cam

        # Advance the camera, bouncing so the view stays inside the photo.
        new_zoom = zoom * zoom_step
        if not z_min <= new_zoom <= z_max:
            zoom_step = 1.0 / zoom_step
            new_zoom = zoom * zoom_step
        zoom = new_zoom
        lo, hi = half_view(zoom), np.array([pw - 1, ph - 1]) - half_view(zoom)
        new_centre = centre + velocity
        out = (new_centre < lo) | (new_centre > hi)
        velocity = np.where(out, -velocity, velocity)
        centre = np.clip(centre + velocity, lo, hi)

        obj_pos = obj_pos + obj_vel
        obj_out = (obj_pos < 0) | (obj_pos > np.array([h - obj_shape[0], w - obj_shape[1]]))
        obj_vel = np.where(obj_out, -obj_vel, obj_vel)
        obj_pos = np.clip(obj_pos, 0, [h - obj_shape[0], w - obj_shape[1]])
    return frames


def synthetic_camera(
    image: np.ndarray,
    n_frames: int,
    size: tuple[int, int] = (224, 224),
    motion: Motion = "pan",
    seed: int = 0,
    insert_object: bool = False,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Frames and true homographies of a virtual camera over ``image``; see :func:`synthetic_scene`.

    Returns:
        ``n_frames`` pairs ``(frame (H, W, 3) uint8 RGB, H_true (3, 3) float64)``, ``H_true`` mapping the
        previous frame's pixel coords to this frame's (identity for the first frame).
    """
    scene = synthetic_scene(image, n_frames, size, motion, seed, insert_object)
    return [(f.frame, f.homography) for f in scene]
