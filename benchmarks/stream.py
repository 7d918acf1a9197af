"""Camera streams: plain per-frame inference vs :class:`incrinf.stream.StreamSession`, clip by clip.

Run: ``python benchmarks/stream.py [--frames 48] [--threads 1] [--rounds 2] [--clips NAME,...]`` (classifier table),
``--dense`` (dense models), ``--no-reuse`` (models in which every change reaches the whole output), ``--loo``
(leave-one-out choice of the defaults).

Clips: the set of :mod:`incrinf.testing.clips` (shipped videos at their own size and 224 px high, a synthetic
pan+zoom, three composed still-camera scenes). Every configuration runs its own stream over the whole clip alone,
as a camera would, the configurations taking turns pass by pass (the order rotated per round, ``--rounds`` passes;
``--lockstep``: frame by frame in turn instead, which puts other models' full frames between a session's frames and
evicts its stored maps from the processor caches): plain inference of the model as given, the same with the model
in channels-last layout ("full CL", the layout the session uses), the same with every batch norm folded into the
convolution before it ("full CL fold", torch.fx's ``fuse``: module convolutions only), the session, and the same
session running every frame in full ("session all full", ``keyframe_interval=1``: the engine's plain frame, whose
graph folds batch norms and symmetric paddings into the convolutions; its ratio is the graph's part of a speedup,
the session's over it the cache's). Reported per
configuration: median and mean ms per frame (the first frame of every pass excluded: it captures the model and
profiles its steps), speedups over the faster of full CL and full CL fold (statistic by statistic: the
baseline) beside the multiply-add ratio the session's plans give (the noise-free side of the same ratio),
agreement with full inference (top-1 for a classifier; for dense outputs the mean and the worst frame's share of
positions whose argmax agrees), the share of full audits and of sampled audits, the audit cost per frame and the
per-frame overhead (matching, mask, plan, commit, decision) as a share of a baseline frame.

Regret: one more pass with ``oracle_sample``: on every third frame that had a plan the session runs both the cached
path and full inference and times both; the regret is the time its choice lost against the faster of the two,
averaged over those frames, and "wrong" counts the frames the guard sent the slower way.

``--loo``: every candidate setting of the grid below runs on every clip; for each clip the candidate that does
best on the *other* clips (every other clip at >= 99% agreement and >= 0.95x mean and median speed of the baseline,
then the highest geometric-mean speedup) is reported on the held-out clip. The defaults are the candidate chosen
on all clips. ``--candidates defaults,NAME,...`` compares only those candidates of the grid.

``--loo --near-tie``: the leave-one-out choice of ``near_tie`` alone (candidates ``NEAR_TIE_GRID``, in lockstep on
every clip): per clip, the candidates at which it kept 100% top-1; for each held-out clip, the smallest candidate
that keeps every other clip at 100% top-1 (a smaller ``near_tie`` checks fewer frames, so it is also the
cheapest), and its figures on the held-out clip, with its audits' cost per frame. A larger candidate checks more
frames, which changes the session's path through the clip (the full frames refill the cache), so a clip may keep
100% at one candidate and not at a larger one.

``--dense``: MTCNN's PNet with its real weights at the clips' own resolution (the weights taken once from the
facenet-pytorch wheel with ``pip download --no-deps``, skipped with a message when that fails) and torchvision's
``fcn_resnet50`` (random init, as the library builds it: no weights can be fetched) on still and moving clips.

``--no-reuse --loo``: the leave-one-out choice of ``min_saving`` over models with and without a tail that
every change reaches.

``--no-reuse``: torchvision's ``efficientnet_b0`` (squeeze-excitation in every block) and
``lraspp_mobilenet_v3_large`` (a global-pooling branch in its head), random init: the plan shows before the first
cached frame that no change can pay for the cache. These run in lockstep: the sessions run every frame in full
from the frame alone, so no stored map is evicted by the other configurations' frames (the reason whole passes are
the default), and pairing frame by frame keeps a third-of-a-second pass's load from deciding a ratio of two equal
computations (whole passes swung these rows by about 10%).
"""

from __future__ import annotations

import argparse
import collections
import copy
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import torch

try:
    from incrinf import models
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from incrinf import models
from incrinf.stream.agreement import OutputKind, compare, output_kind, primary_tensor
from incrinf.stream.config import StreamConfig
from incrinf.stream.session import StreamSession
from incrinf.stream.stats import Cause, FrameStats
from incrinf.testing.clips import CLIP_NAMES, Camera, Clip, Subject, load_clip

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import folded, load_average, machine, plain_input  # noqa: E402


