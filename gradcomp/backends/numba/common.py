"""Compiled helpers shared by the kernels: bit casts, half-precision conversions, typed
loads and stores, and the in-place residual target (the counterpart of
``csrc/gradcomp_common.cuh``).

Half-precision tensors reach the kernels as their raw bits, and the integer dtype names
the format: ``int16`` holds IEEE float16, ``uint16`` holds bfloat16. :func:`load` and
:func:`store` convert with integer arithmetic that reproduces torch's CPU casts exactly
(round to nearest even; NaN as torch's vectorised CPU copy writes it: float32 to bfloat16
gives ``0xFFFF``, float32 to float16 keeps the sign and top payload bits, like
``vcvtps2ph``).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit
from numba.extending import intrinsic, overload

types = numba.types

#: Elements per L1-resident scratch block of the 2-bit and top-k passes; a multiple of 16.
BLOCK = 8192
#: The top-k key of every NaN (and the mask that takes ``|x|`` from float32 bits).
MAGNITUDE = 0x7FFFFFFF

INF32 = np.float32(np.inf)
NAN32 = np.float32(np.nan)
_TWO_POW_M112 = np.float32(2.0**-112)
_TWO_POW_P112 = np.float32(2.0**112)
_TWO_POW_M110 = np.float32(2.0**-110)
_HALF = np.float32(0.5)


# ----------------------------------------------------------------------------------------
# Bit casts.
# ----------------------------------------------------------------------------------------


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of the integer ``bits``."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        width = value.type.width
        if width > 32:
            value = builder.trunc(value, ir.IntType(32))
        elif width < 32:
            value = builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def bits_of_f32(typingctx, value):
    """The bit pattern of the float32 ``value`` as a non-negative int64 (< 2**32)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        raw = builder.bitcast(args[0], ir.IntType(32))
        return builder.zext(raw, ir.IntType(64))

    return types.int64(value), codegen


@intrinsic
def key_of_f32(typingctx, value):
    """The top-k ordering key of ``value`` as an int32: ``bits(|value|)``, and
    ``0x7FFFFFFF`` for every NaN (so NaN > inf > finite, and NaN payloads tie)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        magnitude = builder.and_(builder.bitcast(args[0], i32), ir.Constant(i32, MAGNITUDE))
        is_nan = builder.icmp_signed(">", magnitude, ir.Constant(i32, 0x7F800000))
        return builder.select(is_nan, ir.Constant(i32, MAGNITUDE), magnitude)

    return types.int32(value), codegen


@njit(cache=True)
def key_of_bits(bits):
    """:func:`key_of_f32` of the float32 whose bits are ``bits``, as an int64."""
    magnitude = bits & MAGNITUDE
    return MAGNITUDE if magnitude > 0x7F800000 else magnitude


# ----------------------------------------------------------------------------------------
# Half-precision conversions.
# ----------------------------------------------------------------------------------------


@njit(cache=True)
def f16_bits_to_f32(h):
    """IEEE half bits to float32, exact; a signalling NaN comes out quiet (as F16C does)."""
    w = (np.int64(h) & 0xFFFF) << 16
    sign = w & 0x80000000
    two_w = (w + w) & 0xFFFFFFFF
    # Normal, inf, NaN: rebias the exponent by integer add, then scale by 2**-112.
    normalized = f32_from_bits((two_w >> 4) + (0xE0 << 23)) * _TWO_POW_M112
    # Subnormal: place the mantissa under a 0.5 exponent and subtract 0.5.
    denormalized = f32_from_bits((two_w >> 17) | (126 << 23)) - _HALF
    if two_w < (1 << 27):
        magnitude = bits_of_f32(denormalized)
    else:
        magnitude = bits_of_f32(normalized)
    return f32_from_bits(sign | magnitude)


@njit(cache=True)
def f32_to_f16_bits(f):
    """float32 to IEEE half bits, round to nearest even; NaN keeps sign and top payload."""
    w = bits_of_f32(f)
    sign = (w >> 16) & 0x8000
    shl1_w = (w + w) & 0xFFFFFFFF
    if shl1_w > 0xFF000000:  # NaN
        return sign | 0x7E00 | ((w >> 13) & 0x3FF)
    # Let the float32 adder do the rounding: overflow saturates to inf, tiny values
    # round into the half subnormal range.
    base = (abs(f) * _TWO_POW_P112) * _TWO_POW_M110
    bias = shl1_w & 0xFF000000
    if bias < 0x71000000:
        bias = 0x71000000
    base = f32_from_bits((bias >> 1) + 0x07800000) + base
    bits = bits_of_f32(base)
    return sign | (((bits >> 13) & 0x7C00) + (bits & 0x0FFF))


@njit(cache=True)
def f32_to_bf16_bits(f):
    """float32 to bfloat16 bits, round to nearest even; every NaN becomes ``0xFFFF``."""
    if f != f:
        return 0xFFFF
    w = bits_of_f32(f)
    return (w + 0x7FFF + ((w >> 16) & 1)) >> 16


# ----------------------------------------------------------------------------------------
# Typed loads and stores (float32 arrays and half-precision bit arrays).
# ----------------------------------------------------------------------------------------


def load(array, i):
    """``float32(array[i])`` for float32 arrays and half-precision bit arrays."""


@overload(load)
def _load_impl(array, i):
    if array.dtype == types.float32:
        return lambda array, i: array[i]
    if array.dtype == types.uint16:  # bfloat16 bits
        return lambda array, i: f32_from_bits(np.int64(array[i]) << 16)
    if array.dtype == types.int16:  # float16 bits
        return lambda array, i: f16_bits_to_f32(array[i])
    return None


def store(array, i, value):
    """``array[i] = value`` cast to the array's format; returns ``float32(array[i])``."""


