"""CPU kernels compiled by Numba: the fast path for CPU tensors.

Contracts are in :mod:`gradcomp.backends`; these kernels are tested bit for bit against
:mod:`gradcomp.backends.torch_ops`. Every kernel is ``@njit(parallel=True, cache=True)``
and uses the threads Numba is allowed (``numba.set_num_threads``); this module never
changes that, so a launcher that pins one thread per rank keeps control.

Design notes:

* **Zero copy.** Tensors reach the kernels as NumPy views of their memory. Numba has no
  float16 arithmetic on CPU, so half-precision tensors travel as their raw bits and the
  integer dtype names the format: ``int16`` holds IEEE float16, ``uint16`` holds bfloat16
  (see :func:`_as_array`). :func:`_load` and :func:`_store` convert bits with integer
  arithmetic that reproduces torch's CPU casts exactly (round to nearest even; NaN as
  torch's vectorised CPU copy writes it: float32 to bfloat16 gives ``0xFFFF``, float32
  to float16 keeps the sign and top payload bits, like ``vcvtps2ph``).
* **Vectorisation.** Hot loops run over unsigned indices (a signed index makes Numba
  emit negative-index wraparound, which blocks LLVM's vectoriser). An in-place residual
  is passed as one array (``residual_out=True`` inside, see :func:`_residual_target`),
  because two aliasing arrays would fail LLVM's runtime overlap check and run the
  scalar fallback loop.
* **2-bit** is one fused pass over memory: per block of elements, a vectorised loop
  reads ``grad`` (and the residual), writes ``residual_out`` and one code per byte into
  an L1-resident scratch buffer, and a second vectorised loop packs four codes per byte
  straight into the code words (see the section comment).
* **Top-k** is an exact radix select on the key ``bits(|acc|)`` (31 bits, every NaN
  counted as ``0x7FFFFFFF``; NaN > inf > finite, as the contract wants):

  1. pass 1 over the data computes ``acc``, writes ``residual_out = acc`` and per-chunk
     histograms of the top 11 key bits (8 exponent + 3 mantissa bits);
  2. the merged histogram names the bin ``b1`` holding the k-th largest key. Pass 2
     collects, chunk by chunk and in index order, every element whose key is in ``b1``
     or above (``k`` plus part of one bin) and the keys of bin ``b1``; the elements
     above ``b1`` are selected whatever happens, so their residual is settled while
     their cache lines are hot;
  3. two small histograms over the keys of bin ``b1`` (next 11 bits, last 9 bits) give
     the exact k-th key ``T`` and how many of the ties at ``T`` to take; ties go to the
     lower index because chunks hand them out in index order;
  4. a last pass over the candidates writes values and indices (ascending) and the
     residual of the selected keys of bin ``b1``.

  Everything that decides the selection is an integer count, so the result does not
  depend on the thread count. The chunk count depends on ``n`` only (never on the
  number of threads); any partition into index-ordered chunks gives the same output,
  the count only sets the parallel grain.

Kernels hold the GIL (no ``nogil``), so two Python threads never run them at once; that
keeps Numba's non-thread-safe ``workqueue`` threading layer safe to use, and lets the
top-k workspace be shared.
"""
from __future__ import annotations

import functools
import sys
import threading

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic, overload

types = numba.types

if sys.byteorder != "little":  # the 2-bit kernels address the code words as bytes
    raise ImportError("the numba backend assumes a little-endian CPU")

from gradcomp.backends import register

# ----------------------------------------------------------------------------------------
# Bit casts and half-precision conversions (compiled helpers).
# ----------------------------------------------------------------------------------------


@intrinsic
def _f32_from_bits(typingctx, bits):
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
def _bits_of_f32(typingctx, value):
    """The bit pattern of the float32 ``value`` as a non-negative int64 (< 2**32)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        raw = builder.bitcast(args[0], ir.IntType(32))
        return builder.zext(raw, ir.IntType(64))

    return types.int64(value), codegen


@intrinsic
def _key_of_f32(typingctx, value):
    """The top-k ordering key of ``value`` as an int32: ``bits(|value|)``, and
    ``0x7FFFFFFF`` for every NaN (so NaN > inf > finite, and NaN payloads tie)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        magnitude = builder.and_(builder.bitcast(args[0], i32), ir.Constant(i32, 0x7FFFFFFF))
        is_nan = builder.icmp_signed(">", magnitude, ir.Constant(i32, 0x7F800000))
        return builder.select(is_nan, ir.Constant(i32, 0x7FFFFFFF), magnitude)

    return types.int32(value), codegen