def _still_threshold(value: float) -> StreamConfig:
    """The defaults with another feature threshold on still-camera frames only (``feature_threshold`` sets both;
    the default keeps exact propagation under camera motion, where the warped cache is approximate already)."""
    return type(f"StillThreshold{value:g}", (StreamConfig,), {"STILL_FEATURE_THRESHOLD": value})()


# Candidates for the defaults (--loo): the defaults of StreamConfig and one step either way on each knob that a
# clip could favour, one knob at a time.
GRID = {
    "defaults": {},
    "pixel thr. 6": {"pixel_threshold": 6.0},
    "pixel thr. 15": {"pixel_threshold": 15.0},
    "feature thr. 0.2": {"feature_threshold": 0.2},
    "feature thr. 0.5": {"feature_threshold": 0.5},
    "feature thr. 0.7": {"feature_threshold": 0.7},
    "feature thr. 1.0": {"feature_threshold": 1.0},
    "previous defaults": {"config": _still_threshold(0.35), "near_tie": 0.02, "trust_after": 1},
    "still thr. 0.35": {"config": _still_threshold(0.35)},
    "still thr. 0.5": {"config": _still_threshold(0.5)},
    "still thr. 0.7": {"config": _still_threshold(0.7)},
    "still thr. 1.0": {"config": _still_threshold(1.0)},
    "still 0.5 near_tie 0.1": {"config": _still_threshold(0.5), "near_tie": 0.1},
    "still 0.7 near_tie 0.1": {"config": _still_threshold(0.7), "near_tie": 0.1},
    "still 0.7 near_tie 0.2": {"config": _still_threshold(0.7), "near_tie": 0.2},
    "still 0.7 trust after 2": {"config": _still_threshold(0.7), "trust_after": 2},
    "still 0.7 near_tie 0.2 trust after 2": {"config": _still_threshold(0.7), "near_tie": 0.2, "trust_after": 2},
    "still_fraction 0.25": {"still_fraction": 0.25},
    "still_response 0.8": {"still_response": 0.8},
    "sample tol. 3": {"sample_tolerance": 3.0},
    "full audits only": {"sampled_audits": False},
    "audits 2..16": {"audit_interval": 2, "keyframe_interval": 16},
    "audits 8..64": {"audit_interval": 8, "keyframe_interval": 64},
    "backoff after 1": {"backoff_after": 1},
    "backoff after 2": {"backoff_after": 2},
    "trust after 2": {"trust_after": 2},
    "trust after 3": {"trust_after": 3},
}
# Candidates for near_tie (--loo --near-tie): the near-tie check's reference is the quantile of the audits' lead
# changes that 1 - target_agreement of the frames exceed; these scale it.
NEAR_TIE_GRID = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3)
PNET_WHEEL = "facenet-pytorch==2.6.0"
ORACLE_SHARE = 1 / 3
BASELINES = ("full CL", "full CL fold")  # plain inference in channels-last layout, batch norms as given and folded
# the session, and the same session running every frame in full (keyframe_interval=1): the engine's own plain frame,
# whose graph folds batch norms and paddings into the convolutions, so the table can tell the cache's part of a
# speedup (session / all full) from the graph's (all full / baseline)
ALL_FULL = "session all full"
SESSIONS = {"session": {}, ALL_FULL: {"keyframe_interval": 1}}
_PARTS = ("match", "mask", "plan", "commit", "decide")


@dataclass
class Run:
    """One configuration's passes over a clip."""

    seconds: list[float] = field(default_factory=list)  # first frame of every pass excluded
    outputs: list = field(default_factory=list)  # of every pass
    stats: list[FrameStats] = field(default_factory=list)  # of every pass, first frames excluded
    full_flops: float = 0.0


@dataclass(frozen=True)
class Row:
    """A configuration's figures on a clip."""

    median_ms: float
    mean_ms: float
    median_x: float  # over the baseline (the faster of full CL and full CL fold)
    mean_x: float
    agreement: float  # top-1 share, or mean position share for maps
    worst: float  # the worst frame's agreement (maps), else = agreement
    audits: float  # share of full audit frames
    sampled: float  # share of sampled audit frames
    macs: float  # multiply-add ratio: full frames' over the session's, per frame on average
    audit_ms: float  # audit time per frame
    parts_ms: dict[str, float]  # overhead per frame by part
    how: str


def _subject(clip: Clip) -> str:
    """The clip's subject in words ("small subject", "no subject")."""
    return "no subject" if clip.subject == Subject.NONE else f"{clip.subject.value} subject"