@overload(store)
def _store_impl(array, i, value):
    if array.dtype == types.float32:

        def store_f32(array, i, value):
            array[i] = value
            return value

        return store_f32
    if array.dtype == types.uint16:

        def store_bf16(array, i, value):
            bits = f32_to_bf16_bits(value)
            array[i] = bits
            return f32_from_bits(bits << 16)

        return store_bf16
    if array.dtype == types.int16:

        def store_f16(array, i, value):
            bits = f32_to_f16_bits(value)
            array[i] = bits
            return f16_bits_to_f32(bits)

        return store_f16
    return None


def roundtrip(array, value):
    """``float32(value cast to the array's format)``, without storing it."""


@overload(roundtrip)
def _roundtrip_impl(array, value):
    if array.dtype == types.float32:
        return lambda array, value: value
    if array.dtype == types.uint16:
        return lambda array, value: f32_from_bits(f32_to_bf16_bits(value) << 16)
    if array.dtype == types.int16:
        return lambda array, value: f16_bits_to_f32(f32_to_f16_bits(value))
    return None


@njit(cache=True)
def load_acc(grad, residual_in, i):
    """The compensated value ``float32(grad[i]) + residual_in[i]`` (no residual: ``grad[i]``)."""
    a = load(grad, i)
    if residual_in is not None:
        a = a + residual_in[i]
    return a


# ----------------------------------------------------------------------------------------
# Residual targets: in place or not.
# ----------------------------------------------------------------------------------------


def residual_target(residual_in, residual_out):
    """The array that receives the residual: ``residual_in`` itself when ``residual_out``
    is the in-place marker ``True``, else ``residual_out``."""


@overload(residual_target)
def _residual_target_impl(residual_in, residual_out):
    # In place, the kernel reads and writes one array, so LLVM sees a dependence distance
    # of 0 and vectorises; two arguments that alias would fail its runtime overlap check
    # and drop to the scalar loop.
    if isinstance(residual_out, types.Boolean):
        return lambda residual_in, residual_out: residual_in
    return lambda residual_in, residual_out: residual_out
