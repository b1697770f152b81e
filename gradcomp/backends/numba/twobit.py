"""2-bit kernels (the counterpart of ``csrc/twobit.cu``): one fused pass over memory each.

Element ``i``'s code sits in bits ``2 * (i % 4)`` of byte ``i // 4`` of the little-endian
code stream, which is exactly the documented word layout (bits ``2 * (i % 16)`` of word
``i // 16``). The kernels therefore work on the codes as bytes, in two steps per block of
:data:`~gradcomp.backends.numba.common.BLOCK` elements, both flat loops over contiguous
memory that LLVM vectorises: one code byte per element into an L1-resident scratch buffer
(fused with the residual update), then four code bytes to one packed byte with shifts and
ors. Packing 16 codes into a word in one loop would make LLVM vectorise across words with
strided gathers.

Hot loops run over unsigned indices: a signed index makes Numba emit negative-index
wraparound, which blocks LLVM's vectoriser.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from gradcomp.backends.numba.common import BLOCK, INF32, NAN32, load, residual_target

#: Parallel grain: blocks are dealt to at most this many parts.
MAX_PARTS = 64
_U32_6, _U32_12, _U32_18 = np.uint32(6), np.uint32(12), np.uint32(18)


@njit(cache=True)
def encode_block(grad, residual_in, residual_out, t, lo, hi, scratch):
    """Codes of elements ``[lo, hi)`` into ``scratch[0 : hi - lo]``, one per byte; residual."""
    target = residual_target(residual_in, residual_out)
    neg_t = -t
    base = np.uint64(lo)
    for i in range(base, np.uint64(hi)):
        a = load(grad, i)
        if residual_in is not None:
            a = a + residual_in[i]
        finite = abs(a) < INF32
        positive = finite & (a >= t)
        negative = finite & (a <= neg_t)
        code = np.uint8(positive) | (np.uint8(negative) << np.uint8(1)) | (np.uint8(not finite) * np.uint8(3))
        scratch[i - base] = code
        if residual_out is not None:
            # acc - (-t) == acc + t exactly; a select keeps acc's bits untouched otherwise.
            target[i] = a - (t if positive else neg_t) if (positive | negative) else a


@njit(cache=True)
def pack_block(scratch_u32, code_bytes, first, count):
    """Code bytes ``[first, first + count)`` from ``4 * count`` scratch codes."""
    start = np.uint64(first)
    for q in range(np.uint64(count)):
        x = scratch_u32[q]  # four codes, one per byte
        code_bytes[start + q] = np.uint8((x | (x >> _U32_6) | (x >> _U32_12) | (x >> _U32_18)) & np.uint32(0xFF))


@njit(parallel=True, cache=True)
def compress_kernel(grad, residual_in, residual_out, t, code_bytes):
    """Codes of ``acc = grad + residual_in`` into ``code_bytes``, residual into ``residual_out``.

    ``code_bytes`` is uint8 ``[4 * ceil(n / 16)]`` (the int32 words as bytes); codes past
    ``n`` are written as 0. ``residual_out`` is an array, ``None``, or ``True`` (in place).
    """
    n = grad.size
    padded = code_bytes.size * 4  # elements the words cover; codes past n stay 0
    nblocks = (padded + BLOCK - 1) // BLOCK
    nparts = min(nblocks, MAX_PARTS)
    for p in prange(nparts):
        scratch = np.zeros(BLOCK, np.uint8)
        scratch_u32 = scratch.view(np.uint32)
        for b in range(p * nblocks // nparts, (p + 1) * nblocks // nparts):
            lo = b * BLOCK
            hi = min(lo + BLOCK, n)
            if hi - lo < BLOCK:
                scratch[:] = 0
            encode_block(grad, residual_in, residual_out, t, lo, hi, scratch)
            pack_block(scratch_u32, code_bytes, lo // 4, (min(lo + BLOCK, padded) - lo) // 4)


@njit(cache=True)
def unpack_block(code_bytes, first, count, scratch_u32):
    """Inverse of :func:`pack_block`: one code per scratch byte."""
    start = np.uint64(first)
    for q in range(np.uint64(count)):
        b = np.uint32(code_bytes[start + q])
        scratch_u32[q] = (b | (b << _U32_6) | (b << _U32_12) | (b << _U32_18)) & np.uint32(0x03030303)


@njit(cache=True)
def decode_block(scratch, t, out, lo, hi):
    """``out[lo:hi] += decoded`` from one code per scratch byte."""
    neg_t = -t
    zero = np.float32(0.0)
    base = np.uint64(lo)
    for i in range(base, np.uint64(hi)):
        code = scratch[i - base]
        # Always add, even 0: torch's ``out + 0.0`` turns -0.0 into +0.0.
        out[i] = out[i] + (t if code == 1 else (neg_t if code == 2 else (zero if code == 0 else NAN32)))


@njit(parallel=True, cache=True)
def decompress_add_kernel(code_bytes, t, out):
    """``out += decode(code_bytes)``; ``code_bytes`` must cover ``out.size`` codes (the
    wrapper checks ``4 * ceil(n / 16)`` bytes), so every read and write is in bounds."""
    n = out.size
    nblocks = (n + BLOCK - 1) // BLOCK
    nparts = min(nblocks, MAX_PARTS)
    for p in prange(nparts):
        scratch = np.zeros(BLOCK, np.uint8)
        scratch_u32 = scratch.view(np.uint32)
        for b in range(p * nblocks // nparts, (p + 1) * nblocks // nparts):
            lo = b * BLOCK
            hi = min(lo + BLOCK, n)
            unpack_block(code_bytes, lo // 4, (hi - lo + 3) // 4, scratch_u32)
            decode_block(scratch, t, out, lo, hi)