def run_clip(model: torch.nn.Module, clip: Clip, configs: dict[str, dict], rounds: int,
             mean: tuple[float, ...], std: tuple[float, ...], lockstep: bool = False) -> dict[str, Run]:
    """Plain inference (as given, channels-last) and each session configuration, each running its own stream over
    the clip, ``rounds`` passes.

    By default every configuration runs a whole pass alone, as a camera would run it, the configurations taking
    turns pass by pass (the order rotated per round), so a slow load change on a shared machine falls on all alike.
    With ``lockstep`` they advance frame by frame in turn (the order rotated per frame): robust to fast load
    changes, but every session frame then follows two full frames of other models, which evict its stored maps from
    the processor caches (a one-box hall frame: 8.4 ms back to back, 12-22 ms after a full frame), a cost a camera
    running the session alone does not pay."""
    model_cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
    model_fold = folded(model).to(memory_format=torch.channels_last)
    plain, plain_cl = plain_input(mean, std, False), plain_input(mean, std, True)
    # pass r's sessions draw their sampled audits' tiles from seed r: which tiles a sample draws decides which
    # frames are checked in full, so the passes quote several draws, not one
    factories: dict[str, Callable[[int], Callable]] = {
        "full": lambda r: lambda frame: model(plain(frame)),
        "full CL": lambda r: lambda frame: model_cl(plain_cl(frame)),
        "full CL fold": lambda r: lambda frame: model_fold(plain_cl(frame)),
        **{name: (lambda r, o=options: StreamSession(model, mean=mean, std=std, keep_stats=None,
                                                     **{"sample_seed": r, **o}))
           for name, options in configs.items()},
    }
    runs = {name: Run() for name in factories}
    names = list(factories)

    def rotated(k: int) -> list[str]:
        return names[k % len(names):] + names[:k % len(names)]

    with torch.no_grad():
        for r in range(rounds):
            streams = {name: factories[name](r) for name in names}
            outs: dict[str, list] = {name: [] for name in names}
            # lockstep: frame i's configurations in the order rotated by r + i; alone: a whole pass per configuration
            turns = ([name for i in range(len(clip.frames)) for name in rotated(r + i)] if lockstep else
                     [name for name in rotated(r) for _ in clip.frames])
            index = dict.fromkeys(names, 0)
            for name in turns:
                i = index[name]
                index[name] += 1
                start = time.perf_counter()
                outs[name].append(streams[name](clip.frames[i]))
                if i:
                    runs[name].seconds.append(time.perf_counter() - start)
            for name, run in streams.items():
                runs[name].outputs.extend(outs[name])
                if isinstance(run, StreamSession):
                    runs[name].stats.extend(run.stats[1:])
    return runs


def summarise(runs: dict[str, Run]) -> dict[str, Row]:
    ref = runs["full"].outputs
    # the baseline is the faster plain alternative, statistic by statistic
    cl_median = min(statistics.median(runs[name].seconds) for name in BASELINES)
    cl_mean = min(statistics.mean(runs[name].seconds) for name in BASELINES)
    rows = {}
    for name, run in runs.items():
        median, mean = statistics.median(run.seconds), statistics.mean(run.seconds)
        scores = [compare(o, r, 0.99).agreement for o, r in zip(run.outputs, ref)]
        how, audits, sampled, macs, audit_ms, parts = "all full", 0.0, 0.0, 1.0, 0.0, {}
        stats = run.stats
        if stats:
            causes = collections.Counter(s.cause.name.lower().replace("_", " ") for s in stats)
            how = ", ".join(f"{n} {c}" for c, n in causes.most_common())
            audits = sum(s.audit for s in stats) / len(stats)
            sampled = sum(not math.isnan(s.sampled_error) for s in stats) / len(stats)
            # per frame: full inference's multiply-adds over the session's (audits count a full frame)
            macs = len(stats) / sum(1.0 / s.flops_ratio if math.isfinite(s.flops_ratio) else 0.0 for s in stats)
            audit_ms = statistics.mean(s.times.audit for s in stats) * 1e3
            parts = {p: statistics.mean(getattr(s.times, p) for s in stats) * 1e3 for p in _PARTS}
        rows[name] = Row(median * 1e3, mean * 1e3, cl_median / median, cl_mean / mean, statistics.mean(scores),
                         min(scores), audits, sampled, macs, audit_ms, parts, how)
    return rows


def baseline_ms(rows: dict[str, Row]) -> float:
    """The faster plain alternative's median ms per frame."""
    return min(rows[name].median_ms for name in BASELINES)


