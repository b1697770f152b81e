"""Chunk-scaled 2-bit kernels (the counterpart of ``csrc/twobit_chunk.cu``).

Each chunk of :data:`CHUNK` elements is one unit of work: its 64 compensated values are loaded
once into a scratch row, the two halving-tree sums (mean magnitude, then the mean of the kept
magnitudes) run on copies of it, and the chunk's four code words, its scale and its residuals
are written from the row, so memory is read and written once. The arithmetic follows the
contract of :mod:`gradcomp.backends` step by step (float32 sums in the halving-tree order,
``(sum / L) * 0.7f``), which is what makes every backend agree bit for bit.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from gradcomp.backends.numba.common import INF32, NAN32, load, residual_target

CHUNK = 64
THRESHOLD = np.float32(0.7)
#: Chunks per parallel part: enough work per thread to amortise the scheduling.
PART_CHUNKS = 1024


@njit(cache=True)
def tree_sum(row, scratch):
    """The halving-tree float32 sum of ``row[0:64]`` (``scratch`` is overwritten)."""
    for j in range(CHUNK):
        scratch[j] = row[j]
    half = CHUNK // 2
    while half >= 1:
        for j in range(half):
            scratch[j] = scratch[j] + scratch[j + half]
        half //= 2
    return scratch[0]


@njit(cache=True)
def encode_chunk(grad, residual_in, residual_out, c, n, acc, magnitude, scratch, code_words, scales):
    """Codes, scale and residuals of chunk ``c`` (elements ``64c .. min(64c + 64, n)``)."""
    target = residual_target(residual_in, residual_out)
    lo = c * CHUNK
    length = min(CHUNK, n - lo)
    zero = np.float32(0.0)
    for j in range(CHUNK):
        if j < length:
            a = load(grad, lo + j)
            if residual_in is not None:
                a = a + residual_in[lo + j]
            acc[j] = a
            magnitude[j] = abs(a) if abs(a) < INF32 else zero
        else:
            acc[j] = zero
            magnitude[j] = zero
    tau = (tree_sum(magnitude, scratch) / np.float32(length)) * THRESHOLD
    count = 0
    for j in range(CHUNK):
        if magnitude[j] > tau:
            count += 1
        else:
            magnitude[j] = zero
    alpha = tree_sum(magnitude, scratch) / np.float32(count) if count > 0 else zero
    scales[c] = alpha
    for w in range(4):
        packed = np.uint32(0)
        for b in range(16):
            j = 16 * w + b
            if j >= length:
                break
            a = acc[j]
            code = np.uint32(0)
            if not abs(a) < INF32:
                code = np.uint32(3)
            elif magnitude[j] > zero:
                code = np.uint32(1) if a > zero else np.uint32(2)
            packed |= code << np.uint32(2 * b)
            if residual_out is not None:
                target[lo + j] = a - alpha if code == 1 else (a + alpha if code == 2 else a)
        if 16 * w < length:
            code_words[4 * c + w] = packed


@njit(parallel=True, cache=True)
def compress_kernel(grad, residual_in, residual_out, code_words, scales):
    """Codes of ``acc = grad + residual_in`` into uint32 ``code_words`` ``[ceil(n / 16)]`` and float32
    ``scales`` ``[ceil(n / 64)]``, residual into ``residual_out`` (array, ``None`` or ``True``: in place)."""
    n = grad.size
    chunks = scales.size
    parts = (chunks + PART_CHUNKS - 1) // PART_CHUNKS
    for p in prange(parts):
        acc = np.empty(CHUNK, np.float32)
        magnitude = np.empty(CHUNK, np.float32)
        scratch = np.empty(CHUNK, np.float32)
        for c in range(p * PART_CHUNKS, min(chunks, (p + 1) * PART_CHUNKS)):
            encode_chunk(grad, residual_in, residual_out, c, n, acc, magnitude, scratch, code_words, scales)


@njit(parallel=True, cache=True)
def decompress_add_kernel(code_words, scales, out):
    """``out += decode(code_words, scales)``; the wrapper checks ``ceil(n / 16)`` words and
    ``ceil(n / 64)`` scales, so every read and write is in bounds."""
    n = out.size
    chunks = (n + CHUNK - 1) // CHUNK
    parts = (chunks + PART_CHUNKS - 1) // PART_CHUNKS
    zero = np.float32(0.0)
    for p in prange(parts):
        for c in range(p * PART_CHUNKS, min(chunks, (p + 1) * PART_CHUNKS)):
            alpha = scales[c]
            for i in range(c * CHUNK, min(n, (c + 1) * CHUNK)):
                code = (code_words[i >> 4] >> np.uint32(2 * (i & 15))) & np.uint32(3)
                # Always add, even 0: torch's ``out + 0.0`` turns -0.0 into +0.0.
                out[i] = out[i] + (alpha if code == 1 else (-alpha if code == 2 else (zero if code == 0 else NAN32)))
