"""What the compiler made of the int8 depthwise kernel: LLVM's vectorizer remarks and the hot loops' instructions.

Run: ``python benchmarks/depthwise_int8_codegen.py`` (about half a minute: it compiles the kernel afresh, in a
child process with an empty numba cache, so that LLVM reports on it).

It prints
- LLVM's loop-vectorizer remarks for the compiled kernel (``vectorized loop (vectorization width: W, ...)``);
- the vector types in the kernel's optimized LLVM IR (``<16 x i32>`` multiplies, ``<8 x i64>`` ...);
- the assembly of the kernel's hottest loops: one pixel of a 3x3 and of a 5x5 tile (the unipass kernels), the
  grouped-taps kernel, the two requantization passes and the indirection buffer, each with its instruction
  mix and the number of instructions per 16 outputs (one 512-bit vector of int32).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, test on a basic block's instruction counts); the first match names a block.
LOOPS = [
    ("MAC, 5x5 unipass (25 taps)", lambda c: c["vpmulld"] >= 25 and c["vpmulld"] % 25 == 0),
    ("MAC, 3x3 unipass (9 taps)", lambda c: c["vpmulld"] >= 9 and c["vpmulld"] % 9 == 0),
    ("MAC, groups of 4 taps", lambda c: c["vpmulld"] >= 4 and c["vpmulld"] % 4 == 0),
    ("requantization 1: high multiply, int64 lanes", lambda c: c["vpmuldq"] >= 2),
    ("requantization 2: rounding shift, clamp, store", lambda c: c["vpsravd"] >= 1 and c["vpmovdb"] >= 1),
]


def _child() -> None:
    """Compile the kernel (LLVM remarks on) and print its assembly and IR between markers."""
    import llvmlite.binding as llvm

    for option in ("-pass-remarks=loop-vectorize", "-pass-remarks-missed=loop-vectorize"):
        llvm.set_option("", option)
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from incrinf.kernels import depthwise_int8 as dw
    from incrinf.kernels.depthwise_kernels import depthwise_units

    x = np.zeros((1, 8, 8, 40), np.int8)
    w = np.zeros((1, 3, 3, 40), np.int8)
    dw.depthwise_conv2d_int8(x, w, None, input_offset=0, output_offset=0, output_multiplier=2**30, output_shift=0)
    sig = depthwise_units.signatures[0]
    sys.stderr.flush()
    print("=== ASM ===")
    print(depthwise_units.inspect_asm(sig))
    print("=== IR ===")
    print(depthwise_units.inspect_llvm(sig))
    print("=== CPU ===")
    print(llvm.get_host_cpu_name())


def _blocks(asm: str) -> list[tuple[str, list[str]]]:
    """The parallel loop body's basic blocks: (label, instruction mnemonics)."""
    sections = re.split(r"\n(?=\.LBB\d+_\d+:)", asm)
    blocks = []
    for section in sections:
        lines = section.splitlines()
        if not lines:
            continue
        mnemonics = [ln.split()[0] for ln in lines[1:] if ln.startswith("\t") and not ln.strip().startswith(".")]
        blocks.append((lines[0].strip(), mnemonics))
    return blocks


def report(asm: str, ir: str, remarks: str, cpu: str) -> None:
    pattern = r"vectorized loop \(vectorization width: (\d+), interleaved count: (\d+)\)"
    vectorized = collections.Counter(re.findall(pattern, remarks))
    print(f"host CPU (LLVM): {cpu}")
    print("\nLLVM loop vectorizer, loops vectorized (width, interleave): count")
    for (width, interleave), count in sorted(vectorized.items(), key=lambda kv: -kv[1]):
        print(f"  width {width:>2}, interleave {interleave}: {count}")
    print(f"  (loops not vectorized, all functions of the module: {remarks.count('loop not vectorized')})")
    operation = r"= (mul|add|sub|ashr|lshr|shl|and|or|xor|sext|zext|trunc)[^<\n]*<(\d+ x i\d+)>"
    types = collections.Counter(re.findall(operation, ir))
    print("\nvector operations in the optimized LLVM IR (operation, type): count")
    for (op, vtype), count in sorted(types.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {op:5} <{vtype}>: {count}")
    registers = collections.Counter(re.findall(r"%([xyz])mm\d+", asm))
    used = ", ".join(f"{kind}mm {registers[kind]}" for kind in "zyx")
    print(f"\nvector registers named in the kernel's assembly: {used}")
    print("\nhot loops (the largest basic block of each kind; instructions per 16 outputs = per int32 vector):")
    seen: set[str] = set()
    for label, mnemonics in sorted(_blocks(asm), key=lambda b: -len(b[1])):
        counts = collections.Counter(mnemonics)
        kind = next((name for name, test in LOOPS if test(counts)), None)
        if kind is None or kind in seen:
            continue
        seen.add(kind)
        vectors = counts["vpmulld"] // (25 if "25" in kind else 9 if "9 taps" in kind else 4) if "MAC" in kind else None
        if kind.startswith("requantization 1"):
            vectors = counts["vpmuldq"] // 2
        if kind.startswith("requantization 2"):
            vectors = counts["vpmovdb"]
        vector_ops = sum(n for m, n in counts.items() if m.startswith("v"))
        per = f"{vector_ops / vectors:.1f} vector instructions per 16 outputs" if vectors else ""
        mix = ", ".join(f"{m} {n}" for m, n in counts.most_common(9))
        print(f"- {kind} [{label}]: {len(mnemonics)} instructions, {vector_ops} vector; {per}\n    {mix}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child()
        return
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        done = subprocess.run(
            [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True
        )
    out = done.stdout
    asm = out.split("=== ASM ===", 1)[1].split("=== IR ===", 1)[0]
    ir = out.split("=== IR ===", 1)[1].split("=== CPU ===", 1)[0]
    cpu = out.split("=== CPU ===", 1)[1].strip()
    # The parallel loop's body is the function (between .Lfunc_end markers) with the multiplies.
    body = max(re.split(r"\.Lfunc_end\d+:", asm), key=lambda f: f.count("vpmulld"))
    report(body, ir, done.stderr, cpu)


if __name__ == "__main__":
    main()
