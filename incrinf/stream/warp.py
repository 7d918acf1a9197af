"""Warping images and cached feature maps through a frame-to-frame homography.

``H`` maps previous-frame pixel coords ``(x, y, 1)`` to current-frame coords (see
:mod:`incrinf.stream.matching`). Warping is done by *inverse mapping*: each current position asks where it
came from, ``inv(H) @ (x, y, 1)``, and reads the previous image / cache there. That is CacheInf's "reading
the cache through the homography by index transformation", ``G(u, v, M) = M^-1 (u, v)``.

Images are warped with OpenCV (:func:`warp_image`); maps of frames sent to the offload server are read at the
nearest source position (:func:`nearest_source_index`: one integer index per position, a pure gather, exact
copies of source values, any dtype). The stream's cached feature maps are moved by
:mod:`incrinf.stream.camera`, which also keeps the nearest-neighbour rounding from adding up over frames.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from incrinf.extras import require

Interpolation = Literal["nearest", "bilinear"]

# Slack for float round-off when deciding whether a source coordinate lies on the border pixel.
_EPS = 1e-6


def warp_image(
    img: np.ndarray,
    matrix: np.ndarray,
    out_size: tuple[int, int] | None = None,
    interpolation: Interpolation = "bilinear",
    fill: float = 0,
) -> np.ndarray:
    """Warp the previous frame into the current frame's view (``cv2.warpPerspective``).

    Args:
        img: (H, W) or (H, W, C) previous image, C <= 4, uint8 or float32.
        matrix: (3, 3) homography previous -> current pixel coords.
        out_size: (height, width) of the output; defaults to the input's.
        interpolation: ``"bilinear"`` or ``"nearest"``.
        fill: value of pixels that come from outside ``img`` (see :func:`warp_valid_mask`).

    Returns:
        (out_h, out_w[, C]) warped image, same dtype as ``img``.
    """
    img = np.ascontiguousarray(img)
    out_h, out_w = out_size if out_size is not None else img.shape[:2]
    n_channels = 1 if img.ndim == 2 else img.shape[2]
    cv2 = require("cv2", "stream", "camera streams")  # here, not at import: the offload server has no OpenCV
    flags = {"nearest": cv2.INTER_NEAREST, "bilinear": cv2.INTER_LINEAR}
    return cv2.warpPerspective(
        img,
        np.asarray(matrix, dtype=np.float64),
        (out_w, out_h),
        flags=flags[interpolation],
        borderMode=cv2.BORDER_CONSTANT,
        borderValue=(fill,) * min(n_channels, 4),
    ).reshape((out_h, out_w) + img.shape[2:])


def source_coords(matrix: np.ndarray, out_h: int, out_w: int) -> tuple[np.ndarray, np.ndarray]:
    """For each pixel of the current frame, its coordinates in the previous frame (inverse mapping).

    Args:
        matrix: (3, 3) homography previous -> current pixel coords.
        out_h: current frame height.
        out_w: current frame width.

    Returns:
        ``(src_y, src_x)``, each (out_h, out_w) float64; NaN where the point maps from behind the camera
        (non-positive homogeneous scale).
    """
    inverse = np.linalg.inv(np.asarray(matrix, dtype=np.float64))
    ys, xs = np.mgrid[0:out_h, 0:out_w].astype(np.float64)
    hx = inverse[0, 0] * xs + inverse[0, 1] * ys + inverse[0, 2]
    hy = inverse[1, 0] * xs + inverse[1, 1] * ys + inverse[1, 2]
    hw = inverse[2, 0] * xs + inverse[2, 1] * ys + inverse[2, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        hw = np.where(hw > 0, hw, np.nan)
        return hy / hw, hx / hw


def source_valid(
    src_y: np.ndarray, src_x: np.ndarray, in_size: tuple[int, int], interpolation: Interpolation = "bilinear"
) -> np.ndarray:
    """Whether source coordinates read only pixels inside a previous frame of ``in_size``.

    ``"nearest"`` rounds (``floor(x + 0.5)``) so valid means ``-0.5 <= x < W - 0.5``; ``"bilinear"`` needs
    all four taps inside, ``0 <= x <= W - 1`` (pixels half outside are blended with the fill value).

    Args:
        src_y: (h, w) source rows from :func:`source_coords`.
        src_x: (h, w) source columns.
        in_size: (height, width) of the previous frame.
        interpolation: ``"nearest"`` or ``"bilinear"``.

    Returns:
        (h, w) bool, False also where the coords are NaN.
    """
    in_h, in_w = in_size
    with np.errstate(invalid="ignore"):
        if interpolation == "nearest":
            return (src_x >= -0.5) & (src_x < in_w - 0.5) & (src_y >= -0.5) & (src_y < in_h - 0.5)
        return (src_x >= -_EPS) & (src_x <= in_w - 1 + _EPS) & (src_y >= -_EPS) & (src_y <= in_h - 1 + _EPS)


def warp_valid_mask(
    matrix: np.ndarray,
    out_size: tuple[int, int],
    in_size: tuple[int, int] | None = None,
    interpolation: Interpolation = "bilinear",
) -> np.ndarray:
    """Which pixels of :func:`warp_image`'s output come from inside the previous frame.

    Pass its negation's cells as changed (``change_mask(..., valid=...)`` does this): those pixels have no
    cached counterpart.

    Args:
        matrix: (3, 3) homography previous -> current.
        out_size: (height, width) of the current frame.
        in_size: (height, width) of the previous frame; defaults to ``out_size``.
        interpolation: the interpolation the warp used.

    Returns:
        (out_h, out_w) bool.
    """
    src_y, src_x = source_coords(matrix, *out_size)
    return source_valid(src_y, src_x, in_size or out_size, interpolation)


def nearest_source_index(
    matrix: np.ndarray,
    feature_h: int,
    feature_w: int,
    image_size: tuple[int, int],
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat index into the previous feature map that each position of the current one reads.

    The homography is rescaled from the image grid to the feature grid (:func:`scale_homography`,
    align_corners=False convention) and each current position takes its nearest previous position.

    Args:
        matrix: (3, 3) homography previous -> current, in pixel coords of images of ``image_size``.
        feature_h: height of the feature map (same for previous and current).
        feature_w: width of the feature map.
        image_size: (height, width) of the frames ``matrix`` was estimated on.
        device: device of the returned tensors.

    Returns:
        ``(idx, valid)``: idx (feature_h * feature_w,) int64, row-major ``y * feature_w + x`` into the
        previous map (0 where invalid, so gathers stay in bounds); valid (feature_h * feature_w,) bool,
        False where the source lies outside the previous map (those positions must be recomputed).
    """
    scaled = scale_homography(matrix, image_size, (feature_h, feature_w))
    src_y, src_x = source_coords(scaled, feature_h, feature_w)
    valid = source_valid(src_y, src_x, (feature_h, feature_w), "nearest")
    # floor(x + 0.5), not np.rint: rint rounds half to even, which would make the mapping non-monotonic.
    with np.errstate(invalid="ignore"):
        iy = np.where(valid, np.floor(src_y + 0.5), 0).astype(np.int64)
        ix = np.where(valid, np.floor(src_x + 0.5), 0).astype(np.int64)
    idx = (iy * feature_w + ix).reshape(-1)
    return (
        torch.from_numpy(idx).to(device),
        torch.from_numpy(valid.reshape(-1)).to(device),
    )