_TWO_POW_M112 = np.float32(2.0**-112)
_TWO_POW_P112 = np.float32(2.0**112)
_TWO_POW_M110 = np.float32(2.0**-110)
_HALF = np.float32(0.5)
_INF32 = np.float32(np.inf)
_NAN32 = np.float32(np.nan)


@njit(cache=True)
def _f16_bits_to_f32(h):
    """IEEE half bits to float32, exact; a signalling NaN comes out quiet (as F16C does)."""
    w = (np.int64(h) & 0xFFFF) << 16
    sign = w & 0x80000000
    two_w = (w + w) & 0xFFFFFFFF
    # Normal, inf, NaN: rebias the exponent by integer add, then scale by 2**-112.
    normalized = _f32_from_bits((two_w >> 4) + (0xE0 << 23)) * _TWO_POW_M112
    # Subnormal: place the mantissa under a 0.5 exponent and subtract 0.5.
    denormalized = _f32_from_bits((two_w >> 17) | (126 << 23)) - _HALF
    if two_w < (1 << 27):
        magnitude = _bits_of_f32(denormalized)
    else:
        magnitude = _bits_of_f32(normalized)
    return _f32_from_bits(sign | magnitude)


@njit(cache=True)
def _f32_to_f16_bits(f):
    """float32 to IEEE half bits, round to nearest even; NaN keeps sign and top payload."""
    w = _bits_of_f32(f)
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
    base = _f32_from_bits((bias >> 1) + 0x07800000) + base
    bits = _bits_of_f32(base)
    return sign | (((bits >> 13) & 0x7C00) + (bits & 0x0FFF))


@njit(cache=True)
def _f32_to_bf16_bits(f):
    """float32 to bfloat16 bits, round to nearest even; every NaN becomes ``0xFFFF``."""
    if f != f:
        return 0xFFFF
    w = _bits_of_f32(f)
    return (w + 0x7FFF + ((w >> 16) & 1)) >> 16


def _load(array, i):
    """``float32(array[i])`` for float32 arrays and half-precision bit arrays."""


@overload(_load)
def _load_impl(array, i):
    if array.dtype == types.float32:
        return lambda array, i: array[i]
    if array.dtype == types.uint16:  # bfloat16 bits
        return lambda array, i: _f32_from_bits(np.int64(array[i]) << 16)
    if array.dtype == types.int16:  # float16 bits
        return lambda array, i: _f16_bits_to_f32(array[i])
    return None


def _store(array, i, value):
    """``array[i] = value`` cast to the array's format; returns ``float32(array[i])``."""


@overload(_store)
def _store_impl(array, i, value):
    if array.dtype == types.float32:

        def store_f32(array, i, value):
            array[i] = value
            return value

        return store_f32
    if array.dtype == types.uint16:

        def store_bf16(array, i, value):
            bits = _f32_to_bf16_bits(value)
            array[i] = bits
            return _f32_from_bits(bits << 16)

        return store_bf16
    if array.dtype == types.int16:

        def store_f16(array, i, value):
            bits = _f32_to_f16_bits(value)
            array[i] = bits
            return _f16_bits_to_f32(bits)

        return store_f16
    return None


def _roundtrip(array, value):
    """``float32(value cast to the array's format)``, without storing it."""


@overload(_roundtrip)
def _roundtrip_impl(array, value):
    if array.dtype == types.float32:
        return lambda array, value: value
    if array.dtype == types.uint16:
        return lambda array, value: _f32_from_bits(_f32_to_bf16_bits(value) << 16)
    if array.dtype == types.int16:
        return lambda array, value: _f16_bits_to_f32(_f32_to_f16_bits(value))
    return None


# ----------------------------------------------------------------------------------------
# Residual targets: in place or not.
# ----------------------------------------------------------------------------------------


def _residual_target(residual_in, residual_out):
    """The array that receives the residual: ``residual_in`` itself when ``residual_out``
    is the in-place marker ``True``, else ``residual_out``."""


