"""A moving camera's drift: the quality guard does not trust a linear guess beyond the distances its audits measured
(incrinf.stream.guards.QualityGuard.needs_sample), and a near tie's flip does not make every later sample call a
full audit (incrinf.stream.audits.SampledAudit.record)."""

import math

import cv2
import numpy as np
import pytest
import skimage.data
import torch
from stream_scenes import H, W, frozen_costs, still_camera, wide_classifier

from incrinf.stream.agreement import Comparison, OutputKind
from incrinf.stream.audits import SampledAudit
from incrinf.stream.config import StreamConfig
from incrinf.stream.guards import CAUTIOUS_GROWTH, QualityGuard
from incrinf.stream.session import StreamSession

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _guard(*audits: tuple[float, int]) -> QualityGuard:
    guard = QualityGuard(StreamConfig(target_agreement=0.99, near_tie=0.02, trust_after=1))
    for lost, frames in audits:
        guard.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, lost), frames)
    return guard


def test_a_quadratically_growing_drift_is_looked_at_before_it_flips_a_margin():
    """A moving camera whose cache loses ``0.05 * d ** 2`` of the top-1 lead ``d`` frames after a full one; one audit
    measured 0.05 at ``d = 1``. For every distance and margin at which the cached top-1 would flip (the true loss
    reaches the margin), the guard either checks the frame (risky) or asks for its drift to be measured first
    (needs_sample); the linear guess alone lets flips through at ``d >= 2``."""
    guard = _guard((0.05, 1))
    linear_misses = 0
    for d in range(1, 7):
        true_loss = 0.05 * d ** 2
        for margin in np.linspace(0.01, 2.0, 60):
            flips = margin <= true_loss
            looked = guard.risky(margin, d) or guard.needs_sample(margin, d)
            if flips:
                assert looked, (d, margin)
                linear_misses += not guard.risky(margin, d)
    assert linear_misses > 0  # the linear guess alone would have trusted frames that flip
    # at the audit's own distance there is nothing to guess: both bounds agree
    assert guard.needs_sample(0.049, 1) and guard.risky(0.049, 1) and not guard.needs_sample(0.051, 1)
    # an audit at distance 3 does not make a linear guess from one at distance 1 safe (the case of an animated
    # clip: losses 0.04 at 1 and 0.067 at 3; a frame at 3 with margin 0.129 lost 0.136 and flipped)
    two = _guard((0.04, 1), (0.067, 3))
    assert not two.risky(0.129, 3) and two.needs_sample(0.129, 3)
    assert guard.needs_sample(0.05 * 3 ** CAUTIOUS_GROWTH, 3) and not guard.needs_sample(0.5, 3)


def test_a_fit_from_a_few_audits_does_not_replace_the_cautious_guess():
    """The case of an animated clip: three audits lost 0.04, 0.057 and 0.067 one, two and three frames after a full
    one (a fit like the square root); three frames after the next full one a frame with margin 0.129 lost 0.136
    and flipped. The fitted bound lets it through, the cautious one asks for its sample."""
    fitted = _guard((0.04, 1), (0.067, 3), (0.057, 2))
    assert fitted.drift_growth() < 1.0
    assert not fitted.risky(0.129, 3) and fitted.needs_sample(0.129, 3)
    assert not _guard().needs_sample(0.1, 5)  # before any label audit: risky() checks every frame anyway
    assert not QualityGuard(StreamConfig(near_tie=0)).needs_sample(0.0, 9)  # near_tie 0: no checks at all
    assert not fitted.needs_sample(math.nan, 6)  # a map's output has no margin


def _panning(n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``n`` crops ``(H, W, 3)`` of a photo, the camera moving 3 px right per frame, and the homographies previous ->
    current in the crop's pixel coordinates."""
    photo = cv2.resize(skimage.data.astronaut(), (W + 3 * n + 8, H + 8), interpolation=cv2.INTER_AREA)
    frames = [np.ascontiguousarray(photo[4:4 + H, 3 * k:3 * k + W]) for k in range(n)]
    step = np.array([[1.0, 0.0, -3.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    return frames, [step] * n


@pytest.mark.parametrize("moving", [True, False])
def test_a_frame_the_cautious_bound_doubts_gets_its_own_sample(moving, monkeypatch):
    """When the guard doubts a frame (needs_sample), the session measures it with a sample before trusting it (or
    checks it in full), on a moving camera and on a still one alike; a frame it does not doubt is sampled only
    when a sample is due."""
    model = wide_classifier()
    frames, steps = _panning(12) if moving else (still_camera(12), [np.eye(3)] * 12)
    sampled = []
    for doubt in (True, False):
        session = StreamSession(model, audit_interval=4, keyframe_interval=64, sample_budget=0.8, max_backoff=0,
                                near_tie=0.02, pixel_threshold=8.0)
        session(frames[0])
        frozen_costs(session, monkeypatch)
        quality = session._quality
        doubted = []

        def needs_sample(margin: float, frames_since_full: int, doubted=doubted, doubt=doubt) -> bool:
            doubted.append(margin)
            return doubt

        monkeypatch.setattr(quality, "risky", lambda *args: False)  # only the cautious bound sends frames to checks
        monkeypatch.setattr(quality, "needs_sample", needs_sample)
        quality.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, 0.01), 1)  # a label audit measured a loss
        sampler = next(iter(session._samplers.values()))
        sampler._held.append(1.0)  # a held reference: samples stand in (a tolerant one: they do not flag)
        for frame, step in zip(frames[1:], steps[1:]):
            session(frame, homography=step)
        cached = [s for s in session.stats[1:] if s.mode == "cached"]
        assert cached and doubted, "no frame ran cached"
        sampled.append(sum(not math.isnan(s.sampled_error) for s in cached) / len(cached))
    assert sampled[0] == 1.0 > sampled[1]  # doubted: every cached frame measured its drift


def test_a_near_tie_that_flips_keeps_no_sample_reference():
    """A miss whose flip says nothing of the drift (``missed=None``) keeps no reference: later samples at the same
    drift do not call a full audit; a miss that does (``missed=True``) makes them flag."""
    config = StreamConfig()

    def sampler_after(missed: bool | None) -> SampledAudit:
        sampler = SampledAudit(config, seed=0)
        sampler.probe, sampler.n_tiles = _Probe(), 4
        cached, full = torch.ones(1, 2, 8, 8), torch.ones(1, 2, 8, 8)
        sampler.record(cached, full * 1.04, None, False)  # a held audit: its sample saw 4% error
        sampler.record(cached, full * 1.05, None, missed)  # a near tie or a drift that missed at 5%
        return sampler

    assert sampler_after(True).flags(0.05)
    ordinary = sampler_after(None)
    assert not ordinary.flags(0.05) and not ordinary._missed and ordinary._held
    assert ordinary.flags(0.2)  # a sample far beyond what held still flags


class _Probe:
    dims = (8, 8)
    tile = 4
