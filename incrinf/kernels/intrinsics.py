"""Numba intrinsics the int8 kernels need and numba does not offer (raw-address loads, scoped alias metadata,
int32 pairs as int64, an atomic counter, the thread count, a vector-width hint).

- :func:`address_of` and :func:`load_int8` let a kernel read through an *indirection buffer* of addresses, as
  XNNPACK does: a tap outside the image points at a zero row instead of being tested for bounds, so the
  channel loop has no branch. ``load_int8(address, j)`` is a plain ``getelementptr`` + ``load`` on a loop-invariant
  base, which LLVM's loop vectorizer turns into contiguous vector loads.
- :func:`store_scratch` writes a kernel's int32 scratch (its accumulators). LLVM cannot tell where an address
  made from an integer points, so a loop that reads through addresses and writes accumulators would get a
  run-time overlap test per address (two dozen per pixel for a 5x5 filter). The two carry scoped alias
  metadata instead: reads through addresses are tagged ``!noalias`` with the scratch scope that the scratch
  writes are tagged ``!alias.scope`` with, which states the fact (the input and the zero row are never a
  kernel's scratch) to LLVM.
- :func:`load_pair` / :func:`store_pair` read and write elements ``2k, 2k+1`` of an int32 array as one int64, so a
  loop can treat pairs of int32 lanes as int64 lanes. They do what ``array.view(np.int64)`` does without
  creating a second array object, which numba's parallel alias analysis would count as an alias (dropping the
  ``noalias`` flags that let LLVM vectorize the kernel's loops).
- :func:`fetch_add`, :func:`atomic_load`, :func:`atomic_store` and :func:`compare_exchange` (sequentially
  consistent int64 atomics) and :func:`spin_pause` (the x86 ``pause`` hint, nothing elsewhere) are what the
  kernels' own thread pool (:mod:`incrinf.kernels.depthwise_pool`) hands out work and waits with.
  :func:`array_at` rebuilds a 1-D array from an address and a length, so a pool thread can run a kernel on
  arrays that the calling thread owns (and keeps alive until the job is done). :func:`nap` sleeps through the C
  library's ``usleep`` (``Sleep`` on Windows) at an address found once with ctypes and passed in, so an idle
  pool thread sleeps without the GIL and the function stays cacheable (a ctypes function object would not be).
- :func:`prefer_wide_vectors` marks the function being compiled with ``"prefer-vector-width"="512"``. LLVM tunes
  AVX-512 CPUs (Skylake-SP onwards) to 256-bit vectors by default; the int8 kernels are integer code that runs
  faster with 512-bit vectors (16 int32 lanes). On CPUs without AVX-512, and on other architectures, the hint
  changes nothing. llvmlite validates attribute names against a fixed list that lacks string attributes, so
  the hint is added to the underlying set directly; if that ever fails, the hint is skipped (a slower kernel,
  never a different result).
"""

from __future__ import annotations

import platform

from incrinf.extras import require

numba = require("numba", "int8", "the int8 kernels")
llvm_ir = require("llvmlite.ir", "int8", "the int8 kernels")
types = numba.types
intrinsic = numba.extending.intrinsic
cgutils = numba.core.cgutils

__all__ = [
    "address_of",
    "array_at",
    "atomic_load",
    "atomic_store",
    "compare_exchange",
    "fetch_add",
    "load_int8",
    "load_pair",
    "FUTEX_SYSCALL",
    "SLEEP_ADDRESS",
    "SLEEP_DIVISOR",
    "SYSCALL_ADDRESS",
    "YIELD_SYSCALL",
    "call_int",
    "nap",
    "prefer_wide_vectors",
    "spin_pause",
    "store_pair",
    "store_scratch",
    "syscall6",
]

_VECTOR_WIDTH_ATTRIBUTE = '"prefer-vector-width"="512"'
_ALIAS_DOMAIN = "incrinf.kernels.simd"
_SCRATCH_SCOPE = "incrinf.kernels.simd.scratch"