@overload(_residual_target)
def _residual_target_impl(residual_in, residual_out):
    # In place, the kernel reads and writes one array, so LLVM sees a dependence distance
    # of 0 and vectorises; two arguments that alias would fail its runtime overlap check
    # and drop to the scalar loop.
    if isinstance(residual_out, types.Boolean):
        return lambda residual_in, residual_out: residual_in
    return lambda residual_in, residual_out: residual_out


# ----------------------------------------------------------------------------------------
# 2-bit.
#
# Element i's code sits in bits 2 * (i % 4) of byte i // 4 of the little-endian code
# stream, which is exactly the documented word layout. The kernels therefore work on the
# codes as bytes, in two steps per block of _BLOCK elements, both flat loops over
# contiguous memory that LLVM vectorises: one code byte per element into an L1-resident
# scratch buffer (fused with the residual update), then four code bytes to one packed
# byte with shifts and ors. Packing 16 codes into a word in one loop would make LLVM
# vectorise across words with strided gathers.
# ----------------------------------------------------------------------------------------

_BLOCK = 8192  # elements per scratch block; a multiple of 16
_MAX_PARTS = 64  # parallel grain: blocks are dealt to at most this many parts
_U32_6, _U32_12, _U32_18 = np.uint32(6), np.uint32(12), np.uint32(18)


@njit(cache=True)
def _twobit_encode_block(grad, residual_in, residual_out, t, lo, hi, scratch):
    """Codes of elements ``[lo, hi)`` into ``scratch[0 : hi - lo]``, one per byte; residual."""
    target = _residual_target(residual_in, residual_out)
    neg_t = -t
    base = np.uint64(lo)
    for i in range(base, np.uint64(hi)):
        a = _load(grad, i)
        if residual_in is not None:
            a = a + residual_in[i]
        finite = abs(a) < _INF32
        positive = finite & (a >= t)
        negative = finite & (a <= neg_t)
        code = np.uint8(positive) | (np.uint8(negative) << np.uint8(1)) | (np.uint8(not finite) * np.uint8(3))
        scratch[i - base] = code
        if residual_out is not None:
            # acc - (-t) == acc + t exactly; a select keeps acc's bits untouched otherwise.
            target[i] = a - (t if positive else neg_t) if (positive | negative) else a


@njit(cache=True)
def _twobit_pack_block(scratch_u32, code_bytes, first, count):
    """Code bytes ``[first, first + count)`` from ``4 * count`` scratch codes."""
    start = np.uint64(first)
    for q in range(np.uint64(count)):
        x = scratch_u32[q]  # four codes, one per byte
        code_bytes[start + q] = np.uint8((x | (x >> _U32_6) | (x >> _U32_12) | (x >> _U32_18)) & np.uint32(0xFF))