def scale_homography(matrix: np.ndarray, from_size: tuple[int, int], to_size: tuple[int, int]) -> np.ndarray:
    """Re-express a homography estimated on images of ``from_size`` for maps of ``to_size``.

    Uses the pixel-centre convention of ``align_corners=False`` resampling: a coordinate ``x`` on the
    ``from`` grid is ``x' = (x + 0.5) * s - 0.5`` on the ``to`` grid, ``s = to_w / from_w`` (and likewise
    for ``y``). The result is ``S @ H @ inv(S)``.

    Args:
        matrix: (3, 3) homography on the ``from`` grid.
        from_size: (height, width) the homography was estimated on.
        to_size: (height, width) of the target map (e.g. a feature map).

    Returns:
        (3, 3) float64 homography on the ``to`` grid, normalised so ``[2, 2] == 1``.
    """
    sy = to_size[0] / from_size[0]
    sx = to_size[1] / from_size[1]
    s = np.array([[sx, 0.0, 0.5 * sx - 0.5], [0.0, sy, 0.5 * sy - 0.5], [0.0, 0.0, 1.0]])
    s_inv = np.array([[1 / sx, 0.0, 0.5 / sx - 0.5], [0.0, 1 / sy, 0.5 / sy - 0.5], [0.0, 0.0, 1.0]])
    out = s @ np.asarray(matrix, dtype=np.float64) @ s_inv
    return out / out[2, 2]