def regret(model: torch.nn.Module, clip: Clip, options: dict, mean: tuple, std: tuple) -> tuple[float, int, int, float]:
    """``(mean regret in ms, frames sent the slower way, frames measured, mean full frame ms)`` of the speed guard,
    from a pass where every third planned frame runs both ways."""
    session = StreamSession(model, mean=mean, std=std, keep_stats=None, oracle_sample=ORACLE_SHARE, **options)
    with torch.no_grad():
        for frame in clip.frames:
            session(frame)
    lost, wrong, full = [], 0, []
    for s in session.stats[1:]:
        if math.isnan(s.oracle_cached):
            continue
        chose_cached = s.cause == Cause.CACHED
        chosen = s.oracle_cached if chose_cached else s.oracle_full
        best = min(s.oracle_cached, s.oracle_full)
        lost.append(chosen - best)
        wrong += chosen > best
        full.append(s.oracle_full)
    if not lost:
        return math.nan, 0, 0, math.nan
    return statistics.mean(lost) * 1e3, wrong, len(lost), statistics.mean(full) * 1e3


def print_rows(rows: dict[str, Row], kind: OutputKind) -> None:
    what = "top-1" if kind == OutputKind.LABEL else "pixels (mean / worst)"
    print(f"  {'':16} {'median ms':>9} {'mean ms':>8} {'median x':>8} {'mean x':>7} {'MACs x':>7} {what:>21} "
          f"{'audits':>6} {'sampled':>7}  frames")
    for name, row in rows.items():
        agree = f"{row.agreement:.1%}" if kind == OutputKind.LABEL else f"{row.agreement:.2%} / {row.worst:.2%}"
        print(f"  {name:16} {row.median_ms:9.1f} {row.mean_ms:8.1f} {row.median_x:8.2f} {row.mean_x:7.2f} "
              f"{row.macs:7.1f} {agree:>21} {row.audits:6.0%} {row.sampled:7.0%}  {row.how}")


def print_costs(rows: dict[str, Row], lost: tuple[float, int, int, float]) -> None:
    """The session's audit cost and overhead per frame (shares of a baseline frame) and the guard's regret."""
    full = baseline_ms(rows)
    for name, row in rows.items():
        if not row.parts_ms:
            continue
        overhead = sum(row.parts_ms.values())
        parts = ", ".join(f"{p} {v:.2f}" for p, v in row.parts_ms.items())
        print(f"  {name}: audits {row.audit_ms:.1f} ms/frame ({row.audit_ms / full:.1%} of a full frame); overhead "
              f"{overhead:.1f} ms/frame ({overhead / full:.1%}): {parts}")
    mean_lost, wrong, n, full_ms = lost
    if n:
        print(f"  speed guard vs an oracle timing both paths on {n} frames: regret {mean_lost:.1f} ms/frame "
              f"({mean_lost / full_ms:.1%} of a full frame), {wrong} sent the slower way")
    else:
        print("  speed guard vs an oracle: no frame had a plan (all ran full)")


def pass_breakdown(runs: dict[str, Run], name: str = "session") -> list[str]:
    """Per pass of ``name``: its mean and median ms per frame beside the faster baseline's mean in the same pass,
    and what sets its mean: the ms per frame that each kind of frame adds above the pass's median (full audits,
    near-tie checks, frames sent to full inference by the speed guard, other full frames, cached frames), with
    their counts. A pass's mean is the median plus these; which of them land in a pass's frames (the sampled
    audits' draw is seeded per pass) and the load during it are what makes the mean vary from run to run."""
    run, lines = runs[name], []
    n = _passes(runs)
    size = len(run.seconds) // n
    for r in range(n if size else 0):
        seconds, stats = run.seconds[r * size:(r + 1) * size], run.stats[r * size:(r + 1) * size]
        baseline = min(statistics.mean(runs[b].seconds[r * size:(r + 1) * size]) for b in BASELINES)
        median = statistics.median(seconds)
        kinds: dict[str, list[float]] = collections.defaultdict(list)
        for t, s in zip(seconds, stats):
            kind = ("near-tie check" if "near tie" in s.reason else "audit") if s.cause == Cause.AUDIT else \
                "cached" if s.cause == Cause.CACHED else "slower" if s.cause == Cause.SLOWER else "other full"
            kinds[kind].append(t - median)
        parts = ", ".join(f"{k} {len(v)}: {sum(v) / len(seconds) * 1e3:+.1f}" for k, v in sorted(kinds.items()))
        lines.append(f"    pass {r}: mean {statistics.mean(seconds) * 1e3:.1f} ms = median {median * 1e3:.1f} + "
                     f"({parts}); baseline mean {baseline * 1e3:.1f} ms, {baseline / statistics.mean(seconds):.2f}x")
    return lines


def _passes(runs: dict[str, Run]) -> int:
    """Passes run per configuration: each pass's first frame is in the outputs but not timed."""
    return max(len(runs["full"].outputs) - len(runs["full"].seconds), 1)


