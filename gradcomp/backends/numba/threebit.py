"""Chunk-scaled 3-bit kernels (the counterpart of ``csrc/threebit.cu``).

The unit of work is a tile of :data:`TILE` elements: five 128-element chunks (five scales) and
64 whole code words, so no word is shared between tiles. A tile's compensated values are loaded
once into a scratch row; its scales, codes and residuals are written from the row, so memory is
read and written once. The arithmetic is the contract of :mod:`gradcomp.backends` step by step
(``max / 3.0f``, ``rint(acc / s)`` clamped to ``[-3, 3]``, ``float(code - 3) * s``), all float32.

Speed comes from loops LLVM vectorises, each a flat pass over one chunk or one tile with no
branch and no call in its body (``fastmath`` is not allowed: the bits must match the reference):

* the chunk maximum is an integer maximum of the bits of ``|acc|`` (for non-negative float32
  values the bit patterns order as the values do, and a float maximum would not vectorise
  without ``nnan``/``nsz``);
* quantisation writes one code per scratch byte and the residual, with selects, not branches;
* packing (ten 3-bit codes per word) and unpacking go eight words, 80 codes, at a time as LLVM vector code
  (:func:`pack_group`, :func:`unpack_group`): a word holds ten codes, so across words they are stride-10 accesses
  that LLVM's loop vectoriser leaves scalar (warm, one thread, charlm-small's 43,776 words: unpacking 0.119 ->
  0.022 ms, packing 0.099 -> 0.028 ms; ``experiments/results/research-step-overhead/pack_warm.py``, informal);
* decoding reads one code per scratch byte and one scale per chunk, never ``i // 128``.

Hot loops run over unsigned indices (as in :mod:`~gradcomp.backends.numba.twobit`): a signed
index makes Numba emit negative-index wraparound, which blocks LLVM's vectoriser.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.extending import intrinsic

from gradcomp.backends.numba.common import INF32, NAN32, f32_from_bits, load, load_acc, residual_target

CHUNK = 128
PER_WORD = 10
TILE = 5 * CHUNK  # the smallest whole number of chunks that is also a whole number of words
TILE_WORDS = TILE // PER_WORD
TILE_CHUNKS = TILE // CHUNK
#: Tiles per parallel part: enough work per thread to amortise the scheduling.
PART_TILES = 256
LEVELS = np.float32(3.0)
NONFINITE = 7
#: Words a vector pack or unpack handles at once (80 codes; 64 words a tile, eight groups).
GROUP_WORDS = 8

types = numba.types

_U0 = np.uint64(0)
_U1 = np.uint64(1)
_U_CHUNK = np.uint64(CHUNK)
_U_PER_WORD = np.uint64(PER_WORD)
_ABS_BITS = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
_ZERO_BITS = np.uint32(0)
_U_GROUP = np.uint64(GROUP_WORDS)
_U_GROUP_CODES = np.uint64(GROUP_WORDS * PER_WORD)


@njit(cache=True)
def load_row(grad, residual_in, lo, length, acc):
    """``acc[0:length] = float32(grad[lo + j]) + residual_in[lo + j]`` (float32 ``acc`` is mutated)."""
    for j in range(np.uint64(length)):
        acc[j] = load_acc(grad, residual_in, np.uint64(lo) + j)


@njit(cache=True, error_model="numpy")
def load_row_divided(grad, divisor, residual_in, lo, length, acc):
    """``acc[0:length] = float32(grad[lo + j]) / divisor[lo + j] + residual_in[lo + j]`` (float32 ``acc`` is
    mutated): the same two float32 operations, in the same order, as dividing ``grad`` first. NumPy's error model:
    Python's checks every divisor for zero, a branch that keeps LLVM from vectorising the loop (5x slower)."""
    for j in range(np.uint64(length)):
        i = np.uint64(lo) + j
        a = load(grad, i) / divisor[i]
        if residual_in is not None:
            a = a + residual_in[i]
        acc[j] = a


@njit(cache=True)
def chunk_scale(acc_bits, start, stop):
    """``max |acc_j| / 3.0f`` over the finite ``acc_j``, ``j`` in ``[start, stop)``; ``acc_bits`` is the
    uint32 view of the float32 row (non-finite and +-0.0 count as 0)."""
    largest = _ZERO_BITS
    for j in range(np.uint64(start), np.uint64(stop)):
        m = acc_bits[j] & _ABS_BITS
        largest = max(largest, m if m < _INF_BITS else _ZERO_BITS)
    return f32_from_bits(largest) / LEVELS


