"""Int8 depthwise kernel: bit-exact with TFLite's reference kernel (LiteRT ``BUILTIN_REF``).

The oracle is a one-op DEPTHWISE_CONV_2D model built in memory and run by the LiteRT interpreter
with the reference op resolver. The kernel gets multipliers derived from the same float32 scales
with :func:`per_channel_multipliers` (what the interpreter does in ``Prepare``), so these tests
also cover the multiplier derivation. ``benchmarks/depthwise_int8.py --sweep`` runs the same check on
many more random configurations.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest
from depthwise_strategies import assert_same, cases, one_numba_thread  # noqa: F401 (fixture)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from incrinf.kernels import depthwise_pool
from incrinf.kernels.depthwise_int8 import (
    depthwise_conv2d_int8,
    depthwise_conv2d_int8_packed,
    depthwise_conv2d_int8_reference_order,
    pack_depthwise_int8,
)
from incrinf.kernels.depthwise_kernels import TILE, requantize_block
from incrinf.kernels.depthwise_pool import SpinPool, claim_size, get_pool, planned_units, smallest_claim
from incrinf.kernels.quantize import multiply_by_quantized_multiplier_np
from incrinf.testing.depthwise_cases import SCALE_REGIMES, DepthwiseCase, make_problem, random_case

pytestmark = pytest.mark.usefixtures("one_numba_thread")


def _check_against_tflite(case: DepthwiseCase, reference_order: bool = True) -> None:
    problem = make_problem(case)
    expected = problem.tflite()
    kwargs = problem.kernel_kwargs()
    assert_same(depthwise_conv2d_int8(problem.x, problem.w, problem.bias, **kwargs), expected, case)
    if reference_order:
        got = depthwise_conv2d_int8_reference_order(problem.x, problem.w, problem.bias, **kwargs)
        assert_same(got, expected, case)


# ------------------------------------------------------------------------------------------------
# Bit-exactness against TFLite's reference kernel
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["same", "valid"])
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bit_exact_vs_tflite_reference(padding, data):
    """2 x 1000 random configurations, 0 mismatches (both loop orders)."""
    _check_against_tflite(data.draw(cases(padding)))


def test_bit_exact_on_seeded_sweep():
    """The benchmark's sweep generator (numpy-seeded, independent of hypothesis), 200 configurations."""
    rng = np.random.default_rng(2024)
    for _ in range(200):
        _check_against_tflite(random_case(rng), reference_order=False)


@pytest.mark.parametrize("regime", SCALE_REGIMES[1:])
def test_multiplier_corner_cases_vs_tflite(regime):
    case = DepthwiseCase(2, 9, 7, 40, 2, (3, 3), (1, 2), (1, 1), "same", None, regime, 7, -3, seed=1234)
    problem = make_problem(case)
    kwargs = problem.kernel_kwargs()
    mult, shift = kwargs["output_multiplier"], kwargs["output_shift"]
    if regime == "round_up":
        assert np.any(mult == 2**30)  # q_fixed hit 2**31 and was halved
    elif regime == "tiny":
        assert np.any(mult == 0) and np.any(shift == -31)
    elif regime == "big":
        assert np.any(shift > 0)
    else:
        assert np.any(shift == 30) and np.any(shift <= -29)
    assert_same(depthwise_conv2d_int8(problem.x, problem.w, problem.bias, **kwargs), problem.tflite(), case)