def _scratch_scopes(module):
    """The metadata list ``!{scratch scope}`` (named scopes: the same scope in every function and module)."""
    domain = module.add_metadata([llvm_ir.MetaDataString(module, _ALIAS_DOMAIN)])
    scope = module.add_metadata([llvm_ir.MetaDataString(module, _SCRATCH_SCOPE), domain])
    return module.add_metadata([scope])


@intrinsic
def address_of(typingctx, array):
    """The address of ``array``'s first element, as an int64 (``array`` must stay alive while it is used)."""
    if not isinstance(array, types.Array):
        return None
    sig = types.int64(array)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, llvm_ir.IntType(64))

    return sig, codegen


@intrinsic
def load_int8(typingctx, address, index):
    """The int8 at ``address + index`` (``address`` from :func:`address_of` plus an offset)."""
    if not (isinstance(address, types.Integer) and isinstance(index, types.Integer)):
        return None
    sig = types.int8(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        base = builder.inttoptr(args[0], llvm_ir.PointerType(llvm_ir.IntType(8)))
        value = builder.load(builder.gep(base, [args[1]], inbounds=True))
        value.set_metadata("noalias", _scratch_scopes(builder.module))
        return value

    return sig, codegen


@intrinsic
def store_scratch(typingctx, array, index, value):
    """``array[index] = value`` for a 1-D int32 scratch array that :func:`load_int8` addresses never point into."""
    if not (_is_int32_vector(array) and isinstance(index, types.Integer) and isinstance(value, types.Integer)):
        return None
    sig = types.none(array, types.uint64, types.int32)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        store = builder.store(args[2], builder.gep(data, [args[1]], inbounds=True))
        store.set_metadata("alias.scope", _scratch_scopes(builder.module))
        return context.get_dummy_value()

    return sig, codegen


def _pair_pointer(context, builder, array_type, array, index):
    data = context.make_array(array_type)(context, builder, array).data
    pairs = builder.bitcast(data, llvm_ir.PointerType(llvm_ir.IntType(64)))
    return builder.gep(pairs, [index], inbounds=True)


def _is_int32_vector(array) -> bool:
    return isinstance(array, types.Array) and array.dtype == types.int32 and array.ndim == 1


@intrinsic
def load_pair(typingctx, array, index):
    """Elements ``2*index`` (low 32 bits) and ``2*index + 1`` (high 32 bits) of a 1-D int32 array, as an int64."""
    if not (_is_int32_vector(array) and isinstance(index, types.Integer)):
        return None
    sig = types.int64(array, types.uint64)

    def codegen(context, builder, signature, args):
        value = builder.load(_pair_pointer(context, builder, signature.args[0], args[0], args[1]))
        value.align = 4  # the array is only known to be int32-aligned
        return value

    return sig, codegen


@intrinsic
def store_pair(typingctx, array, index, value):
    """Store ``value``'s low and high 32 bits into elements ``2*index`` and ``2*index + 1`` of a 1-D int32 array."""
    if not (_is_int32_vector(array) and isinstance(index, types.Integer) and isinstance(value, types.Integer)):
        return None
    sig = types.none(array, types.uint64, types.int64)

    def codegen(context, builder, signature, args):
        store = builder.store(args[2], _pair_pointer(context, builder, signature.args[0], args[0], args[1]))
        store.align = 4
        return context.get_dummy_value()

    return sig, codegen


def _is_int64_vector(array) -> bool:
    return isinstance(array, types.Array) and array.dtype == types.int64 and array.ndim == 1


def _int64_slot(context, builder, array_type, array, index):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.gep(data, [index], inbounds=True)


@intrinsic
def fetch_add(typingctx, array, index, value):
    """Atomically add ``value`` to ``array[index]`` (a 1-D int64 array) and return the value it had before."""
    if not (_is_int64_vector(array) and isinstance(index, types.Integer) and isinstance(value, types.Integer)):
        return None
    sig = types.int64(array, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        slot = _int64_slot(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", slot, args[2], "seq_cst")

    return sig, codegen


@intrinsic
def atomic_load(typingctx, array, index):
    """``array[index]`` of a 1-D int64 array, read atomically (it may be written by another thread)."""
    if not (_is_int64_vector(array) and isinstance(index, types.Integer)):
        return None
    sig = types.int64(array, types.intp)

    def codegen(context, builder, signature, args):
        slot = _int64_slot(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(slot, "seq_cst", 8)

    return sig, codegen


@intrinsic
def atomic_store(typingctx, array, index, value):
    """``array[index] = value`` for a 1-D int64 array, atomically; writes before it are visible before it."""
    if not (_is_int64_vector(array) and isinstance(index, types.Integer) and isinstance(value, types.Integer)):
        return None
    sig = types.none(array, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        slot = _int64_slot(context, builder, signature.args[0], args[0], args[1])
        builder.store_atomic(args[2], slot, "seq_cst", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def compare_exchange(typingctx, array, index, expected, value):
    """Atomically set ``array[index]`` (1-D int64) to ``value`` if it holds ``expected``; whether it did."""
    if not (
        _is_int64_vector(array)
        and isinstance(index, types.Integer)
        and isinstance(expected, types.Integer)
        and isinstance(value, types.Integer)
    ):
        return None
    sig = types.boolean(array, types.intp, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        slot = _int64_slot(context, builder, signature.args[0], args[0], args[1])
        pair = builder.cmpxchg(slot, args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)

    return sig, codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def spin_pause(typingctx):
    """The ``pause`` hint of a spin-wait loop on x86 (saves power, frees the core's sibling); nothing elsewhere."""
    sig = types.none()

    def codegen(context, builder, signature, args):
        if _X86:  # numba's JIT has no inline-assembly parser: LLVM's intrinsic for the instruction
            fnty = llvm_ir.FunctionType(llvm_ir.VoidType(), [])
            builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause"), [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def array_at(typingctx, address, length, like):
    """A 1-D C array of ``like``'s dtype (``like``: a 1-D array, or a numpy scalar type such as ``np.int32``)
    over ``length`` elements at ``address`` (from :func:`address_of`).

    The array does not own its memory: the owner must keep it alive while the array is used.
    """
    if isinstance(like, types.NumberClass):
        dtype = like.instance_type
    elif isinstance(like, types.Array) and like.ndim == 1:
        dtype = like.dtype
    else:
        return None
    if not (isinstance(address, types.Integer) and isinstance(length, types.Integer)):
        return None
    array_type = types.Array(dtype, 1, "C")
    sig = array_type(types.int64, types.intp, like)

    def codegen(context, builder, signature, args):
        ltype = context.get_value_type(array_type.dtype)
        data = builder.inttoptr(args[0], llvm_ir.PointerType(ltype))
        array = context.make_array(array_type)(context, builder)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(ltype))
        shape = cgutils.pack_array(builder, [args[1]])
        strides = cgutils.pack_array(builder, [itemsize])
        context.populate_array(array, data=data, shape=shape, strides=strides, itemsize=itemsize, meminfo=None)
        return array._getvalue()

    return sig, codegen


@intrinsic
def prefer_wide_vectors(typingctx):
    """Ask LLVM for 512-bit vectors in the function being compiled (see the module docstring)."""
    sig = types.none()

    def codegen(context, builder, signature, args):
        try:
            set.add(builder.function.attributes, _VECTOR_WIDTH_ATTRIBUTE)
        except Exception:  # llvmlite's attribute set changed shape: go without the hint
            pass
        return context.get_dummy_value()

    return sig, codegen



def _find_sleep() -> tuple[int, int]:
    """``(address, divisor)``: a C function ``f(unsigned n)`` that sleeps ``n * divisor`` microseconds."""
    import ctypes
    import sys

    if sys.platform == "win32":
        return ctypes.cast(ctypes.windll.kernel32.Sleep, ctypes.c_void_p).value or 0, 1000  # milliseconds
    try:
        return ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value or 0, 1
    except (AttributeError, OSError):
        return 0, 1


SLEEP_ADDRESS, SLEEP_DIVISOR = _find_sleep()
"""The C sleep function :func:`nap` calls and its unit in microseconds (address 0 when none was found: then
:func:`nap` only pauses the core)."""


@intrinsic
def nap(typingctx, address, amount):
    """Call the C sleep function at ``address`` (:data:`SLEEP_ADDRESS`) with ``amount`` (microseconds divided by
    :data:`SLEEP_DIVISOR`); with ``address`` 0, only the ``pause`` hint."""
    if not (isinstance(address, types.Integer) and isinstance(amount, types.Integer)):
        return None
    sig = types.none(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i32 = llvm_ir.IntType(32)
        fnty = llvm_ir.FunctionType(i32, [i32])
        with builder.if_else(builder.icmp_signed("!=", args[0], context.get_constant(types.int64, 0))) as (
            have,
            missing,
        ):
            with have:
                fn = builder.inttoptr(args[0], llvm_ir.PointerType(fnty))
                builder.call(fn, [builder.trunc(args[1], i32)])
            with missing:
                if _X86:
                    pause = llvm_ir.FunctionType(llvm_ir.VoidType(), [])
                    builder.call(cgutils.get_or_insert_function(builder.module, pause, "llvm.x86.sse2.pause"), [])
        return context.get_dummy_value()

    return sig, codegen


def _find_futex() -> tuple[int, int]:
    """``(address of the C library's syscall function, the futex system call's number)``; ``(0, 0)`` off Linux on
    x86-64 and AArch64 (the pool then naps with :func:`nap` instead)."""
    import ctypes
    import sys

    numbers = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
    number = numbers.get(platform.machine().lower(), 0)
    if not sys.platform.startswith("linux") or not number:
        return 0, 0
    try:
        return ctypes.cast(ctypes.CDLL(None).syscall, ctypes.c_void_p).value or 0, number
    except (AttributeError, OSError):
        return 0, 0


SYSCALL_ADDRESS, FUTEX_SYSCALL = _find_futex()
"""The C library's ``syscall`` and the futex call's number, for :func:`syscall6` (0, 0 where unavailable)."""

YIELD_SYSCALL = {"x86_64": 24, "amd64": 24, "aarch64": 124, "arm64": 124}.get(platform.machine().lower(), 0) * (
    FUTEX_SYSCALL != 0
)
"""``sched_yield``'s number for :func:`syscall6` where :data:`FUTEX_SYSCALL` is known (Linux), else 0."""


@intrinsic
def syscall6(typingctx, address, number, a1, a2, a3, a4, a5):
    """``syscall(number, a1, ..., a5)`` through the C library's function at ``address`` (:data:`SYSCALL_ADDRESS`;
    its integer arguments go in the same registers as a fixed-argument call's on x86-64 and AArch64 Linux)."""
    args = (address, number, a1, a2, a3, a4, a5)
    if not all(isinstance(a, types.Integer) for a in args):
        return None
    sig = types.int64(*([types.int64] * 7))

    def codegen(context, builder, signature, values):
        i64 = llvm_ir.IntType(64)
        fnty = llvm_ir.FunctionType(i64, [i64] * 6)
        fn = builder.inttoptr(values[0], llvm_ir.PointerType(fnty))
        return builder.call(fn, list(values[1:]))

    return sig, codegen


@intrinsic
def call_int(typingctx, address):
    """Call the C function ``int f(void)`` at ``address`` (an address found once in Python and passed in, so
    the calling function stays cacheable) and return its result as an int64."""
    if not isinstance(address, types.Integer):
        return None
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        i32 = llvm_ir.IntType(32)
        fn = builder.inttoptr(args[0], llvm_ir.PointerType(llvm_ir.FunctionType(i32, [])))
        return builder.sext(builder.call(fn, []), llvm_ir.IntType(64))

    return sig, codegen
