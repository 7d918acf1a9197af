"""Camera streams: what an ideal quality guard could achieve per feature threshold, from multiply-add counts.

Run: ``python benchmarks/stream_ceiling.py [--frames 48] [--clips NAME,...] [--thresholds 0,0.2,...]
[--timed 0.35,0.7] [--rounds 2] [--audit-every 30]``.

For every still-camera clip and every feature threshold of the grid, a session runs with both guards off (a
keyframe every ``--audit-every`` frames and the fallbacks the session takes on its own) beside full inference of
the model on every frame. Per frame it records the multiply-adds the session computed (:attr:`FrameStats.flops_ratio`,
the plan's count: full inference's over the cached frame's), the full output's top-1 margin, the cached output's
own margin (what a guard sees), the signed lead the cached output lost against each of the full output's five
closest rivals (positive: the top-1 class's lead shrank) and whether its top-1 flipped.

The ceiling is what a guard that checks a cached frame (a full frame on top of it) whenever the frame's margin is
within a bound on the lead the cache may have lost would save, by multiply-adds: full frames over the frames' total,
where a cached frame costs its own count plus one full frame when checked, a keyframe one full frame plus the cached
run an audit makes beside it (the clip's median cached count), a fallback one full frame. The bound is the guard's
own (:meth:`QualityGuard._reference <incrinf.stream.guards.QualityGuard>`: the largest loss, or the quantile at the
99% target of an exponential fit to the losses, whichever is larger), fitted either on every other cached frame of
the clip (leave-one-frame-out: a guard that knew every other frame's loss) or on the cached frames before this one
(causal; the first cached frame is always checked), to three kinds of loss:

- pair: the lead over the full output's runner-up, either way; the cached margin is checked against its bound
  (a flip to another class is not what it bounds: the rule is not sound by construction, and its misses show it);
- rival: the largest change, either way, of the lead over any of the full output's five closest rivals (what the
  session's audits measure); a flipped frame's cached margin is at most the rival loss of the class that overtook
  (when that class is among the five), so this rule misses a flip only when the bound is below the frame's loss;
- rank: per rank ``k`` of the cached output's own five closest rivals, the lead the cache added over that rival
  (either way), each rank with its own bound at ``1 - (1 - target) / 5`` (together at most ``1 - target`` of the
  frames left unchecked); a frame is checked when its lead over some rival is within that rank's bound. Sound as
  the rival rule (full inference's top class is then among the rivals), but a far rival's large change no longer
  counts against the close margin;
- pair+ and rank+: the same leads the cache added, signed: full inference's top class can differ from the cached
  one only where the cache added more than the cached lead, so a lead it took away is no risk (the bound:
  :func:`signed_reference`). pair+ bounds the cached runner-up only (not sound by construction, as pair).

The oracle checks exactly the frames that flipped.

Read as a ceiling: counts leave out the session's per-frame overhead (matching, masks, planning), and a checked
frame here does not refresh the cache for the frames after it, as a real check does (the losses measured are those
of a cache never refreshed between keyframes: pessimistic for the frames after a check). The timed part puts wall
time beside the counts on a few thresholds: plain inference (channels-last, batch norms folded: the baseline of
``benchmarks/stream.py``) and the guards-off session, pass by pass in turn (ABAB..., ``--rounds`` of each), medians
and means per frame with the first frame of every pass left out, and the share of frames that could still be checked
(a plain frame each) with the session twice as fast as plain inference by the mean time.

Clips: the still-camera clips of :mod:`incrinf.testing.clips` and ``cafe``, composed here from the same helpers so
the conclusions do not rest on the set's clips alone: a small subject (the cat's head, 56 px high) crossing a cafe
table (scikit-image's coffee photo) at 3.5 px per frame, with sub-pixel jitter, a slow light flicker and sensor noise.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import cv2
import numpy as np
import torch

try:
    from incrinf import models
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from incrinf import models
from incrinf.stream.agreement import top1_margin
from incrinf.stream.config import StreamConfig
from incrinf.stream.guards import QualityGuard
from incrinf.stream.session import StreamSession
from incrinf.stream.stats import Cause
from incrinf.testing import clips as clip_set
from incrinf.testing.clips import Camera, Clip, Subject, load_clip

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import folded, load_average, machine, plain_input  # noqa: E402

STILL_CLIPS = ("walkers", "carphone", "carphone@224", "hall", "yard", "cafe")
THRESHOLDS = (0.0, 0.2, 0.35, 0.5, 0.7, 1.0, 1.5)
TIMED = (0.35, 0.7)
CLOSED = ("rank+ causal",)
RIVALS = 5  # the full output's closest rivals of its top-1 class, as the session's audits measure
MODEL = "efficientnet_lite0"


# --- the ceiling arithmetic (no model) ---------------------------------------------------------------------------

@dataclass(frozen=True)
class FrameRecord:
    """One frame of a guards-off session beside full inference.

    Attributes:
        kind: ``"cached"``, ``"keyframe"`` (a full frame on the keyframe schedule: an audit under the guard) or
            ``"full"`` (a fallback the session took: match failed, too much changed, ...).
        cost: multiply-adds the session computed over a full frame's (1 for full frames, 0 when nothing was).
        margin: the full output's top-1 lead over its runner-up.
        cached_margin: the session output's own top-1 lead over its runner-up (what a guard sees).
        losses: signed lead the session output lost against each of the full output's closest rivals, runner-up
            first (positive: the top-1 class's lead shrank); zeros for full frames.
        flip: the session's top-1 differs from full inference's.
        outside: a flip to a class outside the full output's closest rivals.
        leads: the session output's lead of its own top-1 class over each of its own closest rivals, closest first
            (what a guard sees; the first is ``cached_margin``).
        lead_losses: signed lead the session output's top-1 class has over each of those rivals beyond what full
            inference gives it (positive: the cache inflated it); full inference puts another class first exactly
            when one of these exceeds its lead (or a class outside them overtook).
        cause: why the session ran the frame as it did (:class:`~incrinf.stream.stats.Cause`'s value).
    """

    kind: str
    cost: float
    margin: float
    cached_margin: float
    losses: tuple[float, ...]
    flip: bool = False
    outside: bool = False
    leads: tuple[float, ...] = ()
    lead_losses: tuple[float, ...] = ()
    cause: str = "ok"

    @property
    def pair_loss(self) -> float:
        """The lead lost against the runner-up, either way."""
        return abs(self.losses[0])

    @property
    def rival_loss(self) -> float:
        """The largest change, either way, of the lead over one of the closest rivals."""
        return max(abs(v) for v in self.losses)


def reference(losses: Sequence[float], target: float = 0.99) -> float:
    """The quality guard's bound on the lead a cached frame may have lost, from ``losses`` (the largest, or the
    quantile at ``target`` of an exponential fit: :meth:`QualityGuard._reference`); ``inf`` without losses (nothing
    measured: every frame is checked)."""
    if not losses:
        return math.inf
    return QualityGuard(StreamConfig(target_agreement=target))._reference(list(losses))


def signed_reference(losses: Sequence[float], target: float = 0.99) -> float:
    """A bound on a loss in one direction (the positive one), from signed ``losses``: the positive losses taken as
    exponentially distributed (their mean raised by its standard error, as :func:`reference` does) and as coming on
    ``(positives + 1) / (losses + 1)`` of the frames (one more than seen, so a clip that showed none is not taken as
    safe), the level that only ``1 - target`` of the frames exceed, never below the largest positive loss; the
    unsigned :func:`reference` of the losses' sizes when none is positive (no scale to fit); ``inf`` without losses."""
    if not losses:
        return math.inf
    positive = [v for v in losses if v > 0]
    if not positive:
        return reference([abs(v) for v in losses], target)
    share = (len(positive) + 1) / (len(losses) + 1)
    budget = 1.0 - target
    if share <= budget:
        return max(positive)
    mean = statistics.fmean(positive) * (1.0 + 1.0 / math.sqrt(len(positive)))
    return max(max(positive), mean * math.log(share / budget))


def checked(margins: Sequence[float], losses: Sequence[float], fit: str, target: float = 0.99,
            signed: bool = False) -> list[bool]:
    """Which cached frames a guard checks: frame ``i`` iff ``margins[i] <= bound_i``, the bound fitted on every
    other frame's loss (``fit="loo"``) or on the frames before ``i`` (``fit="causal"``): :func:`reference` of the
    losses' sizes, or with ``signed`` :func:`signed_reference` of the losses as given."""
    if len(margins) != len(losses):
        raise ValueError(f"{len(margins)} margins for {len(losses)} losses")
    if fit not in ("loo", "causal"):
        raise ValueError(f"fit must be 'loo' or 'causal', got {fit!r}")
    out = []
    for i, margin in enumerate(margins):
        fitted = list(losses[:i]) + (list(losses[i + 1:]) if fit == "loo" else [])
        bound = signed_reference(fitted, target) if signed else reference([abs(v) for v in fitted], target)
        out.append(margin <= bound)
    return out


def checked_by_rank(leads: Sequence[Sequence[float]], losses: Sequence[Sequence[float]], fit: str,
                    target: float = 0.99, signed: bool = False) -> list[bool]:
    """Which cached frames a guard that bounds each rival rank on its own checks: frame ``i`` iff its lead over
    its ``k``-th closest rival is within the bound fitted (:func:`checked`) to the other frames' losses at rank ``k``
    (either way; with ``signed`` only the lead the cache added, :func:`signed_reference`) for some ``k``. Each rank's
    bound is taken at ``1 - (1 - target) / ranks`` so the ranks together leave at most ``1 - target`` of the frames
    unchecked (a flip comes from one rank)."""
    ranks = len(leads[0]) if leads else 0
    if not ranks:
        return [False] * len(leads)  # no rival: no lead to lose
    share = 1.0 - (1.0 - target) / ranks
    marks = [checked([lead[k] for lead in leads], [loss[k] for loss in losses], fit, share, signed)
             for k in range(ranks)]
    return [any(mark[i] for mark in marks) for i in range(len(leads))]


def total_cost(records: Sequence[FrameRecord], checks: Sequence[bool]) -> list[float]:
    """Per frame, in full frames of multiply-adds: a cached frame its own count plus a full frame when checked
    (``checks`` runs over the cached frames, in order), a keyframe a full frame plus the cached run its audit makes
    (the median cached count), a fallback a full frame."""
    cached = [r.cost for r in records if r.kind == "cached"]
    if len(checks) != len(cached):
        raise ValueError(f"{len(checks)} checks for {len(cached)} cached frames")
    audit = statistics.median(cached) if cached else 0.0
    marks = iter(checks)
    costs = []
    for r in records:
        if r.kind == "cached":
            costs.append(r.cost + float(next(marks)))
        else:
            costs.append(1.0 + (audit if r.kind == "keyframe" else 0.0))
    return costs


def speedups(costs: Sequence[float]) -> tuple[float, float]:
    """``(mean x, median x)``: full frames over the frames' total cost (the mean time's ratio, by counts), and one
    full frame over the median frame's cost (the median time's)."""
    total, middle = sum(costs), statistics.median(costs)
    return (len(costs) / total if total > 0 else math.inf), (1.0 / middle if middle > 0 else math.inf)


@dataclass(frozen=True)
class Rule:
    """What one checking rule does on a clip: the share of cached frames checked, the flips it leaves unchecked and
    the speedups by counts."""

    checked: float
    missed: int
    mean_x: float
    median_x: float


def apply_rule(records: Sequence[FrameRecord], checks: Sequence[bool]) -> Rule:
    cached = [r for r in records if r.kind == "cached"]
    missed = sum(r.flip and not c for r, c in zip(cached, checks))
    mean_x, median_x = speedups(total_cost(records, checks))
    return Rule(sum(checks) / len(checks) if checks else 0.0, missed, mean_x, median_x)


RULES = ("none", "pair loo", "pair+ loo", "rival loo", "rank loo", "rank+ loo", "pair causal", "rival causal",
         "rank causal", "rank+ causal", "oracle")


def rule_marks(cached: Sequence[FrameRecord], name: str, target: float = 0.99) -> list[bool]:
    """Which of a clip's cached frames rule ``name`` (one of :data:`RULES`) checks."""
    if name == "none":
        return [False] * len(cached)
    if name == "oracle":
        return [r.flip for r in cached]
    loss, fit = name.split()
    margins = [r.cached_margin for r in cached]
    if loss == "pair":
        return checked(margins, [r.pair_loss for r in cached], fit, target)
    if loss == "rival":
        return checked(margins, [r.rival_loss for r in cached], fit, target)
    if loss == "pair+":
        # the lead the cache added over the cached output's runner-up, signed: only an added lead hides a flip
        return checked(margins, [r.lead_losses[0] for r in cached], fit, target, signed=True)
    if loss in ("rank", "rank+"):
        return checked_by_rank([r.leads for r in cached], [r.lead_losses for r in cached], fit, target,
                               signed=loss == "rank+")
    raise ValueError(f"unknown rule {name!r}; the rules: {', '.join(RULES)}")


def rules(records: Sequence[FrameRecord], target: float = 0.99) -> dict[str, Rule]:
    """Every rule of :data:`RULES` on a clip's frames."""
    cached = [r for r in records if r.kind == "cached"]
    return {name: apply_rule(records, rule_marks(cached, name, target)) for name in RULES}


# --- measuring --------------------------------------------------------------------------------------------------

def cafe(n_frames: int) -> Clip:
    """A small subject (the cat's head, 56 px high) crossing a cafe table (the coffee photo), 288x384: sub-pixel
    jitter, a slow light flicker, sensor noise (composed with the clip set's helpers)."""
    h, w = 288, 384
    background = clip_set._fit(clip_set._photo("coffee"), (h, w)).astype(np.float32)
    head, matte = clip_set._cutout(clip_set._photo("chelsea"), (10, 290, 60, 400), 56)
    rng = np.random.default_rng(18)
    frames = []
    speed = 3.5
    for k in range(n_frames):
        canvas = background.copy()
        layer, alpha = clip_set._blur(head, matte, speed)
        clip_set._paste(canvas, layer, alpha, 200 + 1.5 * math.sin(k / 5), 20 + speed * k)
        shake = rng.normal(0.0, 0.25, 2)
        frames.append(clip_set._camera(canvas, (shake[0], shake[1]), 1.0 + 0.01 * math.sin(k / 4), rng, 1.5))
    return Clip("cafe", frames, Camera.STILL, Subject.SMALL, None,
                "composed, 288x384: a small subject (the cat's head) crosses a cafe table (coffee photo); jitter, "
                "light flicker, noise")


def clip_named(name: str, n_frames: int) -> Clip:
    return cafe(n_frames) if name == "cafe" else load_clip(name, n_frames)


def full_outputs(model: torch.nn.Module, clip: Clip, mean: Sequence[float], std: Sequence[float]) -> list[torch.Tensor]:
    """Full inference's (classes,) logits of every frame."""
    plain = plain_input(mean, std, False)
    with torch.no_grad():
        return [model(plain(frame))[0].float() for frame in clip.frames]


def record(session_out: torch.Tensor, full: torch.Tensor, kind: str, cost: float) -> FrameRecord:
    """One frame's record from the session's (1, classes) and full inference's (classes,) logits."""
    c = session_out.reshape(-1).float()
    top = int(full.argmax())
    rivals = full.topk(RIVALS + 1).indices[1:]
    lost = (full[top] - full[rivals]) - (c[top] - c[rivals])
    winner = int(c.argmax())
    flip = winner != top
    own = c.topk(RIVALS + 1).indices[1:]
    leads = c[winner] - c[own]
    inflated = leads - (full[winner] - full[own])
    return FrameRecord(kind, cost, float(full[top] - full[rivals[0]]), top1_margin(session_out),
                       tuple(float(v) for v in lost), flip, flip and winner not in set(rivals.tolist()),
                       tuple(float(v) for v in leads), tuple(float(v) for v in inflated))


def trace(model: torch.nn.Module, clip: Clip, full: list[torch.Tensor], threshold: float, audit_every: int,
          mean: Sequence[float], std: Sequence[float]) -> list[FrameRecord]:
    """A guards-off session's records over the clip, the first frame left out (it runs full by necessity)."""
    session = StreamSession(model, mean=mean, std=std, keep_stats=None, feature_threshold=threshold,
                            speed_guard=False, quality_guard=False, keyframe_interval=audit_every)
    with torch.no_grad():
        return [_frame_record(session, out, full[i]) for i, out in enumerate(map(session, clip.frames)) if i]


def _frame_record(session: StreamSession, out: torch.Tensor, full: torch.Tensor) -> FrameRecord:
    """The session's latest frame as a record (its kind and multiply-adds from its stats)."""
    s = session.stats[-1]
    if s.mode == "cached":
        kind, cost = "cached", (1.0 / s.flops_ratio if math.isfinite(s.flops_ratio) else 0.0)
    else:
        kind, cost = ("keyframe" if s.cause == Cause.KEYFRAME else "full"), 1.0
    return replace(record(out, full, kind, cost), cause=s.cause.value)


def closed_loop(model: torch.nn.Module, clip: Clip, full: list[torch.Tensor], threshold: float, audit_every: int,
                rule: str, target: float, mean: Sequence[float], std: Sequence[float]) -> tuple[list[FrameRecord],
                                                                                             list[bool]]:
    """A guards-off session whose cached frames a guard applying causal ``rule`` checks as the clip goes: a checked
    frame runs again in full and becomes the cache (as an audit's keyframe does), so the frames after it start from a
    fresh cache. The guard knows the loss of every cached frame before (an ideal one: a real guard measures them at
    its audits only). Returns the records (the first frame left out) and the checks of the cached frames, in order.
    """
    if not rule.endswith(" causal"):
        raise ValueError(f"a closed loop decides frame by frame: a causal rule, got {rule!r}")
    session = StreamSession(model, mean=mean, std=std, keep_stats=None, feature_threshold=threshold,
                            speed_guard=False, quality_guard=False, keyframe_interval=audit_every)
    records: list[FrameRecord] = []
    cached: list[FrameRecord] = []
    checks: list[bool] = []
    with torch.no_grad():
        for i, frame in enumerate(clip.frames):
            out = session(frame)
            if i == 0:
                continue
            records.append(_frame_record(session, out, full[i]))
            if records[-1].kind != "cached":
                continue
            cached.append(records[-1])
            checks.append(rule_marks(cached, rule, target)[-1])
            if checks[-1]:
                session.reset()  # the check: this frame in full, kept as the cache
                session(frame)
    return records, checks


def timed_passes(model: torch.nn.Module, clip: Clip, threshold: float, audit_every: int, rounds: int,
                 mean: Sequence[float], std: Sequence[float]) -> tuple[list[float], list[float]]:
    """Seconds per frame of plain inference (channels-last, batch norms folded) and of the guards-off session,
    whole passes in turn (ABAB...), the first frame of every pass left out."""
    baseline = folded(model).to(memory_format=torch.channels_last)
    plain = plain_input(mean, std, True)
    times: dict[str, list[float]] = {"plain": [], "session": []}
    with torch.no_grad():
        for _ in range(rounds):
            for name in ("plain", "session"):
                run = (lambda frame: baseline(plain(frame))) if name == "plain" else StreamSession(
                    model, mean=mean, std=std, keep_stats=None, feature_threshold=threshold, speed_guard=False,
                    quality_guard=False, keyframe_interval=audit_every)
                for i, frame in enumerate(clip.frames):
                    start = time.perf_counter()
                    run(frame)
                    if i:
                        times[name].append(time.perf_counter() - start)
    return times["plain"], times["session"]


# --- printing ---------------------------------------------------------------------------------------------------

def _x(v: float) -> str:
    return "inf" if math.isinf(v) else (f"{v:.0f}" if v >= 100 else f"{v:.2f}" if v < 10 else f"{v:.1f}")


def _rule_cell(rule: Rule) -> str:
    return f"{rule.checked:4.0%} {_x(rule.mean_x):>4}/{_x(rule.median_x):<4} {rule.missed}"


def print_clip_table(rows: list[tuple[float, list[FrameRecord], dict[str, Rule]]]) -> None:
    print(f"  {'thr':>4} {'cached':>6} {'MACs x':>6} {'|pair| med/max':>14} {'|rival| med/max':>15} "
          f"{'min marg':>9} {'med':>4} {'flips':>5}")
    print(f"  {'':>4} {'':>6} {'cached':>6} {'':>14} {'':>15} {'full/cach':>9} {'cach':>4}")
    for threshold, records, _ in rows:
        cached = [r for r in records if r.kind == "cached"]
        if not cached:
            print(f"  {threshold:4g} {0:6d}  (no cached frame)")
            continue
        costs = sum(r.cost for r in cached)
        macs = len(cached) / costs if costs > 0 else math.inf
        pair, rival = [r.pair_loss for r in cached], [r.rival_loss for r in cached]
        flips = sum(r.flip for r in cached)
        outside = sum(r.outside for r in cached)
        margin = f"{min(r.margin for r in cached):.2f}/{min(r.cached_margin for r in cached):.2f}"
        middle = statistics.median(r.cached_margin for r in cached)
        print(f"  {threshold:4g} {len(cached):6d} {_x(macs):>6} {statistics.median(pair):6.3f}/{max(pair):<7.3f} "
              f"{statistics.median(rival):6.3f}/{max(rival):<8.3f} {margin:>9} {middle:4.2f} "
              f"{flips:5d}{'*' * bool(outside)}")
    causes = collections.Counter(r.cause for _, records, _ in rows for r in records if r.kind != "cached")
    if causes:
        print("  full frames over the thresholds: " + ", ".join(f"{c} {n}" for c, n in causes.most_common()))
    print(f"  {'thr':>4} | " + " | ".join(f"{n:^16}" for n in RULES))
    for threshold, _, found in rows:
        print(f"  {threshold:4g} | " + " | ".join(f"{_rule_cell(found[n]):^16}" for n in RULES))


def _room(session: float, plain: float) -> float:
    """The share ``p`` of frames that may also run a plain frame while the session stays twice as fast as plain
    inference by the mean: ``session + p * plain <= plain / 2``."""
    return max(0.5 - session / plain, 0.0)


def _best(rule: str, rows: list[tuple[float, list[FrameRecord], dict[str, Rule]]], label: str = "") -> str:
    """The rule's best threshold on a clip (see main's summary), in words."""
    honest = [(t, found[rule]) for t, records, found in rows if found[rule].missed <= 0.01 * max(len(records), 1)]
    if not honest:
        return f"{label}{rule} none"
    t, r = max(honest, key=lambda v: (min(v[1].mean_x, v[1].median_x), -v[0]))
    return f"{label}{rule} {_x(r.mean_x)}/{_x(r.median_x)} at {t:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=48, help="frames per clip (default 48)")
    parser.add_argument("--clips", type=lambda s: s.split(","), default=list(STILL_CLIPS),
                        help=f"comma-separated clips (default: {','.join(STILL_CLIPS)})")
    parser.add_argument("--thresholds", type=lambda s: [float(v) for v in s.split(",")], default=list(THRESHOLDS),
                        help="feature thresholds (default: " + ",".join(f"{t:g}" for t in THRESHOLDS) + ")")
    parser.add_argument("--timed", type=lambda s: [float(v) for v in s.split(",") if v], default=list(TIMED),
                        help="thresholds also timed against plain inference ('' for none; default: "
                             + ",".join(f"{t:g}" for t in TIMED) + ")")
    parser.add_argument("--rounds", type=int, default=2, help="timed passes of each side per threshold (default 2)")
    parser.add_argument("--audit-every", type=int, default=StreamConfig().keyframe_interval,
                        help="keyframe (a full audit under the guard) every this many frames (default: the "
                             "session's keyframe_interval)")
    parser.add_argument("--target", type=float, default=0.99, help="the guard's top-1 target (default 0.99)")
    parser.add_argument("--closed", type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
                        default=list(CLOSED), help="causal rules also run in a closed loop, checked frames refreshing "
                                                   "the cache ('' for none; default: " + ",".join(CLOSED) + ")")
    parser.add_argument("--threads", type=int, default=1, help="torch and OpenCV threads (default 1)")
    args = parser.parse_args(argv)
    wrong = [r for r in args.closed if r not in RULES or not r.endswith(" causal")]
    if wrong:
        parser.error(f"--closed takes causal rules of {', '.join(RULES)}; got {', '.join(wrong)}")
    known = set(clip_set.CLIP_NAMES) | {"cafe"}
    unknown = [c for c in args.clips if c not in known]
    if unknown:
        parser.error(f"unknown clip(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    torch.set_num_threads(args.threads)
    cv2.setNumThreads(args.threads)
    print(machine())
    print(f"load average at start: {load_average()}")
    print(f"{MODEL}, {args.frames} frames per clip, guards off, a keyframe every {args.audit_every} frames, bound: "
          f"the guard's reference at target {args.target:g}")
    print("columns: cached = cached frames (of frames - 1); MACs x cached = full multiply-adds over the cached frames' "
          "mean count; |pair| = lead lost vs the runner-up, |rival| = largest over the 5 closest rivals (either way); "
          "min marg = smallest top-1 margin of full / cached outputs, med = median cached margin; flips (* some to a "
          "class outside the rivals); "
          "per rule: checked share of cached frames, speedup by counts (mean / median frame), flips left unchecked; "
          "+: signed (only a lead the cache added counts)")
    model = models.load(MODEL).eval()
    meta = models.info(MODEL)
    summary = []
    for name in args.clips:
        clip = clip_named(name, args.frames)
        print(f"\n{clip.name} {clip.size[0]}x{clip.size[1]}: {clip.description}; load {load_average()}")
        start = time.perf_counter()
        full = full_outputs(model, clip, meta.mean, meta.std)
        rows = []
        for threshold in args.thresholds:
            records = trace(model, clip, full, threshold, args.audit_every, meta.mean, meta.std)
            rows.append((threshold, records, rules(records, args.target)))
        print_clip_table(rows)
        closed = {}
        for rule in args.closed:
            closed[rule] = []
            cells = []
            for threshold in args.thresholds:
                records, checks = closed_loop(model, clip, full, threshold, args.audit_every, rule, args.target,
                                              meta.mean, meta.std)
                found = apply_rule(records, checks)
                closed[rule].append((threshold, records, {rule: found}))
                cells.append(f"{threshold:g}: {_rule_cell(found)} ({sum(r.flip for r in records)} flips)")
            print(f"  closed loop, {rule} (a check refreshes the cache): " + " | ".join(cells))
        print(f"  ({time.perf_counter() - start:.0f} s)")
        for threshold in args.timed:
            plain, session = timed_passes(model, clip, threshold, args.audit_every, args.rounds, meta.mean, meta.std)
            records = next((r for t, r, _ in rows if t == threshold), None) or trace(
                model, clip, full, threshold, args.audit_every, meta.mean, meta.std)
            count = apply_rule(records, [False] * sum(r.kind == "cached" for r in records))
            print(f"  timed thr {threshold:g} ({args.rounds} alternated passes each, load {load_average()}): plain "
                  f"{statistics.median(plain) * 1e3:.1f} / {statistics.mean(plain) * 1e3:.1f} ms, session "
                  f"{statistics.median(session) * 1e3:.1f} / {statistics.mean(session) * 1e3:.1f} ms (median / "
                  f"mean): time x {statistics.median(plain) / statistics.median(session):.2f} / "
                  f"{statistics.mean(plain) / statistics.mean(session):.2f}, counts x {_x(count.median_x)} / "
                  f"{_x(count.mean_x)} (guards off, no checks); 2x by the mean time leaves room for checks (a plain "
                  f"frame each) on {_room(statistics.mean(session), statistics.mean(plain)):.0%} of the frames")
        summary.append((clip, rows, closed))
    print(f"\nload at the end: {load_average()}")
    print("\nbest ceiling per clip and rule over the thresholds (the highest of min(mean x, median x)) among those "
          "that left at most 1% of the frames' flips unchecked, by counts, mean / median x:")
    for clip, rows, closed in summary:
        cells = [_best(rule, rows) for rule in RULES[1:]]
        cells += [_best(rule, closed[rule], "closed ") for rule in closed]
        print(f"  {clip.name}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
