"""Chunk-scaled 2-bit kernels (the counterpart of ``csrc/twobit_chunk.cu``).

Each chunk of :data:`CHUNK` elements is one unit of work: its 64 compensated values and their
magnitudes are loaded once into a scratch row, the two halving-tree sums (mean magnitude, then
the mean of the kept magnitudes) read the row, and the chunk's four code words, its scale and its
residuals are written from it, so memory is read and written once. The arithmetic follows the
contract of :mod:`gradcomp.backends` step by step (float32 sums in the halving-tree order,
``(sum / L) * 0.7f``), which is what makes every backend agree bit for bit.

Speed comes from code LLVM vectorises (``fastmath`` is not allowed: the bits must match):

* every pass over a chunk is a flat loop with selects, not branches, over one scratch array
  (so no runtime overlap checks), in helpers inlined into the per-part loop (a call per chunk,
  with its reference counting, cost more than the chunk's arithmetic);
* the halving tree is written as LLVM vector shuffles and adds (:func:`tree_sum`);
* codes go one per scratch byte, then four bytes become one packed byte with shifts and ors
  (as in :mod:`~gradcomp.backends.numba.twobit`), and the reverse when decoding;
* decoding reads the scale once per chunk, never ``i // 64``.

Hot loops run over unsigned indices: a signed index makes Numba emit negative-index
wraparound, which blocks LLVM's vectoriser.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.extending import intrinsic

from gradcomp.backends.numba.common import INF32, NAN32, load_acc, residual_target

types = numba.types

CHUNK = 64
THRESHOLD = np.float32(0.7)
#: Chunks per parallel part: enough work per thread to amortise the scheduling.
PART_CHUNKS = 1024
#: Offsets of the three float32 rows of a chunk's scratch: the compensated values, their
#: magnitudes and the kept magnitudes. One array, not three, so that LLVM sees that the rows
#: never overlap and vectorises without runtime overlap checks.
ACC, MAGNITUDE, KEPT = (np.uint64(r * CHUNK) for r in range(3))
_U32_6, _U32_12, _U32_18 = np.uint32(6), np.uint32(12), np.uint32(18)


@intrinsic
def tree_sum(typingctx, row, start):
    """The halving-tree float32 sum of ``row[start : start + 64]`` (float32 C-contiguous ``row``; the
    caller guarantees the 64 slots), read, not written.

    Written as LLVM vector code: the levels ``s[j] += s[j + h]``, ``h = 32, 16, ..., 1``, are
    shuffles and IEEE adds (no reassociation, so the rounding is the contract's). As loops of
    constant length, LLVM unrolls them before its loop vectoriser runs, and Numba leaves the
    SLP vectoriser off: they would be 63 scalar adds.
    """
    if not (isinstance(row, types.Array) and row.dtype == types.float32 and row.ndim == 1 and row.layout == "C"):
        return None
    if not isinstance(start, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        vector = ir.VectorType(ir.FloatType(), CHUNK)
        first = builder.bitcast(builder.gep(data, [args[1]], inbounds=True), vector.as_pointer())
        values, width = builder.load(first, align=4, typ=vector), CHUNK
        while width > 1:
            half = width // 2
            lanes = ir.VectorType(ir.IntType(32), half)
            low = builder.shuffle_vector(values, values, ir.Constant(lanes, list(range(half))))
            high = builder.shuffle_vector(values, values, ir.Constant(lanes, list(range(half, width))))
            values, width = builder.fadd(low, high), half
        return builder.extract_element(values, ir.Constant(ir.IntType(32), 0))

    return types.float32(row, start), codegen


@njit(inline="always")
def load_chunk(grad, residual_in, lo, length, row):
    """``row[ACC + j]`` = float32 acc and ``row[MAGNITUDE + j]`` = ``|acc|`` (0 if not finite), ``j < length``."""
    zero = np.float32(0.0)
    for j in range(np.uint64(length)):
        a = load_acc(grad, residual_in, np.uint64(lo) + j)
        row[ACC + j] = a
        row[MAGNITUDE + j] = abs(a) if abs(a) < INF32 else zero


@njit(inline="always")
def keep_above(row, length, tau):
    """``row[KEPT + j]`` = the magnitude where it is ``> tau``, else 0, for ``j < length``; the count kept."""
    zero = np.float32(0.0)
    count = 0
    for j in range(np.uint64(length)):
        m = row[MAGNITUDE + j]
        keep = m > tau
        count += np.int64(keep)
        row[KEPT + j] = m if keep else zero
    return count


@njit(inline="always")
def code_chunk(row, length, alpha, code, residual_in, residual_out, lo):
    """One code per byte into uint8 ``code[0:length]``; residuals of elements ``lo .. lo + length``
    into the residual target (none when ``residual_out`` is ``None``)."""
    target = residual_target(residual_in, residual_out)
    zero = np.float32(0.0)
    neg_alpha = -alpha
    for j in range(np.uint64(length)):
        a = row[ACC + j]
        keep = row[KEPT + j] > zero  # a kept magnitude exceeds tau >= 0, and is finite
        sign_code = np.uint8(1) if a > zero else np.uint8(2)
        sent = sign_code if keep else np.uint8(0)
        code[j] = sent if abs(a) < INF32 else np.uint8(3)
        if residual_out is not None:
            # acc - (-alpha) == acc + alpha exactly; a select keeps acc's bits otherwise.
            target[np.uint64(lo) + j] = a - (alpha if a > zero else neg_alpha) if keep else a


@njit(inline="always")
def pack_chunk(code_u32, code_bytes, first, count):
    """Code bytes ``[first, first + count)`` from ``4 * count`` codes, one per scratch byte."""
    for q in range(np.uint64(count)):
        x = code_u32[q]  # four codes, one per byte
        code_bytes[np.uint64(first) + q] = np.uint8((x | (x >> _U32_6) | (x >> _U32_12) | (x >> _U32_18))
                                                    & np.uint32(0xFF))


@njit(cache=True)
def compress_part(grad, residual_in, residual_out, code_bytes, scales, first, stop):
    """Codes, scales and residuals of chunks ``[first, stop)``, with scratch rows of their own."""
    n = grad.size
    row = np.zeros(3 * CHUNK, np.float32)
    code = np.zeros(CHUNK, np.uint8)
    code_u32 = code.view(np.uint32)
    for c in range(first, stop):
        lo = c * CHUNK
        length = min(CHUNK, n - lo)
        if length < CHUNK:  # the last chunk: its slots past n weigh 0 (both sums) and code 0
            row[:] = 0
            code[:] = 0
        load_chunk(grad, residual_in, lo, length, row)
        tau = (tree_sum(row, MAGNITUDE) / np.float32(length)) * THRESHOLD
        count = keep_above(row, length, tau)
        alpha = tree_sum(row, KEPT) / np.float32(count) if count > 0 else np.float32(0.0)
        scales[c] = alpha
        code_chunk(row, length, alpha, code, residual_in, residual_out, lo)
        pack_chunk(code_u32, code_bytes, c * (CHUNK // 4), 4 * ((length + 15) // 16))


@njit(parallel=True, cache=True)
def compress_kernel(grad, residual_in, residual_out, code_words, scales):
    """Codes of ``acc = grad + residual_in`` into uint32 ``code_words`` ``[ceil(n / 16)]`` and float32
    ``scales`` ``[ceil(n / 64)]``, residual into ``residual_out`` (array, ``None`` or ``True``: in place)."""
    code_bytes = code_words.view(np.uint8)  # little-endian: element i in byte i // 4, bits 2 * (i % 4)
    chunks = scales.size
    parts = (chunks + PART_CHUNKS - 1) // PART_CHUNKS
    for p in prange(parts):
        compress_part(grad, residual_in, residual_out, code_bytes, scales, p * PART_CHUNKS,
                      min(chunks, (p + 1) * PART_CHUNKS))


@njit(inline="always")
def decode_chunk(code_bytes, first, length, alpha, code, code_u32, out, at):
    """``out[at + j] += decode(code j)`` for ``j < length``, the chunk's codes from ``code_bytes[first]`` on (chunk
    ``c`` of a payload: ``first = 16c``, and ``at = 64c`` in the group); uint8 ``code`` ``[64]`` is scratch,
    ``code_u32`` its uint32 view."""
    first = np.uint64(first)
    for q in range(np.uint64((length + 3) // 4)):
        b = np.uint32(code_bytes[first + q])
        code_u32[q] = (b | (b << _U32_6) | (b << _U32_12) | (b << _U32_18)) & np.uint32(0x03030303)
    zero = np.float32(0.0)
    neg_alpha = -alpha
    lo = np.uint64(at)
    for j in range(np.uint64(length)):
        k = code[j]
        i = lo + j
        # Always add, even 0: torch's ``out + 0.0`` turns -0.0 into +0.0.
        out[i] = out[i] + (alpha if k == 1 else (neg_alpha if k == 2 else (zero if k == 0 else NAN32)))


@njit(parallel=True, cache=True)
def decompress_add_kernel(code_words, scales, out):
    """``out += decode(code_words, scales)``; the wrapper checks ``ceil(n / 16)`` words and
    ``ceil(n / 64)`` scales, so every read and write is in bounds."""
    n = out.size
    code_bytes = code_words.view(np.uint8)
    chunks = (n + CHUNK - 1) // CHUNK
    parts = (chunks + PART_CHUNKS - 1) // PART_CHUNKS
    for p in prange(parts):
        code = np.empty(CHUNK, np.uint8)
        code_u32 = code.view(np.uint32)
        for c in range(p * PART_CHUNKS, min(chunks, (p + 1) * PART_CHUNKS)):
            decode_chunk(code_bytes, c * (CHUNK // 4), min(CHUNK, n - c * CHUNK), scales[c], code, code_u32, out,
                         c * CHUNK)
