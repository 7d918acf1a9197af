"""Leave-one-out choice of the quality guard's ``PAIR_AUDITS``: audits of a class pair before its own lead losses
bound a cached output's lead over that rival instead of the pooled losses.

Run: ``python benchmarks/stream_pairs.py [--frames 72] [--clips hall,walkers,carphone,bigbuckbunny@224]
[--thresholds 0.35,0.7]``.

Per clip and feature threshold, EfficientNet-Lite0 runs through a session with both guards off (every frame after the
first cached, the cache drifting) and, beside it, full inference, so every frame has both outputs. The guard is then
replayed on them (:class:`incrinf.stream.guards.QualityGuard`, unscaled losses: ``surely_risky``): every other cached
frame is an audit (both parities, so each frame is once an audit and once checked), the rest are checked. Per
candidate count: the checked frames whose runner-up pair's change exceeded the bound used for it (the pair's own
losses or, with fewer audits of the pair, the pooled ones) against the frames whose pooled change exceeded the
pooled bound (how often today's statistic misses itself), the frames checked, and the flips let through unchecked.
For each held-out clip the smallest count at which the other clips let no flip through and their pair bounds
missed no more often than the pooled bound is reported on the held-out clip.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import incrinf.stream.guards as guards
from incrinf import models
from incrinf.stream.agreement import compare, top_leads
from incrinf.stream.config import StreamConfig
from incrinf.stream.session import StreamSession
from incrinf.testing.clips import load_clip

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, plain_input  # noqa: E402

CANDIDATES = (1, 2, 3, 4, 5, 6, 8)
_KEYS = ("checked", "pair_missed", "pooled_missed", "risky_pairs", "risky_pooled", "flips", "through")


def outputs(clip_name: str, frames: int, threshold: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(full, cached)`` logits (classes,) of every cached frame of a guards-off session."""
    name = "efficientnet_lite0"
    model, meta = models.load(name).eval(), models.info(name)
    plain = plain_input(meta.mean, meta.std, False)
    session = StreamSession(model, mean=meta.mean, std=meta.std, keep_stats=None, feature_threshold=threshold,
                            speed_guard=False, quality_guard=False)
    pairs = []
    with torch.no_grad():
        for frame in load_clip(clip_name, frames).frames:
            full, cached = model(plain(frame))[0], session(frame)[0]
            if session.stats[-1].mode == "cached":
                pairs.append((full.clone(), cached.clone()))
    return pairs


def replay(frames: list[tuple[torch.Tensor, torch.Tensor]], count: int, parity: int) -> dict[str, int]:
    """The guard replayed on one clip's frames with ``PAIR_AUDITS = count`` (see the module docstring)."""
    guards.PAIR_AUDITS = count
    guard = guards.QualityGuard(StreamConfig(target_agreement=0.99, near_tie=0.02, trust_after=1))
    seen = dict.fromkeys(_KEYS, 0)
    for k, (full, cached) in enumerate(frames):
        comparison = compare(cached[None], full[None], 0.99)
        if k % 2 == parity or not guard._lead_lost:
            guard.record(comparison, 1)
            continue
        leads = top_leads(cached[None])
        top, rival = leads.top, leads.rivals[0]
        pooled = guard._bound([a.lost for a in guard._lead_lost])
        pair = guard._pair_lost.get((top, rival))
        bound = guard._bound([a.lost for a in pair]) if pair is not None and len(pair) >= count else pooled
        change = float((full[top] - full[rival]) - (cached[top] - cached[rival]))
        flip = int(full.argmax()) != top
        risky = guard.surely_risky(leads)
        seen["checked"] += 1
        seen["pair_missed"] += abs(change) > bound
        seen["pooled_missed"] += comparison.lead_lost > pooled
        seen["risky_pairs"] += risky
        seen["risky_pooled"] += guard.surely_risky(leads.margin)
        seen["flips"] += flip
        seen["through"] += flip and not risky
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=72)
    parser.add_argument("--clips", type=lambda s: s.split(","), default=["hall", "walkers", "carphone",
                                                                          "bigbuckbunny@224"])
    parser.add_argument("--thresholds", type=lambda s: [float(t) for t in s.split(",")], default=[0.35, 0.7])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine())
    table: dict[tuple[str, int], dict[str, int]] = {}
    for clip in args.clips:
        runs = [outputs(clip, args.frames, t) for t in args.thresholds]
        for count in CANDIDATES:
            total = dict.fromkeys(_KEYS, 0)
            for frames in runs:
                for parity in (0, 1):
                    for key, value in replay(frames, count, parity).items():
                        total[key] += value
            table[clip, count] = total
            print(f"{clip:18} PAIR_AUDITS {count}: " + ", ".join(f"{k} {v}" for k, v in total.items()), flush=True)

    def sound(count: int, clips: list[str]) -> bool:
        pair = sum(table[c, count]["pair_missed"] for c in clips)
        return sum(table[c, count]["through"] for c in clips) == 0 and \
            pair <= sum(table[c, count]["pooled_missed"] for c in clips)

    print("\n| held-out clip | chosen on the others | pair bound missed | pooled bound missed | flips let through |")
    print("| --- | --- | --- | --- | --- |")
    for held in args.clips:
        chosen = min((n for n in CANDIDATES if sound(n, [c for c in args.clips if c != held])), default=None)
        row = table[held, chosen] if chosen is not None else None
        print(f"| {held} | {chosen} | " + (" | ".join(str(row[k]) for k in ("pair_missed", "pooled_missed", "through"))
                                         if row else "- | - | -") + " |")
    print(f"\nchosen on all clips: {min((n for n in CANDIDATES if sound(n, args.clips)), default=None)}")


if __name__ == "__main__":
    main()
