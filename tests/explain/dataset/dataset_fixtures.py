"""Small real image folders for the dataset tests: nested directories, a corrupt JPEG, a non-image file.

A plain module, not a conftest.py: a second conftest would take the name `conftest` that tests/test_*.py import
from (this folder has no __init__.py, like tests/). Test modules import the fixture by name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import incrinf

# The real EfficientNet-Lite0 at 64 px with a 4x4 grid of 16-pixel windows: real, varied predictions (cat,
# astronaut, rocket, ...) at about 0.1 s per input.
MODEL = "efficientnet_lite0"
SIZE = 64
OPTIONS = {"patch": 16, "stride": 16, "output": "prob"}


def photo(name: str, side: int = 96) -> np.ndarray:
    """An scikit-image sample photo as (H, W, 3) uint8, shorter side ``side``."""
    import skimage.data
    from PIL import Image

    image = getattr(skimage.data, name)()
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    img = Image.fromarray(np.ascontiguousarray(image[..., :3]))
    scale = side / min(img.size)
    return np.asarray(img.resize((round(img.size[0] * scale), round(img.size[1] * scale)), Image.LANCZOS))


def save(path: Path, rgb: np.ndarray) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb).save(path)
    return path


@pytest.fixture(scope="session", name="photos")
def photos_fixture(tmp_path_factory) -> Path:
    """``data/`` (nested folders, 5 photos, a truncated JPEG, a text file named .png, a readme) and ``extra/``
    (2 photos, for a glob). Read-only for tests: copy before changing."""
    root = tmp_path_factory.mktemp("photos")
    data = root / "data"
    save(data / "cats" / "chelsea.jpg", photo("chelsea"))
    save(data / "cats" / "more" / "chelsea_flipped.png", photo("chelsea")[:, ::-1].copy())
    save(data / "space" / "astronaut.png", photo("astronaut"))
    save(data / "space" / "rocket.jpg", photo("rocket"))
    save(data / "coffee.png", photo("coffee"))
    whole = (data / "cats" / "chelsea.jpg").read_bytes()
    (data / "broken.jpg").write_bytes(whole[: len(whole) // 2])  # a download cut in half
    (data / "notes.png").write_text("not a picture\n")
    (data / "readme.txt").write_text("labels: cats, space\n")
    save(root / "extra" / "coins.png", photo("coins"))
    save(root / "extra" / "camera.png", photo("camera"))
    return root


GOOD = 7  # photos in data/ and extra/
BAD = 2  # broken.jpg, notes.png


class CountingOcclusion:
    """Counts calls of the public ``incrinf.occlusion`` (what every job calls once per input); optionally
    raises KeyboardInterrupt on call ``interrupt_at`` (1-based) as Ctrl-C would."""

    def __init__(self, monkeypatch, interrupt_at: int | None = None) -> None:
        self.original = incrinf.occlusion
        self.calls = 0
        self.interrupt_at = interrupt_at
        monkeypatch.setattr(incrinf, "occlusion", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.interrupt_at is not None and self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        return self.original(*args, **kwargs)