def goals(clip: Clip, row: Row) -> str:
    """Which goals the session's row meets on this clip (classifier)."""
    met = [row.median_x >= 0.95 and row.mean_x >= 0.95, row.agreement >= 0.99]
    text = f"speed>=0.95x {'yes' if met[0] else 'NO'}, top-1>=99% {'yes' if met[1] else 'NO'}"
    if clip.camera == Camera.STILL and clip.subject == Subject.SMALL:
        text += f", >=2x {'yes' if row.median_x >= 2 and row.mean_x >= 2 else 'NO'}"
    return text


def classifier(args: argparse.Namespace) -> None:
    model = models.load("efficientnet_lite0")
    meta = models.info("efficientnet_lite0")
    print(f"EfficientNet-Lite0 (ImageNet weights), {args.frames} frames per clip, {args.rounds} pass(es) per "
          f"configuration; session defaults: {_settings(StreamConfig())}")
    table = []
    for name in args.clips:
        clip = load_clip(name, args.frames)
        print(f"\n{clip.name}: {clip.description}; load {load_average()}")
        runs = run_clip(model, clip, SESSIONS, args.rounds, meta.mean, meta.std, args.lockstep)
        rows = summarise(runs)
        print_rows(rows, OutputKind.LABEL)
        print("  session by pass (ms per frame above the pass's median, by kind of frame):")
        print("\n".join(pass_breakdown(runs)))
        lost = regret(model, clip, {}, meta.mean, meta.std) if args.regret else (math.nan, 0, 0, math.nan)
        print_costs(rows, lost)
        print(f"  goals: {goals(clip, rows['session'])}")
        table.append((clip, rows, lost))
    print(f"\nload at the end: {load_average()}")
    print("\n| clip | baseline ms | session ms (median / mean) | speedup vs baseline (median / mean) | all full x | "
          "MACs ratio | top-1 | audits (full / sampled) | audit, overhead ms/frame | regret ms/frame (wrong) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for clip, rows, lost in table:
        s = rows["session"]
        print(f"| {clip.name} {clip.size[0]}x{clip.size[1]} ({clip.camera.value}, {_subject(clip)}) | "
              f"{baseline_ms(rows):.1f} | {s.median_ms:.1f} / {s.mean_ms:.1f} | {s.median_x:.2f}x / "
              f"{s.mean_x:.2f}x | {rows[ALL_FULL].median_x:.2f}x | {s.macs:.1f} | {s.agreement:.1%} | "
              f"{s.audits:.0%} / {s.sampled:.0%} | "
              f"{s.audit_ms:.1f}, {sum(s.parts_ms.values()):.1f} | {_regret_cell(lost)} |")


def _regret_cell(lost: tuple[float, int, int, float]) -> str:
    mean_lost, wrong, n, _ = lost
    return f"{mean_lost:.1f} ({wrong}/{n})" if n else "n/a"


def _grid_results(args: argparse.Namespace, configs: dict[str, dict]) -> dict[str, dict[str, Row]]:
    """Every candidate configuration on every clip (EfficientNet-Lite0, in lockstep), printed as it goes."""
    model = models.load("efficientnet_lite0")
    meta = models.info("efficientnet_lite0")
    results: dict[str, dict[str, Row]] = {}
    for name in args.clips:
        clip = load_clip(name, args.frames)
        rows = summarise(run_clip(model, clip, configs, args.rounds, meta.mean, meta.std, args.lockstep))
        results[name] = rows
        print(f"\n{name} (load {load_average()})")
        print_rows(rows, OutputKind.LABEL)
    return results


def leave_one_out(args: argparse.Namespace) -> None:
    grid = {name: GRID[name] for name in args.candidates}
    print(f"leave-one-out over {len(args.clips)} clips, {len(grid)} candidates, {args.frames} frames, "
          f"EfficientNet-Lite0, {args.rounds} pass(es)")
    results = _grid_results(args, grid)
    print("\nheld-out clip: candidate chosen on the other clips -> its figures on the held-out clip")
    # the multiply-add ratio (audits and checks count a full frame) is the noise-free side of the wall-time ratios
    print("| held-out clip | chosen on the others | median x | mean x | MACs x | top-1 | audits |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.clips:
        chosen = _choose({k: v for k, v in results.items() if k != name})
        row = results[name][chosen]
        print(f"| {name} | {chosen} | {row.median_x:.2f} | {row.mean_x:.2f} | {row.macs:.1f} | {row.agreement:.1%} | "
              f"{row.audits:.0%} |")
    print(f"\nchosen on all clips (the defaults): {_choose(results)}; load at the end {load_average()}")


def near_tie_loo(args: argparse.Namespace) -> None:
    """Leave-one-out choice of ``near_tie`` (see the module docstring)."""
    configs = {f"near_tie {c:g}": {"near_tie": c} for c in NEAR_TIE_GRID}
    print(f"leave-one-out choice of near_tie over {len(args.clips)} clips, candidates {NEAR_TIE_GRID}, "
          f"{args.frames} frames, EfficientNet-Lite0, {args.rounds} pass(es)")
    results = _grid_results(args, configs)

    def smallest(among: dict[str, dict[str, Row]]) -> str:
        exact = [c for c in configs if all(rows[c].agreement >= 1.0 for rows in among.values())]
        return exact[0] if exact else list(configs)[-1]

    print("\n| clip | near_tie candidates at which top-1 stayed 100% |")
    print("| --- | --- |")
    for name, rows in results.items():
        kept = [c.split()[-1] for c in configs if rows[c].agreement >= 1.0]
        print(f"| {name} | {', '.join(kept) or 'none'} |")
    print("\n| held-out clip | near_tie chosen on the others | median x | mean x | top-1 | full audits | "
          "audit ms/frame (share of a baseline frame) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.clips:
        chosen = smallest({k: v for k, v in results.items() if k != name})
        row = results[name][chosen]
        full = baseline_ms(results[name])
        print(f"| {name} | {chosen.split()[-1]} | {row.median_x:.2f} | {row.mean_x:.2f} | {row.agreement:.1%} | "
              f"{row.audits:.0%} | {row.audit_ms:.1f} ({row.audit_ms / full:.1%}) |")
    print(f"\nchosen on all clips: {smallest(results).split()[-1]}; load at the end {load_average()}")


def _choose(results: dict[str, dict[str, Row]]) -> str:
    """The candidate that keeps every clip at >= 99% agreement and >= 0.95x, then has the highest geometric mean of
    its mean speedups; if none keeps every clip, the one with the best worst-clip agreement."""
    def ok(name: str) -> bool:
        return all(r[name].agreement >= 0.99 and r[name].mean_x >= 0.95 and r[name].median_x >= 0.95
                   for r in results.values())

    def speed(name: str) -> float:
        return math.exp(statistics.mean(math.log(r[name].mean_x) for r in results.values()))

    candidates = [name for name in next(iter(results.values())) if name in GRID]
    feasible = [name for name in candidates if ok(name)]
    if feasible:
        return max(feasible, key=speed)
    return max(candidates, key=lambda name: (min(r[name].agreement for r in results.values()), speed(name)))


def _dense_case(title: str, model: torch.nn.Module, mean: tuple, std: tuple, clip: Clip, args) -> None:
    runs = run_clip(model, clip, SESSIONS, args.rounds, mean, std, args.lockstep)
    rows = summarise(runs)
    ref = primary_tensor(runs["full"].outputs[0])
    labels = ref.argmax(1) if ref.shape[1] > 1 else ref[:, 0] > 0
    majority = float(torch.bincount(labels.flatten().long()).max()) / labels.numel()
    print(f"\n{title} on {clip.name} {clip.size[0]}x{clip.size[1]} ({clip.camera.value} camera), "
          f"{len(clip.frames)} frames; output {tuple(ref.shape)}, largest class {majority:.0%} of positions; "
          f"load {load_average()}")
    print_rows(rows, output_kind(ref))
    lost = regret(model, clip, {}, mean, std) if args.regret else (math.nan, 0, 0, math.nan)
    print_costs(rows, lost)
    s = rows["session"]
    print(f"| {title}, {clip.name} {clip.size[0]}x{clip.size[1]} ({clip.camera.value}) | {len(clip.frames)} | "
          f"{baseline_ms(rows):.1f} | {s.median_ms:.1f} / {s.mean_ms:.1f} | {s.median_x:.2f}x / "
          f"{s.mean_x:.2f}x | {rows[ALL_FULL].median_x:.2f}x | {s.macs:.1f} | {s.agreement:.2%} / {s.worst:.2%} | "
          f"{s.audits:.0%} / {s.sampled:.0%} | "
          f"{s.audit_ms:.1f}, {sum(s.parts_ms.values()):.1f} | {_regret_cell(lost)} |")


def dense(args: argparse.Namespace) -> None:
    import torchvision

    from incrinf.testing.pnet import MEAN, STD, load_pnet

    wheel = _pnet_wheel(Path(args.cache))
    if wheel is not None:
        pnet = load_pnet(wheel)
        for name in ("carphone", "hall", "yard", "walkers", "bikes", "bigbuckbunny"):
            if _wanted(args, name):
                _dense_case("PNet (MTCNN weights)", pnet, MEAN, STD, load_clip(name, args.frames), args)
    torch.manual_seed(0)
    fcn = torchvision.models.segmentation.fcn_resnet50(weights=None, weights_backbone=None).eval()
    imagenet = (models.info("resnet50").mean, models.info("resnet50").std)
    for name, n_frames in (("walkers", args.dense_frames), ("hall", args.dense_frames),
                           ("bikes", args.moving_dense_frames)):
        if _wanted(args, name):
            _dense_case("fcn_resnet50 (random init)", fcn, *imagenet, load_clip(name, n_frames), args)


def no_reuse(args: argparse.Namespace) -> None:
    import torchvision

    torch.manual_seed(0)
    effnet = torchvision.models.efficientnet_b0(weights=None).eval()
    lraspp = torchvision.models.segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None).eval()
    imagenet = (models.info("resnet50").mean, models.info("resnet50").std)
    args.lockstep = True  # full frames from the frame alone: nothing cached to evict (see the module docstring)
    for title, model in (("efficientnet_b0 (squeeze-excitation, random init)", effnet),
                         ("lraspp_mobilenet_v3_large (global-pooling branch, random init)", lraspp)):
        for name in ("carphone", "hall", "walkers", "bikes@224"):
            if _wanted(args, name):
                _dense_case(title, model, *imagenet, load_clip(name, args.frames), args)


# --no-reuse --loo: (model, clip) pairs, and the candidate values of min_saving
SAVING_CASES = (("lraspp_mobilenet_v3_large", "carphone"), ("lraspp_mobilenet_v3_large", "hall"),
                ("deeplabv3_mobilenet_v3_large", "hall"), ("mobilenet_v3_large", "carphone"),
                ("mobilenet_v3_large", "hall"), ("efficientnet_b0", "hall"), ("efficientnet_lite0", "carphone"),
                ("efficientnet_lite0", "hall"), ("resnet18", "hall"), ("pnet", "hall"), ("fcn_resnet50", "walkers"))
SAVING_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)


def _saving_model(name: str, cache: Path) -> tuple[torch.nn.Module, tuple, tuple] | None:
    import torchvision

    torch.manual_seed(0)
    imagenet = (models.info("resnet50").mean, models.info("resnet50").std)
    if name == "efficientnet_lite0":
        meta = models.info(name)
        return models.load(name), meta.mean, meta.std
    if name == "pnet":
        from incrinf.testing.pnet import MEAN, STD, load_pnet

        wheel = _pnet_wheel(cache)
        return (load_pnet(wheel), MEAN, STD) if wheel is not None else None
    if name in ("lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large", "fcn_resnet50"):
        model = getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None)
    else:
        model = getattr(torchvision.models, name)(weights=None)
    return model.eval(), *imagenet


