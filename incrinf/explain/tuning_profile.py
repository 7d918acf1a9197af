"""Tuning profiles: the settings of the approximation's knobs (:class:`Setting`) that :func:`incrinf.tune`
measured on sample images, their SSIMs and speeds, the setting chosen for a target SSIM, and the JSON file that
holds them (:class:`TuningProfile`). The profile records the graph signature it was tuned for and refuses another
model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from incrinf.validation import check_feature_threshold, check_tau

PROFILE_FORMAT = "incrinf-tuning-profile"
PROFILE_VERSION = 2
# A setting counts as faster than the exact run only beyond this (wall times on a shared machine vary by ~10%).
MIN_SPEEDUP = 1.1


@dataclass(frozen=True)
class Setting:
    """One setting of the approximation's knobs.

    Attributes:
        tau: projective field threshold in (0, 1] (1: no cap).
        feature_threshold: value-based pruning threshold (0: none).
        drill_factor: drill-down stage-one stride as a multiple of the stride (1: no drill-down).
        drill_fraction: drill-down stage-two share of the fine grid (0 with factor 1).
    """

    tau: float = 1.0
    feature_threshold: float = 0.0
    drill_factor: int = 1
    drill_fraction: float = 0.0

    def __post_init__(self) -> None:
        check_tau(self.tau)
        check_feature_threshold(self.feature_threshold)
        if isinstance(self.drill_factor, bool) or not isinstance(self.drill_factor, int) or self.drill_factor < 1:
            raise ValueError(f"drill_factor must be an integer >= 1, got {self.drill_factor!r}")
        if (self.drill_factor == 1 and self.drill_fraction != 0.0) or \
                (self.drill_factor > 1 and not 0.0 < self.drill_fraction < 1.0):
            raise ValueError(f"drill_fraction must be in (0, 1) with drill-down and 0 without; got "
                             f"{self.drill_fraction!r}")

    @property
    def exact(self) -> bool:
        return self.tau == 1.0 and self.feature_threshold == 0.0 and self.drill_factor == 1

    def describe(self) -> str:
        parts = [f"tau {self.tau:g}"] if self.tau < 1.0 else []
        if self.feature_threshold > 0:
            parts.append(f"feature threshold {self.feature_threshold:g}")
        if self.drill_factor > 1:
            parts.append(f"drill-down x{self.drill_factor} r={self.drill_fraction:g}")
        return ", ".join(parts) or "exact"


@dataclass
class TuningProfile:
    """What :func:`tune` measured, and the setting it chose.

    Attributes:
        model: model name (the class name unless given).
        signature: captured-graph signature (structure and input shape) the profile was tuned for.
        input_shape: (1, C, H, W) of the tuning images.
        patch: (h, w) occlusion window.
        stride: (sy, sx).
        output: "logit" or "prob".
        target_ssim: the target the profile was tuned for.
        coverage: share of the fitting images a setting must hold the target on.
        settings: every setting measured (``asdict(Setting)`` each).
        ssim: per image, SSIM of each setting against the exact map.
        speed: per image, the exact run's cost over the setting's (wall time, or multiply-adds: ``speed_unit``).
        check: indices of the held-out images (used only to check the chosen setting).
        chosen: index of the chosen setting (the exact one when none reaches the target with a speedup).
        images: names of the tuning images.
        seconds: tuning time.
    """

    model: str
    signature: str
    input_shape: list[int]
    patch: list[int]
    stride: list[int]
    output: str
    target_ssim: float
    coverage: float
    settings: list[dict]
    ssim: list[list[float]]
    speed: list[list[float]]
    check: list[int]
    chosen: int = 0
    images: list[str] = field(default_factory=list)
    seconds: float = 0.0
    speed_unit: str = "wall"

    # --- choosing --------------------------------------------------------------------------------------

    @property
    def setting(self) -> Setting:
        """The chosen setting."""
        return Setting(**self.settings[self.chosen])

    def _fit(self) -> list[int]:
        return [i for i in range(len(self.ssim)) if i not in set(self.check)] or list(range(len(self.ssim)))

    def quality(self, index: int, images: Sequence[int] | None = None) -> float:
        """The SSIM a setting holds on ``coverage`` of the images (default: the fitting ones)."""
        rows = np.asarray(self.ssim)[list(images) if images is not None else self._fit(), index]
        return float(np.quantile(rows, 1.0 - self.coverage))

    def median_speed(self, index: int, images: Sequence[int] | None = None) -> float:
        """Median speed of a setting over the images (default: the fitting ones)."""
        return float(np.median(np.asarray(self.speed)[list(images) if images is not None else self._fit(), index]))

    def choose(self, target_ssim: float | None = None) -> int:
        """Index of the fastest setting whose SSIM holds ``target_ssim`` on ``coverage`` of the fitting images
        and that is faster than the exact run (by :data:`MIN_SPEEDUP`); the exact setting when none is (the
        exact path holds any target; :meth:`unreached` says why nothing faster did).

        Raises:
            ValueError: a bad target, or a profile without the exact setting.
        """
        target = self.target_ssim if target_ssim is None else check_target_ssim(target_ssim)
        candidates = [i for i, s in enumerate(self.settings) if not Setting(**s).exact
                      and self.quality(i) >= target and self.median_speed(i) > MIN_SPEEDUP]
        if candidates:
            return max(candidates, key=self.median_speed)
        exact = [i for i, s in enumerate(self.settings) if Setting(**s).exact]
        if not exact:
            raise ValueError(f"the profile has no exact setting to fall back on: {self.unreached(target)}")
        return exact[0]

    def unreached(self, target_ssim: float | None = None) -> str:
        """Why no approximate setting holds ``target_ssim`` with a speedup: the best reachable ones."""
        target = self.target_ssim if target_ssim is None else check_target_ssim(target_ssim)
        approximate = [i for i, s in enumerate(self.settings) if not Setting(**s).exact]
        if not approximate:
            return "the profile holds no approximate setting"
        best_quality = max(approximate, key=self.quality)
        faster = [i for i in approximate if self.median_speed(i) > MIN_SPEEDUP]
        best_fast = max(faster, key=self.quality) if faster else None
        reach = (f"; the best faster one is {self._label(best_fast)}" if best_fast is not None else
                 "; no approximate setting was faster than the exact run")
        return (f"no tuned setting holds SSIM {target:g} on {self.coverage:.0%} of the tuning images with a "
                f"speedup: the highest SSIM is {self._label(best_quality)}{reach}")

    def _label(self, index: int) -> str:
        return (f"{Setting(**self.settings[index]).describe()} (SSIM {self.quality(index):.3f}, "
                f"{self.median_speed(index):.2f}x)")

    def check_result(self) -> tuple[float, float] | None:
        """``(SSIM held on coverage of the held-out images, their median speed)`` of the chosen setting."""
        if not self.check or Setting(**self.settings[self.chosen]).exact:
            return None
        return self.quality(self.chosen, self.check), self.median_speed(self.chosen, self.check)

    def summary(self) -> str:
        """A table of every setting: SSIM held (fitting images), median speed, and the choice with its check."""
        lines = [f"{'setting':<44} {'SSIM held':>9} {'speed':>7}"]
        for i, s in enumerate(self.settings):
            mark = " <- chosen" if i == self.chosen else ""
            lines.append(f"{Setting(**s).describe():<44} {self.quality(i):>9.3f} {self.median_speed(i):>6.2f}x{mark}")
        fit = len(self._fit())
        lines.append(f"target SSIM {self.target_ssim:g} on {self.coverage:.0%} of {fit} fitting images -> "
                     f"{self.setting.describe()}")
        checked = self.check_result()
        if checked is not None:
            lines.append(f"held out ({len(self.check)} images): SSIM {checked[0]:.3f} on {self.coverage:.0%} of them, "
                         f"{checked[1]:.2f}x" + ("" if checked[0] >= self.target_ssim else
                                                 " -- BELOW the target: the setting did not hold on unseen images"))
        return "\n".join(lines)

    # --- files ------------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **asdict(self)}, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> TuningProfile:
        """Read and validate a profile written by :meth:`save`.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not JSON, not a profile, another version, or a field of the wrong type or shape.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tuning profile not found: {path}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not a tuning profile (not valid JSON: {exc})") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> TuningProfile:
        """Build a profile from its JSON dictionary, validating every field."""
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{source} is not an incrinf tuning profile (no \"format\": \"{PROFILE_FORMAT}\")")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"{source}: unsupported profile version {data.get('version')!r} (this incrinf reads "
                             f"version {PROFILE_VERSION}; tune again with incrinf tune)")
        try:
            values = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
            profile = cls(**values)
            settings = [Setting(**s) for s in profile.settings]
            ssim, speed = np.asarray(profile.ssim, np.float64), np.asarray(profile.speed, np.float64)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"{source}: malformed profile ({exc})") from None
        if ssim.ndim != 2 or ssim.shape != speed.shape or ssim.shape[1] != len(settings) or not len(settings):
            raise ValueError(f"{source}: 'ssim' and 'speed' must hold one value per image and setting")
        if not np.isfinite(ssim).all() or not (speed > 0).all() or not 0 <= profile.chosen < len(settings):
            raise ValueError(f"{source}: non-finite SSIMs, non-positive speeds or a bad 'chosen' index")
        profile.target_ssim = check_target_ssim(profile.target_ssim)
        return profile


def check_target_ssim(value: Any) -> float:
    """A target SSIM in (-1, 1]."""
    try:
        target = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"target_ssim must be a number in (-1, 1], got {value!r}") from None
    if isinstance(value, bool) or not -1.0 < target <= 1.0:
        raise ValueError(f"target_ssim must be a number in (-1, 1], got {value!r}")
    return target


def profile_for(profile: TuningProfile | str | Path) -> TuningProfile:
    """A profile object from a profile or the path of one."""
    if isinstance(profile, TuningProfile):
        return profile
    if not isinstance(profile, (str, Path)):
        raise TypeError(f"profile must be a TuningProfile or a path, got {type(profile).__name__}")
    return TuningProfile.load(profile)


__all__ = ["MIN_SPEEDUP", "PROFILE_FORMAT", "PROFILE_VERSION", "Setting", "TuningProfile", "check_target_ssim",
           "profile_for"]
