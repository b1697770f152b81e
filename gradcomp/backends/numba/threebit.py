"""Chunk-scaled 3-bit kernels (the counterpart of ``csrc/threebit.cu``).

The unit of work is a tile of :data:`TILE` elements: five 128-element chunks (five scales) and
64 whole code words, so no word is shared between tiles. A tile's compensated values are loaded
once into a scratch row; its scales, codes and residuals are written from the row, so memory is
read and written once. The arithmetic is the contract of :mod:`gradcomp.backends` step by step
(``max / 3.0f``, ``rint(acc / s)`` clamped to ``[-3, 3]``, ``float(code - 3) * s``), all float32.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from gradcomp.backends.numba.common import INF32, NAN32, load_acc, residual_target

CHUNK = 128
PER_WORD = 10
TILE = 5 * CHUNK  # the smallest whole number of chunks that is also a whole number of words
TILE_WORDS = TILE // PER_WORD
#: Tiles per parallel part: enough work per thread to amortise the scheduling.
PART_TILES = 256
LEVELS = np.float32(3.0)
NONFINITE = 7


@njit(cache=True)
def quantize(a, s):
    """``(code, decoded)`` of the finite float32 ``a`` at scale ``s``."""
    if not s > np.float32(0.0):
        return 3, np.float32(0.0) * s
    q = min(max(np.rint(a / s), -LEVELS), LEVELS)
    code = np.int64(q) + 3
    return code, np.float32(code - 3) * s


@njit(cache=True)
def encode_tile(grad, residual_in, residual_out, t, n, acc, code_words, scales):
    """Scales, codes and residuals of tile ``t`` (elements ``640t .. min(640t + 640, n)``)."""
    target = residual_target(residual_in, residual_out)
    lo = t * TILE
    length = min(TILE, n - lo)
    for j in range(length):
        acc[j] = load_acc(grad, residual_in, lo + j)
    for c in range((length + CHUNK - 1) // CHUNK):
        largest = np.float32(0.0)
        for j in range(c * CHUNK, min(length, (c + 1) * CHUNK)):
            m = abs(acc[j])
            if m < INF32 and m > largest:
                largest = m
        scales[t * (TILE // CHUNK) + c] = largest / LEVELS
    for w in range((length + PER_WORD - 1) // PER_WORD):
        packed = np.uint32(0)
        for b in range(min(PER_WORD, length - w * PER_WORD)):
            j = w * PER_WORD + b
            a = acc[j]
            code, residual = NONFINITE, a
            if abs(a) < INF32:
                code, decoded = quantize(a, scales[t * (TILE // CHUNK) + j // CHUNK])
                residual = a - decoded
            packed |= np.uint32(code) << np.uint32(3 * b)
            if residual_out is not None:
                target[lo + j] = residual
        code_words[t * TILE_WORDS + w] = packed


@njit(parallel=True, cache=True)
def compress_kernel(grad, residual_in, residual_out, code_words, scales):
    """Codes of ``acc = grad + residual_in`` into uint32 ``code_words`` ``[ceil(n / 10)]`` and float32
    ``scales`` ``[ceil(n / 128)]``, residual into ``residual_out`` (array, ``None`` or ``True``: in place)."""
    n = grad.size
    tiles = (n + TILE - 1) // TILE
    parts = (tiles + PART_TILES - 1) // PART_TILES
    for p in prange(parts):
        acc = np.empty(TILE, np.float32)
        for t in range(p * PART_TILES, min(tiles, (p + 1) * PART_TILES)):
            encode_tile(grad, residual_in, residual_out, t, n, acc, code_words, scales)


@njit(parallel=True, cache=True)
def decompress_add_kernel(code_words, scales, out):
    """``out += decode(code_words, scales)``; the wrapper checks ``ceil(n / 10)`` words and
    ``ceil(n / 128)`` scales, so every read and write is in bounds."""
    n = out.size
    tiles = (n + TILE - 1) // TILE
    for t in prange(tiles):
        for i in range(t * TILE, min(n, (t + 1) * TILE)):
            code = np.int64((code_words[i // PER_WORD] >> np.uint32(3 * (i % PER_WORD))) & np.uint32(7))
            # Always add, even 0: torch's ``out + 0.0`` turns -0.0 into +0.0.
            decoded = NAN32 if code == NONFINITE else np.float32(code - 3) * scales[i // CHUNK]
            out[i] = out[i] + decoded