def saving_loo(args: argparse.Namespace) -> None:
    """Leave-one-out choice of ``min_saving``: per (model, clip), the saving the plan gives for the smallest change
    (what the session compares with ``min_saving``) and whether the cache paid (the session with the cache forced
    on against the same session with it forced off, in lockstep); a held-out case gets the threshold that
    classifies the other cases best (flag exactly those the cache lost on; ties: the smallest threshold)."""
    from incrinf.stream.decisions import best_saving

    print(f"leave-one-out choice of min_saving over {len(SAVING_CASES)} (model, clip) cases, {args.frames} frames")
    cases = []
    for name, clip_name in SAVING_CASES:
        loaded = _saving_model(name, Path(args.cache))
        if loaded is None or not _wanted(args, clip_name):
            continue
        model, mean, std = loaded
        clip = load_clip(clip_name, args.frames)
        rows = summarise(run_clip(model, clip, {"cache": {"min_saving": 0.0}, "no cache": {"min_saving": 0.999}},
                                  args.rounds, mean, std, args.lockstep))
        session = StreamSession(model, mean=mean, std=std, min_saving=0.0)
        session(clip.frames[0])  # the first frame profiles the engine's costs
        engine = next(iter(session._engines.values())).engine
        saving = best_saving(engine, pruning=True)
        paid = rows["no cache"].mean_ms / rows["cache"].mean_ms
        cases.append((f"{name} on {clip_name}", saving, paid))
        print(f"| {name} on {clip_name} | {saving:.3f} | {rows['cache'].median_x:.2f}x / {rows['cache'].mean_x:.2f}x "
              f"| {rows['no cache'].median_x:.2f}x / {rows['no cache'].mean_x:.2f}x | {paid:.2f} | "
              f"load {load_average()} |", flush=True)

    def correct(threshold: float, among: list) -> int:
        return sum((saving < threshold) == (paid < 1.0) for _, saving, paid in among)

    print("\n| held-out case | min_saving chosen on the others | flagged | cache paid (mean, cache / no cache) |")
    print("| --- | --- | --- | --- |")
    for i, (title, saving, paid) in enumerate(cases):
        others = cases[:i] + cases[i + 1:]
        chosen = max(SAVING_GRID, key=lambda t: (correct(t, others), -t))
        print(f"| {title} | {chosen:g} | {'yes' if saving < chosen else 'no'} | {paid:.2f} |")
    print(f"\nchosen on all cases: {max(SAVING_GRID, key=lambda t: (correct(t, cases), -t)):g}; load {load_average()}")