@njit(parallel=True, cache=True)
def _twobit_compress_kernel(grad, residual_in, residual_out, t, code_bytes):
    n = grad.size
    padded = code_bytes.size * 4  # elements the words cover; codes past n stay 0
    nblocks = (padded + _BLOCK - 1) // _BLOCK
    nparts = min(nblocks, _MAX_PARTS)
    for p in prange(nparts):
        scratch = np.zeros(_BLOCK, np.uint8)
        scratch_u32 = scratch.view(np.uint32)
        for b in range(p * nblocks // nparts, (p + 1) * nblocks // nparts):
            lo = b * _BLOCK
            hi = min(lo + _BLOCK, n)
            if hi - lo < _BLOCK:
                scratch[:] = 0
            _twobit_encode_block(grad, residual_in, residual_out, t, lo, hi, scratch)
            _twobit_pack_block(scratch_u32, code_bytes, lo // 4, (min(lo + _BLOCK, padded) - lo) // 4)


@njit(cache=True)
def _twobit_unpack_block(code_bytes, first, count, scratch_u32):
    """Inverse of :func:`_twobit_pack_block`: one code per scratch byte."""
    start = np.uint64(first)
    for q in range(np.uint64(count)):
        b = np.uint32(code_bytes[start + q])
        scratch_u32[q] = (b | (b << _U32_6) | (b << _U32_12) | (b << _U32_18)) & np.uint32(0x03030303)


@njit(cache=True)
def _twobit_decode_block(scratch, t, out, lo, hi):
    neg_t = -t
    zero = np.float32(0.0)
    base = np.uint64(lo)
    for i in range(base, np.uint64(hi)):
        code = scratch[i - base]
        # Always add, even 0: torch's ``out + 0.0`` turns -0.0 into +0.0.
        out[i] = out[i] + (t if code == 1 else (neg_t if code == 2 else (zero if code == 0 else _NAN32)))


@njit(parallel=True, cache=True)
def _twobit_decompress_add_kernel(code_bytes, t, out):
    n = out.size
    nblocks = (n + _BLOCK - 1) // _BLOCK
    nparts = min(nblocks, _MAX_PARTS)
    for p in prange(nparts):
        scratch = np.zeros(_BLOCK, np.uint8)
        scratch_u32 = scratch.view(np.uint32)
        for b in range(p * nblocks // nparts, (p + 1) * nblocks // nparts):
            lo = b * _BLOCK
            hi = min(lo + _BLOCK, n)
            _twobit_unpack_block(code_bytes, lo // 4, (hi - lo + 3) // 4, scratch_u32)
            _twobit_decode_block(scratch, t, out, lo, hi)


# ----------------------------------------------------------------------------------------
# Top-k.
# ----------------------------------------------------------------------------------------

_MAGNITUDE = 0x7FFFFFFF
_L1_SHIFT = 20  # level 1: key bits 30..20 (2048 bins), counted in pass 1 over all elements
_L2_SHIFT = 9  # level 2: key bits 19..9 (2048 bins), over the boundary bin's keys only
_L1_BINS = 2048
_L2_BINS = 2048
_L3_BINS = 512  # level 3: key bits 8..0
_SUB = 4  # interleaved sub-histograms, so that equal neighbours do not serialise on one counter
_MAX_CHUNKS = 64
_MIN_CHUNK = 65536


@njit(cache=True)
def _key_of_bits(bits):
    """:func:`_key_of_f32` of the float32 whose bits are ``bits``, as an int64."""
    magnitude = bits & _MAGNITUDE
    return _MAGNITUDE if magnitude > 0x7F800000 else magnitude


@njit(cache=True)
def _acc(grad, residual_in, i):
    a = _load(grad, i)
    if residual_in is not None:
        a = a + residual_in[i]
    return a


@njit(cache=True)
def _residual_of_sent(a, sent):
    """``acc - float32(value sent)``, with NaN bits as torch's CPU subtraction gives them:
    it computes ``acc + (-1) * sent`` by FMA, which returns the NaN of ``sent`` (quiet)
    when both are NaN, and a NaN is only ever sent for a NaN ``acc``."""
    return a - sent if sent == sent else sent - a


@njit(cache=True)
def _topk_histogram_chunk(grad, residual_in, residual_out, lo, hi, scratch, sub_hist, hist):
    """Pass 1 on ``[lo, hi)``: ``residual_out = acc``; ``hist`` = counts of the top 11 key bits.

    Per block, a vectorised loop writes ``acc`` and the bin numbers to ``scratch``; a
    scalar loop then counts them into four interleaved histograms.
    """
    target = _residual_target(residual_in, residual_out)
    sub_hist[:] = 0
    h0, h1, h2, h3 = sub_hist[0], sub_hist[1], sub_hist[2], sub_hist[3]
    for start in range(lo, hi, _BLOCK):
        stop = min(start + _BLOCK, hi)
        base = np.uint64(start)
        for i in range(base, np.uint64(stop)):
            a = _acc(grad, residual_in, i)
            if residual_out is not None:
                target[i] = a
            scratch[i - base] = np.uint16(_key_of_f32(a) >> _L1_SHIFT)
        m = stop - start
        quads = m - m % 4
        for j in range(0, quads, 4):
            h0[scratch[j]] += 1
            h1[scratch[j + 1]] += 1
            h2[scratch[j + 2]] += 1
            h3[scratch[j + 3]] += 1
        for j in range(quads, m):
            h0[scratch[j]] += 1
    for b in range(_L1_BINS):
        hist[b] = h0[b] + h1[b] + h2[b] + h3[b]


@njit(cache=True)
def _pick_bin(counts, rank):
    """The bin holding the ``rank``-th largest (1-based), and how many lie in higher bins."""
    above = 0
    for b in range(counts.size - 1, -1, -1):
        if above + counts[b] >= rank:
            return b, above
        above += counts[b]
    return -1, above  # unreachable while rank <= counts.sum()


@njit(cache=True)
def _plan_candidates(hist, k):
    """From the per-chunk level-1 histograms: the boundary bin ``b1``, how many keys lie
    above it, and each chunk's start in the candidate and boundary arrays (each segment
    ends with one slot of slack)."""
    nchunks = hist.shape[0]
    total = np.zeros(_L1_BINS, np.int64)
    for c in range(nchunks):
        for b in range(_L1_BINS):
            total[b] += hist[c, b]
    b1, above1 = _pick_bin(total, k)
    cand_start = np.zeros(nchunks + 1, np.int64)
    bound_start = np.zeros(nchunks + 1, np.int64)
    definite = np.zeros(nchunks, np.int64)  # keys in bins above b1, per chunk
    for c in range(nchunks):
        for b in range(b1 + 1, _L1_BINS):
            definite[c] += hist[c, b]
        # One slot of slack per chunk for the branchless appends of pass 2.
        cand_start[c + 1] = cand_start[c] + definite[c] + hist[c, b1] + 1
        bound_start[c + 1] = bound_start[c] + hist[c, b1] + 1
    return b1, above1, cand_start, bound_start, definite


@njit(cache=True)
def _append_candidate(i, a, flag, values, b1, cand_index, cand_bits, c, boundary, d, target, residual_out):
    """Append element ``i`` (``acc = a``) at cursor ``c`` and its key at ``d`` when it is
    in bin ``b1``; both cursors only advance when ``flag`` (it is a candidate) holds, so
    the call has no branch on the data. Returns the new cursors. ``residual_out`` only
    says whether to settle the residual (in ``target``)."""
    bits = _bits_of_f32(a)
    key = _key_of_bits(bits)
    taken = np.int64(flag)
    in_b1 = taken & np.int64((key >> _L1_SHIFT) == b1)
    cand_index[c] = i
    cand_bits[c] = bits
    boundary[d] = key
    if residual_out is not None:
        # A key above b1 is sent whatever the boundary holds; any other keeps acc, which
        # is what pass 1 wrote.
        target[i] = _residual_of_sent(a, _roundtrip(values, a)) if taken > in_b1 else a
    return c + taken, d + in_b1


@njit(cache=True)
def _topk_collect_chunk(
    grad, residual_in, residual_out, values, b1, lo, hi, flags, cand_index, cand_bits, c0, boundary, d0
):
    """Pass 2 on ``[lo, hi)``: append every key in bin ``b1`` or above (index and bits), in
    index order, and the keys of bin ``b1`` to ``boundary``; settle the residual of the
    keys above ``b1``, which are selected whatever the boundary holds (their lines are in
    cache now, which spares the last pass most of its scattered writes).

    Per block, a vectorised loop flags the candidates in ``flags`` (uint8, a multiple of
    8 long), one byte each. Where candidates are sparse, a scalar loop visits only the set
    bytes, eight flags at a time; where they are dense (more than one in eight), every
    element goes through the branchless append. Appends write at the cursor whether or
    not they advance it, so each chunk's segments end with one slot of slack.
    """
    target = _residual_target(residual_in, residual_out)
    floor = np.int32(b1 << _L1_SHIFT)
    flags_u64 = flags.view(np.uint64)
    c = c0
    d = d0
    for start in range(lo, hi, _BLOCK):
        stop = min(start + _BLOCK, hi)
        base = np.uint64(start)
        flagged = 0
        for i in range(base, np.uint64(stop)):
            if residual_out is not None:
                a = target[i]
            else:
                a = _acc(grad, residual_in, i)
            flag = _key_of_f32(a) >= floor
            flags[i - base] = flag
            flagged += flag
        count = stop - start
        if 8 * flagged > count:
            for i in range(base, np.uint64(stop)):
                a = target[i] if residual_out is not None else _acc(grad, residual_in, i)
                c, d = _append_candidate(
                    i, a, flags[i - base], values, b1, cand_index, cand_bits, c, boundary, d, target, residual_out
                )
            continue
        flags[count : (count + 7) // 8 * 8] = 0  # a partial last word
        for w in range(np.uint64((count + 7) // 8)):
            mask = flags_u64[w]
            while mask != 0:
                i = base + w * np.uint64(8) + (trailing_zeros(mask) >> np.uint64(3))
                mask &= mask - np.uint64(1)
                a = target[i] if residual_out is not None else _acc(grad, residual_in, i)
                c, d = _append_candidate(
                    i, a, True, values, b1, cand_index, cand_bits, c, boundary, d, target, residual_out
                )


@njit(cache=True)
def _plan_selection(boundary, bound_start, definite, b1, rank):
    """The exact k-th key ``T`` (the ``rank``-th largest key of bin ``b1``) and, per chunk,
    how many ties at ``T`` it takes and where its output starts.

    Chunk ``c``'s boundary keys are ``boundary[bound_start[c] : bound_start[c + 1] - 1]``.
    """
    nchunks = definite.size
    hist2 = np.zeros(_L2_BINS, np.int64)
    for c in range(nchunks):
        for j in range(bound_start[c], bound_start[c + 1] - 1):
            hist2[(boundary[j] >> _L2_SHIFT) & (_L2_BINS - 1)] += 1
    b2, above2 = _pick_bin(hist2, rank)
    prefix = (b1 << (_L1_SHIFT - _L2_SHIFT)) | b2
    hist3 = np.zeros(_L3_BINS, np.int64)
    for c in range(nchunks):
        for j in range(bound_start[c], bound_start[c + 1] - 1):
            if (boundary[j] >> _L2_SHIFT) == prefix:
                hist3[boundary[j] & (_L3_BINS - 1)] += 1
    b3, above3 = _pick_bin(hist3, rank - above2)
    threshold = (prefix << _L2_SHIFT) | b3
    ties_left = rank - above2 - above3  # keys equal to the threshold still to take
    ties = np.zeros(nchunks, np.int64)
    out_start = np.zeros(nchunks + 1, np.int64)
    for c in range(nchunks):
        above = definite[c]
        equal = 0
        for j in range(bound_start[c], bound_start[c + 1] - 1):
            above += boundary[j] > threshold
            equal += boundary[j] == threshold
        # Chunks are in index order, so handing ties out chunk by chunk sends the lowest
        # indices first.
        ties[c] = min(equal, ties_left)
        ties_left -= ties[c]
        out_start[c + 1] = out_start[c] + above + ties[c]
    return threshold, ties, out_start


@njit(cache=True)
def _write_chunk(
    cand_index, cand_bits, start, stop, b1, threshold, ties, values, indices, o, end, residual_in, residual_out
):
    """Write the selected candidates ``[start, stop)`` of one chunk to ``values[o:end]`` /
    ``indices[o:end]``, and the residual of the selected boundary keys (pass 2 settled
    the others).

    Each candidate is written at the cursor, which only advances when it is selected, so
    the loop has no branch on the selection; it ends when the chunk's quota is written.
    """
    target = _residual_target(residual_in, residual_out)
    taken = 0
    for j in range(start, stop):
        if o == end:
            break
        bits = cand_bits[j]
        key = _key_of_bits(bits)
        tie = key == threshold
        selected = (key > threshold) | (tie & (taken < ties))
        taken += tie & selected
        a = _f32_from_bits(bits)
        sent = _store(values, o, a)
        index = cand_index[j]
        indices[o] = index
        if residual_out is not None:
            if selected & ((key >> _L1_SHIFT) == b1):
                target[index] = _residual_of_sent(a, sent)
        o += selected


@njit(cache=True)
def _chunk_bounds(n, nchunks):
    step = (n + nchunks - 1) // nchunks
    bounds = np.empty(nchunks + 1, np.int64)
    for c in range(nchunks + 1):
        bounds[c] = min(c * step, n)
    return bounds


@njit(cache=True)
def _take(workspace, size):
    """``workspace[:size]`` when it is large enough, else a fresh array."""
    if size <= workspace.size:
        return workspace[:size]
    return np.empty(size, workspace.dtype)


# Only the loops over chunks run in parallel; the glue between them lives in serial
# helpers, because every array expression in a parallel function would be its own
# fork-join, and those are costly on a busy machine.
@njit(parallel=True, cache=True)
def _topk_compress_kernel(
    grad, residual_in, residual_out, values, indices, nchunks, work_hist, work_index, work_bits, work_bound
):
    """Returns the candidate and boundary counts, so the caller can size the workspace."""
    k = values.size
    bounds = _chunk_bounds(grad.size, nchunks)
    hist = work_hist[:nchunks]
    for c in prange(nchunks):
        scratch = np.empty(_BLOCK, np.uint16)
        sub_hist = np.empty((_SUB, _L1_BINS), np.int32)
        _topk_histogram_chunk(grad, residual_in, residual_out, bounds[c], bounds[c + 1], scratch, sub_hist, hist[c])

    b1, above1, cand_start, bound_start, definite = _plan_candidates(hist, k)
    cand_index = _take(work_index, cand_start[nchunks])
    cand_bits = _take(work_bits, cand_start[nchunks])
    boundary = _take(work_bound, bound_start[nchunks])
    for c in prange(nchunks):
        flags = np.empty(_BLOCK, np.uint8)
        _topk_collect_chunk(
            grad, residual_in, residual_out, values, b1, bounds[c], bounds[c + 1], flags,
            cand_index, cand_bits, cand_start[c], boundary, bound_start[c],
        )

    threshold, ties, out_start = _plan_selection(boundary, bound_start, definite, b1, k - above1)
    for c in prange(nchunks):
        _write_chunk(
            cand_index, cand_bits, cand_start[c], cand_start[c + 1] - 1, b1, threshold, ties[c],
            values, indices, out_start[c], out_start[c + 1], residual_in, residual_out,
        )
    return cand_start[nchunks], bound_start[nchunks]


@njit(parallel=True, cache=True)
def _topk_decompress_add_kernel(values, indices, out):
    for j in prange(values.size):
        i = indices[j]
        out[i] = out[i] + _load(values, j)


# ----------------------------------------------------------------------------------------
# Registered ops: thin wrappers from torch tensors to NumPy views.
# ----------------------------------------------------------------------------------------

# Half-precision tensors cross into Numba as their bits; the integer dtype names the format.
_HALF_BITS = {torch.float16: np.int16, torch.bfloat16: np.uint16}


def _as_array(tensor):
    """A zero-copy NumPy view of a CPU contiguous tensor (half formats as bits), or None."""
    if tensor is None:
        return None
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"numba backend needs contiguous CPU tensors, got {tensor.device} shape {tuple(tensor.shape)}")
    bits = _HALF_BITS.get(tensor.dtype)
    if bits is None:
        return tensor.numpy()
    return tensor.view(torch.int16).numpy().view(bits)


_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(name: str, tensor, dtypes) -> None:
    if tensor is not None and tensor.dtype not in dtypes:
        raise TypeError(f"numba backend: {name} must be {' or '.join(map(str, dtypes))}, got {tensor.dtype}")


def _residual_arg(residual_in, residual_out):
    """``residual_out`` for a kernel: ``True`` when it is ``residual_in`` (in place)."""
    if residual_out is not None and residual_in is not None and residual_out.data_ptr() == residual_in.data_ptr():
        return True
    return _as_array(residual_out)


# Grow-only scratch for the top-k histograms and candidates, reused across calls: fresh
# buffers of a few MiB would be page-faulted in on every call, which costs several percent
# of a call. Parallel kernels release the GIL while they run, and DDP calls them from two
# threads at once (compress on the backward thread, decompress in Gloo's callback
# thread), so every op runs under _KERNEL_LOCK: that guards this scratch and keeps
# Numba's threading layers (workqueue aborts on concurrent launches) out of trouble.
_HIST_WORKSPACE = np.empty((_MAX_CHUNKS, _L1_BINS), np.int64)
_KERNEL_LOCK = threading.Lock()


def _serialized(op):
    """Run ``op`` under :data:`_KERNEL_LOCK` (see above)."""

    @functools.wraps(op)
    def locked(*args, **kwargs):
        with _KERNEL_LOCK:
            return op(*args, **kwargs)

    return locked
_TOPK_WORKSPACE = {}


def _topk_workspace(index_dtype):
    work = _TOPK_WORKSPACE.get(index_dtype)
    if work is None:
        work = (np.empty(0, index_dtype), np.empty(0, np.int32), np.empty(0, np.int32))
        _TOPK_WORKSPACE[index_dtype] = work
    return work


_MAX_WORKSPACE = 1 << 22  # entries; rarer, larger needs allocate per call


def _grow_topk_workspace(index_dtype, candidates: int, boundary: int) -> None:
    work_index, work_bits, work_bound = _TOPK_WORKSPACE[index_dtype]
    candidates, boundary = min(candidates, _MAX_WORKSPACE), min(boundary, _MAX_WORKSPACE)
    if candidates > work_index.size:
        work_index = np.empty(candidates + candidates // 4, index_dtype)
        work_bits = np.empty(work_index.size, np.int32)
    if boundary > work_bound.size:
        work_bound = np.empty(boundary + boundary // 4, np.int32)
    _TOPK_WORKSPACE[index_dtype] = (work_index, work_bits, work_bound)


def _chunks(n: int) -> int:
    """Top-k chunk count: a function of ``n`` only, so never of the thread count."""
    return max(1, min(_MAX_CHUNKS, n // _MIN_CHUNK))


@register("twobit_compress", "numba")
@_serialized
def twobit_compress(grad, residual_in, residual_out, threshold: float, codes) -> None:
    _check("grad", grad, _GRAD_DTYPES)
    _check("residual_in", residual_in, (torch.float32,))
    _check("residual_out", residual_out, (torch.float32,))
    _check("codes", codes, (torch.int32,))
    if codes.numel() != (grad.numel() + 15) // 16:
        raise ValueError(f"codes must have ceil(n / 16) = {(grad.numel() + 15) // 16} words, got {codes.numel()}")
    _twobit_compress_kernel(
        _as_array(grad), _as_array(residual_in), _residual_arg(residual_in, residual_out), np.float32(threshold),
        _as_array(codes).view(np.uint8),
    )


@register("twobit_decompress_add", "numba")
@_serialized
def twobit_decompress_add(codes, threshold: float, out) -> None:
    _check("codes", codes, (torch.int32,))
    _check("out", out, (torch.float32,))
    if codes.numel() != (out.numel() + 15) // 16:
        raise ValueError(f"codes must have ceil(n / 16) = {(out.numel() + 15) // 16} words, got {codes.numel()}")
    _twobit_decompress_add_kernel(_as_array(codes).view(np.uint8), np.float32(threshold), _as_array(out))


@register("topk_compress", "numba")
@_serialized
def topk_compress(grad, residual_in, residual_out, values, indices) -> None:
    _check("grad", grad, _GRAD_DTYPES)
    _check("residual_in", residual_in, (torch.float32,))
    _check("residual_out", residual_out, (torch.float32,))
    _check("values", values, _GRAD_DTYPES)
    _check("indices", indices, (torch.int32, torch.int64))
    n, k = grad.numel(), values.numel()
    if not 0 <= k <= n or indices.numel() != k:
        raise ValueError(
            f"topk_compress needs k <= n values and k indices; got n={n}, {k} values, {indices.numel()} indices"
        )
    if k == 0:  # nothing is sent (TopK gives k = 0 only for an empty tensor): residual = acc
        if residual_out is not None:
            residual_out.copy_(grad.float() if residual_in is None else grad.float() + residual_in)
        return
    index_dtype = _as_array(indices).dtype
    work_index, work_bits, work_bound = _topk_workspace(index_dtype)
    needed = _topk_compress_kernel(
        _as_array(grad), _as_array(residual_in), _residual_arg(residual_in, residual_out),
        _as_array(values), _as_array(indices), _chunks(n), _HIST_WORKSPACE, work_index, work_bits, work_bound,
    )
    _grow_topk_workspace(index_dtype, *needed)


@register("topk_decompress_add", "numba")
@_serialized
def topk_decompress_add(values, indices, out) -> None:
    _check("values", values, _GRAD_DTYPES)
    _check("indices", indices, (torch.int32, torch.int64))
    _check("out", out, (torch.float32,))
    _topk_decompress_add_kernel(_as_array(values), _as_array(indices), _as_array(out))