@njit(cache=True)
def quantize_chunk(acc, start, stop, s, code, residual_in, residual_out, lo):
    """Codes of ``acc[start:stop]`` at scale ``s`` into uint8 ``code[start:stop]``; residuals into
    elements ``lo + start .. lo + stop`` of the residual target (none when ``residual_out`` is ``None``)."""
    target = residual_target(residual_in, residual_out)
    # s == 0 only when every finite acc of the chunk is +-0.0: dividing by 1 gives code 3 then,
    # as the contract's "0 when s == 0" does, and keeps the loop free of a branch.
    divisor = s if s > np.float32(0.0) else np.float32(1.0)
    zero = np.float32(0.0)
    for j in range(np.uint64(start), np.uint64(stop)):
        a = acc[j]
        q = np.rint(a / divisor)
        # Selects, not min/max: a NaN (non-finite acc) lands on -3 instead of an undefined
        # int conversion; its code is replaced by 7 below.
        q = q if q > -LEVELS else -LEVELS
        q = q if q < LEVELS else LEVELS
        finite = abs(a) < INF32
        code[j] = np.uint8(np.int32(q) + 3) if finite else np.uint8(NONFINITE)
        if residual_out is not None:
            # q + 0.0f turns -0.0 into +0.0, so level * s is float(code - 3) * s bit for bit.
            level = q + zero
            target[np.uint64(lo) + j] = a - level * s if finite else a


def _is_row(array, dtype) -> bool:
    return isinstance(array, types.Array) and array.dtype == dtype and array.ndim == 1 and array.layout == "C"


def _vector_at(context, builder, array_type, array, index, vector):
    """A pointer to ``vector`` at element ``index`` of the C-contiguous 1-D ``array``."""
    data = context.make_array(array_type)(context, builder, value=array).data
    return builder.bitcast(builder.gep(data, [index], inbounds=True), vector.as_pointer())