def _wanted(args: argparse.Namespace, name: str) -> bool:
    return args.clips == list(CLIP_NAMES) or name in args.clips


def _pnet_wheel(cache: Path) -> Path | None:
    """The facenet-pytorch wheel (PNet's weights), downloaded once into ``cache`` without its dependencies."""
    found = sorted(cache.glob("facenet_pytorch-*.whl"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PNET_WHEEL, "-d",
                             str(cache)], capture_output=True, text=True)
    found = sorted(cache.glob("facenet_pytorch-*.whl"))
    if result.returncode or not found:
        print(f"skipping PNet: could not download {PNET_WHEEL} ({result.stderr.strip()[-200:]})")
        return None
    return found[-1]


def _settings(config: StreamConfig) -> str:
    return (f"pixel threshold {config.pixel_threshold:g}, feature threshold {config.still_feature_threshold:g} "
            f"(still), target agreement {config.target_agreement:g}, audits every "
            f"{config.audit_interval}..{config.keyframe_interval} frames (sampled: {config.sampled_audits}), "
            f"near_tie {config.near_tie:g}, trust after {config.trust_after} audits, speed guard {config.speed_guard}, "
            f"quality guard {config.quality_guard}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=48, help="frames per clip")
    parser.add_argument("--clips", type=lambda s: s.split(","), default=list(CLIP_NAMES),
                        help=f"comma-separated clip names (default: all of {', '.join(CLIP_NAMES)})")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op and OpenCV threads (default 1)")
    parser.add_argument("--rounds", type=int, default=2, help="passes over each clip per configuration")
    parser.add_argument("--lockstep", action="store_true",
                        help="configurations advance frame by frame in turn instead of pass by pass")
    parser.add_argument("--loo", action="store_true", help="leave-one-out choice of the defaults")
    parser.add_argument("--near-tie", action="store_true", help="with --loo: the leave-one-out choice of near_tie")
    parser.add_argument("--candidates", type=lambda s: s.split(","), default=list(GRID),
                        help=f"with --loo: the candidates to compare (default: all of {', '.join(GRID)})")
    parser.add_argument("--dense", action="store_true", help="dense models (PNet, fcn_resnet50)")
    parser.add_argument("--no-reuse", action="store_true", help="models whose every change reaches the output")
    parser.add_argument("--no-regret", dest="regret", action="store_false", help="skip the oracle pass")
    parser.add_argument("--dense-frames", type=int, default=40, help="frames of fcn_resnet50's still-camera runs")
    parser.add_argument("--moving-dense-frames", type=int, default=8, help="frames of fcn_resnet50 on bikes")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "incrinf" / "wheels"),
                        help="where the facenet-pytorch wheel is kept")
    args = parser.parse_args()
    unknown = [c for c in args.clips if c not in CLIP_NAMES]
    if unknown:
        parser.error(f"unknown clip(s) {', '.join(unknown)}; the set: {', '.join(CLIP_NAMES)}")
    unknown = [c for c in args.candidates if c not in GRID]
    if unknown or "defaults" not in args.candidates:
        parser.error(f"--candidates must name 'defaults' and candidates of {', '.join(GRID)}; got "
                     f"{', '.join(args.candidates)}")
    torch.set_num_threads(args.threads)
    # OpenCV's image work (matching, masks, warps) on as many threads as inference: its default pool of one worker
    # per core waits for a busy core on a shared machine (StreamConfig.opencv_threads says what was measured)
    cv2.setNumThreads(args.threads)
    print(machine())
    print(f"OpenCV threads: {cv2.getNumThreads()}")
    print(f"load average at start: {load_average()}")
    if args.loo and args.no_reuse:
        saving_loo(args)
    elif args.loo and args.near_tie:
        near_tie_loo(args)
    elif args.loo:
        leave_one_out(args)
    elif args.dense:
        dense(args)
    elif args.no_reuse:
        no_reuse(args)
    else:
        classifier(args)


if __name__ == "__main__":
    main()