# Configurations at the edges of the kernel's design: channel counts around the tile width, a 1x1 image,
# padding wider than the image, both zero-point extremes, one output pixel, rows and columns of one.
EDGE_CASES = [
    DepthwiseCase(1, 5, 6, c, 1, (3, 3), (1, 1), (1, 1), "same", "relu6", "normal", 5, -9, seed=c)
    for c in (1, TILE - 1, TILE, TILE + 1, 2 * TILE - 1, 2 * TILE + 1, 3 * TILE)
] + [
    DepthwiseCase(3, 1, 1, 19, 1, (3, 3), (1, 1), (1, 1), "same", None, "normal", -128, 127, seed=1),
    DepthwiseCase(2, 1, 1, 40, 2, (7, 7), (2, 2), (3, 3), "same", "relu", "big", 127, -128, seed=2),
    DepthwiseCase(1, 2, 3, 33, 1, (5, 5), (1, 1), (3, 2), "same", None, "extreme", 127, 0, seed=3),
    DepthwiseCase(2, 4, 4, 70, 3, (5, 5), (3, 2), (2, 3), "same", "relu6", "tiny", -128, -128, seed=4),
    DepthwiseCase(1, 7, 7, TILE, 1, (7, 7), (1, 1), (1, 1), "valid", None, "normal", 0, 0, seed=5),
    DepthwiseCase(1, 1, 9, 17, 1, (1, 3), (1, 1), (1, 1), "valid", None, "round_up", 3, 3, seed=6),
    DepthwiseCase(1, 9, 1, 17, 1, (3, 1), (2, 1), (1, 1), "same", None, "normal", 3, 3, seed=7),
    DepthwiseCase(1, 12, 12, 96, 1, (1, 1), (2, 2), (1, 1), "same", "relu", "normal", -5, 4, seed=8),
    DepthwiseCase(1, 13, 11, 48, 1, (5, 5), (2, 2), (1, 1), "same", None, "normal", 11, -7, seed=9),
    DepthwiseCase(2, 3, 3, 5, 2, (3, 3), (3, 3), (1, 1), "same", None, "normal", -1, 1, seed=10),
]


def _case_id(c: DepthwiseCase) -> str:
    return f"{c.batch}x{c.height}x{c.width}x{c.channels}m{c.depth_multiplier}k{c.kernel[0]}x{c.kernel[1]}"


@pytest.mark.parametrize("case", EDGE_CASES, ids=_case_id)
def test_edge_configurations_vs_tflite(case):
    _check_against_tflite(case)