@intrinsic
def pack_group(typingctx, code, at, code_words, first):
    """``code_words[first + w]`` = the ten codes ``code[at + 10w .. at + 10w + 9]`` (uint8, ``< 8``), ``w < 8``: as
    :func:`pack_words`, as LLVM vector code (ten byte shuffles, each shifted into place and or-ed). The caller
    guarantees the 80 codes and 8 words."""
    if not (_is_row(code, types.uint8) and _is_row(code_words, types.uint32)
            and isinstance(at, types.Integer) and isinstance(first, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        lanes = ir.VectorType(ir.IntType(32), GROUP_WORDS)
        codes = ir.VectorType(ir.IntType(8), GROUP_WORDS * PER_WORD)
        row = builder.load(_vector_at(context, builder, signature.args[0], args[0], args[1], codes), align=1)
        packed = None
        for b in range(PER_WORD):
            mask = ir.Constant(lanes, [PER_WORD * w + b for w in range(GROUP_WORDS)])  # code b of each word
            picked = builder.shuffle_vector(row, row, mask)
            bits = builder.shl(builder.zext(picked, lanes), ir.Constant(lanes, [3 * b] * GROUP_WORDS))
            packed = bits if packed is None else builder.or_(packed, bits)
        builder.store(packed, _vector_at(context, builder, signature.args[2], args[2], args[3], lanes), align=4)
        return context.get_dummy_value()

    return types.none(code, at, code_words, first), codegen


@intrinsic
def unpack_group(typingctx, code_words, first, code, at):
    """The inverse of :func:`pack_group`: ``code[at + 10w + b] = (code_words[first + w] >> 3b) & 7``, ``w < 8``,
    ``b < 10``."""
    if not (_is_row(code_words, types.uint32) and _is_row(code, types.uint8)
            and isinstance(first, types.Integer) and isinstance(at, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        count = GROUP_WORDS * PER_WORD
        lanes = ir.VectorType(ir.IntType(32), count)
        words = builder.load(_vector_at(context, builder, signature.args[0], args[0], args[1],
                                        ir.VectorType(ir.IntType(32), GROUP_WORDS)), align=4)
        spread = builder.shuffle_vector(words, words, ir.Constant(lanes, [i // PER_WORD for i in range(count)]))
        shifted = builder.lshr(spread, ir.Constant(lanes, [3 * (i % PER_WORD) for i in range(count)]))
        masked = builder.and_(shifted, ir.Constant(lanes, [7] * count))
        codes = builder.trunc(masked, ir.VectorType(ir.IntType(8), count))
        builder.store(codes, _vector_at(context, builder, signature.args[2], args[2], args[3], codes.type), align=1)
        return context.get_dummy_value()

    return types.none(code_words, first, code, at), codegen


@njit(cache=True)
def pack_words(code, count, code_words, first):
    """``code_words[first + w]`` = ten 3-bit codes ``code[10w .. 10w + 9]`` (bits ``3b``), ``w < count``."""
    groups = np.uint64(count) // _U_GROUP
    for g in range(groups):
        pack_group(code, g * _U_GROUP_CODES, code_words, np.uint64(first) + g * _U_GROUP)
    for w in range(groups * _U_GROUP, np.uint64(count)):
        k = w * _U_PER_WORD
        packed = np.uint32(0)
        for b in range(PER_WORD):
            packed |= np.uint32(code[k + np.uint64(b)]) << np.uint32(3 * b)
        code_words[np.uint64(first) + w] = packed


@njit(cache=True)
def encode_tile(grad, residual_in, residual_out, t, n, acc, code, code_words, scales, divisor):
    """Scales, codes and residuals of tile ``t`` (elements ``640t .. min(640t + 640, n)``); float32
    ``acc`` and uint8 ``code`` ``[640]`` are scratch; ``divisor``: float32 ``[n]`` or ``None``."""
    lo = t * TILE
    length = min(TILE, n - lo)
    if divisor is None:
        load_row(grad, residual_in, lo, length, acc)
    else:
        load_row_divided(grad, divisor, residual_in, lo, length, acc)
    acc_bits = acc.view(np.uint32)
    for c in range((length + CHUNK - 1) // CHUNK):
        start, stop = c * CHUNK, min(length, (c + 1) * CHUNK)
        s = chunk_scale(acc_bits, start, stop)
        scales[t * TILE_CHUNKS + c] = s
        quantize_chunk(acc, start, stop, s, code, residual_in, residual_out, lo)
    words = (length + PER_WORD - 1) // PER_WORD
    code[length: words * PER_WORD] = 0  # the bits past element n - 1 are zero
    pack_words(code, words, code_words, t * TILE_WORDS)


@njit(cache=True)
def compress_part(grad, residual_in, residual_out, code_words, scales, first, stop, divisor):
    """:func:`encode_tile` for tiles ``[first, stop)``, with scratch of its own."""
    n = grad.size
    acc = np.empty(TILE, np.float32)
    code = np.empty(TILE, np.uint8)
    for t in range(first, stop):
        encode_tile(grad, residual_in, residual_out, t, n, acc, code, code_words, scales, divisor)


@njit(parallel=True, cache=True)
def compress_kernel(grad, residual_in, residual_out, code_words, scales, divisor=None):
    """Codes of ``acc = grad + residual_in`` (with ``divisor``, float32 ``[n]``: ``grad / divisor + residual_in``)
    into uint32 ``code_words`` ``[ceil(n / 10)]`` and float32 ``scales`` ``[ceil(n / 128)]``, residual into
    ``residual_out`` (array, ``None`` or ``True``: in place)."""
    tiles = (grad.size + TILE - 1) // TILE
    parts = (tiles + PART_TILES - 1) // PART_TILES
    for p in prange(parts):
        compress_part(grad, residual_in, residual_out, code_words, scales, p * PART_TILES,
                      min(tiles, (p + 1) * PART_TILES), divisor)


@njit(cache=True)
def unpack_words(code_words, first, count, code):
    """Inverse of :func:`pack_words`: uint8 ``code[0 : 10 * count]``, one code per byte."""
    groups = np.uint64(count) // _U_GROUP
    for g in range(groups):
        unpack_group(code_words, np.uint64(first) + g * _U_GROUP, code, g * _U_GROUP_CODES)
    for w in range(groups * _U_GROUP, np.uint64(count)):
        x = code_words[np.uint64(first) + w]
        k = w * _U_PER_WORD
        for b in range(PER_WORD):
            code[k + np.uint64(b)] = np.uint8((x >> np.uint32(3 * b)) & np.uint32(7))


@njit(cache=True)
def decode_chunk(code, start, stop, s, out, lo):
    """``out[lo + j] += float(code[j] - 3) * s`` (NaN for code 7), ``j`` in ``[start, stop)``."""
    for j in range(np.uint64(start), np.uint64(stop)):
        k = code[j]
        decoded = np.float32(np.int32(k) - 3) * s
        i = np.uint64(lo) + j
        # Always add, even 0: torch's ``out + 0.0`` turns -0.0 into +0.0.
        out[i] = out[i] + (NAN32 if k == NONFINITE else decoded)


@njit(cache=True)
def decompress_part(code_words, scales, out, first, stop):
    """``out += decode`` for tiles ``[first, stop)``, with a uint8 scratch row of its own."""
    n = out.size
    code = np.empty(TILE, np.uint8)
    for t in range(first, stop):
        lo = t * TILE
        length = min(TILE, n - lo)
        unpack_words(code_words, t * TILE_WORDS, (length + PER_WORD - 1) // PER_WORD, code)
        for c in range((length + CHUNK - 1) // CHUNK):
            decode_chunk(code, c * CHUNK, min(length, (c + 1) * CHUNK), scales[t * TILE_CHUNKS + c], out, lo)


@njit(parallel=True, cache=True)
def decompress_add_kernel(code_words, scales, out):
    """``out += decode(code_words, scales)``; the wrapper checks ``ceil(n / 10)`` words and
    ``ceil(n / 128)`` scales, so every read and write is in bounds."""
    tiles = (out.size + TILE - 1) // TILE
    parts = (tiles + PART_TILES - 1) // PART_TILES
    for p in prange(parts):
        decompress_part(code_words, scales, out, p * PART_TILES, min(tiles, (p + 1) * PART_TILES))
