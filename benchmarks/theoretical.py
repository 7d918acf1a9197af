"""Theoretical (FLOP-ratio) speedup of incremental inference for a centred 16x16 patch on every zoo model,
beside Krypton's published figures (224x224; Inception3 299x299).

Run: python benchmarks/theoretical.py [--patch 16] [--tau 1.0]
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import machine

from incrinf import analyze, models

# Krypton (SIGMOD 2019), centred patch 16: exact and tau = 0.4 (ANCHORS.md)
KRYPTON = {"vgg16": (6.5, 11.4), "resnet18": (2.2, 7.7), "inception_v3": (2.2, 8.5)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--patch", type=int, default=16)
    parser.add_argument("--models", nargs="*", default=list(models.ZOO))
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    print(f"centred {args.patch}x{args.patch} patch; GFLOPs are multiply-accumulates of one full inference\n")
    print(f"{'model':<20} {'input':>7} {'GFLOPs':>7} {'tau=1':>7} {'Krypton':>8} {'diff':>6} "
          f"{'tau=0.4':>8} {'Krypton':>8} {'diff':>6}  reuse stops at")
    for name in args.models:
        size = models.info(name).input_size
        model = models.load(name)
        start = time.perf_counter()
        exact = analyze(model, (3, size, size), args.patch)
        approx = analyze(model, (3, size, size), args.patch, tau=0.4)
        k_exact, k_tau = KRYPTON.get(name, (None, None))
        d1 = f"{100 * (exact.theoretical_speedup / k_exact - 1):+.0f}%" if k_exact else ""
        d2 = f"{100 * (approx.theoretical_speedup / k_tau - 1):+.0f}%" if k_tau else ""
        print(f"{name:<20} {size:>7} {exact.flops_full / 1e9:>7.2f} {exact.theoretical_speedup:>7.2f} "
              f"{k_exact or '':>8} {d1:>6} {approx.theoretical_speedup:>8.2f} {k_tau or '':>8} {d2:>6}  "
              f"{exact.reuse_stops_at.split(':')[0]} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
