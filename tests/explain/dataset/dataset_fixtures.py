"""Small real image folders for the dataset tests: nested directories, a corrupt JPEG, a non-image file.

A plain module, not a conftest.py: a second conftest would take the name `conftest` that tests/test_*.py import
from (this folder has no __init__.py, like tests/). Test modules import the fixture by name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

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


# --- NIfTI volumes ----------------------------------------------------------------------------------------------

VOLUME_OPTIONS = {"patch": 4, "stride": 4, "output": "prob"}
SHAPE = (16, 12, 10)  # a scan's (x, y, z): the model sees (D, H, W) = (10, 12, 16)


def small_net(seed: int = 0) -> nn.Module:
    """A small 3-D classifier (conv, pool, residual-free: the engine's exactness is tested elsewhere)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2), nn.Conv3d(4, 6, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(6, 3)).eval()


def affine(shift: float) -> np.ndarray:
    out = np.diag([1.5, 2.0, 2.5, 1.0])
    out[:3, 3] = [-12.0, 7.0, shift]
    return out


@pytest.fixture(scope="session", name="scans")
def scans_fixture(tmp_path_factory) -> Path:
    """``scans/``: four small scans (one the first frame of nibabel's real fMRI volume, cropped, in a subfolder),
    a NIfTI-2 file, a gzip cut in half, a text file named .nii and a readme. Read-only for tests."""
    nibabel = pytest.importorskip("nibabel")
    example = Path(nibabel.__file__).parent / "tests" / "data" / "example4d.nii.gz"
    root = tmp_path_factory.mktemp("scans")
    rng = np.random.default_rng(0)
    for i, name in enumerate(["p01.nii.gz", "p02.nii", "p03.nii.gz"]):
        blob = np.zeros(SHAPE, np.float32)
        blob[2 + i:9 + i, 3:9, 2:7] = 3.0  # a bright region that moves from scan to scan
        nibabel.save(nibabel.Nifti1Image(blob + rng.normal(size=SHAPE).astype(np.float32), affine(i)),
                     root / name)
    frame = nibabel.load(example)
    data = np.asarray(frame.dataobj)[40:56, 30:42, 7:17, 0].astype(np.float32)  # (16, 12, 10) of anatomy
    (root / "site-b").mkdir()
    nibabel.save(nibabel.Nifti1Image(data, frame.affine), root / "site-b" / "p04.nii.gz")
    nibabel.save(nibabel.Nifti2Image(rng.normal(size=SHAPE).astype(np.float32), affine(5)), root / "p05.nii")
    whole = (root / "p01.nii.gz").read_bytes()
    (root / "p06-broken.nii.gz").write_bytes(whole[: len(whole) // 2])  # a transfer cut in half
    (root / "p07-text.nii").write_text("not a volume\n")
    (root / "README.txt").write_text("five scans, two damaged\n")
    return root


GOOD_SCANS, BAD_SCANS = 5, 2  # in scans/: explainable, corrupt