# ------------------------------------------------------------------------------------------------
# Threads
# ------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_size=9))
def test_every_available_thread_count_gives_the_same_result(case):
    problem = make_problem(case)
    kwargs = problem.kernel_kwargs()
    one = depthwise_conv2d_int8(problem.x, problem.w, problem.bias, threads=1, **kwargs)
    for threads in range(2, numba.config.NUMBA_NUM_THREADS + 1):
        assert_same(depthwise_conv2d_int8(problem.x, problem.w, problem.bias, threads=threads, **kwargs), one, case)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],  # the fixture is constant
)
@given(case=cases(max_size=9))
def test_the_pool_splits_every_layer_and_gives_the_same_result(case, no_minimum_slice):
    """With no minimum work per claim every layer of more than one work unit is shared: the calling thread and
    a worker claim unit ranges (partial rows and tile ranges included) in turn. The result must not change,
    and every unit must be computed exactly once, in at least two claims."""
    problem = make_problem(case)
    kwargs = problem.kernel_kwargs()
    one = depthwise_conv2d_int8(problem.x, problem.w, problem.bias, threads=1, **kwargs)
    pool = get_pool(numba.config.NUMBA_NUM_THREADS)
    claims, units_done = pool.claims_done().sum(), pool.units_done().sum()
    two = depthwise_conv2d_int8(problem.x, problem.w, problem.bias, threads=2, **kwargs)
    assert_same(two, one, case)
    n_tiles = -(-problem.x.shape[3] // TILE)
    units = two.shape[0] * two.shape[1] * n_tiles * case.depth_multiplier
    if units > 1 and two.size:
        assert pool.units_done().sum() - units_done == units
        assert pool.claims_done().sum() - claims >= 2


@pytest.fixture
def no_minimum_slice():
    """Every layer goes to the pool: no minimum number of multiply-adds per layer or claim."""
    previous = depthwise_pool.MIN_SPLIT_MACS, depthwise_pool.MIN_CLAIM_MACS
    depthwise_pool.MIN_SPLIT_MACS = depthwise_pool.MIN_CLAIM_MACS = 1
    yield
    depthwise_pool.MIN_SPLIT_MACS, depthwise_pool.MIN_CLAIM_MACS = previous


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs numba's 2 threads")
def test_a_pool_with_more_workers_than_cores_gives_the_same_result(no_minimum_slice):
    """Three workers and the caller on this machine's cores, claims down to one unit, many calls in a row:
    workers that the OS runs late or not at all must neither lose nor repeat a unit."""
    from incrinf.kernels import depthwise_int8 as wrappers

    pool = SpinPool(max_threads=4)
    try:
        rng = np.random.default_rng(3)
        for _ in range(30):
            problem = make_problem(random_case(rng, max_size=12))
            kwargs = problem.kernel_kwargs()
            one = depthwise_conv2d_int8(problem.x, problem.w, problem.bias, threads=1, **kwargs)
            packed = pack_depthwise_int8(
                problem.w, problem.bias, input_offset=kwargs["input_offset"],
                output_multiplier=kwargs["output_multiplier"], output_shift=kwargs["output_shift"],
                in_channels=problem.x.shape[3],
            )
            out = np.empty_like(one)
            geometry = {k: kwargs[k] for k in ("stride", "padding", "dilation")}
            quant = (kwargs["output_offset"], kwargs["act_min"], kwargs["act_max"])
            plan = wrappers.call_plan(problem.x.shape, packed, region=None, quant_args=quant, **geometry)
            if not plan.size:
                continue
            for helpers, min_claim in ((3, 1), (2, max(plan.units // 3, 1)), (3, 2)):
                out.fill(0)
                units = pool.units_done().sum()
                pool.run(
                    problem.x.reshape(-1), packed.tile_weights, packed.tile_params, packed.zero_row,
                    out.reshape(-1), plan.config, helpers, min_claim,
                )
                assert_same(out, one, (problem.case, helpers, min_claim))
                assert pool.units_done().sum() - units == plan.units
    finally:
        pool.stop()


def test_calls_from_several_python_threads_give_the_same_results(no_minimum_slice):
    """The kernel releases the GIL: calls from two Python threads at once share one pool (one of them uses
    the workers, the other runs alone), and every result must still be exact."""
    import threading

    rng = np.random.default_rng(5)
    problems = [make_problem(random_case(rng, max_size=12)) for _ in range(6)]
    expected = [
        depthwise_conv2d_int8(p.x, p.w, p.bias, threads=1, **p.kernel_kwargs()) for p in problems
    ]
    failures: list[str] = []

    def caller(offset: int) -> None:
        for i in range(40):
            k = (i + offset) % len(problems)
            p = problems[k]
            got = depthwise_conv2d_int8(p.x, p.w, p.bias, threads=2, **p.kernel_kwargs())
            if not np.array_equal(got, expected[k]):
                failures.append(f"{p.case}")

    threads = [threading.Thread(target=caller, args=(offset,)) for offset in (0, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]


def test_the_kernel_is_compiled_with_noalias_arguments():
    """The tiled kernel vectorizes only when numba marks its arrays ``noalias`` (about 6x slower otherwise,
    with the same results): the hook that asks numba for it must still be in place in this numba version."""
    from numba.core.compiler import Flags

    from incrinf.kernels.depthwise_kernels import depthwise_units

    assert depthwise_units._compiler._customize_flags(Flags()).noalias


def test_claims_follow_the_multiply_adds():
    """A layer of one unit or fewer than MIN_SPLIT_MACS multiply-adds runs alone (smallest claim 0); otherwise
    the smallest claim is MIN_CLAIM_MACS worth of units (at least one). Claims take 1/(2 x threads) of what is
    left, never less than the smallest claim nor more than is left."""
    split, claim = depthwise_pool.MIN_SPLIT_MACS, depthwise_pool.MIN_CLAIM_MACS
    assert smallest_claim(1, 100 * split) == 0
    assert smallest_claim(100, split // 100 - 1) == 0
    assert smallest_claim(100, split // 100 + 1) == -(-claim // (split // 100 + 1))
    assert smallest_claim(100, 10 * claim) == 1
    assert smallest_claim(1000, claim // 4) == 4
    assert claim_size(100, 4, 3) == 25
    assert claim_size(10, 4, 3) == 3
    assert claim_size(2, 4, 3) == 2


@pytest.mark.parametrize("units, macs_per_unit", [(112, 3584), (126, 2016), (210, 2016), (7, 30000), (30, 3000)])
def test_planned_claims_split_the_work_evenly(units, macs_per_unit):
    """Threads of equal speed end within one smallest claim of each other, and every unit is planned once."""
    for threads in (2, 3, 4):
        done = planned_units(units, macs_per_unit, threads)
        assert sum(done) == units
        assert max(done) - min(done) <= max(smallest_claim(units, macs_per_unit), 1)
    assert planned_units(units, macs_per_unit, 1) == [units]


_THREADS_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    from incrinf.kernels import depthwise_conv2d_int8, depthwise_pool
    from incrinf.testing.depthwise_cases import make_problem, random_case

    depthwise_pool.MIN_SPLIT_MACS = depthwise_pool.MIN_CLAIM_MACS = 1  # every layer to the pool, up to 4 workers
    rng = np.random.default_rng(7)
    for _ in range(25):
        problem = make_problem(random_case(rng, max_size=9))
        kwargs = problem.kernel_kwargs()
        one = depthwise_conv2d_int8(problem.x, problem.w, problem.bias, threads=1, **kwargs)
        for threads in range(2, 6):
            other = depthwise_conv2d_int8(problem.x, problem.w, problem.bias, threads=threads, **kwargs)
            assert np.array_equal(one, other), (problem.case, threads)
    print("ok")
    """
)


def test_five_threads_in_a_fresh_process_give_the_same_result():
    """More threads than this machine has cores (and than most layers have units): every thread count's
    slicing, including uneven slices, must not change a result."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "5"}
    done = subprocess.run(
        [sys.executable, "-c", _THREADS_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


# ------------------------------------------------------------------------------------------------
# The vectorized requantization against the literal gemmlowp transcription
# ------------------------------------------------------------------------------------------------


def test_tile_requantization_matches_tflite_arithmetic():
    """The kernel's two-pass requantization (int64 pairs, then int32 rounding) equals TFLite's
    ``MultiplyByQuantizedMultiplier`` on 400,000 accumulators: random, small, mid-size and the int32 limits,
    with every shift from -31 to 30, multipliers 0 and 2**31 - 1 included. Outputs are compared where the
    expected value is not clamped (a clamp could hide a difference), and most of them are not."""
    rng = np.random.default_rng(11)
    n_pixels = 100_000 // TILE * 4
    mult = np.where(rng.random(TILE) < 0.1, 0, rng.integers(2**30, 2**31, TILE)).astype(np.int32)
    mult[:2] = 2**31 - 1
    packs = []
    for shifts in (np.arange(-31, 1), np.arange(-2, 30)):  # every shift, in two tiles of 32 channels
        shift = shifts[:TILE].astype(np.int32)
        packed = pack_depthwise_int8(
            np.zeros((1, 1, 1, TILE), np.int8), None, input_offset=0, output_multiplier=mult, output_shift=shift
        )
        packs.append((packed, shift))
    in_range = 0
    for packed, shift in packs:
        acc = np.concatenate(
            [
                rng.integers(-(2**31), 2**31, n_pixels * TILE // 4),
                rng.integers(-5000, 5000, n_pixels * TILE // 4),
                rng.integers(-(2**22), 2**22, n_pixels * TILE // 4),
                rng.choice(np.array([-(2**31), 2**31 - 1, 0, -1, 1, 2**30, -(2**30)]), n_pixels * TILE // 4),
            ]
        ).astype(np.int32)
        # The kernel applies the left shift (int32, wrapping) before requantizing.
        shifted = (acc.astype(np.int64) << np.maximum(shift, 0)[np.arange(acc.size) % TILE]).astype(np.int32)
        for out_off in (-100, 0, 77):
            out = np.empty(acc.size, np.int8)
            requantize_block(shifted.copy(), packed.tile_params, 0, out, out_off, -128, 127, 32)
            lane = np.arange(acc.size) % TILE
            expected = multiply_by_quantized_multiplier_np(acc, mult[lane], shift[lane]).astype(np.int64) + out_off
            inside = (expected >= -128) & (expected <= 127)
            in_range += int(inside.sum())
            assert int((out.astype(np.int64)[inside] != expected[inside]).sum()) == 0
            assert np.array_equal(out, np.clip(expected, -128, 127).astype(np.int8))
    assert in_range > 0.3 * 3 * 2 * n_pixels * TILE


# ------------------------------------------------------------------------------------------------
# The packed entry point and the tile layout
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("channels", [1, 7, TILE - 1, TILE, TILE + 1, 2 * TILE, 2 * TILE + 5])
@pytest.mark.parametrize("depth_multiplier", [1, 2])
@pytest.mark.parametrize("kernel", [(3, 3), (5, 5), (2, 3), (1, 1), (7, 7)])
def test_every_tile_path_equals_the_reference_order(channels, depth_multiplier, kernel):
    """Unipass 3x3 and 5x5, grouped taps (2x3: one group and two single taps; 7x7: twelve groups and one),
    full and partial tiles, one and several planes: all equal TFLite's loop order."""
    case = DepthwiseCase(
        2, 9, 8, channels, depth_multiplier, kernel, (1, 2), (2, 1), "same", "relu", "normal", -7, 5, seed=3
    )
    problem = make_problem(case)
    kwargs = problem.kernel_kwargs()
    expected = depthwise_conv2d_int8_reference_order(problem.x, problem.w, problem.bias, **kwargs)
    packed = pack_depthwise_int8(
        problem.w,
        problem.bias,
        input_offset=kwargs["input_offset"],
        output_multiplier=kwargs["output_multiplier"],
        output_shift=kwargs["output_shift"],
        depth_multiplier=depth_multiplier,
    )
    got = depthwise_conv2d_int8_packed(
        problem.x,
        packed,
        stride=case.stride,
        padding="same",
        dilation=case.dilation,
        output_offset=kwargs["output_offset"],
        act_min=kwargs["act_min"],
        act_max=kwargs["act_max"],
    )
    assert_same(got, expected, case)


def test_packed_layout_is_per_tile_with_the_filter_sum_in_the_base():
    rng = np.random.default_rng(0)
    c, dm = TILE + 3, 2
    w = rng.integers(-128, 128, (1, 3, 3, c * dm), dtype=np.int8)
    bias = rng.integers(-1000, 1000, c * dm).astype(np.int32)
    packed = pack_depthwise_int8(w, bias, input_offset=9, output_multiplier=2**30, output_shift=-3, depth_multiplier=dm)
    n_tiles = 2
    weights = packed.tile_weights.reshape(dm, n_tiles, 9, TILE)
    params = packed.tile_params.reshape(dm, n_tiles, -1, TILE)
    for m in range(dm):
        for ic in range(c):
            oc = ic * dm + m
            tile, lane = divmod(ic, TILE)
            assert np.array_equal(weights[m, tile, :, lane], w[0, :, :, oc].reshape(-1))
            assert params[m, tile, 0, lane] == bias[oc] + 9 * int(w[0, :, :, oc].astype(np.int64).sum())
    assert not weights[:, 1, :, 3:].any()  # zero past the last channel
    assert np.all(packed.zero_row == -9)  # the input zero point: its taps contribute nothing
